"""The discrete-event engine: ``simulate(workload, cluster) -> Result``.

Every call builds its own ``simpy.Environment``; nothing is global, so simulations never interfere. Each
simulated rank runs one SimPy process for its compute stream and one per process group for its comm streams
(:mod:`simulator.schedule` decides what runs where). Overlap is not modelled explicitly: it emerges because a
``collective_start`` runs on a comm stream while the compute stream keeps going until the matching
``collective_wait``. Collectives meet in a :class:`~simulator.collectives.CollectiveRuntime` (rendezvous, then
a bandwidth-shared transfer); symmetric ranks are collapsed by :mod:`simulator.symmetry`. See
Note [Running ahead] for why a 9,000-op program costs only a few thousand events.

Note [Running ahead]
~~~~~~~~~~~~~~~~~~~~
The compute stream keeps a local clock ``t`` that may run ahead of ``env.now``: a kernel that nobody on another
stream waits for, and that waits for nothing on another stream, just advances ``t``. The process yields to
SimPy only to wait for a cross-stream dependency (first syncing ``env.now`` up to ``t``) or to fire the
completion event of an op another stream waits for (at exactly its end time). This is exact because compute
kernels do not interact with anything else in the model; it turns O(ops) events into O(cross-stream edges).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

import numpy as np
import simpy

from simulator.cluster import Cluster
from simulator.collectives import CollectivePlanner, CollectiveRuntime, Network
from simulator.memory import memory_timeline
from simulator.result import OomEvent, RankResult, RankTimeline, Result, summarize_timeline
from simulator.schedule import BLOCKING, COMPUTE, WAIT, CompiledProgram, compile_program
from simulator.symmetry import RankPlan, plan_ranks
from simulator.validate import validate_workload
from simulator.workload import Workload, WorkloadError

logger = logging.getLogger(__name__)


class SimulationDeadlock(WorkloadError):
    """The event loop ran dry with ops left: collectives were issued in inconsistent orders across ranks."""


class _RankState:
    __slots__ = ("rank", "cp", "begin", "end", "transfer", "stall", "events", "streams_left", "position")

    def __init__(self, rank: int, cp: CompiledProgram, env: simpy.Environment) -> None:
        n = len(cp.kinds)
        self.rank = rank
        self.cp = cp
        self.begin = [math.nan] * n
        self.end = [math.nan] * n
        self.transfer = [math.nan] * n
        self.stall = [math.nan] * n
        self.events = [env.event() if flag else None for flag in cp.notify]
        self.streams_left = 1 + len(cp.comm_streams)
        self.position: dict[str, int] = {}


def _compute_stream(env: simpy.Environment, st: _RankState):
    """Compute stream of one rank; see Note [Running ahead]."""
    cp = st.cp
    kinds, durations, cross, notify = cp.kinds, cp.durations_s, cp.cross_deps, cp.notify
    events, begin, end = st.events, st.begin, st.end
    t = 0.0
    for pos in cp.compute_stream:
        st.position["compute"] = pos
        kind = kinds[pos]
        if kind == BLOCKING:
            deps = cp.stall_deps[pos]
            st.stall[pos] = t
        else:
            deps = cross[pos]
        reached = t
        if deps:
            if t > env.now:
                yield env.timeout(t - env.now)
            for d in deps:
                if not events[d].triggered:
                    yield events[d]
            t = max(t, env.now)
        if kind == COMPUTE:
            begin[pos] = t
            t += durations[pos]
            end[pos] = t
        elif kind == WAIT:
            begin[pos] = reached
            end[pos] = t
        if notify[pos] and kind != BLOCKING:
            if t > env.now:
                yield env.timeout(t - env.now)
            events[pos].succeed()
    st.position.pop("compute", None)
    st.streams_left -= 1


def _comm_stream(env: simpy.Environment, st: _RankState, group: str, positions: list[int],
                 runtime: CollectiveRuntime, plan: RankPlan, in_flight: int):
    """Comm stream of one group on one rank: issue collectives in program order, at most ``in_flight`` running at
    once (1: each waits for the previous one; see HardwarePreset.collectives_in_flight)."""
    cp = st.cp
    ops, cross, notify, events, kinds = cp.program.ops, cp.cross_deps, cp.notify, st.events, cp.kinds
    running: list[simpy.Event] = []
    blocking_running: simpy.Event | None = None  # a blocking collective stalls the compute stream that issues

    def run(pos: int, done: simpy.Event):
        st.transfer[pos] = yield done
        st.end[pos] = env.now
        if notify[pos]:
            events[pos].succeed()

    for pos in positions:
        st.position[group] = pos
        for d in cross[pos]:
            if not events[d].triggered:
                yield events[d]
        if kinds[pos] == BLOCKING and blocking_running is not None and blocking_running.is_alive:
            yield blocking_running  # the next one is issued only once the compute stream runs again
        running = [proc for proc in running if proc.is_alive]
        if len(running) >= in_flight:
            yield env.any_of(running)
            running = [proc for proc in running if proc.is_alive]
        st.begin[pos] = env.now
        coll = ops[pos].collective
        route = plan.route(st.rank, coll)
        done = runtime.arrive(route.rendezvous, expected=route.expected, issuer=st.rank, kind=coll.kind,
                              instances=route.instances, message_bytes=coll.message_bytes,
                              root=coll.peer if coll.kind == "broadcast" else None)
        if in_flight == 1:
            yield from run(pos, done)
        else:
            running.append(env.process(run(pos, done)))
            if kinds[pos] == BLOCKING:
                blocking_running = running[-1]
    if running:
        yield env.all_of(running)
    st.position.pop(group, None)
    st.streams_left -= 1


def simulate(workload: Workload, cluster: Cluster, *, collapse_symmetric: bool = True,
             validate: bool = True) -> Result:
    """Simulate one training step of ``workload`` on ``cluster``.

    ``collapse_symmetric`` simulates one representative per class of identical ranks when that is exact (see
    Note [Collapsing symmetric ranks] in :mod:`simulator.symmetry`); ``validate`` runs
    :func:`simulator.validate.validate_workload` first (skip it only for workloads you just validated).
    Raises :class:`~simulator.workload.WorkloadError` for invalid workloads and :class:`SimulationDeadlock` when
    ranks issue collectives in orders that can never all complete; an OOM is reported in the result.
    """
    wall_start = time.perf_counter()
    if validate:
        validate_workload(workload)
    if workload.world_size > cluster.world_size:
        raise ValueError(f"workload {workload.name!r} has {workload.world_size} ranks but the cluster has only "
                         f"{cluster.world_size} devices; add nodes (--nodes) or pick a preset with more devices")
    env = simpy.Environment()
    planner = CollectivePlanner(cluster.topology, all_to_all=cluster.all_to_all)
    runtime = CollectiveRuntime(env, planner, Network(env, cluster.topology.link_bandwidth_bytes_per_s))
    plan = plan_ranks(workload, planner, collapse=collapse_symmetric)
    logger.info("%s: %s", workload.name, plan.note)
    compiled: dict[int, CompiledProgram] = {}
    states = []
    for rank in plan.simulated:
        program = workload.program(rank)
        cp = compiled.get(id(program))
        if cp is None:
            cp = compiled[id(program)] = compile_program(program, cluster.device)
        st = _RankState(rank, cp, env)
        states.append(st)
        env.process(_compute_stream(env, st))
        for group, positions in cp.comm_streams.items():
            env.process(_comm_stream(env, st, group, positions, runtime, plan,
                                     max(1, cluster.preset.collectives_in_flight)))
    env.run()
    _check_finished(states, runtime)
    capacity = cluster.device.memory_bytes
    host_capacity = cluster.host_memory_per_rank_bytes
    timelines: dict[int, RankTimeline] = {}
    summaries: dict[int, RankResult] = {}
    for st in states:
        timeline, oom, host_oom = _timeline(st, plan.represents[st.rank], capacity, host_capacity)
        timelines[st.rank] = timeline
        summaries[st.rank] = summarize_timeline(timeline, rank=st.rank, capacity_bytes=capacity, oom=oom,
                                                host_capacity_bytes=host_capacity, host_oom=host_oom)
    ranks = []
    for rep in plan.simulated:
        base = summaries[rep]
        for rank in plan.represents[rep]:
            oom, host_oom = (None if e is None else dataclasses.replace(e, rank=rank) for e in (base.oom, base.host_oom))
            ranks.append(base if rank == rep else dataclasses.replace(base, rank=rank, oom=oom, host_oom=host_oom))
    ranks.sort(key=lambda r: r.rank)
    wall = time.perf_counter() - wall_start
    logger.info("%s: simulated %d rank(s), %d collectives in %.3f s wall", workload.name, len(states),
                runtime.completed, wall)
    return Result(workload_name=workload.name, cluster=cluster.describe(), world_size=workload.world_size,
                  step_time_s=max((r.end_time_s for r in ranks), default=0.0), ranks=tuple(ranks),
                  simulated_ranks=plan.simulated, collapsed=plan.collapsed, note=plan.note,
                  simulation_wall_s=wall, timelines=timelines)


def _check_finished(states: list[_RankState], runtime: CollectiveRuntime) -> None:
    stuck = [st for st in states if st.streams_left > 0]
    if not stuck:
        return
    lines = []
    for rendezvous, entry in runtime.pending.items():
        lines.append(f"collective {rendezvous!r} was issued by rank(s) {sorted(entry.issuers)} and waits for "
                     f"{entry.expected - entry.arrived} more")
    for st in stuck:
        ops = st.cp.program.ops
        blocked = ", ".join(f"{stream} at op {ops[pos].id} ({ops[pos].name!r})" for stream, pos in st.position.items())
        lines.append(f"rank {st.rank} is blocked: {blocked}")
    raise SimulationDeadlock("simulation deadlocked; every member of a group must issue its collectives in the "
                             "same order:\n  " + "\n  ".join(lines))


def _timeline(st: _RankState, represents: tuple[int, ...], capacity: int, host_capacity: int | None
              ) -> tuple[RankTimeline, OomEvent | None, OomEvent | None]:
    """The rank's timeline with one memory report per pool (Note [Host tensors] in simulator/workload_types.py): the
    device's (static memory and device tensors) and, when the program has host tensors, the host's."""
    cp = st.cp
    program = cp.program
    begin, end = np.asarray(st.begin), np.asarray(st.end)

    def pool(host: bool, static: int, cap: float, name: str):
        tensor_ids = [t for t in cp.tensor_alloc_pos if (t in program.host_tensors) == host]
        report = memory_timeline(
            static_bytes=static, sizes=[program.tensors[t] for t in tensor_ids],
            alloc_s=[begin[cp.tensor_alloc_pos[t]] for t in tensor_ids],
            free_s=[end[cp.tensor_free_pos[t]] if t in cp.tensor_free_pos else math.inf for t in tensor_ids],
            capacity_bytes=cap)
        if report.oom_index is None:
            return report, None
        op = None if report.oom_index < 0 else program.ops[cp.tensor_alloc_pos[tensor_ids[report.oom_index]]]
        return report, OomEvent(rank=st.rank, op_id=None if op is None else op.id,
                                op_name=None if op is None else op.name, time_s=report.oom_time_s,
                                bytes_needed=report.oom_bytes, capacity_bytes=int(cap), pool=name)

    report, oom = pool(False, program.static_memory.total_bytes, capacity, "device")
    host_report = host_oom = None
    if program.host_tensors:
        host_report, host_oom = pool(True, 0, math.inf if host_capacity is None else host_capacity, "host")
    timeline = RankTimeline(rank=st.rank, represents=represents, compiled=cp, begin_s=begin, end_s=end,
                            transfer_start_s=np.asarray(st.transfer), stall_begin_s=np.asarray(st.stall),
                            memory=report, host_memory=host_report)
    return timeline, oom, host_oom
