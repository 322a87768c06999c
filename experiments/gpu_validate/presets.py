"""The preset the cases are predicted on: its document in the layout `simulator.hardware.preset_from_dict` reads
(`preset_document`, `base_document`), the simulator cluster of a case's ranks on it (`cluster_of`), and a case's
exported workload simulated there (`simulate_on`).
"""

from __future__ import annotations

import dataclasses
import json


def preset_document(preset) -> dict:
    """A `simulator.hardware.HardwarePreset` in the layout `simulator.hardware.preset_from_dict` reads (that of
    ``simulator/presets/cpu_gloo.json``), with the host link a cluster file's node may add."""

    def link(spec):
        return None if spec is None else dataclasses.asdict(spec)

    device = preset.device
    document = {
        "name": preset.name, "calibrated": preset.calibrated, "notes": preset.notes, "sources": list(preset.sources),
        "devices_per_node": preset.devices_per_node, "intra_node_kind": preset.intra_node_kind,
        "collectives_in_flight": preset.collectives_in_flight,
        "device": {**{f.name: getattr(device, f.name) for f in dataclasses.fields(device) if f.name != "efficiency"},
                   "efficiency": {k: dataclasses.asdict(v) for k, v in device.efficiency.items()}},
        "intra_node": link(preset.intra_node),
    }
    if preset.host_link is not None:
        document["host_link"] = link(preset.host_link)
    if preset.host_memory_link is not None:
        document.update(host_memory_link=link(preset.host_memory_link), host_memory_kind=preset.host_memory_kind,
                        host_memory_bytes=preset.host_memory_bytes)
    if preset.architecture:
        document["architecture"] = preset.architecture
    return document


def base_document(preset_name: str) -> dict:
    """The document of the preset the cases are predicted on: the tracked cpu-gloo JSON as it is, a GPU preset
    through `preset_document`."""
    from simulator.hardware import CPU_GLOO_JSON, get_preset

    if preset_name == "cpu-gloo":
        return json.loads(CPU_GLOO_JSON.read_text(encoding="utf-8"))
    return preset_document(get_preset(preset_name))


def cluster_of(document: dict, world: int):
    """The simulator cluster of ``world`` ranks on one node of ``document``: cpu-gloo as the validation builds it
    (`experiments.calibration.validate_simulator.cpu_gloo_cluster`: its fit per world size, the cores shared), a
    GPU preset as `simulator.hardware.preset_from_dict` reads it."""
    from experiments.calibration.validate_simulator import cpu_gloo_cluster
    from simulator import Cluster
    from simulator.hardware import preset_from_dict

    if document.get("intra_node_kind") == "loopback":
        return cpu_gloo_cluster(world, document)
    preset = preset_from_dict(document)
    return Cluster.from_preset(preset, devices_per_node=max(world, preset.devices_per_node))


def simulate_on(workload: dict, document: dict, world: int):
    from simulator import Workload, simulate

    return simulate(Workload.from_dict(workload), cluster_of(document, world))
