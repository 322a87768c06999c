"""``python -m experiments.cpu.bench_lengths``: one compiled model trained on many sequence lengths.

A compiled model needs no setting for variable lengths: each distinct shard length
compiles one program (Note [One program per length] in autosp/model.py).  This trains
one Hugging Face model on 2 gloo ranks over ``--lengths`` in order, with
`autosp.compile`'s default options unless told otherwise, and checks every step
against a single-device run of the full sequence (loss and every gradient); it prints
per length whether it compiled, the compile's seconds, the step's seconds after the
compile (the same program run again) and the largest gradient error.  Each program is
specialised to its shapes, so its step time is that of static shapes; what a new
length costs is its compile.
"""

from __future__ import annotations

import argparse
import copy
import logging
import time

from experiments.cpu import two_ranks
from experiments.tables import markdown_table

log = logging.getLogger(__name__)

DEFAULT_LENGTHS = (64, 96, 65, 128, 160, 33, 192, 127, 256, 80, 224, 48, 64)
"""Twelve distinct lengths (odd ones padded to a multiple of sp_size; 127 shares 128's padded length) and a
repeat of the first (it compiles nothing)."""
FP32_TOL = {"rtol": 1e-4, "atol": 1e-6}


def train_on_lengths(rank: int, world: int, spec: dict) -> list[dict]:
    """Train ``spec["model"]`` compiled once over ``spec["lengths"]``; every step is compared (loss and every
    gradient, fp32 rtol 1e-4 / atol 1e-6) with a single-device run of the full sequence, raising on a mismatch.
    Returns one row per step: the length, the programs compiled so far, that step's compile and re-run seconds,
    the largest absolute gradient difference."""
    import torch

    import autosp
    from experiments.models import build_model, vocab_size

    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = build_model(spec["model"], layers=spec["layers"])
    candidate = copy.deepcopy(reference)
    compiled = autosp.compile(candidate, sp_size=world, **spec["options"])
    rows = []
    for step, length in enumerate(spec["lengths"]):
        generator = torch.Generator().manual_seed(step)
        ids = torch.randint(0, vocab_size(reference), (spec["batch"], length), generator=generator)
        reference.zero_grad(set_to_none=True)
        ref_loss = reference(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        compiled_before = len(compiled.programs)
        timings = []
        for _ in range(2):  # the first call may compile; the second runs the same program again
            candidate.zero_grad(set_to_none=True)
            start = time.perf_counter()
            loss = compiled(**autosp.prepare_inputs(ids, labels=ids)).loss
            loss.backward()
            timings.append(time.perf_counter() - start)
        where = f"rank {rank} {spec['model']} step {step} ({length} tokens)"
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), **FP32_TOL, msg=lambda m, w=where: f"{w}: {m}")
        worst = 0.0
        reference_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
        for name, param in candidate.named_parameters():
            expected = reference_grads.pop(name)
            assert expected.abs().max() > 0, f"{where}: reference gradient of {name} is zero (vacuous comparison)"
            torch.testing.assert_close(param.grad, expected, **FP32_TOL, msg=lambda m, w=where, n=name: f"{w} {n}: {m}")
            worst = max(worst, float((param.grad - expected).abs().max()))
        assert not reference_grads, f"{where}: gradients of {sorted(reference_grads)} missing"
        compiled_now = len(compiled.programs) > compiled_before
        rows.append({"length": length, "programs": len(compiled.programs),
                     "compile_s": compiled.programs[-1].seconds if compiled_now else 0.0,
                     "first_call_s": timings[0], "step_s": timings[1], "max_grad_error": worst})
    return rows


def build_parser() -> argparse.ArgumentParser:
    from experiments import cli
    from experiments.models import TINY_MODELS

    parser = cli.parser("experiments.cpu.bench_lengths", __doc__)
    parser.add_argument("--model", default="hf-llama", choices=sorted(TINY_MODELS), help="tiny model preset")
    parser.add_argument("--batch", type=int, default=2, help="rows")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS),
                        help="sequence lengths, trained in this order")
    two_ranks.add_model_arguments(parser, compiler="inductor",
                                  compiler_help="autosp.compile backend (inductor is its default)")
    return parser


def main(argv=None) -> None:
    args = two_ranks.parse_args(build_parser(), argv)
    spec = {"model": args.model, "layers": args.layers, "batch": args.batch, "lengths": args.lengths,
            "options": {} if args.compiler == "inductor" else {"compiler": args.compiler}}
    log.info("%s, %d layers, %d lengths on 2 gloo ranks, compiler %s, every step checked against one device",
             args.model, args.layers, len(args.lengths), args.compiler)
    per_rank = two_ranks.run_on_two_ranks(train_on_lengths, spec, timeout_s=3600, collective_timeout_s=600)
    rows = [{"length": r["length"], "programs": r["programs"],
             "compile_s": f"{max(p[i]['compile_s'] for p in per_rank):.2f}",
             "first_call_s": f"{max(p[i]['first_call_s'] for p in per_rank):.2f}",
             "step_s": f"{max(p[i]['step_s'] for p in per_rank):.3f}",
             "max_grad_error": f"{max(p[i]['max_grad_error'] for p in per_rank):.1e}"}
            for i, r in enumerate(per_rank[0])]
    print(markdown_table(rows))  # noqa: T201 - the command's output
    compiles = per_rank[0][-1]["programs"]
    total = sum(max(p[i]["compile_s"] for p in per_rank) for i in range(len(rows)))
    print(f"{len(set(args.lengths))} distinct lengths, {compiles} compiles ({total:.1f} s), "  # noqa: T201
          "every step exact against a single-device run")


if __name__ == "__main__":
    main()
