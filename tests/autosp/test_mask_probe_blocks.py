"""Attention masks learnt on blocks shorter than a shard (Note [Mask programs probed on shorter blocks]).

At long context the mask pass runs the model's mask program resized to ``mask_probe_tokens`` tokens.  Over a class
of mask programs (Hugging Face Llama, Qwen2 and Mistral with their packed, padded and windowed masks; chunked and
windowed masks spelt seven ways in the graph; masks refused), on fake groups of 2 ranks (and a cross-section on 4), the rule learnt on
short blocks must equal the rule learnt on the shard's own block, and a mask refused on one is refused on the
other.  Exactness on gloo: loss and every gradient against one device (fp32 rtol 1e-4 / atol 1e-6) with short
blocks.  A program whose length is used as a value is probed as traced, with a warning.  The time it saves at long
context is measured by ``python -m experiments.cpu.bench_mask_probes``, not here.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.autosp.cases import make_sample
from tests.autosp.soundness_models import VOCAB
from tests.autosp.test_chunked_attention import SEQ_LEN, ChunkedLM, _run
from tests.autosp.test_equivalence import FP32_TOL, _check
from tests.autosp.test_packed import SEQ_LEN as HF_SEQ_LEN
from tests.autosp.test_packed import _cases, _model, case_inputs
from tests.harness import fake_process_group, run_on_ranks

SHORT = 4
"""mask_probe_tokens below every shard here (shards of 8 to 32 tokens)."""

CHUNKED = [(16, "arange"), (12, "arange"), (32, "arange"), (16, "hf"), (16, "positions"), (24, "positions"),
           (16, "cumsum"), (8, "two_aranges"), (6, "window"), (24, "window"), (16, "linspace"),
           (16, "arange_from_one")]
"""(chunk or window, spelling) of `ChunkedLM`: learnt (chunks aligned or not with the shards, by index or by
position, longer than a shard, a window shorter and one longer than a shard) or refused (indices it cannot shift)."""

HF = [("hf-llama", None, {"documents": "three documents"}), ("hf-llama", None, {"documents": "one document"}),
      ("hf-qwen2", None, {"documents": "seventeen documents"}), ("hf-llama", None, {"right_padding": [0, 9]}),
      ("hf-qwen2", None, {"left_padding": [5, 37]}), ("hf-mistral-window", 6, {"documents": "three documents"}),
      ("hf-mistral-window", 12, {})]
"""(model, sliding window, batch) of the Hugging Face families with ``use_cache=False`` (`tests.autosp.test_packed`)."""


def _outcome(compile_and_call) -> tuple:
    """The rules a compile learnt and whether each was learnt on blocks shorter than its shard, or the kind of
    error that refused it."""
    import autosp

    try:
        compiled = compile_and_call()
    except autosp.AutoSPError as err:
        return ("refused", type(err).__name__, None)
    report = compiled.report
    return ("learnt", [(m.by_position, m.padding, m.window, m.chunk, m.chunk_by_position) for m in
                       report.document_masks], report.causal_masks_replaced, report.requires_plain_positions,
            [block < shard for _, block, shard in report.mask_probe_blocks])


def _chunked(world: int, chunk: int, spelling: str, options: dict) -> tuple:
    import autosp

    def run():
        ids, labels = make_sample(SEQ_LEN, VOCAB, seed=3)
        torch._dynamo.reset()
        compiled = autosp.compile(ChunkedLM(chunk, spelling), sp_size=world, compiler="aot_eager", **options)
        compiled(**autosp.prepare_inputs(ids, labels=labels))
        return compiled

    with fake_process_group(world, rank=world - 1):
        return _outcome(run)


def _hf(world: int, name: str, window: int | None, case: dict, options: dict) -> tuple:
    import autosp

    def run():
        torch._dynamo.reset()
        ids, labels = make_sample(HF_SEQ_LEN, 256, seed=11)
        compiled = autosp.compile(_model(name, window), sp_size=world, compiler="aot_eager", **options)
        compiled(**autosp.prepare_inputs(ids, labels=labels, **case_inputs(case, ids, labels)))
        return compiled

    with fake_process_group(world, rank=world - 1):
        return _outcome(run)


RETRIED = {(6, "window")}
"""Learnt on the shard after the short blocks refused it: a window of 6 built in the graph (no configuration names
it) is longer than the blocks, which the gap probes see (Note [Mask probes at other offsets])."""


@pytest.mark.parametrize(("world", "chunk", "spelling"), [(2, *case) for case in CHUNKED] + [
    (4, 12, "arange"), (4, 24, "positions"), (4, 8, "two_aranges"), (4, 16, "hf")])
def test_rule_on_short_blocks_equals_rule_on_the_shard_in_graph_masks(world, chunk, spelling):
    short = _chunked(world, chunk, spelling, {"mask_probe_tokens": SHORT})
    assert _chunked(world, chunk, spelling, {})[:-1] == short[:-1]
    if short[0] == "learnt":  # a chunk of exactly a shard: an integer equal to the shard's length used as a value
        assert short[-1] == [(chunk, spelling) not in RETRIED and chunk != SEQ_LEN // world], short


@pytest.mark.parametrize(("world", "name", "window", "case"), [(2, *case) for case in HF] + [
    (4, *HF[0]), (4, *HF[5])], ids=lambda v: str(v))
def test_rule_on_short_blocks_equals_rule_on_the_shard_hugging_face(world, name, window, case):
    short = _hf(world, name, window, case, {"mask_probe_tokens": SHORT})
    expected = _hf(world, name, window, case, {})
    assert expected[0] == "learnt" and expected[:-1] == short[:-1]
    assert short[-1] and all(short[-1]), short  # every layer's mask learnt on blocks shorter than its shard


class LengthAsValueLM(ChunkedLM):
    """A window as long as the row, spelt with the row's length: on a shard the length is the shard's, an integer
    that sets no size (Note [Mask programs probed on shorter blocks]: not resized)."""

    def mask(self, s, position_ids, attention_mask):
        idx = torch.arange(s)
        return (idx[None, :] <= idx[:, None]) & (idx[:, None] - idx[None, :] < s)


def test_length_used_as_a_value_is_probed_as_traced(caplog):
    """The shard's program has a window of a shard where one device's has none: refused, as without resizing."""
    import autosp

    ids, labels = make_sample(SEQ_LEN, VOCAB, seed=3)
    with fake_process_group(2, rank=1), caplog.at_level(logging.INFO, logger="autosp.passes.dynamo.mask_learner"):
        compiled = autosp.compile(LengthAsValueLM(SEQ_LEN), sp_size=2, compiler="aot_eager", mask_probe_tokens=SHORT)
        with pytest.raises(autosp.AutoSPError, match="a window or chunk longer than a shard"):
            compiled(**autosp.prepare_inputs(ids, labels=labels))
    assert "probed on blocks of the shard's 16 tokens" in caplog.text and "as a value" in caplog.text
    assert "probed on blocks of 4" not in caplog.text


def _exact(rank, world, cases):
    return _run(rank, world, cases, {"mask_probe_tokens": SHORT}) + _cases(rank, world, [
        {"model": "hf-llama", "documents": "three documents", "options": {"mask_probe_tokens": SHORT}},
        {"model": "hf-qwen2", "right_padding": [21, 3], "options": {"mask_probe_tokens": SHORT}},
        {"model": "hf-mistral-window", "window": 6, "documents": "three documents",
         "options": {"mask_probe_tokens": SHORT}}])


def test_masks_learnt_on_short_blocks_exact_two_ranks():
    results = run_on_ranks(_exact, 2, [(12, "arange"), (8, "hf"), (24, "positions")], timeout_s=600)
    _check(results, FP32_TOL)
    for r in results[0]:  # every layer's mask learnt on blocks shorter than its shard
        assert r["probe_blocks"] and all(block < shard for _, block, shard in r["probe_blocks"]), r["probe_blocks"]


class LongChunkedLM(ChunkedLM):
    """`ChunkedLM` with learned positions for ``seq_len`` tokens."""

    def __init__(self, chunk: int, spelling: str, seq_len: int):
        super().__init__(chunk, spelling)
        self.pos = torch.nn.Embedding(seq_len, self.embed.embedding_dim)


@pytest.mark.parametrize(("world", "spelling", "why"), [
    (2, "arange", "cannot be resized"), (4, "arange", "cannot be resized"),
    (2, "window", f"not learnt on blocks of {SHORT} tokens")])
def test_shard_too_long_to_probe_is_refused_unless_asked(world, spelling, why):
    """A mask that would be learnt on the shard's own block -- a program that cannot be resized (chunks of exactly a
    shard) or one the short blocks refuse (a window of 6 built in the graph, `RETRIED`) -- on shards longer than
    64 x mask_probe_tokens: refused with what to change; learnt on the shard when mask_probe_tokens is raised to the
    shard's length."""
    import autosp

    shard = 64 * SHORT + 4
    seq_len, chunk = shard * world, shard if spelling == "arange" else 6

    def outcome(options):
        ids, labels = make_sample(seq_len, VOCAB, seed=3)
        with fake_process_group(world, rank=world - 1):
            torch._dynamo.reset()
            compiled = autosp.compile(LongChunkedLM(chunk, spelling, seq_len), sp_size=world, compiler="aot_eager",
                                      **options)
            compiled(**autosp.prepare_inputs(ids, labels=labels))
            return compiled.report

    with pytest.raises(autosp.AutoSPError, match=rf"{why}.*limit of {64 * SHORT} tokens.*mask_probe_tokens={shard}"):
        outcome({"mask_probe_tokens": SHORT})
    report = outcome({"mask_probe_tokens": shard})
    assert [(m.chunk, m.window) for m in report.document_masks] == [
        (chunk, None) if spelling == "arange" else (None, chunk)]
    assert [(block, length) for _, block, length in report.mask_probe_blocks] == [(shard, shard)]
