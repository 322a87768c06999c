"""The technique breakdown on the AutoSP paper's machine: Llama-3.1-8B on 8x A100-80GB under the paper's ZeRO 1,
the published systems simulated as the authors' fork ran them beside the published lengths, then this project's
AutoSP with each memory technique added in turn, then the planner.

Note [The breakdown on the AutoSP paper's machine]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
ALST's breakdown (experiments/paper_scale/alst.py) is modelled on ALST's node and DeepSpeed setting (ZeRO 3 with
optimizer offload). The same question on the machine of the AutoSP paper (its max-seq-len figure,
experiments/data/autosp-paper-figures.csv: one node of 8x A100-80GB SXM) needs that paper's setting instead:
ZeRO 1 over the 8 ranks, no optimizer offload, Ulysses over all 8 (`PAPER_CONFIG`, Note [The public
configurations of the published runs] in experiments/paper_scale/config.py). Three kinds of rows:

* the published systems, as their runs ran: hand-written Ulysses (published), Ulysses with per-layer
  checkpointing (no published figure: the baseline as its users configure it) and the paper's AutoSP, each
  searched by `experiments.paper_scale.simulate.max_length` under the fork's ZeRO 1 configuration
  (`FORK_CONFIG`: DeepSpeed 0.16.3, the fork's long-context checkpointing rule, K/V repeated before SDPA,
  Note [The traced workloads of the AutoSP research fork] in experiments/paper_scale/fork.py), the code the
  max-seq-len-configs table runs, so the two tables agree;
* this project's AutoSP with SAC, then the tiled loss, the tiled MLP and activation offload added in turn, then
  everything under per-layer checkpointing: ALST's AutoSP rows (`alst_breakdown.AUTOSP_ROWS`) with the paper's
  ZeRO 1 and no optimizer offload, traced as a trainer calls the model (no KV cache, `alst.TRAINING`);
* the planner (`alst_planner.planner_row`): ``memory_plan="auto"`` and the DeepSpeed setup chosen by
  `autosp.plan.plan_job`, objective fastest at the paper's published AutoSP length and objective longest from
  there.

What stays unknown: which of the public configurations made the published figure (the max-seq-len-configs table
shows the band they span); the published iteration times name no model, so only lengths stand beside each other.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from experiments.models import PAPER_MODELS, PaperModel
from experiments.paper_scale import alst_breakdown, alst_longest, alst_planner, alst_table
from experiments.paper_scale.config import PUBLIC_CONFIGS
from experiments.paper_scale.simulate import TraceCache, fork_trace_options
from experiments.paper_scale.simulate import max_length as system_max_length
from simulator import Cluster
from simulator.strategies import STRATEGIES

log = logging.getLogger(__name__)

MODEL = "llama-3.1-8b"
CLUSTER = "a100-80gb-sxm"
FORK_CONFIG = "fork-z1-sp8"
"""The public configuration the published systems are simulated under (`PUBLIC_CONFIGS`): the fork at ZeRO 1, SP
over all 8 ranks, the setting this breakdown's AutoSP rows share."""
PUBLISHED_SYSTEMS = tuple(s for s in STRATEGIES.table("paper-scale") if STRATEGIES[s].sequence_parallel == "ulysses")
"""The systems simulated as the published runs ran: the paper-scale systems of Ulysses' kind (AutoSP, hand-written
Ulysses and Ulysses with per-layer checkpointing, in the registry's order); one without a published figure is the
baseline as its users configure it."""
AS_PUBLISHED = "as the paper's runs ran"
"""The row name of a published system (the ``system`` column names it)."""
SEARCH = alst_longest.Search(granularity=4096, start=131_072, high=1 << 23, max_probes=12)
"""The technique rows' search: steps of 4,096 tokens (1/32 of the first probe) up to 8M, the same for every row
(never a published figure)."""

BASELINE_SEARCH = alst_longest.Search(granularity=1024, start=8192, high=1 << 19)
"""The published systems' search (the max-seq-len table's grid; the reproduce run passes its own settings)."""

ITEMS: dict[str, str] = {
    "fork-run": "the published systems ran the authors' research fork (DeepSpeed 0.16.3; AutoSP's long-context "
                "checkpointing rule and K/V repeated before SDPA; the Ulysses baseline's SDPA kernel), simulated as "
                "the fork ran them under its ZeRO 1 configuration (`FORK_CONFIG`); which public configuration made "
                "the figure is unknown (the max-seq-len-configs table gives the band)",
    "this-pass": "this project's pass, not the fork: its SAC, the model called without a KV cache as a trainer "
                 "calls it, current DeepSpeed's ZeRO 1 ledger",
    "depth-extrapolated": alst_breakdown.ITEMS["depth-extrapolated"],
    "planner-depth": alst_breakdown.ITEMS["planner-depth"],
}


def technique_rows() -> tuple[alst_breakdown.BreakdownRow, ...]:
    """ALST's AutoSP rows under the AutoSP paper's setting: ZeRO 1 over the 8 ranks, no optimizer offload."""
    return tuple(replace(row, zero_stage=1, offload_optimizer=False, items=("this-pass",))
                 for row in alst_breakdown.AUTOSP_ROWS)


def published_row(system: str, published_tokens: int | None, *, model_name: str, cluster: Cluster, layers: str,
                  cache: TraceCache, granularity: int, high: int, max_probes: int) -> dict:
    """``system`` searched as the published runs ran it (`FORK_CONFIG`), beside its published length."""
    config = PUBLIC_CONFIGS[FORK_CONFIG]
    sp_size = config.sp_size_of(system, alst_breakdown.RANKS)
    options, _ = fork_trace_options(system, PAPER_MODELS[model_name], dict(STRATEGIES[system].options), sp_size,
                                    config)
    found = system_max_length(system, model_name, granularity=granularity, high=high, max_probes=max_probes,
                              cluster=cluster, cache=cache, config=config, layers=layers)
    best = found.nominal.max_seq_len
    out = alst_longest.table_row(
        system=system, row=AS_PUBLISHED, sp_size=sp_size,
        zero_stage=config.zero_stage(system), checkpointing=options.get("checkpointing", "none"),
        tiled_loss=False, tiled_mlp=False, activation_offload=False, simulated_tokens=best or "",
        band_tokens=f"{found.high_memory.display()} - {found.low_memory.display()}", stopped=found.nominal.stopped,
        published_tokens=published_tokens or "", depth=layers,
        items=" ".join(("fork-run",) + (("depth-extrapolated",) if layers != "full" else ())),
        source=f"experiments.paper_scale.simulate.max_length under {FORK_CONFIG} ({config.label})")
    if best:
        out.update(simulated_step_s=alst_longest.figures(found.nominal.step_time_s))
    if best and published_tokens:
        out.update(error_pct=round(100 * (best / published_tokens - 1), 1))
    log.info("%s as the paper's runs ran: %s tokens (published %s)", system, best, published_tokens)
    return out


def row_tasks(published: Mapping[str, int], *, layers: str = "extrapolated", cache: TraceCache | None = None,
              model: PaperModel | None = None, systems: Sequence[str] = PUBLISHED_SYSTEMS,
              rows: Sequence[alst_breakdown.BreakdownRow] | None = None, search: alst_longest.Search = SEARCH,
              baseline_search: alst_longest.Search = BASELINE_SEARCH, planner: bool = True,
              plans: Sequence | None = None) -> list[tuple[str, Callable[[], dict]]]:
    """The table's rows as (row name, call that returns the row) pairs, in order, for a caller that runs them one
    at a time (progress):
    ``systems`` as the published runs ran them (a paper model only; ``published``: the paper's length by system),
    then ``rows`` (default `technique_rows`), then the planner at the published AutoSP length. ``model``:
    Llama-3.1-8B unless given (tests pass a small one, with no published systems)."""
    model = model or PAPER_MODELS[MODEL]
    cache = cache if cache is not None else TraceCache(interpolate_lengths=True)
    machine = Cluster.from_preset(CLUSTER)
    tasks = [(f"{system}: {AS_PUBLISHED}",
              functools.partial(published_row, system, published.get(system), model_name=model.name, cluster=machine,
                                layers=layers, cache=cache, granularity=baseline_search.granularity,
                                high=baseline_search.high, max_probes=baseline_search.max_probes))
             for system in systems]
    tasks += [(f"{row.system}: {row.name}",
               functools.partial(alst_longest.row_result, row, model=model, cluster=machine, layers=layers,
                                 cache=cache, search=search))
              for row in (technique_rows() if rows is None else rows)]
    if planner:
        beside = alst_breakdown.BreakdownRow(name="the paper's AutoSP", system="autosp",
                                             sp_size=alst_breakdown.RANKS, checkpointing="long-context",
                                             zero_stage=1, offload_optimizer=False,
                                             published_tokens=published["autosp"])
        tasks.append((alst_planner.PLANNER_ROW,
                      functools.partial(alst_planner.planner_row, model=model, cluster=CLUSTER, search=search,
                                        plans=plans, beside=beside, items=())))
    return tasks


def breakdown_rows(published: Mapping[str, int], **settings) -> list[dict]:
    """Every row of `row_tasks` (the same ``settings``), in order."""
    return [task() for _, task in row_tasks(published, **settings)]


def footer(rows: Sequence[dict]) -> list[str]:
    """Below the table: the published lengths beside the simulated ones, what each technique adds over the SAC row,
    the planner's choice, and the items the rows are read against."""
    lines = [f"Llama-3.1-8B on 8x A100-80GB ({CLUSTER}), the AutoSP paper's setting: ZeRO 1 over the 8 ranks, no "
             "optimizer offload (Note [The breakdown on the AutoSP paper's machine] in "
             "experiments/paper_scale/breakdown_a100.py)."]
    for r in rows:
        if r["published_tokens"] and r["row"] != alst_planner.PLANNER_ROW:
            found = f"{r['simulated_tokens']:,}" if r["simulated_tokens"] else "nothing fits"
            lines.append(f"- {r['system']}, {r['row']}: simulated {found} beside the published {r['published_tokens']:,} "
                         f"({r['error_pct']} %)")
    base = next((r for r in rows if r["row"] == alst_breakdown.AUTOSP_ROWS[0].name and r["simulated_tokens"]), None)
    tuned = next((r for r in rows if r["system"] == "ulysses+ckpt" and r["simulated_tokens"]), None)
    for r in rows:
        if r["system"] == "autosp" and r["row"] != AS_PUBLISHED and r["simulated_tokens"] and r is not base and base:
            against = f", {r['simulated_tokens'] / tuned['simulated_tokens']:.2f}x ulysses+ckpt" if tuned else ""
            lines.append(f"- {r['row']}: {r['simulated_tokens'] / base['simulated_tokens']:.2f}x the SAC row's "
                         f"length{against}")
        if r["row"] == alst_planner.PLANNER_ROW:
            lines += ["", f"The planner (no AutoSP or DeepSpeed setting): {r['source']}. Step at the published "
                      f"AutoSP length: {r['simulated_step_at_published_s'] or 'does not fit'} s; longest "
                      f"{alst_planner.planner_longest(r)}."]
    used = sorted({item for r in rows for item in str(r["items"]).split()})
    lines += ["", "Items (what a row is read against):"]
    lines += [f"- {key}: {ITEMS[key]}" for key in used]
    return lines


def plot_breakdown(rows: Sequence[dict], path) -> None:
    """Simulated longest lengths per row beside the published ones (log scale)."""
    alst_table.plot_lengths(rows, path, published="published (AutoSP paper)",
                            title="Llama-3.1-8B on 8x A100-80GB, ZeRO 1: the published systems, then AutoSP's techniques")
