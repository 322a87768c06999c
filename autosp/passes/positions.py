"""Make positions a model builds itself global.

A model called without position ids builds them from the sequence length it
sees, ``torch.arange(S)``; on a shard that would restart at 0 on every rank and
give RoPE or learned position embeddings the wrong positions.  When the compiled
model could not pass position ids (the model's forward takes none), every
``arange`` over the local sequence length is shifted by this rank's offset.
"""

from __future__ import annotations

import logging

import torch
from torch import fx

from autosp.context import TraceContext
from autosp.passes.graph_utils import module_name

log = logging.getLogger(__name__)


def _arange_bounds(node: fx.Node) -> tuple[int, int, int] | None:
    """(start, end, step) of a constant torch.arange call, else None."""
    if node.op != "call_function" or node.target is not torch.arange:
        return None
    args = list(node.args)
    if not all(isinstance(a, int) for a in args):
        return None
    if len(args) == 1:
        return 0, args[0], 1
    if len(args) == 2:
        return args[0], args[1], node.kwargs.get("step", 1)
    if len(args) == 3:
        return args[0], args[1], args[2]
    return None


def offset_positions_pass(gm: fx.GraphModule, example_inputs, *, ctx: TraceContext) -> fx.GraphModule:
    if ctx.positions_passed or ctx.layout is None or ctx.layout.start == 0:
        return gm
    local, offset = ctx.layout.local_seq_len, ctx.layout.start
    for node in gm.graph.nodes:
        bounds = _arange_bounds(node)
        if bounds != (0, local, 1):
            continue
        node.args = (offset, offset + local)
        node.kwargs = {k: v for k, v in node.kwargs.items() if k != "step"}
        log.info("positions built in %s now start at global offset %d", module_name(node), offset)
    return gm
