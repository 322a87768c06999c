"""One reproduction run: its settings (`RunConfig`, typed and frozen, built once from the command line and the
preset) and its working state (`Runner`: the worker pool, the trace cache shared within this process, the trace
counts and the simulated steps one table hands to another)."""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, as_completed
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from experiments.tables import write_table

PRESETS: dict[str, dict] = {
    # measured-cpu on 2 ranks: 4 gloo ranks on a 2-core machine share cores, their step times measure the
    # contention (--cpu-ranks 2 4 on a machine with 4 or more cores; the hybrid autosp-hybrid-2x2 runs only there)
    "default": {"granularity": 1024, "zero3_granularity": 1024, "search_probes": 10, "cpu_ranks": (2,),
                "cpu_seq_len": 1024, "cpu_steps": 8, "memory_cap_mib": 16.0, "cap_granularity": 128,
                "cap_probes": 8, "cap_models": ("mini-llama-3.1-8b", "hf-llama"), "layers": "full"},
    # zero3 fits about 10K tokens: the quick preset's 8K-token steps would be too coarse for it
    "quick": {"granularity": 8192, "zero3_granularity": 2048, "search_probes": 6, "cpu_ranks": (2,),
              "cpu_seq_len": 256, "cpu_steps": 3, "memory_cap_mib": 8.0, "cap_granularity": 256, "cap_probes": 2,
              "cap_models": ("mini-llama-3.1-8b",), "layers": "extrapolated"},
}
"""Settings of the two presets (``--quick`` picks the second); every other setting is shared (`SHARED`)."""
SHARED = {"max_seq_len_ceiling": 262144, "cap_ranks": (2,), "cap_start": 512, "cap_max_len": 32768,
          "step_layers": 2, "step_seq_len": 8192}
PRESET_HELP = {
    "granularity": "max-seq-len search granularity (tokens)", "zero3_granularity": "the same for ZeRO-3",
    "search_probes": "probe budget of a baseline's max-seq-len search", "cpu_ranks": "measured-cpu gloo ranks",
    "cpu_seq_len": "measured-cpu tokens", "cpu_steps": "measured-cpu timed steps",
    "memory_cap_mib": "memory-cap cap (MiB per rank)", "cap_granularity": "memory-cap search granularity (tokens)",
    "cap_probes": "memory-cap probes per system",
    "cap_models": "memory-cap models",
    "layers": "paper-scale depth: traced in full, or extrapolated from 1 and 2 layers (underestimates memory "
              "under checkpointing)",
}


@dataclass(frozen=True)
class RunConfig:
    """What a run builds and with which settings; the tables read nothing else of the command line."""

    out: pathlib.Path
    """The results folder."""
    preset: str
    """``default`` or ``quick`` (`PRESETS`)."""
    tables: tuple[str, ...]
    """The tables this run builds, in registry order (``--only``'s, or every table not run on request)."""
    only: str | None
    models: tuple[str, ...] | None
    """Paper models of the max-seq-len tables (None: every model with a published figure)."""
    iteration_model: str
    """Paper model of the throughput table and of the simulated step."""
    jobs: int
    # the preset's settings (`PRESETS`), with --memory-cap-mib and --cpu-ranks applied
    granularity: int
    zero3_granularity: int
    search_probes: int
    cpu_ranks: tuple[int, ...]
    cpu_seq_len: int
    cpu_steps: int
    memory_cap_mib: float
    cap_granularity: int
    cap_probes: int
    cap_models: tuple[str, ...]
    layers: str
    # settings every preset shares (`SHARED`)
    max_seq_len_ceiling: int
    cap_ranks: tuple[int, ...]
    cap_start: int
    cap_max_len: int
    step_layers: int
    step_seq_len: int
    cpu_systems: tuple[str, ...] | None = None
    """The systems the CPU-measured tables (measured-cpu, memory-cap) measure (``--cpu-systems``); None: each
    table's every system (`simulator.strategies.STRATEGIES`)."""

    @classmethod
    def from_preset(cls, preset: str, *, memory_cap_mib: float | None = None,
                    cpu_ranks: tuple[int, ...] | None = None, **run) -> RunConfig:
        """The run ``run`` with the settings of ``preset`` (`PRESETS`, `SHARED`), the memory cap and the CPU rank
        counts replaced where given (not None)."""
        settings = {**PRESETS[preset], **SHARED}
        if memory_cap_mib is not None:
            settings["memory_cap_mib"] = memory_cap_mib
        if cpu_ranks is not None:
            settings["cpu_ranks"] = tuple(cpu_ranks)
        return cls(preset=preset, **run, **settings)

    def settings(self) -> dict:
        """The preset's settings as this run applies them (run.json records them), in `PRESETS`' order."""
        return {key: getattr(self, key) for key in (*PRESETS[self.preset], *SHARED)}

    def measured(self, systems: tuple[str, ...]) -> tuple[str, ...]:
        """The rows of a CPU-measured table of ``systems`` that this run measures, in the table's order."""
        return tuple(s for s in systems if self.cpu_systems is None or s in self.cpu_systems)

    def granularities(self, systems: tuple[str, ...]) -> dict[str, int]:
        """The max-seq-len search granularity of each system (ZeRO-3 has its own)."""
        return {s: self.zero3_granularity if s == "zero3" else self.granularity for s in systems}


TRACE_KINDS = ("traced", "reused", "interpolated", "resized")


def trace_counts(cache, since: dict | None = None) -> dict:
    """Traces a cache made (traced), reused, built by interpolation and re-sized from joint graphs (Note [One
    trace per length class] in experiments/paper_scale/simulate.py), minus the counts ``since``."""
    counts = {"traced": cache.misses, "reused": cache.hits, "interpolated": cache.interpolated,
              "resized": cache.resized}
    return {k: v - (since or {}).get(k, 0) for k, v in counts.items()}


@dataclass
class Runner:
    """The working state of one run: where simulated tasks run (``pool``: worker processes, each with its own
    trace cache; None: inline, on ``cache``), the trace counts of every task, and the simulated steps of the
    iteration model the max-seq-len table's tasks made for the throughput table (Note [Throughput steps from
    the search's traces] in experiments/reproduction/max_seq_len.py)."""

    cache: object
    """The `experiments.paper_scale.simulate.TraceCache` shared within this process."""
    pool: Executor | None = None
    counts: dict = field(default_factory=lambda: dict.fromkeys(TRACE_KINDS, 0))
    simulated_steps: dict = field(default_factory=dict)
    """(system, length) -> SimulatedStep of the iteration model."""
    out: pathlib.Path | None = None
    """Where `run_named` keeps the rows made so far (None: nowhere)."""

    def add_counts(self, counts: dict) -> None:
        for kind, n in counts.items():
            self.counts[kind] += n

    def run_tasks(self, tasks: list[tuple[Callable, tuple]], desc: str) -> list:
        """Run ``tasks`` [(function, arguments)], each returning (result, trace counts), on the pool or inline
        with the shared cache; the results in task order."""
        results: list = [None] * len(tasks)
        if self.pool is None:
            for i, (fn, fn_args) in enumerate(tqdm(tasks, desc=desc, file=sys.stderr)):
                results[i] = fn(*fn_args, cache=self.cache)
        else:
            futures = {self.pool.submit(fn, *fn_args): i for i, (fn, fn_args) in enumerate(tasks)}
            for future in tqdm(as_completed(futures), total=len(futures), desc=desc, file=sys.stderr):
                results[futures[future]] = future.result()
        for _, counts in results:
            self.add_counts(counts)
        return [result for result, _ in results]

    def run_named(self, tasks: Sequence[tuple[str, Callable[[], Any]]], desc: str) -> list:
        """Run ``tasks`` [(name, call)] here, one at a time, under a progress bar that names the one running; the
        results in task order (a table whose rows share this process's trace cache).  With ``out`` set, the rows
        made so far are written after each one as ``out/DESC.partial.csv`` and ``.md`` (a long table's finished
        rows survive an interrupted run), removed once every row is made: the caller writes the table."""
        results = []
        with tqdm(tasks, desc=desc, file=sys.stderr) as bar:
            for name, task in bar:
                bar.set_postfix_str(name)
                results.append(task())
                if self.out is not None:
                    write_table(f"{desc}.partial", results, self.out)
        if self.out is not None:
            for suffix in (".csv", ".md"):
                (self.out / f"{desc}.partial{suffix}").unlink(missing_ok=True)
        return results
