"""``python -m experiments.cpu.bench_alst``: AutoSP's default compile against DeepSpeed's ALST, side by side under one memory cap.

For each model, the memory-cap table's machinery (experiments.cpu.memory_cap) searches each system's longest
sequence under the cap on gloo ranks, the two searches one after the other with the same model, cap, start,
granularity and probe budget; then one gloo run times both systems' steps at ALST's longest length, interleaved
(experiments.cpu.memory_cap.step_times_on_rank), so that machine noise hits both alike.  AutoSP runs as the
memory-cap table runs it, its memory options chosen by the planner for the cap; ALST is the registry's ``alst``
(experiments/baselines/alst.py, DeepSpeed's released components as ArcticTraining wires them).  Both systems'
host-memory offload is counted in the same host pool (experiments/cpu/peak_memory.py).

Printed per model: both longest lengths and their ratio, and at ALST's longest length both median steps and their
ratio (AutoSP / ALST), with each peak and AutoSP's plan, and every probe and timing into a JSON file.  The ratios
are measured, never asserted: this is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys
import time

from experiments.models import TINY_MODELS
from experiments.reproduction.run import PRESETS, SHARED
from simulator.strategies import STRATEGIES

log = logging.getLogger(__name__)

AUTOSP = STRATEGIES["autosp"].name
"""AutoSP as compiled by default (the planner chooses its memory options for the cap)."""
ALST = STRATEGIES["alst"].name
"""DeepSpeed's ALST, the baseline of the ratios."""
DEFAULTS = {**SHARED, **PRESETS["default"]}
"""The memory-cap table's default settings (models, cap, search), which the flags override."""


def compare_model(model: str, args: argparse.Namespace) -> dict:
    """Both systems' longest lengths on ``model`` under the cap, and both steps timed at ALST's longest."""
    from experiments.cpu.memory_cap import max_seq_len_on_rank, step_times_on_rank
    from experiments.launch import run_on_ranks
    from experiments.reproduction.common import COLLECTIVE_TIMEOUT_S, MEASUREMENT_TIMEOUT_S
    from experiments.reproduction.memory_cap import MODEL_OPTIONS

    spec = {"model": model, "model_options": MODEL_OPTIONS.get(model, {}), "cap_bytes": int(args.cap_mib * 2**20),
            "start": args.start, "granularity": args.granularity, "max_probes": args.probes,
            "max_len": args.max_len}
    searched = {}
    for system in (AUTOSP, ALST):
        start = time.perf_counter()
        result = run_on_ranks(max_seq_len_on_rank, args.ranks, {**spec, "systems": [system]},
                              timeout_s=MEASUREMENT_TIMEOUT_S, collective_timeout_s=COLLECTIVE_TIMEOUT_S)[0]
        searched[system] = result["systems"][system]
        log.info("%s: %s's longest length %s (first failure %s), searched in %.0f s", model, system,
                 searched[system]["max_seq_len"], searched[system]["first_failure"], time.perf_counter() - start)
    length = searched[ALST]["max_seq_len"]
    log.info("%s: timing both steps at %d tokens (%d steps each)", model, length, args.steps)
    timed = run_on_ranks(step_times_on_rank, args.ranks, {**spec, "systems": [ALST, AUTOSP]}, length, args.steps,
                         timeout_s=MEASUREMENT_TIMEOUT_S, collective_timeout_s=COLLECTIVE_TIMEOUT_S)[0]
    return {"model": model, "seq_len": length, "search": searched, "timed": timed}


def ratio_line(result: dict) -> str:
    """One line of ratios for a `compare_model` result."""
    longest = {name: r["max_seq_len"] for name, r in result["search"].items()}
    timed = result["timed"]
    step = {name: timed[name]["median_step_s"] for name in (AUTOSP, ALST)}
    return (f"{result['model']}: longest {AUTOSP} {longest[AUTOSP]:,} / {ALST} {longest[ALST]:,} tokens = "
            f"{longest[AUTOSP] / max(longest[ALST], 1):.2f}x; step at {result['seq_len']:,} tokens "
            f"{AUTOSP} {step[AUTOSP]:.3f} s / {ALST} {step[ALST]:.3f} s = {step[AUTOSP] / step[ALST]:.2f}x; "
            f"peaks {timed[AUTOSP]['peak_bytes'] / 2**20:.2f} / {timed[ALST]['peak_bytes'] / 2**20:.2f} MiB; "
            f"{AUTOSP}'s plan: {timed[AUTOSP]['plan']}")


def _alst_model(name: str) -> str:
    """``--models``: a tiny model ALST can run (`experiments.baselines.alst.unsupported_reason`, from the model's
    structure); another tiny model refused in one line saying why; an unknown name left to the flag's choices."""
    from experiments.baselines.alst import unsupported_reason

    why = unsupported_reason(name) if name in TINY_MODELS else None
    if why is not None:
        raise argparse.ArgumentTypeError(f"{name} cannot run under {ALST}: {why}")
    return name


def build_parser() -> argparse.ArgumentParser:
    from experiments import cli

    parser = cli.parser("experiments.cpu.bench_alst", __doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", type=_alst_model, default=list(DEFAULTS["cap_models"]),
                        choices=sorted(TINY_MODELS),
                        help="the models compared (Hugging Face decoders with gate/up/down MLPs: ALST's tiled MLP "
                             "takes no other; another is refused)")
    parser.add_argument("--cap-mib", type=float, default=DEFAULTS["memory_cap_mib"],
                        help="memory cap per rank (MiB)")
    parser.add_argument("--ranks", type=int, default=DEFAULTS["cap_ranks"][0], help="gloo ranks (the SP degree)")
    parser.add_argument("--start", type=int, default=DEFAULTS["cap_start"], metavar="TOKENS",
                        help="the search's first length")
    parser.add_argument("--granularity", type=int, default=DEFAULTS["cap_granularity"], metavar="TOKENS",
                        help="the search's step")
    parser.add_argument("--probes", type=int, default=DEFAULTS["cap_probes"], help="probes per search")
    parser.add_argument("--max-len", type=int, default=DEFAULTS["cap_max_len"], metavar="TOKENS",
                        help="the longest length searched")
    parser.add_argument("--steps", type=int, default=DEFAULTS["cpu_steps"], help="timed steps per system")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results/bench_alst.json"),
                        help="JSON file for every probe and timing")
    return parser


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.ranks < 2:
        parser.error(f"--ranks {args.ranks}: give 2 or more")
    if min(args.cap_mib, args.start, args.granularity, args.probes, args.max_len, args.steps) <= 0:
        parser.error("--cap-mib, --start, --granularity, --probes, --max-len and --steps must be positive")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    results = []
    for model in args.models:
        results.append(compare_model(model, args))
        sys.stdout.write(ratio_line(results[-1]) + "\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    sys.stdout.write(f"wrote {args.out}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
