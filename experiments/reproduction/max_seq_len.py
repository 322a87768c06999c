"""The ``max-seq-len`` table: the longest trainable sequence of each paper model on 8 A100-80GB GPUs, simulated for
every system beside the published figures.

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

import pathlib
import statistics
from collections.abc import Callable

from experiments.reproduction.common import (
    DISAGREEMENT,
    PAPER_CLUSTER,
    SIMULATED,
    TRACE_GROUPS,
    UNPUBLISHED,
    error_pct,
    length_of,
    published_figures,
    published_systems,
    throughput_lengths,
    tokens,
)
from experiments.reproduction.run import RunConfig, Runner, trace_counts
from experiments.reproduction.table import Table
from simulator.strategies import STRATEGIES


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
    before = trace_counts(cache)
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
    return (found, steps), trace_counts(cache, before)


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


def build(run: RunConfig, runner: Runner) -> list[dict]:
    from experiments.models import PAPER_MODELS
    from experiments.paper_scale.config import ALTERNATIVE_CONFIG, static_memory_bytes
    from simulator import Cluster

    rows = []
    published = [r for r in published_figures() if r["figure"] == "max_seq_len"]
    published = [r for r in published if not run.models or r["model"] in run.models]
    models = sorted({r["model"] for r in published})
    granularity = run.granularities(SIMULATED)
    # Longest tasks first (deeper models trace longer), so that the last task to finish on a worker is a short
    # one.
    by_depth = sorted(models, key=lambda m: -PAPER_MODELS[m].num_layers)
    # Note [Throughput steps from the search's traces]
    step_lengths = throughput_lengths() if "throughput" in run.tables else ()
    tasks = [(search_max_seq_len_task, (model, systems, granularity, run.search_probes, run.max_seq_len_ceiling,
                                        run.layers,
                                        step_lengths if model == run.iteration_model else ()))
             for systems in TRACE_GROUPS for model in by_depth]
    simulated: dict = {}
    for (_, (model, *_)), (found, steps) in zip(tasks, runner.run_tasks(tasks, "max-seq-len (simulated searches)"),
                                                strict=True):
        simulated.update({(model, system): result for system, result in found.items()})
        runner.simulated_steps.update(steps)
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
        error = error_pct(nominal.max_seq_len or 0, row["value"])
        headroom = multiple = None
        if error is not None and nominal.result is not None:
            capacity = nominal.result.capacity_bytes
            headroom = headroom_at(nominal, float(row["value"]), capacity)
            multiple = activation_multiple_at(nominal, float(row["value"]), capacity,
                                              static_memory_bytes(PAPER_MODELS[row["model"]], row["system"]))
        # nothing fits under the alternative: counted as no tokens (-100 %), so the summary does not drop it
        alt_error = error_pct(None if alternative is None else alternative.max_seq_len or 0, row["value"])
        lower_bound = [f"{name} {r.stopped.replace('_', ' ')}: a lower bound" for name, r in
                       (("nominal", nominal), ("band", found.low_memory)) if r.is_lower_bound]
        if alternative is not None and alternative.stopped == "none_fit" and (
                static_memory_bytes(PAPER_MODELS[row["model"]], row["system"], config=ALTERNATIVE_CONFIG)
                >= int(Cluster.from_preset(PAPER_CLUSTER).device.memory_bytes)):
            lower_bound.append("alternative: its static memory alone exceeds the capacity")
        rows.append({
            "model": row["model"], "system": row["system"], "published_tokens": row["value"],
            "simulated_tokens": tokens(nominal), "simulated_nominal": length_of(nominal),
            "band_tokens": f"{tokens(found.high_memory)} – {tokens(found.low_memory)}",
            "error_pct": "" if error is None else f"{error:+.0f}", "stopped": nominal.stopped,
            "alternative_tokens": "" if alternative is None else tokens(alternative),
            "alternative_error_pct": "" if alt_error is None else f"{alt_error:+.0f}",
            "headroom_at_published_gib": "" if headroom is None else f"{headroom / 2**30:.1f}",
            "implied_activation_multiple": "" if multiple is None else f"{multiple:.2f}",
            "note": "; ".join(filter(None, [
                f"differs by more than {DISAGREEMENT:.0%}" if error is not None and abs(error) > DISAGREEMENT * 100
                else "", *lower_bound,
                "memory extrapolated from 1 and 2 layers (--quick): too low under checkpointing"
                if run.layers == "extrapolated" and _checkpoints(row["system"]) else ""])),
        })
    order = published_systems() + UNPUBLISHED
    return sorted(rows, key=lambda r: (r["model"], order.index(r["system"])))


def _checkpoints(system: str) -> bool:
    """Whether ``system`` recomputes activations (its trace option ``checkpointing``; none: the pass's SAC)."""
    return STRATEGIES[system].compile_options.get("checkpointing") != "none"


def plot(rows: list[dict], path: pathlib.Path) -> None:
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


def footer(rows: list[dict], summary: dict) -> list[str]:
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
    lines = ["", "Shape of the gap across models (Note [Fixed or per-token gap] in "
             "experiments/reproduction/max_seq_len.py; "
             "coefficient of variation across the models, smaller = the reading describes the gap better):"]
    for system, s in shape.items():
        lines.append(f"- {system}: as fixed memory {', '.join(f'{v:.1f}' for v in s['fixed_gib'])} GiB per rank "
                     f"(CV {s['fixed_cv']}); per token, hidden unit and layer "
                     f"{', '.join(f'{v:.1f}' for v in s['per_token_hidden_layer_bytes'])} bytes (CV "
                     f"{s['per_token_cv']}); implied activation multiple "
                     f"{', '.join(f'{v:.2f}' for v in s['implied_activation_multiple'])} ({', '.join(s['models'])})")
    return lines


TABLE = Table(
    name="max-seq-len",
    help="longest trainable sequence of each paper model on 8 A100-80GB GPUs, simulated (whole\n"
         "step, memory ledger of the stated configuration, low-high band) for all systems beside\n"
         "the published figures, with the signed error, the search's stop reason, the length\n"
         "under an alternative configuration (BF16_Optimizer) and a summary (median error,\n"
         "ordering of systems)",
    build=build, simulated=True, record="max_seq_len_summary", summary=max_seq_len_summary, footer=footer,
    plot=plot)
