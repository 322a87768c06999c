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
with ``return_logits=False`` the graph returns None in their place when labels are passed
(whenever the pass recognises the projection and loss, whether "auto" then tiles or not), the
tiling applies, and the compiled model's output holds a `DroppedLogits` there, which raises on
any use (Note [Dropped logits]); with ``return_logits=True`` "on" is refused and "auto" keeps
the plain loss.
"""

from __future__ import annotations

import copy
import logging
import operator
from dataclasses import dataclass, fields, is_dataclass, replace

import torch
import torch.nn.functional as F
from torch import fx
from torch.utils._pytree import tree_leaves

from autosp import tiled_ops  # registers autosp_testbed::linear_cross_entropy
from autosp.context import TraceContext
from autosp.errors import AutoSPError
from autosp.passes.dynamo.loss import ancestors
from autosp.passes.dynamo.placements import PARTIAL, REPLICATE, Partial, Replicate, real_shard
from autosp.passes.dynamo.tag_inputs import placeholder_with_role
from autosp.passes.graph_utils import (
    bind,
    eliminate_dead_code,
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
        eliminate_dead_code(gm.graph)  # what the loss pass left behind (the logits slice it bypassed)
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
                            "are materialised anyway; pass return_logits=False to leave them uncomputed "
                            "when labels are given (reading them then raises)")
            return gm
        if found.escaping:  # return_logits=False: not computed, whether "auto" tiles or not (Note [Dropped logits])
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
    log.info("the model's logits output (%s) is not computed: return_logits=False", ", ".join(n.name for n in nodes))


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


# Note [Dropped logits]
# ~~~~~~~~~~~~~~~~~~~~~
# Where the tiled loss leaves a returned [tokens, vocab] logits output uncomputed (``return_logits=False``, passed
# by the user or chosen by the memory plan, and labels given), the compiled model's output holds a `DroppedLogits`
# in its place, not None: a planned default must never change what the model returns silently, and ``None`` reads
# as "this model has no logits" (HF code tests ``outputs.logits is not None``, metrics read ``None`` as nothing to
# compute).  Every use of the placeholder -- an attribute (``.shape``, ``.argmax``), a torch function or tensor
# operator (through ``__torch_function__``), ``bool()``, indexing, iteration, arithmetic, comparison, numpy --
# raises `AutoSPError` saying who dropped them and how to get them; only ``repr`` answers (a debugger or a printed
# output should not fail), ``is None`` is False, and ``hasattr`` answers False (the error of an attribute read is
# also an AttributeError, `DroppedLogitsAttributeError`: generic code walking the outputs probes them so).
# Computing them on demand was rejected: it would need the final hidden states, the head's weight and the chain of
# layout ops to escape the graph, put back the sharded rows of every SP rank, and then form the very [tokens,
# vocab] tensor the plan chose not to hold, at a time the memory plan never priced; a caller who needs them asks
# for them (return_logits=True, tiled_loss="off").
#
# Dynamo rebuilds the model's output object from the graph's outputs, so the placeholder cannot come out of the
# graph (it returns None there, `_drop_outputs`); `mark_dropped_logits` puts it in after the compiled call, in the
# compiled model's forward (autosp.model.SequenceParallelModel.forward).  It replaces a ``logits`` of None in a
# Hugging Face ``ModelOutput`` (rebuilt with the field set, so ``to_tuple()`` and ``outputs[1]`` keep the positions
# the untiled model gives), another dataclass or a dict; a tuple output (``return_dict=False``) has no names and
# keeps its None.  It reads no record of the pass: where the option is in force and labels were passed, the pass
# drops every returned logits output it recognises (in every program of the model, the document program too), and
# a model that returns a ``logits`` field of None beside its loss by itself, which would be marked too, is not
# known to exist.

_PLACEHOLDER_OPERATORS = (
    "__bool__", "__len__", "__iter__", "__reversed__", "__contains__", "__getitem__", "__setitem__", "__delitem__",
    "__call__", "__int__", "__float__", "__complex__", "__index__", "__round__", "__trunc__", "__floor__", "__ceil__",
    "__neg__", "__pos__", "__abs__", "__invert__", "__array__", "__dlpack__", "__lt__", "__le__", "__eq__", "__ne__",
    "__gt__", "__ge__",
    *(f"__{p}{op}__" for op in ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "divmod", "pow",
                                "lshift", "rshift", "and", "xor", "or") for p in ("", "r", "i")),
)


class DroppedLogitsAttributeError(AutoSPError, AttributeError):
    """Reading an attribute of `DroppedLogits`: an `AutoSPError` that is also an AttributeError, so that a probe
    such as ``hasattr(x, "dtype")`` (accelerate's ``convert_outputs_to_fp32`` under the Trainer's mixed precision
    walks the outputs so) answers False instead of failing; a read says why."""


class DroppedLogits:
    """The logits a compiled model did not compute (Note [Dropped logits]): any use raises `AutoSPError`."""

    __slots__ = ("_why",)

    def __init__(self, why: str):
        self._why = why

    def _refuse(self, use: str, error: type[AutoSPError] = AutoSPError):
        raise error(f"{use} the model's logits: {object.__getattribute__(self, '_why')}")

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):  # protocol probes (copy, pickle, numpy) see a plain object
            raise AttributeError(name)
        self._refuse(f"reading .{name} of", DroppedLogitsAttributeError)

    def __setattr__(self, name: str, value):
        if name != "_why":  # (copy and pickle restore it)
            self._refuse(f"setting .{name} of")
        object.__setattr__(self, name, value)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        found = [a for a in tree_leaves((args, kwargs)) if isinstance(a, DroppedLogits)]
        use = f"calling {getattr(func, '__name__', func)} on"
        if not found:  # inside a container that pytree does not flatten
            raise AutoSPError(f"{use} the model's logits: they were not computed; {_RETURN_LOGITS_HINT}")
        found[0]._refuse(use)

    def __repr__(self) -> str:
        return f"<logits not computed: {object.__getattribute__(self, '_why')}>"

    __hash__ = object.__hash__


def _operator(name: str):
    def refuse(self, *args, **kwargs):
        self._refuse(f"applying {name} to")
    refuse.__name__ = name
    return refuse


for _name in _PLACEHOLDER_OPERATORS:
    setattr(DroppedLogits, _name, _operator(_name))
del _name

_RETURN_LOGITS_HINT = "compile with return_logits=True, tiled_loss='off' to get them"


def dropped_logits_reason(config, memory_plan: dict | None) -> str:
    """Why the logits were not computed, and how to get them (the placeholder's message)."""
    planned = memory_plan is not None and "return_logits" not in memory_plan.get("explicit", {})
    who = ("the memory plan (memory_plan='auto', the default where a plan can be made) chose "
           f"tiled_loss={config.tiled_loss!r} with return_logits=False" if planned
           else f"return_logits=False with tiled_loss={config.tiled_loss!r}")
    return (f"{who}, so the compiled model does not return its [tokens, vocab] logits (the tiled loss avoids forming "
            f"them); {_RETURN_LOGITS_HINT}")


def mark_dropped_logits(output, config, ctx: TraceContext):
    """``output`` of the compiled model's call with a `DroppedLogits` where the tiled loss pass left the model's
    logits uncomputed (Note [Dropped logits]); ``output`` itself otherwise.  ``config``: the `AutoSPConfig` the
    model compiled with (after its memory plan), ``ctx``: its trace context, after the call."""
    if config.return_logits or config.tiled_loss == "off" or not ctx.labels_passed:
        return output
    if isinstance(output, dict) and not is_dataclass(output):
        if "logits" not in output or output["logits"] is not None:
            return output
        output = copy.copy(output)
        output["logits"] = DroppedLogits(dropped_logits_reason(config, ctx.memory_plan))
        return output
    if not is_dataclass(output) or isinstance(output, type) or "logits" not in {f.name for f in fields(output)}:
        return output
    if output.logits is not None:
        return output
    return replace(output, logits=DroppedLogits(dropped_logits_reason(config, ctx.memory_plan)))
