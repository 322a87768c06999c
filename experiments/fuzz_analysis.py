"""Differential fuzzer of AutoSP's sequence-sharding analysis: random programs, exact or refused on every rank.

    python -m experiments.fuzz_analysis --programs 200 --seed 0 --ranks 2 4 [--out fuzz.json]
    python -m experiments.fuzz_analysis --sweep --ranks 2 4     # one program per op of the pool

Generates ``--programs`` random small causal-LM programs per rank count
(`experiments.fuzz.programs`: token-local ops, ops with rules, ops that mix
tokens, custom autograd Functions, positions and token counts spelt several
ways, padding masks, several lengths per compiled model), runs them under AutoSP
on gloo ranks and against a single-device run of the full sequence
(`experiments.fuzz.oracle`), and prints the counts and every finding (accepted
but wrong, a crash that is not an AutoSPError, ranks that disagree, a launch that
died), grouped by kind with the smallest program of each kind (``--shrink N``: made minimal by removing
ops, lengths and inputs while the finding persists).  Exit status 1
when there is a finding.  ``--show-refusals`` also lists what was refused.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from experiments import cli
from experiments.fuzz.oracle import run_programs, shrink, summarize
from experiments.fuzz.programs import OPS, generate, sweep

log = logging.getLogger(__name__)


def _report(results, sp_size: int, show_refusals: bool, shrink_groups: int) -> list[str]:
    lines = [f"== {sp_size} ranks: {json.dumps(summarize(results)['by_status'], sort_keys=True)}"]
    groups: dict[str, list] = {}
    for r in results:
        if r.is_finding:
            groups.setdefault(r.signature(), []).append(r)
    for signature, members in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        smallest = min(members, key=lambda r: (len(r.program.ops), len(r.program.lengths)))
        lines.append(f"-- finding x{len(members)}: {signature}")
        lines.append(f"   smallest: {smallest.program.describe()}")
        lines.append(f"   detail:   {smallest.message[:1500]}")
        if shrink_groups > 0:
            shrink_groups -= 1
            minimal = shrink(smallest, sp_size)
            lines.append(f"   minimal:  {minimal.program.describe()}")
            lines.append(f"   minimal detail: {minimal.message[:1500]}")
    if show_refusals:
        for r in results:
            if r.status in ("refused", "mixed"):
                lines.append(f"   {r.status}: {r.program.describe()}: {r.message[:300]}")
    over = [r for r in results if r.status == "refused" and r.program.kinds() == {"local"}]
    if over:
        lines.append(f"   ({len(over)} refused programs hold only token-local ops: over-refusals, not findings)")
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("experiments.fuzz_analysis", __doc__)
    parser.add_argument("--programs", type=int, default=100, help="random programs per rank count")
    parser.add_argument("--seed", type=int, default=0, help="generator seed")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="SP sizes to run, one launch series each")
    parser.add_argument("--max-ops", type=int, default=4, help="most ops per random program")
    parser.add_argument("--batch", type=int, default=50, help="programs per launch of the ranks")
    parser.add_argument("--out", help="write every program's outcome to this JSON file (nothing is written without it)")
    parser.add_argument("--sweep", action="store_true",
                        help="instead of random programs, one program per op and per positions spelling")
    parser.add_argument("--shrink", type=int, default=0, metavar="N",
                        help="shrink the smallest program of the first N kinds of finding to a minimal one")
    parser.add_argument("--show-refusals", action="store_true", help="list refused programs too")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    records, findings = [], 0
    for sp_size in args.ranks:
        programs = (sweep(sp_size, args.seed) if args.sweep
                    else generate(args.programs, args.seed, sp_size, max_ops=args.max_ops))
        start = time.perf_counter()
        results = run_programs(programs, sp_size, batch_size=args.batch)
        elapsed = time.perf_counter() - start
        for line in _report(results, sp_size, args.show_refusals, args.shrink):
            print(line)
        seconds = sorted(c["seconds"] for r in results if r.calls for c in r.calls[0] if "seconds" in c)
        median = seconds[len(seconds) // 2] if seconds else 0.0
        print(f"   {len(results)} programs, {len(seconds)} calls in {elapsed:.0f} s (per call: median {median:.1f} s, "
              f"max {max(seconds, default=0.0):.1f} s)")
        findings += sum(r.is_finding for r in results)
        records += [{"sp_size": sp_size, "status": r.status, "program": r.program.describe(), "message": r.message,
                     "calls": [(c["length"], c["status"]) for c in (r.calls[0] if r.calls else [])]}
                    for r in results]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "ops": sorted(OPS), "results": records}, f, indent=1)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
