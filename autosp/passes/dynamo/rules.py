"""The op table of the sequence-sharding analysis: what each op does to the token axis.

See Note [Sequence-sharding analysis] in autosp.passes.dynamo.sharding and Note [Op
rule registry] in autosp.passes.dynamo.registry.  The rules live in their families'
modules, registered there by `autosp.passes.dynamo.registry.rule`; this module
imports every family (FAMILIES) and applies the table to a node.
"""

from __future__ import annotations

import importlib

from torch import fx

from autosp.passes.dynamo import moe
from autosp.passes.dynamo.higher_order import LOCAL_REDUCTION, higher_order_body
from autosp.passes.dynamo.placements import REPLICATE, Shard
from autosp.passes.dynamo.registry import FIX_GENERIC, lookup, op_table, sharded_inputs

FAMILIES = (
    "autosp.passes.dynamo.pointwise",
    "autosp.passes.dynamo.views",
    "autosp.passes.dynamo.reductions",
    "autosp.passes.dynamo.matmul",
    "autosp.passes.dynamo.indexing",
    "autosp.passes.dynamo.random_ops",
    "autosp.passes.dynamo.attention",
    "autosp.passes.dynamo.positions",
    "autosp.passes.dynamo.factories",
    "autosp.passes.dynamo.higher_order",
)
"""The modules whose ``@rule`` decorators fill the op table (a new op family is added here)."""

for _family in FAMILIES:
    importlib.import_module(_family)


def apply(an, gm: fx.GraphModule, node: fx.Node):
    """The placement of ``node``: its rule's, or replicated for an op without a rule that touches no tokens.

    The MoE family is asked first: it owns placements of its own (rows in a shard-local order, Note [MoE
    dispatch as a shard-local permutation] in autosp/passes/dynamo/moe.py), which every op reading them must
    keep or refuse, whatever the op's ordinary rule."""
    placed = moe.apply(an, gm, node)
    if placed is not moe.NOT_MINE:
        return placed
    entry = lookup(node)
    if entry is None:
        sharded = sharded_inputs(an, node)
        if not sharded:
            return REPLICATE
        tentative = [(a, p) for a, p in sharded if isinstance(p, Shard) and p.tentative]
        if len(tentative) == len(sharded):
            for _, p in tentative:
                an.use_positions(p, "replicated")
            return REPLICATE
        arg, p = next((a, q) for a, q in sharded if not (isinstance(q, Shard) and q.tentative))
        raise an.refuse(node, f"has no sequence-sharding rule in AutoSP and its input {arg.name} is {p}; it may mix "
                        "tokens across the sequence (a scan, a convolution, a reduction)", FIX_GENERIC)
    an.classify(node, entry.op_class)
    return entry(an, gm, node)


__all__ = ["FAMILIES", "LOCAL_REDUCTION", "apply", "higher_order_body", "op_table"]
