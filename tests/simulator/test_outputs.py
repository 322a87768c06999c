"""Result JSON, the Perfetto trace and the PNG plots of a simulated step."""

from __future__ import annotations

import json

import pytest

from simulator import ProgramBuilder, simulate
from simulator.plots import plot_memory, plot_timeline
from simulator.trace import chrome_trace, write_chrome_trace
from tests.simulator.toys import GFLOP, MS, overlap_program, symmetric, toy_cluster


def _result():
    b = overlap_program(hidden_gflop=0.25)
    t = b.tensor(1000)
    b.compute("D", flops=GFLOP, allocates=[t])
    b.collective("ar", kind="all_reduce", group="sp", message_bytes=10**6, frees=[t])
    return simulate(symmetric(b), toy_cluster())


def test_outputs_result_json_has_the_headline_figures(tmp_path):
    result = _result()
    path = tmp_path / "result.json"
    result.to_json(path, include_ops=True)
    doc = json.loads(path.read_text())
    assert doc["step_time_s"] == pytest.approx(5 * MS)
    assert doc["fits"] is True and doc["oom"] is None
    assert doc["collapsed"] is True and doc["simulated_ranks"] == [0]
    assert [r["rank"] for r in doc["ranks"]] == [0, 1]
    assert doc["ranks"][1]["represented_by"] == 0
    assert set(doc["ranks"][0]["stream_busy_s"]) == {"compute", "comm:sp"}
    assert [op["name"] for op in doc["ops"]["0"]][:3] == ["A", "a2a", "B"]


def test_outputs_trace_has_a_process_per_rank_and_a_thread_per_stream(tmp_path):
    result = _result()
    trace = chrome_trace(result)
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert {e["args"]["name"] for e in meta if e["name"] == "thread_name"} == {"compute", "comm:sp"}
    assert any("represents [0, 1]" in e["args"]["name"] for e in meta if e["name"] == "process_name")
    slices = {e["name"]: e for e in trace["traceEvents"] if e["ph"] == "X"}
    assert slices["a2a"]["ts"] == pytest.approx(1000.0) and slices["a2a"]["dur"] == pytest.approx(1000.0)
    assert slices["wait_a2a"]["cat"] == "stall" and slices["wait_a2a"]["dur"] == pytest.approx(750.0)
    assert slices["ar"]["args"]["group"] == "sp"
    assert [e["args"]["bytes"] for e in trace["traceEvents"] if e["ph"] == "C"] == [0, 1000, 0]
    path = tmp_path / "trace.json"
    write_chrome_trace(result, path)
    assert json.loads(path.read_text())["displayTimeUnit"] == "ms"


def test_outputs_plots_write_png_files(tmp_path):
    b = ProgramBuilder()
    t = b.tensor(2000)
    b.compute("A", flops=GFLOP, allocates=[t])
    b.compute("B", flops=GFLOP, frees=[t])
    result = simulate(symmetric(b), toy_cluster(memory_bytes=1000))  # with an OOM marker
    for plot, name in ((plot_timeline, "timeline.png"), (plot_memory, "memory.png")):
        plot(result, tmp_path / name)
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
