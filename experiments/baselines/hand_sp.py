"""The training step every hand-written sequence-parallel baseline shares; a baseline supplies its attention.

`HandWrittenSP` is what a practitioner writes around a distributed attention:
cut the rank's tokens out of the full sample (`common.shard_sample`: global
positions, labels shifted before slicing), run the model on them with the
distributed attention installed (`adapters`), divide the summed loss by the
global number of valid targets, backpropagate, and sum the gradients over the SP
group (averaging data-parallel replicas).  The loss it reports is the sum of the
ranks' shares: the single-device loss of the full sample.  The model code between
attentions is compiled with ``torch.compile(backend=compiler)``; whether the
distributed attention is inside the graph or a graph break depends on the
baseline (each says which, and why).  ``activation_checkpointing=True`` adds
per-layer activation checkpointing (`adapters.enable_layer_checkpointing`): each
decoder layer keeps its input and recomputes everything else, the distributed
attention's collectives included, in backward (``ulysses+ckpt``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from autosp.groups import SequenceParallelGroups, build_groups
from experiments.baselines.adapters import (
    SPAttention,
    enable_layer_checkpointing,
    install_attention,
    local_logits,
)
from experiments.baselines.common import (
    TokenLayout,
    all_reduce_loss,
    maybe_compile,
    named_gradients,
    shard_sample,
    summed_token_loss,
    sync_gradients,
)

log = logging.getLogger(__name__)


class HandWrittenSP:
    """A `System` that shards by hand and calls a distributed attention; see the module docstring."""

    name = "hand-written"

    def __init__(
        self,
        model: nn.Module,
        *,
        sp_size: int,
        process_group: dist.ProcessGroup | None,
        compiler: str,
        make_attention: Callable[[SequenceParallelGroups], SPAttention],
        layout: TokenLayout,
        activation_checkpointing: bool = False,
        fullgraph: bool = False,
    ):
        self.model = model
        self.groups = build_groups(sp_size, process_group)
        self.layout = layout
        how = install_attention(model, make_attention(self.groups), tag=self.name.replace("-", "_"))
        if activation_checkpointing:
            how += "; " + enable_layer_checkpointing(model)
        log.info("%s: %s, sp_size=%d, compiler=%s", self.name, how, sp_size, compiler)
        # fullgraph where the attention is traced (a graph break is then an error, not a silent fallback).
        self._summed_loss = maybe_compile(self._local_summed_loss, compiler, fullgraph=fullgraph)

    def _local_summed_loss(self, input_ids, position_ids, targets) -> torch.Tensor:
        return summed_token_loss(local_logits(self.model, input_ids, position_ids), targets)

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        batch = shard_sample(input_ids, labels, self.layout, self.groups.sp_rank)
        loss = self._summed_loss(batch.input_ids, batch.position_ids, batch.targets) / batch.valid_targets
        loss.backward()
        sync_gradients(self.model, self.groups.group, divide_by=self.groups.dp_size)
        return all_reduce_loss(loss, self.groups.sp_group)

    def gradients(self) -> dict[str, torch.Tensor]:
        return named_gradients(self.model)

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)
