"""Op family: indexing and lookups (``x[...]``, embedding, one_hot, gather and scatter along a row).

See Note [Op rule registry] in autosp.passes.dynamo.registry.  Basic indexing keeps
the token axis when it takes the axis whole; a slice, an integer or a tensor index
along it is refused (positions within a shard are not positions in the sequence).
``gather``/``scatter`` along another axis (a router picking each token's expert
scores) read and write within each token's own row: token-local where every tensor
operand holds the same tokens (`row_wise`).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from autosp.passes.dynamo.placements import REPLICATE, Partial, Shard
from autosp.passes.dynamo.registry import FIX_GENERIC, arguments, ndim, op_name, rule
from autosp.passes.graph_utils import fake_value


@rule("token-local: indexing", targets=(operator.getitem,))
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
    for item in _expand_index(items, ndim(source)):
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
                            FIX_GENERIC)
        out_dim += 0 if isinstance(item, int) else 1
        in_dim += 1
    raise an.refuse(node, "indexes a token-sharded tensor in a way AutoSP cannot follow", FIX_GENERIC)


def _expand_index(items, rank):
    """One entry per input dim (Ellipsis expanded, trailing dims taken whole), None kept as new axes."""
    consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
    out = []
    for item in items:
        if item is Ellipsis:
            out.extend([slice(None)] * (rank - consumed))
        else:
            out.append(item)
    return out + [slice(None)] * (rank - sum(1 for i in out if i is not None))


def _advanced_index(an, node, p, items, tensor_items):
    index_places = [an.of(t) for t in tensor_items]
    if isinstance(p, Shard) and not p.tentative:
        raise an.refuse(node, "gathers from a token-sharded tensor with a tensor index", FIX_GENERIC)
    sharded = [q for q in index_places if isinstance(q, Shard)]
    if not sharded:
        return REPLICATE
    if len(tensor_items) != 1 or any(isinstance(i, (type(None), type(Ellipsis))) for i in items):
        raise an.refuse(node, "indexes with a token-sharded tensor in a way AutoSP cannot follow", FIX_GENERIC)
    at = items.index(tensor_items[0])
    return sharded[0].moved(at + sharded[0].dim)


@rule("token-local: lookup", "embedding")
def embedding(an, gm, node: fx.Node):
    bound = arguments(node)
    if isinstance(an.of(bound["weight"]), (Shard, Partial)):
        raise an.refuse(node, "looks up a token-sharded table", FIX_GENERIC)
    p = an.of(bound.get("indices", bound["input"]))  # F.embedding(input, weight) / aten.embedding(weight, indices)
    return p if isinstance(p, Shard) else REPLICATE


@rule("token-local: lookup", "one_hot")
def one_hot(an, gm, node: fx.Node):
    p = an.of(arguments(node).get("input", node.args[0]))
    return p if isinstance(p, Shard) else REPLICATE


@rule("token-local: row-wise gather and scatter", "gather", "take_along_dim", "scatter", "scatter_", "scatter_add",
      "scatter_add_", "scatter_reduce", "scatter_reduce_")
def row_wise(an, gm, node: fx.Node):
    """``x.gather(d, index)``, ``x.scatter(d, index, src)`` and their kin move entries along dim ``d`` only: entry
    ``[.., i, ..]`` of the result reads or writes ``x`` at the same coordinates as ``index[.., i, ..]`` on every
    other dim.  With ``d`` not the token axis and every tensor operand token-sharded alike (the same tokens on each
    rank, the same local length), each token's row stays its own: token-local.  Along the token axis, or with an
    operand whose rows are other tokens (a replicated table against a sharded index), it would pair one rank's
    tokens with another's: refused."""
    bound = arguments(node)
    operands = [v for k in ("input", "self", "index", "indices", "src") if isinstance(v := bound.get(k), fx.Node)]
    places = [an.of(v) for v in operands]
    if any(isinstance(q, Partial) for q in places):
        raise an.refuse(node, "gathers or scatters a partial sum over the sequence", FIX_GENERIC)
    sharded = [(v, q) for v, q in zip(operands, places, strict=True) if isinstance(q, Shard)]
    if not sharded:
        return REPLICATE
    if all(q.tentative for _, q in sharded):
        for _, q in sharded:
            an.use_positions(q, "replicated")
        return REPLICATE
    p = next(q for _, q in sharded if not q.tentative)
    dim = bound.get("dim")
    if not isinstance(dim, int):
        raise an.refuse(node, f"{op_name(node)} over the flattened tensor mixes the token axis with the others",
                        FIX_GENERIC)
    rank = ndim(operands[0])
    if dim % rank == p.dim:
        raise an.refuse(node, f"{op_name(node)} along dim {p.dim}, the token axis, pairs this rank's tokens with "
                        "positions of the whole sequence", FIX_GENERIC)
    local = {fake_value(v).shape[p.dim] if ndim(v) == rank else None for v in operands}
    if len(sharded) != len(operands) or any(q != p for _, q in sharded) or len(local) != 1 or None in local:
        raise an.refuse(node, f"{op_name(node)} pairs the token-sharded rows of one operand with rows of another "
                        "that hold other tokens (a replicated or differently sharded operand)", FIX_GENERIC)
    return p
