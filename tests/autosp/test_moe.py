"""Mixture-of-experts models under AutoSP: dropless top-k routing exact, capacity-based routing refused.

Hugging Face Mixtral, Qwen2-MoE and Qwen3-MoE (their default ``grouped_mm`` experts sort
each shard's tokens by expert: Note [MoE dispatch as a shard-local permutation]) with the
router auxiliary loss on (``output_router_logits=True``): the loss, the auxiliary loss and
every gradient equal a single-device run on the full sequence (fp32 rtol 1e-4 / atol 1e-6)
on 2 and 4 real gloo ranks.  Dispatches that are not per-token are refused on a fake group.
"""

from __future__ import annotations

import copy

import pytest
import torch

import autosp
from autosp.errors import AutoSPError
from tests.autosp.cases import FP32_TOL, make_sample, named_grads
from tests.harness import fake_process_group, run_on_ranks

VOCAB = 128


def build_moe(family: str, experts: str | None = None, **_) -> torch.nn.Module:
    """A tiny Hugging Face MoE decoder: 2 layers, hidden 32, 4 experts, top-2, router aux loss on.

    ``experts``: Hugging Face's experts implementation (default: its own, ``grouped_mm``)."""
    import transformers

    extra = {"experts_implementation": experts} if experts else {}
    common = dict(**extra, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2, attn_implementation="sdpa",
                  output_router_logits=True, router_aux_loss_coef=0.1, max_position_embeddings=256)
    if family == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(num_local_experts=4, **common))
    elif family == "qwen2-moe":
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32, use_sliding_window=False,
            **common))
    elif family == "qwen3-moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            num_experts=4, moe_intermediate_size=32, **common))
    else:
        raise ValueError(family)
    model.train()
    return model


def _moe_cases(rank, world, cases, seq_len):
    """Each case: (family, options); options ``experts`` (HF experts implementation), ``padding`` (right padding
    with an attention mask: the aux loss then counts tokens through the mask, a ``scatter_add_`` of the
    token-sharded mask and a sum of it, exact like the unmasked count)."""
    sp_size = world
    out = []
    for family, options in cases:
        torch._dynamo.reset()
        torch.manual_seed(0)
        reference = build_moe(family, **options)
        candidate = copy.deepcopy(reference)
        ids, labels = make_sample(seq_len, VOCAB, seed=7)
        mask = None
        if options.get("padding"):
            mask = torch.ones_like(ids)
            mask[1, -5:] = 0
            labels = labels.masked_fill(mask == 0, -100)
        ref = reference(input_ids=ids, labels=labels, attention_mask=mask)
        ref.loss.backward()
        compiled = autosp.compile(candidate, sp_size=sp_size, compiler="aot_eager")
        case = {"family": f"{family} {options}"}
        got = compiled(**autosp.prepare_inputs(ids, labels=labels, attention_mask=mask))
        got.loss.backward()
        autosp.sync_gradients(compiled)
        out.append({**case, "loss": got.loss.detach(), "ref_loss": ref.loss.detach(),
                    "aux": got.aux_loss.detach(), "ref_aux": ref.aux_loss.detach(),
                    "grads": named_grads(candidate), "ref_grads": named_grads(reference),
                    "classes": dict(compiled.report.op_classes)})
    return out


def _check(results):
    for rank, per_case in enumerate(results):
        for r in per_case:
            where = f"{r['family']} rank {rank}"
            torch.testing.assert_close(r["loss"], r["ref_loss"], **FP32_TOL, msg=lambda m, w=where: f"{w} loss: {m}")
            torch.testing.assert_close(r["aux"], r["ref_aux"], **FP32_TOL, msg=lambda m, w=where: f"{w} aux: {m}")
            assert r["grads"].keys() == r["ref_grads"].keys()
            for name, grad in r["grads"].items():
                reference = r["ref_grads"][name]
                assert reference.abs().max() > 0, f"{where} grad {name} is zero: the comparison would be vacuous"
                torch.testing.assert_close(grad, reference, **FP32_TOL,
                                           msg=lambda m, w=f"{where} grad {name}": f"{w}: {m}")
            assert any("MoE dispatch" in c or "layout" in c for c in r["classes"].values()), where


def test_moe_two_ranks_mixtral_qwen2_qwen3_exact_with_router_aux_loss():
    cases = [("mixtral", {}), ("qwen2-moe", {}), ("qwen3-moe", {}), ("qwen3-moe", {"experts": "batched_mm"}),
             ("mixtral", {"padding": True})]
    _check(run_on_ranks(_moe_cases, 2, cases, 16, timeout_s=600))


@pytest.mark.slow
def test_moe_four_ranks_mixtral_and_qwen3_exact_with_router_aux_loss():
    _check(run_on_ranks(_moe_cases, 4, [("mixtral", {}), ("qwen3-moe", {})], 16, timeout_s=600))


class _RoutedLM(torch.nn.Module):
    """Embedding, a top-1 routed MLP dispatched as ``dispatch`` spells it, and an LM head (no attention)."""

    def __init__(self, dispatch: str, hidden: int = 16, experts: int = 4):
        super().__init__()
        self.dispatch = dispatch
        self.embed = torch.nn.Embedding(VOCAB, hidden)
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.w = torch.nn.Parameter(torch.randn(experts, hidden, hidden) * 0.1)
        self.head = torch.nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, input_ids, labels=None, position_ids=None):
        b, s = input_ids.shape
        x = self.embed(input_ids).reshape(b * s, -1)
        probs = self.router(x).softmax(-1)
        weight, expert = probs.max(-1)
        if self.dispatch == "expert-choice":  # each expert picks its top tokens: capacity over the whole batch
            _, chosen = torch.topk(probs, k=max(1, (b * s) // 4), dim=0)
            y = x[chosen[:, 0]]
            x = x.index_add(0, chosen[:, 0], y)
        elif self.dispatch == "capacity":  # tokens past an expert's capacity are dropped
            onehot = torch.nn.functional.one_hot(expert, probs.shape[-1])
            position_in_expert = onehot.cumsum(0) * onehot
            keep = (position_in_expert <= 2).any(-1)
            x = x * keep[:, None] * weight[:, None]
        elif self.dispatch in ("grouped", "descending-groups", "coarse-bins"):
            import transformers.integrations.moe  # noqa: F401 - registers torch.ops.transformers.grouped_mm_fallback

            keys, perm = torch.sort(expert, descending=self.dispatch == "descending-groups")
            bins = probs.shape[-1]
            top = bins if self.dispatch == "coarse-bins" else bins - 1  # coarse: bins no longer one per id
            offsets = torch.cumsum(torch.histc(keys.float(), bins=bins, min=0, max=top), dim=0, dtype=torch.int32)
            rows = torch.ops.transformers.grouped_mm_fallback(x[perm], self.w, offs=offsets)
            inverse = torch.empty_like(perm)
            inverse[perm] = torch.arange(perm.shape[0])
            x = x + rows[inverse] * weight[:, None]
        else:
            keys, perm = torch.sort(expert)
            rows = torch.bmm(x[perm][:, None], self.w[keys]).squeeze(1)
            if self.dispatch == "no-inverse":  # scattered back with the permutation itself, not its inverse
                x = x + rows[perm]
            elif self.dispatch == "scan-rows":  # a running sum over the permuted rows mixes tokens
                x = x + rows.cumsum(0)[torch.argsort(perm)]
            elif self.dispatch == "mixed-order":  # permuted rows added to token-ordered ones
                x = x + rows
            elif self.dispatch == "inverse":  # the per-token dispatch, inverse by argsort: accepted
                x = x + rows[torch.argsort(perm)]
        logits = self.head(x).reshape(b, s, -1)
        shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), shifted.reshape(-1), ignore_index=-100)


@pytest.mark.parametrize("dispatch,pattern", [
    ("expert-choice", r"torch.topk .* token axis"),
    ("capacity", r"cumsum .* token axis"),
    ("no-inverse", r"operator.getitem .*shard-local"),
    ("scan-rows", r"cumsum .*shard-local permutation"),
    ("mixed-order", r"operator.add .*rows are in different orders"),
    ("descending-groups", r"torch.histc .*not the sorted expert ids"),
    ("coarse-bins", r"torch.histc .*not one per id"),
])
def test_moe_dispatch_that_is_not_per_token_is_refused(dispatch, pattern):
    ids, labels = make_sample(16, VOCAB, seed=0)
    with fake_process_group(2, rank=0):
        compiled = autosp.compile(_RoutedLM(dispatch), sp_size=2, compiler="aot_eager")
        with pytest.raises(AutoSPError, match=pattern):
            compiled(**autosp.prepare_inputs(ids, labels=labels))


@pytest.mark.parametrize("dispatch", ["inverse", "grouped"])
def test_moe_sort_dispatch_per_token_is_accepted(dispatch):
    ids, labels = make_sample(16, VOCAB, seed=0)
    with fake_process_group(2, rank=0):
        compiled = autosp.compile(_RoutedLM(dispatch), sp_size=2, compiler="aot_eager")
        compiled(**autosp.prepare_inputs(ids, labels=labels))
        assert compiled.report.op_classes["torch.sort"].startswith("token-local: MoE dispatch")
