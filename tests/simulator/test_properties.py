"""Property tests on random (deadlock-free) workloads: time, memory, consistency, determinism, collapsing."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simulator import ProgramBuilder, StaticMemory, Workload, simulate
from simulator.schedule import COMPUTE
from simulator.trace import chrome_trace
from tests.simulator.toys import GFLOP, toy_cluster

KINDS = ["all_to_all", "all_reduce", "all_gather", "reduce_scatter", "broadcast"]
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def workloads(draw, *, same_on_every_rank: bool = False):
    """Random programs where every rank issues the same collectives in the same order (so none deadlocks)."""
    world = draw(st.sampled_from([2, 3, 4]))
    groups = {"all": [list(range(world))]}
    if world == 4:
        groups["pair"] = [[0, 1], [2, 3]]
    builders = [ProgramBuilder() for _ in range(world)]
    live: list[list[int]] = [[] for _ in range(world)]
    pending: list[list[int]] = []
    for step in range(draw(st.integers(1, 14))):
        action = draw(st.sampled_from(["compute", "compute", "start", "blocking", "wait"]))
        if action == "compute":
            shared = draw(st.integers(0, 4))
            for rank, b in enumerate(builders):
                quarters = shared if same_on_every_rank else draw(st.integers(0, 4))
                size = draw(st.integers(0, 10**6))
                allocs = [b.tensor(size)] if size else []
                frees = [live[rank].pop(0)] if live[rank] and draw(st.booleans()) else []
                b.compute(f"c{step}", flops=quarters * GFLOP // 4, bytes_read=size, allocates=allocs, frees=frees)
                live[rank] += allocs
        elif action in ("start", "blocking"):
            kind = draw(st.sampled_from(KINDS))
            group = draw(st.sampled_from(sorted(groups)))
            nbytes = draw(st.integers(0, 4 * 10**6))
            after_compute = draw(st.booleans())
            ids = []
            for b in builders:
                deps = [b.num_ops - 1] if after_compute and b.num_ops else []
                issue = b.start if action == "start" else b.collective
                ids.append(issue(f"{kind}{step}", kind=kind, group=group, message_bytes=nbytes, deps=deps,
                                 key=f"k{step}"))
            if action == "start":
                pending.append(ids)
        elif pending:
            ids = pending.pop(draw(st.integers(0, len(pending) - 1)))
            for b, op_id in zip(builders, ids, strict=True):
                b.wait(op_id)
    for ids in pending:
        for b, op_id in zip(builders, ids, strict=True):
            b.wait(op_id)
    static = StaticMemory(other_bytes=draw(st.integers(0, 10**6)))
    if same_on_every_rank:
        return Workload(name="random-sym", world_size=world, groups=groups, ranks={0: builders[0].build(static)},
                        symmetric=True)
    return Workload(name="random", world_size=world, groups=groups,
                    ranks={r: b.build(static) for r, b in enumerate(builders)})


CLUSTER = toy_cluster(nodes=2, devices_per_node=2, link_latency_s=1e-6, memory_bytes=3 * 10**6)


@SETTINGS
@given(workloads())
def test_properties_trace_time_never_goes_backwards(workload):
    trace = chrome_trace(simulate(workload, CLUSTER))
    last_end: dict[tuple[int, int], float] = {}
    last_counter: dict[int, float] = {}
    for ev in trace["traceEvents"]:
        if ev["ph"] == "X":
            assert ev["dur"] >= 0
            key = (ev["pid"], ev["tid"])
            assert ev["ts"] >= last_end.get(key, 0.0) - 1e-6  # no slice starts before the previous one ended
            last_end[key] = ev["ts"] + ev["dur"]
        elif ev["ph"] == "C":
            assert ev["ts"] >= last_counter.get(ev["pid"], 0.0)
            last_counter[ev["pid"]] = ev["ts"]


@SETTINGS
@given(workloads())
def test_properties_memory_is_never_negative_and_peak_is_consistent(workload):
    result = simulate(workload, CLUSTER)
    for rank, tl in result.timelines.items():
        mem = tl.memory
        assert (mem.total_bytes >= mem.static_bytes).all()
        assert result.ranks[rank].peak_memory_bytes == mem.total_bytes.max()
        if result.ranks[rank].oom is not None:
            assert result.ranks[rank].oom.bytes_needed > CLUSTER.device.memory_bytes


@SETTINGS
@given(workloads())
def test_properties_every_member_sees_one_transfer_per_collective(workload):
    result = simulate(workload, CLUSTER)
    seen: dict[tuple, tuple[float, float]] = {}
    for rank, tl in result.timelines.items():
        for pos, op in enumerate(tl.compiled.program.ops):
            assert tl.begin_s[pos] <= tl.end_s[pos] + 1e-15
            if tl.compiled.kinds[pos] == COMPUTE:
                assert tl.end_s[pos] - tl.begin_s[pos] == pytest.approx(tl.compiled.durations_s[pos], abs=1e-12)
            elif op.kind in ("collective", "collective_start"):
                assert tl.begin_s[pos] <= tl.transfer_start_s[pos] <= tl.end_s[pos]
                instance = workload.group_instance(op.collective.group, rank)
                times = (tl.transfer_start_s[pos], tl.end_s[pos])
                assert seen.setdefault((instance, op.collective.key), times) == pytest.approx(times)
    assert result.step_time_s == max(r.end_time_s for r in result.ranks)
    assert all(r.compute_busy_s <= result.step_time_s + 1e-12 for r in result.ranks)


@SETTINGS
@given(workloads())
def test_properties_simulation_is_deterministic(workload):
    first = simulate(workload, CLUSTER).to_dict(include_ops=True)
    second = simulate(workload, CLUSTER).to_dict(include_ops=True)
    first.pop("simulation_wall_s")
    second.pop("simulation_wall_s")
    assert first == second


@SETTINGS
@given(workloads(same_on_every_rank=True))
def test_properties_collapsing_symmetric_ranks_changes_nothing(workload):
    collapsed = simulate(workload, CLUSTER)
    full = simulate(workload, CLUSTER, collapse_symmetric=False)
    assert math.isclose(collapsed.step_time_s, full.step_time_s, rel_tol=1e-9, abs_tol=1e-15)
    for a, b in zip(collapsed.ranks, full.ranks, strict=True):
        assert math.isclose(a.exposed_comm_s, b.exposed_comm_s, rel_tol=1e-9, abs_tol=1e-12)
        assert a.peak_memory_bytes == b.peak_memory_bytes
        assert (a.oom is None) == (b.oom is None)
