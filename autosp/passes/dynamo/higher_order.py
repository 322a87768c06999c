"""Op family: higher-order ops, each read by its own signature.

See Note [Op rule registry] in autosp.passes.dynamo.registry.

- Bodies that run inline in the forward (``tag_activation_checkpoint``, ``wrap``,
  ``invoke_subgraph``, the grad-mode and autocast wrappers) are analysed like the
  code around them, their placeholders taking the placements of the operands.
- A custom ``torch.autograd.Function`` is traced as ``autograd_function_apply(fwd_body,
  bwd_body, *operands)``: the forward body's placeholders are the operands, its
  output is ``(outputs, saved tensors)``; the backward body's placeholders are one
  gradient per output then the saved tensors, its outputs one gradient per operand.
  Its backward is the user's code, not autograd's, so no rule may change either
  body: the Function is accepted only when both bodies are token-local (no
  collective inserted, no positions rebuilt) and each gradient is placed like its
  operand; anything else is refused, naming the Function.
- Any other higher-order op with a token-sharded operand is refused.
"""

from __future__ import annotations

import torch
from torch import fx

from autosp.errors import AutoSPError
from autosp.passes.dynamo.placements import REPLICATE, Partial, Shard
from autosp.passes.dynamo.registry import multi, rule, sharded_inputs
from autosp.passes.graph_utils import flatten

LOCAL_REDUCTION = "autosp_local_reduction"
"""node.meta flag: a rule already completes this reduction over the sequence with an all-reduce."""

_INLINE = {"tag_activation_checkpoint", "wrap", "invoke_subgraph", "wrap_with_set_grad_enabled",
           "wrap_with_autocast"}
"""Higher-order ops whose body runs once, inline, on the operands that follow it."""
_FUNCTION = "autograd_function_apply"


def _is_hop(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator)


def _hop_name(node: fx.Node) -> str:
    return node.target.name()


def _body(gm: fx.GraphModule, arg):
    if isinstance(arg, fx.Node) and arg.op == "get_attr":
        sub = getattr(gm, arg.target, None)
        if isinstance(sub, fx.GraphModule):
            return sub
    return None


def hop_bodies(gm: fx.GraphModule, node: fx.Node) -> tuple[list[fx.GraphModule], list]:
    """(bodies, operands) of a higher-order op: its subgraph arguments, then the node arguments after them."""
    bodies, operands = [], []
    for arg in node.args:
        sub = _body(gm, arg)
        if sub is not None:
            bodies.append(sub)
        elif bodies and isinstance(arg, fx.Node):
            operands.append(arg)
    return bodies, operands


def higher_order_body(gm: fx.GraphModule, node: fx.Node):
    """(forward body, operand nodes) of a higher-order op, its placeholders matching the operands; else None."""
    if not _is_hop(node):
        return None
    bodies, operands = hop_bodies(gm, node)
    if not bodies:
        return None
    return bodies[0], operands


def inlined_body(gm: fx.GraphModule, node: fx.Node):
    """Like `higher_order_body`, for the ops whose body's gradient is autograd's (not a custom backward)."""
    if _is_hop(node) and _hop_name(node) in _INLINE:
        return higher_order_body(gm, node)
    return None


@rule("higher-order op (body analysed)", when=lambda node: _is_hop(node) and _hop_name(node) in _INLINE)
def inline_body(an, gm, node: fx.Node):
    sub, operands = higher_order_body(gm, node)
    return an.run_graph(sub, [an.of(a) for a in operands])


@rule("higher-order op: custom autograd.Function (token-local bodies)",
      when=lambda node: _is_hop(node) and _hop_name(node) == _FUNCTION)
def autograd_function(an, gm, node: fx.Node):
    bodies, operands = hop_bodies(gm, node)
    places = [an.of(a) for a in operands]
    if not any(isinstance(p, (Shard, Partial)) for p in places):
        return multi(node, REPLICATE)
    if len(bodies) != 2:
        raise an.refuse(node, "is a custom autograd.Function AutoSP cannot read (expected a forward and a backward "
                        "body)", _FUNCTION_FIX)
    forward, backward = bodies
    outputs, saved = _token_local(an, node, forward, places, "forward")
    grads = _token_local(an, node, backward, [*outputs, *saved], "backward")
    grads = grads if isinstance(grads, tuple) else (grads,)
    returned = _returned(backward)
    for i, (operand, p) in enumerate(zip(operands, places, strict=True)):
        if i >= len(returned) or returned[i] is None:
            continue
        g = grads[i]
        if (isinstance(p, Shard) != isinstance(g, Shard)) or (
                isinstance(p, Shard) and (p.dim, p.inner) != (g.dim, g.inner)):
            raise an.refuse(node, f"is a custom autograd.Function whose backward returns the gradient of "
                            f"{operand.name} ({p}) placed {g}", _FUNCTION_FIX)
    return outputs


def _returned(body: fx.GraphModule) -> tuple:
    output = next(n for n in body.graph.nodes if n.op == "output")
    return tuple(output.args[0]) if isinstance(output.args[0], (tuple, list)) else (output.args[0],)


_FUNCTION_FIX = ("AutoSP accepts a custom autograd.Function only when its forward and backward are token-local "
                 "(no reduction, scan, slice or attention over the sequence inside it, which AutoSP cannot rewrite "
                 "in a hand-written backward); move the sequence-mixing part out of the Function, or train without "
                 "sequence parallelism")


def _token_local(an, node: fx.Node, body: fx.GraphModule, places: list, which: str):
    """Analyse ``body`` with ``places`` for its placeholders, refusing any rewrite; returns its output placements."""
    before = (len(an.result.sequence_reductions), len(an.result.attention))
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(places):
        raise an.refuse(node, f"is a custom autograd.Function whose {which} body takes {len(placeholders)} inputs "
                        f"for {len(places)} values", _FUNCTION_FIX)
    try:
        out = an.run_graph(body, places)
    except AutoSPError as err:
        raise an.refuse(node, f"is a custom autograd.Function whose {which} is not token-local: {err}",
                        _FUNCTION_FIX) from None
    rewritten = (len(an.result.sequence_reductions), len(an.result.attention)) != before
    built_positions = any(n in an.result.positions for n in body.graph.nodes)
    if rewritten or built_positions or any(isinstance(p, Partial) for p in flatten(out)):
        raise an.refuse(node, f"is a custom autograd.Function whose {which} mixes tokens across the sequence "
                        "(a reduction, attention or positions over the token axis)", _FUNCTION_FIX)
    return out


@rule("higher-order op (refused on tokens)", when=_is_hop)
def other_higher_order(an, gm, node: fx.Node):
    sharded = sharded_inputs(an, node)
    if sharded:
        raise an.refuse(node, f"is the higher-order op {_hop_name(node)} with the token-sharded operand "
                        f"{sharded[0][0].name}; AutoSP has no rule for it",
                        "move it out of the compiled model, or train without sequence parallelism")
    return multi(node, REPLICATE)
