"""Sequence-aware activation checkpointing (SAC): which forward tensors the backward recomputes.

Note [Sequence-aware checkpointing]
At long context one layer's attention costs O(S²) FLOPs while everything else
(projections, MLP, norms, rotary, residual adds) costs O(S); the activations
the backward reads are all O(S) bytes.  So the cheapest way to free activation
memory is to keep what is expensive to rebuild and recompute the rest:

- always kept: attention outputs (and the log-sum-exp its backward reads) and the
  results of collectives, which are never recomputed (a recomputed all-to-all is
  a second trip over the network and, worse, a collective that only some code
  paths issue);
- always recomputed: cheap ops (elementwise, norms, reductions, embeddings,
  copies), whose recompute costs bandwidth but almost no FLOPs;
- matmuls: recomputed cheapest per byte freed first, while their FLOPs stay
  within ``sac_recompute_limit`` of the forward pass's FLOPs.  Attention is part
  of that total, so the longer the sequence the more matmuls qualify; a
  ``sac_memory_budget`` recomputes further matmuls until the kept bytes fit;
- always kept: tensors read across an attention boundary (a reader comes after
  a later attention than the producer): the residual stream between layers,
  rotary tables.  Recomputing those would chain the recomputation of one layer
  through every earlier layer, and the partitioner would keep that whole chain
  alive from the start of the backward.  With them kept, each layer's
  recomputation happens just before its own backward, as with per-layer
  checkpointing.

The decision (`choose_recomputation`) is a pure function of plain per-node
costs.  `tag_recomputation` applies it to AOTAutograd's joint graph through the
supported extension point, ``node.meta["recompute"]`` (torch.utils.checkpoint's
`CheckpointPolicy`), which the min-cut partitioner honours: PREFER_RECOMPUTE
forces a node into the backward, MUST_SAVE bans its recomputation.  The
partitioner still chooses the cut (what is actually saved) and orders the
recomputation just before its use.  The other settings use the same tags:
"none" bans every recomputation, "full" recomputes every op except collectives
and the attention-boundary tensors (per-layer checkpointing), "default" leaves the partitioner's heuristics alone (collectives banned).
"long-context" is the rule of Note [The long-context rule of the AutoSP research fork].
"layer" is per-layer checkpointing as ``torch.utils.checkpoint`` around each decoder layer runs it (Hugging Face's
``gradient_checkpointing_enable``, the hand-written baselines of ALST): what runs outside the decoder layers (the
blocks of a module list, by the nodes' ``nn_module_stack``: embedding, final norm, output head, loss) is kept as
autograd keeps it; inside a layer only the attention-boundary tensors (the residual stream between layers) are
kept, and everything else is recomputed, the collectives included, so each
all-to-all of a layer runs again in its backward (a second trip over the network, which the other settings
avoid), and so is the attention (the other settings keep its output: its kernel carries PyTorch's
``nondeterministic_seeded`` tag, for its dropout, which AutoSP refuses, so recomputing it is exact). Every rank
runs the same program, so the recomputed collectives match across ranks.

Note [The last layer's output]
Under "layer" a layer's outputs are kept, as torch.utils.checkpoint keeps a checkpointed block's outputs: those
read by the next layer cross its attention (kept above), and the last layer's output, read by the final norm
outside the layers, is kept too.  Recomputed, it made the final norm's backward wait for the last layer's whole
recomputation (its tiled MLP's forward included, whose result the layer's own backward never reads): an extra MLP
forward per step, and the final norm's gradients live beside the recomputed layer's activations, at the peak.
Measured on CPU (PeakMemory; hf-llama hidden 64, 2 layers, 6,144 tokens on 2 gloo ranks, layer checkpointing,
tiled loss and MLP) that peak held the last layer's recomputation, its output and three hidden-sized gradients of
the final norm at once.

Note [The long-context rule of the AutoSP research fork]
The published AutoSP figures were made with the authors' research fork of DeepSpeed 0.16.3
(GitHub spikerheado1234/AutoSP, commit fd542b43619e03c7454abfcff3b5aaeef05c5318), whose README (step 6) has
torch's min-cut partitioner replaced by ``need_to_copy_paste/partitioners.py``.  Its
``should_ban_recomputation`` (lines 1049-1103) differs from torch's in what it lets the min-cut recompute:

- attention kernels, convolutions, dropout and random ops are always kept (``must_save_set``, lines 1062-1076);
- an op outside torch's recomputable allowlist (a matmul) is never banned (lines 1084-1086);
- a tensor the backward reads ("materialized in backward", line 1088) may be recomputed only when its
  dim 1 is at least 4096 (``heuristic``, lines 1078-1081), and is kept otherwise;
- a reduction whose output is under a quarter of its inputs' bytes is kept (lines 1096-1101).

"long-context" applies these decisions as tags, so that torch's own partitioner (not the fork's) cuts the graph:
a node the fork bans is MUST_SAVE, a node it allows is PREFER_RECOMPUTE (the min-cut weighs bytes only, so it
recomputes what it may).  Where this differs from the fork, it keeps more: collectives are kept (the fork's
partitioner sees its all-to-all custom op as one more op outside the allowlist), and so are tensors read across
an attention boundary (the residual stream; recomputing it would chain through every earlier layer and hold the
chain from the start of the backward, which costs as much memory as keeping it).  A tensor counts as read by
the backward when any backward node reads it (through views); the fork also lets Inductor fuse a recomputation
into a pointwise backward reader without counting it, which is not modelled.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from autosp.costs import VIEWS, classify, nbytes_of, packet_name
from autosp.passes.graph_utils import layer_of

log = logging.getLogger(__name__)

_COLLECTIVE_NAMESPACES = ("autosp_testbed", "_c10d_functional", "c10d_functional")

LONG_CONTEXT_MIN_DIM = 4096
"""The AutoSP research fork's threshold: a tensor the backward reads may be recomputed only when its dim 1 is at
least this (Note [The long-context rule of the AutoSP research fork])."""


@dataclass(frozen=True)
class Candidate:
    """A forward op whose output the backward may recompute instead of keeping."""

    name: str
    op_class: str
    """"matmul" or "cheap"."""
    flops: int
    nbytes: int


@dataclass(frozen=True)
class CheckpointPlan:
    """What the checkpointing setting decided for one joint graph (for logs, tests and reports)."""

    setting: str
    saved: tuple[str, ...]
    """Forward nodes banned from recomputation (kept if the backward reads them)."""
    recomputed: tuple[str, ...]
    """Forward nodes the backward recomputes."""
    forward_flops: int
    recompute_flops: int
    candidate_bytes: int
    """Bytes of the outputs of all recomputable candidates."""
    kept_candidate_bytes: int
    read_by_backward: tuple[str, ...] = ()
    """Forward nodes a backward node reads (through views)."""
    kept_across_attention: tuple[str, ...] = ()
    """Forward nodes kept because a reader comes after a later attention (the residual stream)."""


def choose_recomputation(
    candidates: Iterable[Candidate], *, forward_flops: int, recompute_limit: float, memory_budget: float | None
) -> set[str]:
    """Names of the candidates SAC recomputes.  See Note [Sequence-aware checkpointing]."""
    candidates = list(candidates)
    chosen = {c.name for c in candidates if c.op_class != "matmul"}
    total_bytes = sum(c.nbytes for c in candidates)
    kept_bytes = sum(c.nbytes for c in candidates if c.name not in chosen)
    extra_flops = 0
    matmuls = sorted((c for c in candidates if c.op_class == "matmul"),
                     key=lambda c: (c.flops / max(c.nbytes, 1), c.name))
    for c in matmuls:
        within_flops = extra_flops + c.flops <= recompute_limit * forward_flops
        over_budget = memory_budget is not None and kept_bytes > memory_budget * total_bytes
        if within_flops or over_budget:
            chosen.add(c.name)
            extra_flops += c.flops
            kept_bytes -= c.nbytes
    return chosen


def _is_collective(node: fx.Node) -> bool:
    return getattr(node.target, "namespace", None) in _COLLECTIVE_NAMESPACES


def gathers_parameter(node: fx.Node) -> bool:
    """Whether ``node`` gathers a parameter shard (an all-gather of a graph input, or its wait): gathered again in
    the backward, never kept (Note [Parameters gathered in the graph] in autosp/parameter_sharding.py)."""
    name = packet_name(node.target)
    source = node.args[0] if node.args else None
    if name == "wait_tensor":
        return isinstance(source, fx.Node) and gathers_parameter(source)
    return name == "all_gather_into_tensor" and isinstance(source, fx.Node) and source.op == "placeholder"


def _in_layer(node: fx.Node) -> bool:
    """Whether ``node`` runs inside one block of a module list (a decoder layer: ``model.layers.3``,
    ``transformer.h.3``), what ``gradient_checkpointing_enable`` checkpoints; a collective the passes inserted (no
    module) sits around an attention, inside its layer."""
    if not node.meta.get("nn_module_stack"):
        return _is_collective(node)
    return layer_of(node) is not None


def _is_random(node: fx.Node) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def _forward_ops(graph: fx.Graph) -> list[fx.Node]:
    return [
        n for n in graph.nodes
        if n.op == "call_function" and n.meta.get("partitioner_tag") == "is_forward" and n.target is not operator.getitem
    ]


def attention_segments(nodes: list[fx.Node]) -> dict[fx.Node, int]:
    """Node -> how many attention ops precede it in program order (forward, or backward: the activation offload
    pass cuts the backward there too, Note [Activation offload])."""
    segments, seen = {}, 0
    for node in nodes:
        segments[node] = seen
        if classify(node)[0] == "attention":
            seen += 1
    return segments


def _crosses_attention(node: fx.Node, segments: dict[fx.Node, int], segment: int | None = None) -> bool:
    """Whether a reader of ``node`` (looking through views) comes after a later attention."""
    segment = segments[node] if segment is None else segment
    for user in node.users:
        if segments.get(user, -1) > segment:
            return True
        if user.op == "call_function" and packet_name(user.target) in VIEWS and _crosses_attention(user, segments,
                                                                                                   segment):
            return True
    return False


def _read_outside_layers(node: fx.Node) -> bool:
    """Whether a forward op outside the decoder layers (the final norm) reads ``node`` (looking through views):
    under "layer", a layer's output, which torch.utils.checkpoint keeps (Note [The last layer's output])."""
    for user in node.users:
        if user.op != "call_function" or user.meta.get("partitioner_tag") != "is_forward":
            continue
        if packet_name(user.target) in VIEWS:
            if _read_outside_layers(user):
                return True
        elif not _in_layer(user):
            return True
    return False


def _read_by_backward(node: fx.Node) -> bool:
    """Whether a node outside the forward reads ``node`` (looking through views)."""
    for user in node.users:
        if user.op == "call_function" and user.meta.get("partitioner_tag") != "is_forward":
            return True
        if user.op == "call_function" and packet_name(user.target) in VIEWS and _read_by_backward(user):
            return True
    return False


def long_context_recomputable(node: fx.Node, op_class: str) -> bool:
    """The fork's decision for one forward node that is not an attention, collective or random op: may it be
    recomputed (Note [The long-context rule of the AutoSP research fork])."""
    if op_class == "matmul":
        return True
    val = node.meta.get("val")
    if _read_by_backward(node):
        return isinstance(val, torch.Tensor) and val.dim() >= 2 and val.shape[1] >= LONG_CONTEXT_MIN_DIM
    if op_class == "reduction":
        inputs = sum(nbytes_of(a.meta.get("val")) for a in node.all_input_nodes)
        return 4 * nbytes_of(val) >= inputs
    return True


def tag_recomputation(
    graph: fx.Graph, *, setting: str, recompute_limit: float, memory_budget: float | None,
    decide: Callable[[dict[fx.Node, Candidate], dict[fx.Node, int]], set[str]] | None = None,
) -> CheckpointPlan:
    """Set ``node.meta["recompute"]`` on the forward nodes of AOTAutograd's joint graph.  ``decide(candidates,
    flops)``: SAC's choice (the names recomputed) from its candidates and every forward op's FLOPs, instead of
    `choose_recomputation` on this graph (the planner's shallow traces decide for the full depth: Note [Shallow
    traces checkpointed for the full depth] in autosp/plan/depth.py)."""
    saved, recompute, across, regathered = [], [], [], []
    regathered_set: set[fx.Node] = set()
    candidates, costs, classes = [], {}, {}
    forward_flops = 0
    forward = _forward_ops(graph)
    segments = attention_segments(forward)
    aliases = []  # "layer": views recomputed too (the partitioner would save a reshape like _unsafe_view)
    for node in forward:
        if packet_name(node.target) in VIEWS and node.args and node.args[0] in regathered_set:
            regathered.append(node)
            regathered_set.add(node)  # a view of a gathered weight saved instead would keep the gathered storage
            continue
        if packet_name(node.target) in VIEWS:
            if setting == "layer" and _in_layer(node) and not _crosses_attention(node, segments):
                aliases.append(node)
            continue  # aliases: otherwise the partitioner recomputes views for free
        op_class, flops = classify(node)
        forward_flops += flops
        costs[node], classes[node] = flops, op_class
        if gathers_parameter(node):
            regathered.append(node)
            regathered_set.add(node)
        elif _is_collective(node) and setting != "layer":
            saved.append(node)
        elif _is_random(node) and not (setting == "layer" and op_class == "attention"):
            continue  # never tagged: the partitioner never recomputes random ops by itself
        elif setting == "none" or (setting == "layer" and not _in_layer(node)):
            saved.append(node)  # "layer": what runs outside the decoder layers is kept, as autograd keeps it
        elif setting in ("full", "layer", "sac", "long-context") and op_class != "attention" and \
                _crosses_attention(node, segments) or setting == "layer" and _read_outside_layers(node):
            saved.append(node)
            across.append(node)  # See Note [Sequence-aware checkpointing]: the residual stream between layers
        elif setting in ("full", "layer"):
            recompute.append(node)
        elif setting == "long-context":
            (recompute if op_class != "attention" and long_context_recomputable(node, op_class) else saved).append(node)
        elif setting == "sac":
            if op_class == "attention":
                saved.append(node)
            else:
                candidates.append(node)
    plain = {n: Candidate(n.name, "matmul" if classes[n] == "matmul" else "cheap", costs[n],
                          nbytes_of(n.meta.get("val"))) for n in candidates}
    if setting == "sac":
        chosen = decide(plain, costs) if decide is not None else choose_recomputation(
            plain.values(), forward_flops=forward_flops, recompute_limit=recompute_limit, memory_budget=memory_budget)
        recompute += [n for n in candidates if n.name in chosen]
        saved += [n for n in candidates if n.name not in chosen]
    for node, policy in [(n, CheckpointPolicy.MUST_SAVE) for n in saved] + [
        (n, CheckpointPolicy.PREFER_RECOMPUTE) for n in recompute + aliases] + [
        (n, CheckpointPolicy.MUST_RECOMPUTE) for n in regathered
    ]:
        node.meta["recompute"] = policy
        for user in node.users:  # multi-output ops: their getitems share the decision
            if user.target is operator.getitem:
                user.meta["recompute"] = policy
    plan = CheckpointPlan(
        setting=setting,
        saved=tuple(n.name for n in saved),
        recomputed=tuple(n.name for n in recompute),
        forward_flops=forward_flops,
        recompute_flops=sum(costs[n] for n in recompute),
        candidate_bytes=sum(c.nbytes for c in plain.values()),
        kept_candidate_bytes=sum(plain[n].nbytes for n in saved if n in plain),
        read_by_backward=tuple(n.name for n in forward if packet_name(n.target) not in VIEWS and _read_by_backward(n)),
        kept_across_attention=tuple(n.name for n in across),
    )
    log.debug("checkpointing %s: %d saved, %d recomputed (%.1f%% of forward FLOPs)", setting, len(plan.saved),
              len(plan.recomputed), 100 * plan.recompute_flops / max(forward_flops, 1))
    return plan


def make_recompute_tagger(
    *, setting: str, recompute_limit: float, memory_budget: float | None, record: Callable[[CheckpointPlan], None]
) -> Callable[[fx.Graph], None]:
    """A joint-graph pass applying ``setting`` and handing its plan to ``record``."""

    def tag(graph: fx.Graph) -> None:
        record(tag_recomputation(graph, setting=setting, recompute_limit=recompute_limit,
                                 memory_budget=memory_budget))

    return tag
