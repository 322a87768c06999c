"""The ledger's DeepSpeed 0.16.3 paths (the AutoSP fork's) and current DeepSpeed's stage 0, line by line.

Byte counts are recomputed here from what the cited code allocates (Note [DeepSpeed 0.16.3 as the AutoSP fork ran
it] in simulator/ledger.py), on parameter lists with uneven sizes so the flat buffers' alignment padding shows.
Equality with real engines of the installed DeepSpeed is tests/simulator/test_ledger_deepspeed.py's.
"""

from __future__ import annotations

import pytest

from simulator.ledger import TrainingConfig, memory_ledger, summarize

NUMELS = ((96 * 201, 201, 201 * 301, 301, 301 * 51), (1_000_003,), (7, 5, 3))


def _bytes(cfg: TrainingConfig, at: str) -> dict[str, int]:
    return {c: v[1] for c, v in summarize(memory_ledger(cfg, at=at, device=False)).by_category.items()}


def _flat(n: int, d: int) -> int:
    return -(-n // (2 * d)) * 2 * d


@pytest.mark.parametrize("numels", NUMELS)
@pytest.mark.parametrize("dp", [1, 2, 8])
def test_fork_stage0_bf16_is_bf16_optimizer_with_lingering_grads(numels, dp):
    cfg = TrainingConfig(parameter_numels=numels, zero_stage=0, dp_world_size=dp, deepspeed="0.16.3")
    n, flat = sum(numels), _flat(sum(numels), dp)
    assert cfg.wrapper == "BF16_Optimizer" and cfg.accum_dtype == "fp32"
    expected = {"parameters": 2 * flat,                       # bf16_groups_flat
                "gradients": 4 * flat + 2 * n,                # fp32 flat buffer + bf16 .grad kept between steps
                "optimizer": 4 * flat // dp + 8 * flat // dp + 4}  # fp32 partition, Adam moments, step counter
    for at in ("step", "backward", "optimizer_step"):
        got = _bytes(cfg, at)
        assert {k: got[k] for k in expected} == expected, at
    # After initialisation (before any step) neither Adam's state nor a gradient exists yet.
    init = _bytes(cfg, "initialize")
    assert init["gradients"] == 4 * flat and init["optimizer"] == 4 * flat // dp


@pytest.mark.parametrize("numels", NUMELS)
def test_lingering_grads_are_the_forks_stage0_only(numels):
    """0.19.8's BF16_Optimizer (ZeRO 1 + fp32 accumulation) frees the bf16 grads at the step; the fork's stage 0
    keeps them: between steps the two differ by exactly 2 bytes per parameter."""
    n = sum(numels)
    fork = TrainingConfig(parameter_numels=numels, zero_stage=0, dp_world_size=2, deepspeed="0.16.3")
    z1 = TrainingConfig(parameter_numels=numels, zero_stage=1, grad_accum_dtype="fp32", dp_world_size=2)
    assert z1.wrapper == "BF16_Optimizer"
    assert _bytes(fork, "step")["gradients"] - _bytes(z1, "step")["gradients"] == 2 * n
    assert _bytes(fork, "backward") == _bytes(z1, "backward")


@pytest.mark.parametrize("numels", NUMELS)
def test_fork_zero1_defaults_to_bf16_accumulation(numels):
    """0.16.3's get_data_types accumulates in the model dtype under ZeRO: the same wrapper and bytes as 0.19.8."""
    fork = TrainingConfig(parameter_numels=numels, zero_stage=1, dp_world_size=8, deepspeed="0.16.3")
    now = TrainingConfig(parameter_numels=numels, zero_stage=1, dp_world_size=8)
    assert fork.wrapper == now.wrapper == "DeepSpeedZeroOptimizer"
    for at in ("initialize", "step", "backward", "optimizer_step"):
        assert _bytes(fork, at) == _bytes(now, at)


@pytest.mark.parametrize("numels", NUMELS)
def test_current_stage0_is_about_20_bytes_per_parameter_in_the_step(numels):
    cfg = TrainingConfig(parameter_numels=numels, zero_stage=0, dp_world_size=8)
    n, tensors = sum(numels), len(numels)
    assert cfg.wrapper == "FP16_UnfusedOptimizer"
    # bf16 params + bf16 grads + fp32 masters + Adam moments (+ fp32 grad copies inside the step), unpartitioned
    assert sum(_bytes(cfg, "backward").values()) == (2 + 2 + 4 + 8) * n + 4 * tensors
    assert sum(_bytes(cfg, "optimizer_step").values()) == (2 + 2 + 4 + 8 + 4) * n + 4 * tensors
    assert sum(_bytes(cfg, "step").values()) == (2 + 4 + 8) * n + 4 * tensors


def test_unsupported_combinations_are_refused():
    with pytest.raises(ValueError, match="deepspeed must be one of"):
        TrainingConfig(parameter_numels=(10,), deepspeed="0.17.0")
    with pytest.raises(ValueError, match="Bfloat16 wrapper must use"):
        TrainingConfig(parameter_numels=(10,), zero_stage=0, grad_accum_dtype="bf16", deepspeed="0.16.3")
    with pytest.raises(ValueError, match="ZeRO 0 with bf16"):
        TrainingConfig(parameter_numels=(10,), zero_stage=0, precision="fp32", deepspeed="0.16.3")
    with pytest.raises(ValueError, match="unsupported mix"):
        TrainingConfig(parameter_numels=(10,), zero_stage=0, grad_accum_dtype="fp32")
    with pytest.raises(ValueError, match="at must be one of"):
        memory_ledger(TrainingConfig(parameter_numels=(10,)), at="forward")


def test_fork_lines_cite_the_fork():
    cfg = TrainingConfig(parameter_numels=NUMELS[0], zero_stage=0, dp_world_size=8, deepspeed="0.16.3")
    lines = memory_ledger(cfg, at="backward", device=False)
    assert lines and all("0.16.3" in ln.provenance for ln in lines if not ln.provenance.startswith("torch.optim"))
    assert any("clear_lp_grads" in ln.provenance and ln.when == "step" for ln in lines)
