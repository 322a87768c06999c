"""The memory ledger's arithmetic without DeepSpeed (test_ledger_deepspeed.py checks it against real engines)."""

from __future__ import annotations

import dataclasses

import pytest

from simulator import TrainingConfig, memory_ledger, summarize
from simulator.device_reserve import UNCERTAIN, reserved_bytes, with_uncertain
from simulator.ledger import CATEGORIES, format_ledger

LLAMA_8B = 8_030_000_000


def _cfg(**kw) -> TrainingConfig:
    return TrainingConfig.from_parameter_count(LLAMA_8B, **{"precision": "bf16", "dp_world_size": 8, **kw})


def _by(lines, category):
    return summarize(lines).by_category[category]


def test_ledger_bf16_optimizer_keeps_an_unpartitioned_fp32_gradient_buffer():
    cfg = _cfg(zero_stage=1, grad_accum_dtype="fp32")
    assert cfg.wrapper == "BF16_Optimizer"
    flat = -(-LLAMA_8B // 16) * 16
    lines = memory_ledger(cfg, at="step")
    assert _by(lines, "gradients")[1] == 4 * flat
    assert _by(lines, "parameters")[1] == 2 * flat
    assert _by(lines, "optimizer")[1] == 3 * 4 * flat // 8 + 4
    assert _by(memory_ledger(cfg, at="initialize"), "optimizer")[1] == 4 * flat // 8  # Adam state comes lazily


def test_ledger_zero3_partitions_everything_and_keeps_one_bucket():
    lines = memory_ledger(_cfg(zero_stage=3), at="step", device=False)
    part = -(-LLAMA_8B // 8)
    assert _by(lines, "parameters")[1] == 2 * part and _by(lines, "gradients")[1] == 2 * part
    assert _by(lines, "communication buffers")[1] == 2 * 500_000_000


def test_ledger_of_autosp_sharded_parameters_holds_one_shard_of_each_state_in_the_parameters_dtype():
    numels = (10, 1_000_001)
    cfg = TrainingConfig(parameter_numels=numels, zero_stage=0, dp_world_size=4, precision="bf16",
                         optimizer="adamw", sharded_parameters=True)
    assert cfg.wrapper == "torch, sharded"
    lines = memory_ledger(cfg, at="optimizer_step", device=False)
    shards = sum(-(-n // 4) for n in numels)
    assert _by(lines, "parameters")[1] == 2 * shards and _by(lines, "gradients")[1] == 2 * shards
    assert _by(lines, "optimizer")[1] == 2 * 2 * shards + 4 * len(numels)  # two bf16 states, fp32 step counters
    assert _by(lines, "communication buffers")[1] == 0  # no DeepSpeed engine, no buckets
    for bad in (dict(zero_stage=3), dict(zero_stage=1, offload_optimizer=True)):
        with pytest.raises(ValueError, match="plain optimizer"):
            dataclasses.replace(cfg, **bad)


def test_ledger_zero3_keeps_small_parameters_gathered():
    cfg = TrainingConfig(parameter_numels=(10, 1_000_000), zero_stage=3, dp_world_size=4, precision="fp32")
    gathered = [ln for ln in memory_ledger(cfg, at="step") if ln.name.startswith("persistent")]
    assert [ln.bytes for ln in gathered] == [4 * 12]  # ceil(10 / 4) * 4 elements


def test_ledger_instants_only_add_lines():
    cfg = _cfg(zero_stage=1)
    totals = [summarize(memory_ledger(cfg, at=at)).nominal for at in ("initialize", "step", "backward")]
    assert totals == sorted(totals) and totals[0] < totals[2]


def test_ledger_bands_and_categories():
    lines = memory_ledger(_cfg(zero_stage=1), at="backward", activation_bytes=20 * 2**30, logits_bytes=2**30)
    assert all(ln.low <= ln.bytes <= ln.high and ln.provenance for ln in lines)
    summary = summarize(lines)
    assert set(summary.by_category) == set(CATEGORIES)
    assert summary.low < summary.nominal < summary.high
    assert summary.by_category["allocator"][2] >= 0.2 * 20 * 2**30  # fragmentation band covers the activations
    static = summary.static_memory()
    assert static.total_bytes == summary.nominal
    assert "total" in format_ledger(lines)


def test_ledger_device_lines_follow_the_uncertain_table():
    cfg = _cfg(zero_stage=1, nccl_communicators=3)
    moved = with_uncertain("nccl_bytes_per_communicator", 1.0 * 2**30)
    nccl = [ln for ln in memory_ledger(cfg, uncertain=moved) if ln.name.startswith("NCCL")][0]
    assert nccl.bytes == 3 * 2**30
    assert all(u.provenance for u in UNCERTAIN.values())
    with pytest.raises(ValueError):
        with_uncertain("no_such_constant", 1.0)


def test_ledger_allocator_rounding():
    assert reserved_bytes(1) == 512 and reserved_bytes(512) == 512 and reserved_bytes(513) == 1024
    assert reserved_bytes(10 * 2**20 + 1) == 12 * 2**20  # large: 2 MiB segments
    assert reserved_bytes(0) == 0


@pytest.mark.parametrize("bad", [dict(zero_stage=0, grad_accum_dtype="fp32"), dict(zero_stage=4),
                                 dict(optimizer="lion"), dict(dp_world_size=0), dict(precision="fp8")])
def test_ledger_rejects_configurations_deepspeed_rejects_or_it_cannot_price(bad):
    with pytest.raises(ValueError):
        _cfg(**bad)


def test_ledger_config_is_frozen_and_keyword_only():
    cfg = _cfg(zero_stage=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.zero_stage = 3
    with pytest.raises(TypeError):
        TrainingConfig((1,))
    assert cfg.parameter_count == LLAMA_8B and cfg.wrapper == "DeepSpeedZeroOptimizer"
    with pytest.raises(ValueError):
        memory_ledger(cfg, at="later")


def test_ledger_llama_shape_counts_llama_3_1_8b():
    cfg = TrainingConfig.for_llama(hidden=4096, ffn_hidden=14336, layers=32, heads=32, kv_heads=8, vocab=128256,
                                   zero_stage=2, dp_world_size=8)
    assert cfg.parameter_count == 8_030_261_248 and len(cfg.parameter_numels) == 2 + 32 * 9 + 1
    grads = [ln for ln in memory_ledger(cfg, at="backward") if ln.name.startswith("gradients of the parameters")]
    # the worst partition holds its eighth plus the parameters it cuts: far less than every gradient
    assert LLAMA_8B * 2 / 8 < grads[0].bytes < LLAMA_8B * 2 / 4
