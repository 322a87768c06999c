"""Exact timelines of the engine on hand-built workloads (toy hardware: 1 GFLOP = 1 ms, links 1 MB/ms)."""

from __future__ import annotations

import pytest

from simulator import ProgramBuilder, SimulationDeadlock, Workload, simulate
from simulator.synthetic import LlamaShape, llama_ulysses_workload
from tests.simulator.toys import GFLOP, MS, overlap_program, symmetric, toy_cluster


def _times(result, rank, name):
    tl = result.timelines[rank]
    pos = next(i for i, op in enumerate(tl.compiled.program.ops) if op.name == name)
    return tl.begin_s[pos], tl.transfer_start_s[pos], tl.end_s[pos]


def _two_started_all_to_alls(group_a: str, group_b: str) -> ProgramBuilder:
    """Start "a" (on ``group_a``) and "b" (on ``group_b``), 2 MB each, then wait for both."""
    b = ProgramBuilder()
    first = b.start("a", kind="all_to_all", group=group_a, message_bytes=2 * 10**6)
    second = b.start("b", kind="all_to_all", group=group_b, message_bytes=2 * 10**6)
    b.wait(first)
    b.wait(second)
    return b


def test_engine_collective_hidden_behind_compute_gives_exact_step_time():
    result = simulate(symmetric(overlap_program(hidden_gflop=2)), toy_cluster())
    # A 0-1 ms, all-to-all 1-2 ms (2 MB, half crosses the 1 MB/ms link), B 1-3 ms, C 3-4 ms.
    assert result.step_time_s == pytest.approx(4 * MS)
    assert result.exposed_comm_s == pytest.approx(0.0, abs=1e-12)
    assert result.overlap_fraction == pytest.approx(1.0)
    rank = result.ranks[0]
    assert rank.comm_time_s == pytest.approx(1 * MS)
    assert rank.compute_stall_s == pytest.approx(0.0, abs=1e-12)
    assert rank.stream_busy_s == pytest.approx({"compute": 4 * MS, "comm:sp": 1 * MS})


def test_engine_collective_longer_than_compute_is_partly_exposed():
    result = simulate(symmetric(overlap_program(hidden_gflop=0.25)), toy_cluster())
    assert result.step_time_s == pytest.approx(3 * MS)
    assert result.exposed_comm_s == pytest.approx(0.75 * MS)
    assert result.overlap_fraction == pytest.approx(0.25)
    assert result.ranks[1].compute_stall_s == pytest.approx(0.75 * MS)


def _late_rank_workload(lateness_gflop: float) -> Workload:
    programs = {}
    for rank, before in ((0, 1.0), (1, 1.0 + lateness_gflop)):
        b = ProgramBuilder()
        b.compute("A", flops=int(before * GFLOP))
        b.collective("ar", kind="all_reduce", group="sp", message_bytes=10**6, key="ar")
        b.compute("C", flops=GFLOP)
        programs[rank] = b.build()
    return Workload(name="late", world_size=2, groups={"sp": [0, 1]}, ranks=programs)


def test_engine_late_rank_delays_the_others_by_exactly_its_lateness():
    on_time = simulate(_late_rank_workload(0.0), toy_cluster())
    late = simulate(_late_rank_workload(2.0), toy_cluster())
    # All-reduce of 1 MB on 2 ranks: 2(p-1)/p * 1 MB at 1 MB/ms = 1 ms.
    assert on_time.step_time_s == pytest.approx(3 * MS)
    assert late.ranks[0].end_time_s - on_time.ranks[0].end_time_s == pytest.approx(2 * MS)
    assert late.ranks[0].comm_wait_for_peers_s == pytest.approx(2 * MS)
    assert late.ranks[1].comm_wait_for_peers_s == pytest.approx(0.0, abs=1e-12)
    assert _times(late, 0, "ar") == pytest.approx((1 * MS, 3 * MS, 4 * MS))


def test_engine_concurrent_collectives_on_shared_links_split_bandwidth():
    b = _two_started_all_to_alls("a", "b")
    result = simulate(symmetric(b, groups={"a": [0, 1], "b": [0, 1]}), toy_cluster())
    # Alone each takes 1 ms; sharing every link they both take 2 ms.
    assert _times(result, 0, "a")[1:] == pytest.approx((0.0, 2 * MS))
    assert _times(result, 0, "b")[1:] == pytest.approx((0.0, 2 * MS))


def test_engine_bandwidth_share_is_recomputed_when_a_transfer_joins():
    b = ProgramBuilder()
    first = b.start("a", kind="all_to_all", group="a", message_bytes=2 * 10**6)
    delay = b.compute("delay", flops=GFLOP // 2)
    second = b.start("b", kind="all_to_all", group="b", message_bytes=2 * 10**6, deps=[delay])
    b.wait(first)
    b.wait(second)
    result = simulate(symmetric(b, groups={"a": [0, 1], "b": [0, 1]}), toy_cluster())
    # a: half done alone by 0.5 ms, the other half at half speed -> 1.5 ms.
    # b: from 0.5 ms, half at half speed until 1.5 ms, the rest alone -> 2.0 ms.
    assert _times(result, 0, "a")[2] == pytest.approx(1.5 * MS)
    assert _times(result, 0, "b")[1:] == pytest.approx((0.5 * MS, 2.0 * MS))


def test_engine_collectives_of_one_group_run_in_program_order_on_its_stream():
    b = _two_started_all_to_alls("sp", "sp")
    result = simulate(symmetric(b), toy_cluster())
    assert _times(result, 0, "a") == pytest.approx((0.0, 0.0, 1 * MS))
    assert _times(result, 0, "b") == pytest.approx((1 * MS, 1 * MS, 2 * MS))


def test_engine_two_collectives_in_flight_share_the_link_and_overlap_their_latency():
    b = _two_started_all_to_alls("sp", "sp")
    result = simulate(symmetric(b), toy_cluster(collectives_in_flight=2, link_latency_s=0.25 * MS))
    # Both start at 0: one alpha (two 0.25 ms hops) + 1 MB over a link they share at 0.5 MB/ms = 0.5 + 2 ms.
    assert _times(result, 0, "a") == pytest.approx((0.0, 0.0, 2.5 * MS))
    assert _times(result, 0, "b") == pytest.approx((0.0, 0.0, 2.5 * MS))
    serial = simulate(symmetric(b), toy_cluster(collectives_in_flight=1, link_latency_s=0.25 * MS))
    assert serial.step_time_s == pytest.approx(3 * MS)


def test_engine_blocking_collectives_stay_serial_with_collectives_in_flight():
    b = ProgramBuilder()
    b.collective("a", kind="all_to_all", group="sp", message_bytes=2 * 10**6)
    b.collective("b", kind="all_to_all", group="sp", message_bytes=2 * 10**6)
    result = simulate(symmetric(b), toy_cluster(collectives_in_flight=2))
    # The compute stream that issues "b" is stalled on "a" until it completes.
    assert _times(result, 0, "b") == pytest.approx((1 * MS, 1 * MS, 2 * MS))


def test_engine_blocking_collective_stalls_the_compute_stream():
    b = ProgramBuilder()
    b.compute("A", flops=GFLOP)
    b.collective("a2a", kind="all_to_all", group="sp", message_bytes=2 * 10**6)
    b.compute("C", flops=GFLOP)
    result = simulate(symmetric(b), toy_cluster())
    assert result.step_time_s == pytest.approx(3 * MS)
    assert result.exposed_comm_s == pytest.approx(1 * MS)
    assert result.ranks[0].compute_stall_s == pytest.approx(1 * MS)
    assert _times(result, 0, "C")[0] == pytest.approx(2 * MS)


def test_engine_program_order_alone_does_not_delay_a_collective_start():
    b = ProgramBuilder()
    b.compute("A", flops=GFLOP)
    s = b.start("a2a", kind="all_to_all", group="sp", message_bytes=2 * 10**6)  # no deps: issued at t=0
    b.wait(s)
    result = simulate(symmetric(b), toy_cluster())
    assert _times(result, 0, "a2a") == pytest.approx((0.0, 0.0, 1 * MS))
    assert result.step_time_s == pytest.approx(1 * MS)


def test_engine_latency_adds_one_alpha_per_algorithm_step():
    b = ProgramBuilder()
    b.collective("ar", kind="all_reduce", group="sp", message_bytes=0)
    result = simulate(symmetric(b, world=4), toy_cluster(devices_per_node=4, link_latency_s=1e-6))
    # 2(p-1) = 6 steps, each over two 1 us hops.
    assert result.step_time_s == pytest.approx(6 * 2e-6)


def test_engine_inter_node_all_to_all_is_bound_by_the_nic():
    b = ProgramBuilder()
    b.collective("a2a", kind="all_to_all", group="sp", message_bytes=2 * 10**6)
    result = simulate(symmetric(b), toy_cluster(nodes=2, devices_per_node=1, nic_bytes_per_s=1e8))
    assert result.step_time_s == pytest.approx(10**6 / 1e8)


def _mesh_workload() -> Workload:
    b = ProgramBuilder()
    a = b.compute("attn_in", flops=GFLOP)
    s = b.start("a2a", kind="all_to_all", group="sp", message_bytes=4 * 10**6, deps=[a])
    b.compute("other", flops=GFLOP // 2)
    b.wait(s)
    g = b.start("grad_ar", kind="all_reduce", group="dp", message_bytes=3 * 10**6)
    b.compute("more", flops=GFLOP)
    b.wait(g)
    groups = {"sp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]]}
    return symmetric(b, world=4, groups=groups)


def test_engine_collapsed_symmetric_ranks_match_the_full_simulation():
    workload = _mesh_workload()
    cluster = toy_cluster(nodes=2, devices_per_node=2)
    collapsed = simulate(workload, cluster)
    full = simulate(workload, cluster, collapse_symmetric=False)
    assert collapsed.collapsed and collapsed.simulated_ranks == (0,)
    assert not full.collapsed and full.simulated_ranks == (0, 1, 2, 3)
    assert collapsed.step_time_s == pytest.approx(full.step_time_s)
    for a, b in zip(collapsed.ranks, full.ranks, strict=True):
        assert a.end_time_s == pytest.approx(b.end_time_s)
        assert a.exposed_comm_s == pytest.approx(b.exposed_comm_s)
        assert a.peak_memory_bytes == b.peak_memory_bytes


def test_engine_collapsed_synthetic_llama_matches_the_full_simulation():
    shape = LlamaShape(layers=2, hidden=256, heads=8, kv_heads=4, ffn_hidden=512, vocab=1000)
    workload = llama_ulysses_workload(seq_len=4096, sp_degree=4, shape=shape, ops_per_layer=(40, 80))
    cluster = toy_cluster(devices_per_node=4)
    collapsed = simulate(workload, cluster)
    full = simulate(workload, cluster, collapse_symmetric=False)
    assert collapsed.collapsed
    assert collapsed.step_time_s == pytest.approx(full.step_time_s, rel=1e-12)
    assert collapsed.peak_memory_bytes == full.peak_memory_bytes


def test_engine_equal_non_symmetric_programs_are_collapsed_too():
    program = overlap_program().build()
    workload = Workload(name="eq", world_size=2, groups={"sp": [0, 1]}, ranks={0: program, 1: program})
    result = simulate(workload, toy_cluster())
    assert result.collapsed and result.simulated_ranks == (0,)
    assert result.step_time_s == pytest.approx(4 * MS)


def test_engine_mismatched_collective_order_reports_a_deadlock():
    programs = {}
    for rank, order in ((0, ("x", "y")), (1, ("y", "x"))):
        b = ProgramBuilder()
        for key in order:
            b.collective(key, kind="all_reduce", group="sp", message_bytes=8, key=key)
        programs[rank] = b.build()
    workload = Workload(name="dead", world_size=2, groups={"sp": [0, 1]}, ranks=programs)
    with pytest.raises(SimulationDeadlock, match="same order"):
        simulate(workload, toy_cluster())


def test_engine_workload_larger_than_cluster_says_to_add_nodes():
    with pytest.raises(ValueError, match="add nodes"):
        simulate(symmetric(overlap_program(), world=4), toy_cluster())


def test_engine_simulations_in_one_process_do_not_interfere():
    cluster = toy_cluster()
    first = simulate(symmetric(overlap_program(hidden_gflop=2)), cluster)
    other = simulate(symmetric(overlap_program(hidden_gflop=0.25)), cluster)
    again = simulate(symmetric(overlap_program(hidden_gflop=2)), cluster)
    assert first.to_dict()["ranks"] == again.to_dict()["ranks"]
    assert other.step_time_s != first.step_time_s


def test_engine_p2p_send_recv_pair_up_and_disable_collapsing():
    programs = {}
    for rank in (0, 1):
        b = ProgramBuilder()
        b.compute("A", flops=GFLOP * (rank + 1))
        kind = "send" if rank == 0 else "recv"
        b.collective("p2p", kind=kind, group="sp", message_bytes=10**6, peer=1 - rank, key="p2p")
        programs[rank] = b.build()
    workload = Workload(name="p2p", world_size=2, groups={"sp": [0, 1]}, ranks=programs)
    result = simulate(workload, toy_cluster())
    assert not result.collapsed
    # The receiver is ready at 2 ms; 1 MB at 1 MB/ms.
    assert result.step_time_s == pytest.approx(3 * MS)
