"""Hand-written ring attention on point-to-point sends, as real implementations do it: exact, causal, zig-zag.

The step is `hand_sp.HandWrittenSP`; the sequence is cut into 2P chunks and rank r
holds chunks r and 2P-1-r (`common.TokenLayout.zigzag`), so under causal masking
every rank computes the same number of (query, key) blocks; ``load_balance=False``
uses P contiguous chunks instead.  The attention itself is AutoSP's ring
(``autosp_testbed::ring_attention``, Note [Ring attention] in autosp/ring_attention.py:
key/value blocks travel around the ring with ``dist.batch_isend_irecv``, the next
block's transfer overlapping this block's fused flash-attention call, blocks merged
by the online-softmax rule in fp32, dK/dV passed around the ring in backward); what
is hand-written here is everything around it, as a practitioner writes it: the
sharding, the loss and the gradient sync of `hand_sp`.  The ring runs outside the
compiled graph (``torch.compiler.disable``: one graph break per attention layer, as
hand-written ring implementations built on ``autograd.Function`` have); the model
code between attentions is compiled.  Grouped-query attention is supported without
sending replicated key/value heads.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from autosp.ring_attention import ring_attention
from experiments.baselines.common import TokenLayout
from experiments.baselines.hand_sp import HandWrittenSP


class RingAttention:
    """SDPA-signature callable (q [B, H, L, D], this rank's chunks) running exact ring attention over ``group``."""

    def __init__(self, group: dist.ProcessGroup, layout: TokenLayout):
        self._group_name, self._size = group.group_name, dist.get_world_size(group)
        self._layout = layout.kind

    @torch.compiler.disable
    def __call__(self, q, k, v, *, is_causal: bool = True, enable_gqa: bool = False, scale: float | None = None):
        if q.shape[1] != k.shape[1] and (not enable_gqa or q.shape[1] % k.shape[1]):
            raise ValueError(f"{q.shape[1]} query heads need enable_gqa and a multiple of the {k.shape[1]} kv heads")
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return ring_attention(q, k, v, scale, is_causal, self._layout, self._group_name, self._size)[0]


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
