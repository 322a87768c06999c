"""``alst`` (DeepSpeed's ALST components as ArcticTraining configures them) against a single-device reference.

One launch of 2 gloo ranks runs both Hugging Face models (Llama: 8 query and 2 key-value heads; Qwen2: 4 and 2).
On each, the ALST system must give the single-device loss and every gradient of a full-sequence step (fp32:
rtol 1e-4, atol 1e-6), also after ``zero_grad`` and a second step.  The sample is long enough that every piece
does its work: the tiled MLP runs 2 shards (81 local tokens over a hidden size of 64), the tiled logits+loss 11
shards (the shard size is set small), the first ones holding only ignored targets on rank 0 (ArcticTraining's
fake-loss branch) and the last one token (workaround 7), and the checkpoint offload moves a layer input to the
host pool.  The same system as
released (``as_released=True``: without workarounds 1 and 2 of experiments/baselines/alst.py) pins DeepSpeed's
two faults: every gradient twice the reference's (ZeRO-0's average over 2 SP ranks), but the lm_head weight's,
which is the reference's times the number of valid targets (never divided by the token count).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from experiments.baselines import System, build_system
from tests.harness import run_on_ranks

FP32_TOL = {"rtol": 1e-4, "atol": 1e-6}
SEQ_LEN = 162
"""81 tokens a rank: more than the hidden size (64), so the tiled MLP runs 2 shards."""
LOGITS_SHARD_BYTES = 8192
"""81 tokens x 256 vocabulary x 4 bytes of fp32 logits a rank: 11 shards of the tiled logits+loss, which
``torch.chunk`` cuts into ten of 8 tokens and one of 1."""
MODELS = ("hf-llama", "hf-qwen2")


def _sample(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sample (ALST trains one a step): a long ignored prefix (rank 0's first loss shard holds only ignored
    targets) and ignored targets spread over the rest."""
    g = torch.Generator().manual_seed(100)
    ids = torch.randint(0, vocab, (1, SEQ_LEN), generator=g)
    labels = ids.clone()
    labels[0, : SEQ_LEN // 3] = -100
    labels[0, torch.rand(SEQ_LEN, generator=g) < 0.2] = -100
    return ids, labels


def _run(rank: int, world: int) -> dict:
    from experiments.cpu.peak_memory import PeakMemory
    from experiments.models import build_model, vocab_size

    os.environ["LOCAL_RANK"] = str(rank)  # what a launcher sets; deepspeed.initialize requires it
    out = {}
    for model_name in MODELS:
        torch.manual_seed(0)
        model = build_model(model_name)
        ids, labels = _sample(vocab_size(model))
        reference = copy.deepcopy(model)
        ref_loss = reference(input_ids=ids, labels=labels).loss
        ref_loss.backward()
        result = {"ref_loss": ref_loss.detach(), "valid_targets": int((labels[:, 1:] != -100).sum()),
                  "ref_grads": {n: p.grad.clone() for n, p in reference.named_parameters()}}
        for as_released in (False, True):
            system = build_system("alst", copy.deepcopy(model), sp_size=world, logits_shard_bytes=LOGITS_SHARD_BYTES,
                                  as_released=as_released)
            assert isinstance(system, System) and system.name == "alst"
            steps = []
            for _ in range(1 if as_released else 2):  # the second step checks zero_grad
                system.zero_grad()
                with PeakMemory() as pm:
                    loss = system.step(ids, labels)
                steps.append({"loss": loss, "grads": system.gradients(), "host_peak_bytes": pm.host_peak_bytes,
                              "offloaded": system._offload.stats.offloaded_tensors})
            result["released" if as_released else "exact"] = steps
        out[model_name] = result
    return out


def test_alst_matches_single_device_on_hugging_face_llama_and_qwen2_and_pins_the_peers_faults():
    per_rank = run_on_ranks(_run, 2, timeout_s=300)
    for rank, out in enumerate(per_rank):
        for model_name in MODELS:
            r = out[model_name]
            ref_grads = r["ref_grads"]
            for step, s in enumerate(r["exact"]):
                where = f"rank {rank} {model_name} step {step}"
                assert s["loss"].dim() == 0 and not s["loss"].requires_grad
                torch.testing.assert_close(s["loss"], r["ref_loss"], **FP32_TOL, msg=lambda m, w=where: f"{w}: {m}")
                assert s["grads"].keys() == ref_grads.keys(), where
                for name, grad in s["grads"].items():
                    torch.testing.assert_close(grad, ref_grads[name], **FP32_TOL,
                                               msg=lambda m, w=f"{where} grad {name}": f"{w}: {m}")
                # the checkpoint offload ran: layer 0's input (the last layer's stays) went to the host pool
                assert s["offloaded"] >= 1 and s["host_peak_bytes"] > 0, (where, s["offloaded"], s["host_peak_bytes"])
            (released,) = r["released"]
            torch.testing.assert_close(released["loss"], r["ref_loss"], **FP32_TOL)  # the loss is right
            for name, grad in released["grads"].items():
                factor = r["valid_targets"] if name == "lm_head.weight" else 2  # the two faults
                torch.testing.assert_close(grad, factor * ref_grads[name], **FP32_TOL,
                                           msg=lambda m, w=f"rank {rank} {model_name} as released {name}": f"{w}: {m}")


def test_bench_alst_refuses_at_parse_time_the_models_alst_cannot_run(capsys):
    """``python -m experiments.cpu.bench_alst --models`` takes only what ALST runs, decided from the model's
    structure (`experiments.baselines.alst.unsupported_reason`, the check `ALSTSystem` makes): GPT-2 (no decoder
    ``.model``, no gate/up/down MLP) and the plain Llama (no Hugging Face model) are refused in one line naming the
    model and why, before any work; the Hugging Face Llama, and every default model, are accepted."""
    from experiments.baselines.alst import unsupported_reason
    from experiments.cpu.bench_alst import DEFAULTS, build_parser
    from experiments.models import build_model

    parser = build_parser()
    for name, why in (("hf-gpt2", "GPT2LMHeadModel has no decoder .model"),
                      ("plain-llama", "PlainLlama is no Hugging Face model")):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(["--models", "hf-llama", name])
        assert exc.value.code == 2
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"argument --models: {name} cannot run under alst: {why}" in error, error
        assert "gate/up/down MLP" in error
        assert unsupported_reason(name) == unsupported_reason(build_model(name, layers=1))
    assert parser.parse_args(["--models", "hf-llama"]).models == ["hf-llama"]
    assert unsupported_reason("hf-llama") is None
    assert parser.parse_args([]).models == list(DEFAULTS["cap_models"])
    assert all(unsupported_reason(name) is None for name in DEFAULTS["cap_models"])
