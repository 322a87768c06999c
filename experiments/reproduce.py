"""``python -m experiments.reproduce``: the paper's AutoSP experiments, measured on CPU and simulated at scale.

Tables (``--only NAME`` runs one):

- ``max-seq-len``: longest trainable sequence of each paper model on 8×A100-80GB,
  simulated for AutoSP from the real pass's exported schedule, beside the
  published figures of all four systems, with the simulated/published ratio;
- ``iteration-time``: simulated AutoSP step time at 8K, 24K and 90K tokens beside
  the published iteration times;
- ``measured-cpu``: the systems side by side on real gloo ranks (step-time ratio
  to hand-written Ulysses, loss and gradient error against single-device training).

Outputs go to ``--out`` (default ``results/``): CSV and Markdown per table, PNG
plots, a Perfetto trace (open in ui.perfetto.dev) and memory plot of one
simulated step.  A table's simulated value more than 20 % away from its published
counterpart is flagged in the ``note`` column.
"""

from __future__ import annotations

import argparse
import csv
import logging
import pathlib
import sys
import time
from collections.abc import Callable

from tqdm import tqdm

REFERENCE_CSV = pathlib.Path(__file__).resolve().parent / "data" / "autosp-paper-figures.csv"
DISAGREEMENT = 0.20
SYSTEMS = ("zero3", "ring_attention", "ulysses", "autosp")


def published_figures() -> list[dict[str, str]]:
    lines = [ln for ln in REFERENCE_CSV.read_text().splitlines() if ln and not ln.startswith("#")]
    return list(csv.DictReader(lines))


def _ratio_note(simulated: float | None, published: str) -> tuple[str, str]:
    if simulated is None or not published.replace(".", "").isdigit():
        return "", "" if published != "OOM" else ("simulated fits" if simulated else "")
    ratio = simulated / float(published)
    note = f"differs by more than {DISAGREEMENT:.0%}" if abs(ratio - 1) > DISAGREEMENT else ""
    return f"{ratio:.2f}", note


def table_max_seq_len(args) -> list[dict]:
    from experiments.paper_scale import max_trainable_seq_len

    rows = []
    published = [r for r in published_figures() if r["figure"] == "max_seq_len"]
    models = sorted({r["model"] for r in published})
    for model in tqdm(models, desc="max-seq-len (simulated search per model)", file=sys.stderr):
        simulated = max_trainable_seq_len(model, granularity=args.granularity)
        for row in (r for r in published if r["model"] == model):
            sim = simulated if row["system"] == "autosp" else None
            ratio, note = _ratio_note(sim, row["value"])
            rows.append({
                "model": model, "system": row["system"], "published_tokens": row["value"],
                "simulated_tokens": "" if sim is None else sim, "simulated_over_published": ratio,
                "note": note or ("not simulated yet" if sim is None else ""),
            })
    return rows


def table_iteration_time(args) -> list[dict]:
    from experiments.paper_scale import simulate_autosp_step

    rows = []
    published = [r for r in published_figures() if r["figure"] == "iteration_s"]
    lengths = sorted({int(r["seq_len"]) for r in published})
    sims = {}
    for seq_len in tqdm(lengths, desc="iteration-time (simulated llama-3.1-8b)", file=sys.stderr):
        sims[seq_len] = simulate_autosp_step(args.iteration_model, seq_len)
    for row in published:
        seq_len = int(row["seq_len"])
        sim = sims[seq_len] if row["system"] == "autosp" else None
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


TABLES: dict[str, Callable] = {"max-seq-len": table_max_seq_len, "iteration-time": table_iteration_time}


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
    width = 0.16
    for i, system in enumerate(SYSTEMS):
        values = [next((float(r["published_tokens"]) for r in rows if r["model"] == m and r["system"] == system), 0)
                  for m in models]
        ax.bar([x + i * width for x in range(len(models))], values, width, label=f"{system} (published)")
    simulated = [next((float(r["simulated_tokens"] or 0) for r in rows if r["model"] == m and r["system"] == "autosp"),
                      0) for m in models]
    ax.bar([x + len(SYSTEMS) * width for x in range(len(models))], simulated, width, label="autosp (simulated)",
           hatch="//", color="white", edgecolor="black")
    ax.set_xticks([x + 2 * width for x in range(len(models))], models)
    ax.set_ylabel("max trainable sequence (tokens)")
    ax.set_title("8×A100-80GB: published vs simulated")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_simulated_step(args, out: pathlib.Path) -> None:
    """Perfetto trace, timeline and memory plots of one simulated AutoSP step (2 layers shown)."""
    from experiments.models import PAPER_MODELS
    from experiments.paper_scale import _simulate_layers
    from simulator import Cluster, simulate
    from simulator.plots import plot_memory, plot_timeline
    from simulator.trace import write_chrome_trace

    cluster = Cluster.from_preset("a100-80gb-sxm")
    _, _, workload = _simulate_layers(PAPER_MODELS[args.iteration_model], 8192, 2, 8, cluster, 8)
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
    args = parser.parse_args(argv)
    args.granularity = 8192 if args.quick else 1024
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for name, build in TABLES.items():
        if args.only and name != args.only:
            continue
        rows = build(args)
        write_table(name, rows, args.out)
        if name == "max-seq-len":
            plot_max_seq_len(rows, args.out / "max-seq-len.png")
        print(f"\n## {name}\n\n" + (args.out / f"{name}.md").read_text())
    if not args.only:
        write_simulated_step(args, args.out)
    print(f"results in {args.out}/ ({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
