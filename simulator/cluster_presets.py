"""Named multi-node clusters (2, 4 and 8 nodes of 8 H100, B200 or A100 GPUs) and the provenance of every link figure.

A :class:`ClusterPreset` names a GPU node preset of :mod:`simulator.hardware`, a node count, an inter-node network
and the all-to-all algorithm; :meth:`simulator.cluster.Cluster.from_cluster_preset` builds it. The presets of
:data:`CLUSTER_PRESETS` are rail-optimised 400 Gb/s fabrics with one NIC per GPU (the DGX SuperPOD layout, see
:mod:`simulator.topology`). :func:`link_provenance` lists each bandwidth and latency such a cluster uses, as
:class:`~simulator.device_reserve.Uncertain` entries (value, band, source, assumption flag): the datasheet
bandwidths beside the efficiencies and latencies of :data:`simulator.gpu_constants.GPU_CONSTANTS`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from simulator.device_reserve import Uncertain
from simulator.gpu_constants import GPU_CONSTANTS
from simulator.hardware import DATASHEETS, GB, NETWORK_RATES


@dataclass(frozen=True, kw_only=True)
class ClusterPreset:
    """A named multi-node cluster: ``nodes`` nodes of the GPU preset ``node`` joined by the network ``network``.

    Build it with :meth:`simulator.cluster.Cluster.from_cluster_preset`; :meth:`provenance` lists every bandwidth
    and latency it uses with its band and source."""

    name: str
    """Name used on the command line, ``<node preset>-<nodes>x<GPUs per node>``."""
    node: str
    """GPU preset of every node (a key of :data:`DATASHEETS`)."""
    nodes: int
    """Number of nodes."""
    network: str
    """Inter-node network (a key of :data:`NETWORKS`)."""
    all_to_all: str = "pairwise"
    """All-to-all algorithm the collectives run (see :data:`simulator.collectives.ALL_TO_ALL_ALGORITHMS`):
    ``"pairwise"`` is what NCCL's all-to-all does (a send/recv with every peer); ``"hierarchical"`` the 2-D
    algorithm (intra-node exchange, then one exchange per rail across nodes)."""
    notes: str = ""
    """Modelling simplifications worth knowing."""

    def provenance(self, constants: Mapping[str, Uncertain] | None = None) -> dict[str, Uncertain]:
        """Every bandwidth and latency of this cluster: see :func:`link_provenance`."""
        return link_provenance(self.node, self.network, constants)


def link_provenance(node: str, network: str | None,
                    constants: Mapping[str, Uncertain] | None = None) -> dict[str, Uncertain]:
    """Every bandwidth and latency a cluster of GPU preset ``node`` joined by ``network`` uses, by name: the
    datasheet figures (``<link>.bandwidth_bytes_per_s``, a band of one point, ``assumption=False``) beside the
    efficiencies and latencies of ``constants`` (default :data:`~simulator.gpu_constants.GPU_CONSTANTS`)."""
    try:
        ds = DATASHEETS[node]
    except KeyError:
        raise ValueError(f"{node!r} is not a GPU preset; choose one of {', '.join(DATASHEETS)}") from None
    table = GPU_CONSTANTS if constants is None else constants

    def fixed(name: str, value: float, provenance: str) -> Uncertain:
        return Uncertain(name=name, low=value, nominal=value, high=value, unit="bytes/s per direction",
                         provenance=provenance, assumption=False)

    fabric, datasheet = ds.fabric_key, ds.sources[0]
    out = {
        f"{fabric}.bandwidth_bytes_per_s": fixed(
            f"{fabric}.bandwidth_bytes_per_s", ds.fabric_bidir / 2,
            f"{datasheet}: {ds.fabric_bidir / GB:.0f} GB/s bidirectional per device, half per direction"),
        f"{fabric}.efficiency": table[f"{fabric}.efficiency"],
        f"{fabric}.latency_s": table[f"{fabric}.latency_s"],
    }
    if network is None:
        return out
    try:
        rate, source, rails = NETWORK_RATES[network]
    except KeyError:
        raise ValueError(f"unknown network {network!r}; choose one of {', '.join(NETWORK_RATES)}") from None
    out.update({
        "pcie.bandwidth_bytes_per_s": fixed(
            "pcie.bandwidth_bytes_per_s", ds.pcie_bidir / 2,
            f"{datasheet}: PCIe {ds.pcie_bidir / GB:.0f} GB/s bidirectional (device <-> PCIe switch <-> NIC), half "
            "per direction; no efficiency applied"),
        "pcie.latency_s": table["pcie.latency_s"],
        "nic.bandwidth_bytes_per_s": fixed("nic.bandwidth_bytes_per_s", rate, f"{source}: line rate per direction"),
        "ib.efficiency": table["ib.efficiency"],
        "ib.nic_latency_s": table["ib.nic_latency_s"],
        "ib.switch_latency_s": table["ib.switch_latency_s"],
    })
    if rails:
        out["rail.leaf_latency_s"] = table["rail.leaf_latency_s"]
    return out


_PCIE_BOUND = ("the A100's PCIe Gen4 x16 (32 GB/s per direction) sits between the GPU and its 400 Gb/s NIC, so "
               "inter-node bandwidth is PCIe-bound (a DGX A100 ships 200 Gb/s HDR NICs; pass network='ib-hdr-200' "
               "to Cluster.from_preset for that machine)")

_B200_RAILS = ("DGX B200 nodes: the NVIDIA DGX SuperPOD reference architecture for DGX B200 builds the same "
               "rail-optimised NDR 400 Gb/s compute fabric, one ConnectX-7 per GPU (DGX B200 user guide: 8 single-port "
               "ConnectX-7 cards)")
_NODE_NOTES = {"a100-80gb-sxm": _PCIE_BOUND, "b200": _B200_RAILS}

CLUSTER_PRESETS: dict[str, ClusterPreset] = {
    f"{node}-{nodes}x8": ClusterPreset(
        name=f"{node}-{nodes}x8", node=node, nodes=nodes, network="ib-ndr-400-rail",
        notes="NVLink/NVSwitch inside a node; one 400 Gb/s NIC per GPU on a rail-optimised non-blocking fabric"
              + (f"; {_NODE_NOTES[node]}" if node in _NODE_NOTES else ""))
    for node in ("h100-sxm", "b200", "a100-80gb-sxm") for nodes in (2, 4, 8)}
"""Multi-node clusters of 2, 4 and 8 nodes of 8 GPUs: ``h100-sxm-2x8`` ... ``b200-8x8`` ... ``a100-80gb-sxm-8x8``."""


def get_cluster_preset(name: str) -> ClusterPreset:
    """The cluster preset called ``name``; raises ``ValueError`` listing the valid names otherwise."""
    try:
        return CLUSTER_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown cluster preset {name!r}; choose one of {', '.join(CLUSTER_PRESETS)}") from None
