"""``python -m experiments.cpu.bench_sharding``: what sharded parameters save per rank, and what they cost per step.

The same Hugging Face model compiled by AutoSP on 2 gloo ranks twice, with whole parameters and with
``shard_parameters=True`` (Note [Parameters gathered in the graph] in autosp/parameter_sharding.py), each trained
by its own AdamW.  Per variant: the per-rank peak of one whole training step (forward, backward, optimizer step)
counting the parameters, the optimizer's state and every tensor the step creates
(`experiments.cpu.peak_memory.PeakMemory`), the bytes held between steps (parameters and optimizer state), and the
step time (steps interleaved across the variants, slowest rank, median: `experiments.cpu.measure.time_interleaved`).
Ratios are sharded / whole, measured in one run.  Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import copy

from experiments.cpu import two_ranks
from experiments.models import TINY_MODELS
from experiments.tables import markdown_table

VARIANTS = {"whole": False, "sharded": True}


class _Variant:
    """One compiled model and its optimizer: a training step is forward, backward and the optimizer's step."""

    def __init__(self, compiled):
        import torch

        self.compiled = compiled
        self.optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-4)

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, ids, labels):
        import autosp

        self.compiled(**autosp.prepare_inputs(ids, labels=labels)).loss.backward()
        self.optimizer.step()

    def held_between_steps(self) -> list:
        """The tensors a rank holds between steps: parameters and the optimizer's state."""
        import torch

        states = [t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        return [*self.compiled.parameters(), *states]


def _bench_on_rank(rank: int, world: int, spec: dict) -> dict:
    import torch

    import autosp
    from experiments.cpu.measure import time_interleaved
    from experiments.cpu.peak_memory import PeakMemory, storage_bytes
    from experiments.models import build_model, vocab_size

    torch.manual_seed(0)
    base = build_model(spec["model"], layers=spec["layers"])
    ids = torch.randint(0, vocab_size(base), (1, spec["seq_len"]), generator=torch.Generator().manual_seed(1))
    variants, memory = {}, {}
    for name, sharded in VARIANTS.items():
        compiled = autosp.compile(copy.deepcopy(base), sp_size=world, compiler=spec["compiler"],
                                  shard_parameters=sharded)
        variant = variants[name] = _Variant(compiled)
        for _ in range(2):  # compile, and create the optimizer's state, outside the measurement
            variant.zero_grad()
            variant.step(ids, ids)
        variant.zero_grad()
        held = variant.held_between_steps()
        with PeakMemory(static=held) as pm:
            variant.step(ids, ids)
        memory[name] = {"peak": pm.peak_bytes, "held": storage_bytes(held)}
    return {"times": time_interleaved(variants, ids, ids, steps=spec["steps"]), "memory": memory}


def build_parser() -> argparse.ArgumentParser:
    from experiments import cli

    parser = cli.parser("experiments.cpu.bench_sharding", __doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mini-llama-3.1-8b", choices=sorted(TINY_MODELS), help="the model")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sample")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    two_ranks.add_model_arguments(parser, compiler="aot_eager", compiler_help="autosp.compile backend")
    return parser


def main(argv=None) -> None:
    args = two_ranks.parse_args(build_parser(), argv)
    results, median = two_ranks.interleaved_medians(
        _bench_on_rank, args, f"whole vs sharded parameters: {args.model}, {args.seq_len} tokens")
    rows = []
    for name in VARIANTS:
        peak = max(r["memory"][name]["peak"] for r in results)
        held = max(r["memory"][name]["held"] for r in results)
        rows.append({"variant": name, "peak_MiB": f"{peak / 2**20:.2f}", "held_MiB": f"{held / 2**20:.2f}",
                     "step_ms": f"{median[name] * 1e3:.1f}"})
    whole, sharded = rows
    rows.append({"variant": "sharded / whole",
                 **{k: f"{float(sharded[k]) / float(whole[k]):.3f}" for k in ("peak_MiB", "held_MiB", "step_ms")}})
    print(markdown_table(rows))  # noqa: T201 - the command's output


if __name__ == "__main__":
    main()
