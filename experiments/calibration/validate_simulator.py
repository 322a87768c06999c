"""Validate the simulator against real CPU gloo runs: measured vs simulated step time and per-rank peak memory.

``python -m experiments.validate_simulator [--quick] [--out results/validation]``

For every configuration of a sweep (2 and 4 ranks, several sequence lengths, two sizes of the tiny plain
Llama, AutoSP's overlap of collectives on and off when `autosp.AutoSPConfig` has that option) it starts real
gloo ranks, compiles the model with `autosp.compile` (``aot_eager``), runs warm-up steps, then measures

- the step time: forward + backward of one sample, started on a barrier, ended when the rank's backward
  returns; per step the slowest rank counts, the median over the timed steps is reported;
- the per-rank peak tensor memory of one more (untimed) step with `experiments.cpu.peak_memory.PeakMemory`,
  parameters and preallocated gradients counted as static memory (no optimizer state: the step has none).

Rank 0 exports the same compiled model's forward and backward graphs with `autosp.export.export_workload`;
the parent simulates the workload on ``Cluster.from_preset("cpu-gloo")`` and prints the table (config,
measured and simulated step ms, error %, measured and simulated peak MiB, error %) with the median and
maximum absolute errors, and writes ``validation.csv``, ``validation.md`` and the exported workloads
(``workloads/*.json``) under ``--out``.

What the step covers matches what the export covers: the compiled forward and backward graphs (gradient
synchronisation and the optimizer step are not part of the exported workload, so they are not timed).
The configurations here are not those the ``cpu-gloo`` preset was calibrated on (see
``experiments.calibrate_cpu``: single-op microbenchmarks), so the errors are out-of-sample.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from experiments.tables import write_table

log = logging.getLogger(__name__)

MODEL = "plain-llama"
LAYERS = 2
MIB = 2**20


@dataclass(frozen=True, kw_only=True)
class Case:
    """One configuration of the sweep."""

    world: int
    """Gloo ranks (= SP size)."""
    seq_len: int
    """Tokens of the sample (the full sequence, split over the ranks)."""
    hidden: int
    """Hidden size of the tiny plain Llama (4 heads, intermediate 2x hidden, 2 layers)."""
    overlap: bool = True
    """``overlap_communication`` option of autosp.compile."""
    model: str = MODEL
    """Tiny model preset (`experiments.models.TINY_MODELS`); the sweep uses the plain Llama, the calibration's
    reference step another family."""

    @property
    def label(self) -> str:
        ov = f" overlap={'on' if self.overlap else 'off'}"
        name = "" if self.model == MODEL else f"{self.model} "
        return f"{name}P={self.world} S={self.seq_len} h={self.hidden}{ov}"


def sweep(*, quick: bool = False, smallest: bool = False) -> list[Case]:
    """The configurations to run (``smallest``: one 2-rank case, for tests)."""
    overlaps = (False, True)
    if smallest:
        return [Case(world=2, seq_len=256, hidden=64, overlap=overlaps[0])]
    worlds = (2, 4)
    seqs = (256, 1024) if quick else (256, 512, 1024)
    hiddens = (64, 128)
    return [Case(world=w, seq_len=s, hidden=h, overlap=o)
            for w in worlds for h in hiddens for s in seqs for o in overlaps]


def _sample(seq_len: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, vocab, (1, seq_len), generator=g)
    return ids, ids.clone()


def _measure_rank(rank: int, world: int, cases: list[dict], warmup: int, steps: int) -> list[dict]:
    """Runs on every rank: `_measure_case` for each case (as dicts, since they cross process boundaries)."""
    return [_measure_case(rank, world, Case(**case), warmup, steps) for case in cases]


def _measure_case(rank: int, world: int, case: Case, warmup: int, steps: int) -> dict:
    """Compile, warm up, time ``steps`` steps, measure peak memory on one more step, export (rank 0)."""
    import torch
    import torch.distributed as dist

    import autosp
    from autosp.export import export_workload
    from experiments.cpu.peak_memory import PeakMemory
    from experiments.models import build_model, vocab_size

    torch._dynamo.reset()  # every case compiles afresh; no recompile limits across cases
    torch.manual_seed(0)
    model = build_model(case.model, layers=LAYERS, hidden=case.hidden)
    compiled = autosp.compile(model, sp_size=world, compiler="aot_eager", overlap_communication=case.overlap)
    ids, labels = _sample(case.seq_len, vocab_size(model))

    def step():
        out = compiled(**autosp.prepare_inputs(ids, labels=labels))
        (out if isinstance(out, torch.Tensor) else out.loss).backward()

    for _ in range(warmup):  # the first compiles; afterwards gradients exist and stay allocated
        step()
        model.zero_grad(set_to_none=False)
    step_s = []
    for _ in range(steps):
        model.zero_grad(set_to_none=False)
        dist.barrier()
        start = time.perf_counter()
        step()
        step_s.append(time.perf_counter() - start)
    params = list(model.parameters())
    model.zero_grad(set_to_none=False)
    dist.barrier()
    with PeakMemory(static=params + [p.grad for p in params]) as pm:
        step()
    parameter_bytes = sum(p.numel() * p.element_size() for p in params)
    breakdown = pm.breakdown()
    result = {"case": dataclasses.asdict(case), "step_s": step_s, "peak_bytes": pm.peak_bytes,
              "memory": {k: v for k, v in breakdown.items() if k != "by_op"},
              "memory_by_op": dict(list(breakdown["by_op"].items())[:8])}
    if rank == 0:
        workload = export_workload(compiled.report.aot_graphs, name=case.label, sp_size=world,
                                   parameter_bytes=parameter_bytes, optimizer_bytes_per_parameter_byte=0.0,
                                   saved_freed_at_last_use=True)  # Note [Boxed graphs free their inputs]
        result["workload"] = workload.to_dict()
    dist.barrier()
    return result


def cpu_gloo_cluster(world: int, preset_path: str | os.PathLike | dict | None = None):
    """``Cluster.from_preset("cpu-gloo")`` with ``world`` devices, as this machine runs ``world`` gloo ranks.

    Two facts of the calibration are applied: the loopback fabric's alpha and bandwidth are taken from the
    fit at this world size when the calibration has one (``calibration.fit_per_world``; gloo's cost per
    peer differs between 2 and 4 processes), and when there are more ranks than the calibrated machine's
    cores, the ranks share the cores: compute peaks scale by ``cpus / world`` and per-op host costs by its
    inverse, as is the time per attention score (all ranks compute at the same time in a symmetric SP step).
    ``preset_path`` may also be the preset document itself.
    """

    from simulator import Cluster
    from simulator.hardware import CPU_GLOO_JSON, preset_from_dict

    if isinstance(preset_path, dict):
        document = preset_path
    else:
        document = json.loads(Path(preset_path or CPU_GLOO_JSON).read_text(encoding="utf-8"))
    preset = preset_from_dict(document)
    calibration = document.get("calibration", {})
    fit = calibration.get("fit_per_world", {}).get(str(world))
    if fit:
        link = dataclasses.replace(preset.intra_node, latency_s=fit["alpha_s"] / 2,
                                   bandwidth_bytes_per_s=fit["bandwidth_bytes_per_s"])
        preset = dataclasses.replace(preset, intra_node=link)
    cpus = int(calibration.get("cpus") or os.cpu_count() or 1)
    share = min(1.0, cpus / world)
    if share < 1.0:
        dev = preset.device
        preset = dataclasses.replace(preset, device=dataclasses.replace(
            dev, peak_flops_per_s=dev.peak_flops_per_s * share,
            memory_bandwidth_bytes_per_s=dev.memory_bandwidth_bytes_per_s * share,
            kernel_launch_overhead_s=dev.kernel_launch_overhead_s / share,
            graph_call_overhead_s=dev.graph_call_overhead_s / share,
            view_op_overhead_s=dev.view_op_overhead_s / share,
            attention_score_time_s=dev.attention_score_time_s / share))
    return Cluster.from_preset(preset, devices_per_node=max(world, preset.devices_per_node))


def simulate_case(workload_dict: dict, world: int, preset_path=None):
    """Simulate an exported workload on the cpu-gloo cluster of `cpu_gloo_cluster`."""
    from simulator import Workload, simulate

    return simulate(Workload.from_dict(workload_dict), cpu_gloo_cluster(world, preset_path))


def _error_pct(simulated: float, measured: float) -> float:
    return 100.0 * (simulated - measured) / measured if measured > 0 else math.nan


def measure_case(case: Case, *, warmup: int = 3, steps: int = 15) -> tuple[float, int, dict, list[float]]:
    """Run ``case`` on real gloo ranks: (median slowest-rank step seconds, peak bytes of the largest rank,
    the exported workload document, every timed step's slowest-rank seconds)."""
    from experiments.launch import run_on_ranks

    per_rank = run_on_ranks(_measure_rank, case.world, [dataclasses.asdict(case)], warmup, steps, timeout_s=1800,
                            collective_timeout_s=600)
    measured = [r[0] for r in per_rank]
    step_s = [max(r["step_s"][i] for r in measured) for i in range(steps)]
    log.info("%s: measured memory at peak by op %s", case.label, measured[0]["memory_by_op"])
    return statistics.median(step_s), max(r["peak_bytes"] for r in measured), measured[0]["workload"], step_s


def run_validation(cases: list[Case], *, warmup: int = 3, steps: int = 15, preset_path=None,
                   progress: bool = True, workloads_out: Path | None = None) -> list[dict]:
    """Measure and simulate every case; one table row (dict) per case. ``workloads_out``: a folder to keep
    each case's exported workload in (``python -m simulator`` runs them again on any preset)."""
    from tqdm import tqdm

    rows = []
    by_world: dict[int, list[Case]] = {}
    for case in cases:
        by_world.setdefault(case.world, []).append(case)
    bar = tqdm(total=len(cases), desc="validate", file=sys.stderr, disable=not progress)
    for world, group in by_world.items():
        for case in group:  # one spawn per case: a fresh process state (and allocator) for every measurement
            measured_step_s, measured_peak, workload, step_s = measure_case(case, warmup=warmup, steps=steps)
            result = simulate_case(workload, world, preset_path)
            sim_step_s = result.step_time_s
            sim_peak = max(r.peak_memory_bytes for r in result.ranks)
            if workloads_out is not None:
                workloads_out.mkdir(parents=True, exist_ok=True)
                name = case.label.replace(" ", "_").replace("=", "")
                (workloads_out / f"{name}.json").write_text(json.dumps(workload), encoding="utf-8")
            rows.append({
                "config": case.label, "world": world, "seq_len": case.seq_len, "hidden": case.hidden,
                "overlap": "on" if case.overlap else "off",
                "measured_step_ms": 1e3 * measured_step_s, "simulated_step_ms": 1e3 * sim_step_s,
                "step_error_pct": _error_pct(sim_step_s, measured_step_s),
                "measured_peak_mib": measured_peak / MIB, "simulated_peak_mib": sim_peak / MIB,
                "peak_error_pct": _error_pct(sim_peak, measured_peak),
                "measured_step_spread_ms": 1e3 * (max(step_s) - min(step_s)),
                "simulated_exposed_comm_ms": 1e3 * max(r.exposed_comm_s for r in result.ranks),
                "load_avg_1min": os.getloadavg()[0],
            })
            bar.update(1)
    bar.close()
    return rows


COLUMNS = [("config", "config", "{}"), ("measured_step_ms", "measured step ms", "{:.2f}"),
           ("simulated_step_ms", "simulated step ms", "{:.2f}"), ("step_error_pct", "error %", "{:+.1f}"),
           ("measured_peak_mib", "measured peak MiB", "{:.3f}"), ("simulated_peak_mib", "simulated peak MiB", "{:.3f}"),
           ("peak_error_pct", "error %", "{:+.1f}")]


def summary(rows: list[dict]) -> dict[str, float]:
    """Median and maximum absolute errors (percent) of step time and peak memory."""
    step = [abs(r["step_error_pct"]) for r in rows]
    peak = [abs(r["peak_error_pct"]) for r in rows]
    return {"step_median_abs_error_pct": statistics.median(step), "step_max_abs_error_pct": max(step),
            "peak_median_abs_error_pct": statistics.median(peak), "peak_max_abs_error_pct": max(peak)}


def summary_lines(rows: list[dict]) -> list[str]:
    """The summary written below the table."""
    s = summary(rows)
    return [f"step time: median |error| {s['step_median_abs_error_pct']:.1f} %, max {s['step_max_abs_error_pct']:.1f} %",
            f"peak memory: median |error| {s['peak_median_abs_error_pct']:.1f} %, "
            f"max {s['peak_max_abs_error_pct']:.1f} %"]


def write_outputs(rows: list[dict], out: Path) -> None:
    """``validation.csv`` and ``validation.md`` (with the summary lines) in ``out``."""
    write_table("validation", rows, out, columns=COLUMNS, footer=summary_lines(rows))


def build_parser() -> argparse.ArgumentParser:
    from experiments import cli

    parser = cli.parser("experiments.validate_simulator", __doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sequence lengths and steps")
    parser.add_argument("--smallest", action="store_true", help="one 2-rank, 256-token case (for tests)")
    parser.add_argument("--out", type=Path, default=Path("results/validation"), help="folder for CSV and Markdown")
    parser.add_argument("--preset", type=Path, default=None,
                        help="cpu-gloo preset JSON to simulate with, e.g. results/calibration/cpu_gloo.json "
                             "written by python -m experiments.calibrate_cpu (default: the tracked "
                             "simulator/presets/cpu_gloo.json)")
    parser.add_argument("--verbose", action="store_true", help="log per-case details")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per case (default 15, quick 9)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.preset is not None and not args.preset.is_file():
        parser.error(f"--preset {args.preset}: no such file (python -m experiments.calibrate_cpu writes one)")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps {args.steps}: give at least one timed step")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cases = sweep(quick=args.quick, smallest=args.smallest)
    steps = args.steps or (5 if args.smallest else 9 if args.quick else 15)
    rows = run_validation(cases, warmup=2 if args.smallest else 3, steps=steps, preset_path=args.preset,
                          workloads_out=args.out / "workloads")
    write_outputs(rows, args.out)
    print((args.out / "validation.md").read_text())
    print(f"wrote {args.out / 'validation.csv'} and {args.out / 'validation.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
