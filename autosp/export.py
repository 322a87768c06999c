"""Export a compiled AutoSP program as a simulator Workload (the collective schedule).

Input: the forward and backward aten graphs AOTAutograd produced for one rank
(`CompileReport.aot_graphs`).  Output: `simulator.workload.Workload`, plain data:
every op in program order with its class, FLOPs and bytes, every collective with
its group and message size, and every tensor's size and lifetime.

Note [Tensor lifetimes in the export]
A node's output is allocated when the node runs and freed after its last user.
Views (view, transpose, slice, expand...) allocate nothing: they extend the
lifetime of the tensor they alias.  Forward outputs that the backward graph
reads (saved activations: AOTAutograd names the backward placeholder after the
forward node) live until their last use in backward, or to the end of the
backward where the runtime holds the backward's arguments that long (``aot_eager``).
Parameters, gradients and optimizer state are static memory, not tensors.

FLOPs: matmuls 2·M·N·K; attention counted here (torch's counter misses the CPU
kernels): forward 4·B·H·Sq·Sk·D, backward 2.5× forward (five matmuls to two),
halved under causal masking; elementwise ops one FLOP per output element.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import fx

from autosp.costs import VIEWS, attention_scores_of, classify, nbytes_of, packet_name
from simulator.workload import Collective, Op, RankProgram, StaticMemory, Workload

log = logging.getLogger(__name__)

_COLLECTIVES = {"all_to_all": "all_to_all", "all_reduce_sum": "all_reduce"}
"""Blocking collectives of the autosp_testbed namespace -> simulator collective kind."""
_ASYNC_PHASES = {"all_to_all_start": "collective_start", "all_to_all_wait": "collective_wait"}
"""The overlap pass's split all-to-all (see autosp.passes.overlap)."""


@dataclass
class _Emitter:
    """Accumulates one rank's ops and tensors across the forward and backward graphs."""

    group: str

    def __post_init__(self):
        self.ops: list[Op] = []
        self.tensors: dict[int, int] = {}
        self.frees_at: dict[int, list[int]] = {}
        self.collectives = 0
        self.started: dict[fx.Node, Collective] = {}

    def program(self, static: StaticMemory) -> RankProgram:
        ops = [
            Op(**{**_op_fields(op), "frees": tuple(sorted(set(op.frees) | set(self.frees_at.get(op.id, []))))})
            for op in self.ops
        ]
        return RankProgram(ops=tuple(ops), tensors=dict(self.tensors), static_memory=static)


def _op_fields(op: Op) -> dict:
    return {f: getattr(op, f) for f in Op.__dataclass_fields__}


def _emit_graph(gm: fx.GraphModule, phase: str, em: _Emitter, live: dict[str, int], *,
                inputs_freed_at_last_use: bool = True) -> None:
    """Append ``gm``'s ops; ``live`` maps node names of tensors carried across graphs to tensor ids.

    ``inputs_freed_at_last_use=False``: the graph's inputs stay alive until its last op (see Note
    [Tensor lifetimes in the export])."""
    root: dict[fx.Node, int | None] = {}  # node -> tensor id it aliases (None: static or untracked)
    last_use: dict[int, int] = {}
    node_op: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            root[node] = live.get(node.name)
            continue
        if node.op == "output":
            for arg in node.all_input_nodes:
                tid = root.get(arg)
                if tid is not None:
                    live[arg.name] = tid
                    last_use.pop(tid, None)  # carried into backward: freed there
            continue
        if node.op != "call_function":
            continue
        packet = packet_name(node.target)
        deps = tuple(sorted({node_op[a] for a in node.all_input_nodes if a in node_op}))
        inputs = [root.get(a) for a in node.all_input_nodes]
        op_id = len(em.ops)
        scores = 0
        if packet in VIEWS or node.target.__module__ == "_operator":
            root[node] = next((t for t in inputs if t is not None), None)
            kind, op_class, flops, allocates = "compute", "other", 0, ()
            read = written = 0
        else:
            written = nbytes_of(node.meta.get("val"))
            allocates = ()
            root[node] = None
            if written:
                tid = len(em.tensors)
                em.tensors[tid] = written
                root[node] = tid
                allocates = (tid,)
            read = sum(nbytes_of(a.meta.get("val")) for a in node.all_input_nodes)
            ours = getattr(node.target, "namespace", None) == "autosp_testbed"
            if ours and packet in _COLLECTIVES:
                kind, op_class, flops = "collective", "other", 0
            elif ours and packet in _ASYNC_PHASES:
                kind, op_class, flops = _ASYNC_PHASES[packet], "other", 0
            else:
                kind = "compute"
                op_class, flops = classify(node)
                scores = attention_scores_of(node)
        collective = None
        if kind in ("collective", "collective_start"):
            em.collectives += 1
            collective = Collective(kind=_COLLECTIVES.get(packet, "all_to_all"), group=em.group, message_bytes=read,
                                    key=f"{phase}.{node.name}.{em.collectives}")
            em.started[node] = collective
        elif kind == "collective_wait":
            collective = em.started[node.args[0]]
        em.ops.append(Op(id=op_id, name=f"{phase}.{node.name}", kind=kind, op_class=op_class, phase=phase,
                         flops=int(flops), bytes_read=int(read), bytes_written=int(written),
                         attention_scores=scores, deps=deps,
                         allocates=allocates, collective=collective))
        node_op[node] = op_id
        for t in inputs:
            if t is not None:
                last_use[t] = op_id
        if root.get(node) is not None:
            last_use.setdefault(root[node], op_id)
    if not inputs_freed_at_last_use and em.ops:
        inputs = {root[n] for n in gm.graph.nodes if n.op == "placeholder" and root.get(n) is not None}
        last_use.update({tid: em.ops[-1].id for tid in inputs if tid in last_use})
    for tid, op_id in last_use.items():
        em.frees_at.setdefault(op_id, []).append(tid)


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
) -> Workload:
    """One symmetric Workload of world ``sp_size`` from the latest forward and backward graphs.

    Static memory: parameters and gradients (same dtype as parameters) and optimizer
    state (default 6 bytes per parameter byte: fp32 Adam moments and master weights
    for bf16 parameters, i.e. 12 bytes per 2-byte parameter), the optimizer state and
    gradients divided over ``zero_shards`` ranks (ZeRO-1/2 across the SP group).
    ``saved_freed_at_last_use``: whether the backward frees each saved activation after
    its last use (Inductor's generated code does) or holds them all until it returns
    (``aot_eager`` does: its boxed call keeps the argument list alive).
    """
    graphs = dict(aot_graphs)
    if "forward" not in graphs or "backward" not in graphs:
        raise ValueError("export needs a forward and a backward graph: run one training step (with backward) first")
    em = _Emitter(group="sp")
    live: dict[str, int] = {}
    _emit_graph(graphs["forward"], "forward", em, live)
    _emit_graph(graphs["backward"], "backward", em, live, inputs_freed_at_last_use=saved_freed_at_last_use)
    static = StaticMemory(
        parameter_bytes=int(parameter_bytes),
        gradient_bytes=int(parameter_bytes // zero_shards),
        optimizer_bytes=int(parameter_bytes * optimizer_bytes_per_parameter_byte // zero_shards),
    )
    log.info("exported %d ops (%d collectives), %d tensors", len(em.ops), em.collectives, len(em.tensors))
    return Workload(
        name=name, world_size=sp_size, groups={"sp": [list(range(sp_size))]}, ranks={0: em.program(static)},
        symmetric=True, metadata={"sp_size": sp_size, **(metadata or {})},
    )


def trace_fake_step(build_model, *, seq_len: int, sp_size: int, vocab_size: int, rank: int = 0,
                    dtype: torch.dtype = torch.bfloat16, compiler: str = "aot_eager", **options):
    """Compile and run one training step of ``build_model()`` on fake tensors and a fake group.

    Paper-scale graphs without paper-scale memory: the model is built inside a
    FakeTensorMode (parameters have shapes, no storage) and the collectives run on
    a fake process group of ``sp_size`` ranks, so the real AutoSP passes and
    AOTAutograd produce the real forward and backward graphs.  Returns the
    compiled model (its ``report.aot_graphs`` feed `export_workload`) and the
    parameter bytes.  ``options`` are `autosp.compile` options (e.g. checkpointing).
    The process must not have a process group of its own.
    """
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autosp.api import compile as autosp_compile
    from autosp.inputs import prepare_inputs

    if dist.is_initialized():
        raise RuntimeError("trace_fake_step needs a process without a process group (it creates a fake one)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=sp_size)
    try:
        previous = torch.get_default_dtype()
        # Non-fake constants (e.g. an empty KV-cache tensor created in forward) may mix with fakes.
        with FakeTensorMode(allow_non_fake_inputs=True):
            torch.set_default_dtype(dtype)
            try:
                model = build_model()
            finally:
                torch.set_default_dtype(previous)
            ids = torch.randint(0, vocab_size, (1, seq_len))
            inputs = prepare_inputs(ids, labels=ids)
        compiled = autosp_compile(model, sp_size=sp_size, compiler=compiler, **options)
        out = compiled(**inputs)
        (out if isinstance(out, torch.Tensor) else out.loss).backward()
        parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    finally:
        dist.destroy_process_group()
    return compiled, parameter_bytes
