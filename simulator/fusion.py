"""Price a program's pointwise and reduction chains as the fused kernels Inductor generates for them.

The exported workloads come from ATen graphs with one op per aten call; run eagerly, each elementwise op is its
own kernel that reads its inputs from and writes its output to device memory. On a GPU, ``torch.compile``
(Inductor) fuses chains of pointwise, reduction and data-movement ops into one Triton kernel: the intermediates
stay in registers, only the chain's external inputs and outputs touch HBM, and one launch is paid per kernel.
:func:`fuse_program` applies that model to a :class:`~simulator.workload.RankProgram` using only what the
workload records (op classes, dependencies, tensor ids and sizes), so the simulator stays torch-free. It is used
for devices with :attr:`simulator.hardware.DeviceSpec.fuses_pointwise` (the GPU presets), never for
``cpu-gloo``, whose constants were calibrated on eager graphs. See Note [Fusion groups].

Note [Fusion groups]
~~~~~~~~~~~~~~~~~~~~
Fusible: compute ops of class ``elementwise``, ``reduction`` or ``memory`` (casts, copies, cat, embedding) and
views (compute ops with no FLOPs and no bytes); matmuls, attention, ops of class ``other`` that move data,
collectives and waits are not. Groups are formed greedily in program order, as Inductor's scheduler fuses
producer into consumer: a fusible op joins the group of one of its fusible producers (the latest, in the same
phase) unless that would create a cycle - some other producer of the op, outside the group, depends on the
group (``silu(gate) * up`` fuses across the independent ``up`` matmul; ``pw -> mm -> pw`` does not). Otherwise
it starts a group of its own (a view of an unfused op's output joins nothing). Each group is priced as one kernel:

* memory traffic = the group's external inputs + external outputs. An output is external when a consumer
  outside the group reads it, or it outlives the group (freed by an op outside it, or never: saved activations,
  graph outputs). An input is external when its producer is outside the group; a tensor several members read is
  counted once; bytes an op reads from no tracked tensor (parameters, graph inputs) stay as recorded.
* compute = the sum of the members' vector-unit times; memory efficiency = the lowest of the members' classes.
* one kernel launch.

The group's time is spread over its members in proportion to their unfused roofline times, so the timeline keeps
its order. Internal tensors (produced and consumed only inside the group) are never allocated: they are left out
of the memory timeline, so the peak can only drop. Simplifications: Inductor may split a group with reductions
over different axes into two kernels (we charge one launch), may join an op to several producer groups at once
or fuse horizontally (we join one group); a tensor read through a view is charged at its producer's size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from simulator.hardware import DeviceSpec
from simulator.workload import RankProgram

FUSIBLE_CLASSES = frozenset({"elementwise", "reduction", "memory"})


@dataclass(frozen=True)
class FusedProgram:
    """What fusion changes in one program on one device."""

    durations_s: list[float]
    """Duration per op position: each group's kernel time spread over its members (other ops unchanged)."""
    groups: list[list[int]]
    """Op positions of each fusion group with work to do (views only: no group)."""
    internal_tensors: frozenset[int]
    """Tensor ids never materialised (produced and consumed inside one group)."""
    group_bytes: list[int]
    """External bytes (inputs + outputs) of each group."""


def _is_view(op) -> bool:
    return op.kind == "compute" and op.flops <= 0 and op.bytes_read <= 0 and op.bytes_written <= 0


def _fusible(op) -> bool:
    return op.kind == "compute" and (op.op_class in FUSIBLE_CLASSES or _is_view(op))


def _groups(ops, dep_pos: list[list[int]]) -> list[list[int]]:
    """Greedy fusion in program order (Note [Fusion groups]): a fusible op joins the group of one of its fusible
    producers (the latest) when that creates no cycle, else starts a group of its own."""
    group_of: list[int | None] = [None] * len(ops)
    ancestors = [0] * len(ops)  # bitmask of the groups each op transitively depends on
    groups: list[list[int]] = []
    for pos, op in enumerate(ops):
        anc = 0
        for d in dep_pos[pos]:
            anc |= ancestors[d] | (1 << group_of[d] if group_of[d] is not None else 0)
        ancestors[pos] = anc
        if not _fusible(op):
            continue
        chosen = None
        for d in sorted(dep_pos[pos], reverse=True):
            g = group_of[d]
            if g is None or ops[groups[g][0]].phase != op.phase:
                continue
            # Joining g is legal unless a producer outside g depends on g (g -> outsider -> op: a cycle).
            if all(group_of[e] == g or not ancestors[e] >> g & 1 for e in dep_pos[pos]):
                chosen = g
                break
        if chosen is None:
            if _is_view(op):
                continue  # a view of an unfused op's output starts nothing: its consumer decides
            chosen = len(groups)
            groups.append([])
        groups[chosen].append(pos)
        group_of[pos] = chosen
    return groups


def fuse_program(program: RankProgram, device: DeviceSpec, unfused_s: Sequence[float]) -> FusedProgram:
    """Fusion groups of ``program`` and their kernel times on ``device`` (Note [Fusion groups]).

    ``unfused_s``: each op's roofline duration as an eager kernel (``simulator.cost_model.compute_times_s``).
    """
    ops = program.ops
    position = {op.id: i for i, op in enumerate(ops)}
    dep_pos = [[position[d] for d in op.deps] for op in ops]
    consumers: list[list[int]] = [[] for _ in ops]
    for pos, deps in enumerate(dep_pos):
        for d in deps:
            consumers[d].append(pos)
    free_pos = {t: i for i, op in enumerate(ops) for t in op.frees}
    roots_memo: dict[int, frozenset[int]] = {}

    def roots(pos: int) -> frozenset[int]:
        """Non-view ops whose output ``pos`` is (or aliases)."""
        found = roots_memo.get(pos)
        if found is None:
            found = (frozenset().union(*(roots(d) for d in dep_pos[pos])) if _is_view(ops[pos])
                     else frozenset((pos,)))
            roots_memo[pos] = found
        return found

    def out_bytes(pos: int) -> int:
        return sum(program.tensors.get(t, 0) for t in ops[pos].allocates)

    durations = [float(t) for t in unfused_s]
    groups, group_bytes, internal = [], [], set()
    for comp in _groups(ops, dep_pos):
        members = set(comp)
        work = [p for p in comp if not _is_view(ops[p])]
        if not work:
            continue
        # Reads: subtract every tracked producer's output, then add back the external producers once.
        remainder = 0
        external_producers: set[int] = set()
        for p in work:
            producers = frozenset().union(*(roots(d) for d in dep_pos[p])) if dep_pos[p] else frozenset()
            remainder += max(0, ops[p].bytes_read - sum(out_bytes(q) for q in producers))
            external_producers |= {q for q in producers if q not in members}
        reads = remainder + sum(out_bytes(q) for q in external_producers)
        # Writes: outputs read outside the group or outliving it.
        writes = 0
        for p in work:
            escaped = ops[p].bytes_written - out_bytes(p)  # written bytes with no tracked tensor
            for t in ops[p].allocates:
                users = _users(p, consumers, ops)
                freed_inside = free_pos.get(t) in members
                if freed_inside and users <= members:
                    internal.add(t)
                else:
                    escaped += program.tensors.get(t, 0)
            writes += max(0, escaped)
        compute_s = sum(ops[p].flops / (device.peak_flops_per_s * device.efficiency_for(ops[p].op_class).flops)
                        for p in work)
        mem_eff = min(device.efficiency_for(ops[p].op_class).memory for p in work)
        kernel_s = max(compute_s, (reads + writes) / (device.memory_bandwidth_bytes_per_s * mem_eff))
        kernel_s += device.kernel_launch_overhead_s
        unfused = [durations[p] for p in work]
        total = sum(unfused)
        for p, t in zip(work, unfused, strict=True):
            durations[p] = kernel_s * (t / total if total > 0 else 1.0 / len(work))
        groups.append(sorted(comp))
        group_bytes.append(int(reads + writes))
    return FusedProgram(durations_s=durations, groups=groups, internal_tensors=frozenset(internal),
                        group_bytes=group_bytes)


def _users(pos: int, consumers: list[list[int]], ops) -> set[int]:
    """Ops reading ``pos``'s output, directly or through views (the views themselves excluded)."""
    found: set[int] = set()
    stack = list(consumers[pos])
    seen: set[int] = set()
    while stack:
        c = stack.pop()
        if c in seen:
            continue
        seen.add(c)
        if _is_view(ops[c]):
            stack.extend(consumers[c])
        else:
            found.add(c)
    return found
