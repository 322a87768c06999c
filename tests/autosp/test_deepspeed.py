"""AutoSP through deepspeed.initialize: ZeRO 0/1/2/3 training equals single-device training.

Each rank builds the same model twice from one seed: a single-device reference
(trained on every data-parallel replica's sample, gradients averaged over the
replicas) and a copy handed to `autosp.deepspeed_initialize`.  Over two optimizer
steps the loss, every gradient (DeepSpeed's reduced gradient, read before the
step) and every parameter after the steps equal the reference (fp32: rtol 1e-4 /
atol 1e-6).  Gradient clipping is on in some cases, with a limit the reference
gradient norm exceeds, so a gradient norm counted once too often would show; the
ZeRO 2 case also accumulates gradients over two micro-batches.  ZeRO 3 (AutoSP's sharded parameters under
DeepSpeed's engine, Note [ZeRO 3 through DeepSpeed] in autosp/integrations/deepspeed_engine.py) is read whole:
gradients and parameters gathered from the shards.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch

from tests.autosp.cases import FP32_TOL, TECHNIQUES_ON, build_case_model, loss_of, make_sample
from tests.harness import run_on_ranks
from tests.harness.deepspeed_memory import deepspeed_host_bytes

STEPS = 2
SEQ_LEN = 24
CLIP = 0.5


def _make_optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)
    if kind == "adam":
        # eps well above float noise: Adam's first step g / (|g| + eps) would otherwise turn rounding
        # differences in near-zero gradients into O(lr) parameter differences (ill-conditioned, not wrong).  Its
        # derivative in g is at most lr / eps: with eps = 1e-3 a gradient difference at the fp32 tolerance's
        # scale (1e-7 on a summed embedding row) moves a parameter by 1e-6 at most, inside that tolerance; at
        # 1e-4 it moved one embedding element by 2.4e-6 on this machine's kernels.
        return torch.optim.Adam(params, lr=1e-2, eps=1e-3)
    raise ValueError(kind)


ZERO3_AS_ALST = {"stage": 3, "offload_optimizer": {"device": "cpu"}, "stage3_prefetch_bucket_size": 10**6,
                 "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 10**9,
                 "sub_group_size": 10**9}
"""A ZeRO 3 section as ALST's recipes write it (optimizer offloaded; the hook options are dropped under AutoSP)."""


def _ds_config(*, zero_stage: int, sp_size: int, clip: float | None, gas: int = 1, strategy: dict | None = None,
               zero: dict | None = None) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "sequence_parallel_size": sp_size,
        "zero_optimization": zero or {"stage": zero_stage},
        "zero_force_ds_cpu_optimizer": False,  # a torch optimizer with the optimizer offloaded
        "zero_allow_untested_optimizer": True,  # torch SGD under ZeRO
        "gradient_clipping": clip or 0.0,
        "compile": {"deepcompile": True, "passes": ["autosp"]},  # DeepSpeed's spelling, served by AutoSP
        "autosp": {"compiler": "aot_eager", **(strategy or {})},
        "steps_per_print": 10**9,
    }


def _full_grad(param):
    from deepspeed.utils import safe_get_full_grad

    grad = safe_get_full_grad(param)  # ZeRO 1/2: the reduced partitions, gathered
    return None if grad is None else grad.detach().clone().reshape(param.shape)


def _whole_grads(engine) -> dict:
    """The whole gradients of a sharded model (ZeRO 3): each shard's as DeepSpeed holds it (under the optimizer
    offload's ZeRO 2, in the optimizer's partitions), gathered over the group by the model."""
    params = list(engine.module.parameters())
    held = [p.grad for p in params]
    for p in params:
        p.grad = _full_grad(p)
    try:
        return engine.module.full_parameters(grads=True)
    finally:
        for p, grad in zip(params, held, strict=True):
            p.grad = grad


def _priced_host_bytes(reference, *, world: int, sp_size: int, optimizer: str, gas: int) -> int:
    """The host bytes the memory ledger prices for ZeRO 3 with optimizer offload of ``reference``'s parameters (the
    planner's `TrainingSetup`, fp32), after a step."""
    from autosp.plan import TrainingSetup
    from simulator.ledger import memory_ledger, summarize

    setup = TrainingSetup(seq_len=SEQ_LEN, sp_size=sp_size, dp_size=world // sp_size, zero_stage=3, offload="optimizer",
                          dtype="fp32", optimizer={"sgd": "sgd_momentum", "adam": "adam"}[optimizer], grad_accum=1,
                          micro_batch=2)
    config = setup.training_config(tuple(p.numel() for p in reference.parameters()))
    return summarize(memory_ledger(config, at="step", device=False), "host").nominal


def _plain_deepspeed(model, sp_size, optimizer, config):
    """A compiled model handed to deepspeed.initialize itself, with no mpu (as accelerate's DeepSpeed plugin does):
    DeepSpeed averages over every rank gradients the model already reduced (Note [Gradient reduction in
    backward] in autosp.gradients)."""
    import deepspeed

    import autosp

    config = {k: v for k, v in config.items() if k not in ("sequence_parallel_size", "compile", "autosp")}
    deepspeed.init_distributed(dist_backend="gloo")
    sp_model = autosp.compile(model, sp_size=sp_size, compiler="aot_eager")
    return deepspeed.initialize(model=sp_model, optimizer=optimizer, config=config)


def _train_case(rank, world, *, zero_stage, sp_size, optimizer, clip=None, model="hf-llama", data=False, gas=1,
                plain=False, strategy=None, zero=None):
    import autosp
    from experiments.models import vocab_size

    os.environ["LOCAL_RANK"] = str(rank)  # one node: what torchrun sets
    torch.manual_seed(0)
    reference = build_case_model(model)
    candidate = copy.deepcopy(reference)
    dp_size, dp_rank = world // sp_size, rank // sp_size
    vocab = vocab_size(reference)

    ref_opt = _make_optimizer(optimizer, reference.parameters())
    dataset = torch.utils.data.TensorDataset(torch.arange(16)) if data else None
    config = _ds_config(zero_stage=zero_stage, sp_size=sp_size, clip=clip, gas=gas, strategy=strategy, zero=zero)
    if plain:
        engine, _, loader, _ = _plain_deepspeed(candidate, sp_size, _make_optimizer(optimizer, candidate.parameters()),
                                                config)
    else:
        engine, _, loader, _ = autosp.deepspeed_initialize(
            model=candidate, optimizer=_make_optimizer(optimizer, candidate.parameters()), config=config,
            training_data=dataset,
        )
    assert engine.module.groups.sp_size == sp_size and engine.module.module is candidate
    assert engine.module.config.strategy == (strategy or {}).get("strategy", "ulysses")
    sharded = zero_stage == 3
    # reduced exactly once: by the model (its own reduction, or the shards' reduce-scatter) or by the engine
    assert engine.module.reduces_gradients == (plain or sharded)
    assert bool(engine.module.parameter_shards) == sharded

    out = {"loss": [], "ref_loss": [], "grads": [], "ref_grads": [], "ref_norm": []}
    if data:  # DeepSpeed's loader and AutoSP's sampler: the same samples within an SP group
        out["loader_ids"] = list(loader.data_sampler)  # (iterating it spawns workers, not allowed here)
        out["sampler_ids"] = list(autosp.sequence_parallel_sampler(dataset, engine, seed=3))
    for step in range(STEPS):
        # samples[m][d]: micro-batch m of replica d.  Replicas and micro-batches are averaged.
        samples = [[make_sample(SEQ_LEN, vocab, seed=1000 * step + 10 * m + d) for d in range(dp_size)]
                   for m in range(gas)]
        losses = []
        for ids, labels in (s for micro in samples for s in micro):
            loss = loss_of(reference(input_ids=ids, labels=labels))
            (loss / (dp_size * gas)).backward()
            losses.append(loss.detach())
        out["ref_loss"].append(losses[(gas - 1) * dp_size + dp_rank])  # this rank's last micro-batch
        out["ref_grads"].append({n: p.grad.detach().clone() for n, p in reference.named_parameters()})
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip if clip else float("inf"))
        out["ref_norm"].append(float(norm))
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

        for m in range(gas):
            ids, labels = samples[m][dp_rank]
            loss = loss_of(engine(**autosp.prepare_inputs(ids, labels=labels)))
            engine.backward(loss)
            if m == gas - 1:  # the accumulation boundary: gradients reduced
                out["loss"].append(loss.detach())
                out["grads"].append(_whole_grads(engine) if sharded else
                                    {n: _full_grad(p) for n, p in candidate.named_parameters()})
            engine.step()  # steps the optimizer at the boundary only

    if sharded and (zero or {}).get("offload_optimizer"):  # what the planner prices this engine's host memory at
        out["host_bytes"], out["ledger_host_bytes"] = deepspeed_host_bytes(engine), _priced_host_bytes(
            reference, world=world, sp_size=sp_size, optimizer=optimizer, gas=gas)
    plan = engine.module.report.memory_plan
    if plan is not None:
        out["plan_setup"] = {k: plan["setup"][k] for k in ("zero_stage", "micro_batch", "grad_accum", "optimizer")}
    out["params"] = (engine.module.full_parameters() if sharded else
                     {n: p.detach().clone() for n, p in candidate.named_parameters()})
    out["ref_params"] = {n: p.detach().clone() for n, p in reference.named_parameters()}
    return out


def _cases_on_rank(rank, world, cases):
    return [_train_case(rank, world, **case) for case in cases]


def _check(results, cases):
    for rank, per_case in enumerate(results):
        for case, r in zip(cases, per_case, strict=True):
            where = f"rank {rank} {case}"
            for step in range(STEPS):
                torch.testing.assert_close(r["loss"][step], r["ref_loss"][step], **FP32_TOL,
                                           msg=lambda m, w=f"{where} step {step} loss": f"{w}: {m}")
                assert r["grads"][step].keys() == r["ref_grads"][step].keys()
                for name, grad in r["grads"][step].items():
                    assert grad is not None, f"{where}: no gradient for {name}"
                    torch.testing.assert_close(grad, r["ref_grads"][step][name], **FP32_TOL,
                                               msg=lambda m, w=f"{where} step {step} grad {name}": f"{w}: {m}")
                if case.get("clip"):  # the limit bites, so a wrong norm would change the update
                    assert r["ref_norm"][step] > case["clip"]
            for name, param in r["params"].items():
                torch.testing.assert_close(param, r["ref_params"][name], **FP32_TOL,
                                           msg=lambda m, w=f"{where} param {name}": f"{w}: {m}")
            if "host_bytes" in r:  # the ledger prices the offloaded buffers byte for byte (Note [Optimizer offload])
                assert r["host_bytes"] == r["ledger_host_bytes"] > 0, (where, r["host_bytes"], r["ledger_host_bytes"])
            if (case.get("strategy") or {}).get("memory_plan") == "auto":  # planned for the job DeepSpeed runs
                assert r["plan_setup"] == {"zero_stage": case["zero_stage"], "micro_batch": 2,
                                           "grad_accum": case.get("gas", 1), "optimizer": case["optimizer"]}, where


def _check_data(results, sp_size):
    ids = [next((c["loader_ids"], c["sampler_ids"]) for c in r if "loader_ids" in c) for r in results]
    for rank, got in enumerate(ids):
        assert got == ids[rank - rank % sp_size], f"rank {rank} reads other samples than its SP group"
    replicas = ids[::sp_size]
    flat = [i for loader_ids, _ in replicas for i in loader_ids]
    assert sorted(flat) == list(range(16)), "replicas must split the dataset between them"


ZERO_CASES = [
    {"zero_stage": 0, "optimizer": "sgd", "clip": CLIP, "data": True},
    {"zero_stage": 1, "optimizer": "adam"},
    {"zero_stage": 2, "optimizer": "sgd", "clip": CLIP, "gas": 2},
]


STRATEGY_CASES = [  # the compiled ring through autosp.deepspeed_initialize (autosp.compile's strategies)
    {"zero_stage": 1, "optimizer": "adam", "strategy": {"strategy": "ring"}},
    # the memory planner under ZeRO 2, pricing the DeepSpeed config's setup (target: any plan fits this model)
    {"zero_stage": 2, "optimizer": "adam", "strategy": {"memory_plan": "auto", "target_memory": 2**30}},
]
HYBRID_CASE = {"zero_stage": 2, "optimizer": "sgd", "clip": CLIP, "sp_size": 4,
               "strategy": {"strategy": "hybrid", "ulysses_size": 2}}


ZERO3_CASES = [  # AutoSP's sharded parameters under DeepSpeed's engine (Note [ZeRO 3 through DeepSpeed])
    {"zero_stage": 3, "optimizer": "adam", "clip": CLIP, "gas": 2, "strategy": TECHNIQUES_ON},
    {"zero_stage": 3, "optimizer": "sgd", "clip": CLIP, "model": "hf-qwen2", "zero": ZERO3_AS_ALST},
]
ZERO3_MOE_CASE = {"zero_stage": 3, "optimizer": "adam", "clip": CLIP, "model": "mixtral"}


PLAIN_CASES = [  # deepspeed.initialize without AutoSP's mpu
    {"zero_stage": 0, "optimizer": "sgd", "clip": CLIP, "plain": True},
    {"zero_stage": 2, "optimizer": "sgd", "clip": CLIP, "gas": 2, "plain": True},
]


def test_deepspeed_zero_0_to_3_two_ranks_match_single_device():
    # The plain engines first: an engine given an mpu records it in DeepSpeed's process-wide groups, which a
    # later engine in the same process would read.
    cases = [{**c, "sp_size": 2} for c in PLAIN_CASES + ZERO_CASES + STRATEGY_CASES + ZERO3_CASES + [ZERO3_MOE_CASE]]
    results = run_on_ranks(_cases_on_rank, 2, cases, timeout_s=500)
    _check(results, cases)
    _check_data(results, 2)


@pytest.mark.slow
def test_deepspeed_zero_0_to_3_sequence_times_data_parallel_match_single_device():
    # SP 2 x DP 2, then the hybrid (Ulysses 2 x ring 2, SP 4) and the MoE model sharded over SP 4
    cases = [{**c, "sp_size": 2} for c in ZERO_CASES + ZERO3_CASES] + [HYBRID_CASE, {**ZERO3_MOE_CASE, "sp_size": 4}]
    results = run_on_ranks(_cases_on_rank, 4, cases, timeout_s=600)
    _check(results, cases)
    _check_data(results, 2)


def _bf16_updates_on_rank(rank, world):
    """Under bf16 (Note [ZeRO 3 through DeepSpeed]): DeepSpeed's ZeRO 0 wrapper as released, and each update of
    ZeRO 3 through AutoSP (with and without optimizer offload) against AdamW stepped by hand on the engine's own fp32
    master weights and gradients."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    import autosp
    from experiments.models import build_model, vocab_size

    os.environ["LOCAL_RANK"] = str(rank)
    adamw = {"lr": 1e-3, "weight_decay": 0.01}
    out = {}
    # The fault as released (first in the process: no AutoSP mpu recorded yet): built, the wrapper has stepped.
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 4).to(torch.bfloat16)
    deepspeed.init_distributed(dist_backend="gloo")
    plain, *_ = deepspeed.initialize(model=linear, optimizer=torch.optim.AdamW(linear.parameters(), **adamw), config={
        "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9})
    out["plain"] = (type(plain.optimizer).__name__, [float(s["step"]) for s in plain.optimizer.optimizer.state.values()])
    for offload in (False, True):
        torch.manual_seed(0)
        model = build_model("hf-llama").to(torch.bfloat16)
        zero = {"stage": 3, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
        config = {**_ds_config(zero_stage=3, sp_size=2, clip=CLIP, zero=zero), "bf16": {"enabled": True}}
        engine, *_ = autosp.deepspeed_initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), **adamw),
                                                 config=config)
        shards = engine.module.parameter_shards
        by_hand = [safe_get_full_fp32_param(p).clone() for p in shards]
        reference = torch.optim.AdamW(by_hand, **adamw)
        worst, rounded = 0.0, True
        for step in range(STEPS):
            ids, labels = make_sample(SEQ_LEN, vocab_size(model), seed=step)
            engine.backward(loss_of(engine(**autosp.prepare_inputs(ids, labels=labels))))
            grads = [safe_get_full_grad(p).float().clone() for p in shards]  # clipped by the step, as DeepSpeed does
            norm = torch.stack([g.pow(2).sum() for g in grads]).sum()
            torch.distributed.all_reduce(norm)
            scale = min(1.0, CLIP / (float(norm.sqrt()) + 1e-6))
            engine.step()
            for master, grad in zip(by_hand, grads, strict=True):
                master.grad = grad * scale
            reference.step()
            for p, master in zip(shards, by_hand, strict=True):
                worst = max(worst, float((safe_get_full_fp32_param(p) - master).abs().max()))
                rounded &= torch.equal(p.detach(), safe_get_full_fp32_param(p).to(torch.bfloat16))
        out[offload] = {"worst": worst, "rounded": rounded, "wrapper": type(engine.optimizer).__name__}
    return out


def test_deepspeed_zero_3_in_bf16_steps_adamw_exactly_on_its_fp32_masters():
    results = run_on_ranks(_bf16_updates_on_rank, 2, timeout_s=400)
    for rank, r in enumerate(results):
        # DeepSpeed 0.19.8's ZeRO 0 wrapper for bf16 took an optimizer step when it was built (Note [ZeRO 3 through
        # DeepSpeed]): Adam's step count is 1 before training.  Should DeepSpeed fix it, the Note and the engine
        # choice can be revisited.
        assert r["plain"] == ("FP16_UnfusedOptimizer", [1.0, 1.0]), r["plain"]
        for offload in (False, True):
            got = r[offload]
            assert got["wrapper"] == "DeepSpeedZeroOptimizer", (rank, offload, got)
            # fp32 masters equal AdamW by hand to rounding (the fault above moves them by about 3e-4)
            assert got["worst"] <= 1e-7 and got["rounded"], (rank, offload, got)


# --- errors and the sampler: no training, no ranks ---------------------------------------------------


def _config(**overrides) -> dict:
    return {**_ds_config(zero_stage=0, sp_size=2, clip=None), **overrides}


def _model():
    from experiments.models import build_model

    return build_model("plain-llama")


@pytest.mark.parametrize(("entry", "optimizer", "expected"), [
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "gradient_accumulation_steps": 4},
     "adamw", {"zero_stage": 2, "offload": "optimizer", "micro_batch": 2, "grad_accum": 4, "optimizer": "adamw"}),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}, None,
     {"zero_stage": 0, "offload": "none", "micro_batch": 2, "grad_accum": 1, "optimizer": "sgd_momentum"}),
    ({"zero_optimization": {"stage": 1}, "gradient_accumulation_steps": "auto"}, "sgd",
     {"zero_stage": 1, "offload": "none", "micro_batch": 2, "optimizer": "sgd"}),  # an unresolved "auto" is left out
    ({}, "lbfgs", {"zero_stage": 0, "offload": "none", "micro_batch": 2, "grad_accum": 1}),  # unknown: the default
    ({"zero_optimization": ZERO3_AS_ALST}, "adamw",  # the shards stepped by DeepSpeed's engine
     {"zero_stage": 3, "offload": "optimizer", "engine": "deepspeed", "micro_batch": 2, "grad_accum": 1,
      "optimizer": "adamw"}),
])
def test_deepspeed_config_is_what_the_planner_prices(entry, optimizer, expected):
    from autosp.integrations.deepspeed_engine import _planned_setup

    params = [torch.nn.Parameter(torch.zeros(2))]
    torch_optimizer = {"adamw": lambda: torch.optim.AdamW(params), "sgd": lambda: torch.optim.SGD(params, lr=0.1),
                       "lbfgs": lambda: torch.optim.LBFGS(params), None: lambda: None}[optimizer]()
    assert _planned_setup(_config(**entry), torch_optimizer) == expected


def test_deepspeed_zero_3_is_priced_as_the_engine_that_steps_the_shards():
    """Note [ZeRO 3 through DeepSpeed]: under DeepSpeed's engine the shards are priced as its ZeRO 0 over each rank
    in fp32, its ZeRO 2 over them in bf16 (fp32 master copies) or with the optimizer offloaded; under a plain torch
    optimizer as the shards alone."""
    from autosp.errors import AutoSPError
    from autosp.plan import TrainingSetup

    numels = (1000, 10, 333)
    shards = (250, 3, 84)  # each padded to a multiple of the 4 ranks
    setup = TrainingSetup(seq_len=64, sp_size=2, dp_size=2, zero_stage=3, dtype="bf16")
    by_engine = {engine: dataclasses.replace(setup, engine=engine).training_config(numels)
                 for engine in ("torch", "deepspeed")}
    assert by_engine["torch"].wrapper == "torch, sharded" and by_engine["torch"].dp_world_size == 4
    assert by_engine["deepspeed"].wrapper == "DeepSpeedZeroOptimizer"  # its ZeRO 2 over the rank with bf16
    assert dataclasses.replace(setup, engine="deepspeed", dtype="fp32").training_config(numels).wrapper == "torch"
    assert by_engine["deepspeed"].parameter_numels == shards and by_engine["deepspeed"].dp_world_size == 1
    offloaded = TrainingSetup(seq_len=64, sp_size=2, dp_size=2, zero_stage=3, dtype="bf16", offload="optimizer")
    assert offloaded.training_config(numels).wrapper == "DeepSpeedZeroOptimizer"  # ZeRO 2 over the rank
    with pytest.raises(AutoSPError, match="optimizer offload under ZeRO 3 is DeepSpeed's"):
        TrainingSetup(seq_len=64, zero_stage=3, offload="optimizer", engine="torch").check()
    with pytest.raises(AutoSPError, match="engine='deepspeed' says what steps the shards of ZeRO 3"):
        TrainingSetup(seq_len=64, zero_stage=2, engine="deepspeed").check()


def test_deepspeed_zero_stage_that_does_not_exist_is_refused_naming_the_stages():
    import autosp

    with pytest.raises(autosp.AutoSPError, match=r"ZeRO stage 4 does not exist.*\[0, 1, 2, 3\]"):
        autosp.deepspeed_initialize(model=_model(), config=_config(zero_optimization={"stage": 4}))


def test_deepspeed_zero_3_engine_config_keeps_the_optimizer_offload_and_refuses_parameter_offload():
    from autosp.errors import AutoSPError
    from autosp.integrations.deepspeed_engine import _engine_config_for_shards

    engine = _engine_config_for_shards(_config(zero_optimization=ZERO3_AS_ALST))
    assert engine["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu"}}  # hook options dropped
    assert "sequence_parallel_size" not in engine  # the compiled program is the SP program; DeepSpeed adds none
    assert _engine_config_for_shards(_config(zero_optimization={"stage": 3}))["zero_optimization"] == {"stage": 0}
    low = _engine_config_for_shards(_config(zero_optimization={"stage": 3}, bf16={"enabled": True}))
    assert low["zero_optimization"] == {"stage": 2}  # not ZeRO 0's low-precision wrapper (the Note)
    with pytest.raises(AutoSPError, match="offload_param.*gathered inside the compiled program"):
        _engine_config_for_shards(_config(zero_optimization={"stage": 3, "offload_param": {"device": "cpu"}}))


def test_deepspeed_jit_building_config_optimizer_is_refused_on_cpu():
    import autosp

    for entry in ({"type": "Adam", "params": {"lr": 1e-3}}, {"type": "Lamb"}):
        with pytest.raises(autosp.AutoSPError, match="JIT-builds.*torch.optim.AdamW"):
            autosp.deepspeed_initialize(model=_model(), config=_config(optimizer=entry))


def test_deepspeed_other_deepcompile_passes_are_refused():
    import autosp

    for passes in (["autosp", "z1"], []):
        with pytest.raises(autosp.AutoSPError, match="do not compose with AutoSP"):
            autosp.deepspeed_initialize(model=_model(), config=_config(compile={"deepcompile": True, "passes": passes}))


def test_deepspeed_missing_or_conflicting_sequence_parallel_size_is_refused():
    import autosp

    config = _config()
    del config["sequence_parallel_size"]
    with pytest.raises(autosp.AutoSPError, match="add \"sequence_parallel_size\""):
        autosp.deepspeed_initialize(model=_model(), config=config)
    with pytest.raises(autosp.AutoSPError, match="disagrees"):
        autosp.deepspeed_initialize(model=_model(), config=_config(), sp_size=4)


def test_deepspeed_sp_size_not_dividing_the_world_is_refused(monkeypatch):
    import autosp
    from tests.harness.fake_group import fake_process_group

    monkeypatch.setenv("LOCAL_RANK", "0")
    with fake_process_group(4), pytest.raises(autosp.AutoSPError, match="sp_size=3 does not divide"):
        autosp.deepspeed_initialize(model=_model(), config=_config(sequence_parallel_size=3))


def test_sequence_parallel_sampler_same_indices_within_an_sp_group():
    import autosp
    from autosp.groups import SequenceParallelGroups

    dataset = list(range(10))
    by_rank = []
    for rank in range(6):  # world 6 = SP 3 x DP 2
        groups = SequenceParallelGroups(group=None, sp_group=None, sp_size=3, sp_rank=rank % 3, dp_size=2,
                                        dp_rank=rank // 3)
        by_rank.append(list(autosp.sequence_parallel_sampler(dataset, groups, seed=1)))
    assert by_rank[0] == by_rank[1] == by_rank[2] and by_rank[3] == by_rank[4] == by_rank[5]
    assert sorted(by_rank[0] + by_rank[3]) == dataset
    with pytest.raises(autosp.AutoSPError, match="cannot find AutoSP's groups"):
        autosp.sequence_parallel_sampler(dataset, object())
