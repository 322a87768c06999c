"""The tiled output projection and causal-LM loss as custom ops: never the whole [tokens, vocab] logits.

Note [Tiled logits and loss]
At long context the largest tensors of a causal-LM step are the logits of the output
projection and their fp32 copies: [tokens, vocab] (16,384 tokens x a 128,256 vocabulary are
7.83 GiB in fp32), and cross-entropy keeps its log-softmax of the same size for backward.
``autosp_testbed::linear_cross_entropy(hidden [N, H], weight [V, H], bias [V] | None,
target [N], ignore_index, chunk_tokens)`` computes

    loss_sum = sum over rows i with target_i != ignore_index of  lse_i - z[i, target_i],
    z = hidden @ weight.T + bias (in the model's dtype), lse_i = logsumexp_j z[i, j] (fp32),

one chunk of ``chunk_tokens`` rows at a time, and returns ``(loss_sum, lse)``: an fp32
scalar and the [N] fp32 log-sum-exps, the only values the backward keeps.  Only one
chunk's [chunk, V] logits (and their fp32 copy) exist at any time.  The backward,
``autosp_testbed::linear_cross_entropy_backward``, recomputes the logits block by block and
forms their gradient g * (softmax(z) - onehot(target)) for valid rows from the saved lse.
Sums over blocks are fp32.  By token chunks, the weight's and bias's gradients are summed over
chunks; an fp32 weight is its own accumulator, a bf16 one needs a [V, H] fp32 one.  So for a
weight that is not fp32 and fewer tokens than classes the backward runs over vocabulary blocks
of [N, chunk * V / N] instead: each block of the weight's gradient is then one matmul over all
tokens (as untiled), and the sum over blocks is the hidden states' gradient, [N, H] in fp32.
The extra memory is therefore min(N, V) x H fp32 values for a bf16 weight, none for fp32.

The result equals ``F.cross_entropy(F.linear(hidden, weight, bias).float(), target,
ignore_index=ignore_index, reduction="sum")`` and its gradients up to the order of fp32
summation (tests/autosp/test_tiled_loss.py).  Both ops are opaque nodes to Dynamo,
AOTAutograd and Inductor, like the collectives in autosp/ops.py; the graph pass that
places them is autosp/passes/dynamo/tiled_loss.py, which also explains how the
sequence-sharding analysis classifies them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["linear_cross_entropy", "linear_cross_entropy_backward"]


def _chunks(rows: int, chunk_tokens: int):
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    for start in range(0, rows, chunk_tokens):
        yield start, min(rows, start + chunk_tokens)


@torch.library.custom_op("autosp_testbed::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                         ignore_index: int, chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = hidden.shape[0]
    lse = torch.empty(rows, dtype=torch.float32, device=hidden.device)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start, stop in _chunks(rows, chunk_tokens):
        logits = F.linear(hidden[start:stop], weight, bias).float()  # one chunk, in fp32
        chunk_lse = torch.logsumexp(logits, dim=-1)
        t = target[start:stop]
        valid = t != ignore_index
        picked = logits.gather(1, torch.where(valid, t, 0).unsqueeze(1)).squeeze(1)
        total += torch.where(valid, chunk_lse - picked, 0.0).sum()
        lse[start:stop] = chunk_lse
        del logits
    return total, lse


@linear_cross_entropy.register_fake
def _(hidden, weight, bias, target, ignore_index, chunk_tokens):
    return hidden.new_empty((), dtype=torch.float32), hidden.new_empty(hidden.shape[0], dtype=torch.float32)


def _grad_logits(logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, row_scale: torch.Tensor,
                 first_class: int) -> torch.Tensor:
    """(softmax - onehot(target)) * row_scale for a block of logits holding classes [first_class, first_class +
    columns), in place on their fp32 copy.  ``row_scale`` is the loss gradient on valid rows, 0 on ignored ones."""
    probs = logits.float()
    probs.sub_(lse.unsqueeze(1)).exp_()
    local = target - first_class
    hit = (row_scale != 0) & (local >= 0) & (local < probs.shape[1])
    probs.scatter_add_(1, torch.where(hit, local, 0).unsqueeze(1), hit.to(probs.dtype).neg().unsqueeze(1))
    return probs.mul_(row_scale.unsqueeze(1))


def _backward_by_tokens(hidden, weight, bias, target, lse, row_scale, chunk_tokens, weight_grad, bias_grad):
    """Token chunks: each chunk's logits once; the weight's and bias's gradients summed over chunks in fp32."""
    grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if weight_grad else None
    grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if bias_grad else None
    for start, stop in _chunks(hidden.shape[0], chunk_tokens):
        h = hidden[start:stop]
        grad_logits = _grad_logits(F.linear(h, weight, bias), lse[start:stop], target[start:stop],
                                   row_scale[start:stop], 0).to(hidden.dtype)
        grad_hidden[start:stop] = torch.mm(grad_logits, weight)
        if grad_weight is not None:
            grad_weight += torch.mm(grad_logits.t(), h).float()
        if grad_bias is not None:
            grad_bias += grad_logits.float().sum(0)
    return grad_hidden, grad_weight, grad_bias


def _backward_by_vocabulary(hidden, weight, bias, target, lse, row_scale, block_classes, bias_grad):
    """Vocabulary blocks: each block of the weight's gradient is one matmul over all tokens (as untiled); the
    hidden states' gradient summed over blocks in fp32.  For fewer tokens than classes, where this fp32
    accumulator ([tokens, H]) is smaller than the weight's ([V, H])."""
    grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    grad_weight = torch.empty_like(weight)
    grad_bias = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device) if bias_grad else None
    for start, stop in _chunks(weight.shape[0], block_classes):
        w = weight[start:stop]
        grad_logits = _grad_logits(F.linear(hidden, w, None if bias is None else bias[start:stop]), lse, target,
                                   row_scale, start).to(hidden.dtype)
        grad_hidden += torch.mm(grad_logits, w).float()
        grad_weight[start:stop] = torch.mm(grad_logits.t(), hidden)
        if grad_bias is not None:
            grad_bias[start:stop] = grad_logits.float().sum(0)
    return grad_hidden.to(hidden.dtype), grad_weight, grad_bias


def by_vocabulary(rows: int, vocab: int, dtype: torch.dtype, weight_grad: bool) -> bool:
    """Whether the backward loops over vocabulary blocks: a weight gradient to sum in fp32 for a weight that is
    not fp32 (an fp32 one is its own accumulator), and fewer tokens than classes."""
    return weight_grad and dtype != torch.float32 and rows < vocab


@torch.library.custom_op("autosp_testbed::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward(grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                                  bias: torch.Tensor | None, target: torch.Tensor, lse: torch.Tensor,
                                  ignore_index: int, chunk_tokens: int, weight_grad: bool, bias_grad: bool
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad of hidden, grad of weight or an empty tensor, grad of bias or an empty tensor)."""
    rows, vocab = hidden.shape[0], weight.shape[0]
    row_scale = torch.where(target != ignore_index, grad_loss.float(), 0.0)
    if by_vocabulary(rows, vocab, weight.dtype, weight_grad):
        block = max(1, chunk_tokens * vocab // max(rows, 1))  # a [rows, block] block as large as one chunk
        grads = _backward_by_vocabulary(hidden, weight, bias, target, lse, row_scale, block, bias_grad)
    else:
        grads = _backward_by_tokens(hidden, weight, bias, target, lse, row_scale, chunk_tokens, weight_grad,
                                    bias_grad)
    grad_hidden, grad_weight, grad_bias = grads
    empty = hidden.new_empty(0)
    return (grad_hidden,
            grad_weight.to(weight.dtype) if grad_weight is not None else empty,
            grad_bias.to(bias.dtype) if grad_bias is not None else empty)


@linear_cross_entropy_backward.register_fake
def _(grad_loss, hidden, weight, bias, target, lse, ignore_index, chunk_tokens, weight_grad, bias_grad):
    return (torch.empty_like(hidden), weight.new_empty(weight.shape if weight_grad else (0,)),
            weight.new_empty(weight.shape[0] if bias_grad else 0))


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, target, ctx.ignore_index, ctx.chunk_tokens = inputs
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(output[1])  # the log-sum-exps are returned for the backward only
    ctx.save_for_backward(hidden, weight, bias, target, output[1])


def _backward(ctx, grad_loss, grad_lse):
    hidden, weight, bias, target, lse = ctx.saved_tensors
    need = ctx.needs_input_grad
    grad_hidden, grad_weight, grad_bias = linear_cross_entropy_backward(
        grad_loss, hidden, weight, bias, target, lse, ctx.ignore_index, ctx.chunk_tokens,
        bool(need[1]), bool(ctx.has_bias and need[2]))
    return (grad_hidden if need[0] else None, grad_weight if need[1] else None,
            grad_bias if ctx.has_bias and need[2] else None, None, None, None)


linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)
