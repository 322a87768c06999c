"""Mixture-of-experts dispatch: a sort of a shard's tokens by expert is a per-token permutation.

Note [MoE dispatch as a shard-local permutation]
Dropless top-k routing (Hugging Face's ``grouped_mm`` experts: Mixtral, Qwen2-MoE,
Qwen3-MoE) computes each token's output from that token alone, but spells it with
ops that reorder the token axis:

    expert_ids = top_k_index.reshape(-1)                 # token-sharded, k entries per token
    ids_sorted, perm = torch.sort(expert_ids)            # perm: a permutation of this rank's entries
    rows = hidden[perm // k]; w = weights[perm]          # gathered into expert order
    counts = torch.histc(ids_sorted, bins=E, min=0, max=E - 1); offs = counts.cumsum(0)
    out = grouped_mm(rows, W, offs=offs) ...             # row i uses the expert of its own key
    inv = torch.empty_like(perm); inv[perm] = torch.arange(n)
    out = out[inv].view(T, k, H).sum(1)                  # back in token order

On a shard, ``perm`` (pi) sorts this rank's entries, not the sequence's; but every
value computed in pi's order holds, at row i, the single-device value of entry
pi(i), so the order is never observed as long as (1) rows are only combined with
rows of the same order (pointwise ops, per-row layout changes, a grouped matmul
whose groups are the sorted keys' own counts) and (2) the rows come back through
the inverse permutation (``x[inv]`` with ``inv[perm] = arange``, ``argsort(perm)``,
or ``index_add`` at ``perm``).  The analysis tracks this with four placements,
all of them token-sharded (a gradient flowing back through them is per-rank, as for
any token-sharded value):

- `Permuted`: rows in pi's order (the sorted keys, gathered rows, per-row results);
- `LocalIndex`: pi itself (entries are positions inside this rank's shard), or pi
  floor-divided by a divisor of k (the position of the entry's token);
- `InverseIndex`: pi's inverse; `Scratch`: ``empty_like(perm)`` before it is filled;
- `Groups`: per-key counts of the sorted keys (``histc``/``bincount``) and their
  ``cumsum``, the offsets a grouped matmul reads.

Every op with such an input is handled here or refused: a reduction, scan, slice or
matmul over the permuted rows, mixing them with token-ordered values or another
permutation, or groups that are not the sorted keys' own counts.  Routing whose
capacity depends on the whole batch (expert-choice ``topk`` over the tokens, token
dropping by a cumulative count against a capacity factor) stays refused by the
ordinary rules (``topk``/``cumsum`` along the token axis).

Also here, for MoE auxiliary losses: ``histc``/``bincount`` of a token-sharded
value, and ``zeros(n).scatter_add_(0, index, src)`` with token-sharded index and
source, are sums of per-token counts (local count + all-reduce, as a sum);
``repeat_interleave(r)`` along the token axis keeps each token's block (r times
longer: the mask spelling of the aux loss, ``batched_mm`` experts); and
Hugging Face's ``load_balancing_loss_func`` divides by ``routing_weights.shape[0]``
summed over layers, a row count Dynamo bakes into the graph as this shard's
number: inside that function (a library function whose source says the literal
is a row count) the divisor is made the sequence's.

Consulted before the op table by ``rules.apply`` (`apply` below
returns `NOT_MINE` for every node it does not handle).
"""

from __future__ import annotations

import logging
import operator
import re
from dataclasses import dataclass

import torch
from torch import fx

from autosp.passes.dynamo.placements import REPLICATE, Replicate, Shard
from autosp.passes.graph_utils import fake_value

log = logging.getLogger(__name__)

NOT_MINE = object()
"""`apply`'s answer for a node the ordinary rules handle."""

_FIX = ("AutoSP accepts a mixture-of-experts dispatch that sorts a shard's tokens by expert, computes each row "
        "per token (a grouped matmul over the sorted keys' own counts included) and scatters the rows back with "
        "the inverse permutation; keep the dispatch in that form (Hugging Face's grouped_mm or batched_mm experts)")

_KEY_DTYPE_NAMES = {"to", "float", "int", "long", "double", "half", "bfloat16", "type", "contiguous", "clone",
                    "detach", "_to_copy"}
_ROW_LAYOUT_NAMES = {"view", "reshape", "unsqueeze", "squeeze", "flatten", "contiguous", "clone", "detach", "to",
                     "float", "half", "double", "bfloat16", "type", "type_as", "_to_copy", "view_as", "reshape_as"}
_GROUPED_MM_NAMES = {"grouped_mm", "_grouped_mm", "grouped_mm_fallback"}
_INDEX_ADD_NAMES = {"index_add", "index_add_"}
_AUX_LOSS_FUNCTIONS = {"load_balancing_loss_func"}
"""Hugging Face functions that divide by a row count read from a shape (see the note)."""


@dataclass(frozen=True)
class _Local(Shard):
    """Base of the placements of a shard-local permutation ``perm`` (the sort node) of ``items`` entries."""

    perm: fx.Node | None = None
    items: int = 0


@dataclass(frozen=True)
class Permuted(_Local):
    """Rows along dim 0 in ``perm``'s order: row i holds the single-device value of entry perm(i)."""

    key: bool = False
    """The rows are the sorted keys themselves (what `Groups` may count)."""

    def __str__(self) -> str:
        return "token-sharded(permuted within the shard)"


@dataclass(frozen=True)
class LocalIndex(_Local):
    """The permutation as an index: entry i is perm(i) // ``div`` (``div`` divides the entries per token)."""

    div: int = 1
    stride: int = 1
    """Entries per token in the sorted tensor."""

    def __str__(self) -> str:
        return "shard-local index"


@dataclass(frozen=True)
class InverseIndex(_Local):
    stride: int = 1

    def __str__(self) -> str:
        return "shard-local inverse index"


@dataclass(frozen=True)
class Scratch(_Local):
    stride: int = 1

    def __str__(self) -> str:
        return "shard-local scratch"


@dataclass(frozen=True)
class Groups(_Local):
    """Counts per key of the sorted keys (``offsets``: their cumulative sum)."""

    offsets: bool = False

    def __str__(self) -> str:
        return "shard-local expert counts"


def _name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return target._opname if hasattr(target, "_opname") else str(target).split(".")[-1]
    return getattr(target, "__name__", str(target))


def _flat(placement):
    if isinstance(placement, tuple):
        for p in placement:
            yield from _flat(p)
    else:
        yield placement


def _local_inputs(an, node):
    return [(a, an.of(a)) for a in node.all_input_nodes if any(isinstance(p, _Local) for p in _flat(an.of(a)))]


def _shape(node):
    value = fake_value(node)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else ()


def _arg(node, index, keyword, default=None):
    return node.args[index] if len(node.args) > index else node.kwargs.get(keyword, default)


def apply(an, gm: fx.GraphModule, node: fx.Node):
    """The node's placement if this module handles it, else `NOT_MINE`."""
    if node.op not in ("call_function", "call_method"):
        return NOT_MINE
    name = _name(node)
    if _local_inputs(an, node):
        an.classify(node, "token-local: MoE dispatch (shard-local permutation)")
        return _on_local(an, gm, node, name)
    if name in ("sort", "argsort"):
        return _sort(an, node, name)
    if name in ("histc", "bincount") and _real_shard(an.of(node.args[0])):
        an.classify(node, "reduction (over the sequence: all-reduced counts)")
        from autosp.passes.dynamo.reductions import complete_sequence_reduction

        return complete_sequence_reduction(an, gm, node)
    if name in ("scatter_add", "scatter_add_") and _scatter_count(an, node):
        an.classify(node, "reduction (over the sequence: all-reduced counts)")
        from autosp.passes.dynamo.reductions import complete_sequence_reduction

        return complete_sequence_reduction(an, gm, node)
    if name == "repeat_interleave":
        return _repeat_interleave(an, node)
    if name in ("truediv", "div", "true_divide", "__truediv__") and _aux_loss_row_count(an, node):
        return REPLICATE
    if name in ("mul", "__mul__", "__rmul__") and _aux_loss_expert_count(an, node):
        return REPLICATE
    return NOT_MINE


def _real_shard(p) -> bool:
    return isinstance(p, Shard) and not isinstance(p, _Local) and not p.tentative


def _repeat_interleave(an, node):
    """``x.repeat_interleave(r)`` along the token axis (an int r): every entry of a token repeated r times in place,
    so the token keeps its consecutive block, r times longer (MoE: one row per token and expert slot)."""
    x = node.args[0]
    p = an.of(x)
    repeats = _arg(node, 1, "repeats")
    dim = _arg(node, 2, "dim", None)
    ndim = len(_shape(x))
    if (not _real_shard(p) or not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1
            or (dim is None and ndim != 1) or (dim is not None and dim % max(ndim, 1) != p.dim)):
        return NOT_MINE
    an.classify(node, "token-local: layout")
    return Shard(p.dim, p.inner * repeats)


def _scatter_count(an, node) -> bool:
    """``torch.zeros(n).scatter_add_(0, index, src)`` with token-sharded index and src: a sum over the tokens."""
    target = node.args[0]
    dim = _arg(node, 1, "dim")
    index, src = _arg(node, 2, "index"), _arg(node, 3, "src")
    if not (isinstance(target, fx.Node) and isinstance(index, fx.Node) and isinstance(src, fx.Node)):
        return False
    pi, ps = an.of(index), an.of(src)
    fresh = _name(target) in ("zeros", "new_zeros") and len(target.users) == 1 and isinstance(an.of(target), Replicate)
    return (fresh and dim == 0 and len(_shape(target)) == 1 and _real_shard(pi) and _real_shard(ps)
            and pi.dim == 0 and ps.dim == 0 and (pi.inner, _shape(index)) == (ps.inner, _shape(src)))


# -- the permutation ------------------------------------------------------------------------------
def _sort(an, node, name):
    x = node.args[0]
    p = an.of(x)
    if not _real_shard(p) or len(_shape(x)) != 1:
        return NOT_MINE  # the ordinary rule (along the token axis: refused)
    dim = _arg(node, 1, "dim", -1)
    descending = _arg(node, 2, "descending", False)
    if dim not in (0, -1) or not isinstance(descending, bool):
        return NOT_MINE
    items = _shape(x)[0]
    an.classify(node, "token-local: MoE dispatch (shard-local permutation)")
    index = LocalIndex(0, 1, perm=node, items=items, div=1, stride=p.inner)
    if name == "argsort":
        return index
    # Only ascending keys can be grouped by their counts' cumulative sum (offsets).
    return (Permuted(0, 1, perm=node, items=items, key=not descending and _is_expert_key(x)), index)


def _is_expert_key(node: fx.Node) -> bool:
    """Whether ``node`` is (a reshaped, retyped) index output of topk/argmax/max: non-negative integers."""
    seen = 0
    while seen < 16 and isinstance(node, fx.Node):
        seen += 1
        name = _name(node)
        if name in _ROW_LAYOUT_NAMES | _KEY_DTYPE_NAMES:
            node = node.args[0]
            continue
        if name == "argmax":
            return True
        if node.target is operator.getitem and node.args[1] == 1 and isinstance(node.args[0], fx.Node):
            return _name(node.args[0]) in ("topk", "max", "sort")
        return False
    return False


def _on_local(an, gm, node, name):
    if node.target is operator.getitem:
        return _getitem(an, node)
    if node.target is operator.setitem:
        return _setitem(an, node)
    if name in _GROUPED_MM_NAMES:
        return _grouped_mm(an, node)
    if name in ("histc", "bincount"):
        return _count(an, node, name)
    if name == "cumsum":
        return _cumsum(an, node)
    if name in ("empty_like", "zeros_like"):
        p = an.of(node.args[0])
        if isinstance(p, LocalIndex) and p.div == 1:
            return Scratch(0, 1, perm=p.perm, items=p.items, stride=p.stride)
        if isinstance(p, Permuted):
            return Permuted(0, 1, perm=p.perm, items=p.items)
    if name == "argsort":
        p = an.of(node.args[0])
        if isinstance(p, LocalIndex) and p.div == 1 and _arg(node, 1, "dim", -1) in (0, -1):
            return InverseIndex(0, 1, perm=p.perm, items=p.items, stride=p.stride)
    if name in ("floordiv", "floor_divide", "__floordiv__"):
        return _floordiv(an, node)
    if name in _INDEX_ADD_NAMES:
        return _index_add(an, node)
    if name in ("chunk", "split") and isinstance(an.of(node.args[0]), Permuted):
        dim = _arg(node, 2, "dim", 0)
        if dim % max(1, len(_shape(node.args[0]))) != 0:
            p = an.of(node.args[0])
            return tuple(Permuted(0, 1, perm=p.perm, items=p.items) for _ in fake_value(node))
    if all(isinstance(an.of(a), Groups) or not isinstance(fake_value(a), torch.Tensor) for a in node.all_input_nodes):
        p = an.of(node.args[0])
        if name in _KEY_DTYPE_NAMES and isinstance(p, Groups):
            return p
    return _rowwise(an, node, name)


def _rowwise(an, node, name):
    """Pointwise ops and per-row layout changes of permuted rows (rows stay rows, dim 0 keeps its length)."""
    from autosp.passes.dynamo.pointwise import pointwise
    from autosp.passes.dynamo.registry import names_of
    from autosp.passes.dynamo.views import layout

    pointwise_names, layout_names = names_of(pointwise), names_of(layout)

    out = fake_value(node)
    places = {a: an.of(a) for a in node.all_input_nodes if isinstance(fake_value(a), torch.Tensor)}
    perms = {p.perm for p in places.values() if isinstance(p, _Local)}
    kinds = {type(p) for p in places.values() if isinstance(p, _Local)}
    if kinds != {Permuted} or len(perms) != 1:
        raise an.refuse(node, f"uses values of a shard-local permutation ({', '.join(sorted(map(str, set(places.values()))))}) "
                        "in a way AutoSP cannot prove per-token", _FIX)
    (perm,) = perms
    items = next(p.items for p in places.values() if isinstance(p, Permuted))
    if not isinstance(out, torch.Tensor) or out.dim() == 0 or out.shape[0] != items:
        raise an.refuse(node, "changes the row axis of rows gathered in a shard-local order", _FIX)
    if name in pointwise_names and name not in ("copy_", "masked_fill_", "add_", "sub_", "mul_", "div_", "clamp_"):
        for a, p in places.items():
            if isinstance(p, Permuted):
                if _shape(a)[:1] != (items,) or len(_shape(a)) != out.dim():
                    raise an.refuse(node, "combines permuted rows that do not line up", _FIX)
            elif not isinstance(p, Replicate):
                raise an.refuse(node, f"combines rows gathered in a shard-local order with the {p} tensor {a.name}: "
                                "their rows are in different orders", _FIX)
            elif _per_row(a, out, items):
                raise an.refuse(node, f"combines rows gathered in a shard-local order with {p} tensor "
                                f"{a.name} that has one entry per row: in the single-device program its rows are in "
                                "another order", _FIX)
        return Permuted(0, 1, perm=perm, items=items)
    if name in layout_names or name in _ROW_LAYOUT_NAMES or name in ("silu", "gelu", "relu"):
        source = node.args[0]
        if len(places) != 1 or not isinstance(an.of(source), Permuted):
            raise an.refuse(node, "mixes permuted rows with other tensors in a layout op", _FIX)
        if name in ("unsqueeze", "unsqueeze_") and _arg(node, 1, "dim", 0) % (out.dim()) == 0:
            raise an.refuse(node, "adds a dim before the permuted rows", _FIX)
        in_shape = _shape(source)
        if name in ("view", "reshape", "flatten", "view_as", "reshape_as") and (
                not in_shape or in_shape[0] != out.shape[0]):
            raise an.refuse(node, "reshapes across the permuted row axis", _FIX)
        p = an.of(source)
        return Permuted(0, 1, perm=perm, items=items, key=p.key and name in _KEY_DTYPE_NAMES)
    if name in ("bmm", "matmul", "__matmul__") and len(node.args) == 2 and all(
            isinstance(places.get(a), Permuted) and len(_shape(a)) >= 3 or isinstance(places.get(a), Replicate)
            and len(_shape(a)) <= 2 for a in node.args):
        return Permuted(0, 1, perm=perm, items=items)  # dim 0 (the rows) is a batch dim: one product per row
    if name in ("linear",) and len(places) >= 1 and all(
            isinstance(p, Replicate) for a, p in places.items() if a is not node.args[0]):
        return Permuted(0, 1, perm=perm, items=items)
    raise an.refuse(node, f"applies {name} to rows gathered in a shard-local order; AutoSP accepts only per-row ops "
                    "there (a reduction, scan or matmul over those rows would see this rank's tokens only)", _FIX)


def _per_row(arg, out, items) -> bool:
    shape = _shape(arg)
    lead = out.dim() - len(shape)
    return lead == 0 and len(shape) > 0 and shape[0] == items and items > 1


def _getitem(an, node):
    source, index = node.args
    p = an.of(source)
    if isinstance(p, tuple):
        return p[index] if isinstance(index, int) else REPLICATE
    idx = an.of(index) if isinstance(index, fx.Node) else None
    if isinstance(idx, LocalIndex) and not isinstance(p, _Local):
        return _gather(an, node, source, p, idx)
    items = list(index) if isinstance(index, tuple) else [index]
    if (isinstance(p, Permuted) and not any(isinstance(i, fx.Node) for i in items) and items
            and isinstance(items[0], slice) and items[0] == slice(None) and _shape(node)[:1] == (p.items,)):
        return Permuted(0, 1, perm=p.perm, items=p.items)  # x[:, ...]: every row kept, in place
    if isinstance(idx, Permuted) and isinstance(p, Replicate) and not fake_value(index).is_floating_point():
        return Permuted(0, 1, perm=idx.perm, items=idx.items)  # a table row per permuted row (W[sorted ids])
    if isinstance(idx, InverseIndex) and isinstance(p, Permuted):
        if _shape(source)[:1] != (idx.items,):
            raise an.refuse(node, "restores token order from rows of another length", _FIX)
        return Shard(0, idx.stride)
    raise an.refuse(node, f"indexes {p} with {idx if idx is not None else repr(index)}; only a gather at the "
                    "permutation (x[perm]) and the gather back at its inverse (rows[inverse]) are per-token", _FIX)


def _gather(an, node, source, p, idx):
    per_token = idx.stride // idx.div
    if not _real_shard(p) or p.dim != 0 or p.inner != per_token or _shape(source)[:1] != (idx.items // idx.div,):
        raise an.refuse(node, f"gathers from {p} tensor {source.name} (shape {list(_shape(source))}) at a "
                        "shard-local permutation it was not sorted for", _FIX)
    return Permuted(0, 1, perm=idx.perm, items=idx.items)


def _floordiv(an, node):
    x, d = node.args[0], node.args[1]
    p = an.of(x)
    if isinstance(p, LocalIndex) and isinstance(d, int) and d > 0 and (p.stride // p.div) % d == 0:
        return LocalIndex(0, 1, perm=p.perm, items=p.items, div=p.div * d, stride=p.stride)
    raise an.refuse(node, "divides a shard-local index by something other than a divisor of the entries per token",
                    _FIX)


def _setitem(an, node):
    """``inv[perm] = arange(n)``: ``inv`` becomes the inverse permutation (the target is updated in place)."""
    from autosp.passes.dynamo.positions import arange_bounds

    target, index, value = node.args
    t, i = an.of(target), an.of(index) if isinstance(index, fx.Node) else None
    if (isinstance(t, Scratch) and isinstance(i, LocalIndex) and i.div == 1 and i.perm is t.perm
            and isinstance(value, fx.Node) and _name(value) == "arange"
            and tuple(arange_bounds(value)) == (0, t.items, 1)):
        an.set(target, InverseIndex(0, 1, perm=t.perm, items=t.items, stride=t.stride))
        return REPLICATE
    raise an.refuse(node, "writes into a tensor at shard-local positions other than building the inverse "
                    "permutation (inverse[perm] = arange(n))", _FIX)


def _index_add(an, node):
    """``out.index_add(0, perm // k, rows)``: rows added back at their tokens' positions (token order)."""
    target, dim, index, source = (node.args + (None,) * 4)[:4]
    index = index if index is not None else node.kwargs.get("index")
    source = source if source is not None else node.kwargs.get("source")
    t, i, s = an.of(target), an.of(index), an.of(source)
    if (dim == 0 and isinstance(i, LocalIndex) and isinstance(s, Permuted) and s.perm is i.perm
            and _real_shard(t) and t.dim == 0 and t.inner == i.stride // i.div
            and _shape(target)[:1] == (i.items // i.div,) and _shape(source)[:1] == (i.items,)):
        return t
    raise an.refuse(node, "adds rows back at shard-local positions other than the permutation it sorted them by, "
                    "into a token-sharded tensor", _FIX)


def _count(an, node, name):
    p = an.of(node.args[0])
    if not (isinstance(p, Permuted) and p.key):
        raise an.refuse(node, "counts values of a shard-local permutation that are not the sorted expert ids", _FIX)
    if name == "histc":
        bins, lo, hi = _arg(node, 1, "bins", 100), _arg(node, 2, "min", 0), _arg(node, 3, "max", 0)
        if lo != 0 or hi != bins - 1:
            raise an.refuse(node, f"counts the sorted expert ids in bins ({bins} over [{lo}, {hi}]) that are not one "
                            "per id, so the groups would not be the sorted keys' own", _FIX)
    elif len(node.args) > 1 or node.kwargs.get("weights") is not None:
        raise an.refuse(node, "counts weighted expert ids", _FIX)
    return Groups(0, 1, perm=p.perm, items=p.items)


def _cumsum(an, node):
    p = an.of(node.args[0])
    if isinstance(p, Groups) and not p.offsets and _arg(node, 1, "dim", 0) in (0, -1):
        return Groups(0, 1, perm=p.perm, items=p.items, offsets=True)
    raise an.refuse(node, "accumulates values of a shard-local permutation along its rows (a scan over tokens)", _FIX)


def _grouped_mm(an, node):
    x = node.args[0]
    weight = _arg(node, 1, "weight", None) if len(node.args) > 1 else node.kwargs.get("mat_b")
    offs = _arg(node, 2, "offs", None)
    px, po = an.of(x), an.of(offs) if isinstance(offs, fx.Node) else None
    if (isinstance(px, Permuted) and isinstance(po, Groups) and po.offsets and po.perm is px.perm
            and isinstance(an.of(weight), Replicate)):
        return Permuted(0, 1, perm=px.perm, items=px.items)
    raise an.refuse(node, "is a grouped matmul whose rows, groups or weights are not the permuted rows, the sorted "
                    "keys' own offsets and replicated weights", _FIX)


# -- auxiliary losses ------------------------------------------------------------------------------
_FRAME = re.compile(r'File "([^"]+)", line \d+, in (\S+)')


def _in_aux_loss_function(node) -> bool:
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    return bool(frames) and frames[-1][1] in _AUX_LOSS_FUNCTIONS and "transformers" in frames[-1][0]


def _aux_loss_expert_count(an, node) -> bool:
    """In load_balancing_loss_func, ``overall_loss * num_experts``: the literal is the expert count, not a token
    count (the ordinary rule would refuse it when it happens to equal a multiple of this shard's tokens)."""
    if not _in_aux_loss_function(node) or len(node.args) != 2:
        return False
    x, factor = node.args
    if (isinstance(x, fx.Node) and x in an.sequence_reduced and isinstance(an.of(x), Replicate)
            and isinstance(factor, int) and not isinstance(factor, bool)):
        an.classify(node, "token-local: elementwise (router aux loss: times the expert count)")
        return True
    return False


def _aux_loss_row_count(an, node) -> bool:
    """In Hugging Face's load_balancing_loss_func, ``sum / total_rows`` with total_rows baked from shapes."""
    if not _in_aux_loss_function(node):
        return False
    x, count = node.args[0], node.args[1] if len(node.args) > 1 else None
    layout = an.ctx.layout
    if (not isinstance(x, fx.Node) or x not in an.sequence_reduced or isinstance(count, bool)
            or not isinstance(count, (int, float)) or layout is None or not an.seq_len or count % an.seq_len):
        return False
    # Checked again on every call of the program: autosp.context.TraceContext.require_unpadded.
    an.ctx.require_unpadded("the router auxiliary loss counts rows from shapes")
    node.args = (x, count * an.ctx.sp_size, *node.args[2:])
    an.classify(node, "reduction (router aux loss: row count made global)")
    log.info("router auxiliary loss: the row count %s read from a shard's shape is now the sequence's (%s)",
             count, count * an.ctx.sp_size)
    return True


__all__ = ["NOT_MINE", "Groups", "InverseIndex", "LocalIndex", "Permuted", "Scratch", "apply"]
