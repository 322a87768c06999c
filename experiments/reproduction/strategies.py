"""The ``strategies`` table: every sequence-parallel strategy the pass compiles, simulated at paper scale, and what
``strategy="auto"`` chose (the row groups, their summary, footer and plot: `experiments.paper_scale.strategy_table`)."""

from __future__ import annotations

from experiments.paper_scale import strategy_table
from experiments.reproduction.run import RunConfig, Runner
from experiments.reproduction.table import Table


def build(run: RunConfig, runner: Runner) -> list[dict]:
    """The row groups on the run's task runner."""
    rows = [r for group in runner.run_tasks(strategy_table.strategy_tasks(),
                                            "strategies (strategy='auto' per row group)")
            for r in group]
    return strategy_table.sort_rows(rows)


TABLE = Table(
    name="strategies",
    help="every sequence-parallel strategy the pass compiles (Ulysses, each hybrid Ulysses x ring,\n"
         "the ring) for Llama-3.1-8B at 128K, 512K and 1M tokens on 8 to 64 H100s (1 to 8 nodes),\n"
         "simulated with depth extrapolated: step time, peak, fits, what strategy='auto' chose,\n"
         "the sweep's best and auto's speedup over Ulysses",
    build=build, simulated=True, on_request=True, record="strategies_summary", summary=strategy_table.summary,
    footer=lambda rows, summary: strategy_table.footer(summary), plot=strategy_table.plot_strategies)
