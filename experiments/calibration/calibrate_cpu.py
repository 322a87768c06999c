"""Calibrate the simulator's ``cpu-gloo`` preset on this machine: write ``results/calibration/cpu_gloo.json``.

Run ``python -m experiments.calibrate_cpu`` (about two and a half minutes on 2 cores; ``--quick`` halves it,
``--out PATH`` writes elsewhere, ``--update-preset`` replaces the tracked ``simulator/presets/cpu_gloo.json``,
the preset the simulator and the paper use), with nothing else running. With one thread per process, as the gloo tests run, it measures:
fp32 matmul FLOP/s (the preset's peak), elementwise, copy and reduction memory bandwidth, AutoSP's activation-offload
copies (`measure_host_copy`: the host-memory link; host memory is the machine's RAM), causal
``scaled_dot_product_attention`` forward and backward over head dims 16-128 (fitted to a matmul rate plus a time
per query-key score, see `measure_attention`), the host cost of one graph node and of entering one compiled graph
(`_compiled_step_host_costs`: toy forward + backward steps compiled with ``aot_eager`` on tiny tensors, two
depths: Python, dispatcher and allocator time, which dominates tiny CPU models), and AutoSP's all-to-all custom op (``autosp.ops.all_to_all``: layout copies
and ``all_to_all_single``, as the compiled program calls it) over 2 and 4 local gloo processes at several
message sizes, both alone (after a barrier) and between compute (`measure_all_to_all_in_step`: what a step
pays). Last, one reference training step (`REFERENCE_STEP`: 2 ranks, 768 tokens, hidden 96) is timed and
simulated with those figures; the factor on compute times that makes the two agree becomes
``calibration.step_factor`` (`apply_step_factor`: what hot-loop microbenchmarks miss in a real step).
``experiments.validate_simulator`` checks the preset at 24 other configurations (2 and 4 ranks, 256-1024
tokens, hidden 64 and 128, overlap on and off), so its errors are out of sample. The in-step all-to-all costs are fitted by least squares to the simulator's own model,
``T = (p-1) * alpha + (p-1)/p * n / bandwidth`` (see ``simulator.cost_model.all_to_all_time_s``), giving the
loopback link's latency (alpha split over the two hops of a device-switch-device route) and bandwidth, overall
and per world size.
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

from experiments.launch import run_on_ranks

DEFAULT_OUT = Path("results/calibration/cpu_gloo.json")
TRACKED_PRESET = Path(__file__).resolve().parents[2] / "simulator" / "presets" / "cpu_gloo.json"
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
    out.update(measure_attention(repeat))
    out.update(measure_host_copy(repeat))
    t1, t2 = torch.randn(1), torch.randn(1)
    out["eager_add_call_s"] = _best_time_s(lambda: torch.add(t1, t2), repeat=repeat)
    node_s, graph_s = _compiled_step_host_costs(repeat)
    # Every node of an aot_eager graph, view or not, costs the same dispatcher + Python round trip.
    out["kernel_launch_overhead_s"] = out["view_op_overhead_s"] = node_s
    out["graph_call_overhead_s"] = graph_s
    return out


HOST_COPY_BYTES = 32 * 2**20
"""Bytes of the tensor the activation-offload copies are timed on (well beyond the caches)."""


def measure_host_copy(repeat: int) -> dict[str, float]:
    """The cpu-gloo preset's host-memory link: AutoSP's activation-offload copies as the compiled program calls
    them (``autosp.ops.offload_to_host`` and ``reload_from_host``, Note [Activation offload ops]: on a CPU each is a
    copy into newly allocated RAM, page faults included), on a `HOST_COPY_BYTES` fp32 tensor and on a one-element
    tensor.  The one-element call is the link's latency (the op's dispatch); the bandwidth per direction is the
    large copy's bytes over its time less that latency, the two directions averaged (9.80 and 9.87 ms for
    32 MiB on this project's machine: both allocate and copy).  About 3.4 GB/s there, against 43 GB/s (read plus
    write) of ``copy_`` into an existing tensor: the fresh allocation's page faults dominate."""
    from autosp.ops import offload_to_host, reload_from_host

    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    x, one = torch.randn(HOST_COPY_BYTES // 4), torch.randn(1)
    host, host_one = offload_to_host(x), offload_to_host(one)
    out = {"host_copy_bytes": HOST_COPY_BYTES,
           "offload_to_host_s": _best_time_s(lambda: offload_to_host(x), repeat=repeat),
           "reload_from_host_s": _best_time_s(lambda: reload_from_host(host, cpu), repeat=repeat),
           "offload_to_host_one_element_s": _best_time_s(lambda: offload_to_host(one), repeat=repeat),
           "reload_from_host_one_element_s": _best_time_s(lambda: reload_from_host(host_one, cpu), repeat=repeat)}
    latency = (out["offload_to_host_one_element_s"] + out["reload_from_host_one_element_s"]) / 2
    copy_s = (out["offload_to_host_s"] + out["reload_from_host_s"]) / 2 - latency
    out["host_copy_latency_s"] = latency
    out["host_copy_bytes_per_s"] = HOST_COPY_BYTES / max(copy_s, 1e-9)
    return out


HOST_MEMORY_NOTE = ("host_memory_bytes is the machine's RAM (device and host memory are the same RAM: a run caps the "
                    "device pool itself, e.g. target_memory); host_memory_link is AutoSP's activation-offload copy "
                    "(offload_to_host and reload_from_host of a 32 MiB fp32 tensor, the two directions averaged, "
                    "less the latency: the one-element call), not scaled by step_factor")
"""The preset's notes on its host-memory fields (`host_memory_fields`)."""


def host_memory_fields(host_copy: dict[str, float], total_ram: int) -> dict:
    """The preset's host-memory fields from `measure_host_copy`'s figures: the machine's RAM (device and host
    memory are the same RAM on a CPU: a run caps the device pool itself, e.g. the memory-cap table's 16 MiB per
    rank, and the host pool is the RAM shared by the node's ranks) and the measured copy as the link."""
    return {"host_memory_bytes": int(total_ram), "host_memory_kind": "memory",
            "host_memory_link": {"bandwidth_bytes_per_s": host_copy["host_copy_bytes_per_s"],
                                 "latency_s": host_copy["host_copy_latency_s"], "efficiency": 1.0}}


ATTENTION_HEAD_DIMS = (16, 32, 64, 128)
ATTENTION_SEQ_LENS = (512, 1024)


def measure_attention(repeat: int, heads: int = 8) -> dict:
    """Causal ``scaled_dot_product_attention`` forward and backward over head dims and sequence lengths, fitted
    to the simulator's attention cost ``flops / F + scores * c`` (see `simulator.cost_model.roofline_time_s`).

    On a CPU the softmax work per query-key score (max, exp, sum, rescale) costs as much as the matmuls of a
    16-wide head, so one FLOP rate cannot serve every head dimension; the fit gives the matmul rate F
    (``attention_flops_per_s``) and the time per score c (``attention_score_time_s``). The backward counts
    2.5x the forward's FLOPs and scores (`autosp.costs.attention_scores`). Least squares on relative error.
    """
    from autosp.costs import attention_flops, attention_scores

    samples = []
    for seq in ATTENTION_SEQ_LENS:
        for dim in ATTENTION_HEAD_DIMS:
            forward_s, backward_s = _attention_times_s(heads, seq, dim, repeat)
            for backward, seconds in ((False, forward_s), (True, backward_s)):
                shape = (1, heads, seq, dim)
                samples.append({"seq_len": seq, "head_dim": dim, "backward": backward, "seconds": seconds,
                                "flops": attention_flops(shape, shape, causal=True, backward=backward),
                                "scores": attention_scores(shape, shape, causal=True, backward=backward)})
    rate, score_s = fit_attention(samples)
    for s in samples:
        s["fit_error_pct"] = 100.0 * ((s["flops"] / rate + s["scores"] * score_s) / s["seconds"] - 1.0)
    return {"attention_flops_per_s": rate, "attention_score_time_s": score_s, "attention_samples": samples}


def _attention_times_s(heads: int, seq: int, dim: int, repeat: int) -> tuple[float, float]:
    """(forward, backward) seconds of causal SDPA on [1, heads, seq, dim] tensors."""
    q, k, v = (torch.randn(1, heads, seq, dim, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, heads, seq, dim)

    def forward():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward_backward():
        torch.autograd.grad(forward(), (q, k, v), grad)

    forward_s = _best_time_s(forward, repeat=repeat)
    return forward_s, max(_best_time_s(forward_backward, repeat=repeat) - forward_s, 0.0)


def fit_attention(samples: list[dict]) -> tuple[float, float]:
    """Least-squares (FLOP/s, seconds per score) of ``seconds = flops / rate + scores * score_s``, each sample
    weighted by 1/seconds (relative error)."""
    rows = np.array([[s["flops"] / s["seconds"], s["scores"] / s["seconds"]] for s in samples])
    (inv_rate, score_s), *_ = np.linalg.lstsq(rows, np.ones(len(samples)), rcond=None)
    return 1.0 / max(float(inv_rate), 1e-15), max(float(score_s), 0.0)


class _ToyBlock(torch.nn.Module):
    """A transformer-flavoured block (norm, MLP with gated GELU, residual, a softmax mixing) for host-cost
    calibration; not the model `experiments.validate_simulator` checks."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x):
        h = self.up(self.norm(x))
        y = x + self.down(F.gelu(h) * torch.sigmoid(h))
        mix = torch.softmax(y.transpose(-1, -2) @ y / 8, dim=-1)
        return y + (y @ mix) * 0.5


def _compiled_step_host_costs(repeat: int, depths: tuple[int, int] = (1, 8)) -> tuple[float, float]:
    """Host time per graph node and per compiled graph of an ``aot_eager`` forward + backward step.

    Steps of toy models of two depths on tiny tensors (so the time is host time: Python, dispatcher, allocator,
    autograd engine) are timed; the slope over their node counts is the cost of one node, the intercept (halved:
    a forward and a backward graph) the cost of entering one graph.
    """
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    points = []
    for depth in depths:
        graphs = []

        def record(gm, _inputs, graphs=graphs):
            graphs.append(gm)
            return make_boxed_func(gm.forward)

        torch.manual_seed(0)
        model = torch.nn.Sequential(*[_ToyBlock(8) for _ in range(depth)])
        step_fn = torch.compile(lambda x, model=model: model(x).sum(), fullgraph=True,
                                backend=aot_autograd(fw_compiler=record, bw_compiler=record))
        x = torch.randn(4, 8)
        step_fn(x).backward()
        step_s = _best_time_s(lambda step_fn=step_fn, x=x: step_fn(x).backward(), repeat=repeat)
        nodes = sum(1 for gm in graphs for n in gm.graph.nodes if n.op == "call_function")
        points.append((nodes, step_s))
        torch._dynamo.reset()
    (n1, t1), (n2, t2) = points
    node_s = (t2 - t1) / (n2 - n1)
    return node_s, max(t1 - n1 * node_s, 0.0) / 2


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
    """Median time of AutoSP's all-to-all op per world size and per-rank message bytes (slowest rank), each
    call started right after a barrier: the collective on its own."""
    return _slowest_rank_per_world(_a2a_rank, list(A2A_BYTES), iters)


def _slowest_rank_per_world(rank_fn, *args) -> dict[int, dict[int, float]]:
    """``rank_fn(rank, world, *args)`` (message bytes -> seconds) on each of `WORLDS`; the slowest rank's times."""
    results = {}
    for world in WORLDS:
        per_rank = run_on_ranks(rank_fn, world, *args, timeout_s=1800, collective_timeout_s=600)
        results[world] = {int(n): max(r[n] for r in per_rank) for n in per_rank[0]}
    return results


IN_STEP_COMPUTE_OPS = 24
"""Elementwise ops between two all-to-alls of the in-step loop (with one matmul): about a millisecond of
compute per rank at the middle message size, the order of a layer's work between collectives in the validated
models (it is not one of them)."""


def _local_exchange(t: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """A local stand-in for the all-to-all: the same layout copies, nothing sent."""
    return t.transpose(scatter_dim, gather_dim).contiguous().transpose(scatter_dim, gather_dim).clone()


def _compute_and_exchange(x: torch.Tensor, weight: torch.Tensor, hops: int, exchange) -> torch.Tensor:
    """``hops`` times: a projection, `IN_STEP_COMPUTE_OPS` elementwise ops, then ``exchange`` there and back."""
    _, tokens, heads, head_dim = x.shape
    y = x
    for _ in range(hops):
        y = (y.reshape(tokens, heads * head_dim) @ weight).reshape(1, tokens, heads, head_dim)
        for _ in range(IN_STEP_COMPUTE_OPS):
            y = y * 0.5 + 0.25
        y = exchange(y, 2, 1)
        y = exchange(y, 1, 2)
    return y


def _a2a_in_step_rank(rank: int, world: int, sizes: list[int], iters: int, hops: int) -> dict[str, float]:
    """Mean extra time of an all-to-all inside a compute loop: (loop with collectives - same loop with local
    copies of the same layout) / collectives. Means, not medians: the step pays the occasional slow call."""
    import torch.distributed as dist

    from autosp.ops import all_to_all

    group = dist.group.WORLD.group_name
    heads, head_dim = 4 * world, 16
    width = heads * head_dim

    def collective(t, scatter_dim, gather_dim):
        return all_to_all(t, scatter_dim, gather_dim, group, world)

    torch.manual_seed(rank)
    times = {}
    for nbytes in sizes:
        x = torch.randn(1, max(1, nbytes // 4 // width), heads, head_dim)
        weight = torch.randn(width, width) / width
        for _ in range(2):
            for exchange in (collective, _local_exchange):
                _compute_and_exchange(x, weight, hops, exchange)
        elapsed: dict[object, list[float]] = {collective: [], _local_exchange: []}
        for _ in range(iters):
            for exchange, samples in elapsed.items():
                dist.barrier()
                start = time.perf_counter()
                _compute_and_exchange(x, weight, hops, exchange)
                samples.append(time.perf_counter() - start)
        extra_s = statistics.mean(elapsed[collective]) - statistics.mean(elapsed[_local_exchange])
        times[str(x.numel() * 4)] = max(extra_s, 0.0) / (2 * hops)
    return times


def measure_all_to_all_in_step(iters: int, hops: int = 8) -> dict[int, dict[int, float]]:
    """Mean cost of AutoSP's all-to-all between compute, as a compiled step calls it (slowest rank).

    After a barrier a gloo all-to-all of 128 KiB takes ~0.25 ms here; between compute it costs 2-4x that on
    average (both ranks compute on the machine's cores, so gloo's transport threads wait for a core, and the
    ranks arrive apart). The simulator's loopback link is fitted to these in-step costs.
    """
    return _slowest_rank_per_world(_a2a_in_step_rank, list(A2A_BYTES), iters, hops)


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


def build_preset(compute: dict, a2a: dict[int, dict[int, float]],
                 a2a_isolated: dict[int, dict[int, float]] | None = None) -> dict:
    """The preset document read by ``simulator.hardware.load_cpu_gloo`` (``a2a``: the in-step costs the link
    is fitted to; ``a2a_isolated``: the collective alone, recorded for reference)."""
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
                 "measured elementwise add; per-node and per-graph host costs = aot_eager toy steps of two "
                 "depths (views cost as any node); attention = matmul rate + time per score, fitted over head dims; the loopback "
                 "'fabric' is gloo over TCP on 127.0.0.1, timed through AutoSP's all-to-all op between compute "
                 "(its mean in-step cost); with more "
                 "ranks than calibration.cpus the ranks share the cores; memory_bytes is "
                 f"the machine's RAM split over {devices} ranks; " + HOST_MEMORY_NOTE,
        "sources": ["python -m experiments.calibrate_cpu"],
        "devices_per_node": devices,
        "intra_node_kind": "loopback",
        # gloo runs async work on 2 threads, but two all-to-alls started together on this 2-core machine were
        # sometimes 30 % faster, sometimes 40 % slower than one after the other (run to run): modelled serial.
        "collectives_in_flight": 1,
        **host_memory_fields(compute, total_ram),
        "device": {
            "name": f"cpu process ({platform.machine()}, 1 thread)",
            "peak_flops_per_s": peak,
            "memory_bandwidth_bytes_per_s": ew,
            "memory_bytes": int(total_ram // devices),
            "kernel_launch_overhead_s": compute["kernel_launch_overhead_s"],
            "graph_call_overhead_s": compute.get("graph_call_overhead_s", 0.0),
            "view_op_overhead_s": compute.get("view_op_overhead_s", 0.0),
            "attention_score_time_s": compute.get("attention_score_time_s", 0.0),
            "host_copies_inline": True,  # a rank's offload copies are clones on its own thread
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
            "all_to_all_in_step_s": {str(w): {str(n): t for n, t in by.items()} for w, by in a2a.items()},
            "all_to_all_isolated_s": {str(w): {str(n): t for n, t in by.items()}
                                      for w, by in (a2a_isolated or {}).items()},
            "fit": {"alpha_s": alpha_s, "bandwidth_bytes_per_s": bandwidth},
            "fit_per_world": {str(w): dict(zip(("alpha_s", "bandwidth_bytes_per_s"), fit_alpha_beta({w: by}), strict=True))
                              for w, by in a2a.items()},
        },
    }


REFERENCE_STEP = {"model": "plain-llama", "world": 2, "seq_len": 768, "hidden": 96}
"""The one model step the calibration measures: the plain Llama of ``experiments.validate_simulator`` at a
sequence length and width that its sweep does not use (head dim 24; the sweep has 16 and 32). Not another
model family: the host cost of calling a compiled model (Dynamo's guards, module wrappers) depends on the model
class and is not part of the exported graphs, so a factor measured on a tiny Hugging Face Qwen2 (1.74) does not
carry over to the plain Llama (about 1.25)."""


REFERENCE_RUNS = 3
"""Fresh gloo process groups the reference step is measured in (the median of their medians counts)."""


def measure_reference_step(preset: dict, steps: int) -> dict:
    """Time `REFERENCE_STEP` on real gloo ranks and find the compute factor that makes its simulation match.

    Compute microbenchmarks run hot loops of one op; a training step interleaves hundreds of different ops and
    the autograd engine, and its compute runs slower than the sum of its microbenchmarked parts. The
    all-to-all is already measured between compute, so only compute is scaled: ``step_factor`` is the factor
    (found by bisection; step time grows monotonically with it) by which `apply_step_factor` scales every
    compute time of the preset so that the reference step's simulated time equals its measured median.
    """
    from experiments.calibration.validate_simulator import Case, cpu_gloo_cluster, measure_case
    from simulator import Workload, simulate

    case = Case(**REFERENCE_STEP, overlap=True)
    runs = [measure_case(case, steps=steps) for _ in range(REFERENCE_RUNS)]
    # Run-to-run spread on this machine is ~15 % (where the scheduler puts ranks and gloo's threads), more
    # than the spread within a run: the median over fresh process groups.
    measured_s = statistics.median(run[0] for run in runs)
    workload = Workload.from_dict(runs[0][2])  # parsed and validated once for the ~40 simulations below
    step_s = [run[0] for run in runs]

    def simulated(factor: float) -> float:
        cluster = cpu_gloo_cluster(case.world, apply_step_factor(preset, factor))
        return simulate(workload, cluster, validate=False).step_time_s

    low, high = 0.25, 8.0
    if not simulated(low) <= measured_s <= simulated(high):
        raise RuntimeError(f"reference step measured {measured_s * 1e3:.1f} ms is outside what compute factors "
                           f"{low}-{high} can simulate; was the machine busy? Re-run with nothing else running.")
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if simulated(middle) < measured_s else (low, middle)
    factor = (low + high) / 2
    return {"config": case.label, "measured_step_s": measured_s, "run_median_step_s": step_s,
            "simulated_step_s_before": simulated(1.0), "step_factor": factor}


def apply_step_factor(preset: dict, factor: float) -> dict:
    """``preset`` with every compute time of the simulator's model multiplied by ``factor``: compute peak and
    memory bandwidth divided, per-node, per-graph and per-score times multiplied (the loopback link is left as
    measured between compute). The microbenchmark figures under ``calibration.compute`` stay as measured."""
    out = json.loads(json.dumps(preset))
    device = out["device"]
    for key in ("peak_flops_per_s", "memory_bandwidth_bytes_per_s"):
        device[key] /= factor
    for key in ("kernel_launch_overhead_s", "graph_call_overhead_s", "view_op_overhead_s", "attention_score_time_s"):
        device[key] *= factor
    out["calibration"]["step_factor"] = factor
    return out


def build_parser() -> argparse.ArgumentParser:
    from experiments import cli

    parser = cli.parser("experiments.calibrate_cpu", __doc__.split("\n")[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the preset JSON")
    where.add_argument("--update-preset", action="store_true",
                       help="write the tracked simulator/presets/cpu_gloo.json instead (the preset python -m "
                            "simulator, the tests and the paper read): a change to commit")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (about half the time)")
    parser.add_argument("--no-reference-step", action="store_true",
                        help="microbenchmarks only: skip the reference model step (step_factor 1)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.update_preset:
        args.out = TRACKED_PRESET
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    compute = measure_compute(repeat=3 if args.quick else 5)
    print("compute:", json.dumps({k: f"{v:.3g}" for k, v in compute.items() if isinstance(v, float)}))
    print("attention fit error % (fwd, bwd per head dim):",
          " ".join(f"S{s['seq_len']}/d{s['head_dim']}{'b' if s['backward'] else 'f'} {s['fit_error_pct']:+.0f}"
                   for s in compute["attention_samples"]))
    isolated = measure_all_to_all(iters=10 if args.quick else 25)
    print("autosp all_to_all after a barrier (s):",
          json.dumps({w: {n: f"{t:.3g}" for n, t in by.items()} for w, by in isolated.items()}))
    in_step = measure_all_to_all_in_step(iters=5 if args.quick else 10)
    print("autosp all_to_all between compute (s):",
          json.dumps({w: {n: f"{t:.3g}" for n, t in by.items()} for w, by in in_step.items()}))
    preset = build_preset(compute, in_step, isolated)
    if not args.no_reference_step:
        reference = measure_reference_step(preset, steps=9 if args.quick else 15)
        print(f"reference step {reference['config']}: measured {reference['measured_step_s'] * 1e3:.2f} ms, "
              f"simulated from the microbenchmarks {reference['simulated_step_s_before'] * 1e3:.2f} ms -> compute "
              f"step factor {reference['step_factor']:.3f}")
        preset = apply_step_factor(preset, reference["step_factor"])
        preset["calibration"]["reference_step"] = reference
    fit = preset["calibration"]["fit"]
    print(f"fit: alpha {fit['alpha_s'] * 1e6:.1f} us, bandwidth {fit['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(preset, indent=2) + "\n")
    print(f"wrote {args.out} in {time.perf_counter() - start:.0f} s")
    if args.out != TRACKED_PRESET:
        print(f"check it: python -m experiments.validate_simulator --preset {args.out}; make it the tracked preset: "
              "python -m experiments.calibrate_cpu --update-preset (or copy it to simulator/presets/cpu_gloo.json)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
