"""The strategy registry: every system the tables compare, as one object each, with one spelling per system.

A :class:`Strategy` says what a system is everywhere it appears (the pass, the simulator, the measured CPU table,
the paper-scale tables, the notebooks, the CLIs): its name, who implements it (this project's pass, a hand-written
baseline, DeepSpeed), how it parallelises the sequence (Ulysses, ring, a Ulysses x ring hybrid, the pass's own
choice, or not at all) with its degrees, the ZeRO stage it trains under at paper scale, the ``autosp.compile``
options its simulated workload is traced with, and how its whole-step workload is built from that trace
(:class:`WorkloadRecipe`, whose :meth:`~WorkloadRecipe.build` puts the trace, the rewrites of
:mod:`simulator.workload_rewrites` and DeepSpeed's step of :mod:`simulator.training_step` together). Look systems
up in :data:`STRATEGIES` (``STRATEGIES["ring"]``); an unknown name raises
:class:`UnknownStrategyError` listing the valid ones. The hybrid family is open: ``STRATEGIES["autosp-hybrid-2x4"]``
(Ulysses degree 2, ring degree 4) or :func:`hybrid`.

The module is torch-free (the simulator never imports torch): the experiments turn a strategy into a running
system, and filter its options against the installed ``autosp.AutoSPConfig`` with :meth:`Strategy.options_for`,
which refuses (rather than silently drops) an option that changes what is computed.

Adding a strategy: add its :class:`Strategy` to ``_FIXED`` below (or a family to ``_Registry.__getitem__``),
give it a recipe, list it in the tables it belongs to (``tables``) and add a case to
``tests/simulator/test_strategies.py``; the tables, searches and CLIs read it from here (docs/design.md, "Adding a
strategy").

Note [Hybrid rank layout]
~~~~~~~~~~~~~~~~~~~~~~~~~
A hybrid of Ulysses degree ``u`` and ring degree ``r`` over ``sp = u x r`` ranks puts Ulysses innermost: the
Ulysses groups are ``u`` consecutive ranks (``[0..u-1], [u..2u-1], ...``), so with ``u`` dividing the GPUs per
node their all-to-alls stay on NVLink; the ring groups are the ranks ``u`` apart (``[0, u, 2u, ...]``), whose
neighbours sit on other nodes on the same rail when ``u`` is the node size (:mod:`simulator.topology`). This is
the layout of USP (Fang & Zhao, "USP: A Unified Sequence Parallelism Approach for Long Context Generative AI",
arXiv 2405.07719), and the one ``autosp.compile(strategy="hybrid", ulysses_size=u)`` builds (autosp/groups.py).
Pure Ulysses is ``u = sp, r = 1``, pure ring ``u = 1, r = sp``. It is written once, in
:meth:`simulator.sp_layout.SPLayout.sp_rank`, which the process groups, the export and :meth:`Strategy.sp_groups`
read.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from simulator.training_step import add_training_step, gradients_from_modules, place_gradients
from simulator.workload import (
    CHOSEN_STRATEGIES,
    COMPILED_STRATEGIES,
    MEMORY_PLANNED_STRATEGIES,
    SPKind,
    SPLayout,
)
from simulator.workload_rewrites import ModuleParameters, ring_workload, zero3_workload

if TYPE_CHECKING:
    from simulator.ledger import TrainingConfig
    from simulator.workload import Workload

IMPLEMENTATIONS = ("autosp", "hand-written", "deepspeed")
"""Who runs a strategy: this project's pass (``autosp``), a hand-written baseline in ``experiments/baselines``,
or DeepSpeed itself (its ZeRO-3 engine, its own AutoSP pass)."""
SEQUENCE_PARALLEL = (*COMPILED_STRATEGIES, *CHOSEN_STRATEGIES, "none")
"""How the sequence is split: Ulysses all-to-alls, a ring of K/V passes, both (Note [Hybrid rank layout]), the
pass's choice by simulation (``auto``), or not at all (each rank trains on the whole sequence). The names the pass
compiles and plans are declared once, in :mod:`simulator.workload` (:data:`~simulator.workload.COMPILED_STRATEGIES`,
:data:`~simulator.workload.CHOSEN_STRATEGIES`)."""
REWRITES = ("ring", "zero3")
"""Rewrites of a traced workload (:mod:`simulator.workload_rewrites`): ``ring``: the Ulysses
trace with each attention split into peer-to-peer ring steps and online-softmax merges (the hand-written ring
baseline); ``zero3``: the single-device trace with per-layer parameter all-gathers and gradient reduce-scatters."""
TABLES = ("measured-cpu", "memory-cap", "paper-scale")
"""The tables a strategy can be listed in: measured on CPU gloo ranks (step time; the longest length under a
memory cap), simulated at paper scale."""
# Options that change what the pass computes (memory_plan: what the system is): a pass without the field must
# refuse the strategy, unless the value is what such a pass does anyway (before strategies existed, the pass only
# did Ulysses).
_REQUIRED_OPTIONS = frozenset({"strategy", "ulysses_size", "ring_size", "memory_plan"})
_IMPLICIT_OPTIONS = {"strategy": "ulysses", "memory_plan": "off"}


class UnknownStrategyError(ValueError, KeyError):
    """A name that is no strategy; the message lists the valid names."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True, kw_only=True)
class WorkloadRecipe:
    """How a strategy's whole-step workload is built, torch-free: trace, optional rewrite, DeepSpeed's step."""

    trace_sequence_parallel: bool
    """Trace with the strategy's SP degree (True) or with ``sp_size=1``, every rank the whole sequence (False)."""
    rewrite: str | None = None
    """``None``: the workload the real pass exports, as is; else one of :data:`REWRITES`."""
    gradient_step: str = "deepspeed"
    """The gradient reduction and optimizer step appended (``simulator.training_step.add_training_step``) under
    the strategy's ZeRO stage; ``"in-rewrite"``: the rewrite already reduces the gradients (ZeRO-3's
    reduce-scatters), only the optimizer step is appended."""

    def __post_init__(self) -> None:
        if self.rewrite is not None and self.rewrite not in REWRITES:
            raise ValueError(f"unknown workload rewrite {self.rewrite!r}; choose one of {REWRITES}")
        if self.gradient_step not in ("deepspeed", "in-rewrite"):
            raise ValueError(f"gradient_step must be 'deepspeed' or 'in-rewrite', got {self.gradient_step!r}")

    def build(self, traced: Workload, modules: Sequence[ModuleParameters], cfg: TrainingConfig, *,
              element_bytes: int = 2) -> Workload:
        """The whole training step from ``traced`` (one forward and backward exported by ``autosp.export``, traced
        as :attr:`trace_sequence_parallel` says) and its module map ``modules``
        (``autosp.export.module_parameters``): the rewrite, then DeepSpeed's gradient reduction and optimizer step
        under ``cfg`` (Note [DeepSpeed gradient reduction] in simulator/training_step.py) over
        ``cfg.dp_world_size`` ranks; ``element_bytes``: bytes of one parameter or activation element (2: bf16)."""
        workload = traced
        if self.rewrite == "zero3":
            workload = zero3_workload(traced, modules, world_size=cfg.dp_world_size)
        elif self.rewrite == "ring":
            workload = ring_workload(traced, element_bytes=element_bytes)
        if self.gradient_step == "in-rewrite":  # ZeRO-3's reduce-scatters run on the rewrite's dp_reduce group
            return add_training_step(workload, [], cfg, group="dp_reduce")
        workload = place_gradients(workload, [n for m in modules for n in m.gradients], cfg)
        sizes = [(m.gradients, m.parameter_bytes // element_bytes) for m in modules]
        gradients = {r: gradients_from_modules(p, sizes) for r, p in workload.ranks.items()}
        return add_training_step(workload, gradients, cfg, group="dp",
                                 group_instances=[list(range(cfg.dp_world_size))])


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """One system of the tables (see the module docstring)."""

    name: str
    """The one spelling, everywhere."""
    description: str
    """One line for tables and ``--help``."""
    implementation: str
    """One of :data:`IMPLEMENTATIONS`."""
    sequence_parallel: str
    """One of :data:`SEQUENCE_PARALLEL`."""
    zero_stage: int
    """ZeRO stage of the DeepSpeed engine at paper scale (``experiments/paper_scale/config.py`` explains why 1)."""
    workload: WorkloadRecipe | None
    """How the simulated whole step is built; ``None``: never simulated (DeepSpeed's own AutoSP)."""
    options: tuple[tuple[str, Any], ...] = ()
    """The ``autosp.compile`` options the simulated workload is traced with (and, for the ``autosp``
    implementation, the measured system runs with), as sorted pairs; see :attr:`compile_options`."""
    ulysses_size: int | None = None
    """Hybrid: the Ulysses degree (Note [Hybrid rank layout]); ``None`` for the others (derived from sp_size)."""
    ring_size: int | None = None
    """Hybrid: the ring degree."""
    tables: tuple[str, ...] = ()
    """The tables (:data:`TABLES`) the strategy is listed in, in their order of appearance."""
    published: bool = False
    """The AutoSP paper reports a figure for it (``experiments/data/autosp-paper-figures.csv``)."""

    @property
    def min_ranks(self) -> int:
        """The fewest ranks it trains on: a hybrid's ``ulysses_size x ring_size`` (one sequence over all of them);
        1 for the others."""
        return self.ulysses_size * self.ring_size if self.sequence_parallel == "hybrid" else 1

    def cannot_run_on(self, ranks: int) -> str | None:
        """Why the strategy cannot split one sequence over all ``ranks`` ranks, as a table row's note (``"needs 4
        ranks"``), or ``None`` where it can: what the measured tables ask of it (they give every system the
        whole world as its SP group). A hybrid runs on exactly :attr:`min_ranks` ranks there."""
        if ranks < self.min_ranks:
            return f"needs {self.min_ranks} ranks"
        if self.sequence_parallel == "hybrid" and ranks != self.min_ranks:
            return f"splits a sequence over exactly {self.min_ranks} ranks, not {ranks}"
        return None

    @property
    def memory_planned(self) -> bool:
        """Its memory options are the memory planner's choice wherever the job gives a memory size: the pass with
        ``memory_plan="auto"``, or with its default (unset) under a strategy the planner plans (Note [The default
        memory plan] in autosp/plan/auto.py).  A table that gives memory sizes passes ``target_memory`` (and the
        job's ``plan_setup``) to such a strategy; the others run it unplanned (no memory size on CPU)."""
        options = dict(self.options)  # the planned kinds: SPKind.memory_planned (simulator/sp_layout.py)
        return (self.implementation == "autosp" and options.get("memory_plan", "auto") == "auto"
                and options.get("strategy", SPKind.ULYSSES.value) in MEMORY_PLANNED_STRATEGIES)

    def __post_init__(self) -> None:
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"{self.name}: implementation must be one of {IMPLEMENTATIONS}")
        if self.sequence_parallel not in SEQUENCE_PARALLEL:
            raise ValueError(f"{self.name}: sequence_parallel must be one of {SEQUENCE_PARALLEL}")
        if (self.sequence_parallel == "hybrid") != (self.ulysses_size is not None and self.ring_size is not None):
            raise ValueError(f"{self.name}: a hybrid needs ulysses_size and ring_size, and only a hybrid has them")
        if any(t not in TABLES for t in self.tables):
            raise ValueError(f"{self.name}: tables must be among {TABLES}")

    @property
    def compile_options(self) -> dict[str, Any]:
        """The ``autosp.compile`` options as a fresh dict."""
        return dict(self.options)

    def options_for(self, fields: Collection[str]) -> dict[str, Any]:
        """:attr:`compile_options` restricted to the option names ``fields`` the installed pass accepts
        (``{f.name for f in dataclasses.fields(autosp.AutoSPConfig)}``). Tuning options it lacks (checkpointing,
        overlap) are dropped; an option that changes what is computed (the strategy, its degrees) raises
        ``ValueError`` unless the value is what a pass without it does anyway (Ulysses)."""
        out = {}
        for key, value in self.options:
            if key in fields:
                out[key] = value
            elif key in _REQUIRED_OPTIONS and _IMPLICIT_OPTIONS.get(key) != value:
                raise ValueError(f"{self.name} needs the pass option {key}={value!r}, which this autosp does not "
                                 "have; update autosp or pick another strategy")
        return out

    def sp_size(self, ranks: int) -> int:
        """Ranks one sequence is split over when training on ``ranks`` ranks: all of them, 1 without sequence
        parallelism, ``ulysses_size x ring_size`` for a hybrid (data-parallel replicas over the rest)."""
        if ranks < 1:
            raise ValueError(f"ranks must be positive, got {ranks}")
        if self.sequence_parallel == "none":
            return 1
        if self.sequence_parallel != "hybrid":
            return ranks
        sp = self.ulysses_size * self.ring_size
        if ranks % sp:
            raise ValueError(f"{self.name} splits a sequence over {sp} ranks; {ranks} ranks is not a multiple of it")
        return sp

    def layout(self, sp_size: int) -> SPLayout:
        """Its rank layout over ``sp_size`` ranks (:class:`~simulator.workload.SPLayout`: the degrees, the groups;
        the one rank layout the pass builds its process groups and exports its programs with). Without sequence
        parallelism, the layout of one rank."""
        kind = self.sequence_parallel
        if kind in CHOSEN_STRATEGIES:
            raise ValueError(f"{self.name}: the pass chooses the degrees (strategy='auto'); ask its report")
        if kind == "none":
            if sp_size != 1:
                raise ValueError(f"{self.name} does not split the sequence; sp_size must be 1, got {sp_size}")
            return SPLayout(SPKind.ULYSSES, 1, 1)
        if SPKind(kind).grouped and self.ulysses_size * self.ring_size != sp_size:
            raise ValueError(f"{self.name} has ulysses_size x ring_size = {self.ulysses_size} x {self.ring_size}; "
                             f"sp_size {sp_size} differs: use autosp-hybrid-UxR with U x R = {sp_size}")
        return SPLayout.from_options(kind, sp_size, ulysses_size=self.ulysses_size, ring_size=self.ring_size)

    def degrees(self, sp_size: int) -> tuple[int, int]:
        """``(ulysses_size, ring_size)`` with ``ulysses_size * ring_size == sp_size`` (:meth:`layout`'s)."""
        layout = self.layout(sp_size)
        return layout.ulysses_size, layout.ring_size

    def sp_groups(self, sp_size: int) -> dict[str, list[list[int]]]:
        """The Ulysses and ring groups of ranks ``0..sp_size-1`` (Note [Hybrid rank layout]; :meth:`layout`'s)."""
        layout = self.layout(sp_size)
        return {"ulysses": [list(g) for g in layout.ulysses_groups()], "ring": [list(g) for g in layout.ring_groups()]}


def _options(**kw: Any) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(kw.items()))


_SP, _ZERO1 = WorkloadRecipe(trace_sequence_parallel=True), 1
_BOTH, _MEASURED = ("measured-cpu", "memory-cap", "paper-scale"), ("measured-cpu", "memory-cap")
_HAND = _options(strategy="ulysses", checkpointing="none", overlap_communication=False)


def _hybrid(ulysses_size: int, ring_size: int, *, tables: tuple[str, ...] = ()) -> Strategy:
    """A hybrid of the family (see :func:`hybrid`), listed in ``tables``."""
    if not (isinstance(ulysses_size, int) and isinstance(ring_size, int) and ulysses_size >= 1 and ring_size >= 1):
        raise ValueError(f"hybrid degrees must be positive integers, got {ulysses_size!r} x {ring_size!r}")
    return Strategy(name=f"autosp-hybrid-{ulysses_size}x{ring_size}",
                    description=f"AutoSP (this pass): Ulysses over {ulysses_size} ranks x ring over {ring_size}",
                    implementation="autosp", sequence_parallel="hybrid", zero_stage=_ZERO1, workload=_SP,
                    options=_options(strategy="hybrid", ulysses_size=ulysses_size, ring_size=ring_size,
                                     memory_plan="off"),
                    ulysses_size=ulysses_size, ring_size=ring_size, tables=tables)


_FIXED: tuple[Strategy, ...] = (
    # AutoSP as compiled by default: where the job gives a memory size (the memory-cap table's cap), the memory
    # planner chooses its memory options (Note [The planner's memory-cap row] in experiments/cpu/memory_cap.py);
    # elsewhere (no memory size on CPU; simulated as the paper ran it) SAC, as autosp-sac.
    Strategy(name="autosp", description="AutoSP (this pass) as compiled by default: Ulysses, overlapped "
             "all-to-alls, selective activation checkpointing or, given a memory size, the memory planner's plan",
             implementation="autosp", sequence_parallel="ulysses", zero_stage=_ZERO1,
             workload=_SP, options=_options(strategy="ulysses"), tables=_BOTH, published=True),
    Strategy(name="autosp-nosac", description="AutoSP without activation checkpointing", implementation="autosp",
             sequence_parallel="ulysses", zero_stage=_ZERO1, workload=_SP,
             options=_options(strategy="ulysses", checkpointing="none", memory_plan="off"), tables=_MEASURED),
    Strategy(name="ulysses", description="hand-written DeepSpeed-Ulysses (blocking all-to-alls, no checkpointing)",
             implementation="hand-written", sequence_parallel="ulysses", zero_stage=_ZERO1, workload=_SP,
             options=_HAND, tables=_BOTH, published=True),
    Strategy(name="ulysses+ckpt", description="hand-written Ulysses with per-layer activation checkpointing",
             implementation="hand-written", sequence_parallel="ulysses", zero_stage=_ZERO1, workload=_SP,
             options=_options(strategy="ulysses", checkpointing="layer", overlap_communication=False), tables=_BOTH),
    Strategy(name="ring", description="hand-written zig-zag ring attention (fused chunks, fp32 online softmax)",
             implementation="hand-written", sequence_parallel="ring", zero_stage=_ZERO1,
             workload=WorkloadRecipe(trace_sequence_parallel=True, rewrite="ring"), options=_HAND, tables=_BOTH,
             published=True),
    Strategy(name="zero3", description="DeepSpeed ZeRO-3 data parallelism, no sequence parallelism",
             implementation="deepspeed", sequence_parallel="none", zero_stage=3,
             workload=WorkloadRecipe(trace_sequence_parallel=False, rewrite="zero3", gradient_step="in-rewrite"),
             options=_options(checkpointing="none"), tables=_BOTH, published=True),
    Strategy(name="deepspeed-autosp", description="DeepSpeed's own AutoSP pass, run as it is",
             implementation="deepspeed", sequence_parallel="ulysses", zero_stage=_ZERO1, workload=None,
             tables=_MEASURED),
    # DeepSpeed's ALST (Arctic Long Sequence Training) as ArcticTraining configures it: measured only.  Its tiled
    # autograd functions and offload hooks are no trace of this pass, which is what every workload recipe is built
    # from, so it is never simulated; ALST at paper scale is modelled row by row in experiments/paper_scale/alst.py.
    # zero_stage: ALST's published runs (ZeRO 3); the measured system runs ZeRO 0 (experiments/baselines/alst.py).
    Strategy(name="alst", description="DeepSpeed's ALST: Ulysses attention, tiled MLP, tiled logits+loss, per-layer "
             "checkpointing with its inputs offloaded (ArcticTraining's configuration)", implementation="deepspeed",
             sequence_parallel="ulysses", zero_stage=3, workload=None, tables=_MEASURED),
    # The pass's ring and auto strategies and its hybrid family (issue 21): the ring in the measured table (beside
    # the hand-written ring), and the hybrid 2 x 2 there too: it needs 4 ranks (min_ranks; on fewer its row says
    # so); every other hybrid is the family's (below); "auto" resolves to one of them before compiling
    # (autosp.plan.auto). options_for refuses them on a pass without `strategy`.
    Strategy(name="autosp-ring", description="AutoSP (this pass): zig-zag ring attention", implementation="autosp",
             sequence_parallel="ring", zero_stage=_ZERO1, workload=_SP,
             options=_options(strategy="ring", memory_plan="off"), tables=_MEASURED),
    Strategy(name="autosp-auto", description="AutoSP (this pass): the strategy and degrees it simulates fastest",
             implementation="autosp", sequence_parallel="auto", zero_stage=_ZERO1, workload=_SP,
             options=_options(strategy="auto")),
    _hybrid(2, 2, tables=_MEASURED),
    # AutoSP with the memory options as given (SAC), beside the default compile's plan in the memory-cap table:
    # what the planner adds to SAC alone.
    Strategy(name="autosp-sac", description="AutoSP (this pass) unplanned: Ulysses, selective activation "
             "checkpointing, overlapped all-to-alls (memory_plan='off')", implementation="autosp",
             sequence_parallel="ulysses", zero_stage=_ZERO1, workload=_SP,
             options=_options(strategy="ulysses", memory_plan="off"), tables=("memory-cap",)),
)

_HYBRID = re.compile(r"autosp-hybrid-([1-9][0-9]*)x([1-9][0-9]*)")


def hybrid(ulysses_size: int, ring_size: int) -> Strategy:
    """The AutoSP hybrid of Ulysses degree ``ulysses_size`` and ring degree ``ring_size``, named
    ``autosp-hybrid-<ulysses_size>x<ring_size>`` (Note [Hybrid rank layout]): the registry's own where it lists
    it in a table (``autosp-hybrid-2x2``), else a new one of the family."""
    strategy = _hybrid(ulysses_size, ring_size)
    return next((s for s in _FIXED if s.name == strategy.name), strategy)


@dataclass(frozen=True)
class _Registry(Mapping[str, Strategy]):
    """Name -> :class:`Strategy`: the fixed strategies (iteration, ``len``) plus the hybrid family on lookup."""

    _by_name: Mapping[str, Strategy] = field(default_factory=lambda: {s.name: s for s in _FIXED})

    def __getitem__(self, name: str) -> Strategy:
        strategy = self._by_name.get(name) if isinstance(name, str) else None
        if strategy is not None:
            return strategy
        match = _HYBRID.fullmatch(name) if isinstance(name, str) else None
        if match:
            return hybrid(int(match[1]), int(match[2]))
        raise UnknownStrategyError(f"unknown strategy {name!r}; choose one of {', '.join(self._by_name)} or "
                                   "autosp-hybrid-UxR (Ulysses degree U x ring degree R)")

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def table(self, name: str) -> tuple[str, ...]:
        """The strategies listed in table ``name`` (one of :data:`TABLES`), in registry order."""
        if name not in TABLES:
            raise ValueError(f"unknown table {name!r}; choose one of {TABLES}")
        return tuple(s.name for s in self._by_name.values() if name in s.tables)


    def trace_groups(self, names: Iterable[str]) -> tuple[tuple[str, ...], ...]:
        """``names`` grouped by the trace their simulated workloads are built from (the same SP tracing and
        compile options: ``ring`` rewrites ``ulysses``' trace), in order of first appearance; what one task of a
        table simulates with one trace cache."""
        groups: dict[tuple, list[str]] = {}
        for name in names:
            strategy = self[name]
            if strategy.workload is None:
                raise ValueError(f"{name} is never simulated (it has no workload recipe)")
            groups.setdefault((strategy.workload.trace_sequence_parallel, strategy.options), []).append(name)
        return tuple(tuple(g) for g in groups.values())


STRATEGIES = _Registry()
"""Every strategy by name (see the module docstring)."""


def get_strategy(name: str) -> Strategy:
    """``STRATEGIES[name]``."""
    return STRATEGIES[name]


def sp_candidates(sp_size: int, *, heads: int, kv_heads: int | None = None) -> tuple[Strategy, ...]:
    """The pass's strategies that can split a sequence over ``sp_size`` ranks for a model of ``heads`` query heads
    (``kv_heads`` key/value heads): Ulysses when ``heads`` is a multiple of ``sp_size``, the ring always, every
    hybrid ``U x R = sp_size`` (1 < U < sp_size) whose Ulysses degree divides ``heads`` — what ``strategy="auto"``
    chooses among. Key/value heads fewer than the Ulysses degree are replicated, so ``kv_heads`` restricts
    nothing; it is checked to divide ``heads``."""
    if sp_size < 1 or heads < 1:
        raise ValueError(f"sp_size and heads must be positive, got {sp_size} and {heads}")
    if kv_heads is not None and (kv_heads < 1 or heads % kv_heads):
        raise ValueError(f"kv_heads ({kv_heads}) must divide heads ({heads})")
    def splits(kind: SPKind, ulysses_size: int | None = None) -> bool:  # the layout's heads rule
        return SPLayout.from_options(kind, sp_size, ulysses_size=ulysses_size).heads_rule(heads) is None

    out = [STRATEGIES["autosp"]] if splits(SPKind.ULYSSES) else []
    out += [hybrid(u, sp_size // u) for u in range(2, sp_size) if sp_size % u == 0 and splits(SPKind.HYBRID, u)]
    out.append(STRATEGIES["autosp-ring"])
    return tuple(out)
