"""Activation offload: the tensors saved for backward go to host memory in forward and come back ahead of their use.

Runs where AOTAutograd's partitioner has just split the joint graph, so that the forward and the backward are both
visible: the saved tensors are the forward's outputs past its user outputs, and the backward's placeholders of the
same names receive them (autosp.backend calls `offload_saved_activations` from its partition function, before the
overlap pass).

Note [Activation offload]
~~~~~~~~~~~~~~~~~~~~~~~~~
What is offloaded: storages, not tensors.  Each tensor the partitioned forward saves for the backward is traced
through its views (``_unsafe_view``, ``detach``, every op whose schema returns an alias, and the ``getitem`` of one
of several views: ``split``, ``chunk``, ``unbind``) to the node that owns
its storage; a storage is offloaded when it is an activation, i.e. made by the forward (not a graph input, a
parameter or a view of one: those live on anyway), floating point (integer and bool tensors are indices and
masks, small and often read by guards), at least ``OFFLOAD_MIN_BYTES`` (below that a copy costs more to issue
than it frees), not aliased by a user output of the forward (that one lives on in the caller), and read by the
backward after its first attention (see the prefetch rule).  For each, the forward gets ``offload_to_host(x)`` of
the storage's owner x right after the last forward reader of any of its aliases (a view of it is no reader: the
partitioner's trailing ``detach`` of a saved tensor, read only by the output, is dropped), and every saved alias's output
slot returns that one host copy, so the storage dies in forward (Note [Activation offload ops] in
autosp/ops.py); the backward reloads it once and replays each saved alias's view ops on the reloaded tensor.
Offloading a view while another alias kept its storage alive would free nothing and add a device copy in
backward.

Where the reloads go: the backward is cut into segments at its attention ops (`attention_segments`, the cut SAC
uses in forward): segment 0 runs up to and with the first attention backward (the loss, the head, the last
layer's MLP and attention backward), segment k the ops after the k-th attention op up to and with the next one
(one layer's backward, give or take the projections on either side).  A saved tensor first read in segment k >= 1
is reloaded (``reload_from_host``) right before the attention op that ends segment k - 1, the last attention
backward before its first reader, so that its copy runs while that attention computes (at long context the
largest op of a layer's backward, O(S^2) against the copy's O(S)); it is waited for (``reload_wait``) right before its first reader.  A saved tensor first read in segment 0 has no
attention before it to hide its copy behind, so it stays on the device (it belongs to the last layer, whose
backward runs first); so does everything of a model without attention.  Issued earlier (at the start of segment
k - 1) the copies would overlap more compute but hold the next layer's activations through the whole of the
current layer's backward: on a 2-layer model that brought every offloaded tensor back at the start of backward,
where the peak is.  Measured on CPU (PeakMemory, hf-llama hidden 64, 1,024 tokens on 2 ranks, 4 layers, SAC), with
each saved tensor freed at its last reader (Note [Boxed graphs free their inputs] in autosp/backend.py): the device
peak drops from 6.16 MB to 3.79 MB (tests/autosp/test_activation_offload.py).  With 2 layers only the first layer's
activations can leave: at 6,144 tokens, per-layer checkpointing and tiled loss and MLP, 13.24 to 12.49 MiB.

Why it is exact: the ops copy values and change nothing; the backward reads the reloaded copy, equal element for
element to what the forward saved, and the wait orders every reader after the copy.  On CPU the copies are clones
and the run is the same program with the same arithmetic.

How it composes: SAC (autosp.passes.joint.checkpointing) decides first what is saved at all; a tensor it
recomputes is not saved, so it is not offloaded (the recomputation reads saved tensors, which are reloaded like
any other).  The overlap pass runs after this one on each graph and moves only all-to-all starts and waits.  The
tiled loss and tiled MLP are custom ops whose saved inputs are saved tensors like any other; their chunks never
are.  Sequence sharding: the pass runs on the already-sharded partitioned graphs and moves tensors between
memories; it changes no value, shape or placement that the sequence-sharding analysis decided.

GPU: the copies run on a side stream of the device (pinned host memory, non_blocking copies, the compute stream
waiting only at ``reload_wait``), so they overlap with compute in both directions.  That code path is written but
untried on a GPU; the device peak and step time it would give are the simulator's prediction, not a measurement.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass

import torch
from torch import fx

from autosp import ops  # noqa: F401 - registers the offload ops
from autosp.costs import nbytes_of
from autosp.passes.joint.checkpointing import attention_segments

log = logging.getLogger(__name__)

OFFLOAD = torch.ops.autosp_testbed.offload_to_host.default
RELOAD = torch.ops.autosp_testbed.reload_from_host.default
RELOAD_WAIT = torch.ops.autosp_testbed.reload_wait.default

OFFLOAD_MIN_BYTES = 4096
"""Saved tensors smaller than this stay on the device (Note [Activation offload]): per-row statistics such as a
norm's reciprocal or an attention's log-sum-exp, which free little and cost a copy each."""

_NO_VC_CHECK = "saved_tensor_with_no_vc_check"
"""AOTAutograd's node.meta flag on saved tensors, read back from the forward's outputs after partitioning."""


@dataclass(frozen=True)
class OffloadPlan:
    """What the pass did to one forward/backward pair."""

    offloaded: tuple[str, ...]
    """Forward nodes whose saved value now lives in host memory between forward and backward."""
    offloaded_bytes: int
    kept: tuple[str, ...]
    """Saved activations kept on the device: first read by the backward before any prefetch point."""
    kept_bytes: int
    segments: int
    """Attention segments of the backward (attention ops + 1)."""

    @property
    def count(self) -> int:
        return len(self.offloaded)


def _is_alias(node: fx.Node) -> bool:
    """Whether ``node``'s output shares its first argument's storage: its schema says the return aliases an input,
    or it is ``_unsafe_view`` (a view whose schema does not say so)."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    if node.target is operator.getitem:  # one output of a view op with several (split, chunk, unbind)
        return _is_alias(node.args[0])
    if node.target is torch.ops.aten._unsafe_view.default:
        return True
    schema = getattr(node.target, "_schema", None)
    return (schema is not None and bool(schema.returns) and schema.returns[0].alias_info is not None
            and not schema.returns[0].alias_info.is_write)


def _root(node: fx.Node) -> fx.Node:
    """The node whose output owns ``node``'s storage (``node`` itself unless it is a view)."""
    while _is_alias(node):
        node = node.args[0]
    return node


def _chain(node: fx.Node, root: fx.Node) -> list[fx.Node] | None:
    """The view ops from ``root`` to ``node``, first to last; None if one reads another node besides its base (it
    cannot be replayed in backward from the base alone)."""
    chain = []
    while node is not root:
        if any(isinstance(a, fx.Node) for a in (*node.args[1:], *node.kwargs.values())):
            return None
        chain.append(node)
        node = node.args[0]
    return chain[::-1]


def _offloadable(root: fx.Node) -> bool:
    value = root.meta.get("val")
    return (root.op == "call_function" and isinstance(value, torch.Tensor)
            and (value.is_floating_point() or value.is_complex()) and nbytes_of(value) >= OFFLOAD_MIN_BYTES)


def offload_saved_activations(fw: fx.GraphModule, bw: fx.GraphModule, *, num_fwd_outputs: int) -> OffloadPlan:
    """Rewrite a partitioned forward/backward pair in place (Note [Activation offload]); ``num_fwd_outputs``: the
    forward's outputs before its saved tensors (AOTAutograd's partitioner argument)."""
    fw_output = next(iter(fw.graph.find_nodes(op="output")))
    outputs = list(fw_output.args[0])
    fw_nodes = list(fw.graph.nodes)
    fw_order = {n: i for i, n in enumerate(fw_nodes)}
    aliases: dict[fx.Node, list[fx.Node]] = {}  # storage root -> every forward node sharing its storage
    for node in fw_nodes:
        aliases.setdefault(_root(node), []).append(node)
    user_roots = {_root(n) for n in outputs[:num_fwd_outputs] if isinstance(n, fx.Node)}
    saved_by_root: dict[fx.Node, list[int]] = {}  # storage root -> the output slots of its saved tensors
    for index in range(num_fwd_outputs, len(outputs)):
        if isinstance(outputs[index], fx.Node):
            saved_by_root.setdefault(_root(outputs[index]), []).append(index)
    bw_nodes = list(bw.graph.nodes)
    bw_order = {n: i for i, n in enumerate(bw_nodes)}
    received = {n.name: n for n in bw_nodes if n.op == "placeholder"}
    calls = [n for n in bw_nodes if n.op == "call_function"]
    segments = attention_segments(calls)
    boundaries = [a for a, b in zip(calls, calls[1:], strict=False) if segments[b] > segments[a]]  # attention ops

    offloaded, kept, offloaded_bytes, kept_bytes = [], [], 0, 0
    for root, slots in saved_by_root.items():
        if root in user_roots or not _offloadable(root):
            continue
        members = [outputs[i] for i in slots]
        placeholders = [received.get(m.name) for m in members]
        chains = [_chain(m, root) for m in members]
        if any(p is None or not p.users for p in placeholders) or any(c is None for c in chains):
            continue
        first_reader = min((u for p in placeholders for u in p.users), key=bw_order.__getitem__)
        segment = segments.get(first_reader, len(boundaries))  # the output node reads after every attention
        nbytes = nbytes_of(root.meta["val"])
        if segment == 0:
            kept.append(root.name)
            kept_bytes += nbytes
            continue
        # forward: copy the storage to host after the last reader of any of its aliases; every saved alias's slot
        # returns that copy, so the storage dies in forward
        # (a view of the same storage is not a reader: the partitioner's trailing ``detach`` of a saved tensor,
        # read only by the output, would otherwise hold the storage to the forward's end)
        readers = [u for a in aliases[root] for u in a.users
                   if u is not fw_output and not (_is_alias(u) and _root(u) is root)]
        after = max(readers, key=fw_order.__getitem__) if readers else root
        with fw.graph.inserting_after(after):
            host = fw.graph.call_function(OFFLOAD, (root,))
        host.meta["val"] = OFFLOAD(root.meta["val"])
        if any(m.meta.get(_NO_VC_CHECK) for m in members):
            host.meta[_NO_VC_CHECK] = True
        for i in slots:
            outputs[i] = host
        # backward: fetch ahead of the attention before the first reader, wait right before that reader, then
        # replay each saved alias's views on the reloaded storage
        received_host = placeholders[0]
        device = received_host.meta["val"].device
        with bw.graph.inserting_before(boundaries[segment - 1]):  # the attention op ending the segment before
            reloaded = bw.graph.call_function(RELOAD, (received_host, device))
        reloaded.meta["val"] = RELOAD(host.meta["val"], device)
        with bw.graph.inserting_before(first_reader):
            wait = bw.graph.call_function(RELOAD_WAIT, (reloaded,))
            wait.meta["val"] = None
            for placeholder, chain in zip(placeholders, chains, strict=True):
                value = reloaded
                for view in chain:
                    value_meta = view.target(value.meta["val"], *view.args[1:], **view.kwargs)
                    value = bw.graph.call_function(view.target, (value, *view.args[1:]), dict(view.kwargs))
                    value.meta["val"] = value_meta
                placeholder.replace_all_uses_with(value, delete_user_cb=lambda user, r=reloaded: user is not r)
                placeholder.meta["val"] = host.meta["val"]
        # the forward's views of the storage that only the output read (its saved aliases) are dead now: erased, so
        # that none runs after the copy and keeps the storage alive (after the replay above, which reads them)
        fw_output.args = (tuple(outputs),)
        for view in sorted(aliases[root], key=fw_order.__getitem__, reverse=True):
            if view is not root and not view.users:
                fw.graph.erase_node(view)
        offloaded.append(root.name)
        offloaded_bytes += nbytes
    for gm in (fw, bw):
        gm.graph.lint()
        gm.recompile()
    plan = OffloadPlan(offloaded=tuple(offloaded), offloaded_bytes=offloaded_bytes, kept=tuple(kept),
                       kept_bytes=kept_bytes, segments=len(boundaries) + 1)
    log.info("activation offload: %d saved storage(s), %.2f MiB, moved to host memory; %d (%.2f MiB) kept on the "
             "device (read before the backward's first attention)", plan.count, offloaded_bytes / 2**20, len(kept),
             kept_bytes / 2**20)
    return plan
