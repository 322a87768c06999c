"""The Hugging Face Trainer path: ``AutoSPTrainer`` trains exactly as single-device training.

Two gloo ranks launched as torchrun would (RANK / WORLD_SIZE / LOCAL_RANK in the
environment, so accelerate sees a distributed run) train a tiny HF Llama with the
Trainer's own machinery: a DataCollatorForLanguageModeling (dynamic right padding
over an in-memory dataset of varied lengths, an in-memory tokenizer), gradient
accumulation 2, HF gradient checkpointing, gradient clipping and SGD, for 3
optimizer steps.  Every parameter afterwards equals a plain single-device loop over
the same batches in the same order with the Trainer's loss (sum over the
accumulated targets / their count) (fp32 rtol 1e-4 / atol 1e-6).  With ``bf16=True`` the
compiled forward runs under the Trainer's autocast and matches the plain single-device
Trainer's bf16 step (Note [The bf16 comparison] in tests/autosp/mixed_precision.py); the longest padded sample reaches
``plan_seq_len`` where the compile plans.  With ``shard_parameters=True`` (each rank 1/N of every parameter) the same
training reaches the same parameters, the clipping (checked to bite) taking the whole gradients' norm.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from tests.autosp.cases import FP32_TOL
from tests.autosp.mixed_precision import check_gradients, check_loss, computed_in, linear_term_sums
from tests.harness import run_on_ranks

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


def _train(rank, world, out_dir, sp_size, options=None, arguments=None):
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
        seed=0, use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, **(arguments or {}),
    )
    trainer = AutoSPTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator, sp_size=sp_size,
                            autosp_options={"compiler": "aot_eager", **(options or {})})
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
    padded, norms = [], []
    for step in range(STEPS):
        micro = [collator([dataset[i] for i in o[(step * ACCUMULATION + m) * BATCH:][:BATCH]])
                 for o in orders for m in range(ACCUMULATION)]
        padded += [b["input_ids"].shape[1] for b in micro]
        count = sum((b["labels"][:, 1:] != -100).sum() for b in micro)
        for b in micro:
            reference(**b, num_items_in_batch=count).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
    return {"order": order, "params": trainer.sp_model.full_parameters(),
            "sharded": bool(trainer.sp_model.parameter_shards) and not trainer.is_fsdp_enabled,
            "ref_params": {n: p.detach().clone() for n, p in reference.named_parameters()},
            "initial": initial,
            "padded": padded, "ref_norms": norms}


def _check(results, sp_size):
    for rank, r in enumerate(results):
        assert r["order"] == results[rank - rank % sp_size]["order"], "the ranks of one SP group read different samples"
    assert len(set(results[0]["padded"])) > 1, "every batch had one length: dynamic padding was not exercised"
    assert max(results[0]["ref_norms"]) > CLIP, "clipping never bit: a wrong norm would go unnoticed"
    for rank, r in enumerate(results):
        for name, param in r["params"].items():
            moved = (r["ref_params"][name] - r["initial"][name]).abs().max()
            assert moved > 0, f"rank {rank} {name}: training did not move it, the comparison would be vacuous"
            torch.testing.assert_close(param, r["ref_params"][name], **FP32_TOL,
                                       msg=lambda m, w=f"rank {rank} param {name}": f"{w}: {m}")


def test_hf_trainer_two_ranks_trains_like_single_device(tmp_path):
    _check(run_on_ranks(_train, 2, str(tmp_path), 2, timeout_s=300), sp_size=2)


def test_hf_trainer_with_sharded_parameters_trains_like_single_device(tmp_path):
    """``shard_parameters=True`` under the Trainer: its SGD steps the shards, and its clipping (which bites at
    CLIP) takes the norm of the whole gradients, not of each rank's shard."""
    _check(run_on_ranks(_train, 2, str(tmp_path), 2, {"shard_parameters": True}, timeout_s=300), sp_size=2)


def test_hf_trainer_with_fsdp_settings_trains_like_single_device(tmp_path):
    """The Trainer's FSDP settings (``fsdp=True``, FSDP2 wrapping each decoder layer) served by AutoSP's sharded
    parameters (Note [FSDP under the Trainer] in autosp/integrations/hf.py): accelerate wraps nothing, each rank
    holds 1/N of every parameter, and training reaches the single-device parameters."""
    fsdp = {"fsdp": True, "fsdp_config": {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}
    results = run_on_ranks(_train, 2, str(tmp_path), 2, None, fsdp, timeout_s=300)
    assert all(r["sharded"] for r in results), "the parameters were not sharded by AutoSP"
    _check(results, sp_size=2)


@pytest.mark.parametrize(("fsdp", "refused"), [
    ({"fsdp": True, "fsdp_config": {"cpu_offload": True}}, "cpu_offload"),
    ({"fsdp": "hybrid_shard", "fsdp_config": {"version": 1}}, "hybrid_shard"),
])
def test_hf_trainer_refuses_fsdp_settings_its_sharding_cannot_serve(tmp_path, fsdp, refused):
    import transformers

    from autosp.errors import AutoSPError
    from autosp.integrations.hf import AutoSPTrainer
    from experiments.models import build_model

    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **fsdp)
    with pytest.raises(AutoSPError, match=refused):
        AutoSPTrainer(model=build_model("hf-llama"), args=args)


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
    ({"fsdp": True}, {"zero_stage": 3, "micro_batch": 8, "grad_accum": 1, "optimizer": "adamw"}),  # sharded
])
def test_hf_trainer_job_is_what_the_planner_prices(tmp_path, arguments, expected):
    """Under memory_plan or strategy "auto" the Trainer's own settings fill plan_setup (no ZeRO: every rank holds
    its optimizer's whole state; with FSDP, ZeRO 3's layout: AutoSP's sharded parameters)."""
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


# -- mixed precision -------------------------------------------------------------------------------------------------
def _bf16_dataset():
    g = torch.Generator().manual_seed(5)
    return [{"input_ids": torch.randint(2, VOCAB, (16,), generator=g).tolist()} for _ in range(BATCH)]


def _bf16_args(out_dir, **extra):
    import transformers

    return transformers.TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=BATCH, gradient_accumulation_steps=1, max_steps=1,
        learning_rate=LR, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
        report_to=[], save_strategy="no", seed=0, use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
        bf16=True, **extra)


def _gradient_recorder():
    """A Trainer callback keeping the gradients the optimizer is about to apply."""
    import transformers

    class Recorder(transformers.TrainerCallback):
        def __init__(self):
            self.grads = {}

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    return Recorder()


def _train_bf16_autosp(rank, world, out_dir):
    import transformers

    from autosp.integrations.hf import AutoSPTrainer
    from experiments.models import build_model

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"})
    logits = []

    class Seen(AutoSPTrainer):  # AutoSPTrainer, keeping the logits the compiled model returned
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
            logits.append(outputs.logits.detach().clone())
            return (loss, outputs) if return_outputs else loss

    torch.manual_seed(0)
    model = build_model("hf-llama")
    collator = transformers.DataCollatorForLanguageModeling(_tokenizer(), mlm=False, pad_to_multiple_of=8)
    recorder = _gradient_recorder()
    trainer = Seen(model=model, args=_bf16_args(out_dir), train_dataset=_bf16_dataset(), data_collator=collator,
                   callbacks=[recorder], sp_size=world, autosp_options={"compiler": "aot_eager"})
    order = list(iter(trainer.get_train_dataloader().sampler))
    loss = trainer.train().training_loss
    return {"order": order, "loss": loss, "grads": recorder.grads, "logits": logits,
            "autocast": trainer.accelerator.native_amp}


def _train_bf16_reference(rank, world, out_dir, order):
    """The plain single-device Trainer with bf16 on the samples in the AutoSP run's order; the fp32 loss."""
    import transformers

    from experiments.models import build_model

    torch.manual_seed(0)
    model = build_model("hf-llama")
    model.config.use_cache = False  # as AutoSPTrainer sets it
    fp32 = copy.deepcopy(model)
    dataset = [_bf16_dataset()[i] for i in order]
    collator = transformers.DataCollatorForLanguageModeling(_tokenizer(), mlm=False, pad_to_multiple_of=8)
    recorder = _gradient_recorder()
    sums = linear_term_sums(model, torch.bfloat16)
    trainer = transformers.Trainer(model=model, args=_bf16_args(out_dir, train_sampling_strategy="sequential"),
                                   train_dataset=dataset, data_collator=collator, callbacks=[recorder])
    loss = trainer.train().training_loss
    batch = collator(dataset)
    assert (batch["labels"] != -100).all(), "the samples were padded (Note [The bf16 comparison])"
    return {"loss": loss, "grads": recorder.grads, "sums": sums, "fp32_loss": fp32(**batch).loss.item()}


def test_hf_trainer_bf16_trains_like_the_single_device_bf16_trainer(tmp_path):
    """bf16=True is kept: the compiled forward runs under the Trainer's autocast (Note [Mixed precision under the
    Trainer] in autosp/integrations/hf.py), and its loss and gradients are the plain Trainer's bf16 ones within
    what bf16's rounding of differently split sums allows (Note [The bf16 comparison])."""
    autosp_run = run_on_ranks(_train_bf16_autosp, 2, str(tmp_path / "autosp"), timeout_s=300)
    reference = run_on_ranks(_train_bf16_reference, 1, str(tmp_path / "reference"), autosp_run[0]["order"],
                             timeout_s=300)[0]
    for rank, r in enumerate(autosp_run):
        assert r["autocast"], "accelerate left bf16 on CPU without autocast"
        assert r["logits"] and all(computed_in(x, torch.bfloat16) for x in r["logits"]), \
            f"rank {rank}: the compiled forward did not run in bf16"
        check_loss(r["loss"], reference["loss"], reference["fp32_loss"], f"rank {rank}")
        check_gradients(r["grads"], reference["grads"], reference["sums"], torch.bfloat16, f"rank {rank}")


# -- the planned length ----------------------------------------------------------------------------------------------
def test_hf_trainer_longest_sample_is_read_as_the_trainer_reads_lengths():
    from autosp.integrations.hf import longest_sample

    class Columns(list):  # what the Trainer reads of a datasets.Dataset: whole columns by name
        column_names = ["input_ids", "length"]

        def __getitem__(self, key):
            if key == "length":
                return [7, 31, 12]  # the precomputed length column wins
            return [[1] * 5, [1] * 9] if key == "input_ids" else super().__getitem__(key)

    assert longest_sample([{"input_ids": [1] * n} for n in (5, 17, 9)]) == 17
    assert longest_sample([{"tokens": [1] * 17}], input_name="tokens") == 17  # the processor's model input name
    assert longest_sample(Columns([None, None, None])) == 31
    assert longest_sample(Columns([None, None, None]), length_column=None) == 9
    assert longest_sample([{"text": "a b c"}]) is None  # tokenised in the collator: unknown here
    assert longest_sample(None) is None

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield {"input_ids": [1, 2, 3]}

    assert longest_sample(Stream()) is None


def test_hf_trainer_planned_length_pads_as_the_collator_and_autosp_do():
    import transformers

    from autosp.integrations.hf import planned_length

    lm = transformers.DataCollatorForLanguageModeling(_tokenizer(), mlm=False, pad_to_multiple_of=8)
    assert planned_length(13, lm, sp_size=2) == 16
    assert planned_length(13, lm, sp_size=3) == 18  # 16 from the collator, then a multiple of sp_size
    assert planned_length(13, lm, sp_size=4, strategy="ring") == 16  # 2 * sp_size: the zig-zag layout
    assert planned_length(17, lm, sp_size=4, strategy="auto") == 24  # "auto" may choose the ring
    assert planned_length(13, lm, sp_size=2, length_bucket=32) == 32
    assert planned_length(13, None, sp_size=2) == 14
    fixed = transformers.DataCollatorWithPadding(_tokenizer(), padding="max_length", max_length=40)
    assert planned_length(13, fixed, sp_size=2) == 40


def _plan_seq_len_options(rank, world, out_dir):
    """The options AutoSPTrainer passes to autosp.compile, for a few autosp_options (the compile itself replaced
    by the config it would build, so that no planner runs)."""
    import types

    import transformers

    import autosp.integrations.hf as hf
    from autosp.config import AutoSPConfig
    from autosp.plan.auto import resolve_memory_plan
    from experiments.models import build_model

    passed = []

    def compile_config(model, *, sp_size, compiler="inductor", **options):
        passed.append(dict(options))
        config = resolve_memory_plan(model, AutoSPConfig.from_options(sp_size=sp_size, compiler=compiler,
                                                                      options=options))
        return types.SimpleNamespace(config=config)

    hf.autosp_compile = compile_config
    args = transformers.TrainingArguments(output_dir=out_dir, report_to=[], use_cpu=True, disable_tqdm=True)
    collator = transformers.DataCollatorForLanguageModeling(_tokenizer(), mlm=False, pad_to_multiple_of=8)
    trainer = hf.AutoSPTrainer(model=build_model("hf-llama"), args=args, train_dataset=_dataset(1),
                               data_collator=collator, sp_size=2)
    results = {}
    for case, options in {
        "cpu default": {"compiler": "aot_eager"},  # no memory size on CPU: nothing planned
        "planned by default": {"target_memory": 2 ** 30},
        "memory_plan auto": {"memory_plan": "auto", "target_memory": 2 ** 30},
        "given": {"memory_plan": "auto", "target_memory": 2 ** 30, "plan_seq_len": 64},
        "memory_plan off": {"memory_plan": "off"},
        "strategy auto": {"strategy": "auto"},
    }.items():
        trainer._autosp_options, trainer._sp_model = options, None
        config = trainer.sp_model.config
        results[case] = (passed[-1], config.memory_plan, config.plan_seq_len)
    trainer._autosp_options, trainer._sp_model, trainer.train_dataset = {"target_memory": 2 ** 30}, None, None
    results["no dataset"] = trainer.sp_model.config.plan_seq_len
    return results


def test_hf_trainer_passes_the_longest_padded_sample_as_plan_seq_len(tmp_path):
    """Note [The planned length under the Trainer]: where the compile plans and plan_seq_len is not given, the
    longest sample (20 tokens in `_dataset`) padded by the collator (to 24) and AutoSP reaches the config."""
    results = run_on_ranks(_plan_seq_len_options, 1, str(tmp_path), timeout_s=120)[0]
    assert max(len(s["input_ids"]) for s in _dataset(1)) == 20
    options, plan, length = results["cpu default"]
    assert (plan, length) == ("off", None) and "plan_seq_len" not in options and "plan_setup" not in options
    for case in ("planned by default", "memory_plan auto"):
        options, plan, length = results[case]
        assert (plan, length, options["plan_seq_len"]) == ("auto", 24, 24), case
    assert results["given"][1:] == ("auto", 64)  # the user's wins
    assert results["memory_plan off"] == ({"memory_plan": "off"}, "off", None)
    options, _, _ = results["strategy auto"]
    assert options["plan_seq_len"] == 24  # a multiple of 2 * sp_size too: "auto" may choose the ring
    assert results["no dataset"] is None  # the first batch's length, with a warning


def test_hf_trainer_integration_imports_no_names_from_the_package():
    """autosp/__init__.py imports the integration on first use of AutoSPTrainer; the integration takes its names
    from their defining modules, never from the package (no import circle between the two)."""
    import ast
    import pathlib

    import autosp.integrations.hf as hf

    tree = ast.parse(pathlib.Path(hf.__file__).read_text())
    from_package = [ast.unparse(node) for node in ast.walk(tree)
                    if (isinstance(node, ast.Import) and any(a.name == "autosp" for a in node.names))
                    or (isinstance(node, ast.ImportFrom) and node.module == "autosp")]
    assert from_package == []
