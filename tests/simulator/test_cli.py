"""``python -m simulator``: a subprocess smoke test and its error messages."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from simulator.synthetic import LlamaShape, llama_ulysses_workload

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, "-m", "simulator", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, check=False, timeout=120)


def test_cli_help_explains_the_outputs():
    proc = _cli("--help")
    assert proc.returncode == 0
    for word in ("--cluster", "--nodes", "--out", "result.json", "trace.json", "timeline.png"):
        assert word in proc.stdout


def test_cli_simulates_a_workload_and_writes_every_output(tmp_path):
    shape = LlamaShape(layers=2, hidden=512, heads=8, kv_heads=8, ffn_hidden=1024, vocab=1000)
    workload = llama_ulysses_workload(seq_len=8192, sp_degree=8, shape=shape, ops_per_layer=(60, 100))
    path = tmp_path / "workload.json"
    workload.to_json(path)
    out = tmp_path / "out"
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
    shape = LlamaShape(layers=2, hidden=512, heads=8, kv_heads=8, ffn_hidden=1024, vocab=1000)
    workload = llama_ulysses_workload(seq_len=8192, sp_degree=8, shape=shape, ops_per_layer=(60, 100))
    path = tmp_path / "workload.json"
    workload.to_json(path)
    out = tmp_path / "out"
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
