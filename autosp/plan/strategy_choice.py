"""The strategy decision (``strategy="auto"``): every strategy and hybrid degree predicted, the fastest that fits
chosen (`choose_strategy`, `predict_strategies`, `strategy_choice`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from autosp.errors import AutoSPError
from autosp.plan.candidates import MemoryPlan
from autosp.plan.model_source import ModelSource
from autosp.plan.prediction import Prediction, predict
from autosp.plan.setup import DECIDING_DEPTH, TrainingSetup
from autosp.plan.traces import TraceReuse, strategy_options
from simulator.cluster import Cluster
from simulator.strategies import SEQUENCE_PARALLEL, STRATEGIES, Strategy, sp_candidates
from simulator.workload import CHOSEN_STRATEGIES, COMPILED_STRATEGIES

log = logging.getLogger(__name__)

AUTO_STRATEGIES = COMPILED_STRATEGIES
"""The compiled strategies ``strategy="auto"`` simulates (``simulator.workload``'s ``COMPILED_STRATEGIES``): Ulysses,
the ring and every hybrid Ulysses degree that runs (`strategy_candidates`)."""
STRATEGY_CHOICES = tuple(kind for kind in SEQUENCE_PARALLEL if kind in AUTO_STRATEGIES or kind in CHOSEN_STRATEGIES)
"""``--strategy``: a strategy of `AUTO_STRATEGIES` (the hybrid with its Ulysses degree, ``--ulysses-size``), or
``auto`` (`choose_strategy`); read from the registry."""


@dataclass(frozen=True, kw_only=True)
class StrategyCandidate:
    """One strategy's prediction (traced with its ``autosp.compile`` options, exported, simulated), or why it
    cannot run."""

    strategy: str
    """The pass's strategy (a name of `AUTO_STRATEGIES`)."""
    system: str
    """Its name in the registry (``simulator.strategies.STRATEGIES``): ``autosp``, ``autosp-ring`` or
    ``autosp-hybrid-UxR``; what the decision names."""
    options: dict = field(default_factory=dict)
    """The ``autosp.compile`` options that select it (``strategy``, and a hybrid's ``ulysses_size`` and
    ``ring_size``): `strategy_options` of the registry's."""
    prediction: Prediction | None
    refused: str | None = None

    @property
    def fits(self) -> bool:
        return self.prediction is not None and self.prediction.fits

    def to_dict(self) -> dict:
        p = self.prediction
        return {"strategy": self.strategy, "system": self.system, "options": dict(self.options),
                "refused": self.refused, "fits": self.fits, "step_time_s": None if p is None else p.step.step_time_s,
                "peak_bytes": None if p is None else p.peak_bytes}


@dataclass(frozen=True, kw_only=True)
class StrategyDecision:
    """What ``strategy="auto"`` predicted for each candidate, what it chose and why."""

    candidates: tuple[StrategyCandidate, ...]
    chosen: str | None
    """The registry name (`StrategyCandidate.system`) of the fastest candidate that fits; None when none fits
    (``reason`` says so)."""
    reason: str
    capacity_bytes: int
    seconds: float = 0.0

    @property
    def chosen_candidate(self) -> StrategyCandidate | None:
        return next((c for c in self.candidates if c.system == self.chosen), None)

    @property
    def options(self) -> dict:
        """The `autosp.compile` options of the chosen strategy (``autosp.compile(model, sp_size=P,
        **decision.options)``); an error when none fits."""
        if self.chosen is None:
            raise AutoSPError(f"no strategy fits {self.capacity_bytes / 2**30:.3f} GiB per rank: {self.reason}")
        return dict(self.chosen_candidate.options)

    @property
    def prediction(self) -> Prediction | None:
        """The chosen candidate's prediction."""
        chosen = self.chosen_candidate
        return None if chosen is None else chosen.prediction

    def to_dict(self) -> dict:
        chosen = self.prediction
        return {"strategy": "auto", "chosen": self.chosen, "reason": self.reason,
                "options": None if self.chosen is None else self.options,
                "capacity_bytes": self.capacity_bytes, "seconds": self.seconds,
                "candidates": [c.to_dict() for c in self.candidates],
                "prediction": None if chosen is None else chosen.to_dict()}

    def format(self) -> str:
        gib = 2**30
        out = [f"strategy auto: {len(self.candidates)} candidates, each traced and simulated on its own "
               f"({self.seconds:.1f} s); capacity {self.capacity_bytes / gib:.3f} GiB per rank",
               f"  {'strategy':10s} {'system':18s} {'fits':4s} {'peak GiB':>9s} {'step ms':>10s}"]
        for c in self.candidates:
            mark = "*" if c.system == self.chosen else " "
            if c.prediction is None:
                out.append(f"{mark} {c.strategy:10s} {c.system:18s} refused: {c.refused}")
                continue
            p = c.prediction
            out.append(f"{mark} {c.strategy:10s} {c.system:18s} {'yes' if c.fits else 'NO':4s} "
                       f"{p.peak_bytes / gib:9.3f} {p.step.step_time_s * 1e3:10.3f}")
        out.append(f"  chosen      {self.chosen or 'none'}: {self.reason}")
        if self.prediction is not None:
            out += ["", self.prediction.format()]
        return "\n".join(out)


def strategy_candidates(model, setup: TrainingSetup) -> list[tuple[Strategy, str | None]]:
    """(registry entry, why it cannot run) for every candidate of ``strategy="auto"``: Ulysses (refused when the
    heads do not divide over ``setup.sp_size``), then the registry's `simulator.strategies.sp_candidates` for the
    model's heads and ``setup.sp_size`` (every hybrid ``U x R`` whose Ulysses degree divides the heads, then the
    ring).  ``model``: a preset or config.json (`ModelSource`), or a Hugging Face config object (what the job's
    ranks hold: `autosp.plan.auto.decide_strategy`) or its dict (config.json's fields)."""
    hf = ModelSource(model).config(seq_len=setup.seq_len) if isinstance(model, str) else model
    read = hf.get if isinstance(hf, Mapping) else lambda name, default=None: getattr(hf, name, default)
    heads = int(read("num_attention_heads"))
    kv_heads = int(read("num_key_value_heads", None) or heads)
    runnable = sp_candidates(setup.sp_size, heads=heads, kv_heads=kv_heads)
    ulysses = STRATEGIES["autosp"]
    found = [] if ulysses in runnable else [
        (ulysses, f"{heads} attention heads are not divisible by sp_size {setup.sp_size}")]
    return found + [(s, None) for s in runnable if s.sequence_parallel in AUTO_STRATEGIES]


def every_strategy_plans(model_config: Mapping, setup: TrainingSetup, plans: Callable[[Mapping], Sequence[MemoryPlan]]
                         ) -> tuple[MemoryPlan, ...]:
    """``strategy="auto"`` with the memory planned, or with the longest length searched: one decision over every
    strategy that runs (`strategy_candidates`) crossed with its memory candidates, ``plans(strategy_options)``
    (the candidates with the strategy's ``autosp.compile`` options fixed), each named ``"<system>: <plan>"`` and
    keeping the strategy in its options (Ulysses too), so the planner's choice is the strategy and the memory
    options together (Note [The strategy and the memory in one decision]).  ``model_config``: the Hugging Face
    config as a dict."""
    found = []
    for strategy, why in strategy_candidates(model_config, setup):
        if why is not None:
            log.info("strategy auto: %s not planned: %s", strategy.name, why)
            continue
        fixed = {"strategy": strategy.sequence_parallel, **strategy_options(strategy.compile_options)}
        found += [MemoryPlan(f"{strategy.name}: {p.name}", {**p.options, **fixed}) for p in plans(fixed)]
    if not found:
        raise AutoSPError(f"no strategy runs {model_config.get('num_attention_heads')} attention heads over "
                          f"sp_size {setup.sp_size}")
    return tuple(found)


# Note [The strategy and the memory in one decision]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Which strategy is fastest can depend on the memory options (a ring's KV blocks and a hybrid's smaller all-to-alls
# leave different room for recomputation), and which memory options fit can depend on the strategy.  Choosing one
# after the other could refuse a job that fits or pick a slower pair, so ``strategy="auto"`` with the memory planned
# (``autosp.compile(strategy="auto", memory_plan="auto")``, ``python -m autosp.plan --strategy auto --memory-plan
# auto``) and the longest-length search under ``--strategy auto`` are one planner decision (`plan_memory`) over the
# product: each runnable strategy's memory candidates, named by strategy.  Its objective is the planner's (the
# fastest plan within the target, or the longest length), its cost about the number of strategies times one
# strategy's decision (candidates differing only in checkpointing still share a trace).  The ring of Ulysses
# degree 1 is always among them; Ulysses and every hybrid whose Ulysses degree divides the heads join it.


def strategy_choice(candidates: Sequence[Mapping], capacity_bytes: int) -> dict:
    """The rule of ``strategy="auto"`` on the candidates' rows (`StrategyCandidate.to_dict`, in the order of
    `strategy_candidates`): the fastest candidate that fits (``fits``: its peak within ``capacity_bytes`` and its
    host peak within the host's) is chosen, ties to the earlier candidate.  The answer has the keys of
    `StrategyDecision.to_dict` but ``seconds`` and ``prediction``: ``strategy`` ("auto"), ``chosen`` (a registry name
    or None), ``reason``, ``options`` (the chosen row's), ``capacity_bytes`` and ``candidates`` (the rows).  One rule
    for the decision taken in one process (`choose_strategy`) and the one whose candidates were predicted on the
    process group's ranks (`autosp.plan.auto.decide_strategy`, Note [Candidates spread over the ranks] in
    autosp/plan/auto.py)."""
    rows = [dict(c) for c in candidates]
    fitting = [c for c in rows if c["fits"]]
    if fitting:
        best = min(fitting, key=lambda c: c["step_time_s"])  # min keeps the first of equal times
        others = [c for c in rows if c["step_time_s"] is not None and c is not best]
        reason = f"the fastest that fits ({best['step_time_s'] * 1e3:.3f} ms per step" + "".join(
            f"; {c['system']} {c['step_time_s'] * 1e3:.3f} ms"
            + ("" if c["fits"] else f", peak {c['peak_bytes'] / 2**30:.3f} GiB does not fit") for c in others) + ")"
        chosen = best
    else:
        chosen = None
        reason = f"no strategy fits {capacity_bytes / 2**30:.3f} GiB per rank" + "".join(
            f"; {c['system']} peaks at {c['peak_bytes'] / 2**30:.3f} GiB" for c in rows if c["peak_bytes"] is not None)
    return {"strategy": "auto", "chosen": None if chosen is None else chosen["system"], "reason": reason,
            "options": None if chosen is None else dict(chosen["options"]), "capacity_bytes": int(capacity_bytes),
            "candidates": rows}


def predict_strategies(model: str, setup: TrainingSetup, cluster: Cluster, *, options: Mapping | None = None,
                       capacity_bytes: int | None = None, reuse: TraceReuse | None = None,
                       progress: Callable[[str], None] | None = None, share_capture: bool = True,
                       only: Collection[str] | None = None) -> tuple[list[StrategyCandidate], int]:
    """Every candidate of `strategy_candidates` predicted (traced with its strategy, exported from what its pass
    emits and simulated on ``cluster``: `predict`), or why it cannot run, and the capacity a rank has
    (``capacity_bytes``, default: the device's memory); ``only``: the registry names of the runnable candidates to
    predict (the others are left out of the answer; refused ones are listed).  The arguments as `choose_strategy`'s."""
    setup.check()
    setup = dataclasses.replace(setup, depth=setup.depth or DECIDING_DEPTH)
    if setup.sp_size < 2:
        raise AutoSPError("strategy 'auto' chooses how a sequence is split over ranks: give sp_size >= 2")
    options = dict(options or {})
    fixed = sorted(set(options) & {"strategy", "ulysses_size", "ring_size"})
    if fixed:
        raise AutoSPError(f"strategy 'auto' chooses the strategy and its degrees; do not pass {', '.join(fixed)} too")
    capacity = int(cluster.device.memory_bytes if capacity_bytes is None else capacity_bytes)
    found = [(s, why) for s, why in strategy_candidates(model, setup)
             if only is None or why is not None or s.name in only]
    reuse = TraceReuse([]) if reuse is None else reuse
    # Note [One Dynamo capture for every strategy]: the runnable candidates' shallow traces share Dynamo's capture
    reuse.strategies = tuple(strategy_options(s.compile_options) for s, why in found if why is None) \
        if share_capture else ()
    candidates = []
    for strategy, why in found:
        prediction, selected = None, strategy_options(strategy.compile_options)
        if why is None:
            try:
                prediction = predict(model, setup, cluster, options={**options, **selected},
                                     capacity_bytes=capacity, reuse=reuse, progress=progress)
            except AutoSPError as err:
                why = str(err)
        candidates.append(StrategyCandidate(strategy=strategy.sequence_parallel, system=strategy.name,
                                            options=selected, prediction=prediction, refused=why))
        if prediction is None:
            log.info("strategy %s: refused (%s)", strategy.name, why)
        else:
            log.info("strategy %s: step %.6f s, peak %.3f GiB per rank (%s)", strategy.name,
                     prediction.step.step_time_s, prediction.peak_bytes / 2**30,
                     "fits" if prediction.fits else "does not fit")
    return candidates, capacity


def choose_strategy(model: str, setup: TrainingSetup, cluster: Cluster, *, options: Mapping | None = None,
                    capacity_bytes: int | None = None, reuse: TraceReuse | None = None,
                    progress: Callable[[str], None] | None = None, share_capture: bool = True) -> StrategyDecision:
    """``strategy="auto"``: predict ``setup`` under every candidate strategy and degree the pass compiles
    (`predict_strategies`: `strategy_candidates`, each traced with that strategy, exported from what its pass emits
    and simulated on ``cluster``), and choose by `strategy_choice`: the fastest whose peak fits ``capacity_bytes``
    (default: the device's memory); ties go to the earlier candidate.  ``options``: further `autosp.compile` options
    (not the strategy or its degrees); ``reuse``: traces shared with other calls (`TraceReuse`); ``share_capture``:
    the candidates' shallow traces share one Dynamo capture per depth (Note [One Dynamo capture for every
    strategy]; False: each traced on its own, for comparison)."""
    start = time.perf_counter()
    candidates, capacity = predict_strategies(model, setup, cluster, options=options, capacity_bytes=capacity_bytes,
                                              reuse=reuse, progress=progress, share_capture=share_capture)
    choice = strategy_choice([c.to_dict() for c in candidates], capacity)
    log.info("strategy auto chose %s: %s", choice["chosen"], choice["reason"])
    return StrategyDecision(candidates=tuple(candidates), chosen=choice["chosen"], reason=choice["reason"],
                            capacity_bytes=capacity, seconds=time.perf_counter() - start)
