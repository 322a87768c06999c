"""Paper-scale baselines in the simulator: hand-written Ulysses, modelled as a variant of the AutoSP trace.

Note [Baselines as AutoSP variants]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The paper compares AutoSP on 8×A100-80GB with three hand-written baselines; the
simulator only needs a workload (graphs, tensors' lifetimes, collectives) for each.
One of them is close enough to a graph AutoSP itself produces to be traced that way:

- ``ulysses``: DeepSpeed-Ulysses computes exactly AutoSP's sequence-parallel graph
  (the same shards, the same all-to-alls around every attention) but is written by
  hand: no activation checkpointing, blocking all-to-alls.  Traced with
  ``checkpointing="none"`` and ``overlap_communication=False`` (where `autosp`
  has those options), sharded over 8 ranks; static memory as AutoSP's (bf16
  parameters on every rank, gradients and Adam state sharded over the 8 ranks).

Not modelled: ZeRO-3 (no sequence parallelism; ``autosp.compile`` with
``sp_size=1`` compiles without the pass, so there is no exported graph to simulate)
and ring attention (its peer-to-peer schedule, and the blocks its backward keeps,
have no counterpart among the AutoSP graphs).  Step time and
activation memory of a full model are extrapolated from one- and two-layer traces,
as for AutoSP (see Note [Layer extrapolation] in experiments.paper_scale), and the
longest sequence is found with the secant search of `experiments.measure.next_probe`
on the simulated peak memory (see Note [Memory-cap search]).
"""

from __future__ import annotations

import dataclasses
import logging

from experiments.measure import next_probe
from experiments.paper_scale import SimulatedStep, simulate_autosp_step
from simulator import Cluster

log = logging.getLogger(__name__)

SIMULATED_BASELINES = ("ulysses",)
"""Baselines this module simulates (names as in the published-figures table)."""


def _autosp_options(**wanted) -> dict:
    import autosp

    fields = {f.name for f in dataclasses.fields(autosp.AutoSPConfig)}
    return {k: v for k, v in wanted.items() if k in fields}


def simulate_baseline_step(system: str, model_name: str, seq_len: int, *, ranks: int = 8,
                           cluster: Cluster | None = None) -> SimulatedStep:
    """One training step of baseline ``system`` (see Note [Baselines as AutoSP variants])."""
    if system not in SIMULATED_BASELINES:
        raise ValueError(f"system {system!r} is not simulated at paper scale; choose one of {SIMULATED_BASELINES}")
    options = _autosp_options(checkpointing="none", overlap_communication=False)
    return simulate_autosp_step(model_name, seq_len, sp_size=ranks, cluster=cluster, zero_shards=ranks,
                                autosp_options=options)


def max_trainable_seq_len_baseline(system: str, model_name: str, *, granularity: int = 1024, start: int = 8192,
                                   max_len: int = 262144, max_probes: int = 6) -> tuple[int, bool]:
    """Longest multiple of ``granularity`` tokens whose simulated step fits (0: none), and whether the search
    converged (False: it stopped on ``max_probes`` and the length is a lower bound)."""
    capacity = None
    probes: list[tuple[int, int]] = []
    length = start
    while length is not None and len(probes) < max_probes:
        step = simulate_baseline_step(system, model_name, length)
        capacity = step.capacity_bytes
        probes.append((length, step.peak_memory_bytes))
        length = next_probe(probes, capacity, granularity=granularity, max_len=max_len)
    fit = max((s for s, p in probes if p <= capacity), default=0)
    log.info("%s %s: %d tokens fit (%d probes)", system, model_name, fit, len(probes))
    return fit, length is None
