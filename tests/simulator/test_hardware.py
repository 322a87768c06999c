"""Hardware presets, the calibrated cpu-gloo preset, clusters and their topology graphs."""

from __future__ import annotations

import json

import pytest

from simulator import Cluster, get_preset, load_cpu_gloo, preset_names
from simulator.gpu_constants import ARCHITECTURES, GPU_CONSTANTS, constants_for
from simulator.hardware import CPU_GLOO_JSON, PRESETS, preset_from_dict

GB = 1e9


def test_hardware_all_required_presets_exist():
    assert set(preset_names()) >= {"a100-80gb-sxm", "h100-sxm", "h200-sxm", "gh200", "b200", "mi250", "mi300x",
                                   "cpu-gloo"}


@pytest.mark.parametrize(("name", "tflops", "hbm_gb_s", "mem_gib", "nvlink_dir_gb_s"), [
    ("a100-80gb-sxm", 312, 2039, 80, 300),
    ("h100-sxm", 989, 3350, 80, 450),
    ("h200-sxm", 989, 4800, 141, 450),
    ("b200", 2250, 8000, 180, 900),  # DGX B200: 1,440 GB for 8 GPUs, NVLink 5 1.8 TB/s bidirectional
])
def test_hardware_nvidia_presets_follow_their_datasheets(name, tflops, hbm_gb_s, mem_gib, nvlink_dir_gb_s):
    preset = get_preset(name)
    assert preset.device.peak_flops_per_s == pytest.approx(tflops * 1e12)
    assert preset.device.memory_bandwidth_bytes_per_s == pytest.approx(hbm_gb_s * GB)
    assert preset.device.memory_bytes == mem_gib * 2**30
    assert preset.intra_node.bandwidth_bytes_per_s == pytest.approx(nvlink_dir_gb_s * GB)  # per direction
    assert preset.devices_per_node == 8
    assert preset.sources and not preset.calibrated


def test_hardware_b200_and_mi300x_follow_their_datasheets():
    b200, mi300x = get_preset("b200"), get_preset("mi300x")
    assert (b200.architecture, b200.intra_node_kind, b200.network.name) == ("blackwell", "nvswitch", "ib-ndr-400")
    # MI300X: BF16 dense 1,307.4 TFLOP/s, 192 GB HBM3 at 5.3 TB/s, 7 Infinity Fabric links of 128 GB/s
    # bidirectional to its 7 peers (896 GB/s), modelled as a switch: 448 GB/s per direction
    assert mi300x.device.peak_flops_per_s == pytest.approx(1307.4e12)
    assert mi300x.device.memory_bandwidth_bytes_per_s == pytest.approx(5300 * GB)
    assert mi300x.device.memory_bytes == 192 * 2**30
    assert mi300x.intra_node.bandwidth_bytes_per_s == pytest.approx(448 * GB)
    assert (mi300x.architecture, mi300x.intra_node_kind, mi300x.devices_per_node) == ("cdna3", "xgmi", 8)
    assert mi300x.network.name == "ib-ndr-400" and "switch" in mi300x.notes and "assumption" in mi300x.notes
    for preset in (b200, mi300x):
        assert preset.host_link.bandwidth_bytes_per_s == pytest.approx(64 * GB)  # PCIe Gen5 x16, per direction
        assert preset.sources and not preset.calibrated
        # one 400 Gb/s NIC per GPU behind PCIe Gen5: inter-node traffic is NIC-bound
        cluster = Cluster.from_preset(preset, nodes=2)
        assert cluster.topology.bottleneck_bandwidth_bytes_per_s(0, 8) == pytest.approx(
            50 * GB * GPU_CONSTANTS["ib.efficiency"].nominal)


def test_hardware_every_architecture_has_its_kernel_constants():
    from simulator.hardware import DATASHEETS

    assert {ds.arch for ds in DATASHEETS.values()} == set(ARCHITECTURES)
    for arch in ARCHITECTURES:
        for kernel in ("matmul", "attention"):
            u = GPU_CONSTANTS[f"{arch}.{kernel}.flops"]
            assert 0 < u.low <= u.nominal <= u.high <= 1 and len(u.provenance) > 40, u.name
            assert u.name in constants_for(arch, "nvlink")
    # the new architectures' kernel fractions are not measured at the traced shapes: flagged, with their sources
    for arch in ("blackwell", "cdna3"):
        assert all(GPU_CONSTANTS[f"{arch}.{k}.flops"].assumption for k in ("matmul", "attention"))
    assert "Maximum Achievable Matmul FLOPS" in GPU_CONSTANTS["blackwell.matmul.flops"].provenance
    assert "FlashAttention-4" in GPU_CONSTANTS["blackwell.attention.flops"].provenance
    assert "MI300X" in GPU_CONSTANTS["cdna3.matmul.flops"].provenance
    with pytest.raises(ValueError, match="cdna3"):
        constants_for("rdna3", "xgmi")


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
