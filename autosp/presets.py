"""Model presets and the one model source of every entry point: a preset name (`PRESETS`, the public model cards'
numbers) or any Hugging Face ``config.json``, checked as a command-line argument (`model_argument`), turned into a
config (`hf_config`) and a model with random weights (`build_model`); nothing is downloaded.

`python -m autosp.train`, `python -m autosp.examples.train_lm`, `python -m autosp.plan` and the experiments' paper
models (`experiments.models.PAPER_MODELS`) read these, so a model size is typed once.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autosp.errors import AutoSPError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class LlamaSize:
    """Architecture numbers of a Llama model (public Hugging Face model cards)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tie_embeddings: bool = False
    rope_theta: float = 500000.0
    head_dim: int | None = None
    """Width of one attention head where the model card gives one (Qwen3, Gemma); None: ``hidden // heads``.  The
    query and output projections are ``heads * head_dim`` wide, the key and value ones ``kv_heads * head_dim``."""

    @property
    def effective_head_dim(self) -> int:
        """The width of one attention head: `head_dim`, else ``hidden // heads`` (Hugging Face's default)."""
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads


PRESETS: dict[str, LlamaSize] = {
    "tiny-llama": LlamaSize(hidden=64, intermediate=128, layers=2, heads=8, kv_heads=2, vocab=256),
    "llama-3.2-1b": LlamaSize(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, vocab=128256,
                              tie_embeddings=True),
    "llama-3.2-3b": LlamaSize(hidden=3072, intermediate=8192, layers=28, heads=24, kv_heads=8, vocab=128256,
                              tie_embeddings=True),
    "llama-3.1-8b": LlamaSize(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128256),
    "llama-3.1-70b": LlamaSize(hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8, vocab=128256),
    "llama-2-13b": LlamaSize(hidden=5120, intermediate=13824, layers=40, heads=40, kv_heads=40, vocab=32000,
                             rope_theta=10000.0),
    # Qwen3-4B's numbers (heads of 128 where hidden / heads is 80: the query projection is 2560 -> 4096) on a Llama:
    # Qwen3 also normalises every query and key head (q_norm, k_norm: 2 * head_dim weights a layer), which a Llama
    # has not, hence "-shaped".  The real Qwen3 is its config.json (`hf_config` takes any).
    "qwen3-4b-shaped": LlamaSize(hidden=2560, intermediate=9728, layers=36, heads=32, kv_heads=8, vocab=151936,
                                 tie_embeddings=True, rope_theta=1000000.0, head_dim=128),
}


def model_argument(value: str) -> str:
    """``--model``: a preset name or an existing config.json (or a folder holding one), checked before any work."""
    if value in PRESETS:
        return value
    path = os.path.join(value, "config.json") if os.path.isdir(value) else value
    if not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"{value!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json "
                                         "file or a folder holding one")
    return value


def hf_config(model: str, *, seq_len: int, num_layers: int | None = None):
    """The Hugging Face config of ``model`` (a preset of `PRESETS` or the path of a config.json or of its folder)
    for ``seq_len`` tokens (position embeddings), with ``num_layers`` decoder layers when given, and SDPA
    attention."""
    import transformers

    if model in PRESETS:
        s = PRESETS[model]
        config = transformers.LlamaConfig(
            vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate, num_hidden_layers=s.layers,
            num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.effective_head_dim,
            tie_word_embeddings=s.tie_embeddings, rope_theta=s.rope_theta, max_position_embeddings=max(seq_len, 8192),
            use_cache=False,
        )
    else:
        path = os.path.join(model, "config.json") if os.path.isdir(model) else model
        if not os.path.isfile(path):
            raise AutoSPError(f"--model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json")
        with open(path) as f:
            fields = json.load(f)
        config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
        config.max_position_embeddings = max(getattr(config, "max_position_embeddings", 0) or 0, seq_len)
    if num_layers:
        config.num_hidden_layers = num_layers
    config._attn_implementation = "sdpa"  # AutoSP rewrites scaled_dot_product_attention
    # A preset is trained without a KV cache (use_cache=False above), as AutoSPTrainer and ALST train: a cache serves
    # generation, and in a training step it holds every layer's keys and values to the end of the step (128 KiB a
    # token a rank at 8B).  A config.json keeps its own use_cache: the planner prices the job that config runs, and
    # autosp.compile(memory_plan="auto") passes the job's config as it is.  Without a cache Hugging Face builds its
    # mask from the position ids, which compiles as causal attention on plain positions (Note [Document program] in
    # autosp/api.py) and is learnt on short blocks at long context (Note [Mask programs probed on shorter blocks]
    # in autosp/passes/dynamo/mask_probes.py: 16 s at 3.7M tokens on 8 ranks).
    return config


def build_model(config, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The causal LM of ``config`` with random weights in ``dtype`` on ``device``, in training mode."""
    import torch
    import transformers

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = transformers.AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    return model.train()
