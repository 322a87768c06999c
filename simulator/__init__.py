"""A discrete-event simulator of sequence-parallel LLM training steps, fed by a plain-data collective schedule.

A :class:`Workload` (written by ``autosp.export`` or built by hand with :class:`ProgramBuilder`) lists every
rank's ops - kernels with FLOPs and bytes, collectives with their groups, dependencies and tensor lifetimes. A
:class:`Cluster` instantiates a hardware preset (A100, H100, H200, GH200, B200, MI250, MI300X or the calibrated
``cpu-gloo``) with its topology. :func:`simulate` runs one step in SimPy - a compute stream and per-group comm
streams on each rank, collectives that rendezvous across ranks and share link bandwidth, a memory timeline with
OOM reporting - and returns a :class:`Result` (step time, overlap, peak memory). :func:`max_sequence_length` (and the general
:func:`search_max_length`) searches the longest sequence that fits; :func:`memory_ledger` lists a DeepSpeed
configuration's per-rank static memory; :mod:`simulator.trace` and :mod:`simulator.plots` render Perfetto traces
and PNGs. The package never imports torch.
"""

import importlib
from typing import TYPE_CHECKING

# Lazy exports (PEP 562): ``import simulator.workload`` (what autosp does) must not pull in SimPy or numpy.
_EXPORTS = {
    "ProgramBuilder": "simulator.builder",
    "Cluster": "simulator.cluster",
    "SimulationDeadlock": "simulator.engine",
    "simulate": "simulator.engine",
    "DeviceSpec": "simulator.hardware",
    "HardwarePreset": "simulator.hardware",
    "LinkSpec": "simulator.hardware",
    "NetworkSpec": "simulator.hardware",
    "OpClassEfficiency": "simulator.hardware",
    "get_network": "simulator.hardware",
    "get_preset": "simulator.hardware",
    "load_cpu_gloo": "simulator.hardware",
    "preset_names": "simulator.hardware",
    "OomEvent": "simulator.result",
    "RankResult": "simulator.result",
    "Result": "simulator.result",
    "Probe": "simulator.search",
    "SearchResult": "simulator.search",
    "max_sequence_length": "simulator.search",
    "search_max_length": "simulator.search",
    "GradientReady": "simulator.training_step",
    "add_training_step": "simulator.training_step",
    "LedgerLine": "simulator.ledger",
    "TrainingConfig": "simulator.ledger",
    "memory_ledger": "simulator.ledger",
    "summarize": "simulator.ledger",
    "validate_workload": "simulator.validate",
    "SCHEMA_VERSION": "simulator.workload",
    "Collective": "simulator.workload",
    "Op": "simulator.workload",
    "RankProgram": "simulator.workload",
    "StaticMemory": "simulator.workload",
    "Workload": "simulator.workload",
    "WorkloadError": "simulator.workload",
}

__all__ = [
    "Cluster",
    "Collective",
    "DeviceSpec",
    "HardwarePreset",
    "LinkSpec",
    "NetworkSpec",
    "OomEvent",
    "Op",
    "OpClassEfficiency",
    "ProgramBuilder",
    "RankProgram",
    "RankResult",
    "Result",
    "GradientReady",
    "LedgerLine",
    "Probe",
    "SCHEMA_VERSION",
    "SearchResult",
    "SimulationDeadlock",
    "StaticMemory",
    "Workload",
    "WorkloadError",
    "add_training_step",
    "get_network",
    "get_preset",
    "load_cpu_gloo",
    "max_sequence_length",
    "memory_ledger",
    "preset_names",
    "search_max_length",
    "simulate",
    "summarize",
    "TrainingConfig",
    "validate_workload",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'simulator' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)


if TYPE_CHECKING:
    from simulator.builder import ProgramBuilder
    from simulator.cluster import Cluster
    from simulator.engine import SimulationDeadlock, simulate
    from simulator.hardware import (
        DeviceSpec,
        HardwarePreset,
        LinkSpec,
        NetworkSpec,
        OpClassEfficiency,
        get_network,
        get_preset,
        load_cpu_gloo,
        preset_names,
    )
    from simulator.ledger import LedgerLine, TrainingConfig, memory_ledger, summarize
    from simulator.result import OomEvent, RankResult, Result
    from simulator.search import Probe, SearchResult, max_sequence_length, search_max_length
    from simulator.training_step import GradientReady, add_training_step
    from simulator.validate import validate_workload
    from simulator.workload import (
        SCHEMA_VERSION,
        Collective,
        Op,
        RankProgram,
        StaticMemory,
        Workload,
        WorkloadError,
    )
