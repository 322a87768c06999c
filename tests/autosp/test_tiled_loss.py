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
from autosp.errors import AutoSPError
from tests.autosp.cases import (
    compiled_step_against_single_device,
    measured_step_peak,
    rows_by,
    traced_step,
    two_ranks_fixture,
)
from tests.autosp.test_equivalence import FP32_TOL, _check, checked_cases


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
        "logits": _logits_read(out),
        "op_class": compiled.report.op_classes.get(str(tiled)),
    }


def _logits_read(out) -> str | None:
    """What reading the compiled model's ``logits`` gives: "tensor", the error it raises, or None (a plain loss
    output; a picklable summary for the ranks' results)."""
    if isinstance(out, torch.Tensor):
        return None
    try:
        out.logits.shape  # noqa: B018 - the read under test
    except AutoSPError as err:
        return f"AutoSPError: {err}"
    return "tensor" if isinstance(out.logits, torch.Tensor) else repr(out.logits)


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


two_ranks = two_ranks_fixture(_tiled_case, _CASES, _peak)


def test_tiled_loss_equals_single_device_untiled_training_on_two_ranks(two_ranks):
    for case, r in checked_cases([r["cases"] for r in two_ranks], _CASES):
        assert r["tiled"], f"{case}: the tiled op is not in the compiled graphs"
        if case["model"].startswith("hf-"):  # Note [Dropped logits]: reading them raises, naming the option
            assert "return_logits=False" in r["logits"], f"{case}: {r['logits']}"
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
    return traced_step("hf-llama", vocab=vocab, seq_len=seq_len, sp_size=sp_size, tiled_loss=tiled_loss,
                       return_logits=tiled_loss == "off", loss_chunk_tokens=chunk)


def test_traced_graphs_hold_no_tokens_by_vocab_tensor():
    seq_len, vocab, sp_size = 1024, 32000, 2
    rows = seq_len // sp_size
    assert rows_by(_trace("off", seq_len=seq_len, vocab=vocab, sp_size=sp_size), rows, vocab)
    tiled = _trace("auto", seq_len=seq_len, vocab=vocab, sp_size=sp_size, chunk=128)
    assert not rows_by(tiled, rows, vocab)


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
    from autosp.tracing import trace_fake_step
    from experiments.models import build_model

    torch._dynamo.reset()
    with pytest.raises(AutoSPError, match="return_logits=False"):
        trace_fake_step(lambda: build_model("hf-llama", layers=1), seq_len=64, sp_size=2, vocab_size=256,
                        dtype=torch.float32, tiled_loss="on")


# Note [Dropped logits] in autosp/passes/dynamo/tiled_loss.py, in one process: a fake group of one rank, sp_size=1.
_SMALL = {"layers": 1, "hidden": 32, "vocab": 256}
_DROPPED = {"tiled_loss": "on", "return_logits": False, "loss_chunk_tokens": 5}
_SEED = 300


def _one_rank_step(options: dict, *, seq_len: int = 24):
    """One step of a small Hugging Face Llama compiled at sp_size=1 under ``options`` against the same step
    untiled on one device: (the comparison `_check` reads, the compiled model's output, the model, the reference)."""
    from experiments.models import build_model
    from tests.harness.fake_group import fake_process_group

    torch.manual_seed(0)
    reference = build_model("hf-llama", **_SMALL)
    with fake_process_group(1), pytest.warns(UserWarning, match="sp_size=1"):
        result, compiled = compiled_step_against_single_device(0, 1, reference, sp_size=1, seq_len=seq_len,
                                                               options=options, seed=_SEED)
    tiled = torch.ops.autosp_testbed.linear_cross_entropy.default
    assert any(n.target is tiled for n in dict(compiled.report.aot_graphs)["forward"].graph.nodes) == (
        compiled.config.tiled_loss == "on")
    out = result.pop("output")
    _check([[result]], FP32_TOL)  # the loss and every gradient equal the untiled single-device step
    return out, compiled, reference


def _assert_every_use_raises(logits, match: str) -> None:
    assert logits is not None  # not None: the output still says the model has logits, uncomputed
    for use in (lambda x: x.shape, lambda x: x.argmax(-1), lambda x: x.float(), lambda x: x[:, -1], bool, len,
                lambda x: x + 1, lambda x: torch.zeros(1) * x, lambda x: torch.softmax(x, -1),
                lambda x: F.cross_entropy(x, torch.zeros(1, dtype=torch.long)), lambda x: torch.cat([x, x]),
                lambda x: x == 0, list):
        with pytest.raises(AutoSPError, match=match):
            use(logits)


def test_dropped_logits_raise_naming_return_logits_and_the_step_stays_exact():
    """return_logits=False passed explicitly: the tiled step is exact, and every use of ``outputs.logits`` (and of
    ``outputs["logits"]``, ``outputs[1]``: the positions of the untiled output) raises an AutoSPError naming it.

    Runs the real path once the compiled model's forward calls `mark_dropped_logits` (autosp.model)."""
    out, _, _ = _one_rank_step(_DROPPED)
    assert list(out.keys())[:2] == ["loss", "logits"] and out[1] is out["logits"] is out.logits
    _assert_every_use_raises(out.logits, r"return_logits=False with tiled_loss='on'.*return_logits=True")
    assert "return_logits" in repr(out.logits)  # printing the output still works
    # Probes answer as for a plain object: the Trainer's mixed precision (accelerate) walks the outputs with
    # hasattr(x, "dtype") and leaves the placeholder as it is.
    from accelerate.utils import convert_to_fp32

    assert not hasattr(out.logits, "dtype") and convert_to_fp32(out).logits is out.logits


def test_a_planned_tiled_loss_names_the_memory_plan_and_return_logits(monkeypatch):
    """The default memory plan choosing tiled_loss="on" with return_logits=False (a stand-in for the planner's
    decision, whose real choice tests/autosp/test_planner.py trains on two ranks): the user's code reading
    ``outputs.logits`` gets an error naming the plan and return_logits, never a silent None."""
    import autosp.plan.auto as auto

    chosen = {"tiled_loss": "on", "return_logits": False, "loss_chunk_tokens": 5}

    def decide(module, config, group, *, seq_len, explicit, **_):
        return {"options": dict(chosen), "explicit": dict(explicit), "setup": {"seq_len": seq_len}}

    class NoPlanner:  # the planner process the plan would start; decide above asks none
        def close(self):
            pass

    monkeypatch.setattr(auto, "decide", decide)
    out, compiled, _ = _one_rank_step({"target_memory": 2**30, "planner": NoPlanner()})  # memory_plan: the default
    assert compiled.config.memory_plan == "auto" and compiled.report.memory_plan["options"] == chosen
    _assert_every_use_raises(out.logits, r"memory plan \(memory_plan='auto'.*return_logits=False.*return_logits=True")


def test_return_logits_with_the_plain_loss_returns_the_logits():
    """return_logits=True (the default) and tiled_loss="off": ``outputs.logits`` is the model's logits tensor."""
    from tests.autosp.cases import make_sample

    out, _, reference = _one_rank_step({"tiled_loss": "off", "return_logits": True})
    ids, labels = make_sample(24, _SMALL["vocab"], seed=_SEED)
    with torch.no_grad():
        expected = reference(input_ids=ids, labels=labels).logits
    assert type(out.logits) is torch.Tensor
    torch.testing.assert_close(out.logits.detach(), expected, **FP32_TOL)
