"""``python -m experiments.cpu.bench_packed``: a packed batch against the same tokens unpacked, side by side.

Hugging Face Llama (``use_cache=False``: it builds its packed-sequence mask from the
position ids), compiled by AutoSP on 2 gloo ranks, trained on the same tokens as

- ``unpacked``: one document per row (plain positions: causal SDPA checked on every call, Note [Document
  program] in autosp/model.py),
- ``packed``: ``--documents`` documents per row (position ids restarting at each),
- ``causal sdpa``: the same model with ``use_cache=True`` (no mask built: Ulysses' causal SDPA),

measured in one run with steps interleaved across the variants (experiments.cpu.measure.time_interleaved), slowest
rank, median; each variant's attention keeps the fraction of the scores the report gives (a packed row of n
equal documents keeps about 1/n of what one document keeps).  On CPU without Inductor, flex_attention runs its
reference implementation, which evaluates every score and skips no block: the packed batch's saving shows in
the kept fraction (what a block-sparse GPU kernel skips), not in these CPU times.
"""

from __future__ import annotations

import argparse
import copy

from experiments.cpu import two_ranks
from experiments.tables import markdown_table


class _Variant:
    """A compiled model and the position ids it trains with (the interface of time_interleaved)."""

    def __init__(self, compiled, positions):
        self.compiled, self.positions = compiled, positions

    def zero_grad(self):
        self.compiled.zero_grad(set_to_none=True)

    def step(self, ids, labels):
        import autosp

        out = self.compiled(**autosp.prepare_inputs(ids, labels=labels, position_ids=self.positions))
        out.loss.backward()
        autosp.sync_gradients(self.compiled)


def _bench_on_rank(rank: int, world: int, spec: dict) -> dict:
    import torch

    import autosp
    from experiments.cpu.measure import time_interleaved
    from experiments.models import build_model

    torch.manual_seed(0)
    base = build_model("hf-llama", layers=spec["layers"])
    seq_len, documents = spec["seq_len"], spec["documents"]
    ids = torch.randint(0, 256, (1, seq_len), generator=torch.Generator().manual_seed(1))
    lengths = [seq_len // documents] * documents
    lengths[-1] += seq_len - sum(lengths)
    packed = torch.cat([torch.arange(n) for n in lengths])[None]
    variants, kept = {}, {}
    for name, use_cache, positions in (("unpacked", False, None), ("packed", False, packed),
                                       ("causal sdpa", True, None)):
        model = copy.deepcopy(base)
        model.config.use_cache = use_cache
        compiled = autosp.compile(model, sp_size=world, compiler=spec["compiler"])
        variants[name] = _Variant(compiled, positions)
        variants[name].step(ids, ids)  # compile outside the timed steps
        kept[name] = compiled.report.attention_kept_fraction
    times = time_interleaved(variants, ids, ids, steps=spec["steps"])
    return {"times": times, "kept": kept}


def build_parser() -> argparse.ArgumentParser:
    from experiments import cli

    parser = cli.parser("experiments.cpu.bench_packed", __doc__)
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per row")
    parser.add_argument("--documents", type=int, default=8, help="documents in the packed row")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    two_ranks.add_model_arguments(parser, compiler="aot_eager",
                                  compiler_help="autosp.compile backend (inductor compiles flex_attention)")
    return parser


def main(argv=None) -> None:
    args = two_ranks.parse_args(build_parser(), argv)
    results, median = two_ranks.interleaved_medians(
        _bench_on_rank, args, f"packed vs unpacked: {args.seq_len} tokens, {args.documents} documents")
    kept = results[0]["kept"]
    rows = [{"variant": n, "step_ms": f"{median[n] * 1e3:.1f}", "vs_unpacked": f"{median[n] / median['unpacked']:.2f}",
             "kept_fraction_of_scores": "" if kept[n] is None else f"{kept[n]:.4f}"} for n in median]
    print(markdown_table(rows))  # noqa: T201 - the command's output


if __name__ == "__main__":
    main()
