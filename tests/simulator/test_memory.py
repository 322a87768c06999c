"""Memory timelines: exact peaks, OOM reported with the op that caused it, never negative."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from simulator import ProgramBuilder, StaticMemory, Workload, simulate
from simulator.memory import memory_timeline
from tests.simulator.toys import GFLOP, MS, symmetric, toy_cluster


def _two_op_program(*, second_frees_first: bool) -> ProgramBuilder:
    b = ProgramBuilder()
    t0, t1 = b.tensor(500), b.tensor(600)
    b.compute("A", flops=GFLOP, allocates=[t0], frees=[] if second_frees_first else [t0])
    b.compute("B", flops=GFLOP, allocates=[t1], frees=[t0] if second_frees_first else [])
    b.compute("C", flops=GFLOP, frees=[t1])
    return b


def _static(builder, static_bytes):
    return Workload(name="mem", world_size=2, groups={"sp": [0, 1]}, symmetric=True,
                    ranks={0: builder.build(StaticMemory(other_bytes=static_bytes))})


def test_memory_peak_counts_tensors_live_at_the_same_time():
    result = simulate(_static(_two_op_program(second_frees_first=True), 100), toy_cluster(memory_bytes=10**6))
    assert result.peak_memory_bytes == 100 + 500 + 600
    assert result.ranks[0].peak_memory_time_s == pytest.approx(1 * MS)
    assert result.fits


def test_memory_freed_at_an_op_end_is_reusable_by_the_next_op():
    result = simulate(_static(_two_op_program(second_frees_first=False), 100), toy_cluster(memory_bytes=10**6))
    assert result.peak_memory_bytes == 100 + 600


def test_memory_oom_is_reported_with_the_op_and_the_step_still_completes():
    result = simulate(_static(_two_op_program(second_frees_first=True), 100), toy_cluster(memory_bytes=1000))
    oom = result.oom
    assert not result.fits
    assert (oom.op_id, oom.op_name, oom.bytes_needed, oom.capacity_bytes) == (1, "B", 1200, 1000)
    assert oom.time_s == pytest.approx(1 * MS)
    assert "op 1 ('B')" in oom.message()
    assert result.step_time_s == pytest.approx(3 * MS)  # reported, not blocked
    assert [r.oom.rank for r in result.ranks] == [0, 1]


def test_memory_static_bytes_alone_can_run_out():
    result = simulate(_static(_two_op_program(second_frees_first=False), 5000), toy_cluster(memory_bytes=1000))
    assert result.oom.op_id is None and "static memory" in result.oom.message()


def test_memory_collective_output_lives_from_issue_to_its_free():
    b = ProgramBuilder()
    out = b.tensor(4000)
    s = b.start("a2a", kind="all_to_all", group="sp", message_bytes=2 * 10**6, allocates=[out])
    b.compute("A", flops=2 * GFLOP)
    b.wait(s)
    b.compute("use", flops=GFLOP, frees=[out])
    result = simulate(symmetric(b), toy_cluster())
    mem = result.timelines[0].memory
    assert mem.total_bytes.tolist() == [0, 4000, 0]
    assert mem.times_s.tolist() == pytest.approx([0.0, 0.0, 3 * MS])


def test_memory_zero_duration_workspace_still_counts():
    report = memory_timeline(static_bytes=0, sizes=[10, 7], alloc_s=[0.0, 1.0], free_s=[1.0, 1.0],
                             capacity_bytes=100)
    # The 10-byte tensor dies at 1.0 before the 7-byte workspace appears and vanishes at 1.0.
    assert report.total_bytes.tolist() == [0, 10, 0, 7, 0]
    assert report.peak_bytes == 10


@given(st.lists(st.tuples(st.integers(0, 10**6), st.floats(0, 10), st.one_of(st.floats(0, 10), st.just(np.inf))),
                max_size=40),
       st.integers(0, 10**6))
def test_memory_timeline_is_never_negative_and_ends_with_the_survivors(tensors, static):
    sizes = [t[0] for t in tensors]
    report = memory_timeline(static_bytes=static, sizes=sizes, alloc_s=[t[1] for t in tensors],
                             free_s=[t[2] for t in tensors], capacity_bytes=float("inf"))
    assert (report.total_bytes >= static).all()
    assert (np.diff(report.times_s) >= 0).all()
    assert report.total_bytes[-1] == static + sum(s for s, _, f in tensors if not np.isfinite(f))
    assert report.peak_bytes == report.total_bytes.max()
