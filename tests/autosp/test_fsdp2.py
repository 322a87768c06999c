"""PyTorch FSDP2 on the AutoSP model: ``fully_shard(autosp.compile(model, ...))`` (Note [FSDP2 on the AutoSP model]
in autosp/model.py).

Each rank builds the same model twice from one seed: a single-device reference trained on the full sequence (every
replica's sample, averaged) and a copy compiled by AutoSP and then sharded by ``fully_shard``, each with its own
AdamW (the candidate's over the sharded parameters: each rank holds and steps 1/N of every parameter and of its
optimizer state).  After each of two optimizer steps the loss and every gradient (gathered whole from FSDP's
sharded gradients) equal the reference's, the first step's gradients clipped by their whole norm; after the second
every parameter does.  As in tests/autosp/test_parameter_sharding.py, the reference's optimizer steps on the
gradients just compared, so that the parameters test the sharded optimizer rather than Adam's magnification of
rounding near zero.  Tolerances: fp32 rtol 1e-4 / atol 1e-6, on 2 and 4 real gloo ranks, SP alone and SP x DP,
Hugging Face Llama, Qwen2 and Mixtral (MoE), with SAC, the tiled loss and MLP and activation offload.  What stays
refused is refused in one line each.
"""

from __future__ import annotations

import copy

import torch

from tests.autosp.cases import (
    TECHNIQUES_ON,
    assert_steps_match,
    build_case_model,
    case_records,
    make_sample,
    replicas_step,
)
from tests.harness import run_on_ranks

SEQ_LEN = 64
CLIP = 0.05
"""The gradient norm clipped to in the first step (the models' are larger: the test checks that it clips)."""


def _whole(tensors) -> dict[str, torch.Tensor]:
    """``(name, tensor)`` pairs of the FSDP-sharded model, each gathered whole (a collective), under the plain
    model's names."""
    return {name.removeprefix("module."): t.full_tensor().detach().clone() for name, t in tensors}


def _two_steps(rank: int, world: int, *, model: str, sp_size: int, options: dict) -> dict:
    from torch.distributed.fsdp import fully_shard

    import autosp

    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = build_case_model(model)
    compiled = autosp.compile(copy.deepcopy(reference), sp_size=sp_size, compiler="aot_eager", **options)
    fully_shard(compiled)
    dp_size, dp_rank = world // sp_size, rank // sp_size
    local = {n.removeprefix("module."): p.to_local().numel() for n, p in compiled.named_parameters()}
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
    steps = []
    for step in range(2):
        loss, ref_loss = replicas_step(reference, compiled, step=step, seq_len=SEQ_LEN, dp_size=dp_size,
                                       dp_rank=dp_rank)
        grads = _whole((n, p.grad) for n, p in compiled.named_parameters())
        record = {"loss": loss, "ref_loss": ref_loss, "grads": grads,
                  "ref_grads": {n: p.grad.clone() for n, p in reference.named_parameters()}}
        if step == 0:  # clipped by the whole gradients' norm, as on one device
            norm = compiled.clip_grad_norm_(CLIP)
            record["norm"] = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            record["ref_norm"] = torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
            grads = record["clipped"] = _whole((n, p.grad) for n, p in compiled.named_parameters())
            record["ref_clipped"] = {n: p.grad.clone() for n, p in reference.named_parameters()}
        steps.append(record)
        for name, p in reference.named_parameters():  # see the module docstring: the step, not Adam's eps
            p.grad.copy_(grads[name])
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
    return {"steps": steps, "params": _whole(compiled.named_parameters()), "local": local,
            "ref_params": {n: p.detach().clone() for n, p in reference.named_parameters()},
            "whole": {n: p.numel() for n, p in reference.named_parameters()}}


def _cases(rank, world, cases):
    return [_two_steps(rank, world, **case) for case in cases]


def _check(results: list[list[dict]], cases: list[dict], world: int) -> None:
    for where, _case, r in case_records(results, cases):
        assert_steps_match(r, where, clip=CLIP)
        # FSDP2 shards dim 0 over the ranks (rows padded to a multiple of N): about 1/N of every parameter
        assert sum(r["local"].values()) < sum(r["whole"].values()) / world * 1.5, where


TWO_RANK_CASES = [
    {"model": "hf-llama", "sp_size": 2, "options": {}},
    {"model": "hf-qwen2", "sp_size": 2, "options": TECHNIQUES_ON},
]
FOUR_RANK_CASES = [
    {"model": "hf-llama", "sp_size": 2, "options": TECHNIQUES_ON},  # SP 2 x DP 2
    {"model": "mixtral", "sp_size": 4, "options": {}},
]


def _refusals(rank: int, world: int) -> list[str]:
    """The one-line refusal of each way of sharding the AutoSP model with FSDP2 that does not compose."""
    from torch.distributed.fsdp import fully_shard

    import autosp
    from autosp.errors import AutoSPError
    from experiments.models import build_model, vocab_size

    def refusal(compiled) -> str:
        ids, labels = make_sample(SEQ_LEN, vocab_size(compiled.module), seed=1)
        try:
            compiled(**autosp.prepare_inputs(ids, labels=labels))
        except AutoSPError as err:
            return str(err)
        return "accepted"

    said = []
    inner = autosp.compile(build_model("hf-llama"), sp_size=world, compiler="aot_eager")
    for layer in inner.module.model.layers:
        fully_shard(layer)
    fully_shard(inner)
    said.append(refusal(inner))
    sharded = autosp.compile(build_model("hf-llama"), sp_size=world, compiler="aot_eager", shard_parameters=True)
    fully_shard(sharded)
    said.append(refusal(sharded))
    planned = autosp.compile(build_model("hf-llama"), sp_size=world, compiler="aot_eager", memory_plan="auto",
                             target_memory=2**30)
    fully_shard(planned)
    said.append(refusal(planned))
    return said


def test_fsdp2_on_the_autosp_model_trains_exactly_on_two_ranks_and_refuses_what_does_not_compose():
    _check(run_on_ranks(_cases, 2, TWO_RANK_CASES, timeout_s=600), TWO_RANK_CASES, world=2)
    inner, sharded, planned = run_on_ranks(_refusals, 2, timeout_s=600)[0]
    assert "a module inside the AutoSP model is sharded with fully_shard" in inner
    assert "fully_shard and shard_parameters=True would both shard" in sharded
    assert "does not price FSDP's layout" in planned
    assert all("\n" not in line for line in (inner, sharded, planned))


def test_fsdp2_on_the_autosp_model_trains_exactly_on_four_ranks_with_data_parallelism_and_moe():
    _check(run_on_ranks(_cases, 4, FOUR_RANK_CASES, timeout_s=600), FOUR_RANK_CASES, world=4)
