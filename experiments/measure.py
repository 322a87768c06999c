"""Side-by-side CPU measurements of sequence-parallel systems on real gloo ranks.

`measure_on_rank` runs on every rank (see `experiments.spawn.run_ranks`): it
builds one tiny model, a single-device reference of a training step on the full
sequence, and every requested system (`experiments.baselines`) from copies of
the same weights.  It records each system's compile (first-step) time, its loss
and gradient error against the reference, and then times steps of all systems
interleaved, rotating the order every round, so machine noise hits every system
alike and ratios measured in one run are meaningful.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, kw_only=True)
class MeasureSpec:
    model: str
    """Tiny model preset (experiments.models.TINY_MODELS)."""
    seq_len: int
    """Tokens per sample."""
    systems: tuple[str, ...]
    """Systems to compare (experiments.baselines names)."""
    steps: int = 5
    """Timed steps per system after the first (compile) step."""
    compiler: str = "aot_eager"
    """Code generator for the compiled systems."""
    layers: int = 2
    hidden: int = 64


def _sample(seq_len: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, vocab, (1, seq_len), generator=g)
    labels = ids.clone()
    labels[0, : seq_len // 4] = -100  # ignored targets spread unevenly over the shards
    return ids, labels


def _errors(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """Largest relative gradient error: max |g - g_ref| / max |g_ref| over parameters."""
    worst = 0.0
    for name, ref in reference.items():
        got = grads.get(name)
        if got is None:
            return float("inf")
        worst = max(worst, float((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12)))
    return worst


def measure_on_rank(rank: int, world: int, spec_dict: dict) -> dict:
    from experiments.baselines import build_system
    from experiments.models import build_model, vocab_size

    spec = MeasureSpec(**{**spec_dict, "systems": tuple(spec_dict["systems"])})
    torch.manual_seed(0)
    base = build_model(spec.model, layers=spec.layers, hidden=spec.hidden)
    ids, labels = _sample(spec.seq_len, vocab_size(base))

    reference = copy.deepcopy(base)
    out = reference(input_ids=ids, labels=labels)
    ref_loss = out if isinstance(out, torch.Tensor) else out.loss
    ref_loss.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters() if p.grad is not None}

    systems, results = {}, {}
    for name in spec.systems:
        dist.barrier()
        start = time.perf_counter()
        system = build_system(name, copy.deepcopy(base), sp_size=world, compiler=spec.compiler)
        loss = system.step(ids, labels)
        first_step_s = time.perf_counter() - start
        systems[name] = system
        results[name] = {
            "first_step_s": first_step_s,
            "loss": float(loss),
            "loss_error": abs(float(loss) - float(ref_loss)),
            "grad_max_rel_error": _errors(system.gradients(), ref_grads),
            "step_s": [],
        }
    names = list(spec.systems)
    for round_ in range(spec.steps):
        order = names[round_ % len(names):] + names[: round_ % len(names)]
        for name in order:
            systems[name].zero_grad()
            dist.barrier()
            start = time.perf_counter()
            systems[name].step(ids, labels)
            dist.barrier()
            results[name]["step_s"].append(time.perf_counter() - start)
    for r in results.values():
        r["median_step_s"] = statistics.median(r["step_s"])
    return {"rank": rank, "ref_loss": float(ref_loss), "systems": results, "spec": asdict(spec)}
