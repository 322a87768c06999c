"""Op family: views and reshapes, permutes, expands, repeats, concatenation, splitting and padding.

See Note [Op rule registry] in autosp.passes.dynamo.registry.  The token axis passes
through these ops when it lands whole on one output dim; slicing, splitting,
padding, repeating or reordering it is refused.
"""

from __future__ import annotations

from torch import fx

from autosp.passes.dynamo.placements import PARTIAL, REPLICATE, Partial, Shard, broadcast_dim, reshaped
from autosp.passes.dynamo.registry import FIX_GENERIC, arguments, multi, ndim, op_name, rule, shape


def _input(node: fx.Node):
    return arguments(node).get("input", node.args[0] if node.args else None)


@rule("token-local: layout",
      "view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "view_as", "reshape_as", "contiguous",
      "clone", "detach", "float", "half", "double", "bfloat16", "long", "int", "bool", "short", "to", "type",
      "type_as", "requires_grad_", "_to_copy", "alias", "unsqueeze_", "squeeze_", "cpu", "cuda")
def layout(an, gm, node: fx.Node):
    source = node.args[0]
    p = an.of(source)
    if not isinstance(p, Shard):
        return p if isinstance(p, Partial) else REPLICATE
    moved = reshaped(p, shape(source), shape(node), an.seq_len)
    if moved is None:
        if p.tentative:
            an.use_positions(p, "replicated")
            return REPLICATE
        raise an.refuse(node, f"reshapes {list(shape(source))} -> {list(shape(node))}, splitting the "
                        "token axis across dimensions", FIX_GENERIC)
    return moved


def _as_list(value) -> list:
    return [value] if isinstance(value, int) else list(value)


@rule("token-local: layout", "transpose", "swapaxes", "swapdims", "permute", "movedim", "moveaxis", "t")
def permute(an, gm, node: fx.Node):
    p = an.of(node.args[0])
    if not isinstance(p, Shard):
        return p if isinstance(p, Partial) else REPLICATE
    rank, name, bound = ndim(node.args[0]), op_name(node), arguments(node)
    order = list(range(rank))
    if name in ("transpose", "swapaxes", "swapdims"):
        a, b = (bound.get(k, bound.get(alt)) % rank for k, alt in (("dim0", "axis0"), ("dim1", "axis1")))
        order[a], order[b] = order[b], order[a]
    elif name == "t":
        order = order[::-1]
    elif name == "permute":
        order = [d % rank for d in _as_list(bound["dims"])]
    else:  # movedim / moveaxis
        src = [d % rank for d in _as_list(bound.get("source"))]
        dst = [d % rank for d in _as_list(bound.get("destination"))]
        rest = iter(d for d in range(rank) if d not in src)
        placed = dict(zip(dst, src, strict=True))
        order = [placed[d] if d in placed else next(rest) for d in range(rank)]
    return p.moved(order.index(p.dim))


def _token_axis_unchanged(an, node: fx.Node, p: Shard, what: str) -> Shard:
    """The token axis after an op that may add leading dims (expand, repeat), refused if it grows."""
    dim = broadcast_dim(p.dim, ndim(node.args[0]), ndim(node))
    if shape(node)[dim] != shape(node.args[0])[p.dim]:
        raise an.refuse(node, what, FIX_GENERIC)
    return p.moved(dim)


@rule("token-local: layout", "view_as_complex", "view_as_real")
def complex_view(an, gm, node: fx.Node):
    """``view_as_complex`` pairs the last dim's two entries into one complex number, ``view_as_real`` splits it
    again (complex rotary embeddings): every other dim, the token axis among them, stays where it is."""
    source = _input(node)
    p = an.of(source)
    if not isinstance(p, Shard):
        return p if isinstance(p, Partial) else REPLICATE
    if op_name(node) == "view_as_complex" and p.dim == ndim(source) - 1:
        raise an.refuse(node, "pairs entries along the token axis into complex numbers", FIX_GENERIC)
    return p


@rule("token-local: layout", "expand", "expand_as", "broadcast_to")
def expand(an, gm, node: fx.Node):
    p = an.of(node.args[0])
    if not isinstance(p, Shard):
        return p if isinstance(p, Partial) else REPLICATE
    return _token_axis_unchanged(an, node, p, "broadcasts along the token axis")


@rule("token-local: layout", "repeat", "repeat_interleave", "tile")
def repeat(an, gm, node: fx.Node):
    p = an.of(node.args[0])
    if not isinstance(p, Shard):
        return REPLICATE
    if op_name(node) == "repeat_interleave":
        dim = arguments(node).get("dim")
        if dim is None or dim % ndim(node.args[0]) == p.dim:
            raise an.refuse(node, "repeats elements along the token axis", FIX_GENERIC)
        return p
    return _token_axis_unchanged(an, node, p, "tiles the token axis")


@rule("token-local: concatenation", "cat", "concat", "concatenate", "stack")
def cat(an, gm, node: fx.Node):
    bound = arguments(node)
    # torch.cat skips 1-D empty tensors (a KV cache's initial state): they take no part.
    tensors = [t for t in bound.get("tensors", node.args[0]) if shape(t) != (0,)]
    dim = bound.get("dim", 0)
    name = op_name(node)
    places = [an.of(t) for t in tensors]
    if len(places) == 1 and name != "stack":
        return places[0]
    if not any(isinstance(q, (Shard, Partial)) for q in places):
        return REPLICATE
    if all(isinstance(q, Partial) for q in places):
        return PARTIAL
    if any(isinstance(q, Partial) for q in places):
        raise an.refuse(node, "concatenates a partial sum over the sequence with other values", FIX_GENERIC)
    shards = [q for q in places if isinstance(q, Shard)]
    first = next((q for q in shards if not q.tentative), shards[0])
    rank = ndim(tensors[0])
    if name == "stack":
        dim = dim % (rank + 1)
        token_dim = first.dim + (1 if first.dim >= dim else 0)
    else:
        dim = dim % rank
        token_dim = first.dim
    if (name != "stack" and dim == first.dim) or any(
            not isinstance(q, Shard) or (q.dim, q.inner) != (first.dim, first.inner) for q in places):
        if all(q.tentative for q in shards):
            for q in shards:
                an.use_positions(q, "replicated")
            return REPLICATE
        raise an.refuse(node, f"concatenates along dim {dim} tensors placed {[str(q) for q in places]} (along the "
                        "token axis, or token-sharded with replicated tensors)", FIX_GENERIC)
    return first.moved(token_dim)


@rule("token-local: split", "split", "chunk", "unbind", "tensor_split", "split_with_sizes")
def split(an, gm, node: fx.Node):
    p = an.of(node.args[0])
    dim = arguments(node).get("dim", 0) % max(1, ndim(node.args[0]))
    if isinstance(p, Shard) and dim == p.dim:
        if p.tentative:
            an.use_positions(p, "replicated")
            return multi(node, REPLICATE)
        raise an.refuse(node, "splits the token axis", FIX_GENERIC)
    if isinstance(p, Shard) and op_name(node) == "unbind":
        return multi(node, p.moved(p.dim - (1 if dim < p.dim else 0)))
    return multi(node, p if isinstance(p, (Shard, Partial)) else REPLICATE)


@rule("token-local: padding", "pad")
def pad(an, gm, node: fx.Node):
    p = an.of(node.args[0])
    if not isinstance(p, Shard):
        return REPLICATE
    widths = arguments(node).get("pad")
    rank = ndim(node.args[0])
    padded = {rank - 1 - i // 2 for i, w in enumerate(widths) if w}
    if p.dim in padded:
        raise an.refuse(node, "pads the token axis", FIX_GENERIC)
    return p
