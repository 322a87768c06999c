"""Op family: matrix products (matmul, bmm, mm, @, outer, linear, addmm, einsum).

See Note [Op rule registry] in autosp.passes.dynamo.registry.  A product is
token-local when the token axis is a batch or row/column dim of a token-sharded
operand (never contracted), every other operand has no entry per token along the
dim it lands on (a replicated tensor of the shard's length would cover the whole
sequence on one device), and no two token-sharded operands put their tokens on
different output dims (tokens x tokens: attention written as matmul + softmax).
Positions built from ``arange`` (tentative shards, Note [Positions built in the
graph]) keep being positions through a product (RoPE's ``outer(t, inv_freq)``).
"""

from __future__ import annotations

import torch
from torch import fx

from autosp import tiled_ops  # noqa: F401 - registers autosp_testbed::tiled_mlp
from autosp.passes.dynamo.placements import PARTIAL, REPLICATE, Partial, Shard
from autosp.passes.dynamo.pointwise import refuse_replicated_per_token
from autosp.passes.dynamo.registry import FIX_GENERIC, arguments, ndim, rule, shape

_ATTENTION_FIX = ("call torch.nn.functional.scaled_dot_product_attention instead (Hugging Face: "
                  "attn_implementation='sdpa')")


def _matmul_dims(nd_a: int, nd_b: int, out_nd: int) -> tuple[dict[int, int | None], dict[int, int | None]]:
    """For torch.matmul's broadcasting rules: each operand dim -> the output dim it lands on (None: contracted)."""
    def batch(nd: int, matrix: int, out_matrix: int) -> dict[int, int]:
        return {d: out_nd - out_matrix - (nd - matrix) + d for d in range(nd - matrix)}

    if nd_a == 1 and nd_b == 1:
        return {0: None}, {0: None}
    if nd_b == 1:
        a = {**batch(nd_a, 2, 1), nd_a - 2: out_nd - 1, nd_a - 1: None}
        return a, {0: None}
    if nd_a == 1:
        b = {**batch(nd_b, 2, 1), nd_b - 2: None, nd_b - 1: out_nd - 1}
        return {0: None}, b
    a = {**batch(nd_a, 2, 2), nd_a - 2: out_nd - 2, nd_a - 1: None}
    b = {**batch(nd_b, 2, 2), nd_b - 2: None, nd_b - 1: out_nd - 1}
    return a, b


def product(an, node: fx.Node, operands: list, maps: list[dict[int, int | None]],
            contracted: str = "contracts over the token axis (a matmul summing over tokens)"):
    """The placement of a product whose operand dims land on output dims as ``maps`` say (None: contracted)."""
    places = [an.of(o) for o in operands]
    if not any(isinstance(p, Shard) for p in places):
        if any(isinstance(p, Partial) for p in places):
            raise an.refuse(node, "multiplies a partial sum over the sequence", FIX_GENERIC)
        return REPLICATE
    if any(isinstance(p, Partial) for p in places):
        raise an.refuse(node, "multiplies a partial sum over the sequence with token-sharded values", FIX_GENERIC)
    real, tentative = None, []
    for p, dims in zip(places, maps, strict=True):
        if not isinstance(p, Shard):
            continue
        out_dim = dims.get(p.dim)
        if out_dim is None:
            if p.tentative:
                an.use_positions(p, "replicated")
                continue
            raise an.refuse(node, contracted, FIX_GENERIC)
        placed = p.moved(out_dim)
        if p.tentative:
            tentative.append(placed)
        elif real is not None and (real.dim, real.inner) != (placed.dim, placed.inner):
            raise an.refuse(node, "multiplies two token-sharded tensors into a tokens x tokens product (attention "
                            "computed with matmul + softmax?), which on a shard sees only this rank's tokens",
                            _ATTENTION_FIX)
        else:
            real = placed
    if real is not None:
        for t in tentative:
            an.use_positions(t, "token" if (t.dim, t.inner) == (real.dim, real.inner) else "replicated")
        result = real
    elif tentative and all((t.dim, t.inner) == (tentative[0].dim, tentative[0].inner) for t in tentative):
        result = Shard(tentative[0].dim, tentative[0].inner, frozenset().union(*(t.positions for t in tentative)))
    else:
        for t in tentative:
            an.use_positions(t, "replicated")
        return REPLICATE
    for operand, p, dims in zip(operands, places, maps, strict=True):
        if isinstance(p, Shard):
            continue
        for d, out_dim in dims.items():
            if out_dim == result.dim and shape(operand)[d] != 1:
                if result.tentative:  # a replicated value of the positions' length: they are not positions
                    an.use_positions(result, "replicated")
                    return REPLICATE
                refuse_replicated_per_token(an, node, result, operand)
    return result


@rule("token-local: matmul", "matmul", "bmm", "mm", "__matmul__", "__rmatmul__")
def matmul(an, gm, node: fx.Node):
    bound = arguments(node)
    a, b = (bound.get("input", node.args[0]), bound.get("other", bound.get("mat2", node.args[1])))
    if node.target == "__rmatmul__":
        a, b = b, a
    maps = _matmul_dims(ndim(a), ndim(b), ndim(node))
    return product(an, node, [a, b], list(maps))


@rule("token-local: matmul", "outer", "ger")
def outer(an, gm, node: fx.Node):
    bound = arguments(node)
    return product(an, node, [bound["input"], bound.get("vec2", node.args[1])], [{0: 0}, {0: 1}])


@rule("token-local: matmul", "linear")
def linear(an, gm, node: fx.Node):
    bound = arguments(node)
    x = bound["input"]
    p = an.of(x)
    for name in ("weight", "bias"):
        if isinstance(an.of(bound.get(name)), (Shard, Partial)):
            raise an.refuse(node, "takes a token-sharded weight", FIX_GENERIC)
    if isinstance(p, Partial):
        if bound.get("bias") is not None:
            raise an.refuse(node, "adds a bias to a partial sum over the sequence", FIX_GENERIC)
        return PARTIAL
    if not isinstance(p, Shard):
        return REPLICATE
    if p.dim == ndim(x) - 1:
        raise an.refuse(node, "contracts over the token axis", FIX_GENERIC)
    return p


@rule("token-local: matmul", "addmm", "baddbmm", "addbmm")
def addmm(an, gm, node: fx.Node):
    bound = arguments(node)
    bias = bound["input"]
    first, second = bound.get("mat1", bound.get("batch1")), bound.get("mat2", bound.get("batch2"))
    if isinstance(an.of(bias), (Shard, Partial)):
        raise an.refuse(node, "adds a token-sharded tensor to a product", FIX_GENERIC)
    nd = ndim(first)
    maps = list(_matmul_dims(nd, ndim(second), ndim(node)))
    if node.target == "addbmm" or getattr(node.target, "__name__", "") == "addbmm":
        maps = [{d: (None if d == 0 else o - 1 if o is not None else None) for d, o in m.items()} for m in maps]
    placed = product(an, node, [first, second], maps)
    if isinstance(placed, Shard):
        d = placed.dim - (ndim(node) - ndim(bias))
        if 0 <= d < ndim(bias) and shape(bias)[d] != 1:
            refuse_replicated_per_token(an, node, placed, bias)
    return placed


@rule("token-local: tiled MLP", targets=(torch.ops.autosp_testbed.tiled_mlp.default,))
def tiled_mlp(an, gm, node: fx.Node):
    """The tiled MLP op (Note [Tiled MLP pass] in autosp/passes/dynamo/tiled_mlp.py)."""
    from autosp.passes.dynamo.tiled_mlp import tiled_mlp_placement

    return tiled_mlp_placement(an, node)


@rule("token-local: matmul", "einsum")
def einsum(an, gm, node: fx.Node):
    equation, operands = node.args[0], list(node.args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if not any(isinstance(an.of(o), (Shard, Partial)) for o in operands):
        return REPLICATE
    inputs, _, output = equation.replace(" ", "").partition("->")
    specs = inputs.split(",")
    if "..." in equation or not output or len(specs) != len(operands):
        raise an.refuse(node, "is an einsum with a token-sharded operand AutoSP cannot read (ellipsis or implicit "
                        "output)", "write the output labels explicitly, without '...'")
    for operand in operands:
        p = an.of(operand)
        if isinstance(p, Partial) or (isinstance(p, Shard) and p.inner != 1):
            raise an.refuse(node, "is an einsum over a partial or merged token axis", FIX_GENERIC)
    maps = [{d: (output.index(label) if label in output else None) for d, label in enumerate(spec)}
            for spec in specs]
    sharded = [(spec, an.of(o)) for spec, o in zip(specs, operands, strict=True) if isinstance(an.of(o), Shard)]
    labels = sorted({spec[p.dim] for spec, p in sharded if spec[p.dim] not in output})
    return product(an, node, operands, maps, f"is an einsum that sums over the token axis (label {labels[:1]})")
