"""The op table of the sequence-sharding analysis: what each class of op does to the token axis.

See Note [Sequence-sharding analysis] in autosp.passes.dynamo.sharding.  A rule
takes the analysis, the graph and a node and returns the node's placement (a
tuple for ops with several outputs), rewriting the node where a rule for
sequence-mixing exists, or raising the analysis's refusal.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from torch import fx

from autosp.passes.dynamo import moe  # MoE dispatch hook, see apply()
from autosp.passes.dynamo.attention import ATTENTION_TARGETS
from autosp.passes.dynamo.placements import (
    PARTIAL,
    REPLICATE,
    Partial,
    Shard,
    broadcast_dim,
    normalize_dims,
    real_shard,
    reshaped,
)
from autosp.passes.graph_utils import fake_value

_FIX_GENERIC = ("AutoSP cannot make this exact under sequence parallelism: compute it per token, move it out of "
                "the compiled model, or train this model without sequence parallelism (sp_size=1)")


# ---------------------------------------------------------------------------------------------
# Op classes, by the callables Dynamo records (torch functions, operator builtins) and Tensor methods.
# ---------------------------------------------------------------------------------------------
def _names(*names: str) -> set[str]:
    return set(names)


_POINTWISE_NAMES = _names(
    "add", "sub", "mul", "div", "true_divide", "floor_divide", "truediv", "floordiv", "mod", "remainder", "pow",
    "neg", "pos", "abs", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "square",
    "reciprocal", "sin", "cos", "tan", "tanh", "sinh", "cosh", "asin", "acos", "atan", "atan2", "sigmoid", "erf",
    "erfc", "sign", "floor", "ceil", "round", "trunc", "frac", "clamp", "clip", "clamp_min", "clamp_max",
    "maximum", "minimum", "where", "masked_fill", "lerp", "addcmul", "addcdiv", "eq", "ne", "lt", "le", "gt",
    "ge", "logical_and", "logical_or", "logical_not", "logical_xor", "and_", "or_", "xor", "invert",
    "bitwise_and", "bitwise_or", "bitwise_not", "isnan", "isinf", "isfinite", "nan_to_num", "relu", "relu6",
    "silu", "gelu", "mish", "softplus", "elu", "selu", "celu", "leaky_relu", "hardtanh", "hardswish",
    "hardsigmoid", "logsigmoid", "softsign", "tanhshrink", "threshold", "fmod", "hypot", "sgn",
    "iadd", "isub", "imul", "itruediv", "add_", "sub_", "mul_", "div_", "masked_fill_", "clamp_", "copy_",
    "__add__", "__sub__", "__mul__", "__truediv__", "__radd__", "__rsub__", "__rmul__", "__rtruediv__",
    "__neg__", "__pow__", "__rpow__", "__and__", "__or__", "__invert__", "__eq__", "__ne__", "__lt__",
    "__le__", "__gt__", "__ge__", "__floordiv__", "__mod__",
)
_LINEAR_NAMES = _names("add", "sub", "neg", "mul", "div", "true_divide", "truediv", "iadd", "isub", "imul",
                       "itruediv", "__add__", "__sub__", "__mul__", "__truediv__", "__neg__", "__radd__",
                       "__rmul__", "pos")
"""Pointwise ops that keep a partial sum a partial sum (with the other operand replicated for mul/div)."""

_DROPOUT_NAMES = _names("dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d")
_RANDOM_LIKE_NAMES = _names("rand_like", "randn_like", "randint_like", "bernoulli", "multinomial", "normal",
                            "poisson", "bernoulli_", "uniform_", "normal_")
_LAYOUT_NAMES = _names(
    "view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "view_as", "reshape_as", "contiguous",
    "clone", "detach", "float", "half", "double", "bfloat16", "long", "int", "bool", "short", "to", "type",
    "type_as", "requires_grad_", "_to_copy", "alias", "unsqueeze_", "squeeze_", "cpu", "cuda",
)
_PERMUTE_NAMES = _names("transpose", "swapaxes", "swapdims", "permute", "movedim", "moveaxis", "t")
_EXPAND_NAMES = _names("expand", "expand_as", "broadcast_to")
_LIKE_NAMES = _names("zeros_like", "ones_like", "empty_like", "full_like")
_FACTORY_NAMES = _names("zeros", "ones", "empty", "full", "tensor", "as_tensor", "scalar_tensor", "eye",
                        "linspace", "logspace", "rand", "randn", "randint", "tril", "triu", "new_ones",
                        "new_zeros", "new_empty", "new_full", "new_tensor", "finfo", "iinfo", "get_default_dtype")
_METADATA_NAMES = _names("size", "dim", "numel", "is_floating_point", "is_contiguous", "get_device",
                         "is_complex", "element_size", "stride", "_log_api_usage_once", "_set_grad_enabled",
                         "is_grad_enabled", "is_autocast_enabled", "set_", "_assert", "_check")
_ALONG_DIM_NAMES = {
    # op name -> (index of the dim argument, its keyword, its default)
    "softmax": (1, "dim", None), "log_softmax": (1, "dim", None), "softmin": (1, "dim", None),
    "cumsum": (1, "dim", None), "cumprod": (1, "dim", None), "cummax": (1, "dim", None),
    "cummin": (1, "dim", None), "logcumsumexp": (1, "dim", None), "topk": (2, "dim", -1),
    "sort": (1, "dim", -1), "argsort": (1, "dim", -1), "kthvalue": (2, "dim", -1), "diff": (2, "dim", -1),
    "normalize": (2, "dim", 1), "glu": (1, "dim", -1), "flip": (1, "dims", None), "roll": (2, "dims", None),
    "cumulative_trapezoid": (2, "dim", -1), "gumbel_softmax": (4, "dim", -1),
}
_NORM_NAMES = {"layer_norm": 1, "rms_norm": 1}
"""Norms over the trailing dims given by the normalized_shape argument (its index)."""
_REDUCTION_NAMES = _names("sum", "mean", "nansum", "nanmean", "amax", "amin", "max", "min", "argmax", "argmin",
                          "prod", "var", "std", "logsumexp", "norm", "any", "all", "count_nonzero", "median",
                          "nanmedian", "mode", "var_mean", "std_mean", "aminmax", "histc", "bincount")
_EXACT_SEQUENCE_REDUCTIONS = _names("sum", "mean", "nansum")
"""Reductions over the token axis that a local reduction plus an all-reduce computes exactly."""
_COMPOSED_SEQUENCE_STATISTICS = _names("logsumexp", "var", "std")
"""Reductions over the token axis composed from all-reduced sums (autosp.passes.dynamo.reductions)."""
_MATMUL_NAMES = _names("matmul", "bmm", "mm", "__matmul__", "__rmatmul__")
_SPLIT_NAMES = {"split": (2, "dim", 0), "chunk": (2, "dim", 0), "unbind": (1, "dim", 0),
                "tensor_split": (2, "dim", 0), "split_with_sizes": (2, "dim", 0)}


LOCAL_REDUCTION = "autosp_local_reduction"
"""node.meta flag: a rule already completes this reduction over the sequence with an all-reduce."""


def op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target))


def higher_order_body(gm: fx.GraphModule, node: fx.Node):
    """(body GraphModule, operand nodes) of a higher-order op such as tag_activation_checkpoint, else None."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return None
    for i, arg in enumerate(node.args):
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            sub = getattr(gm, arg.target, None)
            if isinstance(sub, fx.GraphModule):
                return sub, list(node.args[i + 1 :])
    return None


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if isinstance(fake_value(a), torch.Tensor)]


def _arg(node: fx.Node, index: int, keyword: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(keyword, default)


def _ndim(node) -> int:
    value = fake_value(node)
    return value.dim() if isinstance(value, torch.Tensor) else 0


def _shape(node):
    value = fake_value(node)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else ()


def _sharded_inputs(an, node) -> list[tuple[fx.Node, object]]:
    return [(a, an.of(a)) for a in _tensor_args(node) if isinstance(an.of(a), (Shard, Partial))]


# ---------------------------------------------------------------------------------------------
# Rules
# ---------------------------------------------------------------------------------------------
def _demote_tentative(an, node, placements: dict) -> dict:
    """Tentative position shards that a rule cannot keep are replicated values after all."""
    out = {}
    for arg, p in placements.items():
        if isinstance(p, Shard) and p.tentative:
            an.use_positions(p, "replicated")
            p = REPLICATE
        out[arg] = p
    return out


def pointwise(an, gm, node: fx.Node):
    name = op_name(node)
    out = fake_value(node)
    args = {a: an.of(a) for a in _tensor_args(node)}
    if any(a in an.sequence_reduced for a in args):
        _check_token_count_literal(an, node)
    if not any(isinstance(p, (Shard, Partial)) for p in args.values()):
        return REPLICATE
    if not isinstance(out, torch.Tensor):
        raise an.refuse(node, "turns a token-sharded tensor into a Python value", _FIX_GENERIC)
    partials = [a for a, p in args.items() if isinstance(p, Partial)]
    if partials:
        others = [a for a, p in args.items() if not isinstance(p, Partial)]
        linear = name in _LINEAR_NAMES and (
            len(partials) == len(args) and name in ("add", "sub", "iadd", "isub", "__add__", "__sub__", "__radd__")
            or len(partials) == 1 and all(not isinstance(args[o], Shard) for o in others)
            and (name not in ("div", "true_divide", "truediv", "itruediv", "__truediv__")
                 or node.args[0] is partials[0])
        )
        if not linear or any(isinstance(p, Shard) for p in args.values()):
            raise an.refuse(node, "applies a non-linear function to a partial sum over the sequence",
                            "only sums and means over the sequence are supported, combined linearly")
        _check_token_count_literal(an, node)
        return PARTIAL
    out_ndim = out.dim()
    real = {a: p for a, p in args.items() if real_shard(p)}
    lead = real or {a: p for a, p in args.items() if isinstance(p, Shard)}
    first_arg, first = next(iter(lead.items()))
    target = (broadcast_dim(first.dim, _ndim(first_arg), out_ndim), first.inner)
    positions = set()
    for arg, p in args.items():
        if isinstance(p, Shard):
            where = (broadcast_dim(p.dim, _ndim(arg), out_ndim), p.inner)
            aligned = where == target and _shape(arg)[p.dim] == out.shape[target[0]]
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
                                f"({p} vs dim {target[0]})", _FIX_GENERIC)
    for arg, p in args.items():
        if p is REPLICATE:
            d = target[0] - (out_ndim - _ndim(arg))
            if 0 <= d < _ndim(arg) and _shape(arg)[d] != 1:
                if not real:  # only tentative positions: a replicated value of the same length decides it
                    an.use_positions(Shard(0, 1, frozenset(positions)), "replicated")
                    return REPLICATE
                raise an.refuse(
                    node, f"combines the token-sharded {real[next(iter(real))]} operand with a replicated tensor "
                    f"({arg.name}, shape {list(_shape(arg))}) that has one entry per local token: in the "
                    "single-device program that tensor covers the whole sequence, and its global form is unknown "
                    "(a buffer sliced to the sequence length, e.g. a precomputed mask or position table)",
                    "derive it from position_ids or compute it inside the attention call")
    if name in _DROPOUT_NAMES:
        _check_dropout(an, node)
    return Shard(target[0], target[1], frozenset(positions) if not real else frozenset())


def _check_dropout(an, node):
    p = _arg(node, 1, "p", 0.5)
    training = _arg(node, 2, "training", True)
    if p and training:
        raise an.refuse(node, f"applies dropout (p={p}) to token-sharded activations: every rank of the SP group "
                        "draws the same random stream, so the masks would repeat every sequence shard",
                        "set the model's dropout probabilities to 0 (long-context pretraining recipes use none) "
                        "or call model.eval()")


def _check_token_count_literal(an, node):
    """A literal equal to a local token count scaling a sum over the sequence was probably read from a shard's
    shape (``x.sum(0) / x.shape[0]``): in the single-device program it is the sequence's count."""
    counts = {an.seq_len * k for k in range(1, 65)} if an.seq_len else set()
    for arg in node.args[1:]:
        if isinstance(arg, (int, float)) and not isinstance(arg, bool) and arg in counts and arg > 1:
            raise an.refuse(node, f"divides or scales a sum over the sequence by {arg}, a multiple of this rank's "
                            f"{an.seq_len} tokens (probably read from a tensor's shape, which is the shard's, "
                            "not the sequence's)", "use mean() over the tokens, or count them with a reduction "
                            "(e.g. torch.ones_like(x).sum()), so the count is global")


def random_like(an, gm, node):
    if any(isinstance(p, Shard) and not p.tentative for _, p in _sharded_inputs(an, node)):
        raise an.refuse(node, "draws random numbers for token-sharded values: every rank of the SP group draws the "
                        "same random stream, so the draws would repeat every sequence shard",
                        "draw them outside the compiled model, or train without sequence parallelism")
    return _like(an, gm, node)


def _like(an, gm, node):
    p = an.of(node.args[0]) if node.args else REPLICATE
    return p if isinstance(p, Shard) else REPLICATE


def layout(an, gm, node: fx.Node):
    p = an.of(node.args[0])
    if not isinstance(p, Shard):
        return p if isinstance(p, Partial) else REPLICATE
    moved = reshaped(p, _shape(node.args[0]), _shape(node), an.seq_len)
    if moved is None:
        if p.tentative:
            an.use_positions(p, "replicated")
            return REPLICATE
        raise an.refuse(node, f"reshapes {list(_shape(node.args[0]))} -> {list(_shape(node))}, splitting the "
                        "token axis across dimensions", _FIX_GENERIC)
    return moved


def permute(an, gm, node: fx.Node):
    p = an.of(node.args[0])
    if not isinstance(p, Shard):
        return p if isinstance(p, Partial) else REPLICATE
    ndim, name = _ndim(node.args[0]), op_name(node)
    order = list(range(ndim))
    if name in ("transpose", "swapaxes", "swapdims"):
        a, b = (d % ndim for d in node.args[1:3])
        order[a], order[b] = order[b], order[a]
    elif name == "t":
        order = order[::-1]
    elif name == "permute":
        dims = node.args[1:] if not isinstance(node.args[1], (list, tuple)) else node.args[1]
        order = [d % ndim for d in dims]
    else:  # movedim
        src, dst = node.args[1], node.args[2]
        src = [src] if isinstance(src, int) else list(src)
        dst = [dst] if isinstance(dst, int) else list(dst)
        rest = [d for d in range(ndim) if d not in [s % ndim for s in src]]
        order = [None] * ndim
        for s, d in zip(src, dst, strict=True):
            order[d % ndim] = s % ndim
        it = iter(rest)
        order = [o if o is not None else next(it) for o in order]
    return p.moved(order.index(p.dim))


def _token_axis_unchanged(an, node: fx.Node, p: Shard, what: str) -> Shard:
    """The token axis after an op that may add leading dims (expand, repeat), refused if it grows."""
    dim = broadcast_dim(p.dim, _ndim(node.args[0]), _ndim(node))
    if _shape(node)[dim] != _shape(node.args[0])[p.dim]:
        raise an.refuse(node, what, _FIX_GENERIC)
    return p.moved(dim)


def expand(an, gm, node: fx.Node):
    p = an.of(node.args[0])
    if not isinstance(p, Shard):
        return p if isinstance(p, Partial) else REPLICATE
    return _token_axis_unchanged(an, node, p, "broadcasts along the token axis")


def repeat(an, gm, node: fx.Node):
    p = an.of(node.args[0])
    if not isinstance(p, Shard):
        return REPLICATE
    name = op_name(node)
    if name == "repeat_interleave":
        dim = _arg(node, 2, "dim", None)
        if dim is None or dim % _ndim(node.args[0]) == p.dim:
            raise an.refuse(node, "repeats elements along the token axis", _FIX_GENERIC)
        return p
    return _token_axis_unchanged(an, node, p, "tiles the token axis")


def along_dim(an, gm, node: fx.Node):
    p = an.of(node.args[0])
    name = op_name(node)
    if not isinstance(p, Shard):
        if isinstance(p, Partial):
            raise an.refuse(node, "applies a non-linear function to a partial sum over the sequence", _FIX_GENERIC)
        return _multi(node, REPLICATE)
    ndim = _ndim(node.args[0])
    if name in _NORM_NAMES:
        shape = _arg(node, _NORM_NAMES[name], "normalized_shape")
        count = 1 if isinstance(shape, int) else len(shape)
        dims = tuple(range(ndim - count, ndim))
    else:
        index, keyword, default = _ALONG_DIM_NAMES[name]
        dims = _arg(node, index, keyword, default)
        dims = tuple(range(ndim)) if dims is None else normalize_dims(dims, ndim)
    if p.dim in dims:
        if p.tentative:
            an.use_positions(p, "replicated")
            return _multi(node, REPLICATE)
        raise an.refuse(node, f"works along dim {p.dim}, the token axis, so it would see only this rank's tokens",
                        _FIX_GENERIC)
    return _multi(node, p)


def _multi(node, placement):
    value = fake_value(node)
    if isinstance(value, (tuple, list)):
        return tuple(placement for _ in value)
    return placement


def reduction(an, gm, node: fx.Node):
    from autosp.passes.dynamo.reductions import complete_sequence_reduction, rewrite_sequence_statistic

    p = an.of(node.args[0])
    name = op_name(node)
    if isinstance(p, Partial):
        if name in ("sum", "nansum") and fake_value(node) is not None:
            return PARTIAL
        raise an.refuse(node, "reduces a partial sum over the sequence non-linearly", _FIX_GENERIC)
    if not isinstance(p, Shard):
        return _multi(node, REPLICATE)
    ndim = _ndim(node.args[0])
    dims_arg = _arg(node, 1, "dim", None)
    if name == "histc" or name == "bincount":
        dims_arg = None
    dims = normalize_dims(dims_arg, ndim)
    keepdim = bool(_arg(node, 2, "keepdim", False)) if name not in ("histc", "bincount") else False
    if p.dim not in dims:
        dim = p.dim if keepdim else p.dim - sum(d < p.dim for d in dims)
        return _multi(node, p.moved(dim))
    if p.tentative:
        an.use_positions(p, "replicated")
        return _multi(node, REPLICATE)
    if node.meta.get(LOCAL_REDUCTION):  # a rule (the loss) completes this sum with its own all-reduce
        return PARTIAL
    if name in _COMPOSED_SEQUENCE_STATISTICS and not isinstance(fake_value(node), (tuple, list)):
        return rewrite_sequence_statistic(an, gm, node)
    if name not in _EXACT_SEQUENCE_REDUCTIONS or isinstance(fake_value(node), (tuple, list)):
        raise an.refuse(node, f"reduces over the token axis ({name}); AutoSP completes sums, means, logsumexp, "
                        "var and std over the sequence", "express it with one of those over the tokens")
    return complete_sequence_reduction(an, gm, node)


def matmul(an, gm, node: fx.Node):
    a, b = node.args[0], node.args[1]
    pa, pb = an.of(a), an.of(b)
    if not (isinstance(pa, Shard) or isinstance(pb, Shard)):
        if isinstance(pa, Partial) or isinstance(pb, Partial):
            raise an.refuse(node, "multiplies a partial sum over the sequence", _FIX_GENERIC)
        return REPLICATE
    out_ndim = _ndim(node)
    result = None
    for operand, p, contracted, kept in ((a, pa, _ndim(a) - 1, _ndim(a) - 2), (b, pb, _ndim(b) - 2, _ndim(b) - 1)):
        if not isinstance(p, Shard):
            continue
        nd = _ndim(operand)
        if nd < 2 or p.dim == contracted:
            if p.tentative:
                an.use_positions(p, "replicated")
                continue
            raise an.refuse(node, "contracts over the token axis (a matmul summing over tokens)", _FIX_GENERIC)
        dim = out_ndim - 2 if p.dim == kept and operand is a else out_ndim - 1 if p.dim == kept else (
            broadcast_dim(p.dim, nd, out_ndim))
        placed = p.moved(dim)
        if result is not None and (result.dim, result.inner) != (placed.dim, placed.inner):
            raise an.refuse(node, "multiplies two token-sharded tensors into a tokens x tokens product (attention "
                            "computed with matmul + softmax?), which on a shard sees only this rank's tokens",
                            "call torch.nn.functional.scaled_dot_product_attention instead (Hugging Face: "
                            "attn_implementation='sdpa')")
        if result is None or result.tentative:
            result = placed
    return result if result is not None else REPLICATE


def linear(an, gm, node: fx.Node):
    x = node.args[0]
    p = an.of(x)
    for w in node.all_input_nodes[1:]:
        if isinstance(an.of(w), (Shard, Partial)):
            raise an.refuse(node, "takes a token-sharded weight", _FIX_GENERIC)
    if isinstance(p, Partial):
        return PARTIAL if len(node.args) < 3 and node.kwargs.get("bias") is None else _refuse_partial(an, node)
    if not isinstance(p, Shard):
        return REPLICATE
    if p.dim == _ndim(x) - 1:
        raise an.refuse(node, "contracts over the token axis", _FIX_GENERIC)
    return p


def _refuse_partial(an, node):
    raise an.refuse(node, "adds a bias to a partial sum over the sequence", _FIX_GENERIC)


def addmm(an, gm, node: fx.Node):
    bias, m1, m2 = node.args[:3]
    if isinstance(an.of(bias), Shard) or isinstance(an.of(m2), (Shard, Partial)):
        raise an.refuse(node, "mixes token-sharded operands in a way AutoSP has no rule for", _FIX_GENERIC)
    p = an.of(m1)
    if not isinstance(p, Shard):
        return REPLICATE
    if p.dim != 0:
        raise an.refuse(node, "contracts over the token axis", _FIX_GENERIC)
    return p


def one_hot(an, gm, node: fx.Node):
    p = an.of(node.args[0])
    return p if isinstance(p, Shard) else REPLICATE


def embedding(an, gm, node: fx.Node):
    ids, weight = node.args[0], node.args[1]
    if isinstance(an.of(weight), (Shard, Partial)):
        raise an.refuse(node, "looks up a token-sharded table", _FIX_GENERIC)
    p = an.of(ids)
    return p if isinstance(p, Shard) else REPLICATE


def einsum(an, gm, node: fx.Node):
    equation, operands = node.args[0], node.args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = operands[0]
    if not any(isinstance(an.of(o), (Shard, Partial)) for o in operands):
        return REPLICATE
    inputs, _, output = equation.replace(" ", "").partition("->")
    specs = inputs.split(",")
    if "..." in equation or not output or len(specs) != len(operands):
        raise an.refuse(node, "is an einsum with a token-sharded operand AutoSP cannot read (ellipsis or implicit "
                        "output)", "write the output labels explicitly, without '...'")
    letter = None
    for spec, operand in zip(specs, operands, strict=True):
        p = an.of(operand)
        if isinstance(p, Partial) or (isinstance(p, Shard) and p.inner != 1):
            raise an.refuse(node, "is an einsum over a partial or merged token axis", _FIX_GENERIC)
        if isinstance(p, Shard):
            if letter not in (None, spec[p.dim]):
                raise an.refuse(node, "is an einsum whose token-sharded operands disagree", _FIX_GENERIC)
            letter = spec[p.dim]
    if letter not in output:
        raise an.refuse(node, f"is an einsum that sums over the token axis (label {letter!r})", _FIX_GENERIC)
    for spec, operand in zip(specs, operands, strict=True):
        if letter in spec and not isinstance(an.of(operand), Shard) and _shape(operand)[spec.index(letter)] != 1:
            raise an.refuse(node, "is an einsum pairing tokens with a replicated per-token tensor", _FIX_GENERIC)
    return Shard(output.index(letter))


def getitem(an, gm, node: fx.Node):
    source, index = node.args
    p = an.of(source)
    if isinstance(p, tuple):
        return p[index] if isinstance(index, int) else REPLICATE
    if not isinstance(fake_value(source), torch.Tensor):
        return REPLICATE
    items = list(index) if isinstance(index, tuple) else [index]
    tensor_items = [i for i in items if isinstance(i, fx.Node)]
    if tensor_items:
        return _advanced_index(an, node, p, items, tensor_items)
    if not isinstance(p, Shard):
        return p if isinstance(p, Partial) else REPLICATE
    out_dim, in_dim = 0, 0
    for item in _expand_index(items, _ndim(source)):
        if item is None:
            out_dim += 1
            continue
        if in_dim == p.dim:
            if isinstance(item, slice) and item.start in (None, 0) and item.stop is None and item.step in (None, 1):
                return p.moved(out_dim)
            if p.tentative:
                an.use_positions(p, "replicated")
                return REPLICATE
            raise an.refuse(node, f"indexes the token axis with {item!r}: each rank holds a different slice of "
                            "the tokens, so positions within a shard are not positions in the sequence",
                            _FIX_GENERIC)
        out_dim += 0 if isinstance(item, int) else 1
        in_dim += 1
    raise an.refuse(node, "indexes a token-sharded tensor in a way AutoSP cannot follow", _FIX_GENERIC)


def _expand_index(items, ndim):
    """One entry per input dim (Ellipsis expanded, trailing dims taken whole), None kept as new axes."""
    consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
    out = []
    for item in items:
        if item is Ellipsis:
            out.extend([slice(None)] * (ndim - consumed))
        else:
            out.append(item)
    return out + [slice(None)] * (ndim - sum(1 for i in out if i is not None))


def _advanced_index(an, node, p, items, tensor_items):
    index_places = [an.of(t) for t in tensor_items]
    if isinstance(p, Shard) and not p.tentative:
        raise an.refuse(node, "gathers from a token-sharded tensor with a tensor index", _FIX_GENERIC)
    sharded = [q for q in index_places if isinstance(q, Shard)]
    if not sharded:
        return REPLICATE
    if len(tensor_items) != 1 or any(isinstance(i, (type(None), type(Ellipsis))) for i in items):
        raise an.refuse(node, "indexes with a token-sharded tensor in a way AutoSP cannot follow", _FIX_GENERIC)
    at = items.index(tensor_items[0])
    return sharded[0].moved(at + sharded[0].dim)


def cat(an, gm, node: fx.Node):
    # torch.cat skips 1-D empty tensors (a KV cache's initial state): they take no part.
    tensors = [t for t in node.args[0] if _shape(t) != (0,)]
    dim = _arg(node, 1, "dim", 0)
    places = [an.of(t) for t in tensors]
    if len(places) == 1 and op_name(node) != "stack":
        return places[0]
    if not any(isinstance(q, (Shard, Partial)) for q in places):
        return REPLICATE
    name = op_name(node)
    if all(isinstance(q, Partial) for q in places):
        return PARTIAL
    if any(isinstance(q, Partial) for q in places):
        raise an.refuse(node, "concatenates a partial sum over the sequence with other values", _FIX_GENERIC)
    shards = [q for q in places if isinstance(q, Shard)]
    first = next((q for q in shards if not q.tentative), shards[0])
    ndim = _ndim(tensors[0])
    if name == "stack":
        dim = dim % (ndim + 1)
        token_dim = first.dim + (1 if first.dim >= dim else 0)
    else:
        dim = dim % ndim
        token_dim = first.dim
    if (name != "stack" and dim == first.dim) or any(
            not isinstance(q, Shard) or (q.dim, q.inner) != (first.dim, first.inner) for q in places):
        if all(q.tentative for q in shards):
            for q in shards:
                an.use_positions(q, "replicated")
            return REPLICATE
        raise an.refuse(node, f"concatenates along dim {dim} tensors placed {[str(q) for q in places]} (along the "
                        "token axis, or token-sharded with replicated tensors)", _FIX_GENERIC)
    return first.moved(token_dim)


def split(an, gm, node: fx.Node):
    p = an.of(node.args[0])
    name = op_name(node)
    index, keyword, default = _SPLIT_NAMES[name]
    dim = _arg(node, index, keyword, default) % max(1, _ndim(node.args[0]))
    if isinstance(p, Shard) and dim == p.dim:
        if p.tentative:
            an.use_positions(p, "replicated")
            return _multi(node, REPLICATE)
        raise an.refuse(node, "splits the token axis", _FIX_GENERIC)
    if isinstance(p, Shard) and name == "unbind":
        return _multi(node, p.moved(p.dim - (1 if dim < p.dim else 0)))
    return _multi(node, p if isinstance(p, (Shard, Partial)) else REPLICATE)


def pad(an, gm, node: fx.Node):
    p = an.of(node.args[0])
    if not isinstance(p, Shard):
        return REPLICATE
    widths = _arg(node, 1, "pad")
    ndim = _ndim(node.args[0])
    padded = {ndim - 1 - i // 2 for i, w in enumerate(widths) if w}
    if p.dim in padded:
        raise an.refuse(node, "pads the token axis", _FIX_GENERIC)
    return p


def cross_entropy(an, gm, node: fx.Node):
    sharded = _sharded_inputs(an, node)
    if not sharded:
        return REPLICATE
    reduction = _arg(node, 7 if op_name(node) == "cross_entropy" else 6, "reduction", "mean")
    if reduction == "sum":
        return PARTIAL
    if reduction == "none":
        target = node.args[1] if len(node.args) > 1 else node.kwargs["target"]
        q = an.of(target)
        return q if isinstance(q, Shard) else sharded[0][1]
    raise an.refuse(node, "averages a loss over token-sharded rows outside AutoSP's causal-LM loss rule",
                    "compute the loss with one cross_entropy over the labels passed to the model, or use "
                    "reduction='sum' and divide by a token count reduced with sum()")


def all_reduce(an, gm, node: fx.Node):
    p = an.of(node.args[0])
    if not isinstance(p, Partial):
        raise an.refuse(node, "all-reduces a value that is not a partial sum", "this is a bug in AutoSP's rules")
    return REPLICATE


def gather(an, gm, node: fx.Node):
    """all_gather of token-sharded metadata (the mask pass's positions and padding mask): the whole sequence."""
    return REPLICATE


def attention(an, gm, node: fx.Node):
    from autosp.passes.dynamo.attention import ulysses_attention

    return ulysses_attention(an, gm, node)


def tiled_loss(an, gm, node: fx.Node):
    from autosp.passes.dynamo.tiled_loss import tiled_loss_placement

    return tiled_loss_placement(an, node)


def arange(an, gm, node: fx.Node):
    from autosp.passes.dynamo.positions import arange_placement

    return arange_placement(an, node)


def metadata(an, gm, node: fx.Node):
    return REPLICATE


def factory(an, gm, node: fx.Node):
    for _, p in _sharded_inputs(an, node):
        if isinstance(p, Shard) and not p.tentative and op_name(node) in ("tril", "triu"):
            raise an.refuse(node, "masks a token-sharded tensor by position within the shard", _FIX_GENERIC)
    return REPLICATE


_BY_NAME: dict[str, Callable] = {}
for _group, _rule in (
    (_POINTWISE_NAMES | _DROPOUT_NAMES, pointwise), (_LAYOUT_NAMES, layout), (_PERMUTE_NAMES, permute),
    (_EXPAND_NAMES, expand), (_names("repeat", "repeat_interleave", "tile"), repeat), (_LIKE_NAMES, _like),
    (_RANDOM_LIKE_NAMES, random_like), (set(_ALONG_DIM_NAMES) | set(_NORM_NAMES), along_dim),
    (_REDUCTION_NAMES, reduction), (_MATMUL_NAMES, matmul), (_names("linear"), linear),
    (_names("addmm"), addmm), (_names("embedding"), embedding), (_names("one_hot"), one_hot), (_names("einsum"), einsum),
    (_names("getitem"), getitem), (_names("cat", "concat", "concatenate", "stack"), cat), (set(_SPLIT_NAMES), split),
    (_names("pad"), pad), (_names("cross_entropy", "nll_loss"), cross_entropy), (_names("arange"), arange),
    (_METADATA_NAMES, metadata), (_FACTORY_NAMES, factory),
):
    for _name in _group:
        _BY_NAME[_name] = _rule

_RULE_CLASS = {pointwise: "token-local: elementwise", layout: "token-local: layout", permute: "token-local: layout",
               expand: "token-local: layout", repeat: "token-local: layout", _like: "token-local: elementwise",
               random_like: "refused on tokens: random", along_dim: "token-local unless along the sequence",
               reduction: "reduction (over the sequence: all-reduced sums)", matmul: "token-local: matmul",
               linear: "token-local: matmul", addmm: "token-local: matmul", embedding: "token-local: lookup",
               one_hot: "token-local: lookup",
               einsum: "token-local: matmul", getitem: "token-local: indexing", cat: "token-local: concatenation",
               split: "token-local: split", pad: "token-local: padding", cross_entropy: "loss (partial sum)",
               arange: "positions", metadata: "metadata", factory: "factory (replicated)",
               all_reduce: "collective", gather: "collective (gather)", attention: "attention (Ulysses)",
               tiled_loss: "loss (tiled: partial sum)"}


def _rule_for(node: fx.Node) -> Callable | None:
    if node.op == "call_function":
        if node.target in ATTENTION_TARGETS:
            return attention
        if node.target is operator.getitem:
            return getitem
        if node.target is torch.ops.autosp_testbed.linear_cross_entropy.default:  # before the namespace default
            return tiled_loss
        if getattr(node.target, "namespace", None) == "autosp_testbed":
            return all_reduce if "all_reduce" in node.target._opname else (
                gather if node.target._opname == "all_gather" else metadata)
    if node.op in ("call_function", "call_method"):
        return _BY_NAME.get(op_name(node))
    return None


def apply(an, gm: fx.GraphModule, node: fx.Node):
    # --- MoE dispatch hook (autosp.passes.dynamo.moe): sorts within a shard, values in a shard-local order,
    # counts and router aux-loss row counts; it answers moe.NOT_MINE for everything else. ---
    placed = moe.apply(an, gm, node)
    if placed is not moe.NOT_MINE:
        return placed
    rule = _rule_for(node)
    if rule is None:
        if not _sharded_inputs(an, node):
            return REPLICATE
        tentative = [(a, p) for a, p in _sharded_inputs(an, node) if isinstance(p, Shard) and p.tentative]
        if len(tentative) == len(_sharded_inputs(an, node)):
            for _, p in tentative:
                an.use_positions(p, "replicated")
            return REPLICATE
        arg, p = next((a, q) for a, q in _sharded_inputs(an, node) if not (isinstance(q, Shard) and q.tentative))
        raise an.refuse(node, f"has no sequence-sharding rule in AutoSP and its input {arg.name} is {p}; it may mix "
                        "tokens across the sequence (a scan, a convolution, a reduction)", _FIX_GENERIC)
    an.classify(node, _RULE_CLASS.get(rule, rule.__name__))
    return rule(an, gm, node)
