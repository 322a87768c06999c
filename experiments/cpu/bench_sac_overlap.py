"""``python -m experiments.bench_sac_overlap``: checkpointing settings and overlap, side by side on real gloo ranks.

For each sequence length, every variant is built from the same weights on 2
gloo ranks: AutoSP with each activation-checkpointing setting ("sac", "none",
"default" = PyTorch's min-cut partitioner, "full"), with the all-to-alls
overlapped and blocking, and hand-written Ulysses (DeepSpeed's
DistributedAttention, no checkpointing).  Each is measured in one run:

- per-rank peak tensor memory of one step (experiments.cpu.peak_memory, parameters
  included, gradients as backward creates them);
- median step time over timed steps interleaved across variants (the order
  rotates every round, so machine noise hits every variant alike), of the
  slowest rank, as a ratio to Ulysses' (slowest rank too) at the same length.

Flash attention keeps every activation O(S), so per-rank peak memory is affine in
S: the script fits ``peak = static + per_token · S`` per variant over the
measured lengths (the fit's worst residual is printed) and reports the longest
sequence that fits a per-rank memory cap (``--cap-mib``), next to Ulysses'.

``--paper-scale MODEL`` adds the same comparison at paper scale, simulated: the
real passes trace the model on fake tensors and a fake group of 8 (one and two
layers, extrapolated; experiments.paper_scale.simulate), and the exported schedule's
memory timeline on 8×A100-80GB gives the peak per rank and the longest
trainable sequence for each checkpointing setting.
"""

from __future__ import annotations

import argparse
import copy
import logging
import pathlib
import statistics
import sys
import time

from experiments.tables import markdown_table, write_table

log = logging.getLogger(__name__)

VARIANTS: dict[str, tuple[str, dict]] = {
    "autosp sac": ("autosp", {"checkpointing": "sac"}),
    "autosp sac blocking": ("autosp", {"checkpointing": "sac", "overlap_communication": False}),
    "autosp none": ("autosp", {"checkpointing": "none"}),
    "autosp none blocking": ("autosp", {"checkpointing": "none", "overlap_communication": False}),
    "autosp default": ("autosp", {"checkpointing": "default"}),
    "autosp full": ("autosp", {"checkpointing": "full"}),
    "ulysses": ("ulysses", {}),
}
"""Label -> (experiments.baselines system, autosp.compile options)."""
BASELINE = "ulysses"


def _bench_on_rank(rank: int, world: int, spec: dict) -> dict:
    import torch
    import torch.distributed as dist

    from experiments.baselines import build_system
    from experiments.cpu.measure import time_interleaved
    from experiments.cpu.peak_memory import PeakMemory
    from experiments.models import build_model, vocab_size

    torch.manual_seed(0)
    base = build_model(spec["model"], layers=spec["layers"], hidden=spec["hidden"])
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab_size(base), (1, spec["seq_len"]), generator=generator)
    labels = ids.clone()
    systems, models, results = {}, {}, {}
    for label in spec["variants"]:
        name, options = VARIANTS[label]
        model = copy.deepcopy(base)
        dist.barrier()
        start = time.perf_counter()
        system = build_system(name, model, sp_size=world, compiler=spec["compiler"], **options)
        loss = system.step(ids, labels)
        systems[label], models[label] = system, model
        results[label] = {"loss": float(loss), "compile_s": time.perf_counter() - start, "step_s": []}
    # A warm-up round once all are built: building one variant may change state another's compiled
    # code guards on, so its first step afterwards could recompile.
    for system in systems.values():
        system.zero_grad()
        system.step(ids, labels)
    for label, system in systems.items():
        system.zero_grad()
        with PeakMemory(static=list(models[label].parameters()), keep_breakdown=False) as memory:
            system.step(ids, labels)
        results[label]["peak_bytes"] = memory.peak_bytes
        if rank == 0:
            log.info("S=%d %s: compiled in %.1f s, peak %.1f MiB", spec["seq_len"], label,
                     results[label]["compile_s"], memory.peak_bytes / 2**20)
    for label, step_s in time_interleaved(systems, ids, labels, steps=spec["steps"]).items():
        results[label]["step_s"] = step_s
    for r in results.values():
        r["median_step_s"] = statistics.median(r["step_s"])
    return results


def _fit_affine(points: list[tuple[int, int]]) -> tuple[float, float, float]:
    """Least squares ``bytes = static + per_token · S``; returns (static, per_token, worst relative residual)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    if len(points) == 1:
        return 0.0, ys[0] / xs[0], 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    static = my - slope * mx
    worst = max(abs(static + slope * x - y) / y for x, y in points)
    return static, slope, worst


def step_rows(per_rank: list[dict], seq_len: int) -> list[dict]:
    """One row per variant from every rank's results: the slowest rank's median step (as
    experiments.cpu.measure reports it, not rank 0's), its ratio to Ulysses' slowest rank, the largest peak."""
    base_step = max(r[BASELINE]["median_step_s"] for r in per_rank)
    rows = []
    for label in VARIANTS:
        step_s = max(r[label]["median_step_s"] for r in per_rank)
        rows.append({
            "variant": label, "seq_len": seq_len, "ranks": len(per_rank),
            "step_ms": round(1e3 * step_s, 2), "step_vs_ulysses": round(step_s / base_step, 3),
            "peak_mib": round(max(r[label]["peak_bytes"] for r in per_rank) / 2**20, 2),
            "compile_s": round(max(r[label]["compile_s"] for r in per_rank), 2),
        })
    return rows


def run(args) -> tuple[list[dict], list[dict]]:
    from tqdm import tqdm

    from experiments.launch import run_on_ranks

    rows = []
    for seq_len in tqdm(args.seq_lens, desc="sequence lengths", file=sys.stderr):
        spec = {"model": args.model, "layers": args.layers, "hidden": args.hidden, "seq_len": seq_len,
                "variants": list(VARIANTS), "steps": args.steps, "compiler": "aot_eager"}
        per_rank = run_on_ranks(_bench_on_rank, args.ranks, spec, timeout_s=3600, collective_timeout_s=600)
        rows += step_rows(per_rank, seq_len)
    cap_bytes = args.cap_mib * 2**20
    caps = []
    for label in VARIANTS:
        points = [(r["seq_len"], r["peak_mib"] * 2**20) for r in rows if r["variant"] == label]
        static, per_token, residual = _fit_affine(points)
        caps.append({"variant": label, "static_mib": round(static / 2**20, 2),
                     "kib_per_token": round(per_token / 2**10, 3), "fit_worst_residual": round(residual, 4),
                     "max_seq_len_at_cap": int((cap_bytes - static) / per_token) if per_token > 0 else 0})
    base_len = next(c["max_seq_len_at_cap"] for c in caps if c["variant"] == BASELINE)
    for c in caps:
        c["vs_ulysses"] = round(c["max_seq_len_at_cap"] / base_len, 2) if base_len else float("nan")
    return rows, caps


PAPER_SCALE_SETTINGS = ("sac", "none", "default", "full")


def run_paper_scale(model: str, seq_len: int, granularity: int) -> list[dict]:
    from tqdm import tqdm

    from experiments.paper_scale.simulate import max_length, simulate_step

    rows = []
    for setting in tqdm(PAPER_SCALE_SETTINGS, desc=f"{model} (simulated)", file=sys.stderr):
        options = {"checkpointing": setting}
        step = simulate_step("autosp", model, seq_len, autosp_options=options)
        longest = max_length("autosp", model, granularity=granularity, autosp_options=options).nominal
        rows.append({
            "model": model, "checkpointing": setting, "seq_len": seq_len,
            "step_s": round(step.step_time_s, 3), "peak_gib": round(step.peak_memory_bytes / 2**30, 2),
            "activation_gib": round((step.peak_memory_bytes - step.static_memory_bytes) / 2**30, 2),
            "max_seq_len": longest.max_seq_len or 0, "at_search_ceiling": longest.hit_upper_bound,
        })
    none = next(r for r in rows if r["checkpointing"] == "none")
    for r in rows:
        r["max_seq_vs_none"] = round(r["max_seq_len"] / none["max_seq_len"], 2) if none["max_seq_len"] else "n/a"
        r["step_vs_none"] = round(r["step_s"] / none["step_s"], 3)
    return rows


def build_parser() -> argparse.ArgumentParser:
    from experiments import cli
    from experiments.models import PAPER_MODELS, TINY_MODELS

    parser = cli.parser("experiments.bench_sac_overlap", __doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096], metavar="TOKENS",
                        help="tokens per sample")
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks (the SP degree)")
    parser.add_argument("--model", default="hf-llama", choices=sorted(TINY_MODELS), help="tiny model preset")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers of the tiny model")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size of the tiny model")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--cap-mib", type=float, default=1024.0, help="per-rank memory cap for the max-length table")
    parser.add_argument("--quick", action="store_true", help="two short lengths, two timed steps")
    parser.add_argument("--paper-scale", metavar="MODEL", choices=sorted(PAPER_MODELS),
                        help=f"also simulate MODEL ({', '.join(sorted(PAPER_MODELS))}) on 8xA100")
    parser.add_argument("--paper-seq-len", type=int, default=65536, help="sequence length of the paper-scale step")
    parser.add_argument("--granularity", type=int, default=8192, help="paper-scale max-length search step")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results/bench_sac_overlap"),
                        help="folder for the CSV and Markdown tables")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.seq_lens, args.steps = [256, 512], 2
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    rows, caps = run(args)
    tables = {"steps": rows, "max_seq_len_at_cap": caps}
    if args.paper_scale:
        tables["paper_scale"] = run_paper_scale(args.paper_scale, args.paper_seq_len, args.granularity)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, table in tables.items():
        write_table(name, table, args.out)
    sys.stdout.write(markdown_table(rows) + "\n\n" + f"per-rank memory cap {args.cap_mib:g} MiB:\n" + markdown_table(caps) + "\n")
    if args.paper_scale:
        sys.stdout.write("\nsimulated at paper scale (8xA100-80GB, SP 8):\n" + markdown_table(tables["paper_scale"]) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
