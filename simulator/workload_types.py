"""The workload's types: the plain-data collective schedule that the simulator consumes.

A workload is what ``autosp/export.py`` writes after compiling a model: for every rank an ordered program of
operations (:class:`Op`: compute kernels and collectives) with their FLOPs, bytes moved, dependencies and the
tensors they allocate and free, plus the process groups the collectives run on and each rank's static memory
(parameters, gradients, optimizer state). This module holds the types as plain data (:class:`WorkloadData`: the
fields of a whole step) and uses only the standard library. Their JSON form and the loader that checks a
document's fields (:class:`simulator.workload.Workload`, the class everyone builds and reads) live in
:mod:`simulator.workload`; the semantic checks across ops (dependencies, tensor lifetimes, matching collectives)
in :mod:`simulator.validate`, which reads these types and nothing of the loader.

Note [Host tensors]
~~~~~~~~~~~~~~~~~~
A program's tensors are in device memory unless :attr:`RankProgram.host_tensors` lists them (activation offload:
the copies ``autosp_testbed::offload_to_host`` makes). The simulator keeps one memory timeline per pool: the
device's (static memory plus device tensors, against the device's capacity) and the host's (host tensors only,
against ``Cluster.host_memory_per_rank_bytes``); each reports its peak and its first OOM. Moving a tensor is an
async copy (``collective_start`` of kind ``to_host``/``from_host`` on the rank's ``host`` group): the copy
allocates its destination when it is issued and frees its source when it completes (``frees`` of a start take
effect when its collective ends), and a ``collective_wait`` stalls the compute stream until it has.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from simulator.workload_kinds import WorkloadError

SCHEMA_VERSION = 2
"""2: :attr:`RankProgram.host_tensors` (activation offload); a version-1 document is refused like any other."""

HOST_GROUP = "host"
"""Process group of a rank's device<->host copies: one instance per rank, so one host-link stream per rank."""

RING_GROUPS = ("ring_send", "ring_recv")
"""The process groups a ring's point-to-point transfers run on, sends on the first and receives on the second:
two comm streams, so that a rank sends to its next neighbour while it receives from its previous one, as
``batch_isend_irecv`` does (on one stream every rank's send would wait for its own receive, and the ring deadlock).
Their instances are the ring's ranks; a ``send``'s ``peer`` is the next rank, a ``recv``'s the previous one."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Collective:
    """One collective (or point-to-point) operation as issued by one rank."""

    kind: str
    """One of :data:`COLLECTIVE_KINDS`."""
    group: str
    """Name of the process group (a key of :attr:`Workload.groups`); the rank's instance of that group is the
    member list that contains the rank."""
    message_bytes: int
    """Per-rank *input* size in bytes: the local shard for ``all_gather``, the full buffer for ``all_reduce``,
    ``reduce_scatter`` and ``all_to_all``, the payload for ``send``/``recv``/``broadcast``."""
    key: str
    """Identifies the collective: the same key links a ``collective_start`` to its ``collective_wait`` on one rank
    and the same collective across the member ranks. Unique per rank among issued collectives."""
    peer: int | None = None
    """``send``: destination rank; ``recv``: source rank; ``broadcast``: root rank (default: the group's first
    member). Unused otherwise."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Op:
    """One operation of a rank's program, in program (host issue) order."""

    id: int
    """Unique within the rank's program; referenced by :attr:`deps`."""
    name: str
    """Human-readable label (e.g. the FX node name); shown in traces and OOM reports."""
    kind: str
    """One of :data:`OP_KINDS`."""
    op_class: str = "other"
    """One of :data:`OP_CLASSES`; selects the roofline efficiency. Ignored for collective kinds."""
    phase: str = "forward"
    """One of :data:`PHASES`; used for per-phase time breakdowns."""
    flops: int = 0
    """Floating-point operations performed (a multiply-add counts 2)."""
    bytes_read: int = 0
    """Bytes read from device memory."""
    bytes_written: int = 0
    """Bytes written to device memory. An op with zero FLOPs and zero bytes is a view (it costs only
    :attr:`simulator.hardware.DeviceSpec.view_op_overhead_s`)."""
    attention_scores: int = 0
    """Attention ops only: query-key scores whose softmax the kernel evaluates (B·H·Sq·Sk, halved under causal
    masking; the backward counts 2.5x, as its FLOPs do: it recomputes the probabilities and forms their
    gradient). Priced by :attr:`simulator.hardware.DeviceSpec.attention_score_time_s`; 0 elsewhere."""
    deps: tuple[int, ...] = ()
    """Ids of earlier ops on the same rank that must finish before this op starts (a collective "finishes" when
    the whole collective completes, so depending on a ``collective_start`` waits for its result). Program order
    implies nothing beyond stream order: compute ops and waits run in program order on the compute stream,
    collectives of one group run in program order on that group's comm stream, and any cross-stream ordering
    (e.g. a ``collective_start`` on the compute op producing its input) must be listed here. A blocking
    ``collective`` is issued only when the compute stream reaches it."""
    allocates: tuple[int, ...] = ()
    """Tensor ids allocated when this op starts (its outputs and workspaces)."""
    frees: tuple[int, ...] = ()
    """Tensor ids freed when this op ends (after their last use; saved activations are freed in backward). A
    ``collective_start`` ends when its collective completes."""
    collective: Collective | None = None
    """Required for the collective kinds, ``None`` for ``compute``. A ``collective_wait`` carries the same
    :class:`Collective` as its ``collective_start``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StaticMemory:
    """Bytes resident on a rank for the whole step (not tracked per tensor)."""

    parameter_bytes: int = 0
    """Model parameters held by this rank (after any sharding)."""
    gradient_bytes: int = 0
    """Gradient buffers held by this rank."""
    optimizer_bytes: int = 0
    """Optimizer state (e.g. Adam moments, fp32 master weights) held by this rank."""
    other_bytes: int = 0
    """Anything else resident: communication buffers, allocator reserve, CUDA context, input batch."""

    @property
    def total_bytes(self) -> int:
        """Sum of all static components."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes + self.other_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class RankProgram:
    """The program one rank executes in one training step."""

    ops: tuple[Op, ...]
    """Operations in program (host issue) order; a valid execution order (deps point backwards)."""
    tensors: Mapping[int, int] = field(default_factory=dict)
    """Tensor id -> size in bytes, for every tensor named in an op's ``allocates``/``frees``."""
    static_memory: StaticMemory = field(default_factory=StaticMemory)
    """Memory resident for the whole step."""
    host_tensors: frozenset[int] = frozenset()
    """Ids of :attr:`tensors` that live in the host's memory, not the device's (Note [Host tensors])."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "host_tensors", frozenset(self.host_tensors))


@dataclass(frozen=True, kw_only=True)
class WorkloadData:
    """A whole training step: every rank's program plus the process groups (the fields of
    :class:`simulator.workload.Workload`, which adds their JSON form)."""

    name: str
    """Label for reports (e.g. ``"llama-3.1-8b/autosp/S=65536"``)."""
    world_size: int
    """Number of ranks."""
    groups: Mapping[str, tuple[tuple[int, ...], ...]]
    """Group name -> its instances, each an ordered tuple of ranks; the instances of one name are disjoint
    (like one dimension of a device mesh: ``{"sp": ((0, 1, 2, 3), (4, 5, 6, 7))}``). A single flat list of ranks
    is accepted and read as one instance."""
    ranks: Mapping[int, RankProgram]
    """Rank -> program. When :attr:`symmetric`, only rank 0 is given and every rank runs it."""
    symmetric: bool = False
    """All ranks run the program of rank 0 (which then is the only entry of :attr:`ranks`)."""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """Free-form JSON-serialisable provenance (model, sequence length, SP degree, exporter version...)."""
    version: int = SCHEMA_VERSION
    """Schema version; must equal :data:`SCHEMA_VERSION`."""

    def __post_init__(self) -> None:
        groups = {str(name): _normalise_instances(name, members) for name, members in dict(self.groups).items()}
        object.__setattr__(self, "groups", groups)
        object.__setattr__(self, "ranks", {int(r): p for r, p in dict(self.ranks).items()})

    def program(self, rank: int) -> RankProgram:
        """The program run by ``rank`` (rank 0's for a symmetric workload)."""
        if self.symmetric:
            return self.ranks[0]
        return self.ranks[rank]

    def group_instance(self, group: str, rank: int) -> tuple[int, ...]:
        """The instance of ``group`` that contains ``rank``."""
        for members in self.groups.get(group, ()):
            if rank in members:
                return members
        raise WorkloadError(f"rank {rank} is in no instance of group {group!r}; add it to workload.groups[{group!r}]")


def _normalise_instances(name: object, members: object) -> tuple[tuple[int, ...], ...]:
    if not isinstance(members, (list, tuple)) or not members:
        raise WorkloadError(f"group {name!r} must be a non-empty list of ranks or a list of rank lists")
    if all(isinstance(m, (list, tuple)) for m in members):
        return tuple(tuple(checked_int(r, f"group {name!r} member") for r in inst) for inst in members)
    if any(isinstance(m, (list, tuple)) for m in members):
        raise WorkloadError(f"group {name!r} mixes ranks and rank lists; give either one list or a list of lists")
    return (tuple(checked_int(r, f"group {name!r} member") for r in members),)


def checked_int(value: object, where: str) -> int:
    """``value`` when it is an integer (not a bool); else a :class:`WorkloadError` naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise WorkloadError(f"{where} must be an integer, got {value!r}")
    return value

