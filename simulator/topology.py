"""The interconnect graph of a cluster: devices, node fabrics, PCIe, NICs and the inter-node switch.

:func:`build_topology` turns a :class:`~simulator.hardware.HardwarePreset` and a node count into a directed
``networkx`` graph (one edge per link direction, so full-duplex links carry both directions at full speed):

    gpu{r} <-> fabric{n}          node-local NVSwitch / Infinity Fabric / loopback, one per node
    gpu{r} <-> pcie{r} <-> nic{r} the device's PCIe switch and NIC (GPUDirect RDMA path), multi-node only
    gpu{r} <-> host{n}            the device's link to its node's host memory (PCIe or NVLink-C2C), when the
                                  preset has one: what ``to_host``/``from_host`` copies cross
    nic{r} <-> ib                 a non-blocking fat tree abstracted as one switch, or, on a rail-optimised
    nic{r} <-> rail{k} <-> spine  network, NIC r into the leaf switch of its rail k = r % devices_per_node, the
                                  leaves into a non-blocking spine

On a rail-optimised network (:attr:`~simulator.hardware.NetworkSpec.rail_latency_s`) a transfer between GPUs of
equal local index crosses one leaf switch; one between rails crosses leaf, spine and leaf and pays the fat tree's
``switch_latency_s``. The spine's uplinks carry the rail's whole NIC bandwidth (non-blocking, as in the DGX
SuperPOD reference architecture), so rails change latencies, not bandwidth; NCCL's PXN (moving cross-rail data
over NVLink to the GPU on the right rail first) is not modelled.

Routes between devices are latency-weighted shortest paths that never pass through a third device (intra-node
traffic stays on the node fabric) nor through host memory, cached per source. :class:`Topology` exposes them as tuples of integer link indices so that the cost model and the
bandwidth-sharing network can work on flat arrays.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import networkx as nx

from simulator.hardware import HardwarePreset, LinkSpec, NetworkSpec


@dataclass(frozen=True, kw_only=True)
class Link:
    """One direction of one physical link."""

    index: int
    """Position in :attr:`Topology.links`."""
    src: str
    """Graph node the data leaves."""
    dst: str
    """Graph node the data enters."""
    kind: str
    """``"nvswitch"``, ``"xgmi"``, ``"loopback"``, ``"pcie"``, ``"network"`` (a NIC's port) or ``"spine"`` (a rail's
    leaf-to-spine uplink)."""
    bandwidth_bytes_per_s: float
    """Effective (achievable) bandwidth in this direction."""
    latency_s: float
    """Per-hop latency."""


class Topology:
    """A directed link graph plus cached device-to-device routes."""

    def __init__(self, graph: nx.DiGraph, num_devices: int) -> None:
        self.graph = graph
        self.num_devices = num_devices
        self.links: list[Link] = []
        for u, v, data in graph.edges(data=True):
            data["index"] = len(self.links)
            self.links.append(Link(index=data["index"], src=u, dst=v, kind=data["kind"],
                                   bandwidth_bytes_per_s=data["bandwidth_bytes_per_s"], latency_s=data["latency_s"]))
        self.link_bandwidth_bytes_per_s = [link.bandwidth_bytes_per_s for link in self.links]
        self._routes: dict[int, dict[str, list[str]]] = {}
        self._paths: dict[tuple[int, int], tuple[int, ...]] = {}
        self._latency: dict[tuple[int, int], float] = {}

    @staticmethod
    def device_node(rank: int) -> str:
        """Graph node name of device ``rank``."""
        return f"gpu{rank}"

    def path(self, src: int, dst: int) -> tuple[int, ...]:
        """Link indices from device ``src`` to device ``dst`` (empty when equal)."""
        key = (src, dst)
        cached = self._paths.get(key)
        if cached is not None:
            return cached
        if not (0 <= src < self.num_devices and 0 <= dst < self.num_devices):
            raise ValueError(f"ranks {src}->{dst} outside this cluster's {self.num_devices} devices; "
                             "use more nodes or a smaller world size")
        if src == dst:
            links: tuple[int, ...] = ()
        else:
            routes = self._routes.get(src)
            if routes is None:
                routes = nx.single_source_dijkstra_path(self.graph, self.device_node(src),
                                                        weight=self._weight_from(self.device_node(src)))
                self._routes[src] = routes
            nodes = routes[self.device_node(dst)]
            links = tuple(self.graph.edges[u, v]["index"] for u, v in itertools.pairwise(nodes))
        self._paths[key] = links
        self._latency[key] = sum(self.links[i].latency_s for i in links)
        return links

    def _weight_from(self, source: str):
        """Edge latency as a Dijkstra weight, hiding the edges out of any device but ``source`` and out of host
        memory (no transit)."""
        nodes = self.graph.nodes

        def weight(u: str, _v: str, data: dict) -> float | None:
            kind = nodes[u].get("kind")
            return None if (u != source and kind == "device") or kind == "host_memory" else data["latency_s"]

        return weight

    def host_path(self, rank: int, *, to_host: bool) -> tuple[int, ...]:
        """Link indices between device ``rank`` and its node's host memory (``to_host``: device to host)."""
        gpu = self.device_node(rank)
        host = f"host{self.node_of(rank)}"
        ends = (gpu, host) if to_host else (host, gpu)
        if not self.graph.has_edge(*ends):
            raise ValueError(f"device {rank} has no link to host memory in this cluster; give the preset a "
                             "host_memory_link (e.g. host_memory_link in a cluster file)")
        return (self.graph.edges[ends]["index"],)

    def node_of(self, rank: int) -> int:
        """The node hosting device ``rank``."""
        return self.graph.nodes[self.device_node(rank)]["node"]

    def path_latency_s(self, src: int, dst: int) -> float:
        """Sum of the per-hop latencies from ``src`` to ``dst``."""
        self.path(src, dst)
        return self._latency[(src, dst)]

    def bottleneck_bandwidth_bytes_per_s(self, src: int, dst: int) -> float:
        """The slowest link's bandwidth on the route (infinite for ``src == dst``)."""
        links = self.path(src, dst)
        return min((self.links[i].bandwidth_bytes_per_s for i in links), default=float("inf"))


def _add_duplex(graph: nx.DiGraph, a: str, b: str, spec: LinkSpec, kind: str, extra_latency_s: float = 0.0) -> None:
    attrs = {"bandwidth_bytes_per_s": spec.effective_bandwidth_bytes_per_s,
             "latency_s": spec.latency_s + extra_latency_s, "kind": kind}
    graph.add_edge(a, b, **attrs)
    graph.add_edge(b, a, **attrs)


def build_topology(preset: HardwarePreset, *, nodes: int, devices_per_node: int,
                   network: NetworkSpec | None) -> Topology:
    """The link graph of ``nodes`` nodes of ``devices_per_node`` devices each, joined by ``network``."""
    if nodes < 1 or devices_per_node < 1:
        raise ValueError(f"nodes ({nodes}) and devices_per_node ({devices_per_node}) must be positive")
    if nodes > 1 and (network is None or preset.host_link is None):
        raise ValueError(f"preset {preset.name!r} has no inter-node network; use nodes=1 or pass a network "
                         "(and a preset with a host link)")
    graph = nx.DiGraph()
    for n in range(nodes):
        fabric = f"fabric{n}"
        graph.add_node(fabric, kind=preset.intra_node_kind, node=n)
        for local in range(devices_per_node):
            rank = n * devices_per_node + local
            gpu = Topology.device_node(rank)
            graph.add_node(gpu, kind="device", node=n, rank=rank)
            _add_duplex(graph, gpu, fabric, preset.intra_node, preset.intra_node_kind)
            if preset.host_memory_link is not None:
                graph.add_node(f"host{n}", kind="host_memory", node=n)
                _add_duplex(graph, gpu, f"host{n}", preset.host_memory_link, "host")
            if nodes > 1:
                pcie, nic = f"pcie{rank}", f"nic{rank}"
                graph.add_node(pcie, kind="pcie_switch", node=n)
                graph.add_node(nic, kind="nic", node=n)
                _add_duplex(graph, gpu, pcie, preset.host_link, "pcie")
                _add_duplex(graph, pcie, nic, preset.host_link, "pcie")
                if network.rail_optimized:
                    _add_duplex(graph, nic, f"rail{local}", network.nic, "network", network.rail_latency_s / 2)
                else:
                    _add_duplex(graph, nic, "ib", network.nic, "network", network.switch_latency_s / 2)
    if nodes > 1 and network.rail_optimized:
        # Non-blocking: each leaf's uplink carries all of its rail's NICs at once; crossing leaf-spine-leaf adds
        # what the fat tree's latency has beyond one leaf's.
        uplink = LinkSpec(bandwidth_bytes_per_s=nodes * network.nic.effective_bandwidth_bytes_per_s,
                          latency_s=max(0.0, network.switch_latency_s - network.rail_latency_s) / 2)
        for local in range(devices_per_node):
            graph.add_node(f"rail{local}", kind="rail_switch")
            _add_duplex(graph, f"rail{local}", "spine", uplink, "spine")
    return Topology(graph, nodes * devices_per_node)
