"""Pieces the baselines share: token layouts, sharding a sample by hand, the exact loss and gradient sync.

A hand-written sequence-parallel step has to do by hand what AutoSP does in the
compiler: give each rank its tokens (contiguous slices, or the zig-zag chunks of
load-balanced ring attention) with their *global* position ids, shift the labels
over the whole sequence *before* slicing (so the target at each shard border
survives), divide the local summed loss by the global number of valid targets,
and sum the gradients over the SP group.  This module holds those steps as plain
functions, plus the error type and small helpers every system uses.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autosp.inputs import shift_labels
from autosp.ring_attention import rank_chunks

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
"""Label value that does not count in the loss (PyTorch's and Hugging Face's convention)."""


class BaselineUnsupported(NotImplementedError):
    """This baseline cannot run this model or configuration; the message says why (a result, not a bug)."""


def loss_of(output) -> torch.Tensor:
    """The loss from a plain tensor or a Hugging Face ``ModelOutput``."""
    return output if isinstance(output, torch.Tensor) else output.loss


def named_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of the gradients of ``model``'s parameters, by name."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def maybe_compile(fn, compiler: str, **kwargs):
    """``torch.compile(fn, backend=compiler)``, or ``fn`` itself for ``compiler="eager"``."""
    return fn if compiler == "eager" else torch.compile(fn, backend=compiler, **kwargs)


def ensure_deepspeed_comm() -> None:
    """Make ``deepspeed.comm`` wrap the already initialised ``torch.distributed`` (DeepSpeed's ops need it).

    On CPU the first call JIT-builds DeepSpeed's shared-memory comm op once (cached
    under ``TORCH_EXTENSIONS_DIR``).
    """
    import deepspeed.comm as ds_comm

    if not dist.is_initialized():
        raise ValueError("torch.distributed is not initialised; call torch.distributed.init_process_group() first")
    if not ds_comm.is_initialized():
        ds_comm.init_distributed(dist_backend=dist.get_backend(), verbose=False)


# --- token layouts ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenLayout:
    """Which equal-sized chunks of the sequence each rank of an SP group holds, in local order."""

    num_chunks: int
    """The sequence is cut into this many equal chunks."""
    chunks: tuple[tuple[int, ...], ...]
    """``chunks[r]``: the chunk indices rank r holds, concatenated in this order."""
    kind: str = "contiguous"
    """The layout's name in autosp.ring_attention.LAYOUTS (what AutoSP's ring attention is told)."""

    @classmethod
    def of(cls, kind: str, sp_size: int) -> TokenLayout:
        """The layout ``kind`` ("contiguous", or "zigzag": Note [Zig-zag layout] in autosp/inputs.py)."""
        chunks = tuple(rank_chunks(kind, sp_size, r) for r in range(sp_size))
        return cls(sum(len(c) for c in chunks), chunks, kind)

    @classmethod
    def contiguous(cls, sp_size: int) -> TokenLayout:
        return cls.of("contiguous", sp_size)

    @classmethod
    def zigzag(cls, sp_size: int) -> TokenLayout:
        return cls.of("zigzag", sp_size)

    def chunk_len(self, seq_len: int) -> int:
        if seq_len % self.num_chunks:
            raise ValueError(
                f"sequence length {seq_len} does not split into {self.num_chunks} equal chunks for this layout; "
                f"pass a multiple of {self.num_chunks} tokens"
            )
        return seq_len // self.num_chunks

    def token_indices(self, seq_len: int, rank: int) -> torch.Tensor:
        """Global indices of rank ``rank``'s tokens, in local order."""
        c = self.chunk_len(seq_len)
        return torch.cat([torch.arange(i * c, (i + 1) * c) for i in self.chunks[rank]])


@dataclass(frozen=True)
class LocalBatch:
    """One rank's share of a full-length sample."""

    input_ids: torch.Tensor
    """[B, S_local] token ids."""
    position_ids: torch.Tensor
    """[B, S_local] the tokens' positions in the full sequence."""
    targets: torch.Tensor
    """[B, S_local] next-token targets, shifted over the full sequence (IGNORE_INDEX where none)."""
    valid_targets: int
    """Targets that count in the whole sample (all ranks together): the loss denominator."""


def shard_sample(input_ids: torch.Tensor, labels: torch.Tensor, layout: TokenLayout, rank: int) -> LocalBatch:
    """Cut rank ``rank``'s tokens out of a full [B, S] sample; labels are shifted before slicing."""
    if input_ids.dim() != 2 or labels.shape != input_ids.shape:
        raise ValueError(
            f"expected input_ids and labels of one shape [batch, sequence], got {tuple(input_ids.shape)} "
            f"and {tuple(labels.shape)}"
        )
    seq_len = input_ids.shape[1]
    index = layout.token_indices(seq_len, rank).to(input_ids.device)
    targets = shift_labels(labels, IGNORE_INDEX)
    positions = torch.arange(seq_len, device=input_ids.device).expand_as(input_ids)
    return LocalBatch(
        input_ids=input_ids[:, index],
        position_ids=positions[:, index],
        targets=targets[:, index].contiguous(),
        valid_targets=int((targets != IGNORE_INDEX).sum()),
    )


def summed_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over this rank's valid targets (fp32); divide by the global count."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def all_reduce_loss(loss: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum of each rank's share of the loss over the SP group: the full-sample loss (detached)."""
    total = loss.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total


def sync_gradients(model: nn.Module, group: dist.ProcessGroup, *, divide_by: int = 1) -> None:
    """All-reduce every gradient over ``group`` (one flat buffer per dtype), then divide by ``divide_by``.

    Summing over all SP groups and dividing by the number of data-parallel
    replicas gives the replica average of the full-sequence gradients.
    """
    if dist.get_world_size(group) == 1 and divide_by == 1:
        return
    buckets: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.grad is not None:
            buckets.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        if divide_by != 1:
            flat /= divide_by
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
