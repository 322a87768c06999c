"""The ``breakdown-a100`` table: the AutoSP paper's systems on its machine (Llama-3.1-8B, 8x A100-80GB, ZeRO 1)
beside its published lengths, then this project's AutoSP with each memory technique added in turn, then the
planner (the rows, footer and plot: `experiments.paper_scale.breakdown_a100`)."""

from __future__ import annotations

from experiments.paper_scale import alst_longest, breakdown_a100
from experiments.reproduction.common import published_figures
from experiments.reproduction.run import RunConfig, Runner
from experiments.reproduction.table import Table


def published_lengths(model: str = breakdown_a100.MODEL) -> dict[str, int]:
    """The paper's longest trainable length of ``model`` by system (its max-seq-len figure)."""
    return {r["system"]: int(r["value"]) for r in published_figures()
            if r["figure"] == "max_seq_len" and r["model"] == model}


def build(run: RunConfig, runner: Runner) -> list[dict]:
    """Every row, inline on the run's trace cache, one at a time with a progress bar; the published systems
    searched as the max-seq-len tables search (the run's granularity, probes and ceiling)."""
    search = alst_longest.Search(granularity=run.granularity, start=8192, high=run.max_seq_len_ceiling,
                                 max_probes=run.search_probes)
    tasks = breakdown_a100.row_tasks(published_lengths(), layers=run.layers, cache=runner.cache,
                                     baseline_search=search)
    return runner.run_named(tasks, "breakdown-a100")


TABLE = Table(
    name="breakdown-a100",
    help="the AutoSP paper's machine (Llama-3.1-8B on 8 A100-80GB, ZeRO 1): Ulysses, Ulysses with\n"
         "per-layer checkpointing and the paper's AutoSP as its runs ran, beside the published lengths;\n"
         "then AutoSP's techniques added in turn and the planner; depth as --quick/default say",
    build=build, simulated=True, on_request=True,
    footer=lambda rows, summary: breakdown_a100.footer(rows), plot=breakdown_a100.plot_breakdown)
