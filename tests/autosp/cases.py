"""Shared pieces of the AutoSP tests: samples and a single-device reference step."""

from __future__ import annotations

import torch

IGNORE = -100


def make_sample(seq_len: int, vocab: int, *, seed: int, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels whose ignored targets are spread unevenly over the sequence."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=g)
    labels = ids.clone()
    labels[0, : seq_len // 3] = IGNORE  # a long ignored prefix: the first shard holds most of them
    labels[1, torch.rand(seq_len, generator=g) < 0.2] = IGNORE
    return ids, labels


def loss_of(output) -> torch.Tensor:
    """The loss from a plain tensor or a Hugging Face ModelOutput."""
    return output if isinstance(output, torch.Tensor) else output.loss


def named_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
