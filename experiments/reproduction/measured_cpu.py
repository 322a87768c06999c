"""The ``measured-cpu`` table: the systems side by side on real gloo ranks with a small Hugging Face Llama."""

from __future__ import annotations

import math
import sys

from tqdm import tqdm

from experiments.reproduction.common import (
    COLLECTIVE_TIMEOUT_S,
    CPU_MODEL,
    CPU_MODEL_OPTIONS,
    EXACT_GRAD_ERROR,
    MEASURED,
    MEASUREMENT_TIMEOUT_S,
    fmt,
)
from experiments.reproduction.run import RunConfig, Runner
from experiments.reproduction.table import Table
from experiments.tables import bar_plot
from simulator.strategies import STRATEGIES

BLANK = dict.fromkeys(("first_step_s", "median_step_ms", "ratio_to_ulysses", "loss_error", "grad_max_rel_error",
                       "peak_mib", "peak_mib_by_rank", "graph_breaks", "recompiles"), "")
"""The measured columns of a row whose system did not run."""


def build(run: RunConfig, runner: Runner) -> list[dict]:
    from experiments.cpu.measure import measure_on_rank
    from experiments.launch import run_on_ranks

    rows, systems = [], run.measured(MEASURED)
    for ranks in tqdm(run.cpu_ranks, desc="measured-cpu (gloo ranks per run)", file=sys.stderr):
        spec = {"model": CPU_MODEL, "model_options": CPU_MODEL_OPTIONS, "seq_len": run.cpu_seq_len,
                "steps": run.cpu_steps, "compiler": "aot_eager"}
        # A system that cannot split one sequence over this many ranks (a hybrid on too few) gets a row saying why.
        cannot = {name: STRATEGIES[name].cannot_run_on(ranks) for name in systems}
        # Each system in its own processes: a fresh compile state and its own graph-break/recompile counts.
        by_system = {name: [r["systems"][name] for r in run_on_ranks(
            measure_on_rank, ranks, {**spec, "systems": [name]}, timeout_s=MEASUREMENT_TIMEOUT_S,
            collective_timeout_s=COLLECTIVE_TIMEOUT_S)] for name in systems if not cannot[name]}
        ulysses = by_system["ulysses"]
        ulysses_s = max(r["median_step_s"] for r in ulysses) if "median_step_s" in ulysses[0] else None
        for name in systems:
            row = {"system": name, "ranks": ranks, "seq_len": run.cpu_seq_len}
            if cannot[name]:
                rows.append({**row, **BLANK, "note": cannot[name]})
                continue
            results = by_system[name]
            if "unsupported" in results[0]:
                rows.append({**row, **BLANK, "note": f"unsupported: {results[0]['unsupported']}"})
                continue
            step_s = max(r["median_step_s"] for r in results)
            grad_error = max(r["grad_max_rel_error"] for r in results)
            row.update({
                "first_step_s": f"{max(r['first_step_s'] for r in results):.1f}",
                "median_step_ms": f"{step_s * 1e3:.1f}",
                "ratio_to_ulysses": fmt(step_s / ulysses_s if ulysses_s else None, ".2f"),
                "loss_error": f"{max(r['loss_error'] for r in results):.1e}",
                "grad_max_rel_error": f"{grad_error:.1e}",
            })
            peaks = [r["peak_memory_bytes"] / 2**20 for r in results]
            row.update({"peak_mib": f"{max(peaks):.2f}", "peak_mib_by_rank": "/".join(f"{p:.2f}" for p in peaks)})
            breaks = max(r.get("graph_breaks", 0) for r in results)
            recompiles = max(r.get("recompiles", 0) for r in results)
            row.update({"graph_breaks": breaks, "recompiles": recompiles})
            nan_ranks = [str(i) for i, r in enumerate(results) if math.isnan(r["loss"])]
            row["note"] = "; ".join(filter(None, [
                "inexact" if not grad_error <= EXACT_GRAD_ERROR else "",
                f"graph breaks ({max(r.get('graphs', 0) for r in results)} graphs)" if breaks else "",
                "recompiles" if recompiles else "",
                f"NaN loss on rank {', '.join(nan_ranks)}" if nan_ranks else "",
            ]))
            rows.append(row)
    return rows


def footer(rows: list[dict], summary: dict | None = None) -> list[str]:
    """The closing note: on each rank count, every system's median step as a multiple of hand-written Ulysses'
    (the same compiler, `aot_eager`, for all), or why it has none."""
    lines = []
    for ranks in dict.fromkeys(r["ranks"] for r in rows):
        ratios = [f"`{r['system']}` {r['ratio_to_ulysses']}x" if r["ratio_to_ulysses"] != ""
                  else f"`{r['system']}` ({r['note']})" for r in rows if r["ranks"] == ranks]
        lines.append(f"Step time on {ranks} ranks over hand-written Ulysses': {', '.join(ratios)}.")
    return lines


def plot(rows: list[dict], path) -> None:
    bar_plot(rows, "median_step_ms", "median step (ms)", "CPU gloo: median training step", path)


TABLE = Table(
    name="measured-cpu",
    help="the systems side by side on real gloo ranks with a small Hugging Face Llama: compile time,\n"
         "median step time and its ratio to hand-written Ulysses, loss and gradient error against\n"
         "single-device training, per-rank peak tensor memory",
    build=build, simulated=False, footer=footer, plot=plot)
