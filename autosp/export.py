"""Export a compiled AutoSP program as a simulator Workload (the collective schedule).

Input: the forward and backward aten graphs AOTAutograd produced for one rank
(`CompileReport.aot_graphs`).  Output: `simulator.workload.Workload`, plain data:
every op in program order with its class, FLOPs and bytes, every collective with
its group and message size, and every tensor's size and lifetime.  This module walks
the graphs; a ring attention node's steps are autosp/export_ring.py's (Note [Ring
attention in the export]), and the program being built is autosp/export_program.py's.

Note [Tensor lifetimes in the export]
A node's output is allocated when the node runs and freed after its last user.
Views (view, transpose, slice, expand...) allocate nothing: they extend the
lifetime of the tensor they alias.  An op with several outputs (``meta["val"]`` a
tuple: attention's output and log-sum-exp, its backward's dq, dk, dv, layer norm's
output, mean and rstd, the tiled loss's backward's hidden-state and weight gradients)
allocates one tensor per element, each freed on its own: ``getitem(node, i)`` is
element i, an element nobody reads is freed by the op itself, and a None or
non-tensor element allocates nothing; an element that is a tuple is split the same way,
and a higher-order op without a ``val`` (per-layer checkpointing's RNG wrapper around
attention) takes its elements from its getitems.  (Priced as one tensor of the summed size,
every element would live as long as the longest-lived one, and a rewrite freeing the
op's returned gradients at the op, `simulator.training_step.release_gradients`, would
free the others with them.)  Forward outputs that the backward graph
reads (saved activations: AOTAutograd names the backward placeholder after the
forward node) live until their last use in backward, or to the end of the
backward where the runtime holds the backward's arguments that long (``aot_eager``).
Parameters, gradients and optimizer state are static memory, not tensors.

Note [Outputs and tangents in the export]
AOTAutograd's forward graph returns the model's outputs first (mutated inputs, then what the model returns: the
loss and, for a Hugging Face model, the logits and the KV cache under ``use_cache``), then the tensors it saves
for the backward; the backward takes those saved tensors as placeholders (named after the forward nodes), then
one ``tangents_*`` placeholder per differentiable output (`user_outputs` counts the outputs as the forward's
outputs less the backward's saved placeholders).  Two rules follow.
- The model's outputs belong to the caller.  ``model(...).loss.backward()`` (the Trainer, autosp.train, the
  measured systems of experiments/) drops the output object once the loss is taken, before the backward runs: an
  output the backward does not read is freed at the forward's last op.  A caller that keeps the object
  (``out = model(...); out.loss.backward()``) holds them to the end of the step: ``outputs_held=True``, under
  which they are never freed.  An output the backward reads (also saved) lives as a saved tensor, or to the end
  of the step if held.  (The loss, which the caller keeps to call backward on, is dropped with the others: a
  scalar.)
- A tangent is a real tensor: the gradient of the loss (a scalar one) and, for every output the loss does not
  read, a zero-filled gradient autograd makes before the backward graph runs.  Each tangent placeholder is a
  tensor allocated by the backward's first op and freed at its last use, or at the backward's end where the runtime
  holds the backward's arguments (``saved_freed_at_last_use=False``, as for saved tensors).

Note [Hybrid attention in the export]
A strategy="hybrid" program (Note [Hybrid attention] in autosp/passes/dynamo/attention.py) has both: all-to-alls
on the Ulysses groups and ring attention nodes over the ring groups (size R = P / U).  It is exported as the ring
is, one program per rank, with the ring's steps at ring rank ``rank // U`` and its neighbours the ranks U apart
(``rank ± U`` modulo P, absolute ranks as the send/recv peers want); its all-to-alls go to the workload group
"ulysses", whose instances are the Ulysses groups of U consecutive ranks, and the ring's transfers to
``RING_GROUPS``, whose instances are the ring groups; every other collective (the loss all-reduce) stays on "sp".
Ring ranks, neighbours and both kinds of group are the program's `simulator.workload.SPLayout`'s (``coordinates``,
``ring_neighbours``, ``ulysses_groups``, ``ring_groups``), the layout `autosp.groups.build_groups` made the process
groups of; a ring program is its layout with U = 1.

Note [Activation offload in the export]
Activation offload's ops (`autosp.costs.ACTIVATION_OFFLOAD`, inserted by the offload pass) are device<->host
copies on the rank's host-link stream (group ``simulator.workload.HOST_GROUP``), not kernels:
``offload_to_host(x)`` is a ``collective_start`` of kind ``to_host`` whose output, the host copy, is a host
tensor (``RankProgram.host_tensors``, Note [Host tensors] in simulator/workload_types.py) allocated when the copy is
issued; x, last used by the copy, is freed when the copy completes.  ``reload_from_host(h, device)`` is a
``collective_start`` of kind ``from_host``: its device output is allocated when the copy is issued and h, last
used by it, is freed when it completes.  ``reload_wait`` is the ``collective_wait`` on that copy: the compute
stream stalls there until it completes.  Both copies are issued when the compute stream reaches them (they
depend on the compute op before them: the side stream waits for the current one), so a copy issued early
enough is hidden behind the kernels between it and its wait.

FLOPs: matmuls 2·M·N·K; attention counted here (torch's counter misses the CPU
kernels): forward 4·B·H·Sq·Sk·D, backward 2.5× forward (five matmuls to two),
halved under causal masking; elementwise ops one FLOP per output element.  An op with scratch memory
(the tiled loss's chunk, `autosp.costs.workspace_bytes`) allocates it and frees it itself.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from dataclasses import dataclass

import torch
from torch import fx

from autosp.costs import (
    ACTIVATION_OFFLOAD,
    RING_ATTENTION,
    VIEWS,
    attention_scores_of,
    classify,
    nbytes_of,
    packet_name,
    schema_arg,
    workspace_bytes,
)
from autosp.errors import AutoSPError
from autosp.export_program import RankEmitter
from autosp.export_ring import emit_ring
from simulator.workload import (
    HOST_GROUP,
    RING_GROUPS,
    Collective,
    Op,
    SPKind,
    SPLayout,
    StaticMemory,
    Workload,
)

log = logging.getLogger(__name__)

_COLLECTIVES = {"all_to_all": "all_to_all", "all_reduce_sum": "all_reduce", "all_reduce_sum_sum_grad": "all_reduce",
                "all_reduce_max": "all_reduce", "all_gather": "all_gather"}
"""Blocking collectives of the autosp_testbed namespace -> simulator collective kind."""
_ASYNC_PHASES = {"all_to_all_start": "collective_start", "all_to_all_wait": "collective_wait"}
"""The overlap pass's split all-to-all (see autosp.passes.partitioned.overlap)."""
_HOST_COPIES = dict(zip(ACTIVATION_OFFLOAD[:2], ("to_host", "from_host"), strict=True))
"""Activation offload's copies -> simulator collective kind (Note [Activation offload in the export])."""
_TANGENT = "tangents_"
"""AOTAutograd's name for a backward graph's placeholders that take the gradients of the forward's outputs."""



def _emit_graph(gm: fx.GraphModule, phase: str, em: RankEmitter, live: dict[str, int], *,
                inputs_freed_at_last_use: bool = True, user_outputs: int = 0, outputs_held: bool = False) -> None:
    """Append ``gm``'s ops; ``live`` maps node names of tensors carried across graphs to tensor ids.

    ``inputs_freed_at_last_use=False``: the graph's inputs stay alive until its last op (see Note
    [Tensor lifetimes in the export]).  ``user_outputs``: how many of the graph's outputs, first, are the
    caller's (a forward graph's; the rest it saves for the backward), which live to the forward's end or, with
    ``outputs_held``, to the end of the step (Note [Outputs and tangents in the export])."""
    root: dict[fx.Node, int | None] = {}  # node -> tensor id it aliases (None: static or untracked)
    parts: dict[fx.Node, tuple] = {}  # a multi-output node -> its elements' tensor ids (nested as its value)
    last_use: dict[int, int] = {}
    node_op: dict[fx.Node, int] = {}
    first_op = len(em.ops)
    tangents: list[int] = []  # allocated by autograd at the start of this (backward) graph

    def used_by(node: fx.Node, op_id: int, inputs: list[int | None]) -> None:
        """``node`` ran as op ``op_id``: its inputs are last used there so far, its output from there on."""
        node_op[node] = op_id
        last_use.update({t: op_id for t in inputs if t is not None})
        for tid in (root.get(node), *_flat(parts.get(node, ()))):  # an element nobody reads: freed by the op
            if tid is not None:
                last_use.setdefault(tid, op_id)

    def read_by(node: fx.Node) -> list[int | None]:
        """The tensor ids ``node`` reads: a getitem one element of a multi-output node, others whole nodes."""
        if node.target is operator.getitem and node.args[0] in parts:
            return _flat((parts[node.args[0]][node.args[1]],))
        return [t for a in node.all_input_nodes for t in (_flat(parts[a]) if a in parts else (root.get(a),))]

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            root[node] = live.get(node.name)
            if root[node] is None and node.name.startswith(_TANGENT):  # Note [Outputs and tangents in the export]
                written = nbytes_of(node.meta.get("val"))
                if written:
                    root[node] = em.new_tensor(written)
                    tangents.append(root[node])
            continue
        if node.op == "output":
            outputs = _output_nodes(node)
            carried = outputs[user_outputs:]
            carried_ids = {root.get(a) for a in carried} - {None}
            for arg in carried:  # saved for the backward (a forward graph), or returned (a backward graph)
                tid = root.get(arg)
                if tid is not None:
                    live[arg.name] = tid
                    last_use.pop(tid, None)  # carried into backward: freed there
            for arg in outputs[:user_outputs]:  # the caller's
                tid = root.get(arg)
                if tid is None or tid in carried_ids:
                    continue
                if outputs_held:
                    em.held.add(tid)
                    last_use.pop(tid, None)
                elif em.ops:
                    last_use[tid] = em.ops[-1].id
            continue
        if node.op != "call_function":
            continue
        packet = packet_name(node.target)
        deps = tuple(sorted({node_op[a] for a in node.all_input_nodes if a in node_op}))
        inputs = read_by(node)
        op_id = len(em.ops)
        scores = 0
        if node.target is operator.getitem and node.args[0] in parts:  # element i (a tuple itself: nested)
            element = parts[node.args[0]][node.args[1]]
            root[node] = None if isinstance(element, tuple) else element
            if isinstance(element, tuple):
                parts[node] = element
            kind, op_class, flops, allocates = "compute", "other", 0, ()
            read = written = 0
        elif packet in VIEWS or node.target.__module__ == "_operator":
            root[node] = next((t for t in inputs if t is not None), None)
            kind, op_class, flops, allocates = "compute", "other", 0, ()
            read = written = 0
        else:
            costs = em.node_costs.get(node)
            if costs is None:
                costs = em.node_costs[node] = _node_costs(node, packet, em.masked_fraction)
            value, written, scratch, read, ours, computed = costs
            root[node] = None
            if isinstance(value, (tuple, list)):  # one tensor per element (Note [Tensor lifetimes in the export])
                parts[node] = _element_tensors(em, value)
                allocates = tuple(t for t in _flat(parts[node]) if t is not None)
            else:
                root[node] = em.new_tensor(written) if written else None
                allocates = () if root[node] is None else (root[node],)
            if scratch:  # allocated and freed by this op (the tiled loss's chunk)
                tid = em.new_tensor(scratch)
                allocates += (tid,)
                em.frees_at.setdefault(op_id, []).append(tid)
            if ours and packet in RING_ATTENTION:  # its steps and transfers (Note [Ring attention in the export])
                used_by(node, emit_ring(node, phase, em, deps, allocates), inputs)
                continue
            if ours and packet in _COLLECTIVES:
                kind, op_class, flops = "collective", "other", 0
            elif ours and packet in _ASYNC_PHASES:
                kind, op_class, flops = _ASYNC_PHASES[packet], "other", 0
            elif ours and packet in ACTIVATION_OFFLOAD:  # Note [Activation offload in the export]
                kind, op_class, flops = "collective_wait", "other", 0
                if packet in _HOST_COPIES:  # issued when the compute stream reaches it
                    kind = "collective_start"
                    issuer = next((op.id for op in reversed(em.ops) if op.kind != "collective_start"), None)
                    deps = tuple(sorted({*deps, *(() if issuer is None else (issuer,))}))
                if packet == ACTIVATION_OFFLOAD[0]:
                    em.host_tensors.update(allocates)
            else:
                kind = "compute"
                op_class, flops, scores = computed
        collective = None
        if kind in ("collective", "collective_start"):
            em.collectives += 1
            group = (em.named_groups or {}).get(str(schema_arg(node, "group_name", "")), em.group)
            if packet in _HOST_COPIES:
                group = HOST_GROUP
            collective = Collective(kind=_HOST_COPIES.get(packet) or _COLLECTIVES.get(packet, "all_to_all"),
                                    group=group, message_bytes=read, key=f"{phase}.{node.name}.{em.collectives}")
            em.started[node] = collective
        elif kind == "collective_wait":
            collective = em.started[node.args[0]]
        em.ops.append(Op(id=op_id, name=f"{phase}.{node.name}", kind=kind, op_class=op_class, phase=phase,
                         flops=int(flops), bytes_read=int(read), bytes_written=int(written),
                         attention_scores=scores, deps=deps,
                         allocates=allocates, collective=collective))
        used_by(node, op_id, inputs)
    if tangents and len(em.ops) > first_op:  # made by autograd before the graph runs: live from its first op on
        start = em.ops[first_op]
        em.ops[first_op] = dataclasses.replace(start, allocates=(*tangents, *start.allocates))
        for tid in tangents:
            last_use.setdefault(tid, start.id)
    if not inputs_freed_at_last_use and em.ops:
        inputs = {root[n] for n in gm.graph.nodes if n.op == "placeholder" and root.get(n) is not None}
        last_use.update({tid: em.ops[-1].id for tid in inputs if tid in last_use})
    for tid, op_id in last_use.items():
        if tid not in em.held:
            em.frees_at.setdefault(op_id, []).append(tid)


def _node_costs(node: fx.Node, packet: str, masked_fraction: float | None) -> tuple:
    """What `_emit_graph` reads of a node that allocates, the same on every rank: (value, bytes written, scratch
    bytes, bytes read, an autosp_testbed op, (class, FLOPs, attention scores) of a compute op, None for ours)."""
    value = _value_of(node)
    ours = getattr(node.target, "namespace", None) == "autosp_testbed"
    special = ours and (packet in RING_ATTENTION or packet in _COLLECTIVES or packet in _ASYNC_PHASES
                        or packet in ACTIVATION_OFFLOAD)
    computed = None if special else (*classify(node, masked_fraction=masked_fraction),
                                     attention_scores_of(node, masked_fraction=masked_fraction))
    return (value, nbytes_of(value), workspace_bytes(node),
            sum(nbytes_of(a.meta.get("val")) for a in node.all_input_nodes), ours, computed)


def _element_tensors(em: RankEmitter, value) -> tuple:
    """A new tensor id per tensor of a tuple-valued op's output (None for a non-tensor, a tuple for a tuple)."""
    return tuple(_element_tensors(em, v) if isinstance(v, (tuple, list))
                 else em.new_tensor(nbytes_of(v)) if nbytes_of(v) else None for v in value)


def _flat(elements) -> list[int | None]:
    return [t for e in elements for t in (_flat(e) if isinstance(e, tuple) else (e,))]


def _value_of(node: fx.Node):
    """``node.meta["val"]``; for a node without one whose users are all getitems (a higher-order op such as the
    ``run_with_rng_state`` wrapping a recomputed attention), the tuple its getitems take apart."""
    value = node.meta.get("val")
    if value is None and node.users and all(u.target is operator.getitem for u in node.users):
        elements = [None] * (1 + max(int(u.args[1]) for u in node.users))
        for user in node.users:
            elements[int(user.args[1])] = user.meta.get("val")
        return tuple(elements)
    return value


def _output_nodes(output: fx.Node) -> list[fx.Node | None]:
    """The values a graph's output node returns, in order (None for a constant or a None gradient)."""
    values = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    return [v if isinstance(v, fx.Node) else None for v in values]


def user_outputs(forward: fx.GraphModule, backward: fx.GraphModule) -> int:
    """How many of the forward graph's outputs, first, are the model's (returned to the caller, mutated inputs
    included); the rest are saved for the backward, which takes each as a placeholder before its tangents."""
    returned = _output_nodes(next(n for n in forward.graph.nodes if n.op == "output"))
    saved = [n for n in backward.graph.nodes if n.op == "placeholder" and not n.name.startswith(_TANGENT)]
    if len(saved) > len(returned):
        raise AutoSPError(f"the backward graph takes {len(saved)} saved values but the forward returns only "
                          f"{len(returned)}: pass the forward and backward graphs of one compile")
    return len(returned) - len(saved)


def _ring_nodes(graphs) -> list[fx.Node]:
    return [n for gm in graphs for n in gm.graph.nodes if n.op == "call_function"
            and getattr(n.target, "namespace", None) == "autosp_testbed" and packet_name(n.target) in RING_ATTENTION]


def export_workload(
    aot_graphs: list[tuple[str, fx.GraphModule]],
    *,
    name: str,
    sp_size: int,
    parameter_bytes: int,
    optimizer_bytes_per_parameter_byte: float = 6.0,
    zero_shards: int = 1,
    metadata: dict | None = None,
    saved_freed_at_last_use: bool = True,
    attention_kept_fraction: float | None = None,
    document_ids: torch.Tensor | None = None,
    outputs_held: bool = False,
) -> Workload:
    """One Workload of world ``sp_size`` from the latest forward and backward graphs: symmetric (rank 0's
    program) for a Ulysses program, one program per rank for a ring or hybrid program
    (Note [Ring attention in the export], Note [Hybrid attention in the export]); ``metadata["strategy"]`` says
    which (with ``sp_size`` > 1).

    Static memory: parameters and gradients (same dtype as parameters) and optimizer
    state (default 6 bytes per parameter byte: fp32 Adam moments and master weights
    for bf16 parameters, i.e. 12 bytes per 2-byte parameter), the optimizer state and
    gradients divided over ``zero_shards`` ranks (ZeRO-1/2 across the SP group).
    ``saved_freed_at_last_use``: whether the backward frees each saved activation after
    its last use (Inductor's generated code does) or holds them all until it returns
    (``aot_eager`` does: its boxed call keeps the argument list alive).
    ``attention_kept_fraction``: the fraction of its Sq·Sk scores document-masked attention keeps
    (`CompileReport.attention_kept_fraction`); None prices it as causal.
    ``document_ids``: a ring or hybrid program over packed documents, the traced batch's document ids
    (`CompileReport.document_ids`): the chunk pairs no query reads are left out, as the op skips them; None
    prices every pair the causal ring computes.
    ``outputs_held``: the caller keeps the model's outputs (a Hugging Face model's logits and KV cache) to the
    end of the step (``out = model(...); out.loss.backward()``) rather than dropping them after the forward
    (``model(...).loss.backward()``, the Trainer's and the measured systems' way); Note [Outputs and tangents in the
    export].
    """
    graphs = dict(aot_graphs)
    if "forward" not in graphs or "backward" not in graphs:
        raise ValueError("export needs a forward and a backward graph: run one training step (with backward) first")
    static = StaticMemory(
        parameter_bytes=int(parameter_bytes),
        gradient_bytes=int(parameter_bytes // zero_shards),
        optimizer_bytes=int(parameter_bytes * optimizer_bytes_per_parameter_byte // zero_shards),
    )
    ring = _ring_nodes([graphs["forward"], graphs["backward"]])
    sizes = sorted({int(schema_arg(n, "group_size")) for n in ring})
    ulysses_names = {str(schema_arg(n, "group_name")) for gm in graphs.values() for n in gm.graph.nodes
                     if n.op == "call_function" and getattr(n.target, "namespace", None) == "autosp_testbed"
                     and packet_name(n.target) in ("all_to_all", "all_to_all_start")}
    hybrid = bool(ring and ulysses_names)
    if ring and (len(sizes) != 1 or sp_size % sizes[0] or (not hybrid and sizes != [sp_size])):
        raise AutoSPError(f"the program's ring attention runs over {sizes} ranks but the export was asked for "
                          f"sp_size={sp_size}; pass the sp_size the program was compiled with")
    kind = SPKind.HYBRID if hybrid else SPKind.RING if ring else SPKind.ULYSSES
    layout = SPLayout(kind, sp_size, sp_size // sizes[0] if hybrid else 1 if ring else sp_size)
    everyone = [list(range(sp_size))]
    programs, node_costs = {}, {}
    for rank in range(sp_size) if ring else (0,):  # a ring's neighbours are absolute ranks: a program per rank
        em = RankEmitter(group="sp", masked_fraction=attention_kept_fraction, rank=rank, sp_layout=layout,
                      node_costs=node_costs,
                      document_ids=document_ids if ring else None,
                      named_groups=dict.fromkeys(ulysses_names, "ulysses") if hybrid else None)
        live: dict[str, int] = {}
        _emit_graph(graphs["forward"], "forward", em, live, outputs_held=outputs_held,
                    user_outputs=user_outputs(graphs["forward"], graphs["backward"]))
        _emit_graph(graphs["backward"], "backward", em, live, inputs_freed_at_last_use=saved_freed_at_last_use)
        programs[rank] = em.program(static)
    log.info("exported %d ops (%d collectives), %d tensors%s", len(em.ops), em.collectives, len(em.tensors),
             f" per rank, {sp_size} ranks" if ring else "")
    # Note [Hybrid attention in the export]: the groups are the layout's (simulator.workload.SPLayout)
    groups = {"sp": everyone, **(dict.fromkeys(RING_GROUPS, layout.ring_groups()) if ring else {})}
    if any(p.host_tensors for p in programs.values()):  # Note [Activation offload in the export]
        groups[HOST_GROUP] = [[r] for r in range(sp_size)]
    if hybrid:
        groups["ulysses"] = layout.ulysses_groups()
    strategy = {"strategy": kind.value, **({"ulysses_size": layout.ulysses_size} if hybrid else {})} \
        if sp_size > 1 else {}
    return Workload(name=name, world_size=sp_size, groups=groups, ranks=programs, symmetric=not ring,
                    metadata={"sp_size": sp_size, **strategy, **(metadata or {})})


@dataclass(frozen=True, kw_only=True)
class ModuleParameters:
    """One module's parameters in an exported workload, by op name (see `module_parameters`)."""

    module: str
    """Qualified name: a decoder layer (``model.layers.0``) or a module outside the layers (``lm_head``)."""
    parameter_bytes: int
    """Bytes of its parameters (as traced: the rank's full, unsharded copy)."""
    forward_reads: tuple[str, ...]
    """Forward ops reading one of its parameters (directly or through a view), in program order."""
    backward_reads: tuple[str, ...]
    """Backward ops reading one of its parameters, in program order."""
    gradients: tuple[str, ...]
    """Backward ops allocating its parameters' gradients (the storage behind each gradient output)."""


def _parameter_path(placeholder_name: str) -> str | None:
    """Dynamo's placeholder name of a lifted parameter -> its qualified name (None: not a parameter).

    ``l_args_0_modules_model_modules_layers_modules_0_modules_mlp_modules_up_proj_parameters_weight_``
    -> ``model.layers.0.mlp.up_proj.weight``."""
    head, sep, rest = placeholder_name.partition("_modules_")
    if not sep or "_parameters_" not in rest:
        return None
    modules, _, attribute = rest.rpartition("_parameters_")
    return ".".join(modules.split("_modules_") + [attribute.rstrip("_")])


def _module_of(path: str) -> str:
    """A parameter's unit: its decoder layer (the prefix up to the layer index), else its module."""
    parts = path.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1])


def _readers(node: fx.Node) -> list[fx.Node]:
    """Nodes reading ``node`` directly or through views."""
    found, todo = [], list(node.users)
    while todo:
        user = todo.pop()
        if user.op != "call_function":
            continue
        found.append(user)
        if packet_name(user.target) in VIEWS or user.target.__module__ == "_operator":
            todo.extend(user.users)
    return found


def module_parameters(aot_graphs: list[tuple[str, fx.GraphModule]], dynamo_graph: fx.GraphModule
                      ) -> tuple[ModuleParameters, ...]:
    """Where each module's parameters are read, and their gradients produced, in `export_workload`'s op names.

    Plain data for workload rewrites that move parameters (ZeRO-3).  The forward graph's placeholders are
    Dynamo's graph inputs in order (AOTAutograd's ``primals``), which names them; the backward graph names its
    saved inputs after the forward nodes and returns one gradient per primal.  Modules are ordered by their
    first forward read.
    """
    graphs = dict(aot_graphs)
    forward, backward = graphs["forward"], graphs["backward"]
    inputs = [n for n in dynamo_graph.graph.nodes if n.op == "placeholder"]
    primals = [n for n in forward.graph.nodes if n.op == "placeholder"]
    if len(inputs) != len(primals):
        raise ValueError(f"the forward graph has {len(primals)} inputs but the Dynamo graph {len(inputs)}; pass "
                         "the Dynamo graph these AOTAutograd graphs were compiled from")
    order = {node: i for i, node in enumerate(list(forward.graph.nodes) + list(backward.graph.nodes))}
    saved = {n.name: n for n in backward.graph.nodes if n.op == "placeholder"}
    output = next(n for n in backward.graph.nodes if n.op == "output")
    gradient_of = output.args[0]
    units: dict[str, dict] = {}
    for index, (source, primal) in enumerate(zip(inputs, primals, strict=True)):
        path = _parameter_path(source.name)
        if path is None:
            continue
        unit = units.setdefault(_module_of(path), {"bytes": 0, "fw": set(), "bw": set(), "grad": set()})
        unit["bytes"] += nbytes_of(primal.meta.get("val"))
        unit["fw"].update(_readers(primal))
        if primal.name in saved:
            unit["bw"].update(_readers(saved[primal.name]))
        grad = gradient_of[index] if index < len(gradient_of) else None
        while isinstance(grad, fx.Node) and (packet_name(grad.target) in VIEWS or grad.op != "call_function"):
            grad = grad.args[0] if grad.op == "call_function" and grad.args else None
        if isinstance(grad, fx.Node):
            unit["grad"].add(grad)

    def names(phase: str, nodes) -> tuple[str, ...]:
        return tuple(f"{phase}.{n.name}" for n in sorted(nodes, key=order.__getitem__))

    found = [
        ModuleParameters(module=name, parameter_bytes=u["bytes"], forward_reads=names("forward", u["fw"]),
                         backward_reads=names("backward", u["bw"]), gradients=names("backward", u["grad"]))
        for name, u in units.items() if u["fw"]
    ]
    first = {f"forward.{n.name}": i for i, n in enumerate(forward.graph.nodes)}
    return tuple(sorted(found, key=lambda m: first[m.forward_reads[0]]))
