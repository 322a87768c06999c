"""The SAC/overlap benchmark's arithmetic (the benchmark itself is a script, not a timed test)."""

from __future__ import annotations

import pytest

from experiments.cpu.bench_sac_overlap import VARIANTS, _fit_affine


def test_bench_fit_recovers_static_and_per_token_memory():
    static, per_token, residual = _fit_affine([(1024, 1000 + 1024 * 8), (2048, 1000 + 2048 * 8), (4096, 1000 + 4096 * 8)])
    assert static == pytest.approx(1000) and per_token == pytest.approx(8) and residual == pytest.approx(0, abs=1e-12)


def test_bench_fit_reports_a_non_affine_profile_in_its_residual():
    _, _, residual = _fit_affine([(1, 1.0), (2, 4.0), (3, 9.0)])  # quadratic: an S x S tensor would show like this
    assert residual > 0.1


def test_bench_covers_the_four_checkpointing_settings_overlap_on_and_off_and_ulysses():
    settings = {opts.get("checkpointing") for system, opts in VARIANTS.values() if system == "autosp"}
    assert settings == {"sac", "none", "default", "full"}
    assert {opts.get("overlap_communication", True) for _, opts in VARIANTS.values()} == {True, False}
    assert "ulysses" in VARIANTS


def test_bench_reports_the_slowest_rank_not_rank_zero():
    from experiments.cpu.bench_sac_overlap import BASELINE, VARIANTS, step_rows

    def rank(step_s, baseline_s):
        return {label: {"median_step_s": baseline_s if label == BASELINE else step_s, "peak_bytes": 2**20,
                        "compile_s": 1.0} for label in VARIANTS}

    rows = step_rows([rank(0.010, 0.020), rank(0.030, 0.025)], 256)  # rank 1 is the slow one
    other = next(r for r in rows if r["variant"] != BASELINE)
    assert other["step_ms"] == 30.0 and other["step_vs_ulysses"] == 1.2 and other["ranks"] == 2
