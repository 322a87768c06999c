"""Hand-written ring attention on point-to-point sends: exact, causal, load-balanced (zig-zag chunks).

The step is `hand_sp.HandWrittenSP`; the sequence is cut into 2P chunks and rank r
holds chunks r and 2P-1-r (`common.TokenLayout.zigzag`), so under causal masking
every rank computes the same number of (query, key) blocks; ``load_balance=False``
uses P contiguous chunks instead.  Key/value blocks travel around the ring with
``dist.batch_isend_irecv`` (the next block's transfer overlaps this block's
compute); see Note [Exact ring attention] for the forward and backward.  The ring
runs outside the compiled graph (``torch.compiler.disable``): it is an
``autograd.Function`` issuing point-to-point sends, which Dynamo does not trace.
Grouped-query attention is supported without replicating key/value heads.
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
# b < a.  Each computed block yields an output O_blk (softmax over the block's keys)
# and its row-wise log-sum-exp L_blk; blocks merge exactly by
#     L = logaddexp(L1, L2),   O = O1 * exp(L1 - L) + O2 * exp(L2 - L),
# so after all steps O and L are those of softmax attention over the whole sequence.
# Backward (the same ring, key/value blocks travelling forward again while their
# gradient accumulators travel with them): with the final O and L, a block's
# probabilities are P_blk = exp(S_blk - L) and, with Delta = rowsum(dO * O),
#     dV_b += P^T dO_a,   dS = P * (dO_a V_b^T - Delta_a),
#     dQ_a += scale * dS K_b,   dK_b += scale * dS^T Q_a,
# which is exactly the gradient of full attention restricted to the block.  After P
# steps plus one final transfer, each rank holds the finished dK/dV of its own
# chunks.  All arithmetic is fp32 (inputs of lower precision are upcast).

_KV_TAG, _GRAD_TAG = 0, 1


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


def _scores(q, k, scale: float, relation: str) -> torch.Tensor:
    """q [B, Hkv, G, c, D], k [B, Hkv, c, D] -> scaled scores [B, Hkv, G, c, c], causal-masked on the diagonal."""
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    if relation == "diagonal":
        c = s.shape[-1]
        s = s.masked_fill(torch.ones(c, c, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _merge(out, lse, block_out, block_lse):
    if out is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    return out * torch.exp(lse - new_lse)[..., None] + block_out * torch.exp(block_lse - new_lse)[..., None], new_lse


class _RingAttentionFn(torch.autograd.Function):
    """q [B, H, L, D], k/v [B, Hkv, L, D] (this rank's chunks) -> out [B, H, L, D]; see Note [Exact ring attention]."""

    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring, scale: float, causal: bool):
        b, h, length, d = q.shape
        hkv = k.shape[1]
        mine = ring.layout.chunks[ring.rank]
        n = len(mine)
        qg = q.float().reshape(b, hkv, h // hkv, length, d)  # [B, Hkv, G, L, D]
        q_chunks = qg.chunk(n, dim=3)
        kv = torch.stack([k.float(), v.float()]).contiguous()  # [2, B, Hkv, L, D]
        outs, lses = [None] * n, [None] * n
        for step in range(ring.size):
            pending = ring.start_shift(kv, _KV_TAG) if step < ring.size - 1 else None
            k_chunks, v_chunks = kv[0].chunk(n, dim=2), kv[1].chunk(n, dim=2)
            for i, a in enumerate(mine):
                for j, bk in enumerate(ring.chunks_at(step)):
                    relation = _relation(a, bk, causal)
                    if relation is None:
                        continue
                    s = _scores(q_chunks[i], k_chunks[j], scale, relation)
                    block_lse = torch.logsumexp(s, dim=-1)
                    block_out = torch.matmul(torch.exp(s - block_lse[..., None]), v_chunks[j].unsqueeze(2))
                    outs[i], lses[i] = _merge(outs[i], lses[i], block_out, block_lse)
            if pending is not None:
                requests, kv = pending
                for request in requests:
                    request.wait()
        out, lse = torch.cat(outs, dim=3), torch.cat(lses, dim=3)  # [B, Hkv, G, L, D], [B, Hkv, G, L]
        ctx.save_for_backward(qg, k, v, out, lse)
        ctx.ring, ctx.scale, ctx.causal, ctx.q_dtype = ring, scale, causal, q.dtype
        return out.reshape(b, h, length, d).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        qg, k, v, out, lse = ctx.saved_tensors
        ring, scale, causal = ctx.ring, ctx.scale, ctx.causal
        mine = ring.layout.chunks[ring.rank]
        n = len(mine)
        dout = grad_out.float().reshape(out.shape)
        delta = (dout * out).sum(dim=-1)  # [B, Hkv, G, L]
        dq = torch.zeros_like(qg)
        q_chunks, dq_chunks = qg.chunk(n, dim=3), dq.chunk(n, dim=3)
        dout_chunks, delta_chunks, lse_chunks = dout.chunk(n, dim=3), delta.chunk(n, dim=3), lse.chunk(n, dim=3)
        kv = torch.stack([k.float(), v.float()]).contiguous()
        dkv = torch.zeros_like(kv)  # travels with the key/value block it belongs to
        for step in range(ring.size):
            pending = ring.start_shift(kv, _KV_TAG) if step < ring.size - 1 else None
            k_chunks, v_chunks = kv[0].chunk(n, dim=2), kv[1].chunk(n, dim=2)
            dk_chunks, dv_chunks = dkv[0].chunk(n, dim=2), dkv[1].chunk(n, dim=2)
            for i, a in enumerate(mine):
                for j, bk in enumerate(ring.chunks_at(step)):
                    relation = _relation(a, bk, causal)
                    if relation is None:
                        continue
                    p = torch.exp(_scores(q_chunks[i], k_chunks[j], scale, relation) - lse_chunks[i][..., None])
                    dv_chunks[j].add_(torch.matmul(p.transpose(-1, -2), dout_chunks[i]).sum(dim=2))
                    dp = torch.matmul(dout_chunks[i], v_chunks[j].unsqueeze(2).transpose(-1, -2))
                    ds = p * (dp - delta_chunks[i][..., None])
                    dq_chunks[i].add_(torch.matmul(ds, k_chunks[j].unsqueeze(2)), alpha=scale)
                    dk_chunks[j].add_(torch.matmul(ds.transpose(-1, -2), q_chunks[i]).sum(dim=2), alpha=scale)
            if ring.size > 1:
                grad_requests, dkv = ring.start_shift(dkv, _GRAD_TAG)
                for request in grad_requests:
                    request.wait()
            if pending is not None:
                requests, kv = pending
                for request in requests:
                    request.wait()
        b, hkv, g, length, d = qg.shape
        dq = dq.reshape(b, hkv * g, length, d).to(ctx.q_dtype)
        return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


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
