"""The memory planner: choose `autosp.compile`'s memory options (checkpointing, SAC budget, tiled loss, tiled MLP,
activation offload)
for a model, a cluster and a training configuration by predicting every candidate plan (the candidates:
autosp/plan/candidates.py; docs/design.md, "Memory planner").

Each candidate is predicted by `autosp.plan.prediction.predict` (one memory definition: the ledger inside backward plus
the simulated activations); candidates differing only in checkpointing share one trace, and those with the same
program one simulation (`autosp.plan.traces.TraceReuse`, docs/design.md "Trace reuse").  The planner picks by a
stated objective and explains its choice in a `PlanReport`: the candidate table (peak per ledger category, step
time, max length), the chosen plan and why.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from autosp.errors import AutoSPError
from autosp.plan.candidates import MemoryPlan, candidates_for
from autosp.plan.deepspeed_setups import JOB_SETUPS, deepspeed_config, job_name, job_setups, plans_for_job
from autosp.plan.model_source import ModelSource
from autosp.plan.prediction import Prediction, held_before_activations, predict
from autosp.plan.setup import DECIDING_DEPTH, TrainingSetup
from autosp.plan.shares import LengthBoard, in_plan_order, plan_shares, plan_units
from autosp.plan.traces import OFFLOAD_OPTION, TraceReuse
from simulator.cluster import Cluster

log = logging.getLogger(__name__)

OBJECTIVES = ("fastest", "longest")

Progress = Callable[[int, int, str], None]
"""Told ``(decided, total, plan name)`` as a decision's candidates are decided (first ``(0 or the candidates
decided at once, total, "")``): what a command shows as a progress bar."""


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One plan's prediction at the planned length (and, for ``objective="longest"``, its longest length)."""

    plan: MemoryPlan
    prediction: Prediction | None
    """None when the plan does not apply to the model (``refused`` says why)."""
    refused: str | None = None
    traces: int = 0
    """Fake-tensor traces taken while predicting this plan (0: every program it needed was traced before)."""
    same_program_as: str | None = None
    """An earlier candidate whose program this plan's is (equal recomputation tags: same partition), so its
    prediction is that one's (docs/design.md, "Trace reuse")."""

    @property
    def fits(self) -> bool:
        return self.prediction is not None and self.prediction.fits

    def _searched(self, field: str):
        """``field`` of the max-length search's answer (`predict`'s ``max_length``); None without a search."""
        found = self.prediction.max_length if self.prediction is not None else None
        return found[field] if found else None

    @property
    def max_seq_len(self) -> int | None:
        return self._searched("max_seq_len")

    @property
    def max_length_step_time_s(self) -> float | None:
        return self._searched("step_time_s")

    @property
    def max_length_display(self) -> str | None:
        """The search's answer as shown: ``131,072``, ``≥ 131,072`` (a lower bound: the search stopped at its
        ceiling or probe budget) or ``< 131,072`` (nothing fitted from where the search started)."""
        return self._searched("display")

    @property
    def max_length_stopped(self) -> str | None:
        """Why the search stopped (`simulator.search.STOP_REASONS`)."""
        return self._searched("stopped")

    def to_dict(self) -> dict:
        """The candidate's row: what `choose_plan` reads, and the report's table (JSON)."""
        p = self.prediction
        return {"plan": self.plan.name, "options": dict(self.plan.options), "refused": self.refused,
                "fits": self.fits, "traces": self.traces, "same_program_as": self.same_program_as,
                "peak_bytes": p.peak_bytes if p else None,
                "peak_by_category_bytes": p.by_category if p else None,
                "host_peak_bytes": p.host_peak_bytes if p else None,
                "host_fits": p.host_fits if p else None,
                "step_time_s": p.step.step_time_s if p else None,
                "max_seq_len": self.max_seq_len, "max_length_step_time_s": self.max_length_step_time_s,
                "max_length_display": self.max_length_display, "max_length_stopped": self.max_length_stopped}


@dataclass(frozen=True, kw_only=True)
class PlanReport:
    """What the planner predicted for each candidate, what it chose and why."""

    model: str
    objective: str
    seq_len: int
    target_memory_bytes: int
    candidates: tuple[Candidate, ...]
    chosen: int | None
    """Index into ``candidates``; None when no candidate fits."""
    reason: str
    traces: int
    """Fake-tensor traces (Dynamo captures, each with one joint graph) the decision took: one per group of plans
    differing only in checkpointing and length simulated (two with depth extrapolation); one per candidate
    without trace reuse."""
    seconds: float
    partitions: int = 0
    """Min-cut partitions of the joint graphs: one per distinct program."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    job: Mapping | None = None
    """The DeepSpeed setup the planner chose (`TrainingSetup` fields: ``zero_stage``, ``offload``) where it chose
    one (`plan_job`); None: the setup as given."""
    jobs_without_plan: tuple[Mapping, ...] = ()
    """The DeepSpeed setups `plan_job` tried before ``job``, under which no plan was chosen."""

    @property
    def options(self) -> dict:
        """The `autosp.compile` options of the chosen plan."""
        if self.chosen is None:
            raise AutoSPError(f"no memory plan fits {self.target_memory_bytes / 2**30:.2f} GiB per rank: {self.reason}")
        sharded = {"shard_parameters": True} if (self.job or {}).get("zero_stage") == 3 else {}
        return {**self.candidates[self.chosen].plan.options, **sharded}  # ZeRO 3 is AutoSP's sharded parameters

    def format(self) -> str:
        gib = 2**30
        categories = []
        for c in self.candidates:
            for cat in (c.prediction.by_category if c.prediction else {}):
                if cat not in categories:
                    categories.append(cat)
        longest = self.objective == "longest"
        host = any(c.prediction and c.prediction.host_peak_bytes for c in self.candidates)
        head = f"  {'plan':44s} {'fits':4s} {'peak GiB':>9s} " + " ".join(f"{c[:12]:>12s}" for c in categories) \
            + (f" {'host GiB':>9s}" if host else "") + f" {'step s':>9s}" \
            + (f" {'max len':>11s} {'step s@max':>10s}" if longest else "")
        out = [f"memory plan for {self.model}: objective {self.objective}, {self.seq_len:,} tokens, target "
               f"{self.target_memory_bytes / gib:.3f} GiB per rank; {len(self.candidates)} candidates, "
               f"{self.traces} traces, {self.partitions} partitions, {self.seconds:.1f} s",
               "  peak by category (GiB per rank, the ledger inside backward with the simulated activations):", head]
        shared = shared_refusal([c.to_dict() for c in self.candidates])
        for i, c in enumerate(() if shared else self.candidates):
            mark = "*" if i == self.chosen else " "
            if c.prediction is None:
                out.append(f"{mark} {c.plan.name:44s} "
                           + (c.refused if c.refused == NEEDLESS_OFFLOAD else f"refused: {c.refused}"))
                continue
            p = c.prediction
            row = f"{mark} {c.plan.name:44s} {'yes' if p.fits else 'no':4s} {p.peak_bytes / gib:9.4f} " + " ".join(
                f"{p.by_category.get(cat, 0) / gib:12.4f}" for cat in categories) \
                + (f" {p.host_peak_bytes / gib:9.4f}" if host else "") + f" {p.step.step_time_s:9.4g}"
            if longest:
                t = c.max_length_step_time_s
                row += f" {c.max_length_display or '-':>11s} {t if t is not None else float('nan'):10.4g}"
            if c.same_program_as:
                row += f"  (same program as {c.same_program_as})"
            out.append(row)
        if shared:
            out[1:] = [f"  every candidate ({len(self.candidates)}) is refused for the reason below"]
        out.append(f"  chosen: {self.candidates[self.chosen].plan.name if self.chosen is not None else 'none'}")
        out.append(f"  why:    {self.reason}")
        if self.chosen is not None:
            out.append(f"  autosp.compile options: {self.options}")
        if self.job is not None:
            sharded = " through autosp.deepspeed_initialize" if self.job["zero_stage"] == 3 else ""
            out.append(f"  DeepSpeed setup: {job_name(self.job)} (DeepSpeed config: {deepspeed_config(self.job)}"
                       f"{sharded})")
        out += [f"  note:   {n}" for n in self.notes]
        return "\n".join(out)

    def to_dict(self) -> dict:
        return {
            "model": self.model, "objective": self.objective, "seq_len": self.seq_len,
            "target_memory_bytes": self.target_memory_bytes, "traces": self.traces,
            "partitions": self.partitions, "seconds": self.seconds,
            "chosen": self.chosen, "reason": self.reason,
            "options": self.options if self.chosen is not None else None, "job": dict(self.job or {}) or None,
            "jobs_without_plan": [dict(j) for j in self.jobs_without_plan],
            "candidates": [c.to_dict() for c in self.candidates],
            "notes": list(self.notes),
        }


# Note [Offload only where it is needed]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Activation offload adds copies and removes no compute, so it cannot make a step faster than the same plan
# without it.  Its predictions can still come out a hair faster (at 8B, 65,536 tokens on h100-sxm: SAC with
# offload 2.241 s against 2.243 s without): an offload candidate is simulated from a deeper trace unrolled to the
# model's depth (Note [Unrolling a traced workload to the model's depth] in simulator/depth_unroll.py), its twin
# extrapolated from 1 and 2 layers, and the two methods differ by that much.  So when the fastest plan is asked
# for, the candidates without offload are predicted first, and an offload candidate whose twin without offload
# fits is not predicted at all (listed with the reason): offload is chosen only where memory needs it, the compiled
# model never moves 17 GiB a rank to host memory for a predicted 0.1 %, and the decision skips the deeper traces
# and unrolled steps of such candidates (the larger part of a decision's time at 8B, docs/design.md).

# Note [The planner's margin]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A plan fits when its predicted peak is at most ``target_memory`` less `PREDICTION_MARGIN` of it: room for the
# prediction's own error, which on a GPU would be an out-of-memory crash.  The margin is taken from what the
# prediction is measured to miss: ``python -m experiments.cpu.bench_plan_accuracy`` runs the plan the planner
# chose at targets below the unplanned peak and compares its predicted peak with the one measured on gloo ranks
# (its summary line: the median and worst error, and the plans measured over their target).  With the gradients
# priced over time (Note [Gradients the program holds] in simulator/training_step.py) the prediction is
# optimistic only by the batch's integer tensors (ids, labels, positions: a few tenths of a percent of a tiny
# model's peak, far less at real sizes); the margin is a few times that.  What the margin does not cover the
# run-time check catches (Note [The plan's promise checked] in autosp/model.py): the first steps' measured peak
# against the target itself.

PREDICTION_MARGIN = 0.01
"""Share of ``target_memory`` a chosen plan's predicted peak leaves free (Note [The planner's margin])."""


def planning_capacity(target: int) -> int:
    """The bytes a plan's predicted peak may reach under ``target`` (Note [The planner's margin])."""
    return int(target * (1 - PREDICTION_MARGIN))


def target_for(peak: int) -> int:
    """The least ``target_memory`` a plan predicted at ``peak`` bytes fits (Note [The planner's margin])."""
    target = int(peak / (1 - PREDICTION_MARGIN))
    while planning_capacity(target) < peak:
        target += 1
    return target


def _target_text(target: int) -> str:
    return f"{target / 2**30:.3f} GiB less the {PREDICTION_MARGIN:.0%} margin"


NOT_PREDICTED = "not predicted: "
"""How a candidate's refusal begins when the planner chose not to predict it (it may well trace)."""
NEEDLESS_OFFLOAD = (f"{NOT_PREDICTED}the same plan fits without activation offload, which only adds copies (Note "
                    "[Offload only where it is needed] in autosp/plan/planner.py)")
"""Why a candidate with activation offload is not predicted when the fastest plan is asked for."""


def _offload_twin_fits(plan: MemoryPlan, predicted: Iterable[Candidate]) -> bool:
    """Whether ``plan`` offloads activations and the same plan without offload is among ``predicted`` and fits."""
    options = dict(plan.options)
    if options.get(OFFLOAD_OPTION) != "on":
        return False
    twin = {**options, OFFLOAD_OPTION: "off"}
    return any(c.fits and {OFFLOAD_OPTION: "off", **c.plan.options} == twin for c in predicted)


def _choose_fastest(rows: Sequence[Mapping], seq_len: int, target: int) -> tuple[int | None, str]:
    fitting = [i for i, c in enumerate(rows) if c["fits"]]
    if not fitting:
        least = min((i for i, c in enumerate(rows) if c["peak_bytes"] is not None), default=None,
                    key=lambda i: rows[i]["peak_bytes"])
        lowest = ""
        if least is not None:
            low = rows[least]
            lowest = (f"; the lowest peak is {low['plan']}'s, {low['peak_bytes'] / 2**30:.3f} GiB, which a target of "
                      f"{target_for(low['peak_bytes']) / 2**30:.3f} GiB fits")
            if low["peak_bytes"] <= planning_capacity(target) and low.get("host_fits") is False:
                lowest += f" (within the target, but its host peak of {low['host_peak_bytes'] / 2**30:.1f} GiB is " \
                          "over the host memory)"
        return None, (f"no candidate fits {_target_text(target)} at {seq_len:,} tokens{lowest}: use more SP ranks, "
                      "a shorter sequence or more memory")
    best = min(fitting, key=lambda i: (rows[i]["step_time_s"], rows[i]["peak_bytes"]))
    c = rows[best]
    faster = [x["plan"] for x in rows if x["step_time_s"] is not None and x["step_time_s"] < c["step_time_s"]]
    needless = sum(x["refused"] == NEEDLESS_OFFLOAD for x in rows)
    return best, (f"fastest of the {len(fitting)} candidates that fit {_target_text(target)} at {seq_len:,} tokens "
                  f"(step {c['step_time_s']:.4g} s, peak {c['peak_bytes'] / 2**30:.3f} GiB)"
                  + (f"; faster but not fitting: {_listed(faster)}" if faster else "; no candidate is faster")
                  + (f"; {needless} offload candidate(s) not predicted: the same plan fits without offload"
                     if needless else ""))


def _listed(names: Sequence[str], most: int = 4) -> str:
    """``names`` joined, the first ``most`` of them and how many more."""
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _choose_longest(rows: Sequence[Mapping], target: int) -> tuple[int | None, str]:
    found = [i for i, c in enumerate(rows) if c["max_seq_len"]]
    if not found:
        return None, f"no candidate fits {_target_text(target)} at any length searched"
    best = max(found, key=lambda i: (rows[i]["max_seq_len"], -rows[i]["max_length_step_time_s"]))
    c = rows[best]
    tied = [rows[i]["plan"] for i in found if i != best and rows[i]["max_seq_len"] == c["max_seq_len"]]
    return best, (f"longest length that fits {_target_text(target)}: {c['max_seq_len']:,} tokens "
                  f"(step {c['max_length_step_time_s']:.4g} s there); {BINDS[c.get('max_length_stopped')]}"
                  + (f"; fastest of those reaching it (also: {_listed(tied)})" if tied else ""))


BINDS = {"converged": "memory binds: the next length of the search's grid does not fit",
         "ceiling": "a lower bound: the search's ceiling fits (--max-length-high, default 8 x --seq-len, searches "
                    "further)",
         "probe_budget": "a lower bound: the search spent its probes first (--max-probes searches further)",
         None: "memory binds"}
"""What bounds a longest length, by the search's stop reason (`simulator.search.STOP_REASONS`; None: a row
without one)."""


def choose_plan(rows: Sequence[Mapping], objective: str, *, seq_len: int, target: int) -> tuple[int | None, str]:
    """The planner's one rule: (index of the chosen row or None, why) among candidate rows (`Candidate.to_dict`,
    in the candidates' order; rows predicted in several processes are merged first, Note [Candidates spread over
    the ranks] in autosp/plan/auto.py).  ``"fastest"``: the fastest step at ``seq_len`` among the rows that fit
    ``target`` bytes, ties by the lower peak; ``"longest"``: the longest length that fits, ties by the faster step
    there."""
    if objective not in OBJECTIVES:
        raise AutoSPError(f"objective {objective!r}: choose one of {OBJECTIVES}")
    shared = shared_refusal(rows)
    if shared is not None:
        return None, f"every candidate is refused for one reason: {shared}"
    return _choose_fastest(rows, seq_len, target) if objective == "fastest" else _choose_longest(rows, target)


def shared_refusal(rows: Sequence[Mapping]) -> str | None:
    """The refusal every row shares (the binding limit of the whole decision: a head count, the model states), or
    None."""
    refusals = {row["refused"] for row in rows}
    return next(iter(refusals)) if rows and len(refusals) == 1 and None not in refusals else None


# Note [The longest plan bounds the others' searches]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``objective="longest"`` chooses the longest length any plan fits, ties by the faster step there.  A plan that
# does not fit at the longest length L another plan already fits cannot be chosen, and a plan's fit is monotone in
# the length (every tensor the step holds grows with it), so its own search need not go below L: `_plan_here`
# searches each plan from the longest length found so far (`predict`'s ``max_length_low``), and a plan that does not
# fit there is answered in one probe, ``< L``, instead of a search of up to ``max_probes`` lengths.  A plan that
# fits at L is searched upward as before, so the choice and its reason are those of a full search of every plan;
# what changes is the table, which shows ``< L`` for the plans ruled out that way.  The plans are taken in the
# reverse of the candidates' order (activation offload, the tiled ops and per-layer checkpointing first: those that
# save the most memory), so that L is long early.  In a decision spread over processes (`_plan_in_workers`) every
# process keeps its longest L on a board the others read before each plan (`autosp.plan.shares.LengthBoard`), and
# the calling process, which starts first, holds the plan saving the most: a process searches from the longest
# length any process has found, not only its own.  Which plans are ruled out that way (their rows) then depends on
# the order in which the processes' answers arrive; the choice and its reason do not.


def states_over_target(held: Mapping[str, int], target: int, setup: TrainingSetup) -> str:
    """Why no plan is predicted when ``held`` (`held_before_activations`) fills ``target``: the binding limit named
    with what changes it."""
    gib, largest = 2**30, sorted(held.items(), key=lambda item: -item[1])[:3]
    under = f"ZeRO {setup.zero_stage}" + (" with optimizer offload" if setup.offload != "none" else "")
    if setup.zero_stage == 3:
        change = "use more ranks (every rank holds 1/N of the states)"
    elif setup.zero_stage == 2 and setup.offload != "none":  # the last --zero-stage auto tries for a ring plan
        change = ("shard the parameters too (--zero-stage 3: AutoSP's sharded parameters, autosp.compile(..., "
                  "shard_parameters=True), under --strategy ulysses), or use more ranks")
    else:
        change = ("partition them (a higher ZeRO stage or optimizer offload; python -m autosp.plan --zero-stage auto "
                  "chooses among ZeRO 1-3), or use more ranks")
    return (f"{NOT_PREDICTED}before any activation every plan holds {sum(held.values()) / gib:.2f} GiB per rank "
            f"under {under} ({', '.join(f'{cat} {b / gib:.2f}' for cat, b in largest)} GiB), and the target is "
            f"{target / gib:.2f} GiB; the model states bind, not the activations: {change}")


def plan_memory(model: str, setup: TrainingSetup, cluster: Cluster, *, objective: str = "fastest",
                target_memory: int | None = None, plans: Sequence[MemoryPlan] | None = None,
                max_length_high: int | None = None, granularity: int = 1024, max_probes: int = 8,
                reuse_traces: bool = True, resize_lengths: bool = True, workers: int = 1,
                progress: Progress | None = None) -> PlanReport:
    """Predict every plan of ``plans`` (default: `candidates_for` the model and target) for ``setup`` on
    ``cluster`` and choose one: ``"fastest"``: the fastest step at ``setup.seq_len`` whose peak fits ``target_memory`` (bytes per rank; default:
    the device's memory), ties by the lower peak; ``"longest"``: the longest length that fits (the max-length search
    of `predict`, starting at ``setup.seq_len``), ties by the faster step at that length.  ``reuse_traces``: plans
    differing only in checkpointing share one trace and plans with the same program one simulation (`TraceReuse`);
    False traces every plan on its own (the same predictions, slower).  ``resize_lengths``: with trace reuse and
    ``objective="longest"``, a group's program at a length inside its traced range is built from a re-sized joint
    graph (`TraceReuse`).  ``workers``: processes predicting the plans' trace groups side by side (`plan_groups`;
    Note [Candidates spread over the ranks] in autosp/plan/auto.py), with the same choice as one process (and the
    same rows, but for which show ``< L`` under objective longest); 1: this process alone.  ``progress``: called as each candidate of this process is decided (`Progress`)."""
    if objective not in OBJECTIVES:
        raise AutoSPError(f"objective {objective!r}: choose one of {OBJECTIVES}")
    setup.check()
    setup = dataclasses.replace(setup, depth=setup.depth or DECIDING_DEPTH)
    start = time.perf_counter()
    target = int(cluster.device.memory_bytes if target_memory is None else target_memory)
    plans = tuple(plans or candidates_for(model, setup, target))
    units = plan_units(plans, workers)
    # a setup whose model states alone exceed the target is refused at once, here: no worker is started for it
    spread = workers > 1 and reuse_traces and len(units) > 1 and \
        sum(held_before_activations(model, setup, cluster).values()) < planning_capacity(target)
    if spread:
        report = _plan_in_workers(model, setup, cluster, units, plans, workers=workers, start=start, target=target,
                                  objective=objective, max_length_high=max_length_high, granularity=granularity,
                                  max_probes=max_probes, resize_lengths=resize_lengths)
    else:
        report = _plan_here(model, setup, cluster, plans, start=start, target=target, objective=objective,
                            max_length_high=max_length_high, granularity=granularity, max_probes=max_probes,
                            reuse_traces=reuse_traces, resize_lengths=resize_lengths, progress=progress)
    log.info("%s", report.format())
    return report


def _plan_here(model: str, setup: TrainingSetup, cluster: Cluster, plans: Sequence[MemoryPlan], *, start: float,
               target: int, objective: str, max_length_high: int | None, granularity: int, max_probes: int,
               reuse_traces: bool, resize_lengths: bool, progress: Progress | None = None,
               lengths: tuple[LengthBoard, str] | None = None) -> PlanReport:
    """`plan_memory` in this process (its arguments checked and defaulted), unlogged.  ``lengths``: the board of a
    decision spread over processes and this process's name on it, where the longest length each process's plans fit
    so far is kept and read before every plan (Note [The longest plan bounds the others' searches])."""
    # Only the max-length search asks for several lengths.
    reuse = TraceReuse([p.options for p in plans], resize_lengths=resize_lengths and objective == "longest") \
        if reuse_traces else None
    found, traces = {}, 0
    held = held_before_activations(model, setup, cluster, source=reuse.source(model) if reuse else None)
    if sum(held.values()) >= planning_capacity(target):  # no plan fits: nothing is traced
        found = {i: Candidate(plan=plan, prediction=None, refused=states_over_target(held, target, setup))
                 for i, plan in enumerate(plans)}
    if objective == "fastest":  # Note [Offload only where it is needed]: the plans without offload first
        order = sorted(range(len(plans)), key=lambda i: plans[i].options.get("activation_offload") == "on")
    else:  # Note [The longest plan bounds the others' searches]: the plans saving the most memory first
        order = list(reversed(range(len(plans))))
    longest = None  # the longest length a plan decided so far fits
    if progress:
        progress(len(found), len(plans), "")
    for index in (i for i in order if i not in found):
        plan, candidates = plans[index], list(found.values())
        if lengths is not None:
            longest = max(longest or 0, lengths[0].longest() or 0) or None
        found[index], taken = _decided(plan, candidates, reuse, objective=objective, model=model, setup=setup,
                                       cluster=cluster, target=target, max_length_high=max_length_high,
                                       granularity=granularity, max_probes=max_probes, max_length_low=longest)
        reached = found[index].prediction and found[index].prediction.max_length
        if reached and reached["max_seq_len"] is not None:
            longest = max(longest or 0, reached["max_seq_len"])
            if lengths is not None:
                lengths[0].keep(lengths[1], longest)
        traces += taken
        if progress:
            progress(len(found), len(plans), plan.name)
    candidates = [found[i] for i in range(len(plans))]  # in the plans' order
    traces = reuse.traces if reuse else traces  # with a refused group's traces
    chosen, reason = choose_plan([c.to_dict() for c in candidates], objective, seq_len=setup.seq_len, target=target)
    notes = sorted({n for c in candidates if c.prediction for n in c.prediction.notes})
    report = PlanReport(model=model, objective=objective, seq_len=setup.seq_len, target_memory_bytes=target,
                        candidates=tuple(candidates), chosen=chosen, reason=reason,
                        traces=traces, partitions=reuse.partitions if reuse else traces,
                        seconds=time.perf_counter() - start, notes=tuple(notes))
    return report


def _decided(plan: MemoryPlan, candidates: Sequence[Candidate], reuse: TraceReuse | None, *, objective: str,
             model: str, setup: TrainingSetup, cluster: Cluster, target: int, **search) -> tuple[Candidate, int]:
    """``plan``'s candidate (``candidates``: those decided before it) and the traces its prediction took."""
    if objective == "fastest" and _offload_twin_fits(plan, candidates):
        return Candidate(plan=plan, prediction=None, refused=NEEDLESS_OFFLOAD), 0
    before = reuse.traces if reuse else 0
    try:
        p = predict(model, setup, cluster, options=plan.options, capacity_bytes=planning_capacity(target),
                    max_length=objective == "longest", reuse=reuse, **search)
    except AutoSPError as err:  # the plan does not apply to this model (e.g. a loss the tiling cannot take)
        log.info("memory plan %s refused: %s", plan.name, err)
        return Candidate(plan=plan, prediction=None, refused=str(err)), 0
    if reuse:
        taken = reuse.traces - before
        same = next((c.plan.name for c in candidates
                     if c.prediction and reuse.same_program(plan.options, c.plan.options)), None)
    else:
        lengths = len(p.max_length["lengths_simulated"]) if p.max_length else 1
        taken, same = lengths * (1 if p.step.extrapolated_from is None else 2), None
    return Candidate(plan=plan, prediction=p, traces=taken, same_program_as=same), taken


def _plan_in_workers(model: str, setup: TrainingSetup, cluster: Cluster, units: list[list[int]],
                     plans: Sequence[MemoryPlan], *, workers: int, start: float, target: int, objective: str,
                     **choices) -> PlanReport:
    """`plan_memory` with the units ``units`` of ``plans`` (`plan_units`) spread over ``workers`` processes (the
    share of worker w: `plan_shares`): this one, whose imports are made, predicts share 0 while ``workers``
    - 1 fresh processes predict the others; their candidates are merged in the plans' order and chosen among by
    `choose_plan`: the one-process report but for ``seconds`` (this call's), where a group was halved the counts
    (Note [Trace groups halved for spare processes] in autosp/plan/shares.py), and under objective longest which
    rows show ``< L`` (Note [The longest plan bounds the others' searches])."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    workers = min(workers, len(units))
    # the unit of the plan saving the most to this process, whose imports are made: the others start after theirs
    units = sorted(units, key=lambda unit: len(plans) - 1 not in unit)
    shares = [sorted(share) for share in plan_shares(units, workers)]  # each decided in the plans' order
    log.info("memory plan for %s: %d candidates in %d units, predicted by %d worker processes", model,
             len(plans), len(units), workers)
    with tempfile.TemporaryDirectory(prefix="autosp-plan-lengths-") as folder:
        board = LengthBoard(folder) if objective == "longest" else None
        asked = [(model, setup, cluster, [plans[i] for i in share], objective, target, choices, board, f"share{k}")
                 for k, share in enumerate(shares)]
        # Fresh processes (spawn): a planner resets Dynamo between traces and must not share a forked torch's state.
        with ProcessPoolExecutor(workers - 1, mp_context=multiprocessing.get_context("spawn")) as pool:
            others = pool.map(_plan_share, asked[1:])  # submitted now, collected after this process's own share
            reports = [_plan_share(asked[0], here=True), *others]
    candidates = in_plan_order(shares, [r.candidates for r in reports], len(plans))
    chosen, reason = choose_plan([c.to_dict() for c in candidates], objective, seq_len=setup.seq_len, target=target)
    report = PlanReport(model=model, objective=objective, seq_len=setup.seq_len, target_memory_bytes=target,
                        candidates=tuple(candidates), chosen=chosen, reason=reason,
                        traces=sum(r.traces for r in reports), partitions=sum(r.partitions for r in reports),
                        seconds=time.perf_counter() - start, notes=tuple(sorted({n for r in reports for n in r.notes})))
    return report


def _plan_share(asked: tuple, here: bool = False) -> PlanReport:
    """One worker of `_plan_in_workers`: its share planned in this process (``here``: the calling one, which logs
    the merged report; a worker process logs warnings only)."""
    model, setup, cluster, plans, objective, target, choices, board, name = asked
    if not here:
        logging.basicConfig(level=logging.WARNING)
    return _plan_here(model, setup, cluster, plans, start=time.perf_counter(), target=target, objective=objective,
                      reuse_traces=True, lengths=(board, name) if board else None, **choices)


def plan_job(model: str, setup: TrainingSetup, cluster: Cluster, *, fixed: Mapping | None = None,
             **planning) -> PlanReport:
    """`plan_memory` (``planning``: its keyword arguments) under the first setup of `job_setups` (``setup`` with
    each DeepSpeed setup laid over it, ``fixed`` kept) with which a plan is chosen (objective longest: a plan that
    reaches ``setup.seq_len``; where none does, the setup that reaches furthest), or under the last when none
    is: the plan and the DeepSpeed setup the job needs (Note [The DeepSpeed setup only as far as memory
    needs]); the report's ``job`` names it and its notes the setups tried before."""
    jobs = job_setups(setup, fixed)
    if not jobs:
        raise AutoSPError(f"no DeepSpeed setup of {JOB_SETUPS} with {dict(fixed or {})} can train this setup")
    source = ModelSource(model)

    def states(job: Mapping) -> int:  # the ledger inside backward but the activations: what the setup holds
        return sum(held_before_activations(model, dataclasses.replace(setup, **job), cluster,
                                           source=source).values())

    tried, without, least = [], [], None
    given = planning.pop("plans", None)
    jobs = [job for job in jobs if plans_for_job(given, job) != ()]  # a setup with no plan priced under it
    longest = planning.get("objective") == "longest"
    short: list[tuple[int, Mapping, PlanReport]] = []  # objective longest: setups whose plans stop short
    chosen = None
    for job in jobs:
        held = states(job)
        if least is not None and held >= least and job is not jobs[-1]:
            tried.append(f"{job_name(job)}: not planned, its ledger holds no less than one without a plan")
            without.append(job)
            continue
        report = plan_memory(model, dataclasses.replace(setup, **job), cluster, plans=plans_for_job(given, job),
                             **planning)
        reach = report.candidates[report.chosen].max_seq_len or 0 if longest and report.chosen is not None else None
        if report.chosen is not None and (reach is None or reach >= setup.seq_len):
            chosen = (job, report)
            break
        if report.chosen is not None:  # a plan, short of the length asked: a leaner setup may reach further
            short.append((reach, job, report))
            tried.append(f"{job_name(job)}: reaches {reach:,} tokens, short of the {setup.seq_len:,} asked")
        else:
            least = held if least is None else min(least, held)
            tried.append(f"{job_name(job)}: {report.reason}")
        without.append(job)
        log.info("memory plan: %s", tried[-1])
    names = ", ".join(job_name(j) for j in jobs)
    if chosen is not None:
        why = f"the first of {names} under which a plan is chosen"
    elif short:  # none reaches the length asked: the one that reaches furthest
        reach, *chosen = max(short, key=lambda found: found[0])
        without.remove(chosen[0])
        why = f"of {names}, the one that reaches furthest ({reach:,} tokens; none reaches the {setup.seq_len:,} asked)"
    else:
        chosen, why = (without.pop(), report), f"the last of {names}, no plan under any"
    job, report = chosen
    before = [t for t in tried if not t.startswith(f"{job_name(job)}:")]  # the setups passed over
    note = (f"DeepSpeed setup {job_name(job)}: {why} (Note [The DeepSpeed setup only as far as memory needs] in "
            "autosp/plan/deepspeed_setups.py)" + (f"; {'; '.join(before)}" if before else ""))
    return dataclasses.replace(report, job=job, notes=(*report.notes, note), jobs_without_plan=tuple(without))


def choose_options(model: str, sp_size: int, seq_len: int, target_memory: int | None = None, *,
                   cluster: str = "h100-sxm", objective: str = "fastest", **setup: object) -> dict:
    """The `autosp.compile` options of the plan `plan_memory` chooses (an `AutoSPError` when none fits).

    ``model``: a preset of `autosp.presets` or a Hugging Face config.json; ``cluster``: a preset or a cluster file;
    ``setup``: further `TrainingSetup` fields (dp_size, zero_stage, dtype, ...).  Pass the result to
    ``autosp.compile(model, sp_size=sp_size, **options)``."""
    from autosp.plan.cluster_file import load_cluster

    training = TrainingSetup(seq_len=seq_len, sp_size=sp_size, **setup)
    report = plan_memory(model, training, load_cluster(cluster, world_size=training.world_size),
                         objective=objective, target_memory=target_memory)
    return report.options
