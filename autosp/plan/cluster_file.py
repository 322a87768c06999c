"""``--cluster``: a hardware preset, a multi-node cluster preset, or a cluster file (JSON) of your own.

The file's fields and their units are documented in docs/design.md ("Cluster files"); an example is
docs/examples/two_node_cluster.json.  The node is a GPU preset name or a hardware document in the layout of
`simulator.hardware.preset_from_dict` (the one ``simulator/presets/cpu_gloo.json`` uses) plus an optional host
link and host memory (size and the device's link to it); the network is a network name or its figures.  Everything becomes the simulator's own dataclasses
(`simulator.hardware.HardwarePreset`, `simulator.hardware.NetworkSpec`, `simulator.cluster.Cluster`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autosp.errors import AutoSPError
from simulator.cluster import Cluster
from simulator.cluster_presets import CLUSTER_PRESETS
from simulator.hardware import LinkSpec, NetworkSpec, get_network, get_preset, preset_from_dict, preset_names

FILE_FIELDS = ("name", "nodes", "devices_per_node", "node", "memory_gib", "host_memory_gib", "network", "all_to_all")
"""The top-level fields of a cluster file (only ``node`` and ``nodes`` are required)."""


def cluster_names() -> tuple[str, ...]:
    """Every name ``--cluster`` accepts besides a file."""
    return (*preset_names(), *CLUSTER_PRESETS)


def _link(data: Mapping[str, Any], where: str) -> LinkSpec:
    try:
        return LinkSpec(bandwidth_bytes_per_s=float(data["bandwidth_bytes_per_s"]), latency_s=float(data["latency_s"]),
                        efficiency=float(data.get("efficiency", 1.0)))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise AutoSPError(f"{where}: a link needs bandwidth_bytes_per_s (bytes/s per direction) and latency_s "
                          f"(seconds), optionally efficiency (a fraction); {exc!r}") from None


def _network(value: Any, where: str) -> NetworkSpec:
    if isinstance(value, str):
        try:
            return get_network(value)
        except ValueError as exc:
            raise AutoSPError(f"{where}: {exc}") from None
    if not isinstance(value, Mapping) or "nic" not in value or "switch_latency_s" not in value:
        raise AutoSPError(f"{where}: give a network name or an object with name, nic (a link) and switch_latency_s "
                          "(seconds), optionally rail_latency_s (seconds; a rail-optimised fabric)")
    rail = value.get("rail_latency_s")
    return NetworkSpec(name=str(value.get("name", "custom")), nic=_link(value["nic"], f"{where}.nic"),
                       switch_latency_s=float(value["switch_latency_s"]), source=str(value.get("source", where)),
                       rail_latency_s=None if rail is None else float(rail))


def _node(value: Any, where: str):
    if isinstance(value, str):
        try:
            return get_preset(value)
        except ValueError as exc:
            raise AutoSPError(f"{where}: {exc}") from None
    if not isinstance(value, Mapping):
        raise AutoSPError(f"{where}: give a hardware preset name ({', '.join(preset_names())}) or a hardware "
                          "object (device, intra_node, devices_per_node; see docs/design.md, Cluster files)")
    try:
        # the host-memory fields are read below, each error naming its field
        preset = preset_from_dict({"calibrated": False, "name": "custom",
                                   **{k: v for k, v in value.items() if k != "host_memory_link"}})
    except ValueError as exc:
        raise AutoSPError(f"{where}: {exc}; see docs/design.md, Cluster files, for the fields") from None
    host = value.get("host_link")
    memory_link = value.get("host_memory_link")
    kind = str(value.get("host_memory_kind", "pcie"))
    if kind not in ("pcie", "nvlink-c2c"):
        raise AutoSPError(f"{where}.host_memory_kind: {kind!r}; choose pcie or nvlink-c2c")
    return dataclasses.replace(preset, host_link=None if host is None else _link(host, f"{where}.host_link"),
                               architecture=str(value.get("architecture", "")),
                               host_memory_link=None if memory_link is None else _link(memory_link,
                                                                                       f"{where}.host_memory_link"),
                               host_memory_kind=kind if memory_link is not None else "",
                               host_memory_bytes=_gib(value, "host_memory_gib", where))


def _gib(data: Mapping[str, Any], key: str, where: str) -> int | None:
    """``data[key]`` GiB as bytes (None when absent); refused unless a positive number."""
    if data.get(key) is None:
        return None
    try:
        gib = float(data[key])
    except (TypeError, ValueError):
        gib = -1.0
    if gib <= 0:
        raise AutoSPError(f"{where}: {key} must be a positive number of GiB, got {data[key]!r}")
    return int(gib * 2**30)


def cluster_from_dict(data: Mapping[str, Any], *, source: str = "cluster file") -> Cluster:
    """The simulator cluster a cluster document describes (fields: :data:`FILE_FIELDS`)."""
    if not isinstance(data, Mapping):
        raise AutoSPError(f"{source}: expected a JSON object with fields {', '.join(FILE_FIELDS)}")
    unknown = sorted(set(data) - set(FILE_FIELDS))
    if unknown:
        raise AutoSPError(f"{source}: unknown field(s) {unknown}; the fields are {', '.join(FILE_FIELDS)}")
    if "node" not in data:
        raise AutoSPError(f"{source}: missing field 'node' (a hardware preset name or a hardware object)")
    preset = _node(data["node"], f"{source}: node")
    if "memory_gib" in data:
        memory = _gib(data, "memory_gib", source)
        preset = dataclasses.replace(preset, device=dataclasses.replace(preset.device, memory_bytes=memory))
    if data.get("host_memory_gib") is not None:
        preset = dataclasses.replace(preset, host_memory_bytes=_gib(data, "host_memory_gib", source))
    nodes = data.get("nodes", 1)
    network = _network(data["network"], f"{source}: network") if data.get("network") is not None else None
    if isinstance(nodes, int) and nodes > 1 and network is None and preset.network is None:
        raise AutoSPError(f"{source}: {nodes} nodes need a network (a name or its figures)")
    if isinstance(nodes, int) and nodes > 1 and preset.host_link is None:
        raise AutoSPError(f"{source}: {nodes} nodes need the node's host_link (device to NIC, e.g. PCIe)")
    preset = dataclasses.replace(preset, name=str(data.get("name", preset.name)))
    try:
        return Cluster.from_preset(preset, nodes=nodes, devices_per_node=data.get("devices_per_node"),
                                   network=network, all_to_all=str(data.get("all_to_all", "pairwise")))
    except ValueError as exc:
        raise AutoSPError(f"{source}: {exc}") from None


def load_cluster(spec: str, *, world_size: int) -> Cluster:
    """``--cluster``: a hardware preset (as many nodes as ``world_size`` ranks need), a cluster preset, or the path
    of a cluster file."""
    if spec in CLUSTER_PRESETS:
        return Cluster.from_cluster_preset(spec)
    if spec in preset_names():
        preset = get_preset(spec)
        return Cluster.from_preset(preset, nodes=max(1, -(-world_size // preset.devices_per_node)))
    path = Path(spec)
    if not path.is_file():
        raise AutoSPError(f"--cluster {spec!r} is neither a preset ({', '.join(cluster_names())}) nor a cluster "
                          "file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise AutoSPError(f"--cluster {spec}: not valid JSON ({exc})") from None
    return cluster_from_dict(data, source=str(path))
