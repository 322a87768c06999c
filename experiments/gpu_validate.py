"""Validate AutoSP on this machine's GPU in one command: exactness, kernels, prediction, calibration record.

``python -m experiments.gpu_validate [--out results/gpu_validate]`` on a CUDA machine (under ten minutes on one GPU;
the sequence-parallel cases run only where there are two or more GPUs), ``python -m experiments.gpu_validate
--cpu-only`` anywhere (CI): the same sections on CPU gloo ranks, CPU timings not judged. Each case of `cases` is
run on real ranks by `experiments.launch.run_on_ranks` (gloo on CPU, NCCL with one GPU per rank), and four
sections read what the ranks report:

(a) exactness: the compiled step (``autosp.compile``, Inductor on the GPU, ``aot_eager`` on CPU) against the same
    step of the uncompiled model on one device over the whole sequence: the loss and every gradient within the
    case's tolerance (fp32: rtol 1e-4, atol 1e-6 on CPU; on the GPU atol relative to the gradient's scale, since
    the kernels differ from eager's; bf16: `BF16_TOL`). Sequence parallelism over 2 gloo ranks on CPU, over NCCL
    with 2 GPUs; at SP 1 with ``memory_plan="auto"`` and a target one byte below the predicted peak of the step
    with no memory technique, so the planner must choose one (tiled loss or MLP, SAC, activation offload).
(b) kernels: ``torch.profiler`` over one compiled step lists the attention kernels, the ring attention's blocks
    (the ops inside its ``autosp.ring.*.compute.*`` ranges), flex attention and the activation-offload copies, and
    fails on a math path (``aten::_scaled_dot_product_attention_math``, a softmax outside the loss, a matmul or
    log-sum-exp inside a ring block) or a quadratic one (an op reading a [B, H, S, S]-shaped tensor), and when no
    fused attention ran forward and backward. A control forces SDPA's math backend on the same device: the check
    must reject it.
(c) prediction: each case's measured step (median of the timed steps after warm-up, the slowest rank's) and peak
    memory (``torch.cuda.max_memory_allocated``; on CPU `experiments.cpu.peak_memory.PeakMemory`) beside the
    simulator's step time and peak of the same compiled graphs (`autosp.export.export_workload`) on the matching
    preset (`autosp.plan.auto.default_cluster`: the GPU's by name, ``cpu-gloo`` on CPU), errors printed, not
    judged; a planned case's chosen plan must fit its target (by its prediction, and on the GPU by the measured
    allocator peak).
(d) calibration: ``calibration/PRESET.json``, the preset in the layout `simulator.hardware.preset_from_dict` reads
    (that of ``simulator/presets/cpu_gloo.json``; a cluster file's ``node`` reads it too) with its compute times
    scaled by the factor that makes the median case's simulated step equal its measured one
    (`experiments.calibration.calibrate_cpu.apply_step_factor`), and a ``calibration`` block naming the device and
    holding every case's measured and simulated numbers; it is read back to check.

A summary table is printed and written with the JSON record (``gpu_validate.json``) and each case's exported
workload (``workloads/CASE.json``) under ``--out``; the exit status is 1 when any check failed.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import gc
import json
import logging
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_OUT = Path("results/gpu_validate")
BUDGET_S = 540.0
"""The whole command's time budget (ranks still running when it is spent are stopped, their cases fail): under ten
minutes with the start-up."""

FP32_TOL = {"rtol": 1e-4, "atol": 1e-6}
"""CPU fp32: the tolerance of the project's equivalence tests (tests/autosp/test_equivalence.py)."""
GPU_FP32_TOL = {"rtol": 1e-4, "atol": 1e-5, "relative_to_scale": True}
"""GPU fp32 (TF32 off): Inductor's fused kernels and cuBLAS's shape-dependent algorithms sum in another order than
eager's; atol is relative to the gradient's largest magnitude."""
BF16_TOL = {"rtol": 2e-2, "atol": 2e-2, "relative_to_scale": True}
"""bf16, as tests/autosp/test_equivalence.py compares it."""
PLAIN = {"checkpointing": "none", "tiled_loss": "off", "tiled_mlp": "off"}
"""The step with no memory technique: a planned case's target is one byte below its predicted peak."""

TINY_CPU = {"layers": 1, "hidden": 32, "vocab": 2048}
"""The tiny Hugging Face Llama of the CPU cases (tests/autosp/test_memory_plan.py's): 8 heads of 4, 2 kv heads."""
SMALL_GPU = {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "vocab": 4096}
"""The fp32 exactness cases on a GPU (head dim 64)."""
MEDIUM_GPU = {"layers": 4, "hidden": 1024, "heads": 8, "kv_heads": 2, "vocab": 32000}
"""The bf16 timed cases on a GPU (head dim 128): long enough a step for its time to mean something."""


@dataclass(frozen=True, kw_only=True)
class Case:
    """One compiled training step to run, check, measure and predict."""

    name: str
    world: int
    """Ranks (= SP size)."""
    sizes: dict
    """`experiments.models.build_model` overrides of the Hugging Face Llama."""
    seq_len: int
    dtype: str = "float32"
    compiler: str = "aot_eager"
    options: dict = field(default_factory=dict)
    """Other ``autosp.compile`` options."""
    plan_below_plain: bool = False
    """``memory_plan="auto"`` with ``target_memory`` one byte below the predicted peak of `PLAIN`."""
    tolerance: dict = field(default_factory=lambda: dict(FP32_TOL))
    warmup: int = 1
    steps: int = 3
    model: str = "hf-llama"

    @property
    def quadratic_from(self) -> int:
        """A 4-D tensor whose last two dims both reach this is a [.., S, S] score or mask block (the shortest
        attention block is a zig-zag chunk, S / 2P tokens; the cases keep head dims and head counts below it)."""
        return max(2, self.seq_len // (2 * self.world))


def cases(device: str, gpus: int = 0) -> list[Case]:
    """The cases of a run: on CPU 2-rank Ulysses and ring and a planned SP 1 step; on a GPU a planned fp32 and a
    timed bf16 step at SP 1, and with two or more GPUs Ulysses and ring (fp32) and a timed Ulysses step over NCCL."""
    if device == "cpu":
        return [Case(name="sp2-ulysses", world=2, sizes=TINY_CPU, seq_len=64, options={"memory_plan": "off"}),
                Case(name="sp2-ring", world=2, sizes=TINY_CPU, seq_len=64,
                     options={"memory_plan": "off", "strategy": "ring"}),
                Case(name="sp1-planned", world=1, sizes=TINY_CPU, seq_len=64, plan_below_plain=True)]
    gpu = {"compiler": "inductor", "tolerance": GPU_FP32_TOL, "warmup": 2, "steps": 5}
    timed = {"compiler": "inductor", "dtype": "bfloat16", "tolerance": BF16_TOL, "warmup": 3, "steps": 10,
             "sizes": MEDIUM_GPU, "seq_len": 4096}
    out = [Case(name="sp1-planned", world=1, sizes=SMALL_GPU, seq_len=1024, plan_below_plain=True, **gpu),
           Case(name="sp1-bf16", world=1, options={"memory_plan": "off"}, **timed)]
    if gpus >= 2:
        out += [Case(name="sp2-ulysses", world=2, sizes=SMALL_GPU, seq_len=1024, options={"memory_plan": "off"}, **gpu),
                Case(name="sp2-ring", world=2, sizes=SMALL_GPU, seq_len=1024,
                     options={"memory_plan": "off", "strategy": "ring"}, **gpu),
                Case(name="sp2-bf16", world=2, options={"memory_plan": "off"}, **timed)]
    return out


CASE_NAMES = tuple(sorted({c.name for device, gpus in (("cpu", 0), ("cuda", 2)) for c in cases(device, gpus)}))


# --- (b) kernels: what the profiler saw -----------------------------------------------------------------------

FUSED_ATTENTION = ("aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
                   "aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_fused_attention",
                   "aten::_flash_attention", "aten::_efficient_attention", "aten::_cudnn_attention")
"""Name prefixes of the fused attention ops (the CPU flash kernel's ``..._for_cpu`` included; backward ops end in
``_backward``)."""
MATH_ATTENTION = ("aten::_scaled_dot_product_attention_math",)
RING_MATH = frozenset(("aten::matmul", "aten::bmm", "aten::baddbmm", "aten::logsumexp", "aten::softmax",
                       "aten::_softmax", "aten::_safe_softmax"))
"""Ops that inside a ring block mean its attention runs as plain matmuls (`autosp.ring_attention._math_forward`)."""
OFFLOAD_COPIES = ("autosp_testbed::offload_to_host", "autosp_testbed::reload_from_host", "Memcpy DtoH",
                  "Memcpy HtoD")
RING_COMPUTE = "autosp.ring."


@dataclass(frozen=True)
class ProfiledOp:
    """One op or kernel name the profiler saw, where it ran, how often."""

    name: str
    ring_block: str = ""
    """The ring attention range it ran in (``autosp.ring.forward.compute``), empty outside one."""
    quadratic: bool = False
    """It read a 4-D tensor whose last two dims both reach the case's `Case.quadratic_from`."""
    device: bool = False
    """A device kernel (CUDA), not an op seen on the host."""
    in_fused_attention: bool = False
    """A device kernel a fused attention op launched (its internals are not judged by name)."""
    count: int = 1


def profiled_ops(prof, quadratic_from: int) -> list[ProfiledOp]:
    """The ops and kernels of a ``torch.profiler.profile`` run (recorded with ``record_shapes=True``), counted."""
    counts: Counter = Counter()
    events = list(prof.events())
    fused = {k.name for e in events if e.name.startswith(FUSED_ATTENTION) for k in getattr(e, "kernels", None) or ()}
    for event in events:
        name = event.name
        block, parent = "", event.cpu_parent
        while parent is not None:
            if parent.name.startswith(RING_COMPUTE) and ".compute." in parent.name:
                block = parent.name.rsplit(".", 1)[0]
                break
            parent = parent.cpu_parent
        on_device = "cuda" in str(getattr(event, "device_type", "")).lower()
        shapes = event.input_shapes if isinstance(event.input_shapes, list) else []
        quadratic = name.startswith("aten::") and any(
            isinstance(s, list) and len(s) == 4 and all(isinstance(d, int) for d in s) and min(s[2:]) >= quadratic_from
            for s in shapes)
        counts[(name, block, quadratic, on_device, on_device and name in fused)] += 1
        for kernel in getattr(event, "kernels", None) or ():  # device kernels a host op launched
            counts[(kernel.name, block, False, True, kernel.name in fused)] += 1
    return [ProfiledOp(n, b, q, d, f, c) for (n, b, q, d, f), c in sorted(counts.items())]


class _Judged:
    """A section's record (a dataclass with a ``problems`` field): it passed when ``problems`` is empty."""

    problems: list[str]

    @property
    def passed(self) -> bool:
        return not self.problems


@dataclass
class KernelCheck(_Judged):
    """Section (b) for one case: the kernels listed by kind, and what is wrong."""

    case: str
    attention: list[str]
    ring_blocks: list[str]
    flex_attention: list[str]
    offload_copies: list[str]
    problems: list[str]
    notes: list[str] = field(default_factory=list)
    """What is worth knowing and not wrong (the control: what the check rejected, as it must)."""


def _softmax(op: ProfiledOp) -> bool:
    """An attention softmax: an aten op or a device kernel named softmax (not one a fused attention op launched),
    not the loss's log-softmax (autograd's node names, ``SafeSoftmaxBackward0``, repeat the aten ops: not read)."""
    lowered = op.name.lower()
    return ((op.name.startswith("aten::") or op.device and not op.in_fused_attention) and "softmax" in lowered
            and not any(log in lowered for log in ("log_softmax", "logsoftmax")))


def check_kernels(case: str, ops: list[ProfiledOp], *, ring: bool = False, offload: bool = False) -> KernelCheck:
    """Section (b)'s verdict on the ops of one compiled step (`profiled_ops`): a fused attention forward and
    backward, no math or quadratic path; with ``ring``, ring blocks of fused attention; with ``offload``, the
    activation-offload copies."""
    names = sorted({op.name for op in ops})
    fused = [n for n in names if n.startswith(FUSED_ATTENTION)]
    attention = fused + sorted({op.name for op in ops if op.device and any(k in op.name.lower() for k in (
        "flash", "fmha", "attention"))} - set(fused))
    blocks = sorted({f"{op.name} in {op.ring_block}" for op in ops
                     if op.ring_block and (op.name.startswith(FUSED_ATTENTION) or op.name in RING_MATH)})
    flex = [n for n in names if "flex" in n.lower()]
    copies = [n for n in names if n.startswith(OFFLOAD_COPIES)]
    problems = []
    math_ops = [n for n in names if n.startswith(MATH_ATTENTION)]
    if math_ops:
        problems.append(f"math attention: {', '.join(math_ops)}")
    softmax = sorted({op.name for op in ops if _softmax(op)})
    if softmax:
        problems.append(f"a softmax outside fused attention (matmul + softmax attention): {', '.join(softmax)}")
    in_ring = sorted({f"{op.name} in {op.ring_block}" for op in ops if op.ring_block and op.name in RING_MATH})
    if in_ring:
        problems.append(f"ring blocks computed as plain matmuls: {', '.join(in_ring)}")
    quadratic = sorted({op.name for op in ops if op.quadratic})
    if quadratic:
        problems.append(f"quadratic tensors ([.., S, S]) read by {', '.join(quadratic)}")
    for phase, present in (("forward", any("backward" not in n for n in fused)),
                           ("backward", any("backward" in n for n in fused))):
        if not present:
            problems.append(f"no fused attention op in the {phase}")
    if ring and not any(op.ring_block and op.name.startswith(FUSED_ATTENTION) for op in ops):
        problems.append("no ring block ran a fused attention kernel")
    if offload and not copies:
        problems.append("the plan offloads activations and no offload copy ran")
    return KernelCheck(case=case, attention=attention, ring_blocks=blocks, flex_attention=flex, offload_copies=copies,
                       problems=problems)


def math_control_ops(device: str) -> list[ProfiledOp]:
    """The profiled ops of causal SDPA forward and backward with the math backend forced, on ``device``: what
    section (b) must reject."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    q, k, v = (torch.randn(1, 4, 128, 16, device=device, requires_grad=True) for _ in range(3))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof, sdpa_kernel(SDPBackend.MATH):
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
    return profiled_ops(prof, quadratic_from=64)


# --- the ranks ------------------------------------------------------------------------------------------------


def _compare(loss, ref_loss, grads: dict, ref_grads: dict, tol: dict) -> dict:
    """Loss and every gradient against the single-device ones, as tests/autosp/test_equivalence.py compares them:
    the failures and the worst error as a fraction of its tolerance (<= 1 passes)."""
    import torch

    def scaled(ref):
        atol = tol["atol"] * (float(ref.detach().abs().max().float()) if tol.get("relative_to_scale") else 1.0)
        return tol["rtol"], atol

    failures, worst = [], ("", 0.0)
    pairs = [("loss", loss, ref_loss), *((n, grads.get(n), r) for n, r in ref_grads.items())]
    if grads.keys() != ref_grads.keys():
        failures.append(f"gradients of {sorted(set(grads) ^ set(ref_grads))} on one side only")
    for name, got, ref in pairs:
        if got is None:
            continue
        if name != "loss" and not bool(ref.abs().max() > 0):
            failures.append(f"{name}: the single-device gradient is zero (the comparison would be vacuous)")
            continue
        rtol, atol = scaled(ref)
        got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
        ratio = float(((got - ref).abs() / (atol + rtol * ref.abs())).max())
        if ratio > worst[1]:
            worst = (name, ratio)
        try:
            torch.testing.assert_close(got, ref, rtol=rtol, atol=atol)
        except AssertionError as err:
            failures.append(f"{name}: {str(err).splitlines()[0]} ({str(err).splitlines()[1].strip()})")
    return {"failures": failures, "worst": worst, "loss": float(loss), "ref_loss": float(ref_loss)}


def _plan_facts(plan: dict | None) -> dict | None:
    """What section (c) reads of a compiled model's memory-plan decision (``report.memory_plan``)."""
    if not plan:
        return None
    chosen = plan["candidates"][plan["chosen"]] if plan.get("chosen") is not None else None
    return {"target_bytes": plan.get("target_memory_bytes"), "reason": plan.get("reason"),
            "options": plan.get("options"), "plan": chosen and chosen["plan"],
            "fits": bool(chosen and chosen["fits"]), "predicted_peak_bytes": chosen and chosen["peak_bytes"],
            "predicted_step_s": chosen and chosen["step_time_s"], "candidates": len(plan["candidates"])}


def _cases_on_rank(rank: int, world: int, cases: list[dict], device_kind: str) -> list[dict]:
    """Runs on every rank of one launch: `_case_on_rank` for each case (as dicts: they cross processes); a case
    that raises is reported with its traceback and the next one runs (every rank raises alike, or the launcher's
    deadline stops a rank left waiting in a collective)."""
    import traceback

    results = []
    for c in cases:
        try:
            results.append(_case_on_rank(rank, world, Case(**c), device_kind))
        except Exception:  # noqa: BLE001 - the case fails, with its story
            results.append({"case": c["name"], "rank": rank, "error": traceback.format_exc()})
    return results


def _case_on_rank(rank: int, world: int, case: Case, device_kind: str) -> dict:
    """Reference step, compiled step (exactness), timed steps, one peak-memory step, one profiled step, export."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import autosp
    from autosp.export import export_workload
    from experiments.cpu.peak_memory import PeakMemory
    from experiments.models import build_model, vocab_size

    cuda = device_kind == "cuda"
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 exactness: no TF32 on either side
        torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    torch._dynamo.reset()  # every case compiles afresh
    gc.collect()  # the previous case's models gone before this one's allocator peak
    if cuda:
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    reference = build_model(case.model, **case.sizes).to(device=device, dtype=getattr(torch, case.dtype))
    candidate = copy.deepcopy(reference)
    ids = torch.randint(0, vocab_size(reference), (1, case.seq_len), generator=torch.Generator().manual_seed(1234))
    ids = ids.to(device)
    ref_loss = reference(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters() if p.grad is not None}
    ref_loss = ref_loss.detach()
    del reference

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="autosp.compile with sp_size=1")
        compiled = autosp.compile(candidate, sp_size=world, compiler=case.compiler, **case.options)
    inputs = autosp.prepare_inputs(ids, labels=ids)
    loss = compiled(**inputs).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in candidate.named_parameters() if p.grad is not None}
    exact = _compare(loss.detach(), ref_loss, grads, ref_grads, case.tolerance)
    del grads, ref_grads, loss

    def step():
        compiled(**inputs).loss.backward()  # the output dropped after the forward, as the export assumes

    for _ in range(case.warmup):
        candidate.zero_grad(set_to_none=False)
        step()
    step_s = []
    for _ in range(case.steps):
        candidate.zero_grad(set_to_none=False)
        sync()
        dist.barrier()
        start = time.perf_counter()
        step()
        sync()
        step_s.append(time.perf_counter() - start)
    params = list(candidate.parameters())
    candidate.zero_grad(set_to_none=False)
    sync()
    dist.barrier()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        step()
        sync()
        peak = torch.cuda.max_memory_allocated(device)
    else:
        with PeakMemory(static=params + [p.grad for p in params]) as pm:
            step()
        peak = pm.peak_bytes
    candidate.zero_grad(set_to_none=False)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        step()
        sync()
    ops = profiled_ops(prof, case.quadratic_from)
    result = {"case": case.name, "rank": rank, "exact": exact, "step_s": step_s, "peak_bytes": peak,
              "ops": [dataclasses.asdict(op) for op in ops], "plan": _plan_facts(compiled.report.memory_plan),
              "options": {k: getattr(compiled.config, k) for k in (*PLAIN, "activation_offload", "strategy")}}
    if rank == 0:
        workload = export_workload(compiled.report.aot_graphs, name=f"gpu_validate {case.name}", sp_size=world,
                                   parameter_bytes=sum(p.numel() * p.element_size() for p in params),
                                   optimizer_bytes_per_parameter_byte=0.0, saved_freed_at_last_use=True)
        result["workload"] = workload.to_dict()
    dist.barrier()
    return result


# --- presets --------------------------------------------------------------------------------------------------


def preset_document(preset) -> dict:
    """A `simulator.hardware.HardwarePreset` in the layout `simulator.hardware.preset_from_dict` reads (that of
    ``simulator/presets/cpu_gloo.json``), with the host link a cluster file's node may add."""

    def link(spec):
        return None if spec is None else dataclasses.asdict(spec)

    device = preset.device
    document = {
        "name": preset.name, "calibrated": preset.calibrated, "notes": preset.notes, "sources": list(preset.sources),
        "devices_per_node": preset.devices_per_node, "intra_node_kind": preset.intra_node_kind,
        "collectives_in_flight": preset.collectives_in_flight,
        "device": {**{f.name: getattr(device, f.name) for f in dataclasses.fields(device) if f.name != "efficiency"},
                   "efficiency": {k: dataclasses.asdict(v) for k, v in device.efficiency.items()}},
        "intra_node": link(preset.intra_node),
    }
    if preset.host_link is not None:
        document["host_link"] = link(preset.host_link)
    if preset.host_memory_link is not None:
        document.update(host_memory_link=link(preset.host_memory_link), host_memory_kind=preset.host_memory_kind,
                        host_memory_bytes=preset.host_memory_bytes)
    if preset.architecture:
        document["architecture"] = preset.architecture
    return document


def base_document(preset_name: str) -> dict:
    """The document of the preset the cases are predicted on: the tracked cpu-gloo JSON as it is, a GPU preset
    through `preset_document`."""
    from simulator.hardware import CPU_GLOO_JSON, get_preset

    if preset_name == "cpu-gloo":
        return json.loads(CPU_GLOO_JSON.read_text(encoding="utf-8"))
    return preset_document(get_preset(preset_name))


def cluster_of(document: dict, world: int):
    """The simulator cluster of ``world`` ranks on one node of ``document``: cpu-gloo as the validation builds it
    (`experiments.calibration.validate_simulator.cpu_gloo_cluster`: its fit per world size, the cores shared), a
    GPU preset as `simulator.hardware.preset_from_dict` reads it."""
    from experiments.calibration.validate_simulator import cpu_gloo_cluster
    from simulator import Cluster
    from simulator.hardware import preset_from_dict

    if document.get("intra_node_kind") == "loopback":
        return cpu_gloo_cluster(world, document)
    preset = preset_from_dict(document)
    return Cluster.from_preset(preset, devices_per_node=max(world, preset.devices_per_node))


# --- sections -------------------------------------------------------------------------------------------------


@dataclass
class Exactness(_Judged):
    """Section (a) for one case: the compiled step against single-device training, on every rank."""

    case: str
    world: int
    loss: float
    ref_loss: float
    worst: str
    """The gradient (or loss) nearest its tolerance, and how near (error / tolerance, <= 1 passes)."""
    problems: list[str]


@dataclass
class Prediction(_Judged):
    """Section (c) for one case: measured beside simulated, and the plan's fit."""

    case: str
    world: int
    preset: str
    measured_step_s: float
    simulated_step_s: float
    step_error_pct: float
    measured_peak_bytes: int
    simulated_peak_bytes: int
    peak_error_pct: float
    plan: dict | None
    """A planned case's decision (`_plan_facts`); the errors above are printed, never judged."""
    problems: list[str]


@dataclass
class Calibration(_Judged):
    """Section (d): the record written and read back."""

    path: str
    preset: str
    device: str
    step_factor: float
    problems: list[str]


def exactness(case: Case, per_rank: list[dict]) -> Exactness:
    problems = [f"rank {r['rank']}: {f}" for r in per_rank for f in r["exact"]["failures"]]
    worst = max((r["exact"]["worst"] for r in per_rank), key=lambda w: w[1])
    return Exactness(case=case.name, world=case.world, loss=per_rank[0]["exact"]["loss"],
                     ref_loss=per_rank[0]["exact"]["ref_loss"], worst=f"{worst[0]} at {worst[1]:.2g} of tolerance",
                     problems=problems)


def kernels(case: Case, per_rank: list[dict]) -> KernelCheck:
    ops = [ProfiledOp(**op) for r in per_rank for op in r["ops"]]
    options = per_rank[0]["options"]
    return check_kernels(case.name, ops, ring=options["strategy"] == "ring",
                         offload=options["activation_offload"] == "on")


def math_control(device: str) -> KernelCheck:
    """Section (b)'s control: SDPA with the math backend forced must fail the kernel check."""
    found = check_kernels("control: forced math SDPA", math_control_ops(device))
    problems = [] if found.problems else ["the kernel check passed a forced math path: it cannot see one"]
    return dataclasses.replace(found, problems=problems, notes=[f"rejected as it must: {p}" for p in found.problems])


def _error_pct(simulated: float, measured: float) -> float:
    return 100.0 * (simulated - measured) / measured if measured > 0 else math.nan


def _simulate(workload: dict, document: dict, world: int):
    from simulator import Workload, simulate

    return simulate(Workload.from_dict(workload), cluster_of(document, world))


def prediction(case: Case, per_rank: list[dict], preset: str, document: dict, *, on_gpu: bool) -> Prediction:
    """The measured step (median of the slowest rank's) and peak (the largest rank's) beside the simulation of
    rank 0's exported graphs on ``document``; a planned case's plan must fit."""
    measured_s = statistics.median(max(r["step_s"][i] for r in per_rank) for i in range(case.steps))
    measured_peak = max(r["peak_bytes"] for r in per_rank)
    result = _simulate(per_rank[0]["workload"], document, case.world)
    simulated_peak = max(r.peak_memory_bytes for r in result.ranks)
    plan, problems = per_rank[0]["plan"], []
    if case.plan_below_plain:
        if plan is None or plan["plan"] is None:
            problems.append(f"no plan chosen: {plan and plan['reason']}")
        else:
            if not plan["fits"]:
                problems.append(f"the chosen plan {plan['plan']} does not fit by its own prediction")
            if all(plan["options"].get(k) == v for k, v in PLAIN.items()) and plan["options"].get(
                    "activation_offload", "off") == "off":
                problems.append(f"the target is below the plain step's peak and the plan chose no technique: "
                                f"{plan['options']}")
            if on_gpu and measured_peak > plan["target_bytes"]:
                problems.append(f"the chosen plan {plan['plan']} measured {measured_peak:,} bytes at its peak, above "
                                f"its target of {plan['target_bytes']:,}")
    return Prediction(case=case.name, world=case.world, preset=preset, measured_step_s=measured_s,
                      simulated_step_s=result.step_time_s, step_error_pct=_error_pct(result.step_time_s, measured_s),
                      measured_peak_bytes=measured_peak, simulated_peak_bytes=simulated_peak,
                      peak_error_pct=_error_pct(simulated_peak, measured_peak), plan=plan,
                      problems=problems)


def fit_step_factor(document: dict, runs: list[tuple[Case, dict, float]]) -> float:
    """The factor on the preset's compute times (`apply_step_factor`) that makes the median of the cases'
    simulated / measured step times 1 (bisection: a case's simulated time grows with the factor). ``runs``:
    (case, exported workload, measured seconds)."""
    from experiments.calibration.calibrate_cpu import apply_step_factor
    from simulator import Workload, simulate

    workloads = [(case, Workload.from_dict(w), measured) for case, w, measured in runs]

    def median_ratio(factor: float) -> float:
        scaled = apply_step_factor(document, factor)
        return statistics.median(simulate(w, cluster_of(scaled, case.world), validate=False).step_time_s / measured
                                 for case, w, measured in workloads)

    low, high = 1 / 64, 64.0
    if median_ratio(low) > 1 or median_ratio(high) < 1:
        return math.nan
    for _ in range(30):
        middle = math.sqrt(low * high)
        low, high = (middle, high) if median_ratio(middle) < 1 else (low, middle)
    return math.sqrt(low * high)


def calibration(preset: str, document: dict, predictions: list[Prediction], runs: list[tuple[Case, dict, float]],
                device: dict, out: Path) -> Calibration:
    """Section (d): write ``out/calibration/PRESET.json`` and read it back as the presets and cluster files do."""
    from autosp.plan.cluster_file import cluster_from_dict
    from experiments.calibration.calibrate_cpu import apply_step_factor
    from simulator.hardware import preset_from_dict

    problems = []
    base = copy.deepcopy(document)
    base.setdefault("calibration", {})
    factor = fit_step_factor(base, runs) if runs else math.nan
    if not math.isfinite(factor):
        problems.append("no compute factor in 1/64..64 brings the simulated steps to the measured ones")
    record = apply_step_factor(base, factor) if math.isfinite(factor) else base
    before = document.get("calibration", {}).get("step_factor", 1.0)
    record["device"]["name"] = device["name"]
    record["calibrated"] = True
    record["sources"] = [*record.get("sources", []), "python -m experiments.gpu_validate"]
    record["calibration"] = {
        **record["calibration"], "date": datetime.date.today().isoformat(), "device": device,
        "preset": preset, "step_factor": before * factor if math.isfinite(factor) else before,
        "step_factor_of_this_run": factor,
        "cases": [{"case": p.case, "world": p.world, "measured_step_s": p.measured_step_s,
                   "simulated_step_s": p.simulated_step_s, "measured_peak_bytes": p.measured_peak_bytes,
                   "simulated_peak_bytes": p.simulated_peak_bytes} for p in predictions],
        "timings_judged": False,  # printed beside the simulation, never judged: this record is what they give
    }
    path = out / "calibration" / f"{preset}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    try:  # read back as the presets and a cluster file's node read it
        read = json.loads(path.read_text(encoding="utf-8"))
        preset_from_dict(read)
        if read.get("intra_node_kind") != "loopback":  # cpu-gloo's host memory is RAM, no cluster-file kind
            cluster_from_dict({"node": read})
        for case, workload, _ in runs:
            _simulate(workload, read, case.world)
    except Exception as err:  # noqa: BLE001 - a failed check, reported
        problems.append(f"the record cannot be read back: {type(err).__name__}: {err}")
    return Calibration(path=str(path), preset=preset, device=device["name"], step_factor=factor, problems=problems)


# --- the run --------------------------------------------------------------------------------------------------


def plain_peak(case: Case, preset: str, folder: Path) -> int:
    """The predicted peak of ``case`` with no memory technique (`PLAIN`), as ``autosp.compile``'s planner prices the
    job (tests/autosp/test_memory_plan.py's baseline)."""
    from autosp.plan import TrainingSetup, load_cluster, predict
    from autosp.plan.setup import DECIDING_DEPTH
    from experiments.models import build_model

    path = folder / f"{case.name}.json"
    path.write_text(build_model(case.model, **case.sizes).config.to_json_string(use_diff=False), encoding="utf-8")
    setup = TrainingSetup(seq_len=case.seq_len, sp_size=case.world, micro_batch=1,
                          dtype="fp32" if case.dtype == "float32" else "bf16", compiler=case.compiler, zero_stage=0,
                          depth=DECIDING_DEPTH)  # the depth the planner decides at
    return predict(str(path), setup, load_cluster(preset, world_size=case.world), options=PLAIN).peak_bytes


def run_cases(selected: list[Case], device_kind: str, preset: str, deadline: float) -> dict[str, list[dict] | str]:
    """Every case on its ranks (one launch per world size): case name -> per-rank results, or the error."""
    from experiments import gpu_validate  # the ranks import the function by this name, also under python -m
    from experiments.launch import RankFailure, run_on_ranks

    out: dict[str, list[dict] | str] = {}
    with tempfile.TemporaryDirectory() as folder:
        prepared = []
        for case in selected:
            if case.plan_below_plain:
                try:
                    target = plain_peak(case, preset, Path(folder)) - 1
                except Exception as err:  # noqa: BLE001 - the case fails, the others run
                    out[case.name] = f"failed: the plain step's peak could not be predicted: {type(err).__name__}: {err}"
                    continue
                case = dataclasses.replace(case, options={**case.options, "memory_plan": "auto",
                                                          "target_memory": target})
            prepared.append(case)
    for world in sorted({c.world for c in prepared}):
        group = [c for c in prepared if c.world == world]
        left = deadline - time.monotonic()
        if left <= 0:
            out.update({c.name: "not run: over the time budget" for c in group})
            continue
        try:
            per_rank = run_on_ranks(gpu_validate._cases_on_rank, world, [dataclasses.asdict(c) for c in group],
                                    device_kind, timeout_s=left, collective_timeout_s=min(600.0, left),
                                    backend="nccl" if device_kind == "cuda" else "gloo")
        except RankFailure as err:
            out.update({c.name: f"failed: {err}" for c in group})
            continue
        for i, case in enumerate(group):
            errors = [r[i] for r in per_rank if "error" in r[i]]
            out[case.name] = [r[i] for r in per_rank] if not errors else \
                "failed: " + "".join(f"--- rank {e['rank']} ---\n{e['error']}" for e in errors)
    return out


def device_facts(device_kind: str) -> dict:
    """The record's ``device``: what ran the cases."""
    import torch

    if device_kind == "cuda":
        return {"type": "cuda", "name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count(),
                "torch": torch.__version__, "cuda": torch.version.cuda}
    return {"type": "cpu", "name": f"cpu process ({platform.machine()}, 1 thread)", "count": os.cpu_count(),
            "processor": platform.processor() or platform.machine(), "torch": torch.__version__}


def _mib(n: float) -> str:
    return f"{n / 2**20:.3f}"


def summary_rows(results: dict) -> list[dict]:
    """One row per check: section, case, passed, what was seen."""
    rows = []
    for e in results["exactness"]:
        rows.append({"section": "a exactness", "case": e["case"], "passed": e["passed"],
                     "detail": f"loss {e['loss']:.6g} vs {e['ref_loss']:.6g}; worst {e['worst']}"
                               + "".join(f"; {p}" for p in e["problems"][:3])})
    for k in results["kernels"]:
        seen = "; ".join(f"{label}: {', '.join(k[key]) or '-'}" for label, key in (
            ("attention", "attention"), ("ring blocks", "ring_blocks"), ("flex", "flex_attention"),
            ("offload copies", "offload_copies")))
        rows.append({"section": "b kernels", "case": k["case"], "passed": k["passed"],
                     "detail": seen + "".join(f"; {p}" for p in k["problems"] + k["notes"])})
    for p in results["prediction"]:
        judged = " (not judged on CPU)" if results["device"]["type"] == "cpu" else " (errors printed, not judged)"
        plan = p["plan"]
        plan_text = "" if not plan else (f"; plan {plan['plan']} (predicted peak {_mib(plan['predicted_peak_bytes'] or 0)}"
                                         f" MiB, target {_mib(plan['target_bytes'] or 0)} MiB, fits: {plan['fits']})")
        rows.append({"section": "c prediction", "case": p["case"], "passed": p["passed"],
                     "detail": f"{p['preset']}: step {p['measured_step_s'] * 1e3:.2f} ms measured, "
                               f"{p['simulated_step_s'] * 1e3:.2f} ms simulated ({p['step_error_pct']:+.1f} %); "
                               f"peak {_mib(p['measured_peak_bytes'])} MiB measured, "
                               f"{_mib(p['simulated_peak_bytes'])} MiB simulated ({p['peak_error_pct']:+.1f} %)"
                               f"{judged}{plan_text}" + "".join(f"; {x}" for x in p["problems"])})
    c = results.get("calibration")
    if c:
        rows.append({"section": "d calibration", "case": c["preset"], "passed": c["passed"],
                     "detail": f"{c['path']} (device {c['device']}, compute factor {c['step_factor']:.3g})"
                               + "".join(f"; {p}" for p in c["problems"])})
    for name, error in results["errors"].items():
        lines = [line.strip() for line in error.splitlines() if line.strip()]
        headline = lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}"  # the exception: the last line
        rows.append({"section": "run", "case": name, "passed": False, "detail": headline[:400]})
    return rows


def validate(*, cpu_only: bool, out: Path, budget_s: float = BUDGET_S, only: list[str] | None = None) -> dict:
    """Run every section; the results as a JSON-ready dict (``passed``: every check passed)."""
    import torch

    from autosp.plan.auto import default_cluster

    start = time.monotonic()
    device_kind = "cpu" if cpu_only else "cuda"
    preset = default_cluster(torch.device(device_kind, 0) if device_kind == "cuda" else torch.device("cpu"))
    gpus = torch.cuda.device_count() if device_kind == "cuda" else 0
    selected = [c for c in cases(device_kind, gpus) if not only or c.name in only]
    document = base_document(preset)
    ran = run_cases(selected, device_kind, preset, start + budget_s)
    results: dict = {"mode": "cpu-only" if cpu_only else "gpu", "device": device_facts(device_kind), "preset": preset,
                     "cases": [dataclasses.asdict(c) for c in selected], "exactness": [], "kernels": [],
                     "prediction": [], "calibration": None, "errors": {}}
    predictions, runs = [], []
    for case in selected:
        per_rank = ran.get(case.name)
        if not isinstance(per_rank, list):
            results["errors"][case.name] = str(per_rank)
            continue
        for section, record in (("exactness", exactness(case, per_rank)), ("kernels", kernels(case, per_rank))):
            results[section].append({**dataclasses.asdict(record), "passed": record.passed})
        p = prediction(case, per_rank, preset, document, on_gpu=not cpu_only)
        predictions.append(p)
        runs.append((case, per_rank[0]["workload"], p.measured_step_s))
        (out / "workloads").mkdir(parents=True, exist_ok=True)  # python -m simulator runs them on any preset
        (out / "workloads" / f"{case.name}.json").write_text(json.dumps(per_rank[0]["workload"]), encoding="utf-8")
        results["prediction"].append({**dataclasses.asdict(p), "passed": p.passed})
    control = math_control(device_kind)
    results["kernels"].append({**dataclasses.asdict(control), "passed": control.passed})
    if predictions:
        c = calibration(preset, document, predictions, runs, results["device"], out)
        results["calibration"] = {**dataclasses.asdict(c), "passed": c.passed}
    if not cpu_only and time.monotonic() - start > budget_s:
        results["errors"]["budget"] = f"the run took {time.monotonic() - start:.0f} s, over its {budget_s:.0f} s budget"
    results["elapsed_s"] = time.monotonic() - start
    results["summary"] = summary_rows(results)
    results["passed"] = bool(results["summary"]) and all(r["passed"] for r in results["summary"])
    return results


def write_outputs(results: dict, out: Path) -> None:
    """``gpu_validate.json`` and ``summary.csv``/``summary.md`` in ``out``."""
    from experiments.tables import write_table

    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_validate.json").write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")
    write_table("summary", results["summary"], out,
                footer=[f"{'PASSED' if results['passed'] else 'FAILED'}: {results['mode']} on {results['device']['name']}"
                        f", preset {results['preset']}, {results['elapsed_s']:.0f} s"])


def build_parser() -> argparse.ArgumentParser:
    from experiments import cli

    parser = cli.parser("experiments.gpu_validate", __doc__.split("\n\n")[0])
    parser.add_argument("--cpu-only", action="store_true",
                        help="run the sections on CPU gloo ranks (CI): everything but the GPU measurements; CPU "
                             "timings are printed, not judged")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="folder for gpu_validate.json, summary.csv/.md and calibration/PRESET.json")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                        help="time budget of the whole run in seconds: ranks still running when it is spent are "
                             "stopped and their cases fail")
    parser.add_argument("--only", nargs="+", default=None, choices=CASE_NAMES, metavar="CASE",
                        help="run only these cases (CPU: sp2-ulysses sp2-ring sp1-planned; GPU: sp1-planned sp1-bf16,"
                             " with two or more GPUs also sp2-ulysses sp2-ring sp2-bf16)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        parser.error(f"--budget-s {args.budget_s}: give a positive number of seconds")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    import torch

    if not args.cpu_only and not torch.cuda.is_available():
        print("gpu_validate: no CUDA GPU visible (torch.cuda.is_available() is False); run it on a GPU machine "
              "with a CUDA build of torch, or pass --cpu-only", file=sys.stderr)
        return 1
    runnable = {c.name for c in cases("cpu" if args.cpu_only else "cuda", torch.cuda.device_count())}
    if args.only and not runnable & set(args.only):
        parser.error(f"--only {' '.join(args.only)}: none of these runs here; choose from {' '.join(sorted(runnable))}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from autosp.errors import AutoSPError

    try:
        results = validate(cpu_only=args.cpu_only, out=args.out, budget_s=args.budget_s, only=args.only)
    except AutoSPError as err:  # e.g. a GPU without a hardware preset (autosp.plan.auto.GPU_PRESETS)
        print(f"gpu_validate: {err}", file=sys.stderr)
        return 1
    write_outputs(results, args.out)
    from experiments.tables import markdown_table

    print(markdown_table(results["summary"]))
    print(f"\n{'PASSED' if results['passed'] else 'FAILED'} in {results['elapsed_s']:.0f} s; wrote "
          f"{args.out / 'gpu_validate.json'} and {args.out / 'summary.md'}")
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
