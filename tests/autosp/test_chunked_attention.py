"""Chunked attention (a query reads only its own chunk of C tokens, causally) under sequence parallelism.

On a shard's own block a chunk as long as the shard (or a multiple of it, aligned) looks like the plain causal
mask; the mask pass probes the mask at other offsets of the sequence (Note [Mask probes at other offsets]).
Each mask spelling and chunk size is exact against one device running the full sequence (loss and every
gradient, fp32 rtol 1e-4 / atol 1e-6), or refused naming the op, the module and the fix; the learnt rules are
also checked on fake groups of 2 and 4 ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tests.autosp.cases import loss_of, make_sample, named_grads
from tests.autosp.soundness_models import VOCAB, _Core
from tests.autosp.test_equivalence import FP32_TOL, _check
from tests.harness import fake_process_group, run_on_ranks

SEQ_LEN = 32
"""Tokens per row: shards of 16 on 2 ranks, 8 on 4."""


class ChunkedLM(_Core):
    """Embedding (plus learned positions from a running count for three spellings), one attention layer with a
    chunked causal mask built in the graph, and an LM head.

    ``spelling``: how the mask is built -- ``arange`` (one arange, boolean), ``two_aranges`` (query and key
    indices from separate aranges broadcast to [1, 1, S, S], an additive float mask, as Hugging Face builds it),
    ``positions`` (causal by index, chunks by position id), ``cumsum`` (indices from ``ones(S).cumsum(0) - 1``),
    ``hf`` (Hugging Face's own ``sdpa_mask`` with its ``chunked_causal_mask_function``, Llama-4's mask), and two it
    cannot shift to a shard's offset: ``linspace`` and ``arange_from_one`` (``arange(1, S + 1)``); ``window``: a
    sliding window of ``chunk`` tokens built from an arange."""

    def __init__(self, chunk: int, spelling: str = "arange"):
        super().__init__()
        self.chunk, self.spelling = chunk, spelling
        self.pos = torch.nn.Embedding(SEQ_LEN, self.embed.embedding_dim)

    def positions(self, input_ids):
        """Learned positions from a running count (Note [Positions built in the graph]), spelt three ways."""
        s = input_ids.shape[1]
        if self.spelling == "cumsum":
            return torch.ones(s).cumsum(0).long() - 1
        if self.spelling == "arange":
            return input_ids.new_ones(s).cumsum(-1) - 1
        if self.spelling == "hf":
            return input_ids.new_full((s,), 2).cumsum(0) // 2 - 1
        return None

    def mask(self, s: int, position_ids, attention_mask):
        c = self.chunk
        if self.spelling == "hf":
            from transformers.masking_utils import chunked_causal_mask_function, sdpa_mask

            b = position_ids.shape[0]
            padding = None if attention_mask is None else attention_mask.bool()
            left = torch.zeros(b, dtype=torch.long) if padding is None else (attention_mask.cumsum(-1) == 0).sum(-1)
            return sdpa_mask(batch_size=b, q_length=s, kv_length=s, mask_function=chunked_causal_mask_function(c, left),
                             attention_mask=padding, allow_is_causal_skip=False)
        if self.spelling == "two_aranges":
            q = torch.arange(s)[None, None, :, None]
            k = torch.arange(s)[None, None, None, :]
            allowed = (k <= q) & (k // c == q // c)
            return torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
        if self.spelling == "cumsum":
            idx = torch.ones(s).cumsum(0).long() - 1
        elif self.spelling == "linspace":
            idx = torch.linspace(0, s - 1, s).long()
        elif self.spelling == "arange_from_one":
            idx = torch.arange(1, s + 1)
        else:
            idx = torch.arange(s)
        allowed = idx[None, :] <= idx[:, None]
        if self.spelling == "window":  # a sliding window of ``chunk`` tokens, no chunks
            return allowed & (idx[:, None] - idx[None, :] < c)
        if self.spelling == "positions":
            p = position_ids // c
            return (allowed[None] & (p[:, :, None] == p[:, None, :]))[:, None]
        return allowed & (idx[None, :] // c == idx[:, None] // c)

    def forward(self, input_ids, labels=None, position_ids=None, attention_mask=None):
        x = self.embed(input_ids)
        if (count := self.positions(input_ids)) is not None:
            x = x + self.pos(count)
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(s, position_ids, attention_mask))
        x = x + self.out(y.transpose(1, 2).reshape(b, s, h))
        return self.lm_loss(x, labels)[0]


EXACT = [  # (chunk, spelling, the learnt rule's chunk: None is the plain causal mask)
    (16, "arange", 16),  # a chunk per shard on 2 ranks (two shards on 4): each shard's block alone looks causal
    (16, "hf", 16),
    (16, "positions", 16),
    (16, "cumsum", 16),
    (12, "arange", 12),  # not aligned with the shards
    (32, "arange", None),  # the whole sequence: the plain causal mask
]


def _run(rank, world, cases, options=None):
    """Each (chunk, spelling) case compiled with ``options`` on ``world`` ranks, beside one device."""
    import autosp

    results = []
    for chunk, spelling in cases:
        torch._dynamo.reset()
        torch.manual_seed(0)
        reference = ChunkedLM(chunk, spelling)
        candidate = copy.deepcopy(reference)
        ids, labels = make_sample(SEQ_LEN, VOCAB, seed=3)
        loss = reference(ids, labels, torch.arange(SEQ_LEN).expand_as(ids))
        loss.backward()
        compiled = autosp.compile(candidate, sp_size=world, compiler="aot_eager", **(options or {}))
        out = loss_of(compiled(**autosp.prepare_inputs(ids, labels=labels)))
        out.backward()
        results.append({"loss": out.detach(), "ref_loss": loss.detach(), "grads": named_grads(candidate),
                        "ref_grads": named_grads(reference),
                        "chunks": [m.chunk for m in compiled.report.document_masks],
                        "causal": compiled.report.causal_masks_replaced,
                        "probe_blocks": compiled.report.mask_probe_blocks})
    return results


@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_chunked_attention_exact(ranks):
    results = run_on_ranks(_run, ranks, [(c, s) for c, s, _ in EXACT], timeout_s=600)
    for per_rank in results:
        for (_, _, chunk), r in zip(EXACT, per_rank, strict=True):
            assert r["chunks"] == ([] if chunk is None else [chunk]) and r["causal"] == (chunk is None)
    _check(results, FP32_TOL)


def _learn(world: int, chunk: int, spelling: str, attention_mask=None):
    import autosp

    ids, labels = make_sample(SEQ_LEN, VOCAB, seed=3)
    with fake_process_group(world, rank=world - 1):
        compiled = autosp.compile(ChunkedLM(chunk, spelling), sp_size=world, compiler="aot_eager")
        compiled(**autosp.prepare_inputs(ids, labels=labels, attention_mask=attention_mask))
    return [m.chunk for m in compiled.report.document_masks]


@pytest.mark.parametrize(("world", "chunk", "spelling"), [
    (4, 16, "arange"),  # a chunk of two shards
    (4, 24, "positions"),  # chunks by position, longer than a shard, not aligned
    (2, 8, "two_aranges"),  # shorter than a shard
])
def test_chunked_attention_rule_learnt_on_fake_groups(world, chunk, spelling):
    assert _learn(world, chunk, spelling) == [chunk]


@pytest.mark.parametrize(("spelling", "op"), [("linspace", "linspace"), ("arange_from_one", "arange")])
def test_chunked_attention_indices_that_cannot_be_shifted_are_refused(spelling, op):
    import autosp

    with pytest.raises(autosp.AutoSPError, match=rf"module <model> \(test_chunked_attention.py:\d+\) builds token "
                       rf"indices for its attention mask with {op} .*torch.arange\(seq_len\)"):
        _learn(2, 16, spelling)


def test_chunked_attention_hugging_face_with_a_padding_mask_is_refused():
    """Hugging Face counts chunks from a row's first non-padding token, which a shard's block cannot show."""
    import autosp

    padding = torch.ones(2, SEQ_LEN, dtype=torch.long)
    padding[1, -5:] = 0
    with pytest.raises(autosp.AutoSPError, match=r"module <model> attends with a mask that, on a padding mask"):
        _learn(2, 16, "hf", padding)


def test_window_longer_than_a_shard_built_in_the_graph_is_refused():
    """On a shard of 16 tokens a window of 24 looks causal; the gap probes see it (exact would need its length)."""
    import autosp

    with pytest.raises(autosp.AutoSPError, match=r"module <model> attends with a mask that, between tokens 0..7 "
                       r"and tokens .*a window or chunk longer than a shard"):
        _learn(2, 24, "window")
