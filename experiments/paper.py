"""``python -m experiments.paper``: build the write-up from a results folder written by ``experiments.reproduce``.

    python -m experiments.reproduce --out results          # or --quick
    python -m experiments.paper --results results --out paper/build

The source ``paper/paper.md`` holds prose and placeholders; every table, figure
and number in the built ``paper/build/paper.md`` comes from the results folder
(nothing is typed by hand).  Placeholders:

- ``{{table:NAME}}``: the Markdown table ``NAME.md`` (``NAME`` may contain a
  sub-folder, e.g. ``validation/validation``);
- ``{{figure:FILE|caption}}``: the image ``FILE`` (copied to ``figures/``);
- ``{{cell:TABLE:COL=VALUE,...:COLUMN}}``: one value of ``TABLE.csv``, from the
  first row whose columns equal the given values;
- ``{{compare:TABLE:COL=VALUE,...:COLUMN:A:B}}``: how row ``system=A``'s numeric
  ``COLUMN`` compares with row ``system=B``'s ("larger than", "smaller than" or
  "equal to"), so a sentence that ranks two systems follows the run, not the author;
- ``{{run:KEY}}``: a value of ``run.json`` (the settings and timings of the run);
- ``{{calibration:KEY}}``: a value of the calibrated cpu-gloo preset
  (``simulator/presets/cpu_gloo.json``, written by ``python -m experiments.calibrate_cpu --update-preset``):
  a key of its ``calibration`` record (dotted for nested ones) or one of the values
  `calibration_values` derives from it.

A placeholder ending in ``|optional}}`` (tables only) becomes a note naming the
command that produces it when its file is missing; any other missing input is
an error (`MissingResult`) that says which table to run.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import pathlib
import re
import shutil

log = logging.getLogger(__name__)

SOURCE = pathlib.Path(__file__).resolve().parents[1] / "paper" / "paper.md"
PLACEHOLDER = re.compile(r"\{\{(table|figure|cell|compare|run|calibration):([^{}]*)\}\}")
PRESET = pathlib.Path(__file__).resolve().parents[1] / "simulator" / "presets" / "cpu_gloo.json"
SOURCE_COMMENT = re.compile(r"<!--.*?-->\n?", re.DOTALL)  # notes for the source's editors only
PRODUCERS = {
    "validation/validation": "python -m experiments.validate_simulator --out RESULTS/validation",
}
"""Commands that write a table other than the reproduce tables (`producer`)."""


def producer(name: str) -> str:
    """The command that writes table ``name`` into ``results``: its `PRODUCERS` entry, ``--only NAME`` for a
    reproduce table run only on request (`experiments.reproduction.TABLES`), else a default reproduce run."""
    from experiments.reproduction import BY_NAME

    if name in PRODUCERS:
        return PRODUCERS[name].replace("RESULTS", "results")
    if name in BY_NAME and BY_NAME[name].on_request:
        return f"python -m experiments.reproduce --only {name} --out results"
    return "python -m experiments.reproduce"


class MissingResult(FileNotFoundError):
    """The results folder lacks a table, figure or value the paper needs; the message says how to make it."""


def _read_csv(path: pathlib.Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def calibration_values(calibration: dict) -> dict[str, str]:
    """Values the paper quotes that are computed from a preset's ``calibration`` record."""
    values = {}
    samples = calibration.get("compute", {}).get("attention_samples", [])
    if samples:
        values["attention_head_dims"] = ", ".join(str(d) for d in sorted({s["head_dim"] for s in samples}))
    in_step, alone = calibration.get("all_to_all_in_step_s", {}), calibration.get("all_to_all_isolated_s", {})
    ratios = [in_step[w][n] / alone[w][n] for w in in_step if w in alone for n in in_step[w] if n in alone[w]]
    if ratios:
        values["all_to_all_in_step_over_isolated"] = f"{min(ratios):.1f}–{max(ratios):.1f}"
    reference = calibration.get("reference_step", {})
    if "config" in reference:  # "P=2 S=768 h=96 overlap=on"
        fields = dict(part.split("=", 1) for part in reference["config"].split() if "=" in part)
        values["reference_step"] = (f"{fields.get('P')} ranks, {fields.get('S')} tokens, hidden {fields.get('h')}, "
                                    f"overlap {fields.get('overlap')}")
    if "step_factor" in calibration:
        values["step_factor"] = f"{calibration['step_factor']:.2f}"
    return values


class Builder:
    def __init__(self, results: pathlib.Path, out: pathlib.Path, preset: pathlib.Path = PRESET):
        self.results, self.out, self.preset = results, out, preset
        self.figures: list[pathlib.Path] = []

    def _missing(self, what: str) -> MissingResult:
        return MissingResult(f"{self.results}/{what} is missing: run python -m experiments.reproduce --out "
                             f"{self.results} (all tables), then build the paper again")

    def table(self, arg: str) -> str:
        name, _, flag = arg.partition("|")
        path = self.results / f"{name}.md"
        if not path.exists():
            if flag == "optional":
                return f"*(This table is not in the results folder: `{producer(name)}` writes it.)*"
            raise self._missing(f"{name}.md")
        return path.read_text().strip()

    def figure(self, arg: str) -> str:
        name, _, caption = arg.partition("|")
        path = self.results / name
        if not path.exists():
            raise self._missing(name)
        self.figures.append(path)
        return f"![{caption or name}](figures/{path.name})"

    def cell(self, arg: str) -> str:
        try:
            table, where, column = arg.split(":")
        except ValueError:
            raise ValueError(f"malformed cell placeholder {{{{cell:{arg}}}}}: use TABLE:COL=VALUE,...:COLUMN") from None
        path = self.results / f"{table}.csv"
        if not path.exists():
            raise self._missing(f"{table}.csv")
        conditions = dict(kv.split("=", 1) for kv in where.split(",") if kv)
        for row in _read_csv(path):
            if all(row.get(k) == v for k, v in conditions.items()):
                if column not in row:
                    raise ValueError(f"{path.name} has no column {column!r} (columns: {list(row)})")
                return row[column]
        raise MissingResult(f"{path.name} has no row with {conditions}")

    def compare(self, arg: str) -> str:
        try:
            table, where, column, first, second = arg.split(":")
        except ValueError:
            raise ValueError(f"malformed compare placeholder {{{{compare:{arg}}}}}: use "
                             "TABLE:COL=VALUE,...:COLUMN:SYSTEM_A:SYSTEM_B") from None
        values = []
        for system in (first, second):
            text = self.cell(f"{table}:{where + ',' if where else ''}system={system}:{column}")
            try:
                values.append(float(text.replace(",", "")))
            except ValueError:
                raise MissingResult(f"{table}.csv: {system}'s {column} is {text!r}, not a number") from None
        a, b = values
        return "larger than" if a > b else "smaller than" if a < b else "equal to"

    def run(self, key: str) -> str:
        path = self.results / "run.json"
        if not path.exists():
            raise self._missing("run.json")
        value = json.loads(path.read_text())
        for part in key.split("."):
            if not isinstance(value, dict) or part not in value:
                raise MissingResult(f"run.json has no {key!r}")
            value = value[part]
        if isinstance(value, dict):
            return ", ".join(f"{k} {v}" for k, v in value.items())
        return ", ".join(map(str, value)) if isinstance(value, list) else str(value)

    def calibration(self, key: str) -> str:
        if not self.preset.exists():
            raise MissingResult(f"{self.preset} is missing: run python -m experiments.calibrate_cpu --out {self.preset}")
        record = json.loads(self.preset.read_text()).get("calibration", {})
        derived = calibration_values(record)
        if key in derived:
            return derived[key]
        value = record
        for part in key.split("."):
            if not isinstance(value, dict) or part not in value:
                raise MissingResult(f"{self.preset.name} has no calibration value {key!r} "
                                    f"(derived values: {sorted(derived)})")
            value = value[part]
        return str(value)

    def render(self, text: str) -> str:
        return PLACEHOLDER.sub(lambda m: getattr(self, m.group(1))(m.group(2).strip()), text)


def build_paper(results: pathlib.Path, out: pathlib.Path, source: pathlib.Path = SOURCE,
                preset: pathlib.Path = PRESET) -> pathlib.Path:
    """Render ``source`` with the results in ``results`` (and the calibrated ``preset``) into ``out/paper.md``
    (+ ``out/figures/``)."""
    builder = Builder(results, out, preset)
    text = builder.render(SOURCE_COMMENT.sub("", source.read_text()))
    out.mkdir(parents=True, exist_ok=True)
    (out / "figures").mkdir(exist_ok=True)
    for figure in builder.figures:
        shutil.copy2(figure, out / "figures" / figure.name)
    target = out / "paper.md"
    target.write_text(text)
    log.info("wrote %s with %d figures", target, len(builder.figures))
    return target


def build_parser() -> argparse.ArgumentParser:
    from experiments import cli

    parser = cli.parser("experiments.paper", __doc__)
    parser.add_argument("--results", type=pathlib.Path, default=pathlib.Path("results"),
                        help="folder written by python -m experiments.reproduce")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("paper/build"), help="output folder")
    parser.add_argument("--source", type=pathlib.Path, default=SOURCE,
                        help="paper source with placeholders (default: paper/paper.md)")
    parser.add_argument("--preset", type=pathlib.Path, default=PRESET,
                        help="calibrated cpu-gloo preset for the {{calibration:...}} placeholders "
                             "(default: simulator/presets/cpu_gloo.json)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        build_paper(args.results, args.out, args.source, args.preset)
    except MissingResult as err:
        parser.exit(1, f"error: {err}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
