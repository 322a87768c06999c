"""Compile-time cost of the sequence-sharding analysis: its share of compiling a 32-layer HF Llama.

``python -m experiments.bench_analysis_cost [--layers 32] [--world 8] [--seq-len 4096]`` builds a
Hugging Face Llama (small width, real depth) on a fake process group, compiles one training step with
AutoSP (aot_eager, the default SAC and overlap) and prints the wall time of each Dynamo-stage pass next
to the whole first step (Dynamo tracing, the passes, AOTAutograd, partitioning, code generation).
"""

from __future__ import annotations

import argparse
import time

import torch


def measure(layers: int, world: int, seq_len: int) -> dict[str, float]:
    import transformers

    import autosp
    from experiments.models import _hf_decoder  # noqa: PLC2701 - the project's HF builder
    from tests.harness import fake_process_group

    model = _hf_decoder("Llama", layers=layers, hidden=128, heads=8, kv_heads=8, vocab=512)
    ids = torch.randint(0, 512, (1, seq_len))
    torch._dynamo.reset()
    with fake_process_group(world, rank=1):
        compiled = autosp.compile(model, sp_size=world, compiler="aot_eager")
        start = time.perf_counter()
        compiled(**autosp.prepare_inputs(ids, labels=ids)).loss.backward()
        total = time.perf_counter() - start
    del transformers
    return {"total_first_step_s": total, **compiled.report.pass_seconds}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32, help="decoder layers (default 32)")
    parser.add_argument("--world", type=int, default=8, help="fake SP group size (default 8)")
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens (default 4096)")
    args = parser.parse_args(argv)
    times = measure(args.layers, args.world, args.seq_len)
    total = times.pop("total_first_step_s")
    analysis = times.get("sequence_sharding_pass", 0.0) + times.get("causal_mask_pass", 0.0)
    print(f"{'pass':32s} {'seconds':>9s} {'share':>7s}")
    for name, seconds in times.items():
        print(f"{name:32s} {seconds:9.3f} {100 * seconds / total:6.2f}%")
    print(f"{'first step (compile + run)':32s} {total:9.3f}")
    print(f"analysis (sharding + mask rules): {analysis:.3f} s = {100 * analysis / total:.2f} % of the first step")


if __name__ == "__main__":
    main()
