"""Random small causal-LM programs for the differential fuzzer of AutoSP's sequence-sharding analysis.

A `Program` is a picklable recipe (op names, how positions are built, the loss
spelling, which inputs the model takes, and the sequence lengths it is called
with); `build_model` turns it into a `FuzzLM`, an ``nn.Module`` whose forward
takes ``input_ids`` and ``labels`` (and, per program, ``position_ids`` and
``attention_mask``) and returns an object with ``.loss``.  The ranks rebuild the
same model from the recipe and a seed.

The op pool deliberately goes beyond the ops AutoSP has rules for: besides
token-local ops (pointwise, views and reshapes spelt several ways, reductions
over the hidden axis) and ops with rules (sums, means, logsumexp, var over the
sequence; causal attention; positions from ``arange``) it holds ops that mix
tokens (scans, sorts, rolls and flips along the sequence, matmuls contracting
tokens, a replicated per-token operand), token counts read from shapes, and
custom ``torch.autograd.Function`` blocks whose forward or backward mixes tokens.
Every op is labelled with what an exact analysis must do with it (`OpSpec.kind`):
``local`` (exact with no rule), ``rule`` (exact through a rule) or ``mixing`` (to
be refused unless a rule makes it exact) — the label is used only for statistics;
the oracle is the single-device run (`experiments.fuzz.oracle`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 128
HIDDEN = 32
HEADS = 4
HIDDEN_SIZES = (24, 32, 40, 56, 72)
"""Hidden sizes `generate` draws from (head dims 6-18, each even for the rotary ops): none a multiple of every
token count, so a count or divisor read from a shape cannot pass by a coincidence of sizes (issue: a guard keyed on
the local token count times a small factor)."""
BATCH_SIZES = (1, 2, 3)
"""Rows per batch `generate` draws from."""
MAX_POS = 128
IGNORE = -100


class FuzzOutput(NamedTuple):
    loss: torch.Tensor


# ---- custom autograd Functions (module level: Dynamo traces them as higher-order ops) -------------
class ScaledTanh(torch.autograd.Function):
    """Pointwise forward and backward: exact under sequence parallelism."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return 1.5 * y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * 1.5 * (1 - y * y)


class GainMul(torch.autograd.Function):
    """Two inputs, pointwise (the weight's gradient sums over tokens: a partial sum, like a Linear's)."""

    @staticmethod
    def forward(ctx, x, gain):
        ctx.save_for_backward(x, gain)
        return x * gain

    @staticmethod
    def backward(ctx, grad):
        x, gain = ctx.saved_tensors
        return grad * gain, (grad * x).reshape(-1, x.shape[-1]).sum(0)


class CumsumSequence(torch.autograd.Function):
    """A scan over the sequence in forward and backward: must be refused."""

    @staticmethod
    def forward(ctx, x):
        return x.cumsum(1)

    @staticmethod
    def backward(ctx, grad):
        return grad.flip(1).cumsum(1).flip(1)


class PointwiseForwardMixingBackward(torch.autograd.Function):
    """Forward is pointwise, the (hand-written) backward smooths along the sequence: must be refused."""

    @staticmethod
    def forward(ctx, x):
        return x * 2.0

    @staticmethod
    def backward(ctx, grad):
        return 2.0 * grad + 0.5 * grad.roll(1, 1)


class SequenceCenter(torch.autograd.Function):
    """x - mean over the sequence with its exact backward (a rule-shaped op inside a Function)."""

    @staticmethod
    def forward(ctx, x):
        return x - x.mean(1, keepdim=True)

    @staticmethod
    def backward(ctx, grad):
        return grad - grad.mean(1, keepdim=True)


# ---- the op pool --------------------------------------------------------------------------------
@dataclass(frozen=True)
class OpSpec:
    kind: str
    """"local" (exact without a rule), "rule" (exact through a rule), "mixing" (refused unless a rule exists)."""
    fn: Callable
    """fn(model, x, env) -> x; ``env`` holds the inputs and the auxiliary-loss list."""
    needs: frozenset = frozenset()
    """"mask" (the program passes an attention_mask), "positions" (the model takes position_ids),
    "even" (every length a multiple of 2 * P)."""


def _seq_len(x):
    return x.shape[1]


def _attend(m, x, *, mask=None, is_causal=True, rope=None):
    b, s, h = x.shape
    q, k, v = m.qkv(x).view(b, s, 3, HEADS, h // HEADS).permute(2, 0, 3, 1, 4)
    if rope is not None:
        cos, sin = rope  # [.., s, d/2]
        q, k = (_rotate(t, cos, sin) for t in (q, k))
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
    return x + m.out(y.transpose(1, 2).reshape(b, s, h))


def _rotate(t, cos, sin):
    a, b = t.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def _rope_from(angles):
    """angles [..., s, d/2] -> (cos, sin) broadcastable to [b, heads, s, d/2]."""
    if angles.dim() == 2:
        angles = angles[None, None]
    else:
        angles = angles[:, None]
    return angles.cos(), angles.sin()


def _key_mask(env, s, device):
    causal = torch.ones(s, s, dtype=torch.bool, device=device).tril()
    mask = env["mask"]
    if mask is None:
        return causal[None, None]
    return causal[None, None] & mask[:, None, None, :].bool()


def _masked_mean_aux(m, x, env):
    mask = env["mask"]
    w = torch.ones_like(x[..., 0]) if mask is None else mask.to(x.dtype)
    mean = (x * w[..., None]).sum(1) / w.sum(1, keepdim=True).clamp(min=1.0)
    env["aux"].append(mean.pow(2).mean())
    return x


def _token_count(x):
    """A count read from a shape in a helper, as training code spells it in a module of its own."""
    batch, tokens = x.shape[:2]
    return tokens * batch / batch


def _topk_mask_in_place(m, x, env):
    """A router's mask, scattered in place by a statement (Dynamo records it as a node nobody uses)."""
    mask = torch.zeros_like(x)
    mask.scatter_(-1, x.topk(2, dim=-1).indices, 1.0)
    return x * (1 + mask) + x.gather(-1, x.argsort(-1))


def _updated_in_place(m, x, env):
    y = x.clone()
    y.mul_(m.gain)
    y.add_(x)
    top = y.argmax(-1, keepdim=True)
    return torch.zeros_like(y).scatter_add(-1, top, y.gather(-1, top)) + y


def _aux(value_fn):
    def fn(m, x, env):
        env["aux"].append(value_fn(m, x, env))
        return x
    return fn


OPS: dict[str, OpSpec] = {
    # -- token-local: pointwise and hidden-axis ops ---------------------------------------------
    "linear": OpSpec("local", lambda m, x, env: m.mix(x)),
    "silu_gain": OpSpec("local", lambda m, x, env: F.silu(x) * m.gain),
    "gelu_tanh": OpSpec("local", lambda m, x, env: F.gelu(x, approximate="tanh") + torch.tanh(x)),
    "binary_max": OpSpec("local", lambda m, x, env: torch.max(x, x * m.gain)),
    "where_clamp": OpSpec("local", lambda m, x, env: torch.where(x > 0, x, 0.1 * x).clamp(-3, 3)),
    "softmax_hidden": OpSpec("local", lambda m, x, env: x.softmax(-1) * x.shape[-1]),
    "cumsum_hidden": OpSpec("local", lambda m, x, env: x.cumsum(-1) / x.shape[-1]),
    "layer_norm": OpSpec("local", lambda m, x, env: F.layer_norm(x, x.shape[-1:])),
    "rms_norm_manual": OpSpec("local", lambda m, x, env: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)),
    "amax_hidden": OpSpec("local", lambda m, x, env: x - x.amax(-1, keepdim=True)),
    "logsumexp_hidden": OpSpec("local", lambda m, x, env: x - torch.logsumexp(x, -1, keepdim=True)),
    "norm_hidden": OpSpec("local", lambda m, x, env: x / (x.norm(dim=-1, keepdim=True) + 1.0)),
    "var_hidden": OpSpec("local", lambda m, x, env: x / (x.var(-1, keepdim=True, unbiased=False) + 1.0).sqrt()),
    # row-wise gathers and scatters along the hidden axis, and writes into a tensor made as statements
    "topk_mask_in_place": OpSpec("local", _topk_mask_in_place),
    "updated_in_place": OpSpec("local", _updated_in_place),
    "sort_hidden": OpSpec("local", lambda m, x, env: x.sort(-1).values + 0.1 * x),
    "aux_hidden_mean": OpSpec("rule", _aux(lambda m, x, env: x.pow(2).mean(-1).mean())),
    # -- token-local: views and reshapes, spelt several ways ---------------------------------------
    "view_roundtrip": OpSpec("local", lambda m, x, env: m.mix(x.reshape(-1, x.shape[-1])).view(x.shape)),
    "flatten_unflatten": OpSpec("local", lambda m, x, env: m.mix(x.flatten(0, 1)).unflatten(0, x.shape[:2])),
    "split_heads": OpSpec("local", lambda m, x, env: (x.unflatten(-1, (HEADS, -1)) * 0.5).flatten(-2) + x),
    "heads_transpose": OpSpec("local", lambda m, x, env: x.view(x.shape[0], x.shape[1], HEADS, -1).transpose(1, 2)
                              .softmax(-1).transpose(1, 2).reshape(x.shape)),
    "permute_linear": OpSpec("local", lambda m, x, env: m.mix(x.permute(1, 0, 2)).permute(1, 0, 2)),
    "einsum_transpose": OpSpec("local", lambda m, x, env: torch.einsum("sbh->bsh", torch.einsum("bsh->sbh", x) * 2)),
    "einsum_linear": OpSpec("local", lambda m, x, env: torch.einsum("bsh,kh->bsk", x, m.mix.weight)),
    "matmul_weight": OpSpec("local", lambda m, x, env: torch.matmul(x, m.mix.weight.t()) + x),
    "seq_major_merge": OpSpec("local", lambda m, x, env: m.mix(x.transpose(0, 1).reshape(-1, x.shape[-1]))
                              .view(x.shape[1], x.shape[0], -1).transpose(0, 1)),
    "pair_tokens": OpSpec("local", lambda m, x, env: m.mix2(x.reshape(x.shape[0], -1, 2 * x.shape[-1]))
                          .reshape(x.shape), needs=frozenset({"even"})),
    # -- custom autograd Functions -------------------------------------------------------------------
    "fn_pointwise": OpSpec("local", lambda m, x, env: ScaledTanh.apply(x)),
    "fn_two_inputs": OpSpec("local", lambda m, x, env: GainMul.apply(x, m.gain)),
    "fn_cumsum_sequence": OpSpec("mixing", lambda m, x, env: CumsumSequence.apply(x)),
    "fn_mixing_backward": OpSpec("mixing", lambda m, x, env: PointwiseForwardMixingBackward.apply(x)),
    "fn_sequence_center": OpSpec("mixing", lambda m, x, env: SequenceCenter.apply(x)),
    # -- attention -------------------------------------------------------------------------------------
    "attention": OpSpec("rule", lambda m, x, env: _attend(m, x)),
    "attention_tril_mask": OpSpec("rule", lambda m, x, env: _attend(
        m, x, mask=torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril(), is_causal=False)),
    "attention_arange_mask": OpSpec("rule", lambda m, x, env: _attend(
        m, x, mask=(lambda p: p[:, None] >= p[None, :])(torch.arange(x.shape[1], device=x.device)), is_causal=False)),
    "attention_padding_mask": OpSpec("rule", lambda m, x, env: _attend(
        m, x, mask=_key_mask(env, x.shape[1], x.device), is_causal=False), needs=frozenset({"mask"})),
    "attention_rope_ids": OpSpec("rule", lambda m, x, env: _attend(
        m, x, rope=_rope_from(env["positions"].float()[..., None] * m.rope_freq)), needs=frozenset({"positions"})),
    "attention_rope_arange_einsum": OpSpec("rule", lambda m, x, env: _attend(
        m, x, rope=_rope_from(torch.einsum("s,f->sf", torch.arange(x.shape[1], device=x.device).float(),
                                           m.rope_freq)))),
    "attention_rope_arange_outer": OpSpec("rule", lambda m, x, env: _attend(
        m, x, rope=_rope_from(torch.outer(torch.arange(x.shape[1], device=x.device).float(), m.rope_freq)))),
    # -- reductions over the sequence that rules complete -------------------------------------------------
    "center_sequence": OpSpec("rule", lambda m, x, env: x - x.mean(dim=1, keepdim=True)),
    "add_sequence_sum": OpSpec("rule", lambda m, x, env: x + 0.01 * torch.sum(x, 1, keepdim=True)),
    "std_normalize_sequence": OpSpec("rule", lambda m, x, env: x / (torch.std(x, dim=1, keepdim=True) + 1.0)),
    "log_softmax_sequence": OpSpec("rule", lambda m, x, env: x - torch.logsumexp(x, dim=1, keepdim=True)),
    "aux_mean_sequence": OpSpec("rule", _aux(lambda m, x, env: x.pow(2).mean(dim=(0, 1)).sum())),
    "aux_var_sequence": OpSpec("rule", _aux(lambda m, x, env: x.var(1).mean())),
    "aux_var_correction": OpSpec("rule", _aux(lambda m, x, env: torch.var(x, dim=1, correction=0).mean())),
    "aux_logsumexp_sequence": OpSpec("rule", _aux(lambda m, x, env: torch.logsumexp(x, 1).mean())),
    "aux_sum_sequence_tuple": OpSpec("rule", _aux(lambda m, x, env: x.pow(2).sum(dim=(1,)).mean() * 0.01)),
    "aux_masked_mean": OpSpec("rule", _masked_mean_aux, needs=frozenset({"mask"})),
    "mask_multiply": OpSpec("local", lambda m, x, env: x * env["mask"][..., None].to(x.dtype),
                            needs=frozenset({"mask"})),
    # -- token counts read from shapes (exact only if the count is the global one) -------------------------
    "sum_div_shape": OpSpec("mixing", lambda m, x, env: x - x.sum(1, keepdim=True) / x.shape[1]),
    "sum_div_size": OpSpec("mixing", lambda m, x, env: x - x.sum(1, keepdim=True) / x.size(1)),
    "sum_times_inverse_count": OpSpec("mixing", lambda m, x, env: x - x.sum(1, keepdim=True) * (1.0 / x.shape[1])),
    "sum_div_count_tensor": OpSpec("mixing", lambda m, x, env: x - x.sum(1, keepdim=True) / torch.tensor(
        float(x.shape[1]), device=x.device)),
    "aux_sum_div_numel": OpSpec("mixing", _aux(lambda m, x, env: x.pow(2).sum() / x.numel())),
    "aux_sum_times_inverse_numel": OpSpec("mixing", _aux(lambda m, x, env: x.pow(2).sum() * (1.0 / x.numel()))),
    # counts after arithmetic, through len and numel, and in a helper: each the global count on one device
    "sum_div_shape_minus_one": OpSpec("mixing", lambda m, x, env: x - x.sum(1, keepdim=True) / (x.shape[1] - 1)),
    "sum_div_len": OpSpec("mixing", lambda m, x, env: x - x.sum(1, keepdim=True) / len(x[0])),
    "aux_sum_div_tokens_times_batch": OpSpec("mixing", _aux(lambda m, x, env: x.pow(2).sum(-1).sum()
                                                            / (x.shape[1] * x.shape[0]))),
    "aux_sum_div_numel_over_hidden": OpSpec("mixing", _aux(lambda m, x, env: x.pow(2).sum(-1).sum()
                                                           / (x.numel() // x.shape[-1]))),
    "aux_unbiased_variance_by_hand": OpSpec("mixing", _aux(lambda m, x, env: (
        (x - x.mean(1, keepdim=True)).pow(2).sum(1) / (x.size(1) - 1)).mean())),
    "sum_div_helper_count": OpSpec("mixing", lambda m, x, env: x - x.sum(1, keepdim=True) / _token_count(x)),
    # -- reductions over the sequence without an exact rule (or with a differently spelt argument) ---------
    "amax_sequence": OpSpec("mixing", lambda m, x, env: x - x.amax(dim=1, keepdim=True)),
    "gather_along_sequence": OpSpec("mixing", lambda m, x, env: x.gather(1, torch.zeros_like(x, dtype=torch.long))),
    "max_sequence_values": OpSpec("mixing", lambda m, x, env: x - torch.max(x, dim=1, keepdim=True).values),
    "aux_norm_positional_dim": OpSpec("mixing", _aux(lambda m, x, env: x.norm(2, 1).mean())),
    "aux_norm_keyword_dim": OpSpec("mixing", _aux(lambda m, x, env: torch.norm(x, dim=1).mean())),
    "aux_vector_norm": OpSpec("mixing", _aux(lambda m, x, env: torch.linalg.vector_norm(x, dim=1).mean())),
    "aux_median_sequence": OpSpec("mixing", _aux(lambda m, x, env: x.median(dim=1).values.mean())),
    # -- scans, sorts and reorderings along the sequence ----------------------------------------------------
    "cumsum_sequence": OpSpec("mixing", lambda m, x, env: x.cumsum(1) / 8),
    "cummax_sequence": OpSpec("mixing", lambda m, x, env: x.cummax(1).values),
    "roll_sequence": OpSpec("mixing", lambda m, x, env: x.roll(1, dims=1)),
    "flip_sequence": OpSpec("mixing", lambda m, x, env: x.flip(1)),
    "sort_sequence": OpSpec("mixing", lambda m, x, env: x.sort(dim=1).values),
    "diff_sequence": OpSpec("mixing", lambda m, x, env: x + F.pad(x.diff(dim=1), (0, 0, 1, 0))),
    "shift_slice_sequence": OpSpec("mixing", lambda m, x, env: x + torch.cat([x[:, :1], x[:, :-1]], dim=1)),
    "conv_sequence": OpSpec("mixing", lambda m, x, env: F.conv1d(x.transpose(1, 2), m.conv_w, padding=1,
                                                                 groups=x.shape[-1]).transpose(1, 2)),
    # -- matmuls contracting tokens ---------------------------------------------------------------------------
    "gram_matmul": OpSpec("mixing", lambda m, x, env: x @ (x.transpose(1, 2) @ x) * 1e-3),
    "gram_einsum": OpSpec("mixing", lambda m, x, env: torch.einsum("bsh,bhk->bsk", x, torch.einsum(
        "bsh,bsk->bhk", x, x)) * 1e-3),
    "gram_bmm": OpSpec("mixing", lambda m, x, env: torch.bmm(x, torch.bmm(x.transpose(1, 2), x)) * 1e-3),
    "token_mix_parameter": OpSpec("mixing", lambda m, x, env: x + torch.matmul(
        m.tok_mix[: x.shape[1], : x.shape[1]], x)),
    "token_mix_einsum_parameter": OpSpec("mixing", lambda m, x, env: x + torch.einsum(
        "st,bth->bsh", m.tok_mix[: x.shape[1], : x.shape[1]], x)),
    "causal_average_matmul": OpSpec("mixing", lambda m, x, env: x + torch.matmul(
        torch.ones(x.shape[1], x.shape[1], device=x.device).tril() / x.shape[1], x)),
    "attention_manual_softmax": OpSpec("mixing", lambda m, x, env: x + (
        (x @ x.transpose(1, 2) / 8).softmax(-1) @ x)),
}

POSITIONS: dict[str, tuple[Callable, frozenset]] = {
    # name -> (fn(model, x, env) -> x, needs)
    "none": (lambda m, x, env: x, frozenset()),
    "ids_embedding": (lambda m, x, env: x + m.pos(env["positions"]), frozenset({"positions"})),
    "ids_sinusoid": (lambda m, x, env: x + _sinusoid(env["positions"].float()[..., None] * m.inv_freq),
                     frozenset({"positions"})),
    "arange_embedding": (lambda m, x, env: x + m.pos(torch.arange(x.shape[1], device=x.device)), frozenset()),
    "arange_start_end": (lambda m, x, env: x + m.pos(torch.arange(0, x.shape[1], 1, device=x.device))[None],
                         frozenset()),
    "arange_end_keyword": (lambda m, x, env: x + m.pos(torch.arange(end=x.shape[1], device=x.device)), frozenset()),
    "arange_expand": (lambda m, x, env: x + m.pos(torch.arange(x.shape[1], device=x.device)[None].expand(
        x.shape[0], -1)), frozenset()),
    "ones_cumsum": (lambda m, x, env: x + m.pos(env["input_ids"].new_ones(x.shape[1]).cumsum(0) - 1), frozenset()),
    "arange_sinusoid_einsum": (lambda m, x, env: x + _sinusoid(torch.einsum(
        "s,f->sf", torch.arange(x.shape[1], device=x.device, dtype=x.dtype), m.inv_freq)), frozenset()),
    "arange_sinusoid_outer": (lambda m, x, env: x + _sinusoid(
        torch.arange(x.shape[1], device=x.device, dtype=x.dtype)[:, None] * m.inv_freq[None, :]), frozenset()),
}


def _sinusoid(angles):
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


def _loss_pad_shift(logits, labels):
    shifted = F.pad(labels, (0, 1), value=IGNORE)[..., 1:]
    return F.cross_entropy(logits.reshape(-1, VOCAB), shifted.reshape(-1), ignore_index=IGNORE)


def _loss_slice_shift(logits, labels):
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), labels[:, 1:].reshape(-1),
                           ignore_index=IGNORE)


def _loss_sum_over_count(logits, labels):
    shifted = F.pad(labels, (0, 1), value=IGNORE)[..., 1:]
    total = F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=IGNORE, reduction="sum")
    return total / (shifted != IGNORE).sum()


LOSSES: dict[str, Callable] = {
    "pad_shift": _loss_pad_shift,
    "slice_shift": _loss_slice_shift,
    "sum_over_count": _loss_sum_over_count,
}


# ---- programs and models ------------------------------------------------------------------------
@dataclass(frozen=True)
class Program:
    """One random model and the batches it is called with, in order, on one compiled instance."""

    ops: tuple[str, ...]
    positions: str = "none"
    loss: str = "pad_shift"
    takes_positions: bool = True
    mask: bool = False
    """Pass an attention_mask with zeros (right padding, labels ignored there); the model reads it."""
    lengths: tuple[int, ...] = (32,)
    seed: int = 0
    hidden: int = HIDDEN
    batch: int = 2

    def describe(self) -> str:
        inputs = "ids,labels" + (",position_ids" if self.takes_positions else "") + (",attention_mask" if self.mask
                                                                                      else "")
        return (f"Program(ops={self.ops}, positions={self.positions!r}, loss={self.loss!r}, inputs={inputs}, "
                f"lengths={self.lengths}, hidden={self.hidden}, batch={self.batch}, seed={self.seed})")

    def kinds(self) -> set[str]:
        return {OPS[o].kind for o in self.ops}


class FuzzLM(nn.Module):
    """Embedding -> positions -> the program's ops -> LM head -> causal-LM loss (+ 0.1 x auxiliary terms)."""

    def __init__(self, program: Program):
        super().__init__()
        self.ops = tuple(program.ops)
        self.positions_spelling = program.positions
        self.loss_spelling = program.loss
        h = program.hidden
        self.embed = nn.Embedding(VOCAB, h)
        self.pos = nn.Embedding(MAX_POS, h)
        self.qkv = nn.Linear(h, 3 * h)
        self.out = nn.Linear(h, h)
        self.mix = nn.Linear(h, h)
        self.mix2 = nn.Linear(2 * h, 2 * h)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, h))
        self.tok_mix = nn.Parameter(0.02 * torch.randn(MAX_POS, MAX_POS))
        self.conv_w = nn.Parameter(0.3 * torch.randn(h, 1, 3))
        self.head = nn.Linear(h, VOCAB, bias=False)
        self.register_buffer("inv_freq", 1.0 / (100.0 ** (torch.arange(0, h // 2) / (h // 2))), persistent=False)
        half_head = h // HEADS // 2
        self.register_buffer("rope_freq", 1.0 / (100.0 ** (torch.arange(0, half_head) / half_head)), persistent=False)

    def run(self, input_ids, labels, position_ids, attention_mask):
        env = {"input_ids": input_ids, "positions": position_ids, "mask": attention_mask, "aux": []}
        x = self.embed(input_ids)
        x = POSITIONS[self.positions_spelling][0](self, x, env)
        for name in self.ops:
            x = OPS[name].fn(self, x, env)
        loss = LOSSES[self.loss_spelling](self.head(x), labels)
        for term in env["aux"]:
            loss = loss + 0.1 * term
        return FuzzOutput(loss)

    def forward(self, input_ids, labels=None, position_ids=None, attention_mask=None):
        return self.run(input_ids, labels, position_ids, attention_mask)


class FuzzLMNoPositions(FuzzLM):
    """The same model, whose forward takes no position_ids (positions, if any, are built inside)."""

    def forward(self, input_ids, labels=None, attention_mask=None):
        return self.run(input_ids, labels, None, attention_mask)


def build_model(program: Program) -> FuzzLM:
    torch.manual_seed(program.seed)
    return (FuzzLM if program.takes_positions else FuzzLMNoPositions)(program)


def make_batch(program: Program, seq_len: int, call: int):
    """(input_ids, labels, attention_mask or None) for one call of ``program.batch`` rows: ignored targets spread
    unevenly (a prefix of row 0, a random 20 % of the last row); with a mask, the last row is right-padded (mask 0,
    labels ignored) over a random tail."""
    g = torch.Generator().manual_seed(1000 * program.seed + 17 * call + seq_len)
    rows, last = program.batch, program.batch - 1
    ids = torch.randint(0, VOCAB, (rows, seq_len), generator=g)
    labels = ids.clone()
    labels[0, : seq_len // 3] = IGNORE
    labels[last, torch.rand(seq_len, generator=g) < 0.2] = IGNORE
    mask = None
    if program.mask:
        mask = torch.ones(rows, seq_len, dtype=torch.long)
        pad = int(torch.randint(1, max(2, seq_len // 2), (1,), generator=g))
        mask[last, seq_len - pad:] = 0
        labels[last, seq_len - pad:] = IGNORE
    return ids, labels, mask


# ---- the generator ------------------------------------------------------------------------------
def _lengths(rng: random.Random, sp_size: int, even: bool) -> tuple[int, ...]:
    """Two or three lengths for one compiled model: multiples of P, lengths that need padding, and pairs that
    pad to the same shard length (no recompile between them)."""
    unit = 2 * sp_size if even else 1
    base = rng.choice([16, 24, 32, 40]) if sp_size == 2 else rng.choice([16, 32, 40])
    pool = [base, base - 1, base + sp_size, base - sp_size + 1, base + 2 * sp_size - 1]
    pool = [n for n in pool if n >= 2 * sp_size and n % unit == 0] or [4 * sp_size]
    count = rng.choice([1, 2, 2, 3])
    picked = [pool[0]] + rng.sample(pool[1:], min(count - 1, len(pool) - 1))
    rng.shuffle(picked)
    return tuple(picked)


def generate(count: int, seed: int, sp_size: int, *, max_ops: int = 4) -> list[Program]:
    """``count`` random programs for ``sp_size`` ranks, from one seed (deterministic), each of a hidden size and a
    batch drawn from `HIDDEN_SIZES` and `BATCH_SIZES` (by a generator of their own, so the ops drawn for a seed do not
    depend on the shapes)."""
    rng = random.Random(f"{seed}-{sp_size}")
    shapes = random.Random(f"{seed}-{sp_size}-shapes")
    by_kind: dict[str, list[str]] = {}
    for name, spec in OPS.items():
        by_kind.setdefault(spec.kind, []).append(name)
    programs = []
    for i in range(count):
        takes_positions = rng.random() < 0.6
        mask = rng.random() < 0.3
        have = {"mask"} if mask else set()
        if takes_positions:
            have.add("positions")
        even = rng.random() < 0.15
        if even:
            have.add("even")
        n_ops = rng.randint(1, max_ops)
        ops = []
        # Most programs: one token-mixing or rule-based op among token-local ones, so that a finding is attributable.
        for j in range(n_ops):
            kind = rng.choices(["local", "rule", "mixing"], weights=[6, 3, 1] if j else [3, 3, 2])[0]
            choices = [o for o in by_kind[kind] if OPS[o].needs <= have]
            ops.append(rng.choice(choices))
        if not any(o.startswith("attention") for o in ops) and rng.random() < 0.7:
            ops.insert(rng.randint(0, len(ops)), "attention")
        pos_choices = [p for p, (_, needs) in POSITIONS.items() if needs <= have]
        positions = rng.choice(pos_choices) if rng.random() < 0.5 else "none"
        programs.append(Program(
            ops=tuple(ops), positions=positions, loss=rng.choice(sorted(LOSSES)), takes_positions=takes_positions,
            mask=mask, lengths=_lengths(rng, sp_size, even), seed=seed * 100003 + i,
            hidden=shapes.choice(HIDDEN_SIZES), batch=shapes.choice(BATCH_SIZES)))
    return programs


def sweep(sp_size: int, seed: int = 0) -> list[Program]:
    """One small program per op and per positions spelling (that op, then causal attention, which must see the op's
    output token-sharded to be rewritten), each called first
    with a multiple of P tokens and then with one token fewer (the same shard length, padded): the pool's
    coverage in its most readable form, every finding minimal by construction."""
    full = 8 * sp_size
    lengths = (full, full - 1)
    programs = []
    for i, (name, spec) in enumerate(OPS.items()):
        programs.append(Program(ops=(name, "attention"), takes_positions="positions" in spec.needs,
                                mask="mask" in spec.needs, lengths=(full,) if "even" in spec.needs else lengths,
                                seed=seed * 100003 + i))
    for j, (name, (_, needs)) in enumerate(POSITIONS.items()):
        if name != "none":
            programs.append(Program(ops=("attention",), positions=name, takes_positions="positions" in needs,
                                    lengths=lengths, seed=seed * 100003 + len(OPS) + j))
    return programs
