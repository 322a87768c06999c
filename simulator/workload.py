"""The workload schema: the plain-data collective schedule that the simulator consumes.

A :class:`Workload` is what ``autosp/export.py`` writes after compiling a model: for every rank an ordered
program of operations (compute kernels and collectives) with their FLOPs, bytes moved, dependencies and the
tensors they allocate and free, plus the process groups the collectives run on and each rank's static memory
(parameters, gradients, optimizer state). It uses only the standard library so that ``autosp`` can import it
without pulling in SimPy, and it round-trips through JSON (:meth:`Workload.to_json` / :meth:`Workload.from_json`).
The format is versioned by :data:`SCHEMA_VERSION`; loading a malformed or wrong-version document raises
:class:`WorkloadError`, a ``ValueError`` whose message names the offending field and what to change.
Semantic checks across ops (dependencies, tensor lifetimes, matching collectives) live in
:mod:`simulator.validate`.

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

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from simulator.sp_layout import (  # noqa: F401 - the sequence-parallel kinds and layout, re-exported for autosp
    CHOSEN_STRATEGIES,
    COMPILED_STRATEGIES,
    MEMORY_PLANNED_STRATEGIES,
    ZIGZAG_STRATEGIES,
    SPKind,
    SPLayout,
    SPLayoutError,
)
from simulator.workload_kinds import (  # noqa: F401 - the schema's vocabulary, re-exported
    COLLECTIVE_KINDS,
    OP_CLASSES,
    OP_KINDS,
    PHASES,
    WorkloadError,
)

SCHEMA_VERSION = 2
"""2: :attr:`RankProgram.host_tensors` (activation offload); a version-1 document is refused like any other."""

HOST_GROUP = "host"
"""Process group of a rank's device<->host copies: one instance per rank, so one host-link stream per rank."""

RING_GROUPS = ("ring_send", "ring_recv")
"""The process groups a ring's point-to-point transfers run on, sends on the first and receives on the second:
two comm streams, so that a rank sends to its next neighbour while it receives from its previous one, as
``batch_isend_irecv`` does (on one stream every rank's send would wait for its own receive, and the ring deadlock).
Their instances are the ring's ranks; a ``send``'s ``peer`` is the next rank, a ``recv``'s the previous one."""

_T = TypeVar("_T")

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
class Workload:
    """A whole training step: every rank's program plus the process groups."""

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

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (inverse of :meth:`from_dict`)."""
        return {
            "version": self.version,
            "name": self.name,
            "world_size": self.world_size,
            "symmetric": self.symmetric,
            "groups": {name: [list(m) for m in inst] for name, inst in self.groups.items()},
            "ranks": {str(r): _program_to_dict(p) for r, p in sorted(self.ranks.items())},
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, validate: bool = True) -> Workload:
        """Build a workload from :meth:`to_dict` output; raises :class:`WorkloadError` when malformed."""
        if not isinstance(data, Mapping):
            raise WorkloadError(f"a workload document must be a JSON object, got {type(data).__name__}")
        version = data.get("version")
        if version != SCHEMA_VERSION:
            raise WorkloadError(
                f"workload schema version {version!r} is not supported (this simulator reads version "
                f"{SCHEMA_VERSION}); re-export the workload with a matching autosp/simulator"
            )
        _require(data, ("name", "world_size", "groups", "ranks"), "workload")
        ranks_doc = data["ranks"]
        if not isinstance(ranks_doc, Mapping):
            raise WorkloadError("workload.ranks must be an object mapping rank numbers to programs")
        ranks = _by_int_key(ranks_doc, "workload.ranks", "a rank number",
                            lambda key, prog: _program_from_dict(prog, f"ranks[{key}]"))
        groups = data["groups"]
        if not isinstance(groups, Mapping):
            raise WorkloadError("workload.groups must be an object mapping group names to rank lists")
        workload = cls(
            name=str(data["name"]),
            world_size=_int(data["world_size"], "workload.world_size"),
            groups=groups,
            ranks=ranks,
            symmetric=bool(data.get("symmetric", False)),
            metadata=dict(data.get("metadata") or {}),
            version=version,
        )
        if validate:
            from simulator.validate import validate_workload

            validate_workload(workload)
        return workload

    def to_json(self, path: str | os.PathLike[str]) -> None:
        """Write the workload as JSON to ``path``."""
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, separators=(",", ":"))

    @classmethod
    def from_json(cls, path: str | os.PathLike[str], *, validate: bool = True) -> Workload:
        """Read a workload written by :meth:`to_json`; raises :class:`WorkloadError` when malformed."""
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{os.fspath(path)} is not valid JSON ({exc}); pass a file written by "
                                "Workload.to_json") from None
        return cls.from_dict(data, validate=validate)


def _normalise_instances(name: object, members: object) -> tuple[tuple[int, ...], ...]:
    if not isinstance(members, (list, tuple)) or not members:
        raise WorkloadError(f"group {name!r} must be a non-empty list of ranks or a list of rank lists")
    if all(isinstance(m, (list, tuple)) for m in members):
        return tuple(tuple(_int(r, f"group {name!r} member") for r in inst) for inst in members)
    if any(isinstance(m, (list, tuple)) for m in members):
        raise WorkloadError(f"group {name!r} mixes ranks and rank lists; give either one list or a list of lists")
    return (tuple(_int(r, f"group {name!r} member") for r in members),)


def _require(data: Mapping[str, Any], keys: tuple[str, ...], where: str) -> None:
    missing = [k for k in keys if k not in data]
    if missing:
        raise WorkloadError(f"{where} is missing required field(s) {', '.join(missing)}")


def _by_int_key(doc: Mapping[str, Any], where: str, noun: str, read: Callable[[str, Any], _T]) -> dict[int, _T]:
    """``doc`` (a JSON object, so its keys are strings) keyed by its keys read as integers, each value ``read(key,
    value)``; a key that is no integer is refused as not ``noun``."""
    out = {}
    for key, value in doc.items():
        try:
            number = int(key)
        except (TypeError, ValueError):
            raise WorkloadError(f"{where} key {key!r} is not {noun}") from None
        out[number] = read(key, value)
    return out


def _int(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise WorkloadError(f"{where} must be an integer, got {value!r}")
    return value


def _int_tuple(value: object, where: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise WorkloadError(f"{where} must be a list of integers, got {value!r}")
    return tuple(_int(v, where) for v in value)


def _program_to_dict(program: RankProgram) -> dict[str, Any]:
    return {
        "static_memory": dataclasses.asdict(program.static_memory),
        "tensors": {str(t): b for t, b in program.tensors.items()},
        **({"host_tensors": sorted(program.host_tensors)} if program.host_tensors else {}),
        "ops": [_op_to_dict(op) for op in program.ops],
    }


def _op_to_dict(op: Op) -> dict[str, Any]:
    out: dict[str, Any] = {"id": op.id, "name": op.name, "kind": op.kind, "phase": op.phase}
    if op.kind == "compute" or op.op_class != "other":
        out["op_class"] = op.op_class
    if op.attention_scores:
        out["attention_scores"] = op.attention_scores
    for key in ("flops", "bytes_read", "bytes_written"):
        value = getattr(op, key)
        if value or op.kind == "compute":
            out[key] = value
    for key in ("deps", "allocates", "frees"):
        value = getattr(op, key)
        if value:
            out[key] = list(value)
    if op.collective is not None:
        coll = {f.name: getattr(op.collective, f.name) for f in dataclasses.fields(Collective)}
        if coll["peer"] is None:
            del coll["peer"]
        out["collective"] = coll
    return out


def _program_from_dict(data: object, where: str) -> RankProgram:
    if not isinstance(data, Mapping):
        raise WorkloadError(f"{where} must be an object with ops, tensors and static_memory")
    _require(data, ("ops",), where)
    static_doc = data.get("static_memory") or {}
    if not isinstance(static_doc, Mapping):
        raise WorkloadError(f"{where}.static_memory must be an object")
    known = {f.name for f in dataclasses.fields(StaticMemory)}
    unknown = set(static_doc) - known
    if unknown:
        raise WorkloadError(f"{where}.static_memory has unknown field(s) {sorted(unknown)}; allowed: {sorted(known)}")
    static = StaticMemory(**{k: _int(v, f"{where}.static_memory.{k}") for k, v in static_doc.items()})
    tensors_doc = data.get("tensors") or {}
    if not isinstance(tensors_doc, Mapping):
        raise WorkloadError(f"{where}.tensors must be an object mapping tensor ids to byte sizes")
    tensors = _by_int_key(tensors_doc, f"{where}.tensors", "an integer tensor id",
                          lambda key, size: _int(size, f"{where}.tensors[{key}]"))
    ops_doc = data["ops"]
    if not isinstance(ops_doc, list):
        raise WorkloadError(f"{where}.ops must be a list")
    ops = tuple(_op_from_dict(op, f"{where}.ops[{i}]") for i, op in enumerate(ops_doc))
    host = _int_tuple(data.get("host_tensors", ()), f"{where}.host_tensors")
    return RankProgram(ops=ops, tensors=tensors, static_memory=static, host_tensors=frozenset(host))


_OP_FIELDS = {f.name for f in dataclasses.fields(Op)}
_COLLECTIVE_FIELDS = {f.name for f in dataclasses.fields(Collective)}


def _op_from_dict(data: object, where: str) -> Op:
    if not isinstance(data, Mapping):
        raise WorkloadError(f"{where} must be an object")
    _require(data, ("id", "name", "kind"), where)
    unknown = set(data) - _OP_FIELDS
    if unknown:
        raise WorkloadError(f"{where} has unknown field(s) {sorted(unknown)}; allowed: {sorted(_OP_FIELDS)}")
    collective = None
    coll_doc = data.get("collective")
    if coll_doc is not None:
        if not isinstance(coll_doc, Mapping):
            raise WorkloadError(f"{where}.collective must be an object")
        _require(coll_doc, ("kind", "group", "message_bytes", "key"), f"{where}.collective")
        unknown = set(coll_doc) - _COLLECTIVE_FIELDS
        if unknown:
            raise WorkloadError(f"{where}.collective has unknown field(s) {sorted(unknown)}")
        peer = coll_doc.get("peer")
        collective = Collective(
            kind=str(coll_doc["kind"]),
            group=str(coll_doc["group"]),
            message_bytes=_int(coll_doc["message_bytes"], f"{where}.collective.message_bytes"),
            key=str(coll_doc["key"]),
            peer=None if peer is None else _int(peer, f"{where}.collective.peer"),
        )
    return Op(
        id=_int(data["id"], f"{where}.id"),
        name=str(data["name"]),
        kind=str(data["kind"]),
        op_class=str(data.get("op_class", "other")),
        phase=str(data.get("phase", "forward")),
        flops=_int(data.get("flops", 0), f"{where}.flops"),
        bytes_read=_int(data.get("bytes_read", 0), f"{where}.bytes_read"),
        bytes_written=_int(data.get("bytes_written", 0), f"{where}.bytes_written"),
        attention_scores=_int(data.get("attention_scores", 0), f"{where}.attention_scores"),
        deps=_int_tuple(data.get("deps", ()), f"{where}.deps"),
        allocates=_int_tuple(data.get("allocates", ()), f"{where}.allocates"),
        frees=_int_tuple(data.get("frees", ()), f"{where}.frees"),
        collective=collective,
    )
