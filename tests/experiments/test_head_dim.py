"""An attention head width set apart from ``hidden // heads`` (Qwen3, Gemma): every description of a decoder's shape
(`autosp.presets.LlamaSize`, `experiments.models.PaperModel`, `simulator.training_config.TrainingConfig.for_llama`,
`simulator.synthetic.LlamaShape`) sizes the query and output projections ``heads * head_dim`` and the key and value
ones ``kv_heads * head_dim``, as the Hugging Face model built from the same numbers does (on the meta device: no
memory)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from autosp import presets
from experiments import models
from experiments.models import PaperModel, miniature
from experiments.paper_scale.config import training_config
from experiments.paper_scale.gpu_check import model_flops_per_token
from simulator.synthetic import LlamaShape, llama_ulysses_workload
from simulator.training_config import TrainingConfig

# (hidden, intermediate, layers, heads, kv_heads, vocab, head_dim, tied)
SHAPES = {
    "implicit": (64, 160, 2, 8, 2, 256, None, False),
    "implicit-tied": (64, 160, 2, 8, 2, 256, None, True),
    "equal": (64, 160, 2, 8, 2, 256, 8, False),
    "wider": (40, 96, 2, 4, 2, 128, 16, False),  # Qwen3-like: heads * head_dim (64) above hidden
    "wider-tied": (40, 96, 3, 8, 4, 128, 16, True),
    "narrower": (96, 128, 1, 4, 4, 200, 16, False),  # heads * head_dim (64) below hidden
    "narrower-tied": (96, 128, 2, 6, 2, 200, 12, True),
}


def _hf_numels(hidden, intermediate, layers, heads, kv_heads, vocab, head_dim, tied) -> list[int]:
    """Parameter element counts, in module order, of the Hugging Face Llama of these numbers (tied weights once)."""
    extra = {} if head_dim is None else {"head_dim": head_dim}
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, tie_word_embeddings=tied, **extra)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    return [p.numel() for p in model.parameters()]


def _paper(name, hidden, intermediate, layers, heads, kv_heads, vocab, head_dim, tied) -> PaperModel:
    return PaperModel(name=name, hidden_size=hidden, intermediate_size=intermediate, num_layers=layers,
                      num_heads=heads, num_kv_heads=kv_heads, vocab_size=vocab, tie_word_embeddings=tied,
                      head_dim=head_dim)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_head_dim_for_llama_lists_the_hugging_face_tensors(name):
    hidden, intermediate, layers, heads, kv_heads, vocab, head_dim, tied = SHAPES[name]
    cfg = TrainingConfig.for_llama(hidden=hidden, ffn_hidden=intermediate, layers=layers, heads=heads,
                                   kv_heads=kv_heads, vocab=vocab, tied_embeddings=tied, head_dim=head_dim)
    assert list(cfg.parameter_numels) == _hf_numels(*SHAPES[name])


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_head_dim_paper_model_counts_and_builds_the_hugging_face_model(name):
    shape = SHAPES[name]
    paper = _paper(name, *shape)
    expected = _hf_numels(*shape)
    assert paper.parameter_count() == sum(expected)
    assert list(training_config(paper, "autosp").parameter_numels) == expected
    with torch.device("meta"):
        built = transformers.LlamaForCausalLM(paper.hf_config())
    assert [p.numel() for p in built.parameters()] == expected
    attention = built.model.layers[0].self_attn
    assert attention.q_proj.out_features == attention.o_proj.in_features == paper.num_heads * paper.effective_head_dim
    assert attention.k_proj.out_features == paper.num_kv_heads * paper.effective_head_dim


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_head_dim_synthetic_shape_counts_a_hugging_face_layer(name):
    hidden, intermediate, layers, heads, kv_heads, vocab, head_dim, _ = SHAPES[name]
    shape = LlamaShape(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn_hidden=intermediate,
                       vocab=vocab, head_dim=head_dim)
    numels = _hf_numels(hidden, intermediate, layers, heads, kv_heads, vocab, head_dim, False)  # untied, as params
    assert shape.layer_params == sum(numels[1:10]) and shape.params == sum(numels)


def test_head_dim_synthetic_workload_sizes_the_query_side_by_heads_times_head_dim():
    base = LlamaShape(layers=1, hidden=64, heads=4, kv_heads=4, ffn_hidden=128, vocab=256)
    implicit = llama_ulysses_workload(seq_len=256, sp_degree=4, shape=base).program(0)
    explicit = llama_ulysses_workload(seq_len=256, sp_degree=4,
                                      shape=dataclasses.replace(base, head_dim=16)).program(0)
    assert [(o.name, o.flops, o.bytes_read, o.bytes_written) for o in implicit.ops] == \
        [(o.name, o.flops, o.bytes_read, o.bytes_written) for o in explicit.ops]  # 16 is 64 // 4
    wide = llama_ulysses_workload(seq_len=256, sp_degree=4,
                                  shape=dataclasses.replace(base, head_dim=32)).program(0)
    ops = {o.name: o for o in wide.ops}
    local = 256 // 4
    assert ops["L0.q_proj"].flops == 2 * local * 64 * (4 * 32)
    assert ops["L0.o_proj"].flops == 2 * local * (4 * 32) * 64
    assert ops["L0.k_proj"].flops == 2 * local * 64 * (4 * 32)


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_head_dim_presets_build_projections_of_heads_times_head_dim(name):
    size = presets.PRESETS[name]
    config = presets.hf_config(name, seq_len=128, num_layers=2)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    attention = model.model.layers[0].self_attn
    d = size.effective_head_dim
    assert attention.q_proj.out_features == attention.o_proj.in_features == size.heads * d
    assert attention.k_proj.out_features == attention.v_proj.out_features == size.kv_heads * d
    expected = [p.numel() for p in model.parameters()]
    cfg = TrainingConfig.for_llama(hidden=size.hidden, ffn_hidden=size.intermediate, layers=2, heads=size.heads,
                                   kv_heads=size.kv_heads, vocab=size.vocab, tied_embeddings=size.tie_embeddings,
                                   head_dim=size.head_dim)
    assert list(cfg.parameter_numels) == expected
    assert list(models._paper_model(name).training_config(layers=2).parameter_numels) == expected


def test_head_dim_a_preset_sets_a_head_width_apart_from_hidden_over_heads():
    apart = [name for name, s in presets.PRESETS.items() if s.effective_head_dim != s.hidden // s.heads]
    assert apart
    size = presets.PRESETS["qwen3-4b-shaped"]
    assert size.heads * size.effective_head_dim > size.hidden  # Qwen3-4B: 32 heads of 128 over a 2560-wide model


def test_head_dim_miniature_keeps_the_attention_width_of_a_model_that_sets_it(monkeypatch):
    paper = models._paper_model("qwen3-4b-shaped")
    monkeypatch.setitem(models.PAPER_MODELS, paper.name, paper)
    mini = miniature(paper.name, layers=1, hidden=64)
    attention = mini.model.layers[0].self_attn
    width = attention.q_proj.out_features
    assert width / 64 == pytest.approx(paper.num_heads * paper.effective_head_dim / paper.hidden_size, rel=0.1)
    assert mini.config.head_dim % 2 == 0 and width == mini.config.num_attention_heads * mini.config.head_dim
    loss = mini(input_ids=torch.zeros(1, 8, dtype=torch.long), labels=torch.zeros(1, 8, dtype=torch.long)).loss
    assert torch.isfinite(loss)
    # a model that leaves its head width to hidden // heads keeps the miniature it had
    assert miniature("llama-3.1-8b", layers=1).config.head_dim == 8


def test_head_dim_flops_per_token_counts_heads_times_head_dim():
    shape = SHAPES["wider"]
    wide, plain = _paper("wide", *shape), _paper("plain", *shape[:6], None, shape[7])
    seq = 1024
    attention = 12 * wide.num_layers * seq
    assert model_flops_per_token(wide, seq) - 6 * (wide.parameter_count() - wide.vocab_size * wide.hidden_size) == \
        attention * wide.num_heads * 16
    assert model_flops_per_token(plain, seq) - 6 * (plain.parameter_count() - plain.vocab_size * plain.hidden_size) == \
        attention * plain.hidden_size


def test_head_dim_qwen3_shaped_preset_is_qwen3_less_its_per_head_norms():
    size = presets.PRESETS["qwen3-4b-shaped"]
    qwen3 = transformers.Qwen3Config(vocab_size=size.vocab, hidden_size=size.hidden,
                                     intermediate_size=size.intermediate, num_hidden_layers=2,
                                     num_attention_heads=size.heads, num_key_value_heads=size.kv_heads,
                                     head_dim=size.head_dim, tie_word_embeddings=size.tie_embeddings)
    with torch.device("meta"):
        real = transformers.AutoModelForCausalLM.from_config(qwen3)
        shaped = transformers.AutoModelForCausalLM.from_config(presets.hf_config("qwen3-4b-shaped", seq_len=128,
                                                                                 num_layers=2))
    norms = [p.numel() for n, p in real.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight"))]
    assert norms == [size.head_dim] * 2 * 2
    assert [p.numel() for n, p in real.named_parameters() if not n.endswith(("q_norm.weight", "k_norm.weight"))] == \
        [p.numel() for p in shaped.parameters()]
