"""Cost-model formulas from tables of hand-computed cases, and their topology-aware counterparts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simulator import cost_model as cm
from simulator.collectives import CollectivePlanner
from simulator.hardware import DEFAULT_GPU_EFFICIENCY, DeviceSpec, OpClassEfficiency
from tests.simulator.toys import toy_cluster

ALPHA, BW = 1e-6, 1e9  # 1 us per step, 1 GB/s

# kind, world, message bytes, expected seconds (written out by hand from each docstring's formula)
FORMULA_CASES = [
    ("all_to_all", 8, 8e6, 7 * ALPHA + 7 / 8 * 8e6 / BW),
    ("all_to_all", 2, 1e6, 1 * ALPHA + 0.5e-3),
    ("all_reduce", 8, 8e6, 14 * ALPHA + 14e-3),
    ("all_reduce", 4, 1e6, 6 * ALPHA + 1.5e-3),
    ("all_gather", 8, 1e6, 7 * ALPHA + 7e-3),
    ("reduce_scatter", 8, 8e6, 7 * ALPHA + 7e-3),
    ("broadcast", 4, 2e6, 3 * ALPHA + 2e-3),
    ("send", 2, 1e6, ALPHA + 1e-3),
    ("recv", 2, 0, ALPHA),
    ("all_reduce", 1, 1e9, 0.0),
    ("all_to_all", 1, 1e9, 0.0),
]


@pytest.mark.parametrize(("kind", "world", "nbytes", "expected"), FORMULA_CASES)
def test_cost_model_alpha_beta_formulas_match_hand_computed_cases(kind, world, nbytes, expected):
    got = cm.collective_time_s(kind, nbytes, world, latency_s=ALPHA, bandwidth_bytes_per_s=BW)
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize(("kind", "world", "factor"), [
    ("all_reduce", 8, 1.75), ("all_gather", 8, 0.875), ("reduce_scatter", 4, 0.75), ("all_to_all", 2, 0.5),
    ("broadcast", 8, 1.0), ("send", 2, 1.0),
])
def test_cost_model_bus_bandwidth_factors_follow_nccl_tests(kind, world, factor):
    assert cm.bus_bandwidth_factor(kind, world) == pytest.approx(factor)


@pytest.mark.parametrize("kind", ["all_to_all", "all_reduce", "reduce_scatter", "broadcast"])
def test_cost_model_bandwidth_term_equals_busbw_factor_over_bandwidth(kind):
    # NCCL's definition: time = size / algbw = size * factor / busbw, with busbw the link bandwidth.
    world, nbytes = 8, 8e6
    t = cm.collective_time_s(kind, nbytes, world, latency_s=0.0, bandwidth_bytes_per_s=BW)
    assert t == pytest.approx(nbytes * cm.bus_bandwidth_factor(kind, world) / BW)


def test_cost_model_all_gather_busbw_is_over_the_gathered_size():
    world, shard = 8, 1e6
    t = cm.all_gather_time_s(shard, world, latency_s=0.0, bandwidth_bytes_per_s=BW)
    assert t == pytest.approx(world * shard * cm.bus_bandwidth_factor("all_gather", world) / BW)


ROOFLINE_CASES = [
    # flops, bytes, flops_eff, mem_eff, launch, expected
    (1e12, 0, 1.0, 1.0, 0.0, 1.0),            # compute bound: 1e12 / 1e12
    (0, 2e12, 1.0, 1.0, 0.0, 1.0),            # memory bound: 2e12 / 2e12
    (1e12, 4e12, 1.0, 1.0, 0.0, 2.0),         # memory dominates
    (1e12, 1e12, 0.5, 1.0, 0.0, 2.0),         # efficiency halves the compute roof
    (1e9, 1e9, 1.0, 0.25, 5e-6, 2e-3 + 5e-6),  # launch overhead added once
    (0, 0, 1.0, 1.0, 5e-6, 0.0),              # a view launches nothing
]


@pytest.mark.parametrize(("flops", "nbytes", "eff_f", "eff_m", "launch", "expected"), ROOFLINE_CASES)
def test_cost_model_roofline_takes_the_slower_roof(flops, nbytes, eff_f, eff_m, launch, expected):
    got = cm.roofline_time_s(flops=flops, bytes_moved=nbytes, peak_flops_per_s=1e12, memory_bandwidth_bytes_per_s=2e12,
                             flops_efficiency=eff_f, memory_efficiency=eff_m, launch_overhead_s=launch)
    assert got == pytest.approx(expected)


def test_cost_model_attention_pays_per_score_and_a_view_pays_host_time():
    common = dict(peak_flops_per_s=1e12, memory_bandwidth_bytes_per_s=2e12, attention_score_time_s=1e-9,
                  view_overhead_s=2e-6)
    # 1e9 FLOPs at 1e12 FLOP/s = 1 ms, plus 1e6 scores at 1 ns each = 1 ms
    assert cm.roofline_time_s(flops=1e9, bytes_moved=0, attention_scores=1e6, **common) == pytest.approx(2e-3)
    assert cm.roofline_time_s(flops=0, bytes_moved=0, **common) == pytest.approx(2e-6)


def test_cost_model_vectorised_roofline_matches_the_scalar_one():
    device = DeviceSpec(name="d", peak_flops_per_s=1e12, memory_bandwidth_bytes_per_s=2e12, memory_bytes=1,
                        kernel_launch_overhead_s=3e-6, view_op_overhead_s=1e-6, attention_score_time_s=2e-10,
                        efficiency={**DEFAULT_GPU_EFFICIENCY, "matmul": OpClassEfficiency(flops=0.5, memory=0.9)})
    ops = [(1e9, 1e6, "matmul", 0), (1e6, 1e9, "elementwise", 0), (0, 0, "other", 0), (5e8, 5e8, "unknown-class", 0),
           (4e9, 1e7, "attention", 10**7)]
    times = cm.compute_times_s([o[0] for o in ops], [o[1] for o in ops], [o[2] for o in ops], device,
                               [o[3] for o in ops])
    for (flops, nbytes, cls, scores), got in zip(ops, times, strict=True):
        eff = device.efficiency_for(cls)
        want = cm.roofline_time_s(flops=flops, bytes_moved=nbytes, peak_flops_per_s=1e12,
                                  memory_bandwidth_bytes_per_s=2e12, flops_efficiency=eff.flops,
                                  memory_efficiency=eff.memory, launch_overhead_s=3e-6, attention_scores=scores,
                                  attention_score_time_s=2e-10, view_overhead_s=1e-6)
        assert got == pytest.approx(want)


@pytest.mark.parametrize("kind", ["all_to_all", "all_reduce", "all_gather", "reduce_scatter", "broadcast"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_cost_model_topology_time_equals_textbook_on_one_switch(kind, world):
    # Each hop 0.5 us, so a device-switch-device route is one 1 us alpha; links 1 GB/s.
    cluster = toy_cluster(devices_per_node=world, link_bytes_per_s=BW, link_latency_s=ALPHA / 2)
    planner = CollectivePlanner(cluster.topology)
    members = tuple(range(world))
    got = planner.isolated_time_s(kind, members, 4e6)
    want = cm.collective_time_s(kind, 4e6, world, latency_s=ALPHA, bandwidth_bytes_per_s=BW)
    assert got == pytest.approx(want, rel=1e-12)


def test_cost_model_topology_bottleneck_is_the_nic_across_nodes():
    cluster = toy_cluster(nodes=2, devices_per_node=4, link_bytes_per_s=100e9, nic_bytes_per_s=25e9)
    planner = CollectivePlanner(cluster.topology)
    # Ring over 8 ranks in rank order: two ring edges cross the nodes, each on its own NIC.
    got = planner.isolated_time_s("all_reduce", tuple(range(8)), 8e6)
    assert got == pytest.approx(2 * 7 / 8 * 8e6 / 25e9)
    # All-to-all: each rank sends 4 of its 8 blocks off-node through its NIC.
    got = planner.isolated_time_s("all_to_all", tuple(range(8)), 8e6)
    assert got == pytest.approx(4 / 8 * 8e6 / 25e9)


KINDS = ["all_to_all", "all_reduce", "all_gather", "reduce_scatter", "broadcast", "send"]


@given(kind=st.sampled_from(KINDS), world=st.integers(2, 16), root=st.integers(0, 15))
def test_cost_model_traffic_conserves_bytes_and_matches_bus_factor(kind, world, root):
    members = tuple(range(world)) if kind != "send" else (0, 1)
    flows = cm.traffic_pattern(kind, members, root=root % world)
    sent = {r: 0.0 for r in members}
    received = {r: 0.0 for r in members}
    for src, dst, per_byte in flows:
        assert src != dst and per_byte > 0
        sent[src] += per_byte
        received[dst] += per_byte
    assert sum(sent.values()) == pytest.approx(sum(received.values()))  # bytes are conserved
    p = len(members)
    factor = cm.bus_bandwidth_factor(kind, p) * (p if kind == "all_gather" else 1)
    assert max(sent.values()) == pytest.approx(factor)
    if kind == "all_to_all":  # every rank keeps 1/p and sends/receives the rest
        assert all(v == pytest.approx((p - 1) / p) for v in sent.values())
        assert all(v == pytest.approx((p - 1) / p) for v in received.values())


@pytest.mark.parametrize(("kind", "world", "nbytes", "out"), [
    ("all_gather", 4, 100, 400), ("reduce_scatter", 4, 400, 100), ("all_to_all", 4, 400, 400),
    ("all_reduce", 4, 400, 400), ("send", 2, 10, 0), ("recv", 2, 10, 10), ("broadcast", 8, 10, 10),
])
def test_cost_model_output_bytes_per_rank(kind, world, nbytes, out):
    assert cm.output_bytes(kind, nbytes, world) == out


def test_cost_model_unknown_kind_names_the_valid_ones():
    with pytest.raises(ValueError, match="choose one of"):
        cm.collective_time_s("gossip", 1, 2, latency_s=0, bandwidth_bytes_per_s=1)
