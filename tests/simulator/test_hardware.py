"""Hardware presets, the calibrated cpu-gloo preset, clusters and their topology graphs."""

from __future__ import annotations

import json

import pytest

from simulator import Cluster, get_preset, load_cpu_gloo, preset_names
from simulator.hardware import CPU_GLOO_JSON, PRESETS, preset_from_dict

GB = 1e9


def test_hardware_all_required_presets_exist():
    assert set(preset_names()) >= {"a100-80gb-sxm", "h100-sxm", "h200-sxm", "gh200", "mi250", "cpu-gloo"}


@pytest.mark.parametrize(("name", "tflops", "hbm_gb_s", "mem_gib", "nvlink_dir_gb_s"), [
    ("a100-80gb-sxm", 312, 2039, 80, 300),
    ("h100-sxm", 989, 3350, 80, 450),
    ("h200-sxm", 989, 4800, 141, 450),
])
def test_hardware_nvidia_presets_follow_their_datasheets(name, tflops, hbm_gb_s, mem_gib, nvlink_dir_gb_s):
    preset = get_preset(name)
    assert preset.device.peak_flops_per_s == pytest.approx(tflops * 1e12)
    assert preset.device.memory_bandwidth_bytes_per_s == pytest.approx(hbm_gb_s * GB)
    assert preset.device.memory_bytes == mem_gib * 2**30
    assert preset.intra_node.bandwidth_bytes_per_s == pytest.approx(nvlink_dir_gb_s * GB)  # per direction
    assert preset.devices_per_node == 8
    assert preset.sources and not preset.calibrated


def test_hardware_every_preset_has_efficiencies_for_every_op_class():
    from simulator.workload import OP_CLASSES

    for name in preset_names():
        device = get_preset(name).device
        for op_class in OP_CLASSES:
            eff = device.efficiency_for(op_class)
            assert 0 < eff.flops <= 1 and 0 < eff.memory <= 1


def test_hardware_cpu_gloo_preset_loads_from_the_shipped_json():
    preset = load_cpu_gloo()
    doc = json.loads(CPU_GLOO_JSON.read_text())
    assert preset.name == "cpu-gloo"
    assert preset.calibrated == doc["calibrated"]
    assert preset.device.peak_flops_per_s > 0 and preset.intra_node.bandwidth_bytes_per_s > 0
    assert preset.network is None


def test_hardware_malformed_preset_document_says_how_to_regenerate():
    with pytest.raises(ValueError, match="calibrate_cpu"):
        preset_from_dict({"name": "cpu-gloo"})


def test_hardware_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError, match="a100-80gb-sxm"):
        get_preset("tpu-v9")


def test_hardware_cluster_routes_intra_node_traffic_over_the_node_fabric():
    cluster = Cluster.from_preset("a100-80gb-sxm", nodes=2)
    topo = cluster.topology
    kinds = [topo.links[i].kind for i in topo.path(0, 5)]
    assert kinds == ["nvswitch", "nvswitch"]
    assert topo.bottleneck_bandwidth_bytes_per_s(0, 5) == pytest.approx(300 * GB * 0.8)
    assert topo.path_latency_s(0, 5) == pytest.approx(2e-6)


def test_hardware_cluster_routes_inter_node_traffic_over_pcie_and_the_nic():
    cluster = Cluster.from_preset("a100-80gb-sxm", nodes=2)
    topo = cluster.topology
    kinds = [topo.links[i].kind for i in topo.path(1, 9)]
    assert kinds == ["pcie", "pcie", "network", "network", "pcie", "pcie"]
    assert topo.bottleneck_bandwidth_bytes_per_s(1, 9) == pytest.approx(25 * GB * 0.9)  # HDR 200 Gb/s
    assert cluster.world_size == 16 and cluster.node_of(9) == 1


def test_hardware_cluster_network_can_be_overridden():
    cluster = Cluster.from_preset("a100-80gb-sxm", nodes=2, network="ib-ndr-400")
    # A 400 Gb/s NIC behind the A100's PCIe Gen4 x16 (32 GB/s per direction) is PCIe-bound.
    assert cluster.topology.bottleneck_bandwidth_bytes_per_s(0, 8) == pytest.approx(32 * GB)
    faster = Cluster.from_preset("h100-sxm", nodes=2, network="ib-ndr-400")
    assert faster.topology.bottleneck_bandwidth_bytes_per_s(0, 8) == pytest.approx(50 * GB * 0.9)
    assert cluster.describe()["network"] == "ib-ndr-400"


def test_hardware_single_node_preset_refuses_several_nodes():
    with pytest.raises(ValueError, match="no inter-node network"):
        Cluster.from_preset("cpu-gloo", nodes=2)


@pytest.mark.parametrize("kwargs", [{"nodes": 0}, {"devices_per_node": 0}])
def test_hardware_cluster_rejects_non_positive_sizes(kwargs):
    with pytest.raises(ValueError, match="positive"):
        Cluster.from_preset("h100-sxm", **kwargs)


def test_hardware_presets_cite_a_datasheet():
    for preset in PRESETS.values():
        assert any("datasheet" in s.lower() for s in preset.sources), preset.name
