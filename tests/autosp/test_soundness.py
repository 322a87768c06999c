"""Exact or refused, never silently wrong: real training patterns on real gloo ranks.

Each case compares the compiled model's loss and every gradient (after sync_gradients) with a
single-device run of the full sequence (fp32: rtol 1e-4 / atol 1e-6), or expects an AutoSPError.
"""

from __future__ import annotations

import copy
import functools
import random

import pytest
import torch

from tests.autosp.cases import loss_of, make_sample, named_grads, reference_and_candidate
from tests.autosp.soundness_models import MIXING_OPS, TOKEN_LOCAL_OPS, VOCAB, ComposedLM, build
from tests.autosp.test_equivalence import FP32_TOL, _check
from tests.harness import run_on_ranks


def _step(reference, candidate, ids, labels, *, sp_size, call_kwargs=None, options=None, outer_compile=False):
    import autosp

    loss = loss_of(reference(input_ids=ids, labels=labels, **(call_kwargs or {})))
    loss.backward()
    compiled = autosp.compile(candidate, sp_size=sp_size, compiler="aot_eager", **(options or {}))
    runner = torch.compile(compiled) if outer_compile else compiled
    out = loss_of(runner(**autosp.prepare_inputs(ids, labels=labels), **(call_kwargs or {})))
    out.backward()
    autosp.sync_gradients(compiled)
    return {"loss": out.detach(), "ref_loss": loss.detach(), "grads": named_grads(candidate),
            "ref_grads": named_grads(reference), "report": compiled.report}


def _named_cases(rank, world, cases):
    results = []
    for case in cases:
        torch._dynamo.reset()
        reference = build(case["model"])
        candidate = copy.deepcopy(reference)
        ids, labels = make_sample(case.get("seq_len", 32), VOCAB, seed=7)
        r = _step(reference, candidate, ids, labels, sp_size=world, call_kwargs=case.get("call_kwargs"),
                  outer_compile=case.get("outer_compile", False))
        report = r.pop("report")
        r["facts"] = (len(report.attention_sites), [(m.by_position, m.padding, m.window) for m in report.document_masks],
                      any("higher-order" in v for v in report.op_classes.values()), report.requires_plain_positions)
        results.append(r)
    return results


_PATTERNS = [
    {"model": "checkpointed-plain-llama"},                               # checkpoint bodies, arange(end=S)
    {"model": "hf-llama-gradient-checkpointing"},                        # HF checkpointing, use_cache=False
    {"model": "hf-qwen2-no-cache"},                                      # HF's position-built mask
    {"model": "router-aux"},                                             # MoE balance + z losses
    {"model": "sequence-centered"},                                      # x - mean over the sequence
    {"model": "hf-llama", "outer_compile": True},                        # torch.compile(autosp model)
]


def test_soundness_real_training_patterns_two_ranks():
    results = run_on_ranks(_named_cases, 2, _PATTERNS, timeout_s=600)
    _check(results, FP32_TOL)
    facts = [r["facts"] for r in results[0]]
    assert facts[0][2] and facts[1][2]            # the checkpointed bodies were analysed ...
    assert facts[0][0] == 3 and facts[1][0] == 2  # ... and every attention inside them rewritten
    # HF's masks (use_cache=False), learnt as packed-document masks, on plain positions: the causal mask, checked
    # on every call (Note [Document program] in autosp/model.py)
    assert facts[1][1] == facts[2][1] == [] and facts[1][3] and facts[2][3]


@pytest.mark.slow
def test_soundness_real_training_patterns_four_ranks():
    _check(run_on_ranks(_named_cases, 4, _PATTERNS[:5], timeout_s=900), FP32_TOL)


def _variable_lengths(rank, world, lengths):
    import autosp
    from experiments.models import build_model, vocab_size

    torch.manual_seed(0)
    reference = build_model("plain-llama", layers=1)
    candidate = copy.deepcopy(reference)
    compiled = autosp.compile(candidate, sp_size=world, compiler="aot_eager", length_bucket=32)
    results = []
    for i, seq_len in enumerate(lengths):
        reference.zero_grad(set_to_none=True)
        candidate.zero_grad(set_to_none=True)
        ids, labels = make_sample(seq_len, vocab_size(reference), seed=i)
        ref = loss_of(reference(input_ids=ids, labels=labels))
        ref.backward()
        loss = loss_of(compiled(**autosp.prepare_inputs(ids, labels=labels)))
        loss.backward()
        autosp.sync_gradients(compiled)
        results.append({"loss": loss.detach(), "ref_loss": ref.detach(), "grads": named_grads(candidate),
                        "ref_grads": named_grads(reference)})
    results[-1]["compiles"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return results


def test_soundness_twelve_sequence_lengths_in_one_process_each_step_exact():
    lengths = [17, 20, 23, 26, 29, 32, 35, 41, 47, 52, 58, 64]
    results = run_on_ranks(_variable_lengths, 2, lengths, timeout_s=600)
    _check(results, FP32_TOL)
    assert results[0][-1]["compiles"] == 2  # buckets of 32 tokens: 17..32 and 33..64


# ---- the property test: random compositions are exact or refused ------------------------------------
def _programs(count: int, seed: int) -> list[tuple[str, ...]]:
    rng = random.Random(seed)
    pool = TOKEN_LOCAL_OPS + MIXING_OPS
    return [tuple(rng.choice(pool) for _ in range(rng.randint(1, 4))) for _ in range(count)]


def _compositions(rank, world, programs):
    from autosp import AutoSPError

    outcomes = []
    for ops in programs:
        reference, candidate = reference_and_candidate(functools.partial(ComposedLM, ops))
        ids, labels = make_sample(32, VOCAB, seed=3)
        try:
            r = _step(reference, candidate, ids, labels, sp_size=world)
        except AutoSPError as err:
            outcomes.append(("refused", str(err)))
            continue
        r.pop("report")
        outcomes.append(("ran", r))
    return outcomes


def test_soundness_property_random_compositions_exact_or_refused():
    # A seeded draw, plus every composed statistic at least once.
    programs = _programs(16, seed=12) + [("log_softmax_over_sequence", "linear"),
                                         ("var_sequence_into_loss", "std_normalize_sequence")]
    results = run_on_ranks(_compositions, 2, programs, timeout_s=900)
    ran = refused = 0
    for i, ops in enumerate(programs):
        kinds = {per_rank[i][0] for per_rank in results}
        assert len(kinds) == 1, f"{ops}: ranks disagree {kinds}"  # refused on every rank or on none
        if "refused" in kinds:
            refused += 1
            assert set(ops) & {"cumsum_sequence", "amax_sequence", "roll_sequence", "flip_sequence"}, (
                f"{ops} has no op without a rule, yet was refused: {results[0][i][1]}")
            continue
        ran += 1
        _check([[per_rank[i][1]] for per_rank in results], FP32_TOL)
    assert ran and refused  # the draw exercises both outcomes
