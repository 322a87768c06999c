"""Op family: elementwise ops (with broadcasting).  See Note [Op rule registry] in autosp.passes.dynamo.registry.

An elementwise op is token-local when its token-sharded operands' token axes land
on the same output dim; a replicated operand with one entry per local token (a
buffer sliced to the shard's length) is refused, as is a literal equal to a
token count read from a shard's shape that scales a sum over the sequence.
"""

from __future__ import annotations

import linecache
import operator
import re

import torch
from torch import fx

from autosp.passes.dynamo.placements import (
    PARTIAL,
    REPLICATE,
    Partial,
    Shard,
    broadcast_dim,
    describe,
    real_shard,
)
from autosp.passes.dynamo.registry import FIX_GENERIC, arguments, ndim, op_name, rule, shape, tensor_args
from autosp.passes.graph_utils import fake_value, module_name

_LINEAR_NAMES = frozenset((
    "add", "sub", "neg", "mul", "div", "true_divide", "truediv", "iadd", "isub", "imul", "itruediv", "__add__",
    "__sub__", "__mul__", "__truediv__", "__neg__", "__radd__", "__rmul__", "pos"))
"""Pointwise ops that keep a partial sum a partial sum (with the other operand replicated for mul/div)."""
_SUMS = frozenset(("add", "sub", "iadd", "isub", "__add__", "__sub__", "__radd__"))
_DIVISIONS = frozenset(("div", "true_divide", "truediv", "itruediv", "__truediv__"))
_PER_TOKEN_HINT = ("derive it from position_ids or compute it inside the attention call")


@rule("token-local: elementwise",
      "add", "sub", "mul", "div", "true_divide", "floor_divide", "truediv", "floordiv", "mod", "remainder", "pow",
      "neg", "pos", "abs", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "square",
      "reciprocal", "sin", "cos", "tan", "tanh", "sinh", "cosh", "asin", "acos", "atan", "atan2", "sigmoid", "erf",
      "erfc", "sign", "floor", "ceil", "round", "trunc", "frac", "clamp", "clip", "clamp_min", "clamp_max",
      "maximum", "minimum", "fmax", "fmin", "where", "masked_fill", "lerp", "addcmul", "addcdiv", "eq", "ne", "lt",
      "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "logical_xor", "and_", "or_", "xor", "invert",
      "bitwise_and", "bitwise_or", "bitwise_not", "isnan", "isinf", "isfinite", "nan_to_num", "relu", "relu6",
      "silu", "gelu", "mish", "softplus", "elu", "selu", "celu", "leaky_relu", "hardtanh", "hardswish",
      "hardsigmoid", "logsigmoid", "softsign", "tanhshrink", "threshold", "fmod", "hypot", "sgn", "polar", "complex",
      "conj", "conj_physical", "angle",
      "iadd", "isub", "imul", "itruediv", "add_", "sub_", "mul_", "div_", "masked_fill_", "clamp_", "copy_",
      "__add__", "__sub__", "__mul__", "__truediv__", "__radd__", "__rsub__", "__rmul__", "__rtruediv__",
      "__neg__", "__pow__", "__rpow__", "__and__", "__or__", "__invert__", "__eq__", "__ne__", "__lt__",
      "__le__", "__gt__", "__ge__", "__floordiv__", "__mod__")
def pointwise(an, gm, node: fx.Node):
    return elementwise(an, node)


def elementwise(an, node: fx.Node):
    """The placement of an elementwise op's result (shared with the binary forms of max/min and dropout)."""
    name = op_name(node)
    out = fake_value(node)
    args = {a: an.of(a) for a in tensor_args(node)}
    if args:
        globalize_token_counts(an, node)
    if any(a in an.sequence_reduced for a in args):
        check_token_count_literal(an, node)
    if not any(isinstance(p, (Shard, Partial)) for p in args.values()):
        return REPLICATE
    if not isinstance(out, torch.Tensor):
        raise an.refuse(node, "turns a token-sharded tensor into a Python value", FIX_GENERIC)
    partials = [a for a, p in args.items() if isinstance(p, Partial)]
    if partials:
        others = [a for a, p in args.items() if not isinstance(p, Partial)]
        linear = name in _LINEAR_NAMES and (
            len(partials) == len(args) and name in _SUMS
            or len(partials) == 1 and all(not isinstance(args[o], Shard) for o in others)
            and (name not in _DIVISIONS or node.args[0] is partials[0])
        )
        if not linear or any(isinstance(p, Shard) for p in args.values()):
            raise an.refuse(node, "applies a non-linear function to a partial sum over the sequence",
                            "only sums and means over the sequence are supported, combined linearly")
        check_token_count_literal(an, node)
        return PARTIAL
    check_token_count_literal(an, node, sharded=True)
    out_ndim = out.dim()
    real = {a: p for a, p in args.items() if real_shard(p)}
    lead = real or {a: p for a, p in args.items() if isinstance(p, Shard)}
    first_arg, first = next(iter(lead.items()))
    target = (broadcast_dim(first.dim, ndim(first_arg), out_ndim), first.inner)
    positions = set()
    for arg, p in args.items():
        if isinstance(p, Shard):
            where = (broadcast_dim(p.dim, ndim(arg), out_ndim), p.inner)
            aligned = where == target and shape(arg)[p.dim] == out.shape[target[0]]
            if p.tentative:
                if real and aligned:
                    an.use_positions(p, "token")
                elif real or not aligned:
                    an.use_positions(p, "replicated")
                    args[arg] = REPLICATE
                else:
                    positions |= p.positions
            elif not aligned:
                raise an.refuse(node, f"combines token-sharded operands whose token axes do not line up "
                                f"({p} vs dim {target[0]})", FIX_GENERIC)
    for arg, p in args.items():
        if p is REPLICATE:
            d = target[0] - (out_ndim - ndim(arg))
            if 0 <= d < ndim(arg) and shape(arg)[d] != 1:
                if not real:  # only tentative positions: a replicated value of the same length decides it
                    an.use_positions(Shard(0, 1, frozenset(positions)), "replicated")
                    return REPLICATE
                refuse_replicated_per_token(an, node, real[next(iter(real))], arg)
    return Shard(target[0], target[1], frozenset(positions) if not real else frozenset())


def token_count_scale(an, value) -> bool | None:
    """For a SymInt: None if it does not depend on this rank's token count, True if it is proportional to it
    (``S``, ``B * S * H``: the single-device value is ``sp_size`` times this rank's), False otherwise."""
    symbol = an.token_symbol
    if symbol is None or not isinstance(value, torch.SymInt) or symbol not in value.node.expr.free_symbols:
        return None
    return symbol not in (value.node.expr / symbol).free_symbols


def globalize_token_counts(an, node: fx.Node) -> None:
    """Note [Token counts]: a token count read from a shard's dynamic shape (``x.shape[1]``, ``x.size(1)``,
    ``x.numel()``, ``len(x)``), in arithmetic on tensor values, becomes the sequence's (times sp_size)."""
    for arg in node.all_input_nodes:
        proportional = token_count_scale(an, fake_value(arg))
        if proportional is None:
            continue
        if not proportional:
            raise an.refuse(node, f"computes with {arg.name} = {fake_value(arg)}, derived non-linearly from this "
                            "rank's token count (read from a shape), whose single-device value AutoSP cannot "
                            "derive", "count the tokens with a reduction (e.g. torch.ones_like(x).sum())")
        # Checked again on every call of the program: autosp.context.TraceContext.require_unpadded.
        an.ctx.require_unpadded(f"{describe(node)} in module {module_name(node)} computes with {arg.name}, a count "
                                "of this rank's tokens read from a shape")
        with node.graph.inserting_before(node):
            whole = node.graph.call_function(operator.mul, (arg, an.ctx.sp_size))
        an.set(whole, REPLICATE)
        node.replace_input_with(arg, whole)


def refuse_replicated_per_token(an, node: fx.Node, placement, arg: fx.Node):
    """A replicated operand of the token axis's length, combined with token-sharded values: refused (any op)."""
    raise an.refuse(
        node, f"combines the token-sharded {placement} operand with a replicated tensor ({arg.name}, shape "
        f"{list(shape(arg))}) that has one entry per local token: in the single-device program that tensor covers "
        "the whole sequence, and its global form is unknown (a buffer sliced to the sequence length, e.g. a "
        "precomputed mask or position table)", _PER_TOKEN_HINT)


def check_token_count_literal(an, node, *, sharded: bool = False):
    """A literal equal to a local token count, in arithmetic on values, was probably read from a shard's shape.

    Dynamo bakes ``x.shape[1]``, ``x.size(1)``, ``x.numel()`` and ``len(x)`` of a static shape into the graph as
    constants, so the local count and a coincidental literal look alike.  Refused where the shard's count would
    change the result: scaling a sum over the sequence by a multiple of the shard's token count
    (``x.sum(1) / x.shape[1]``), or (``sharded``) multiplying or dividing token-sharded values by exactly the
    shard's token count or the shard's element count (``x * x.size(1)``, ``x / x.numel()``) on a source line
    that reads a shape (a literal that only equals the count by coincidence, ``x / 16``, is left alone)."""
    if not an.seq_len:
        return
    if sharded:
        if op_name(node) not in _LINEAR_NAMES or op_name(node) in _SUMS or not _reads_a_shape(node):
            return
        counts = {an.seq_len}
        for a in tensor_args(node):
            p = an.of(a)
            if isinstance(p, Shard) and not p.tentative:  # static sizes only (a dynamic count is a node)
                counts |= {n for n in (fake_value(a).numel(), shape(a)[p.dim]) if type(n) is int}
        counts.discard(1)
    else:
        counts = _counts_from_tokens(an.seq_len) | {n for n in an.sharded_numels if n > 1}
    for value in _literal_operands(node):
        if _is_count_or_inverse(value, counts):
            relation = "a multiple" if sharded else _relation(value, an.seq_len)
            raise an.refuse(node, f"scales {'token-sharded values' if sharded else 'a sum over the sequence'} by "
                            f"{value}, {relation} of this rank's {an.seq_len} tokens (probably read from a tensor's "
                            "shape, size(), numel() or len(), which are the shard's, not the sequence's), or its reciprocal",
                            "use mean() over the tokens, or count them with a reduction "
                            "(e.g. torch.ones_like(x).sum()), so the count is global")


_COUNT_MULTIPLES = range(1, 65)
"""Multiples of the local token count a literal scaling a sum over the sequence is compared with (batch x tokens)."""


def _counts_from_tokens(tokens: int) -> set[int]:
    """Values a count computed from ``tokens`` (this rank's token count, read from a static shape) takes in
    ordinary code: its multiples (times a batch) and the count one off (``S - 1``: an unbiased variance, a
    shifted sequence's length).  Dynamo bakes such a count into the graph as a literal, so a sum over the sequence
    scaled by one of them is refused (Note [Token counts] in autosp/passes/dynamo/sharding.py, which says what
    this does not see)."""
    return {tokens * k for k in _COUNT_MULTIPLES} | {tokens - 1, tokens + 1}


def _relation(value: float, tokens: int) -> str:
    """How literal ``value`` (or its reciprocal) relates to ``tokens``, for a refusal."""
    count = round(1.0 / value) if 0 < value < 1 else int(value)
    return "a multiple" if count % tokens == 0 else "one off"


_SCALAR_FACTORIES = frozenset(("tensor", "as_tensor", "scalar_tensor", "full"))


def _literal_operands(node: fx.Node) -> list:
    """The Python numbers ``node`` computes with: its literal arguments, and the literal inside a scalar tensor
    made for it (``x / torch.tensor(float(x.shape[1]))``)."""
    values = []
    for value in arguments(node).values():
        if isinstance(value, fx.Node):
            if value.op == "call_function" and op_name(value) in _SCALAR_FACTORIES:
                values += [v for v in value.args if not isinstance(v, fx.Node)]
        else:
            values.append(value)
    return [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]


def _is_count_or_inverse(value: float, counts: set[int]) -> bool:
    """``value`` is one of the token counts, or the reciprocal of one (``* (1.0 / x.shape[1])``)."""
    if value in counts and value > 1:
        return True
    if isinstance(value, float) and 0 < value < 1:
        inverse = 1.0 / value
        nearest = round(inverse)
        return nearest > 1 and nearest in counts and abs(inverse - nearest) <= 1e-9 * nearest
    return False


_SHAPE_READ = re.compile(r"\.shape\b|\.size\(|\bnumel\(|\blen\(")


_ASSIGNMENT = re.compile(r"\s*([\w\s,()\[\]]+?)\s*(?<![=!<>+\-*/%&|^])=(?!=)\s*(.*)")
_FUNCTION_START = re.compile(r"\s*(async\s+)?def\s")


def _reads_a_shape(node: fx.Node) -> bool:
    """Whether the source line that made ``node`` reads a shape, directly or through a name assigned from one
    earlier in the same function (``n = x.shape[1]`` ... ``x / n``); True when no source line was recorded."""
    trace = node.meta.get("stack_trace") or ""
    code = [line for line in trace.splitlines()
            if line.strip() and set(line.strip()) - set("^~") and not line.lstrip().startswith("File ")]
    frames = re.findall(r'File "([^"]+)", line (\d+)', trace)
    if not code or not frames:
        return True
    if _SHAPE_READ.search(code[-1]):
        return True
    names = set(re.findall(r"\b[A-Za-z_]\w*\b", code[-1]))
    path, line = frames[-1]
    lines = linecache.getlines(path)
    for text in reversed(lines[: int(line) - 1]):
        if _FUNCTION_START.match(text):
            break
        assigned = _ASSIGNMENT.match(text)
        if assigned and _SHAPE_READ.search(assigned.group(2)) and names & set(re.findall(r"\w+", assigned.group(1))):
            return True
    return False


@rule("token-local: elementwise", "zeros_like", "ones_like", "empty_like", "full_like")
def like(an, gm, node):
    p = an.of(arguments(node).get("input"))
    return p if isinstance(p, Shard) else REPLICATE
