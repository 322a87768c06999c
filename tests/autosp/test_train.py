"""``python -m autosp.train`` under torchrun on CPU: it trains, logs, and its first loss is the single-device loss."""

from __future__ import annotations

import json
import os
import re
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
    from autosp import presets, train

    args = train.parse_args(["--model", "tiny-llama", "--seq-len", str(seq_len)])
    torch.manual_seed(args.seed)
    model = presets.build_model(presets.hf_config(args.model, seq_len=args.seq_len), torch.device("cpu"),
                                 torch.float32)
    ids = train.random_sample(0, 0, batch=1, seq_len=seq_len, vocab=model.config.vocab_size, seed=args.seed,
                              device=torch.device("cpu"))
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.item()


def test_train_torchrun_two_cpu_ranks_trains_and_reports(tmp_path):
    """Under ZeRO 3 (AutoSP's parameter shards under DeepSpeed's engine); ZeRO 2 in the test of strategy auto."""
    seq_len, steps = 64, 3
    summary_path = tmp_path / "summary.json"
    torchrun = os.path.join(sysconfig.get_path("scripts"), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "autosp.train", "--model", "tiny-llama",
           "--seq-len", str(seq_len), "--steps", str(steps), "--zero-stage", "3", "--compiler", "aot_eager",
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


def test_train_strategy_auto_decides_with_planners_started_before_the_model_and_trains_exactly(tmp_path):
    """``--strategy auto``: every rank starts its planner process before it builds the model, the SP-2 candidates
    (Ulysses and the ring) are predicted one per rank, the choice is compiled, and the first loss is still the
    single-device loss."""
    seq_len = 64
    torchrun = os.path.join(sysconfig.get_path("scripts"), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "autosp.train", "--model", "tiny-llama",
           "--seq-len", str(seq_len), "--steps", "2", "--compiler", "aot_eager", "--strategy", "auto",
           "--zero-stage", "2"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    decision = summary["strategy_decision"]
    rows = {c["system"]: c for c in decision["candidates"]}
    assert set(rows) == {"autosp", "autosp-ring"} and {c["rank"] for c in rows.values()} == {0, 1}
    fastest = min((c for c in rows.values() if c["fits"]), key=lambda c: c["step_time_s"])
    assert decision["chosen"] == fastest["system"] and summary["strategy"] == fastest["strategy"]
    assert all(ahead > 0 for ahead in decision["planner_started_before_s_by_rank"])
    # The planner priced the job the DeepSpeed config describes (autosp.train builds it; AdamW on the ranks).
    assert {k: decision["setup"][k] for k in ("seq_len", "zero_stage", "micro_batch", "grad_accum", "offload",
                                              "optimizer")} == {"seq_len": seq_len, "zero_stage": 2, "micro_batch": 1,
                                                                "grad_accum": 1, "offload": "none", "optimizer": "adamw"}
    assert f"chosen by strategy='auto' as {decision['chosen']}" in proc.stderr
    assert summary["losses"][0] == pytest.approx(_single_device_first_loss(seq_len), rel=1e-5)


def test_train_unsupported_zero_stage_exits_with_the_reason():
    cmd = [sys.executable, "-m", "autosp.train", "--model", "tiny-llama", "--seq-len", "16", "--steps", "2",
           "--zero-stage", "4", "--compiler", "aot_eager"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "ZeRO stage 4 does not exist; use 0, 1, 2 or 3" in proc.stderr


def _torchrun_lines(output: str) -> tuple[list[str], list[str]]:
    """``output`` split into what torchrun printed itself (its log lines, and its own traceback and failure
    report, which end its output) and the rest, what the ranks printed."""
    lines = output.splitlines()
    end = next((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")
                and i + 1 < len(lines) and "torchrun" in lines[i + 1]), len(lines))
    launcher = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ .*torch/distributed/")
    ranks = [line for line in lines[:end] if not launcher.match(line)]
    return [line for line in lines if line not in ranks], ranks


def test_train_refusal_under_torchrun_is_one_line(tmp_path):
    """A refusal (here an option AutoSP refuses before any compile) on both ranks: the ranks print one line,
    rank 0's, and no traceback (rank 0's INFO progress aside); the rest is torchrun's own failure report, which a rank exiting non-zero cannot
    shorten (Note [One line per refusal] in autosp/entry.py)."""
    torchrun = os.path.join(sysconfig.get_path("scripts"), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "autosp.train", "--model", "tiny-llama",
           "--seq-len", "16", "--steps", "2", "--compiler", "aot_eager", "--strategy", "hybrid"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    launcher, ranks = _torchrun_lines(proc.stdout + proc.stderr)
    ranks = [line for line in ranks if " rank 0 INFO autosp." not in line]  # progress (a first run's build)
    assert ranks == ["autosp: error: strategy='hybrid' needs its Ulysses degree: pass ulysses_size= a divisor of "
                     "sp_size=2 (the ring then runs over sp_size // ulysses_size groups)"], proc.stderr[-5000:]
    assert "ChildFailedError" in proc.stderr and len(launcher) <= 45, launcher


def test_train_deepspeed_config_merges_deeply_and_typed_flags_win(tmp_path, caplog):
    from autosp import train

    extra = tmp_path / "extra.json"
    extra.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": 1000},
                                 "autosp": {"compiler": "aot_eager"}, "gradient_clipping": 0.5,
                                 "train_micro_batch_size_per_gpu": 2, "wall_clock_breakdown": True}))
    base = ["--model", "tiny-llama", "--deepspeed-config", str(extra)]
    # Flags left at their defaults: the file's values win, its other keys are kept beside the generated ones.
    with caplog.at_level("INFO", logger="autosp.train"):
        config = train.ds_config(train.parse_args(base), 2, torch.float32)
    assert config["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 1000}
    assert config["autosp"] == {"compiler": "aot_eager", "strategy": "ulysses"} and config["gradient_clipping"] == 0.5
    assert config["train_micro_batch_size_per_gpu"] == 2 and config["wall_clock_breakdown"] is True
    assert config["compile"] == {"deepcompile": True, "passes": ["autosp"]}  # generated, not in the file
    assert config["sequence_parallel_size"] == 2 and config["bf16"] == {"enabled": False}
    log = caplog.text
    assert "zero_optimization.stage: 2 in" in log and "the default of --zero-stage" in log
    assert "autosp.compiler: 'aot_eager' in" in log and "gradient_clipping: 0.5 in" in log and "built in" in log
    # Typed flags win over the file, and the log says so; the rest of the file's sections still merge.
    caplog.clear()
    with caplog.at_level("INFO", logger="autosp.train"):
        config = train.ds_config(train.parse_args([*base, "--zero-stage", "1", "--compiler", "inductor",
                                                   "--micro-batch-size", "1"]), 2, torch.float32)
    assert config["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 1000}
    assert config["autosp"] == {"compiler": "inductor", "strategy": "ulysses"}
    assert config["train_micro_batch_size_per_gpu"] == 1
    assert "--zero-stage on the command line (1) wins over 2" in caplog.text
    assert "--compiler on the command line ('inductor') wins over 'aot_eager'" in caplog.text
    # The same value in both is no conflict; a section replacing a scalar (or the reverse) is the file's.
    assert train.merge_config({"a": {"b": 1}, "c": 1}, {"a": {"b": 1}, "c": {"d": 2}}) == {"a": {"b": 1},
                                                                                          "c": {"d": 2}}
