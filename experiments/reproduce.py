"""``python -m experiments.reproduce``: the paper's AutoSP experiments, measured on CPU and simulated at scale.

`DESCRIPTION` (the ``--help`` text) lists the tables and outputs; `PRESETS` holds the settings of the default
and the ``--quick`` preset.  A table's simulated value more than 20 % away from its published counterpart is
flagged in the ``note`` column; a search that stopped before converging (probe budget, search ceiling) says
so there too.

Note [Fixed or per-token gap]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
When a simulated max length is longer than the published one, the real run held memory the simulation does
not count.  Two readings of that gap predict different things across models: a fixed amount per rank (a
buffer the ledger lacks: it should be about the same, or grow with the parameter count, from model to model)
or an amount per token (activations the simulation undercounts: it should scale with tokens × hidden size ×
layers).  `gap_shape` computes both readings at each model's published length and their spread across
models; the reading with the smaller spread is the one the data support.  It attributes nothing by itself:
it says where to look (the ledger's static side, or the activations a traced graph holds), and the
max-seq-len footer prints it from the run.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import logging
import math
import multiprocessing
import os
import pathlib
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed

from tqdm import tqdm

from experiments import cli
from experiments.paper_scale import alst, strategy_table
from experiments.tables import bar_plot, write_table
from simulator.strategies import STRATEGIES

REFERENCE_CSV = pathlib.Path(__file__).resolve().parent / "data" / "autosp-paper-figures.csv"
DISAGREEMENT = 0.20
CPU_MODEL, CPU_MODEL_OPTIONS = "hf-llama", {"kv_heads": 4}  # 8 query heads, 4 kv heads: GQA splits over 4 ranks
EXACT_GRAD_ERROR = 1e-3  # above this relative gradient error a system is flagged inexact
MEASUREMENT_TIMEOUT_S = 3600.0  # deadline of one gloo run of the measured tables (all systems)
COLLECTIVE_TIMEOUT_S = 600.0  # how long a collective waits for a rank still compiling


def published_figures() -> list[dict[str, str]]:
    lines = [ln for ln in REFERENCE_CSV.read_text().splitlines() if ln and not ln.startswith("#")]
    return list(csv.DictReader(lines))


def published_systems() -> tuple[str, ...]:
    """The strategies with a published figure, in the order of the published-figures table (its ``system``
    column spells them as `simulator.strategies.STRATEGIES` does)."""
    return tuple(dict.fromkeys(STRATEGIES[r["system"]].name for r in published_figures()))


SIMULATED = STRATEGIES.table("paper-scale")
"""The systems of the simulated tables."""
UNPUBLISHED = tuple(s for s in SIMULATED if not STRATEGIES[s].published)
"""Simulated beside the published systems, with no published figure."""
MEASURED = STRATEGIES.table("measured-cpu")
"""The systems of the measured CPU tables."""


def search_max_seq_len_task(model: str, systems: tuple[str, ...], granularity: dict[str, int], max_probes: int,
                            ceiling: int, layers: str = "full", step_lengths: tuple[int, ...] = (),
                            cache=None) -> tuple[tuple[dict, dict], dict]:
    """Longest simulated sequence of ``systems`` for one model up to ``ceiling`` tokens ({system:
    experiments.paper_scale.simulate.MaxLength}: the nominal length, the ledger's band and the alternative
    configuration's length, each with its stop reason), the simulated steps at ``step_lengths`` ({(system,
    length): SimulatedStep}, the throughput table's, Note [Throughput steps from the search's traces]) and
    (traced, reused) trace counts.  One task of the max-seq-len table; runs in a worker process or inline."""
    from experiments.paper_scale.config import ALTERNATIVE_CONFIG
    from experiments.paper_scale.simulate import TraceCache, max_length, simulate_step

    cache = cache if cache is not None else TraceCache(interpolate_lengths=True)
    before = _trace_counts(cache)
    # First, so that the throughput lengths are the traces a length-invariant system interpolates the search's
    # probes between (Note [Throughput steps from the search's traces]).
    steps = {(system, length): simulate_step(system, model, length, cache=cache, layers=layers)
             for length in step_lengths for system in systems}
    found = {}
    for system in systems:
        # ``systems`` share one trace (`STRATEGIES.trace_groups`): the later ones rewrite the first's (ring:
        # Ulysses' activations plus small receive buffers), so they start at its length, whose traces are
        # cached (Note [Baselines as AutoSP variants]).
        first = found.get(systems[0])
        start = first.nominal.max_seq_len if first else None
        found[system] = max_length(system, model, granularity=granularity[system], high=ceiling,
                                   start=start or 8192, max_probes=max_probes, cache=cache,
                                   alternative=ALTERNATIVE_CONFIG, layers=layers)
    return (found, steps), _trace_counts(cache, before)


# Note [Throughput steps from the search's traces]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The throughput table simulates whole steps of the iteration model at the published lengths, one task per
# length and trace group, each in a fresh trace cache: every step a full-depth trace.  The max-seq-len search
# of the same model and group traces that group at several lengths of its own, and builds most of them from a
# few traces: by interpolation between three traced lengths where the checkpointing plan does not depend on the
# length, from the joint graphs of two traces where it does (AutoSP's SAC; Note [One trace per length class] in
# experiments/paper_scale/simulate.py, each checked once against a real trace).  So when both tables run, the
# search's task simulates the throughput table's steps first, from its own cache: their three lengths (8,000 to
# 90,000 tokens) become the traces that the search's probes in between are built from, and the throughput
# table only reads the steps.  The same steps and the same search results (a built workload equals the traced
# one, or the length is traced), fewer full-depth traces of Llama-3.1-8B.  `--only throughput` still
# simulates its steps itself.


def simulate_steps_task(model: str, seq_len: int, systems: tuple[str, ...], layers: str = "full", cache=None):
    """Simulated whole steps of ``systems`` for one model and length ({system: SimulatedStep}), and (traced,
    reused) trace counts.  One task of the throughput table."""
    from experiments.paper_scale.simulate import TraceCache, simulate_step

    cache = cache if cache is not None else TraceCache(interpolate_lengths=True)
    before = _trace_counts(cache)
    steps = {system: simulate_step(system, model, seq_len, cache=cache, layers=layers) for system in systems}
    return steps, _trace_counts(cache, before)


def _trace_counts(cache, since: dict | None = None) -> dict:
    """Traces a cache made (traced), reused, built by interpolation and re-sized from joint graphs (Note [One
    trace per length class] in experiments/paper_scale/simulate.py), minus the counts ``since``."""
    counts = {"traced": cache.misses, "reused": cache.hits, "interpolated": cache.interpolated,
              "resized": cache.resized}
    return {k: v - (since or {}).get(k, 0) for k, v in counts.items()}


TRACE_GROUPS = STRATEGIES.trace_groups(SIMULATED)
"""Systems simulated by one task: ring attention rewrites the Ulysses traces, so they share a task (a cache).
AutoSP first (first in the registry): its selective checkpointing is re-sized from the joint graphs of two traces,
the others are interpolated between a few traces (Note [One trace per length class] in experiments/paper_scale/simulate.py)."""


def _run_tasks(args, tasks: list[tuple[Callable, tuple]], desc: str) -> list:
    """Run ``tasks`` [(function, arguments)] on ``args.pool`` (worker processes, each with its own trace
    cache) or inline with ``args.cache``; results in task order."""
    results: list = [None] * len(tasks)
    if args.pool is None:
        for i, (fn, fn_args) in enumerate(tqdm(tasks, desc=desc, file=sys.stderr)):
            results[i] = fn(*fn_args, cache=args.cache)
    else:
        futures = {args.pool.submit(fn, *fn_args): i for i, (fn, fn_args) in enumerate(tasks)}
        for future in tqdm(as_completed(futures), total=len(futures), desc=desc, file=sys.stderr):
            results[futures[future]] = future.result()
    for _, counts in results:
        for kind, n in counts.items():
            args.trace_counts[kind] += n
    return [result for result, _ in results]


def _error_pct(simulated: int | None, published: str) -> float | None:
    """Signed error of ``simulated`` against a published number, in percent (None: either is missing)."""
    if simulated is None or not published.replace(".", "").isdigit():  # 0: nothing fits (-100 %)
        return None
    return 100.0 * (simulated - float(published)) / float(published)


def _tokens(result) -> str:
    """A search's length as the table shows it (``≥ N`` for a lower bound, ``< N`` when nothing fitted)."""
    return result.display().replace(",", "")


def ordering_agrees(lengths: dict[str, float], published: dict[str, float]) -> list[tuple[str, str]]:
    """Pairs of systems whose simulated order differs from their published order (pairs tied in the published
    figures, read off a bar plot, are not compared)."""
    systems = sorted(set(lengths) & set(published))
    return [(a, b) for i, a in enumerate(systems) for b in systems[i + 1:]
            if published[a] != published[b] and (lengths[a] - lengths[b]) * (published[a] - published[b]) <= 0]


def max_seq_len_summary(rows: list[dict]) -> dict:
    """Median |error| over the published rows and, per model, whether the simulated ordering of the systems is
    the published one (the acceptance of the paper-scale reproduction)."""
    errors = [abs(float(r["error_pct"])) for r in rows if r["error_pct"] != ""]
    alternative = [abs(float(r["alternative_error_pct"])) for r in rows if r["alternative_error_pct"] != ""]
    ordering = {}
    for model in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == model and r["published_tokens"] and r["simulated_nominal"]]
        disagree = ordering_agrees({r["system"]: float(r["simulated_nominal"]) for r in mine},
                                   {r["system"]: float(r["published_tokens"]) for r in mine})
        ordering[model] = "; ".join(f"{a} vs {b}" for a, b in disagree) or "same"
    return {"compared": len(errors), "median_abs_error_pct": round(statistics.median(errors), 1) if errors else None,
            "within_disagreement": sum(e <= DISAGREEMENT * 100 for e in errors),
            "alternative_median_abs_error_pct": round(statistics.median(alternative), 1) if alternative else None,
            "ordering": ordering, "ordering_same_for_every_model": all(v == "same" for v in ordering.values()),
            "gap_shape": gap_shape(rows)}


def _peak_line(result) -> Callable[[float], float] | None:
    """The nominal peak as a function of the length: a least-squares line through the lengths the search
    simulated (peak memory is about linear in the length); None with fewer than two lengths."""
    points = sorted({t.seq_len: t.peak_memory_bytes for t in result.trials}.items())
    if len(points) < 2:
        return None
    n = len(points)
    mean_s, mean_p = sum(s for s, _ in points) / n, sum(p for _, p in points) / n
    slope = (sum((s - mean_s) * (p - mean_p) for s, p in points) / sum((s - mean_s) ** 2 for s, _ in points))
    return lambda seq_len: mean_p + slope * (seq_len - mean_s)


def headroom_at(result, seq_len: float, capacity_bytes: int) -> float | None:
    """Capacity minus the nominal peak at ``seq_len`` tokens (`_peak_line`): how much fixed memory the ledger
    would be missing for ``seq_len`` to be the longest that fits (negative: it does not fit as simulated)."""
    line = _peak_line(result)
    return None if line is None else capacity_bytes - line(seq_len)


def activation_multiple_at(result, seq_len: float, capacity_bytes: int, static_bytes: int) -> float | None:
    """The other reading of the same gap (Note [Fixed or per-token gap]): the activation memory a rank would
    hold at ``seq_len`` tokens if the published length were the longest that fits, as a multiple of the
    simulated activations there (capacity minus static memory, over the simulated peak minus static memory)."""
    line = _peak_line(result)
    if line is None or line(seq_len) <= static_bytes:
        return None
    return (capacity_bytes - static_bytes) / (line(seq_len) - static_bytes)


def gap_shape(rows: list[dict]) -> dict:
    """Note [Fixed or per-token gap]: for each system that misses its published length by more than
    `DISAGREEMENT` on several models, the memory missing at the
    published length read as a fixed amount per rank (GiB) and as an amount per token, per hidden unit and per
    layer (bytes), with each reading's spread across the models (coefficient of variation: the smaller, the
    better that reading describes the gap), and the implied activation multiple."""
    from experiments.models import PAPER_MODELS

    shape = {}
    for system in published_systems():
        mine = [r for r in rows if r["system"] == system and r["headroom_at_published_gib"] != ""
                and r["error_pct"] != "" and abs(float(r["error_pct"])) > DISAGREEMENT * 100]
        if not mine:
            continue
        fixed = [float(r["headroom_at_published_gib"]) for r in mine]
        per_token = [float(r["headroom_at_published_gib"]) * 2**30 / (
            float(r["published_tokens"]) * PAPER_MODELS[r["model"]].hidden_size * PAPER_MODELS[r["model"]].num_layers)
            for r in mine]
        multiple = [float(r["implied_activation_multiple"]) for r in mine if r["implied_activation_multiple"]]

        def cv(values: list[float]) -> float | None:  # None: fewer than two models, no spread to compare
            mean = statistics.fmean(values)
            return round(statistics.pstdev(values) / abs(mean), 2) if len(values) > 1 and mean else None

        shape[system] = {"models": [r["model"] for r in mine], "fixed_gib": fixed, "fixed_cv": cv(fixed),
                         "per_token_hidden_layer_bytes": [round(v, 1) for v in per_token],
                         "per_token_cv": cv(per_token), "implied_activation_multiple": multiple}
    return shape


def _length_of(result) -> str:
    """The number behind a search's display (a lower bound's bound; empty when nothing fitted)."""
    return "" if result is None or result.max_seq_len is None else str(result.max_seq_len)


def table_max_seq_len(args) -> list[dict]:
    from experiments.models import PAPER_MODELS
    from experiments.paper_scale.config import ALTERNATIVE_CONFIG, static_memory_bytes
    from simulator import Cluster

    rows = []
    published = [r for r in published_figures() if r["figure"] == "max_seq_len"]
    published = [r for r in published if not args.models or r["model"] in args.models]
    models = sorted({r["model"] for r in published})
    granularity = {s: args.zero3_granularity if s == "zero3" else args.granularity for s in SIMULATED}
    # Longest tasks first (deeper models trace longer), so that the last task to finish on a worker is a short
    # one.
    by_depth = sorted(models, key=lambda m: -PAPER_MODELS[m].num_layers)
    # Note [Throughput steps from the search's traces]
    step_lengths = throughput_lengths() if "throughput" in selected_tables(args) else ()
    tasks = [(search_max_seq_len_task, (model, systems, granularity, args.search_probes, args.max_seq_len_ceiling,
                                        args.layers,
                                        step_lengths if model == args.iteration_model else ()))
             for systems in TRACE_GROUPS for model in by_depth]
    simulated: dict = {}
    for (_, (model, *_)), (found, steps) in zip(tasks, _run_tasks(args, tasks, "max-seq-len (simulated searches)"),
                                                strict=True):
        simulated.update({(model, system): result for system, result in found.items()})
        args.simulated_steps.update(steps)
    published += [{"model": model, "system": system, "value": ""} for model in models for system in UNPUBLISHED]
    for row in published:
        found = simulated.get((row["model"], row["system"]))
        if found is None:
            rows.append({"model": row["model"], "system": row["system"], "published_tokens": row["value"],
                         "simulated_tokens": "", "simulated_nominal": "", "band_tokens": "", "error_pct": "",
                         "stopped": "", "alternative_tokens": "", "alternative_error_pct": "",
                         "headroom_at_published_gib": "", "implied_activation_multiple": "",
                         "note": "not simulated yet"})
            continue
        nominal, alternative = found.nominal, found.alternative
        error = _error_pct(nominal.max_seq_len or 0, row["value"])
        headroom = multiple = None
        if error is not None and nominal.result is not None:
            capacity = nominal.result.capacity_bytes
            headroom = headroom_at(nominal, float(row["value"]), capacity)
            multiple = activation_multiple_at(nominal, float(row["value"]), capacity,
                                              static_memory_bytes(PAPER_MODELS[row["model"]], row["system"]))
        # nothing fits under the alternative: counted as no tokens (-100 %), so the summary does not drop it
        alt_error = _error_pct(None if alternative is None else alternative.max_seq_len or 0, row["value"])
        lower_bound = [f"{name} {r.stopped.replace('_', ' ')}: a lower bound" for name, r in
                       (("nominal", nominal), ("band", found.low_memory)) if r.is_lower_bound]
        if alternative is not None and alternative.stopped == "none_fit" and (
                static_memory_bytes(PAPER_MODELS[row["model"]], row["system"], config=ALTERNATIVE_CONFIG)
                >= int(Cluster.from_preset(PAPER_CLUSTER).device.memory_bytes)):
            lower_bound.append("alternative: its static memory alone exceeds the capacity")
        rows.append({
            "model": row["model"], "system": row["system"], "published_tokens": row["value"],
            "simulated_tokens": _tokens(nominal), "simulated_nominal": _length_of(nominal),
            "band_tokens": f"{_tokens(found.high_memory)} – {_tokens(found.low_memory)}",
            "error_pct": "" if error is None else f"{error:+.0f}", "stopped": nominal.stopped,
            "alternative_tokens": "" if alternative is None else _tokens(alternative),
            "alternative_error_pct": "" if alt_error is None else f"{alt_error:+.0f}",
            "headroom_at_published_gib": "" if headroom is None else f"{headroom / 2**30:.1f}",
            "implied_activation_multiple": "" if multiple is None else f"{multiple:.2f}",
            "note": "; ".join(filter(None, [
                f"differs by more than {DISAGREEMENT:.0%}" if error is not None and abs(error) > DISAGREEMENT * 100
                else "", *lower_bound,
                "memory extrapolated from 1 and 2 layers (--quick): too low under checkpointing"
                if args.layers == "extrapolated" and _checkpoints(row["system"]) else ""])),
        })
    order = published_systems() + UNPUBLISHED
    rows = sorted(rows, key=lambda r: (r["model"], order.index(r["system"])))
    args.summaries["max-seq-len"] = max_seq_len_summary(rows)
    return rows


def _checkpoints(system: str) -> bool:
    """Whether ``system`` recomputes activations (its trace option ``checkpointing``; none: the pass's SAC)."""
    return STRATEGIES[system].compile_options.get("checkpointing") != "none"


def search_configs_task(model: str, systems: tuple[str, ...], configs: tuple[str, ...], granularity: dict[str, int],
                        max_probes: int, ceiling: int, layers: str = "full", cache=None) -> tuple[dict, dict]:
    """Longest simulated sequence of ``systems`` for one model under each public configuration ``configs``
    ({(config, system): MaxLength}) and the trace counts; traces of equal SP degree are shared through
    ``cache``."""
    from experiments.paper_scale.config import PUBLIC_CONFIGS
    from experiments.paper_scale.simulate import TraceCache, max_length

    cache = cache if cache is not None else TraceCache(interpolate_lengths=True)
    before = _trace_counts(cache)
    found = {}
    for name in configs:
        for system in systems:  # the later systems of a trace group start at the first's length (as above)
            first = found.get((name, systems[0]))
            start = first.nominal.max_seq_len if first else None
            found[name, system] = max_length(system, model, granularity=granularity[system], high=ceiling,
                                             start=start or 8192, max_probes=max_probes, cache=cache,
                                             config=PUBLIC_CONFIGS[name], layers=layers)
    return found, _trace_counts(cache, before)


def table_max_seq_len_configs(args) -> list[dict]:
    """The published max lengths beside the simulated ones under every public configuration, their band and
    the closest configuration (Note [The public configurations of the published runs])."""
    from experiments.paper_scale.config import (
        BAND_CONFIGS,
        PUBLIC_CONFIGS,
        configuration_band,
        consistent_configs,
        explain_outside,
    )

    published = [r for r in published_figures() if r["figure"] == "max_seq_len"]
    published = [r for r in published if not args.models or r["model"] in args.models]
    configs = tuple(PUBLIC_CONFIGS)
    published_only = published_systems()
    granularity = {s: args.zero3_granularity if s == "zero3" else args.granularity for s in published_only}
    groups = [g for g in TRACE_GROUPS if set(g) <= set(published_only)]
    tasks = [(search_configs_task, (model, systems, configs, granularity, args.search_probes,
                                    args.max_seq_len_ceiling, args.layers))
             for model in sorted({r["model"] for r in published}) for systems in groups]
    lengths: dict = {name: {} for name in configs}
    results: dict = {}
    for (_, (model, *_)), found in zip(tasks, _run_tasks(args, tasks, "max-seq-len-configs"), strict=True):
        for (name, system), result in found.items():
            lengths[name][model, system] = result.nominal.max_seq_len
            results.setdefault((model, system), {})[name] = result
    band = tuple(name for name in BAND_CONFIGS if name in configs)
    rows = explain_outside(configuration_band(published, lengths, band=band, granularity=granularity), results)
    args.summaries["max-seq-len-configs"] = {
        "configs": {name: {"label": PUBLIC_CONFIGS[name].label, "provenance": PUBLIC_CONFIGS[name].provenance}
                    for name in configs},
        "band": list(band), "inside_band": sum(r["inside_band"] == "true" for r in rows), "compared": len(rows),
        "consistent_with_all": consistent_configs(rows, tuple(configs), DISAGREEMENT)}
    return rows


def _max_seq_len_configs_footer(args) -> list[str]:
    summary = args.summaries["max-seq-len-configs"]
    consistent = ", ".join(summary["consistent_with_all"]) or "none"
    return [
        f"{summary['inside_band']} of {summary['compared']} published lengths inside the band of "
        f"{', '.join(summary['band'])} (its upper end extended by the search granularity: a search answers the "
        f"longest fitting multiple of it). Configuration within {DISAGREEMENT:.0%} of every published length: "
        f"{consistent}. closest_config is a choice among stated configurations, not a prediction; nothing is "
        "fitted. The fork configurations trace what the authors' fork ran (AutoSP's checkpointing rule, K/V repeated "
        "before SDPA, the Ulysses baseline's attention kernel: Note [The traced workloads of the AutoSP research "
        "fork]); outside_evidence names, for a figure outside the band, the closest configuration's peak at the "
        "published length and its largest ledger items.",
        "", *[f"{name}: {c['label']} -- {c['provenance']}" for name, c in summary["configs"].items()],
    ]


def table_external_fidelity(args) -> list[dict]:
    """Published per-GPU memory of runs whose whole configuration is published, beside the simulated one
    (experiments.paper_scale.external_fidelity)."""
    from experiments.paper_scale.external_fidelity import external_fidelity_rows, median_abs_error_pct

    rows = external_fidelity_rows(layers=args.layers, cache=args.cache)
    args.summaries["external-fidelity"] = {"median_abs_error_pct": median_abs_error_pct(rows),
                                           "figures": len(rows), "sources": sorted({r["source"] for r in rows})}
    return rows


def throughput_lengths() -> tuple[int, ...]:
    """The lengths of the published iteration times (the throughput table's rows)."""
    return tuple(sorted({int(r["seq_len"]) for r in published_figures() if r["figure"] == "iteration_s"}))


def table_throughput(args) -> list[dict]:
    rows = []
    published = [r for r in published_figures() if r["figure"] == "iteration_s"]
    lengths = throughput_lengths()
    published += [{"seq_len": str(length), "system": system, "value": ""} for length in lengths
                  for system in UNPUBLISHED]
    sims = dict(args.simulated_steps)  # simulated by the max-seq-len table's tasks when it ran
    tasks = [(simulate_steps_task, (args.iteration_model, seq_len, systems, args.layers))
             for seq_len in lengths for systems in TRACE_GROUPS
             if any((system, seq_len) not in sims for system in systems)]
    for (_, (_, seq_len, *_)), steps in zip(tasks, _run_tasks(args, tasks, f"throughput (simulated "
                                                                          f"{args.iteration_model})"), strict=True):
        sims.update({(system, seq_len): step for system, step in steps.items()})
    for row in published:
        seq_len = int(row["seq_len"])
        sim = sims.get((row["system"], seq_len))
        fits = sim is not None and sim.fits
        rows.append({
            "seq_len": seq_len, "system": row["system"],
            "simulated_tokens_per_s_per_gpu": f"{sim.tokens_per_s_per_gpu:.0f}" if fits else "",
            "simulated_step_s": f"{sim.step_time_s:.3f}" if fits else "",
            "simulated_peak_gib": "" if sim is None else f"{sim.peak_memory_bytes / 2**30:.1f}",
            "published_iteration_s": row["value"],
            "note": "simulated OOM" if sim is not None and not fits else "not simulated yet" if sim is None else "",
        })
    return rows


THROUGHPUT_UNKNOWN = ("The published iteration times come without their batch size, gradient-accumulation steps or "
                      "what the timer covers (data loading, optimizer step, logging), so they are shown beside the "
                      "simulated throughput, not divided by it.")
"""What is unknown about the published iteration (the throughput table's note and the paper say it)."""


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def table_measured_cpu(args) -> list[dict]:
    from experiments.cpu.measure import measure_on_rank
    from experiments.launch import run_on_ranks

    rows = []
    for ranks in tqdm(args.cpu_ranks, desc="measured-cpu (gloo ranks per run)", file=sys.stderr):
        spec = {"model": CPU_MODEL, "model_options": CPU_MODEL_OPTIONS, "seq_len": args.cpu_seq_len,
                "steps": args.cpu_steps, "compiler": "aot_eager"}
        # Each system in its own processes: a fresh compile state and its own graph-break/recompile counts.
        by_system = {name: [r["systems"][name] for r in run_on_ranks(
            measure_on_rank, ranks, {**spec, "systems": [name]}, timeout_s=MEASUREMENT_TIMEOUT_S,
            collective_timeout_s=COLLECTIVE_TIMEOUT_S)] for name in MEASURED}
        ulysses = by_system["ulysses"]
        ulysses_s = max(r["median_step_s"] for r in ulysses) if "median_step_s" in ulysses[0] else None
        for name, results in by_system.items():
            row = {"system": name, "ranks": ranks, "seq_len": args.cpu_seq_len}
            if "unsupported" in results[0]:
                rows.append({**row, "first_step_s": "", "median_step_ms": "", "ratio_to_ulysses": "",
                             "loss_error": "", "grad_max_rel_error": "",
                             "peak_mib": "", "peak_mib_by_rank": "",
                             "graph_breaks": "", "recompiles": "",
                             "note": f"unsupported: {results[0]['unsupported']}"})
                continue
            step_s = max(r["median_step_s"] for r in results)
            grad_error = max(r["grad_max_rel_error"] for r in results)
            row.update({
                "first_step_s": f"{max(r['first_step_s'] for r in results):.1f}",
                "median_step_ms": f"{step_s * 1e3:.1f}",
                "ratio_to_ulysses": _fmt(step_s / ulysses_s if ulysses_s else None, ".2f"),
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


def table_memory_cap(args) -> list[dict]:
    from experiments.cpu.memory_cap import max_seq_len_on_rank
    from experiments.launch import run_on_ranks

    rows = []
    for ranks in tqdm(args.cap_ranks, desc="memory-cap (search per gloo run)", file=sys.stderr):
        spec = {"model": CPU_MODEL, "model_options": CPU_MODEL_OPTIONS,
                "cap_bytes": int(args.memory_cap_mib * 2**20), "start": args.cap_start,
                "granularity": args.cap_granularity, "max_probes": args.cap_probes, "max_len": args.cap_max_len}
        results = {name: run_on_ranks(max_seq_len_on_rank, ranks, {**spec, "systems": [name]},
                                      timeout_s=MEASUREMENT_TIMEOUT_S, collective_timeout_s=COLLECTIVE_TIMEOUT_S,
                                      )[0]["systems"][name]
                   for name in MEASURED}  # each system in its own processes
        for name in MEASURED:
            r = results[name]
            probes = ", ".join(f"{s}:{p / 2**20:.1f}" for s, p in r["probes"])
            row = {"system": name, "ranks": ranks, "cap_mib": f"{args.memory_cap_mib:g}"}
            if "unsupported" in r:
                rows.append({**row, "max_seq_len": "", "first_failure": "", "probes_tokens_mib": probes,
                             "search_s": "", "note": f"unsupported: {r['unsupported']}"})
                continue
            fit, fail = r["max_seq_len"], r["first_failure"]
            if fail is None and fit >= args.cap_max_len:
                note = f"fits up to the search limit ({args.cap_max_len} tokens)"
            elif fail is None or fail - fit > args.cap_granularity:
                note = f"probe budget ({args.cap_probes}) spent: a lower bound"
            else:
                note = ""
            rows.append({**row, "max_seq_len": r["max_seq_len"], "first_failure": r["first_failure"] or "",
                         "probes_tokens_mib": probes, "search_s": f"{r['search_s']:.0f}", "note": note})
    return rows


SIMULATED_TABLES = ("max-seq-len", "max-seq-len-configs", "external-fidelity", "strategies", "alst", "throughput")
ON_REQUEST = ("max-seq-len-configs", "external-fidelity", "strategies", "alst")
"""Tables run only when ``--only`` names them (each is several times the max-seq-len table's simulation)."""
TABLES: dict[str, Callable] = {
    "max-seq-len": table_max_seq_len, "max-seq-len-configs": table_max_seq_len_configs,
    "external-fidelity": table_external_fidelity, "strategies": strategy_table.table_strategies,
    "alst": alst.table_alst, "throughput": table_throughput,
    "measured-cpu": table_measured_cpu, "memory-cap": table_memory_cap,
}


def selected_tables(args) -> tuple[str, ...]:
    """The tables this run builds, in order: ``--only``'s, or every table but those run on request."""
    return tuple(name for name in TABLES if name == args.only or (not args.only and name not in ON_REQUEST))


def plot_max_seq_len(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    systems = published_systems()
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.13
    for i, system in enumerate(systems):
        values = [next((float(r["published_tokens"]) for r in rows if r["model"] == m and r["system"] == system), 0)
                  for m in models]
        ax.bar([x + i * width for x in range(len(models))], values, width, label=f"{system} (published)")
    simulated_systems = [s for s in systems if any(r["system"] == s and r["simulated_nominal"] != "" for r in rows)]
    for j, system in enumerate(simulated_systems):
        simulated = [next((float(r["simulated_nominal"] or 0) for r in rows if r["model"] == m and r["system"] == system),
                          0) for m in models]
        ax.bar([x + (len(systems) + j) * width for x in range(len(models))], simulated, width,
               label=f"{system} (simulated)", hatch="//" if system == "autosp" else "..", color="white",
               edgecolor=f"C{systems.index(system)}")
    ax.set_xticks([x + (len(systems) + len(simulated_systems) - 1) * width / 2 for x in range(len(models))], models)
    ax.set_ylabel("max trainable sequence (tokens)")
    ax.set_title("8×A100-80GB: published vs simulated")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _max_seq_len_footer(args) -> list[str]:
    summary = args.summaries["max-seq-len"]
    ordering = "; ".join(f"{model}: {text}" for model, text in summary["ordering"].items())
    return [
        f"Median |error| over the {summary['compared']} published lengths: {summary['median_abs_error_pct']} % "
        f"({summary['within_disagreement']} within {DISAGREEMENT:.0%}); ordering of systems against the published "
        f"one (pairs tied in the figure not compared): {ordering}.",
        "",
        "simulated_tokens: nominal ledger of the stated configuration (experiments/paper_scale/config.py); "
        "band_tokens: the ledger's high - low static memory; stopped: why the nominal search stopped "
        "(converged, ceiling, probe_budget, none_fit). alternative_tokens is NOT the stated configuration: the "
        "same runs with fp32 gradient accumulation (ZeRO 1: DeepSpeed's BF16_Optimizer and its unpartitioned "
        f"fp32 gradient buffer; nothing fitting counts as -100 %), median |error| "
        f"{summary['alternative_median_abs_error_pct']} %, shown to "
        "explain the gap. headroom_at_published_gib: capacity minus the simulated nominal peak at the "
        "published length (interpolated between the search's probes): the fixed memory per rank the ledger "
        "would have to be missing for the published length to be the maximum; implied_activation_multiple: "
        "the same gap read as activations, their multiple of the simulated ones at the published length.",
        *_gap_shape_lines(summary.get("gap_shape", {})),
    ]


def _gap_shape_lines(shape: dict) -> list[str]:
    """The footer's reading of Note [Fixed or per-token gap]."""
    if not shape:
        return []
    lines = ["", "Shape of the gap across models (Note [Fixed or per-token gap] in experiments/reproduce.py; "
             "coefficient of variation across the models, smaller = the reading describes the gap better):"]
    for system, s in shape.items():
        lines.append(f"- {system}: as fixed memory {', '.join(f'{v:.1f}' for v in s['fixed_gib'])} GiB per rank "
                     f"(CV {s['fixed_cv']}); per token, hidden unit and layer "
                     f"{', '.join(f'{v:.1f}' for v in s['per_token_hidden_layer_bytes'])} bytes (CV "
                     f"{s['per_token_cv']}); implied activation multiple "
                     f"{', '.join(f'{v:.2f}' for v in s['implied_activation_multiple'])} ({', '.join(s['models'])})")
    return lines


TABLE_FOOTERS: dict[str, Callable] = {
    "max-seq-len": _max_seq_len_footer,
    "max-seq-len-configs": _max_seq_len_configs_footer,
    "external-fidelity": lambda args: [
        f"Median |simulated / published - 1|: {args.summaries['external-fidelity']['median_abs_error_pct']} % over "
        f"{args.summaries['external-fidelity']['figures']} figures from "
        f"{', '.join(args.summaries['external-fidelity']['sources'])}; nothing fitted. Memory is torch's "
        "max_memory_reserved (no CUDA context, no NCCL buffers); how each configuration is modelled is in "
        "modelled_as (Note [What the external figures measure and how they are modelled])."],
    "strategies": lambda args: strategy_table.footer(args.summaries["strategies"]),
    "alst": lambda args: args.summaries["alst"]["footer"],
    "throughput": lambda args: [THROUGHPUT_UNKNOWN + " Simulated: one whole step (forward, backward, gradient "
                                "reduction, optimizer) of one sequence split over the ranks (ZeRO-3: one "
                                "sequence per rank), micro-batch 1."],
}


PLOTS = {
    "measured-cpu": lambda rows, path: bar_plot(rows, "median_step_ms", "median step (ms)",
                                                 "CPU gloo: median training step", path),
    "memory-cap": lambda rows, path: bar_plot(rows, "max_seq_len", "longest sequence (tokens)",
                                               f"CPU gloo: longest sequence under {rows[0]['cap_mib']} MiB per rank",
                                               path),
    "strategies": strategy_table.plot_strategies,
    "alst": alst.plot_alst,
}


STEP_FILES = {"workload": "step-workload.json", "trace": "step-trace.json", "timeline": "step-timeline.png",
              "memory": "step-memory.png"}
"""Outputs of `write_simulated_step` (what they show is in run.json's ``simulated_step``)."""


def write_simulated_step(args, out: pathlib.Path) -> dict:
    """Workload, Perfetto trace, timeline and memory plots of one simulated whole AutoSP step (gradient reduction
    and optimizer step included) of ``args.step_layers`` layers of ``args.iteration_model`` at
    ``args.step_seq_len`` tokens; what it simulated, for run.json."""
    from experiments.models import PAPER_MODELS
    from experiments.paper_scale.simulate import step_workload
    from simulator import Cluster, simulate
    from simulator.plots import plot_memory, plot_timeline
    from simulator.trace import write_chrome_trace

    cluster = Cluster.from_preset(PAPER_CLUSTER)
    workload = step_workload("autosp", PAPER_MODELS[args.iteration_model], args.step_seq_len, args.step_layers,
                             ranks=PAPER_RANKS, cache=args.cache)
    result = simulate(workload, cluster)
    workload.to_json(out / STEP_FILES["workload"])
    write_chrome_trace(result, out / STEP_FILES["trace"])
    plot_timeline(result, out / STEP_FILES["timeline"])
    plot_memory(result, out / STEP_FILES["memory"])
    return {"model": args.iteration_model, "layers": args.step_layers, "seq_len": args.step_seq_len,
            "ranks": PAPER_RANKS, "cluster": PAPER_CLUSTER, "files": STEP_FILES}


PRESETS: dict[str, dict] = {
    # measured-cpu on 2 ranks: 4 gloo ranks on a 2-core machine share cores, their step times measure the
    # contention (--cpu-ranks 2 4 on a machine with 4 or more cores)
    "default": {"granularity": 1024, "zero3_granularity": 1024, "search_probes": 10, "cpu_ranks": (2,),
                "cpu_seq_len": 1024, "cpu_steps": 8, "memory_cap_mib": 16.0, "cap_granularity": 128,
                "cap_probes": 5, "layers": "full"},
    # zero3 fits about 10K tokens: the quick preset's 8K-token steps would be too coarse for it
    "quick": {"granularity": 8192, "zero3_granularity": 2048, "search_probes": 6, "cpu_ranks": (2,),
              "cpu_seq_len": 256, "cpu_steps": 3, "memory_cap_mib": 8.0, "cap_granularity": 256, "cap_probes": 2,
              "layers": "extrapolated"},
}
"""Settings of the two presets (``--quick`` picks the second); every other setting is shared (`SHARED`)."""
SHARED = {"max_seq_len_ceiling": 262144, "cap_ranks": (2,), "cap_start": 512, "cap_max_len": 32768,
          "step_layers": 2, "step_seq_len": 8192}
PAPER_CLUSTER, PAPER_RANKS = "a100-80gb-sxm", 8
PRESET_HELP = {
    "granularity": "max-seq-len search granularity (tokens)", "zero3_granularity": "the same for ZeRO-3",
    "search_probes": "probe budget of a baseline's max-seq-len search", "cpu_ranks": "measured-cpu gloo ranks",
    "cpu_seq_len": "measured-cpu tokens", "cpu_steps": "measured-cpu timed steps",
    "memory_cap_mib": "memory-cap cap (MiB per rank)", "cap_granularity": "memory-cap search granularity (tokens)",
    "cap_probes": "memory-cap probes per system",
    "layers": "paper-scale depth: traced in full, or extrapolated from 1 and 2 layers (underestimates memory "
              "under checkpointing)",
}

DESCRIPTION = """\
The paper's AutoSP experiments, measured on CPU gloo ranks and simulated at paper scale.

Tables (--only NAME runs one):
  max-seq-len     longest trainable sequence of each paper model on 8 A100-80GB GPUs, simulated (whole
                  step, memory ledger of the stated configuration, low-high band) for all systems beside
                  the published figures, with the signed error, the search's stop reason, the length
                  under an alternative configuration (BF16_Optimizer) and a summary (median error,
                  ordering of systems)
  max-seq-len-configs
                  the published max lengths beside the simulated ones under every public configuration
                  of the authors' runs (DeepSpeed 0.16.3 stage 0 / ZeRO 1, SP 8, SP 4 x DP 2, SP 2 x DP 4),
                  the script default, the band they span and the closest configuration
  external-fidelity
                  published per-GPU memory of runs whose whole configuration is published (torchtitan's
                  Llama-3.1-8B benchmarks), beside the simulated one, with each configuration's provenance
  strategies      every sequence-parallel strategy the pass compiles (Ulysses, each hybrid Ulysses x ring,
                  the ring) for Llama-3.1-8B at 128K, 512K and 1M tokens on 8 to 64 H100s (1 to 8 nodes),
                  simulated with depth extrapolated: step time, peak, fits, what strategy='auto' chose,
                  the sweep's best and auto's speedup over Ulysses
  alst            ALST's feature breakdown (arXiv 2506.13996 Table 1: Llama-3.1-8B on 8 H100-80GB, ZeRO 3
                  with optimizer offload) modelled row by row beside the published lengths, then AutoSP's
                  techniques added in turn; depth as --quick/default say
  throughput      simulated tokens/s per GPU of every system at the published lengths, beside the
                  published iteration seconds (whose batch and timer are not published: no ratio)
  measured-cpu    the systems side by side on real gloo ranks with a small Hugging Face Llama: compile time,
                  median step time and its ratio to hand-written Ulysses, loss and gradient error against
                  single-device training, per-rank peak tensor memory
  memory-cap      the longest sequence each system trains on CPU gloo ranks under a per-rank memory cap

max-seq-len-configs, external-fidelity, strategies and alst run only with --only NAME.

Outputs in --out: NAME.csv and NAME.md per table, PNG plots, run.json (the command line, settings and
timings; written by every run, --only included), and, on a full run, one simulated step of the
throughput model: its workload, a Perfetto trace (open in ui.perfetto.dev), timeline and memory plots.
"""


def _preset_epilog() -> str:
    width = max(len(text) for text in PRESET_HELP.values())
    lines = ["what --quick changes (default -> quick):"]
    for key, text in PRESET_HELP.items():
        default, quick = PRESETS["default"][key], PRESETS["quick"][key]
        lines.append(f"  {text:<{width}}  {_plain(default)} -> {_plain(quick)}")
    return "\n".join(lines)


def _plain(value) -> str:
    return ", ".join(map(str, value)) if isinstance(value, tuple) else f"{value:g}" if isinstance(value, float) \
        else str(value)


def _command_line(argv: list[str]) -> str:
    return shlex.join(["python", "-m", "experiments.reproduce", *argv])


TABLE_RECORDS = ("max_seq_len_summary", "max_seq_len_configs_summary", "external_fidelity_summary",
                 "strategies_summary", "simulated_step")
"""run.json entries a table run writes besides its table; kept from an earlier run.json when this run did not
redo them."""


def _write_run_json(path: pathlib.Path, run_info: dict, tables: dict[str, dict]) -> None:
    """``run.json`` of this invocation; the per-table records of an earlier run.json in the same folder (and its
    `TABLE_RECORDS`) are kept for tables this invocation did not run, so each table names the command that
    produced it."""
    earlier, kept = {}, {}
    if path.exists():
        with contextlib.suppress(ValueError, AttributeError):
            previous = json.loads(path.read_text())
            earlier = previous.get("tables", {})
            kept = {key: previous[key] for key in TABLE_RECORDS if key in previous and key not in run_info}
    merged = {**earlier, **tables}
    run_info = {**kept, **run_info, "tables": merged, "table_s": {name: t["seconds"] for name, t in merged.items()},
                "commands": list(dict.fromkeys(t["command"] for t in merged.values()))}
    path.write_text(json.dumps(run_info, indent=2) + "\n")


def paper_models() -> list[str]:
    """The models of the published max-seq-len figure: what ``--models`` and ``--iteration-model`` accept."""
    return list(dict.fromkeys(r["model"] for r in published_figures() if r["figure"] == "max_seq_len"))


def build_parser() -> argparse.ArgumentParser:
    models = paper_models()
    parser = cli.parser("experiments.reproduce", DESCRIPTION, epilog=_preset_epilog())
    parser.add_argument("--quick", action="store_true",
                        help="the quick preset: coarser searches, fewer ranks, tokens and steps (below)")
    parser.add_argument("--only", choices=list(TABLES), help="run one table (all when absent)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"), help="results folder")
    parser.add_argument("--iteration-model", default="llama-3.1-8b", choices=models,
                        help="paper model simulated for the throughput table (the published iteration times are unlabelled)")
    parser.add_argument("--models", nargs="+", default=None, choices=models, metavar="MODEL",
                        help=f"paper models of the max-seq-len table: {', '.join(models)} (all when absent)")
    parser.add_argument("--memory-cap-mib", type=float, default=None,
                        help="per-rank cap of the memory-cap table (when absent: the preset's, below)")
    parser.add_argument("--cpu-ranks", type=int, nargs="+", default=None, metavar="N",
                        help="gloo rank counts of the measured-cpu table, e.g. 2 4 (when absent: the preset's, "
                             "below; give no more ranks than CPU cores, or the step times measure the sharing)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="worker processes for the simulated tables (1: none; the default is the CPU count, "
                             "at most 2: %(default)s here)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: give 1 or more worker processes")
    if args.memory_cap_mib is not None and args.memory_cap_mib <= 0:
        parser.error(f"--memory-cap-mib {args.memory_cap_mib:g}: give a positive cap")
    preset = "quick" if args.quick else "default"
    settings = {**PRESETS[preset], **SHARED}
    if args.cpu_ranks is not None and any(n < 2 for n in args.cpu_ranks):
        parser.error(f"--cpu-ranks {' '.join(map(str, args.cpu_ranks))}: give rank counts of 2 or more")
    if args.memory_cap_mib is not None:
        settings["memory_cap_mib"] = args.memory_cap_mib
    if args.cpu_ranks is not None:
        settings["cpu_ranks"] = tuple(args.cpu_ranks)
    vars(args).update(settings)
    from experiments.paper_scale.simulate import TraceCache

    # traces shared within this process (see experiments.paper_scale.simulate.TraceCache)
    args.cache = TraceCache(interpolate_lengths=True)
    args.trace_counts = {"traced": 0, "reused": 0, "interpolated": 0, "resized": 0}
    args.summaries = {}
    args.simulated_steps = {}  # (system, length) -> SimulatedStep of the iteration model
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    command = _command_line(argv)
    run_info = {"command": command, "argv": argv, "preset": preset, "only": args.only,
                "cpu_model": CPU_MODEL, "cpu_model_options": CPU_MODEL_OPTIONS,
                **{key: list(value) if isinstance(value, tuple) else value for key, value in settings.items()},
                "max_seq_len_granularity": args.granularity, "iteration_model": args.iteration_model,
                "paper_cluster": PAPER_CLUSTER, "paper_ranks": PAPER_RANKS,
                "disagreement_pct": round(DISAGREEMENT * 100),
                "jobs": args.jobs, "torch": _version("torch"), "deepspeed": _version("deepspeed"),
                "transformers": _version("transformers")}
    tables: dict[str, dict] = {}
    with contextlib.ExitStack() as stack:
        args.pool = None
        if args.jobs > 1 and (not args.only or args.only in SIMULATED_TABLES):
            # Each simulated probe is a single-threaded trace: spread the tasks over worker processes.
            args.pool = stack.enter_context(ProcessPoolExecutor(max_workers=args.jobs,
                                                                mp_context=multiprocessing.get_context("spawn")))
        for name, build in TABLES.items():
            if name not in selected_tables(args):
                continue
            if name not in SIMULATED_TABLES and args.pool is not None:
                args.pool.shutdown()  # idle workers must not share the CPU with measured gloo ranks
                args.pool = None
            table_start = time.perf_counter()
            rows = build(args)
            tables[name] = {"command": command, "preset": preset,
                            "seconds": round(time.perf_counter() - table_start, 1), "rows": len(rows)}
            if not rows:
                continue
            write_table(name, rows, args.out, footer=TABLE_FOOTERS.get(name, lambda _: [])(args))
            if name == "max-seq-len":
                plot_max_seq_len(rows, args.out / "max-seq-len.png")
            elif name in PLOTS:
                PLOTS[name](rows, args.out / f"{name}.png")
            table = (args.out / f"{name}.md").read_text()
            print(f"\n## {name} ({time.perf_counter() - table_start:.0f} s)\n\n{table}")
    if not args.only:
        before = _trace_counts(args.cache)
        run_info["simulated_step"] = write_simulated_step(args, args.out)
        for kind, n in _trace_counts(args.cache, before).items():
            args.trace_counts[kind] += n
    if "max-seq-len" in args.summaries:
        run_info["max_seq_len_summary"] = args.summaries["max-seq-len"]
    if "external-fidelity" in args.summaries:
        run_info["external_fidelity_summary"] = args.summaries["external-fidelity"]
    if "strategies" in args.summaries:
        run_info["strategies_summary"] = args.summaries["strategies"]
    if "max-seq-len-configs" in args.summaries:
        run_info["max_seq_len_configs_summary"] = args.summaries["max-seq-len-configs"]
    run_info["traces"] = args.trace_counts
    run_info["total_s"] = round(time.perf_counter() - start, 1)
    _write_run_json(args.out / "run.json", run_info, tables)
    print(f"results in {args.out}/ ({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
