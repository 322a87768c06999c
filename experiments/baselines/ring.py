"""Hand-written ring attention on point-to-point sends, as real implementations do it: exact, causal, zig-zag.

The step is `hand_sp.HandWrittenSP`; the sequence is cut into 2P chunks and rank r
holds chunks r and 2P-1-r (`common.TokenLayout.zigzag`), so under causal masking
every rank computes the same number of (query, key) blocks; ``load_balance=False``
uses P contiguous chunks instead.  Key/value blocks travel around the ring with
``dist.batch_isend_irecv`` (the next block's transfer overlaps this block's
compute).  Each step runs fused flash attention on CPU
(``aten._scaled_dot_product_flash_attention_for_cpu``, which returns the
log-sum-exp: no score matrix is materialised) and merges the blocks with the
online-softmax rule in fp32; backward calls the fused flash backward kernel per
block (the ring_flash_attn / zig-zag ring recipe); see Note [Exact ring
attention].  The ring runs outside the compiled graph (``torch.compiler.disable``:
one graph break per attention layer): it is an ``autograd.Function`` issuing
point-to-point sends, which Dynamo does not trace; the model code between
attentions is compiled.  Grouped-query attention is supported without sending
replicated key/value heads.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from experiments.baselines.common import TokenLayout
from experiments.baselines.hand_sp import HandWrittenSP

# Note [Exact ring attention]
# ---------------------------
# Rank r holds the queries, keys and values of its chunks.  In P steps it sees
# every rank's key/value chunks (its own first).  For a query chunk a and key chunk b,
# causal attention is: nothing if b > a, the causal triangle if b == a, every pair if
# b < a.  Each step's work is cut into as few fused attention calls as the causal
# structure allows (`_blocks`): at step 0 (its own chunks) one causal call over the
# rank's concatenated chunks (exact because a rank's chunks are in ascending order);
# at a later step, under the zig-zag layout, one non-causal call (both query chunks
# against the earlier rank's first key chunk, or the second query chunk against both
# key chunks of a later rank).  Each call is CPU flash attention
# (``aten._scaled_dot_product_flash_attention_for_cpu``), which returns the block's
# output O_blk (softmax over the block's keys) and its row-wise log-sum-exp L_blk;
# blocks merge exactly, in fp32, by the online-softmax rule
#     L = logaddexp(L1, L2),   O = O1 * exp(L1 - L) + O2 * exp(L2 - L),
# so after all steps O and L are those of softmax attention over the whole sequence.
# Backward (the same ring, key/value blocks travelling forward again while their
# gradient accumulators travel with them): the flash backward kernel
# (``aten._scaled_dot_product_flash_attention_for_cpu_backward``) of each block is
# given the *final* O and L of the query rows, so its P_blk = exp(S_blk - L) and
# Delta = rowsum(dO * O) are those of full attention, and the dQ, dK, dV it returns
# are exactly the gradient of full attention restricted to the block.  After P steps
# plus one final transfer, each rank holds the finished dK/dV of its own chunks.
# Grouped-query attention: the key/value heads travel unreplicated; each call sees
# them expanded to the query heads (the kernel has no GQA), and their gradients are
# summed back over the group.

_KV_TAG, _GRAD_TAG = 0, 1
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


class _Ring:
    """This rank's place in the ring and its neighbours (global ranks, as point-to-point ops want)."""

    def __init__(self, group: dist.ProcessGroup, layout: TokenLayout):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.layout = layout
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def chunks_at(self, step: int) -> tuple[int, ...]:
        """The chunk indices of the key/value block this rank holds at ``step`` (it came from rank - step)."""
        return self.layout.chunks[(self.rank - step) % self.size]

    def start_shift(self, tensor: torch.Tensor, tag: int):
        """Send ``tensor`` to the next rank and receive the previous rank's; returns (requests, received)."""
        received = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
            dist.P2POp(dist.irecv, received, self.prev, self.group, tag),
        ]
        return dist.batch_isend_irecv(ops), received


def _relation(query_chunk: int, key_chunk: int, causal: bool) -> str | None:
    """``"full"``, ``"diagonal"`` (causal triangle) or None (masked out entirely)."""
    if not causal or key_chunk < query_chunk:
        return "full"
    return "diagonal" if key_chunk == query_chunk else None


def _blocks(mine: tuple[int, ...], theirs: tuple[int, ...], causal: bool) -> list[tuple[list[int], list[int], bool]]:
    """The fused attention calls of one ring step: (local query chunk positions, key chunk positions, causal).

    As few as the causal structure allows (see Note [Exact ring attention]): the pairs a
    call covers are exactly the pairs that attend, in ascending chunk order."""
    relations = {(i, j): _relation(a, b, causal) for i, a in enumerate(mine) for j, b in enumerate(theirs)}
    live = {pair: rel for pair, rel in relations.items() if rel is not None}
    if not live:
        return []
    if mine == theirs and list(mine) == sorted(mine):  # own chunks: one causal call over their concatenation
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


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Online-softmax merge of a block into the fp32 accumulators ``out`` [B, H, l, D], ``lse`` [B, H, l], in place."""
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new_lse)[..., None]).add_(block_out.float() * torch.exp(block_lse - new_lse)[..., None])
    lse.copy_(new_lse)


class _RingAttentionFn(torch.autograd.Function):
    """q [B, H, L, D], k/v [B, Hkv, L, D] (this rank's chunks) -> out [B, H, L, D]; see Note [Exact ring attention]."""

    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring, scale: float, causal: bool):
        b, h, length, d = q.shape
        groups = h // k.shape[1]
        mine = ring.layout.chunks[ring.rank]
        n = len(mine)
        q_chunks = q.chunk(n, dim=2)
        out = torch.zeros(b, h, length, d, dtype=torch.float32, device=q.device)
        lse = torch.full((b, h, length), float("-inf"), dtype=torch.float32, device=q.device)
        out_chunks, lse_chunks = out.chunk(n, dim=2), lse.chunk(n, dim=2)
        kv = torch.stack([k, v]).contiguous()  # [2, B, Hkv, L, D]
        for step in range(ring.size):
            pending = ring.start_shift(kv, _KV_TAG) if step < ring.size - 1 else None
            k_chunks, v_chunks = kv[0].chunk(n, dim=2), kv[1].chunk(n, dim=2)
            for rows, cols, block_causal in _blocks(mine, ring.chunks_at(step), causal):
                block_out, block_lse = _flash(
                    _take(q_chunks, rows), _expand_heads(_take(k_chunks, cols), groups),
                    _expand_heads(_take(v_chunks, cols), groups), 0.0, block_causal, scale=scale,
                )
                c = block_out.shape[2] // len(rows)
                for t, i in enumerate(rows):
                    _merge(out_chunks[i], lse_chunks[i], block_out[:, :, t * c:(t + 1) * c],
                           block_lse[:, :, t * c:(t + 1) * c])
            if pending is not None:
                requests, kv = pending
                for request in requests:
                    request.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale, ctx.causal = ring, scale, causal
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale, causal = ctx.ring, ctx.scale, ctx.causal
        b, h, length, d = q.shape
        hkv = k.shape[1]
        groups = h // hkv
        mine = ring.layout.chunks[ring.rank]
        n = len(mine)
        dout = grad_out.to(q.dtype)
        q_chunks, dout_chunks, out_chunks, lse_chunks = (t.chunk(n, dim=2) for t in (q, dout, out, lse))
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dq_chunks = dq.chunk(n, dim=2)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # travels with its key/value block
        for step in range(ring.size):
            pending = ring.start_shift(kv, _KV_TAG) if step < ring.size - 1 else None
            k_chunks, v_chunks = kv[0].chunk(n, dim=2), kv[1].chunk(n, dim=2)
            dk_chunks, dv_chunks = dkv[0].chunk(n, dim=2), dkv[1].chunk(n, dim=2)
            for rows, cols, block_causal in _blocks(mine, ring.chunks_at(step), causal):
                dq_blk, dk_blk, dv_blk = _flash_backward(
                    _take(dout_chunks, rows), _take(q_chunks, rows),
                    _expand_heads(_take(k_chunks, cols), groups), _expand_heads(_take(v_chunks, cols), groups),
                    _take(out_chunks, rows), _take(lse_chunks, rows).contiguous(), 0.0, block_causal, scale=scale,
                )
                c = dq_blk.shape[2] // len(rows)
                for t, i in enumerate(rows):
                    dq_chunks[i].add_(dq_blk[:, :, t * c:(t + 1) * c])
                if groups > 1:  # gradients of the expanded heads, summed back onto each kv head
                    dk_blk = dk_blk.unflatten(1, (hkv, groups)).sum(dim=2)
                    dv_blk = dv_blk.unflatten(1, (hkv, groups)).sum(dim=2)
                for t, j in enumerate(cols):
                    dk_chunks[j].add_(dk_blk[:, :, t * c:(t + 1) * c])
                    dv_chunks[j].add_(dv_blk[:, :, t * c:(t + 1) * c])
            if ring.size > 1:
                grad_requests, dkv = ring.start_shift(dkv, _GRAD_TAG)
                for request in grad_requests:
                    request.wait()
            if pending is not None:
                requests, kv = pending
                for request in requests:
                    request.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


class RingAttention:
    """SDPA-signature callable (q [B, H, L, D], this rank's chunks) running exact ring attention over ``group``."""

    def __init__(self, group: dist.ProcessGroup, layout: TokenLayout):
        self._ring = _Ring(group, layout)

    @torch.compiler.disable
    def __call__(self, q, k, v, *, is_causal: bool = True, enable_gqa: bool = False, scale: float | None = None):
        if q.shape[1] != k.shape[1] and (not enable_gqa or q.shape[1] % k.shape[1]):
            raise ValueError(f"{q.shape[1]} query heads need enable_gqa and a multiple of the {k.shape[1]} kv heads")
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return _RingAttentionFn.apply(q, k, v, self._ring, scale, is_causal)


class RingSystem(HandWrittenSP):
    """``build_system("ring", ...)``: exact ring attention; ``load_balance`` picks zig-zag (default) or contiguous."""

    name = "ring"

    def __init__(
        self, model: nn.Module, *, sp_size: int, process_group=None, compiler: str = "aot_eager",
        load_balance: bool = True,
    ):
        layout = TokenLayout.zigzag(sp_size) if load_balance else TokenLayout.contiguous(sp_size)
        super().__init__(
            model, sp_size=sp_size, process_group=process_group, compiler=compiler,
            make_attention=lambda groups: RingAttention(groups.sp_group, layout), layout=layout,
        )
