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
log-sum-exp L_b, with no score matrix kept (Note [Ring block kernels] in autosp/ring_block_kernels.py); the blocks
merge exactly, in fp32, by the online-softmax rule

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
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from autosp.document_attention import mask_rule, reads_any
from autosp.inputs import zigzag_chunks
from autosp.ring_block_kernels import (
    BlockKernel,
    accumulator_dtype,
    block_backward,
    block_forward,
    block_kernel,
)

__all__ = ["LAYOUTS", "Documents", "ring_attention", "ring_attention_backward", "schedule"]

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
                        block_out, block_lse = block_forward(
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
                    dq_blk, dk_blk, dv_blk = block_backward(
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
