"""Exported whole steps + ``python -m simulator --max-length DIR`` give what the paper-scale search gives.

The simulator side runs without torch on JSON files; these tests check it is the same mechanism as
`experiments.paper_scale.simulate` (the same step at each length, the same ledger, the same search) by
comparing the command line's numbers with `simulate_step` on the same traces, and that a length set whose
longest member fits is reported as a lower bound.
"""

from __future__ import annotations

import json

import pytest

from experiments.models import PAPER_MODELS
from experiments.paper_scale.export_steps import export_steps
from experiments.paper_scale.simulate import TraceCache, simulate_step
from simulator.__main__ import main as simulator_main

LENGTHS = (4096, 8192, 16384)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """AutoSP and ZeRO-3 steps of Llama-3.2-3B at three lengths, one- and two-layer traces, and the
    paper-scale simulation of the same steps from the same traces."""
    out = tmp_path_factory.mktemp("steps")
    cache = TraceCache()
    paths = export_steps("llama-3.2-3b", ("autosp", "zero3"), LENGTHS, out, layers="extrapolated", cache=cache)
    steps = {(system, n): simulate_step(system, "llama-3.2-3b", n, cache=cache, layers="extrapolated")
             for system in ("autosp", "zero3") for n in LENGTHS}
    assert len(paths) == 2 * len(LENGTHS) * 2
    return out, steps


def _cli(directory, out, capacity_gib: float) -> dict:
    assert simulator_main(["--max-length", str(directory), "--memory-gib", str(capacity_gib), "--out", str(out)]) == 0
    return {row["system"]: row for row in json.loads((out / "max_length.json").read_text())}


@pytest.mark.parametrize("answer_index", [0, 1])
def test_cli_finds_the_longest_exported_length_the_paper_scale_search_would(exported, tmp_path, answer_index):
    directory, steps = exported
    # A capacity between the nominal peaks of two exported lengths: the answer is the shorter one.
    fits, fails = (steps[("autosp", n)].peak[1] for n in LENGTHS[answer_index:answer_index + 2])
    assert fits < fails
    capacity = (fits + fails) / 2
    rows = _cli(directory, tmp_path, capacity / 2**30)
    autosp = rows["autosp"]
    assert autosp["nominal"]["max_seq_len"] == LENGTHS[answer_index]
    assert autosp["nominal"]["stopped"] == "converged"
    assert autosp["next_length"] == LENGTHS[answer_index + 1]
    assert autosp["depth_extrapolated"] is True
    # Same step, same ledger: every probed length's peak equals the paper-scale simulation's nominal peak.
    for trial in autosp["nominal"]["trials"]:
        assert trial["peak_memory_bytes"] == steps[("autosp", trial["seq_len"])].peak[1]
        assert trial["step_time_s"] == pytest.approx(steps[("autosp", trial["seq_len"])].step_time_s, rel=1e-12)
    # The interpolated crossing lies strictly between the answer and the next length.
    assert LENGTHS[answer_index] < autosp["interpolated_crossing"] < LENGTHS[answer_index + 1]
    # The band's ends bracket the nominal answer (the high-memory end may fit none of the exported lengths).
    assert autosp["low_memory"]["max_seq_len"] >= LENGTHS[answer_index]
    assert (autosp["high_memory"]["max_seq_len"] or 0) <= LENGTHS[answer_index]


def test_cli_says_lower_bound_when_the_longest_export_fits(exported, tmp_path, capsys):
    directory, steps = exported
    roomy = max(s.peak[2] for s in steps.values()) * 1.5
    rows = _cli(directory, tmp_path, roomy / 2**30)
    for system in ("autosp", "zero3"):
        assert rows[system]["nominal"]["stopped"] == "ceiling"
        assert rows[system]["nominal"]["display"] == f"≥ {LENGTHS[-1]:,}"
    printed = capsys.readouterr().out
    assert "export longer ones" in printed and "depth extrapolated" in printed


def test_cli_refuses_workloads_without_step_metadata(exported, tmp_path, capsys):
    directory, _ = exported
    source = next(directory.glob("*autosp__L1*.json"))
    doc = json.loads(source.read_text())
    doc["metadata"] = {"sp_size": 8}
    (tmp_path / "bare.json").write_text(json.dumps(doc))
    assert simulator_main(["--max-length", str(tmp_path)]) == 2
    assert "export_steps" in capsys.readouterr().err


def test_cli_refuses_a_length_with_one_shallow_depth(exported, tmp_path, capsys):
    directory, _ = exported
    source = next(directory.glob(f"*autosp__L1__S{LENGTHS[0]}.json"))
    (tmp_path / source.name).write_text(source.read_text())
    assert simulator_main(["--max-length", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"full depth ({PAPER_MODELS['llama-3.2-3b'].num_layers} layers)" in err
