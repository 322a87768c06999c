"""The ``strategies`` table: every sequence-parallel strategy the pass compiles, simulated at paper scale, and what
``strategy="auto"`` chose (``python -m experiments.reproduce --only strategies``).

For each row group (a model, a length and a GPU count, the whole world one SP group) the decision is
`autosp.plan.strategy_choice.choose_strategy` itself, the code ``autosp.compile(strategy="auto")`` runs in its planner
process: every candidate of the registry (`simulator.strategies.sp_candidates`: Ulysses where the heads divide,
every hybrid ``autosp-hybrid-UxR``, the ring) traced with its own ``autosp.compile`` options, exported from what
its pass emits, simulated on the cluster, and the fastest that fits chosen.  This module only lays the decision out
(`group_rows`) and checks it against the sweep (Note [What the strategy table checks]); it chooses nothing.

Note [The strategy table's settings]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
* Llama-3.1-8B (32 query heads, 8 key/value heads) at 131,072, 524,288 and 1,048,576 tokens on 8, 16, 32 and 64
  GPUs: one node (the GPU preset) or 2, 4, 8 nodes (`simulator.cluster_presets`).  SP degree = every GPU, DP 1,
  micro-batch 1, bf16, AdamW, ZeRO 1 (the registry's stage for the pass's strategies; experiments/paper_scale/
  config.py says why), Inductor.
* H100 SXM nodes (`NODE`).  The max-seq-len and throughput tables run on A100-80GB because the published figures
  they sit beside were measured there; this table has no published figure, and the runs it stands for --
  Llama-3.1-8B at up to a million tokens over several nodes -- are the torchtitan H100 context-parallel runs the
  external-fidelity table compares against.  The A100 cluster presets are also PCIe-bound between GPU and NIC
  (32 GB/s per direction under a 400 Gb/s NIC, the preset's note), which would price every cross-node transfer
  below the fabric's rate.
* The memory options of the long rows (`OPTIONS`): AutoSP's default selective activation checkpointing, the tiled
  loss and the tiled MLP (``"auto"``: on where a rank's rows span more than one chunk, which is every row here)
  with ``return_logits=False``, so that the [tokens, vocab] logits and the [tokens, intermediate] MLP values never
  exist whole.  Each candidate is traced with them; nothing else is tuned per row.  A row group where nothing fits
  says so (``auto_choice`` "none"): that is the answer, not a failure.
* Depth extrapolated from traces of 1 and 2 layers (Note [Depth extrapolation] in simulator/max_length.py), SAC
  deciding as for the full model (Note [Shallow traces checkpointed for the full depth] in autosp/plan/depth.py):
  the table is labelled so.  Measured against full-depth decisions for Llama-3.1-8B on 8 ranks at 131,072 tokens
  without the tiled ops (experiments/bench_planner.py --compare): the same choice, step times within 0.1 %, peaks
  1.6-1.7 % high.
* One `autosp.plan.traces.TraceReuse` per row group: its traces are keyed by length, depth and options, not by SP
  degree, so it is never shared between GPU counts.

Note [What the strategy table checks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The exhaustive sweep of a row group is the registry's candidates for its GPU count and the model's heads, read
from `simulator.strategies.sp_candidates` here, each with the step time and peak its own trace gave.  Per group:
``sweep_best`` is the fastest candidate that fits, ``auto_within_5pct`` whether the auto choice's step time is
within 5 % of it (and the choice fits; empty where nothing fits and auto chose nothing), and a candidate of the sweep that the decision did not consider is named
in ``note``.  The sweep's numbers are the decision's own predictions (tracing every candidate twice would double
the table's time), so the 5 % check confirms the choice rule and the coverage of the candidates, not the cost
model.  ``auto_vs_ulysses`` is Ulysses' step time over the auto choice's (> 1: auto is faster), where Ulysses runs
(its heads divide) and both fit.
"""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Callable, Mapping, Sequence

log = logging.getLogger(__name__)

MODEL = "llama-3.1-8b"
"""A preset of `autosp.train` (Llama-3.1-8B's shape)."""
LENGTHS = (131072, 524288, 1048576)
GPUS = (8, 16, 32, 64)
NODE = "h100-sxm"
"""The GPU preset of every node (Note [The strategy table's settings])."""
OPTIONS = {"tiled_loss": "auto", "tiled_mlp": "auto", "return_logits": False}
"""``autosp.compile`` options every candidate is traced with beside its strategy (checkpointing: the pass's
default, SAC)."""
DEPTH = "extrapolated"
WITHIN = 0.05
"""The auto choice counts as the best when its step time is at most this much above the sweep's fastest."""
DEPTH_LABEL = ("depth extrapolated from 1 and 2 layers, SAC deciding as for the full model (Note [Shallow traces "
               "checkpointed for the full depth] in autosp/plan/depth.py)")


def cluster_for(gpus: int, node: str = NODE) -> str:
    """The cluster of ``gpus`` GPUs of preset ``node``: the node preset itself for one node, else the cluster
    preset of as many nodes (`simulator.cluster_presets.CLUSTER_PRESETS`)."""
    from simulator.cluster_presets import CLUSTER_PRESETS
    from simulator.hardware import get_preset

    if gpus == get_preset(node).devices_per_node:
        return node
    found = [p.name for p in CLUSTER_PRESETS.values() if p.node == node
             and p.nodes * get_preset(node).devices_per_node == gpus]
    if not found:
        raise ValueError(f"no cluster of {gpus} {node} GPUs: one node ({get_preset(node).devices_per_node}) or a "
                         f"cluster preset of {node} ({', '.join(p for p in CLUSTER_PRESETS if p.startswith(node))})")
    return found[0]


def decide(model: str, seq_len: int, gpus: int, cluster: str, *, options: Mapping = OPTIONS,
           depth: str = DEPTH, capacity_bytes: int | None = None, reuse=None):
    """``strategy="auto"``'s decision (`autosp.plan.strategy_choice.StrategyDecision`) for ``model`` at ``seq_len`` tokens
    over ``gpus`` SP ranks of ``cluster``, every candidate traced with ``options``; ``reuse``: a TraceReuse of
    earlier decisions of the same length and GPU count (default: a fresh one)."""
    from autosp.plan.cluster_file import load_cluster
    from autosp.plan.setup import TrainingSetup
    from autosp.plan.strategy_choice import choose_strategy
    from autosp.plan.traces import TraceReuse
    from simulator.strategies import STRATEGIES

    setup = TrainingSetup(seq_len=seq_len, sp_size=gpus, zero_stage=STRATEGIES["autosp-auto"].zero_stage,
                          depth=depth)
    return choose_strategy(model, setup, load_cluster(cluster, world_size=gpus), options=dict(options),
                           capacity_bytes=capacity_bytes, reuse=TraceReuse([]) if reuse is None else reuse)


def sweep_names(model: str, gpus: int) -> tuple[str, ...]:
    """The registry's candidates for ``gpus`` SP ranks and ``model``'s heads, Ulysses first even where it cannot
    run (its row says why)."""
    from autosp.plan.model_source import ModelSource
    from simulator.strategies import sp_candidates

    hf = ModelSource(model).config(seq_len=gpus)
    heads = int(hf.num_attention_heads)
    names = [s.name for s in sp_candidates(gpus, heads=heads,
                                           kv_heads=int(getattr(hf, "num_key_value_heads", None) or heads))]
    return tuple(dict.fromkeys(["autosp", *names]))


def group_rows(model: str, seq_len: int, gpus: int, cluster: str, decision: Mapping,
               sweep: Sequence[str]) -> list[dict]:
    """The rows of one group: one per candidate of ``decision`` (`StrategyDecision.to_dict`) and of ``sweep``
    (`sweep_names`), in the sweep's order, with the group's columns (Note [What the strategy table checks])."""
    from simulator.strategies import STRATEGIES

    found = {c["system"]: c for c in decision["candidates"]}
    chosen = decision["chosen"]
    fitting = [found[name] for name in sweep if name in found and found[name]["fits"]]
    best = min(fitting, key=lambda c: c["step_time_s"]) if fitting else None
    auto = found.get(chosen)
    within = (auto is not None and auto["fits"] and best is not None
              and auto["step_time_s"] <= (1 + WITHIN) * best["step_time_s"])
    ulysses = found.get("autosp")
    speedup = (ulysses["step_time_s"] / auto["step_time_s"] if auto is not None and ulysses is not None
               and ulysses["fits"] and auto["fits"] else None)
    rows = []
    for name in [*sweep, *(n for n in found if n not in sweep)]:
        strategy = STRATEGIES[name]
        u, r = strategy.degrees(gpus)
        c = found.get(name)
        note = ("not considered by strategy='auto'" if c is None else
                "not in the registry's sweep" if name not in sweep else
                f"refused: {c['refused']}" if c["refused"] else "")
        timed = c is not None and c["step_time_s"] is not None
        rows.append({
            "model": model, "seq_len": seq_len, "gpus": gpus, "cluster": cluster, "strategy": name,
            "ulysses_size": u, "ring_size": r,
            "step_time_s": f"{c['step_time_s']:.5g}" if timed else "",
            "peak_gib": f"{c['peak_bytes'] / 2**30:.2f}" if timed else "",
            "fits": str(c is not None and c["fits"]).lower(), "chosen": str(name == chosen).lower(),
            "auto_choice": chosen or "none", "sweep_best": best["system"] if best else "none",
            "auto_within_5pct": "" if best is None and chosen is None else str(within).lower(),
            "auto_vs_ulysses": "" if speedup is None else f"{speedup:.3f}",
            "note": note,
        })
    return rows


def strategy_rows_task(model: str, seq_len: int, gpus: int, cluster: str, options: Mapping = OPTIONS,
                       depth: str = DEPTH, capacity_bytes: int | None = None, cache=None) -> tuple[list[dict], dict]:
    """One row group (`decide`, `group_rows`) and its trace counts; a task of the reproduce tables' runner
    (``cache``, a paper-scale TraceCache, is not used: the decision traces through its own TraceReuse)."""
    decision = decide(model, seq_len, gpus, cluster, options=options, depth=depth, capacity_bytes=capacity_bytes)
    log.info("%s at %d tokens on %s: %s (%.0f s)", model, seq_len, cluster, decision.chosen, decision.seconds)
    traces = sum(2 if depth == "extrapolated" else 1 for c in decision.candidates if c.prediction is not None)
    rows = group_rows(model, seq_len, gpus, cluster, decision.to_dict(), sweep_names(model, gpus))
    return rows, {"traced": traces, "reused": 0, "interpolated": 0}


def strategy_tasks(model: str = MODEL, lengths: Sequence[int] = LENGTHS, gpus: Sequence[int] = GPUS,
                   node: str = NODE, options: Mapping = OPTIONS, depth: str = DEPTH,
                   capacity_bytes: int | None = None) -> list[tuple[Callable, tuple]]:
    """The table's tasks, one per row group, the most ranks first (their candidates take longest: on two workers
    the last to finish is a short one)."""
    order = sorted(((g, n) for n in lengths for g in gpus), key=lambda gn: (-gn[0], gn[1]))
    return [(strategy_rows_task, (model, n, g, cluster_for(g, node), dict(options), depth, capacity_bytes))
            for g, n in order]


def sort_rows(rows: list[dict]) -> list[dict]:
    """Rows by length, then GPU count, each group in its sweep's order."""
    return sorted(rows, key=lambda r: (r["seq_len"], r["gpus"]))  # sorted is stable: the sweep's order stays


def summary(rows: list[dict], devices_per_node: int = 8) -> dict:
    """Per row group: the auto choice, the sweep's best, within 5 %, the speedup over Ulysses (multi-node groups:
    more than ``devices_per_node`` GPUs)."""
    groups = {}
    for r in sort_rows(rows):
        groups.setdefault((r["seq_len"], r["gpus"]), r)
    multi = {k: r for k, r in groups.items() if k[1] > devices_per_node}
    ulysses_rows = {(r["seq_len"], r["gpus"]): r for r in rows if r["strategy"] == "autosp"}
    speedups = {}
    for (n, g), r in multi.items():
        u = ulysses_rows.get((n, g))
        if r["auto_vs_ulysses"]:
            speedups[f"{n}/{g}"] = float(r["auto_vs_ulysses"])
        else:
            why = ("nothing fits" if r["auto_choice"] == "none" else u["note"] if u and u["note"] else
                   "Ulysses does not fit")
            speedups[f"{n}/{g}"] = why
    decided = [r for r in groups.values() if r["auto_choice"] != "none"]
    return {"groups": len(groups), "decided": len(decided),
            "none_fit": [f"{n}/{g}" for (n, g), r in groups.items() if r["auto_choice"] == "none"],
            "auto_within_5pct": sum(r["auto_within_5pct"] == "true" for r in decided),
            "multi_node_vs_ulysses": speedups,
            "multi_node_strictly_faster": [k for k, v in speedups.items() if isinstance(v, float) and v > 1],
            "options": dict(OPTIONS), "node": NODE, "depth": DEPTH_LABEL}


def footer(s: Mapping) -> list[str]:
    """The table's footer lines from `summary`."""
    def group(key: str) -> str:
        n, g = key.split("/")
        return f"{int(n):,} tokens on {g} GPUs"

    compared = [f"{group(k)}: {v:.3f}x" if isinstance(v, float) else f"{group(k)}: n/a ({v})"
                for k, v in s["multi_node_vs_ulysses"].items()]
    faster = ", ".join(group(k) for k in s["multi_node_strictly_faster"]) or "none"
    return [
        f"Simulated, {s['depth']}: Llama-3.1-8B, SP over every GPU, ZeRO 1, bf16, AdamW, micro-batch 1, "
        f"{s['node']} nodes; every candidate traced with SAC and {', '.join(f'{k}={v}' for k, v in s['options'].items())} "
        "(Note [The strategy table's settings] in experiments/paper_scale/strategy_table.py). The decision is "
        "autosp.plan.strategy_choice.choose_strategy, what autosp.compile(strategy='auto') runs; chosen marks its pick.",
        "",
        f"auto within 5 % of the sweep's best on {s['auto_within_5pct']} of {s['decided']} groups where something "
        f"fits (Note [What the strategy table checks]: the sweep reuses the decision's predictions); nothing fits "
        f"in {', '.join(group(k) for k in s['none_fit']) or 'no group'}.",
        f"auto vs Ulysses-only on the multi-node groups (Ulysses step / auto step): {'; '.join(compared) or 'none'}. "
        f"Strictly faster than Ulysses-only: {faster}.",
    ]


def plot_strategies(rows: list[dict], path: pathlib.Path) -> None:
    """Step time of every candidate per row group, one panel per length (log scale; hatched: does not fit; a
    black edge: the auto choice)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({int(r["seq_len"]) for r in rows})
    fig, axes = plt.subplots(len(lengths), 1, figsize=(11, 3.2 * len(lengths)), squeeze=False)
    for ax, n in zip(axes[:, 0], lengths, strict=True):
        mine = [r for r in rows if int(r["seq_len"]) == n]
        x, ticks, labels = 0.0, [], []
        for g in sorted({int(r["gpus"]) for r in mine}):
            group = [r for r in mine if int(r["gpus"]) == g]
            for r in group:
                if r["step_time_s"]:
                    u, ring = int(r["ulysses_size"]), int(r["ring_size"])
                    color = "C0" if ring == 1 else "C3" if u == 1 else "C2"
                    ax.bar(x, float(r["step_time_s"]), 0.8, color=color if r["fits"] == "true" else "white",
                           edgecolor="black" if r["chosen"] == "true" else color,
                           linewidth=2 if r["chosen"] == "true" else 1,
                           hatch="" if r["fits"] == "true" else "//")
                elif r["note"].startswith("refused"):
                    ax.text(x, 0.02, "refused", rotation=90, fontsize=6, ha="center", va="bottom",
                            transform=ax.get_xaxis_transform())
                ticks.append(x)
                labels.append(f"{r['ulysses_size']}x{r['ring_size']}\n{g}")
                x += 1
            x += 0.8
        ax.set_xticks(ticks, labels, fontsize=6)
        ax.set_yscale("log")
        ax.set_ylabel("step (s)")
        ax.set_title(f"{n:,} tokens (Ulysses x ring degree / GPUs; blue Ulysses, green hybrid, red ring; hatched: "
                     "does not fit; black edge: the auto choice)", fontsize=8)
    fig.suptitle("Simulated step time per strategy, Llama-3.1-8B, depth extrapolated", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
