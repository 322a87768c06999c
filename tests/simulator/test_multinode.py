"""Multi-node cluster presets: provenance, rail-optimised routes, all-to-all algorithms and ring p2p.

Expected times are written from the preset's own figures (datasheet bandwidths, GPU_CONSTANTS' efficiencies and
latencies) with the alpha-beta formulas of Note [All-to-all algorithms] in simulator.collectives, never copied from
an output.
"""

from __future__ import annotations

import functools
import itertools
import json

import pytest

from simulator import Cluster, ProgramBuilder, Workload, simulate
from simulator.cluster_presets import CLUSTER_PRESETS, get_cluster_preset
from simulator.collectives import CollectivePlanner
from simulator.gpu_constants import GPU_CONSTANTS, constants_for
from simulator.hardware import DATASHEETS

GB = 1e9
C = {k: u.nominal for k, u in GPU_CONSTANTS.items()}


def _figures(node: str) -> dict[str, float]:
    """Per-direction effective bandwidths and per-route latencies of a cluster of ``node``, by hand."""
    ds = DATASHEETS[node]
    nic_bw = 50 * GB * C["ib.efficiency"]  # 400 Gb/s = 50 GB/s per direction
    host = 4 * C["pcie.latency_s"] + 2 * C["ib.nic_latency_s"]  # gpu-pcie-nic on both ends
    return {
        "nvlink_bw": ds.fabric_bidir / 2 * C["nvlink.efficiency"],
        "nvlink_lat": 2 * C["nvlink.latency_s"],  # gpu -> NVSwitch -> gpu
        "inter_bw": min(nic_bw, ds.pcie_bidir / 2),  # the NIC, or PCIe where it is slower
        "same_rail_lat": host + C["rail.leaf_latency_s"],
        "cross_rail_lat": host + C["ib.switch_latency_s"],  # leaf, spine, leaf
    }


@functools.cache
def _planner(name: str, algorithm: str = "pairwise") -> CollectivePlanner:
    return CollectivePlanner(Cluster.from_cluster_preset(name).topology, all_to_all=algorithm)


@pytest.mark.parametrize("node", ["h100-sxm", "b200", "a100-80gb-sxm"])
@pytest.mark.parametrize("nodes", [2, 4, 8])
def test_multinode_presets_are_nodes_of_eight_gpus_on_a_rail_optimised_400g_network(node, nodes):
    cluster = Cluster.from_cluster_preset(f"{node}-{nodes}x8")
    assert cluster.nodes == nodes and cluster.devices_per_node == 8 and cluster.world_size == 8 * nodes
    assert cluster.preset.name == node and cluster.network.rail_optimized
    assert cluster.network.nic.bandwidth_bytes_per_s == pytest.approx(50 * GB)
    assert cluster.describe()["network"] == "ib-ndr-400-rail" and cluster.describe()["all_to_all"] == "pairwise"


def test_multinode_unknown_cluster_preset_lists_the_valid_names():
    with pytest.raises(ValueError, match="h100-sxm-2x8"):
        get_cluster_preset("h100-sxm-3x8")
    with pytest.raises(ValueError, match="hierarchical"):
        Cluster.from_cluster_preset("h100-sxm-2x8", all_to_all="tree")


@pytest.mark.parametrize("name", sorted(CLUSTER_PRESETS))
def test_multinode_every_link_figure_has_a_band_and_a_source_and_is_the_one_the_topology_uses(name):
    spec = get_cluster_preset(name)
    prov = spec.provenance()
    for u in prov.values():
        assert u.low <= u.nominal <= u.high and len(u.provenance) > 20, u.name
    # Every constant the cluster reads, and nothing the sensitivity study cannot move, is listed.
    movable = set(constants_for(DATASHEETS[spec.node].arch, "nvlink", rail_optimized=True))
    assert {k for k in prov if not k.endswith("bandwidth_bytes_per_s")} <= movable
    p = {k: u.nominal for k, u in prov.items()}
    links = Cluster.from_cluster_preset(name).topology.links
    by_kind = {kind: {(link.bandwidth_bytes_per_s, link.latency_s) for link in links if link.kind == kind}
               for kind in {link.kind for link in links}}
    assert set(by_kind) == {"nvswitch", "pcie", "network", "spine", "host"}  # host: device <-> host memory
    (nvswitch,), (pcie,), (network,), (spine,) = (by_kind[k] for k in ("nvswitch", "pcie", "network", "spine"))
    assert nvswitch == pytest.approx((p["nvlink.bandwidth_bytes_per_s"] * p["nvlink.efficiency"],
                                      p["nvlink.latency_s"]))
    assert pcie == pytest.approx((p["pcie.bandwidth_bytes_per_s"], p["pcie.latency_s"]))
    assert network == pytest.approx((p["nic.bandwidth_bytes_per_s"] * p["ib.efficiency"],
                                     p["ib.nic_latency_s"] + p["rail.leaf_latency_s"] / 2))
    assert spine == pytest.approx((spec.nodes * p["nic.bandwidth_bytes_per_s"] * p["ib.efficiency"],
                                   (p["ib.switch_latency_s"] - p["rail.leaf_latency_s"]) / 2))


@pytest.mark.parametrize("node", ["h100-sxm", "a100-80gb-sxm"])
def test_multinode_routes_stay_on_a_rail_cross_rails_through_the_spine_and_never_through_a_third_gpu(node):
    topo = Cluster.from_cluster_preset(f"{node}-2x8").topology
    f = _figures(node)
    kinds = [topo.links[i].kind for i in topo.path(3, 11)]
    assert kinds == ["pcie", "pcie", "network", "network", "pcie", "pcie"]
    assert topo.path_latency_s(3, 11) == pytest.approx(f["same_rail_lat"])
    kinds = [topo.links[i].kind for i in topo.path(3, 12)]
    assert kinds == ["pcie", "pcie", "network", "spine", "spine", "network", "pcie", "pcie"]
    assert topo.path_latency_s(3, 12) == pytest.approx(f["cross_rail_lat"])
    assert topo.bottleneck_bandwidth_bytes_per_s(3, 12) == pytest.approx(f["inter_bw"])
    assert topo.path_latency_s(3, 4) == pytest.approx(f["nvlink_lat"])
    for a, b in itertools.permutations(range(16), 2):
        inner = [topo.links[i].dst for i in topo.path(a, b)][:-1]
        assert not any(n.startswith("gpu") for n in inner), (a, b, inner)


@pytest.mark.parametrize("node", ["h100-sxm", "a100-80gb-sxm"])
@pytest.mark.parametrize("nbytes", [4096, 64 * 2**20])
def test_multinode_all_to_all_times_by_hand(node, nbytes):
    topo = Cluster.from_cluster_preset(f"{node}-2x8").topology
    f = _figures(node)
    pairwise, hierarchical = CollectivePlanner(topo), CollectivePlanner(topo, all_to_all="hierarchical")
    # One node, 8 ranks: both algorithms are 7 steps over NVSwitch, 7/8 of the buffer out of each GPU.
    one_node = 7 * f["nvlink_lat"] + nbytes * 7 / 8 / f["nvlink_bw"]
    for planner in (pairwise, hierarchical):
        assert planner.isolated_time_s("all_to_all", range(8), nbytes) == pytest.approx(one_node)
    # Pairwise over 16 ranks on 2 nodes: 15 steps of the slowest (cross-rail) route; half the buffer leaves each
    # GPU through its NIC, concurrently with 7/16 over NVLink (not the bottleneck).
    expected = 15 * f["cross_rail_lat"] + nbytes * (8 / 16) / f["inter_bw"]
    assert pairwise.isolated_time_s("all_to_all", range(16), nbytes) == pytest.approx(expected)
    # Hierarchical: 7 NVLink steps moving 7/8 of the buffer, then 1 step on the rail moving half of it.
    expected = (7 * f["nvlink_lat"] + nbytes * 7 / 8 / f["nvlink_bw"]
                + 1 * f["same_rail_lat"] + nbytes * (1 / 2) / f["inter_bw"])
    assert hierarchical.isolated_time_s("all_to_all", range(16), nbytes) == pytest.approx(expected)
    assert len(hierarchical.plan("all_to_all", (tuple(range(16)),)).phases) == 2
    # One rank per node (a group across nodes on one rail): both algorithms are the same single exchange.
    rail = (2, 10)
    expected = f["same_rail_lat"] + nbytes / 2 / f["inter_bw"]
    for planner in (pairwise, hierarchical):
        assert planner.isolated_time_s("all_to_all", rail, nbytes) == pytest.approx(expected)


@pytest.mark.parametrize("node", ["h100-sxm", "a100-80gb-sxm"])
def test_multinode_ring_p2p_by_hand_intra_and_inter_node_neighbours(node):
    topo = Cluster.from_cluster_preset(f"{node}-2x8").topology
    f = _figures(node)
    planner = CollectivePlanner(topo)
    n = 8 * 2**20
    intra = f["nvlink_lat"] + n / f["nvlink_bw"]
    same_rail = f["same_rail_lat"] + n / f["inter_bw"]
    cross_rail = f["cross_rail_lat"] + n / f["inter_bw"]
    assert planner.isolated_time_s("send", (0, 1), n) == pytest.approx(intra)
    assert planner.isolated_time_s("send", (0, 8), n) == pytest.approx(same_rail)
    assert planner.isolated_time_s("send", (7, 8), n) == pytest.approx(cross_rail)
    # A ring step moves every member's chunk at once: as slow as its slowest neighbour pair.
    assert planner.ring_step_time_s(range(8), n) == pytest.approx(intra)
    assert planner.ring_step_time_s(range(16), n) == pytest.approx(cross_rail)  # 7 -> 8 and 15 -> 0
    assert planner.ring_step_time_s((0, 8), n) == pytest.approx(same_rail)  # a ring across nodes on one rail
    assert planner.ring_step_time_s((5,), n) == 0.0


@pytest.mark.parametrize("algorithm", ["pairwise", "hierarchical"])
@pytest.mark.parametrize("nbytes", [4096, 2**20, 64 * 2**20])
def test_multinode_all_to_all_properties(algorithm, nbytes):
    def per_byte(name: str, members) -> float:
        return _planner(name, algorithm).isolated_time_s("all_to_all", members, nbytes) / nbytes

    # Crossing nodes costs more per byte than staying on NVLink, and more nodes never make it cheaper.
    assert per_byte("h100-sxm-2x8", range(16)) > per_byte("h100-sxm-2x8", range(8))
    assert per_byte("h100-sxm-4x8", range(32)) >= per_byte("h100-sxm-2x8", range(16))
    assert per_byte("h100-sxm-8x8", range(64)) >= per_byte("h100-sxm-4x8", range(32))
    # The A100's PCIe Gen4 caps its 400 Gb/s NIC below the H100's.
    assert per_byte("a100-80gb-sxm-2x8", range(16)) > per_byte("h100-sxm-2x8", range(16))


def test_multinode_hierarchical_wins_when_latency_bound_and_pairwise_when_bandwidth_bound():
    pairwise, hierarchical = _planner("h100-sxm-8x8"), _planner("h100-sxm-8x8", "hierarchical")
    world = range(64)
    small, large = 64 * 2**10, 256 * 2**20
    assert hierarchical.isolated_time_s("all_to_all", world, small) < pairwise.isolated_time_s("all_to_all", world,
                                                                                               small)
    assert pairwise.isolated_time_s("all_to_all", world, large) < hierarchical.isolated_time_s("all_to_all", world,
                                                                                               large)


def test_multinode_hierarchical_refuses_a_group_spread_unevenly_over_nodes():
    planner = _planner("h100-sxm-2x8", "hierarchical")
    with pytest.raises(ValueError, match="same number of members on every node"):
        planner.plan("all_to_all", ((0, 1, 2, 8),))


def _all_to_all_workload(world: int, nbytes: int) -> Workload:
    b = ProgramBuilder()
    b.collective("a2a", kind="all_to_all", group="sp", message_bytes=nbytes)
    return Workload(name="a2a", world_size=world, groups={"sp": [list(range(world))]}, ranks={0: b.build()},
                    symmetric=True)


def _ring_workload(world: int, nbytes: int) -> Workload:
    programs = {}
    for r in range(world):
        b = ProgramBuilder()
        send = b.start("send", kind="send", group="ring", message_bytes=nbytes, peer=(r + 1) % world, key=f"k{r}")
        recv = b.start("recv", kind="recv", group="ring_recv", message_bytes=nbytes, peer=(r - 1) % world,
                       key=f"k{(r - 1) % world}")
        b.wait(send)
        b.wait(recv)
        programs[r] = b.build()
    return Workload(name="ring", world_size=world, groups={"ring": [list(range(world))],
                                                           "ring_recv": [list(range(world))]}, ranks=programs)


@pytest.mark.parametrize("algorithm", ["pairwise", "hierarchical"])
def test_multinode_engine_runs_the_planned_phases(algorithm):
    cluster = Cluster.from_cluster_preset("h100-sxm-2x8", all_to_all=algorithm)
    planner = CollectivePlanner(cluster.topology, all_to_all=algorithm)
    nbytes = 16 * 2**20
    result = simulate(_all_to_all_workload(16, nbytes), cluster)
    assert result.step_time_s == pytest.approx(planner.isolated_time_s("all_to_all", range(16), nbytes))
    ring = simulate(_ring_workload(16, nbytes), cluster)
    assert ring.step_time_s == pytest.approx(planner.ring_step_time_s(range(16), nbytes))


def test_multinode_cli_runs_a_named_cluster_with_the_chosen_all_to_all(tmp_path):
    from simulator.__main__ import main

    path = tmp_path / "a2a.json"
    _all_to_all_workload(16, 2**20).to_json(path)
    assert main([str(path), "--cluster", "h100-sxm-2x8", "--all-to-all", "hierarchical", "--out",
                 str(tmp_path / "out"), "--no-plots"]) == 0
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["cluster"]["nodes"] == 2 and result["cluster"]["network"] == "ib-ndr-400-rail"
    assert result["cluster"]["all_to_all"] == "hierarchical"
    expected = _planner("h100-sxm-2x8", "hierarchical").isolated_time_s("all_to_all", range(16), 2**20)
    assert result["step_time_s"] == pytest.approx(expected)
