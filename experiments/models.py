"""Model presets: tiny models for CPU runs and tests, paper-scale configs for simulation.

Every model is a real class (the project's `PlainLlama` or a Hugging Face model
class) built from a config, with random weights: nothing is downloaded.
``build_model(name)`` returns a model in training mode with dropout off, so
single-device and sequence-parallel runs are comparable exactly.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from experiments.plain_llama import PlainLlama, PlainLlamaConfig


def _hf_llama(layers: int = 2, hidden: int = 64, heads: int = 8, kv_heads: int = 2, vocab: int = 256):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config)


def _hf_gpt2(layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 256):
    import transformers

    config = transformers.GPT2Config(
        vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=4096,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_implementation="sdpa",
    )
    model = transformers.GPT2LMHeadModel(config)
    # GPT2LMHeadModel has no loss_type of its own; Hugging Face then logs a warning from
    # inside forward, which torch.compile(fullgraph=True) cannot trace.  Name the loss.
    model.loss_type = "ForCausalLM"
    return model


def _hf_qwen2(layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, vocab: int = 256):
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
        use_sliding_window=False, attn_implementation="sdpa",
    )
    return transformers.Qwen2ForCausalLM(config)


def _hf_mistral(layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 1, vocab: int = 256):
    import transformers

    config = transformers.MistralConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
        sliding_window=None, attn_implementation="sdpa",
    )
    return transformers.MistralForCausalLM(config)


def _plain(layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 4, vocab: int = 256):
    return PlainLlama(PlainLlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads,
    ))


TINY_MODELS: dict[str, Callable[..., nn.Module]] = {
    "plain-llama": _plain,
    "hf-llama": _hf_llama,
    "hf-gpt2": _hf_gpt2,
    "hf-qwen2": _hf_qwen2,
    "hf-mistral": _hf_mistral,
}


def build_model(name: str, **overrides) -> nn.Module:
    """A tiny model by preset name (see TINY_MODELS), in training mode; ``overrides`` resize it."""
    if name not in TINY_MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(TINY_MODELS)}")
    model = TINY_MODELS[name](**overrides)
    model.train()
    return model


def vocab_size(model: nn.Module) -> int:
    return model.config.vocab_size
