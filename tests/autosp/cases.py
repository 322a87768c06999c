"""Shared pieces of the AutoSP tests: samples, a single-device reference step, a traced step and what it holds,
and the one launch on 2 gloo ranks of a tiled op's tests."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from tests.harness import run_on_ranks

IGNORE = -100
FP32_TOL = {"rtol": 1e-4, "atol": 1e-6}
"""The fp32 equivalence tolerance of the AutoSP tests."""
TECHNIQUES_ON = {"tiled_loss": "on", "return_logits": False, "tiled_mlp": "on", "activation_offload": "on"}
"""AutoSP's memory techniques all on (SAC is the default checkpointing)."""


def replicas_step(reference: torch.nn.Module, compiled, *, step: int, seq_len: int, dp_size: int,
                  dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One backward of a data-parallel SP job against one device: the reference trains on every replica's sample of
    ``step`` (its gradients averaged over the replicas), the compiled model on its replica's; their two losses on
    that sample (the compiled one's, the reference's)."""
    import autosp
    from experiments.models import vocab_size

    samples = [make_sample(seq_len, vocab_size(reference), seed=100 + 10 * step + i) for i in range(dp_size)]
    ref_losses = []
    for ids, labels in samples:
        loss = loss_of(reference(input_ids=ids, labels=labels))
        (loss / dp_size).backward()
        ref_losses.append(loss.detach())
    ids, labels = samples[dp_rank]
    loss = loss_of(compiled(**autosp.prepare_inputs(ids, labels=labels)))
    loss.backward()
    return loss.detach(), ref_losses[dp_rank]


def assert_named_close(actual: dict, expected: dict, where: str) -> None:
    """Every named tensor equal to the reference's within `FP32_TOL`, none of the reference's all zero (the
    comparison would be vacuous)."""
    assert actual.keys() == expected.keys(), where
    for name, value in actual.items():
        assert expected[name].abs().max() > 0, f"{where} {name} is zero: the comparison would be vacuous"
        torch.testing.assert_close(value, expected[name], **FP32_TOL, msg=lambda m, w=f"{where} {name}": f"{w}: {m}")


def assert_steps_match(record: dict, where: str, *, clip: float) -> None:
    """A run of optimizer steps against its reference: each step's loss and every gradient (``steps``: ``loss``,
    ``grads`` and the ``ref_`` pair of each), the first step's norm clipped to ``clip`` and the clipped gradients
    (``norm``, ``clipped``), then every parameter (``params``)."""
    for step, s in enumerate(record["steps"]):
        torch.testing.assert_close(s["loss"], s["ref_loss"], **FP32_TOL,
                                   msg=lambda m, i=step: f"{where} step {i} loss: {m}")
        assert_named_close(s["grads"], s["ref_grads"], f"{where} step {step} grad")
        if "norm" in s:
            assert s["ref_norm"] > clip, f"{where}: the norm {s['ref_norm']} is not clipped at {clip}"
            torch.testing.assert_close(s["norm"], s["ref_norm"], **FP32_TOL)
            assert_named_close(s["clipped"], s["ref_clipped"], f"{where} step {step} clipped grad")
    assert_named_close(record["params"], record["ref_params"], f"{where} parameter")


def case_records(results: list[list[dict]], cases: list[dict]):
    """``(where, case, record)`` for every case of a launch on every rank (``results[rank][i]``: case i's record)."""
    for rank, per_case in enumerate(results):
        for case, record in zip(cases, per_case, strict=True):
            yield f"rank {rank} {case}", case, record


def build_case_model(model: str) -> torch.nn.Module:
    """A model of the training-equivalence tests by name: an `experiments.models` preset, or ``"mixtral"`` (the
    Hugging Face Mixtral of tests/autosp/test_moe.py)."""
    if model == "mixtral":
        from tests.autosp.test_moe import build_moe

        return build_moe("mixtral")
    from experiments.models import build_model

    return build_model(model)


def config_json(folder, config: dict) -> str:
    """``config`` written as ``folder/config.json`` (a Hugging Face config, as the planner reads one); its path."""
    path = pathlib.Path(folder) / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


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


def reference_and_candidate(build) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``build()`` after a Dynamo reset under seed 0 (the single-device reference), and a deep copy of it (what
    AutoSP compiles): one process compiles many models, and stays under torch.compile's recompile limit."""
    import copy

    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = build()
    return reference, copy.deepcopy(reference)


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


def traced_step(model: str, *, vocab: int, seq_len: int, sp_size: int, **options):
    """The compiled step `autosp.tracing.trace_fake_step` traces (fp32, fake tensors) of a one-layer
    ``build_model(model)`` with a vocabulary of ``vocab``, under ``options``."""
    from autosp.tracing import trace_fake_step
    from experiments.models import build_model

    torch._dynamo.reset()
    compiled, _ = trace_fake_step(lambda: build_model(model, layers=1, vocab=vocab), seq_len=seq_len, sp_size=sp_size,
                                  vocab_size=vocab, dtype=torch.float32, **options)
    return compiled


def rows_by(compiled, rows: int, width: int) -> list[str]:
    """The tensors of ``compiled``'s traced graphs (the last Dynamo graph, the AOT graphs) with an axis of
    ``width`` and at least ``rows x width`` elements: a [rows, width] tensor, such as tiling avoids."""
    from autosp.costs import tensors_of

    found = []
    graphs = [("dynamo", compiled.report.forward_graphs[-1]), *compiled.report.aot_graphs]
    for name, gm in graphs:
        for node in gm.graph.nodes:
            for t in tensors_of(node.meta.get("val", node.meta.get("example_value"))):
                if width in t.shape and t.numel() >= rows * width:
                    found.append(f"{name}: {node.name} {tuple(t.shape)}")
    return found


def cases_and_peaks(rank: int, world: int, run_case, cases: list[dict], peak) -> dict:
    """On this rank: ``run_case(rank, world, **case)`` of each of ``cases``, and ``peak(tiled=False)`` and
    ``peak(tiled=True)`` (a tiled op's exactness cases and its memory measurement, in one launch)."""
    return {"cases": [run_case(rank, world, **case) for case in cases],
            "peaks": {"untiled": peak(tiled=False), "tiled": peak(tiled=True)}}


def two_ranks_fixture(run_case, cases: list[dict], peak):
    """A module-scoped fixture: one launch of 2 gloo ranks running `cases_and_peaks`, every rank's result."""

    @pytest.fixture(scope="module")
    def two_ranks():
        """One launch of 2 gloo ranks for the exactness cases and the memory measurement."""
        return run_on_ranks(cases_and_peaks, 2, run_case, cases, peak, timeout_s=600)

    return two_ranks
