"""The datasheet figures of every GPU preset, each beside the public document it comes from.

A :class:`Datasheet` holds what a datasheet gives (peak BF16 FLOP/s, HBM bandwidth and capacity, the node fabric's
and host link's bandwidths, GPUs per node, host memory) for one preset of :data:`DATASHEETS`: ``a100-80gb-sxm``,
``h100-sxm``, ``h200-sxm``, ``gh200``, ``b200``, ``mi250`` and ``mi300x``; a figure no datasheet gives is marked an
assumption where it is written. :func:`simulator.hardware.build_preset` joins a datasheet to the efficiencies and
latencies of :data:`simulator.gpu_constants.GPU_CONSTANTS`.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
GIB = 2**30
TIB = 2**40


@dataclass(frozen=True, kw_only=True)
class Datasheet:
    """The datasheet figures of one GPU preset (everything a datasheet gives)."""

    arch: str
    flops: float
    hbm: float
    mem: int
    fabric_bidir: float
    pcie_bidir: float
    per_node: int
    network: str
    sources: tuple[str, ...]
    fabric: str = "nvswitch"
    device_name: str = ""
    notes: str = ""
    host_mem: int = 0
    """Host memory per node, bytes (DRAM sizes are binary: a "2 TB" node is 2 TiB)."""
    host_bidir: float = 0.0
    """Device <-> host memory link, both directions together (0: the PCIe figure ``pcie_bidir``)."""
    host_kind: str = "pcie"
    host_source: str = ""
    """Where the host-memory figures come from (assumptions say so)."""

    @property
    def fabric_key(self) -> str:
        """Scope of the fabric's constants in ``GPU_CONSTANTS``."""
        return "nvlink" if self.fabric == "nvswitch" else self.fabric


DATASHEETS: dict[str, Datasheet] = {
    # NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM): BF16 tensor 312 TFLOP/s dense, HBM2e 2,039 GB/s, 80 GB,
    # NVLink 3 600 GB/s bidirectional, PCIe Gen4 64 GB/s. DGX A100 datasheet: 8 GPUs on NVSwitch, 8x ConnectX-6 HDR.
    "a100-80gb-sxm": Datasheet(arch="ampere", flops=312e12, hbm=2039 * GB, mem=80 * GIB, fabric_bidir=600 * GB,
                                pcie_bidir=64 * GB, per_node=8, network="ib-hdr-200", host_mem=2 * TIB,
                                sources=("NVIDIA A100 Tensor Core GPU datasheet", "NVIDIA DGX A100 datasheet"),
                                host_source="NVIDIA DGX A100 datasheet (DGX A100 640GB): 2 TB system memory; each GPU "
                                            "reaches it over its PCIe Gen4 x16 link (A100 datasheet: 64 GB/s)"),
    # NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): BF16 1,979 TFLOP/s with sparsity = 989 dense, HBM3 3.35 TB/s,
    # 80 GB, NVLink 4 900 GB/s, PCIe Gen5 128 GB/s. DGX H100 datasheet: 8 GPUs, 4 NVSwitch, 8x ConnectX-7 NDR.
    "h100-sxm": Datasheet(arch="hopper", flops=989e12, hbm=3350 * GB, mem=80 * GIB, fabric_bidir=900 * GB,
                           pcie_bidir=128 * GB, per_node=8, network="ib-ndr-400", host_mem=2 * TIB,
                           sources=("NVIDIA H100 Tensor Core GPU datasheet", "NVIDIA DGX H100 datasheet"),
                           host_source="NVIDIA DGX H100 datasheet: 2 TB system memory; PCIe Gen5 x16 per GPU "
                                       "(H100 datasheet: 128 GB/s)"),
    # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): BF16 989 TFLOP/s dense, HBM3e 4.8 TB/s, 141 GB, NVLink 900 GB/s,
    # PCIe Gen5 128 GB/s; HGX H200: 8 GPUs on NVSwitch.
    "h200-sxm": Datasheet(arch="hopper", flops=989e12, hbm=4800 * GB, mem=141 * GIB, fabric_bidir=900 * GB,
                           pcie_bidir=128 * GB, per_node=8, network="ib-ndr-400", host_mem=2 * TIB,
                           sources=("NVIDIA H200 Tensor Core GPU datasheet",),
                           host_source="NVIDIA DGX H200 datasheet: 2 TB system memory; PCIe Gen5 x16 per GPU (H200 "
                                       "datasheet: 128 GB/s)"),
    # NVIDIA GH200 Grace Hopper Superchip datasheet: H100 GPU, BF16 989 TFLOP/s dense, 96 GB HBM3 at 4 TB/s, NVLink-C2C
    # 900 GB/s to Grace. Quad-GH200 nodes (e.g. HPE Cray EX254n) join the four GPUs all-to-all with NVLink 4
    # (18 links, 900 GB/s bidirectional per GPU), modelled as a switch.
    "gh200": Datasheet(arch="hopper", flops=989e12, hbm=4000 * GB, mem=96 * GIB, fabric_bidir=900 * GB,
                        pcie_bidir=128 * GB, per_node=4, network="ib-ndr-400", host_mem=4 * 480 * GIB,
                        host_bidir=900 * GB, host_kind="nvlink-c2c",
                        sources=("NVIDIA GH200 Grace Hopper Superchip datasheet",),
                        host_source="NVIDIA GH200 Grace Hopper Superchip datasheet: NVLink-C2C 900 GB/s between "
                                    "Hopper and Grace, up to 480 GB of LPDDR5X memory per superchip; assumption: every "
                                    "superchip of the node has the largest (480 GB) configuration (systems also "
                                    "ship with less)",
                        notes="4 superchips per node; the all-to-all NVLink mesh is modelled as a non-blocking switch"),
    # NVIDIA DGX B200 user guide (hardware overview): 8 B200 GPUs with 1,440 GB of GPU memory in all (180 GB per GPU,
    # taken as 180 GiB like the other entries' capacities; the first HGX B200 announcement said 192 GB), 2 NVSwitch
    # chips with 14.4 TB/s aggregate (NVLink 5, 1.8 TB/s bidirectional per GPU), 8 single-port ConnectX-7 cards at up
    # to 400 Gb/s InfiniBand (one per GPU), 2 TB of system memory (upgradable to 4 TB), 2 Intel Xeon Platinum 8570
    # (PCIe Gen5) CPUs. NVIDIA DGX B200 datasheet / HGX B200 specifications: HBM3e 8 TB/s per GPU, FP16/BF16 tensor
    # 4.5 PFLOP/s per GPU with sparsity = 2.25 dense. Host link: PCIe Gen5 x16, 128 GB/s bidirectional; assumption
    # that the path runs at Gen5 end to end, as the node's CPUs and ConnectX-7 cards are Gen5 devices.
    "b200": Datasheet(arch="blackwell", flops=2250e12, hbm=8000 * GB, mem=180 * GIB, fabric_bidir=1800 * GB,
                       pcie_bidir=128 * GB, per_node=8, network="ib-ndr-400", host_mem=2 * TIB,
                       sources=("NVIDIA DGX B200 datasheet", "NVIDIA DGX B200 user guide (hardware overview)",
                                "NVIDIA HGX B200 specifications"),
                       host_source="NVIDIA DGX B200 user guide: 2 TB system memory (32 DIMMs, upgradable to 4 TB); "
                                   "each GPU reaches it over PCIe Gen5 x16 (128 GB/s bidirectional; assumption: "
                                   "Gen5 end to end, the DGX B200's Xeon Platinum 8570 CPUs are PCIe Gen5)"),
    # AMD Instinct MI250 datasheet (OAM): BF16 362.1 TFLOP/s, 128 GB HBM2e at 3.2768 TB/s, two GCDs per module, each
    # seen by ROCm as one device. ROCm "MI250 microarchitecture": each Infinity Fabric link carries 50 GB/s per
    # direction. One device here is one GCD (half the module): 181 TFLOP/s, 1.6384 TB/s, 64 GB; 8 GCDs per node,
    # 2 links (100 GB/s per direction) per GCD.
    "mi250": Datasheet(arch="cdna2", flops=181.05e12, hbm=1638.4 * GB, mem=64 * GIB, fabric_bidir=200 * GB,
                        pcie_bidir=64 * GB, per_node=8, network="ib-hdr-200", fabric="xgmi", host_mem=512 * GIB,
                        host_bidir=32 * GB,
                        host_source="assumption: 512 GB DDR4 per node of 8 GCDs as on OLCF Frontier (HPE Cray "
                                    "EX235a, 4 MI250X); the module's PCIe Gen4 x16 host interface (64 GB/s, AMD "
                                    "MI250 datasheet) shared by its two GCDs: 32 GB/s per GCD",
                        device_name="mi250 (one GCD)",
                        sources=("AMD Instinct MI250 accelerator datasheet",
                                 "ROCm documentation: AMD Instinct MI250 microarchitecture"),
                        notes="the partial Infinity Fabric mesh is modelled as a switch with 2 links (100 GB/s) per GCD"),
    # AMD Instinct MI300X accelerator datasheet (OAM): BF16 dense 1,307.4 TFLOP/s (2,614.9 with sparsity), 192 GB HBM3
    # at 5.3 TB/s, PCIe Gen5 x16 host interface (128 GB/s bidirectional), Infinity Fabric links of 128 GB/s
    # bidirectional each. AMD Instinct MI300X platform datasheet: 8 OAMs per server, fully connected, each GPU with
    # 7 links to its 7 peers = 896 GB/s aggregate bidirectional (448 GB/s per direction). Host memory and network
    # are assumptions (see host_source and notes).
    "mi300x": Datasheet(arch="cdna3", flops=1307.4e12, hbm=5300 * GB, mem=192 * GIB, fabric_bidir=896 * GB,
                         pcie_bidir=128 * GB, per_node=8, network="ib-ndr-400", fabric="xgmi", host_mem=2 * TIB,
                         sources=("AMD Instinct MI300X accelerator datasheet",
                                  "AMD Instinct MI300X platform datasheet (8 OAMs, fully connected Infinity Fabric)"),
                         host_source="assumption: 2 TB of DDR5 host memory per 8-GPU server, a common MI300X "
                                     "platform size (published systems have 1.5 TiB, AMD's 8xMI300X MLPerf Inference "
                                     "v4.1 submission, to 1,850 GiB, an Azure ND MI300X v5 VM); each GPU reaches it "
                                     "over its PCIe Gen5 x16 host interface (AMD MI300X datasheet: 128 GB/s "
                                     "bidirectional)",
                         notes="the fully connected Infinity Fabric mesh (7 links of 64 GB/s per direction per GPU) "
                               "is modelled as a switch with their aggregate, 448 GB/s per direction per GPU: right "
                               "for collectives that send to every peer at once (all-to-all), optimistic for one "
                               "peer-to-peer transfer (a ring's send/recv crosses one link, 64 GB/s per direction); "
                               "inter-node network: assumption, one 400 Gb/s NIC per GPU as on Azure ND MI300X v5 "
                               "(8x 400 Gb/s NDR InfiniBand)"),
}
"""Datasheet figures of every GPU preset; the efficiencies and latencies come from ``GPU_CONSTANTS``."""
