"""``python -m autosp.train`` under torchrun on CPU: it trains, logs, and its first loss is the single-device loss."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".torch_extensions"))
    return env


def _single_device_first_loss(seq_len: int) -> float:
    from autosp import train

    args = train.parse_args(["--model", "tiny-llama", "--seq-len", str(seq_len)])
    torch.manual_seed(args.seed)
    model = train.build_model(train.hf_config(args), torch.device("cpu"), torch.float32)
    ids = train.random_sample(0, 0, batch=1, seq_len=seq_len, vocab=model.config.vocab_size, seed=args.seed,
                              device=torch.device("cpu"))
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.item()


def test_train_torchrun_two_cpu_ranks_trains_and_reports(tmp_path):
    seq_len, steps = 64, 3
    summary_path = tmp_path / "summary.json"
    torchrun = os.path.join(sysconfig.get_path("scripts"), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "autosp.train", "--model", "tiny-llama",
           "--seq-len", str(seq_len), "--steps", str(steps), "--zero-stage", "2", "--compiler", "aot_eager",
           "--summary-json", str(summary_path)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    summary = json.loads(summary_path.read_text())
    assert printed == summary
    assert (summary["world_size"], summary["sp_size"], summary["dp_size"]) == (2, 2, 1)
    assert len(summary["losses"]) == steps and summary["tokens_per_step"] == seq_len
    assert summary["tokens_per_s"] > 0
    assert [m["rank"] for m in summary["per_rank_memory"]] == [0, 1]
    assert all(m["peak_rss_bytes"] > 0 for m in summary["per_rank_memory"])
    assert "step 3/3" in proc.stderr and "tokens/s" in proc.stderr  # progress is logged
    # The first step's loss (before any update) is the single-device loss of the same sample.
    assert summary["losses"][0] == pytest.approx(_single_device_first_loss(seq_len), rel=1e-5)


def test_train_unsupported_zero_stage_exits_with_the_reason():
    cmd = [sys.executable, "-m", "autosp.train", "--model", "tiny-llama", "--seq-len", "16", "--steps", "2",
           "--zero-stage", "3", "--compiler", "aot_eager"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "ZeRO stage 3 does not compose" in proc.stderr
