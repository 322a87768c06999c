"""The Hugging Face Trainer path: ``AutoSPTrainer`` trains exactly as single-device training.

Two gloo ranks launched as torchrun would (RANK / WORLD_SIZE / LOCAL_RANK in the
environment, so accelerate sees a distributed run) train a tiny HF Llama with the
Trainer's own machinery: a DataCollatorForLanguageModeling (dynamic right padding
over an in-memory dataset of varied lengths, an in-memory tokenizer), gradient
accumulation 2, HF gradient checkpointing, gradient clipping and SGD, for 3
optimizer steps.  Every parameter afterwards equals a plain single-device loop over
the same batches in the same order with the Trainer's loss (sum over the
accumulated targets / their count) (fp32 rtol 1e-4 / atol 1e-6).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from tests.harness import run_on_ranks

FP32_TOL = {"rtol": 1e-4, "atol": 1e-6}
VOCAB = 256
STEPS, ACCUMULATION, BATCH, LR, CLIP = 3, 2, 2, 0.5, 1.0


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", unk_token="t1")


def _dataset(replicas: int):
    """STEPS * ACCUMULATION * BATCH samples per data-parallel replica (one epoch), of varied lengths."""
    g = torch.Generator().manual_seed(3)
    lengths = [9, 14, 11, 20, 7, 16, 13, 10, 18, 12, 15, 8] * replicas
    return [{"input_ids": torch.randint(2, VOCAB, (n,), generator=g).tolist()} for n in lengths]


def _train(rank, world, out_dir, sp_size):
    import transformers

    from autosp.integrations.hf import AutoSPTrainer
    from experiments.models import build_model

    # What torchrun sets: accelerate then treats the run as distributed (and would wrap DDP).
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"})
    torch.manual_seed(0)
    model = build_model("hf-llama")
    reference = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    # Dynamic padding to the longest sample of each batch, rounded up to 8 tokens (fewer shapes to compile).
    collator = transformers.DataCollatorForLanguageModeling(_tokenizer(), mlm=False, pad_to_multiple_of=8)
    replicas = world // sp_size
    dataset = _dataset(replicas)
    args = transformers.TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUMULATION,
        max_steps=STEPS, learning_rate=LR, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=CLIP, gradient_checkpointing=True, report_to=[], save_strategy="no", logging_steps=1,
        seed=0, use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = AutoSPTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator, sp_size=sp_size,
                            autosp_options={"compiler": "aot_eager"})
    order = list(iter(trainer.get_train_dataloader().sampler))
    orders = [list(torch.utils.data.DistributedSampler(dataset, replicas, r, shuffle=True, seed=0))
              for r in range(replicas)]
    assert order == orders[rank // sp_size]
    trainer.train()
    assert trainer.state.global_step == STEPS

    # The single-device reference: every replica's batches in the same order, the Trainer's loss (summed over
    # all of them, divided by the count over all of them).
    reference.config.use_cache = False
    reference.gradient_checkpointing_enable()
    reference.train()
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    padded = []
    for step in range(STEPS):
        micro = [collator([dataset[i] for i in o[(step * ACCUMULATION + m) * BATCH:][:BATCH]])
                 for o in orders for m in range(ACCUMULATION)]
        padded += [b["input_ids"].shape[1] for b in micro]
        count = sum((b["labels"][:, 1:] != -100).sum() for b in micro)
        for b in micro:
            reference(**b, num_items_in_batch=count).loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
    return {"order": order, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "ref_params": {n: p.detach().clone() for n, p in reference.named_parameters()},
            "initial": initial,
            "padded": padded}


def _check(results, sp_size):
    for rank, r in enumerate(results):
        assert r["order"] == results[rank - rank % sp_size]["order"], "the ranks of one SP group read different samples"
    assert len(set(results[0]["padded"])) > 1, "every batch had one length: dynamic padding was not exercised"
    for rank, r in enumerate(results):
        for name, param in r["params"].items():
            moved = (r["ref_params"][name] - r["initial"][name]).abs().max()
            assert moved > 0, f"rank {rank} {name}: training did not move it, the comparison would be vacuous"
            torch.testing.assert_close(param, r["ref_params"][name], **FP32_TOL,
                                       msg=lambda m, w=f"rank {rank} param {name}": f"{w}: {m}")


def test_hf_trainer_two_ranks_trains_like_single_device(tmp_path):
    _check(run_on_ranks(_train, 2, str(tmp_path), 2, timeout_s=300), sp_size=2)


@pytest.mark.slow
def test_hf_trainer_sequence_times_data_parallel_trains_like_single_device(tmp_path):
    results = run_on_ranks(_train, 4, str(tmp_path), 2, timeout_s=600)
    assert results[0]["order"] != results[2]["order"], "data-parallel replicas read the same samples"
    _check(results, sp_size=2)


@pytest.mark.parametrize(("arguments", "expected"), [
    ({}, {"zero_stage": 0, "micro_batch": 8, "grad_accum": 1, "optimizer": "adamw"}),
    ({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4, "optim": "sgd"},
     {"zero_stage": 0, "micro_batch": 2, "grad_accum": 4, "optimizer": "sgd"}),
    ({"optim": "sgd", "optim_args": "momentum=0.9, nesterov=true"},
     {"zero_stage": 0, "micro_batch": 8, "grad_accum": 1, "optimizer": "sgd_momentum"}),
    ({"optim": "adafactor"}, {"zero_stage": 0, "micro_batch": 8, "grad_accum": 1}),  # the planner's default
])
def test_hf_trainer_job_is_what_the_planner_prices(tmp_path, arguments, expected):
    """Under memory_plan or strategy "auto" the Trainer's own settings fill plan_setup (no ZeRO: every rank holds
    its optimizer's whole state)."""
    import transformers

    from autosp.integrations.hf import planned_setup

    assert planned_setup(transformers.TrainingArguments(output_dir=str(tmp_path), **arguments)) == expected


def test_a_frameworks_job_setup_fills_plan_setup_unless_nothing_can_be_planned():
    from autosp.config import with_job_setup

    def job():
        asked.append(True)
        return {"zero_stage": 0, "micro_batch": 4}

    asked = []
    assert with_job_setup({"memory_plan": "off"}, job) == {"memory_plan": "off"} and asked == []
    # The default memory_plan plans where it can (Note [The default memory plan] in autosp/plan/auto.py)
    assert with_job_setup({"compiler": "aot_eager"}, job)["plan_setup"] == {"zero_stage": 0, "micro_batch": 4}
    planned = with_job_setup({"memory_plan": "auto", "plan_setup": {"micro_batch": 2}}, job)
    assert planned == {"memory_plan": "auto", "plan_setup": {"zero_stage": 0, "micro_batch": 2}}  # the user's win
    assert with_job_setup({"strategy": "auto"}, job)["plan_setup"] == {"zero_stage": 0, "micro_batch": 4}
