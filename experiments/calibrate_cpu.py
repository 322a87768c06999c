"""Calibrate the simulator's ``cpu-gloo`` preset on this machine and write ``simulator/presets/cpu_gloo.json``.

Run ``python -m experiments.calibrate_cpu`` (about a minute on 2 cores; ``--quick`` halves it, ``--out PATH``
writes elsewhere). With one thread per process, as the gloo tests run, it measures: fp32 matmul FLOP/s (the
preset's peak), elementwise, copy and reduction memory bandwidth, causal ``scaled_dot_product_attention``
throughput, the fixed per-op cost (an aten op called from an FX graph on tiny tensors, as ``aot_eager`` runs
compiled graphs: Python and dispatcher time, which dominates tiny CPU models), the host cost of entering a compiled
graph (a toy forward + backward compiled with ``aot_eager``, its ops' cost removed, per graph), and AutoSP's
all-to-all custom op (``autosp.ops.all_to_all``: layout copies and ``all_to_all_single``, as the compiled program
calls it) over 2 and 4 local gloo processes at several message sizes. None of these is a measurement of a model
step, so ``experiments.validate_simulator`` checks the preset out of sample. The all-to-all times are fitted by
least squares to the simulator's own model,
``T = (p-1) * alpha + (p-1)/p * n / bandwidth`` (see ``simulator.cost_model.all_to_all_time_s``), giving the
loopback link's latency (alpha split over the two hops of a device-switch-device route) and bandwidth.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from experiments.spawn import run_ranks

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "simulator" / "presets" / "cpu_gloo.json"
A2A_BYTES = (4 * 2**10, 64 * 2**10, 512 * 2**10, 2 * 2**20, 8 * 2**20)
WORLDS = (2, 4)


def _best_time_s(fn, *, repeat: int, min_time_s: float = 0.05) -> float:
    """Best per-call time over ``repeat`` batches, each batch long enough to time reliably."""
    fn()
    calls = 1
    while True:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if time.perf_counter() - start >= min_time_s or calls >= 1 << 16:
            break
        calls *= 2
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def measure_compute(repeat: int) -> dict[str, float]:
    """Single-thread compute figures of this CPU."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    out: dict[str, float] = {}
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    out["matmul_fp32_flops_per_s"] = 2 * n**3 / _best_time_s(lambda: a @ b, repeat=repeat)
    a16, b16 = a.bfloat16(), b.bfloat16()
    out["matmul_bf16_flops_per_s"] = 2 * n**3 / _best_time_s(lambda: a16 @ b16, repeat=repeat)
    numel = 8 * 2**20  # 32 MiB per fp32 tensor, well beyond the caches
    x, y, z = torch.randn(numel), torch.randn(numel), torch.empty(numel)
    out["elementwise_bytes_per_s"] = 3 * 4 * numel / _best_time_s(lambda: torch.add(x, y, out=z), repeat=repeat)
    out["copy_bytes_per_s"] = 2 * 4 * numel / _best_time_s(lambda: z.copy_(x), repeat=repeat)
    out["reduction_bytes_per_s"] = 4 * numel / _best_time_s(lambda: x.sum(), repeat=repeat)
    heads, seq, dim = 8, 1024, 64
    q, k, v = (torch.randn(1, heads, seq, dim) for _ in range(3))
    attn_s = _best_time_s(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), repeat=repeat)
    out["attention_flops_per_s"] = 4 * heads * seq * seq * dim / 2 / attn_s  # causal: half of QK^T and PV
    t1, t2 = torch.randn(1), torch.randn(1)
    out["eager_add_call_s"] = _best_time_s(lambda: torch.add(t1, t2), repeat=repeat)
    out["kernel_launch_overhead_s"] = _fx_op_call_s(repeat)
    out["graph_call_overhead_s"] = _graph_call_overhead_s(repeat, out["kernel_launch_overhead_s"])
    return out


def _fx_op_call_s(repeat: int, ops: int = 200) -> float:
    """Per-op time of a chain of tiny ``aten.mul.Tensor`` calls in an FX GraphModule (how aot_eager runs)."""
    from torch import fx

    graph = fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    node = x
    for _ in range(ops):
        node = graph.call_function(torch.ops.aten.mul.Tensor, (node, y))
    graph.output(node)
    gm = fx.GraphModule({}, graph)
    a, b = torch.randn(4), torch.randn(4)
    return _best_time_s(lambda: gm(a, b), repeat=repeat) / ops


def _graph_call_overhead_s(repeat: int, op_s: float) -> float:
    """Host time of entering one aot_eager-compiled graph: a toy forward + backward step, minus its ops, / 2."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def record(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8)
    step_fn = torch.compile(lambda x: layer(x).sum(), fullgraph=True,
                            backend=aot_autograd(fw_compiler=record, bw_compiler=record))
    x = torch.randn(4, 8)
    step_fn(x).backward()
    step_s = _best_time_s(lambda: step_fn(x).backward(), repeat=repeat)
    ops = sum(1 for gm in graphs for n in gm.graph.nodes if n.op == "call_function")
    torch._dynamo.reset()
    return max(step_s - ops * op_s, 0.0) / 2


def _a2a_rank(rank: int, world: int, sizes: list[int], iters: int) -> dict[str, float]:
    import torch.distributed as dist

    from autosp.ops import all_to_all

    group = dist.group.WORLD.group_name
    heads, head_dim = 4 * world, 16  # [1, S/P, H, D] -> [1, S, H/P, D], as around attention
    times = {}
    for nbytes in sizes:
        tokens = max(1, nbytes // 4 // (heads * head_dim))
        x = torch.ones(1, tokens, heads, head_dim)
        for _ in range(2):
            all_to_all(x, 2, 1, group, world)
        samples = []
        for _ in range(iters):
            dist.barrier()
            start = time.perf_counter()
            all_to_all(x, 2, 1, group, world)
            samples.append(time.perf_counter() - start)
        times[str(x.numel() * 4)] = statistics.median(samples)
    return times


def measure_all_to_all(iters: int) -> dict[int, dict[int, float]]:
    """Median time of AutoSP's all-to-all op per world size and per-rank message bytes (slowest rank)."""
    results = {}
    for world in WORLDS:
        per_rank = run_ranks(_a2a_rank, world, list(A2A_BYTES), iters)
        results[world] = {int(n): max(r[n] for r in per_rank) for n in per_rank[0]}
    return results


def fit_alpha_beta(a2a: dict[int, dict[int, float]]) -> tuple[float, float]:
    """Least-squares (alpha_s, bandwidth_bytes_per_s) of ``T = (p-1) alpha + (p-1)/p n / bw``."""
    rows, rhs = [], []
    for world, by_size in a2a.items():
        for nbytes, t in by_size.items():
            # Weight by 1/T so small and large messages count alike (relative error).
            rows.append([(world - 1) / t, (world - 1) / world * nbytes / t])
            rhs.append(1.0)
    (alpha, inv_bw), *_ = np.linalg.lstsq(np.array(rows), np.array(rhs), rcond=None)
    return max(float(alpha), 1e-7), 1.0 / max(float(inv_bw), 1e-15)


def build_preset(compute: dict[str, float], a2a: dict[int, dict[int, float]]) -> dict:
    """The preset document read by ``simulator.hardware.load_cpu_gloo``."""
    alpha_s, bandwidth = fit_alpha_beta(a2a)
    peak = compute["matmul_fp32_flops_per_s"]
    ew = compute["elementwise_bytes_per_s"]
    devices = max(WORLDS)
    total_ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def eff(flops: float, memory: float) -> dict[str, float]:
        return {"flops": round(min(flops, 1.0), 4), "memory": round(min(memory, 1.0), 4)}

    return {
        "name": "cpu-gloo",
        "calibrated": True,
        "notes": "one CPU process per rank with one thread; peak = measured fp32 matmul, memory bandwidth = "
                 "measured elementwise add; per-op cost = an aten op called from an FX graph (aot_eager); the "
                 "loopback 'fabric' is gloo over TCP on 127.0.0.1, timed through AutoSP's all-to-all op; with more "
                 "ranks than calibration.cpus the ranks share the cores; memory_bytes is "
                 f"the machine's RAM split over {devices} ranks",
        "sources": ["python -m experiments.calibrate_cpu"],
        "devices_per_node": devices,
        "intra_node_kind": "loopback",
        "device": {
            "name": f"cpu process ({platform.machine()}, 1 thread)",
            "peak_flops_per_s": peak,
            "memory_bandwidth_bytes_per_s": ew,
            "memory_bytes": int(total_ram // devices),
            "kernel_launch_overhead_s": compute["kernel_launch_overhead_s"],
            "graph_call_overhead_s": compute.get("graph_call_overhead_s", 0.0),
            "efficiency": {
                "matmul": eff(1.0, 1.0),
                "attention": eff(compute["attention_flops_per_s"] / peak, 1.0),
                "elementwise": eff(0.25, 1.0),
                "reduction": eff(0.25, compute["reduction_bytes_per_s"] / ew),
                "memory": eff(1.0, compute["copy_bytes_per_s"] / ew),
                "other": eff(0.25, 0.5),
            },
        },
        "intra_node": {"bandwidth_bytes_per_s": bandwidth, "latency_s": alpha_s / 2, "efficiency": 1.0},
        "calibration": {
            "date": datetime.date.today().isoformat(),
            "torch": torch.__version__,
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "compute": compute,
            "all_to_all_s": {str(w): {str(n): t for n, t in by.items()} for w, by in a2a.items()},
            "fit": {"alpha_s": alpha_s, "bandwidth_bytes_per_s": bandwidth},
            "fit_per_world": {str(w): dict(zip(("alpha_s", "bandwidth_bytes_per_s"), fit_alpha_beta({w: by}), strict=True))
                              for w, by in a2a.items()},
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.calibrate_cpu", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the preset JSON")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (about half the time)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    compute = measure_compute(repeat=3 if args.quick else 5)
    print("compute:", json.dumps({k: f"{v:.3g}" for k, v in compute.items()}))
    a2a = measure_all_to_all(iters=10 if args.quick else 25)
    print("autosp all_to_all (s):", json.dumps({w: {n: f"{t:.3g}" for n, t in by.items()} for w, by in a2a.items()}))
    preset = build_preset(compute, a2a)
    fit = preset["calibration"]["fit"]
    print(f"fit: alpha {fit['alpha_s'] * 1e6:.1f} us, bandwidth {fit['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(preset, indent=2) + "\n")
    print(f"wrote {args.out} in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
