"""Small models with the token-mixing patterns of real training code, for the soundness tests.

Module-level classes (the gloo ranks are spawned and rebuild them by name).  Each
computes a causal-LM loss from unshifted labels inside forward, as Hugging Face
models do, plus the pattern under test.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from experiments.models import build_model
from experiments.models.plain_llama import PlainLlama, PlainLlamaConfig

VOCAB = 256


class _Core(nn.Module):
    """Embedding, one causal SDPA attention layer with rotary-free learned positions, and an LM head."""

    def __init__(self, hidden: int = 32, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, VOCAB, bias=False)
        self.heads = heads

    def attend(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, s, h))

    def lm_loss(self, x, labels):
        logits = self.head(x)
        shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
        return F.cross_entropy(logits.reshape(-1, VOCAB), shifted.reshape(-1), ignore_index=-100), logits


class RouterAuxLM(_Core):
    """A dense mixture of two MLP experts with Switch-style load-balancing and z auxiliary losses.

    The aux losses average router statistics over every token of the sequence (reductions over the
    token axis, completed with an all-reduce under SP)."""

    def __init__(self, hidden: int = 32, experts: int = 4):
        super().__init__(hidden)
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(experts))

    def forward(self, input_ids, labels=None, position_ids=None):
        x = self.attend(self.embed(input_ids))
        logits = self.router(x)  # [B, S, E]
        probs = logits.softmax(-1)
        x = x + sum(probs[..., e : e + 1] * torch.tanh(expert(x)) for e, expert in enumerate(self.experts))
        ce, out = self.lm_loss(x, labels)
        chosen = F.one_hot(probs.argmax(-1), probs.shape[-1]).to(probs.dtype)
        balance = probs.shape[-1] * (chosen.mean(dim=(0, 1)) * probs.mean(dim=(0, 1))).sum()
        z_loss = torch.logsumexp(logits, dim=-1).pow(2).mean()
        return ce + 0.1 * balance + 0.01 * z_loss


class SequenceCenteredLM(_Core):
    """Subtracts each sequence's mean hidden state (a reduction over the tokens read by token-sharded values)."""

    def forward(self, input_ids, labels=None, position_ids=None):
        x = self.attend(self.embed(input_ids))
        x = x - x.mean(dim=1, keepdim=True)
        return self.lm_loss(x, labels)[0]


class CheckpointedPlainLlama(PlainLlama):
    """The plain Llama with every other block under torch.utils.checkpoint (non-reentrant), and positions
    built with arange's keyword spelling."""

    def forward(self, input_ids, labels=None):
        positions = torch.arange(end=input_ids.shape[1], device=input_ids.device)[None]
        x = self.embed(input_ids)
        for i, block in enumerate(self.blocks):
            x = checkpoint(block, x, positions, use_reentrant=False) if i % 2 == 0 else block(x, positions)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
                               ignore_index=-100)


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "router-aux":
        return RouterAuxLM()
    if name == "sequence-centered":
        return SequenceCenteredLM()
    if name == "checkpointed-plain-llama":
        return CheckpointedPlainLlama(PlainLlamaConfig(vocab_size=VOCAB, hidden_size=32, num_layers=3, num_heads=4,
                                                       num_kv_heads=2, intermediate_size=64))
    if name == "hf-llama-gradient-checkpointing":
        model = build_model("hf-llama", layers=2)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        return model
    if name == "hf-qwen2-no-cache":
        model = build_model("hf-qwen2")
        model.config.use_cache = False
        return model
    return build_model(name)


# ---- random compositions for the property test -------------------------------------------------------
TOKEN_LOCAL_OPS = ("linear", "silu", "softmax_hidden", "cumsum_hidden", "scale", "reshape_roundtrip", "norm")
MIXING_OPS = ("center_over_sequence", "add_sequence_sum", "cumsum_sequence", "amax_sequence", "roll_sequence",
              "flip_sequence", "mean_sequence_into_loss", "log_softmax_over_sequence", "var_sequence_into_loss",
              "std_normalize_sequence")


class ComposedLM(_Core):
    """Embedding -> attention -> a sequence of named ops -> LM loss (+ a sequence-mean term if asked)."""

    def __init__(self, ops: tuple[str, ...], hidden: int = 32):
        super().__init__(hidden)
        self.ops = ops
        self.mix = nn.Linear(hidden, hidden)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, hidden))

    def forward(self, input_ids, labels=None, position_ids=None):
        x = self.attend(self.embed(input_ids))
        extra = 0.0
        for op in self.ops:
            if op == "linear":
                x = self.mix(x)
            elif op == "silu":
                x = F.silu(x)
            elif op == "softmax_hidden":
                x = x.softmax(-1) * x.shape[-1]
            elif op == "cumsum_hidden":
                x = x.cumsum(-1) / x.shape[-1]
            elif op == "scale":
                x = x * self.gain
            elif op == "reshape_roundtrip":
                b, s, h = x.shape
                x = x.reshape(b * s, h).view(b, s, h)
            elif op == "norm":
                x = F.layer_norm(x, x.shape[-1:])
            elif op == "center_over_sequence":
                x = x - x.mean(dim=1, keepdim=True)
            elif op == "add_sequence_sum":
                x = x + 0.01 * x.sum(dim=1, keepdim=True)
            elif op == "cumsum_sequence":
                x = x.cumsum(1)
            elif op == "amax_sequence":
                x = x - x.amax(dim=1, keepdim=True)
            elif op == "roll_sequence":
                x = x.roll(1, dims=1)
            elif op == "flip_sequence":
                x = x.flip(1)
            elif op == "mean_sequence_into_loss":
                extra = extra + x.pow(2).mean(dim=(0, 1)).sum()
            elif op == "log_softmax_over_sequence":
                x = x - torch.logsumexp(x, dim=1, keepdim=True)
            elif op == "var_sequence_into_loss":
                extra = extra + x.var(dim=1).mean()
            elif op == "std_normalize_sequence":
                x = x / (torch.std(x, dim=1, keepdim=True) + 1.0)
        return self.lm_loss(x, labels)[0] + 0.1 * extra
