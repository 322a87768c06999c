"""Validate AutoSP on this machine's GPU in one command: exactness, kernels, prediction, calibration record.

``python -m experiments.gpu_validate [--out results/gpu_validate]`` on a CUDA machine (under ten minutes on one GPU;
the sequence-parallel cases run only where there are two or more GPUs), ``python -m experiments.gpu_validate
--cpu-only`` anywhere (CI): the same sections on CPU gloo ranks, CPU timings not judged. Each case of `cases`
(`case_set`) is run on real ranks by `experiments.launch.run_on_ranks` (gloo on CPU, NCCL with one GPU per rank;
what a rank runs: `ranks`), and four sections, one module each, read what the ranks report:

(a) exactness (`section_exactness`): the compiled step (``autosp.compile``, Inductor on the GPU, ``aot_eager`` on
    CPU) against the same step of the uncompiled model on one device over the whole sequence: the loss and every
    gradient within the case's tolerance (fp32: rtol 1e-4, atol 1e-6 on CPU; on the GPU atol relative to the
    gradient's scale, since the kernels differ from eager's; bf16: `BF16_TOL`). Sequence parallelism over 2 gloo
    ranks on CPU, over NCCL with 2 GPUs; at SP 1 with ``memory_plan="auto"`` and a target one byte below the
    predicted peak of the step with no memory technique, so the planner must choose one (tiled loss or MLP, SAC,
    activation offload).
(b) kernels (`section_kernels`): ``torch.profiler`` over one compiled step lists the attention kernels, the ring
    attention's blocks (the ops inside its ``autosp.ring.*.compute.*`` ranges), flex attention and the
    activation-offload copies, and fails on a math path (``aten::_scaled_dot_product_attention_math``, a softmax
    outside the loss, a matmul or log-sum-exp inside a ring block) or a quadratic one (an op reading a
    [B, H, S, S]-shaped tensor), and when no fused attention ran forward and backward. A control forces SDPA's math
    backend on the same device: the check must reject it.
(c) prediction (`section_prediction`): each case's measured step (median of the timed steps after warm-up, the
    slowest rank's) and peak memory (``torch.cuda.max_memory_allocated``; on CPU
    `experiments.cpu.peak_memory.PeakMemory`) beside the simulator's step time and peak of the same compiled graphs
    (`autosp.export.export_workload`) on the matching preset (`autosp.plan.auto.default_cluster`: the GPU's by
    name, ``cpu-gloo`` on CPU; its document and cluster: `presets`), errors printed, not judged; a planned case's
    chosen plan must fit its target (by its prediction, and on the GPU by the measured allocator peak).
(d) calibration (`section_calibration`): ``calibration/PRESET.json``, the preset in the layout
    `simulator.hardware.preset_from_dict` reads (that of ``simulator/presets/cpu_gloo.json``; a cluster file's
    ``node`` reads it too) with its compute times scaled by the factor that makes the median case's simulated step
    equal its measured one (`experiments.calibration.calibrate_cpu.apply_step_factor`), and a ``calibration`` block
    naming the device and holding every case's measured and simulated numbers; it is read back to check.

A summary table is printed and written with the JSON record (``gpu_validate.json``) and each case's exported
workload (``workloads/CASE.json``) under ``--out`` (`report`); the exit status is 1 when any check failed. The run
within its budget: `run`; the command line: `command` (``__main__`` runs it). Every public name of these modules
is importable from this package.
"""

from __future__ import annotations

from experiments.gpu_validate.case_set import (
    BF16_TOL,
    CASE_NAMES,
    FP32_TOL,
    GPU_FP32_TOL,
    MEDIUM_GPU,
    PLAIN,
    SMALL_GPU,
    TINY_CPU,
    Case,
    Judged,
    cases,
)
from experiments.gpu_validate.command import DEFAULT_OUT, build_parser, main
from experiments.gpu_validate.presets import base_document, cluster_of, preset_document, simulate_on
from experiments.gpu_validate.ranks import case_on_rank, cases_on_rank
from experiments.gpu_validate.report import summary_rows, write_outputs
from experiments.gpu_validate.run import BUDGET_S, device_facts, plain_peak, run_cases, validate
from experiments.gpu_validate.section_calibration import Calibration, calibration, fit_step_factor
from experiments.gpu_validate.section_exactness import Exactness, compare_with_reference, exactness
from experiments.gpu_validate.section_kernels import (
    FUSED_ATTENTION,
    MATH_ATTENTION,
    OFFLOAD_COPIES,
    RING_COMPUTE,
    RING_MATH,
    KernelCheck,
    ProfiledOp,
    check_kernels,
    kernels,
    math_control,
    math_control_ops,
    profiled_ops,
)
from experiments.gpu_validate.section_prediction import Prediction, plan_facts, prediction

__all__ = [
    "BF16_TOL", "BUDGET_S", "CASE_NAMES", "DEFAULT_OUT", "FP32_TOL", "FUSED_ATTENTION", "GPU_FP32_TOL",
    "MATH_ATTENTION", "MEDIUM_GPU", "OFFLOAD_COPIES", "PLAIN", "RING_COMPUTE", "RING_MATH", "SMALL_GPU", "TINY_CPU",
    "Calibration", "Case", "Exactness", "Judged", "KernelCheck", "Prediction", "ProfiledOp",
    "base_document", "build_parser", "calibration", "case_on_rank", "cases", "cases_on_rank", "check_kernels",
    "cluster_of", "compare_with_reference", "device_facts", "exactness", "fit_step_factor", "kernels", "main",
    "math_control", "math_control_ops", "plain_peak", "plan_facts", "prediction", "preset_document", "profiled_ops",
    "run_cases", "simulate_on", "summary_rows", "validate", "write_outputs",
]
