"""Activation offload in the simulator (Note [Host tensors] in simulator/workload_types.py): host tensors are a pool of
their own, a copy's source is freed when the copy completes, a copy hidden behind compute costs no step time, and
host memory runs out against the cluster's host memory per rank.

Toy numbers (tests/simulator/toys.py): 1 GFLOP = 1 ms, the host-memory link moves 1 MB/ms.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from simulator import Cluster, ProgramBuilder, Workload, WorkloadError, simulate
from simulator.hardware import LinkSpec
from tests.simulator.toys import GFLOP, MS, toy_preset

MB = 10**6
HOST = LinkSpec(bandwidth_bytes_per_s=1e9, latency_s=0.0)


def _cluster(host_per_rank: int | None = 2**30, *, inline: bool = False) -> Cluster:
    preset = toy_preset()
    host = None if host_per_rank is None else host_per_rank * preset.devices_per_node
    device = dataclasses.replace(preset.device, host_copies_inline=inline)
    return Cluster.from_preset(dataclasses.replace(preset, host_memory_link=HOST, host_memory_bytes=host,
                                                   device=device))


def _offloaded(*, prefetch: bool = True) -> Workload:
    """F1 makes x (2 MB), which goes to host memory while F2 runs; backward brings it back into d, ahead of B1
    (``prefetch``) or right before B2 reads it."""
    b = ProgramBuilder()
    x, y, d = b.tensor(2 * MB), b.tensor(MB // 2), b.tensor(2 * MB)
    h = b.tensor(2 * MB, host=True)
    f1 = b.compute("F1", flops=GFLOP, allocates=[x])
    b.start("offload", kind="to_host", group="host", message_bytes=2 * MB, deps=[f1], allocates=[h], frees=[x])
    f2 = b.compute("F2", flops=3 * GFLOP, allocates=[y])

    def reload(after: int) -> int:
        return b.start("reload", kind="from_host", group="host", message_bytes=2 * MB, deps=[after], allocates=[d],
                       frees=[h])

    start = reload(f2) if prefetch else None
    b1 = b.compute("B1", flops=2 * GFLOP, phase="backward", frees=[y])
    if start is None:
        start = reload(b1)
    b.wait(start)
    b.compute("B2", flops=GFLOP, phase="backward", frees=[d])
    return Workload(name="offload", world_size=1, groups={"host": [[0]]}, ranks={0: b.build()}, symmetric=True)


def test_host_tensors_are_their_own_pool_and_a_copy_frees_its_source_when_it_completes():
    result = simulate(_offloaded(), _cluster())
    tl = result.timelines[0]
    # x lives 0-3 ms: its copy runs 1-3 ms, so x is freed at 3 (not when the copy is issued at 1); d 4-7 ms.
    device = dict(zip(np.round(tl.memory.times_s / MS, 9), tl.memory.total_bytes / MB, strict=True))
    assert {t: device[t] for t in (0.0, 1.0, 3.0, 4.0, 6.0, 7.0)} == pytest.approx(
        {0.0: 2.0, 1.0: 2.5, 3.0: 0.5, 4.0: 2.5, 6.0: 2.0, 7.0: 0.0})
    # the host copy exists from its copy's issue (1 ms) until the reload completes (6 ms)
    host = tl.host_memory
    assert dict(zip(np.round(host.times_s / MS, 9), host.total_bytes / MB, strict=True)) == pytest.approx(
        {0.0: 0.0, 1.0: 2.0, 6.0: 0.0})
    assert len(host.times_s) == 3
    rank = result.ranks[0]
    assert rank.peak_memory_bytes == 2.5 * MB and rank.host_peak_memory_bytes == result.host_peak_memory_bytes == 2 * MB
    assert rank.host_memory_capacity_bytes == 2**30 and result.fits
    assert result.to_dict()["host_peak_memory_bytes"] == 2 * MB


def test_a_copy_hidden_behind_compute_costs_no_step_time_and_a_late_one_stalls():
    hidden = simulate(_offloaded(), _cluster())
    assert hidden.step_time_s == pytest.approx(7 * MS)  # F1 1 + F2 3 + B1 2 + B2 1: both copies hidden
    assert hidden.ranks[0].compute_stall_s == pytest.approx(0.0)
    late = simulate(_offloaded(prefetch=False), _cluster())
    assert late.step_time_s == pytest.approx(9 * MS)  # the reload issued after B1 is waited for: 2 ms exposed
    assert late.ranks[0].compute_stall_s == pytest.approx(2 * MS)
    assert "comm:host" in late.ranks[0].stream_busy_s


def test_a_device_that_copies_inline_frees_the_source_before_its_next_op_and_pays_each_copy():
    # cpu-gloo: a CPU process makes its host copies itself, so the compute stream waits for each copy
    inline = simulate(_offloaded(), _cluster(inline=True))
    tl = inline.timelines[0]
    device = dict(zip(np.round(tl.memory.times_s / MS, 9), tl.memory.total_bytes / MB, strict=True))
    # x's copy runs 1-3 ms and F2 starts after it: y is made at 3 ms, when x is already freed (2.5 MB when
    # overlapped); the reload runs 6-8 ms, d from 6 ms beside y until B1 frees y at 10 ms.
    assert device == pytest.approx({0.0: 2.0, 3.0: 0.5, 6.0: 2.5, 10.0: 2.0, 11.0: 0.0})
    assert inline.step_time_s == pytest.approx(11 * MS)  # 7 ms of compute and both 2 ms copies, none hidden
    assert inline.ranks[0].compute_stall_s == pytest.approx(4 * MS)


def test_host_memory_runs_out_against_the_host_memory_per_rank():
    result = simulate(_offloaded(), _cluster(host_per_rank=MB * 3 // 2))
    rank = result.ranks[0]
    assert rank.oom is None and rank.host_oom is not None and not result.fits
    oom = result.oom
    assert (oom.pool, oom.op_name, oom.time_s, oom.bytes_needed, oom.capacity_bytes) == (
        "host", "offload", pytest.approx(1 * MS), 2 * MB, MB * 3 // 2)
    assert "runs out of host memory at op 1 ('offload')" in oom.message()
    # a cluster whose host memory is unknown never runs out of it; the host peak is still reported
    unknown = simulate(_offloaded(), _cluster(host_per_rank=None))
    assert unknown.fits and unknown.host_peak_memory_bytes == 2 * MB


def test_host_tensors_round_trip_through_json_and_must_be_tensors_of_the_program():
    workload = _offloaded()
    again = Workload.from_dict(workload.to_dict())
    assert again.program(0).host_tensors == workload.program(0).host_tensors == frozenset({3})
    doc = workload.to_dict()
    doc["ranks"]["0"]["host_tensors"] = [3, 9]
    with pytest.raises(WorkloadError, match=r"host_tensors names \[9\]"):
        Workload.from_dict(doc)
