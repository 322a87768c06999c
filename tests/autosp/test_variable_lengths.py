"""One compiled model trains on many sequence lengths with default options, every step exact.

Note [One program per length] (autosp/api.py): each distinct shard shape compiles one
program, guarded by its shapes, so twelve lengths need no setting, a length seen
before compiles nothing, and the count is reported by `SequenceParallelModel.programs`.
Each step compares the loss and every gradient with a single-device run of the full
sequence (fp32 rtol 1e-4 / atol 1e-6).  Lengths that are not multiples of sp_size are
padded at the end (labels ignored) and share the padded length's program.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.autosp.cases import loss_of, make_sample, named_grads
from tests.harness import run_on_ranks

FP32_TOL = {"rtol": 1e-4, "atol": 1e-6}
# Twelve lengths: odd ones (padded to the next multiple of sp_size), a length that shares its padded
# length with another (31 and 32 at sp_size 2), and a repeat of the first at the end (no compile).
LENGTHS = (16, 24, 17, 32, 40, 9, 48, 31, 64, 20, 56, 12, 16)


def _padded(length: int, sp_size: int) -> int:
    return -(-length // sp_size) * sp_size


def _train_on_lengths(rank, world, name, lengths, options):
    import autosp
    from experiments.models import build_model, vocab_size

    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = build_model(name)
    candidate = copy.deepcopy(reference)
    compiled = autosp.compile(candidate, sp_size=world, **options)
    for step, length in enumerate(lengths):
        ids, labels = make_sample(length, vocab_size(reference), seed=step)
        for model in (reference, candidate):
            model.zero_grad(set_to_none=True)
        ref_loss = loss_of(reference(input_ids=ids, labels=labels))
        ref_loss.backward()
        loss = loss_of(compiled(**autosp.prepare_inputs(ids, labels=labels)))
        loss.backward()
        where = f"rank {rank} {name} step {step} ({length} tokens)"
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), **FP32_TOL, msg=lambda m, w=where: f"{w}: {m}")
        got, ref = named_grads(candidate), named_grads(reference)
        assert got.keys() == ref.keys() and ref, where
        for key, grad in got.items():
            assert ref[key].abs().max() > 0, f"{where}: reference gradient of {key} is zero (vacuous comparison)"
            torch.testing.assert_close(grad, ref[key], **FP32_TOL, msg=lambda m, w=where, k=key: f"{w} {k}: {m}")
    return [(p.seq_len, p.local_seq_len, p.batch_size, p.seconds) for p in compiled.programs]


@pytest.mark.parametrize("name", ["hf-llama", "hf-qwen2"])
def test_twelve_lengths_one_model_default_options(name):
    results = run_on_ranks(_train_on_lengths, 2, name, LENGTHS, {}, timeout_s=900, collective_timeout_s=300)
    distinct = sorted({_padded(n, 2) // 2 for n in LENGTHS})
    assert len(set(LENGTHS)) == 12
    for programs in results:
        # One compile per distinct shard length, in the order the lengths first arrived; none for a repeat.
        assert [local for _, local, _, _ in programs] == list(dict.fromkeys(_padded(n, 2) // 2 for n in LENGTHS))
        assert sorted(local for _, local, _, _ in programs) == distinct
        assert all(batch == 2 and seconds > 0 for _, _, batch, seconds in programs)
    print(f"{name}: {len(LENGTHS)} steps on {len(set(LENGTHS))} lengths, {len(results[0])} compiles, "
          f"{sum(s for *_, s in results[0]):.1f} s compiling on rank 0")


def _past_max_programs(rank, world):
    import autosp
    from autosp.errors import AutoSPError
    from experiments.models import build_model, vocab_size

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model("hf-llama")
    compiled = autosp.compile(model, sp_size=world, compiler="aot_eager", max_programs=2)
    for step, length in enumerate((16, 24, 16)):
        ids, labels = make_sample(length, vocab_size(model), seed=step)
        loss_of(compiled(**autosp.prepare_inputs(ids, labels=labels))).backward()
    ids, labels = make_sample(32, vocab_size(model), seed=3)
    try:
        compiled(**autosp.prepare_inputs(ids, labels=labels))
    except AutoSPError as err:
        return len(compiled.programs), str(err)
    return len(compiled.programs), None


def test_a_length_past_max_programs_is_refused_naming_length_bucket():
    for programs, message in run_on_ranks(_past_max_programs, 2):
        assert programs == 2
        assert message is not None and "max_programs=2" in message and "length_bucket" in message
