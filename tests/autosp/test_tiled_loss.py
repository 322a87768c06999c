"""Tiled logits and loss (autosp/tiled_ops.py, autosp/passes/dynamo/tiled_loss.py): exact, and no [tokens, vocab].

- the op alone against ``F.cross_entropy(F.linear(...))``: loss and every gradient, chunks that do and do not
  divide the rows, ignored rows, with and without bias;
- AutoSP with ``tiled_loss`` on real gloo ranks (SP 2, and sp_size=1 on the same two ranks as data-parallel
  replicas) against single-device untiled training: Hugging Face Llama, Qwen2 and GPT-2 (tied embeddings), the
  project's plain Llama (classic label shift) under ``"auto"``, padded and ignored labels;
- the traced graphs at a vocabulary-heavy size hold no [tokens, vocab] tensor (and do without tiling), and the
  measured per-rank peak memory drops.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autosp
from autosp.costs import tensors_of
from tests.autosp.cases import compiled_step_against_single_device, measured_step_peak
from tests.autosp.test_equivalence import FP32_TOL, _check
from tests.harness import run_on_ranks


@pytest.mark.parametrize("bias", [False, True])
def test_op_equals_linear_then_cross_entropy(bias):
    torch.manual_seed(0)
    rows, width, vocab = 23, 8, 40
    for chunk in (1, 5, 23, 64):  # 5 does not divide 23 rows; 64 is one chunk
        hidden = torch.randn(rows, width, requires_grad=True)
        weight = torch.randn(vocab, width, requires_grad=True)
        b = torch.randn(vocab, requires_grad=True) if bias else None
        target = torch.randint(0, vocab, (rows,))
        target[::3] = -100
        leaves = [t for t in (hidden, weight, b) if t is not None]
        seed = torch.tensor(0.37)
        expected = F.cross_entropy(F.linear(hidden, weight, b), target, ignore_index=-100, reduction="sum")
        expected_grads = torch.autograd.grad(expected, leaves, seed)
        loss, lse = torch.ops.autosp_testbed.linear_cross_entropy(hidden, weight, b, target, -100, chunk)
        grads = torch.autograd.grad(loss, leaves, seed)
        torch.testing.assert_close(loss, expected, **FP32_TOL)
        torch.testing.assert_close(lse, torch.logsumexp(F.linear(hidden, weight, b), -1), **FP32_TOL)
        for got, want in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(got, want, **FP32_TOL)
    torch.library.opcheck(torch.ops.autosp_testbed.linear_cross_entropy.default,
                          (hidden, weight, b, target, -100, 5), test_utils=("test_schema", "test_faketensor"))


def _problem(rows: int, vocab: int, width: int = 8, *, bias: bool = True):
    g = torch.Generator().manual_seed(rows + vocab)
    hidden = torch.randn(rows, width, generator=g)
    weight = torch.randn(vocab, width, generator=g)
    b = torch.randn(vocab, generator=g) if bias else None
    target = torch.randint(0, vocab, (rows,), generator=g)
    target[::4] = -100
    return hidden, weight, b, target


def _reference_grads(hidden, weight, b, target, seed):
    leaves = [t.detach().float().requires_grad_() for t in (hidden, weight, b)]
    loss = F.cross_entropy(F.linear(*leaves), target, ignore_index=-100, reduction="sum")
    return torch.autograd.grad(loss, leaves, seed)


def test_both_backward_loops_equal_autograd():
    """By token chunks and by vocabulary blocks (the latter taken for bf16 weights and fewer tokens than
    classes), each checked in fp32 against autograd, with blocks that do and do not divide."""
    from autosp.tiled_ops import _backward_by_tokens, _backward_by_vocabulary

    hidden, weight, b, target = _problem(23, 40)
    seed = torch.tensor(0.37)
    _, lse = torch.ops.autosp_testbed.linear_cross_entropy(hidden, weight, b, target, -100, 5)
    row_scale = torch.where(target != -100, seed, 0.0)
    expected = _reference_grads(hidden, weight, b, target, seed)
    for grads in (_backward_by_tokens(hidden, weight, b, target, lse, row_scale, 5, True, True),
                  _backward_by_vocabulary(hidden, weight, b, target, lse, row_scale, 7, True),
                  _backward_by_vocabulary(hidden, weight, b, target, lse, row_scale, 8, True)):
        for got, want in zip(grads, expected, strict=True):
            torch.testing.assert_close(got, want, **FP32_TOL)


@pytest.mark.parametrize("rows", [12, 60])  # fewer tokens than classes (by vocabulary) and more (by tokens)
def test_bf16_op_within_bf16_tolerance(rows):
    hidden, weight, b, target = (t if t is None or t.dtype == torch.long else t.bfloat16()
                                 for t in _problem(rows, 40, width=16))
    leaves = [t.requires_grad_() for t in (hidden, weight, b)]
    loss, _ = torch.ops.autosp_testbed.linear_cross_entropy(*leaves, target, -100, 5)
    grads = torch.autograd.grad(loss, leaves)
    expected = _reference_grads(hidden, weight, b, target, torch.tensor(1.0))
    for got, want in zip(grads, expected, strict=True):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


def _tiled_case(rank, world, *, model, sp_size, seq_len, options, overrides=None):
    from experiments.models import build_model

    torch.manual_seed(0)
    reference = build_model(model, layers=1, **(overrides or {}))
    result, compiled = compiled_step_against_single_device(rank, world, reference, sp_size=sp_size, seq_len=seq_len,
                                                           options=options, seed=200)
    autosp.sync_gradients(compiled)
    tiled = torch.ops.autosp_testbed.linear_cross_entropy.default
    tiled_backward = torch.ops.autosp_testbed.linear_cross_entropy_backward.default
    graphs = dict(compiled.report.aot_graphs)
    out = result.pop("output")
    return {
        **result,
        "tiled": (any(n.target is tiled for n in graphs["forward"].graph.nodes)
                  and any(n.target is tiled_backward for n in graphs["backward"].graph.nodes)),
        "logits": None if isinstance(out, torch.Tensor) else out.logits,
        "op_class": compiled.report.op_classes.get(str(tiled)),
    }


_HF = {"tiled_loss": "on", "return_logits": False}
_CASES = [
    {"model": "hf-llama", "sp_size": 2, "seq_len": 32, "options": {**_HF, "loss_chunk_tokens": 5}},
    {"model": "hf-llama", "sp_size": 2, "seq_len": 31, "options": {**_HF, "loss_chunk_tokens": 8}},  # padded
    {"model": "hf-qwen2", "sp_size": 2, "seq_len": 32, "options": {**_HF, "loss_chunk_tokens": 16}},
    {"model": "hf-gpt2", "sp_size": 2, "seq_len": 32, "options": {**_HF, "loss_chunk_tokens": 6}},  # tied
    {"model": "plain-llama", "sp_size": 2, "seq_len": 32,  # classic shift, no logits returned
     "options": {"tiled_loss": "auto", "loss_chunk_tokens": 7}},
    {"model": "hf-llama", "sp_size": 1, "seq_len": 24, "options": {**_HF, "loss_chunk_tokens": 7}},
]


def _peak(*, tiled: bool) -> int:
    """Per-rank peak tensor memory of one step (after a compiling step) of a vocabulary-heavy model."""
    from experiments.models import build_model

    torch.manual_seed(0)
    model = build_model("hf-llama", layers=1, hidden=64, vocab=32000)
    options = {"tiled_loss": "on", "loss_chunk_tokens": 128, "return_logits": False} if tiled else {}
    return measured_step_peak(model, seq_len=1024, vocab=32000, checkpointing="none", **options)


def _on_ranks(rank, world):
    return {"cases": [_tiled_case(rank, world, **case) for case in _CASES],
            "peaks": {"untiled": _peak(tiled=False), "tiled": _peak(tiled=True)}}


@pytest.fixture(scope="module")
def two_ranks():
    """One launch of 2 gloo ranks for the exactness cases and the memory measurement."""
    return run_on_ranks(_on_ranks, 2, timeout_s=600)


def test_tiled_loss_equals_single_device_untiled_training_on_two_ranks(two_ranks):
    results = [r["cases"] for r in two_ranks]
    _check(results, FP32_TOL)
    for per_rank in results:
        for case, r in zip(_CASES, per_rank, strict=True):
            assert r["tiled"], f"{case}: the tiled op is not in the compiled graphs"
            assert r["logits"] is None, f"{case}: logits returned although return_logits=False"
            if case["sp_size"] > 1:
                assert r["op_class"] == "loss (tiled: partial sum)"


def test_tiled_loss_lowers_the_measured_peak_memory_per_rank(two_ranks):
    """1,024 tokens of a 32,000 vocabulary on 2 ranks: the untiled step holds the [512, 32000] fp32 logits and
    cross-entropy's log-softmax of the same size at once (62.5 MiB each); the tiled one [128, 32000] at a time."""
    logits_bytes = 512 * 32000 * 4
    for r in two_ranks:
        peaks = r["peaks"]
        assert peaks["untiled"] - peaks["tiled"] >= 2 * logits_bytes, peaks


def _trace(tiled_loss: str, *, seq_len: int, vocab: int, sp_size: int, chunk: int | None = None):
    from autosp.export import trace_fake_step
    from experiments.models import build_model

    torch._dynamo.reset()
    compiled, _ = trace_fake_step(lambda: build_model("hf-llama", layers=1, vocab=vocab), seq_len=seq_len,
                                  sp_size=sp_size, vocab_size=vocab, dtype=torch.float32,
                                  tiled_loss=tiled_loss, return_logits=tiled_loss == "off", loss_chunk_tokens=chunk)
    return compiled


def _token_by_vocab_tensors(compiled, rows: int, vocab: int) -> list[str]:
    found = []
    graphs = [("dynamo", compiled.report.forward_graphs[-1]), *compiled.report.aot_graphs]
    for name, gm in graphs:
        for node in gm.graph.nodes:
            for t in tensors_of(node.meta.get("val", node.meta.get("example_value"))):
                if vocab in t.shape and t.numel() >= rows * vocab:
                    found.append(f"{name}: {node.name} {tuple(t.shape)}")
    return found


def test_traced_graphs_hold_no_tokens_by_vocab_tensor():
    seq_len, vocab, sp_size = 1024, 32000, 2
    rows = seq_len // sp_size
    assert _token_by_vocab_tensors(_trace("off", seq_len=seq_len, vocab=vocab, sp_size=sp_size), rows, vocab)
    tiled = _trace("auto", seq_len=seq_len, vocab=vocab, sp_size=sp_size, chunk=128)
    assert not _token_by_vocab_tensors(tiled, rows, vocab)


def test_export_prices_the_tiled_loss_as_chunked_matmuls():
    from autosp.costs import LOSS_SCRATCH_ROWS  # the planner's chunk rule counts the same scratch
    from autosp.export import export_workload

    seq_len, vocab, sp_size, width, chunk = 256, 4096, 2, 64, 32
    rows = seq_len // sp_size
    compiled = _trace("on", seq_len=seq_len, vocab=vocab, sp_size=sp_size, chunk=chunk)
    program = export_workload(compiled.report.aot_graphs, name="tiled", sp_size=sp_size,
                              parameter_bytes=0).program(0)
    tiled = {op.phase: op for op in program.ops if "linear_cross_entropy" in op.name}
    assert tiled.keys() == {"forward", "backward"}
    matmul = 2 * rows * width * vocab
    assert (tiled["forward"].op_class, tiled["forward"].flops) == ("matmul", matmul)
    assert (tiled["backward"].op_class, tiled["backward"].flops) == ("matmul", 3 * matmul)  # recompute, dh, dW
    for op in tiled.values():  # one chunk's scratch, allocated and freed by the op itself
        scratch = [t for t in op.allocates if t in op.frees]
        assert [program.tensors[t] for t in scratch] == [LOSS_SCRATCH_ROWS * chunk * vocab * 4] == [2 * chunk * vocab * 4]
    assert max(program.tensors.values()) < rows * vocab * 4


def test_auto_keeps_the_plain_loss_within_one_chunk_and_on_refuses_returned_logits():
    import autosp
    from autosp.errors import AutoSPError

    plain = _trace("auto", seq_len=64, vocab=256, sp_size=2)  # 32 rows x 256: one chunk of the default budget
    graph = plain.report.forward_graphs[-1].graph
    assert not any(n.target is torch.ops.autosp_testbed.linear_cross_entropy.default for n in graph.nodes)
    assert None in next(n for n in graph.nodes if n.op == "output").args[0]  # return_logits=False all the same
    with pytest.raises(AutoSPError, match="tiled_loss='on' or 'auto'"):
        autosp.AutoSPConfig(sp_size=2, return_logits=False)
    from autosp.export import trace_fake_step
    from experiments.models import build_model

    torch._dynamo.reset()
    with pytest.raises(AutoSPError, match="return_logits=False"):
        trace_fake_step(lambda: build_model("hf-llama", layers=1), seq_len=64, sp_size=2, vocab_size=256,
                        dtype=torch.float32, tiled_loss="on")
