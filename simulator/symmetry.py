"""Decide which ranks to simulate: collapse ranks that provably share a timeline into one representative.

See Note [Collapsing symmetric ranks]. :func:`plan_ranks` returns a :class:`RankPlan`: the simulated
(representative) ranks, which ranks each stands for, and a :meth:`RankPlan.route` that tells the engine, for a
collective issued by a representative, its rendezvous id, how many representatives must issue it and which
group instances the transfer covers.

Note [Collapsing symmetric ranks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Ranks running equal programs form a class; the lowest rank of a class represents it. Simulating only the
representatives is exact when every rank of a class would see the same timeline, which holds inductively if,
for every group a class uses, each of its ranks' instances (a) contains the same set of classes and (b) costs
the same in isolation on the topology. Then a collective that the real system runs on all instances of a group
at once is simulated as one rendezvous among the representatives of the classes involved, whose transfer loads
the links of *all* those instances (so bandwidth sharing between instances, e.g. DP groups crossing the same
NICs, is kept) and progresses at the pace of the slowest instance (equal to every instance's pace on a symmetric
topology, conservative otherwise). Point-to-point ops name absolute peers, which breaks the argument, so
workloads with send/recv are simulated rank by rank, as are workloads failing (a) or (b).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field

from simulator.collectives import CollectivePlanner
from simulator.validate import P2P_KINDS
from simulator.workload import Collective, Workload


@dataclass(frozen=True, kw_only=True)
class Route:
    """Where a collective issued by a simulated rank goes."""

    rendezvous: Hashable
    """Identifies the collective across the simulated ranks."""
    expected: int
    """How many simulated ranks issue it."""
    instances: tuple[tuple[int, ...], ...]
    """Group instances (or ``(sender, receiver)``) whose transfers it represents."""


@dataclass(frozen=True, kw_only=True)
class RankPlan:
    """Which ranks are simulated and how collectives connect them."""

    simulated: tuple[int, ...]
    """Representative ranks, ascending."""
    represents: dict[int, tuple[int, ...]]
    """Representative -> ranks it stands for (itself included)."""
    collapsed: bool
    """Whether any rank is not simulated."""
    note: str
    """Why the plan is what it is (for logs and results)."""
    _class_of: dict[int, int] = field(repr=False)
    _workload: Workload = field(repr=False)
    _routes: dict[tuple[int, str], tuple[Hashable, int, tuple[tuple[int, ...], ...]]] = field(
        default_factory=dict, repr=False)

    def route(self, rank: int, coll: Collective) -> Route:
        """The route of collective ``coll`` issued by simulated rank ``rank``."""
        if coll.kind in P2P_KINDS:
            pair = (rank, coll.peer) if coll.kind == "send" else (coll.peer, rank)
            return Route(rendezvous=("p2p", pair, coll.key), expected=2, instances=(pair,))
        cached = self._routes.get((rank, coll.group))
        if cached is None:
            cached = self._group_route(rank, coll.group)
            self._routes[(rank, coll.group)] = cached
        prefix, expected, instances = cached
        return Route(rendezvous=(prefix, coll.key), expected=expected, instances=instances)

    def _group_route(self, rank: int, group: str):
        instances = self._workload.groups[group]
        mine = self._workload.group_instance(group, rank)
        if not self.collapsed:
            return (group, instances.index(mine)), len(mine), (mine,)
        classes = _class_set(mine, self._class_of)
        covered = tuple(inst for inst in instances if _class_set(inst, self._class_of) == classes)
        return (group, classes), len(classes), covered


def _class_set(members: tuple[int, ...], class_of: dict[int, int]) -> tuple[int, ...]:
    return tuple(sorted({class_of[r] for r in members}))


def _rank_classes(workload: Workload) -> dict[int, int]:
    """Rank -> lowest rank running an equal program."""
    if workload.symmetric:
        return dict.fromkeys(range(workload.world_size), 0)
    reps: list[int] = []
    class_of: dict[int, int] = {}
    for rank in range(workload.world_size):
        program = workload.ranks[rank]
        for rep in reps:
            other = workload.ranks[rep]
            if other is program or other == program:
                class_of[rank] = rep
                break
        else:
            reps.append(rank)
            class_of[rank] = rank
    return class_of


def _full(workload: Workload, note: str, class_of: dict[int, int]) -> RankPlan:
    ranks = tuple(range(workload.world_size))
    return RankPlan(simulated=ranks, represents={r: (r,) for r in ranks}, collapsed=False, note=note,
                    _class_of=class_of, _workload=workload)


def plan_ranks(workload: Workload, planner: CollectivePlanner, *, collapse: bool = True) -> RankPlan:
    """Choose the simulated ranks for ``workload`` (all of them unless collapsing is valid and allowed)."""
    if not collapse:
        return _full(workload, "collapsing disabled by the caller", {})
    class_of = _rank_classes(workload)
    reps = sorted(set(class_of.values()))
    if len(reps) == workload.world_size:
        return _full(workload, "no two ranks run the same program", class_of)
    used: dict[int, dict[str, set[tuple[str, int | None]]]] = {}
    for rep in reps:
        groups: dict[str, set[tuple[str, int | None]]] = {}
        for op in workload.program(rep).ops:
            if op.kind in ("collective", "collective_start"):
                if op.collective.kind in P2P_KINDS:
                    return _full(workload, "point-to-point ops name absolute peers; simulating every rank", class_of)
                groups.setdefault(op.collective.group, set()).add((op.collective.kind, op.collective.peer))
        used[rep] = groups
    for rank in range(workload.world_size):
        rep = class_of[rank]
        for group, kinds in used[rep].items():
            mine = workload.group_instance(group, rank)
            theirs = workload.group_instance(group, rep)
            if _class_set(mine, class_of) != _class_set(theirs, class_of):
                return _full(workload, f"ranks {rep} and {rank} run the same program but their {group!r} instances "
                             "mix different programs; simulating every rank", class_of)
            for kind, root in kinds:
                a = planner.plan(kind, (mine,), root)
                b = planner.plan(kind, (theirs,), root)
                if not (math.isclose(a.latency_s, b.latency_s, rel_tol=1e-9)
                        and math.isclose(a.seconds_per_byte, b.seconds_per_byte, rel_tol=1e-9)):
                    return _full(workload, f"ranks {rep} and {rank} run the same program but their {group!r} "
                                 "instances cost differently on this topology; simulating every rank", class_of)
    represents = {rep: tuple(r for r in range(workload.world_size) if class_of[r] == rep) for rep in reps}
    note = (f"simulated {len(reps)} representative rank(s) for {workload.world_size} ranks "
            "(see Note [Collapsing symmetric ranks])")
    return RankPlan(simulated=tuple(reps), represents=represents, collapsed=True, note=note,
                    _class_of=class_of, _workload=workload)
