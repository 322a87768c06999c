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

import json
import math
import operator

import torch
import torch.nn.functional as F

__all__ = ["linear_cross_entropy", "linear_cross_entropy_backward", "tiled_mlp", "tiled_mlp_backward",
           "tokens_per_chunk"]


def tokens_per_chunk(row_bytes: int, configured: int | None, budget: int) -> int:
    """Tokens per chunk of a tiled op: ``configured``, else as many rows of ``row_bytes`` bytes of intermediates
    as fit ``budget`` (at least one)."""
    return configured if configured is not None else max(1, budget // max(1, row_bytes))


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
        _accumulate(grad_weight, grad_logits.t(), h)  # in place: no [vocab, hidden] product per chunk
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


# ---------------------------------------------------------------------------------------------
# The tiled MLP
# ---------------------------------------------------------------------------------------------
# Note [Tiled MLP]
# A transformer's MLP, ``down(act(gate(x)) * up(x))`` (Llama, Qwen2) or ``c_proj(act(c_fc(x)))``
# (GPT-2), is token-local, and its [tokens, intermediate] values (the projections' outputs, the
# activation and its temporaries; intermediate = 3.5-4 x hidden) are its largest tensors.
# ``autosp_testbed::tiled_mlp(x [N, H], w_in0, b_in0, w_in1, b_in1, w_out, b_out, expression,
# chunk_tokens)`` computes, one chunk of ``chunk_tokens`` rows at a time,
#
#     out = linear(f(linear(x, w_in0, b_in0)[, linear(x, w_in1, b_in1)]), w_out, b_out)    [N, O]
#
# where ``f`` is the chain of elementwise ops between the projections, given as ``expression``: a
# small JSON program over a fixed list of elementwise ops (`expression_step`; the graph pass
# writes it from the graph, so GPT-2's tanh-GELU spelt as Python arithmetic is as welcome as
# ``silu(g) * u``).  Weights follow F.linear's [out, in] layout; one or two input projections.  It
# keeps only x (and the parameters) for backward.  The backward, ``tiled_mlp_backward``, recomputes
# each chunk's projections and ``f`` (``f``'s vector-Jacobian product by `expression_vjp`, with
# autograd's formulas: autograd records nothing inside an op's kernel, which runs below it) and
# produces the gradients of x and of every parameter, summing the parameters' over chunks in fp32
# (an fp32 parameter's gradient is its own accumulator).  So [chunk, intermediate] values exist one
# chunk at a time, forward and backward; the extra memory is the fp32 accumulators of parameters
# that are not fp32.  The result and its gradients equal the untiled chain up to the order of fp32
# summation over chunks (tests/autosp/test_tiled_mlp.py).  Both ops are opaque to Dynamo,
# AOTAutograd and Inductor like the tiled loss; the graph pass that places them is
# autosp/passes/dynamo/tiled_mlp.py (Note [Tiled MLP pass]).

_A = torch.ops.aten
_BINARY = {"add", "sub", "mul", "div", "pow"}
_FORWARD = {
    "add": lambda a, b, alpha=1: a + b if alpha == 1 else torch.add(a, b, alpha=alpha),
    "sub": lambda a, b, alpha=1: a - b if alpha == 1 else torch.sub(a, b, alpha=alpha),
    "mul": operator.mul, "div": operator.truediv, "pow": operator.pow, "neg": operator.neg,
    "tanh": torch.tanh, "sigmoid": torch.sigmoid, "exp": torch.exp, "erf": torch.erf, "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt, "square": torch.square, "reciprocal": torch.reciprocal, "relu": torch.relu,
    "silu": F.silu, "gelu": F.gelu, "relu6": F.relu6, "mish": F.mish, "softplus": F.softplus,
    "leaky_relu": F.leaky_relu, "elu": F.elu, "hardswish": F.hardswish,
}
"""The elementwise ops an expression may use, by canonical name, with their literal parameters as keywords."""
_PARAMETERS = {"add": ("alpha",), "sub": ("alpha",), "gelu": ("approximate",), "softplus": ("beta", "threshold"),
               "leaky_relu": ("negative_slope", "inplace"), "elu": ("alpha", "inplace"), "relu": ("inplace",),
               "silu": ("inplace",), "relu6": ("inplace",), "mish": ("inplace",), "hardswish": ("inplace",)}
"""Literal parameters after the operands, in positional order (``inplace`` must be False)."""
_FUNCTION_NAMES = {
    operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "div", operator.neg: "neg",
    operator.pow: "pow", F.sigmoid: "sigmoid", F.tanh: "tanh",
    **{getattr(torch, n): n for n in ("add", "sub", "mul", "div", "pow", "neg", "tanh", "sigmoid", "exp", "erf",
                                      "sqrt", "rsqrt", "square", "reciprocal", "relu")},
    **{getattr(F, n): n for n in ("silu", "gelu", "relu", "relu6", "mish", "softplus", "leaky_relu", "elu",
                                  "hardswish")},
}
_METHOD_NAMES = {
    **{n: (n, False) for n in ("add", "sub", "mul", "div", "pow", "neg", "tanh", "sigmoid", "exp", "erf", "sqrt",
                               "rsqrt", "square", "reciprocal", "relu")},
    **{f"__{n}__": (c, False) for n, c in (("add", "add"), ("sub", "sub"), ("mul", "mul"), ("truediv", "div"),
                                           ("pow", "pow"), ("neg", "neg"))},
    **{f"__r{n}__": (c, True) for n, c in (("add", "add"), ("sub", "sub"), ("mul", "mul"), ("truediv", "div"),
                                           ("pow", "pow"))},
}
"""Tensor methods: name -> (canonical name, operands swapped: ``a.__rsub__(b)`` is ``b - a``)."""
_LITERALS = (bool, int, float, str, type(None))


def expression_step(kind: str, target, args: tuple, kwargs: dict) -> tuple[str, list, dict] | None:
    """A graph call (``kind`` "call_function" or "call_method") as an expression step ``(canonical name,
    operands, literal parameters)``, or None if it is not an allowed out-of-place elementwise op."""
    if kind == "call_method":
        name, swapped = _METHOD_NAMES.get(target, (None, False))
    else:
        name, swapped = (_FUNCTION_NAMES.get(target) if _hashable(target) else None), False
    if name is None:
        return None
    arity = 2 if name in _BINARY else 1
    operands, extra = list(args[:arity]), args[arity:]
    if len(operands) != arity or len(extra) > len(_PARAMETERS.get(name, ())):
        return None
    params = {**dict(zip(_PARAMETERS.get(name, ()), extra, strict=False)), **kwargs}
    if set(params) - set(_PARAMETERS.get(name, ())) or params.pop("inplace", False) or not all(
            is_literal(v) for v in params.values()):
        return None
    if name == "gelu" and params.get("approximate", "none") not in ("none", "tanh"):
        return None
    return name, operands[::-1] if swapped else operands, params


def is_literal(value) -> bool:
    """Whether ``value`` can be an expression's constant (a Python bool, int, float, str or None)."""
    return isinstance(value, _LITERALS)


def _hashable(target) -> bool:
    try:
        hash(target)
    except TypeError:
        return False
    return True


class Ref:
    """A reference to value ``index`` of an expression (its inputs, then its steps' results)."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def encode_expression(inputs: int, steps: list[tuple[str, list, dict]], out: int) -> str:
    """The expression string of ``f``: ``inputs`` tensors (values 0..inputs-1), then ``steps`` as
    `expression_step` gives them, with `Ref`s to earlier values among their operands; ``out`` is the value
    returned."""
    def operand(a):
        if isinstance(a, Ref):
            return {"$": a.index}
        if not is_literal(a):
            raise ValueError(f"expression operand {a!r} is neither a value nor a literal")
        return a

    return json.dumps({"inputs": inputs, "out": out,
                       "steps": [[name, [operand(a) for a in operands], params] for name, operands, params in steps]})


def _run(expression: str, inputs: list[torch.Tensor]) -> tuple[dict, list]:
    program = json.loads(expression)
    if program["inputs"] != len(inputs):
        raise ValueError(f"the expression takes {program['inputs']} inputs, got {len(inputs)}")
    values: list = list(inputs)
    for name, operands, params in program["steps"]:
        if name not in _FORWARD:
            raise ValueError(f"expression step {name!r} is not an allowed elementwise op")
        values.append(_FORWARD[name](*(values[a["$"]] if isinstance(a, dict) else a for a in operands), **params))
    return program, values


def evaluate_expression(expression: str, inputs: list[torch.Tensor]) -> torch.Tensor:
    """Run an expression (`encode_expression`) on its input tensors."""
    program, values = _run(expression, inputs)
    return values[program["out"]]


def _step_vjp(name: str, grad: torch.Tensor, ops: list, params: dict, out: torch.Tensor) -> list:
    """The gradients of one step's operands (None for literals) given its output's gradient: the formulas of
    PyTorch's autograd (tools/autograd/derivatives.yaml), with its backward kernels for the activations."""
    a = ops[0]
    b = ops[1] if len(ops) > 1 else None
    if name == "add":
        return [grad, grad if params.get("alpha", 1) == 1 else grad * params["alpha"]]
    if name == "sub":
        return [grad, -grad if params.get("alpha", 1) == 1 else grad * -params["alpha"]]
    if name == "mul":
        return [grad * b, grad * a]
    if name == "div":
        return [grad / b, -grad * a / (b * b) if isinstance(b, torch.Tensor) else None]
    if name == "pow":
        ga = grad * (b * a.pow(b - 1)) if isinstance(a, torch.Tensor) else None
        gb = None
        if isinstance(b, torch.Tensor):
            gb = grad * (out * (a.log() if isinstance(a, torch.Tensor) else math.log(a)))
        return [ga, gb]
    unary = {
        "neg": lambda: -grad, "exp": lambda: grad * out, "tanh": lambda: _A.tanh_backward(grad, out),
        "sigmoid": lambda: _A.sigmoid_backward(grad, out),
        "erf": lambda: grad * (2.0 / math.sqrt(math.pi)) * torch.exp(-a * a),
        "sqrt": lambda: grad / (2 * out), "rsqrt": lambda: -0.5 * grad * out.pow(3),
        "square": lambda: grad * 2 * a, "reciprocal": lambda: -grad * (out * out),
        "relu": lambda: _A.threshold_backward(grad, out, 0), "silu": lambda: _A.silu_backward(grad, a),
        "gelu": lambda: _A.gelu_backward(grad, a, approximate=params.get("approximate", "none")),
        "relu6": lambda: _A.hardtanh_backward(grad, a, 0.0, 6.0), "mish": lambda: _A.mish_backward(grad, a),
        "softplus": lambda: _A.softplus_backward(grad, a, params.get("beta", 1.0), params.get("threshold", 20.0)),
        "leaky_relu": lambda: _A.leaky_relu_backward(grad, a, params.get("negative_slope", 0.01), False),
        "elu": lambda: _A.elu_backward(grad, params.get("alpha", 1.0), 1, 1, False, a),
        "hardswish": lambda: _A.hardswish_backward(grad, a),
    }
    return [unary[name]()]


def expression_vjp(expression: str, inputs: list[torch.Tensor], grad: torch.Tensor
                   ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The expression's value and the gradients of its inputs given its value's gradient (reverse mode over its
    steps; done by hand because an op's kernel runs below the autograd dispatch keys, where autograd records
    nothing)."""
    program, values = _run(expression, inputs)
    first, out = len(inputs), program["out"]
    result, grads = values[out], {out: grad}
    for index in range(len(values) - 1, first - 1, -1):
        g = grads.pop(index, None)
        name, operands, params = program["steps"][index - first]
        if g is not None:
            ops = [values[a["$"]] if isinstance(a, dict) else a for a in operands]
            for a, ga in zip(operands, _step_vjp(name, g, ops, params, values[index]), strict=True):
                if isinstance(a, dict) and ga is not None:
                    grads[a["$"]] = grads[a["$"]] + ga if a["$"] in grads else ga
        if index != out:
            values[index] = None  # nothing later in the reverse walk reads it
    return result, [grads[i] if i in grads else torch.zeros_like(inputs[i]) for i in range(first)]


def _mlp_projections(w_in0, b_in0, w_in1, b_in1) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    return [(w_in0, b_in0)] + ([(w_in1, b_in1)] if w_in1 is not None else [])


@torch.library.custom_op("autosp_testbed::tiled_mlp", mutates_args=())
def tiled_mlp(x: torch.Tensor, w_in0: torch.Tensor, b_in0: torch.Tensor | None, w_in1: torch.Tensor | None,
              b_in1: torch.Tensor | None, w_out: torch.Tensor, b_out: torch.Tensor | None, expression: str,
              chunk_tokens: int) -> torch.Tensor:
    projections = _mlp_projections(w_in0, b_in0, w_in1, b_in1)
    out = x.new_empty(x.shape[0], w_out.shape[0])
    for start, stop in _chunks(x.shape[0], chunk_tokens):
        rows = x[start:stop]
        hidden = evaluate_expression(expression, [F.linear(rows, w, b) for w, b in projections])
        out[start:stop] = F.linear(hidden, w_out, b_out)
        del hidden
    return out


@tiled_mlp.register_fake
def _(x, w_in0, b_in0, w_in1, b_in1, w_out, b_out, expression, chunk_tokens):
    return x.new_empty(x.shape[0], w_out.shape[0])


def _accumulate(total: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> None:
    """total += a @ b, in place (in total's dtype, fp32 for a parameter that is not)."""
    if total is None:
        return
    if total.dtype == a.dtype:
        total.addmm_(a, b)
    else:
        total += torch.mm(a, b).float()


def _accumulate_sum(total: torch.Tensor | None, rows: torch.Tensor) -> None:
    if total is not None:
        total += rows.sum(0, dtype=total.dtype)


@torch.library.custom_op("autosp_testbed::tiled_mlp_backward", mutates_args=())
def tiled_mlp_backward(grad_out: torch.Tensor, x: torch.Tensor, w_in0: torch.Tensor, b_in0: torch.Tensor | None,
                       w_in1: torch.Tensor | None, b_in1: torch.Tensor | None, w_out: torch.Tensor,
                       b_out: torch.Tensor | None, expression: str, chunk_tokens: int, needs: list[bool]
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                  torch.Tensor]:
    """The gradients of (x, w_in0, b_in0, w_in1, b_in1, w_out, b_out), an empty tensor where ``needs`` is False
    or the parameter is absent."""
    params = (w_in0, b_in0, w_in1, b_in1, w_out, b_out)
    totals = [torch.zeros(p.shape, dtype=torch.float32 if p.dtype != torch.float32 else p.dtype, device=p.device)
              if p is not None and need else None for p, need in zip(params, needs[1:], strict=True)]
    grad_x = x.new_empty(x.shape) if needs[0] else None
    projections = _mlp_projections(w_in0, b_in0, w_in1, b_in1)
    for start, stop in _chunks(x.shape[0], chunk_tokens):
        rows, grad_rows = x[start:stop], grad_out[start:stop]
        inputs = [F.linear(rows, w, b) for w, b in projections]
        hidden, grad_inputs = expression_vjp(expression, inputs, torch.mm(grad_rows, w_out))
        del inputs
        _accumulate(totals[4], grad_rows.t(), hidden)
        _accumulate_sum(totals[5], grad_rows)
        del hidden
        for i, ((w, _), grad) in enumerate(zip(projections, grad_inputs, strict=True)):
            _accumulate(totals[2 * i], grad.t(), rows)
            _accumulate_sum(totals[2 * i + 1], grad)
            if grad_x is not None and i:
                grad_x[start:stop].addmm_(grad, w)
            elif grad_x is not None:
                torch.mm(grad, w, out=grad_x[start:stop])
        del grad_inputs, grad  # the loop variable would keep the last gradient into the next chunk
    return (grad_x if grad_x is not None else x.new_empty(0),  # distinct empties: outputs may not alias
            *(t.to(p.dtype) if t is not None else x.new_empty(0) for p, t in zip(params, totals, strict=True)))


@tiled_mlp_backward.register_fake
def _(grad_out, x, w_in0, b_in0, w_in1, b_in1, w_out, b_out, expression, chunk_tokens, needs):
    params = (w_in0, b_in0, w_in1, b_in1, w_out, b_out)
    return (x.new_empty(x.shape) if needs[0] else x.new_empty(0),  # contiguous, as the kernel returns them
            *(p.new_empty(p.shape) if p is not None and need else x.new_empty(0)
              for p, need in zip(params, needs[1:], strict=True)))


def _mlp_setup_context(ctx, inputs, output):
    *tensors, ctx.expression, ctx.chunk_tokens = inputs
    ctx.save_for_backward(*tensors)


def _mlp_backward(ctx, grad_out):
    tensors = ctx.saved_tensors
    needs = [bool(need) and t is not None for need, t in zip(ctx.needs_input_grad, tensors, strict=False)]
    grads = tiled_mlp_backward(grad_out, *tensors, ctx.expression, ctx.chunk_tokens, needs)
    return (*(g if need else None for g, need in zip(grads, needs, strict=True)), None, None)


tiled_mlp.register_autograd(_mlp_backward, setup_context=_mlp_setup_context)
