"""The sequence-sharding analysis: every value classified, every token-mixing op made exact or refused.

Note [Sequence-sharding analysis]
Each rank traces the model on its own contiguous slice of the tokens, but the
program must compute what the single-device program computes on the whole
sequence.  The analysis walks the Dynamo graph in order, descending into the
bodies of higher-order ops (activation-checkpointed blocks, ``wrap``), and gives
every value one element of a small lattice (autosp.passes.dynamo.placements):

- ``Replicate``: the same whole value on every rank (parameters, constants);
- ``Shard(dim, inner)``: this rank's slice of a token-indexed value, the tokens
  running along ``dim`` (with stride ``inner`` when a reshape merged them with
  other axes); the graph inputs input_ids, labels and position_ids start here;
- ``Partial``: a per-rank partial sum (a reduction over the tokens before its
  all-reduce).

Each op is looked up by what it does to the token axis, not by name alone:
elementwise ops with broadcasting, layout ops (views, reshapes, permutes,
expands), ops along named dims (softmax, norms, scans, sorts), reductions,
matmul/linear/embedding/einsum, indexing, concatenation and splitting.  An op
is token-local when the token axis passes through it untouched (it lands on one
output dim, and is neither reduced, contracted, scanned, sliced, split nor
reordered); then it computes, on each rank, exactly the slice of the single-
device result.  That is the whole soundness argument: by induction over the
graph, every Shard value is the rank's slice of the single-device value and
every Replicate value equals it, because each op either preserves that
property by construction or is rewritten by a rule that restores it:

- ``scaled_dot_product_attention`` over the token axis: Ulysses all-to-alls
  (autosp.passes.dynamo.attention) make it head-sharded over the whole sequence;
- a sum or mean over the token axis: local reduction (a mean divides by the
  global count) then an all-reduce over the SP group (Partial -> Replicate);
  logsumexp, var and std are composed from such sums (autosp.passes.dynamo.reductions);
- the causal-LM loss: autosp.passes.dynamo.loss (runs before the analysis and
  leaves a sum -> all-reduce the analysis checks like any other);
- positions built in the graph with ``arange`` in any spelling:
  Note [Positions built in the graph] in autosp.passes.dynamo.positions.

Every other op whose input is token-sharded along an axis it mixes (cumsum,
convolutions and scans over the sequence, a matmul contracting tokens, a slice
or a gather along the sequence, amax or median over it, random ops that
would repeat their stream on every rank, a replicated tensor with one entry
per local token such as a sliced mask buffer) and every op without a rule is
refused with an `AutoSPError` naming the op, the module and what to change.

Gradients (Note [Gradient placements]): the backward is derived by autograd
from this forward, so it is exact when every collective's backward is.  The
all-to-all's is; an all-reduce's depends on who reads its result: readers that
every rank repeats (the loss) hand each rank the whole gradient (the backward
is the identity), readers on token-sharded values hand each rank a partial
gradient (the backward sums it over the group).  A reverse walk classifies
each replicated value's gradient as replicated, partial or both and picks the
all-reduce accordingly, refusing the mixed case, and refuses a parameter whose
gradient would be replicated: `sync_gradients` sums gradients over the group,
so it would count P times.

Note [Token counts]
A count read from a shard's shape (``x.shape[1]``, ``x.size(1)``, ``x.numel()``,
``len(x)``) is the shard's.  With static shapes Dynamo bakes it into the graph as
an integer the analysis cannot tell from a coincidental literal, so the likely
cases are refused (autosp.passes.dynamo.pointwise.check_token_count_literal): a
multiple of the local count, the count one off (``S - 1``) or the element count
of a token-sharded value (``x.numel()`` at any hidden size), scaling a value
computed from a reduction over the sequence, and
the local token or element count multiplying or dividing
token-sharded values on a source line that reads a shape (directly or through a
name assigned from one earlier in the function).  With a dynamic
sequence dim the count is a symbol (``token_symbol``): a count proportional to
it, in arithmetic on tensors, becomes ``sp_size`` times itself (exact when the
sequence was not padded), one derived non-linearly is refused, and ``arange`` of
it is a position table (Note [Positions built in the graph]).  What a static
trace cannot see: a count derived from the local one by other arithmetic
(``S // 2``, ``B * (S - 1)``) is a literal like any other, and a sum over the
sequence scaled by it computes with the shard's value (the fuzzer leaves such
spellings out of its pool); tracing the sequence dim as a symbol throughout is
what would make every derived count known.

The op rules are registered by family (Note [Op rule registry] in
autosp.passes.dynamo.registry) and read arguments bound by the ops' schemas.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import fx

from autosp.context import TraceContext
from autosp.errors import AutoSPError
from autosp.passes.dynamo import rules
from autosp.passes.dynamo.placements import PARTIAL, REPLICATE, Partial, Replicate, Shard, describe
from autosp.passes.dynamo.registry import op_name
from autosp.passes.graph_utils import (
    eliminate_dead_code,
    fake_value,
    flatten,
    infer_fake_value,
    module_name,
    source_location,
    writes_an_input,
)

log = logging.getLogger(__name__)

ROLE_PLACEMENTS = {"input_ids": Shard(1), "labels": Shard(1), "position_ids": Shard(1), "attention_mask": Shard(1)}
"""Graph inputs that hold tokens: [batch, sequence] slices of the full sample (every input role is placed)."""


@dataclass
class SequenceSharding:
    """What the analysis found; the rewrites and the export read it."""

    placements: dict[fx.Node, object] = field(default_factory=dict)
    """Placement of every node of every analysed graph (tuples for multi-output nodes)."""
    positions: dict[fx.Node, set[str]] = field(default_factory=dict)
    """Each ``arange(local_seq_len)`` -> how it was used ("token" and/or "replicated")."""
    sequence_reductions: list[fx.Node] = field(default_factory=list)
    """All-reduces inserted after reductions over the token axis (their variant is chosen last)."""
    attention: list[fx.Node] = field(default_factory=list)
    """Attention calls rewritten with all-to-alls."""
    op_classes: dict[str, str] = field(default_factory=dict)
    """op name -> rule class that handled it (for the report and the tests)."""


class Analysis:
    """One walk over a graph and its nested bodies; rules call back into it."""

    def __init__(self, ctx: TraceContext, root: fx.GraphModule):
        self.ctx = ctx
        self.root = root
        self.seq_len = ctx.layout.local_seq_len if ctx.layout is not None else _local_tokens(root)
        self.result = SequenceSharding()
        self.sequence_reduced: set[fx.Node] = set()
        """Replicated values computed from a reduction over the sequence (for the token-count literal check)."""
        self.token_symbol = None
        """The symbol of this rank's token count when the sequence dim is dynamic (Note [Token counts])."""
        self.sharded_numels: set[int] = set()
        """Element counts of the token-sharded values placed so far: what ``x.numel()`` of one bakes into the graph
        (Note [Token counts])."""

    # -- placements -------------------------------------------------------------------------
    def of(self, arg):
        if isinstance(arg, fx.Node):
            return self.result.placements.get(arg, REPLICATE)
        if isinstance(arg, (list, tuple)):
            return tuple(self.of(a) for a in arg)
        return REPLICATE

    def set(self, node: fx.Node, placement) -> None:
        self.result.placements[node] = placement
        if isinstance(placement, Shard) and not placement.tentative:
            value = fake_value(node)
            if isinstance(value, torch.Tensor) and type(value.numel()) is int:
                self.sharded_numels.add(value.numel())

    # -- decisions and refusals ----------------------------------------------------------------
    def use_positions(self, shard: Shard, how: str) -> None:
        for source in shard.positions:
            self.result.positions.setdefault(source, set()).add(how)

    def refuse(self, node: fx.Node, why: str, fix: str) -> AutoSPError:
        return AutoSPError(f"{describe(node)} in module {module_name(node)}{source_location(node)} {why}; {fix}")

    def classify(self, node: fx.Node, rule_class: str) -> None:
        self.result.op_classes.setdefault(describe(node), rule_class)

    # -- the walk -----------------------------------------------------------------------------
    def run_graph(self, gm: fx.GraphModule, inputs: list | None = None):
        """Analyse ``gm``; ``inputs`` are the placements of its placeholders (None: the model's own graph)."""
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for i, node in enumerate(placeholders):
            if inputs is not None:
                self.set(node, inputs[i])
            else:
                self.set(node, ROLE_PLACEMENTS.get(node.meta.get("autosp_role"), REPLICATE))
                placed, value = self.of(node), fake_value(node)
                if isinstance(placed, Shard) and isinstance(value, torch.Tensor):
                    length = value.shape[placed.dim]
                    if isinstance(length, torch.SymInt) and self.token_symbol is None:
                        self.token_symbol = length.node.expr
        output = None
        for node in list(gm.graph.nodes):
            if node.op in ("placeholder", "get_attr"):
                continue
            if node.op == "output":
                output = node
                continue
            if node in self.result.placements:  # inserted by a rule, already placed
                continue
            self.set(node, self.visit(gm, node))
            if writes_an_input(node):
                self._check_write(node)
            if isinstance(self.of(node), Replicate) and any(a in self.sequence_reduced for a in node.all_input_nodes):
                self.sequence_reduced.add(node)
        return self.of(output.args[0]) if output is not None else ()

    def _check_write(self, node: fx.Node) -> None:
        """A node that writes into a tensor (``mask.scatter_(...)``, ``acc += x``, ``out=``) leaves every later read
        of that tensor's own node with the written value, read under the tensor's placement: the result's
        placement must be the tensor's."""
        written = node.kwargs.get("out", node.args[0] if node.args else None)
        if not isinstance(written, fx.Node) or not isinstance(fake_value(written), torch.Tensor):
            return
        if op_name(written) in _FRESH and all(u is node for u in written.users):
            return  # a tensor made for this write alone (zeros(n).scatter_add_(...)): only its result is read
        before, after = self.of(written), self.of(node)
        plain = type(before) is Shard and type(after) is Shard  # the positions they carry may differ
        same = (before.dim, before.inner) == (after.dim, after.inner) if plain else before == after
        if not same:
            raise self.refuse(node, f"writes a {after} value into {written.name}, which is {before}, so later reads of "
                              f"{written.name} would take it for {before}", "write the result into a new tensor "
                              "(an out-of-place op) instead")

    def visit(self, gm: fx.GraphModule, node: fx.Node):
        return rules.apply(self, gm, node)


_FRESH = frozenset(("zeros", "ones", "empty", "full", "new_zeros", "new_ones", "new_empty", "new_full", "zeros_like",
                    "ones_like", "empty_like", "full_like", "clone", "tensor"))
"""Ops that make a new tensor (not a view of another): one written by a single op and read nowhere else leaves no
stale read behind (`Analysis._check_write`)."""


def _local_tokens(gm: fx.GraphModule) -> int:
    """Tokens per rank, read from the token inputs when no layout was recorded (graphs traced directly)."""
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.meta.get("autosp_role") in ROLE_PLACEMENTS:
            return int(fake_value(node).shape[1])
    return 0


def analyse_sequence_sharding(gm: fx.GraphModule, ctx: TraceContext) -> SequenceSharding:
    """Classify every value of ``gm`` (and its nested bodies), applying the rules; raise on what cannot be exact."""
    from autosp.passes.dynamo.positions import globalize_positions
    from autosp.passes.dynamo.reductions import choose_all_reduce_backward

    analysis = Analysis(ctx, gm)
    out = analysis.run_graph(gm)
    for leaf in flatten(out):
        if isinstance(leaf, Partial):
            raise AutoSPError("the model returns a partial sum over the sequence (a reduction AutoSP did not "
                              "complete with an all-reduce); this is a bug in AutoSP's rules, please report it")
    globalize_positions(analysis)
    choose_all_reduce_backward(analysis, gm)
    return analysis.result


def sequence_sharding_pass(gm: fx.GraphModule, example_inputs, *, ctx: TraceContext) -> fx.GraphModule:
    """Run the analysis and its rewrites over the whole graph; record what it found in the report."""
    eliminate_dead_code(gm.graph)  # what earlier rewrites left behind is not part of the program
    for node in gm.graph.nodes:  # nodes earlier rules inserted carry no fake value yet
        if node.op.startswith("call_") and fake_value(node) is None:
            infer_fake_value(node)
    result = analyse_sequence_sharding(gm, ctx)
    ctx.report.op_classes.update(result.op_classes)
    output = next(n for n in gm.graph.nodes if n.op == "output")  # read at run time by autosp.guards
    ctx.report.output_placements = tuple(result.placements.get(a, REPLICATE) if isinstance(a, fx.Node) else REPLICATE
                                         for a in flatten(output.args[0]))
    for sub in gm.modules():
        if isinstance(sub, fx.GraphModule) and sub is not gm:
            sub.graph.lint()
            sub.recompile()
    log.info("sequence-sharding analysis: %d node(s), %d attention(s), %d reduction(s) over the sequence, "
             "%d position arange(s) made global", len(result.placements), len(result.attention),
             len(result.sequence_reductions), sum("token" in v for v in result.positions.values()))
    return gm


__all__ = ["PARTIAL", "REPLICATE", "Analysis", "Partial", "Replicate", "SequenceSharding", "Shard",
           "analyse_sequence_sharding", "sequence_sharding_pass"]
