"""GPU smoke test for AutoSP (not run in CI): ``python scripts/gpu_smoke.py`` on a CUDA machine, < 5 minutes.

Checks, on two ranks:
1. the CUDA path compiles: a Hugging Face Llama (bf16, 4 layers) compiled by AutoSP with
   inductor, sp_size=2, trains one step whose loss and gradients match single-device
   training (bf16 tolerance);
2. the attention AutoSP leaves in the aten graphs is a fused GPU kernel
   (``aten._scaled_dot_product_flash_attention`` / ``_efficient_attention`` /
   ``_cudnn_attention``, forward and backward), not a matmul + softmax decomposition;
3. NCCL: with two or more GPUs the ranks talk over NCCL (one GPU each); with one GPU
   both ranks share it over gloo (NCCL refuses two ranks on one GPU) and NCCL is
   checked separately with a one-rank all-reduce.

Exits 0 when every check passes, 1 with a message otherwise (also when there is no GPU).
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

log = logging.getLogger("gpu_smoke")

FUSED_ATTENTION = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                   "_scaled_dot_product_cudnn_attention", "_efficient_attention", "_flash_attention")
GRAD_REL_TOL = 5e-2  # bf16: relative error of each gradient (norm-wise)
LOSS_REL_TOL = 2e-2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build_model(seq_len: int):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=max(seq_len, 4096), attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config).train()


def _attention_ops(report) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {"forward": [], "backward": []}
    for kind, gm in report.aot_graphs:
        for node in gm.graph.nodes:
            name = str(node.target)
            if node.op == "call_function" and any(k in name for k in FUSED_ATTENTION) and "_for_cpu" not in name:
                found.setdefault(kind, []).append(name)
    return found


def _rank_main(rank: int, world: int, backend: str, port: int, seq_len: int, results) -> None:
    import autosp

    gpus = torch.cuda.device_count()
    device = torch.device("cuda", rank % gpus)
    torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        torch.manual_seed(0)
        with device:
            reference = _build_model(seq_len).to(torch.bfloat16)
        candidate = copy.deepcopy(reference)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, reference.config.vocab_size, (1, seq_len), generator=g).to(device)

        ref_loss = reference(input_ids=ids, labels=ids).loss
        ref_loss.backward()

        compiled = autosp.compile(candidate, sp_size=world, compiler="inductor")
        start = time.perf_counter()
        loss = compiled(**autosp.prepare_inputs(ids, labels=ids)).loss
        loss.backward()
        autosp.sync_gradients(compiled)
        torch.cuda.synchronize(device)
        first_step_s = time.perf_counter() - start

        worst_name, worst = "", 0.0
        for (name, p), q in zip(candidate.named_parameters(), reference.parameters(), strict=True):
            rel = float((p.grad.float() - q.grad.float()).norm() / q.grad.float().norm().clamp_min(1e-12))
            if rel > worst:
                worst_name, worst = name, rel

        candidate.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        steps = 3
        for _ in range(steps):
            compiled(**autosp.prepare_inputs(ids, labels=ids)).loss.backward()
            autosp.sync_gradients(compiled)
        torch.cuda.synchronize(device)
        results.put({
            "rank": rank, "device": torch.cuda.get_device_name(device), "backend": backend,
            "loss": float(loss), "ref_loss": float(ref_loss), "worst_grad": (worst_name, worst),
            "attention": _attention_ops(compiled.report), "first_step_s": first_step_s,
            "step_s": (time.perf_counter() - start) / steps,
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        })
    finally:
        dist.destroy_process_group()


def _nccl_one_rank() -> str | None:
    """A one-rank NCCL group and an all-reduce: None if it works, else the error."""
    try:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        x = torch.ones(4, device="cuda")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        return None if bool((x == 1).all()) else f"all_reduce gave {x.tolist()}"
    except Exception as err:  # noqa: BLE001 - reported as a failed check
        return f"{type(err).__name__}: {err}"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python scripts/gpu_smoke.py",
        description="GPU smoke test for AutoSP (not run in CI), under 5 minutes on a CUDA machine: two ranks, "
                    "inductor, bf16 loss and gradients against single-device training, fused attention kernels "
                    "in the aten graphs, NCCL. Exits 0 when every check passes, 1 with a message otherwise "
                    "(also when there is no GPU).")
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens of the sample (default: %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        sys.exit("gpu_smoke: no CUDA GPU visible (torch.cuda.is_available() is False); run this on a GPU machine "
                 "with a CUDA build of torch")
    gpus = torch.cuda.device_count()
    backend = "nccl" if gpus >= 2 else "gloo"
    log.info("%d GPU(s): %s; two ranks over %s, seq_len %d", gpus, torch.cuda.get_device_name(0), backend,
             args.seq_len)

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_rank_main, args=(2, backend, _free_port(), args.seq_len, results), nprocs=2,
                       join=True, start_method="spawn")
    by_rank = sorted((results.get() for _ in range(2)), key=lambda r: r["rank"])

    failures = []
    for r in by_rank:
        log.info("rank %d on %s: loss %.5f (single device %.5f), worst gradient %s rel err %.3g, attention %s, "
                 "first step %.1f s, then %.3f s/step, peak %.2f GiB", r["rank"], r["device"], r["loss"],
                 r["ref_loss"], *r["worst_grad"], r["attention"], r["first_step_s"], r["step_s"], r["peak_gib"])
        if abs(r["loss"] - r["ref_loss"]) > LOSS_REL_TOL * abs(r["ref_loss"]):
            failures.append(f"rank {r['rank']}: loss {r['loss']} != single-device {r['ref_loss']}")
        if r["worst_grad"][1] > GRAD_REL_TOL:
            failures.append(f"rank {r['rank']}: gradient of {r['worst_grad'][0]} off by {r['worst_grad'][1]:.3g}")
        for kind in ("forward", "backward"):
            if not r["attention"].get(kind):
                failures.append(f"rank {r['rank']}: no fused attention kernel in the {kind} aten graph "
                                "(SDPA fell back to matmul + softmax)")
    if backend == "gloo":
        nccl_error = _nccl_one_rank()
        log.info("NCCL one-rank all-reduce: %s", nccl_error or "ok")
        if nccl_error:
            failures.append(f"NCCL: {nccl_error}")
    if failures:
        sys.exit("gpu_smoke FAILED:\n  " + "\n  ".join(failures))
    log.info("gpu_smoke passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
