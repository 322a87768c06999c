"""Make positions a model builds itself global: the analysis's rule for ``arange``.

Note [Positions built in the graph]
A model called without position ids builds them from the length it sees,
``torch.arange(S)`` (or ``arange(0, S)``, ``arange(end=S)``, ``arange(S, dtype=..)``,
``cache_position`` in Hugging Face, or a running count ``ones(S).cumsum(0) - 1``).
On a shard that length is the local one
and the positions would restart at 0 on every rank.  But not every
``arange(local_seq_len)`` is a position: a head index or a feature ramp may have
that length by coincidence.  So the analysis treats each such arange as a
*tentative* token shard and lets its uses decide:

- it meets a token-sharded value along the token axis (``cos(pos) * q``,
  ``embed(pos) + x``): in the single-device program it had one entry per token
  of the whole sequence, so it is a position; this rank's slice is
  ``arange(offset, offset + local_seq_len)`` (under strategy="ring" the
  concatenated aranges of its zig-zag chunks, Note [Zig-zag layout]);
- it is used any other way (reduced, contracted, combined with a replicated
  tensor of its own length, or never meets tokens): it is a replicated value and
  is left alone;
- both: refused, since no single rewrite is right for both uses.

The rewrite happens after the walk, when every use has been seen.

A running count is a position for the same reason: ``cumsum`` of L copies of a
constant c along its only dim is c·(i+1), and the single-device program's
``cumsum`` of S copies, cut to rank r's tokens j = rL + i, is c·(rL + i + 1): the
local count plus c·rL, which the rewrite adds (`constant_fill` says which counts
qualify: ``ones``, ``new_ones``, ``full``, ``new_full`` of one dim of L entries).
"""

from __future__ import annotations

import logging
import operator

import torch
from torch import fx

from autosp.config import ZIGZAG_STRATEGIES
from autosp.errors import AutoSPError
from autosp.passes.dynamo.placements import REPLICATE, Shard, describe
from autosp.passes.dynamo.registry import arguments, op_name, rule
from autosp.passes.graph_utils import fake_value, infer_fake_value, module_name

log = logging.getLogger(__name__)


def _arange_signature(start=None, end=None, step=1, **kwargs):
    """torch.arange(end) / arange(start, end[, step]) with keyword forms; returns (start, end, step)."""
    if end is None:
        start, end = 0, start
    return start if start is not None else 0, end, step


def arange_bounds(node: fx.Node) -> tuple[object, object, object]:
    return _arange_signature(*node.args, **node.kwargs)


_FILLS = {"ones": None, "new_ones": None, "full": 1, "new_full": 2}
"""Factories of one constant value -> the position of their fill value (None: 1)."""


def constant_fill(node: object, length: int) -> float | None:
    """The value c of a one-dim tensor of ``length`` copies of c built by a factory (``ones(L)``,
    ``x.new_full((L,), c)`` ...), else None."""
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
        return None
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    value = fake_value(node)
    if name not in _FILLS or not isinstance(value, torch.Tensor) or tuple(value.shape) != (length,):
        return None
    at = _FILLS[name]
    if at is None:
        return 1
    fill = node.kwargs.get("fill_value", node.args[at] if len(node.args) > at else None)
    return fill if isinstance(fill, (int, float)) and not isinstance(fill, bool) else None


def running_count(an, node: fx.Node):
    """A tentative token shard for ``cumsum`` over a constant fill of this shard's length, else None."""
    bound = arguments(node)
    if an.seq_len <= 1 or constant_fill(bound.get("input"), an.seq_len) is None or bound.get("dim") not in (0, -1):
        return None
    return Shard(0, 1, frozenset({node}))


@rule("positions", "arange")
def arange_placement(an, gm: fx.GraphModule, node: fx.Node):
    """A tentative token shard for ``arange(0, local_seq_len, 1)``, replicated otherwise."""
    start, end, step = arange_bounds(node)
    if isinstance(end, fx.Node) and an.token_symbol is not None:  # a dynamic length: its symbol says
        value = fake_value(end)
        end = an.seq_len if isinstance(value, torch.SymInt) and value.node.expr == an.token_symbol else None
    if an.seq_len > 1 and (start, end, step) == (0, an.seq_len, 1):
        return Shard(0, 1, frozenset({node}))
    return REPLICATE


def globalize_positions(an) -> None:
    """Shift every arange used as positions to this rank's offset; refuse one used both ways."""
    layout = an.ctx.layout
    for node, uses in an.result.positions.items():
        if "token" not in uses:
            continue
        if "replicated" in uses:
            raise AutoSPError(
                f"{describe(node)} in module {module_name(node)} builds a range of this shard's length that is "
                "used both as token positions and as a replicated value; AutoSP cannot tell which the "
                "single-device program meant.  Pass position_ids to the model (autosp.prepare_inputs does) and "
                "use them for positions"
            )
        if layout is None or (layout.contiguous and layout.start == 0):
            continue
        offset = layout.start
        if op_name(node) == "cumsum":  # a running count (see the Note): add the tokens before this shard
            if layout.zigzag:
                raise AutoSPError(f"{describe(node)} in module {module_name(node)} builds positions as a running "
                                  f"count, which strategy={an.ctx.strategy!r} (two chunks per rank) does not shift "
                                  "yet: pass position_ids to the model (autosp.prepare_inputs does), or use "
                                  "strategy='ulysses'")
            fill = constant_fill(arguments(node)["input"], an.seq_len)
            with node.graph.inserting_after(node):
                shifted = node.graph.call_function(operator.add, (node, fill * offset))
            node.replace_all_uses_with(shifted, delete_user_cb=lambda user, added=shifted: user is not added)
            infer_fake_value(shifted)
            log.info("running count in %s now starts at global offset %d", module_name(node), offset)
            continue
        kwargs = {k: v for k, v in node.kwargs.items() if k not in ("start", "end", "step")}
        length = arange_bounds(node)[1]
        if isinstance(length, fx.Node) and an.ctx.strategy in ZIGZAG_STRATEGIES:  # not rank r's r-th slice
            raise AutoSPError(f"{describe(node)} in module {module_name(node)} builds positions from a dynamic "
                              f"length, which strategy={an.ctx.strategy!r} does not support: pass position_ids to "
                              "the model (autosp.prepare_inputs does), or use strategy='ulysses'")
        if layout.zigzag:  # this rank's chunks (Note [Zig-zag layout] in autosp/inputs.py), concatenated
            with node.graph.inserting_before(node):
                pieces = [node.graph.call_function(torch.arange, (begin, end), kwargs) for begin, end in layout.ranges]
            for piece in pieces:
                piece.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")})
                infer_fake_value(piece)
            node.target, node.args, node.kwargs = torch.cat, (pieces,), {}
            log.info("positions built in %s now are this rank's zig-zag chunks %s", module_name(node), layout.ranges)
            continue
        if isinstance(length, fx.Node):  # a dynamic length: rank r's tokens are [r * length, (r + 1) * length)
            with node.graph.inserting_before(node):
                first = node.graph.call_function(operator.mul, (length, an.ctx.sp_rank))
                last = node.graph.call_function(operator.mul, (length, an.ctx.sp_rank + 1))
            node.args = (first, last)
            node.kwargs = kwargs
            node.target = torch.arange
            continue
        node.args = (offset, offset + an.seq_len)
        node.kwargs = kwargs
        node.target = torch.arange
        log.info("positions built in %s now start at global offset %d", module_name(node), offset)
