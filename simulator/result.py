"""What a simulation returns: step time, per-stream busy time, exposed communication, memory peak and OOM.

:class:`Result` aggregates one :class:`RankResult` per rank (ranks that were collapsed onto a representative copy
its figures; see :mod:`simulator.symmetry`) and keeps the raw per-op :class:`RankTimeline` of every simulated rank
for traces and plots. ``to_dict()``/``to_json()`` give the JSON written as ``result.json`` by the CLI. Definitions:
*busy* time of a stream is the union of its active intervals (compute: kernels; comm: transfers from rendezvous
to completion); *exposed* communication is the time some transfer runs while the compute stream runs no kernel;
the *overlap fraction* is the share of communication time hidden behind compute.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from simulator.memory import MemoryReport
from simulator.schedule import BLOCKING, COMPUTE, COMPUTE_STREAM, START, WAIT, CompiledProgram


@dataclass(frozen=True, kw_only=True)
class OomEvent:
    """The first allocation that does not fit on a rank."""

    rank: int
    """Rank that runs out of memory."""
    op_id: int | None
    """Op whose allocation exceeds the capacity (``None``: static memory alone does not fit)."""
    op_name: str | None
    """That op's name."""
    time_s: float
    """Simulated time of the allocation."""
    bytes_needed: int
    """Total bytes the rank would hold right after the allocation."""
    capacity_bytes: int
    """Capacity of the pool."""
    pool: str = "device"
    """``device`` or ``host`` memory (Note [Host tensors] in :mod:`simulator.workload_types`)."""

    def message(self) -> str:
        """A one-line human explanation."""
        what = "static memory" if self.op_id is None else f"op {self.op_id} ({self.op_name!r})"
        return (f"rank {self.rank} runs out of {'host ' if self.pool == 'host' else ''}memory at {what}: needs "
                f"{self.bytes_needed / 2**30:.2f} GiB, capacity {self.capacity_bytes / 2**30:.2f} GiB")


@dataclass(frozen=True, kw_only=True, eq=False)
class RankTimeline:
    """Raw per-op times of one simulated rank (arrays indexed by op position)."""

    rank: int
    """The simulated rank."""
    represents: tuple[int, ...]
    """Ranks whose timeline this is (itself included)."""
    compiled: CompiledProgram
    """The compiled program (ops, streams, kinds)."""
    begin_s: np.ndarray
    """When each op became active: kernel start, wait reached, collective issued."""
    end_s: np.ndarray
    """When each op completed."""
    transfer_start_s: np.ndarray
    """Collectives: when all members had issued it (NaN for other ops)."""
    stall_begin_s: np.ndarray
    """Blocking collectives: when the compute stream reached it (NaN for other ops)."""
    memory: MemoryReport
    """Device memory over time."""
    host_memory: MemoryReport | None = None
    """Host memory over time (the program's host tensors); None when it has none."""


@dataclass(frozen=True, kw_only=True)
class RankResult:
    """Summary figures of one rank."""

    rank: int
    """The rank."""
    represented_by: int
    """Simulated rank whose timeline this rank shares (itself when simulated)."""
    end_time_s: float
    """When this rank's last op completed."""
    compute_busy_s: float
    """Time the compute stream ran kernels."""
    compute_stall_s: float
    """Time the compute stream stood in collective waits and blocking collectives."""
    stream_busy_s: dict[str, float]
    """Stream name (``compute``, ``comm:<group>``) -> busy time."""
    comm_time_s: float
    """Union of all transfer intervals."""
    comm_wait_for_peers_s: float
    """Time collectives were issued but waited for other members (summed over comm streams)."""
    exposed_comm_s: float
    """Transfer time not overlapped by compute kernels."""
    overlap_fraction: float | None
    """``1 - exposed / comm``; ``None`` when the rank communicates nothing."""
    phase_compute_s: dict[str, float]
    """Compute-kernel time by phase (forward/backward/optimizer)."""
    static_memory_bytes: int
    """Parameters, gradients, optimizer state and other static bytes."""
    peak_memory_bytes: int
    """Peak of static plus live tensor bytes."""
    peak_memory_time_s: float
    """When the peak is first reached."""
    memory_capacity_bytes: int
    """Device memory capacity."""
    oom: OomEvent | None
    """First allocation that does not fit in device memory, if any."""
    host_peak_memory_bytes: int = 0
    """Peak of live host tensors (Note [Host tensors] in :mod:`simulator.workload_types`)."""
    host_memory_capacity_bytes: int | None = None
    """Host memory per rank (``Cluster.host_memory_per_rank_bytes``; None: unknown, never an OOM)."""
    host_oom: OomEvent | None = None
    """First allocation that does not fit in host memory, if any."""


@dataclass(frozen=True, kw_only=True)
class Result:
    """Outcome of :func:`simulator.simulate`."""

    workload_name: str
    """:attr:`Workload.name`."""
    cluster: dict[str, Any]
    """:meth:`Cluster.describe` of the cluster simulated on."""
    world_size: int
    """Number of ranks."""
    step_time_s: float
    """Time from step start until the last op of any rank completes."""
    ranks: tuple[RankResult, ...]
    """One entry per rank, by rank."""
    simulated_ranks: tuple[int, ...]
    """Ranks actually simulated (representatives when collapsed)."""
    collapsed: bool
    """Whether symmetric ranks were collapsed."""
    note: str
    """How the simulated ranks were chosen."""
    simulation_wall_s: float = 0.0
    """Host wall-clock seconds the simulation took (not deterministic; excluded from equality)."""
    timelines: dict[int, RankTimeline] = field(default_factory=dict, repr=False, compare=False)
    """Simulated rank -> raw per-op timeline."""

    @property
    def oom(self) -> OomEvent | None:
        """The earliest OOM, device or host, over all ranks (ties: lowest rank), or ``None``."""
        events = [e for r in self.ranks for e in (r.oom, r.host_oom) if e is not None]
        return min(events, key=lambda e: (e.time_s, e.rank)) if events else None

    @property
    def fits(self) -> bool:
        """No rank runs out of memory."""
        return self.oom is None

    @property
    def peak_memory_bytes(self) -> int:
        """Largest peak over ranks."""
        return max(r.peak_memory_bytes for r in self.ranks)

    @property
    def activation_peak_bytes(self) -> int:
        """Largest peak above static memory over ranks: the simulated activations (what
        `simulator.max_length.ledger_peak` puts under the memory ledger)."""
        return max(r.peak_memory_bytes - r.static_memory_bytes for r in self.ranks)

    @property
    def host_peak_memory_bytes(self) -> int:
        """Largest host-memory peak over ranks (0 without host tensors)."""
        return max(r.host_peak_memory_bytes for r in self.ranks)

    @property
    def exposed_comm_s(self) -> float:
        """Largest exposed communication time over ranks."""
        return max(r.exposed_comm_s for r in self.ranks)

    @property
    def overlap_fraction(self) -> float | None:
        """Share of all ranks' communication time hidden behind compute (``None`` without communication)."""
        comm = sum(r.comm_time_s for r in self.ranks)
        return None if comm <= 0 else 1.0 - sum(r.exposed_comm_s for r in self.ranks) / comm

    def to_dict(self, *, include_ops: bool = False) -> dict[str, Any]:
        """JSON-friendly summary; ``include_ops`` adds every simulated op's times."""
        oom = self.oom
        out: dict[str, Any] = {
            "workload": self.workload_name,
            "cluster": self.cluster,
            "world_size": self.world_size,
            "step_time_s": self.step_time_s,
            "fits": oom is None,
            "oom": None if oom is None else {**oom.__dict__, "message": oom.message()},
            "peak_memory_bytes": self.peak_memory_bytes,
            "host_peak_memory_bytes": self.host_peak_memory_bytes,
            "exposed_comm_s": self.exposed_comm_s,
            "overlap_fraction": self.overlap_fraction,
            "collapsed": self.collapsed,
            "simulated_ranks": list(self.simulated_ranks),
            "note": self.note,
            "simulation_wall_s": self.simulation_wall_s,
            "ranks": [{**r.__dict__, "oom": None if r.oom is None else r.oom.__dict__,
                       "host_oom": None if r.host_oom is None else r.host_oom.__dict__} for r in self.ranks],
        }
        if include_ops:
            out["ops"] = {str(rank): _ops_dict(tl) for rank, tl in self.timelines.items()}
        return out

    def to_json(self, path: str | os.PathLike[str], *, include_ops: bool = False) -> None:
        """Write :meth:`to_dict` to ``path``."""
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(include_ops=include_ops), fh, indent=1)


def _ops_dict(tl: RankTimeline) -> list[dict[str, Any]]:
    def num(x: float) -> float | None:
        return None if np.isnan(x) else float(x)

    return [{"id": op.id, "name": op.name, "stream": tl.compiled.stream_of[i], "begin_s": float(tl.begin_s[i]),
             "end_s": float(tl.end_s[i]), "transfer_start_s": num(tl.transfer_start_s[i])}
            for i, op in enumerate(tl.compiled.program.ops)]


def merge_intervals(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of intervals ``[starts[i], ends[i]]`` as sorted disjoint intervals (touching ones merge)."""
    keep = ends > starts
    starts, ends = starts[keep], ends[keep]
    if len(starts) == 0:
        return starts, ends
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], np.maximum.accumulate(ends[order])
    breaks = s[1:] > e[:-1]
    return s[np.concatenate([[True], breaks])], e[np.concatenate([breaks, [True]])]


def intersection_length(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> float:
    """Total length of the intersection of two merged interval sets."""
    (a_s, a_e), (b_s, b_e) = a, b
    i = j = 0
    total = 0.0
    while i < len(a_s) and j < len(b_s):
        lo, hi = max(a_s[i], b_s[j]), min(a_e[i], b_e[j])
        if hi > lo:
            total += hi - lo
        if a_e[i] < b_e[j]:
            i += 1
        else:
            j += 1
    return float(total)


def _length(iv: tuple[np.ndarray, np.ndarray]) -> float:
    return float(np.sum(iv[1] - iv[0]))


def summarize_timeline(tl: RankTimeline, *, rank: int, capacity_bytes: int, oom: OomEvent | None,
                       host_capacity_bytes: int | None = None, host_oom: OomEvent | None = None) -> RankResult:
    """Figures of ``rank`` from the timeline of the rank that represents it."""
    cp = tl.compiled
    kinds = np.asarray(cp.kinds)
    begin, end = tl.begin_s, tl.end_s
    is_compute = kinds == COMPUTE
    compute_iv = merge_intervals(begin[is_compute], end[is_compute])
    stall = float(np.sum((end - begin)[kinds == WAIT]))
    blocking = kinds == BLOCKING
    stall += float(np.sum((end - tl.stall_begin_s)[blocking]))
    is_coll = (kinds == START) | blocking
    streams = np.asarray(cp.stream_of)
    stream_busy = {COMPUTE_STREAM: _length(compute_iv)}
    for name in sorted(set(streams[is_coll].tolist())):
        mask = is_coll & (streams == name)
        stream_busy[name] = _length(merge_intervals(tl.transfer_start_s[mask], end[mask]))
    comm_iv = merge_intervals(tl.transfer_start_s[is_coll], end[is_coll])
    comm = _length(comm_iv)
    exposed = max(0.0, comm - intersection_length(comm_iv, compute_iv))
    phases: dict[str, float] = {}
    durations = end - begin
    for pos in np.flatnonzero(is_compute):
        phase = cp.program.ops[pos].phase
        phases[phase] = phases.get(phase, 0.0) + float(durations[pos])
    return RankResult(
        rank=rank,
        represented_by=tl.rank,
        end_time_s=float(end.max(initial=0.0)),
        compute_busy_s=stream_busy[COMPUTE_STREAM],
        compute_stall_s=stall,
        stream_busy_s=stream_busy,
        comm_time_s=comm,
        comm_wait_for_peers_s=float(np.sum((tl.transfer_start_s - begin)[is_coll])),
        exposed_comm_s=exposed,
        overlap_fraction=None if comm <= 0 else 1.0 - exposed / comm,
        phase_compute_s=phases,
        static_memory_bytes=tl.memory.static_bytes,
        peak_memory_bytes=tl.memory.peak_bytes,
        peak_memory_time_s=tl.memory.peak_time_s,
        memory_capacity_bytes=int(capacity_bytes),
        oom=oom,
        host_peak_memory_bytes=0 if tl.host_memory is None else tl.host_memory.peak_bytes,
        host_memory_capacity_bytes=host_capacity_bytes,
        host_oom=host_oom,
    )
