"""Make the causal-LM loss that of the full sequence.

Note [Exact loss across shard borders]
A causal LM trains token i to predict label i + 1, and models shift the labels
themselves: Hugging Face pads the labels with one ignored value and drops the
first (``pad(labels, (0, 1), value=-100)[..., 1:]``), classic code pairs
``logits[:, :-1]`` with ``labels[:, 1:]``.  Done on a shard, either loses the
target of the last token of every shard but the last.  The compiled model
therefore passes labels already shifted over the full sequence (see
`autosp.inputs.shard_batch`), and this pass removes the model's own shift so the
shifted labels line up with the local logits one to one.

The mean must be over the valid targets of the whole sequence, and ranks can
hold different numbers of ignored targets.  So ``cross_entropy(reduction="mean")``
becomes a local sum and a local count of valid targets, summed over the SP group
by one all-reduce; the loss is sum / count, identical on every rank.  The
all-reduce's gradient is the identity (see Note [Loss all-reduce gradient] in
autosp/ops.py).  ``reduction="sum"`` only needs the all-reduce.  A model whose
labels are not shifted by one of these patterns, or whose loss is not
``cross_entropy`` over the labels, is refused: a silently wrong loss is worse.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import fx

from autosp.context import TraceContext
from autosp.errors import AutoSPError
from autosp.passes.dynamo.higher_order import LOCAL_REDUCTION
from autosp.passes.dynamo.tag_inputs import placeholder_with_role
from autosp.passes.graph_utils import (
    bind,
    infer_fake_value,
    is_full_slice,
    is_getitem,
    module_name,
    normalized_index,
    shape_of,
)

log = logging.getLogger(__name__)

_TRANSPARENT_METHODS = {"contiguous", "view", "reshape", "to", "flatten", "long", "clone", "float", "double", "half", "bfloat16"}
_PAD_TARGETS = (F.pad, torch._C._nn.pad)


def _producer(node: fx.Node) -> fx.Node | None:
    """The tensor a layout-only op (view, contiguous, to...) was applied to, else None."""
    if node.op == "call_method" and node.target in _TRANSPARENT_METHODS:
        return node.args[0]
    if node.op == "call_function" and node.target in (torch.flatten, torch.reshape):
        return node.args[0]
    return None


def _seq_slice(node: fx.Node, seq_dim: int) -> slice | None:
    """The slice a getitem applies along ``seq_dim`` when every other dim is taken whole."""
    if not is_getitem(node):
        return None
    ndim = len(shape_of(node.args[0]))
    items = normalized_index(node.args[1], ndim)
    if len(items) != ndim or not isinstance(items[seq_dim], slice):
        return None
    if not all(is_full_slice(item) for d, item in enumerate(items) if d != seq_dim):
        return None
    return items[seq_dim]


def _find_label_shift(target: fx.Node, labels: fx.Node, ignore_index: int) -> tuple[fx.Node, str]:
    """Walk from the loss target back to the labels; return the shifting getitem and the pattern name."""
    node = target
    while node is not labels:
        sliced = _seq_slice(node, len(shape_of(node.args[0])) - 1) if is_getitem(node) else None
        if sliced is not None and sliced.start == 1 and sliced.stop is None and sliced.step in (None, 1):
            base = node.args[0]
            if base is labels:
                return node, "classic"
            if base.op == "call_function" and base.target in _PAD_TARGETS:
                pad = bind(F.pad, base).arguments
                if (
                    tuple(pad["pad"]) == (0, 1)
                    and pad["input"] is labels
                    and pad["value"] == ignore_index
                    and pad["mode"] == "constant"
                ):
                    return node, "padded"
        node = _producer(node)
        if node is None:
            break
    raise AutoSPError(
        "could not find where the model shifts its labels by one for next-token prediction (expected "
        "pad(labels, (0, 1), value=ignore_index)[..., 1:] or logits[:, :-1] with labels[:, 1:]); AutoSP "
        "needs a causal-LM loss computed inside the model from unshifted labels"
    )


def _drop_logits_shift(logits: fx.Node) -> list[fx.Node] | None:
    """Remove a ``logits[:, :-1]`` slice on the way to the loss; its former readers, or None if not found."""
    node = logits
    while node is not None:
        if is_getitem(node) and len(shape_of(node.args[0])) == 3:
            sliced = _seq_slice(node, 1)
            if sliced is not None and sliced.start in (None, 0) and sliced.stop == -1 and sliced.step in (None, 1):
                readers = list(node.users)
                node.replace_all_uses_with(node.args[0])
                return readers
        node = _producer(node)
    return None


def _refresh_downstream(starts: list[fx.Node]) -> None:
    """Shapes after a removed slice grow by the token it dropped: recompute the fake values downstream."""
    seen: set[fx.Node] = set()
    stack = list(starts)
    while stack:
        node = stack.pop()
        if node in seen or node.op == "output":
            continue
        seen.add(node)
        stack.extend(node.users)
    order = {n: i for i, n in enumerate(starts[0].graph.nodes)} if starts else {}
    for node in sorted(seen, key=order.__getitem__):
        infer_fake_value(node)


def exact_causal_lm_loss_pass(gm: fx.GraphModule, example_inputs, *, ctx: TraceContext) -> fx.GraphModule:
    if not ctx.labels_passed:
        return gm
    graph = gm.graph
    labels = placeholder_with_role(gm, "labels")
    if labels is None:
        raise AutoSPError("labels were passed but the model's graph never reads them; pass labels=None")
    losses = [
        n for n in graph.nodes
        if n.op == "call_function" and n.target is F.cross_entropy and labels in ancestors(n)
    ]
    if len(losses) != 1:
        raise AutoSPError(
            f"expected exactly one torch.nn.functional.cross_entropy over the labels, found {len(losses)}; "
            "AutoSP makes the loss exact only for a single causal-LM cross-entropy"
        )
    (loss,) = losses
    call = bind(F.cross_entropy, loss).arguments
    where = module_name(loss)
    if call["ignore_index"] != ctx.ignore_index:
        raise AutoSPError(
            f"the model's loss ignores label {call['ignore_index']} but AutoSP was compiled with "
            f"ignore_index={ctx.ignore_index}; pass ignore_index={call['ignore_index']} to autosp.compile"
        )
    if call["weight"] is not None or call["size_average"] is not None or call["reduce"] is not None:
        raise AutoSPError(f"{where}: cross_entropy with class weights or legacy size_average/reduce is not supported")
    if call["reduction"] not in ("mean", "sum"):
        raise AutoSPError(f"{where}: cross_entropy reduction={call['reduction']!r} is not supported; use mean or sum")

    shift, pattern = _find_label_shift(call["target"], labels, ctx.ignore_index)
    readers = list(shift.users)
    shift.replace_all_uses_with(labels if pattern == "classic" else shift.args[0].args[0])
    if pattern == "classic":
        dropped = _drop_logits_shift(call["input"])
        if dropped is None:
            raise AutoSPError(f"{where}: labels are sliced [:, 1:] but no matching logits[:, :-1] was found")
        readers += dropped
    _refresh_downstream(readers)
    log.info("loss in %s: removed the model's %s label shift; mean over the whole sequence", where, pattern)

    all_reduce = torch.ops.autosp_testbed.all_reduce_sum.default
    with graph.inserting_before(loss):
        local_sum = graph.call_function(F.cross_entropy, (call["input"], call["target"]), {
            "ignore_index": ctx.ignore_index, "reduction": "sum", "label_smoothing": call["label_smoothing"],
        })
        if call["reduction"] == "sum":
            result = graph.call_function(all_reduce, (local_sum, ctx.group_name))
        else:
            valid = graph.call_method("sum", (graph.call_function(torch.ne, (call["target"], ctx.ignore_index)),))
            valid.meta[LOCAL_REDUCTION] = True  # summed over the group by the all-reduce below
            pair = graph.call_function(
                torch.stack, ([graph.call_method("double", (local_sum,)), graph.call_method("double", (valid,))],)
            )
            total = graph.call_function(all_reduce, (pair, ctx.group_name))
            total_sum = graph.call_function(torch.select, (total, 0, 0))
            total_count = graph.call_function(torch.select, (total, 0, 1))
            mean = graph.call_function(torch.div, (total_sum, total_count))
            result = graph.call_method("type_as", (mean, local_sum))
    loss.replace_all_uses_with(result)
    graph.erase_node(loss)
    return gm


def ancestors(node: fx.Node) -> set[fx.Node]:
    """Every node ``node`` depends on (transitively)."""
    seen: set[fx.Node] = set()
    stack = list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen
