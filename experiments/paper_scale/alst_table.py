"""The ALST breakdown table: its rows in order (`row_tasks`, `alst_rows`: ALST's modelled beside the published,
AutoSP's techniques in turn, the planner's), its footer (the reproduction's verdict, the items its misses are read
against) and its plot.
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Callable, Mapping, Sequence

from experiments.models import PAPER_MODELS, PaperModel
from experiments.paper_scale.alst_breakdown import (
    ALST_ROWS,
    AUTOSP_ROWS,
    CLUSTER,
    ITEMS,
    MODEL,
    PAPER,
    RECIPES,
    TOLERANCE,
    BreakdownRow,
    autosp_zero2_row,
)
from experiments.paper_scale.alst_longest import Search, row_result
from experiments.paper_scale.alst_planner import PLANNER_ROW, planner_longest, planner_row
from experiments.paper_scale.simulate import TraceCache
from simulator import Cluster


def alst_rows(**settings) -> list[dict]:
    """Every row of `row_tasks` (the same ``settings``), in order."""
    return [task() for _, task in row_tasks(**settings)]


def row_tasks(*, layers: str = "extrapolated", cache: TraceCache | None = None,
              rows: Sequence[BreakdownRow] | None = None, searches: Mapping[str, Search] | None = None,
              cluster: str = CLUSTER, model: PaperModel | None = None,
              planner: bool | None = None) -> list[tuple[str, Callable[[], dict]]]:
    """The breakdown table as (row name, call that returns the row) pairs, in order, for a caller that runs them
    one at a time (progress): ALST's rows (:data:`ALST_ROWS`) then AutoSP's (:data:`AUTOSP_ROWS` and
    `autosp_zero2_row`), or ``rows``, then the planner's (`planner_row`; ``planner``: default only without
    ``rows``); ``searches`` overrides a row's search settings by row name; ``layers``:
    ``full`` or ``extrapolated`` depth (Note [Depth extrapolation] in simulator/max_length.py); ``model``:
    Llama-3.1-8B unless given (tests pass a small one)."""
    model = model or PAPER_MODELS[MODEL]
    cache = cache if cache is not None else TraceCache(interpolate_lengths=True)
    machine = Cluster.from_preset(cluster)
    chosen = rows if rows is not None else (*ALST_ROWS, *AUTOSP_ROWS, autosp_zero2_row())
    tasks = [(f"{row.system}: {row.name}", functools.partial(row_result, row, model=model, cluster=machine,
                                                             layers=layers, cache=cache,
                                                             search=(searches or {}).get(row.name)))
             for row in chosen]
    if planner is None:
        planner = rows is None
    if planner:
        tasks.append((PLANNER_ROW, functools.partial(planner_row, model=model, cluster=cluster,
                                                     search=(searches or {}).get(PLANNER_ROW))))
    return tasks


def footer(rows: Sequence[dict]) -> list[str]:
    """The table's footer: the reproduction's verdict, the items its misses are read against, what AutoSP adds."""
    alst = [r for r in rows if r["system"] == "alst" and r["error_pct"] != ""]
    inside = sum(1 for r in alst if r["within_tolerance"] is True)
    lines = [f"ALST's configuration reproduced within +-{TOLERANCE:.0%} on {inside} of {len(alst)} published "
             f"lengths ({PAPER}; recipes: {RECIPES}); nothing fitted (Note [ALST's published breakdown and "
             "configuration] in experiments/paper_scale/alst.py)."]
    for r in alst:
        if r["within_tolerance"] is not True:
            found = f"{r['simulated_tokens']:,}" if r["simulated_tokens"] else "nothing fits"
            lines.append(f"- miss: {r['row']}: {found} vs {r['published_tokens']:,} "
                         f"({r['error_pct']} %); peak at the published length {r['peak_at_published_gib']} GiB "
                         f"(largest ledger lines, GiB: {r['largest_ledger_lines_gib']}); explained by "
                         f"{r['miss_item'] or 'nothing sized'}; items: {r['items']}")
    used = sorted({item for r in rows for item in str(r["items"]).split()})
    lines += ["", "Items (what the model of a row differs in from ALST's run):"]
    lines += [f"- {key}: {ITEMS[key]}" for key in used]
    best = {r["system"]: max((int(x["simulated_tokens"] or 0) for x in rows if x["system"] == r["system"]), default=0)
            for r in rows}
    if best.get("autosp") and best.get("alst"):
        lines += ["", f"Longest simulated: ALST's configuration {best['alst']:,} tokens, AutoSP's techniques "
                  f"{best['autosp']:,} ({best['autosp'] / best['alst']:.2f}x). AutoSP rows at ZeRO 3 price the AutoSP "
                  "program under ALST's ZeRO setting (AutoSP refuses ZeRO 3 today); the ZeRO 2 row is what it runs."]
    for r in rows:
        if r["row"] == PLANNER_ROW:
            lines += ["", "The planner (no AutoSP or DeepSpeed setting): "
                      f"{r['source']}. Step at the published length: "
                      f"{r['simulated_step_at_published_s'] or 'does not fit'} s simulated against "
                      f"{r['published_iteration_s']} s published; longest {planner_longest(r)}."]
    return lines


def plot_alst(rows: Sequence[dict], path: pathlib.Path) -> None:
    """Published and simulated longest lengths per row (log scale)."""
    plot_lengths(rows, path, published="published (ALST)",
                 title="Llama-3.1-8B on 8x H100-80GB: ALST's breakdown and AutoSP's techniques")


def plot_lengths(rows: Sequence[dict], path: pathlib.Path, *, published: str, title: str) -> None:
    """A breakdown table's published (labelled ``published``) and simulated longest lengths per row, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    names = [f"{r['system']}: {r['row']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [float(r["published_tokens"] or 0) for r in rows], 0.4, label=published)
    ax.bar([i + 0.2 for i in x], [float(r["simulated_tokens"] or 0) for r in rows], 0.4, label="simulated",
           color="white", edgecolor="C1", hatch="//")
    ax.set_yscale("log")
    ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("longest trainable sequence (tokens)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
