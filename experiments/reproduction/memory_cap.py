"""The ``memory-cap`` table: the longest sequence each system trains on CPU gloo ranks under a per-rank memory
cap."""

from __future__ import annotations

import sys

from tqdm import tqdm

from experiments.reproduction.common import (
    COLLECTIVE_TIMEOUT_S,
    CPU_MODEL,
    CPU_MODEL_OPTIONS,
    MEASUREMENT_TIMEOUT_S,
)
from experiments.reproduction.run import RunConfig, Runner
from experiments.reproduction.table import Table
from experiments.tables import bar_plot
from simulator.strategies import STRATEGIES

SYSTEMS = STRATEGIES.table("memory-cap")
"""The rows: the measured systems (``autosp``, the default compile, planned for the cap) and ``autosp-sac``, AutoSP
unplanned (Note [The planner's memory-cap row] in experiments/cpu/memory_cap.py)."""
MODEL_OPTIONS = {CPU_MODEL: CPU_MODEL_OPTIONS}
"""Size options of the table's models (`RunConfig.cap_models`; a model not named here is built as its preset is):
the other CPU tables' Hugging Face Llama with their options, so that its rows stand beside theirs."""


def _step_times(ranks: int, spec: dict, results: dict, steps: int) -> dict:
    """Median step seconds of `REFERENCE_ROW` and `PLANNER_ROW` measured side by side (interleaved, one gloo run)
    at the reference's longest length ({} when either found none): {"seq_len": ..., row: seconds}."""
    from experiments.cpu.memory_cap import PLANNER_ROW, REFERENCE_ROW, step_times_on_rank
    from experiments.launch import run_on_ranks

    pair = (REFERENCE_ROW, PLANNER_ROW)
    length = (results.get(REFERENCE_ROW) or {}).get("max_seq_len")
    if not length or not all((results.get(name) or {}).get("max_seq_len") for name in pair):
        return {}
    timed = run_on_ranks(step_times_on_rank, ranks, {**spec, "systems": list(pair)}, length, steps,
                         timeout_s=MEASUREMENT_TIMEOUT_S, collective_timeout_s=COLLECTIVE_TIMEOUT_S)[0]
    return {"seq_len": length, **{name: timed[name]["median_step_s"] for name in pair}}


def build(run: RunConfig, runner: Runner) -> list[dict]:
    from experiments.cpu.memory_cap import PLANNER_ROW, REFERENCE_ROW, max_seq_len_on_rank, row_note
    from experiments.launch import run_on_ranks

    rows, systems = [], run.measured(SYSTEMS)
    runs = [(model, ranks) for model in run.cap_models for ranks in run.cap_ranks]
    for model, ranks in tqdm(runs, desc="memory-cap (search per model and gloo run)", file=sys.stderr):
        spec = {"model": model, "model_options": MODEL_OPTIONS.get(model, {}),
                "cap_bytes": int(run.memory_cap_mib * 2**20), "start": run.cap_start,
                "granularity": run.cap_granularity, "max_probes": run.cap_probes, "max_len": run.cap_max_len}
        # a system that cannot split one sequence over this many ranks (a hybrid on too few): a row saying why
        cannot = {name: STRATEGIES[name].cannot_run_on(ranks) for name in systems}
        results = {name: run_on_ranks(max_seq_len_on_rank, ranks, {**spec, "systems": [name]},
                                      timeout_s=MEASUREMENT_TIMEOUT_S, collective_timeout_s=COLLECTIVE_TIMEOUT_S,
                                      )[0]["systems"][name]
                   for name in systems if not cannot[name]}  # each system in its own processes
        timed = _step_times(ranks, spec, results, run.cpu_steps)
        for name in systems:
            row = {"system": name, "model": model, "ranks": ranks, "cap_mib": f"{run.memory_cap_mib:g}"}
            if cannot[name]:
                rows.append({**row, "max_seq_len": "", "first_failure": "", "probes_tokens_mib": "",
                             "search_s": "", "step_s_at_reference": "", "note": cannot[name]})
                continue
            r = results[name]
            probes = ", ".join(f"{s}:{p / 2**20:.1f}" for s, p in r["probes"])
            if "unsupported" in r:
                rows.append({**row, "max_seq_len": "", "first_failure": "", "probes_tokens_mib": probes,
                             "search_s": "", "step_s_at_reference": "", "note": f"unsupported: {r['unsupported']}"})
                continue
            fit, fail = r["max_seq_len"], r["first_failure"]
            below = r.get("below_fit") or []
            if below:  # Note [Memory-cap search]: the peak is not monotone in the length
                note = (f"failed at {', '.join(map(str, below))} below the {fit} that fitted (its peak is not "
                        "monotone in the length): a lower bound")
            elif fail is None and fit >= run.cap_max_len:
                note = f"fits up to the search limit ({run.cap_max_len} tokens)"
            elif fail is None or fail - fit > run.cap_granularity:
                note = f"probe budget ({run.cap_probes}) spent: a lower bound"
            else:
                note = ""
            step = timed.get(name)
            if step is not None and name == PLANNER_ROW:  # Note [The planner's memory-cap row]
                reference = REFERENCE_ROW
                note = (f"{note}; " if note else "") + (
                    f"{r['max_seq_len'] / results[reference]['max_seq_len']:.2f}x {reference}'s length; step at "
                    f"its {timed['seq_len']} tokens {step / timed[reference]:.2f}x its (side by side)")
            note = "; ".join(filter(None, (note, row_note(r))))
            rows.append({**row, "max_seq_len": r["max_seq_len"], "first_failure": r["first_failure"] or "",
                         "probes_tokens_mib": probes, "search_s": f"{r['search_s']:.0f}",
                         "step_s_at_reference": f"{step:.3f}" if step is not None else "", "note": note})
    return rows


def plot(rows: list[dict], path) -> None:
    bar_plot(rows, "max_seq_len", "longest sequence (tokens)",
             f"CPU gloo ({'/'.join(dict.fromkeys(str(r['ranks']) for r in rows))} ranks): longest sequence under "
             f"{rows[0]['cap_mib']} MiB per rank", path,
             group="model", group_label="{}")


TABLE = Table(
    name="memory-cap",
    help="the longest sequence each system trains on CPU gloo ranks under a per-rank memory cap, on Llama-3.1-8B's "
         "proportions at hidden 64 (the default preset adds measured-cpu's model)",
    build=build, simulated=False, plot=plot)
