"""Attention over a whole sequence of packed documents, padding and sliding windows, without an [S, S] mask.

Note [Document masks]
A training batch row is described by one integer per token, its *document id*
(`document_ids`): tokens of one document share an id, every padding token has
an id of its own.  The attention rule the pass applies after the Ulysses
all-to-all is

    query q may read key k  ⇔  k ≤ q  and  |doc[q]| = doc[k]  and  (window is None or q − k < window)

with document ids ≥ 1, negated for padding tokens.  Chunked attention (a query
reads only keys of its own chunk of C tokens) is documents too: a new document
starts at every multiple of C, of the token index or of the position.  A padding key (negative id)
is read by no query; a padding query reads the valid keys of its document, as
Hugging Face masks keys only (a row with no valid key gives 0, as
scaled_dot_product_attention does).  That is, exactly, the mask Hugging Face
builds from packed position ids (`find_packed_sequence_indices`), a padding mask
and a sliding window (index-based, as its ``kv_idx > q_idx - window``).  `autosp.passes.dynamo.masks`
decides, by evaluating the model's own mask subgraph on probe inputs, which of
the three ingredients the model's mask has; this module only runs the rule.

The rule runs in ``flex_attention`` with a block mask: the sequence is cut into
blocks of `BLOCK` tokens, and for each (query block, key block) pair the mask is
*empty* (skipped), *full* (no mask evaluated) or *partial* (the rule evaluated
per element).  The block classes come from per-block minimum and maximum
document ids, O((S/BLOCK)²) work, so no [S, S] tensor exists at any point of the
graph.  Classifying a pair as partial when it is empty or full is always exact
(the rule is evaluated), only slower; classifying it empty or full wrongly would
not be, which is what `tests/autosp/test_document_attention.py` checks against the
dense rule on random layouts.  The same block classes tell ring attention which
(query chunk, key chunk) pairs it skips (`reads_any`, Note [Ring attention] in
autosp/ring_attention.py).

On CPU without Inductor the flex_attention higher-order op runs its reference
implementation, which forms each call's scores densely (the compiled graph does
not: the op is one node); under Inductor it is a fused block-sparse kernel.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, _apply_kernel_options

BLOCK = 128
"""Block size of the block mask (flex_attention's default)."""


def document_ids(position_ids: torch.Tensor, attention_mask: torch.Tensor | None, *,
                 by_position: bool, padding: bool, chunk: int | None = None, chunk_by_position: bool = False,
                 first_index: int = 0) -> torch.Tensor:
    """Document id of every token of full-length rows ([B, S] int32), see Note [Document masks].

    ``by_position``: a document starts wherever a position is not its predecessor's plus one (Hugging Face's
    packed-sequence rule); otherwise ``position_ids`` only give the shape.  ``chunk``: a document also starts at
    every token whose index (``chunk_by_position``: whose position) is a multiple of ``chunk`` (chunked attention,
    Llama-4's ``attention_chunk_size``); ``first_index`` is the index of the rows' first token.  Chunks by position
    without documents by position are ``position // chunk`` (a restart returns to an earlier chunk).  ``padding``: a
    token whose ``attention_mask`` is 0 gets its document's id negated (read by no query)."""
    if chunk is not None and chunk_by_position and not by_position:
        docs = (torch.div(position_ids, chunk, rounding_mode="floor") + 1).to(torch.int32)
        return torch.where(attention_mask != 0, docs, -docs) if padding and attention_mask is not None else docs
    length = position_ids.shape[1]
    first = torch.ones_like(position_ids[:, :1], dtype=torch.bool)
    if by_position:
        starts = torch.cat([first, position_ids[:, 1:] - position_ids[:, :-1] != 1], dim=1)
    else:
        starts = torch.cat([first, torch.zeros_like(position_ids[:, 1:], dtype=torch.bool)], dim=1)
    if chunk is not None:
        index = position_ids if chunk_by_position else first_index + torch.arange(length, device=position_ids.device)
        starts = starts | (index % chunk == 0)
    docs = starts.to(torch.int32).cumsum(1, dtype=torch.int32)
    if padding and attention_mask is not None:
        docs = torch.where(attention_mask != 0, docs, -docs)
    return docs


def kept_fraction(documents: torch.Tensor, window: int | None) -> float:
    """Fraction of the B·S·S query-key pairs of rows ``documents`` the rule of Note [Document masks] keeps
    (what the export prices document-masked attention at), counted in O(S) per row."""
    batch, length = documents.shape
    valid = (documents > 0).to(torch.int64)
    before = torch.cat([torch.zeros_like(valid[:, :1]), valid.cumsum(1)], dim=1)  # valid keys in [0, i)
    idx = torch.arange(length, device=documents.device).expand(batch, length)
    doc = documents.abs()
    new_doc = torch.cat([torch.ones_like(doc[:, :1], dtype=torch.bool), doc[:, 1:] != doc[:, :-1]], dim=1)
    doc_start = torch.cummax(torch.where(new_doc, idx, torch.zeros_like(idx)), dim=1).values
    first = doc_start if window is None else torch.maximum(doc_start, idx - window + 1)
    kept = before.gather(1, idx + 1) - before.gather(1, first)  # valid keys in [first, i]
    return float(kept.sum()) / (batch * length * length)


def _block_ranges(documents: torch.Tensor, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(min id, max id) per block of tokens [start, start + length) ([B, blocks] each), and the block count.
    A last partial block is padded by repeating its last token (it does not exist: the ranges stay exact)."""
    rows = documents[:, start:start + length]
    blocks = -(-length // BLOCK)
    pad = blocks * BLOCK - length
    if pad:
        rows = torch.cat([rows, rows[:, -1:].expand(-1, pad)], dim=1)
    grouped = rows.reshape(rows.shape[0], blocks, BLOCK)
    return grouped.amin(-1), grouped.amax(-1), blocks


def _as_indices(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BlockMask's (count, indices) of the true entries of ``blocks`` [B, q blocks, kv blocks]."""
    count = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count[:, None], order[:, None]


def block_classes(documents: torch.Tensor, *, q_start: int, q_len: int, kv_start: int, kv_len: int,
                  window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) boolean [B, q blocks, kv blocks] of queries [q_start, q_start + q_len) against keys
    [kv_start, kv_start + kv_len) of rows described by ``documents`` (see Note [Document masks])."""
    q_lo, q_hi, nq = _block_ranges(documents.abs(), q_start, q_len)  # a query's document, padding or not
    k_lo, k_hi, nk = _block_ranges(documents, kv_start, kv_len)
    device = documents.device
    # Token index ranges of each block (the last block may be short).
    q_first = q_start + torch.arange(nq, device=device)[:, None] * BLOCK
    q_last = torch.clamp(q_first + BLOCK - 1, max=q_start + q_len - 1)
    k_first = kv_start + torch.arange(nk, device=device)[None, :] * BLOCK
    k_last = torch.clamp(k_first + BLOCK - 1, max=kv_start + kv_len - 1)
    # Keys: only positive ids are read, so the overlap test may use the raw range (a superset is exact).
    same_range = (k_lo.clamp(min=1)[:, None, :] <= q_hi[:, :, None]) & (k_hi[:, None, :] >= q_lo[:, :, None])
    some = same_range & (k_first <= q_last)
    one_doc = (q_lo == q_hi)[:, :, None] & (k_lo == k_hi)[:, None, :] & (q_lo[:, :, None] == k_lo[:, None, :])
    every = one_doc & (k_last <= q_first) & (k_lo > 0)[:, None, :]
    some = some & (k_hi > 0)[:, None, :]  # a block of padding keys only is read by no query
    if window is not None:
        some = some & (q_first - k_last < window)
        every = every & (q_last - k_first < window)
    return some & ~every, every


def reads_any(documents: torch.Tensor, *, q_start: int, q_len: int, kv_start: int, kv_len: int,
              window: int | None = None) -> bool:
    """Whether any query of [q_start, q_start + q_len) reads any key of [kv_start, kv_start + kv_len) in some row
    of ``documents`` (from `block_classes`: False only when the pair is empty, so skipping it is exact).  Ring
    attention asks this of each (query chunk, key chunk) pair on every call (Note [Ring attention])."""
    partial, full = block_classes(documents, q_start=q_start, q_len=q_len, kv_start=kv_start, kv_len=kv_len,
                                  window=window)
    return bool((partial | full).any())


def document_block_mask(documents: torch.Tensor, *, q_start: int, q_len: int, kv_start: int, kv_len: int,
                        window: int | None) -> BlockMask:
    """The BlockMask of Note [Document masks] for queries [q_start, q_start + q_len) and keys
    [kv_start, kv_start + kv_len)."""
    partial, full = block_classes(documents, q_start=q_start, q_len=q_len, kv_start=kv_start, kv_len=kv_len,
                                  window=window)
    kv_num, kv_idx = _as_indices(partial)
    full_num, full_idx = _as_indices(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK,
                                    mask_mod=mask_rule(q_start, kv_start, window), seq_lengths=(q_len, kv_len))


def mask_rule(q_start: int, kv_start: int, window: int | None):
    """The per-element rule of Note [Document masks] as a flex_attention mask_mod (documents as its buffer); also
    evaluated on broadcast index tensors, as the ring does for its per-chunk masks (autosp/ring_attention.py)."""

    def rule(b, h, q_idx, kv_idx, documents):
        q, k = q_idx + q_start, kv_idx + kv_start
        key_doc = documents[b, k]
        allowed = (k <= q) & (documents[b, q].abs() == key_doc)
        if window is not None:
            allowed = allowed & (q - k < window)
        return allowed

    return rule


def _identity_score(score, b, h, q_idx, kv_idx):
    return score


def document_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, documents: torch.Tensor, *,
                       q_start: int = 0, kv_start: int = 0, window: int | None = None, scale: float | None = None,
                       enable_gqa: bool = False) -> torch.Tensor:
    """Attention of queries [q_start, q_start + Sq) over keys [kv_start, kv_start + Sk) of rows described by
    ``documents``
    ([B, S] ids, see `document_ids`), under the rule of Note [Document masks].  q [B, H, Sq, D], k and v
    [B, Hkv, Sk, D] (``enable_gqa``: H a multiple of Hkv, as in scaled_dot_product_attention)."""
    from torch._higher_order_ops.flex_attention import flex_attention as flex_attention_op

    if not enable_gqa and query.shape[1] != key.shape[1]:
        raise ValueError(f"query has {query.shape[1]} heads and key {key.shape[1]}: pass enable_gqa=True")
    block_mask = document_block_mask(documents, q_start=q_start, q_len=query.shape[2], kv_start=kv_start,
                                     kv_len=key.shape[2], window=window)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    options = _apply_kernel_options(query, key, value, False, None)
    # The operator, not torch.nn.attention.flex_attention: that wrapper compiles itself when called outside
    # Dynamo, which must not happen while AOTAutograd traces the graph this call sits in.
    out, _, _ = flex_attention_op(query, key, value, _identity_score, block_mask.as_tuple(), scale, options,
                                  (), (documents,))
    return out
