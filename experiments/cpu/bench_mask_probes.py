"""``python -m experiments.cpu.bench_mask_probes``: learning a Hugging Face mask on short blocks against the shard's.

Hugging Face Llama with ``use_cache=False`` (the packed-sequence mask it builds from the position ids, what
``AutoSPTrainer`` and gradient checkpointing run), one decoder layer, traced by the real passes on fake tensors
and a fake group of ``--sp-size`` ranks with a real packed layout (`autosp.tracing.trace_fake_step`: the real
batch is checked too), once per variant, each in its own process (its peak resident memory is its own):

- ``shard``: the mask program probed as traced, on blocks of the shard's length (``mask_probe_tokens`` set to it:
  what every compile did before Note [Mask programs probed on shorter blocks]);
- ``blocks of N``: resized to ``mask_probe_tokens=N`` (the default, or ``--block``).

Printed: the mask pass's seconds (``CompileReport.pass_seconds``), the whole trace's, the process's peak resident
memory, and the ratios.  Both variants must learn the same rule (checked, printed).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import resource
import time

from experiments.tables import markdown_table

log = logging.getLogger(__name__)


def _trace(spec: dict) -> dict:
    import torch

    from autosp.tracing import trace_fake_step
    from experiments.models import build_model

    def build():
        model = build_model("hf-llama", layers=1, hidden=128, heads=16, kv_heads=4)
        model.config.use_cache = False
        return model

    seq_len, documents = spec["seq_len"], spec["documents"]
    lengths = [seq_len // documents] * documents
    lengths[-1] += seq_len - sum(lengths)
    start = time.perf_counter()
    compiled, _ = trace_fake_step(build, seq_len=seq_len, sp_size=spec["sp_size"], vocab_size=256,
                                  dtype=torch.float32, checkpointing="none", overlap_communication=False,
                                  document_lengths=lengths, mask_probe_tokens=spec["block"])
    report = compiled.report
    return {"trace_s": time.perf_counter() - start, "mask_s": report.pass_seconds["attention_mask_pass"],
            "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rules": [str(m) for m in report.document_masks], "blocks": report.mask_probe_blocks}


def build_parser() -> argparse.ArgumentParser:
    from autosp.config import MASK_PROBE_TOKENS
    from experiments import cli

    parser = cli.parser("experiments.cpu.bench_mask_probes", __doc__)
    parser.add_argument("--seq-len", type=int, default=65536, help="tokens per row")
    parser.add_argument("--sp-size", type=int, default=8, help="ranks of the fake group")
    parser.add_argument("--documents", type=int, default=4, help="documents packed in the row")
    parser.add_argument("--block", type=int, default=MASK_PROBE_TOKENS, help="mask_probe_tokens of the short blocks")
    parser.add_argument("--no-shard", action="store_true",
                        help="skip the shard variant (out of reach at long shards: L x L booleans a probe)")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.seq_len % args.sp_size:
        raise SystemExit(f"--seq-len {args.seq_len} is not a multiple of --sp-size {args.sp_size}")
    shard = args.seq_len // args.sp_size
    variants = {f"blocks of {args.block}": args.block, **({} if args.no_shard else {"shard": shard})}
    results = {}
    context = multiprocessing.get_context("spawn")
    for name, block in variants.items():
        log.info("tracing with the mask probed on %s (%d tokens, %d a rank) ...", name, args.seq_len, shard)
        with context.Pool(1) as pool:
            results[name] = pool.apply(_trace, ({"seq_len": args.seq_len, "sp_size": args.sp_size,
                                                 "documents": args.documents, "block": block},))
    short, whole = results[f"blocks of {args.block}"], results.get("shard")
    if whole is None:
        whole = {"mask_s": float("nan"), "peak_mib": float("nan"), "rules": short["rules"]}
        log.info("shard variant skipped: %.1f GB of booleans a probe", shard * shard / 1e9)
    if short["rules"] != whole["rules"]:
        raise SystemExit(f"the variants learnt different rules: {short['rules']} against {whole['rules']}")
    rows = [{"variant": name, "block_tokens": r["blocks"][0][1] if r["blocks"] else "",
             "mask_pass_s": f"{r['mask_s']:.2f}", "trace_s": f"{r['trace_s']:.1f}", "peak_mib": f"{r['peak_mib']:.0f}",
             "mask_pass_vs_shard": f"{r['mask_s'] / whole['mask_s']:.3f}",
             "peak_vs_shard": f"{r['peak_mib'] / whole['peak_mib']:.3f}"} for name, r in results.items()]
    print(markdown_table(rows))  # noqa: T201 - the command's output
    print(f"rule learnt: {short['rules'] or 'the plain causal mask'}")  # noqa: T201


if __name__ == "__main__":
    main()
