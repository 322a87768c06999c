"""Simulated paper-scale runs: AutoSP on 8×A100-80GB for the paper's Llama models.

Note [Layer extrapolation]
Tracing a full 32-layer model at 100K tokens takes ~20 s here, and the maximum
sequence-length search needs a dozen traces per model.  Every decoder layer of
these models is identical, so the step is traced with one and with two layers
(real passes, fake tensors, fake group of 8) and both workloads are simulated;
step time and activation memory are extrapolated linearly in the layer count:
x(L) = x(1) + (L - 1)·(x(2) - x(1)).  Static memory (parameters, gradients and
optimizer state) comes from the full model's parameter count.  The exactness of
the linear model is checked in the tests against a direct four-layer trace.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from autosp.export import export_workload, trace_fake_step
from experiments.models import PAPER_MODELS, PaperModel
from simulator import Cluster, simulate

log = logging.getLogger(__name__)

BF16_BYTES = 2
ADAM_BYTES_PER_PARAMETER_BYTE = 6.0
"""fp32 master weights and two fp32 Adam moments (12 bytes) per 2-byte bf16 parameter."""


@dataclass(frozen=True)
class SimulatedStep:
    model: str
    seq_len: int
    sp_size: int
    step_time_s: float
    peak_memory_bytes: int
    static_memory_bytes: int
    capacity_bytes: int

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.capacity_bytes


def _simulate_layers(model: PaperModel, seq_len: int, layers: int, sp_size: int, cluster: Cluster, zero_shards: int,
                     autosp_options: dict | None = None):
    import torch
    import transformers

    # Each trace compiles the same model code again with a new backend; drop the previous
    # traces' compiled code (it is for fake tensors and never runs again) so Dynamo's
    # per-function recompile limit is not reached.  This clears every compiled function
    # in the process: the paper-scale experiments own theirs.
    torch._dynamo.reset()
    compiled, parameter_bytes = trace_fake_step(
        lambda: transformers.LlamaForCausalLM(model.hf_config(num_layers=layers)),
        seq_len=seq_len, sp_size=sp_size, vocab_size=model.vocab_size, **(autosp_options or {}),
    )
    workload = export_workload(
        compiled.report.aot_graphs, name=f"{model.name}/autosp/L={layers}/S={seq_len}", sp_size=sp_size,
        parameter_bytes=parameter_bytes, optimizer_bytes_per_parameter_byte=ADAM_BYTES_PER_PARAMETER_BYTE,
        zero_shards=zero_shards,
    )
    result = simulate(workload, cluster)
    rank = result.ranks[0]
    return result.step_time_s, rank.peak_memory_bytes - rank.static_memory_bytes, workload


def simulate_autosp_step(model_name: str, seq_len: int, *, sp_size: int = 8, cluster: Cluster | None = None,
                         zero_shards: int = 8, autosp_options: dict | None = None) -> SimulatedStep:
    """One AutoSP training step of a paper model, simulated with layer extrapolation (see the Note).

    ``autosp_options`` are `autosp.compile` options (default: its defaults, SAC and overlap on)."""
    model = PAPER_MODELS[model_name]
    cluster = cluster or Cluster.from_preset("a100-80gb-sxm")
    t1, m1, _ = _simulate_layers(model, seq_len, 1, sp_size, cluster, zero_shards, autosp_options)
    t2, m2, _ = _simulate_layers(model, seq_len, 2, sp_size, cluster, zero_shards, autosp_options)
    layers = model.num_layers
    parameter_bytes = model.parameter_count() * BF16_BYTES
    static = parameter_bytes + (parameter_bytes + int(parameter_bytes * ADAM_BYTES_PER_PARAMETER_BYTE)) // zero_shards
    dynamic = m1 + (layers - 1) * (m2 - m1)
    return SimulatedStep(
        model=model_name, seq_len=seq_len, sp_size=sp_size,
        step_time_s=t1 + (layers - 1) * (t2 - t1),
        peak_memory_bytes=int(static + dynamic), static_memory_bytes=int(static),
        capacity_bytes=int(cluster.device.memory_bytes),
    )


def max_trainable_seq_len(model_name: str, *, sp_size: int = 8, granularity: int = 1024, low: int = 1024,
                          high: int = 262144, **kwargs) -> int:
    """Longest multiple of ``granularity`` tokens whose simulated AutoSP step fits in device memory (0: none)."""
    lo, hi = max(1, low // granularity), high // granularity
    if not simulate_autosp_step(model_name, lo * granularity, sp_size=sp_size, **kwargs).fits:
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if simulate_autosp_step(model_name, mid * granularity, sp_size=sp_size, **kwargs).fits:
            lo = mid
        else:
            hi = mid - 1
    return lo * granularity
