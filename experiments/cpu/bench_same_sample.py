"""``python -m experiments.cpu.bench_same_sample``: the cost of checking that an SP group holds one sample.

Every call of an AutoSP model checks, with one all-gather of a few checksums, that the
ranks of its SP group were given the same input ids, labels, positions and mask
(`autosp.guards.check_same_sample`; ``AutoSPConfig.check_same_sample``).  This runs the
same Hugging Face Llama on 2 gloo ranks with the check on and off, steps interleaved
(experiments.cpu.measure.time_interleaved), slowest rank, median, and times the check
alone (median of ``--calls`` calls).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

from experiments.cpu import two_ranks
from experiments.tables import markdown_table


class _Variant:
    def __init__(self, compiled):
        self.compiled = compiled

    def zero_grad(self):
        self.compiled.zero_grad(set_to_none=True)

    def step(self, ids, labels):
        import autosp

        self.compiled(**autosp.prepare_inputs(ids, labels=labels)).loss.backward()


def _bench_on_rank(rank: int, world: int, spec: dict) -> dict:
    import torch
    import torch.distributed as dist

    import autosp
    from autosp.guards import check_same_sample
    from experiments.cpu.measure import time_interleaved
    from experiments.models import build_model

    torch.manual_seed(0)
    base = build_model("hf-llama", layers=spec["layers"])
    ids = torch.randint(0, 256, (spec["batch"], spec["seq_len"]), generator=torch.Generator().manual_seed(1))
    variants = {}
    for name, check in (("check on", True), ("check off", False)):
        compiled = autosp.compile(copy.deepcopy(base), sp_size=world, compiler=spec["compiler"],
                                  check_same_sample=check)
        variants[name] = _Variant(compiled)
        variants[name].step(ids, ids)  # compile outside the timed steps
    times = time_interleaved(variants, ids, ids, steps=spec["steps"])
    batch = autosp.prepare_inputs(ids, labels=ids)
    alone = []
    for _ in range(spec["calls"]):
        dist.barrier()
        start = time.perf_counter()
        check_same_sample(batch, dist.group.WORLD, world, ids.device)
        alone.append(time.perf_counter() - start)
    return {"times": times, "alone": statistics.median(alone)}


def build_parser() -> argparse.ArgumentParser:
    from experiments import cli

    parser = cli.parser("experiments.cpu.bench_same_sample", __doc__)
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per row")
    parser.add_argument("--batch", type=int, default=1, help="rows")
    parser.add_argument("--steps", type=int, default=7, help="timed steps per variant")
    parser.add_argument("--calls", type=int, default=50, help="timed calls of the check alone")
    two_ranks.add_model_arguments(parser, compiler="aot_eager", compiler_help="autosp.compile backend")
    return parser


def main(argv=None) -> None:
    args = two_ranks.parse_args(build_parser(), argv)
    results, median = two_ranks.interleaved_medians(
        _bench_on_rank, args, f"same-sample check on vs off: {args.batch} x {args.seq_len} tokens")
    alone = max(r["alone"] for r in results)
    rows = [{"variant": n, "step_ms": f"{median[n] * 1e3:.1f}", "vs_off": f"{median[n] / median['check off']:.3f}"}
            for n in median]
    rows.append({"variant": "the check alone", "step_ms": f"{alone * 1e3:.3f}",
                 "vs_off": f"{alone / median['check off']:.4f}"})
    print(markdown_table(rows))  # noqa: T201 - the command's output


if __name__ == "__main__":
    main()
