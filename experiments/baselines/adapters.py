"""Plugging a hand-written distributed attention into a model, and running the model on one rank's tokens.

Two model families are supported.  The project's `PlainLlama` takes an attention
callable per block (``Attention.attention_fn``); its driver runs the blocks with
explicit global positions (its own ``forward`` builds positions 0..S-1, which is
wrong for a shard).  A Hugging Face model gets the attention through transformers'
``AttentionInterface``, registered under a name unique to this model and set on
this model's config only; it is driven with ``position_ids``.  Either way the
attention callable has SDPA's signature: ``fn(q, k, v, *, is_causal, enable_gqa,
scale=None)`` with q/out [B, H, S_local, D] and k/v [B, Hkv, S_local, D].
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable

import torch
import torch.utils.checkpoint
from torch import nn

from experiments.baselines.common import BaselineUnsupported
from experiments.models.plain_llama import Attention, PlainLlama

log = logging.getLogger(__name__)

SPAttention = Callable[..., torch.Tensor]
"""``fn(q, k, v, *, is_causal, enable_gqa, scale=None) -> out``, shapes as ``F.scaled_dot_product_attention``."""

_names = itertools.count()


def _is_hugging_face(model: nn.Module) -> bool:
    return hasattr(model, "config") and hasattr(model, "set_attn_implementation")


def _hugging_face_attention(fn: SPAttention, name: str):
    """Wrap ``fn`` in transformers' attention-function signature (output [B, S, H, D], no weights)."""

    def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if attention_mask is not None:
            raise BaselineUnsupported(
                f"{name}: the model passed an attention mask; the hand-written baselines shard the sequence and "
                "support causal attention without a padding mask only (pad at the end with ignored labels instead)"
            )
        if dropout:
            raise BaselineUnsupported(f"{name}: attention dropout {dropout} is not supported; build the model with 0")
        out = fn(query, key, value, is_causal=True, enable_gqa=query.shape[1] != key.shape[1], scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    return attention_forward


def install_attention(model: nn.Module, fn: SPAttention, *, tag: str) -> str:
    """Make every attention layer of ``model`` call ``fn``; returns how it was installed (for logs)."""
    if isinstance(model, PlainLlama):
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        for layer in layers:
            layer.attention_fn = fn
        return f"PlainLlama attention hook on {len(layers)} layers"
    if _is_hugging_face(model):
        from transformers import AttentionInterface

        # Unique per model and process: the registry is global, the choice is this model's config only.
        name = f"{tag}_{os.getpid()}_{next(_names)}"
        AttentionInterface.register(name, _hugging_face_attention(fn, name))
        model.set_attn_implementation(name)
        log.debug("registered attention implementation %s for %s", name, type(model).__name__)
        return f"transformers attention implementation {name!r}"
    raise BaselineUnsupported(
        f"{tag}: no way to install a distributed attention in {type(model).__name__}; the hand-written baselines "
        "support the project's PlainLlama and Hugging Face models that use transformers' AttentionInterface"
    )


def enable_layer_checkpointing(model: nn.Module) -> str:
    """Per-layer activation checkpointing as practitioners switch it on (non-reentrant ``torch.utils.checkpoint``).

    A Hugging Face model gets its own ``activation_checkpointing_enable`` (older
    transformers: ``gradient_checkpointing_enable``), which wraps every decoder layer;
    a `PlainLlama` is checkpointed block by block in `local_logits`.  Either way each
    layer keeps only its input and recomputes the rest in backward."""
    if isinstance(model, PlainLlama):
        model._sp_checkpoint_layers = True
        return "per-block torch.utils.checkpoint"
    if _is_hugging_face(model):
        # No dropout in these models: nothing random to replay, so no RNG state is saved.
        kwargs = {"use_reentrant": False, "preserve_rng_state": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return "Hugging Face gradient checkpointing (every decoder layer, non-reentrant)"
    raise BaselineUnsupported(f"no per-layer activation checkpointing for {type(model).__name__}")


def local_logits(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """[B, S_local, V] logits for one rank's tokens at their global ``position_ids``."""
    if isinstance(model, PlainLlama):
        x = model.embed(input_ids)
        for block in model.blocks:
            if getattr(model, "_sp_checkpoint_layers", False):
                x = torch.utils.checkpoint.checkpoint(block, x, position_ids, use_reentrant=False,
                                                      preserve_rng_state=False)
            else:
                x = block(x, position_ids)
        return model.lm_head(model.norm(x))
    # use_cache=False is also what Hugging Face forces under gradient checkpointing: the mask stays None
    # for the registered attention (checked in `_hugging_face_attention`), so sharding stays exact.
    return model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
