"""Recognise a causal attention mask the model built from its positions, and make it ``is_causal=True``.

Note [Causal masks built from positions]
Hugging Face models called with ``use_cache=False`` (what gradient checkpointing
forces) and position ids build their attention mask under tracing: a packed-
sequence mask from the position ids, and-ed with the causal mask, handed to
``scaled_dot_product_attention`` as ``attn_mask``.  On a shard that mask is the
shard's [L, L] block, not the sequence's; after the Ulysses all-to-all the
attention needs the [S, S] mask.  For one unpacked sequence per row (positions
0..S-1, what `autosp.prepare_inputs` passes by default) the single-device mask
is exactly the causal mask.  So:

1. the mask's inputs must be the position ids alone (and constants): a mask
   that reads anything else (a padding mask, the tokens) is left to the
   attention rule, which refuses it;
2. the mask subgraph is evaluated at compile time on this rank's real position
   ids and must equal the causal (lower-triangular) block for every row and
   head: a packed batch or a sliding window shorter than the shard fails here;
3. the attention then gets ``attn_mask=None, is_causal=True``, and the compiled
   model checks on every call that the positions are still 0..S-1 per row and
   that the model's sliding window (if any) is not shorter than the sequence,
   the two facts step 2 cannot see from one shard (`SequenceParallelModel`).

Packed documents and sliding windows need a mask over the whole sequence
(flex attention block masks); they are refused until then.
"""

from __future__ import annotations

import logging

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor

from autosp.context import TraceContext
from autosp.errors import AutoSPError
from autosp.guards import PACKED_POSITIONS_REFUSED
from autosp.passes.dynamo.attention import SDPA_TARGETS, _sdpa_signature
from autosp.passes.dynamo.rules import higher_order_body
from autosp.passes.graph_utils import bind, module_name

log = logging.getLogger(__name__)


def _sdpa_nodes(gm: fx.GraphModule, hop: fx.Node | None = None):
    """(graph module, SDPA node, enclosing higher-order op node or None), bodies one level deep included."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in SDPA_TARGETS:
            yield gm, node, hop
        body = higher_order_body(gm, node) if hop is None else None
        if body is not None:
            yield from _sdpa_nodes(body[0], node)


def _to_outer(gm_body: fx.GraphModule, hop: fx.Node | None, value):
    """The top-level node a body placeholder receives (the value itself in the top graph)."""
    if hop is None or not isinstance(value, fx.Node) or value.op != "placeholder":
        return value
    placeholders = [n for n in gm_body.graph.nodes if n.op == "placeholder"]
    operands = [a for a in hop.args if not (isinstance(a, fx.Node) and a.op == "get_attr")]
    operands = operands[len(operands) - len(placeholders):]
    return operands[placeholders.index(value)]


def _ancestors(node: fx.Node) -> list[fx.Node]:
    seen, stack, order = set(), [node], []
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        order.append(n)
        stack.extend(n.all_input_nodes)
    return order


def _evaluate(gm: fx.GraphModule, mask: fx.Node, inputs: dict[fx.Node, torch.Tensor]) -> torch.Tensor | None:
    """Run the subgraph that computes ``mask`` on real inputs; None if it reads something else."""
    needed = set(_ancestors(mask))
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node not in needed:
            continue
        if node.op == "placeholder":
            if node not in inputs:
                return None
            env[node] = sub.placeholder(node.name)
        elif node.op == "get_attr":
            return None
        else:
            env[node] = sub.node_copy(node, lambda n: env[n])
    sub.output(env[mask])
    module = fx.GraphModule(gm, sub)
    order = [n for n in gm.graph.nodes if n.op == "placeholder" and n in needed]
    try:
        with torch.no_grad():
            return module(*[inputs[n] for n in order])
    except Exception as err:  # a mask we cannot evaluate is simply not recognised
        log.debug("attention mask not evaluable: %s", err)
        return None


def _is_causal_block(mask: torch.Tensor) -> bool:
    allowed = mask if mask.dtype == torch.bool else mask == 0
    if allowed.dim() < 2 or allowed.shape[-1] != allowed.shape[-2]:
        return False
    size = allowed.shape[-1]
    causal = torch.ones(size, size, dtype=torch.bool).tril()
    return bool((allowed == causal).all())


def causal_mask_pass(gm: fx.GraphModule, example_inputs, *, ctx: TraceContext) -> fx.GraphModule:
    """Replace attention masks that are the causal mask of the given positions by ``is_causal=True``."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    by_role = {n.meta.get("autosp_role"): (n, v) for n, v in zip(placeholders, example_inputs, strict=False)}
    positions = by_role.get("position_ids")
    replaced = 0
    for graph_module, node, hop in list(_sdpa_nodes(gm)):
        call = bind(_sdpa_signature, node).arguments
        if call["attn_mask"] is None:
            continue
        outer = _to_outer(graph_module, hop, call["attn_mask"])
        if positions is None or not isinstance(outer, fx.Node):
            continue
        if isinstance(positions[1], FakeTensor):  # a shape-only trace has no positions to evaluate the mask on
            continue
        value = _evaluate(gm, outer, {positions[0]: positions[1]})
        if value is None:
            continue
        if not ctx.positions_plain:  # decided on the full-length positions: the same on every rank
            raise AutoSPError(f"module {module_name(node)}: {PACKED_POSITIONS_REFUSED}")
        if not _is_causal_block(value):
            raise AutoSPError(
                f"module {module_name(node)} attends with a mask built from the position ids that is not causal "
                "over this shard (packed documents, or a sliding window shorter than a shard); AutoSP supports one "
                "unpacked sequence per row (position_ids 0..S-1) so far"
            )
        call["attn_mask"], call["is_causal"] = None, True
        q, k, v = call.pop("query"), call.pop("key"), call.pop("value")
        node.args, node.kwargs = (q, k, v), dict(call)
        replaced += 1
        log.info("attention in %s: the mask built from positions is causal; using is_causal=True", module_name(node))
    if replaced:
        _drop_unused_operands(gm)
        gm.graph.eliminate_dead_code()
        gm.recompile()
        ctx.report.causal_masks_replaced += replaced
    return gm


def _drop_unused_operands(gm: fx.GraphModule) -> None:
    """Remove body inputs nothing reads any more (the replaced masks), from the body and its call."""
    for node in list(gm.graph.nodes):
        body = higher_order_body(gm, node)
        if body is None:
            continue
        sub, operands = body
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        first = len(node.args) - len(operands)
        keep = [i for i, ph in enumerate(placeholders) if ph.users]
        if len(keep) == len(placeholders):
            continue
        for i, ph in enumerate(placeholders):
            if i not in keep:
                sub.graph.erase_node(ph)
        node.args = tuple(node.args[:first]) + tuple(operands[i] for i in keep)
        sub.recompile()
