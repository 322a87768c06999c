"""``python -m experiments.reproduce``: the paper's AutoSP experiments, measured on CPU and simulated at scale.

Tables (``--only NAME`` runs one):

- ``max-seq-len``: longest trainable sequence of each paper model on 8×A100-80GB,
  simulated for all four systems (AutoSP from the real pass's exported schedule,
  the baselines as rewrites of traced graphs: see Note [Baselines as AutoSP
  variants]) beside the published figures, with the simulated/published ratio;
- ``iteration-time``: simulated step time of the four systems at 8K, 24K and 90K
  tokens beside the published iteration times;
- ``measured-cpu``: the systems on real gloo ranks with a small Hugging Face
  Llama, each in its own processes from a fresh compile state (first-step/compile
  time, median step time and its ratio to hand-written Ulysses, loss and gradient
  error against single-device training, per-rank peak tensor memory, Dynamo's
  graph breaks and recompiles; a system that breaks its graph or recompiles is
  marked in the note);
- ``memory-cap``: the longest sequence each system trains on CPU gloo ranks under
  a fixed per-rank memory cap (measured peak memory, a short secant search).

Outputs go to ``--out`` (default ``results/``): CSV and Markdown per table, PNG
plots, a Perfetto trace (open in ui.perfetto.dev) and memory plot of one
simulated step.  A table's simulated value more than 20 % away from its published
counterpart is flagged in the ``note`` column.
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
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed

from tqdm import tqdm

REFERENCE_CSV = pathlib.Path(__file__).resolve().parent / "data" / "autosp-paper-figures.csv"
DISAGREEMENT = 0.20
SYSTEMS = ("zero3", "ring_attention", "ulysses", "autosp")
UNPUBLISHED_SYSTEMS = ("ulysses+ckpt",)  # simulated beside the published systems, no published figure
MEASURED_SYSTEMS = ("autosp", "autosp-nosac", "ulysses", "ulysses+ckpt", "ring", "zero3", "deepspeed-autosp")
CPU_MODEL, CPU_MODEL_OPTIONS = "hf-llama", {"kv_heads": 4}  # 8 query heads, 4 kv heads: GQA splits over 4 ranks
EXACT_GRAD_ERROR = 1e-3  # above this relative gradient error a system is flagged inexact


def published_figures() -> list[dict[str, str]]:
    lines = [ln for ln in REFERENCE_CSV.read_text().splitlines() if ln and not ln.startswith("#")]
    return list(csv.DictReader(lines))


def _ratio_note(simulated: float | None, published: str) -> tuple[str, str]:
    if simulated is None or not published.replace(".", "").isdigit():
        return "", "" if published != "OOM" else ("simulated fits" if simulated else "")
    ratio = simulated / float(published)
    note = f"differs by more than {DISAGREEMENT:.0%}" if abs(ratio - 1) > DISAGREEMENT else ""
    return f"{ratio:.2f}", note


def search_max_seq_len_task(model: str, systems: tuple[str, ...], granularity: dict[str, int], max_probes: int,
                            cache=None) -> tuple[dict[str, tuple[int, bool]], tuple[int, int]]:
    """Longest simulated sequence of ``systems`` for one model: {system: (tokens, converged)}, and (traced,
    reused) trace counts.  One task of the max-seq-len table; runs in a worker process or inline."""
    from experiments.paper_scale import TraceCache, max_trainable_seq_len
    from experiments.paper_scale_baselines import max_trainable_seq_len_baseline

    cache = cache if cache is not None else TraceCache()
    before = (cache.misses, cache.hits)
    found: dict[str, tuple[int, bool]] = {}
    for system in systems:
        if system == "autosp":
            # AutoSP's peak memory is not smooth in the length (checkpointing decisions change with
            # it): bisection.  The baselines' is about linear: the secant search of Note [Memory-cap search].
            found[system] = (max_trainable_seq_len(model, granularity=granularity[system], cache=cache), True)
            continue
        # Ring attention's activations are Ulysses' plus small receive buffers: searched after Ulysses in
        # the same task, it starts at the Ulysses length, whose traces are cached (Note [Baselines as
        # AutoSP variants]).
        start = found["ulysses"][0] if system == "ring_attention" and found.get("ulysses", (0,))[0] else 8192
        found[system] = max_trainable_seq_len_baseline(system, model, granularity=granularity[system], start=start,
                                                       max_probes=max_probes, cache=cache)
    return found, (cache.misses - before[0], cache.hits - before[1])


def simulate_steps_task(model: str, seq_len: int, systems: tuple[str, ...], cache=None):
    """Simulated steps of ``systems`` for one model and length ({system: SimulatedStep}), and (traced, reused)
    trace counts.  One task of the iteration-time table."""
    from experiments.paper_scale import TraceCache, simulate_autosp_step
    from experiments.paper_scale_baselines import simulate_baseline_step

    cache = cache if cache is not None else TraceCache()
    before = (cache.misses, cache.hits)
    steps = {system: simulate_autosp_step(model, seq_len, cache=cache) if system == "autosp"
             else simulate_baseline_step(system, model, seq_len, cache=cache) for system in systems}
    return steps, (cache.misses - before[0], cache.hits - before[1])


TRACE_GROUPS = (("autosp",), ("ulysses", "ring_attention"), ("ulysses+ckpt",), ("zero3",))
"""Systems simulated by one task: ring attention rewrites the Ulysses traces, so they share a task (a cache)."""


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
    for _, (traced, reused) in results:
        args.trace_counts["traced"] += traced
        args.trace_counts["reused"] += reused
    return [result for result, _ in results]


def table_max_seq_len(args) -> list[dict]:
    rows = []
    published = [r for r in published_figures() if r["figure"] == "max_seq_len"]
    models = sorted({r["model"] for r in published})
    granularity = {s: args.zero3_granularity if s == "zero3" else args.granularity
                   for s in SYSTEMS + UNPUBLISHED_SYSTEMS}
    tasks = [(search_max_seq_len_task, (model, systems, granularity, args.search_probes))
             for model in models for systems in TRACE_GROUPS]
    simulated: dict[tuple[str, str], tuple[int, bool]] = {}
    for (_, (model, *_)), found in zip(tasks, _run_tasks(args, tasks, "max-seq-len (simulated searches)"),
                                       strict=True):
        simulated.update({(model, system): result for system, result in found.items()})
    published += [{"model": model, "system": system, "value": ""} for model in models for system in UNPUBLISHED_SYSTEMS]
    for row in published:
        sim, converged = simulated.get((row["model"], row["system"]), (None, True))
        ratio, note = _ratio_note(sim, row["value"])
        rows.append({
            "model": row["model"], "system": row["system"], "published_tokens": row["value"],
            "simulated_tokens": "" if sim is None else sim, "simulated_over_published": ratio,
            "note": "; ".join(filter(None, [
                note or ("not simulated yet" if sim is None else ""),
                "" if converged else "search stopped on its probe budget: a lower bound",
            ])),
        })
    return sorted(rows, key=lambda r: (r["model"], (SYSTEMS + UNPUBLISHED_SYSTEMS).index(r["system"])))


def table_iteration_time(args) -> list[dict]:
    rows = []
    published = [r for r in published_figures() if r["figure"] == "iteration_s"]
    lengths = sorted({int(r["seq_len"]) for r in published})
    published += [{"seq_len": str(length), "system": system, "value": ""} for length in lengths
                  for system in UNPUBLISHED_SYSTEMS]
    tasks = [(simulate_steps_task, (args.iteration_model, seq_len, systems))
             for seq_len in lengths for systems in TRACE_GROUPS]
    sims = {}
    for (_, (_, seq_len, _)), steps in zip(tasks, _run_tasks(args, tasks, f"iteration-time (simulated "
                                                                          f"{args.iteration_model})"), strict=True):
        sims.update({(system, seq_len): step for system, step in steps.items()})
    for row in published:
        seq_len = int(row["seq_len"])
        sim = sims.get((row["system"], seq_len))
        value = None if sim is None else (sim.step_time_s if sim.fits else None)
        ratio, note = _ratio_note(value, row["value"])
        if sim is not None and not sim.fits:
            note = "simulated OOM"
        rows.append({
            "seq_len": seq_len, "system": row["system"], "published_s": row["value"],
            "simulated_s": "" if value is None else f"{value:.3f}",
            "simulated_peak_gib": "" if sim is None else f"{sim.peak_memory_bytes / 2**30:.1f}",
            "simulated_over_published": ratio,
            "note": note or ("not simulated yet" if sim is None else ""),
        })
    return rows


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def table_measured_cpu(args) -> list[dict]:
    from experiments.measure import measure_on_rank, peak_memory_available
    from experiments.spawn import run_ranks

    with_memory = peak_memory_available()
    rows = []
    for ranks in tqdm(args.cpu_ranks, desc="measured-cpu (gloo ranks per run)", file=sys.stderr):
        spec = {"model": CPU_MODEL, "model_options": CPU_MODEL_OPTIONS, "seq_len": args.cpu_seq_len,
                "steps": args.cpu_steps, "compiler": "aot_eager"}
        # Each system in its own processes: a fresh compile state and its own graph-break/recompile counts.
        by_system = {name: [r["systems"][name] for r in run_ranks(measure_on_rank, ranks, {**spec, "systems": [name]})]
                     for name in MEASURED_SYSTEMS}
        ulysses = by_system["ulysses"]
        ulysses_s = max(r["median_step_s"] for r in ulysses) if "median_step_s" in ulysses[0] else None
        for name, results in by_system.items():
            row = {"system": name, "ranks": ranks, "seq_len": args.cpu_seq_len}
            if "unsupported" in results[0]:
                rows.append({**row, "first_step_s": "", "median_step_ms": "", "ratio_to_ulysses": "",
                             "loss_error": "", "grad_max_rel_error": "",
                             **({"peak_mib": "", "peak_mib_by_rank": ""} if with_memory else {}),
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
            if with_memory:
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
    from experiments.measure import max_seq_len_on_rank, peak_memory_available
    from experiments.spawn import run_ranks

    if not peak_memory_available():
        logging.getLogger(__name__).warning("memory-cap: experiments.peak_memory is missing; table skipped")
        return []
    rows = []
    for ranks in tqdm(args.cap_ranks, desc="memory-cap (search per gloo run)", file=sys.stderr):
        spec = {"model": CPU_MODEL, "model_options": CPU_MODEL_OPTIONS,
                "cap_bytes": int(args.memory_cap_mib * 2**20), "start": args.cap_start,
                "granularity": args.cap_granularity, "max_probes": args.cap_probes, "max_len": args.cap_max_len}
        results = {name: run_ranks(max_seq_len_on_rank, ranks, {**spec, "systems": [name]})[0]["systems"][name]
                   for name in MEASURED_SYSTEMS}  # each system in its own processes
        for name in MEASURED_SYSTEMS:
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


SIMULATED_TABLES = ("max-seq-len", "iteration-time")
TABLES: dict[str, Callable] = {
    "max-seq-len": table_max_seq_len, "iteration-time": table_iteration_time,
    "measured-cpu": table_measured_cpu, "memory-cap": table_memory_cap,
}


def write_table(name: str, rows: list[dict], out: pathlib.Path) -> None:
    if not rows:
        return
    columns = list(rows[0])
    with open(out / f"{name}.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    md = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    md += ["| " + " | ".join(str(r[c]) for c in columns) + " |" for r in rows]
    (out / f"{name}.md").write_text("\n".join(md) + "\n")


def plot_max_seq_len(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.13
    for i, system in enumerate(SYSTEMS):
        values = [next((float(r["published_tokens"]) for r in rows if r["model"] == m and r["system"] == system), 0)
                  for m in models]
        ax.bar([x + i * width for x in range(len(models))], values, width, label=f"{system} (published)")
    simulated_systems = [s for s in SYSTEMS if any(r["system"] == s and r["simulated_tokens"] != "" for r in rows)]
    for j, system in enumerate(simulated_systems):
        simulated = [next((float(r["simulated_tokens"] or 0) for r in rows if r["model"] == m and r["system"] == system),
                          0) for m in models]
        ax.bar([x + (len(SYSTEMS) + j) * width for x in range(len(models))], simulated, width,
               label=f"{system} (simulated)", hatch="//" if system == "autosp" else "..", color="white",
               edgecolor=f"C{SYSTEMS.index(system)}")
    ax.set_xticks([x + (len(SYSTEMS) + len(simulated_systems) - 1) * width / 2 for x in range(len(models))], models)
    ax.set_ylabel("max trainable sequence (tokens)")
    ax.set_title("8×A100-80GB: published vs simulated")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _bar_plot(rows: list[dict], value: str, ylabel: str, title: str, path: pathlib.Path) -> None:
    """Grouped bars of column ``value`` per system, one group per rank count (rows without a value skipped)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted({int(r["ranks"]) for r in rows})
    systems = list(dict.fromkeys(r["system"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / max(len(ranks), 1)
    for i, p in enumerate(ranks):
        values = [next((float(r[value]) for r in rows if r["system"] == s and int(r["ranks"]) == p and r[value] != ""),
                       0.0) for s in systems]
        ax.bar([x + i * width for x in range(len(systems))], values, width, label=f"{p} ranks")
    ax.set_xticks([x + width * (len(ranks) - 1) / 2 for x in range(len(systems))], systems, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


PLOTS = {
    "measured-cpu": lambda rows, path: _bar_plot(rows, "median_step_ms", "median step (ms)",
                                                 "CPU gloo: median training step", path),
    "memory-cap": lambda rows, path: _bar_plot(rows, "max_seq_len", "longest sequence (tokens)",
                                               f"CPU gloo: longest sequence under {rows[0]['cap_mib']} MiB per rank",
                                               path),
}


def write_simulated_step(args, out: pathlib.Path) -> None:
    """Perfetto trace, timeline and memory plots of one simulated AutoSP step (2 layers shown)."""
    from experiments.models import PAPER_MODELS
    from experiments.paper_scale import _simulate_layers
    from simulator import Cluster, simulate
    from simulator.plots import plot_memory, plot_timeline
    from simulator.trace import write_chrome_trace

    cluster = Cluster.from_preset("a100-80gb-sxm")
    _, _, workload = _simulate_layers(PAPER_MODELS[args.iteration_model], 8192, 2, 8, cluster, 8, cache=args.cache)
    result = simulate(workload, cluster)
    workload.to_json(out / "workload-llama-3.1-8b-2layers-8k.json")
    write_chrome_trace(result, out / "trace-llama-3.1-8b-2layers-8k.json")
    plot_timeline(result, out / "timeline-llama-3.1-8b-2layers-8k.png")
    plot_memory(result, out / "memory-llama-3.1-8b-2layers-8k.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.reproduce", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="coarse search (8K-token steps): a few minutes")
    parser.add_argument("--only", choices=sorted(TABLES), help="run one table")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"), help="results folder")
    parser.add_argument("--iteration-model", default="llama-3.1-8b",
                        help="paper model simulated for the (unlabelled) published iteration times")
    parser.add_argument("--memory-cap-mib", type=float, default=None,
                        help="per-rank cap of the memory-cap table (default 16; --quick: 8)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="worker processes for the simulated tables (default: up to 2; 1: no workers)")
    args = parser.parse_args(argv)
    args.granularity = 8192 if args.quick else 1024
    args.zero3_granularity = 2048 if args.quick else 1024  # zero3 fits ~10K tokens: 8K steps are too coarse
    args.search_probes = 6 if args.quick else 10
    from experiments.paper_scale import TraceCache

    args.cache = TraceCache()  # traces shared within this process (see experiments.paper_scale.TraceCache)
    args.trace_counts = {"traced": 0, "reused": 0}
    # CPU measurements: --quick is one 2-rank run of a short sequence, a few timed steps.
    args.cpu_ranks = (2,) if args.quick else (2, 4)
    args.cpu_seq_len = 256 if args.quick else 1024
    args.cpu_steps = 3 if args.quick else 8
    args.cap_ranks = (2,)
    args.memory_cap_mib = args.memory_cap_mib or (8.0 if args.quick else 16.0)
    args.cap_start, args.cap_granularity = 512, 256 if args.quick else 128
    args.cap_probes = 2 if args.quick else 5
    args.cap_max_len = 32768
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    run_info = {"command": "python -m experiments.reproduce" + (" --quick" if args.quick else ""),
                "preset": "quick" if args.quick else "default", "cpu_model": CPU_MODEL,
                "cpu_model_options": CPU_MODEL_OPTIONS, "cpu_ranks": list(args.cpu_ranks),
                "cpu_seq_len": args.cpu_seq_len, "cpu_steps": args.cpu_steps, "memory_cap_mib": args.memory_cap_mib,
                "max_seq_len_granularity": args.granularity, "jobs": args.jobs, "torch": _version("torch"),
                "deepspeed": _version("deepspeed"), "transformers": _version("transformers"), "table_s": {}}
    with contextlib.ExitStack() as stack:
        args.pool = None
        if args.jobs > 1 and (not args.only or args.only in SIMULATED_TABLES):
            # Each simulated probe is a single-threaded trace: spread the tasks over worker processes.
            args.pool = stack.enter_context(ProcessPoolExecutor(max_workers=args.jobs,
                                                                mp_context=multiprocessing.get_context("spawn")))
        for name, build in TABLES.items():
            if args.only and name != args.only:
                continue
            if name not in SIMULATED_TABLES and args.pool is not None:
                args.pool.shutdown()  # idle workers must not share the CPU with measured gloo ranks
                args.pool = None
            table_start = time.perf_counter()
            rows = build(args)
            run_info["table_s"][name] = round(time.perf_counter() - table_start, 1)
            if not rows:
                continue
            write_table(name, rows, args.out)
            if name == "max-seq-len":
                plot_max_seq_len(rows, args.out / "max-seq-len.png")
            elif name in PLOTS:
                PLOTS[name](rows, args.out / f"{name}.png")
            table = (args.out / f"{name}.md").read_text()
            print(f"\n## {name} ({time.perf_counter() - table_start:.0f} s)\n\n{table}")
    if not args.only:
        misses, hits = args.cache.misses, args.cache.hits
        write_simulated_step(args, args.out)
        run_info["traces"] = {"traced": args.trace_counts["traced"] + args.cache.misses - misses,
                              "reused": args.trace_counts["reused"] + args.cache.hits - hits}
        run_info["total_s"] = round(time.perf_counter() - start, 1)
        (args.out / "run.json").write_text(json.dumps(run_info, indent=2) + "\n")
    print(f"results in {args.out}/ ({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
