"""Hand-written DeepSpeed-Ulysses: DeepSpeed's ``DistributedAttention`` around each layer's local attention.

The step is `hand_sp.HandWrittenSP` with contiguous token slices.  In each layer
``DistributedAttention`` (``deepspeed.sequence.layer``) all-to-alls the
sequence-sharded q/k/v [B, S/P, H, D] into head-sharded full-sequence
[B, S, H/P, D], runs causal SDPA on this rank's heads, and all-to-alls the output
back.  Exact: attention sees the whole sequence, everything else is token-wise.
The whole local step, ``DistributedAttention`` included, is compiled with
``torch.compile(backend=compiler, fullgraph=True)``: Dynamo (torch 2.13) traces its all-to-all
``autograd.Function`` over ``deepspeed.comm`` in one graph, forward and backward
(checked exact in tests/experiments).  ``attention_in_graph=False`` keeps it out
of the graph instead (``torch.compiler.disable``: one graph break per layer, the
collective runs eagerly as DeepSpeed wrote it), for versions where tracing fails.
Key/value heads must be at least P (DeepSpeed's own check).

``ulysses+ckpt`` is the same with per-layer activation checkpointing, as
Ulysses is run for long sequences in practice (Megatron/DeepSpeed
``checkpoint_activations``, Hugging Face ``gradient_checkpointing``): every decoder
layer keeps its input and recomputes its forward, both all-to-alls included, in
backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from experiments.baselines.common import TokenLayout, ensure_deepspeed_comm
from experiments.baselines.hand_sp import HandWrittenSP


def _local_attention(q, k, v, *, is_causal: bool, enable_gqa: bool, scale: float | None):
    """SDPA over the full sequence for this rank's heads; q/k/v and the result are [B, S, H/P, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=is_causal, enable_gqa=enable_gqa,
        scale=scale,
    )
    return out.transpose(1, 2).contiguous()


class UlyssesAttention:
    """SDPA-signature callable (q [B, H, S/P, D]) running ``DistributedAttention`` over ``group``."""

    def __init__(self, group: dist.ProcessGroup, *, in_graph: bool = True):
        from deepspeed.sequence.layer import DistributedAttention

        ensure_deepspeed_comm()
        # [B, S/P, H, D]: scatter heads (dim 2), gather sequence (dim 1); batch_dim_idx=0 per call.
        self._attention = DistributedAttention(_local_attention, group, scatter_idx=2, gather_idx=1)
        self._run = self._forward if in_graph else torch.compiler.disable(self._forward)

    def __call__(self, q, k, v, *, is_causal: bool = True, enable_gqa: bool = False, scale: float | None = None):
        return self._run(q, k, v, is_causal=is_causal, enable_gqa=enable_gqa, scale=scale)

    def _forward(self, q, k, v, *, is_causal: bool, enable_gqa: bool, scale: float | None):
        out = self._attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0, None,
            is_causal=is_causal, enable_gqa=enable_gqa, scale=scale,
        )  # [B, S/P, H, D]
        return out.transpose(1, 2)


class UlyssesSystem(HandWrittenSP):
    """``build_system("ulysses", ...)``: exact, contiguous shards, DeepSpeed's all-to-all attention."""

    name = "ulysses"

    def __init__(
        self, model: nn.Module, *, sp_size: int, process_group=None, compiler: str = "aot_eager",
        attention_in_graph: bool = True, activation_checkpointing: bool = False,
    ):
        super().__init__(
            model, sp_size=sp_size, process_group=process_group, compiler=compiler,
            make_attention=lambda groups: UlyssesAttention(groups.sp_group, in_graph=attention_in_graph),
            layout=TokenLayout.contiguous(sp_size), activation_checkpointing=activation_checkpointing,
            fullgraph=attention_in_graph,
        )
