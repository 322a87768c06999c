"""Longest trainable sequence of a whole model under a training configuration, from simulated steps.

The paper-scale machinery, in one place and without torch:

* :func:`extrapolate_depth` - a model's step from steps traced at two shallower depths (Note [Depth
  extrapolation]), or the step itself when it was traced at full depth;
* :func:`ledger_peak` - a rank's peak memory: the activations a simulation measured plus the static memory of
  :mod:`simulator.ledger` for the training configuration (its allocator fragmentation applies to both), at the
  ledger's low, nominal or high end;
* :func:`device_peak` - the one peak per rank of a simulated run (:class:`DevicePeak`) that ``python -m
  simulator`` prints, writes into result.json and trace.json and draws in memory.png;
* :func:`max_length` - the longest length whose peak fits, with one search
  (:func:`simulator.search.search_max_length`) per end of the ledger's band, all over the same memoised steps
  (Note [Max-length band from one set of steps]); each result says why it stopped ("≥ N" at the ceiling);
* :func:`steps_from_workloads` / :func:`max_length_table` - the same from workloads exported to JSON, one per
  length (and depth), as ``python -m simulator --max-length DIR`` runs it.

Who produces the steps is the caller's business: ``experiments.paper_scale.simulate`` traces a paper model on
fake tensors at each length the search asks for; the command line reads the lengths someone exported (the
search then runs over those lengths only).

Note [Depth extrapolation]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Tracing a 32-layer model at long lengths takes minutes; a model traced at depths ``d1 < d2`` gives the full
model's step time and activation memory by a straight line in the depth: x(L) = x(d1) + (L - d1)·(x(d2) -
x(d1))/(d2 - d1).  It holds where every layer adds the same work and the same live memory at the peak - without
activation checkpointing it is exact.  It does *not* hold where checkpointing plans depend on the depth:
selective checkpointing budgets recomputation as a share of the whole graph's compute, so a one- or two-layer
graph (LM head and loss dominant) saves a different share of each layer than a 32-layer one.  Measured on
Llama-3.1-8B over 8 ranks: 6.63 GiB extrapolated vs 16.96 GiB traced at 32 layers (32K tokens, SAC).  So a step
extrapolated from shallow traces is labelled as such, and full-depth traces are the default where it matters.
Where the two shallow traces disagree in direction - the deeper one holds less memory (or takes less time), as
when SAC recomputes more of the two-layer graph than of the one-layer graph - the line would fall with the depth
and at long lengths even below zero (-95.6 GiB at 294,912 tokens for Llama-3.1-8B on 8 ranks under SAC), so
:func:`extrapolate_depth` refuses (:class:`DepthExtrapolationError`) and its callers trace the full depth there.
The planner's decisions extrapolate with SAC deciding as for the full model instead (Note [Shallow traces
checkpointed for the full depth] in autosp/plan/depth.py), through this same function.

Note [Max-length band from one set of steps]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The ledger's band (low, nominal, high) moves only static memory and the fragmentation charged in proportion to
the activations; the simulated step at a length is the same for every end.  So the step at each length is
simulated once and the search runs once per end (and once for an alternative configuration): the nominal
search pays for its steps, the others start at the nominal answer and pay only for lengths it did not probe.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from simulator.ledger import LedgerLine, TrainingConfig, memory_ledger, summarize
from simulator.result import Result
from simulator.search import Probe, SearchResult, search_max_length
from simulator.workload import Workload

log = logging.getLogger(__name__)

BANDS = ("low", "nominal", "high")


@dataclass(frozen=True, kw_only=True)
class ModelStep:
    """A whole model's training step at one length, as far as the search needs it."""

    seq_len: int
    step_time_s: float
    dynamic_memory_bytes: int
    """Peak above static memory of the busiest rank (activations and transients)."""
    host_dynamic_memory_bytes: int = 0
    """Peak of host tensors (offloaded activations, Note [Host tensors] in :mod:`simulator.workload_types`)."""
    extrapolated_from: tuple[int, int] | None = None
    """The two traced depths, when the step was extrapolated (Note [Depth extrapolation]); None: traced whole."""


class DepthExtrapolationError(ValueError):
    """Two shallow traces that no straight line in the depth can extend (Note [Depth extrapolation]): the deeper
    one takes less time or holds less memory.  Callers trace the full depth instead."""


def extrapolate_depth(at_depth: Callable[[int], tuple[float, int]], layers: int,
                      depths: tuple[int, int]) -> tuple[float, int]:
    """(step time, dynamic memory) of ``layers`` layers from ``at_depth(d)`` at the two ``depths`` (Note [Depth
    extrapolation]); equal depths mean the step was traced at that depth and is returned as is."""
    d1, d2 = depths
    if d1 > d2 or d1 < 1:
        raise ValueError(f"depths must satisfy 1 <= d1 <= d2, got {depths}")
    t1, m1 = at_depth(d1)
    if d1 == d2:
        return t1, m1
    t2, m2 = at_depth(d2)
    if t2 < t1 or m2 < m1:
        raise DepthExtrapolationError(
            f"the step traced at {d2} layers has {'less time' if t2 < t1 else 'less memory'} than at {d1} "
            f"({t2:.4g} s, {m2:,} B vs {t1:.4g} s, {m1:,} B): the shallow traces planned differently (Note [Depth "
            "extrapolation]) and a straight line through them would predict too little; trace the full depth")
    extra = (layers - d1) / (d2 - d1)
    return t1 + extra * (t2 - t1), int(m1 + extra * (m2 - m1))


def extrapolate_or_trace_full(at_depth: Callable[[int], tuple[float, int]], layers: int, depths: tuple[int, int],
                              *, what: str = "step") -> tuple[float, int, tuple[int, int]]:
    """`extrapolate_depth`, or where it refuses, ``at_depth(layers)``: the full depth traced (logged, naming
    ``what``).  Also returns the depths the figure came from (equal: traced whole)."""
    try:
        return (*extrapolate_depth(at_depth, layers, depths), depths)
    except DepthExtrapolationError as exc:
        log.warning("%s: %s; tracing all %d layers", what, exc, layers)
        return (*at_depth(layers), (layers, layers))


def peak_ledger(config: TrainingConfig, dynamic_memory_bytes: int) -> list[LedgerLine]:
    """The memory ledger of ``config`` at a rank's peak, inside backward, with ``dynamic_memory_bytes`` of
    simulated activations (which also get the ledger's allocator rounding and fragmentation band)."""
    return memory_ledger(config, at="backward", activation_bytes=int(dynamic_memory_bytes))


def ledger_peak(config: TrainingConfig, dynamic_memory_bytes: int, which: str = "nominal") -> int:
    """Per-rank peak inside backward: the device total of :func:`peak_ledger`, the ledger's static memory for
    ``config`` plus ``dynamic_memory_bytes`` of simulated activations; ``which`` is one of :data:`BANDS`."""
    if which not in BANDS:
        raise ValueError(f"which must be one of {BANDS}, got {which!r}")
    return int(getattr(summarize(peak_ledger(config, dynamic_memory_bytes)), which))


def ledger_host_peak(config: TrainingConfig, host_dynamic_memory_bytes: int) -> int:
    """Per-rank host-memory peak: the ledger's host lines for ``config`` (optimizer offload) plus
    ``host_dynamic_memory_bytes`` of simulated host tensors (offloaded activations), nominal; 0 when nothing is in
    host memory."""
    lines = memory_ledger(config, at="backward", host_activation_bytes=int(host_dynamic_memory_bytes))
    return summarize(lines, "host").nominal


@dataclass(frozen=True, kw_only=True)
class DevicePeak:
    """A simulated run's peak memory per rank: what the device must hold, the figure that decides whether the step
    fits (docs/design.md, "One memory definition"); :func:`device_peak` computes it."""

    peak_bytes: int
    """:func:`ledger_peak` of the workload's training configuration and the simulated activations; without a
    training configuration the engine's count (``program_peak_bytes``)."""
    program_peak_bytes: int
    """The engine's count (``Result.peak_memory_bytes``): the program's tensors plus the workload's static memory."""
    activation_bytes: int
    """The simulated activations (``Result.activation_peak_bytes``)."""
    capacity_bytes: int
    """Device memory per rank."""
    fits: bool
    """The peak fits ``capacity_bytes`` and no rank runs out of host memory."""
    lines: tuple[LedgerLine, ...] = ()
    """:func:`peak_ledger`, whose device lines sum to ``peak_bytes``; empty without a training configuration."""

    @property
    def definition(self) -> str:
        """``ledger`` (the memory ledger plus the simulated activations) or ``program`` (the engine's count)."""
        return "ledger" if self.lines else "program"

    def to_dict(self) -> dict[str, Any]:
        """The keys ``python -m simulator`` puts into result.json and trace.json (over the engine's own)."""
        return {"peak_memory_bytes": self.peak_bytes, "peak_memory_definition": self.definition,
                "program_peak_memory_bytes": self.program_peak_bytes, "activation_peak_bytes": self.activation_bytes,
                "capacity_bytes": self.capacity_bytes, "fits": self.fits}


def device_peak(workload: Workload, result: Result) -> DevicePeak:
    """The peak per rank of ``result``, a simulation of ``workload``: :func:`ledger_peak` of the training
    configuration its metadata names (:func:`step_metadata`), else the engine's count."""
    activations, capacity = result.activation_peak_bytes, result.ranks[0].memory_capacity_bytes
    config = workload.metadata.get("training_config")
    lines = () if config is None else tuple(peak_ledger(_config_from(config), activations))
    if lines:
        peak = summarize(lines).nominal  # ledger_peak(config, activations)
        fits = peak <= capacity and all(r.host_oom is None for r in result.ranks)
    else:
        peak, fits = result.peak_memory_bytes, result.fits
    return DevicePeak(peak_bytes=peak, program_peak_bytes=result.peak_memory_bytes, activation_bytes=activations,
                      capacity_bytes=capacity, fits=fits, lines=lines)


@dataclass(frozen=True, kw_only=True)
class MaxLength:
    """Longest trainable sequence under a configuration, with the ledger's band (see :func:`max_length`)."""

    nominal: SearchResult
    low_memory: SearchResult
    """With the ledger's low static memory (the longer end of the band)."""
    high_memory: SearchResult
    """With the ledger's high static memory (the shorter end)."""
    alternative: SearchResult | None = None
    """Nominal, under the alternative configuration passed to :func:`max_length` (not the stated one)."""
    steps: Mapping[int, ModelStep] = field(default_factory=dict)
    """Every step simulated, by length."""

    @property
    def band(self) -> tuple[int | None, int | None]:
        """(shortest, longest) length of the band."""
        return self.high_memory.max_seq_len, self.low_memory.max_seq_len


def max_length(step: Callable[[int], ModelStep], config: TrainingConfig, *, capacity_bytes: int,
               low: int, high: int, granularity: int = 1024, start: int | None = None,
               max_probes: int | None = None, lengths: Sequence[int] | None = None,
               alternative: TrainingConfig | None = None, host_capacity_bytes: int | None = None) -> MaxLength:
    """Longest length in ``[low, high]`` (a multiple of ``granularity``, or one of ``lengths``) whose
    :func:`ledger_peak` fits ``capacity_bytes``, at each end of the ledger's band and, given ``alternative``,
    under that configuration (Note [Max-length band from one set of steps]); with ``host_capacity_bytes`` a length
    fits only if its :func:`ledger_host_peak` fits that too.  ``step(seq_len)`` is called at
    most once per length."""
    steps: dict[int, ModelStep] = {}

    def simulated(seq_len: int) -> ModelStep:
        if seq_len not in steps:
            steps[seq_len] = step(seq_len)
        return steps[seq_len]

    def search(which: str, cfg: TrainingConfig, first: int | None) -> SearchResult:
        static = ledger_peak(cfg, 0, which)

        def probe(seq_len: int) -> Probe:
            s = simulated(seq_len)
            peak = ledger_peak(cfg, s.dynamic_memory_bytes, which)
            host_fits = host_capacity_bytes is None or ledger_host_peak(cfg, s.host_dynamic_memory_bytes) <= \
                host_capacity_bytes
            return Probe(fits=peak <= capacity_bytes and host_fits, peak_memory_bytes=peak, step_time_s=s.step_time_s,
                         static_memory_bytes=static, result=s)

        return search_max_length(probe, low=low, high=high, granularity=granularity, capacity_bytes=capacity_bytes,
                                 start=first, max_probes=max_probes, lengths=lengths)

    nominal = search("nominal", config, start)
    again = nominal.max_seq_len or start
    return MaxLength(nominal=nominal, low_memory=search("low", config, again),
                     high_memory=search("high", config, again),
                     alternative=None if alternative is None else search("nominal", alternative, again),
                     steps=steps)


# --- from exported workloads ---------------------------------------------------------------------------------

METADATA_KEYS = ("model", "system", "seq_len", "layers", "model_layers", "training_config")
"""What a workload's ``metadata`` must say to be part of a max-length table (see :func:`step_metadata`)."""


def step_metadata(*, model: str, system: str, seq_len: int, layers: int, model_layers: int,
                  config: TrainingConfig) -> dict:
    """The ``metadata`` an exporter writes into a whole-step workload (forward, backward, gradient reduction and
    optimizer step) for :func:`steps_from_workloads`: which model and system, how many tokens, the depth it was
    traced at and the full model's depth, and the training configuration whose ledger gives static memory."""
    return {"model": model, "system": system, "seq_len": int(seq_len), "layers": int(layers),
            "model_layers": int(model_layers), "training_config": dataclasses.asdict(config)}


def _config_from(data: Mapping) -> TrainingConfig:
    fields = dict(data)
    try:
        fields["parameter_numels"] = tuple(fields["parameter_numels"])
        return TrainingConfig(**fields)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"metadata training_config is not a simulator.ledger.TrainingConfig ({exc}); write it "
                         "with simulator.max_length.step_metadata") from None


@dataclass(frozen=True, kw_only=True)
class ExportedSteps:
    """The exported whole-step workloads of one model and system: path by (length, depth)."""

    model: str
    system: str
    model_layers: int
    config: TrainingConfig
    paths: Mapping[tuple[int, int], Path]

    @property
    def lengths(self) -> list[int]:
        return sorted({length for length, _ in self.paths})

    def depths(self, seq_len: int) -> tuple[int, int]:
        """The depths the step at ``seq_len`` comes from: the full depth, or the two shallowest traced."""
        traced = sorted(d for length, d in self.paths if length == seq_len)
        if self.model_layers in traced:
            return self.model_layers, self.model_layers
        if len(traced) < 2:
            raise ValueError(f"{self.model}/{self.system} at {seq_len:,} tokens: exported at depth {traced} only; "
                             f"export it at the full depth ({self.model_layers} layers) or at two depths to "
                             "extrapolate from")
        return traced[0], traced[1]


def steps_from_workloads(paths: Iterable[Path]) -> list[ExportedSteps]:
    """Group exported workload files (each with :func:`step_metadata`) by model and system."""
    groups: dict[tuple[str, str], dict] = {}
    for path in sorted(paths):
        meta = Workload.from_json(path).metadata
        missing = [k for k in METADATA_KEYS if k not in meta]
        if missing:
            raise ValueError(f"{path.name}: workload metadata lacks {missing}; export whole steps with "
                             "simulator.max_length.step_metadata (python -m experiments.paper_scale.export_steps)")
        group = groups.setdefault((meta["model"], meta["system"]), {
            "model_layers": meta["model_layers"], "config": _config_from(meta["training_config"]), "paths": {}})
        if group["model_layers"] != meta["model_layers"] or group["config"] != _config_from(meta["training_config"]):
            raise ValueError(f"{path.name}: {meta['model']}/{meta['system']} workloads disagree on the model depth "
                             "or the training configuration; export each configuration into its own directory")
        group["paths"][(int(meta["seq_len"]), int(meta["layers"]))] = path
    return [ExportedSteps(model=m, system=s, **g) for (m, s), g in groups.items()]


@dataclass(frozen=True, kw_only=True)
class TableRow:
    """One model and system of a max-length table."""

    model: str
    system: str
    config: TrainingConfig
    found: MaxLength
    next_length: int | None
    """The shortest exported length above the nominal answer (it does not fit), when there is one."""

    @property
    def static_memory_bytes(self) -> int:
        return ledger_peak(self.config, 0)

    @property
    def extrapolated(self) -> bool:
        return any(s.extrapolated_from for s in self.found.steps.values())

    def crossing(self, capacity_bytes: int) -> int | None:
        """Where the nominal peak reaches ``capacity_bytes`` on the straight line between the longest fitting
        length and the next exported one (both simulated): an interpolation, labelled as such in tables."""
        best, above = self.found.nominal.max_seq_len, self.next_length
        if best is None or above is None or above not in self.found.steps:
            return None
        lo, hi = (ledger_peak(self.config, self.found.steps[n].dynamic_memory_bytes) for n in (best, above))
        if hi <= lo:
            return None
        return int(best + (capacity_bytes - lo) * (above - best) / (hi - lo))


def max_length_table(groups: Sequence[ExportedSteps], simulate_dynamic: Callable[[Path], tuple[float, int]], *,
                     capacity_bytes: int, progress: Callable[[str], None] | None = None) -> list[TableRow]:
    """For each model and system: the longest exported length whose whole step (``simulate_dynamic(path)`` =
    step time, dynamic memory) fits with the ledger of the exported configuration, with its band."""
    rows = []
    for group in groups:
        def step(seq_len: int, group: ExportedSteps = group) -> ModelStep:
            depths = group.depths(seq_len)
            if progress:
                progress(f"{group.model}/{group.system}: {seq_len:,} tokens")
            time_s, dynamic = extrapolate_depth(lambda d: simulate_dynamic(group.paths[(seq_len, d)]),
                                                group.model_layers, depths)
            return ModelStep(seq_len=seq_len, step_time_s=time_s, dynamic_memory_bytes=dynamic,
                             extrapolated_from=None if depths[0] == depths[1] else depths)

        lengths = group.lengths
        found = max_length(step, group.config, capacity_bytes=capacity_bytes, low=lengths[0], high=lengths[-1],
                           lengths=lengths, start=lengths[0])
        best = found.nominal.max_seq_len
        above = [n for n in lengths if best is None or n > best]
        rows.append(TableRow(model=group.model, system=group.system, config=group.config, found=found,
                             next_length=above[0] if above else None))
    return rows


def format_table(rows: Sequence[TableRow], capacity_bytes: int) -> str:
    """A plain-text table of :func:`max_length_table`'s rows."""
    head = (f"{'model':16s} {'system':14s} {'max length':>11s} {'band (high-low static)':>23s} {'stopped':>9s} "
            f"{'interp.':>9s} {'step s':>8s} {'static GiB':>10s}  note")
    out = [head, "-" * len(head)]
    for row in rows:
        nominal = row.found.nominal
        band = f"{row.found.high_memory.display()} – {row.found.low_memory.display()}"
        step = "-" if nominal.step_time_s is None else f"{nominal.step_time_s:.2f}"
        crossing = row.crossing(capacity_bytes)
        notes = []
        if nominal.stopped == "converged" and row.next_length is not None:
            notes.append(f"{row.next_length:,} does not fit")
        if nominal.stopped == "ceiling":
            notes.append("the longest exported length fits: export longer ones")
        if row.extrapolated:
            notes.append("depth extrapolated: too low under checkpointing")
        out.append(f"{row.model:16s} {row.system:14s} {nominal.display():>11s} {band:>23s} {nominal.stopped:>9s} "
                   f"{'-' if crossing is None else f'{crossing:,}':>9s} {step:>8s} "
                   f"{row.static_memory_bytes / 2**30:>10.2f}  {'; '.join(notes)}")
    out.append(f"capacity {capacity_bytes / 2**30:.2f} GiB per rank. Lengths are the exported ones; 'interp.' is "
               "where a straight line between the answer and the next exported length reaches capacity (not "
               "simulated).")
    return "\n".join(out)
