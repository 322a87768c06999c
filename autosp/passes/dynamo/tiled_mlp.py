"""Tiled token-local blocks: the MLP over token chunks, recomputed chunk by chunk in backward.

Note [Tiled MLP pass]
The pass finds, from the graph alone (no module names), every chain

    down(f(in0(x)[, in1(x)]))

where ``in0``, ``in1`` and ``down`` are linear projections (``F.linear``, what ``nn.Linear``
records, or ``torch.addmm(b, x2d, W)``, GPT-2's ``Conv1D``), both input projections read the same
tensor ``x`` (through reshapes that keep its rows), and ``f`` is a chain of out-of-place
elementwise ops (`autosp.tiled_ops.expression_step`: arithmetic, silu, gelu, tanh, pow ...) and
row-keeping reshapes, with Python literals as its only other arguments, every value the same
[rows, intermediate] shape and dtype (no broadcasting), and no value of the chain read outside it.
That is Llama's and Qwen2's ``down(act(gate(x)) * up(x))`` and GPT-2's ``c_proj(act(c_fc(x)))``.
Each match is replaced by ``autosp_testbed::tiled_mlp`` (Note [Tiled MLP] in autosp/tiled_ops.py)
on ``x`` reshaped to [rows, H], with ``f`` written as its expression, and the result reshaped to
what ``down`` returned.  Then no [rows, intermediate] value exists in the forward or backward
graphs: the op computes and recomputes them one chunk of ``mlp_chunk_tokens`` rows at a time.

Where it runs: stage 1, after the loss rule and the tiled loss and before the sequence-sharding
analysis, which classifies the op like any other: `tiled_mlp_placement` is its rule (rows
token-sharded along dim 0, or replicated, with replicated parameters -> the output placed like the
rows; anything else refused).  Without sequence parallelism (sp_size=1) the tiling passes run without
the others (autosp.pipeline.passes_for).

When: ``tiled_mlp="on"`` tiles every match and is refused with an error when the graph has none;
``"auto"`` tiles a match when its rows span more than one chunk, i.e. one chunk's input-projection
outputs would exceed `MLP_CHUNK_BYTES` (or ``mlp_chunk_tokens`` rows are fewer than the rows).
SAC never recomputes the op (no ``autosp_testbed`` op is recomputed); the op keeps only its input rows
(and the parameters) for backward.
Not found: chains inside a higher-order op's body (a user's activation-checkpointed block) and chains
with more than two input projections.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import fx

from autosp import tiled_ops
from autosp.context import TraceContext
from autosp.passes.dynamo.placements import REPLICATE, Replicate, Shard
from autosp.passes.dynamo.tiled_loss import refuse_or_skip
from autosp.passes.graph_utils import (
    eliminate_dead_code,
    emit_call,
    fake_value,
    is_linear,
    linear_args,
    module_name,
    shape_of,
)

log = logging.getLogger(__name__)

TILED_MLP_MODES = ("off", "on", "auto")
MLP_CHUNK_BYTES = 64 * 2**20
"""Default budget of one chunk's input-projection outputs (64 MiB: 1,170 tokens of Llama-3.1-8B's two bf16
[tokens, 14,336] projections)."""
EXPECTED = ("MLP-shaped chain (linear -> elementwise ops [x a second linear of the same input] -> linear, whose "
            "intermediate values nothing else reads)")

_RESHAPES = {"view", "reshape", "flatten"}


@dataclass(frozen=True)
class _Projection:
    node: fx.Node
    input: fx.Node
    weight: fx.Node
    bias: fx.Node | None
    transposed: bool
    """The weight is [in, out] (``addmm``), not F.linear's [out, in]."""


@dataclass(frozen=True)
class _Match:
    down: _Projection
    inputs: tuple[_Projection, ...]
    rows: fx.Node
    """The tensor both input projections read (before reshapes that keep its rows)."""
    chain: tuple[fx.Node, ...]
    """The elementwise ops and reshapes between the input projections and ``down``, in graph order."""
    head: fx.Node
    """The chain's value ``down`` reads."""
    intermediate: int


def _tensor(node) -> torch.Tensor | None:
    value = fake_value(node) if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _row_reshape(node: fx.Node) -> bool:
    """A reshape that keeps the last dim, so the same rows in the same (row-major) order."""
    if not ((node.op == "call_method" and node.target in _RESHAPES)
            or (node.op == "call_function" and node.target in (torch.reshape, torch.flatten))):
        return False
    src, out = _tensor(node.args[0]), _tensor(node)
    return (src is not None and out is not None and src.dim() >= 1 and out.dim() >= 1 and src.dtype == out.dtype
            and src.shape[-1] == out.shape[-1] and src.numel() == out.numel())


def _through_reshapes(node: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """The tensor below row-keeping reshapes of ``node``, and those reshapes (outermost first)."""
    reshapes = []
    while isinstance(node, fx.Node) and _row_reshape(node):
        reshapes.append(node)
        node = node.args[0]
    return node, reshapes


def _projection(node: fx.Node) -> _Projection | None:
    if not isinstance(node, fx.Node):
        return None
    if is_linear(node):
        x, w, b = linear_args(node)
        transposed = False
    elif node.op == "call_function" and node.target is torch.addmm and len(node.args) == 3 and not node.kwargs:
        b, x, w = node.args
        transposed = True
    else:
        return None
    tx, tw, tb = _tensor(x), _tensor(w), _tensor(b)
    if tx is None or tw is None or tw.dim() != 2 or (b is not None and tb is None):
        return None
    out_features = tw.shape[1] if transposed else tw.shape[0]
    if (transposed and tx.dim() != 2) or (tb is not None and tuple(tb.shape) != (out_features,)):
        return None
    return _Projection(node, x, w, b, transposed)


def _match(down_node: fx.Node) -> _Match | None:
    """The MLP-shaped chain ending in the projection ``down_node``, if there is one."""
    down = _projection(down_node)
    if down is None:
        return None
    head, tail = _through_reshapes(down.input)
    chain, leaves, seen, stack = list(tail), {}, set(), [head]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        projection = _projection(node)
        if projection is not None:
            leaves[node] = projection
        elif _row_reshape(node):
            chain.append(node)
            stack.append(node.args[0])
        elif node.op in ("call_function", "call_method") and tiled_ops.expression_step(
                node.op, node.target, node.args, node.kwargs) is not None:
            if not all(isinstance(v, fx.Node) or tiled_ops.is_literal(v) for v in (*node.args, *node.kwargs.values())):
                return None
            if any(_tensor(a) is None for a in node.all_input_nodes):
                return None  # a symbolic size or another non-tensor value
            chain.append(node)
            stack.extend(node.all_input_nodes)
        else:
            return None
    if not 1 <= len(leaves) <= 2 or not any(not _row_reshape(n) for n in chain):
        return None
    sources = {_through_reshapes(p.input)[0] for p in leaves.values()}
    if len(sources) != 1:
        return None
    (rows,) = sources
    x, example = _tensor(rows), _tensor(head)
    if x is None or example is None or x.dim() < 1:
        return None
    width, intermediate = x.shape[-1], example.shape[-1]
    count = x.numel() // max(1, width)
    members = set(chain) | set(leaves)
    for node in members:
        value = _tensor(node)
        if value is None or value.dtype != x.dtype or value.shape[-1] != intermediate or (
                value.numel() != count * intermediate):
            return None
        if node not in leaves and not _row_reshape(node) and any(
                tuple(_tensor(a).shape) != tuple(value.shape) for a in node.all_input_nodes):
            return None  # broadcasting
        if any(user not in members and user is not down_node for user in node.users):
            return None  # an intermediate read outside the chain
    for p in leaves.values():
        if _tensor(p.input).shape[-1] != width:
            return None
    order = {n: i for i, n in enumerate(down_node.graph.nodes)}
    return _Match(down=down, inputs=tuple(sorted(leaves.values(), key=lambda p: order[p.node])), rows=rows,
                  chain=tuple(sorted(chain, key=order.__getitem__)), head=head, intermediate=int(intermediate))


def _expression(found: _Match) -> str:
    """``f`` as an expression string (`autosp.tiled_ops.encode_expression`)."""
    value = {p.node: tiled_ops.Ref(i) for i, p in enumerate(found.inputs)}
    steps = []
    for node in found.chain:
        if _row_reshape(node):
            value[node] = value[node.args[0]]
            continue
        name, operands, params = tiled_ops.expression_step(node.op, node.target, node.args, node.kwargs)
        steps.append((name, [value[a] if isinstance(a, fx.Node) else a for a in operands], params))
        value[node] = tiled_ops.Ref(len(found.inputs) + len(steps) - 1)
    return tiled_ops.encode_expression(len(found.inputs), steps, value[found.head].index)


def make_tiled_mlp_pass(mode: str, mlp_chunk_tokens: int | None):
    """The Dynamo-stage pass for these `AutoSPConfig` options (see Note [Tiled MLP pass])."""

    def tiled_mlp_pass(gm: fx.GraphModule, example_inputs, *, ctx: TraceContext) -> fx.GraphModule:
        if mode == "off":
            return gm
        eliminate_dead_code(gm.graph)
        found = 0
        for node in list(gm.graph.nodes):  # a rewrite erases and inserts only nodes before the one matched
            match = _match(node)
            if match is None:
                continue
            found += 1
            x = _tensor(match.rows)
            rows = x.numel() // x.shape[-1]
            chunk = tiled_ops.tokens_per_chunk(len(match.inputs) * match.intermediate * x.element_size(),
                                               mlp_chunk_tokens, MLP_CHUNK_BYTES)
            if mode == "auto" and rows <= chunk:
                log.info("tiled MLP not applied (auto) in %s: %d rows x %d intermediate fit one chunk of %d rows",
                         module_name(node), rows, match.intermediate, chunk)
                continue
            _rewrite(gm, match, chunk)
        if not found:
            refuse_or_skip("tiled_mlp", mode, f"the graph has no {EXPECTED}")
            return gm
        gm.graph.lint()
        gm.recompile()
        return gm

    return tiled_mlp_pass


def _rewrite(gm: fx.GraphModule, found: _Match, chunk: int) -> None:
    graph, down = gm.graph, found.down.node
    order = {n: i for i, n in enumerate(graph.nodes)}
    meta = {k: v for k, v in down.meta.items() if k in ("nn_module_stack", "stack_trace")}
    expression = _expression(found)
    x = _tensor(found.rows)

    def emit(kind, target, *args):
        return emit_call(graph, kind, target, args, meta)

    def weight(p: _Projection) -> fx.Node:
        return emit("method", "t", p.weight) if p.transposed else p.weight

    with graph.inserting_before(down):
        rows = found.rows if x.dim() == 2 else emit("method", "reshape", found.rows, (-1, x.shape[-1]))
        params = [(weight(p), p.bias) for p in found.inputs] + [(None, None)] * (2 - len(found.inputs))
        tiled = emit("function", torch.ops.autosp_testbed.tiled_mlp.default, rows, *params[0], *params[1],
                     weight(found.down), found.down.bias, expression, chunk)
        shape = shape_of(down)
        result = tiled if shape == shape_of(tiled) else emit("method", "reshape", tiled, shape)
    down.replace_all_uses_with(result)
    graph.erase_node(down)
    for node in sorted([*(p.node for p in found.inputs), *found.chain], key=order.__getitem__, reverse=True):
        if not node.users:
            graph.erase_node(node)
    log.info("tiled MLP in %s: %d rows x %d intermediate in chunks of %d rows", module_name(down),
             math.prod(shape_of(rows)[:-1]), found.intermediate, chunk)


def tiled_mlp_placement(an, node: fx.Node):
    """The sequence-sharding rule of ``autosp_testbed::tiled_mlp`` (see Note [Sequence-sharding analysis] in
    autosp/passes/dynamo/sharding.py).

    Rows token-sharded along dim 0 (any stride; positions stay positions, as through a linear) with replicated
    parameters: every row is computed on its own, so the output is placed like the rows.  All replicated:
    replicated.  Anything else (a partial sum, tokens along the features) is refused."""
    x, *params = node.args[:7]
    for param in params:
        if param is not None and not isinstance(an.of(param), Replicate):
            raise an.refuse(node, f"takes a {an.of(param)} MLP weight or bias",
                            "this is a bug in AutoSP's tiled MLP pass, please report it")
    placed = an.of(x)
    if isinstance(placed, Replicate):
        return REPLICATE
    if not (isinstance(placed, Shard) and placed.dim == 0):
        raise an.refuse(node, f"takes MLP input rows placed {placed}; the tiled MLP needs them token-sharded "
                        "along its rows", "compile with tiled_mlp='off'")
    return placed
