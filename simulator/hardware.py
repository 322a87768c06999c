"""Hardware descriptions: devices, links, inter-node networks and named presets built from public datasheets.

A :class:`HardwarePreset` bundles one :class:`DeviceSpec` (peak FLOP/s, memory bandwidth and capacity, launch
overhead, per-op-class efficiencies), the intra-node fabric a device sees (NVSwitch, Infinity Fabric, loopback),
the host link on the path to the NIC (PCIe) and a default inter-node :class:`NetworkSpec`. Bandwidths are per
direction (a "600 GB/s bidirectional" NVLink figure becomes 300 GB/s). Presets: ``a100-80gb-sxm``, ``h100-sxm``,
``h200-sxm``, ``gh200``, ``mi250`` and ``cpu-gloo``, the last loaded from ``presets/cpu_gloo.json`` as written by
``python -m experiments.calibrate_cpu``. The efficiencies of the GPU presets are uncalibrated defaults; replace them
with :func:`dataclasses.replace` or :meth:`DeviceSpec.with_efficiency` after measuring.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GB = 1e9
GIB = 2**30
CPU_GLOO_JSON = Path(__file__).resolve().parent / "presets" / "cpu_gloo.json"


@dataclass(frozen=True, kw_only=True)
class OpClassEfficiency:
    """Achieved fraction of a device's peaks for one op class."""

    flops: float
    """Fraction of ``peak_flops_per_s`` reached when the op is compute-bound."""
    memory: float
    """Fraction of ``memory_bandwidth_bytes_per_s`` reached when the op is memory-bound."""


# Uncalibrated defaults for GPUs. Elementwise/reduction/other kernels run on the vector units, not the tensor
# cores: non-tensor FP32 peak is ~6 % of the dense BF16 tensor peak on A100 (19.5 vs 312 TFLOP/s) and H100
# (67 vs 989), hence 0.06.
DEFAULT_GPU_EFFICIENCY: Mapping[str, OpClassEfficiency] = {
    "matmul": OpClassEfficiency(flops=0.70, memory=0.80),
    "attention": OpClassEfficiency(flops=0.50, memory=0.80),
    "elementwise": OpClassEfficiency(flops=0.06, memory=0.80),
    "reduction": OpClassEfficiency(flops=0.06, memory=0.70),
    "memory": OpClassEfficiency(flops=1.00, memory=0.85),
    "other": OpClassEfficiency(flops=0.06, memory=0.60),
}


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator (or one CPU process for ``cpu-gloo``)."""

    name: str
    """Marketing name, for reports."""
    peak_flops_per_s: float
    """Dense peak of the training dtype (BF16 tensor cores on GPUs; measured FP32 matmul on CPU)."""
    memory_bandwidth_bytes_per_s: float
    """Peak device-memory (HBM) bandwidth."""
    memory_bytes: int
    """Device-memory capacity usable by the program."""
    kernel_launch_overhead_s: float
    """Fixed cost added to every compute op that does any work."""
    graph_call_overhead_s: float = 0.0
    """Host time of entering one compiled graph (guards, runtime wrappers, autograd engine), charged once per
    phase before its first compute op; 0 on GPUs, where it hides behind queued kernels (see ``cpu-gloo``)."""
    view_op_overhead_s: float = 0.0
    """Host time of an op that moves no data (a view: reshape, transpose, getitem). 0 on GPUs, where the host
    issues views ahead of the kernels; on a CPU running an eager FX graph every node is a dispatcher call."""
    attention_score_time_s: float = 0.0
    """Time per attention score (one query-key pair, see :attr:`simulator.workload.Op.attention_scores`) added
    to an attention op's roofline time: the softmax work (max, exp, sum, rescale) of a fused attention kernel,
    which does not shrink with the head dimension as the matmul FLOPs do. 0 on GPUs, where FlashAttention
    overlaps it with the tensor-core matmuls; calibrated on CPU, where it dominates small head dimensions."""
    efficiency: Mapping[str, OpClassEfficiency] = field(default_factory=lambda: dict(DEFAULT_GPU_EFFICIENCY))
    """Op class -> achieved fractions of the peaks; a class missing here uses ``"other"``."""

    def efficiency_for(self, op_class: str) -> OpClassEfficiency:
        """The efficiency of ``op_class`` (falling back to ``"other"``)."""
        eff = self.efficiency.get(op_class) or self.efficiency.get("other")
        if eff is None:
            raise ValueError(f"device {self.name!r} has no efficiency for {op_class!r} and no 'other' fallback")
        return eff

    def with_efficiency(self, **classes: OpClassEfficiency) -> DeviceSpec:
        """A copy with the given op classes' efficiencies replaced."""
        return dataclasses.replace(self, efficiency={**self.efficiency, **classes})


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """One direction of a point-to-point link."""

    bandwidth_bytes_per_s: float
    """Peak bandwidth in one direction."""
    latency_s: float
    """Effective per-hop latency, protocol overhead included (the alpha of each hop)."""
    efficiency: float = 1.0
    """Achievable fraction of the peak bandwidth (e.g. NCCL bus bandwidth / link peak)."""

    @property
    def effective_bandwidth_bytes_per_s(self) -> float:
        """``bandwidth_bytes_per_s * efficiency``."""
        return self.bandwidth_bytes_per_s * self.efficiency


@dataclass(frozen=True, kw_only=True)
class NetworkSpec:
    """The inter-node network: one NIC per device into a non-blocking fat tree."""

    name: str
    """Preset name, e.g. ``"ib-ndr-400"``."""
    nic: LinkSpec
    """One device's NIC port, per direction."""
    switch_latency_s: float
    """Latency through the fabric (all switch hops of the fat tree together)."""
    source: str = ""
    """Datasheet the figures come from."""


@dataclass(frozen=True, kw_only=True)
class HardwarePreset:
    """A node type: device, fabrics and where the numbers come from."""

    name: str
    """Preset name used on the command line."""
    device: DeviceSpec
    """The accelerator."""
    devices_per_node: int
    """Devices (ranks) per node."""
    intra_node_kind: str
    """``"nvswitch"``, ``"xgmi"`` or ``"loopback"``: the node-local fabric, modelled as a non-blocking switch."""
    intra_node: LinkSpec
    """A device's link into the node-local fabric, per direction."""
    host_link: LinkSpec | None
    """Device <-> PCIe switch <-> NIC hop (``None`` when the preset has no NIC)."""
    network: NetworkSpec | None
    """Default inter-node network (``None``: single node only)."""
    sources: tuple[str, ...] = ()
    """Datasheets and documents the figures come from."""
    calibrated: bool = False
    """True when the figures were measured on the target (see ``experiments/calibrate_cpu.py``)."""
    notes: str = ""
    """Modelling simplifications worth knowing."""
    collectives_in_flight: int = 1
    """How many collectives one rank's stream of one process group runs at once. NCCL runs a communicator's
    collectives one after another on its stream (1); gloo's ProcessGroupGloo hands asynchronous work to a pool of
    worker threads (2 by default, ``ProcessGroupGloo.Options.threads``), so two collectives started back to back
    are in flight together (their latencies overlap, their bytes share the links)."""


NETWORKS: dict[str, NetworkSpec] = {
    # NVIDIA ConnectX-6 / Quantum HDR InfiniBand product briefs: 200 Gb/s per port = 25 GB/s per direction.
    "ib-hdr-200": NetworkSpec(name="ib-hdr-200", nic=LinkSpec(bandwidth_bytes_per_s=25 * GB, latency_s=2.5e-6,
                                                             efficiency=0.9),
                              switch_latency_s=0.6e-6, source="NVIDIA ConnectX-6 VPI product brief (HDR 200 Gb/s)"),
    # NVIDIA ConnectX-7 / Quantum-2 NDR InfiniBand product briefs: 400 Gb/s per port = 50 GB/s per direction.
    "ib-ndr-400": NetworkSpec(name="ib-ndr-400", nic=LinkSpec(bandwidth_bytes_per_s=50 * GB, latency_s=2.5e-6,
                                                             efficiency=0.9),
                              switch_latency_s=0.6e-6, source="NVIDIA ConnectX-7 product brief (NDR 400 Gb/s)"),
}

_NVLINK_EFF = 0.8  # NCCL all-reduce bus bandwidth reaches ~80 % of NVLink peak on DGX A100/H100 (nccl-tests).


def _nvidia(name: str, *, flops: float, hbm: float, mem: int, nvlink_bidir: float, pcie_bidir: float,
            per_node: int, network: str, sources: tuple[str, ...], notes: str = "") -> HardwarePreset:
    return HardwarePreset(
        name=name,
        device=DeviceSpec(name=name, peak_flops_per_s=flops, memory_bandwidth_bytes_per_s=hbm, memory_bytes=mem,
                          kernel_launch_overhead_s=4e-6),
        devices_per_node=per_node,
        intra_node_kind="nvswitch",
        intra_node=LinkSpec(bandwidth_bytes_per_s=nvlink_bidir / 2, latency_s=1.0e-6, efficiency=_NVLINK_EFF),
        host_link=LinkSpec(bandwidth_bytes_per_s=pcie_bidir / 2, latency_s=0.5e-6),
        network=NETWORKS[network],
        sources=sources,
        notes=notes,
    )


PRESETS: dict[str, HardwarePreset] = {
    # NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM): BF16 tensor 312 TFLOP/s dense, HBM2e 2,039 GB/s, 80 GB,
    # NVLink 3 600 GB/s bidirectional, PCIe Gen4 64 GB/s. DGX A100 datasheet: 8 GPUs on NVSwitch, 8x ConnectX-6 HDR.
    "a100-80gb-sxm": _nvidia("a100-80gb-sxm", flops=312e12, hbm=2039 * GB, mem=80 * GIB, nvlink_bidir=600 * GB,
                             pcie_bidir=64 * GB, per_node=8, network="ib-hdr-200",
                             sources=("NVIDIA A100 Tensor Core GPU datasheet", "NVIDIA DGX A100 datasheet")),
    # NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): BF16 1,979 TFLOP/s with sparsity = 989 dense, HBM3 3.35 TB/s,
    # 80 GB, NVLink 4 900 GB/s, PCIe Gen5 128 GB/s. DGX H100 datasheet: 8 GPUs, 4 NVSwitch, 8x ConnectX-7 NDR.
    "h100-sxm": _nvidia("h100-sxm", flops=989e12, hbm=3350 * GB, mem=80 * GIB, nvlink_bidir=900 * GB,
                        pcie_bidir=128 * GB, per_node=8, network="ib-ndr-400",
                        sources=("NVIDIA H100 Tensor Core GPU datasheet", "NVIDIA DGX H100 datasheet")),
    # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): BF16 989 TFLOP/s dense, HBM3e 4.8 TB/s, 141 GB, NVLink 900 GB/s,
    # PCIe Gen5 128 GB/s; HGX H200: 8 GPUs on NVSwitch.
    "h200-sxm": _nvidia("h200-sxm", flops=989e12, hbm=4800 * GB, mem=141 * GIB, nvlink_bidir=900 * GB,
                        pcie_bidir=128 * GB, per_node=8, network="ib-ndr-400",
                        sources=("NVIDIA H200 Tensor Core GPU datasheet",)),
    # NVIDIA GH200 Grace Hopper Superchip datasheet: H100 GPU, BF16 989 TFLOP/s dense, 96 GB HBM3 at 4 TB/s, NVLink-C2C
    # 900 GB/s to Grace. Quad-GH200 nodes (e.g. HPE Cray EX254n) join the four GPUs all-to-all with NVLink 4
    # (18 links, 900 GB/s bidirectional per GPU), modelled as a switch.
    "gh200": _nvidia("gh200", flops=989e12, hbm=4000 * GB, mem=96 * GIB, nvlink_bidir=900 * GB, pcie_bidir=128 * GB,
                     per_node=4, network="ib-ndr-400",
                     sources=("NVIDIA GH200 Grace Hopper Superchip datasheet",),
                     notes="4 superchips per node; the all-to-all NVLink mesh is modelled as a non-blocking switch"),
    # AMD Instinct MI250 datasheet (OAM): BF16 362.1 TFLOP/s, 128 GB HBM2e at 3.2768 TB/s, two GCDs per module, each
    # seen by ROCm as one device. ROCm "MI250 microarchitecture": each Infinity Fabric link carries 50 GB/s per
    # direction. One device here is one GCD (half the module): 181 TFLOP/s, 1.6384 TB/s, 64 GB; 8 GCDs per node.
    "mi250": HardwarePreset(
        name="mi250",
        device=DeviceSpec(name="mi250 (one GCD)", peak_flops_per_s=181.05e12, memory_bandwidth_bytes_per_s=1638.4 * GB,
                          memory_bytes=64 * GIB, kernel_launch_overhead_s=5e-6),
        devices_per_node=8,
        intra_node_kind="xgmi",
        intra_node=LinkSpec(bandwidth_bytes_per_s=100 * GB, latency_s=1.5e-6, efficiency=0.7),
        host_link=LinkSpec(bandwidth_bytes_per_s=32 * GB, latency_s=0.5e-6),
        network=NETWORKS["ib-hdr-200"],
        sources=("AMD Instinct MI250 accelerator datasheet", "ROCm documentation: AMD Instinct MI250 microarchitecture"),
        notes="the partial Infinity Fabric mesh is modelled as a switch with 2 links (100 GB/s) per GCD",
    ),
}


def preset_from_dict(data: Mapping[str, Any]) -> HardwarePreset:
    """Build a preset from the JSON layout written by ``experiments/calibrate_cpu.py``."""
    try:
        dev = data["device"]
        device = DeviceSpec(
            name=str(dev["name"]),
            peak_flops_per_s=float(dev["peak_flops_per_s"]),
            memory_bandwidth_bytes_per_s=float(dev["memory_bandwidth_bytes_per_s"]),
            memory_bytes=int(dev["memory_bytes"]),
            kernel_launch_overhead_s=float(dev["kernel_launch_overhead_s"]),
            graph_call_overhead_s=float(dev.get("graph_call_overhead_s", 0.0)),
            view_op_overhead_s=float(dev.get("view_op_overhead_s", 0.0)),
            attention_score_time_s=float(dev.get("attention_score_time_s", 0.0)),
            efficiency={k: OpClassEfficiency(flops=float(v["flops"]), memory=float(v["memory"]))
                        for k, v in dev["efficiency"].items()},
        )
        link = data["intra_node"]
        return HardwarePreset(
            name=str(data["name"]),
            device=device,
            devices_per_node=int(data["devices_per_node"]),
            intra_node_kind=str(data.get("intra_node_kind", "loopback")),
            intra_node=LinkSpec(bandwidth_bytes_per_s=float(link["bandwidth_bytes_per_s"]),
                                latency_s=float(link["latency_s"]), efficiency=float(link.get("efficiency", 1.0))),
            host_link=None,
            network=None,
            sources=tuple(data.get("sources", ())),
            calibrated=bool(data["calibrated"]),
            notes=str(data.get("notes", "")),
            collectives_in_flight=int(data.get("collectives_in_flight", 1)),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"malformed hardware preset document ({exc!r}); regenerate it with "
                         "python -m experiments.calibrate_cpu") from None


def load_cpu_gloo(path: str | Path | None = None) -> HardwarePreset:
    """The ``cpu-gloo`` preset from ``path`` (default: the JSON shipped in ``simulator/presets``)."""
    path = Path(path) if path is not None else CPU_GLOO_JSON
    with open(path, encoding="utf-8") as fh:
        return preset_from_dict(json.load(fh))


def preset_names() -> tuple[str, ...]:
    """All preset names accepted by :func:`get_preset`."""
    return (*PRESETS, "cpu-gloo")


def get_preset(name: str) -> HardwarePreset:
    """The preset called ``name``; raises ``ValueError`` listing the valid names otherwise."""
    if name == "cpu-gloo":
        return load_cpu_gloo()
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown hardware preset {name!r}; choose one of {', '.join(preset_names())}") from None


def get_network(name: str) -> NetworkSpec:
    """The inter-node network called ``name``; raises ``ValueError`` listing the valid names otherwise."""
    try:
        return NETWORKS[name]
    except KeyError:
        raise ValueError(f"unknown network {name!r}; choose one of {', '.join(NETWORKS)}") from None
