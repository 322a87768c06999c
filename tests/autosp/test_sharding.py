"""The sequence-sharding analysis, table-driven, on a fake process group (graph structure only, no numerics).

Each row is a small model whose forward applies one op to token-sharded activations; the analysis
either classifies the op (token-local, or handled by a rule) or refuses it, naming the op and the fix.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autosp
from autosp import AutoSPError
from tests.autosp.cases import make_sample
from tests.autosp.soundness_models import VOCAB, _Core
from tests.harness import fake_process_group


class OneOp(_Core):
    """Embedding -> attention -> ``op(x)`` -> LM loss.  ``op`` is chosen by name (picklable, traceable)."""

    def __init__(self, op: str):
        super().__init__()
        self.op = op
        self.register_buffer("table", torch.randn(4096, 32))
        self.conv = nn.Conv1d(32, 32, 3, padding=1)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, input_ids, labels=None, position_ids=None):
        x = self.attend(self.embed(input_ids))
        op, extra = self.op, 0.0
        if op == "cumsum":
            x = x.cumsum(dim=1)
        elif op == "conv1d":
            x = self.conv(x.transpose(1, 2)).transpose(1, 2)
        elif op == "token_matmul":
            x = x + (x.transpose(1, 2) @ x).mean() * 0
        elif op == "sliced_buffer":
            x = x + self.table[: x.shape[1]]
        elif op == "dropout":
            x = F.dropout(x, p=0.1, training=True)
        elif op == "amax":
            x = x - x.amax(dim=1, keepdim=True)
        elif op == "shape_count":
            flat = x.reshape(-1, x.shape[-1]).softmax(-1)
            extra = (flat.sum(dim=0) / flat.shape[0]).pow(2).sum()
        elif op == "replicated_parameter":
            extra = self.scale * x.pow(2).mean()
        elif op == "reduction_read_both_ways":
            m = x.mean(dim=1, keepdim=True)
            x = x - m
            extra = m.pow(2).sum()
        elif op == "sequence_slice":
            x = torch.cat([x[:, 1:], x[:, :1]], dim=1)
        elif op == "rms_norm_hidden":
            x = F.rms_norm(x, x.shape[-1:])
        elif op == "einsum_local":
            x = torch.einsum("bsh,hk->bsk", x, torch.eye(x.shape[-1]))
        elif op == "einsum_over_tokens":
            x = x + torch.einsum("bsh,bsk->bhk", x, x).mean() * 0
        elif op == "topk_hidden":
            x = x + x.topk(2, dim=-1).values.sum(-1, keepdim=True)
        elif op == "mean_into_loss":
            extra = x.pow(2).mean()
        elif op == "center":
            x = x - x.mean(dim=1, keepdim=True)
        elif op == "logsumexp":
            x = x - torch.logsumexp(x, dim=1, keepdim=True)
        elif op == "var":
            extra = x.var(dim=1).mean()
        return self.lm_loss(x, labels)[0] + 0.1 * extra


def _compile(model, seq_len=32, world=2):
    with fake_process_group(world, rank=1):
        compiled = autosp.compile(model, sp_size=world, compiler="aot_eager")
        ids, labels = make_sample(seq_len, VOCAB, seed=0)
        loss = compiled(**autosp.prepare_inputs(ids, labels=labels))
        loss.backward()
    return compiled.report


REFUSED = [
    ("cumsum", r"Tensor.cumsum in module <model> \(test_sharding.py:\d+\) works along dim 1, the token axis"),
    ("conv1d", r"has no sequence-sharding rule"),
    ("token_matmul", r"operator.matmul in module <model> .* contracts over the token axis"),
    ("sliced_buffer", r"replicated tensor .* one entry per local token"),
    ("dropout", r"applies dropout \(p=0.1\).*set the model's dropout probabilities to 0"),
    ("amax", r"reduces over the token axis \(amax\).*express it with one of those over the tokens"),
    ("shape_count", r"a multiple of this rank's 16 tokens \(probably read from a tensor's shape"),
    ("replicated_parameter", r"parameter .*scale.* sync_gradients would count it sp_size times"),
    ("reduction_read_both_ways", r"read both by computations every rank repeats"),
    ("sequence_slice", r"indexes the token axis with slice\(1, None, None\)"),
    ("einsum_over_tokens", r"einsum that sums over the token axis"),
]


@pytest.mark.parametrize(("op", "message"), REFUSED, ids=[r[0] for r in REFUSED])
def test_sharding_sequence_mixing_op_without_a_rule_is_refused_naming_op_and_fix(op, message):
    with pytest.raises(AutoSPError, match=message):
        _compile(OneOp(op))


HANDLED = [
    ("rms_norm_hidden", "torch.rms_norm", "token-local unless along the sequence"),
    ("einsum_local", "torch.einsum", "token-local: matmul"),
    ("topk_hidden", "Tensor.topk", "token-local unless along the sequence"),
    ("mean_into_loss", "Tensor.mean", "reduction (over the sequence: all-reduced sums)"),
    ("center", "Tensor.mean", "reduction (over the sequence: all-reduced sums)"),
    ("logsumexp", "torch.logsumexp", "reduction (over the sequence: all-reduced sums)"),
    ("var", "Tensor.var", "reduction (over the sequence: all-reduced sums)"),
]


@pytest.mark.parametrize(("op", "name", "rule_class"), HANDLED, ids=[r[0] for r in HANDLED])
def test_sharding_token_local_or_ruled_op_is_classified(op, name, rule_class):
    report = _compile(OneOp(op))
    assert report.op_classes[name] == rule_class
    assert report.op_classes["torch.nn.functional.scaled_dot_product_attention"] == "attention (Ulysses, ring or hybrid)"


def _all_reduces(report) -> list[str]:
    forward = dict(report.aot_graphs)["forward"]
    return [str(n.target) for n in forward.graph.nodes if "all_reduce" in str(n.target)]


def test_sharding_all_reduce_backward_follows_its_readers():
    # A mean read by the loss: identity backward; a mean read by token-sharded values: summed gradient.
    assert _all_reduces(_compile(OneOp("mean_into_loss"))).count("autosp_testbed.all_reduce_sum.default") == 2
    assert "autosp_testbed.all_reduce_sum_sum_grad.default" in _all_reduces(_compile(OneOp("center")))


def test_sharding_one_token_per_rank_is_refused():
    with pytest.raises(AutoSPError, match="at least 2 tokens per rank"):
        _compile(OneOp("mean_into_loss"), seq_len=2)


def test_sharding_padding_with_a_reduction_over_the_sequence_is_refused():
    with pytest.raises(AutoSPError, match="the padding tokens would count"):
        _compile(OneOp("center"), seq_len=31)


def test_sharding_unrelated_arange_of_shard_length_is_left_alone():
    class HeadRamp(_Core):
        def forward(self, input_ids, labels=None, position_ids=None):
            x = self.attend(self.embed(input_ids))
            ramp = torch.arange(16, dtype=x.dtype)  # 16 = the hidden half, also this rank's token count
            x = x * torch.cat([ramp, ramp]) / 16
            return self.lm_loss(x, labels)[0]

    with fake_process_group(2, rank=1):
        compiled = autosp.compile(HeadRamp(), sp_size=2, compiler="aot_eager")
        ids, labels = make_sample(32, VOCAB, seed=0)
        compiled(**autosp.prepare_inputs(ids, labels=labels)).backward()
    graph = compiled.report.forward_graphs[-1]
    bounds = [tuple(n.args) for n in graph.graph.nodes if n.target is torch.arange]
    assert bounds == [(16,)]  # not shifted to rank 1's offset: it never meets the tokens


def test_sharding_classic_loss_shift_on_one_sample_keeps_shapes_consistent():
    # logits[:, :-1] / labels[:, 1:] removed by the loss rule: the reshapes after them must see the shard's
    # full length (a stale [S/P - 1, V] shape once read as a split token axis).
    from experiments.models import build_model

    model = build_model("plain-llama")
    with fake_process_group(2, rank=1):
        compiled = autosp.compile(model, sp_size=2, compiler="aot_eager")
        ids = torch.randint(0, 256, (1, 128))
        compiled(**autosp.prepare_inputs(ids, labels=ids)).backward()
    assert len(compiled.report.attention_sites) == 2
