"""AutoSP training equals single-device training: loss and every gradient, on real gloo ranks.

Each rank builds the same model twice from one seed: a single-device reference
that runs the full sequence (and, with data parallelism, every replica's sample)
and a copy compiled by AutoSP.  Tolerances: fp32 rtol 1e-4 / atol 1e-6; under bf16 or fp16 autocast the loss to fp32
round-off and each nn.Linear weight gradient element within 3 u S, S the sum of its terms' magnitudes (Note [The bf16
comparison] in tests/autosp/mixed_precision.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.autosp.cases import FP32_TOL, loss_of, make_sample, named_grads
from tests.autosp.mixed_precision import check_gradients, check_loss, computed_in, linear_term_sums
from tests.harness import run_on_ranks


def _run_case(rank, world, *, model, sp_size, seq_len, autocast=None, overrides=None, compiler="aot_eager",
              options=None, documents=None):
    """``documents``: per data-parallel replica, the lengths of the documents its row packs (position ids restart
    at each; a Hugging Face model then masks attention within documents).  ``autocast`` ("bfloat16", "float16"):
    both runs' forwards under CPU autocast to it (fp32 parameters, as mixed-precision training keeps them)."""
    import contextlib

    import autosp
    from experiments.models import build_model, vocab_size

    torch.manual_seed(0)
    reference = build_model(model, **(overrides or {}))
    low = getattr(torch, autocast) if autocast else None
    in_precision = (lambda: torch.autocast("cpu", dtype=low)) if low else contextlib.nullcontext
    if documents is not None and hasattr(reference, "config"):
        reference.config.use_cache = False  # Hugging Face: the packed-sequence mask needs no cache
    candidate = copy.deepcopy(reference)
    dp_size, dp_rank = world // sp_size, rank // sp_size
    samples = [make_sample(seq_len, vocab_size(reference), seed=100 + i) for i in range(dp_size)]
    extras = [{} if documents is None else
              {"position_ids": torch.cat([torch.arange(n) for n in documents[i]])[None].expand(ids.shape[0], -1)}
              for i, (ids, _) in enumerate(samples)]

    precision = {}
    if low:  # the fp32 loss (a witness that the precision changed it) and the sums bounding each Linear gradient
        precision["fp32_loss"] = loss_of(copy.deepcopy(reference)(input_ids=samples[dp_rank][0],
                                                                  labels=samples[dp_rank][1])).item()
        precision["sums"] = linear_term_sums(reference, low)
    ref_losses = []
    for (ids, labels), extra in zip(samples, extras, strict=True):  # data parallelism averages the replicas' gradients
        with in_precision():
            loss = loss_of(reference(input_ids=ids, labels=labels, **extra))
        (loss / dp_size).backward()
        ref_losses.append(loss.detach())

    compiled = autosp.compile(candidate, sp_size=sp_size, compiler=compiler, **(options or {}))
    ids, labels = samples[dp_rank]
    with in_precision():
        output = compiled(**autosp.prepare_inputs(ids, labels=labels, **extras[dp_rank]))
    loss = loss_of(output)
    loss.backward()
    autosp.sync_gradients(compiled)
    if low:  # the compiled program ran in the low precision: every logit is a value of it
        precision["logits_in_precision"] = computed_in(output.logits, low)
    return {
        **precision,
        "loss": loss.detach(), "ref_loss": ref_losses[dp_rank],
        "grads": named_grads(candidate), "ref_grads": named_grads(reference),
        "sites": [(s.num_heads, s.num_kv_heads, s.kv_replication) for s in compiled.report.attention_sites],
        "masks": [(m.by_position, m.padding, m.window) for m in compiled.report.document_masks],
    }


def _cases_on_rank(rank, world, cases):
    return [_run_case(rank, world, **case) for case in cases]


def _check(results, tol):
    for rank, per_case in enumerate(results):
        for r in per_case:
            where = f"rank {rank}"
            torch.testing.assert_close(r["loss"], r["ref_loss"], **tol,
                                       msg=lambda m, w=where: f"{w} loss: {m}")
            assert r["grads"].keys() == r["ref_grads"].keys()
            for name, grad in r["grads"].items():
                reference = r["ref_grads"][name]
                assert reference.abs().max() > 0, f"{where} grad {name} is zero: the comparison would be vacuous"
                torch.testing.assert_close(
                    grad, reference, **tol, msg=lambda m, w=f"{where} grad {name}": f"{w}: {m}"
                )
    # The loss is bit-identical on every rank that trained the same sample.
    for case in range(len(results[0])):
        by_sample: dict[float, set[float]] = {}
        for per_rank in results:
            by_sample.setdefault(float(per_rank[case]["ref_loss"]), set()).add(float(per_rank[case]["loss"]))
        assert all(len(losses) == 1 for losses in by_sample.values()), by_sample


def checked_cases(per_rank_results: list[list[dict]], cases: list[dict], tol=FP32_TOL) -> list[tuple[dict, dict]]:
    """(case, result) of every rank's results of ``cases``, once `_check` has passed on them all."""
    _check(per_rank_results, tol)
    return [(case, r) for per_rank in per_rank_results for case, r in zip(cases, per_rank, strict=True)]


@pytest.mark.parametrize("model", ["plain-llama", "hf-llama", "hf-gpt2"])
def test_equivalence_two_ranks_loss_and_gradients_match_single_device(model):
    cases = [
        {"model": model, "sp_size": 2, "seq_len": 32},
        {"model": model, "sp_size": 2, "seq_len": 31},  # not divisible by P: padded, exact
    ]
    _check(run_on_ranks(_cases_on_rank, 2, cases, timeout_s=300), FP32_TOL)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["plain-llama", "hf-llama", "hf-gpt2"])
def test_equivalence_four_ranks_loss_and_gradients_match_single_device(model):
    cases = [{"model": model, "sp_size": 4, "seq_len": 30}]
    results = run_on_ranks(_cases_on_rank, 4, cases, timeout_s=400)
    _check(results, FP32_TOL)
    if model == "hf-llama":  # 2 kv heads < 4 ranks: replicated so each rank gets its query heads' kv head
        assert results[0][0]["sites"][0] == (8, 2, 2)


@pytest.mark.slow
def test_equivalence_data_parallel_times_sequence_parallel_matches_single_device():
    cases = [{"model": "hf-llama", "sp_size": 2, "seq_len": 32}, {"model": "plain-llama", "sp_size": 2, "seq_len": 17}]
    _check(run_on_ranks(_cases_on_rank, 4, cases, timeout_s=400), FP32_TOL)


def test_equivalence_every_checkpointing_setting_with_and_without_overlap():
    cases = [
        {"model": "hf-llama", "sp_size": 2, "seq_len": 32,
         "options": {"checkpointing": setting, "overlap_communication": overlap}}
        for setting in ("sac", "none", "default", "full", "layer") for overlap in (True, False)
    ]
    # SAC recomputing every matmul too (a zero memory budget), as it would at long sequences.
    cases.append({"model": "plain-llama", "sp_size": 2, "seq_len": 32, "options": {"sac_memory_budget": 0.0}})
    _check(run_on_ranks(_cases_on_rank, 2, cases, timeout_s=600), FP32_TOL)


def test_equivalence_gqa_with_fewer_kv_heads_than_ranks():
    cases = [{"model": "plain-llama", "sp_size": 2, "seq_len": 24, "overrides": {"heads": 4, "kv_heads": 1}}]
    results = run_on_ranks(_cases_on_rank, 2, cases, timeout_s=300)
    _check(results, FP32_TOL)
    assert results[0][0]["sites"][0] == (4, 1, 2)


@pytest.mark.parametrize("world", [2, 4])
def test_equivalence_under_bf16_and_fp16_autocast_element_by_element(world):
    """Mixed precision as users train: fp32 parameters, the forward under CPU autocast to bf16 or fp16, against the
    same single-device step under the same autocast, every gradient element held to what the precision's rounding
    of differently split sums allows (Note [The bf16 comparison] in tests/autosp/mixed_precision.py)."""
    kv = {"overrides": {"kv_heads": 4}} if world == 4 else {}  # no replicated kv head (the Note's first condition)
    cases = [{"model": "hf-llama", "sp_size": world, "seq_len": 32, "autocast": "bfloat16", **kv},
             {"model": "hf-qwen2", "sp_size": world, "seq_len": 32, "autocast": "float16", **kv}]
    if world == 2:
        cases += [{"model": "hf-mistral", "sp_size": 2, "seq_len": 32, "autocast": "bfloat16",
                   "overrides": {"kv_heads": 2}},
                  {"model": "hf-llama", "sp_size": 2, "seq_len": 32, "autocast": "float16",
                   "options": {"checkpointing": "sac"}}]
    results = run_on_ranks(_cases_on_rank, world, cases, timeout_s=400)
    for rank, per_case in enumerate(results):
        for case, r in zip(cases, per_case, strict=True):
            where, low = f"rank {rank} {case['model']} {case['autocast']}", getattr(torch, case["autocast"])
            assert r["logits_in_precision"], f"{where}: the compiled forward did not run in {case['autocast']}"
            check_loss(r["loss"], r["ref_loss"], r["fp32_loss"], where)
            check_gradients(r["grads"], r["ref_grads"], r["sums"], low, where)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["hf-qwen2", "hf-mistral"])
def test_equivalence_more_hugging_face_decoders(model):
    cases = [{"model": model, "sp_size": 2, "seq_len": 32}]
    _check(run_on_ranks(_cases_on_rank, 2, cases, timeout_s=300), FP32_TOL)


def _two_compiles(rank, world):
    # Two models with different SP sizes in one process, and the same model compiled twice.
    return _cases_on_rank(rank, world, [
        {"model": "plain-llama", "sp_size": 2, "seq_len": 16},
        {"model": "plain-llama", "sp_size": 4, "seq_len": 16},
        {"model": "plain-llama", "sp_size": 2, "seq_len": 16},
    ])


@pytest.mark.slow
def test_equivalence_two_compiles_with_different_sp_sizes_in_one_process():
    _check(run_on_ranks(_two_compiles, 4, timeout_s=400), FP32_TOL)


@pytest.mark.slow
@pytest.mark.inductor
def test_equivalence_inductor_two_ranks():
    cases = [
        {"model": "hf-llama", "sp_size": 2, "seq_len": 32, "compiler": "inductor"},  # SAC and overlap on
        {"model": "hf-llama", "sp_size": 2, "seq_len": 32, "compiler": "inductor",
         "options": {"checkpointing": "none", "overlap_communication": False}},
    ]
    _check(run_on_ranks(_cases_on_rank, 2, cases, timeout_s=600), FP32_TOL)
