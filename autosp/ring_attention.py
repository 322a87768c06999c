"""Exact ring attention over a sequence-parallel group, as custom ops with autograd.

Note [Ring attention]
~~~~~~~~~~~~~~~~~~~~~
Under ``strategy="ring"`` each rank holds the queries, keys and values of its own tokens, all heads
(autosp/passes/dynamo/attention.py puts ``autosp_testbed::ring_attention`` where the model calls
scaled_dot_product_attention).  With the zig-zag layout (Note [Zig-zag layout] in autosp/inputs.py) group
rank r holds chunks r and 2P-1-r of the 2P equal chunks, in ascending order; with the contiguous one (used
by the hand-written baseline's ``load_balance=False``) chunk r of P.

Forward: in P steps rank r sees every rank's key/value block, its own first; at step s it holds the block of
rank r - s.  Before it computes with that block it starts the transfer of the same block to rank r + 1 and
the receive of the next one from rank r - 1 (``dist.batch_isend_irecv``: asynchronous point-to-point), so the
P - 1 transfers overlap the P - 1 first steps' compute (`schedule`).  For a query chunk a and a key chunk b,
causal attention is nothing if b > a, the causal triangle if b == a, every pair if b < a; each step's work is
cut into as few fused attention calls as that structure allows (`blocks`): at step 0 one causal call over the
rank's concatenated chunks (exact because they are in ascending order), at a later step, under the zig-zag
layout, one non-causal call (both query chunks against an earlier rank's first chunk, or the second query
chunk against both chunks of a later rank): every rank does the same work at every step.  Each call is a
fused attention kernel that returns its output O_b (softmax over the block's keys) and the row-wise
log-sum-exp L_b, with no score matrix kept (Note [Ring block kernels]); the blocks merge exactly, in fp32, by the
online-softmax rule

    L = logaddexp(L1, L2),   O = O1 * exp(L1 - L) + O2 * exp(L2 - L),

so after P steps O and L are those of softmax attention over the whole sequence.

Backward (``autosp_testbed::ring_attention_backward``): the key/value blocks travel the same ring again; each
block's kernel backward is given the *final* O and L of its query rows, so its P_b = exp(S_b - L) and
Delta = rowsum(dO * O) are those of full attention and the dQ, dK, dV it returns are exactly the gradient of
full attention restricted to the block.  dQ accumulates locally; the dK/dV of a block travel around the ring
behind it: at step s a rank adds its contribution to the accumulator that arrived from rank r - 1 and sends
the sum on to rank r + 1, the transfer overlapping step s + 1's compute, so after P steps and one last
transfer each rank holds the finished dK/dV of its own tokens.  All accumulation is fp32 (fp64 for fp64
inputs).

Packed documents: with ``documents`` (the whole sequence's document ids, [B, S] in sequence order, Note [Document
masks] in autosp/document_attention.py; the mask pass computes them from the all-gathered positions put back in
sequence order, autosp/passes/dynamo/masks.py) the attention is causal within documents.  The op cuts the ids by
the chunk indices it already knows (`rank_chunks`), so a visiting block's ids need no transfer.  Before a step's
calls are formed, each (query chunk, key chunk) pair is asked of the batch's ids whether any query reads any key
in any row (`Documents.reads`, from the block classes of `reads_any`: exact to skip when it says no); pairs that
read nothing are left out of `blocks`, forward and backward alike (the ids are the same, so are the calls), and
cost no kernel call.  This is decided at run time, per batch, inside the op: one compiled program serves every
packing.  A call whose tokens lie in one document keeps the plain causal or non-causal kernel; any other gets the
rule as an additive [B, 1, Lq, Lk] mask beside its causal flag (`Documents.mask`, the rule's `mask_rule`), the
op's only dense mask.  A query row that reads no key of a call gets log-sum-exp -inf there (the CPU kernel reports
0 for such a row), and `merge` weighs it 0, so the result is the same online softmax.  The K/V blocks still travel
the whole ring (another rank may read them).  Padding, windows and chunked attention are not applied here (the
mask pass refuses them under the ring); the padding AutoSP adds at the end of the sequence needs no mask under
causal attention.

Grouped-query attention: key/value heads travel unreplicated (each rank holds every head of its tokens); a
kernel call sees them expanded to the query heads, and their gradients are summed back over each group.

The op is one node for Dynamo, AOTAutograd and Inductor (like the collectives of autosp/ops.py): it is saved,
never recomputed, by selective checkpointing (autosp/passes/joint/checkpointing.py treats every
``autosp_testbed`` op as a collective), and its backward is a second op, so the forward's and backward's
communication sit inside the two.  Each step runs under ``torch.profiler.record_function`` ranges named
``autosp.ring.<phase>.send_recv.<step>`` and ``autosp.ring.<phase>.compute.<step>``, which the tests read to
check the order of transfers and compute (tests/autosp/test_ring.py), and each block's kernel under
``autosp.ring_block.<phase>.<step>.<index>.<kernel>``.

Note [Ring block kernels]
~~~~~~~~~~~~~~~~~~~~~~~~~
One function, `block_kernel(device, dtype, head_dim, masked=...)`, names the kernel every block runs, forward and
backward, on every device; the run calls what it names and the export (Note [Ring attention in the export] in
autosp/export.py) prices and names the same, asking it of the traced device and dtype.  The kernels are the fused
attention ops that return the log-sum-exp, called directly (not through scaled_dot_product_attention, which
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
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from autosp.document_attention import mask_rule, reads_any
from autosp.inputs import zigzag_chunks

__all__ = ["CUDA_KERNELS", "LAYOUTS", "BlockKernel", "CudaDevice", "Documents", "MathBlockWarning", "block_kernel",
           "ring_attention", "ring_attention_backward", "schedule"]

LAYOUTS = ("zigzag", "contiguous")
"""How the tokens are spread over the group: zig-zag chunks (autosp's ring) or one contiguous slice per rank."""

_KV_TAG, _GRAD_TAG = 0, 1


def rank_chunks(layout: str, size: int, rank: int) -> tuple[int, ...]:
    """The chunk indices rank ``rank`` holds, in local order (2P chunks for zig-zag, P for contiguous)."""
    if layout == "zigzag":
        return zigzag_chunks(size, rank)
    if layout == "contiguous":
        return (rank,)
    raise ValueError(f"ring layout must be one of {LAYOUTS}, got {layout!r}")


@dataclass(frozen=True)
class Step:
    """One event of a ring pass: ``kind`` is "send_recv" (issue the transfer of the block held at ``step``),
    "compute" (the block's attention) or "wait" (block until that transfer arrived)."""

    kind: str
    step: int


def schedule(size: int) -> tuple[Step, ...]:
    """The order of events of one ring pass over ``size`` ranks, forward and backward alike: at every step but
    the last, the transfer of the held block is issued before the step's compute and waited for after it."""
    events: list[Step] = []
    for step in range(size):
        if step < size - 1:
            events.append(Step("send_recv", step))
        events.append(Step("compute", step))
        if step < size - 1:
            events.append(Step("wait", step))
    return tuple(events)


class _Ring:
    """This rank's place in the ring: its neighbours (global ranks, as point-to-point ops want) and chunks."""

    def __init__(self, group_name: str, size: int, layout: str):
        self.group = _resolve_process_group(group_name)
        self.size = size
        self.rank = dist.get_rank(self.group)
        if dist.get_world_size(self.group) != size:
            raise ValueError(f"ring attention over a group of {dist.get_world_size(self.group)} ranks given size {size}")
        self.layout = layout
        self.mine = rank_chunks(layout, size, self.rank)
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % size)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % size)

    def chunks_at(self, step: int) -> tuple[int, ...]:
        """The chunk indices of the key/value block held at ``step`` (it came from rank - step)."""
        return rank_chunks(self.layout, self.size, (self.rank - step) % self.size)

    def start_shift(self, tensor: torch.Tensor, tag: int):
        """Send ``tensor`` to the next rank, receive the previous rank's; returns (requests, receive buffer)."""
        received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
               dist.P2POp(dist.irecv, received, self.prev, self.group, tag)]
        return dist.batch_isend_irecv(ops), received


def _relation(query_chunk: int, key_chunk: int, causal: bool) -> str | None:
    """``"full"``, ``"diagonal"`` (causal triangle) or None (masked out entirely)."""
    if not causal or key_chunk < query_chunk:
        return "full"
    return "diagonal" if key_chunk == query_chunk else None


def blocks(mine: tuple[int, ...], theirs: tuple[int, ...], causal: bool,
           reads: Callable[[int, int], bool] | None = None) -> list[tuple[list[int], list[int], bool]]:
    """The fused attention calls of one ring step: (local query chunk positions, key chunk positions, causal).

    As few as the causal structure allows (Note [Ring attention]): the pairs a call covers are exactly the
    pairs that attend, in ascending chunk order.  ``reads(query chunk, key chunk)`` (packed documents: asked of
    the batch's document ids at run time, `Documents.reads`) is False for a pair no query of which reads a
    key of the other; such a pair is skipped."""
    causal_pairs = {(i, j): rel for i, a in enumerate(mine) for j, b in enumerate(theirs)
                    if (rel := _relation(a, b, causal)) is not None}
    live = {(i, j): rel for (i, j), rel in causal_pairs.items() if reads is None or reads(mine[i], theirs[j])}
    if not live:
        return []
    if mine == theirs and list(mine) == sorted(mine) and live == causal_pairs:  # own chunks: one call over both
        return [(list(range(len(mine))), list(range(len(theirs))), causal)]
    rows = sorted({i for i, _ in live})
    cols = sorted({j for _, j in live})
    if all(rel == "full" for rel in live.values()) and len(live) == len(rows) * len(cols):
        return [(rows, cols, False)]  # a rectangle of whole blocks: one non-causal call
    return [([i], [j], rel == "diagonal") for (i, j), rel in sorted(live.items())]


def _take(chunks: tuple[torch.Tensor, ...], positions: list[int]) -> torch.Tensor:
    return chunks[positions[0]] if len(positions) == 1 else torch.cat([chunks[i] for i in positions], dim=2)


def _expand_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, L, D] -> [B, Hkv * groups, L, D], each kv head repeated for its query heads."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Online-softmax merge of a block into the accumulators ``out`` [B, H, l, D], ``lse`` [B, H, l], in place.
    A row that has read no key yet (log-sum-exp -inf, as a document-masked block leaves some) weighs 0."""
    new_lse = torch.logaddexp(lse, block_lse)
    safe = torch.where(new_lse == float("-inf"), torch.zeros_like(new_lse), new_lse)
    out.mul_(torch.exp(lse - safe)[..., None]).add_(block_out.to(out.dtype) * torch.exp(block_lse - safe)[..., None])
    lse.copy_(new_lse)


class Documents:
    """The document ids of a ring's whole (padded) sequence, [B, S] in sequence order (Note [Document masks] in
    autosp/document_attention.py), cut into the ring's ``chunks`` equal chunks: which (query chunk, key chunk)
    pairs any query reads in (`reads`, the skip decision), and the mask of a fused call (`mask`)."""

    def __init__(self, ids: torch.Tensor, chunks: int):
        self.ids, self.chunk = ids, ids.shape[1] // chunks
        self._reads: dict[tuple[int, int], bool] = {}

    def reads(self, query_chunk: int, key_chunk: int) -> bool:
        """False when no query of ``query_chunk`` reads a key of ``key_chunk`` in any row: the pair is skipped."""
        if (query_chunk, key_chunk) not in self._reads:
            c = self.chunk
            self._reads[query_chunk, key_chunk] = reads_any(self.ids, q_start=query_chunk * c, q_len=c,
                                                            kv_start=key_chunk * c, kv_len=c)
        return self._reads[query_chunk, key_chunk]

    def _index(self, chunks: list[int]) -> torch.Tensor:
        return torch.cat([torch.arange(a * self.chunk, (a + 1) * self.chunk, device=self.ids.device) for a in chunks])

    def one_document(self, query_chunks: list[int], key_chunks: list[int]) -> bool:
        """Whether, in every row, every token of the chunks lies in one document: a call over them needs no mask
        (its causal flag is exact on its own).  Linear in the tokens: the export asks it too, to price the kernel a
        masked call runs (`block_kernel`)."""
        ids = torch.cat([self.ids[:, self._index(query_chunks)], self.ids[:, self._index(key_chunks)]], dim=1)
        return bool((ids == ids[:, :1]).all())

    def mask(self, query_chunks: list[int], key_chunks: list[int], dtype: torch.dtype):
        """(additive mask [B, 1, Lq, Lk] of ``dtype``, [B, 1, Lq] whether each query reads a key) of a fused call
        over the concatenated chunks; None when every token of both lies in one document (`one_document`)."""
        if self.one_document(query_chunks, key_chunks):
            return None
        q_index, k_index = self._index(query_chunks), self._index(key_chunks)
        batch = torch.arange(self.ids.shape[0], device=self.ids.device)[:, None, None]
        allowed = mask_rule(0, 0, None)(batch, None, q_index[None, :, None], k_index[None, None, :], self.ids)
        bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
        return bias[:, None], allowed.any(-1)[:, None]


# --- one block: a fused kernel that returns the log-sum-exp, and its backward from the final O and L -------------


class BlockKernel(str, enum.Enum):
    """The kernel one ring block runs, forward and backward (Note [Ring block kernels]); `block_kernel` chooses it,
    the run calls it (`_block_forward`, `_block_backward`) and the export prices and names it
    (autosp/export.py)."""

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
formed in place in their product with dO): what the export allocates for it (autosp/export.py)."""

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


def _block_forward(kernel: BlockKernel, q, k, v, causal: bool, scale: float, mask=None):
    """(output, log-sum-exp [B, H, Lq] in the accumulator dtype) of attention of q over k/v, by ``kernel``
    (`block_kernel`'s choice).  ``mask``: (additive mask, rows that read a key) of `Documents.mask`; the causal
    flag is kept beside it (the mask holds it already: the kernel then skips the tiles above the diagonal)."""
    out, lse = _KERNELS[kernel][0](q, k, v, causal, scale, None if mask is None else mask[0])
    lse = lse.to(accumulator_dtype(q.dtype))
    if mask is None:
        return out, lse
    # A row whose keys are all masked read nothing: log-sum-exp -inf (the CPU kernel reports 0), output 0.
    return out.masked_fill(~mask[1][..., None], 0.0), lse.masked_fill(~mask[1], float("-inf"))


def _block_backward(kernel: BlockKernel, dout, q, k, v, out, lse, causal: bool, scale: float, mask=None):
    """(dq, dk, dv) of a block in the inputs' dtype, by ``kernel``, given the final output and log-sum-exp of its
    query rows."""
    return tuple(_KERNELS[kernel][1](dout, q, k, v, out, lse.contiguous(), causal, scale,
                                     None if mask is None else mask[0]))


BLOCK_RANGE = "autosp.ring_block"


def _block_range(phase: str, step: int, index: int, kernel: BlockKernel):
    """The profiler range around a block's kernel, ``autosp.ring_block.<phase>.<step>.<index>.<kernel>``: which
    kernel each block ran (tests/autosp/test_ring.py compares it with the export's)."""
    return torch.profiler.record_function(f"{BLOCK_RANGE}.{phase}.{step}.{index}.{kernel.value}")


# --- the ring -------------------------------------------------------------------------------------------------


def _ring_forward(q, k, v, ring: _Ring, scale: float, causal: bool, documents: Documents | None):
    b, h, length, d = q.shape
    groups = h // k.shape[1]
    n = len(ring.mine)
    q_chunks = q.chunk(n, dim=2)
    acc = accumulator_dtype(q.dtype)
    out = torch.zeros(b, h, length, d, dtype=acc, device=q.device)
    lse = torch.full((b, h, length), float("-inf"), dtype=acc, device=q.device)
    out_chunks, lse_chunks = out.chunk(n, dim=2), lse.chunk(n, dim=2)
    kv = torch.stack([k, v]).contiguous()  # [2, B, Hkv, L, D]
    pending = None
    for event in schedule(ring.size):
        with torch.profiler.record_function(f"autosp.ring.forward.{event.kind}.{event.step}"):
            if event.kind == "send_recv":
                pending = ring.start_shift(kv, _KV_TAG)
            elif event.kind == "wait":
                requests, kv = pending
                for request in requests:
                    request.wait()
            else:
                k_chunks, v_chunks = kv[0].chunk(n, dim=2), kv[1].chunk(n, dim=2)
                theirs = ring.chunks_at(event.step)
                for j, (rows, cols, block_causal) in enumerate(
                        blocks(ring.mine, theirs, causal, documents and documents.reads)):
                    mask = _mask(documents, ring.mine, theirs, rows, cols, q.dtype)
                    kernel = block_kernel(q.device, q.dtype, d, masked=mask is not None)
                    with _block_range("forward", event.step, j, kernel):
                        block_out, block_lse = _block_forward(
                            kernel, _take(q_chunks, rows), _expand_heads(_take(k_chunks, cols), groups),
                            _expand_heads(_take(v_chunks, cols), groups), block_causal, scale, mask)
                    c = block_out.shape[2] // len(rows)
                    for t, i in enumerate(rows):
                        merge(out_chunks[i], lse_chunks[i], block_out[:, :, t * c:(t + 1) * c],
                              block_lse[:, :, t * c:(t + 1) * c])
    return out.to(q.dtype), lse


def _mask(documents: Documents | None, mine, theirs, rows: list[int], cols: list[int], dtype: torch.dtype):
    if documents is None:
        return None
    return documents.mask([mine[i] for i in rows], [theirs[j] for j in cols], dtype)


def _ring_backward(dout, q, k, v, out, lse, ring: _Ring, scale: float, causal: bool, documents: Documents | None):
    h, hkv = q.shape[1], k.shape[1]
    groups = h // hkv
    n = len(ring.mine)
    dout = dout.to(q.dtype)
    q_chunks, dout_chunks, out_chunks, lse_chunks = (t.chunk(n, dim=2) for t in (q, dout, out, lse))
    acc = accumulator_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dq_chunks = dq.chunk(n, dim=2)
    kv = torch.stack([k, v]).contiguous()
    pending, grads_in_flight = None, None
    for event in schedule(ring.size):
        with torch.profiler.record_function(f"autosp.ring.backward.{event.kind}.{event.step}"):
            if event.kind == "send_recv":
                pending = ring.start_shift(kv, _KV_TAG)
                continue
            if event.kind == "wait":
                requests, kv = pending
                for request in requests:
                    request.wait()
                continue
            # This step's dK/dV contributions, for the block of rank r - step.
            dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
            k_chunks, v_chunks = kv[0].chunk(n, dim=2), kv[1].chunk(n, dim=2)
            dk_chunks, dv_chunks = dkv[0].chunk(n, dim=2), dkv[1].chunk(n, dim=2)
            theirs = ring.chunks_at(event.step)
            for j, (rows, cols, block_causal) in enumerate(
                    blocks(ring.mine, theirs, causal, documents and documents.reads)):
                mask = _mask(documents, ring.mine, theirs, rows, cols, q.dtype)
                kernel = block_kernel(q.device, q.dtype, q.shape[-1], masked=mask is not None)
                with _block_range("backward", event.step, j, kernel):
                    dq_blk, dk_blk, dv_blk = _block_backward(
                        kernel, _take(dout_chunks, rows), _take(q_chunks, rows),
                        _expand_heads(_take(k_chunks, cols), groups), _expand_heads(_take(v_chunks, cols), groups),
                        _take(out_chunks, rows), _take(lse_chunks, rows), block_causal, scale, mask)
                c = dq_blk.shape[2] // len(rows)
                for t, i in enumerate(rows):
                    dq_chunks[i].add_(dq_blk[:, :, t * c:(t + 1) * c])
                if groups > 1:  # gradients of the expanded heads, summed back onto each kv head
                    dk_blk = dk_blk.unflatten(1, (hkv, groups)).sum(dim=2)
                    dv_blk = dv_blk.unflatten(1, (hkv, groups)).sum(dim=2)
                for t, j in enumerate(cols):
                    dk_chunks[j].add_(dk_blk[:, :, t * c:(t + 1) * c])
                    dv_chunks[j].add_(dv_blk[:, :, t * c:(t + 1) * c])
            if grads_in_flight is not None:  # the accumulator of this block, from rank r - 1: add ours to it
                requests, arrived, _sent = grads_in_flight
                for request in requests:
                    request.wait()
                dkv.add_(arrived)
            if ring.size == 1:
                grads_in_flight = ([], dkv, dkv)
            else:  # on to rank r + 1 (the block's owner after the last step); overlaps the next step's compute
                with torch.profiler.record_function(f"autosp.ring.backward.grad_send_recv.{event.step}"):
                    grads_in_flight = (*ring.start_shift(dkv, _GRAD_TAG), dkv)  # the sent buffer kept alive
    requests, dkv, _sent = grads_in_flight
    for request in requests:
        request.wait()
    # Separate tensors (a custom op's outputs must not alias each other), in the inputs' dtypes.
    return dq.to(q.dtype), dkv[0].to(k.dtype, copy=True), dkv[1].to(v.dtype, copy=True)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, size: int, causal: bool,
           documents: torch.Tensor | None) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        raise ValueError(f"ring attention takes q [B, H, L, D] and k, v [B, Hkv, L, D], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of the {k.shape[1]} key/value heads")
    chunks = len(rank_chunks(layout, size, 0))
    if q.shape[2] % chunks:
        raise ValueError(f"ring attention ({layout}) needs a multiple of {chunks} local tokens, got {q.shape[2]}")
    if documents is not None and (not causal or tuple(documents.shape) != (q.shape[0], q.shape[2] * size)):
        raise ValueError(f"ring attention over documents is causal and takes the ids of the whole sequence, "
                         f"[{q.shape[0]}, {q.shape[2] * size}]; got causal={causal}, {tuple(documents.shape)}")


def _documents(documents: torch.Tensor | None, layout: str, size: int) -> Documents | None:
    return None if documents is None else Documents(documents, size * len(rank_chunks(layout, size, 0)))


@torch.library.custom_op("autosp_testbed::ring_attention", mutates_args=())
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, layout: str,
                   group_name: str, group_size: int, documents: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [B, H, L, D], log-sum-exp [B, H, L] in fp32, fp64 for fp64 inputs) of attention of this rank's queries over the whole
    sequence's keys and values, held by the ranks of the group as ``layout`` says (Note [Ring attention]).
    ``documents``: the whole sequence's document ids [B, S] in sequence order (Note [Document masks] in
    autosp/document_attention.py), for causal attention within documents, pairs of chunks it leaves empty skipped."""
    _check(q, k, v, layout, group_size, causal, documents)
    return _ring_forward(q, k, v, _Ring(group_name, group_size, layout), scale, causal,
                         _documents(documents, layout, group_size))


@ring_attention.register_fake
def _(q, k, v, scale, causal, layout, group_name, group_size, documents=None):
    _check(q, k, v, layout, group_size, causal, documents)  # the real op's outputs are contiguous, whatever the inputs' strides
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=accumulator_dtype(q.dtype))


@torch.library.custom_op("autosp_testbed::ring_attention_backward", mutates_args=())
def ring_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool, layout: str,
                            group_name: str, group_size: int, documents: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `ring_attention`, dK/dV passed around the ring (Note [Ring attention])."""
    return _ring_backward(grad_out, q, k, v, out, lse, _Ring(group_name, group_size, layout), scale, causal,
                          _documents(documents, layout, group_size))


@ring_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, scale, causal, layout, group_name, group_size, documents=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, ctx.scale, ctx.causal, ctx.layout, ctx.group_name, ctx.group_size, documents = inputs
    ctx.mark_non_differentiable(output[1])  # the log-sum-exp is returned for the backward only
    ctx.save_for_backward(q, k, v, output[0], output[1], documents)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, documents = ctx.saved_tensors
    dq, dk, dv = ring_attention_backward(grad_out, q, k, v, out, lse, ctx.scale, ctx.causal, ctx.layout,
                                         ctx.group_name, ctx.group_size, documents)
    return dq, dk, dv, None, None, None, None, None, None


ring_attention.register_autograd(_backward, setup_context=_setup_context)


def default_scale(head_dim: int) -> float:
    """scaled_dot_product_attention's default softmax scale, 1 / sqrt(head_dim)."""
    return 1.0 / math.sqrt(head_dim)
