"""Liger-Kernel's RMSNorm as a traced model runs it: what its autograd keeps, not how its Triton kernel computes.

Note [Liger's RMSNorm in a trace]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
ALST's rows with ``model.type: liger`` (ArcticTraining ``arctic_training/model/liger_factory.py``) load the model
through ``AutoLigerKernelForCausalLM``, whose ``apply_liger_kernel_to_llama`` replaces Llama's RMSNorm by default
(``rms_norm=True``; linkedin/Liger-Kernel ``src/liger_kernel/transformers/monkey_patch.py``, commit 05b43a14 of
30 April 2025). Its ``LigerRMSNormFunction`` (``src/liger_kernel/ops/rms_norm.py``, ``rms_norm_forward``) keeps
for the backward the input ``X`` in its own dtype and ``RSTD``, one fp32 value per row, and computes in fp32
inside one kernel (Llama casting: ``(X.float() * rstd).to(X.dtype) * W``); Hugging Face's ``LlamaRMSNorm`` runs it
as separate ops, so autograd keeps the fp32 copy of the input ([tokens, hidden] at 4 bytes) and the normalised
fp32 values. `liger_rms_norm` is the same arithmetic written so that autograd keeps ``X`` and ``rstd`` plus one
tensor Liger does not keep: the normalised values in ``X``'s dtype, which the weight's gradient reads (Liger
recomputes them in its backward kernel): [tokens, hidden] at 2 bytes per norm, where Hugging Face's keeps 4 bytes
and more.  (AutoSP accepts a custom ``autograd.Function`` only when its backward is token-local, and the weight's
gradient sums over the tokens, so the exact saved set is not traceable here.)  Its fp32 temporaries are a
pointwise chain that the simulator fuses (:mod:`simulator.fusion`), as Liger's kernel does.
"""

from __future__ import annotations

import functools

import torch


def liger_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` with the mean in fp32, written so that autograd keeps
    ``x`` in its own dtype and the fp32 ``rstd`` (as Liger does), not an fp32 copy of ``x`` (Note [Liger's RMSNorm
    in a trace])."""
    rstd = torch.rsqrt((x * x).mean(-1, keepdim=True, dtype=torch.float32) + eps)
    return weight * (x * rstd).to(x.dtype)


def use_liger_rms_norm(model: torch.nn.Module) -> int:
    """Make every ``LlamaRMSNorm`` of ``model`` run `liger_rms_norm` (its parameters unchanged); the number of
    modules changed."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    changed = 0
    for module in model.modules():
        if type(module) is LlamaRMSNorm:
            module.__class__ = _liger_llama_rms_norm()
            changed += 1
    return changed


@functools.cache
def _liger_llama_rms_norm() -> type:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class LigerLlamaRMSNorm(LlamaRMSNorm):
        def forward(self, hidden_states):
            return liger_rms_norm(hidden_states, self.weight, self.variance_epsilon)

    return LigerLlamaRMSNorm
