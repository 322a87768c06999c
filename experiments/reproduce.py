"""``python -m experiments.reproduce``: the paper's AutoSP experiments, measured on CPU and simulated at scale.

The command line and the run loop: the tables themselves are `experiments.reproduction.TABLES`, one module each
(docs/design.md, "Adding a reproduce table"), built from one `experiments.reproduction.RunConfig` made here from
the arguments and the preset (`experiments.reproduction.run.PRESETS`).  `DESCRIPTION` (the ``--help`` text) lists
the tables and outputs.  A table's simulated value more than 20 % away from its published counterpart is flagged
in the ``note`` column; a search that stopped before converging (probe budget, search ceiling) says so there too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import multiprocessing
import os
import pathlib
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from experiments import cli
from experiments.reproduction import BY_NAME, RECORDS, TABLES, RunConfig, Runner, Table, selected
from experiments.reproduction.common import (
    CPU_MODEL,
    CPU_MODEL_OPTIONS,
    CPU_SYSTEMS,
    DISAGREEMENT,
    PAPER_CLUSTER,
    PAPER_RANKS,
    paper_models,
)
from experiments.reproduction.run import PRESET_HELP, PRESETS, trace_counts
from experiments.reproduction.simulated_step import write_simulated_step
from experiments.tables import write_table


def _tables_help() -> str:
    """The tables' entries of ``--help`` (`experiments.reproduction.Table.help_lines`) and which run on request."""
    on_request = [t.name for t in TABLES if t.on_request]
    return "\n".join([*(line for table in TABLES for line in table.help_lines()), "",
                      f"{', '.join(on_request[:-1])} and {on_request[-1]} run only with --only NAME."])


DESCRIPTION = f"""\
The paper's AutoSP experiments, measured on CPU gloo ranks and simulated at paper scale.

Tables (--only NAME runs one):
{_tables_help()}

Outputs in --out: NAME.csv and NAME.md per table, PNG plots, run.json (the command line, settings and
timings; written by every run, --only included), and, on a full run, one simulated step of the
throughput model: its workload, a Perfetto trace (open in ui.perfetto.dev), timeline and memory plots.
A table made row by row (alst, breakdown-a100) keeps the rows made so far in NAME.partial.csv and
NAME.partial.md until it is written.
"""


def _preset_epilog() -> str:
    width = max(len(text) for text in PRESET_HELP.values())
    lines = ["what --quick changes (default -> quick):"]
    for key, text in PRESET_HELP.items():
        default, quick = PRESETS["default"][key], PRESETS["quick"][key]
        lines.append(f"  {text:<{width}}  {_plain(default)} -> {_plain(quick)}")
    return "\n".join(lines)


def _plain(value) -> str:
    return ", ".join(map(str, value)) if isinstance(value, tuple) else f"{value:g}" if isinstance(value, float) \
        else str(value)


def _command_line(argv: list[str]) -> str:
    return shlex.join(["python", "-m", "experiments.reproduce", *argv])


TABLE_RECORDS = (*RECORDS, "simulated_step")
"""run.json entries a table run writes besides its table; kept from an earlier run.json when this run did not
redo them."""


def _write_run_json(path: pathlib.Path, run_info: dict, tables: dict[str, dict]) -> None:
    """``run.json`` of this invocation; the per-table records of an earlier run.json in the same folder (and its
    `TABLE_RECORDS`) are kept for tables this invocation did not run, so each table names the command that
    produced it."""
    earlier, kept = {}, {}
    if path.exists():
        with contextlib.suppress(ValueError, AttributeError):
            previous = json.loads(path.read_text())
            earlier = previous.get("tables", {})
            kept = {key: previous[key] for key in TABLE_RECORDS if key in previous and key not in run_info}
    merged = {**earlier, **tables}
    run_info = {**kept, **run_info, "tables": merged, "table_s": {name: t["seconds"] for name, t in merged.items()},
                "commands": list(dict.fromkeys(t["command"] for t in merged.values()))}
    path.write_text(json.dumps(run_info, indent=2) + "\n")


def build_parser() -> argparse.ArgumentParser:
    models = paper_models()
    parser = cli.parser("experiments.reproduce", DESCRIPTION, epilog=_preset_epilog())
    parser.add_argument("--quick", action="store_true",
                        help="the quick preset: coarser searches, fewer ranks, tokens and steps (below)")
    parser.add_argument("--only", choices=list(BY_NAME), help="run one table (all when absent)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"), help="results folder")
    parser.add_argument("--iteration-model", default="llama-3.1-8b", choices=models,
                        help="paper model simulated for the throughput table (the published iteration times are unlabelled)")
    parser.add_argument("--models", nargs="+", default=None, choices=models, metavar="MODEL",
                        help=f"paper models of the max-seq-len table: {', '.join(models)} (all when absent)")
    parser.add_argument("--memory-cap-mib", type=float, default=None,
                        help="per-rank cap of the memory-cap table (when absent: the preset's, below)")
    parser.add_argument("--cpu-ranks", type=int, nargs="+", default=None, metavar="N",
                        help="gloo rank counts of the measured-cpu table, e.g. 2 4 (when absent: the preset's, "
                             "below; give no more ranks than CPU cores, or the step times measure the sharing)")
    parser.add_argument("--cpu-systems", nargs="+", default=None, choices=CPU_SYSTEMS,
                        help="the systems the measured-cpu and memory-cap tables measure (all when absent; ulysses "
                             "is always among them: measured-cpu's ratios are to it)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="worker processes for the simulated tables (1: none; the default is the CPU count, "
                             "at most 2: %(default)s here)")
    return parser


def run_config(argv: list[str]) -> RunConfig:
    """The run ``argv`` asks for (exits with status 2 and a message on a bad argument)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: give 1 or more worker processes")
    if args.memory_cap_mib is not None and args.memory_cap_mib <= 0:
        parser.error(f"--memory-cap-mib {args.memory_cap_mib:g}: give a positive cap")
    if args.cpu_ranks is not None and any(n < 2 for n in args.cpu_ranks):
        parser.error(f"--cpu-ranks {' '.join(map(str, args.cpu_ranks))}: give rank counts of 2 or more")
    return RunConfig.from_preset("quick" if args.quick else "default", memory_cap_mib=args.memory_cap_mib,
                                 cpu_ranks=args.cpu_ranks, out=args.out, tables=selected(args.only),
                                 only=args.only, models=None if args.models is None else tuple(args.models),
                                 iteration_model=args.iteration_model, jobs=args.jobs,
                                 cpu_systems=None if args.cpu_systems is None else
                                 tuple(dict.fromkeys(("ulysses", *args.cpu_systems))))


def run_tables(run: RunConfig, runner: Runner, building: list[Table], command: str) -> tuple[dict, dict]:
    """Build ``building`` in order, write each one's files into ``run.out`` and print its Markdown; what
    run.json records of them: per table the command, preset, seconds and row count, and their summaries by
    record key."""
    tables: dict[str, dict] = {}
    summaries: dict[str, dict] = {}
    with contextlib.ExitStack() as stack:
        if run.jobs > 1 and any(table.simulated for table in building):
            # Each simulated probe is a single-threaded trace: spread the tasks over worker processes.
            runner.pool = stack.enter_context(ProcessPoolExecutor(max_workers=run.jobs,
                                                                  mp_context=multiprocessing.get_context("spawn")))
        for table in building:
            if not table.simulated and runner.pool is not None:
                runner.pool.shutdown()  # idle workers must not share the CPU with measured gloo ranks
                runner.pool = None
            table_start = time.perf_counter()
            rows = table.build(run, runner)
            tables[table.name] = {"command": command, "preset": run.preset,
                                  "seconds": round(time.perf_counter() - table_start, 1), "rows": len(rows)}
            summary = table.summary(rows) if table.summary else None
            if table.record:
                summaries[table.record] = summary
            if not rows:
                continue
            write_table(table.name, rows, run.out, footer=table.footer(rows, summary) if table.footer else ())
            if table.plot:
                table.plot(rows, run.out / f"{table.name}.png")
            text = (run.out / f"{table.name}.md").read_text()
            print(f"\n## {table.name} ({time.perf_counter() - table_start:.0f} s)\n\n{text}")
        runner.pool = None
    return tables, summaries


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    run = run_config(argv)
    from experiments.paper_scale.simulate import TraceCache

    # traces shared within this process (see experiments.paper_scale.simulate.TraceCache)
    runner = Runner(cache=TraceCache(interpolate_lengths=True), out=run.out)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    run.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    command = _command_line(argv)
    settings = run.settings()
    run_info = {"command": command, "argv": argv, "preset": run.preset, "only": run.only,
                "cpu_model": CPU_MODEL, "cpu_model_options": CPU_MODEL_OPTIONS,
                **{key: list(value) if isinstance(value, tuple) else value for key, value in settings.items()},
                "max_seq_len_granularity": run.granularity, "iteration_model": run.iteration_model,
                "paper_cluster": PAPER_CLUSTER, "paper_ranks": PAPER_RANKS,
                "disagreement_pct": round(DISAGREEMENT * 100),
                "jobs": run.jobs, "torch": _version("torch"), "deepspeed": _version("deepspeed"),
                "transformers": _version("transformers")}
    tables, summaries = run_tables(run, runner, [BY_NAME[name] for name in run.tables], command)
    if not run.only:
        before = trace_counts(runner.cache)
        run_info["simulated_step"] = write_simulated_step(run, runner, run.out)
        runner.add_counts(trace_counts(runner.cache, before))
    run_info.update(summaries)
    run_info["traces"] = runner.counts
    run_info["total_s"] = round(time.perf_counter() - start, 1)
    _write_run_json(run.out / "run.json", run_info, tables)
    print(f"results in {run.out}/ ({time.perf_counter() - start:.0f} s)")
    return 0


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    raise SystemExit(main())
