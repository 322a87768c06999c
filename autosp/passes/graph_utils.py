"""Small helpers shared by the passes: naming nodes' modules, binding call arguments, fake values, copying a
graph module."""

from __future__ import annotations

import copy
import inspect
import operator
import re
import warnings
from collections import Counter

import torch
from torch import fx

EXAMPLE_VALUE = "example_value"
"""Dynamo's node.meta key for a node's fake tensor."""


# Note [Graph modules generate their code when first called]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A torch.fx ``GraphModule`` generates and compiles the Python code of its graph when it is built and at every
# ``recompile()``; torch's lazy graph modules (``torch.fx._lazy_graph_module``, what Inductor compiles under) do it
# at the first call or the first read of ``.code`` instead.  Most graph modules AutoSP makes are never called: the
# checkpointing variants' partitions, the copies the planner partitions and rewrites, the recorded graphs the
# export reads, a partition rewritten by two passes (each ending in ``recompile()``) before it runs once.  Measured
# on a 2-core machine, generating that code was about a fifth of a memory-plan decision (Llama-3.1-8B, 8 ranks,
# 48 candidates).  So the backend compiles under lazy graph modules (`lazy_graph_modules`), and copies are made
# lazy (`graph_copy`); a module that is called generates its code then, once, so nothing that runs changes.


def lazy_graph_modules():
    """A context inside which the graph modules torch and AutoSP build (torch's ``_make_graph_module``: its
    partitioner's, `graph_copy`'s) generate their Python code when first called, not when built (Note [Graph
    modules generate their code when first called])."""
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    return _use_lazy_graph_module(True)


def graph_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A graph module over a deep copy of ``gm``'s graph (its submodules and attributes shared with ``gm``), whose
    Python code is generated when first called (Note [Graph modules generate their code when first called])."""
    from torch.fx._lazy_graph_module import _make_graph_module

    with warnings.catch_warnings(), lazy_graph_modules():
        # deep-copying the graph's pytree codegen warns about a deprecated spelling
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec")
        return _make_graph_module(gm, copy.deepcopy(gm.graph))


_IN_PLACE_OPERATORS = frozenset((operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                                  operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
                                  operator.ilshift, operator.irshift, operator.imatmul))


def writes_an_input(node: fx.Node) -> bool:
    """Whether ``node`` writes into a tensor it is given: an in-place Tensor method or function (``mask.scatter_(...)``,
    ``x.add_(1)``), an augmented assignment, ``out=`` or ``inplace=True``.  Dynamo records ``mask.scatter_(1, i, 1)``
    written as a statement as a node nobody uses (later reads use ``mask``'s own node), so such a node is live
    whatever uses its result (see `eliminate_dead_code`)."""
    if node.op not in ("call_function", "call_method"):
        return False
    if getattr(node.target, "__module__", None) in ("_operator", "operator"):  # and_, or_, not_: no writes
        return node.target in _IN_PLACE_OPERATORS
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if isinstance(name, str) and name.endswith("_") and not name.endswith("__"):
        return True
    return node.kwargs.get("out") is not None or node.kwargs.get("inplace") is True


def eliminate_dead_code(graph: fx.Graph) -> bool:
    """``graph.eliminate_dead_code()`` that keeps every node writing into an input (`writes_an_input`): FX's own
    test counts a ``call_method`` as pure, so it would drop ``mask.scatter_(1, index, 1)`` written as a statement
    and the program would read the unwritten ``mask``.  A random draw nobody reads goes, as FX's default does
    inside a compile."""
    return graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure(False) or writes_an_input(n))


def module_name(node: fx.Node) -> str:
    """The qualified name of the innermost module whose code produced ``node`` (best effort)."""
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        name = re.sub(r"^L\['[^']*'\](\[\d+\])?\.?", "", list(stack.values())[-1][0])
        return name or "<model>"
    return "<model>"


def layer_of(node: fx.Node) -> int | None:
    """The index of the decoder layer ``node`` runs in: the block of a module list (``model.layers.3``,
    ``transformer.h.3``) in its ``nn_module_stack``; None outside the layers or without a module stack."""
    for entry in (node.meta.get("nn_module_stack") or {}).values():
        last = str(entry[0]).rsplit(".", 1)[-1]
        if last.isdigit():
            return int(last)
    return None


def source_location(node: fx.Node) -> str:
    """' (file.py:123)' for the user code that produced ``node``, from Dynamo's recorded stack trace."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or "")
    if not frames:
        return ""
    path, line = frames[-1]
    return f" ({path.rsplit('/', 1)[-1]}:{line})"


def bind(fn, node: fx.Node) -> inspect.BoundArguments:
    """Bind a call_function node's args and kwargs to ``fn``'s Python signature, defaults applied."""
    bound = inspect.signature(fn).bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    return bound


def fake_value(node: fx.Node | object):
    """The fake tensor Dynamo recorded for ``node`` (or the constant itself)."""
    if isinstance(node, fx.Node):
        return node.meta.get(EXAMPLE_VALUE, node.meta.get("val"))
    return node


def shape_of(node: fx.Node) -> tuple[int, ...]:
    value = fake_value(node)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"graph node {node.name} has no tensor metadata")
    return tuple(value.shape)


LINEARS = (torch.nn.functional.linear, torch._C._nn.linear)


def is_linear(node: fx.Node) -> bool:
    """Whether ``node`` calls ``F.linear`` (what ``nn.Linear`` records)."""
    return node.op == "call_function" and node.target in LINEARS


def linear_args(node: fx.Node) -> tuple:
    """(input, weight, bias) of a linear call (torch._C._nn.linear has no Python signature to bind)."""
    names = ("input", "weight", "bias")
    values = dict(zip(names, node.args, strict=False))
    values.update(node.kwargs)
    return values["input"], values["weight"], values.get("bias")


def op_counts(gm: fx.GraphModule) -> Counter:
    """How many nodes call each target (for per-pass diffs in the logs)."""
    counts: Counter = Counter()
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            target = node.target
            counts[target if isinstance(target, str) else getattr(target, "__name__", str(target))] += 1
    return counts


def is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def normalized_index(index, ndim: int) -> list[slice | object]:
    """A tensor index as one entry per dimension (Ellipsis expanded; only slices/None-free indices)."""
    items = list(index) if isinstance(index, tuple) else [index]
    if any(item is None for item in items):
        return []
    if Ellipsis in items:
        at = items.index(Ellipsis)
        fill = [slice(None)] * (ndim - (len(items) - 1))
        items = items[:at] + fill + items[at + 1 :]
    return items + [slice(None)] * (ndim - len(items))


def is_full_slice(item) -> bool:
    return isinstance(item, slice) and item.start in (None, 0) and item.stop is None and item.step in (None, 1)


def infer_fake_value(node: fx.Node) -> None:
    """Fill ``node.meta["example_value"]`` of a node a rewrite inserted, by running it on its inputs' fake values."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), fake_value)
    fake_mode = next((t.fake_mode for t in _tensors((args, kwargs)) if hasattr(t, "fake_mode")), None)
    if fake_mode is None:
        return
    with fake_mode:
        if node.op == "call_method":
            value = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            value = node.target(*args, **kwargs)
    node.meta[EXAMPLE_VALUE] = value


def emit_call(graph: fx.Graph, kind: str, target, args: tuple, meta: dict) -> fx.Node:
    """Insert a call (``kind`` "method" or "function") at the graph's insertion point, with ``meta`` (module
    stack, source line) and its fake value."""
    node = graph.call_method(target, args) if kind == "method" else graph.call_function(target, args)
    node.meta.update(meta)
    infer_fake_value(node)
    return node


def flatten(value):
    """The leaves of nested tuples and lists, in order (anything else is one leaf)."""
    if isinstance(value, (tuple, list)):
        for v in value:
            yield from flatten(v)
    else:
        yield value


def _tensors(tree) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    fx.node.map_aggregate(tree, lambda x: found.append(x) if isinstance(x, torch.Tensor) else None)
    return found
