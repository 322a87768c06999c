"""Overlap the all-to-alls with computation: start each as early as its input allows, wait as late as its users allow.

Runs on the forward and backward aten graphs that AOTAutograd partitioned (so the
backward's own all-to-alls, the gradients of the forward ones, are covered too).
Each blocking ``autosp_testbed::all_to_all`` becomes an ``all_to_all_start`` placed
right after the node producing its input and an ``all_to_all_wait`` placed right
before the first node reading its result (see Note [All-to-all as start and
wait] in autosp.ops).  Everything in between that does not depend on the
collective runs while it is in flight: in forward, the k and v all-to-alls
travel while the q (and k) projections and rotary embeddings compute; in
backward, an output-gradient all-to-all travels while the weight gradient of the
projection that produced it computes.  Only the position of the two halves
changes, never a data dependency, so the numerics are those of the blocking op.
"""

from __future__ import annotations

import logging

import torch
from torch import fx

log = logging.getLogger(__name__)

A2A = torch.ops.autosp_testbed.all_to_all.default
A2A_START = torch.ops.autosp_testbed.all_to_all_start.default
A2A_WAIT = torch.ops.autosp_testbed.all_to_all_wait.default


def _first_user(node: fx.Node, order: dict[fx.Node, int]) -> fx.Node:
    return min(node.users, key=order.__getitem__)


def _split(graph: fx.Graph, node: fx.Node) -> tuple[fx.Node, fx.Node]:
    x, scatter_dim, gather_dim, group_name, group_size = node.args
    with graph.inserting_before(node):
        start = graph.call_function(A2A_START, (x, scatter_dim, group_name, group_size))
        wait = graph.call_function(A2A_WAIT, (start, gather_dim))
    out = node.meta.get("val")
    if isinstance(out, torch.Tensor):
        chunk = list(x.meta["val"].shape)
        chunk[scatter_dim] //= group_size
        start.meta["val"] = out.new_empty([group_size, *chunk])
        wait.meta["val"] = out
    for meta_key in ("stack_trace", "nn_module_stack", "partitioner_tag"):
        if meta_key in node.meta:
            start.meta[meta_key] = wait.meta[meta_key] = node.meta[meta_key]
    node.replace_all_uses_with(wait)
    graph.erase_node(node)
    return start, wait


def overlap_all_to_alls_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Split every all-to-all of a partitioned graph into start/wait and spread the two apart."""
    graph = gm.graph
    pairs = [_split(graph, n) for n in list(graph.nodes) if n.op == "call_function" and n.target is A2A]
    if not pairs:
        return gm
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for start, _ in pairs:
        producer = start.args[0]
        anchor = producer if producer.op != "placeholder" else placeholders[-1]
        anchor.append(start)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for _, wait in pairs:
        if wait.users:
            _first_user(wait, order).prepend(wait)
    graph.lint()
    gm.recompile()
    log.debug("overlap: %d all-to-all(s) split into start/wait", len(pairs))
    return gm


def overlapped_compute(gm: fx.GraphModule) -> list[int]:
    """For each start/wait pair, how many compute nodes run between them (for tests and logs)."""
    nodes = list(gm.graph.nodes)
    counts = []
    for i, node in enumerate(nodes):
        if node.op == "call_function" and node.target is A2A_START:
            wait = next(u for u in node.users if u.target is A2A_WAIT)
            between = nodes[i + 1 : nodes.index(wait)]
            counts.append(sum(1 for n in between if n.op == "call_function" and n.target not in (A2A_START, A2A_WAIT)))
    return counts
