"""Ops read by their schema, not by name tables and argument positions: exact or refused, several spellings each.

Refusals run on a fake process group (graph only); the accepted spellings run on two gloo ranks against a
single-device run of the full sequence (loss and every gradient, fp32 rtol 1e-4 / atol 1e-6).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autosp
from autosp import AutoSPError
from autosp.passes.dynamo.registry import TABLE, op_table
from tests.autosp.cases import loss_of, make_sample, named_grads, reference_and_candidate
from tests.autosp.soundness_models import VOCAB, _Core
from tests.autosp.test_equivalence import FP32_TOL, _check
from tests.harness import fake_process_group, run_on_ranks

SEQ = 32  # 16 tokens per rank on 2 ranks


class _Gate(torch.autograd.Function):
    """A token-local custom Function of two token-sharded inputs (x * sigmoid(g)), with its own backward."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.save_for_backward(x, g)
        return x * torch.sigmoid(g)

    @staticmethod
    def backward(ctx, grad):
        x, g = ctx.saved_tensors
        s = torch.sigmoid(g)
        return grad * s, grad * x * s * (1 - s)


class _ScanInside(torch.autograd.Function):
    """A Function whose forward scans the sequence (cumsum over dim 1)."""

    @staticmethod
    def forward(ctx, x, g):
        return x.cumsum(1) + g

    @staticmethod
    def backward(ctx, grad):
        return grad.flip(1).cumsum(1).flip(1), grad


class _ScanInBackward(torch.autograd.Function):
    """A token-local forward with a backward that scans the sequence (a wrong hand-written gradient)."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad.cumsum(1)


class _WeightGrad(torch.autograd.Function):
    """A Function of tokens and a replicated weight: the weight's gradient sums over the tokens."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(dim=(0, 1))


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class SchemaLM(_Core):
    """Embedding -> (positions, attention) -> pattern -> LM loss; the pattern is chosen by name (picklable)."""

    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = pattern
        head_dim = 32 // self.heads
        self.register_buffer("inv_freq", 1.0 / 100.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("pos_w", torch.randn(4096, 32, 32) * 0.1)
        self.register_buffer("fixed_targets", torch.randint(0, VOCAB, (4096,)))
        self.gate = nn.Linear(32, 32)
        self.weight = nn.Parameter(torch.ones(32))

    # -- RoPE from arange, three spellings (one per q / k / v) -----------------------------------------------
    def _rotary(self, t, spelling):
        if spelling == "einsum":
            freqs = torch.einsum("i,j->ij", t, self.inv_freq)
        elif spelling == "outer":
            freqs = torch.outer(t, self.inv_freq)
        else:
            freqs = t[:, None] @ self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    def rope_attend(self, x):
        b, s, h = x.shape
        t = torch.arange(s, dtype=torch.float32)
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        rotated = []
        for y, spelling in ((q, "einsum"), (k, "outer"), (v, "matmul")):
            cos, sin = self._rotary(t, spelling)
            rotated.append(y * cos + _rotate_half(y) * sin)
        y = F.scaled_dot_product_attention(*rotated, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, s, h))

    def forward(self, input_ids, labels=None, attention_mask=None):
        p = self.pattern
        x = self.embed(input_ids)
        x = self.rope_attend(x) if p == "rope" else self.attend(x)
        extra = 0.0
        # exact spellings
        if p == "norms_and_max":
            # p and dim bound by name: x.norm(1, -1) is an L1 norm over the hidden dim, not a norm over dim 1
            n = x.norm(1, -1, keepdim=True) + torch.norm(x, p=2, dim=-1, keepdim=True)
            x = x / (n + torch.linalg.vector_norm(x, dim=-1, keepdim=True) + x.norm(dim=2, keepdim=True))
            y = torch.tanh(x)  # the elementwise forms of max and min
            x = torch.max(x, y) + torch.min(x, y) + x.max(y) + x.min(other=y)
        elif p == "mask_and_function":  # the mask is token-sharded; a token-local Function of two inputs
            x = _Gate.apply(x, self.gate(x)) * attention_mask[..., None].to(x.dtype)
        elif p == "router_gather_scatter":  # a router's row-wise picks; the in-place scatter_ a statement
            scores = torch.sigmoid(self.gate(x))
            picked = scores.topk(4, dim=-1).indices
            chosen = torch.zeros_like(scores)
            chosen.scatter_(-1, picked, 1.0)  # recorded as a node nobody uses: it must not be dropped
            weights = scores.gather(-1, picked) + torch.take_along_dim(scores, picked, dim=-1)
            spread = torch.zeros_like(scores).scatter_add(2, picked, weights)
            x = x * (chosen * scores + spread) + x * weights.sum(-1, keepdim=True)
        elif p == "complex_rope":  # rotary embeddings through complex numbers (DeepSeek-V2's, Llama 4's)
            b, s, h = x.shape
            angles = torch.outer(torch.arange(s, dtype=torch.float32), torch.linspace(0.01, 1.0, h // 2))
            rotation = torch.polar(torch.ones_like(angles), angles)
            x = torch.view_as_real(torch.view_as_complex(x.float().reshape(b, s, h // 2, 2)) * rotation).flatten(2)
        elif p == "buffer_filled_per_token":  # keys assembled in a buffer made like x (multi-head latent attention)
            h = x.shape[-1]
            buffer = x.new_empty(*x.shape[:-1], 2 * h)
            buffer[..., :h].copy_(x)
            buffer[..., h:].copy_(torch.tanh(self.gate(x)))
            x = buffer[..., :h] * buffer[..., h:] + x
        elif p == "loss_read_by_tokens":  # the loss's all-reduce read by token-sharded values
            ce = self.lm_loss(x, labels)[0]
            return (torch.tanh(x).pow(2).mean(-1) * ce).mean()
        # refused spellings
        elif p == "norm_positional":
            extra = x.norm(2, 1).sum()
        elif p == "norm_keywords":
            extra = torch.norm(x, p=2, dim=1).sum()
        elif p == "vector_norm":
            extra = torch.linalg.vector_norm(x, dim=1).sum()
        elif p == "per_token_matmul":
            x = (x.unsqueeze(2) @ self.pos_w[: x.shape[1]]).squeeze(2)
        elif p == "per_token_torch_matmul":
            x = torch.matmul(x.unsqueeze(2), self.pos_w[: x.shape[1]]).squeeze(2)
        elif p == "per_token_bmm":
            x = torch.bmm(x.transpose(0, 1), self.pos_w[: x.shape[1]]).transpose(0, 1)
        elif p == "per_token_einsum":
            x = torch.einsum("bsh,shk->bsk", x, self.pos_w[: x.shape[1]])
        elif p == "per_token_target":
            logits = self.head(x).reshape(-1, VOCAB)
            extra = F.cross_entropy(logits, self.fixed_targets[: logits.shape[0]], reduction="sum")
        elif p == "divide_by_shape":
            x = x / x.shape[1]
        elif p == "divide_by_named_count":
            batch, length, hidden = x.shape
            x = torch.tanh(x)
            x = x / length
        elif p == "multiply_by_size":
            x = x * x.size(1)
        elif p == "divide_by_numel":
            extra = x.sum() / x.numel()
        elif p == "divide_by_numel_of_a_wide_value":  # 2 x 16 x 96 elements: 192 times this rank's tokens
            wide = torch.cat([x, x * 2, x * 3], dim=-1)
            extra = wide.pow(2).sum() / wide.numel()
        elif p == "divide_by_len":
            flat = x.reshape(-1, x.shape[-1])
            extra = (flat.sum(0) / len(flat)).pow(2).sum()
        elif p == "divide_by_shape_minus_one":  # an unbiased variance written out
            extra = ((x - x.mean(1, keepdim=True)).pow(2).sum(1) / (x.shape[1] - 1)).mean()
        elif p == "loss_over_shifted_count":
            return self.lm_loss(x, labels)[0] / (labels.shape[1] - 1)
        elif p == "loss_over_shape":
            return self.lm_loss(x, labels)[0] / input_ids.shape[1]
        elif p == "function_with_scan":
            x = _ScanInside.apply(x, self.gate(x))
        elif p == "function_scan_in_backward":
            x = _ScanInBackward.apply(x)
        elif p == "function_weight_gradient":
            x = _WeightGrad.apply(x, self.weight)
        elif p == "gather_along_tokens":
            x = x.gather(1, torch.zeros_like(x, dtype=torch.long))
        elif p == "gather_from_a_replicated_table":  # a per-position table's rows paired with this rank's tokens
            table = self.pos_w[0, : x.shape[1]].expand(x.shape[0], -1, -1)
            x = x + table.gather(-1, self.gate(x).topk(2, dim=-1).indices)[..., :1]
        elif p == "buffer_of_another_length":  # a buffer made like x but longer: its rows are not x's tokens
            buffer = x.new_zeros(x.shape[0], 2 * x.shape[1], x.shape[2])
            buffer[:, : x.shape[1]].copy_(x)
            x = buffer[:, : x.shape[1]] + x
        elif p == "cond":
            x = torch.cond(self.weight.sum() > 0, lambda y: y.cumsum(1), lambda y: y * 2, (x,))
        return self.lm_loss(x, labels)[0] + 0.1 * extra


REFUSED = [
    ("norm_positional", r"Tensor.norm in module <model> \(test_op_schemas.py:\d+\) reduces over the token axis \(norm\)"),
    ("norm_keywords", r"torch.norm in module .* reduces over the token axis \(norm\)"),
    ("vector_norm", r"torch.linalg_vector_norm in module .* reduces over the token axis"),
    ("per_token_matmul", r"operator.matmul in module .* replicated tensor .* one entry per local token"),
    ("per_token_torch_matmul", r"torch.matmul in module .* replicated tensor .* one entry per local token"),
    ("per_token_bmm", r"torch.bmm in module .* replicated tensor .* one entry per local token"),
    ("per_token_einsum", r"torch.einsum in module .* replicated tensor .* one entry per local token"),
    ("per_token_target", r"torch.nn.functional.cross_entropy in module .* replicated tensor .* one entry per local"),
    ("divide_by_shape", r"operator.truediv .* by 16, a multiple of this rank's 16 tokens"),
    ("divide_by_named_count", r"operator.truediv .* by 16, a multiple of this rank's 16 tokens"),
    ("multiply_by_size", r"operator.mul .* by 16, a multiple of this rank's 16 tokens"),
    ("divide_by_numel", r"by 1024, a multiple of this rank's 16 tokens"),
    ("divide_by_len", r"by 32, a multiple of this rank's 16 tokens"),
    ("divide_by_numel_of_a_wide_value", r"by 3072, a multiple of this rank's 16 tokens"),
    ("loss_over_shape", r"operator.truediv .* scales a sum over the sequence by 16"),
    ("divide_by_shape_minus_one", r"operator.truediv .* by 15, one off of this rank's 16 tokens"),
    ("loss_over_shifted_count", r"operator.truediv .* by 15, one off of this rank's 16 tokens"),
    ("function_with_scan", r"custom autograd.Function whose forward is not token-local: Tensor.cumsum"),
    ("function_scan_in_backward", r"custom autograd.Function whose backward is not token-local: Tensor.cumsum"),
    ("function_weight_gradient", r"custom autograd.Function whose backward mixes tokens.*move the sequence-mixing"),
    ("cond", r"higher-order op cond with the token-sharded operand"),
    ("buffer_of_another_length", r"Tensor.copy_ in module .* token-sharded"),
    ("gather_along_tokens", r"Tensor.gather in module .* gather along dim 1, the token axis"),
    ("gather_from_a_replicated_table", r"Tensor.gather in module .* pairs the token-sharded rows of one operand"),
]


@pytest.mark.parametrize(("pattern", "message"), REFUSED, ids=[r[0] for r in REFUSED])
def test_op_schemas_refused_with_op_module_and_fix(pattern, message):
    ids, labels = make_sample(SEQ, VOCAB, seed=0)
    with fake_process_group(2, rank=1):
        compiled = autosp.compile(SchemaLM(pattern), sp_size=2, compiler="aot_eager")
        with pytest.raises(AutoSPError, match=message):
            compiled(**autosp.prepare_inputs(ids, labels=labels))


def test_op_schemas_registry_is_one_table():
    table = op_table()
    assert table["norm"] == table["linalg_vector_norm"] == "reduction (over the sequence: all-reduced sums)"
    assert table["outer"] == table["einsum"] == "token-local: matmul"
    families = {entry.family for entry in TABLE.by_name.values()} | {e.family for _, e in TABLE.by_predicate}
    assert {"pointwise", "views", "reductions", "matmul", "indexing", "random_ops", "positions", "factories",
            "higher_order"} <= families


# ---- exact spellings, on two gloo ranks --------------------------------------------------------------------
EXACT = ["norms_and_max", "rope", "mask_and_function", "loss_read_by_tokens", "router_gather_scatter",
         "complex_rope", "buffer_filled_per_token"]


def _padding_mask(ids):
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # a left-padded row
    mask[1, 20] = 0
    return mask


def _exact_cases(rank, world, patterns):
    results = []
    for pattern in patterns:
        reference, candidate = reference_and_candidate(functools.partial(SchemaLM, pattern))
        ids, labels = make_sample(SEQ, VOCAB, seed=5)
        mask = _padding_mask(ids)
        ref = loss_of(reference(input_ids=ids, labels=labels, attention_mask=mask))
        ref.backward()
        compiled = autosp.compile(candidate, sp_size=world, compiler="aot_eager")
        out = loss_of(compiled(**autosp.prepare_inputs(ids, labels=labels, attention_mask=mask)))
        out.backward()
        autosp.sync_gradients(compiled)
        results.append({"loss": out.detach(), "ref_loss": ref.detach(), "grads": named_grads(candidate),
                        "ref_grads": named_grads(reference),
                        "classes": dict(compiled.report.op_classes)})
    return results


def test_op_schemas_accepted_spellings_are_exact_two_ranks():
    results = run_on_ranks(_exact_cases, 2, EXACT, timeout_s=600)
    classes = [r.pop("classes") for r in results[0]]
    for per_rank in results[1]:
        per_rank.pop("classes")
    _check(results, FP32_TOL)
    assert classes[0]["Tensor.norm"] == "reduction (over the sequence: all-reduced sums)"
    assert classes[1]["torch.outer"] == "token-local: matmul"
    assert any("custom autograd.Function" in c for c in classes[2].values())
    assert classes[4]["Tensor.gather"] == classes[4]["Tensor.scatter_"] == "token-local: row-wise gather and scatter"
    assert classes[5]["torch.polar"] == "token-local: elementwise"
    assert classes[5]["torch.view_as_complex"] == classes[5]["torch.view_as_real"] == "token-local: layout"


# ---- token counts read from a dynamic shape (Note [Token counts]) ----------------------------------------------
def _counts_and_positions(x):
    positions = torch.arange(x.shape[1], dtype=x.dtype)[None, :, None]
    return x / x.shape[1] + x * x.size(1) - x / x.numel() + positions


def _traced_shard(fn, full, *, sp_size, sp_rank):
    """``fn`` traced by Dynamo with a dynamic sequence dim on rank ``sp_rank``'s shard, analysed, and run on it."""
    from autosp.context import TraceContext
    from autosp.inputs import ShardLayout
    from autosp.passes.dynamo.sharding import analyse_sequence_sharding

    local = full.shape[1] // sp_size
    shard = full[:, sp_rank * local : (sp_rank + 1) * local].clone()
    layout = ShardLayout(full.shape[1], full.shape[1], local, sp_rank * local)
    ctx = TraceContext(sp_size=sp_size, sp_rank=sp_rank, group_name="", ignore_index=-100, layout=layout)
    graphs = []

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "placeholder" and isinstance(node.meta.get("example_value"), torch.Tensor):
                node.meta["autosp_role"] = "input_ids"
        analyse_sequence_sharding(gm, ctx)
        gm.recompile()
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    torch._dynamo.mark_dynamic(shard, 1)
    out = torch.compile(fn, backend=backend, fullgraph=True)(shard)
    return out, graphs[0]


def test_op_schemas_dynamic_token_counts_and_positions_are_global():
    full = torch.randn(2, 24, 4)
    expected = _counts_and_positions(full)
    for rank in (0, 2):
        out, gm = _traced_shard(_counts_and_positions, full, sp_size=3, sp_rank=rank)
        torch.testing.assert_close(out, expected[:, rank * 8 : (rank + 1) * 8], rtol=1e-5, atol=1e-6)
    assert any(n.target is torch.arange for n in gm.graph.nodes)


def test_op_schemas_dynamic_token_count_derived_non_linearly_is_refused():
    def squared(x):
        return x / (x.shape[1] * x.shape[1])

    with pytest.raises(AutoSPError, match="derived non-linearly from this rank's token count"):
        try:
            _traced_shard(squared, torch.randn(2, 8, 4), sp_size=2, sp_rank=1)
        except torch._dynamo.exc.BackendCompilerFailed as err:
            raise err.inner_exception from None
