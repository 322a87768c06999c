"""Tiled MLP (autosp/tiled_ops.py, autosp/passes/dynamo/tiled_mlp.py): exact, and no [tokens, intermediate].

- the op alone against the untiled chain: gated (SiLU, no biases) and GPT-2's (tanh-GELU written as arithmetic,
  biases), chunks that do and do not divide the rows, output and every gradient;
- AutoSP with ``tiled_mlp`` on real gloo ranks (SP 2, and sp_size=1 on the same two ranks as data-parallel
  replicas) against single-device untiled training: Hugging Face Llama, Qwen2 and GPT-2, with SAC (the default)
  and with the tiled loss on too, "auto", a padded sequence;
- the traced forward and backward graphs hold no [tokens, intermediate] tensor when on (and do when off); "on"
  without an MLP is refused; "auto" within one chunk keeps the plain MLP;
- the measured per-rank peak memory drops.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autosp.tiled_ops import Ref, encode_expression
from tests.autosp.cases import (
    compiled_step_against_single_device,
    measured_step_peak,
    rows_by,
    traced_step,
    two_ranks_fixture,
)
from tests.autosp.test_equivalence import FP32_TOL, checked_cases

log = logging.getLogger(__name__)
_TILED = torch.ops.autosp_testbed.tiled_mlp.default
_TILED_BACKWARD = torch.ops.autosp_testbed.tiled_mlp_backward.default
_GATED = encode_expression(2, [("silu", [Ref(0)], {}), ("mul", [Ref(2), Ref(1)], {})], 3)
_C = math.sqrt(2.0 / math.pi)
_TANH_GELU = encode_expression(1, [  # HF's NewGELUActivation as Dynamo records it
    ("mul", [0.5, Ref(0)], {}), ("pow", [Ref(0), 3.0], {}), ("mul", [0.044715, Ref(2)], {}),
    ("add", [Ref(0), Ref(3)], {}), ("mul", [_C, Ref(4)], {}), ("tanh", [Ref(5)], {}), ("add", [1.0, Ref(6)], {}),
    ("mul", [Ref(1), Ref(7)], {})], 8)


def _untiled(x, w0, b0, w1, b1, wo, bo, gated):
    if gated:
        return F.linear(F.silu(F.linear(x, w0, b0)) * F.linear(x, w1, b1), wo, bo)
    a = F.linear(x, w0, b0)
    return F.linear(0.5 * a * (1.0 + torch.tanh(_C * (a + 0.044715 * torch.pow(a, 3.0)))), wo, bo)


@pytest.mark.parametrize("gated", [True, False])
def test_op_equals_the_untiled_chain(gated):
    g = torch.Generator().manual_seed(3)
    rows, width, inner = 23, 8, 12
    x = torch.randn(rows, width, generator=g, requires_grad=True)
    w0, wo = torch.randn(inner, width, generator=g), torch.randn(width, inner, generator=g)
    if gated:
        params = [w0, None, torch.randn(inner, width, generator=g), None, wo, None]
    else:  # GPT-2's Conv1D weights are [in, out]: the pass hands the op their transposes
        w0, wo = torch.randn(width, inner, generator=g).t(), torch.randn(inner, width, generator=g).t()
        params = [w0, torch.randn(inner, generator=g), None, None, wo, torch.randn(width, generator=g)]
    params = [p.requires_grad_() if p is not None else None for p in params]
    leaves = [x, *(p for p in params if p is not None)]
    seed = torch.randn(rows, width, generator=g)
    expected = _untiled(x, *params, gated)
    expected_grads = torch.autograd.grad(expected, leaves, seed)
    expression = _GATED if gated else _TANH_GELU
    for chunk in (1, 5, 23, 64):  # 5 does not divide 23 rows; 64 is one chunk
        out = _TILED(x, *params, expression, chunk)
        torch.testing.assert_close(out, expected, **FP32_TOL)
        for got, want in zip(torch.autograd.grad(out, leaves, seed), expected_grads, strict=True):
            torch.testing.assert_close(got, want, **FP32_TOL)
    torch.library.opcheck(_TILED, (x, *params, expression, 5), test_utils=("test_schema", "test_faketensor"))
    needs = [True, *(p is not None for p in params)]
    torch.library.opcheck(_TILED_BACKWARD, (seed, x.detach(), *(p.detach() if p is not None else None for p in params),
                                            expression, 5, needs), test_utils=("test_schema", "test_faketensor"))


def test_bf16_op_within_bf16_tolerance():
    """bf16 parameters: gradients summed over chunks in fp32, returned in bf16, against fp32 autograd."""
    g = torch.Generator().manual_seed(5)
    x, w0, w1, wo = (torch.randn(*shape, generator=g) for shape in ((40, 16), (32, 16), (32, 16), (16, 32)))
    leaves = [t.bfloat16().requires_grad_() for t in (x, w0, w1, wo)]
    out = _TILED(leaves[0], leaves[1], None, leaves[2], None, leaves[3], None, _GATED, 6)
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    reference = [t.detach().float().requires_grad_() for t in leaves]
    want = _untiled(reference[0], reference[1], None, reference[2], None, reference[3], None, True)
    expected = torch.autograd.grad(want, reference, torch.ones_like(want))
    for got, ref in zip((out, *grads), (want.detach(), *expected), strict=True):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))


_STEPS = [  # every op of the expression vocabulary, with literal operands first and last and parameters
    ("add", [Ref(0), Ref(1)], {}), ("add", [1.5, Ref(0)], {"alpha": 1}), ("add", [Ref(0), Ref(1)], {"alpha": 0.5}),
    ("sub", [Ref(0), Ref(1)], {}), ("sub", [2.0, Ref(0)], {}), ("sub", [Ref(0), Ref(1)], {"alpha": 3}),
    ("mul", [Ref(0), Ref(1)], {}), ("mul", [0.25, Ref(1)], {}), ("div", [Ref(0), Ref(1)], {}),
    ("div", [3.0, Ref(1)], {}), ("div", [Ref(0), 4.0], {}), ("pow", [Ref(1), 3.0], {}), ("pow", [2.0, Ref(0)], {}),
    ("pow", [Ref(1), Ref(0)], {}), ("neg", [Ref(0)], {}), ("tanh", [Ref(0)], {}), ("sigmoid", [Ref(0)], {}),
    ("exp", [Ref(0)], {}), ("erf", [Ref(0)], {}), ("sqrt", [Ref(1)], {}), ("rsqrt", [Ref(1)], {}),
    ("square", [Ref(0)], {}), ("reciprocal", [Ref(1)], {}), ("relu", [Ref(0)], {}), ("silu", [Ref(0)], {}),
    ("gelu", [Ref(0)], {}), ("gelu", [Ref(0)], {"approximate": "tanh"}), ("relu6", [Ref(0)], {}),
    ("mish", [Ref(0)], {}), ("softplus", [Ref(0)], {"beta": 2.0, "threshold": 1.0}),
    ("leaky_relu", [Ref(0)], {"negative_slope": 0.2}), ("elu", [Ref(0)], {"alpha": 0.7}), ("hardswish", [Ref(0)], {}),
]


@pytest.mark.parametrize("step", _STEPS, ids=lambda s: f"{s[0]}{[type(a).__name__ for a in s[1]]}{s[2] or ''}")
def test_each_expression_step_has_autograds_gradient(step):
    """The hand-written reverse mode (`expression_vjp`) against autograd on the same expression, one op at a
    time, each result also read by a second step (gradients that add up).  Input 0 spans the activations'
    kinks and input 1 is positive (sqrt, rsqrt, a base of pow)."""
    from autosp.tiled_ops import evaluate_expression, expression_vjp

    g = torch.Generator().manual_seed(7)
    inputs = [torch.linspace(-7, 7, 60).reshape(6, 10), torch.rand(6, 10, generator=g) + 0.5]
    expression = encode_expression(2, [step, ("mul", [Ref(2), Ref(2)], {}), ("add", [Ref(3), Ref(2)], {})], 4)
    seed = torch.randn(6, 10, generator=g)
    leaves = [t.clone().requires_grad_() for t in inputs]
    expected = evaluate_expression(expression, leaves)
    expected_grads = torch.autograd.grad(expected, leaves, seed, allow_unused=True, materialize_grads=True)
    value, grads = expression_vjp(expression, inputs, seed)
    torch.testing.assert_close(value, expected.detach(), **FP32_TOL)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, **FP32_TOL)


def _tiled_case(rank, world, *, model, sp_size, seq_len, options, layers=1):
    from experiments.models import build_model

    torch._dynamo.reset()  # one process compiles many models: stay under torch.compile's recompile limit
    torch.manual_seed(0)
    reference = build_model(model, layers=layers)
    result, compiled = compiled_step_against_single_device(rank, world, reference, sp_size=sp_size, seq_len=seq_len,
                                                           options=options, seed=300)
    result.pop("output")
    graphs = dict(compiled.report.aot_graphs)
    return {
        **result,
        "ops": (sum(n.target is _TILED for n in graphs["forward"].graph.nodes),
                sum(n.target is _TILED_BACKWARD for n in graphs["backward"].graph.nodes)),
        "op_class": compiled.report.op_classes.get(str(_TILED)),
    }


_LOSS = {"tiled_loss": "on", "return_logits": False, "loss_chunk_tokens": 5}
_CASES = [  # make_sample's batch of 2: a rank holds 2 x seq_len / sp_size rows
    {"model": "hf-llama", "sp_size": 2, "seq_len": 32, "layers": 2,
     "options": {"tiled_mlp": "on", "mlp_chunk_tokens": 5}},  # 32 rows: 5 does not divide
    {"model": "hf-qwen2", "sp_size": 2, "seq_len": 32, "options": {"tiled_mlp": "on", "mlp_chunk_tokens": 8}},
    {"model": "hf-gpt2", "sp_size": 2, "seq_len": 32, "options": {"tiled_mlp": "on", "mlp_chunk_tokens": 6, **_LOSS}},
    {"model": "hf-llama", "sp_size": 2, "seq_len": 31,  # padded
     "options": {"tiled_mlp": "auto", "mlp_chunk_tokens": 8, **_LOSS}},
    {"model": "hf-llama", "sp_size": 1, "seq_len": 24, "options": {"tiled_mlp": "on", "mlp_chunk_tokens": 10}},
    {"model": "hf-qwen2", "sp_size": 1, "seq_len": 24, "options": {"tiled_mlp": "on", "mlp_chunk_tokens": 7, **_LOSS}},
    {"model": "hf-gpt2", "sp_size": 1, "seq_len": 24, "options": {"tiled_mlp": "on", "mlp_chunk_tokens": 16}},
]


def _peak(*, tiled: bool, checkpointing: str = "sac", seq_len: int = 1024) -> int:
    """Per-rank peak tensor memory of one step (after a compiling step) of an MLP-heavy Llama (intermediate
    8 x hidden, 2 layers), ``seq_len`` tokens on 2 ranks."""
    import transformers

    torch._dynamo.reset()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                      attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config)
    options = {"tiled_mlp": "on", "mlp_chunk_tokens": 64} if tiled else {}
    return measured_step_peak(model, seq_len=seq_len, vocab=256, checkpointing=checkpointing, **options)


two_ranks = two_ranks_fixture(_tiled_case, _CASES, _peak)


def test_tiled_mlp_equals_single_device_untiled_training_on_two_ranks(two_ranks):
    for case, r in checked_cases([r["cases"] for r in two_ranks], _CASES):
        layers = case.get("layers", 1)
        assert r["ops"] == (layers, layers), f"{case}: {r['ops']} tiled MLP ops in forward, backward"
        if case["sp_size"] > 1:
            assert r["op_class"] == "token-local: tiled MLP"


def test_tiled_mlp_lowers_the_measured_peak_memory_per_rank(two_ranks):
    """With SAC (the default), 512 rows per rank, intermediate 256, 2 layers: each [512, 256] fp32 intermediate
    is 0.5 MiB.  Untiled, SAC recomputes the cheap ops (the activation, the product) but keeps the projections'
    outputs, or rebuilds them whole in backward, and the backward holds them with their gradients; tiled,
    [64, 256] chunks only (the chunk scratch, which PeakMemory sees, included).  Measured: see docs/design.md,
    "Tiled MLP"."""
    inner = 512 * 256 * 4
    for rank, r in enumerate(two_ranks):
        peaks = r["peaks"]
        log.info("rank %d peak bytes: %s", rank, peaks)
        assert peaks["untiled"] - peaks["tiled"] >= 2 * inner, peaks


def _trace(model: str, *, seq_len: int, sp_size: int = 2, **options):
    return traced_step(model, vocab=320, seq_len=seq_len, sp_size=sp_size, **options)


@pytest.mark.parametrize(("model", "inner"), [("hf-llama", 128), ("hf-qwen2", 128), ("hf-gpt2", 256)])
def test_traced_graphs_hold_no_tokens_by_intermediate_tensor(model, inner):
    """192 tokens on 2 ranks: 96 rows of hidden 64 per rank (more rows than the hidden size, so no weight has as
    many elements as a [rows, intermediate] tensor; a vocabulary of 320, unlike any intermediate)."""
    rows = 96
    if model == "hf-llama":  # the check can fail: untiled, the intermediates are there
        assert rows_by(_trace(model, seq_len=192), rows, inner)
    tiled = _trace(model, seq_len=192, tiled_mlp="on", mlp_chunk_tokens=32)
    assert not rows_by(tiled, rows, inner)
    assert any(n.target is _TILED for n in dict(tiled.report.aot_graphs)["forward"].graph.nodes)


def test_export_prices_the_tiled_mlp_as_its_matmuls():
    """Llama's gated MLP (two input projections, no biases; hidden 64, intermediate 128) on 96 rows, 32-row
    chunks: forward 2·N·I·(2H + H), backward the recomputed projections, the activation's gradient, the input's
    and the three weights' (2·N·I·(2H + H + 2H + 2H + H)); one chunk's intermediates as scratch."""
    from autosp.export import export_workload

    rows, width, inner, chunk = 96, 64, 128, 32
    compiled = _trace("hf-llama", seq_len=192, tiled_mlp="on", mlp_chunk_tokens=chunk)
    program = export_workload(compiled.report.aot_graphs, name="tiled", sp_size=2, parameter_bytes=0).program(0)
    tiled = {op.phase: op for op in program.ops if "tiled_mlp" in op.name}
    assert tiled.keys() == {"forward", "backward"}
    assert (tiled["forward"].op_class, tiled["forward"].flops) == ("matmul", 2 * rows * inner * 3 * width)
    assert (tiled["backward"].op_class, tiled["backward"].flops) == ("matmul", 2 * rows * inner * 8 * width)
    steps = 2  # silu, mul
    for op, buffers in ((tiled["forward"], 2 + 2), (tiled["backward"], 2 * 2 + 2 + steps)):
        scratch = [program.tensors[t] for t in op.allocates if t in op.frees]
        assert scratch == [buffers * chunk * inner * 4]
    from autosp.plan.candidates import MLP_SCRATCH_ROWS  # the planner's chunk rule counts backward's scratch

    assert MLP_SCRATCH_ROWS == 2 * 2 + 2 + steps


class _NoMLP(nn.Module):
    """Embedding -> one linear -> output projection: no elementwise chain between two projections."""

    def __init__(self, vocab: int = 256, width: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.mix(self.embed(input_ids)))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def test_on_without_an_mlp_is_refused_and_auto_within_one_chunk_keeps_the_plain_mlp():
    from autosp import AutoSPConfig
    from autosp.errors import AutoSPError
    from autosp.tracing import trace_fake_step

    torch._dynamo.reset()
    with pytest.raises(AutoSPError, match="tiled_mlp='on': the graph has no MLP-shaped chain"):
        trace_fake_step(_NoMLP, seq_len=16, sp_size=1, vocab_size=256, dtype=torch.float32, tiled_mlp="on")
    plain = _trace("hf-llama", seq_len=64, tiled_mlp="auto")  # 32 rows: one chunk of the default budget
    assert not any(n.target is _TILED for n in plain.report.forward_graphs[-1].graph.nodes)
    for bad in ({"tiled_mlp": "yes"}, {"mlp_chunk_tokens": 0}, {"mlp_chunk_tokens": 2.5}):
        with pytest.raises(AutoSPError, match=next(iter(bad))):
            AutoSPConfig(sp_size=2, **bad)
