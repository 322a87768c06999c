"""Tiled logits and loss: the output projection and the causal-LM loss as one op over token chunks.

Note [Tiled loss pass]
The pass finds ``F.cross_entropy(chain(linear(hidden, weight, bias)), target)`` where
``chain`` only changes the layout or dtype of the logits (``.float()``, ``.view(-1, V)``,
``.contiguous()``, slices of the token dims), and replaces it by
``autosp_testbed::linear_cross_entropy`` (Note [Tiled logits and loss] in autosp/tiled_ops.py)
on the hidden states put through the same layout changes, reshaped to [tokens, H].  The
[tokens, vocab] logits then never exist, in forward or backward.  ``reduction="sum"`` becomes
the op's loss sum; ``reduction="mean"`` (only met without sequence parallelism: under SP the
loss pass, autosp/passes/dynamo/loss.py, has already made it a sum completed by an all-reduce)
becomes that sum over the count of valid targets.  The loss is computed in fp32 whatever the
dtype of the logits, and cast to the dtype the model's cross-entropy returned.

Where it runs: stage 1, after the loss pass (which removes the model's label shift and leaves
the sum over this rank's tokens) and before the sequence-sharding analysis, which classifies
the op like any other: `tiled_loss_placement` is its rule (token-sharded hidden states and
targets along the same rows, replicated weight and bias -> a partial-sum loss and token-sharded
log-sum-exps; anything else refused).  Without sequence parallelism (sp_size=1) it runs alone
(autosp.pipeline.passes_for).

When: ``tiled_loss="on"`` always (refused with an error if the loss is not of that form);
``"auto"`` when the rank's logits span more than one chunk, i.e. their fp32 copy would exceed
the chunk budget (`chunk_tokens`), silently keeping the plain loss otherwise.  Logits that
are also returned by the model (Hugging Face returns them beside the loss) cannot be avoided;
with ``return_logits=False`` the compiled model returns None in their place when labels are
passed (whenever the pass recognises the projection and loss, whether "auto" then tiles or
not), and the tiling applies; with ``return_logits=True`` "on" is refused and "auto" keeps the
plain loss.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx

from autosp import tiled_ops  # registers autosp_testbed::linear_cross_entropy
from autosp.context import TraceContext
from autosp.errors import AutoSPError
from autosp.passes.dynamo.loss import ancestors
from autosp.passes.dynamo.placements import PARTIAL, REPLICATE, Partial, Replicate, real_shard
from autosp.passes.dynamo.tag_inputs import placeholder_with_role
from autosp.passes.graph_utils import (
    bind,
    emit_call,
    fake_value,
    is_full_slice,
    is_getitem,
    is_linear,
    linear_args,
    module_name,
    shape_of,
)

log = logging.getLogger(__name__)

TILED_LOSS_MODES = ("off", "on", "auto")
LOSS_CHUNK_BYTES = 64 * 2**20
"""Default budget of one chunk's fp32 logits (64 MiB: 524 tokens of a 32,000 vocabulary, 130 of 128,256)."""

_DTYPE_METHODS = {"float", "double", "half", "bfloat16", "contiguous", "to"}
_RESHAPE_METHODS = {"view", "reshape", "flatten"}


def chunk_tokens(vocab: int, configured: int | None) -> int:
    """Tokens per chunk: the configured number, else as many as keep one chunk's fp32 logits within
    `LOSS_CHUNK_BYTES`."""
    return tiled_ops.tokens_per_chunk(4 * vocab, configured, LOSS_CHUNK_BYTES)


@dataclass(frozen=True)
class _Match:
    loss: fx.Node
    projection: fx.Node
    chain: tuple[fx.Node, ...]
    """Layout/dtype ops from the projection's output to the loss input, in order."""
    escaping: tuple[fx.Node, ...]
    """Nodes of [projection, *chain] the graph also returns."""


def refuse_or_skip(option: str, mode: str, why: str) -> None:
    """A tiling option's pattern is absent: an error under "on", a log line under "auto"."""
    if mode == "on":
        raise AutoSPError(f"{option}='on': {why}; compile with {option}='off' (or 'auto', which skips such "
                          "models)")
    log.info("%s not applied: %s", option, why)


def _refuse_or_skip(mode: str, why: str) -> None:
    refuse_or_skip("tiled_loss", mode, why)


def _layout_step(node: fx.Node, vocab: int) -> bool:
    """Whether ``node`` only changes the layout or dtype of logits, keeping the vocabulary as the last dim."""
    if len(node.all_input_nodes) != 1 or node.args[0] is not node.all_input_nodes[0]:
        return False
    shape = shape_of(node)
    if not shape or shape[-1] != vocab:
        return False
    if node.op == "call_method" and node.target in _DTYPE_METHODS | _RESHAPE_METHODS:
        return True
    if node.op == "call_function" and node.target in (torch.flatten, torch.reshape):
        return True
    if is_getitem(node):
        index = node.args[1]
        items = list(index) if isinstance(index, tuple) else [index]
        if any(i is None or i is Ellipsis or not isinstance(i, (slice, int)) for i in items):
            return False
        return len(items) < len(shape_of(node.args[0])) or is_full_slice(items[-1])
    return False


def _match(loss: fx.Node) -> _Match | str:
    """The projection and layout chain feeding ``loss``, or why there is none."""
    call = bind(F.cross_entropy, loss).arguments
    logits = call["input"]
    if len(shape_of(logits)) != 2:
        return "the cross-entropy input is not [tokens, vocab]"
    vocab = shape_of(logits)[-1]
    chain = []
    node = logits
    while not is_linear(node):
        if not isinstance(node, fx.Node) or node.op not in ("call_method", "call_function") or not _layout_step(
                node, vocab):
            return (f"the logits of the cross-entropy in {module_name(loss)} do not come from a linear output "
                    "projection through layout changes only (.float(), .view(-1, vocab), slices)")
        chain.append(node)
        node = node.args[0]
    projection = node
    chain.reverse()
    nodes = [projection, *chain]
    escaping = []
    for here, after in zip(nodes, [*chain, loss], strict=True):
        others = [u for u in here.users if u is not after]
        if any(u.op != "output" for u in others):
            return f"the logits in {module_name(loss)} are also read by {others[0].name}, not only by the loss"
        if others:
            escaping.append(here)
    return _Match(loss=loss, projection=projection, chain=tuple(chain), escaping=tuple(escaping))


def make_tiled_loss_pass(mode: str, loss_chunk_tokens: int | None, return_logits: bool):
    """The Dynamo-stage pass for these `AutoSPConfig` options (see Note [Tiled loss pass])."""

    def tiled_loss_pass(gm: fx.GraphModule, example_inputs, *, ctx: TraceContext) -> fx.GraphModule:
        if mode == "off" or not ctx.labels_passed:
            return gm
        gm.graph.eliminate_dead_code()  # what the loss pass left behind (the logits slice it bypassed)
        labels = placeholder_with_role(gm, "labels")
        losses = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is F.cross_entropy
                  and labels is not None and labels in ancestors(n)]
        if len(losses) != 1:
            _refuse_or_skip(mode, f"expected one cross_entropy over the labels, found {len(losses)}")
            return gm
        (loss,) = losses
        call = bind(F.cross_entropy, loss).arguments
        if call["weight"] is not None or call["label_smoothing"] or call["reduction"] not in ("sum", "mean") or (
                call["size_average"] is not None or call["reduce"] is not None):
            _refuse_or_skip(mode, "the cross-entropy has class weights, label smoothing or a reduction other than "
                            "sum or mean")
            return gm
        found = _match(loss)
        if isinstance(found, str):
            _refuse_or_skip(mode, found)
            return gm
        if found.escaping and return_logits:
            _refuse_or_skip(mode, f"the model returns its logits ({found.escaping[0].name}) beside the loss, so they "
                            "are materialised anyway; pass return_logits=False to return None in their place "
                            "when labels are given")
            return gm
        if found.escaping:  # return_logits=False: None in their place, whether "auto" tiles or not
            _drop_outputs(gm, found.escaping)
        rows, vocab = shape_of(call["input"])
        chunk = chunk_tokens(vocab, loss_chunk_tokens)
        if mode == "auto" and rows <= chunk:
            log.info("tiled loss not applied (auto): %d tokens x %d vocabulary fit one chunk of %d tokens",
                     rows, vocab, chunk)
            return gm
        _rewrite(gm, found, call, chunk, ctx)
        return gm

    return tiled_loss_pass


def _rewrite(gm: fx.GraphModule, found: _Match, call: dict, chunk: int, ctx: TraceContext) -> None:
    graph, loss, projection = gm.graph, found.loss, found.projection
    hidden, weight, bias = linear_args(projection)
    width = shape_of(hidden)[-1]
    meta = {k: v for k, v in loss.meta.items() if k in ("nn_module_stack", "stack_trace")}

    def emit(kind, target, *args):
        return emit_call(graph, kind, target, args, meta)

    with graph.inserting_before(loss):
        rows = hidden
        for step in found.chain:  # the same layout changes, applied to the hidden states
            if is_getitem(step):
                rows = emit("function", operator.getitem, rows, step.args[1])
            elif step.op == "call_function" or step.target in _RESHAPE_METHODS:
                rows = emit("method", "reshape", rows, (*shape_of(step)[:-1], width))
        rows = emit("method", "reshape", rows, (-1, width))
        target = call["target"]
        tiled = emit("function", torch.ops.autosp_testbed.linear_cross_entropy.default, rows, weight, bias, target,
                     call["ignore_index"], chunk)
        result = emit("function", operator.getitem, tiled, 0)
        if call["reduction"] == "mean":
            if ctx.sp_size > 1:
                raise AutoSPError("internal: a mean cross-entropy reached the tiled loss pass under sequence "
                                  "parallelism (the loss pass makes it a sum); please report it")
            valid = emit("method", "sum", emit("function", torch.ne, target, call["ignore_index"]))
            result = emit("function", torch.div, result, valid)
        dtype = fake_value(call["input"]).dtype
        if dtype != torch.float32:
            result = emit("method", "to", result, dtype)
    loss.replace_all_uses_with(result)
    graph.erase_node(loss)
    for node in reversed([projection, *found.chain]):
        if not node.users:
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
    log.info("tiled loss in %s: %d tokens x %d vocabulary in chunks of %d tokens", module_name(loss),
             shape_of(rows)[0], shape_of(weight)[0], chunk)


def _drop_outputs(gm: fx.GraphModule, nodes: tuple[fx.Node, ...]) -> None:
    """Return None where the graph returned ``nodes`` (the logits; Dynamo rebuilds the model's output from it)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    output.args = fx.node.map_arg(output.args, lambda n: None if n in nodes else n)
    log.info("the model's logits output (%s) is None: return_logits=False", ", ".join(n.name for n in nodes))


def tiled_loss_placement(an, node: fx.Node):
    """The sequence-sharding rule of ``autosp_testbed::linear_cross_entropy`` (see Note [Sequence-sharding
    analysis] in autosp/passes/dynamo/sharding.py).

    Token-sharded hidden states and targets along the same rows (dim 0) with a replicated weight and bias:
    each rank sums the loss of its own tokens, a partial sum (completed by the loss pass's all-reduce), and
    holds the log-sum-exps of its own rows.  All replicated: replicated.  Anything else is refused."""
    hidden, weight, bias, target = node.args[:4]
    for param in (weight, bias):
        if param is not None and not isinstance(an.of(param), Replicate):
            raise an.refuse(node, f"takes a {an.of(param)} output-projection weight or bias",
                            "this is a bug in AutoSP's tiled loss pass, please report it")
    ph, pt = an.of(hidden), an.of(target)
    if isinstance(ph, Replicate) and isinstance(pt, Replicate):
        return (REPLICATE, REPLICATE)
    if isinstance(ph, Partial) or isinstance(pt, Partial) or not (
            real_shard(ph) and real_shard(pt) and ph.dim == 0 and pt.dim == 0 and ph.inner == pt.inner):
        raise an.refuse(node, f"pairs hidden states placed {ph} with targets placed {pt}; the tiled loss needs "
                        "both token-sharded along the same rows", "compile with tiled_loss='off'")
    return (PARTIAL, ph)

