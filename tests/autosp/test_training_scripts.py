"""Ordinary training scripts are exact or refused at run time, on real gloo ranks.

One 2-rank launch runs every scenario (compiles dominate the time): gradients reduced
by the model itself under gradient accumulation (sync_gradients per micro-batch is a
no-op, a regulariser outside the model is not reduced) and over data-parallel
replicas; ranks fed different samples refused on every rank; all-ones and absent masks
with packed positions as Hugging Face reads them on one device; a loss computed outside
the model from the logits of a call without labels; a padded and an unpadded length of
one length bucket, in both orders, for a model with a reduction over the sequence.
Every exact case compares the loss and every gradient with a single-device run of the
full sequence (fp32 rtol 1e-4 / atol 1e-6).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from tests.autosp.cases import FP32_TOL, loss_of, make_sample, named_grads
from tests.harness import run_on_ranks


def _assert_same(where, got_loss, ref_loss, got_model, ref_model):
    torch.testing.assert_close(got_loss, ref_loss, **FP32_TOL, msg=lambda m: f"{where} loss: {m}")
    got, ref = named_grads(got_model), named_grads(ref_model)
    assert got.keys() == ref.keys() and ref, f"{where}: gradients of {sorted(set(got) ^ set(ref))} missing"
    for name, grad in got.items():
        assert ref[name].abs().max() > 0, f"{where} grad {name} is zero: the comparison would be vacuous"
        torch.testing.assert_close(grad, ref[name], **FP32_TOL, msg=lambda m, n=name: f"{where} grad {n}: {m}")


def _pair(name, **overrides):
    from experiments.models import build_model

    torch._dynamo.reset()  # each scenario compiles a fresh model: stay under the recompile limit
    torch.manual_seed(0)
    reference = build_model(name, **overrides) if isinstance(name, str) else name()
    return reference, copy.deepcopy(reference)


def _accumulation(rank, world, name, sp_size):
    """Two micro-batches accumulated into .grad, sync_gradients after each (the old per-micro-batch mistake),
    then a regulariser on one parameter outside the model; data-parallel replicas when sp_size < world."""
    import autosp
    from experiments.models import vocab_size

    reference, candidate = _pair(name)
    dp_size, dp_rank = world // sp_size, rank // sp_size
    micro = [[make_sample(24, vocab_size(reference), seed=10 * m + d) for d in range(dp_size)] for m in range(2)]
    for per_replica in micro:
        for ids, labels in per_replica:
            (loss_of(reference(input_ids=ids, labels=labels)) / (2 * dp_size)).backward()
    compiled = autosp.compile(candidate, sp_size=sp_size, compiler="aot_eager")
    for per_replica in micro:
        ids, labels = per_replica[dp_rank]
        loss = loss_of(compiled(**autosp.prepare_inputs(ids, labels=labels)))
        (loss / 2).backward()
        autosp.sync_gradients(compiled)  # a checked no-op
    for model in (reference, candidate):
        (0.01 * next(model.parameters()).square().sum()).backward()
    ref_loss = loss_of(reference(input_ids=micro[1][dp_rank][0], labels=micro[1][dp_rank][1])).detach()
    _assert_same(f"rank {rank} {name} sp {sp_size} accumulation", loss.detach(), ref_loss, candidate, reference)


def _packed_masks(rank):
    """Packed positions with no mask (HF separates the documents) and with an all-ones mask (HF does not)."""
    import autosp

    ids, labels = make_sample(32, 256, seed=5)
    positions = torch.cat([torch.arange(11), torch.arange(21)])[None].expand(2, -1)
    losses = {}
    for mask in (None, torch.ones_like(ids)):
        reference, candidate = _pair("hf-llama")
        for model in (reference, candidate):
            model.config.use_cache = False  # with a cache, HF never reads packed positions as documents
        extra = {} if mask is None else {"attention_mask": mask}
        ref_loss = reference(input_ids=ids, labels=labels, position_ids=positions, **extra).loss
        ref_loss.backward()
        compiled = autosp.compile(candidate, sp_size=2, compiler="aot_eager")
        loss = compiled(**autosp.prepare_inputs(ids, labels=labels, position_ids=positions, **extra)).loss
        loss.backward()
        where = f"rank {rank} packed positions, {'no mask' if mask is None else 'all-ones mask'}"
        _assert_same(where, loss.detach(), ref_loss.detach(), candidate, reference)
        losses[mask is None] = float(ref_loss.detach())
    assert abs(losses[True] - losses[False]) > 1e-3, "the two masks must mean different things on one device"


def _loss_outside(rank, name):
    """No labels: the logits come back for the whole sequence (15 tokens: padded to 16 inside, cut back)."""
    import autosp

    reference, candidate = _pair(name)
    ids, labels = make_sample(15, 256, seed=7)

    def outside(logits):
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))

    def logits_of(output):
        return output if isinstance(output, torch.Tensor) else output.logits

    ref_loss = outside(logits_of(reference(input_ids=ids)))
    ref_loss.backward()
    compiled = autosp.compile(candidate, sp_size=2, compiler="aot_eager")
    logits = logits_of(compiled(**autosp.prepare_inputs(ids)))
    assert logits.shape[:2] == ids.shape, f"logits {tuple(logits.shape)} for a sample of {tuple(ids.shape)}"
    loss = outside(logits)
    loss.backward()
    _assert_same(f"rank {rank} {name} loss outside the model", loss.detach(), ref_loss.detach(), candidate, reference)


def _padding_orders(rank):
    """length_bucket=8 with a reduction over the sequence: 16 tokens (no padding) exact, 13 (padded to 16: same
    shapes, same program) refused, whichever comes first."""
    import autosp
    from autosp import AutoSPError
    from tests.autosp.soundness_models import SequenceCenteredLM

    outcomes = []
    for order in ((16, 13), (13, 16)):
        reference, candidate = _pair(SequenceCenteredLM)
        compiled = autosp.compile(candidate, sp_size=2, compiler="aot_eager", length_bucket=8)
        outcome = {}
        for length in order:
            ids, labels = make_sample(length, 256, seed=length)
            try:
                loss = compiled(**autosp.prepare_inputs(ids, labels=labels))
            except AutoSPError as err:
                outcome[length] = str(err)
                continue
            loss.backward()
            ref_loss = reference(ids, labels)
            ref_loss.backward()
            _assert_same(f"rank {rank} {length} tokens after {order}", loss.detach(), ref_loss.detach(), candidate,
                         reference)
            outcome[length] = "exact"
        outcomes.append(outcome)
    return outcomes


def _different_samples(rank):
    """Each rank given its own sample (a DistributedSampler over all ranks), spelt four ways."""
    import autosp
    from autosp import AutoSPError
    from experiments.models import build_model

    compiled = autosp.compile(build_model("plain-llama"), sp_size=2, compiler="aot_eager")
    ids, labels = make_sample(16, 256, seed=0)
    other_ids = ids.clone()
    other_ids[1, 3] += 1
    other_labels = labels.clone()
    other_labels[0, -1] = -100
    padding = torch.ones_like(ids)
    padding[:, :2] = 0
    spellings = {
        "input_ids": {"input_ids": ids if rank == 0 else other_ids, "labels": labels},
        "labels": {"input_ids": ids, "labels": labels if rank == 0 else other_labels},
        "position_ids": {"input_ids": ids, "labels": labels, "document_lengths": [16] if rank == 0 else [5, 11]},
        "attention_mask": {"input_ids": ids, "labels": labels, "attention_mask": padding if rank else None},
    }
    messages = {}
    for differing, kwargs in spellings.items():
        try:
            compiled(**autosp.prepare_inputs(**kwargs))
            messages[differing] = None
        except AutoSPError as err:
            messages[differing] = str(err)
    return messages


def _scenarios(rank, world):
    _accumulation(rank, world, "plain-llama", sp_size=2)
    _accumulation(rank, world, "hf-qwen2", sp_size=1)  # two data-parallel replicas, averaged
    _packed_masks(rank)
    _loss_outside(rank, "plain-llama")
    _loss_outside(rank, "hf-qwen2")
    return {"padding": _padding_orders(rank), "samples": _different_samples(rank)}


def test_training_scripts_exact_or_refused_on_two_ranks():
    results = run_on_ranks(_scenarios, 2, timeout_s=400)
    for rank, r in enumerate(results):
        for outcome in r["padding"]:
            assert outcome[16] == "exact", f"rank {rank}: {outcome}"
            assert "reduces over the sequence" in outcome[13] and "padded to 16" in outcome[13], outcome[13]
        for differing, message in r["samples"].items():
            assert message is not None, f"rank {rank}: ranks given different {differing} were accepted"
            assert f"({differing} differ" in message and "autosp.sequence_parallel_sampler" in message, message
            assert "autosp.integrations.hf" in message, message
