"""The document-mask attention of Note [Document masks] (autosp.document_attention) against the dense rule.

The block classes must never call a block empty or full when it is not (that would be silently wrong under a
block-sparse kernel, while the CPU reference implementation evaluates every element and would not show it),
and the attention must equal scaled_dot_product_attention with the dense mask, values and gradients."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from autosp.document_attention import BLOCK, block_classes, document_attention, document_ids


def dense_rule(documents: torch.Tensor, *, q_start: int, q_len: int, kv_len: int, window: int | None,
               kv_start: int = 0):
    q = torch.arange(q_start, q_start + q_len)[:, None]
    k = torch.arange(kv_start, kv_start + kv_len)[None, :]
    keys = documents[:, None, kv_start:kv_start + kv_len]
    allowed = (k <= q) & (documents[:, q_start:q_start + q_len, None].abs() == keys)
    if window is not None:
        allowed &= q - k < window
    return allowed


def random_layout(rng: random.Random, length: int, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed position ids (documents of random lengths, some shorter than a block, some spanning several)
    and a padding mask (left or right padding, or none) for ``batch`` rows."""
    positions, masks = [], []
    for _ in range(batch):
        row, left = [], length
        while left:
            n = min(left, rng.choice([1, 3, 17, BLOCK - 1, BLOCK + 5, 3 * BLOCK]))
            start = rng.choice([0, 0, 0, 7])  # a document may also start at a non-zero position
            row += list(range(start, start + n))
            left -= n
        pad = rng.choice([0, 0, 5, BLOCK + 3])
        side = rng.choice(["left", "right"])
        mask = [1] * length
        if pad:
            span = range(pad) if side == "left" else range(length - pad, length)
            for i in span:
                mask[i] = 0
        positions.append(row)
        masks.append(mask)
    return torch.tensor(positions), torch.tensor(masks)


@pytest.mark.parametrize("seed", range(12))
def test_block_classes_never_skip_or_fill_wrongly(seed):
    rng = random.Random(seed)
    length = rng.choice([BLOCK * 4, BLOCK * 6 + 37, 5 * BLOCK])
    positions, mask = random_layout(rng, length)
    docs = document_ids(positions, mask, by_position=rng.random() < 0.8, padding=rng.random() < 0.8)
    window = rng.choice([None, 7, BLOCK, 2 * BLOCK + 9])
    q_start = rng.choice([0, BLOCK, length // 2])
    q_len = length - q_start if rng.random() < 0.5 else min(length - q_start, 2 * BLOCK)
    kv_start = rng.choice([0, 0, q_start])  # keys of the whole row, or of the queries' own shard
    kv_len = length - kv_start if kv_start == 0 else q_len
    dense = dense_rule(docs, q_start=q_start, q_len=q_len, kv_start=kv_start, kv_len=kv_len, window=window)
    partial, full = block_classes(docs, q_start=q_start, q_len=q_len, kv_start=kv_start, kv_len=kv_len,
                                  window=window)
    assert not (partial & full).any()
    checked = {"empty": 0, "full": 0}
    for qb in range(partial.shape[1]):
        for kb in range(partial.shape[2]):
            tile = dense[:, qb * BLOCK:(qb + 1) * BLOCK, kb * BLOCK:(kb + 1) * BLOCK]
            for b in range(docs.shape[0]):
                if full[b, qb, kb]:
                    assert tile[b].all(), (b, qb, kb)
                    checked["full"] += 1
                elif not partial[b, qb, kb]:
                    assert not tile[b].any(), (b, qb, kb)
                    checked["empty"] += 1
    assert checked["empty"] > 0  # the layouts exercise skipping, not only partial blocks


def test_document_ids_follow_position_restarts_and_padding():
    positions = torch.tensor([[0, 1, 2, 0, 1, 5, 6, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]])
    assert document_ids(positions, None, by_position=True, padding=False).tolist() == [[1, 1, 1, 2, 2, 3, 3, 4]]
    assert document_ids(positions, mask, by_position=False, padding=True).tolist() == [[-1, 1, 1, 1, 1, 1, 1, 1]]
    assert document_ids(positions, mask, by_position=True, padding=True).tolist() == [[-1, 1, 1, 2, 2, 3, 3, 4]]


@pytest.mark.parametrize("heads,kv_heads,window,q_start,kv_start", [
    (4, 4, None, 0, 0), (4, 2, 40, 0, 0), (4, 1, None, 128, 0), (2, 2, 300, 64, 0), (2, 1, 100, 150, 150)])
def test_attention_equals_sdpa_with_the_dense_mask(heads, kv_heads, window, q_start, kv_start):
    torch.manual_seed(0)
    rng = random.Random(heads * 7 + kv_heads)
    length, dim = 3 * BLOCK + 20, 16
    positions, mask = random_layout(rng, length)
    docs = document_ids(positions, mask, by_position=True, padding=True)
    q = torch.randn(2, heads, length - q_start, dim, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, length - kv_start, dim, requires_grad=True) for _ in range(2))
    dense = dense_rule(docs, q_start=q_start, q_len=length - q_start, kv_start=kv_start, kv_len=length - kv_start,
                       window=window)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=dense[:, None], enable_gqa=heads != kv_heads)
    got = document_attention(q, k, v, docs, q_start=q_start, kv_start=kv_start, window=window,
                             enable_gqa=heads != kv_heads)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
    grad = torch.randn_like(expected)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad),
                    strict=True):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("seed", range(6))
def test_kept_fraction_counts_the_dense_rule(seed):
    from autosp.document_attention import kept_fraction

    rng = random.Random(100 + seed)
    length = BLOCK * 3 + 11
    positions, mask = random_layout(rng, length)
    docs = document_ids(positions, mask, by_position=True, padding=seed % 2 == 0)
    window = rng.choice([None, 5, 200])
    dense = dense_rule(docs, q_start=0, q_len=length, kv_len=length, window=window)
    assert kept_fraction(docs, window) == pytest.approx(dense.sum().item() / (2 * length * length), rel=1e-12)
