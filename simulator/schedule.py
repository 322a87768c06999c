"""Compile a :class:`~simulator.workload.RankProgram` into per-stream instruction lists for the engine.

Each op is placed on a stream: compute ops and ``collective_wait`` on the compute stream, ``collective_start`` on
the comm stream of its group, and a blocking ``collective`` on its comm stream *and* (as a stall) on the compute
stream. Streams run in program order, so a dependency on an earlier op of the same stream is implied and dropped;
what remains are the cross-stream dependencies the engine must wait on (see Note [Cross-stream dependencies]).
Compute durations come from the roofline model, vectorised over the program; on a device that fuses pointwise
chains (the GPU presets) :mod:`simulator.fusion` then prices each chain as one kernel and drops its internal
tensors from the memory timeline. A compiled program depends only on the program and the device, so ranks sharing
a program share one compilation.

Note [Cross-stream dependencies]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
"Op B depends on op A" means B may not begin before A *completes*; a ``collective_start`` or blocking
``collective`` completes when the collective does. A ``collective_wait`` depends on its start. A blocking
collective is issued only once the compute stream reaches it, so its comm-stream entry also depends on the
previous compute-stream op, and its compute-stream stall depends on the collective itself. Ops that something
on another stream waits for are flagged ``notify``: the engine fires their completion event; all other compute
ops run back to back without touching the event queue.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simulator.cost_model import compute_times_s
from simulator.fusion import fuse_program
from simulator.hardware import DeviceSpec
from simulator.workload import HOST_GROUP, RankProgram

COMPUTE, START, WAIT, BLOCKING = 0, 1, 2, 3
KIND_CODES = {"compute": COMPUTE, "collective_start": START, "collective_wait": WAIT, "collective": BLOCKING}
COMPUTE_STREAM = "compute"


def comm_stream_name(group: str) -> str:
    """Name of the comm stream for ``group`` (as shown in results and traces)."""
    return f"comm:{group}"


@dataclass(frozen=True, eq=False)
class CompiledProgram:
    """Stream-level view of one program; all lists are indexed by op position."""

    program: RankProgram
    """The source program."""
    kinds: list[int]
    """Kind code per op (:data:`COMPUTE`, :data:`START`, :data:`WAIT`, :data:`BLOCKING`)."""
    durations_s: list[float]
    """Roofline duration of compute ops (0 for the others)."""
    stream_of: list[str]
    """Stream that executes each op (``compute`` or ``comm:<group>``)."""
    compute_stream: list[int]
    """Positions executed (or stalled on) by the compute stream, in order."""
    comm_streams: dict[str, list[int]]
    """Group -> positions of its collectives, in order."""
    cross_deps: list[tuple[int, ...]]
    """Positions each op must see complete first (its stream predecessors excluded)."""
    stall_deps: dict[int, tuple[int, ...]]
    """Blocking collective position -> what its compute-stream stall waits for (the collective itself)."""
    notify: list[bool]
    """Whether another stream waits for the op's completion."""
    tensor_alloc_pos: dict[int, int]
    """Tensor id -> position of the op that allocates it."""
    tensor_free_pos: dict[int, int]
    """Tensor id -> position of the op that frees it."""


def compile_program(program: RankProgram, device: DeviceSpec) -> CompiledProgram:
    """Compile ``program`` for ``device``. The program must already be valid (see :mod:`simulator.validate`)."""
    ops = program.ops
    n = len(ops)
    kinds = [KIND_CODES[op.kind] for op in ops]
    if device.host_copies_inline:  # the compute stream makes its host copies itself (DeviceSpec)
        kinds = [BLOCKING if k == START and op.collective.group == HOST_GROUP else k
                 for op, k in zip(ops, kinds, strict=True)]
    durations = compute_times_s([op.flops for op in ops], [op.bytes_read + op.bytes_written for op in ops],
                                [op.op_class for op in ops], device, [op.attention_scores for op in ops])
    durations[[k != COMPUTE for k in kinds]] = 0.0
    internal: frozenset[int] = frozenset()
    if device.fuses_pointwise:
        fused = fuse_program(program, device, durations)
        durations, internal = np.asarray(fused.durations_s), fused.internal_tensors
    if device.graph_call_overhead_s:
        # One compiled-graph entry per phase, paid by the phase's first compute op (see DeviceSpec).
        seen_phases: set[str] = set()
        for i, op in enumerate(ops):
            if kinds[i] == COMPUTE and op.phase not in seen_phases:
                seen_phases.add(op.phase)
                durations[i] += device.graph_call_overhead_s
    position = {op.id: i for i, op in enumerate(ops)}
    stream_of = [COMPUTE_STREAM if k in (COMPUTE, WAIT) else comm_stream_name(op.collective.group)
                 for op, k in zip(ops, kinds, strict=True)]
    compute_stream: list[int] = []
    comm_streams: dict[str, list[int]] = {}
    cross: list[tuple[int, ...]] = []
    stall_deps: dict[int, tuple[int, ...]] = {}
    start_of_key: dict[str, int] = {}
    notify = [False] * n
    last_compute = -1
    for pos, op in enumerate(ops):
        kind = kinds[pos]
        stream = stream_of[pos]
        deps = {position[d] for d in op.deps}
        if kind == WAIT:
            deps.add(start_of_key[op.collective.key])
        if kind == BLOCKING and last_compute >= 0:
            deps.add(last_compute)
        # Same-stream predecessors are implied by stream order; a blocking collective's compute-stream
        # predecessors are implied by its dependency on the last compute-stream op.
        keep = tuple(sorted(d for d in deps if stream_of[d] != stream
                            and not (kind == BLOCKING and stream_of[d] == COMPUTE_STREAM and d != last_compute)))
        cross.append(keep)
        for d in keep:
            notify[d] = True
        if kind in (START, BLOCKING):
            start_of_key[op.collective.key] = pos
            comm_streams.setdefault(op.collective.group, []).append(pos)
        if kind in (COMPUTE, WAIT, BLOCKING):
            compute_stream.append(pos)
            last_compute = pos
        if kind == BLOCKING:
            stall_deps[pos] = (pos,)
            notify[pos] = True
    alloc_pos = {t: i for i, op in enumerate(ops) for t in op.allocates if t not in internal}
    free_pos = {t: i for i, op in enumerate(ops) for t in op.frees if t not in internal}
    return CompiledProgram(program=program, kinds=kinds, durations_s=durations.tolist(), stream_of=stream_of,
                           compute_stream=compute_stream, comm_streams=comm_streams, cross_deps=cross,
                           stall_deps=stall_deps, notify=notify, tensor_alloc_pos=alloc_pos,
                           tensor_free_pos=free_pos)
