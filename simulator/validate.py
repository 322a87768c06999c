"""Semantic validation of a :class:`~simulator.workload.Workload` before it is simulated.

The loader (:mod:`simulator.workload`) checks a document's field types and runs these checks on what it loads;
this module reads only the types (:mod:`simulator.workload_types`) and checks meaning: allowed enum values,
dependencies that point backwards, collectives whose group contains the rank, waits that match a start with the
same key, tensor lifetimes that are allocated once and freed once after allocation, and - across ranks - that
every member of a group instance issues each collective (otherwise the simulation would deadlock). Every failure raises
:class:`~simulator.workload.WorkloadError` naming the rank, the op and what to change. Standard library only.
"""

from __future__ import annotations

from simulator.workload_kinds import COLLECTIVE_KINDS, OP_CLASSES, OP_KINDS, PHASES, WorkloadError
from simulator.workload_types import Collective, RankProgram, WorkloadData

P2P_KINDS = ("send", "recv")


def validate_workload(workload: WorkloadData) -> None:
    """Raise :class:`WorkloadError` if ``workload`` cannot be simulated; return ``None`` otherwise."""
    world = workload.world_size
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise WorkloadError(f"workload.world_size must be a positive integer, got {world!r}")
    _validate_groups(workload)
    expected = {0} if workload.symmetric else set(range(world))
    if set(workload.ranks) != expected:
        hint = "give only rank 0's program" if workload.symmetric else f"give one program for each of ranks 0..{world - 1}"
        raise WorkloadError(f"workload.ranks has ranks {sorted(workload.ranks)}; {hint}")
    if workload.symmetric:
        _validate_program(workload.ranks[0], "rank 0", workload.groups)
        _validate_symmetric(workload)
        return
    checked: set[int] = set()
    issued: dict[int, dict[str, Collective]] = {}
    for rank in range(world):
        program = workload.program(rank)
        if id(program) not in checked:
            _validate_program(program, f"rank {rank}", workload.groups)
            checked.add(id(program))
        issued[rank] = _check_rank_collectives(workload, rank, program)
    _validate_matching(workload, issued)


def _validate_groups(workload: WorkloadData) -> None:
    for name, instances in workload.groups.items():
        seen: set[int] = set()
        for members in instances:
            if not members:
                raise WorkloadError(f"group {name!r} has an empty instance; remove it")
            for r in members:
                if not 0 <= r < workload.world_size:
                    raise WorkloadError(
                        f"group {name!r} names rank {r}, outside 0..{workload.world_size - 1}; fix the group "
                        "or raise world_size"
                    )
                if r in seen:
                    raise WorkloadError(f"group {name!r} lists rank {r} twice; instances of one group must be disjoint")
                seen.add(r)


def _where(where: str, op) -> str:
    return f"{where} op {op.id} ({op.name!r})"


class _Loc:
    """Formats as :func:`_where` only when an error message is built (validation is on the hot path)."""

    __slots__ = ("where", "op")

    def __init__(self, where: str, op) -> None:
        self.where, self.op = where, op

    def __format__(self, spec: str) -> str:
        return _where(self.where, self.op)


def _validate_program(program: RankProgram, where: str, groups) -> None:
    for tid, size in program.tensors.items():
        if size < 0:
            raise WorkloadError(f"{where}: tensor {tid} has negative size {size}")
    unknown = sorted(program.host_tensors - program.tensors.keys())
    if unknown:
        raise WorkloadError(f"{where}: host_tensors names {unknown}, missing from the program's tensors; list each "
                            "host tensor's size in tensors")
    position: dict[int, int] = {}
    allocated_by: dict[int, int] = {}
    freed: set[int] = set()
    started: dict[str, Collective] = {}
    waited: set[str] = set()
    for pos, op in enumerate(program.ops):
        loc = _Loc(where, op)
        if op.id in position:
            raise WorkloadError(f"{loc}: duplicate op id; op ids must be unique within a rank")
        if op.kind not in OP_KINDS:
            raise WorkloadError(f"{loc}: kind {op.kind!r} is not one of {OP_KINDS}")
        if op.op_class not in OP_CLASSES:
            raise WorkloadError(f"{loc}: op_class {op.op_class!r} is not one of {OP_CLASSES}")
        if op.phase not in PHASES:
            raise WorkloadError(f"{loc}: phase {op.phase!r} is not one of {PHASES}")
        if min(op.flops, op.bytes_read, op.bytes_written, op.attention_scores) < 0:
            raise WorkloadError(f"{loc}: flops, bytes and attention_scores must be non-negative")
        if op.attention_scores and op.op_class != "attention":
            raise WorkloadError(f"{loc}: attention_scores is set on a {op.op_class!r} op; only attention ops have "
                                "scores")
        for dep in op.deps:
            if dep not in position:
                raise WorkloadError(
                    f"{loc}: depends on op {dep}, which is not an earlier op of this rank; list ops in a valid "
                    "execution order and make deps point backwards"
                )
        position[op.id] = pos
        _check_collective_fields(op, loc, started, waited, groups)
        for tid in op.allocates:
            if tid not in program.tensors:
                raise WorkloadError(f"{loc}: allocates tensor {tid}, which is missing from the program's tensors")
            if tid in allocated_by:
                raise WorkloadError(f"{loc}: tensor {tid} is already allocated by op {allocated_by[tid]}; "
                                    "give each allocation its own tensor id")
            allocated_by[tid] = op.id
        for tid in op.frees:
            if tid not in allocated_by:
                raise WorkloadError(f"{loc}: frees tensor {tid}, which no earlier op (or this op) allocates; add it "
                                    "to its producer's allocates, or count it in static_memory instead")
            if tid in freed:
                raise WorkloadError(f"{loc}: tensor {tid} is freed twice")
            freed.add(tid)


def _check_collective_fields(op, loc: _Loc, started: dict[str, Collective], waited: set[str], groups) -> None:
    coll = op.collective
    if op.kind == "compute":
        if coll is not None:
            raise WorkloadError(f"{loc}: a compute op must not carry a collective; use kind 'collective_start'")
        return
    if coll is None:
        raise WorkloadError(f"{loc}: kind {op.kind!r} needs a collective description")
    if coll.kind not in COLLECTIVE_KINDS:
        raise WorkloadError(f"{loc}: collective kind {coll.kind!r} is not one of {COLLECTIVE_KINDS}")
    if coll.group not in groups:
        raise WorkloadError(f"{loc}: group {coll.group!r} is not in workload.groups ({sorted(groups)}); add it")
    if coll.message_bytes < 0:
        raise WorkloadError(f"{loc}: collective message_bytes must be non-negative")
    if coll.kind in P2P_KINDS and coll.peer is None:
        raise WorkloadError(f"{loc}: a {coll.kind} needs a peer rank")
    if op.kind == "collective_wait":
        if coll.key not in started:
            raise WorkloadError(f"{loc}: waits for collective key {coll.key!r}, which no earlier collective_start issued")
        if started[coll.key] != coll:
            raise WorkloadError(f"{loc}: the collective of a wait must equal that of its start (key {coll.key!r})")
        if coll.key in waited:
            raise WorkloadError(f"{loc}: collective key {coll.key!r} is waited for twice")
        waited.add(coll.key)
        return
    if coll.key in started:
        raise WorkloadError(f"{loc}: collective key {coll.key!r} is issued twice; keys must be unique per rank")
    started[coll.key] = coll


def _check_rank_collectives(workload: WorkloadData, rank: int, program: RankProgram) -> dict[str, Collective]:
    """Check that each collective's group contains ``rank``; return the collectives this rank issues by key."""
    issued: dict[str, Collective] = {}
    for op in program.ops:
        if op.kind not in ("collective", "collective_start"):
            continue
        coll = op.collective
        loc = _Loc(f"rank {rank}", op)
        if coll.group not in workload.groups:
            raise WorkloadError(f"{loc}: group {coll.group!r} is not in workload.groups ({sorted(workload.groups)})")
        members = workload.group_instance(coll.group, rank)
        if coll.peer is not None and coll.peer not in members:
            raise WorkloadError(f"{loc}: peer rank {coll.peer} is not in this rank's instance of group {coll.group!r}")
        if coll.kind in P2P_KINDS and coll.peer == rank:
            raise WorkloadError(f"{loc}: a {coll.kind} cannot have the rank itself as peer")
        issued[coll.key] = coll
    return issued


def _validate_symmetric(workload: WorkloadData) -> None:
    """Every rank runs rank 0's program: each group it uses must cover every rank, and p2p is impossible."""
    used: dict[str, object] = {}
    for op in workload.ranks[0].ops:
        if op.kind in ("collective", "collective_start"):
            used.setdefault(op.collective.group, op)
            if op.collective.kind in P2P_KINDS:
                raise WorkloadError(
                    f"{_where('rank 0', op)}: a symmetric workload cannot contain {op.collective.kind} (every rank "
                    "would use the same peer); write one program per rank and set symmetric=False"
                )
    for group, op in used.items():
        if group not in workload.groups:
            raise WorkloadError(f"{_where('rank 0', op)}: group {group!r} is not in workload.groups")
        covered = {r for members in workload.groups[group] for r in members}
        missing = sorted(set(range(workload.world_size)) - covered)
        if missing:
            raise WorkloadError(
                f"symmetric workload: every rank runs collectives on group {group!r}, but ranks {missing} are in "
                "no instance of it; make its instances cover all ranks"
            )
    for op in workload.ranks[0].ops:
        coll = op.collective
        if op.kind != "collective_wait" and coll is not None and coll.peer is not None:
            if any(coll.peer not in members for members in workload.groups[coll.group]):
                raise WorkloadError(f"{_where('rank 0', op)}: root rank {coll.peer} is not in every instance of "
                                    f"group {coll.group!r}; a symmetric broadcast must leave peer unset (first member)")


def _validate_matching(workload: WorkloadData, issued: dict[int, dict[str, Collective]]) -> None:
    """Every member of a group instance must issue each collective; p2p sends need a matching recv."""
    for rank, colls in issued.items():
        for key, coll in colls.items():
            if coll.kind in P2P_KINDS:
                other = issued[coll.peer].get(key)
                want = "recv" if coll.kind == "send" else "send"
                if other is None or other.kind != want or other.peer != rank:
                    raise WorkloadError(
                        f"rank {rank} issues {coll.kind} {key!r} with peer {coll.peer}, but rank {coll.peer} issues "
                        f"no matching {want} with peer {rank} and the same key"
                    )
                continue
            for member in workload.group_instance(coll.group, rank):
                other = issued[member].get(key)
                if other is None:
                    raise WorkloadError(
                        f"rank {rank} issues collective {key!r} on group {coll.group!r} but member rank {member} "
                        "never does; every member of a group instance must issue each collective"
                    )
                if other.kind != coll.kind or other.group != coll.group:
                    raise WorkloadError(
                        f"collective {key!r}: rank {rank} issues {coll.kind} on {coll.group!r} but rank {member} "
                        f"issues {other.kind} on {other.group!r}"
                    )
