"""Pure cost functions: roofline time of a compute op and alpha-beta time of each collective.

Nothing here holds state or touches SimPy; every function is a formula with its source in the docstring, tested
from tables of cases. Conventions: ``message_bytes`` is the per-rank *input* size (as in
:class:`~simulator.workload.Collective`), ``world`` the number of ranks in the group, ``latency_s`` the alpha of
one algorithm step and ``bandwidth_bytes_per_s`` the per-direction bandwidth of each rank's bottleneck link
(1/beta). Links are full duplex, so in ring and pairwise algorithms every rank sends and receives concurrently.

The topology-aware engine (:mod:`simulator.collectives`) uses the same algorithms through
:func:`traffic_pattern` (which bytes go from which rank to which, per message byte) and :func:`algorithm_steps`;
on a uniform single-switch topology it reproduces these closed forms exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from simulator.hardware import DeviceSpec

COLLECTIVE_FORMULAS = ("all_to_all", "all_reduce", "all_gather", "reduce_scatter", "send", "recv", "broadcast")


def roofline_time_s(*, flops: float, bytes_moved: float, peak_flops_per_s: float,
                    memory_bandwidth_bytes_per_s: float, flops_efficiency: float = 1.0,
                    memory_efficiency: float = 1.0, launch_overhead_s: float = 0.0,
                    attention_scores: float = 0.0, attention_score_time_s: float = 0.0,
                    view_overhead_s: float = 0.0) -> float:
    """Roofline time of one kernel: ``max(flops / (peak * eff_f), bytes / (bw * eff_m)) + launch``.

    Williams, Waterman & Patterson, "Roofline: an insightful visual performance model for multicore
    architectures", CACM 52(4), 2009: a kernel is bound by whichever of compute or memory traffic takes longer.
    A fused attention kernel also pays ``attention_scores * attention_score_time_s`` for its softmax (work per
    query-key pair that does not scale with the head dimension; Dao, "FlashAttention-2", 2023, sec. 3.1 counts
    these non-matmul FLOPs separately because they run far below the matmul peak). A kernel with no FLOPs and
    no bytes (a view) launches nothing: it costs ``view_overhead_s`` of host time (0 on GPUs).
    """
    if flops <= 0 and bytes_moved <= 0:
        return view_overhead_s
    compute_s = flops / (peak_flops_per_s * flops_efficiency)
    memory_s = bytes_moved / (memory_bandwidth_bytes_per_s * memory_efficiency)
    return max(compute_s, memory_s) + attention_scores * attention_score_time_s + launch_overhead_s


def compute_times_s(flops: Sequence[int], bytes_moved: Sequence[int], op_classes: Sequence[str],
                    device: DeviceSpec, attention_scores: Sequence[int] | None = None) -> np.ndarray:
    """Vectorised :func:`roofline_time_s` over many ops on ``device`` (efficiency chosen by op class)."""
    flops_a = np.asarray(flops, dtype=np.float64)
    bytes_a = np.asarray(bytes_moved, dtype=np.float64)
    classes = sorted(set(op_classes))
    index = {c: i for i, c in enumerate(classes)}
    cls = np.fromiter((index[c] for c in op_classes), dtype=np.int64, count=len(op_classes))
    eff_f = np.array([device.efficiency_for(c).flops for c in classes] or [1.0])[cls]
    eff_m = np.array([device.efficiency_for(c).memory for c in classes] or [1.0])[cls]
    times = np.maximum(flops_a / (device.peak_flops_per_s * eff_f),
                       bytes_a / (device.memory_bandwidth_bytes_per_s * eff_m))
    times += device.kernel_launch_overhead_s
    if attention_scores is not None and device.attention_score_time_s:
        times += np.asarray(attention_scores, dtype=np.float64) * device.attention_score_time_s
    times[(flops_a <= 0) & (bytes_a <= 0)] = device.view_op_overhead_s
    return times


def p2p_time_s(message_bytes: float, *, latency_s: float, bandwidth_bytes_per_s: float) -> float:
    """Point-to-point send/recv: ``alpha + n * beta``.

    Hockney, "The communication challenge for MPP: Intel Paragon and Meiko CS-2", Parallel Computing 20, 1994.
    """
    return latency_s + message_bytes / bandwidth_bytes_per_s


def all_to_all_time_s(message_bytes: float, world: int, *, latency_s: float, bandwidth_bytes_per_s: float) -> float:
    """Pairwise-exchange all-to-all: ``(p-1) * alpha + (p-1)/p * n * beta``.

    Thakur, Rabenseifner & Gropp, "Optimization of collective communication operations in MPICH", IJHPCA 19(1),
    2005, sec. 4.5 (long messages): p-1 steps, each sending one n/p block. NCCL tests' PERFORMANCE.md gives the
    same bus-bandwidth factor (p-1)/p.
    """
    if world <= 1:
        return 0.0
    return (world - 1) * latency_s + (world - 1) / world * message_bytes / bandwidth_bytes_per_s


def all_reduce_time_s(message_bytes: float, world: int, *, latency_s: float, bandwidth_bytes_per_s: float) -> float:
    """Ring all-reduce (reduce-scatter then all-gather): ``2(p-1) * alpha + 2(p-1)/p * n * beta``.

    Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC 69(2), 2009;
    Thakur et al. 2005, sec. 4.4. NCCL tests' PERFORMANCE.md: busbw = algbw * 2(p-1)/p. The reduction
    arithmetic is assumed hidden behind the transfer.
    """
    if world <= 1:
        return 0.0
    return 2 * (world - 1) * latency_s + 2 * (world - 1) / world * message_bytes / bandwidth_bytes_per_s


def all_gather_time_s(message_bytes: float, world: int, *, latency_s: float, bandwidth_bytes_per_s: float) -> float:
    """Ring all-gather of a per-rank shard of ``n`` bytes: ``(p-1) * alpha + (p-1) * n * beta``.

    Chan, Heimlich, Purkayastha & van de Geijn, "Collective communication: theory, practice, and experience",
    CCPE 19(13), 2007 (bucket/ring algorithm, total gathered size p*n: (p-1)/p * p*n * beta); Thakur et al. 2005
    sec. 4.1. NCCL tests: busbw = algbw * (p-1)/p with algbw measured on the gathered size.
    """
    if world <= 1:
        return 0.0
    return (world - 1) * latency_s + (world - 1) * message_bytes / bandwidth_bytes_per_s


def reduce_scatter_time_s(message_bytes: float, world: int, *, latency_s: float,
                          bandwidth_bytes_per_s: float) -> float:
    """Ring reduce-scatter of an ``n``-byte buffer: ``(p-1) * alpha + (p-1)/p * n * beta``.

    Chan et al. 2007 (bucket algorithm); Thakur et al. 2005 sec. 4.3 (pairwise/ring for long messages).
    NCCL tests: busbw = algbw * (p-1)/p.
    """
    if world <= 1:
        return 0.0
    return (world - 1) * latency_s + (world - 1) / world * message_bytes / bandwidth_bytes_per_s


def broadcast_time_s(message_bytes: float, world: int, *, latency_s: float, bandwidth_bytes_per_s: float) -> float:
    """Pipelined chain (ring) broadcast, in the large-message limit: ``(p-1) * alpha + n * beta``.

    Chan et al. 2007 (pipelined broadcast: fill the chain of p-1 hops, then stream n bytes); this is the
    algorithm NCCL uses, and NCCL tests' PERFORMANCE.md gives broadcast a bus-bandwidth factor of 1.
    """
    if world <= 1:
        return 0.0
    return (world - 1) * latency_s + message_bytes / bandwidth_bytes_per_s


_FORMULAS = {
    "all_to_all": all_to_all_time_s,
    "all_reduce": all_reduce_time_s,
    "all_gather": all_gather_time_s,
    "reduce_scatter": reduce_scatter_time_s,
    "broadcast": broadcast_time_s,
}


def collective_time_s(kind: str, message_bytes: float, world: int, *, latency_s: float,
                      bandwidth_bytes_per_s: float) -> float:
    """Dispatch to the formula of ``kind`` (``send``/``recv`` use :func:`p2p_time_s`)."""
    if kind in ("send", "recv"):
        return p2p_time_s(message_bytes, latency_s=latency_s, bandwidth_bytes_per_s=bandwidth_bytes_per_s)
    try:
        formula = _FORMULAS[kind]
    except KeyError:
        raise ValueError(f"unknown collective kind {kind!r}; choose one of {COLLECTIVE_FORMULAS}") from None
    return formula(message_bytes, world, latency_s=latency_s, bandwidth_bytes_per_s=bandwidth_bytes_per_s)


def bus_bandwidth_factor(kind: str, world: int) -> float:
    """NCCL tests' bus-bandwidth factor (busbw = algbw * factor; NVIDIA nccl-tests, doc/PERFORMANCE.md).

    For all-gather the algbw is taken over the gathered (output) size, as nccl-tests does.
    """
    p = world
    factors = {"all_reduce": 2 * (p - 1) / p, "all_gather": (p - 1) / p, "reduce_scatter": (p - 1) / p,
               "all_to_all": (p - 1) / p, "broadcast": 1.0, "send": 1.0, "recv": 1.0}
    if kind not in factors:
        raise ValueError(f"unknown collective kind {kind!r}; choose one of {COLLECTIVE_FORMULAS}")
    return factors[kind]


def algorithm_steps(kind: str, world: int) -> int:
    """Number of sequential latency (alpha) steps of the algorithm used for ``kind``."""
    if world <= 1:
        return 0
    if kind in ("send", "recv"):
        return 1
    return 2 * (world - 1) if kind == "all_reduce" else world - 1


def output_bytes(kind: str, message_bytes: int, world: int) -> int:
    """Per-rank output size of a collective whose per-rank input is ``message_bytes``."""
    if kind == "all_gather":
        return message_bytes * world
    if kind == "reduce_scatter":
        return message_bytes // world
    if kind == "send":
        return 0
    return message_bytes


def traffic_pattern(kind: str, members: Sequence[int], *, root: int | None = None) -> list[tuple[int, int, float]]:
    """``(src, dst, bytes per message byte)`` flows of the algorithm used for ``kind`` among ``members``.

    Ring algorithms use the ring ``members[0] -> members[1] -> ... -> members[0]``; all-to-all sends ``1/p`` of
    the buffer to every other member (Thakur et al. 2005); broadcast streams the whole buffer down the chain that
    starts at ``root`` (default ``members[0]``) and follows the ring. For ``send``/``recv`` pass
    ``members=(sender, receiver)``. On a uniform topology the busiest rank sends exactly the bus-bandwidth
    factor of :func:`bus_bandwidth_factor` (times ``p`` for all-gather, whose factor is per output byte).
    """
    p = len(members)
    if p <= 1:
        return []
    if kind == "all_to_all":
        return [(a, b, 1.0 / p) for a in members for b in members if a != b]
    if kind in ("send", "recv"):
        return [(members[0], members[1], 1.0)]
    ring = list(members)
    if kind == "broadcast":
        start = ring.index(root) if root is not None else 0
        chain = ring[start:] + ring[:start]
        return [(chain[i], chain[i + 1], 1.0) for i in range(p - 1)]
    per_edge = {"all_reduce": 2 * (p - 1) / p, "all_gather": float(p - 1), "reduce_scatter": (p - 1) / p}
    if kind not in per_edge:
        raise ValueError(f"unknown collective kind {kind!r}; choose one of {COLLECTIVE_FORMULAS}")
    return [(ring[i], ring[(i + 1) % p], per_edge[kind]) for i in range(p)]
