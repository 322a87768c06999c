"""``python -m autosp.train``: train a causal LM on random tokens with AutoSP + DeepSpeed ZeRO.

Runs under ``torchrun`` or the ``deepspeed`` launcher (or plainly, as one rank):
NCCL on GPUs, gloo on CPU.  The model is a Hugging Face model built from a config
(a preset below or a ``config.json`` path) with random weights; nothing is
downloaded.  Every rank of an SP group trains the same random sample; data-parallel
replicas train different ones.  Logs progress, tokens/s and per-rank peak memory,
and prints a one-line JSON summary on rank 0 at the end.

    torchrun --nproc-per-node 2 -m autosp.train --model tiny-llama --seq-len 256 --compiler aot_eager
    deepspeed --num_nodes 2 --num_gpus 8 --hostfile hosts --module autosp.train \\
        --model llama-3.1-8b --seq-len 65536 --sp-size 8 --zero-stage 2
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import socket
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import autosp
from autosp.errors import AutoSPError

log = logging.getLogger("autosp.train")


@dataclass(frozen=True)
class LlamaSize:
    """Architecture numbers of a Llama model (public Hugging Face model cards)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tie_embeddings: bool = False
    rope_theta: float = 500000.0


PRESETS: dict[str, LlamaSize] = {
    "tiny-llama": LlamaSize(hidden=64, intermediate=128, layers=2, heads=8, kv_heads=2, vocab=256),
    "llama-3.2-1b": LlamaSize(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, vocab=128256,
                              tie_embeddings=True),
    "llama-3.2-3b": LlamaSize(hidden=3072, intermediate=8192, layers=28, heads=24, kv_heads=8, vocab=128256,
                              tie_embeddings=True),
    "llama-3.1-8b": LlamaSize(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128256),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m autosp.train", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a causal LM on random tokens with AutoSP (sequence parallelism) and DeepSpeed ZeRO 0-2.\n"
                    "Run it under torchrun or the deepspeed launcher (or plainly, as one rank): NCCL on GPUs, gloo on\n"
                    "CPU. The model is a Hugging Face model built from a preset or a config.json with random weights\n"
                    "(nothing is downloaded). Logs progress, tokens/s and per-rank peak memory; rank 0 prints a JSON\n"
                    "summary at the end.",
        epilog="examples:\n"
               "  # one CPU machine, 2 ranks (SP 2)\n"
               "  torchrun --standalone --nproc-per-node 2 -m autosp.train \\\n"
               "      --model tiny-llama --seq-len 256 --steps 5 --zero-stage 1 --compiler aot_eager\n"
               "  # one GPU node, 8 GPUs: SP 4 x DP 2\n"
               "  torchrun --standalone --nproc-per-node 8 -m autosp.train \\\n"
               "      --model llama-3.1-8b --seq-len 32768 --sp-size 4 --zero-stage 2 --steps 20\n"
               "  # several nodes: the deepspeed launcher with a hostfile (\"node-a slots=8\" per line)\n"
               "  deepspeed --hostfile hostfile --module autosp.train \\\n"
               "      --model llama-3.1-8b --seq-len 131072 --sp-size 8 --zero-stage 2\n"
               "Keep an SP group inside a node (--sp-size at most the GPUs per node). On CPU set OMP_NUM_THREADS\n"
               "on a busy machine (torchrun sets 1).")
    p.add_argument("--model", default="tiny-llama",
                   help=f"a preset ({', '.join(PRESETS)}) or the path of a Hugging Face config.json (or its folder) "
                        "(default: %(default)s)")
    p.add_argument("--num-layers", type=int, help="override the number of decoder layers (default: the model's)")
    p.add_argument("--seq-len", type=int, default=1024,
                   help="tokens per sample, the full sequence before sharding (default: %(default)s)")
    p.add_argument("--sp-size", type=int,
                   help="ranks sharing one sequence; divides the world size, the rest is data parallelism "
                        "(default: all ranks)")
    p.add_argument("--zero-stage", type=int, default=0, help="DeepSpeed ZeRO stage: 0, 1 or 2 (default: %(default)s)")
    p.add_argument("--steps", type=int, default=10, help="training steps (default: %(default)s)")
    p.add_argument("--warmup-steps", type=int, default=1,
                   help="first steps (compilation) left out of tokens/s (default: %(default)s)")
    p.add_argument("--micro-batch-size", type=int, default=1,
                   help="samples per SP group per step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate, unless the DeepSpeed config names an optimizer (default: %(default)s)")
    p.add_argument("--compiler", choices=("inductor", "aot_eager"), default="inductor",
                   help="torch.compile backend AutoSP hands its graphs to (default: %(default)s)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), help="parameter and compute dtype (default: bf16 on GPUs, "
                                                             "fp32 on CPU)")
    p.add_argument("--deepspeed-config", metavar="JSON",
                   help="a DeepSpeed config file merged over the one built from these flags")
    p.add_argument("--summary-json", metavar="PATH", help="also write rank 0's JSON summary to this file")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the random tokens (default: %(default)s)")
    p.add_argument("--log-interval", type=int, default=1, help="log every N steps (default: %(default)s)")
    # The deepspeed launcher passes --local_rank (LOCAL_RANK in the environment says the same).
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps <= args.warmup_steps:
        p.error(f"--steps ({args.steps}) must exceed --warmup-steps ({args.warmup_steps}) to measure tokens/s")
    return args


def init_distributed() -> torch.device:
    """Join the launcher's process group (NCCL on GPUs, gloo on CPU); one rank if there is no launcher."""
    cuda = torch.cuda.is_available()
    if "WORLD_SIZE" not in os.environ:  # plain `python -m autosp.train`: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    elif "OMP_NUM_THREADS" not in os.environ:
        # The deepspeed launcher (unlike torchrun) leaves every CPU rank all cores' threads:
        # oversubscribed, spinning OpenMP threads make steps ~50x slower.  Share the cores.
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or os.environ["WORLD_SIZE"])
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local))
    dist.init_process_group("nccl" if cuda else "gloo")
    return torch.device("cuda", local_rank) if cuda else torch.device("cpu")


def hf_config(args: argparse.Namespace):
    import transformers

    if args.model in PRESETS:
        s = PRESETS[args.model]
        config = transformers.LlamaConfig(
            vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate, num_hidden_layers=s.layers,
            num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, tie_word_embeddings=s.tie_embeddings,
            rope_theta=s.rope_theta, max_position_embeddings=max(args.seq_len, 8192),
        )
    else:
        path = os.path.join(args.model, "config.json") if os.path.isdir(args.model) else args.model
        if not os.path.isfile(path):
            raise AutoSPError(f"--model {args.model!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json")
        with open(path) as f:
            fields = json.load(f)
        config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
        config.max_position_embeddings = max(getattr(config, "max_position_embeddings", 0) or 0, args.seq_len)
    if args.num_layers:
        config.num_hidden_layers = args.num_layers
    config._attn_implementation = "sdpa"  # AutoSP rewrites scaled_dot_product_attention
    return config


def build_model(config, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    import transformers

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = transformers.AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    return model.train()


def ds_config(args: argparse.Namespace, sp_size: int, dtype: torch.dtype) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "sequence_parallel_size": sp_size,
        "zero_optimization": {"stage": args.zero_stage},
        "compile": {"deepcompile": True, "passes": ["autosp"]},
        "autosp": {"compiler": args.compiler},
        "gradient_clipping": 1.0,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "steps_per_print": 10**9,
    }
    if args.deepspeed_config:
        with open(args.deepspeed_config) as f:
            config.update(json.load(f))
    return config


def random_sample(step: int, dp_rank: int, *, batch: int, seq_len: int, vocab: int, seed: int,
                  device: torch.device) -> torch.Tensor:
    """Random token ids, identical on every rank of one SP group (seeded by step and replica)."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 10_007 + dp_rank)
    return torch.randint(0, vocab, (batch, seq_len), generator=g).to(device)


def peak_memory(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"peak_allocated_bytes": torch.cuda.max_memory_allocated(device)}
    return {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux: KiB


def train(args: argparse.Namespace) -> dict | None:
    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    sp_size = args.sp_size or world
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    torch.manual_seed(args.seed)
    config = hf_config(args)
    model = build_model(config, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    config_dict = ds_config(args, sp_size, dtype)
    # A torch optimizer unless --deepspeed-config names one (refused on CPU if it would JIT-build ops).
    optimizer = None if "optimizer" in config_dict else torch.optim.AdamW(model.parameters(), lr=args.lr)
    engine, *_ = autosp.deepspeed_initialize(model=model, optimizer=optimizer, config=config_dict)
    groups = engine.module.groups
    log.info("model %s: %.3g B parameters, %d layers; world %d = SP %d x DP %d; seq %d; ZeRO %d; %s; %s on %s",
             args.model, n_params / 1e9, config.num_hidden_layers, world, groups.sp_size, groups.dp_size,
             args.seq_len, args.zero_stage, args.compiler, str(dtype).removeprefix("torch."), device.type)

    tokens_per_step = groups.dp_size * args.micro_batch_size * args.seq_len  # each sequence counted once
    measured_s, losses = 0.0, []
    for step in range(args.steps):
        ids = random_sample(step, groups.dp_rank, batch=args.micro_batch_size, seq_len=args.seq_len,
                            vocab=config.vocab_size, seed=args.seed, device=device)
        start = time.perf_counter()
        loss = engine(**autosp.prepare_inputs(ids, labels=ids)).loss
        engine.backward(loss)
        engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_s = time.perf_counter() - start
        if step >= args.warmup_steps:
            measured_s += step_s
        losses.append(loss.detach().item())
        if step % args.log_interval == 0 or step == args.steps - 1:
            log.info("step %d/%d  loss %.4f  %.2f s  %.1f tokens/s", step + 1, args.steps, losses[-1], step_s,
                     tokens_per_step / step_s)

    per_rank = [None] * world
    dist.all_gather_object(per_rank, {"rank": rank, **peak_memory(device)})
    measured_steps = args.steps - args.warmup_steps
    summary = {
        "model": args.model, "parameters": n_params, "layers": config.num_hidden_layers, "world_size": world,
        "sp_size": groups.sp_size, "dp_size": groups.dp_size, "seq_len": args.seq_len,
        "micro_batch_size": args.micro_batch_size, "zero_stage": args.zero_stage, "compiler": args.compiler,
        "dtype": str(dtype).removeprefix("torch."), "device": device.type, "steps": args.steps,
        "losses": losses, "tokens_per_step": tokens_per_step,
        "step_time_s": measured_s / measured_steps, "tokens_per_s": tokens_per_step * measured_steps / measured_s,
        "per_rank_memory": per_rank,
    }
    for entry in per_rank:
        log.info("rank %d peak memory %s", entry["rank"],
                 ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in entry.items() if k != "rank"))
    log.info("%.1f tokens/s (%.3f s per step over %d steps after %d warm-up)", summary["tokens_per_s"],
             summary["step_time_s"], measured_steps, args.warmup_steps)
    return summary if rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO if rank == "0" else logging.WARNING,
                        format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s")
    try:
        summary = train(args)
        if dist.is_initialized():
            # Every rank has finished communicating before any tears its process group down:
            # a gloo peer destroyed while another still talks to it can abort that process.
            dist.barrier()
    except AutoSPError as err:
        log.error("%s", err)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if summary is not None:
        # The command's result (not a diagnostic, which goes to logging): one JSON line on stdout.
        sys.stdout.write(json.dumps(summary) + "\n")
        sys.stdout.flush()
        if args.summary_json:
            with open(args.summary_json, "w") as f:
                json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
