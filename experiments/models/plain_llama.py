"""A plain PyTorch Llama-style causal LM: the project's own model, no Hugging Face.

RMSNorm, rotary position embeddings computed from positions, SwiGLU MLP and
causal ``F.scaled_dot_product_attention`` with optional grouped-query attention.
It builds its own positions (``torch.arange``) when none are passed and computes
the classic shifted loss (``logits[:, :-1]`` against ``labels[:, 1:]``), so it
exercises the paths of AutoSP that Hugging Face models do not.  An optional
``attention`` callable (default ``F.scaled_dot_product_attention``) lets the
hand-written sequence-parallel baselines swap in their distributed attention.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class PlainLlamaConfig:
    vocab_size: int = 256
    """Number of token ids."""
    hidden_size: int = 64
    """Model width."""
    intermediate_size: int = 128
    """SwiGLU inner width."""
    num_layers: int = 2
    """Decoder blocks."""
    num_heads: int = 4
    """Query heads."""
    num_kv_heads: int = 4
    """Key/value heads (fewer than num_heads: grouped-query attention)."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate ``x`` [B, H, S, D] by angles position * theta^(-2i/D); ``positions`` is [B or 1, S]."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=x.device, dtype=torch.float32) / head_dim))
    angles = positions.to(torch.float32)[:, None, :, None] * inv_freq  # [B, 1, S, D/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


AttentionFn = Callable[..., torch.Tensor]
"""``fn(q, k, v, *, is_causal, enable_gqa) -> out``: q/out [B, H, S, D], k/v [B, Hkv, S, D], as SDPA."""


class Attention(nn.Module):
    def __init__(self, config: PlainLlamaConfig, attention: AttentionFn | None = None):
        super().__init__()
        self.config = config
        self.attention_fn = attention if attention is not None else F.scaled_dot_product_attention
        d, h, kv = config.head_dim, config.num_heads, config.num_kv_heads
        self.q_proj = nn.Linear(config.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, config.hidden_size, bias=False)

    def forward(self, x, positions):
        b, s, _ = x.shape
        c = self.config
        q = self.q_proj(x).view(b, s, c.num_heads, c.head_dim).transpose(1, 2)  # [B, H, S, D]
        k = self.k_proj(x).view(b, s, c.num_kv_heads, c.head_dim).transpose(1, 2)  # [B, Hkv, S, D]
        v = self.v_proj(x).view(b, s, c.num_kv_heads, c.head_dim).transpose(1, 2)
        q, k = rotary(q, positions, c.rope_theta), rotary(k, positions, c.rope_theta)
        out = self.attention_fn(q, k, v, is_causal=True, enable_gqa=c.num_kv_heads != c.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, config: PlainLlamaConfig, attention: AttentionFn | None = None):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, attention)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gate = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x, positions):
        x = x + self.attn(self.attn_norm(x), positions)
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class PlainLlama(nn.Module):
    """``forward(input_ids, labels=None)`` returns the mean next-token loss if labels are given, else logits.

    ``attention`` replaces ``F.scaled_dot_product_attention`` in every block (see `AttentionFn`);
    it is kept on each `Attention` module as ``attention_fn``.
    """

    def __init__(self, config: PlainLlamaConfig, *, attention: AttentionFn | None = None):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config, attention) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]  # [1, S]
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, positions)
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        return F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=-100
        )
