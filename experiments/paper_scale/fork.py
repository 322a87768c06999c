"""What the authors' research fork of DeepSpeed ran, as options of the paper-scale traces.

Note [The traced workloads of the AutoSP research fork]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The published figures were made with GitHub spikerheado1234/AutoSP at commit
fd542b43619e03c7454abfcff3b5aaeef05c5318 (README: torch 2.7.0, transformers 4.50.3; Note [The public
configurations of the published runs] in experiments/paper_scale/config.py).  Three things it ran change the
traced program, not the ledger; a `ForkTrace` names which of them a configuration traces:

- ``checkpointing``: AutoSP is compiled by ``torch._inductor.compile`` (``deepspeed/compile/backend.py``,
  ``make_autosp_backend``), whose min-cut partitioner the fork replaces with ``need_to_copy_paste/partitioners.py``
  (README step 6): a tensor the backward reads may be recomputed only when its dim 1 is at least 4096 (line 1081).
  Traced as ``checkpointing="long-context"`` (Note [The long-context rule of the AutoSP research fork] in
  autosp/passes/joint/checkpointing.py) in place of this project's SAC, which stays AutoSP's own setting.
- ``repeat_kv``: AutoSP runs the model with ``attn_implementation="sdpa"`` (``bench_dc_ulysses/run_acc_lm.py``,
  ``attention_backend = "sdpa"`` for ``--compile deepcompile``), and transformers 4.50.3's ``sdpa_attention_forward``
  (``src/transformers/integrations/sdpa_attention.py``, lines 29-31 at tag v4.50.3) repeats K/V to every query head
  before SDPA.  The fork's AutoSP pass puts its all-to-alls on SDPA's own arguments
  (``deepspeed/compile/passes/autosp.py``, ``pass_insert_attention_all_to_all``), so the K/V all-to-alls carry
  every query head and what the backward keeps of K/V holds every head.  Traced through `repeat_kv_attention`,
  which does what 4.50.3's function does (the installed transformers passes ``enable_gqa`` instead).
- ``ulysses_kernel``: the Ulysses baseline is DeepSpeed's ``DistributedAttention`` around ``sdpa_wrapper``
  (``bench_dc_ulysses/distributed_attention.py``): SDPA with ``is_causal=True`` and ``enable_gqa=False`` since
  commit f97a5a6 ("working sp", 2026-01-28; ``True`` from 181c2c5, "add enable_gqa flag", 2026-01-25).  The
  baseline's attention function receives K/V before any repetition (it replaces ``sdpa_attention_forward``), so
  with a GQA model query and K/V head counts differ and no fused kernel accepts them without ``enable_gqa``: torch
  runs ``_scaled_dot_product_attention_math`` (aten/src/ATen/native/transformers/attention.cpp), which upcasts
  bf16 q, k, v to fp32 (unless ``allow_fp16_bf16_reduction_math_sdp`` is set, which the fork does not), builds the
  causal mask as an [S, S] tensor, and materialises the [B, H/P, S, S] scores and their softmax, which autograd
  keeps for the backward.  That only runs when the per-rank K/V heads broadcast against the query heads (one K/V
  head per rank: SP 8 for the Llama-3 models).  At SP 4 or 2 a GQA model ran at no public commit: until 8491331
  ("add zero-1 support to all baselines", 2026-01-30) ``DistributedAttention`` ran on ``dist.group.WORLD`` (SP =
  every rank), and from then on ``enable_gqa`` was False and the per-rank heads do not broadcast; such a
  configuration is traced with the fused kernel, as if ``enable_gqa`` were True (`ulysses_kernel`).  Traced with
  ``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)``, so the math kernel's own decomposition is what the trace
  holds.  It differs from the fork's in one way: the project's AutoSP pass passes ``enable_gqa=True`` where heads
  differ, so the math kernel repeats K/V (fp32, [B, H/P, S, D]) instead of broadcasting them.
"""

from __future__ import annotations

from dataclasses import dataclass

FORK = "spikerheado1234/AutoSP fd542b4"
REPEAT_KV_ATTENTION = "sdpa_repeat_kv_4_50"
"""The transformers attention implementation `repeat_kv_attention` is registered under."""
CAUSAL_ATTENTION = "sdpa_causal_no_mask"
"""transformers' own ``sdpa_attention_forward`` under a name whose mask function builds no mask (SDPA's
``is_causal`` applies the causal rule, as flash_attention_2's mask function leaves it to the kernel): a model run
with ``use_cache=False`` then builds no [S, S] mask from its position ids (`causal_attention_mask`)."""
KERNELS = ("fused", "math")
ATTENTIONS = ("sdpa", REPEAT_KV_ATTENTION, CAUSAL_ATTENTION)


@dataclass(frozen=True)
class ForkTrace:
    """Which of the fork's traced behaviours a configuration models (Note [The traced workloads of the AutoSP
    research fork]); the default models none of them (this project's AutoSP, transformers' attention as
    installed, fused attention for every baseline)."""

    checkpointing: str | None = None
    """AutoSP's ``checkpointing`` option in place of its own (``"long-context"``: the fork's rule)."""
    repeat_kv: bool = False
    """AutoSP's model repeats K/V to every query head before SDPA (transformers 4.50.3)."""
    ulysses_enable_gqa: bool | None = None
    """The hand-written Ulysses baseline's ``enable_gqa`` (False: the fork's head commit; None: not modelled,
    fused attention)."""

    @property
    def label(self) -> str:
        parts = [f"AutoSP checkpointing {self.checkpointing}" if self.checkpointing else "",
                 "K/V repeated before SDPA" if self.repeat_kv else "",
                 "" if self.ulysses_enable_gqa is None else f"Ulysses enable_gqa={self.ulysses_enable_gqa}"]
        return ", ".join(p for p in parts if p)


FORK_TRACE = ForkTrace(checkpointing="long-context", repeat_kv=True, ulysses_enable_gqa=False)
"""What the fork's head commit traces (Note [The traced workloads of the AutoSP research fork])."""


def ulysses_kernel(fork: ForkTrace, *, heads: int, kv_heads: int, sp_size: int) -> str:
    """The attention kernel the hand-written Ulysses baseline gets for a model with ``heads`` query and
    ``kv_heads`` K/V heads split over ``sp_size`` ranks: ``"math"`` where the fork's head commit runs a GQA model
    without ``enable_gqa`` (one K/V head per rank, which broadcasts), ``"fused"`` otherwise (equal heads,
    ``enable_gqa``, or a split whose heads do not broadcast, which ran at no public commit and is traced as if
    ``enable_gqa`` were True)."""
    if fork.ulysses_enable_gqa is None or fork.ulysses_enable_gqa or heads == kv_heads:
        return "fused"
    return "math" if kv_heads == sp_size else "fused"


def repeat_kv_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                        **kwargs):
    """transformers 4.50.3's ``sdpa_attention_forward``: K/V repeated to every query head, then SDPA (causal
    when the query has more than one token and no mask is given)."""
    import torch

    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        b, kv_heads, s, d = key.shape
        key = key[:, :, None].expand(b, kv_heads, groups, s, d).reshape(b, kv_heads * groups, s, d)
        value = value[:, :, None].expand(b, kv_heads, groups, s, d).reshape(b, kv_heads * groups, s, d)
    mask = attention_mask if attention_mask is None else attention_mask[:, :, :, : key.shape[-2]]
    if is_causal is None:
        is_causal = query.shape[2] > 1 and mask is None
    out = torch.nn.functional.scaled_dot_product_attention(
        query.contiguous(), key.contiguous(), value.contiguous(), attn_mask=mask, dropout_p=dropout, scale=scaling,
        is_causal=is_causal)
    return out.transpose(1, 2).contiguous(), None


def build_llama(hf_config, attention: str = "sdpa"):
    """A ``LlamaForCausalLM`` from ``hf_config`` whose attention is ``attention`` (one of `ATTENTIONS`)."""
    import transformers

    if attention not in ATTENTIONS:
        raise ValueError(f"attention {attention!r}: choose one of {ATTENTIONS}")
    model = transformers.LlamaForCausalLM(hf_config)
    if attention == REPEAT_KV_ATTENTION:
        # transformers' registry is global; the name is fixed and the function the same, so registering it again
        # changes nothing.  Only this model's config selects it.
        transformers.AttentionInterface.register(REPEAT_KV_ATTENTION, repeat_kv_attention)
        model.set_attn_implementation(REPEAT_KV_ATTENTION)
    elif attention == CAUSAL_ATTENTION:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import AttentionMaskInterface

        transformers.AttentionInterface.register(CAUSAL_ATTENTION, sdpa_attention_forward)
        AttentionMaskInterface.register(CAUSAL_ATTENTION, causal_attention_mask)
        model.set_attn_implementation(CAUSAL_ATTENTION)
    return model


def causal_attention_mask(*args, **kwargs):
    """The mask function of `CAUSAL_ATTENTION`: no mask (the kernel is causal), whatever the inputs."""
    return None


def sdpa_backends(kernel: str):
    """The context in which a trace gets ``kernel`` (one of `KERNELS`): SDPA restricted to the math kernel, or
    left as it is."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    if kernel not in KERNELS:
        raise ValueError(f"kernel {kernel!r}: choose one of {KERNELS}")
    return sdpa_kernel([SDPBackend.MATH]) if kernel == "math" else contextlib.nullcontext()
