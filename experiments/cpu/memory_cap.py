"""The longest sequence each system trains under a per-rank memory cap, measured on real gloo ranks.

`max_seq_len_on_rank` runs on every rank (see `experiments.launch.run_on_ranks`): per system, a short
secant search over lengths (`next_probe`, Note [Memory-cap search]) whose probes are measured training
steps (the peak tensor memory of one step, `experiments.cpu.peak_memory`, largest over the ranks).
The paper-scale search over simulated steps is `simulator.search.search_max_length` (called by
`experiments.paper_scale.simulate.max_length`).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from experiments.cpu.measure import _measured_step, _quiet_rank, _sample
from simulator.strategies import STRATEGIES

log = logging.getLogger(__name__)


# Note [The planner's memory-cap row]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# `PLANNER_ROW` is ``autosp``, AutoSP as compiled by default (the registry's strategy whose memory options the planner
# chooses wherever a memory size is given, `simulator.strategies.Strategy.memory_planned`): the table gives it
# ``target_memory=cap_bytes``, as a user on a device of that size would have the GPU's memory, so its default
# ``memory_plan`` plans (Note [The default memory plan] in autosp/plan/auto.py) and at each probed length the planner
# chooses checkpointing (per-layer checkpointing, "layer", among them: what ulysses+ckpt runs), SAC budget, tiled
# loss, tiled MLP and activation offload (all its candidates) as the fastest plan it predicts to fit the cap; the
# probe then measures the plan it chose, like any other system.  The planner is told what the probe runs
# (`PLANNER_SETUP`: plain torch, no optimizer state), and on the cpu-gloo preset its peak is tensor memory (a CPU
# process: no device reserve), what PeakMemory measures.  A length at which it predicts that no plan fits is a
# failed probe (`NO_PLAN_PEAK`: where that bounds the bracket the search takes its middle).  Its measured peak
# need not grow with the length (a longer probe may get a leaner plan), which the search assumes: the search then
# brackets above the longest length that fitted, ignoring failures below it, and the table calls the row's length
# a lower bound (Note [Memory-cap search]).  The table compares the row with `REFERENCE_ROW` (ulysses+ckpt): their
# longest lengths, and their step times measured side by side at the reference's longest length (`step_times_on_rank`,
# column ``step_s_at_reference``).  ``autosp-sac`` is the same pass unplanned (``memory_plan="off"``: SAC alone),
# what the plan adds to it.

# Note [Memory-cap search]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# A CPU has no out-of-memory point worth hitting, so the cap is virtual: a sequence "fits" when the
# largest per-rank peak tensor memory of one training step (PeakMemory, measured on the step after
# the compiling one, maximum over ranks by all_reduce) stays at or under ``cap_bytes``.  Every
# probe builds the system afresh on a fresh Dynamo cache (no recompile limits, no dynamic shapes),
# so a probe costs a compile: the search must need few.  Peak memory grows about linearly with the
# length (activations; attention is flash-style, O(S) memory), so the next length is where a
# straight line crosses the cap: through the first probe and the origin at first, then through the
# two longest fitting (or two shortest failing) probes, and once the cap is bracketed through the
# bracket's ends (regula falsi), clamped so that the bracket shrinks by at least a quarter per probe
# (robust to memory that is not quite linear, or not monotone at short lengths); rounded to
# ``granularity`` and kept strictly between the longest length that fitted and the shortest that did not.  It stops when those two are
# ``granularity`` apart, at ``max_len``, or after ``max_probes`` probes (bounded run time); the
# answer is always a length that was measured to fit.  Monotone growth of peak memory with length,
# true for every system of fixed options here, is what makes the bracket valid.  A system whose options change
# with the length (`PLANNER_ROW`) may fail at a length below one that fits: such a failure is kept out of the
# bracket (the search goes on above the longest fit) and the result names it (``below_fit``), so that the
# table says the length is a lower bound.  Nor does such a row's peak say where the cap is: the planner fills the
# cap at every length it plans (a fitting probe measures just under the cap, a longer one gets a leaner plan), so a
# line through two fitting probes creeps up by a granularity per probe.  For it (``fills_cap``) the search steps by
# length alone: after the first probe's line through the origin it doubles the longest fit until a probe fails,
# then bisects the bracket.


def next_probe(probes: list[tuple[int, int]], cap_bytes: int, *, granularity: int, max_len: int,
               fills_cap: bool = False) -> int | None:
    """The next length to probe given ``probes`` [(seq_len, peak_bytes)], or None when the search is done.

    A pure function (see Note [Memory-cap search]); lengths are multiples of ``granularity``.  Failures below the
    longest fitting length (peaks not monotone in the length) bound nothing.  ``fills_cap``: the system's options
    are chosen per length to fit the cap (`PLANNER_ROW`), so its peaks are not extrapolated: the search doubles,
    then bisects.
    """
    peak = dict(probes)
    fits = sorted(s for s, p in probes if p <= cap_bytes)
    lo = max(fits, default=0)
    fails = sorted(s for s, p in probes if p > cap_bytes and s > lo)
    hi = min(fails, default=max_len + granularity)
    if hi - lo <= granularity or (not fails and lo >= max_len):
        return None
    if fills_cap and (len(probes) > 1 or fails):  # by length alone: double the longest fit, or bisect
        guess = (lo + hi) / 2 if fails else 2 * lo
    elif fits and fails:  # bracketed: interpolate, but shrink the bracket by at least a quarter
        slope = (peak[hi] - peak[lo]) / (hi - lo)
        guess = lo + (cap_bytes - peak[lo]) / slope if 0 < slope < math.inf else (lo + hi) / 2
        guess = min(max(guess, lo + (hi - lo) / 4), hi - (hi - lo) / 4)
    elif len(fits or fails) == 1:  # one point: the line through it and the origin
        s0 = (fits or fails)[0]
        guess = s0 * cap_bytes / max(peak[s0], 1)
    else:  # all fit (extrapolate from the two longest) or all fail (from the two shortest)
        s0, s1 = fits[-2:] if not fails else fails[:2]
        p0, p1 = peak[s0], peak[s1]
        slope = (p1 - p0) / (s1 - s0)
        guess = s1 + (cap_bytes - p1) / slope if 0 < slope < math.inf else (2 * s1 if not fails else s0 / 2)
    length = int(guess // granularity) * granularity
    return max(lo + granularity, min(length, hi - granularity, max_len))


def search_result(probes: list[tuple[int, float]], cap_bytes: int) -> dict:
    """What a search found from its ``probes``: ``max_seq_len`` (the longest length measured to fit, 0 if none),
    ``first_failure`` (the shortest failing length above it, None if none) and ``below_fit`` (failing lengths below
    it: the peak is not monotone in the length, so ``max_seq_len`` is a lower bound of the longest that fits)."""
    fit = max((s for s, p in probes if p <= cap_bytes), default=0)
    fails = sorted(s for s, p in probes if p > cap_bytes)
    return {"max_seq_len": fit, "first_failure": next((s for s in fails if s > fit), None),
            "below_fit": [s for s in fails if s < fit]}


@dataclass(frozen=True, kw_only=True)
class MemoryCapSpec:
    model: str
    """Tiny model preset (experiments.models.TINY_MODELS)."""
    systems: tuple[str, ...]
    """Systems to search (experiments.baselines names)."""
    cap_bytes: int
    """Per-rank memory cap: a length fits when every rank's peak stays at or under it."""
    start: int = 512
    """First length probed (a multiple of ``granularity``)."""
    max_len: int = 65536
    """The search stops here even if this length still fits."""
    granularity: int = 256
    """The search stops at this many tokens (a multiple of 2 × ranks, for ring attention's chunks)."""
    max_probes: int = 5
    """Probes per system at most (each compiles the system afresh)."""
    compiler: str = "aot_eager"
    layers: int = 2
    hidden: int = 64
    model_options: dict = field(default_factory=dict)
    """Further size overrides for the preset (e.g. ``{"kv_heads": 4}``)."""
    planner_options: dict = field(default_factory=dict)
    """Compile options given to `PLANNER_ROW`, which its planner keeps (e.g. ``{"activation_offload": "on"}``);
    it chooses the rest."""


PLANNER_ROW = next(name for name in STRATEGIES.table("memory-cap") if STRATEGIES[name].memory_planned)
"""The row of AutoSP under its memory planner: ``autosp``, the default compile given the cap (Note [The planner's
memory-cap row])."""
REFERENCE_ROW = "ulysses+ckpt"
"""The row `PLANNER_ROW` is compared with (issue: the planner's longest length against it, and the two rows' step
times side by side at its longest length, `step_times_on_rank`)."""
PLANNER_SETUP = {"zero_stage": 0, "optimizer": "sgd"}
"""``plan_setup`` of `PLANNER_ROW`: what every probe runs (the model's own fp32 parameters and ``param.grad``, no
DeepSpeed wrapper, no optimizer state), for the planner's memory ledger."""
NO_PLAN_PEAK = float("inf")
"""The peak recorded for a probe at which the planner finds no plan that fits."""


def row_system(row: str, cap_bytes: int, planner_options: dict | None = None) -> tuple[str, dict]:
    """The `experiments.baselines.build_system` name and extra options of memory-cap row ``row``: a system of the
    registry as it is, for one whose memory options the planner chooses (`PLANNER_ROW`) the target
    (``cap_bytes``) and `PLANNER_SETUP`, and for ``alst`` ArcticTraining's tiled logits+loss shard scaled to the cap
    (`experiments.baselines.alst.logits_shard_bytes_for`: 1 GiB of an 80 GiB H100's memory, the same share of the
    cap; unscaled, a few MiB of cap would get one shard, no tiling).  ``planner_options``: options the planned row is
    compiled with besides (`MemoryCapSpec.planner_options`)."""
    if STRATEGIES[row].memory_planned:
        return row, {**(planner_options or {}), "target_memory": int(cap_bytes), "plan_setup": dict(PLANNER_SETUP)}
    if row == "alst":
        from experiments.baselines.alst import logits_shard_bytes_for

        return row, {"logits_shard_bytes": logits_shard_bytes_for(cap_bytes)}
    return row, {}


def row_note(result: dict) -> str:
    """What the table says of a row's search beyond its lengths: for `PLANNER_ROW`, the plan chosen (and its
    predicted peak) at the longest length that fitted and at the first that did not ("" for the other rows)."""
    plans = result.get("plans") or {}
    said = [f"{what} {s}: {plans[s]}" for what, s in (("plan at", result.get("max_seq_len")),
                                                         ("at", result.get("first_failure"))) if s in plans]
    return "; ".join(said)


def chosen_plan(system) -> dict | None:
    """The memory plan the planner chose for ``system``: its name (``plan``) and the peak it predicted for it
    (``peak_bytes``), which the probe's measured peak stands beside (None: it did not plan)."""
    compiled = getattr(system, "compiled", None)
    plan = compiled.report.memory_plan if compiled is not None else None
    if not plan:
        return None
    chosen = plan["candidates"][plan["chosen"]]
    return {"plan": chosen["plan"], "peak_bytes": int(chosen["peak_bytes"])}


NO_PLAN = {"plan": "no plan fits"}
"""What `probe` gives as the chosen plan where the planner found none."""


def plan_text(chosen: dict | None) -> str | None:
    """A `chosen_plan` as the table's note says it."""
    if chosen is None:
        return None
    if "peak_bytes" not in chosen:  # `NO_PLAN`
        return chosen["plan"]
    return f"{chosen['plan']} (predicted {chosen['peak_bytes'] / 2**20:.2f} MiB)"


def probe(name: str, base, seq_len: int, world: int, spec: MemoryCapSpec) -> tuple[float, dict | None]:
    """Largest peak bytes over the ranks of one step (after the compiling one) of row ``name`` at ``seq_len``, and
    the memory plan the planner chose (`chosen_plan`; `NO_PLAN` with `NO_PLAN_PEAK` where it found none; None for
    a row it does not plan)."""
    from autosp.errors import AutoSPError
    from experiments.baselines import build_system
    from experiments.models import vocab_size

    torch._dynamo.reset()
    ids, labels = _sample(seq_len, vocab_size(base))
    system_name, options = row_system(name, spec.cap_bytes, spec.planner_options)
    system = build_system(system_name, copy.deepcopy(base), sp_size=world, compiler=spec.compiler, **options)
    try:
        system.step(ids, labels)
    except AutoSPError as err:  # every rank raises it (the decision is broadcast)
        if STRATEGIES[name].memory_planned and "found no plan" in str(err):
            log.info("memory cap %s at %d tokens: %s", name, seq_len, err)
            return NO_PLAN_PEAK, NO_PLAN
        raise
    peak = torch.tensor([_measured_step(system, ids, labels)], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    chosen = chosen_plan(system)
    del system
    return int(peak.item()), chosen


def max_seq_len_on_rank(rank: int, world: int, spec_dict: dict) -> dict:
    """Per system: the longest length that fitted under the cap, and every probe ``[seq_len, peak_bytes]``."""
    from experiments.baselines import BaselineUnsupported
    from experiments.models import build_model

    spec = MemoryCapSpec(**{**spec_dict, "systems": tuple(spec_dict["systems"])})
    os.environ.setdefault("LOCAL_RANK", str(rank))
    _quiet_rank()
    torch.manual_seed(0)
    base = build_model(spec.model, layers=spec.layers, hidden=spec.hidden, **spec.model_options)
    results = {}
    for name in spec.systems:
        start_s = time.perf_counter()
        probes: list[tuple[int, float]] = []
        plans: dict[int, str] = {}
        try:
            length = spec.start
            while length is not None and len(probes) < spec.max_probes:
                peak, chosen = probe(name, base, length, world, spec)
                probes.append((length, peak))
                if chosen is not None:
                    plans[length] = plan_text(chosen)
                length = next_probe(probes, spec.cap_bytes, granularity=spec.granularity, max_len=spec.max_len,
                                    fills_cap=STRATEGIES[name].memory_planned)
        except BaselineUnsupported as err:
            results[name] = {"unsupported": str(err), "probes": probes}
            continue
        found = search_result(probes, spec.cap_bytes)
        results[name] = {**found, "probes": probes, "plans": plans, "search_s": time.perf_counter() - start_s}
        log.info("memory cap %s: %d tokens fit (%d probes)", name, found["max_seq_len"], len(probes))
    return {"rank": rank, "systems": results, "spec": asdict(spec)}


def step_times_on_rank(rank: int, world: int, spec_dict: dict, seq_len: int, steps: int) -> dict:
    """Median step seconds (slowest rank) of every row of ``spec_dict["systems"]`` at ``seq_len``, steps interleaved
    (`experiments.cpu.measure.time_interleaved`) after one compiling step each, with each row's measured peak and
    the plan `PLANNER_ROW` chose: the step-time side of the memory-cap comparison, at one length."""
    import statistics

    from experiments.baselines import build_system
    from experiments.cpu.measure import time_interleaved
    from experiments.models import build_model, vocab_size

    spec = MemoryCapSpec(**{**spec_dict, "systems": tuple(spec_dict["systems"])})
    os.environ.setdefault("LOCAL_RANK", str(rank))
    _quiet_rank()
    torch.manual_seed(0)
    base = build_model(spec.model, layers=spec.layers, hidden=spec.hidden, **spec.model_options)
    ids, labels = _sample(seq_len, vocab_size(base))
    systems, out = {}, {}
    for name in spec.systems:
        system_name, options = row_system(name, spec.cap_bytes, spec.planner_options)
        systems[name] = build_system(system_name, copy.deepcopy(base), sp_size=world, compiler=spec.compiler,
                                     **options)
        systems[name].step(ids, labels)
        peak = torch.tensor([_measured_step(systems[name], ids, labels)], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        out[name] = {"peak_bytes": int(peak.item()), "plan": plan_text(chosen_plan(systems[name]))}
    time_interleaved(systems, ids, labels, steps=1)  # a later build may make an earlier system recompile
    for name, seconds in time_interleaved(systems, ids, labels, steps=steps).items():
        slowest = torch.tensor(seconds, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out[name]["median_step_s"] = statistics.median(slowest.tolist())
    return out
