"""Tag the graph's placeholders with the role of the sharded input they receive.

The compiled model knows which tensors it passed as input_ids, labels and
position_ids; Dynamo hands the backend the same tensor objects as example inputs,
in placeholder order.  Roles are stored as ``node.meta["autosp_role"]`` so later
passes find the labels without guessing from names.
"""

from __future__ import annotations

from torch import fx

from autosp.context import TraceContext

ROLE = "autosp_role"


def tag_sequence_inputs_pass(gm: fx.GraphModule, example_inputs, *, ctx: TraceContext) -> fx.GraphModule:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, example in zip(placeholders, example_inputs, strict=False):
        role = ctx.input_roles.get(id(example))
        if role is None:
            # Dynamo names an input `l_kwargs_<name>_` or `l_<name>_`; use it when identity is lost.
            for candidate in ("input_ids", "labels", "position_ids", "attention_mask"):
                if node.name.lower() in (f"l_kwargs_{candidate}_", f"l_{candidate}_"):
                    role = candidate
        if role is not None:
            node.meta[ROLE] = role
    return gm


def placeholder_with_role(gm: fx.GraphModule, role: str) -> fx.Node | None:
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.meta.get(ROLE) == role:
            return node
    return None
