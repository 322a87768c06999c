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

import torch
import torch.distributed as dist

import autosp
from autosp import entry
from autosp.errors import AutoSPError
from autosp.presets import build_model, hf_config

log = logging.getLogger("autosp.train")


FLAG_DEFAULTS = {"zero_stage": 0, "micro_batch_size": 1, "compiler": "inductor", "strategy": "ulysses"}
"""Defaults of the flags a ``--deepspeed-config`` file can also set: an explicit flag wins over the file, the
file wins over these defaults (`merge_config` logs each conflict)."""


def _json_file(value: str) -> str:
    if not os.path.isfile(value):
        raise argparse.ArgumentTypeError(f"{value!r}: no such file")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = entry.ArgumentParser(
        prog="python -m autosp.train", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a causal LM on random tokens with AutoSP (sequence parallelism) and DeepSpeed ZeRO 0-3.\n"
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
               "on a busy machine (torchrun sets 1).\n"
               "--deepspeed-config FILE is merged deeply over the config these flags build: a flag given on the\n"
               "command line wins over the file, the file wins over a flag's default; each conflict is logged and\n"
               "the summary shows the values that were used.")
    entry.add_model_arguments(p)
    p.add_argument("--seq-len", type=int, default=1024,
                   help="tokens per sample, the full sequence before sharding (default: %(default)s)")
    p.add_argument("--zero-stage", type=int, metavar="{0,1,2,3}",
                   help="DeepSpeed ZeRO stage: 0, 1, 2, or 3 (AutoSP's parameter shards, gathered layer by layer inside "
                        "the compiled step, under DeepSpeed's engine) "
                        f"(default: {FLAG_DEFAULTS['zero_stage']})")
    p.add_argument("--steps", type=int, default=10, help="training steps (default: %(default)s)")
    p.add_argument("--warmup-steps", type=int, default=1,
                   help="first steps (compilation) left out of tokens/s (default: %(default)s)")
    p.add_argument("--micro-batch-size", type=int,
                   help=f"samples per SP group per step (default: {FLAG_DEFAULTS['micro_batch_size']})")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate, unless the DeepSpeed config names an optimizer (default: %(default)s)")
    p.add_argument("--compiler", choices=("inductor", "aot_eager"),
                   help=f"torch.compile backend AutoSP hands its graphs to (default: {FLAG_DEFAULTS['compiler']})")
    entry.add_sp_arguments(
        p, strategy_help="how a sequence is split over its SP ranks: ulysses (attention heads), ring (zig-zag ring "
                         "attention), hybrid (Ulysses inside groups of --ulysses-size ranks, ring across them) or auto "
                         "(the planner simulates each on this job's model and length and the fastest that fits is "
                         "compiled; its process starts before the model is built) (default: "
                         f"{FLAG_DEFAULTS['strategy']})")
    p.add_argument("--deepspeed-config", metavar="JSON", type=_json_file,
                   help="a DeepSpeed config file merged deeply over the one built from these flags (see below)")
    p.add_argument("--summary-json", metavar="PATH", help="also write rank 0's JSON summary to this file")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the random tokens (default: %(default)s)")
    p.add_argument("--log-interval", type=int, default=1, help="log every N steps (default: %(default)s)")
    entry.add_launcher_arguments(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.steps <= args.warmup_steps:
        p.error(f"--steps ({args.steps}) must exceed --warmup-steps ({args.warmup_steps}) to measure tokens/s")
    entry.require_at_least(p, args, ("seq_len", "steps", "log_interval", "sp_size", "micro_batch_size", "num_layers",
                                     "ulysses_size"), 1)
    if args.zero_stage is not None and args.zero_stage not in (0, 1, 2, 3):
        p.error(f"--zero-stage {args.zero_stage}: ZeRO stage {args.zero_stage} does not exist; use 0, 1, 2 or 3")
    # Which of FLAG_DEFAULTS were typed (they win over --deepspeed-config); the rest take their defaults.
    args.explicit = {name for name in (*FLAG_DEFAULTS, "dtype", "sp_size", "ulysses_size")
                     if getattr(args, name) is not None}
    for name, default in FLAG_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
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


CONFIG_FLAGS = {
    ("train_micro_batch_size_per_gpu",): "micro_batch_size",
    ("sequence_parallel_size",): "sp_size",
    ("zero_optimization", "stage"): "zero_stage",
    ("autosp", "compiler"): "compiler",
    ("autosp", "strategy"): "strategy",
    ("autosp", "ulysses_size"): "ulysses_size",
    ("bf16", "enabled"): "dtype",
}
"""The entries of the generated DeepSpeed config that come from a flag (key path -> argparse dest)."""


def merge_config(base: dict, extra: dict, *, explicit: set[str] = frozenset(), source: str = "the file",
                 _path: tuple[str, ...] = ()) -> dict:
    """``extra`` (a ``--deepspeed-config`` file) merged deeply over ``base`` (the config built from the flags).

    Sections merge key by key at every depth; a value that is not a section (a number, a list) replaces the
    other whole.  On a conflict the file wins, except over an entry whose flag was typed on the command line
    (``explicit``: argparse dests, see `CONFIG_FLAGS`); each conflict is logged, naming the winner.
    """
    merged = dict(base)
    for key, value in extra.items():
        path = (*_path, key)
        if key not in base:
            merged[key] = value
        elif isinstance(base[key], dict) and isinstance(value, dict):
            merged[key] = merge_config(base[key], value, explicit=explicit, source=source, _path=path)
        elif base[key] != value:
            name, flag = ".".join(path), CONFIG_FLAGS.get(path)
            if flag in explicit:
                log.info("DeepSpeed config %s: --%s on the command line (%r) wins over %r in %s", name,
                         flag.replace("_", "-"), base[key], value, source)
            else:
                merged[key] = value
                log.info("DeepSpeed config %s: %r in %s wins over %r (%s)", name, value, source, base[key],
                         f"the default of --{flag.replace('_', '-')}" if flag else "built in")
    return merged


def ds_config(args: argparse.Namespace, sp_size: int, dtype: torch.dtype) -> dict:
    """The DeepSpeed config of this run: built from the flags, with ``--deepspeed-config`` merged over it."""
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "sequence_parallel_size": sp_size,
        "zero_optimization": {"stage": args.zero_stage},
        "compile": {"deepcompile": True, "passes": ["autosp"]},
        "autosp": {"compiler": args.compiler, "strategy": args.strategy,
                   **({} if args.ulysses_size is None else {"ulysses_size": args.ulysses_size})},
        "gradient_clipping": 1.0,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "steps_per_print": 10**9,
    }
    if args.deepspeed_config:
        with open(args.deepspeed_config) as f:
            extra = json.load(f)
        if not isinstance(extra, dict):
            raise AutoSPError(f"--deepspeed-config {args.deepspeed_config}: expected a JSON object (a DeepSpeed "
                              "config), got " + type(extra).__name__)
        config = merge_config(config, extra, explicit=getattr(args, "explicit", set()),
                              source=args.deepspeed_config)
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
    config_dict = ds_config(args, sp_size, dtype)
    # The values in effect (a --deepspeed-config entry may have replaced a flag's default).
    dtype = torch.bfloat16 if (config_dict.get("bf16") or {}).get("enabled") else torch.float32
    zero_stage = int((config_dict.get("zero_optimization") or {}).get("stage", 0))
    section = config_dict.setdefault("autosp", {})
    compiler = section.get("compiler", FLAG_DEFAULTS["compiler"])
    micro_batch = int(config_dict["train_micro_batch_size_per_gpu"])
    planner = None
    if section.get("strategy") == "auto":
        section.setdefault("plan_seq_len", args.seq_len)  # the planner prices the length this job trains at
        # Started before the model is built, so that the decision does not wait for its imports (Note [Planner
        # process started ahead] in autosp/plan/process.py); autosp.compile closes it once it has answered.
        planner = autosp.start_planner()
    torch.manual_seed(args.seed)
    config = hf_config(args.model, seq_len=args.seq_len, num_layers=args.num_layers)
    model = build_model(config, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    # A torch optimizer unless --deepspeed-config names one (refused on CPU if it would JIT-build ops).
    optimizer = None if "optimizer" in config_dict else torch.optim.AdamW(model.parameters(), lr=args.lr)
    entry.announce_deepspeed_comm_build(log)  # a first run's C++ builds, announced
    entry.announce_optimizer_build(config_dict, log)
    with entry.without_build_notices(log):
        engine, *_ = autosp.deepspeed_initialize(model=model, optimizer=optimizer, config=config_dict,
                                                 planner=planner)
    groups, compiled = engine.module.groups, engine.module.config
    decision = engine.module.report.strategy_plan
    strategy = compiled.strategy + (f" {compiled.ulysses_size}x{compiled.sp_size // compiled.ulysses_size}"
                                    if compiled.strategy == "hybrid" else "")
    log.info("model %s: %.3g B parameters, %d layers; world %d = SP %d x DP %d (%s%s); seq %d; ZeRO %d; %s; %s on "
             "%s", args.model, n_params / 1e9, config.num_hidden_layers, world, groups.sp_size, groups.dp_size,
             strategy, "" if decision is None else f", chosen by strategy='auto' as {decision['chosen']}",
             args.seq_len, zero_stage, compiler, str(dtype).removeprefix("torch."), device.type)

    tokens_per_step = groups.dp_size * micro_batch * args.seq_len  # each sequence counted once
    measured_s, losses = 0.0, []
    entry.announce_first_compile(engine.module, log)
    for step in range(args.steps):
        ids = random_sample(step, groups.dp_rank, batch=micro_batch, seq_len=args.seq_len,
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
        "micro_batch_size": micro_batch, "zero_stage": zero_stage, "compiler": compiler,
        "strategy": compiled.strategy, "ulysses_size": compiled.ulysses_size if compiled.strategy == "hybrid" else None,
        "strategy_decision": None if decision is None else {
            k: decision[k] for k in ("chosen", "reason", "candidates", "setup", "seconds", "planner_seconds",
                                     "planner_started_before_s_by_rank")},
        "dtype": str(dtype).removeprefix("torch."), "device": device.type, "steps": args.steps,
        "losses": losses, "tokens_per_step": tokens_per_step,
        "step_time_s": measured_s / measured_steps, "tokens_per_s": tokens_per_step * measured_steps / measured_s,
        "per_rank_memory": per_rank, "deepspeed_config": config_dict,
    }
    for memory in per_rank:
        log.info("rank %d peak memory %s", memory["rank"],
                 ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in memory.items() if k != "rank"))
    log.info("%.1f tokens/s (%.3f s per step over %d steps after %d warm-up)", summary["tokens_per_s"],
             summary["step_time_s"], measured_steps, args.warmup_steps)
    return summary if rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    """The command; a refusal (`AutoSPError`) exits 2 with one line (`autosp.entry.run`), not a traceback."""
    args = parse_args(argv)
    entry.configure_logging()
    summary = entry.run(lambda: train(args), debug=args.debug)
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
