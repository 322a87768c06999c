"""The ``alst`` table: ALST's feature breakdown (arXiv 2506.13996 Table 1) modelled row by row beside the published
lengths, then AutoSP's techniques added in turn (the rows, footer and plot: `experiments.paper_scale.alst_table`)."""

from __future__ import annotations

from experiments.paper_scale import alst_table
from experiments.reproduction.run import RunConfig, Runner
from experiments.reproduction.table import Table


def build(run: RunConfig, runner: Runner) -> list[dict]:
    """Every row, inline on the run's trace cache (each row's search reuses the traces of the rows before it), one at
    a time with a progress bar."""
    return runner.run_named(alst_table.row_tasks(layers=run.layers, cache=runner.cache), "alst")


TABLE = Table(
    name="alst",
    help="ALST's feature breakdown (arXiv 2506.13996 Table 1: Llama-3.1-8B on 8 H100-80GB, ZeRO 3\n"
         "with optimizer offload) modelled row by row beside the published lengths, then AutoSP's\n"
         "techniques added in turn; depth as --quick/default say",
    build=build, simulated=True, on_request=True,
    footer=lambda rows, summary: alst_table.footer(rows), plot=alst_table.plot_alst)
