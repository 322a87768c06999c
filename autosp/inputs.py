"""The input contract: full-length samples in, one rank's shard out.

`prepare_inputs` checks a full-length causal-LM batch and returns the keyword
arguments to call a compiled model with; every rank of an SP group passes the same
sample.  `shard_batch` (called by the compiled model, not by users) pads the
sequence to a multiple of the SP size, shifts the labels by one over the *whole*
sequence (so the target at every shard border survives) and cuts out this rank's
tokens, global position ids, padding mask and shifted labels: one contiguous slice
(Ulysses), or the zig-zag pieces of ring or hybrid attention (Note [Zig-zag layout]).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from autosp.errors import AutoSPError
from simulator.workload import SPKind, SPLayout

PREPARED_KEY = "autosp_batch"
"""Keyword under which `prepare_inputs` marks its output (popped before the model sees it)."""

SEQ_DIM = 1
"""Token tensors are [batch, sequence]."""


@dataclass(frozen=True)
class PreparedBatch:
    """Marker that the keyword arguments came from `prepare_inputs`, with the full sequence length."""

    seq_len: int
    plain_positions: bool = False
    """`prepare_inputs` made the position ids 0..S-1 itself: what a shape-only trace, whose positions have no
    values, knows of them (Note [Document program] in autosp/model.py)."""


def _check_token_tensor(name: str, t: torch.Tensor, shape: torch.Size | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise AutoSPError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise AutoSPError(f"{name} must be [batch, sequence], got shape {tuple(t.shape)}")
    if t.dtype not in (torch.int64, torch.int32):
        raise AutoSPError(f"{name} must hold integer ids (torch.long), got {t.dtype}")
    if shape is not None and t.shape[-1] != shape[-1]:
        raise AutoSPError(f"{name} has shape {tuple(t.shape)} but input_ids has {tuple(shape)}; they must match")


def _positions_from_lengths(document_lengths, input_ids: torch.Tensor) -> torch.Tensor:
    """Position ids restarting at 0 at every document, from per-row (or one shared) document lengths."""
    batch, length = input_ids.shape
    rows = list(document_lengths)
    if rows and not isinstance(rows[0], (list, tuple)):
        rows = [rows] * batch
    if len(rows) != batch:
        raise AutoSPError(f"document_lengths has {len(rows)} rows but input_ids has {batch}")
    positions = []
    for i, row in enumerate(rows):
        if any(int(n) <= 0 for n in row) or sum(int(n) for n in row) != length:
            raise AutoSPError(
                f"document_lengths row {i} is {list(row)}: lengths must be positive and sum to the sequence length "
                f"({length} tokens)"
            )
        positions.append(torch.cat([torch.arange(int(n)) for n in row]))
    return torch.stack(positions).to(input_ids.device)


def prepare_inputs(
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    document_lengths=None,
) -> dict:
    """Keyword arguments for a model compiled by `autosp.compile`, from one full-length batch.

    ``labels`` are the unshifted next-token labels as the model expects them
    (``ignore_index`` where a token must not count).  ``position_ids`` default to
    0..S-1; packed documents are given either as position ids that restart at each
    document or as ``document_lengths`` (one list of lengths for every row, or one
    per row), which become such position ids.  A padding ``attention_mask`` (with
    zeros) is passed to the model; one of all ones is dropped only where the positions
    are 0..S-1 in every row, where a model reads it as no mask at all.  With packed
    positions it is kept: Hugging Face detects packed documents from the position ids
    only when no mask is given, so an all-ones mask there means "attend across the
    documents" and dropping it would change what the model computes.

    The model then computes exactly what it computes on one device from the same
    inputs: where its attention mask depends on the positions (Hugging Face's
    packed-sequence detection) or on the padding mask, AutoSP applies that mask
    over the whole sequence (Note [Document masks] in autosp.document_attention).
    """
    _check_token_tensor("input_ids", input_ids, None)
    if input_ids.shape[SEQ_DIM] == 0:
        raise AutoSPError("input_ids has an empty sequence; pass at least sp_size tokens")
    if labels is not None:
        _check_token_tensor("labels", labels, input_ids.shape)
        if labels.shape != input_ids.shape:
            raise AutoSPError(f"labels shape {tuple(labels.shape)} must equal input_ids shape {tuple(input_ids.shape)}")
    if document_lengths is not None:
        if position_ids is not None:
            raise AutoSPError("pass either position_ids or document_lengths, not both")
        position_ids = _positions_from_lengths(document_lengths, input_ids)
    generated = position_ids is None
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[SEQ_DIM], device=input_ids.device)[None].expand_as(input_ids)
    else:
        _check_token_tensor("position_ids", position_ids, input_ids.shape)
        if position_ids.shape != input_ids.shape:
            raise AutoSPError(f"position_ids shape {tuple(position_ids.shape)} must equal input_ids shape "
                              f"{tuple(input_ids.shape)}")
    kwargs = {"input_ids": input_ids, "position_ids": position_ids,
              PREPARED_KEY: PreparedBatch(input_ids.shape[1], plain_positions=generated)}
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise AutoSPError(
                f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape {tuple(input_ids.shape)}"
            )
        if not (bool((attention_mask != 0).all()) and positions_are_plain(position_ids)):
            kwargs["attention_mask"] = attention_mask
    if labels is not None:
        kwargs["labels"] = labels
    return kwargs


# Note [Zig-zag layout]
# ~~~~~~~~~~~~~~~~~~~~~
# Under strategy="ring" the (padded) sequence is cut into 2P equal chunks and group rank i holds chunks i and
# 2P-1-i, concatenated in that order (`zigzag_chunks`).  Under causal attention every rank then computes the
# same number of (query, key) blocks in the ring (autosp/ring_attention.py), where a contiguous layout would
# leave rank 0 one block and rank P-1 P blocks.  Under strategy="hybrid" (Ulysses groups of U consecutive ranks,
# a ring of R = P / U groups) the zig-zag is the ring's: the sequence is cut into 2R chunks, Ulysses group j holds
# chunks j and 2R-1-j, and its U ranks hold consecutive equal pieces of that pair's concatenation, in Ulysses-rank
# order (`zigzag_ranges`), so that the all-to-all that gathers the group's sequence (in rank order) hands every
# rank the pair exactly as the ring expects it (Note [Hybrid attention] in autosp/passes/dynamo/attention.py).
# U = 1 is the ring's layout.  Everything token-indexed follows this one layout: the
# tokens, their global position ids, the padding mask, the labels (shifted over the whole sequence *before* the
# cut, so a chunk's last target is the next chunk's first token wherever that chunk lives), positions the model
# builds in the graph (autosp/passes/dynamo/positions.py) and outputs gathered back to the whole sequence
# (autosp/guards.py, from `ShardLayout.every_rank`).  Sums over the tokens (the loss) do not depend on the order.
# A consumer that needs a contiguous shard reads `ShardLayout.start` only after checking
# `ShardLayout.contiguous`, or refuses.


def zigzag_chunks(sp_size: int, sp_rank: int) -> tuple[int, int]:
    """The chunks of 2 * sp_size equal chunks that group rank ``sp_rank`` holds, in local order (Note [Zig-zag
    layout])."""
    return sp_rank, 2 * sp_size - 1 - sp_rank


@functools.lru_cache(maxsize=64)
def _zigzag_layout(sp_size: int, ulysses_size: int) -> SPLayout:
    """The rank layout of a ring over Ulysses groups of ``ulysses_size`` ranks (1: the ring alone)."""
    return SPLayout(SPKind.HYBRID, sp_size, ulysses_size)


def zigzag_ranges(padded_seq_len: int, sp_size: int, sp_rank: int, ulysses_size: int = 1) -> tuple[tuple[int, int], ...]:
    """Group rank ``sp_rank``'s tokens under the zig-zag layout of a ring over ``sp_size // ulysses_size`` Ulysses
    groups of ``ulysses_size`` ranks, as [begin, end) ranges of the padded sequence in local order, one per chunk
    the rank has tokens of (Note [Zig-zag layout]).  ``padded_seq_len`` is a multiple of 2 * sp_size."""
    layout = _zigzag_layout(sp_size, ulysses_size)
    ring, (ring_rank, ulysses_rank) = layout.ring_size, layout.coordinates(sp_rank)
    chunk, local = padded_seq_len // (2 * ring), padded_seq_len // sp_size
    pair = [(c * chunk, (c + 1) * chunk) for c in zigzag_chunks(ring, ring_rank)]
    skip, want, out = ulysses_rank * local, local, []
    for begin, end in pair:  # this rank's piece of the pair's concatenation
        if skip >= end - begin:
            skip -= end - begin
            continue
        first = begin + skip
        take = min(end - first, want)
        if take:
            out.append((first, first + take))
        skip, want = 0, want - take
    return tuple(out)


@dataclass(frozen=True)
class ShardLayout:
    """Where one rank's tokens sit in the (padded) full sequence."""

    seq_len: int
    """Tokens in the sample as given."""
    padded_seq_len: int
    """Tokens after padding to a multiple of the SP size (2 x SP size for the zig-zag layout)."""
    local_seq_len: int
    """Tokens on each rank."""
    start: int
    """Index of this rank's first token."""
    ranges: tuple[tuple[int, int], ...] = ()
    """This rank's tokens as [begin, end) index ranges of the padded sequence, in local order; () means the one
    contiguous range from ``start`` (filled in on creation)."""
    every_rank: tuple[tuple[tuple[int, int], ...], ...] = ()
    """Every group rank's ``ranges``, in group-rank order (what gathers outputs back to the whole sequence); ()
    means contiguous slices in rank order (filled in on creation)."""

    def __post_init__(self) -> None:
        if not self.ranges:
            object.__setattr__(self, "ranges", ((self.start, self.start + self.local_seq_len),))
        if not self.every_rank:
            local = self.local_seq_len
            object.__setattr__(self, "every_rank", tuple(((r * local, (r + 1) * local),)
                                                         for r in range(self.padded_seq_len // local)))

    @property
    def pad_tokens(self) -> int:
        return self.padded_seq_len - self.seq_len

    @property
    def contiguous(self) -> bool:
        """Whether this rank holds one contiguous slice [start, start + local_seq_len) (False: zig-zag)."""
        return len(self.ranges) == 1

    @property
    def zigzag(self) -> bool:
        return not self.contiguous

    def window(self) -> ShardLayout:
        """The contiguous layout of ``local_seq_len`` tokens from ``start`` (this layout, when contiguous)."""
        return self if self.contiguous else ShardLayout(self.seq_len, self.padded_seq_len, self.local_seq_len,
                                                        self.start)


def shard_layout(seq_len: int, *, sp_size: int, sp_rank: int, pad_to_multiple: bool,
                 length_bucket: int | None = None, zigzag: bool = False, ulysses_size: int = 1) -> ShardLayout:
    """The shard of a sequence of ``seq_len`` tokens for group rank ``sp_rank``: contiguous, or with ``zigzag`` the
    pieces of Note [Zig-zag layout] (a ring over Ulysses groups of ``ulysses_size`` ranks: 1 for the ring).

    The sequence is padded to a multiple of ``length_bucket`` when given (see AutoSPConfig), else of sp_size
    (2 * sp_size for the zig-zag layout, whose pieces are equal)."""
    if seq_len < sp_size:
        raise AutoSPError(f"sequence of {seq_len} tokens is shorter than sp_size={sp_size}; pass at least sp_size tokens")
    multiple = length_bucket or (2 * sp_size if zigzag else sp_size)
    if zigzag and multiple % (2 * sp_size):
        raise AutoSPError(f"length_bucket={length_bucket} is not a multiple of 2 * sp_size = {2 * sp_size}, which "
                          "strategy='ring' and 'hybrid' need (their zig-zag layout cuts the sequence into 2 * "
                          "sp_size equal pieces); pass a multiple of it")
    padded = -(-seq_len // multiple) * multiple
    if padded != seq_len and not pad_to_multiple:
        what = f"2 * sp_size = {multiple}" if zigzag else f"sp_size={sp_size}"
        raise AutoSPError(
            f"sequence length {seq_len} is not divisible by {what}; pass a multiple of {multiple} "
            "tokens or compile with pad_to_multiple=True"
        )
    local = padded // sp_size
    if local < 2 and sp_size > 1:
        raise AutoSPError(
            f"a sequence of {seq_len} tokens leaves {local} token per rank at sp_size={sp_size}; AutoSP needs at "
            f"least 2 tokens per rank (models such as Hugging Face's treat a one-token query as non-causal): pass "
            f"at least {2 * sp_size} tokens"
        )
    if not zigzag or sp_size == 1:
        return ShardLayout(seq_len=seq_len, padded_seq_len=padded, local_seq_len=local, start=sp_rank * local)
    every_rank = tuple(zigzag_ranges(padded, sp_size, r, ulysses_size) for r in range(sp_size))
    ranges = every_rank[sp_rank]
    return ShardLayout(seq_len=seq_len, padded_seq_len=padded, local_seq_len=local, start=ranges[0][0],
                       ranges=ranges, every_rank=every_rank)


def in_sequence_order(parts, every_rank: tuple[tuple[tuple[int, int], ...], ...], dim: int) -> torch.Tensor:
    """Every rank's tokens put back in sequence order: ``parts[r]`` holds group rank r's tokens along ``dim`` in its
    local order, ``every_rank[r]`` says where they came from (`ShardLayout.every_rank`)."""
    pieces = []
    for part, ranges in zip(parts, every_rank, strict=True):
        pieces += zip((begin for begin, _ in ranges), part.split([end - begin for begin, end in ranges], dim),
                      strict=True)
    return torch.cat([piece for _, piece in sorted(pieces, key=lambda p: p[0])], dim)


def gathered_in_sequence_order(gathered: torch.Tensor, dim: int,
                               every_rank: tuple[tuple[tuple[int, int], ...], ...]) -> torch.Tensor:
    """`in_sequence_order` of every rank's tokens concatenated in rank order along ``dim`` (an all-gather's result):
    under the zig-zag layout, the whole sequence in its own order (the mask pass's document ids read it)."""
    return in_sequence_order(gathered.chunk(len(every_rank), dim), every_rank, dim)


def pad_end(t: torch.Tensor, tokens: int, value: int | None) -> torch.Tensor:
    """``t`` ([batch, sequence]) with ``tokens`` more tokens of ``value`` at the end; None repeats the last token.

    Public because the attention-mask pass rebuilds the whole padded sequence (to check a
    mask against the rule over it), and must pad exactly as the ranks' shards are padded."""
    if tokens == 0:
        return t
    fill = t[:, -1:].expand(-1, tokens) if value is None else torch.full_like(t[:, :1], value).expand(-1, tokens)
    return torch.cat([t, fill], dim=SEQ_DIM)


def shard_tokens(t: torch.Tensor, layout: ShardLayout, value: int | None) -> torch.Tensor:
    """This rank's tokens of the full-sequence ``t``: padded to the layout's length with ``value`` (see `pad_end`),
    then cut to the rank's window (or zig-zag chunks, in local order).

    The one place a rank's tokens are taken, so that `shard_batch` and the attention-mask
    pass's check of the real batch see the same tokens."""
    padded = pad_end(t, layout.pad_tokens, value)
    pieces = [padded[:, begin:end] for begin, end in layout.ranges]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=SEQ_DIM)


def shift_labels(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Targets of the full sequence: token i is trained to predict labels[i + 1]; the last predicts nothing."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], ignore_index)], dim=SEQ_DIM)


def shard_batch(kwargs: dict, layout: ShardLayout, *, ignore_index: int, pad_token_id: int) -> dict:
    """This rank's slice of a prepared batch.  ``labels`` come out already shifted over the full sequence."""
    local = dict(kwargs)
    # Every shard is made contiguous: Dynamo guards a program on its inputs' strides, and a view's strides
    # depend on how the full tensor was built (an expanded arange of positions, or one padded by a cat), which
    # would compile a second program for one shard shape (Note [One program per length] in autosp/model.py).
    local["input_ids"] = shard_tokens(kwargs["input_ids"], layout, pad_token_id).contiguous()
    # Padding tokens reuse the last position: any valid position is exact since their outputs are ignored.
    local["position_ids"] = shard_tokens(kwargs["position_ids"], layout, None).contiguous()
    if kwargs.get("attention_mask") is not None:  # tokens padded to the layout are padding: 0
        local["attention_mask"] = shard_tokens(kwargs["attention_mask"], layout, 0).contiguous()
    if kwargs.get("labels") is not None:
        shifted = shift_labels(kwargs["labels"], ignore_index)
        local["labels"] = shard_tokens(shifted, layout, ignore_index).contiguous()
    return local


def positions_are_plain(position_ids) -> bool:
    """Whether ``position_ids`` are 0..S-1 in every row (one unpacked sequence per row).

    False where the values are not known, so a program that relies on plain positions is
    never built or run on a guess: no position ids, something that is not a tensor, or a
    FakeTensor (a shape-only trace)."""
    if not isinstance(position_ids, torch.Tensor) or isinstance(position_ids, FakeTensor):
        return False
    with unset_fake_temporarily():  # real values, compared as such inside a shape-only trace's fake mode
        plain = torch.arange(position_ids.shape[-1], device=position_ids.device)
        return torch.equal(position_ids, plain.expand_as(position_ids))
