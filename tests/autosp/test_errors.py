"""Each user mistake gets a clear AutoSPError before any collective can run (fake group, one process)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autosp
from autosp import AutoSPError
from experiments.models import build_model
from tests.autosp.cases import make_sample
from tests.harness import fake_process_group


def _call(model, ids, labels=None, *, world=2, **compile_options):
    with fake_process_group(world, rank=0):
        compiled = autosp.compile(model, sp_size=world, compiler="aot_eager", **compile_options)
        return compiled(**autosp.prepare_inputs(ids, labels=labels))


def test_errors_sp_size_must_divide_the_group():
    with fake_process_group(4):
        with pytest.raises(AutoSPError, match="sp_size=3 does not divide"):
            autosp.compile(build_model("plain-llama"), sp_size=3)


def test_errors_unknown_option_names_the_valid_ones():
    with fake_process_group(2):
        with pytest.raises(AutoSPError, match="valid options are"):
            autosp.compile(build_model("plain-llama"), sp_size=2, checkpointing_level=3)


def test_errors_without_process_group():
    with pytest.raises(AutoSPError, match="init_process_group"):
        autosp.compile(build_model("plain-llama"), sp_size=2)


def test_errors_unprepared_inputs():
    ids, labels = make_sample(16, 256, seed=0)
    with fake_process_group(2):
        compiled = autosp.compile(build_model("plain-llama"), sp_size=2, compiler="aot_eager")
        with pytest.raises(AutoSPError, match="prepare_inputs"):
            compiled(input_ids=ids, labels=labels)


class _MlpOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(256, 16)
        self.out = nn.Linear(16, 256)

    def forward(self, input_ids, labels=None):
        logits = self.out(self.embed(input_ids))
        return F.cross_entropy(logits[:, :-1].reshape(-1, 256), labels[:, 1:].reshape(-1))


def test_errors_model_without_attention_is_token_local_not_refused():
    # Nothing mixes tokens (every op is token-local), so there is nothing to refuse and no all-to-all.
    ids, labels = make_sample(16, 256, seed=0)
    with fake_process_group(2, rank=0):
        compiled = autosp.compile(_MlpOnly(), sp_size=2, compiler="aot_eager")
        compiled(**autosp.prepare_inputs(ids, labels=labels))
    assert compiled.report.attention_sites == []
    assert compiled.report.op_classes["torch.nn.functional.linear"] == "token-local: matmul"


def test_errors_eager_attention_names_the_module():
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=4, attn_implementation="eager")
    ids, labels = make_sample(16, 256, seed=0)
    with pytest.raises(AutoSPError, match=r"torch.matmul in module model\.layers\.0\.self_attn .*tokens x tokens.*scaled_dot_product_attention"):
        _call(transformers.LlamaForCausalLM(config), ids, labels)


class _GraphBreak(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = build_model("plain-llama", layers=1)

    def forward(self, input_ids, labels=None):
        if input_ids.sum().item() > 0:  # data-dependent control flow: a graph break
            input_ids = input_ids + 0
        return self.inner(input_ids, labels)


def test_errors_graph_break_says_fullgraph_and_where():
    ids, labels = make_sample(16, 256, seed=0)
    with pytest.raises(AutoSPError, match=r"_GraphBreak.forward does not trace as one graph: .* at "
                                          r"test_errors\.py:\d+ in forward\(\).*fullgraph=True"):
        _call(_GraphBreak(), ids, labels)


def test_errors_padding_mask_for_a_model_without_attention_mask_refused():
    ids, labels = make_sample(16, 256, seed=0)
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    assert autosp.prepare_inputs(ids, labels=labels, attention_mask=mask)["attention_mask"] is mask
    # An all-ones mask is dropped: causal attention is exact without it.
    assert "attention_mask" not in autosp.prepare_inputs(ids, labels=labels, attention_mask=torch.ones_like(ids))
    with fake_process_group(2, rank=0):
        compiled = autosp.compile(build_model("plain-llama", layers=1), sp_size=2, compiler="aot_eager")
        with pytest.raises(AutoSPError, match="takes no attention_mask"):
            compiled(**autosp.prepare_inputs(ids, labels=labels, attention_mask=mask))


def test_errors_document_lengths_must_cover_the_row():
    ids, labels = make_sample(16, 256, seed=0)
    assert autosp.prepare_inputs(ids, document_lengths=[5, 11])["position_ids"][1].tolist() == [
        *range(5), *range(11)]
    with pytest.raises(AutoSPError, match="sum to the sequence length"):
        autosp.prepare_inputs(ids, document_lengths=[5, 10])


class _OwnAttention(nn.Module):
    """The plain Llama's embedding and head around one attention the model spells itself (`attend`)."""

    def __init__(self):
        super().__init__()
        self.inner = build_model("plain-llama", layers=1)
        self.qkv = nn.Linear(64, 192)

    def attend(self, q, k, v, input_ids):
        raise NotImplementedError

    def forward(self, input_ids, labels=None):
        x = self.inner.embed(input_ids)
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 4, 16).permute(2, 0, 3, 1, 4)
        x = x + self.attend(q, k, v, input_ids).transpose(1, 2).reshape_as(x)
        logits = self.inner.lm_head(x)
        return F.cross_entropy(logits[:, :-1].reshape(-1, 256), labels[:, 1:].reshape(-1))


class _MaskedAttention(_OwnAttention):
    def __init__(self, bidirectional: bool = False):
        super().__init__()
        self.bidirectional = bidirectional

    def attend(self, q, k, v, input_ids):
        n = input_ids.shape[1]
        if self.bidirectional:  # a mask of constants that is not causal
            mask = torch.ones(n, n, dtype=torch.bool)
        else:  # a causal mask that also reads the tokens
            mask = torch.ones(n, n, dtype=torch.bool).tril() & (input_ids[:, None, None, :] != 3)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_errors_model_built_attention_mask_refused_naming_the_module():
    ids, labels = make_sample(16, 256, seed=0)
    with pytest.raises(AutoSPError, match="test_errors.py:[0-9]+.*one entry per local token"):
        _call(_MaskedAttention(), ids, labels)
    torch._dynamo.reset()
    with pytest.raises(AutoSPError, match="module .* on plain positions, is not causal attention"):
        _call(_MaskedAttention(bidirectional=True), ids, labels)


@pytest.mark.parametrize(
    "labels, message",
    [
        (torch.zeros(2, 15, dtype=torch.long), "must equal input_ids shape|has shape"),
        (torch.zeros(2, 16), "integer ids"),
        (torch.zeros(2, 16, 1, dtype=torch.long), r"\[batch, sequence\]"),
    ],
)
def test_errors_labels_of_wrong_shape_or_dtype(labels, message):
    ids, _ = make_sample(16, 256, seed=0)
    with pytest.raises(AutoSPError, match=message):
        autosp.prepare_inputs(ids, labels=labels)


def test_errors_empty_sequence():
    with pytest.raises(AutoSPError, match="empty sequence"):
        autosp.prepare_inputs(torch.zeros(1, 0, dtype=torch.long))


def test_errors_sequence_shorter_than_sp_size():
    ids, labels = make_sample(3, 256, seed=0)
    with pytest.raises(AutoSPError, match="shorter than sp_size=4"):
        _call(build_model("plain-llama"), ids, labels, world=4)


def test_errors_indivisible_sequence_when_padding_disabled():
    ids, labels = make_sample(15, 256, seed=0)
    with pytest.raises(AutoSPError, match="not divisible by sp_size=2"):
        _call(build_model("plain-llama"), ids, labels, pad_to_multiple=False)


def test_errors_heads_not_divisible_by_sp_size():
    ids, labels = make_sample(64, 256, seed=0)
    with pytest.raises(AutoSPError, match="4 attention heads, not divisible by sp_size=8"):
        _call(build_model("plain-llama", heads=4, kv_heads=4), ids, labels, world=8)


@pytest.mark.parametrize(("heads", "world", "options", "message"), [
    (6, 4, {}, "6 attention heads, not divisible by sp_size=4"),
    (3, 2, {}, "3 attention heads, not divisible by sp_size=2"),
    (6, 8, {"strategy": "hybrid", "ulysses_size": 4}, r"6 attention heads, not divisible by ulysses_size=4.*one of \[1, 2\]"),
])
def test_errors_heads_the_layout_cannot_split_are_refused_at_compile(heads, world, options, message):
    # Issue #50: checked from the model's config by autosp.compile itself, before any forward or trace.
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(hidden_size=heads * 8, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=heads, num_key_value_heads=heads, vocab_size=64))
    with fake_process_group(world):
        with pytest.raises(AutoSPError, match=f"LlamaForCausalLM's config \\(num_attention_heads\\) has {message}"):
            autosp.compile(model, sp_size=world, compiler="aot_eager", **options)
        # The ring splits any number of heads: the same model compiles.
        autosp.compile(model, sp_size=world, compiler="aot_eager", strategy="ring")


def test_a_config_whose_heads_vary_by_layer_is_left_to_the_attention_rule():
    """A config that refuses the global ``num_attention_heads`` read (transformers raises for per-layer attributes,
    e.g. dots3) is not a raw crash at compile: the heads are checked per attention call when traced."""
    from autosp.api import check_heads
    from autosp.config import AutoSPConfig

    class PerLayerConfig:
        @property
        def num_attention_heads(self):
            raise RuntimeError("'num_attention_heads' is a per-layer attribute and may vary across layers")

    model = nn.Linear(2, 2)
    model.config = PerLayerConfig()
    check_heads(model, AutoSPConfig(sp_size=8))  # no error: nothing global to check


class _Unshifted(nn.Module):
    """Computes a loss that does not shift labels (a token-classification loss)."""

    def __init__(self):
        super().__init__()
        self.inner = build_model("plain-llama", layers=1)

    def forward(self, input_ids, labels=None):
        logits = self.inner(input_ids)
        return F.cross_entropy(logits.reshape(-1, 256), labels.reshape(-1))


def test_errors_loss_without_label_shift_refused():
    ids, labels = make_sample(16, 256, seed=0)
    with pytest.raises(AutoSPError, match="shifts its labels"):
        _call(_Unshifted(), ids, labels)


class _Bidirectional(_OwnAttention):
    def attend(self, q, k, v, input_ids):
        return F.scaled_dot_product_attention(q, k, v, is_causal=False)


def test_errors_padding_under_non_causal_attention_refused():
    ids, labels = make_sample(15, 256, seed=0)
    with pytest.raises(AutoSPError, match="non-causal attention"):
        _call(_Bidirectional(), ids, labels)


def test_errors_sp_size_one_warns_and_compiles_plainly():
    model = build_model("plain-llama", layers=1)
    ids, labels = make_sample(16, 256, seed=0)
    expected = model(ids, labels)
    with fake_process_group(1):
        with pytest.warns(UserWarning, match="sp_size=1"):
            compiled = autosp.compile(model, sp_size=1, compiler="aot_eager")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            loss = compiled(**autosp.prepare_inputs(ids, labels=labels))
    torch.testing.assert_close(loss, expected)


def test_errors_recompile_limit_says_what_to_do_not_graph_break():
    # The model's calls raise torch.compile's per-function limit to max_programs (Note [One program per length])
    # unless it is higher already; the limit is shared by every instance of the class, so with both at 1 a second
    # instance's first compile is over it.
    ids, labels = make_sample(16, 256, seed=0)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1):
        _call(build_model("plain-llama"), ids, labels, max_programs=1)
        with pytest.raises(AutoSPError, match=r"recompile limit .*max_programs=1.*torch._dynamo.reset\(\)"):
            _call(build_model("plain-llama"), ids, labels, max_programs=1)  # a second instance compiles again


def test_errors_data_parallel_wrapper_refused_with_the_fix():
    from torch.nn.parallel import DistributedDataParallel

    ids, labels = make_sample(16, 256, seed=0)
    with fake_process_group(2, rank=0):
        compiled = autosp.compile(build_model("plain-llama"), sp_size=2, compiler="aot_eager")
        wrapped = DistributedDataParallel(compiled)
        with pytest.raises(AutoSPError, match="DistributedDataParallel.*already sums its gradients"):
            wrapped(**autosp.prepare_inputs(ids, labels=labels))


def test_errors_sync_gradients_is_a_no_op_and_refused_where_an_engine_reduces():
    """The model reduces its gradients in backward: sync_gradients (per micro-batch too) changes nothing; once
    DeepSpeed's mpu took the reduction over, calling it would sum twice and is refused."""
    ids, labels = make_sample(16, 256, seed=0)
    with fake_process_group(2, rank=0):
        compiled = autosp.compile(build_model("plain-llama"), sp_size=2, compiler="aot_eager")
        compiled(**autosp.prepare_inputs(ids, labels=labels)).backward()
        before = {n: p.grad.clone() for n, p in compiled.named_parameters()}
        autosp.sync_gradients(compiled)
        autosp.sync_gradients(compiled)
        for n, p in compiled.named_parameters():
            assert torch.equal(p.grad, before[n]), n
        with pytest.raises(AutoSPError, match="SequenceParallelMPU takes the model from autosp.compile"):
            autosp.SequenceParallelMPU(compiled.groups)
        autosp.SequenceParallelMPU(compiled)
        assert not compiled.reduces_gradients
        with pytest.raises(AutoSPError, match="reduced by DeepSpeed.*would sum them again"):
            autosp.sync_gradients(compiled)


def test_errors_state_dict_has_the_original_keys_and_loads_into_the_plain_model():
    model = build_model("plain-llama")
    keys = set(model.state_dict())
    with fake_process_group(2, rank=0):
        compiled = autosp.compile(model, sp_size=2, compiler="aot_eager")
    assert set(compiled.state_dict()) == keys
    assert sum(1 for _ in compiled.parameters()) == sum(1 for _ in model.parameters())
    build_model("plain-llama").load_state_dict(compiled.state_dict())


def test_errors_model_dynamo_cannot_capture_whole_is_refused_naming_the_construct():
    class Logs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = build_model("plain-llama")

        def forward(self, input_ids, labels=None):
            print("step")  # a graph break under fullgraph
            return self.inner(input_ids, labels)

    ids, labels = make_sample(16, 256, seed=0)
    with pytest.raises(AutoSPError, match=r"Logs.forward does not trace as one graph: .*test_errors.py:\d+ in forward\(\)"):
        _call(Logs(), ids, labels)


@pytest.mark.parametrize("family", ["gpt_neo", "llama"])
def test_errors_of_a_model_with_eager_attention_say_so_and_what_to_change(family):
    """A Hugging Face model that runs eager attention is refused wherever its mask or attention is first met, and
    the refusal adds why and what to change: GPT-Neo has no SDPA attention (its refusal is at the mask's slice of
    the token axis), Llama loaded with attn_implementation='eager' has."""
    import transformers

    if family == "gpt_neo":
        config = transformers.GPTNeoConfig(vocab_size=256, hidden_size=32, num_layers=2, num_heads=4,
                                           attention_types=[[["global", "local"], 1]], window_size=8,
                                           max_position_embeddings=64)
        model, fix = transformers.GPTNeoForCausalLM(config), "GPTNeoForCausalLM has no SDPA attention"
    else:
        config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=4, attn_implementation="eager")
        model, fix = transformers.LlamaForCausalLM(config), "load it with attn_implementation='sdpa'"
    assert model.config._attn_implementation == "eager"
    ids, labels = make_sample(16, 256, seed=0)
    with pytest.raises(AutoSPError) as refused:
        _call(model, ids, labels)
    message = str(refused.value)
    assert "runs eager attention, which AutoSP cannot split over the sequence" in message and fix in message
    assert "\n" not in message


def test_errors_of_a_model_with_sdpa_attention_add_no_eager_note():
    """The note is added only where the model runs eager attention (here: a refusal of attention dropout)."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=4, attn_implementation="sdpa",
                                      attention_dropout=0.1)
    model = transformers.LlamaForCausalLM(config)
    ids, labels = make_sample(16, 256, seed=0)
    with pytest.raises(AutoSPError, match="attention dropout") as refused:
        _call(model, ids, labels)
    assert "eager attention" not in str(refused.value)
