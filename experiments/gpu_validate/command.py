"""Validate AutoSP on this machine's GPU in one command: exactness, kernels, prediction, calibration record.

The command line of ``python -m experiments.gpu_validate`` (`build_parser`, `main`); what it checks:
`experiments.gpu_validate`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from experiments.gpu_validate.case_set import CASE_NAMES, cases
from experiments.gpu_validate.report import write_outputs
from experiments.gpu_validate.run import BUDGET_S, validate

DEFAULT_OUT = Path("results/gpu_validate")


def build_parser() -> argparse.ArgumentParser:
    from experiments import cli

    parser = cli.parser("experiments.gpu_validate", __doc__.split("\n\n")[0])
    parser.add_argument("--cpu-only", action="store_true",
                        help="run the sections on CPU gloo ranks (CI): everything but the GPU measurements; CPU "
                             "timings are printed, not judged")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="folder for gpu_validate.json, summary.csv/.md and calibration/PRESET.json")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                        help="time budget of the whole run in seconds: ranks still running when it is spent are "
                             "stopped and their cases fail")
    parser.add_argument("--only", nargs="+", default=None, choices=CASE_NAMES, metavar="CASE",
                        help="run only these cases (CPU: sp2-ulysses sp2-ring sp1-planned; GPU: sp1-planned sp1-bf16,"
                             " with two or more GPUs also sp2-ulysses sp2-ring sp2-bf16)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        parser.error(f"--budget-s {args.budget_s}: give a positive number of seconds")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    import torch

    if not args.cpu_only and not torch.cuda.is_available():
        print("gpu_validate: no CUDA GPU visible (torch.cuda.is_available() is False); run it on a GPU machine "
              "with a CUDA build of torch, or pass --cpu-only", file=sys.stderr)
        return 1
    runnable = {c.name for c in cases("cpu" if args.cpu_only else "cuda", torch.cuda.device_count())}
    if args.only and not runnable & set(args.only):
        parser.error(f"--only {' '.join(args.only)}: none of these runs here; choose from {' '.join(sorted(runnable))}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from autosp.errors import AutoSPError

    try:
        results = validate(cpu_only=args.cpu_only, out=args.out, budget_s=args.budget_s, only=args.only)
    except AutoSPError as err:  # e.g. a GPU without a hardware preset (autosp.plan.auto.GPU_PRESETS)
        print(f"gpu_validate: {err}", file=sys.stderr)
        return 1
    write_outputs(results, args.out)
    from experiments.tables import markdown_table

    print(markdown_table(results["summary"]))
    print(f"\n{'PASSED' if results['passed'] else 'FAILED'} in {results['elapsed_s']:.0f} s; wrote "
          f"{args.out / 'gpu_validate.json'} and {args.out / 'summary.md'}")
    return 0 if results["passed"] else 1
