"""The planner-accuracy benchmark's figures (`experiments.cpu.bench_plan_accuracy`): each point's error, and the
summary's median, worst and over-target points, from points whose numbers are given here."""

from __future__ import annotations

import pytest

from experiments.cpu.bench_plan_accuracy import error_pct, point_line, summarize, summary_line

MIB = 2**20


def _point(predicted, measured, target, *, plan="sac", fraction=0.5):
    return {"model": "hf-llama", "seq_len": 1024, "fraction": fraction, "unplanned_bytes": 10 * MIB,
            "target_bytes": target, "plan": plan, "predicted_bytes": predicted, "measured_bytes": measured,
            "seconds": 1.0}


def test_error_is_signed_in_percent_of_the_measured_peak_and_none_without_a_plan():
    assert error_pct(_point(11 * MIB, 10 * MIB, 12 * MIB)) == pytest.approx(10.0)  # pessimistic
    assert error_pct(_point(9 * MIB, 10 * MIB, 12 * MIB)) == pytest.approx(-10.0)  # optimistic
    assert error_pct(_point(None, None, 2 * MIB, plan="no plan fits")) is None
    assert point_line(_point(None, None, 2 * MIB, plan="no plan fits")).endswith("no plan fits")


def test_summary_takes_median_and_worst_of_the_planned_points_and_names_those_over_their_target():
    points = [_point(11 * MIB, 10 * MIB, 12 * MIB, fraction=0.5),  # +10 %
              _point(9 * MIB, 10 * MIB, 9.5 * MIB, fraction=0.7),  # -10 %, measured over its target
              _point(10.2 * MIB, 10 * MIB, 12 * MIB, fraction=0.9),  # +2 %
              _point(None, None, MIB, plan="no plan fits", fraction=0.3)]
    summary = summarize(points)
    assert (summary["points"], summary["planned"], summary["no_plan"]) == (4, 3, 1)
    assert summary["median_abs_error_pct"] == pytest.approx(10.0)
    assert summary["worst_abs_error_pct"] == pytest.approx(10.0)
    assert summary["median_error_pct"] == pytest.approx(2.0)
    assert summary["over_target"] == ["hf-llama 1024 @ 0.7"]
    assert "OVER TARGET" in point_line(points[1]) and "OVER TARGET" not in point_line(points[0])
    assert "over their target: 1 (hf-llama 1024 @ 0.7)" in summary_line(summary)
    assert summary_line(summarize(points[3:])) == "1 points, none planned"


def test_fixed_options_are_memory_options_the_planned_row_is_compiled_with():
    """``--fixed activation_offload=on`` measures the offload plans: the option reaches the planned row's compile
    beside its target, and the planner keeps it; anything but a memory option and one of its values is refused."""
    import argparse

    from experiments.cpu.bench_plan_accuracy import _fixed, build_parser
    from experiments.cpu.memory_cap import PLANNER_ROW, row_system

    args = build_parser().parse_args(["--fixed", "activation_offload=on", "checkpointing=sac"])
    assert dict(args.fixed) == {"activation_offload": "on", "checkpointing": "sac"}
    name, options = row_system(PLANNER_ROW, 16 * MIB, dict(args.fixed))
    assert name == PLANNER_ROW and options["activation_offload"] == "on" and options["checkpointing"] == "sac"
    assert options["target_memory"] == 16 * MIB
    assert "activation_offload" not in row_system(PLANNER_ROW, 16 * MIB)[1]
    for wrong in ("activation_offload", "activation_offload=maybe", "sp_size=4"):
        with pytest.raises(argparse.ArgumentTypeError, match="OPTION=VALUE"):
            _fixed(wrong)
