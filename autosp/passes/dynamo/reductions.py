"""Reductions over the sequence: a local reduction, then an all-reduce whose backward fits its readers.

Note [Gradient placements]
A sum over the token axis is computed exactly as a local sum plus an
all-reduce over the SP group (a mean divides each local sum by the global
count first).  Its backward depends on who reads the result.  Every rank holds
the same result (replicated) and runs the same code on it, but the gradient
that reaches it in backward is either

- replicated: its readers are computations every rank repeats (the loss, an
  auxiliary loss); each rank then holds the whole gradient and hands it to its
  own partial sum unchanged (the identity backward of
  ``autosp_testbed::all_reduce_sum``, Note [Loss all-reduce gradient]), or
- partial: its readers combine it with token-sharded values (``x - x.mean(1)``);
  each rank then holds only its tokens' share and the backward must sum it
  over the group (``autosp_testbed::all_reduce_sum_sum_grad``).

`gradient_kinds` finds which by a reverse walk over the placements; a result
read both ways is refused (its backward would need to tell the two parts
apart).  The same walk refuses a parameter whose gradient would be replicated:
`sync_gradients` sums parameter gradients over the SP group, so it would be
counted once per rank.
"""

from __future__ import annotations

import logging

import torch
from torch import fx

from autosp import tiled_ops  # noqa: F401 - registers autosp_testbed::linear_cross_entropy
from autosp.errors import AutoSPError
from autosp.passes.dynamo.higher_order import LOCAL_REDUCTION, inlined_body
from autosp.passes.dynamo.placements import (
    PARTIAL,
    REPLICATE,
    Partial,
    Replicate,
    Shard,
    describe,
    normalize_dims,
)
from autosp.passes.dynamo.pointwise import elementwise, refuse_replicated_per_token
from autosp.passes.dynamo.positions import running_count
from autosp.passes.dynamo.registry import (
    FIX_GENERIC,
    arguments,
    multi,
    ndim,
    op_name,
    rule,
    shape,
    sharded_inputs,
)
from autosp.passes.graph_utils import fake_value, infer_fake_value, module_name

log = logging.getLogger(__name__)

REPLICATED, PARTIAL_GRAD = "replicated", "partial"


def complete_sequence_reduction(an, gm: fx.GraphModule, node: fx.Node):
    """Rewrite ``sum``/``mean`` over the token axis into local reduction -> all-reduce; returns the placement."""
    ctx = an.ctx
    _refuse_padding(an, node)
    graph = gm.graph
    an.set(node, PARTIAL)
    local = node
    with graph.inserting_after(node):
        if op_name(node) == "mean":
            local = graph.call_function(torch.div, (node, ctx.sp_size))
            infer_fake_value(local)
            an.set(local, PARTIAL)
    with graph.inserting_after(local):
        reduced = graph.call_function(torch.ops.autosp_testbed.all_reduce_sum.default, (local, ctx.group_name))
    infer_fake_value(reduced)
    reduced.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")})
    for user in list(node.users):
        if user is not local and user is not reduced:
            user.replace_input_with(node, reduced)
    if local is not node:
        for user in list(local.users):
            if user is not reduced:
                user.replace_input_with(local, reduced)
    an.set(reduced, REPLICATE)
    an.sequence_reduced.add(reduced)
    an.result.sequence_reductions.append(reduced)
    log.info("%s in %s reduces over the sequence: local %s + all-reduce", describe(node), module_name(node),
             op_name(node))
    return PARTIAL


class _Emitter:
    """Inserts placed nodes, with fake values, before ``anchor`` (the reduction being rewritten)."""

    def __init__(self, an, gm: fx.GraphModule, anchor: fx.Node):
        self.an, self.graph, self.anchor = an, gm.graph, anchor
        self.meta = {k: v for k, v in anchor.meta.items() if k in ("nn_module_stack", "stack_trace")}

    def __call__(self, placement, target, *args, **kwargs) -> fx.Node:
        with self.graph.inserting_before(self.anchor):
            if isinstance(target, str):
                node = self.graph.call_method(target, args, kwargs)
            else:
                node = self.graph.call_function(target, args, kwargs)
        node.meta.update(self.meta)
        infer_fake_value(node)
        self.an.set(node, placement)
        return node

    def summed(self, partial: fx.Node) -> fx.Node:
        """The all-reduce completing a partial sum (its backward is chosen later, Note [Gradient placements])."""
        ctx = self.an.ctx
        reduced = self(REPLICATE, torch.ops.autosp_testbed.all_reduce_sum.default, partial, ctx.group_name)
        self.an.sequence_reduced.add(reduced)
        self.an.result.sequence_reductions.append(reduced)
        return reduced


def _dims_keepdim(node: fx.Node, rank: int) -> tuple[tuple[int, ...], bool, int]:
    """(reduced dims, keepdim, correction) of a logsumexp/var/std call in any of its spellings (by schema)."""
    bound = arguments(node)
    correction = bound.get("correction")
    if correction is None:
        correction = 0 if bound.get("unbiased") is False else 1
    return normalize_dims(bound.get("dim"), rank), bool(bound.get("keepdim", False)), correction


def rewrite_sequence_statistic(an, gm: fx.GraphModule, node: fx.Node):
    """``logsumexp``, ``var`` and ``std`` over the token axis as compositions of all-reduced sums (exact):

    - logsumexp: m = max over the group of the local amax (no gradient: the result does not depend
      on it); lse = log(sum over the group of sum(exp(x - m))) + m;
    - var: mu = (sum over the group of sum(x)) / n; var = (sum over the group of sum((x - mu)^2)) / (n - correction),
      n the global count; std = sqrt(var).
    """
    _refuse_padding(an, node)
    x = arguments(node)["input"]
    value = fake_value(x)
    dims, keepdim, correction = _dims_keepdim(node, value.dim())
    emit = _Emitter(an, gm, node)
    name = op_name(node)
    shard = an.of(x)
    if name == "logsumexp":
        local_max = emit(REPLICATE, torch.amax, x, dims, keepdim=True)
        shift = emit(REPLICATE, "detach", emit(REPLICATE, torch.ops.autosp_testbed.all_reduce_max.default,
                                                   local_max, an.ctx.group_name))
        shifted = emit(shard, torch.exp, emit(shard, torch.sub, x, shift))
        total = emit.summed(emit(PARTIAL, torch.sum, shifted, dims, keepdim=True))
        out = emit(REPLICATE, torch.add, emit(REPLICATE, torch.log, total), shift)
    else:
        count = an.ctx.sp_size
        for d in dims:
            count *= int(value.shape[d])
        mean = emit(REPLICATE, torch.div, emit.summed(emit(PARTIAL, torch.sum, x, dims, keepdim=True)), count)
        centred = emit(shard, torch.pow, emit(shard, torch.sub, x, mean), 2)
        squares = emit.summed(emit(PARTIAL, torch.sum, centred, dims, keepdim=True))
        out = emit(REPLICATE, torch.div, squares, max(count - correction, 0))
        if name == "std":
            out = emit(REPLICATE, torch.sqrt, out)
    if not keepdim:
        for d in sorted(dims, reverse=True):
            out = emit(REPLICATE, torch.squeeze, out, d)
    node.replace_all_uses_with(out)
    gm.graph.erase_node(node)
    log.info("%s in %s over the sequence: composed from all-reduced sums", describe(node), module_name(node))
    return REPLICATE


def _refuse_padding(an, node: fx.Node) -> None:
    # Checked again on every call of the program: autosp.context.TraceContext.require_unpadded.
    an.ctx.require_unpadded(f"{describe(node)} in module {module_name(node)} reduces over the sequence")


# ---------------------------------------------------------------------------------------------
# Rules: reductions, ops along a dim, losses
# ---------------------------------------------------------------------------------------------
_EXACT_SEQUENCE_REDUCTIONS = frozenset(("sum", "mean", "nansum"))
"""Reductions over the token axis that a local reduction plus an all-reduce computes exactly."""
_COMPOSED_SEQUENCE_STATISTICS = frozenset(("logsumexp", "var", "std"))
"""Reductions over the token axis composed from all-reduced sums (`rewrite_sequence_statistic`)."""
_WHOLE_TENSOR = frozenset(("histc", "bincount"))


@rule("reduction (over the sequence: all-reduced sums)",
      "sum", "mean", "nansum", "nanmean", "amax", "amin", "max", "min", "argmax", "argmin", "prod", "var", "std",
      "logsumexp", "norm", "linalg_vector_norm", "linalg_norm", "any", "all", "count_nonzero", "median",
      "nanmedian", "mode", "var_mean", "std_mean", "aminmax", "histc", "bincount")
def reduction(an, gm, node: fx.Node):
    bound = arguments(node)
    if "other" in bound:  # torch.max(a, b), torch.min(a, b): the elementwise forms
        return elementwise(an, node)
    x = bound["input"]
    p = an.of(x)
    name = op_name(node)
    if isinstance(p, Partial):
        if name in ("sum", "nansum") and fake_value(node) is not None:
            return PARTIAL
        raise an.refuse(node, "reduces a partial sum over the sequence non-linearly", FIX_GENERIC)
    if not isinstance(p, Shard):
        return multi(node, REPLICATE)
    dims = normalize_dims(None if name in _WHOLE_TENSOR else bound.get("dim"), ndim(x))
    keepdim = bool(bound.get("keepdim", False)) and name not in _WHOLE_TENSOR
    if p.dim not in dims:
        dim = p.dim if keepdim else p.dim - sum(d < p.dim for d in dims)
        return multi(node, p.moved(dim))
    if p.tentative:
        an.use_positions(p, "replicated")
        return multi(node, REPLICATE)
    if node.meta.get(LOCAL_REDUCTION):  # a rule (the loss) completes this sum with its own all-reduce
        return PARTIAL
    if name in _COMPOSED_SEQUENCE_STATISTICS and not isinstance(fake_value(node), (tuple, list)):
        return rewrite_sequence_statistic(an, gm, node)
    if name not in _EXACT_SEQUENCE_REDUCTIONS or isinstance(fake_value(node), (tuple, list)):
        raise an.refuse(node, f"reduces over the token axis ({name}); AutoSP completes sums, means, logsumexp, "
                        "var and std over the sequence", "express it with one of those over the tokens")
    return complete_sequence_reduction(an, gm, node)


_NORMALIZED_SHAPE = frozenset(("layer_norm", "rms_norm", "group_norm"))


@rule("token-local unless along the sequence",
      "softmax", "log_softmax", "softmin", "cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "topk", "sort",
      "argsort", "kthvalue", "diff", "normalize", "glu", "flip", "roll", "cumulative_trapezoid", "gumbel_softmax",
      "layer_norm", "rms_norm")
def along_dim(an, gm, node: fx.Node):
    """Ops that work along named dims (softmax, scans, sorts) or trailing dims (norms): local unless one is the
    token axis."""
    bound = arguments(node)
    x = bound["input"]
    p = an.of(x)
    if p == REPLICATE and op_name(node) == "cumsum" and (count := running_count(an, node)) is not None:
        return count  # Note [Positions built in the graph]
    if not isinstance(p, Shard):
        if isinstance(p, Partial):
            raise an.refuse(node, "applies a non-linear function to a partial sum over the sequence", FIX_GENERIC)
        return multi(node, REPLICATE)
    rank = ndim(x)
    if op_name(node) in _NORMALIZED_SHAPE:
        normalized = bound.get("normalized_shape")
        count = 1 if isinstance(normalized, int) else len(normalized)
        dims = tuple(range(rank - count, rank))
    else:
        dims = normalize_dims(bound.get("dim", bound.get("dims")), rank)
    if p.dim in dims:
        if p.tentative:
            an.use_positions(p, "replicated")
            return multi(node, REPLICATE)
        raise an.refuse(node, f"works along dim {p.dim}, the token axis, so it would see only this rank's tokens",
                        FIX_GENERIC)
    return multi(node, p)


@rule("loss (tiled: partial sum)", targets=(torch.ops.autosp_testbed.linear_cross_entropy.default,))
def tiled_loss(an, gm, node: fx.Node):
    """The tiled logits + loss op (Note [Tiled loss pass] in autosp/passes/dynamo/tiled_loss.py)."""
    from autosp.passes.dynamo.tiled_loss import tiled_loss_placement

    return tiled_loss_placement(an, node)


@rule("loss (partial sum)", "cross_entropy", "nll_loss")
def cross_entropy(an, gm, node: fx.Node):
    sharded = sharded_inputs(an, node)
    if not sharded:
        return REPLICATE
    bound = arguments(node)
    rows, target = bound["input"], bound["target"]
    # input [N, C] / [B, C, S...] and target [N] / [B, S...]: the class dim 1 is the input's only extra dim
    for this, other, to_other in ((rows, target, lambda d: d - (d > 1)), (target, rows, lambda d: d + (d > 0))):
        p = an.of(this)
        if isinstance(p, Shard) and not isinstance(an.of(other), (Shard, Partial)) and ndim(other) == (
                ndim(this) + (1 if other is rows else -1)) and shape(other)[to_other(p.dim)] != 1:
            refuse_replicated_per_token(an, node, p, other)
    reduction = bound.get("reduction", "mean")
    if reduction == "sum":
        return PARTIAL
    if reduction == "none":
        q = an.of(bound["target"])
        return q if isinstance(q, Shard) else sharded[0][1]
    raise an.refuse(node, "averages a loss over token-sharded rows outside AutoSP's causal-LM loss rule",
                    "compute the loss with one cross_entropy over the labels passed to the model, or use "
                    "reduction='sum' and divide by a token count reduced with sum()")


def _differentiable(node: fx.Node) -> bool:
    value = fake_value(node)
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


def gradient_kinds(an, gm: fx.GraphModule, output_kinds=None) -> dict[fx.Node, set[str]]:
    """For each replicated value of ``gm``: is its gradient replicated, partial, or both?  (reverse walk)"""
    kinds: dict[fx.Node, set[str]] = {}
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outputs = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    out_kind = {}
    for i, value in enumerate(outputs):
        if isinstance(value, fx.Node):
            given = output_kinds[i] if output_kinds is not None else {REPLICATED}
            out_kind.setdefault(value, set()).update(given)
    for node in reversed(list(gm.graph.nodes)):
        if node.op == "output":
            continue
        found = set(out_kind.get(node, set()))
        for user in node.users:
            if user.op == "output":
                continue
            body = inlined_body(gm, user)
            if body is not None:
                sub, operands = body
                inner = gradient_kinds(an, sub, _hop_output_kinds(user, sub, kinds))
                placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
                for operand, ph in zip(operands, placeholders, strict=False):
                    if operand is node:
                        found |= inner.get(ph, set())
                continue
            placement = an.of(user)
            if isinstance(placement, tuple) or isinstance(placement, Replicate):
                found |= kinds.get(user, set())
            elif isinstance(placement, (Shard, Partial)):
                found.add(PARTIAL_GRAD)
        kinds[node] = found
    return kinds


def _hop_output_kinds(hop: fx.Node, sub: fx.GraphModule, kinds) -> list[set[str]]:
    output = next(n for n in sub.graph.nodes if n.op == "output")
    count = len(output.args[0]) if isinstance(output.args[0], (tuple, list)) else 1
    per_output = [set() for _ in range(count)]
    for user in hop.users:
        if user.target.__name__ == "getitem" and isinstance(user.args[1], int):
            per_output[user.args[1]] |= kinds.get(user, set())
    return per_output


def choose_all_reduce_backward(an, gm: fx.GraphModule) -> None:
    """Pick each sequence reduction's all-reduce variant; refuse parameters whose gradient would be replicated."""
    if not an.result.sequence_reductions and not an.result.attention:
        return
    kinds = _all_kinds(an, gm)
    for reduced in an.result.sequence_reductions:
        found = kinds.get(reduced, set())
        if found == {REPLICATED, PARTIAL_GRAD}:
            raise AutoSPError(
                f"the reduction over the sequence in module {module_name(reduced)} is read both by computations "
                "every rank repeats (such as a loss) and by token-sharded computations; AutoSP cannot split its "
                "gradient between the two.  Compute the two uses from separate reductions"
            )
        if found == {PARTIAL_GRAD}:
            reduced.target = torch.ops.autosp_testbed.all_reduce_sum_sum_grad.default
    for node, found in kinds.items():
        value = fake_value(node)
        if (node.op == "placeholder" and REPLICATED in found and isinstance(value, torch.Tensor)
                and value.requires_grad and isinstance(an.of(node), Replicate)):
            raise AutoSPError(
                f"parameter {node.name} reaches the loss only through computations every rank of the SP group "
                "repeats (after a reduction over the sequence), so each rank would hold its whole gradient and "
                "sync_gradients would count it sp_size times; apply it to token-sharded values, or keep it out "
                "of the sequence-parallel model"
            )


def _all_kinds(an, gm):
    kinds = gradient_kinds(an, gm)
    return {n: k for n, k in kinds.items() if _differentiable(n)}


__all__ = ["PARTIAL", "choose_all_reduce_backward", "complete_sequence_reduction", "gradient_kinds"]
