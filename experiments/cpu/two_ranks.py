"""What the side-by-side benches on 2 gloo ranks share (``python -m experiments.cpu.bench_packed``,
``bench_same_sample``, ``bench_lengths``): their ``--layers`` and ``--compiler`` flags, the logging, the run on the
ranks and the slowest-rank median of step times measured interleaved.

Nothing here imports torch, so that ``--help`` stays quick; the ranks import it themselves.
"""

from __future__ import annotations

import argparse
import logging
import statistics
from collections.abc import Callable

log = logging.getLogger(__name__)

COMPILERS = ("aot_eager", "inductor")
"""The ``--compiler`` choices: `autosp.compile`'s backends that run on CPU."""


def add_model_arguments(parser: argparse.ArgumentParser, *, compiler: str, compiler_help: str,
                        layers: int = 2) -> None:
    """``--layers`` (decoder layers, default ``layers``) and ``--compiler`` (default ``compiler``, listed first)."""
    parser.add_argument("--layers", type=int, default=layers, help="decoder layers")
    parser.add_argument("--compiler", default=compiler, choices=sorted(COMPILERS, key=lambda c: c != compiler),
                        help=compiler_help)


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser``'s arguments, then INFO logging to stderr set up (the bench logs its progress)."""
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return args


def run_on_two_ranks(fn: Callable, spec: dict, *, timeout_s: float, **kwargs) -> list:
    """``fn(rank, 2, spec)`` on 2 gloo ranks (`experiments.launch.run_on_ranks`, ``kwargs`` passed on), every
    rank's result in rank order."""
    from experiments.launch import run_on_ranks

    return run_on_ranks(fn, 2, spec, timeout_s=timeout_s, **kwargs)


def interleaved_medians(bench_on_rank: Callable, args: argparse.Namespace, what: str, *, timeout_s: float = 1800
                        ) -> tuple[list[dict], dict[str, float]]:
    """``bench_on_rank(rank, 2, spec)`` on 2 gloo ranks, every flag in ``spec`` (``what``: the comparison, logged
    first); it returns ``{"times": {variant: [seconds per step]}, ...}`` of ``args.steps`` steps timed interleaved
    across the variants (`experiments.cpu.measure.time_interleaved`).  Every rank's result, and per variant (in
    order) the median over the steps of the slowest rank's seconds."""
    log.info("%s, 2 gloo ranks, %d timed steps each", what, args.steps)
    results = run_on_two_ranks(bench_on_rank, vars(args), timeout_s=timeout_s)
    medians = {name: statistics.median(max(r["times"][name][i] for r in results) for i in range(args.steps))
               for name in results[0]["times"]}
    return results, medians
