"""Sensitivity of the longest trainable sequence to the ledger's uncertain constants."""

from __future__ import annotations

import pytest

from simulator import TrainingConfig, memory_ledger, summarize
from simulator.device_reserve import UNCERTAIN
from simulator.sensitivity import format_sensitivity, length_sensitivity

GIB = 2**30
CFG = TrainingConfig.from_parameter_count(8_030_000_000, precision="bf16", dp_world_size=8, zero_stage=3)


def test_sensitivity_nominal_row_is_the_longest_length_that_fits_the_ledger():
    rows = length_sensitivity(CFG, seq_len=32768, activation_bytes=20 * GIB, capacity_bytes=80 * GIB)
    nominal = rows[0].at_low
    fits = summarize(memory_ledger(CFG, at="backward", activation_bytes=int(20 * GIB * nominal / 32768))).nominal
    over = summarize(memory_ledger(CFG, at="backward",
                                   activation_bytes=int(20 * GIB * (nominal + 1024) / 32768))).nominal
    assert fits <= 80 * GIB < over


def test_sensitivity_moving_a_memory_constant_up_never_lengthens_the_sequence():
    rows = length_sensitivity(CFG, seq_len=32768, activation_bytes=20 * GIB, capacity_bytes=80 * GIB)
    assert [r.name for r in rows] == ["nominal", *UNCERTAIN, "all"]
    nominal = rows[0].at_low
    for row in rows[1:]:
        assert row.at_low >= nominal >= row.at_high, row
    assert rows[-1].at_low > rows[-1].at_high
    assert "fragmentation_fraction" in format_sensitivity(rows)


def test_sensitivity_reports_none_when_static_memory_alone_does_not_fit():
    rows = length_sensitivity(CFG, seq_len=4096, activation_bytes=GIB, capacity_bytes=10 * GIB)
    assert rows[0].at_low is None and "none" in format_sensitivity(rows)
    with pytest.raises(ValueError):
        length_sensitivity(CFG, seq_len=0, activation_bytes=GIB, capacity_bytes=10 * GIB)


def test_sensitivity_gpu_constants_move_the_step_time_the_way_their_physics_says(tmp_path):
    from simulator import Cluster, Workload, simulate
    from simulator.gpu_constants import constants_for
    from simulator.hardware import build_preset
    from simulator.sensitivity import format_timing_sensitivity, timing_sensitivity
    from simulator.synthetic import LlamaShape, llama_ulysses_workload

    shape = LlamaShape(layers=1, hidden=512, heads=8, kv_heads=8, ffn_hidden=1024, vocab=1000)
    workload: Workload = llama_ulysses_workload(seq_len=8192, sp_degree=8, shape=shape, ops_per_layer=(60, 100))

    def simulate_with(table):
        result = simulate(workload, Cluster.from_preset(build_preset("h100-sxm", table)))
        return result.step_time_s, max(r.peak_memory_bytes - r.static_memory_bytes for r in result.ranks)

    names = constants_for("hopper", "nvlink")
    rows = timing_sensitivity(CFG, constants=names, simulate_with=simulate_with, seq_len=8192,
                              capacity_bytes=80 * GIB)
    by = {r.name: r for r in rows}
    assert [r.name for r in rows] == ["nominal", *names]
    nominal = by["nominal"].step_low_s
    # Faster kernels and faster links never lengthen the step; a longer launch overhead never shortens it.
    for name in ("hopper.matmul.flops", "hopper.attention.flops", "nvlink.efficiency"):
        assert by[name].step_low_s >= nominal >= by[name].step_high_s, name
    assert by["hopper.matmul.flops"].step_low_s > by["hopper.matmul.flops"].step_high_s
    assert by["gpu.kernel_launch_overhead_s"].step_low_s <= nominal <= by["gpu.kernel_launch_overhead_s"].step_high_s
    assert "hopper.matmul.flops *" in format_timing_sensitivity(rows)
