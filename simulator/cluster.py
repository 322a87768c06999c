"""A :class:`Cluster`: a hardware preset instantiated for a number of nodes, with its topology.

Rank ``r`` runs on device ``r``, which sits on node ``r // devices_per_node``. A cluster may have more devices
than a workload has ranks (the extra devices idle); never fewer. Build one with :meth:`Cluster.from_preset`,
passing a preset name (``"a100-80gb-sxm"``) or a :class:`~simulator.hardware.HardwarePreset` of your own, or
:meth:`Cluster.from_cluster_preset` with a named multi-node cluster (``"h100-sxm-4x8"``, see
:mod:`simulator.cluster_presets`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from simulator.cluster_presets import get_cluster_preset
from simulator.collectives import ALL_TO_ALL_ALGORITHMS
from simulator.hardware import DeviceSpec, HardwarePreset, NetworkSpec, get_network, get_preset
from simulator.topology import Topology, build_topology


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Devices plus topology. Prefer :meth:`from_preset` to calling the constructor."""

    preset: HardwarePreset
    """Node type."""
    nodes: int
    """Number of nodes."""
    devices_per_node: int
    """Devices per node (defaults to the preset's)."""
    network: NetworkSpec | None
    """Inter-node network (``None`` for a single node without a network)."""
    topology: Topology = field(repr=False, compare=False)
    """The link graph (see :mod:`simulator.topology`)."""
    all_to_all: str = "pairwise"
    """All-to-all algorithm (Note [All-to-all algorithms] in :mod:`simulator.collectives`)."""

    @classmethod
    def from_preset(cls, preset: str | HardwarePreset, *, nodes: int = 1, devices_per_node: int | None = None,
                    network: str | NetworkSpec | None = None, all_to_all: str = "pairwise") -> Cluster:
        """A cluster of ``nodes`` nodes of ``preset``; ``network`` overrides the preset's inter-node network,
        ``all_to_all`` picks the all-to-all algorithm (``"pairwise"`` or ``"hierarchical"``)."""
        if isinstance(preset, str):
            preset = get_preset(preset)
        if isinstance(network, str):
            network = get_network(network)
        per_node = preset.devices_per_node if devices_per_node is None else devices_per_node
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise ValueError(f"nodes must be a positive integer, got {nodes!r}")
        if not isinstance(per_node, int) or per_node < 1:
            raise ValueError(f"devices_per_node must be a positive integer, got {per_node!r}")
        if all_to_all not in ALL_TO_ALL_ALGORITHMS:
            raise ValueError(f"unknown all-to-all algorithm {all_to_all!r}; choose one of {ALL_TO_ALL_ALGORITHMS}")
        net = network if network is not None else preset.network
        topology = build_topology(preset, nodes=nodes, devices_per_node=per_node, network=net)
        return cls(preset=preset, nodes=nodes, devices_per_node=per_node, network=net,
                   topology=topology, all_to_all=all_to_all)

    @classmethod
    def from_cluster_preset(cls, name: str, *, all_to_all: str | None = None) -> Cluster:
        """The named multi-node cluster ``name`` (a key of :data:`simulator.hardware.CLUSTER_PRESETS`, e.g.
        ``"h100-sxm-2x8"``); ``all_to_all`` overrides its all-to-all algorithm."""
        spec = get_cluster_preset(name)
        return cls.from_preset(spec.node, nodes=spec.nodes, network=spec.network,
                               all_to_all=spec.all_to_all if all_to_all is None else all_to_all)

    @property
    def device(self) -> DeviceSpec:
        """The (homogeneous) device of every rank."""
        return self.preset.device

    @property
    def world_size(self) -> int:
        """Number of devices."""
        return self.nodes * self.devices_per_node

    @property
    def host_memory_per_rank_bytes(self) -> int | None:
        """Host memory a rank may use: the node's, shared equally by its devices (``None``: unknown)."""
        total = self.preset.host_memory_bytes
        return None if total is None else total // self.devices_per_node

    def node_of(self, rank: int) -> int:
        """The node hosting ``rank``."""
        return rank // self.devices_per_node

    def describe(self) -> dict[str, Any]:
        """A JSON-friendly summary for reports."""
        dev = self.device
        return {
            "preset": self.preset.name,
            "calibrated": self.preset.calibrated,
            "nodes": self.nodes,
            "devices_per_node": self.devices_per_node,
            "world_size": self.world_size,
            "device": dev.name,
            "peak_flops_per_s": dev.peak_flops_per_s,
            "memory_bandwidth_bytes_per_s": dev.memory_bandwidth_bytes_per_s,
            "memory_bytes": dev.memory_bytes,
            "intra_node": {"kind": self.preset.intra_node_kind,
                           "bandwidth_bytes_per_s": self.preset.intra_node.effective_bandwidth_bytes_per_s,
                           "latency_s": self.preset.intra_node.latency_s},
            "host_memory_per_rank_bytes": self.host_memory_per_rank_bytes,
            "host_memory_link": None if self.preset.host_memory_link is None else {
                "kind": self.preset.host_memory_kind,
                "bandwidth_bytes_per_s": self.preset.host_memory_link.effective_bandwidth_bytes_per_s},
            "network": None if self.network is None or self.nodes == 1 else self.network.name,
            "all_to_all": self.all_to_all,
        }
