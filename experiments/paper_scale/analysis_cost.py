"""Compile-time cost of the sequence-sharding analysis: its share of compiling a 32-layer HF Llama.

``python -m experiments.paper_scale.analysis_cost [--model llama-3.1-8b] [--world 8] [--seq-len 8192]`` traces
one training step of the paper-scale Hugging Face Llama (all 32 layers, fake tensors, a fake process
group: `autosp.tracing.trace_fake_step`) with AutoSP (aot_eager, default SAC and overlap) and prints the
wall time of each Dynamo-stage pass next to the whole first step (Dynamo tracing, the passes,
AOTAutograd, partitioning).
"""

from __future__ import annotations

import argparse
import time

import torch


def measure(model_name: str, world: int, seq_len: int) -> dict[str, float]:
    """Seconds of each Dynamo-stage pass and of the whole first step (trace, passes, AOTAutograd, codegen)."""
    import transformers

    from autosp.tracing import trace_fake_step
    from experiments.models import PAPER_MODELS

    model = PAPER_MODELS[model_name]
    torch._dynamo.reset()
    start = time.perf_counter()
    compiled, _ = trace_fake_step(lambda: transformers.LlamaForCausalLM(model.hf_config()), seq_len=seq_len,
                                  sp_size=world, vocab_size=model.vocab_size)
    return {"total_first_step_s": time.perf_counter() - start, **compiled.report.pass_seconds}


def build_parser() -> argparse.ArgumentParser:
    from experiments import cli
    from experiments.models import PAPER_MODELS

    parser = cli.parser("experiments.paper_scale.analysis_cost", __doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b", choices=sorted(PAPER_MODELS), help="paper-scale preset")
    parser.add_argument("--world", type=int, default=8, help="fake SP group size")
    parser.add_argument("--seq-len", type=int, default=8192, help="tokens")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    times = measure(args.model, args.world, args.seq_len)
    total = times.pop("total_first_step_s")
    analysis = times.get("sequence_sharding_pass", 0.0) + times.get("attention_mask_pass", 0.0)
    print(f"{'pass':32s} {'seconds':>9s} {'share':>7s}")
    for name, seconds in times.items():
        print(f"{name:32s} {seconds:9.3f} {100 * seconds / total:6.2f}%")
    print(f"{'first step (compile + run)':32s} {total:9.3f}")
    print(f"analysis (sharding + mask rules): {analysis:.3f} s = {100 * analysis / total:.2f} % of the first step")


if __name__ == "__main__":
    main()
