"""What the notebooks run on gloo ranks: a spawned rank imports its function from a module, not from a notebook.

`equivalence_on_rank` is the README's "Use it on your model" snippet beside a single-device reference, on the
public API only: the model a name or a config.json stands for (`autosp.plan.ModelSource`, the model
``python -m autosp.train --model`` builds), `autosp.compile` and `autosp.prepare_inputs`.  Launch it with
`experiments.launch.run_on_ranks`; ``experiments/notebooks/equivalence_and_overhead.ipynb`` does.
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings

RTOL, ATOL = 1e-4, 1e-6
"""The project's tolerance for an fp32 equivalence (docs/guarantees.md, "What AutoSP guarantees")."""


def _sample(seq_len: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, vocab, (1, seq_len), generator=g)
    labels = ids.clone()
    labels[0, : seq_len // 4] = -100  # ignored targets spread unevenly over the shards
    return ids, labels


def _loss(out):
    return out if hasattr(out, "backward") else out.loss


def equivalence_on_rank(rank: int, world: int, spec: dict) -> dict:
    """One training step of ``spec["model"]`` (``seq_len`` tokens, fp32, ``num_layers`` layers or the model's)
    compiled by `autosp.compile` over all ``world`` ranks under each entry of ``spec["variants"]`` (name ->
    `autosp.compile` options) against the same step on one device over the full sequence: loss and every
    gradient, then ``spec["steps"]`` timed training steps of each - forward, backward and an AdamW step, what
    `autosp.plan.predict`'s step time covers - barrier-aligned (the single-device step runs on every rank at
    once).  Answers, per variant: the loss error, the largest relative gradient error (max |g - g_ref| /
    max |g_ref| over parameters), whether every gradient is within rtol `RTOL` / atol `ATOL`, the first
    (compiling) step's seconds and the timed steps' median."""
    import torch
    import torch.distributed as dist

    import autosp
    from autosp.plan import ModelSource

    if spec["steps"] < 1:
        raise ValueError(f"steps {spec['steps']}: time at least one step")

    warnings.filterwarnings("ignore", message="autosp.compile with sp_size=1")
    source = ModelSource(spec["model"])
    config = source.config(seq_len=spec["seq_len"], num_layers=spec.get("num_layers"))
    torch.manual_seed(0)
    base = source.build(config, torch.float32)
    ids, labels = _sample(spec["seq_len"], config.vocab_size)

    reference = copy.deepcopy(base)

    def reference_step():
        loss = _loss(reference(input_ids=ids, labels=labels))
        loss.backward()
        return loss.detach()

    ref_loss = reference_step()
    ref_grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters() if p.grad is not None}

    steps = {"single device": (reference, reference_step, torch.optim.AdamW(reference.parameters(), lr=1e-5))}
    answers = {}
    for name, options in spec["variants"].items():
        model = copy.deepcopy(base)
        compiled = autosp.compile(model, sp_size=world, compiler=spec.get("compiler", "aot_eager"), **options)

        def step(compiled=compiled):
            loss = _loss(compiled(**autosp.prepare_inputs(ids, labels=labels)))
            loss.backward()
            return loss.detach()

        dist.barrier()
        start = time.perf_counter()
        loss = step()
        first = time.perf_counter() - start
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        worst, close = 0.0, set(grads) == set(ref_grads)
        for n, ref in ref_grads.items():
            got = grads.get(n)
            if got is None:
                worst = float("inf")
                continue
            worst = max(worst, float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12)))
            close = close and torch.allclose(got, ref, rtol=RTOL, atol=ATOL)
        answers[name] = {"loss_error": abs(float(loss - ref_loss)), "grad_max_rel_error": worst,
                         "grads_close": bool(close), "first_step_s": first}
        steps[name] = (model, step, torch.optim.AdamW(model.parameters(), lr=1e-5))

    times = {name: [] for name in steps}
    names = list(steps)
    for round_ in range(spec["steps"]):
        for name in names[round_ % len(names):] + names[: round_ % len(names)]:  # rotate: noise hits all alike
            module, step, optimizer = steps[name]
            module.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            step()
            optimizer.step()
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    for name, answer in answers.items():
        answer["median_step_s"] = median[name]
    return {"rank": rank, "reference_loss": float(ref_loss), "reference_median_step_s": median["single device"],
            "variants": answers}
