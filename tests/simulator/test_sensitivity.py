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
