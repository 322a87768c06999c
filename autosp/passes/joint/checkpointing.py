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

log = logging.getLogger(__name__)

_COLLECTIVE_NAMESPACES = ("autosp_testbed", "_c10d_functional", "c10d_functional")


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


def _is_random(node: fx.Node) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def _forward_ops(graph: fx.Graph) -> list[fx.Node]:
    return [
        n for n in graph.nodes
        if n.op == "call_function" and n.meta.get("partitioner_tag") == "is_forward" and n.target is not operator.getitem
    ]


def _attention_segments(nodes: list[fx.Node]) -> dict[fx.Node, int]:
    """Forward node -> how many attention ops precede it in program order."""
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


def tag_recomputation(
    graph: fx.Graph, *, setting: str, recompute_limit: float, memory_budget: float | None
) -> CheckpointPlan:
    """Set ``node.meta["recompute"]`` on the forward nodes of AOTAutograd's joint graph."""
    saved, recompute = [], []
    candidates, costs, classes = [], {}, {}
    forward_flops = 0
    forward = _forward_ops(graph)
    segments = _attention_segments(forward)
    for node in forward:
        if packet_name(node.target) in VIEWS:
            continue  # aliases: the partitioner recomputes views for free
        op_class, flops = classify(node)
        forward_flops += flops
        costs[node], classes[node] = flops, op_class
        if _is_collective(node):
            saved.append(node)
        elif _is_random(node):
            continue  # never tagged: the partitioner never recomputes random ops by itself
        elif setting == "none":
            saved.append(node)
        elif setting in ("full", "sac") and op_class != "attention" and _crosses_attention(node, segments):
            saved.append(node)  # See Note [Sequence-aware checkpointing]: the residual stream between layers
        elif setting == "full":
            recompute.append(node)
        elif setting == "sac":
            if op_class == "attention":
                saved.append(node)
            else:
                candidates.append(node)
    plain = {n: Candidate(n.name, "matmul" if classes[n] == "matmul" else "cheap", costs[n],
                          nbytes_of(n.meta.get("val"))) for n in candidates}
    if setting == "sac":
        chosen = choose_recomputation(plain.values(), forward_flops=forward_flops, recompute_limit=recompute_limit,
                                      memory_budget=memory_budget)
        recompute += [n for n in candidates if n.name in chosen]
        saved += [n for n in candidates if n.name not in chosen]
    for node, policy in [(n, CheckpointPolicy.MUST_SAVE) for n in saved] + [
        (n, CheckpointPolicy.PREFER_RECOMPUTE) for n in recompute
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
