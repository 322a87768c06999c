"""Every command line of the project, listed once (`CLIS`), keeps the rules of ``experiments/cli.py``.

Two subprocesses (in parallel, each given half the command lines, so that the imports they share are paid twice,
not once per command line) run, for each command line in an empty working folder of its own, ``--help``, then
each typo of `Cli.typos`, in-process one after another (``runpy``, as ``python -m`` runs it), then report its
parser (``build_parser()``).  A file written by an import shows in the folder of the first command line of its
batch that imports the module.  Checked:

- ``--help`` exits 0 and changes nothing: the tracked and untracked-but-not-ignored files of the checkout keep
  their size and modification time, and the working folder stays empty;
- ``prog`` is the command a user types (``python -m MODULE``), every argument has help text, every option with
  a default shows it, every choice is listed, and the help has no reST markup;
- a typo in each choice-type flag exits 2, quickly (the imports are already done: no work started), names the
  typo, and writes nothing;
- every module of the project that runs as ``__main__`` is in `CLIS` (as the command or as an alias of one).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Cli:
    command: str
    """What follows ``python -m`` (a module), or a script path relative to the root (``scripts/x.py``)."""
    typos: tuple[tuple[str, ...], ...] = ()
    """Arguments with one typo each (a choice-type flag's value), each of which must exit 2 before any work."""
    aliases: tuple[str, ...] = ()
    """Modules that run the same command line (the implementation behind a ``python -m`` shim)."""
    required: tuple[str, ...] = field(default=())
    """Arguments every typo run adds, so that the typo, not a missing argument, is what fails."""

    @property
    def is_script(self) -> bool:
        return self.command.endswith(".py")

    @property
    def prog(self) -> str:
        return f"python {self.command}" if self.is_script else f"python -m {self.command}"


CLIS = (
    Cli("experiments.reproduce", typos=(("--only", "max-seq-lenn"), ("--models", "llama-3.1-8b", "llama-9b"),
                                        ("--iteration-model", "llama-9b"), ("--cpu-systems", "ulyses"))),
    Cli("experiments.paper"),
    Cli("experiments.calibrate_cpu", aliases=("experiments.calibration.calibrate_cpu",)),
    Cli("experiments.validate_simulator", aliases=("experiments.calibration.validate_simulator",),
        typos=(("--preset", "no-such-preset.json"),)),
    Cli("experiments.gpu_check", aliases=("experiments.paper_scale.gpu_check",),
        typos=(("--model", "llama-9b"), ("--cluster", "h100"))),
    Cli("experiments.gpu_validate", typos=(("--only", "sp2-ulyses"),)),
    Cli("experiments.bench_sac_overlap", aliases=("experiments.cpu.bench_sac_overlap",),
        typos=(("--model", "hf-lama"), ("--paper-scale", "llama-9b"))),
    Cli("experiments.bench_planner", typos=(("--only", "longst"), ("--depth", "ful"))),
    Cli("experiments.bench_answers", typos=(("--only", "llama-9b"), ("--workers", "two"))),
    Cli("experiments.cpu.bench_packed", typos=(("--compiler", "inductr"),)),
    Cli("experiments.cpu.bench_mask_probes", typos=(("--sp-sise", "8"),)),
    Cli("experiments.cpu.bench_same_sample", typos=(("--compiler", "inductr"),)),
    Cli("experiments.cpu.bench_lengths", typos=(("--compiler", "inductr"), ("--model", "hf-lama"))),
    Cli("experiments.cpu.bench_strategies", typos=(("--compiler", "inductr"), ("--systems", "autosp-rng"))),
    Cli("experiments.cpu.bench_alst", typos=(("--models", "hf-lama"), ("--steps", "three"))),
    Cli("experiments.cpu.bench_plan_accuracy", typos=(("--models", "hf-lama"), ("--compiler", "inductr"))),
    Cli("experiments.cpu.bench_sharding", typos=(("--model", "hf-lama"), ("--compiler", "inductr"))),
    Cli("experiments.paper_scale.export_steps", required=("--lengths", "1024", "--out", "steps"),
        typos=(("--model", "llama-9b"), ("--model", "llama-3.1-8b", "--systems", "autosp", "ulyses"),
               ("--model", "llama-3.1-8b", "--layers", "ful"))),
    Cli("experiments.paper_scale.analysis_cost", typos=(("--model", "llama-9b"),)),
    Cli("experiments.fuzz_analysis"),
    Cli("experiments.architecture_sweep"),
    Cli("experiments.notebooks.build"),
    Cli("simulator", typos=(("--cluster", "a100"), ("--all-to-all", "pairwize"), ("--network", "ib-hdr-100"),
                            ("--precision", "bf32"),
                            ("--grad-accum-dtype", "fp64"), ("--optimizer", "adamm"), ("--zero-stage", "4"))),
    Cli("autosp.train", typos=(("--model", "tiny-lama"), ("--compiler", "inductr"), ("--dtype", "fp16"),
                               ("--zero-stage", "4"), ("--deepspeed-config", "no-such-config.json"),
                               ("--strategy", "ulyses"))),
    Cli("autosp.plan", required=("--model", "tiny-llama", "--cluster", "h100-sxm", "--seq-len", "1024"),
        typos=(("--model", "tiny-lama"), ("--cluster", "h100"), ("--dtype", "fp16"), ("--optimizer", "adamm"), ("--offload", "cpu"), ("--engine", "megatron"), ("--zero-stage", "4"),
               ("--compiler", "inductr"), ("--depth", "ful"), ("--memory-plan", "automatic"),
               ("--objective", "fastes"), ("--strategy", "ulyses"), ("--activation-offload", "yes"))),
    Cli("autosp.plan.worker"),
    Cli("autosp.examples.train_lm", required=("--data", "corpus.txt", "--output-dir", "out"),
        typos=(("--model", "tiny-lama"), ("--compiler", "inductr"), ("--dtype", "fp16"), ("--zero-stage", "4"),
               ("--text-split", "paragraf"), ("--strategy", "rign"))),
    Cli("scripts/gpu_smoke.py"),
)
"""Every command line of the project: add a new one here (`test_every_main_module_is_listed` fails until then)."""

HELP_BUDGET_S = 120.0  # --help, imports included, on a loaded 2-core machine
TYPO_BUDGET_S = 5.0  # a typo after the imports: the parser's error, nothing else
MARKUP = re.compile(r"`|:(mod|class|func|meth|data|attr|ref|doc):|^\s*\.\. \w+::|::\s*$", re.MULTILINE)

# Run inside a subprocess, for each (command, runs, working folder) of its batch: --help, then each typo (as
# `python -m` runs the module) in the command line's own working folder, then the parser's details.
RUNNER = r"""
import contextlib, importlib, importlib.util, io, json, os, runpy, sys, time


def report(command, runs):
    results = []
    for argv in runs:
        sys.argv = [command, *argv]
        out, err = io.StringIO(), io.StringIO()
        start = time.perf_counter()
        code = None
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                if command.endswith(".py"):
                    runpy.run_path(command, run_name="__main__")
                else:
                    runpy.run_module(command, run_name="__main__", alter_sys=True)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        results.append({"argv": argv, "code": code, "seconds": time.perf_counter() - start,
                        "stdout": out.getvalue(), "stderr": err.getvalue()})
    if command.endswith(".py"):
        spec = importlib.util.spec_from_file_location("cli_under_test", command)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        package = importlib.util.find_spec(command).submodule_search_locations is not None
        module = importlib.import_module(command + ".__main__" if package else command)
    parser = module.build_parser()
    actions = []
    for action in parser._actions:
        formatter = parser._get_formatter()
        formatter.add_argument(action)
        actions.append({"flags": action.option_strings, "dest": action.dest, "default": repr(action.default),
                        "meaningful_default": action.default not in (None, False, "==SUPPRESS==")
                                              and action.help != "==SUPPRESS==",
                        "choices": None if action.choices is None else [str(c) for c in action.choices],
                        "has_help": bool(action.help),
                        "help": formatter.format_help()})
    return {"runs": results, "prog": parser.prog, "actions": actions}


reports = {}
for command, runs, workdir in json.loads(sys.argv[1]):
    os.chdir(workdir)
    reports[command] = report(command, runs)
print(json.dumps(reports))
"""


def _tree_state() -> dict[str, tuple[int, int]] | None:
    """(size, mtime) of every tracked and untracked-not-ignored path; None outside a git checkout."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                capture_output=True, check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        return None
    state = {}
    for name in filter(None, listed):
        try:
            st = os.lstat(ROOT / name)
        except FileNotFoundError:
            continue
        state[name] = (st.st_size, st.st_mtime_ns)
    return state


BATCHES = 2
"""Subprocesses running the command lines, each a share of `CLIS` (the imports are paid once per subprocess)."""


def _run_batch(clis: Sequence[Cli], workdirs: Sequence[Path]) -> dict[str, dict]:
    jobs = []
    for cli, workdir in zip(clis, workdirs, strict=True):
        workdir.mkdir()
        command = str(ROOT / cli.command) if cli.is_script else cli.command
        jobs.append((command, [["--help"], *([*cli.required, *typo] for typo in cli.typos)], str(workdir)))
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(jobs)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"the runner of {[c.prog for c in clis]} failed\n{proc.stderr[-4000:]}"
    by_command = json.loads(proc.stdout.strip().splitlines()[-1])
    out = {}
    for cli, (command, _, _), workdir in zip(clis, jobs, workdirs, strict=True):
        report = by_command[command]
        report["leftovers"] = sorted(str(p.relative_to(workdir)) for p in workdir.rglob("*"))
        out[cli.command] = report
    return out


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, dict]:
    """The runner's report of every CLI; the checkout is unchanged by all of them together."""
    before = _tree_state()
    base = tmp_path_factory.mktemp("cli")
    workdirs = [base / f"cwd{i}" for i in range(len(CLIS))]
    with ThreadPoolExecutor(max_workers=BATCHES) as pool:
        futures = [pool.submit(_run_batch, CLIS[i::BATCHES], workdirs[i::BATCHES]) for i in range(BATCHES)]
        out = {command: report for future in futures for command, report in future.result().items()}
    for command, report in out.items():  # shown with -s: where the time goes
        print(f"{command}: --help {report['runs'][0]['seconds']:.1f} s")
    after = _tree_state()
    if before is not None:
        changed = sorted(name for name in set(before) | set(after) if before.get(name) != after.get(name))
        assert changed == [], f"running --help and the typos changed files of the checkout: {changed}"
    return out


@pytest.mark.parametrize("cli", CLIS, ids=lambda c: c.command)
def test_cli_help_is_side_effect_free_and_shows_prog_defaults_choices_without_markup(cli, reports):
    report = reports[cli.command]
    help_run = report["runs"][0]
    assert help_run["code"] == 0, help_run["stderr"][-3000:]
    assert help_run["seconds"] < HELP_BUDGET_S
    assert report["leftovers"] == [], f"{cli.prog} --help wrote {report['leftovers']} into its working folder"
    text = help_run["stdout"]
    assert report["prog"] == cli.prog and text.startswith(f"usage: {cli.prog}")
    markup = MARKUP.search(text)
    assert markup is None, f"{cli.prog} --help has reST markup: {text[max(0, markup.start() - 80):markup.end() + 40]!r}"
    for action in report["actions"]:
        if action["dest"] == "help":
            continue
        assert action["has_help"], f"{cli.prog} {action['flags'] or action['dest']}: no help text"
        if action["meaningful_default"]:
            assert "default" in action["help"], f"{cli.prog} {action['flags']}: the default is not shown"
        for choice in action["choices"] or ():
            assert choice in action["help"] or choice in text, f"{cli.prog} {action['flags']}: {choice} not listed"


@pytest.mark.parametrize("cli", [c for c in CLIS if c.typos], ids=lambda c: c.command)
def test_cli_typo_in_a_choice_flag_fails_fast_before_any_work(cli, reports):
    report = reports[cli.command]
    for run, typo in zip(report["runs"][1:], cli.typos, strict=True):
        assert run["code"] == 2, f"{cli.prog} {' '.join(run['argv'])}: exit {run['code']}\n{run['stderr'][-2000:]}"
        assert typo[-1] in run["stderr"], f"{cli.prog}: the error does not name {typo[-1]!r}: {run['stderr']}"
        assert run["seconds"] < TYPO_BUDGET_S, f"{cli.prog} {' '.join(run['argv'])} took {run['seconds']:.1f} s"
        assert run["stdout"] == ""
    assert report["leftovers"] == []
    # Every flag with choices has a typo here.
    typed = {next(arg for arg in reversed(typo) if arg.startswith("--")) for typo in cli.typos}
    with_choices = {a["flags"][0] for a in report["actions"] if a["choices"] and a["flags"]}
    assert with_choices <= typed, f"{cli.prog}: add a typo for {sorted(with_choices - typed)} to CLIS"


def test_every_main_module_is_listed():
    """A module that runs as __main__ (a __main__.py or an ``if __name__ == "__main__"`` block) is in `CLIS`."""
    listed = {c.command for c in CLIS} | {a for c in CLIS for a in c.aliases}
    found = set()
    for package in ("autosp", "simulator", "experiments", "scripts"):
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            if path.name == "__main__.py":
                found.add(".".join(path.parent.relative_to(ROOT).parts))
            elif re.search(r"^if __name__ == .__main__.:", text, re.MULTILINE):
                rel = path.relative_to(ROOT)
                found.add(str(rel) if package == "scripts" else ".".join(rel.with_suffix("").parts))
    assert found - listed == set(), f"command lines missing from CLIS in tests/test_cli_hygiene.py: {found - listed}"
    commands = {c.command for c in CLIS}
    assert commands - found == set(), f"CLIS names modules that are not command lines: {commands - found}"
