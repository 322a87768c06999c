"""Paper-scale baselines in the simulator: hand-written Ulysses, ring attention and ZeRO-3, from real traces.

Note [Baselines as AutoSP variants]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The paper compares AutoSP on 8×A100-80GB with three hand-written baselines; the
simulator only needs a workload (graphs, tensors' lifetimes, collectives) for each.
Each is derived from a graph the real compiler produces for the same model:

- ``ulysses``: DeepSpeed-Ulysses computes exactly AutoSP's sequence-parallel graph
  (the same shards, the same all-to-alls around every attention) but is written by
  hand: no activation checkpointing, blocking all-to-alls.  Traced with
  ``checkpointing="none"`` and ``overlap_communication=False`` (where `autosp`
  has those options), sharded over 8 ranks; static memory as AutoSP's (bf16
  parameters on every rank, gradients and Adam state sharded over the 8 ranks).
- ``ulysses+ckpt``: hand-written Ulysses with per-layer activation checkpointing,
  as Ulysses is run for long sequences in practice.  Traced like ``ulysses`` but
  with ``checkpointing="full"``; see Note [Ulysses with per-layer checkpointing].
- ``ring_attention``: that same Ulysses trace, rewritten: no all-to-alls, each
  attention split into 8 chunks between peer-to-peer K,V (and dK,dV) transfers
  around the ring (see Note [Ring attention as a rewrite of the Ulysses trace] in
  experiments.paper_scale.workload_rewrites); static memory as Ulysses'.
- ``zero3``: the model compiled without sequence parallelism (``autosp.compile``
  with ``sp_size=1``, ``checkpointing="none"``: each rank trains on the full
  sequence), rewritten with ZeRO-3's per-module parameter all-gathers and gradient
  reduce-scatters over the 8 data-parallel ranks; parameters, gradients and Adam
  state all sharded 8 ways (see Note [ZeRO-3 as a rewrite of the single-device
  trace]).

Step time and activation memory of a full model are extrapolated from one- and
two-layer traces, as for AutoSP (see Note [Layer extrapolation] in
experiments.paper_scale.simulate), and the longest sequence is found with the secant search
of `experiments.cpu.memory_cap.next_probe` on the simulated peak memory (see Note
[Memory-cap search]).

Note [Ulysses with per-layer checkpointing]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A hand-written per-layer checkpoint (``torch.utils.checkpoint`` around each decoder
layer) keeps each layer's input and reruns the whole layer forward in backward,
its four all-to-alls included.  The closest program the real compiler emits is
AutoSP's ``checkpointing="full"`` on the Ulysses trace (blocking all-to-alls): it
recomputes every op in backward, attention included, except that collectives are
never recomputed and the tensors that cross layers (residual stream, rotary
tables) are kept.  So this model differs from the hand-written program in two
known directions: it keeps the four all-to-all outputs of every layer (q, k, v in
head-sharded layout and the attention output in sequence-sharded layout: about
(2 + 2·kv_heads/heads)× the layer input's bytes more per layer), which makes its
peak memory higher and its longest sequence shorter than the real baseline's; and it
does not resend those all-to-alls in backward, which makes its step faster than the
real baseline's (by four blocking all-to-alls per layer).  The CPU measurement
(``ulysses+ckpt`` in the measured-cpu and memory-cap tables) runs the real
per-layer checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from experiments.cpu.memory_cap import next_probe
from experiments.models import PAPER_MODELS
from experiments.paper_scale.simulate import (
    ADAM_BYTES_PER_PARAMETER_BYTE,
    BF16_BYTES,
    SimulatedStep,
    TraceCache,
    extrapolate_layers,
    simulate_autosp_step,
    simulate_dynamic,
    trace_workload,
)
from experiments.paper_scale.workload_rewrites import ring_attention_workload, zero3_workload
from simulator import Cluster

log = logging.getLogger(__name__)

SIMULATED_BASELINES = ("zero3", "ring_attention", "ulysses", "ulysses+ckpt")
"""Baselines this module simulates (names as in the published-figures table; ``ulysses+ckpt`` has no published figure)."""


def _autosp_options(**wanted) -> dict:
    import autosp

    fields = {f.name for f in dataclasses.fields(autosp.AutoSPConfig)}
    return {k: v for k, v in wanted.items() if k in fields}


def simulate_baseline_step(system: str, model_name: str, seq_len: int, *, ranks: int = 8,
                           cluster: Cluster | None = None, cache: TraceCache | None = None) -> SimulatedStep:
    """One training step of baseline ``system`` (see Note [Baselines as AutoSP variants])."""
    if system not in SIMULATED_BASELINES:
        raise ValueError(f"system {system!r} is not simulated at paper scale; choose one of {SIMULATED_BASELINES}")
    if system in ("ulysses", "ulysses+ckpt"):
        # See Note [Ulysses with per-layer checkpointing] for what "full" stands for.
        checkpointing = "full" if system == "ulysses+ckpt" else "none"
        options = _autosp_options(checkpointing=checkpointing, overlap_communication=False)
        return simulate_autosp_step(model_name, seq_len, sp_size=ranks, cluster=cluster, zero_shards=ranks,
                                    autosp_options=options, cache=cache)
    model = PAPER_MODELS[model_name]
    cluster = cluster or Cluster.from_preset("a100-80gb-sxm")
    parameter_bytes = model.parameter_count() * BF16_BYTES
    if system == "ring_attention":
        options = _autosp_options(checkpointing="none", overlap_communication=False)

        def per_layers(layers: int) -> tuple[float, int]:
            traced = trace_workload(model, seq_len, layers, sp_size=ranks, zero_shards=ranks, autosp_options=options,
                                    cache=cache)
            return simulate_dynamic(ring_attention_workload(traced.workload), cluster)

        static = parameter_bytes + int(parameter_bytes * (1 + ADAM_BYTES_PER_PARAMETER_BYTE)) // ranks
        return extrapolate_layers(model_name, seq_len, per_layers, static_bytes=static, sp_size=ranks,
                                  cluster=cluster)
    options = _autosp_options(checkpointing="none")

    def per_layers(layers: int) -> tuple[float, int]:
        traced = trace_workload(model, seq_len, layers, sp_size=1, zero_shards=1, autosp_options=options, cache=cache)
        return simulate_dynamic(zero3_workload(traced.workload, traced.modules, world_size=ranks), cluster)

    static = int(parameter_bytes * (2 + ADAM_BYTES_PER_PARAMETER_BYTE)) // ranks
    return extrapolate_layers(model_name, seq_len, per_layers, static_bytes=static, sp_size=1, cluster=cluster)


def search_max_seq_len(step: Callable[[int], SimulatedStep], *, granularity: int, start: int, max_len: int,
                       max_probes: int) -> tuple[int, bool, list[tuple[int, int]]]:
    """Longest multiple of ``granularity`` tokens whose simulated ``step(length)`` fits (0: none), whether the
    search converged (False: it stopped on ``max_probes`` and the length is a lower bound), and the probes
    [(length, peak bytes)].  The secant search of Note [Memory-cap search] runs on the memory above static
    memory (the same for every length), which activations make roughly proportional to the length, so the
    first probe's extrapolation already lands close.  Static memory over the capacity: nothing fits."""
    probes: list[tuple[int, int]] = []
    dynamic: list[tuple[int, int]] = []  # the search runs on memory above static: proportional to the length
    headroom = None
    length = max(granularity, start // granularity * granularity)
    while length is not None and len(probes) < max_probes:
        simulated = step(length)
        headroom = simulated.capacity_bytes - simulated.static_memory_bytes
        probes.append((length, simulated.peak_memory_bytes))
        dynamic.append((length, simulated.peak_memory_bytes - simulated.static_memory_bytes))
        length = next_probe(dynamic, headroom, granularity=granularity, max_len=max_len) if headroom > 0 else None
    fit = max((s for s, d in dynamic if d <= headroom), default=0)
    return fit, length is None, probes


def max_trainable_seq_len_baseline(system: str, model_name: str, *, granularity: int = 1024, start: int = 8192,
                                   max_len: int = 262144, max_probes: int = 6,
                                   cache: TraceCache | None = None) -> tuple[int, bool]:
    """Longest multiple of ``granularity`` tokens whose simulated step fits (0: none), and whether the search
    converged (False: it stopped on ``max_probes`` and the length is a lower bound)."""
    fit, converged, probes = search_max_seq_len(
        lambda length: simulate_baseline_step(system, model_name, length, cache=cache), granularity=granularity,
        start=start, max_len=max_len, max_probes=max_probes)
    log.info("%s %s: %d tokens fit (%d probes)", system, model_name, fit, len(probes))
    return fit, converged
