"""Shared pieces of the AutoSP tests: samples and a single-device reference step."""

from __future__ import annotations

import torch

IGNORE = -100


def make_sample(seq_len: int, vocab: int, *, seed: int, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels whose ignored targets are spread unevenly over the sequence."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=g)
    labels = ids.clone()
    labels[0, : seq_len // 3] = IGNORE  # a long ignored prefix: the first shard holds most of them
    labels[1, torch.rand(seq_len, generator=g) < 0.2] = IGNORE
    return ids, labels


def loss_of(output) -> torch.Tensor:
    """The loss from a plain tensor or a Hugging Face ModelOutput."""
    return output if isinstance(output, torch.Tensor) else output.loss


def named_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def compiled_step_against_single_device(rank: int, world: int, reference: torch.nn.Module, *, sp_size: int,
                                        seq_len: int, options: dict, seed: int) -> tuple[dict, object]:
    """One training step of ``reference`` (deep-copied) compiled by AutoSP under ``options`` on this rank of
    ``world`` (``sp_size`` ranks per sequence, the rest data parallelism), and the same step of ``reference`` on
    one device over every replica's sample.  Returns the loss and gradient comparison (as
    `tests.autosp.test_equivalence._check` reads it) and the compiled model (for its report)."""
    import copy

    import autosp
    from experiments.models import vocab_size

    candidate = copy.deepcopy(reference)
    dp_size, dp_rank = world // sp_size, rank // sp_size
    samples = [make_sample(seq_len, vocab_size(reference), seed=seed + i) for i in range(dp_size)]
    ref_losses = []
    for ids, labels in samples:
        loss = loss_of(reference(input_ids=ids, labels=labels))
        (loss / dp_size).backward()
        ref_losses.append(loss.detach())
    compiled = autosp.compile(candidate, sp_size=sp_size, **{"compiler": "aot_eager", **options})
    ids, labels = samples[dp_rank]
    out = compiled(**autosp.prepare_inputs(ids, labels=labels))
    loss_of(out).backward()
    return {"loss": loss_of(out).detach(), "ref_loss": ref_losses[dp_rank], "grads": named_grads(candidate),
            "ref_grads": named_grads(reference), "output": out}, compiled


def measured_step_peak(model: torch.nn.Module, *, seq_len: int, vocab: int, **options) -> int:
    """Per-rank peak tensor memory of one step of ``model`` compiled by AutoSP on 2 ranks under ``options``
    (aot_eager unless given), measured after a first, compiling step (experiments.cpu.peak_memory.PeakMemory,
    parameters excluded)."""
    import autosp
    from experiments.cpu.peak_memory import PeakMemory

    compiled = autosp.compile(model, sp_size=2, **{"compiler": "aot_eager", **options})
    ids = torch.randint(0, vocab, (1, seq_len), generator=torch.Generator().manual_seed(1))
    inputs = autosp.prepare_inputs(ids, labels=ids)
    loss_of(compiled(**inputs)).backward()  # compile outside the measurement
    model.zero_grad(set_to_none=True)
    with PeakMemory(static=list(model.parameters())) as pm:
        loss_of(compiled(**inputs)).backward()
    return pm.peak_bytes
