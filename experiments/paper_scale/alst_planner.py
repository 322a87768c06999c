"""The planner's row of the ALST breakdown: AutoSP's memory planner on ALST's machine with no AutoSP setting
(`planner_row`), objective fastest at ALST's longest published length and objective longest from there, and its
longest length as a footer reads it (`planner_longest`).
"""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Sequence
from dataclasses import replace

from experiments.models import PaperModel
from experiments.paper_scale.alst_breakdown import ALST_ROWS, AUTOSP_ROWS, CLUSTER, RANKS, BreakdownRow
from experiments.paper_scale.alst_longest import Search, default_search, figures, table_row, tflops_per_gpu

log = logging.getLogger(__name__)


# Note [Narrowing the longest search]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A peak grows with the length, so only a plan that fits at a length L can train longer than L, and the longest
# search over the plans that fit at L gives the answer of the search over every candidate.  At ALST's 3.7M one plan
# of 48 fits.  At a short published length (the AutoSP paper's 45,000 tokens on A100s) every plan fits, and 48
# longest searches of an 8B model take most of an hour; fastest decisions (one length each) at 2L, 4L, ... narrow
# the plans to at most `NARROWED` (or to those of the last length where any fits) first.

NARROWED = 4
"""The most plans the planner row's longest search runs over when doubling the length can narrow them further
(`planner_row`'s default)."""


def fitting_plans(report) -> list:
    """The plans of a fastest decision that fit: those predicted to fit, and the offload plans not predicted because
    their twins fit (Note [Offload only where it is needed] in autosp/plan/planner.py), which fit as well."""
    from autosp.plan.planner import NEEDLESS_OFFLOAD

    return [c.plan for c in report.candidates if c.fits or c.refused == NEEDLESS_OFFLOAD]


def _over(fitting: Sequence, narrowed: Sequence, fit_at: int) -> str:
    """What the planner row's longest search ran over, for its source column."""
    if not fitting:
        return "over every candidate"
    if narrowed is fitting:
        return "over those"
    return f"over the {len(narrowed)} of those that fit at {fit_at:,} tokens (Note [Narrowing the longest search])"


PLANNER_ROW = "planner: memory_plan='auto', DeepSpeed setup chosen"
"""The planner row: no AutoSP setting, and the DeepSpeed setup (ZeRO 1, 2, 2 with optimizer offload, or 3: AutoSP's
sharded parameters) chosen by the planner as well (`autosp.plan.plan_job`)."""


def _tried(report) -> str:
    """", with no plan under ZeRO 1 and ZeRO 2" when `plan_job` passed over setups before the one it chose."""
    from autosp.plan.deepspeed_setups import job_name

    before = [job_name(j) for j in report.jobs_without_plan]
    return f", with no plan under {' and '.join(before)}" if before else ""


def planner_row(*, model: PaperModel, cluster: str = CLUSTER, search: Search | None = None,
                plans: Sequence | None = None, seq_len: int | None = None,
                beside: BreakdownRow | None = None, items: tuple[str, ...] = ("host-memory",),
                narrow_to: int = NARROWED) -> dict:
    """AutoSP's memory planner on ``cluster`` (ALST's machine unless given) with no AutoSP setting
    (`autosp.plan.plan_memory`, the code ``autosp.compile(memory_plan="auto")`` runs; every candidate of
    `autosp.plan.candidates_for`, or ``plans``): objective ``fastest`` at the published length of ``beside``
    (ALST's longest row unless given; or ``seq_len``; its step beside the published iteration there) and
    objective ``longest`` from there (``items``: the keys of the table's items the row is read against, with
    ``planner-depth`` added; ``narrow_to``: Note [Narrowing the longest search]) (the longest length, its plan and
    step; over the plans that fit at ``seq_len`` when any does, since no other can train longer).  The planner
    predicts at its own depth (`autosp.plan.setup.DECIDING_DEPTH`) whatever depth the table's other rows take:
    the row is what ``autosp.compile`` decides, and the technique row with the same options checks its choice at the
    table's depth.  The model is traced as ALST
    calls it (no KV cache) from ``model``'s config; the DeepSpeed setup the first decision chose (`plan_job`: the
    first of ZeRO 1, ZeRO 2, ZeRO 2 with optimizer offload, ZeRO 3 under which a plan fits), kept for the second."""
    import json
    import tempfile

    from autosp.plan import TrainingSetup, load_cluster, plan_job, plan_memory
    from autosp.plan.deepspeed_setups import job_name
    from autosp.plan.setup import DECIDING_DEPTH

    everything = beside or ALST_ROWS[-1]
    at = seq_len or everything.published_tokens - everything.published_tokens % RANKS
    search = search or default_search(AUTOSP_ROWS[0])
    setup = TrainingSetup(seq_len=at, sp_size=RANKS)  # depth None: the planner's own, DECIDING_DEPTH
    machine = load_cluster(cluster, world_size=RANKS)
    config = json.loads(model.hf_config().to_json_string(use_diff=False))
    config.update(use_cache=False)  # as ALST calls the model (`TRAINING`)
    with tempfile.TemporaryDirectory(prefix="alst-planner-") as folder:
        path = pathlib.Path(folder, "config.json")
        path.write_text(json.dumps(config))
        fastest = plan_job(str(path), setup, machine, objective="fastest", plans=plans)
        setup = replace(setup, **fastest.job)
        # Only a plan that fits at ``at`` can train longer than ``at`` (a peak grows with the length), so when one
        # fits the longest search needs those alone: the same answer as over every candidate, for a fraction of
        # the time (each candidate's search traces or re-sizes up to max_probes lengths of an 8B model).  An offload
        # plan the fastest decision did not predict because its twin fits (Note [Offload only where it is needed] in
        # autosp/plan/planner.py) is searched too: it may train longer than its twin.
        fitting = fitting_plans(fastest)
        narrowed, fit_at = fitting, at
        # Where many fit (a short published length), the same argument at doubled lengths narrows them to at most
        # ``narrow_to`` before the longest search, which is the expensive part (Note [Narrowing the longest search]).
        while len(narrowed) > narrow_to and 2 * fit_at <= search.high:
            longer = fitting_plans(plan_memory(str(path), replace(setup, seq_len=2 * fit_at), machine,
                                               objective="fastest", plans=narrowed))
            if not longer:
                break
            narrowed, fit_at = longer, 2 * fit_at
        longest = plan_memory(str(path), replace(setup, seq_len=fit_at), machine, objective="longest",
                              plans=narrowed or plans, granularity=search.granularity, max_length_high=search.high,
                              max_probes=search.max_probes)
    out = table_row(system="autosp", row=PLANNER_ROW, sp_size=RANKS, zero_stage=setup.zero_stage,
               published_tokens=everything.published_tokens, published_iteration_s=everything.published_iteration_s or "",
               published_tflops=everything.published_tflops or "", depth=DECIDING_DEPTH,
               items=" ".join(items + ("planner-depth",)),
               source=f"autosp.plan.plan_job, {len(fastest.candidates)} candidates: objective fastest at {at:,} "
                      f"tokens chose {_chosen_name(fastest)} ({len(fitting)} fit) under {job_name(fastest.job)}"
                      f"{_tried(fastest)}; objective longest "
                      f"({_over(fitting, narrowed, fit_at)}) chose {_chosen_name(longest)}")
    if fastest.chosen is not None:
        chosen = fastest.candidates[fastest.chosen].prediction
        out.update(peak_at_published_gib=round(chosen.peak_bytes / 2**30, 1),
                   simulated_step_at_published_s=figures(chosen.step.step_time_s))
    if longest.chosen is not None:
        chosen = longest.candidates[longest.chosen]
        options, found = chosen.plan.options, chosen.prediction.max_length
        best = found["max_seq_len"]
        out.update(checkpointing=options.get("checkpointing", "sac"), tiled_loss=options.get("tiled_loss") == "on",
                   tiled_mlp=options.get("tiled_mlp") == "on", activation_offload=options.get("activation_offload") == "on",
                   simulated_tokens=best, band_tokens=" - ".join(found["band"]), stopped=found["stopped"],
                   simulated_step_s=figures(found["step_time_s"]),
                   simulated_tflops=figures(tflops_per_gpu(best, found["step_time_s"], RANKS, model)),
                   host_peak_gib=round((found["host_peak_bytes"] or 0) / 2**30, 1))
    log.info("autosp %s: %s tokens (fastest at %s: %s)", PLANNER_ROW, out["simulated_tokens"], at,
             out["simulated_step_at_published_s"])
    return out


def _chosen_name(report) -> str:
    return report.candidates[report.chosen].plan.name if report.chosen is not None else "nothing (none fits)"


def planner_longest(row: dict) -> str:
    """The planner row's longest length for a footer, beside the published length it planned at.  The row has no
    ``error_pct``: it reproduces no published run, and its length over the published one is a gain."""
    if not row["simulated_tokens"]:
        return "nothing fits"
    return (f"{row['simulated_tokens']:,} tokens, {row['simulated_tokens'] / row['published_tokens']:.2f}x the "
            f"published {row['published_tokens']:,}")
