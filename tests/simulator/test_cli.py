"""``python -m simulator``: a subprocess smoke test and its error messages."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from simulator.synthetic import LlamaShape, llama_ulysses_workload

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, "-m", "simulator", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, check=False, timeout=120)


def _small_workload(folder: pathlib.Path) -> pathlib.Path:
    """A two-layer Llama-style Ulysses workload on 8 ranks (8,192 tokens), written as ``folder/workload.json``."""
    shape = LlamaShape(layers=2, hidden=512, heads=8, kv_heads=8, ffn_hidden=1024, vocab=1000)
    path = folder / "workload.json"
    llama_ulysses_workload(seq_len=8192, sp_degree=8, shape=shape, ops_per_layer=(60, 100)).to_json(path)
    return path


def test_cli_help_explains_the_outputs():
    proc = _cli("--help")
    assert proc.returncode == 0
    for word in ("--cluster", "--nodes", "--out", "result.json", "trace.json", "timeline.png"):
        assert word in proc.stdout


def test_cli_simulates_a_workload_and_writes_every_output(tmp_path):
    path, out = _small_workload(tmp_path), tmp_path / "out"
    proc = _cli(str(path), "--cluster", "h100-sxm", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "step time" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["memory.png", "result.json", "timeline.png", "trace.json"]
    result = json.loads((out / "result.json").read_text())
    assert result["cluster"]["preset"] == "h100-sxm" and result["world_size"] == 8 and result["fits"]


def test_cli_lists_clusters():
    proc = _cli("--list-clusters")
    assert proc.returncode == 0 and "a100-80gb-sxm" in proc.stdout and "cpu-gloo" in proc.stdout


def test_cli_reports_input_errors_with_exit_status_2(tmp_path):
    missing = _cli(str(tmp_path / "nope.json"), "--out", str(tmp_path / "o"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"version": 99}))
    wrong = _cli(str(bad), "--out", str(tmp_path / "o"))
    assert wrong.returncode == 2 and "version 99 is not supported" in wrong.stderr
    preset = _cli(str(bad), "--cluster", "tpu", "--out", str(tmp_path / "o"))
    assert preset.returncode == 2 and "error:" in preset.stderr
    assert "Traceback" not in missing.stderr + wrong.stderr + preset.stderr


def test_cli_sensitivity_reports_how_the_longest_sequence_moves(tmp_path):
    path, out = _small_workload(tmp_path), tmp_path / "out"
    proc = _cli(str(path), "--out", str(out), "--no-plots", "--sensitivity", "--params", "8.03e9",
                "--zero-stage", "3", "--memory-gib", "24")
    assert proc.returncode == 0, proc.stderr
    assert "nccl_bytes_per_communicator" in proc.stdout and "DeepSpeedZeroOptimizer_Stage3" in proc.stdout
    doc = json.loads((out / "sensitivity.json").read_text())
    rows = {r["name"]: r for r in doc["rows"]}
    assert rows["all"]["at_low"] >= rows["nominal"]["at_low"] >= rows["all"]["at_high"]
    assert {line["category"] for line in doc["ledger"]} >= {"parameters", "optimizer", "runtime", "allocator"}
    timing = {r["name"]: r for r in doc["timing_rows"]}  # the a100 preset's efficiency and latency constants
    assert "ampere.attention.flops" in proc.stdout and "nominal" in timing
    assert timing["ampere.matmul.flops"]["step_low_s"] > timing["ampere.matmul.flops"]["step_high_s"]
    missing = _cli(str(path), "--out", str(out), "--no-plots", "--sensitivity")
    assert missing.returncode == 2 and "--params" in missing.stderr


@pytest.mark.parametrize("configured", [True, False], ids=["ledger", "program"])
def test_cli_prints_writes_and_plots_one_peak_memory(tmp_path, capsys, configured):
    """Issue #50: the printed peak, result.json's and memory.png's are one figure. With a training configuration in
    the workload's metadata it is the memory ledger's peak, whose static memory differs from the workload's own
    (the engine's count stays in result.json as program_peak_memory_bytes); without one, the engine's count."""
    from PIL import Image

    from simulator.__main__ import main
    from simulator.ledger import TrainingConfig
    from simulator.max_length import ledger_peak, step_metadata

    shape = LlamaShape(layers=1, hidden=256, heads=8, kv_heads=8, ffn_hidden=512, vocab=1000)
    workload = llama_ulysses_workload(seq_len=4096, sp_degree=8, shape=shape, ops_per_layer=(20, 30))
    config = TrainingConfig.from_parameter_count(10**8, zero_stage=1, dp_world_size=8)
    if configured:
        workload = dataclasses.replace(workload, metadata={**workload.metadata, **step_metadata(
            model="m", system="s", seq_len=4096, layers=1, model_layers=1, config=config)})
    path, out = tmp_path / "workload.json", tmp_path / "out"
    workload.to_json(path)
    assert main([str(path), "--cluster", "h100-sxm", "--out", str(out)]) == 0
    printed = re.search(r"peak memory +(\d+\.\d\d) GiB", capsys.readouterr().out).group(1)
    result = json.loads((out / "result.json").read_text())
    trace = json.loads((out / "trace.json").read_text())["otherData"]
    plotted = re.search(r"peak (\d+\.\d\d)", Image.open(out / "memory.png").text["Title"]).group(1)
    assert printed == plotted == f"{result['peak_memory_bytes'] / 2**30:.2f}" == \
        f"{trace['peak_memory_bytes'] / 2**30:.2f}"
    assert result["fits"] and result["peak_memory_definition"] == ("ledger" if configured else "program")
    if configured:  # the bug: the engine's count (its own static memory) was in result.json and the plot
        assert result["peak_memory_bytes"] == ledger_peak(config, result["activation_peak_bytes"])
        assert f"{result['program_peak_memory_bytes'] / 2**30:.2f}" != printed
    else:
        assert result["peak_memory_bytes"] == result["program_peak_memory_bytes"]
