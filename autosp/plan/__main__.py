"""``python -m autosp.plan``: predict a training configuration for a model on a cluster before running it.

Answers whether it fits, the peak per rank by ledger category, the step time and (with ``--max-length``) the
longest sequence that fits; ``--json`` writes the same as a document.  Exit status 0 with an answer (also when it
does not fit), 2 on a usage error with a message saying what to change.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from autosp.config import ACTIVATION_OFFLOAD
from autosp.errors import AutoSPError
from autosp.plan.cluster_file import cluster_names
from autosp.plan.planner import OBJECTIVES
from autosp.plan.predict import (
    COMPILERS,
    DEPTHS,
    DTYPES,
    OFFLOADS,
    OPTIMIZERS,
    STRATEGY_CHOICES,
    TrainingSetup,
)
from autosp.presets import model_argument

log = logging.getLogger("autosp.plan")

EPILOG = """\
--cluster takes a hardware preset (as many nodes as the ranks need), a multi-node cluster preset, or a cluster
file (JSON; fields and units: docs/design.md, "Cluster files"; example: docs/examples/two_node_cluster.json).
Peak memory is one definition everywhere: the DeepSpeed memory ledger inside backward (parameters, gradients,
optimizer state, communication buffers, CUDA context, NCCL, workspaces, allocator rounding and fragmentation)
plus the simulated activations of the traced AutoSP step - what python -m simulator --max-length reports.

examples:
  python -m autosp.plan --model llama-3.1-8b --cluster h100-sxm --seq-len 65536 --sp-size 8
  python -m autosp.plan --model path/to/config.json --cluster docs/examples/two_node_cluster.json \\
      --seq-len 131072 --sp-size 4 --dp-size 2 --zero-stage 2 --micro-batch 2 --json plan.json
  python -m autosp.plan --model tiny-llama --cluster a100-80gb-sxm --seq-len 4096 --sp-size 2 --max-length
  python -m autosp.plan --model llama-3.1-8b --cluster h100-sxm --seq-len 131072 --sp-size 8 --strategy auto
  python -m autosp.plan --model llama-3.1-8b --cluster h100-sxm --seq-len 65536 --sp-size 8 --zero-stage 2 \\
      --offload optimizer
  python -m autosp.plan --model llama-3.1-8b --cluster h100-sxm --seq-len 262144 --sp-size 8 \\
      --activation-offload on
  python -m autosp.plan --model llama-3.1-8b --cluster h100-sxm --seq-len 65536 --sp-size 8 --memory-plan auto \\
      --workers 4
"""


def _cluster(value: str) -> str:
    if value in cluster_names() or Path(value).is_file():
        return value
    raise argparse.ArgumentTypeError(f"{value!r} is neither a preset ({', '.join(cluster_names())}) nor a "
                                     "cluster file")


def _positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"{number}: give a positive number")
    return number


def build_parser() -> argparse.ArgumentParser:
    from autosp.presets import PRESETS as MODEL_PRESETS

    p = argparse.ArgumentParser(
        prog="python -m autosp.plan", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Predict an AutoSP training configuration for a model on a cluster: whether it fits, the peak "
                    "memory per rank by\nledger category, the step time and the longest sequence that fits. The "
                    "model is traced on fake tensors\n(no weights, no downloads) and the step simulated.")
    p.add_argument("--model", required=True, type=model_argument,
                   help=f"a preset of autosp.presets ({', '.join(MODEL_PRESETS)}) or the path of any "
                        "Hugging Face causal-LM config.json (or its folder)")
    p.add_argument("--cluster", required=True, type=_cluster, metavar="PRESET_OR_FILE",
                   help=f"a hardware or cluster preset ({', '.join(cluster_names())}) or a cluster file (JSON)")
    p.add_argument("--seq-len", required=True, type=_positive, help="tokens per sample (the full sequence)")
    p.add_argument("--sp-size", type=_positive, default=1, help="ranks sharing one sequence (default: %(default)s)")
    p.add_argument("--dp-size", type=_positive, default=None,
                   help="data-parallel replicas (default: --world-size / --sp-size, else 1)")
    p.add_argument("--world-size", type=_positive, default=None,
                   help="ranks in all, SP x DP (default: --sp-size x --dp-size)")
    p.add_argument("--zero-stage", type=int, default=None, choices=(0, 1, 2, 3),
                   help="DeepSpeed ZeRO stage; 3 is refused (AutoSP does not compose with it) (default: 1; with "
                        "--memory-plan auto and neither this nor --offload given, the planner chooses ZeRO 1, 2 or "
                        "2 with --offload optimizer: the first under which a plan fits)")
    p.add_argument("--micro-batch", type=_positive, default=1,
                   help="samples per SP group per micro-step (default: %(default)s)")
    p.add_argument("--grad-accum", type=_positive, default=1,
                   help="micro-steps per optimizer step (default: %(default)s)")
    p.add_argument("--dtype", default="bf16", choices=DTYPES, help="parameter and compute dtype (default: %(default)s)")
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS,
                   help="optimizer whose state the ledger counts (default: %(default)s)")
    p.add_argument("--offload", default=None, choices=OFFLOADS,
                   help="optimizer: DeepSpeed's offload_optimizer (device cpu; ZeRO 1 or 2): fp32 master weights, "
                        "gradient partitions and optimizer state in host memory, CPU Adam; reports the host peak "
                        "beside the device peak (default: none; with --memory-plan auto, see --zero-stage)")
    p.add_argument("--activation-offload", default=None, choices=ACTIVATION_OFFLOAD,
                   help="AutoSP's activation offload (autosp.compile's activation_offload): on moves the tensors saved "
                        "for backward to host memory and back, asynchronously, and reports the host peak beside the "
                        "device peak; auto (with --memory-plan auto) lets the planner try each plan with and without "
                        "it (default: off; with --memory-plan auto, auto)"),
    p.add_argument("--compiler", default="inductor", choices=COMPILERS,
                   help="backend the graphs run under (frees saved activations after last use; aot_eager holds "
                        "them to the end of backward) (default: %(default)s)")
    p.add_argument("--depth", default=None, choices=DEPTHS,
                   help="trace every layer, or 1 and 2 layers and extrapolate, SAC deciding as for the full model "
                        "(faster; the full depth where that is refused) (default: full for a prediction, "
                        "extrapolated for --strategy auto and --memory-plan auto)")
    p.add_argument("--max-length", action="store_true",
                   help="also search the longest sequence that fits (one trace per length probed)")
    p.add_argument("--max-length-high", type=_positive, default=None,
                   help="ceiling of the --max-length search (default: 8 x --seq-len)")
    p.add_argument("--granularity", type=_positive, default=1024,
                   help="length grid of the --max-length search, rounded up to a multiple of --sp-size "
                        "(default: %(default)s)")
    p.add_argument("--max-probes", type=_positive, default=8,
                   help="lengths the --max-length search may simulate (default: %(default)s)")
    p.add_argument("--strategy", default="ulysses", choices=STRATEGY_CHOICES,
                   help="how the sequence is split: the strategy autosp.compile traces with, or auto: trace and "
                        "simulate each, print each one's step time and peak, choose the fastest that fits "
                        "(default: %(default)s)")
    p.add_argument("--memory-plan", default="none", choices=("none", "auto"),
                   help="auto: choose checkpointing (per-layer among them), SAC budget, tiled loss and tiled MLP by "
                        "predicting every candidate plan, "
                        "print the candidate table and the chosen autosp.compile options: what autosp.compile "
                        "plans by default on a GPU (or with target_memory); none: predict the options as given, "
                        "what memory_plan='off' compiles (default: %(default)s)")
    p.add_argument("--objective", default="fastest", choices=OBJECTIVES,
                   help="with --memory-plan auto: the fastest step that fits at --seq-len, or the longest length "
                        "that fits (ties by speed) (default: %(default)s)")
    p.add_argument("--workers", type=_positive, default=1,
                   help="with --memory-plan auto: processes predicting the candidates side by side, one trace group "
                        "(tiled loss x tiled MLP) each at a time, with the same predictions and choice; on a "
                        "machine with that many free cores up to that many times faster for a large model "
                        "(default: %(default)s)")
    p.add_argument("--target-memory", type=float, default=None, metavar="GiB",
                   help="memory per rank a plan must fit (default: the device's memory)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT",
                   help="also write the answer as JSON to this file (default: none)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress logging")
    return p


def setup_from_args(args: argparse.Namespace) -> TrainingSetup:
    """The training configuration of the flags (world = SP x DP)."""
    dp = args.dp_size
    if args.world_size is not None:
        if args.world_size % args.sp_size:
            raise AutoSPError(f"--world-size {args.world_size} is not a multiple of --sp-size {args.sp_size}")
        if dp is not None and dp * args.sp_size != args.world_size:
            raise AutoSPError(f"--world-size {args.world_size} != --sp-size {args.sp_size} x --dp-size {dp}")
        dp = args.world_size // args.sp_size
    setup = TrainingSetup(seq_len=args.seq_len, sp_size=args.sp_size, dp_size=dp or 1,
                          zero_stage=1 if args.zero_stage is None else args.zero_stage,
                          micro_batch=args.micro_batch, grad_accum=args.grad_accum, dtype=args.dtype,
                          optimizer=args.optimizer, offload=args.offload or "none", compiler=args.compiler,
                          depth=args.depth)
    setup.check()
    return setup


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        setup = setup_from_args(args)  # every refusal before any work
        from autosp.plan.cluster_file import load_cluster
        from autosp.plan.predict import predict

        cluster = load_cluster(args.cluster, world_size=setup.world_size)
        if args.target_memory is not None and args.target_memory <= 0:
            raise AutoSPError(f"--target-memory {args.target_memory}: give a positive number of GiB")
        target = None if args.target_memory is None else int(args.target_memory * 2**30)
        offload = args.activation_offload
        if offload == "auto" and args.memory_plan != "auto":
            raise AutoSPError("--activation-offload auto lets the memory planner decide: add --memory-plan auto, or "
                              "choose on or off")
        options = {"activation_offload": "on"} if offload == "on" else {}
        if args.strategy != "ulysses" and (args.memory_plan == "auto" or args.max_length):
            raise AutoSPError(f"--strategy {args.strategy} is not combined with --memory-plan auto or --max-length "
                              "yet; predict the strategy alone, or use --strategy ulysses")
        if args.strategy == "auto":
            from autosp.plan.predict import choose_strategy

            answer = choose_strategy(args.model, setup, cluster, capacity_bytes=target, options=options,
                                     progress=lambda s: log.info("step at %s", s))
        elif args.memory_plan == "auto":
            from autosp.plan.planner import candidates_for, plan_job, plan_memory

            # the candidates autosp.compile(memory_plan="auto") tries, chunks sized for the same target
            plans = candidates_for(args.model, setup, cluster.device.memory_bytes if target is None else target,
                                   activation_offload=("off", "on") if offload in (None, "auto") else (offload,))
            planning = dict(objective=args.objective, target_memory=target, plans=plans,
                            max_length_high=args.max_length_high, granularity=args.granularity,
                            max_probes=args.max_probes, workers=args.workers)
            if args.zero_stage is None and args.offload is None:  # the planner chooses the DeepSpeed setup too
                answer = plan_job(args.model, setup, cluster, **planning)
            else:
                answer = plan_memory(args.model, setup, cluster, **planning)
        else:
            from autosp.plan.predict import TraceReuse

            options = {**options, **({} if args.strategy == "ulysses" else {"strategy": args.strategy})}
            answer = predict(args.model, setup, cluster, capacity_bytes=target, max_length=args.max_length,
                             max_length_high=args.max_length_high, granularity=args.granularity,
                             max_probes=args.max_probes, progress=lambda s: log.info("step at %s", s),
                             options=options or None, reuse=TraceReuse([options], resize_lengths=args.max_length))
    except AutoSPError as err:
        log.error("%s", err)
        return 2
    # The command's result (not a diagnostic): the answer on stdout.
    sys.stdout.write(answer.format() + "\n")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(answer.to_dict(), indent=1, default=str))
        sys.stdout.write(f"wrote {args.json}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
