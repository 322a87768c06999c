"""The kernel each ring attention block runs, forward and backward, and the one function that chooses it.

A block is one fused attention call of a ring step (`autosp.ring_attention.blocks` cuts the steps into them, Note
[Ring attention] in autosp/ring_attention.py): attention of some query chunks over some key chunks that returns
its output and the row-wise log-sum-exp, and a backward given the final output and log-sum-exp of its query rows.
This module names the kernels (`BlockKernel`), chooses one for a device, dtype and head dimension
(`block_kernel`), and runs it (`block_forward`, `block_backward`); the ring's schedule and its custom ops are
autosp/ring_attention.py's.

Note [Ring block kernels]
~~~~~~~~~~~~~~~~~~~~~~~~~
One function, `block_kernel(device, dtype, head_dim, masked=...)`, names the kernel every block runs, forward and
backward, on every device; the run calls what it names and the export (Note [Ring attention in the export] in
autosp/export_ring.py) prices and names the same, asking it of the traced device and dtype.  The kernels are the
fused attention ops that return the log-sum-exp, called directly (not through scaled_dot_product_attention, which
returns no log-sum-exp):
- CPU (fp32, fp64, fp16, bf16): ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward; it takes
  the document mask.
- CUDA, in scaled_dot_product_attention's order: ``_scaled_dot_product_flash_attention`` (sm80+, fp16/bf16, head
  dimension a multiple of 8 up to 256, up to 192 on sm86/sm89; no mask), ``_scaled_dot_product_efficient_attention``
  (sm50+, fp32/fp16, bf16 on sm80+, head dimension aligned as sdp_utils asks; takes the mask, rows padded to 16
  elements as scaled_dot_product_attention pads them, and returns the log-sum-exp padded to 32 rows), then
  ``_scaled_dot_product_cudnn_attention`` (sm80+, fp16/bf16, head dimension a multiple of 8 up to 128, cuDNN 9),
  each with its backward op, each only where ``torch.backends.cuda``'s switch for it is on (`CudaDevice`; tests
  inject a capability).  The backward ops get the *final* O and L and no dropout, so the dropout seed and offset
  they take are empty and the variable-length arguments None.
- The math path ([Lq, Lk] scores in fp32, fp64 for fp64 inputs: `MATH_SCORE_BUFFERS` such buffers at once)
  only where no fused kernel serves (a device without one, fp64 on CUDA, a head dimension none takes), with a
  `MathBlockWarning` naming that cost.  It is exact, but quadratic in the block length.
A masked block (packed documents) sets ``masked``: flash cannot take it, so a CUDA device runs such blocks on the
memory-efficient kernel and the others on flash; a row a masked call leaves without keys gets output 0 and
log-sum-exp -inf whatever the kernel reports.
"""

from __future__ import annotations

import enum
import functools
import warnings
from dataclasses import dataclass

import torch

__all__ = ["CUDA_KERNELS", "MATH_SCORE_BUFFERS", "MATH_SCORE_TRAFFIC", "BlockKernel", "CudaDevice",
           "MathBlockWarning", "accumulator_dtype", "block_backward", "block_forward", "block_kernel"]


class BlockKernel(str, enum.Enum):
    """The kernel one ring block runs, forward and backward (Note [Ring block kernels]); `block_kernel` chooses it,
    the run calls it (`block_forward`, `block_backward`) and the export prices and names it
    (autosp/export_ring.py)."""

    FLASH_CPU = "flash_cpu"
    FLASH_CUDA = "flash_cuda"
    EFFICIENT_CUDA = "efficient_cuda"
    CUDNN_CUDA = "cudnn_cuda"
    MATH = "math"

    @property
    def fused(self) -> bool:
        """Whether the kernel keeps no [Lq, Lk] score block (every kernel but the math path)."""
        return self is not BlockKernel.MATH


CUDA_KERNELS = (BlockKernel.FLASH_CUDA, BlockKernel.EFFICIENT_CUDA, BlockKernel.CUDNN_CUDA)
"""The fused CUDA kernels, in the order `block_kernel` prefers them (scaled_dot_product_attention's own order,
cuDNN after memory-efficient; the math path last)."""

_HALF = (torch.float16, torch.bfloat16)
_CPU_FLASH_DTYPES = (torch.float32, torch.float64, *_HALF)


class MathBlockWarning(UserWarning):
    """A ring block runs the math path: no fused kernel returning the log-sum-exp serves its device and dtype."""


@dataclass(frozen=True)
class CudaDevice:
    """What `block_kernel` asks of a CUDA device: its compute capability (major, minor) and which of
    scaled_dot_product_attention's fused backends are enabled and built (``torch.backends.cuda.*_sdp_enabled()``;
    cuDNN also needs cuDNN >= 9).  `of` reads a real device; a test or a price for a GPU that is not here passes
    its own."""

    capability: tuple[int, int]
    flash: bool = True
    efficient: bool = True
    cudnn: bool = True

    @classmethod
    def of(cls, device: torch.device) -> CudaDevice:
        """The device's own; where no CUDA device is present (a trace on fake CUDA tensors), an H100 (sm90, the
        simulator's reference GPU) under this process's ``torch.backends.cuda`` switches."""
        cuda = torch.backends.cuda
        if not torch.cuda.is_available():
            return cls((9, 0), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.cudnn_sdp_enabled())
        cudnn = torch.backends.cudnn
        return cls(tuple(torch.cuda.get_device_capability(device)),
                   cuda.flash_sdp_enabled() and cuda.is_flash_attention_available(),
                   cuda.mem_efficient_sdp_enabled(),
                   cuda.cudnn_sdp_enabled() and cudnn.is_available() and (cudnn.version() or 0) >= 90000)


def _cuda_refusal(kernel: BlockKernel, cuda: CudaDevice, dtype: torch.dtype, head_dim: int, masked: bool
                  ) -> str | None:
    """Why ``kernel`` cannot run a block on ``cuda`` (None: it can), by the checks scaled_dot_product_attention
    makes before it picks the same kernel (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp)."""
    cap, half = cuda.capability, dtype in _HALF
    if kernel is BlockKernel.FLASH_CUDA:
        if not cuda.flash:
            return "flash disabled"
        if (refusal := _sm80_half_refusal("flash", cap, dtype, head_dim, 256)) is not None:
            return refusal
        if head_dim > 192 and cap in ((8, 6), (8, 9)):
            return "flash's backward on sm86/sm89 takes a head dimension up to 192"
        if masked:
            return "flash takes no additive mask"
        return None
    if kernel is BlockKernel.EFFICIENT_CUDA:
        if not cuda.efficient:
            return "memory-efficient disabled"
        if cap < (5, 0):
            return f"memory-efficient needs sm50+, got sm{cap[0]}{cap[1]}"
        if dtype not in (torch.float32, *_HALF) or (dtype == torch.bfloat16 and cap < (8, 0)):
            return f"memory-efficient takes fp32/fp16 (and bf16 on sm80+), got {dtype}"
        tensor_cores = cap >= (8, 0) or (cap >= (7, 0) and half)
        alignment = max(4 if cap >= (8, 0) else 1, (8 if half else 4) if tensor_cores else 1)
        if head_dim % alignment:
            return f"memory-efficient takes a head dimension that is a multiple of {alignment}, got {head_dim}"
        return None
    if not cuda.cudnn:
        return "cuDNN disabled or older than 9"
    return _sm80_half_refusal("cuDNN attention", cap, dtype, head_dim, 128)


def _sm80_half_refusal(kernel: str, cap: tuple[int, int], dtype: torch.dtype, head_dim: int, max_head_dim: int
                       ) -> str | None:
    """The checks flash and cuDNN attention share: sm80+, fp16/bf16, a head dimension that is a multiple of 8 up
    to ``max_head_dim``."""
    if cap < (8, 0):
        return f"{kernel} needs sm80+, got sm{cap[0]}{cap[1]}"
    if dtype not in _HALF:
        return f"{kernel} takes fp16/bf16, got {dtype}"
    if head_dim % 8 or head_dim > max_head_dim:
        return f"{kernel} takes a head dimension that is a multiple of 8 up to {max_head_dim}, got {head_dim}"
    return None


def block_kernel(device: torch.device | str, dtype: torch.dtype, head_dim: int, *, masked: bool = False,
                 cuda: CudaDevice | None = None) -> BlockKernel:
    """The kernel a ring block of ``dtype`` queries with ``head_dim`` runs on ``device`` (Note [Ring block
    kernels]): the one function that chooses, for the run and for the export alike.  ``masked``: the block carries
    an additive document mask (`Documents.mask`).  ``cuda``: the CUDA device's capability and enabled backends
    (default `CudaDevice.of` the device).  The math path only where no fused kernel serves, with a
    `MathBlockWarning` naming its cost."""
    device = torch.device(device)
    if device.type == "cpu" and dtype in _CPU_FLASH_DTYPES:
        return BlockKernel.FLASH_CPU
    refusals = [f"{device.type} has no fused kernel returning the log-sum-exp"]
    if device.type == "cuda":
        cuda = cuda or CudaDevice.of(device)
        refusals = [_cuda_refusal(kernel, cuda, dtype, head_dim, masked) for kernel in CUDA_KERNELS]
        for kernel, refusal in zip(CUDA_KERNELS, refusals, strict=True):
            if refusal is None:
                return kernel
    acc = accumulator_dtype(dtype)
    warnings.warn(f"ring attention on {device} ({dtype}, head dimension {head_dim}{', masked' if masked else ''}) "
                  f"runs every block on the math path ({'; '.join(refusals)}): each block materialises {acc} "
                  f"[Lq, Lk] scores, B*H*Lq*Lk*{acc.itemsize} bytes, {MATH_SCORE_BUFFERS[False]} such buffers "
                  f"forward and {MATH_SCORE_BUFFERS[True]} backward, memory quadratic in the block length",
                  MathBlockWarning, stacklevel=2)
    return BlockKernel.MATH


MATH_SCORE_BUFFERS = {False: 2, True: 2}
"""[B, H, Lq, Lk] buffers (in the accumulator dtype) the math path holds at once, forward (the scores, turned into
the probabilities in place, and logsumexp's temporary) and backward (the probabilities; the gradient of the scores,
formed in place in their product with dO): what the export allocates for it (autosp/export_ring.py)."""

MATH_SCORE_TRAFFIC = {False: (3, 2), True: (6, 3)}
"""(reads, writes) of a whole [B, H, Lq, Lk] buffer the math path makes, forward (scores written; read by logsumexp,
turned into probabilities in place, read by the matmul) and backward (scores written, probabilities in place, read
for dV, dP written, its in-place turn into dS reads the probabilities, read for dQ and for dK); a causal flag and a
mask each add one read and one write: what the export prices it at."""


def _math_scores(q, k, causal: bool, scale: float, mask):
    """The block's scores q k^T * scale, causal and mask applied, in the accumulator dtype: the math path's one
    [B, H, Lq, Lk] buffer (every later step works in place on it)."""
    acc = accumulator_dtype(q.dtype)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)).mul_(scale)
    if causal:
        lq, lk = scores.shape[-2:]
        scores.masked_fill_(torch.ones(lq, lk, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return scores if mask is None else scores.add_(mask.to(acc))


def _probabilities_(scores, lse):
    """exp(scores - lse) in place, 0 in a row that reads no key (lse -inf)."""
    return scores.sub_(torch.where(lse == float("-inf"), torch.zeros_like(lse), lse)[..., None]).exp_()


def _math_forward(q, k, v, causal: bool, scale: float, mask=None):
    acc = accumulator_dtype(q.dtype)
    scores = _math_scores(q, k, causal, scale, mask)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(_probabilities_(scores, lse), v.to(acc)).to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, causal: bool, scale: float, mask=None):
    acc = accumulator_dtype(q.dtype)
    probs = _probabilities_(_math_scores(q, k, causal, scale, mask), lse)
    grad = dout.to(acc)
    dv = torch.matmul(probs.transpose(-1, -2), grad)
    delta = (grad * out.to(acc)).sum(-1, keepdim=True)
    dscores = torch.matmul(grad, v.to(acc).transpose(-1, -2)).sub_(delta).mul_(probs)
    del probs
    dq, dk = torch.matmul(dscores, k.to(acc)) * scale, torch.matmul(dscores.transpose(-1, -2), q.to(acc)) * scale
    return tuple(g.to(q.dtype) for g in (dq, dk, dv))


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the ring accumulates in (and returns the log-sum-exp in): fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


_aten = torch.ops.aten


def _cpu_flash_forward(q, k, v, causal, scale, bias):
    return _aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, 0.0, causal, attn_mask=bias,
                                                                     scale=scale)


def _cpu_flash_backward(dout, q, k, v, out, lse, causal, scale, bias):
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)


def _unused_rng(device, shapes=((), ()), dtype=torch.int64):
    """The dropout seed and offset a CUDA kernel's backward takes; read only under dropout, which the ring has not."""
    return tuple(torch.empty(shape, dtype=dtype, device=device) for shape in shapes)


def _aligned_bias(bias, heads: int | None = None):
    """The additive mask with rows 16-element aligned, as scaled_dot_product_attention hands it to the fused CUDA
    kernels (its ``pad_bias``), expanded (a view) to ``heads`` heads where the kernel wants them."""
    if bias is None:
        return None
    lk = bias.shape[-1]
    if lk % 16:
        bias = torch.nn.functional.pad(bias, (0, 16 - lk % 16))[..., :lk]
    return bias if heads is None else bias.expand(bias.shape[0], heads, *bias.shape[2:])


def _flash_cuda_forward(q, k, v, causal, scale, bias):
    out, lse, *_ = _aten._scaled_dot_product_flash_attention.default(q, k, v, 0.0, causal, False, scale=scale)
    return out, lse


def _flash_cuda_backward(dout, q, k, v, out, lse, causal, scale, bias):
    seed, offset = _unused_rng(q.device, ((2,), ()), torch.uint64)  # as the forward returns them
    return _aten._scaled_dot_product_flash_attention_backward.default(
        dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale)


def _efficient_forward(q, k, v, causal, scale, bias):
    out, lse, *_ = _aten._scaled_dot_product_efficient_attention.default(
        q, k, v, _aligned_bias(bias, q.shape[1]), True, 0.0, causal, scale=scale)
    return out, lse[..., :q.shape[2]]  # the kernel pads the log-sum-exp's rows to a multiple of 32


def _efficient_backward(dout, q, k, v, out, lse, causal, scale, bias):
    seed, offset = _unused_rng(q.device)
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward.default(
        dout, q, k, v, _aligned_bias(bias, q.shape[1]), out, lse, seed, offset, 0.0, [True, True, True, False],
        causal, scale=scale)
    return dq, dk, dv


def _cudnn_forward(q, k, v, causal, scale, bias):
    q, k, v = (t.contiguous() for t in (q, k, v))  # cuDNN's graphs are built for dense layouts
    out, lse, *_ = _aten._scaled_dot_product_cudnn_attention.default(q, k, v, _aligned_bias(bias), True, 0.0, causal,
                                                                      False, scale=scale)
    return out, lse.reshape(q.shape[:3])  # [B, H, Lq, 1] or [B, H, Lq], by the build


@functools.cache
def _cudnn_lse_dims(device: torch.device) -> int:
    """The rank of the log-sum-exp the cuDNN forward returns on ``device`` ([B, H, Lq, 1] or [B, H, Lq], by the
    build; its backward takes it back so): asked of the op once, on a tiny block."""
    x = torch.zeros(1, 1, 8, 8, device=device, dtype=torch.float16)
    return _aten._scaled_dot_product_cudnn_attention.default(x, x, x, None, True)[1].dim()


def _cudnn_backward(dout, q, k, v, out, lse, causal, scale, bias):
    dout, q, k, v, out = (t.contiguous() for t in (dout, q, k, v, out))
    seed, offset = _unused_rng(q.device)
    lse = lse.reshape(*q.shape[:3], *(1,) * (_cudnn_lse_dims(q.device) - 3))
    return _aten._scaled_dot_product_cudnn_attention_backward.default(
        dout, q, k, v, out, lse, seed, offset, _aligned_bias(bias), None, None, q.shape[2], k.shape[2], 0.0, causal,
        scale=scale)


_KERNELS = {
    BlockKernel.FLASH_CPU: (_cpu_flash_forward, _cpu_flash_backward),
    BlockKernel.FLASH_CUDA: (_flash_cuda_forward, _flash_cuda_backward),
    BlockKernel.EFFICIENT_CUDA: (_efficient_forward, _efficient_backward),
    BlockKernel.CUDNN_CUDA: (_cudnn_forward, _cudnn_backward),
    BlockKernel.MATH: (_math_forward, _math_backward),
}
"""Each kernel's (forward, backward): forward(q, k, v, causal, scale, additive mask or None) -> (output,
log-sum-exp [B, H, Lq]); backward(dout, q, k, v, out, lse, causal, scale, mask) -> (dq, dk, dv)."""


def block_forward(kernel: BlockKernel, q, k, v, causal: bool, scale: float, mask=None):
    """(output, log-sum-exp [B, H, Lq] in the accumulator dtype) of attention of q over k/v, by ``kernel``
    (`block_kernel`'s choice).  ``mask``: (additive mask, rows that read a key) of `Documents.mask`; the causal
    flag is kept beside it (the mask holds it already: the kernel then skips the tiles above the diagonal)."""
    out, lse = _KERNELS[kernel][0](q, k, v, causal, scale, None if mask is None else mask[0])
    lse = lse.to(accumulator_dtype(q.dtype))
    if mask is None:
        return out, lse
    # A row whose keys are all masked read nothing: log-sum-exp -inf (the CPU kernel reports 0), output 0.
    return out.masked_fill(~mask[1][..., None], 0.0), lse.masked_fill(~mask[1], float("-inf"))


def block_backward(kernel: BlockKernel, dout, q, k, v, out, lse, causal: bool, scale: float, mask=None):
    """(dq, dk, dv) of a block in the inputs' dtype, by ``kernel``, given the final output and log-sum-exp of its
    query rows."""
    return tuple(_KERNELS[kernel][1](dout, q, k, v, out, lse.contiguous(), causal, scale,
                                     None if mask is None else mask[0]))

