"""The input contract: full-length samples in, one rank's shard out.

`prepare_inputs` checks a full-length causal-LM batch and returns the keyword
arguments to call a compiled model with; every rank of an SP group passes the same
sample.  `shard_batch` (called by the compiled model, not by users) pads the
sequence to a multiple of the SP size, shifts the labels by one over the *whole*
sequence (so the target at every shard border survives) and cuts out this rank's
contiguous slice of tokens, global position ids and shifted labels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autosp.errors import AutoSPError

PREPARED_KEY = "autosp_batch"
"""Keyword under which `prepare_inputs` marks its output (popped before the model sees it)."""

SEQ_DIM = 1
"""Token tensors are [batch, sequence]."""


@dataclass(frozen=True)
class PreparedBatch:
    """Marker that the keyword arguments came from `prepare_inputs`, with the full sequence length."""

    seq_len: int


def _check_token_tensor(name: str, t: torch.Tensor, shape: torch.Size | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise AutoSPError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise AutoSPError(f"{name} must be [batch, sequence], got shape {tuple(t.shape)}")
    if t.dtype not in (torch.int64, torch.int32):
        raise AutoSPError(f"{name} must hold integer ids (torch.long), got {t.dtype}")
    if shape is not None and t.shape[-1] != shape[-1]:
        raise AutoSPError(f"{name} has shape {tuple(t.shape)} but input_ids has {tuple(shape)}; they must match")


def prepare_inputs(
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> dict:
    """Keyword arguments for a model compiled by `autosp.compile`, from one full-length batch.

    ``labels`` are the unshifted next-token labels as the model expects them
    (``ignore_index`` where a token must not count).  ``position_ids`` default to
    0..S-1.  An ``attention_mask`` of all ones is dropped (causal attention is
    exact without it); a padding mask is refused, see the error for what to do.
    """
    _check_token_tensor("input_ids", input_ids, None)
    if input_ids.shape[SEQ_DIM] == 0:
        raise AutoSPError("input_ids has an empty sequence; pass at least sp_size tokens")
    if labels is not None:
        _check_token_tensor("labels", labels, input_ids.shape)
        if labels.shape != input_ids.shape:
            raise AutoSPError(f"labels shape {tuple(labels.shape)} must equal input_ids shape {tuple(input_ids.shape)}")
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[SEQ_DIM], device=input_ids.device)[None].expand_as(input_ids)
    else:
        _check_token_tensor("position_ids", position_ids, input_ids.shape)
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise AutoSPError(
                f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape {tuple(input_ids.shape)}"
            )
        if not bool((attention_mask != 0).all()):
            raise AutoSPError(
                "attention_mask masks some tokens (padding); AutoSP shards the sequence and only supports "
                "causal attention without a padding mask.  Pack sequences without padding, or pad at the end, "
                "set those labels to -100 and drop the mask: under causal attention this is exact."
            )
    kwargs = {"input_ids": input_ids, "position_ids": position_ids, PREPARED_KEY: PreparedBatch(input_ids.shape[1])}
    if labels is not None:
        kwargs["labels"] = labels
    return kwargs


@dataclass(frozen=True)
class ShardLayout:
    """Where one rank's tokens sit in the (padded) full sequence."""

    seq_len: int
    """Tokens in the sample as given."""
    padded_seq_len: int
    """Tokens after padding to a multiple of the SP size."""
    local_seq_len: int
    """Tokens on each rank."""
    start: int
    """Index of this rank's first token."""

    @property
    def pad_tokens(self) -> int:
        return self.padded_seq_len - self.seq_len


def shard_layout(seq_len: int, *, sp_size: int, sp_rank: int, pad_to_multiple: bool,
                 length_bucket: int | None = None) -> ShardLayout:
    """Contiguous shard of a sequence of ``seq_len`` tokens for group rank ``sp_rank``.

    The sequence is padded to a multiple of ``length_bucket`` when given (see AutoSPConfig), else of sp_size."""
    if seq_len < sp_size:
        raise AutoSPError(f"sequence of {seq_len} tokens is shorter than sp_size={sp_size}; pass at least sp_size tokens")
    multiple = length_bucket or sp_size
    padded = -(-seq_len // multiple) * multiple
    if padded != seq_len and not pad_to_multiple:
        raise AutoSPError(
            f"sequence length {seq_len} is not divisible by sp_size={sp_size}; pass a multiple of {sp_size} "
            "tokens or compile with pad_to_multiple=True"
        )
    local = padded // sp_size
    if local < 2 and sp_size > 1:
        raise AutoSPError(
            f"a sequence of {seq_len} tokens leaves {local} token per rank at sp_size={sp_size}; AutoSP needs at "
            f"least 2 tokens per rank (models such as Hugging Face's treat a one-token query as non-causal): pass "
            f"at least {2 * sp_size} tokens"
        )
    return ShardLayout(seq_len=seq_len, padded_seq_len=padded, local_seq_len=local, start=sp_rank * local)


def _pad_end(t: torch.Tensor, tokens: int, value: int | None) -> torch.Tensor:
    if tokens == 0:
        return t
    fill = t[:, -1:].expand(-1, tokens) if value is None else torch.full_like(t[:, :1], value).expand(-1, tokens)
    return torch.cat([t, fill], dim=SEQ_DIM)


def shift_labels(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Targets of the full sequence: token i is trained to predict labels[i + 1]; the last predicts nothing."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], ignore_index)], dim=SEQ_DIM)


def shard_batch(kwargs: dict, layout: ShardLayout, *, ignore_index: int, pad_token_id: int) -> dict:
    """This rank's slice of a prepared batch.  ``labels`` come out already shifted over the full sequence."""
    local = dict(kwargs)
    window = slice(layout.start, layout.start + layout.local_seq_len)
    local["input_ids"] = _pad_end(kwargs["input_ids"], layout.pad_tokens, pad_token_id)[:, window]
    # Padding tokens reuse the last position: any valid position is exact since their outputs are ignored.
    local["position_ids"] = _pad_end(kwargs["position_ids"], layout.pad_tokens, None)[:, window]
    if kwargs.get("labels") is not None:
        shifted = shift_labels(kwargs["labels"], ignore_index)
        local["labels"] = _pad_end(shifted, layout.pad_tokens, ignore_index)[:, window].contiguous()
    return local
