"""Hardware descriptions: devices, links, inter-node networks and named presets built from public datasheets.

A :class:`HardwarePreset` bundles one :class:`DeviceSpec` (peak FLOP/s, memory bandwidth and capacity, launch
overhead, per-op-class efficiencies), the intra-node fabric a device sees (NVSwitch, Infinity Fabric, loopback),
the host link on the path to the NIC (PCIe), the host memory of a node and the device's link to it (PCIe or
NVLink-C2C, :attr:`HardwarePreset.host_memory_link`: what optimizer offload moves over) and a default inter-node
:class:`NetworkSpec`. Bandwidths are per
direction (a "600 GB/s bidirectional" NVLink figure becomes 300 GB/s). Presets: ``a100-80gb-sxm``, ``h100-sxm``,
``h200-sxm``, ``gh200``, ``b200``, ``mi250``, ``mi300x`` and ``cpu-gloo``, the last loaded from
``presets/cpu_gloo.json`` as written by ``python -m experiments.calibrate_cpu``. The GPU presets' datasheet figures,
each beside its source, are :data:`simulator.datasheets.DATASHEETS`; every efficiency and latency
constant of the GPU presets comes from :data:`simulator.gpu_constants.GPU_CONSTANTS` (value, band, provenance), and
:func:`build_preset` rebuilds a preset with any of them moved (what ``--sensitivity`` does). GPU presets price
pointwise/reduction chains as Inductor's fused kernels (:mod:`simulator.fusion`); ``cpu-gloo`` does not.
Inter-node networks (:data:`NETWORKS`): ``ib-hdr-200``, ``ib-ndr-400`` (one non-blocking fat tree) and
``ib-ndr-400-rail`` (rail-optimised); the named multi-node clusters built on them are in
:mod:`simulator.cluster_presets`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from simulator.datasheets import DATASHEETS, GB, Datasheet
from simulator.device_reserve import Uncertain
from simulator.gpu_constants import GPU_CONSTANTS, HOST_SCOPES

CPU_GLOO_JSON = Path(__file__).resolve().parent / "presets" / "cpu_gloo.json"


@dataclass(frozen=True, kw_only=True)
class OpClassEfficiency:
    """Achieved fraction of a device's peaks for one op class."""

    flops: float
    """Fraction of ``peak_flops_per_s`` reached when the op is compute-bound."""
    memory: float
    """Fraction of ``memory_bandwidth_bytes_per_s`` reached when the op is memory-bound."""


def gpu_efficiency(arch: str, constants: Mapping[str, Uncertain] | None = None) -> dict[str, OpClassEfficiency]:
    """Op class -> efficiency of a GPU of architecture ``arch`` from the nominal values of ``constants``
    (default :data:`simulator.gpu_constants.GPU_CONSTANTS`)."""
    c = {k: u.nominal for k, u in (GPU_CONSTANTS if constants is None else constants).items()}
    vector = c["gpu.vector.flops"]
    return {
        "matmul": OpClassEfficiency(flops=c[f"{arch}.matmul.flops"], memory=c["gpu.matmul.memory"]),
        "attention": OpClassEfficiency(flops=c[f"{arch}.attention.flops"], memory=c["gpu.matmul.memory"]),
        "elementwise": OpClassEfficiency(flops=vector, memory=c["gpu.elementwise.memory"]),
        "reduction": OpClassEfficiency(flops=vector, memory=c["gpu.reduction.memory"]),
        "memory": OpClassEfficiency(flops=1.00, memory=c["gpu.memory.memory"]),
        "other": OpClassEfficiency(flops=vector, memory=c["gpu.other.memory"]),
    }


DEFAULT_GPU_EFFICIENCY: Mapping[str, OpClassEfficiency] = gpu_efficiency("ampere")
"""The A100's efficiencies (the default of a hand-built :class:`DeviceSpec`); see :func:`gpu_efficiency`."""


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
    fuses_pointwise: bool = False
    """Price maximal chains of elementwise/reduction/copy ops as one fused kernel each, as Inductor generates
    them (:mod:`simulator.fusion`): True on the GPU presets; False on ``cpu-gloo``, calibrated on eager graphs."""
    host_copies_inline: bool = False
    """Copies to and from host memory (``HOST_GROUP`` collectives: activation and optimizer offload) run on the
    compute stream, which waits for each, so a tensor copied out is freed before the next op: True on
    ``cpu-gloo``, whose ranks are CPU processes that copy themselves (a clone); False on a GPU, whose copy engines
    overlap them with kernels."""

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
    """Latency through the fabric (all switch hops of the fat tree together); on a rail-optimised network, the
    latency between NICs on different rails (leaf, spine, leaf)."""
    source: str = ""
    """Datasheet the figures come from."""
    rail_latency_s: float | None = None
    """Rail-optimised network (NIC ``k`` of every node on leaf switch ``k``): the latency between NICs of equal
    local index, through their one leaf switch. ``None``: one non-blocking fat tree, every pair pays
    ``switch_latency_s``. Both shapes are non-blocking (full bisection bandwidth); see :mod:`simulator.topology`."""

    @property
    def rail_optimized(self) -> bool:
        """Whether NICs of equal local index share a leaf switch (see :attr:`rail_latency_s`)."""
        return self.rail_latency_s is not None


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
    architecture: str = ""
    """GPU architecture whose constants the preset reads (``ampere``, ``hopper``, ``blackwell``, ``cdna2``,
    ``cdna3``; empty for CPU)."""
    host_memory_bytes: int | None = None
    """Host (CPU) memory of one node that its training processes may use, bytes (``None``: unknown; the
    devices of a node share it equally, :meth:`simulator.cluster.Cluster.host_memory_per_rank_bytes`)."""
    host_memory_link: LinkSpec | None = None
    """One device's link to host memory, per direction: what device<->host copies (optimizer and activation
    offload) cross (``None``: the preset has no host memory to offload to). On ``cpu-gloo`` device and host memory
    are the same RAM and the link is a memory-to-memory copy, measured (``experiments.calibrate_cpu``)."""
    host_memory_kind: str = ""
    """``"pcie"`` or ``"nvlink-c2c"`` (GPU presets: selects the link's constants), ``"memory"`` (``cpu-gloo``: a
    copy within RAM, measured)."""


_CX6_HDR = "NVIDIA ConnectX-6 VPI product brief (HDR 200 Gb/s)"
_CX7_NDR = "NVIDIA ConnectX-7 product brief (NDR 400 Gb/s InfiniBand, 400GbE RoCE)"
_RAILS = ("NVIDIA DGX SuperPOD reference architecture (DGX H100): rail-optimised compute fabric, one NDR 400 Gb/s "
          "ConnectX-7 per GPU, NIC k of every node on leaf switch k, non-blocking leaf-spine fat tree")
NETWORK_RATES = {"ib-hdr-200": (25 * GB, _CX6_HDR, False),
             "ib-ndr-400": (50 * GB, _CX7_NDR, False),
             "ib-ndr-400-rail": (50 * GB, f"{_CX7_NDR}; {_RAILS}", True)}
"""Network name -> (NIC line rate per direction, source, rail-optimised). InfiniBand product briefs: 200 Gb/s per
port = 25 GB/s per direction, 400 Gb/s = 50 GB/s. A 400GbE RoCE fabric on the same ConnectX-7 has the same line
rate; its latencies and efficiency are taken as InfiniBand's (the constants' bands cover both)."""


def build_network(name: str, constants: Mapping[str, Uncertain] | None = None) -> NetworkSpec:
    """The inter-node network ``name`` with latencies and efficiency from ``constants`` (default the table's)."""
    c = {k: u.nominal for k, u in (GPU_CONSTANTS if constants is None else constants).items()}
    try:
        rate, source, rails = NETWORK_RATES[name]
    except KeyError:
        raise ValueError(f"unknown network {name!r}; choose one of {', '.join(NETWORK_RATES)}") from None
    return NetworkSpec(name=name, nic=LinkSpec(bandwidth_bytes_per_s=rate, latency_s=c["ib.nic_latency_s"],
                                               efficiency=c["ib.efficiency"]),
                       switch_latency_s=c["ib.switch_latency_s"], source=source,
                       rail_latency_s=c["rail.leaf_latency_s"] if rails else None)


NETWORKS: dict[str, NetworkSpec] = {name: build_network(name) for name in NETWORK_RATES}


def build_preset(name: str, constants: Mapping[str, Uncertain] | None = None) -> HardwarePreset:
    """The GPU preset ``name`` built from its datasheet and the nominal values of ``constants`` (default
    :data:`simulator.gpu_constants.GPU_CONSTANTS`; pass a moved copy for a sensitivity study)."""
    try:
        ds = DATASHEETS[name]
    except KeyError:
        raise ValueError(f"{name!r} is not a GPU preset; choose one of {', '.join(DATASHEETS)}") from None
    table = GPU_CONSTANTS if constants is None else constants
    c = {k: u.nominal for k, u in table.items()}
    return HardwarePreset(
        name=name,
        device=DeviceSpec(name=ds.device_name or name, peak_flops_per_s=ds.flops, memory_bandwidth_bytes_per_s=ds.hbm,
                          memory_bytes=ds.mem, kernel_launch_overhead_s=c["gpu.kernel_launch_overhead_s"],
                          efficiency=gpu_efficiency(ds.arch, table), fuses_pointwise=True),
        devices_per_node=ds.per_node,
        intra_node_kind=ds.fabric,
        intra_node=LinkSpec(bandwidth_bytes_per_s=ds.fabric_bidir / 2, latency_s=c[f"{ds.fabric_key}.latency_s"],
                            efficiency=c[f"{ds.fabric_key}.efficiency"]),
        host_link=LinkSpec(bandwidth_bytes_per_s=ds.pcie_bidir / 2, latency_s=c["pcie.latency_s"]),
        network=build_network(ds.network, table),
        sources=(*ds.sources, *((ds.host_source,) if ds.host_source else ())),
        notes=ds.notes,
        architecture=ds.arch,
        host_memory_bytes=ds.host_mem or None,
        host_memory_link=_host_memory_link(ds, c),
        host_memory_kind=ds.host_kind,
    )


def _host_memory_link(ds: Datasheet, c: Mapping[str, float]) -> LinkSpec:
    """Device <-> host memory, per direction, with the efficiency and latency constants of its kind."""
    scope = HOST_SCOPES[ds.host_kind]
    return LinkSpec(bandwidth_bytes_per_s=(ds.host_bidir or ds.pcie_bidir) / 2, latency_s=c[f"{scope}.latency_s"],
                    efficiency=c[f"{scope}.efficiency"])


PRESETS: dict[str, HardwarePreset] = {name: build_preset(name) for name in DATASHEETS}


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
            fuses_pointwise=bool(dev.get("fuses_pointwise", False)),
            host_copies_inline=bool(dev.get("host_copies_inline", False)),
            efficiency={k: OpClassEfficiency(flops=float(v["flops"]), memory=float(v["memory"]))
                        for k, v in dev["efficiency"].items()},
        )
        link = data["intra_node"]
        host = data.get("host_memory_link")
        host_bytes = data.get("host_memory_bytes")
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
            host_memory_bytes=None if host_bytes is None else int(host_bytes),
            host_memory_link=None if host is None else LinkSpec(
                bandwidth_bytes_per_s=float(host["bandwidth_bytes_per_s"]), latency_s=float(host["latency_s"]),
                efficiency=float(host.get("efficiency", 1.0))),
            host_memory_kind=str(data.get("host_memory_kind", "")) if host is not None else "",
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"malformed hardware preset document ({exc!r}); regenerate it with "
                         "python -m experiments.calibrate_cpu --update-preset") from None


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

