"""``python -m experiments.cpu.bench_plan_accuracy``: how close the memory planner's predicted peak is to the peak of the plan it chose, measured on gloo ranks, and whether that plan stays under its target.

For each model and length, on gloo ranks: the peak of one step that plans nothing (`UNPLANNED`: Ulysses without
checkpointing, about what the planner's leanest-recomputing candidate holds) is measured; then for each fraction of
that peak, AutoSP's default compile is given the fraction as ``target_memory`` exactly as the memory-cap table's
planner row is (`experiments.cpu.memory_cap.row_system`), the planner chooses a plan at the first step, and the
second step's peak is measured (tensor memory, largest over the ranks: `experiments.cpu.peak_memory`), beside the
peak the planner predicted for that plan.  A point: (model, length, target).

Printed per point: the target, the plan, its predicted and measured peaks and the prediction's error
(predicted - measured, in % of measured: positive is pessimistic, which costs length; negative is optimistic,
which on a GPU is an out-of-memory crash); then the median and worst |error| and how many chosen plans measured
over their target, and every point into a JSON file.  Measured, never asserted: this is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import statistics
import sys
import time
from collections.abc import Sequence

from autosp.entry import positive_int
from experiments.models import TINY_MODELS

log = logging.getLogger(__name__)

UNPLANNED = "ulysses"
"""The row whose measured peak scales each point's target: no checkpointing and no memory technique."""
DEFAULT_MODELS = ("hf-llama", "hf-qwen2", "mini-llama-3.1-8b")
DEFAULT_LENGTHS = (1024, 2048, 4096)
DEFAULT_FRACTIONS = (0.5, 0.7, 0.9)


def points_on_rank(rank: int, world: int, model: str, lengths: Sequence[int], fractions: Sequence[float],
                   compiler: str, fixed: dict | None = None) -> list[dict]:
    """Every point of ``model`` (one gloo run): per length the unplanned peak, then per fraction the planner's
    choice under that share of it (``fixed``: compile options it keeps), its predicted and measured peaks."""
    import os

    import torch

    from experiments.cpu.measure import _quiet_rank
    from experiments.cpu.memory_cap import NO_PLAN, PLANNER_ROW, MemoryCapSpec, probe
    from experiments.models import build_model
    from experiments.reproduction.memory_cap import MODEL_OPTIONS

    os.environ.setdefault("LOCAL_RANK", str(rank))
    _quiet_rank()
    torch.manual_seed(0)
    base = build_model(model, **MODEL_OPTIONS.get(model, {}))
    out = []
    for seq_len in lengths:
        spec = MemoryCapSpec(model=model, systems=(UNPLANNED,), cap_bytes=0, compiler=compiler)
        unplanned, _ = probe(UNPLANNED, base, seq_len, world, spec)
        for fraction in fractions:
            target = int(unplanned * fraction)
            spec = MemoryCapSpec(model=model, systems=(PLANNER_ROW,), cap_bytes=target, compiler=compiler,
                                 planner_options=dict(fixed or {}))
            start = time.perf_counter()
            measured, chosen = probe(PLANNER_ROW, base, seq_len, world, spec)
            point = {"model": model, "seq_len": seq_len, "fraction": fraction, "unplanned_bytes": int(unplanned),
                     "target_bytes": target, "plan": (chosen or NO_PLAN)["plan"],
                     "predicted_bytes": (chosen or {}).get("peak_bytes"),
                     "measured_bytes": None if chosen == NO_PLAN else int(measured),
                     "seconds": time.perf_counter() - start}
            out.append(point)
            log.info("%s", point_line(point))
    return out


def error_pct(point: dict) -> float | None:
    """The prediction's error at ``point``: (predicted - measured) / measured, in %; None where nothing was
    planned or measured."""
    if point["predicted_bytes"] is None or not point["measured_bytes"]:
        return None
    return 100.0 * (point["predicted_bytes"] - point["measured_bytes"]) / point["measured_bytes"]


def point_line(point: dict) -> str:
    mib = 2**20
    head = (f"{point['model']} {point['seq_len']:>6,} tokens, target {point['target_bytes'] / mib:6.2f} MiB "
            f"({point['fraction']:.2f} of unplanned): ")
    error = error_pct(point)
    if error is None:
        return head + point["plan"]
    over = "  OVER TARGET" if point["measured_bytes"] > point["target_bytes"] else ""
    return (head + f"{point['plan']}: predicted {point['predicted_bytes'] / mib:.2f}, measured "
            f"{point['measured_bytes'] / mib:.2f} MiB, error {error:+.1f} %{over}")


def summarize(points: Sequence[dict]) -> dict:
    """The benchmark's figures over ``points``: how many were planned, the median and worst |error| (%), the
    median signed error, and the points whose chosen plan measured over its target."""
    errors = [e for e in map(error_pct, points) if e is not None]
    over = [p for p in points if error_pct(p) is not None and p["measured_bytes"] > p["target_bytes"]]
    return {"points": len(points), "planned": len(errors), "no_plan": len(points) - len(errors),
            "median_abs_error_pct": statistics.median(map(abs, errors)) if errors else None,
            "worst_abs_error_pct": max(map(abs, errors)) if errors else None,
            "median_error_pct": statistics.median(errors) if errors else None,
            "over_target": [f"{p['model']} {p['seq_len']} @ {p['fraction']}" for p in over]}


def summary_line(summary: dict) -> str:
    if not summary["planned"]:
        return f"{summary['points']} points, none planned"
    return (f"{summary['planned']} of {summary['points']} points planned: |error| median "
            f"{summary['median_abs_error_pct']:.1f} %, worst {summary['worst_abs_error_pct']:.1f} % (signed median "
            f"{summary['median_error_pct']:+.1f} %); chosen plans over their target: {len(summary['over_target'])}"
            + (f" ({', '.join(summary['over_target'])})" if summary["over_target"] else ""))


def _fraction(value: str) -> float:
    """An argparse type: a positive share of the unplanned peak."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not number > 0:
        raise argparse.ArgumentTypeError(f"{number}: give a positive fraction")
    return number


FIXABLE = {"activation_offload": ("on", "off"), "checkpointing": ("none", "sac", "full", "layer"),
           "tiled_loss": ("on", "off"), "tiled_mlp": ("on", "off")}
"""The memory options ``--fixed`` may set, and their values."""


def _fixed(value: str) -> tuple[str, str]:
    """An argparse type: ``OPTION=VALUE``, a memory option of `FIXABLE` and one of its values."""
    option, sep, setting = value.partition("=")
    if not sep or option not in FIXABLE or setting not in FIXABLE[option]:
        raise argparse.ArgumentTypeError(f"{value!r}: give OPTION=VALUE, one of "
                                         + ", ".join(f"{k}={'|'.join(v)}" for k, v in FIXABLE.items()))
    return option, setting


def _ranks(value: str) -> int:
    """An argparse type: 2 or more gloo ranks."""
    number = positive_int(value)
    if number < 2:
        raise argparse.ArgumentTypeError(f"{number}: give 2 or more")
    return number


def build_parser() -> argparse.ArgumentParser:
    from experiments import cli

    parser = cli.parser("experiments.cpu.bench_plan_accuracy", __doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=sorted(TINY_MODELS),
                        help="tiny models (default: %(default)s)")
    parser.add_argument("--lengths", nargs="+", type=positive_int, default=list(DEFAULT_LENGTHS), metavar="TOKENS",
                        help="sequence lengths, multiples of 2 x ranks (default: %(default)s)")
    parser.add_argument("--fractions", nargs="+", type=_fraction, default=list(DEFAULT_FRACTIONS),
                        help="targets, as fractions of the unplanned step's measured peak (default: %(default)s)")
    parser.add_argument("--ranks", type=_ranks, default=2, help="gloo ranks (the SP degree) (default: %(default)s)")
    parser.add_argument("--fixed", nargs="+", type=_fixed, default=[], metavar="OPTION=VALUE",
                        help="memory options the planner keeps, choosing the rest (e.g. activation_offload=on, to "
                             "measure the offload plans)")
    parser.add_argument("--compiler", default="aot_eager", choices=("aot_eager", "inductor"),
                        help="the compiler of every step (default: %(default)s)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results/bench_plan_accuracy.json"),
                        help="JSON file for every point and the summary (default: %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    from experiments.launch import run_on_ranks
    from experiments.reproduction.common import COLLECTIVE_TIMEOUT_S, MEASUREMENT_TIMEOUT_S

    points = []
    for model in args.models:
        start = time.perf_counter()
        points += run_on_ranks(points_on_rank, args.ranks, model, args.lengths, args.fractions, args.compiler,
                               dict(args.fixed), timeout_s=MEASUREMENT_TIMEOUT_S, collective_timeout_s=COLLECTIVE_TIMEOUT_S)[0]
        log.info("%s: %d points in %.0f s", model, len(args.lengths) * len(args.fractions),
                 time.perf_counter() - start)
    for point in points:
        sys.stdout.write(point_line(point) + "\n")
    summary = summarize(points)
    sys.stdout.write(summary_line(summary) + "\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"argv": sys.argv[1:], "summary": summary, "points": points}, indent=1) + "\n")
    sys.stdout.write(f"wrote {args.out}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
