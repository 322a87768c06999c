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
import logging
import statistics
import time

from experiments.tables import markdown_table

log = logging.getLogger(__name__)


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
    parser.add_argument("--layers", type=int, default=2, help="decoder layers")
    parser.add_argument("--steps", type=int, default=7, help="timed steps per variant")
    parser.add_argument("--calls", type=int, default=50, help="timed calls of the check alone")
    parser.add_argument("--compiler", default="aot_eager", choices=("aot_eager", "inductor"),
                        help="autosp.compile backend")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    from experiments.launch import run_on_ranks

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    spec = {"seq_len": args.seq_len, "batch": args.batch, "layers": args.layers, "steps": args.steps,
            "calls": args.calls, "compiler": args.compiler}
    log.info("same-sample check on vs off: %d x %d tokens, 2 gloo ranks, %d timed steps each", args.batch,
             args.seq_len, args.steps)
    results = run_on_ranks(_bench_on_rank, 2, spec, timeout_s=1800)
    names = list(results[0]["times"])
    median = {n: statistics.median(max(r["times"][n][i] for r in results) for i in range(args.steps))
              for n in names}
    alone = max(r["alone"] for r in results)
    rows = [{"variant": n, "step_ms": f"{median[n] * 1e3:.1f}", "vs_off": f"{median[n] / median['check off']:.3f}"}
            for n in names]
    rows.append({"variant": "the check alone", "step_ms": f"{alone * 1e3:.3f}",
                 "vs_off": f"{alone / median['check off']:.4f}"})
    print(markdown_table(rows))  # noqa: T201 - the command's output


if __name__ == "__main__":
    main()
