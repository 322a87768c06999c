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
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

from autosp.export import ModuleParameters, export_workload, module_parameters, trace_fake_step
from experiments.models import PAPER_MODELS, PaperModel
from simulator import Cluster, simulate
from simulator.workload import Workload

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


@dataclass
class TraceCache:
    """Exported workloads of one run, keyed by everything that determines the trace.

    Owned by a caller (one reproduction run) and passed down explicitly; the searches of
    different systems probe some of the same lengths (ring attention reuses the Ulysses
    trace, see experiments.paper_scale.baselines), each of which is traced once."""

    workloads: dict = field(default_factory=dict)
    hits: int = 0
    misses: int = 0

    def get(self, key, make: Callable[[], TracedStep]) -> TracedStep:
        found = self.workloads.get(key)
        if found is None:
            self.misses += 1
            found = self.workloads[key] = make()
        else:
            self.hits += 1
        return found


@dataclass(frozen=True)
class TracedStep:
    """One traced and exported training step (see `trace_workload`)."""

    workload: Workload
    modules: tuple[ModuleParameters, ...] = ()
    """Which ops read which module's parameters (traced with ``sp_size=1`` only: what ZeRO-3 gathers)."""


def trace_workload(model: PaperModel, seq_len: int, layers: int, *, sp_size: int, zero_shards: int,
                   autosp_options: dict | None = None, cache: TraceCache | None = None) -> TracedStep:
    """``layers`` decoder layers of ``model`` compiled by AutoSP for ``sp_size`` ranks (1: without sequence
    parallelism) on fake tensors, exported as a workload."""
    options = dict(autosp_options or {})
    key = (model.name, seq_len, layers, sp_size, zero_shards, tuple(sorted(options.items())))

    def make() -> TracedStep:
        import torch
        import transformers

        # Each trace compiles the same model code again with a new backend; drop the previous
        # traces' compiled code (it is for fake tensors and never runs again) so Dynamo's
        # per-function recompile limit is not reached.  This clears every compiled function
        # in the process: the paper-scale experiments own theirs.
        torch._dynamo.reset()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="autosp.compile with sp_size=1")
            compiled, parameter_bytes = trace_fake_step(
                lambda: transformers.LlamaForCausalLM(model.hf_config(num_layers=layers)),
                seq_len=seq_len, sp_size=sp_size, vocab_size=model.vocab_size, **options,
            )
        graphs = compiled.report.aot_graphs
        workload = export_workload(
            graphs, name=f"{model.name}/{'autosp' if sp_size > 1 else 'single'}/L={layers}/S={seq_len}",
            sp_size=sp_size, parameter_bytes=parameter_bytes,
            optimizer_bytes_per_parameter_byte=ADAM_BYTES_PER_PARAMETER_BYTE, zero_shards=zero_shards,
        )
        modules = module_parameters(graphs, compiled.report.forward_graphs[-1]) if sp_size == 1 else ()
        return TracedStep(workload=workload, modules=modules)

    return make() if cache is None else cache.get(key, make)


def _simulate_layers(model: PaperModel, seq_len: int, layers: int, sp_size: int, cluster: Cluster, zero_shards: int,
                     autosp_options: dict | None = None, cache: TraceCache | None = None):
    workload = trace_workload(model, seq_len, layers, sp_size=sp_size, zero_shards=zero_shards,
                              autosp_options=autosp_options, cache=cache).workload
    time_s, dynamic_bytes = simulate_dynamic(workload, cluster)
    return time_s, dynamic_bytes, workload


def simulate_dynamic(workload: Workload, cluster: Cluster) -> tuple[float, int]:
    """Step time and peak memory above static memory (the busiest simulated rank) of one workload."""
    result = simulate(workload, cluster)
    return result.step_time_s, max(r.peak_memory_bytes - r.static_memory_bytes for r in result.ranks)


def extrapolate_layers(model_name: str, seq_len: int, per_layers: Callable[[int], tuple[float, int]], *,
                       static_bytes: int, sp_size: int, cluster: Cluster) -> SimulatedStep:
    """The full model's step from ``per_layers(L)`` = (step time, dynamic memory) of L = 1 and 2 layers (see
    Note [Layer extrapolation]) and the full model's static memory."""
    (t1, m1), (t2, m2) = per_layers(1), per_layers(2)
    layers = PAPER_MODELS[model_name].num_layers
    dynamic = m1 + (layers - 1) * (m2 - m1)
    return SimulatedStep(
        model=model_name, seq_len=seq_len, sp_size=sp_size, step_time_s=t1 + (layers - 1) * (t2 - t1),
        peak_memory_bytes=int(static_bytes + dynamic), static_memory_bytes=int(static_bytes),
        capacity_bytes=int(cluster.device.memory_bytes),
    )


def simulate_autosp_step(model_name: str, seq_len: int, *, sp_size: int = 8, cluster: Cluster | None = None,
                         zero_shards: int = 8, autosp_options: dict | None = None,
                         cache: TraceCache | None = None) -> SimulatedStep:
    """One AutoSP training step of a paper model, simulated with layer extrapolation (see the Note).

    ``autosp_options`` are `autosp.compile` options (default: its defaults, SAC and overlap on)."""
    model = PAPER_MODELS[model_name]
    cluster = cluster or Cluster.from_preset("a100-80gb-sxm")
    parameter_bytes = model.parameter_count() * BF16_BYTES
    static = parameter_bytes + (parameter_bytes + int(parameter_bytes * ADAM_BYTES_PER_PARAMETER_BYTE)) // zero_shards
    return extrapolate_layers(
        model_name, seq_len,
        lambda layers: _simulate_layers(model, seq_len, layers, sp_size, cluster, zero_shards, autosp_options,
                                        cache)[:2],
        static_bytes=static, sp_size=sp_size, cluster=cluster)


@dataclass(frozen=True)
class MaxSeqLen:
    """Outcome of `max_trainable_seq_len` (the shape of `simulator.search.SearchResult`)."""

    max_seq_len: int
    """Longest fitting multiple of the granularity (0: not even the shortest fits)."""
    hit_upper_bound: bool
    """True when the ceiling itself fits: the real maximum may be larger."""
    upper_bound: int
    """The search's ceiling (tokens)."""

    def __str__(self) -> str:
        return f"≥ {self.max_seq_len}" if self.hit_upper_bound else str(self.max_seq_len)


def max_trainable_seq_len(model_name: str, *, sp_size: int = 8, granularity: int = 1024, low: int = 1024,
                          high: int = 262144, **kwargs) -> MaxSeqLen:
    """Longest multiple of ``granularity`` tokens up to ``high`` whose simulated AutoSP step fits in device
    memory, by bisection, and whether the ceiling itself fits."""
    lo, hi = max(1, low // granularity), high // granularity
    ceiling = hi
    if not simulate_autosp_step(model_name, lo * granularity, sp_size=sp_size, **kwargs).fits:
        return MaxSeqLen(0, False, ceiling * granularity)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if simulate_autosp_step(model_name, mid * granularity, sp_size=sp_size, **kwargs).fits:
            lo = mid
        else:
            hi = mid - 1
    return MaxSeqLen(lo * granularity, lo == ceiling, ceiling * granularity)
