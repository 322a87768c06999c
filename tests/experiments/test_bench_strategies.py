"""The strategies benchmark's choice of systems, argument checks and table arithmetic (the benchmark itself is a
script, not a timed test: one gloo run compiles every strategy, about a minute on two cores)."""

from __future__ import annotations

import pytest

from experiments.cpu.bench_strategies import BASELINE, main, rows_of, systems_for


@pytest.mark.parametrize(("ranks", "heads", "kv_heads", "expected"), [
    (2, 8, 4, ("autosp", "autosp-ring", "ring")),
    (4, 8, 4, ("autosp", "autosp-hybrid-2x2", "autosp-ring", "ring")),
    (4, 6, 2, ("autosp-hybrid-2x2", "autosp-ring", "ring")),  # 6 heads: no Ulysses over 4 ranks
    (8, 8, 2, ("autosp", "autosp-hybrid-2x4", "autosp-hybrid-4x2", "autosp-ring", "ring")),
])
def test_bench_strategies_runs_the_pass_candidates_and_the_hand_written_ring(ranks, heads, kv_heads, expected):
    assert systems_for(ranks, heads=heads, kv_heads=kv_heads) == expected


@pytest.mark.parametrize("argv", [
    ["--ranks", "1"], ["--ranks", "2", "4", "--systems", "autosp-hybrid-2x2"], ["--systems", "autosp-rng"],
    ["--compiler", "inductr"], ["--steps", "0"], ["--seq-len", "-4"],
])
def test_bench_strategies_refuses_bad_arguments_before_any_work(argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2 and "error:" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _rank(steps: dict[str, float], *, unsupported: str = "") -> dict:
    systems = {name: {"median_step_s": s, "first_step_s": 2.0, "loss": 1.5, "loss_error": 1e-7,
                      "grad_max_rel_error": 2e-6, "peak_memory_bytes": 2**20} for name, s in steps.items()}
    if unsupported:
        systems[unsupported] = {"unsupported": "no such pass option"}
    return {"systems": systems}


def test_bench_strategies_rows_take_the_slowest_rank_and_the_ratio_to_autosp():
    per_rank = [_rank({BASELINE: 0.020, "autosp-ring": 0.030}, unsupported="ring"),
                _rank({BASELINE: 0.025, "autosp-ring": 0.040}, unsupported="ring")]  # rank 1 is the slow one
    rows = {r["system"]: r for r in rows_of(2, 512, per_rank)}
    assert rows[BASELINE]["median_step_ms"] == "25.0" and rows[BASELINE][f"ratio_to_{BASELINE}"] == "1.00"
    assert rows["autosp-ring"]["median_step_ms"] == "40.0" and rows["autosp-ring"][f"ratio_to_{BASELINE}"] == "1.60"
    assert rows["autosp-ring"]["grad_max_rel_error"] == "2.0e-06" and rows["autosp-ring"]["peak_mib"] == "1.00"
    assert rows["ring"]["median_step_ms"] == "" and rows["ring"]["note"].startswith("unsupported")
    without_baseline = rows_of(2, 512, [_rank({"autosp-ring": 0.03})])
    assert without_baseline[0][f"ratio_to_{BASELINE}"] == ""
