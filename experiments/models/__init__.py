"""Model presets: tiny models for CPU runs and tests, paper-scale configs for simulation.

Every model is a real class (the project's `PlainLlama` or a Hugging Face model
class) built from a config, with random weights: nothing is downloaded.
``build_model(name)`` returns a model in training mode with dropout off, so
single-device and sequence-parallel runs are comparable exactly.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from autosp.presets import PRESETS as MODEL_PRESETS
from experiments.models.plain_llama import PlainLlama, PlainLlamaConfig
from simulator.training_config import TrainingConfig


def _hf_decoder(family: str, *, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int,
                intermediate: int | None = None, **extra):
    """A Llama-shaped Hugging Face decoder (``family``: "Llama", "Qwen2", "Mistral") with SDPA attention; its MLP
    is ``intermediate`` wide (twice ``hidden`` when None); ``extra``: more config fields (``head_dim`` among
    them)."""
    import transformers

    config = getattr(transformers, f"{family}Config")(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
        attn_implementation="sdpa", **extra,
    )
    return getattr(transformers, f"{family}ForCausalLM")(config)


def _hf_llama(layers: int = 2, hidden: int = 64, heads: int = 8, kv_heads: int = 2, vocab: int = 256):
    return _hf_decoder("Llama", layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab)


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
    return _hf_decoder("Qwen2", layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab,
                       use_sliding_window=False)


def _hf_mistral(layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 1, vocab: int = 256):
    return _hf_decoder("Mistral", layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab,
                       sliding_window=None)


def _plain(layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 4, vocab: int = 256):
    return PlainLlama(PlainLlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads,
    ))


@dataclass(frozen=True, kw_only=True)
class PaperModel:
    """Architecture of a model the paper trains (Hugging Face Llama configs, public model cards)."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    tie_word_embeddings: bool = False
    head_dim: int | None = None
    """Width of one attention head where the model card sets one (Qwen3, Gemma); None: ``hidden_size //
    num_heads``.  The query and output projections are ``num_heads * head_dim`` wide."""

    @property
    def effective_head_dim(self) -> int:
        """The width of one attention head: `head_dim`, else ``hidden_size // num_heads`` (Hugging Face's
        default)."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    def hf_config(self, *, num_layers: int | None = None, max_positions: int = 262144):
        import transformers

        return transformers.LlamaConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=num_layers or self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, head_dim=self.effective_head_dim,
            max_position_embeddings=max_positions, tie_word_embeddings=self.tie_word_embeddings,
            attn_implementation="sdpa",
        )

    def training_config(self, *, layers: int | None = None, **kwargs) -> TrainingConfig:
        """The memory ledger's `TrainingConfig` with this model's parameter tensors (``layers`` decoder layers;
        None: all) and the setup ``kwargs`` name (`TrainingConfig`'s fields)."""
        return TrainingConfig.for_llama(
            hidden=self.hidden_size, ffn_hidden=self.intermediate_size, layers=layers or self.num_layers,
            heads=self.num_heads, kv_heads=self.num_kv_heads, head_dim=self.effective_head_dim,
            vocab=self.vocab_size, tied_embeddings=self.tie_word_embeddings, **kwargs)

    def parameter_count(self) -> int:
        """Parameters of the full model (embedding, layers, final norm, output head)."""
        return self.training_config().parameter_count


def _paper_model(name: str) -> PaperModel:
    size = MODEL_PRESETS[name]
    return PaperModel(name=name, hidden_size=size.hidden, intermediate_size=size.intermediate, num_layers=size.layers,
                      num_heads=size.heads, num_kv_heads=size.kv_heads, vocab_size=size.vocab,
                      tie_word_embeddings=size.tie_embeddings, head_dim=size.head_dim)


PAPER_MODELS: dict[str, PaperModel] = {name: _paper_model(name) for name in ("llama-3.2-3b", "llama-3.1-8b", "llama-2-13b")}
"""The models the paper trains, sized by `autosp.presets.PRESETS` (the one list of model-card numbers)."""


# Note [Paper models in miniature]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# What sets a long sequence's memory per token is the model's proportions: the vocabulary against the hidden size
# (the logits and the loss, about three [tokens, vocab] fp32 tensors in a plain training step), the MLP's width
# against it, the query heads against the key-value heads.  The tiny presets above keep a vocabulary four times
# the hidden size; Llama-3.1-8B's is 31 times.  `miniature` keeps a paper model's proportions at a tiny hidden
# size: vocabulary and MLP width divided by the same factor as the hidden size (128,256 / 64 = 2,004 and 14,336 / 64
# = 224 for Llama-3.1-8B at hidden 64), 8 query heads or the fewest above that keep the paper model's ratio of
# query to key-value heads (32:8 -> 8:2, head dimension 8).  A model whose card sets its head width (Qwen3: heads of
# 128 where hidden / heads is 80) keeps its attention width against the hidden size instead: heads * head_dim divided
# by the same factor, shared by the miniature's query heads, rounded to an even head width (RoPE rotates pairs).
# Nothing is fitted: every number is the model card's divided by one factor.
# Depth is the caller's (2 layers in the CPU tables): fewer layers than the paper model's keep fewer per-layer
# checkpoints, which helps a checkpointing baseline more than a plan that offloads them, so a comparison against
# per-layer checkpointing made on the miniature understates what the depth would add.


def miniature(paper: str, *, layers: int = 2, hidden: int = 64, heads: int | None = None) -> nn.Module:
    """Paper model ``paper`` (`PAPER_MODELS`) at hidden size ``hidden`` with its proportions kept (Note [Paper
    models in miniature]): a Hugging Face Llama of ``layers`` layers.  ``heads``: query heads (None: the fewest
    from 8 up that keep the paper model's ratio of query to key-value heads and divide ``hidden``, as Hugging Face's
    LlamaConfig requires even of a model that sets its head width)."""
    model = PAPER_MODELS[paper]
    group = model.num_heads // math.gcd(model.num_heads, model.num_kv_heads)  # query heads per key-value head, reduced
    if heads is None:
        heads = next((h for h in range(group, hidden + 1, group) if h >= 8 and hidden % h == 0), None)
    if heads is None or heads % group or hidden % heads:
        raise ValueError(f"{paper} at hidden {hidden}: {heads or 'no number of'} query heads cannot keep its "
                         f"{model.num_heads}:{model.num_kv_heads} query:key-value heads and divide the hidden size")
    scale = model.hidden_size / hidden
    extra = {}
    if model.head_dim is not None:
        extra["head_dim"] = max(2, 2 * round(model.num_heads * model.effective_head_dim / scale / heads / 2))
    return _hf_decoder("Llama", layers=layers, hidden=hidden, heads=heads,
                       kv_heads=heads * model.num_kv_heads // model.num_heads, vocab=round(model.vocab_size / scale),
                       intermediate=round(model.intermediate_size / scale),
                       tie_word_embeddings=model.tie_word_embeddings, **extra)


TINY_MODELS: dict[str, Callable[..., nn.Module]] = {
    "plain-llama": _plain,
    "hf-llama": _hf_llama,
    "hf-gpt2": _hf_gpt2,
    "hf-qwen2": _hf_qwen2,
    "hf-mistral": _hf_mistral,
    # Llama-3.1-8B's proportions at hidden 64 (Note [Paper models in miniature])
    "mini-llama-3.1-8b": functools.partial(miniature, "llama-3.1-8b"),
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
