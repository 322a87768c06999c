"""``python -m experiments.cpu.bench_strategies``: AutoSP's strategies and the hand-written ring, side by side on gloo ranks.

For each rank count, one gloo run builds, from the same weights of the measured-cpu table's model (a small
Hugging Face Llama with GQA: experiments.reproduction.common.CPU_MODEL), every strategy of the pass that can split the
sequence over that many ranks (simulator.strategies.sp_candidates: Ulysses where the heads divide, every hybrid
U x R, the ring) and the hand-written ring baselines of the registry, all under the same compiler
(experiments.baselines.build_system).  experiments.cpu.measure.measure_on_rank measures them in that one run:
loss and largest relative gradient error against a single-device step on the full sequence, per-rank peak
memory, and the median step time over timed steps interleaved across the systems (the order rotates every
round, so machine noise hits every system alike).  The table gives the slowest rank's median step and its
ratio to AutoSP's Ulysses (autosp) at the same rank count.

Ranks share the machine's cores: with fewer cores than ranks the step times measure the contention too.
"""

from __future__ import annotations

import argparse
import logging
import math
import pathlib
import sys
import time

from experiments.tables import markdown_table, write_table
from simulator.strategies import STRATEGIES, sp_candidates

log = logging.getLogger(__name__)

BASELINE = STRATEGIES["autosp"].name
"""The ratios' denominator: AutoSP's Ulysses."""
COMPILERS = ("aot_eager", "inductor", "eager")
"""``torch.compile`` backends every system is built with (experiments.baselines.build_system)."""


def hand_written_rings() -> tuple[str, ...]:
    """The registry's hand-written ring baselines."""
    return tuple(name for name, s in STRATEGIES.items()
                 if s.implementation == "hand-written" and s.sequence_parallel == "ring")


def systems_for(ranks: int, *, heads: int, kv_heads: int) -> tuple[str, ...]:
    """The systems benchmarked on ``ranks`` ranks: the pass's candidates for a model of ``heads`` query heads
    (``kv_heads`` key/value heads), then the hand-written rings."""
    return tuple(s.name for s in sp_candidates(ranks, heads=heads, kv_heads=kv_heads)) + hand_written_rings()


def rows_of(ranks: int, seq_len: int, per_rank: list[dict]) -> list[dict]:
    """One row per system from every rank's `measure_on_rank` result: the slowest rank's median step, its ratio
    to the baseline's slowest rank (blank where the baseline did not run), the worst errors, the largest peak."""
    systems = per_rank[0]["systems"]
    base = systems.get(BASELINE, {})
    base_s = max(r["systems"][BASELINE]["median_step_s"] for r in per_rank) if "median_step_s" in base else None
    rows = []
    for name, first in systems.items():
        row = {"ranks": ranks, "seq_len": seq_len, "system": name}
        if "unsupported" in first:
            rows.append({**row, "median_step_ms": "", f"ratio_to_{BASELINE}": "", "first_step_s": "",
                         "loss_error": "", "grad_max_rel_error": "", "peak_mib": "",
                         "note": f"unsupported: {first['unsupported']}"})
            continue
        results = [r["systems"][name] for r in per_rank]
        step_s = max(r["median_step_s"] for r in results)
        rows.append({**row, "median_step_ms": f"{1e3 * step_s:.1f}",
                     f"ratio_to_{BASELINE}": f"{step_s / base_s:.2f}" if base_s else "",
                     "first_step_s": f"{max(r['first_step_s'] for r in results):.1f}",
                     "loss_error": f"{max(r['loss_error'] for r in results):.1e}",
                     "grad_max_rel_error": f"{max(r['grad_max_rel_error'] for r in results):.1e}",
                     "peak_mib": f"{max(r['peak_memory_bytes'] for r in results) / 2**20:.2f}",
                     "note": "NaN loss" if any(math.isnan(r["loss"]) for r in results) else ""})
    return rows


def run(args) -> list[dict]:
    from experiments.cpu.measure import measure_on_rank
    from experiments.launch import run_on_ranks
    from experiments.models import build_model
    from experiments.reproduction.common import COLLECTIVE_TIMEOUT_S, CPU_MODEL, CPU_MODEL_OPTIONS

    config = build_model(CPU_MODEL, layers=args.layers, hidden=args.hidden, **CPU_MODEL_OPTIONS).config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    rows = []
    for ranks in args.ranks:
        systems = args.systems or systems_for(ranks, heads=heads, kv_heads=kv_heads)
        log.info("%d ranks, %d tokens, %d timed steps: %s", ranks, args.seq_len, args.steps, ", ".join(systems))
        spec = {"model": CPU_MODEL, "model_options": CPU_MODEL_OPTIONS, "layers": args.layers,
                "hidden": args.hidden, "seq_len": args.seq_len, "steps": args.steps, "compiler": args.compiler,
                "systems": list(systems)}
        start = time.perf_counter()
        per_rank = run_on_ranks(measure_on_rank, ranks, spec, timeout_s=args.timeout_s,
                                collective_timeout_s=COLLECTIVE_TIMEOUT_S)
        rows += rows_of(ranks, args.seq_len, per_rank)
        log.info("%d ranks done in %.0f s", ranks, time.perf_counter() - start)
    return rows


def _system(name: str) -> str:
    try:
        STRATEGIES[name]
    except ValueError as err:  # UnknownStrategyError: its message lists the names
        raise argparse.ArgumentTypeError(str(err)) from None
    return name


def build_parser() -> argparse.ArgumentParser:
    from experiments import cli

    parser = cli.parser("experiments.cpu.bench_strategies", __doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], metavar="N",
                        help="gloo rank counts (the SP degree), one run each")
    parser.add_argument("--seq-len", type=int, default=512, metavar="TOKENS", help="tokens per sample")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per system")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the model")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size of the model")
    parser.add_argument("--compiler", default="aot_eager", choices=COMPILERS,
                        help=f"torch.compile backend of every system ({', '.join(COMPILERS)})")
    parser.add_argument("--systems", type=_system, nargs="+", metavar="NAME",
                        help="strategies to run at every rank count (names of simulator.strategies.STRATEGIES; "
                             "default: the pass's candidates at each rank count and the hand-written ring)")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="deadline of one gloo run")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results/bench_strategies"),
                        help="folder for the CSV and Markdown table")
    return parser



def _check(parser, args) -> None:
    if any(n < 2 for n in args.ranks):
        parser.error(f"--ranks {' '.join(map(str, args.ranks))}: give rank counts of 2 or more")
    if args.seq_len < 1 or args.steps < 1 or args.layers < 1 or args.hidden < 1:
        parser.error("--seq-len, --steps, --layers and --hidden must be positive")
    for name in args.systems or ():
        strategy = STRATEGIES[name]
        for ranks in args.ranks:  # a hybrid's degrees must split the one sequence over all the ranks
            reason = strategy.cannot_run_on(ranks)
            if reason:
                parser.error(f"--systems {name} cannot run on {ranks} ranks: {reason}")

def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    rows = run(args)
    write_table("bench_strategies", rows, args.out)
    sys.stdout.write(markdown_table(rows) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
