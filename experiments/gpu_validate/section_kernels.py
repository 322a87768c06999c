"""Section (b), kernels: what ``torch.profiler`` saw in one compiled step (`profiled_ops`) and the verdict on it
(`check_kernels`): fused attention forward and backward, no math or quadratic path, ring blocks of fused attention,
the activation-offload copies; and the control that forces SDPA's math backend, which the check must reject
(`math_control`).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

from experiments.gpu_validate.case_set import Case, Judged

FUSED_ATTENTION = ("aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
                   "aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_fused_attention",
                   "aten::_flash_attention", "aten::_efficient_attention", "aten::_cudnn_attention")
"""Name prefixes of the fused attention ops (the CPU flash kernel's ``..._for_cpu`` included; backward ops end in
``_backward``)."""
MATH_ATTENTION = ("aten::_scaled_dot_product_attention_math",)
RING_MATH = frozenset(("aten::matmul", "aten::bmm", "aten::baddbmm", "aten::logsumexp", "aten::softmax",
                       "aten::_softmax", "aten::_safe_softmax"))
"""Ops that inside a ring block mean its attention runs as plain matmuls (`autosp.ring_block_kernels._math_forward`)."""
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


@dataclass
class KernelCheck(Judged):
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
