"""The rest of a training step: DeepSpeed's gradient reduction and the optimizer step, added to any workload.

An exported workload ends with the backward pass. :func:`add_training_step` appends what DeepSpeed does next for
a :class:`simulator.ledger.TrainingConfig`, given which ops produce the parameters' gradients
(:class:`GradientReady`: an op id and the gradient's element count, e.g. from ``autosp.export.module_parameters``):
gradient reductions bucketed and overlapped as the configuration's DeepSpeed path does them, then a memory-bound
optimizer pass over the rank's shard of fp32 state and, where the path needs it, the all-gather of the updated
low-precision parameters. Only time is added: the buffers these steps use are in the memory ledger. Do not apply
it to a workload that already reduces its gradients (e.g. a ZeRO-3 rewrite with its own reduce-scatters).

Note [DeepSpeed gradient reduction]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Followed in deepspeed 0.19.8 (see Note [Which DeepSpeed path holds what] in :mod:`simulator.ledger`):

* ZeRO 0 and ``BF16_Optimizer``: after backward returns, ``runtime/engine.py DeepSpeedEngine.allreduce_gradients``
  -> ``buffered_allreduce_fallback`` all-reduces the gradients (``BF16_Optimizer.get_grads_for_reduction``: its
  fp32 accumulation buffer) in flat buckets of ``MEMORY_OPT_ALLREDUCE_SIZE`` = 5e8 elements, on the compute
  stream: blocking, not overlapped with backward.
* ``DeepSpeedZeroOptimizer`` (ZeRO 1/2) and ZeRO 3: backward hooks copy each gradient into an ipg bucket; when the
  next gradient would overflow ``reduce_bucket_size`` elements the bucket is reduced to the partition owners
  (``average_tensor`` / ``__reduce_and_partition_ipg_grads``: a reduce-scatter) - on the compute stream, or with
  ``overlap_comm`` on a side stream (DeepSpeed's default: on for ZeRO 3 only) with two buffers: the hook that
  starts filling bucket k first waits for bucket k-2's reduction, stalling backward when communication falls
  behind (ZeRO 3 keeps one buffer and copies out; the two-buffer rule is used for it too). The last partial
  bucket is reduced at the end of backward.
* Then the optimizer: one elementwise pass over the rank's fp32 shard (Adam reads parameter, gradient and two
  moments, writes parameter and moments, and writes the low-precision copy), and for ZeRO 1/2 and
  ``BF16_Optimizer`` the all-gather of the updated low-precision partitions (``all_gather_dp_groups``: the flat
  partition in ``max(1, flat_numel // allgather_bucket_size)`` shards).

Note [Optimizer offload traffic]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``offload_optimizer`` (Note [Optimizer offload] in :mod:`simulator.ledger`) each reduced bucket's share of
the rank's partition goes to host memory as soon as its reduction completes, as a ``to_host`` copy on the rank's
own ``host`` stream (group :data:`HOST_GROUP`, one rank per instance) over the preset's host-memory link: in
fp32 under ZeRO 1/2 (``stage_1_and_2.py async_inplace_copy_grad_to_fp32_buffer_from_gpu`` casts on the device,
then copies), in the accumulation dtype and again in fp32 under ZeRO 3 (``stage3.py partition_grads`` into
``grad_partitions_flat_buffer``, then ``_offload_grad_partition_at_boundary``). The optimizer step runs on the
CPU (no device op); its time is :func:`host_optimizer_time_s`, an assumption (``host_cpu.adam_elements_per_s`` in
:mod:`simulator.gpu_constants`) that is *not* in the simulated step: add it (nothing overlaps it, so the sum is
the step; ``metadata["training_step"]["host_optimizer_s"]``). Then the updated low-precision partition comes
back (``from_host``, blocking: ZeRO 1/2 copy ``param_buffer_of_bit16_for_cpu_offload_groups`` into the device
partition; ZeRO 3 ``_reassign_or_swap_out_partitioned_parameters``, a blocking copy that converts on the CPU),
before ZeRO 1/2's all-gather. A workload that reduces its own gradients (no :class:`GradientReady` given: the
ZeRO-3 rewrite) sends its whole partition down after its last op.

Note [Gradients the program holds]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Under ZeRO 0 with the torch optimizer or ``FP16_UnfusedOptimizer`` and one micro-step per step
(``TrainingConfig.gradients_in_program``), ``param.grad`` is the tensor the backward op returns: it exists from that
op on, is reduced in place after backward and freed after the step. A simulated program built from an exported trace
(`place_gradients`) keeps those tensors where they are made, so its activation peak holds the gradients made by the
peak's instant and no more. Such a line is marked ``in_workload``: ``simulator.ledger.memory_ledger`` counts it
whole when no simulated workload is given and leaves it out when ``activation_bytes`` is (the workload line then
says it holds the gradients). Counting it whole beside the workload's peak, which lies early in backward when few
gradients exist, over-predicted the planner's measured peaks by up to the gradients' bytes (the benchmark ``python
-m experiments.cpu.bench_plan_accuracy``). Every other wrapper copies each gradient into its own buffers at once
(ipg buckets, partitions) or keeps them across steps, and the program releases them at their op
(`release_gradients`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from simulator.gpu_constants import GPU_CONSTANTS
from simulator.ledger import OPTIMIZER_STATES, TrainingConfig
from simulator.workload import HOST_GROUP, Collective, Op, RankProgram, Workload, WorkloadError

MEMORY_OPT_ALLREDUCE_SIZE = 500_000_000
"""deepspeed runtime/engine.py: elements per all-reduce bucket of ``allreduce_gradients``."""
_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True, kw_only=True)
class GradientReady:
    """One parameter's (or module's) gradient: complete when op ``op_id`` ends."""

    op_id: int
    numel: int


@dataclass(frozen=True, kw_only=True)
class ReductionPlan:
    """How a configuration reduces its gradients (see Note [DeepSpeed gradient reduction])."""

    kind: str
    """``all_reduce`` or ``reduce_scatter``."""
    bytes_per_element: int
    bucket_elements: int
    during_backward: bool
    """Buckets are reduced as they fill (backward hooks), not after backward."""
    overlapped: bool
    """On a side stream (``collective_start``), at most two buckets in flight."""
    gather_after_step: bool
    """All-gather the updated low-precision partitions after the step."""
    shard_elements: int
    """Elements of fp32 optimizer state this rank updates."""


def host_optimizer_time_s(cfg: TrainingConfig, elements_per_s: float | None = None) -> float:
    """Time of the optimizer step on the CPU under ``offload_optimizer`` (0 otherwise): the rank's shard at
    ``elements_per_s`` (default the nominal ``host_cpu.adam_elements_per_s``, an assumption)."""
    if not cfg.offload_optimizer:
        return 0.0
    rate = GPU_CONSTANTS["host_cpu.adam_elements_per_s"].nominal if elements_per_s is None else elements_per_s
    return reduction_plan(cfg).shard_elements / rate


def reduction_plan(cfg: TrainingConfig) -> ReductionPlan:
    """The DeepSpeed reduction path of ``cfg``."""
    d, n = cfg.dp_world_size, cfg.parameter_count
    wrapper = cfg.wrapper
    if wrapper in ("torch", "FP16_UnfusedOptimizer", "BF16_Optimizer"):
        grad_dtype = "fp32" if wrapper == "BF16_Optimizer" else cfg.precision
        shard = -(-n // (2 * d)) * 2 if wrapper == "BF16_Optimizer" else n
        return ReductionPlan(kind="all_reduce", bytes_per_element=_BYTES[grad_dtype],
                             bucket_elements=MEMORY_OPT_ALLREDUCE_SIZE, during_backward=False, overlapped=False,
                             gather_after_step=wrapper == "BF16_Optimizer", shard_elements=shard)
    overlap = cfg.overlap_comm if cfg.overlap_comm is not None else cfg.zero_stage == 3
    if cfg.zero_stage == 3:
        shard = sum(-(-e // d) for e in cfg.parameter_numels)
    else:
        shard = -(-n // (2 * d)) * 2
    return ReductionPlan(kind="reduce_scatter", bytes_per_element=_BYTES[cfg.precision],
                         bucket_elements=cfg.reduce_bucket_size, during_backward=True, overlapped=overlap,
                         gather_after_step=cfg.zero_stage in (1, 2), shard_elements=shard)


def gradients_from_modules(program: RankProgram,
                           modules: Sequence[tuple[Sequence[str], int]]) -> list[GradientReady]:
    """One :class:`GradientReady` per module from ``(gradient op names, element count)`` pairs (what
    ``autosp.export.module_parameters`` gives as ``gradients`` and ``parameter_bytes``): ready when the module's
    last gradient op in program order ends. Modules with no gradient op in the program are skipped."""
    position = {op.name: (i, op.id) for i, op in enumerate(program.ops)}
    out = []
    for names, numel in modules:
        found = [position[n] for n in names if n in position]
        if found:
            out.append(GradientReady(op_id=max(found)[1], numel=int(numel)))
    return out


def release_gradients(program: RankProgram, gradient_ops: Iterable[str]) -> RankProgram:
    """``program`` with every tensor the named ops allocate (the parameters' gradients) freed by the op itself.

    DeepSpeed's backward hooks copy each gradient into its own buffers as soon as it is produced (ZeRO 1/2: the
    ipg bucket, ``reduce_independent_p_g_buckets_and_remove_grads``; ZeRO 0: ``param.grad``), and the memory
    ledger (:mod:`simulator.ledger`) prices those buffers; the exported program's gradient tensors would count them
    a second time. ``gradient_ops``: op names, e.g. ``autosp.export.ModuleParameters.gradients``."""
    names = set(gradient_ops)
    freed = {t for op in program.ops for t in op.frees}
    ops = tuple(dataclasses.replace(op, frees=tuple(sorted(set(op.frees) | {t for t in op.allocates if t not in freed})))
                if op.name in names else op for op in program.ops)
    return dataclasses.replace(program, ops=ops)


def place_gradients(workload: Workload, gradient_ops: Iterable[str], cfg: TrainingConfig) -> Workload:
    """``workload`` with its parameters' gradients (the tensors the ``gradient_ops`` allocate) where DeepSpeed
    keeps them under ``cfg``: in the program, from their op to the step, when ``cfg.gradients_in_program``, else
    released at their op (`release_gradients`), the ledger pricing DeepSpeed's own buffers (Note [Gradients the
    program holds] in simulator/ledger.py)."""
    if cfg.gradients_in_program:
        return workload
    names = list(gradient_ops)
    return dataclasses.replace(workload, ranks={r: release_gradients(p, names) for r, p in workload.ranks.items()})


def bucket_gradients(gradients: Sequence[GradientReady], bucket_elements: int) -> list[list[GradientReady]]:
    """Greedy buckets in ready order: a bucket is closed when the next gradient would overflow it (a gradient
    larger than a bucket gets one of its own)."""
    buckets: list[list[GradientReady]] = [[]]
    filled = 0
    for grad in gradients:
        if buckets[-1] and filled + grad.numel > bucket_elements:
            buckets.append([])
            filled = 0
        buckets[-1].append(grad)
        filled += grad.numel
    return [b for b in buckets if b]


def _program_with_step(program: RankProgram, gradients: Sequence[GradientReady], cfg: TrainingConfig,
                       plan: ReductionPlan, group: str) -> RankProgram:
    ops = list(program.ops)
    position = {op.id: i for i, op in enumerate(ops)}
    missing = [g.op_id for g in gradients if g.op_id not in position]
    if missing:
        raise WorkloadError(f"gradient ops {missing[:5]} are not ops of the program; pass GradientReady.op_id of "
                            "the backward ops that produce the gradients")
    ready = sorted(gradients, key=lambda g: position[g.op_id])
    next_id = max((op.id for op in ops), default=-1) + 1
    inserts: dict[int, list[Op]] = {}  # position -> ops inserted right after it
    tail: list[Op] = []

    def new_op(**fields) -> Op:
        nonlocal next_id
        op = Op(id=next_id, **fields)
        next_id += 1
        return op

    backward_end = max((i for i, op in enumerate(ops) if op.phase == "backward"), default=len(ops) - 1)
    starts: list[Op] = []
    waited: set[int] = set()
    offload = cfg.offload_optimizer
    # bytes per partition element sent down (Note [Optimizer offload traffic])
    down = 4 + (_BYTES[cfg.accum_dtype] if cfg.zero_stage == 3 else 0)
    copies: list[Op] = []

    def to_host(k: int, after: int, reduce_op: Op, numel: int) -> None:
        coll = Collective(kind="to_host", group=HOST_GROUP, key=f"grad_to_host_{k}",
                          message_bytes=down * -(-numel // cfg.dp_world_size))
        copies.append(new_op(name=f"grad_to_host_{k}", kind="collective_start", phase="backward",
                             deps=(reduce_op.id,), collective=coll))
        inserts.setdefault(after, []).append(copies[-1])

    for k, bucket in enumerate(bucket_gradients(ready, plan.bucket_elements)):
        first, last = (f(position[g.op_id] for g in bucket) for f in (min, max))
        numel = sum(g.numel for g in bucket)
        coll = Collective(kind=plan.kind, group=group, key=f"grad_{plan.kind}_{k}",
                          message_bytes=plan.bytes_per_element * numel)
        deps = tuple(dict.fromkeys(g.op_id for g in bucket))
        if not plan.overlapped:
            op = new_op(name=f"grad_reduce_{k}", kind="collective", phase="backward", deps=deps, collective=coll)
            at = last if plan.during_backward else max(backward_end, last)
            inserts.setdefault(at, []).append(op)
            if offload:
                to_host(k, at, op, numel)
            continue
        if k >= 2:  # two ipg buffers: filling bucket k reuses bucket k-2's buffer
            old = starts[k - 2]
            inserts.setdefault(first, []).append(new_op(name=f"wait_{old.name}", kind="collective_wait",
                                                        phase="backward", collective=old.collective))
            waited.add(k - 2)
        starts.append(new_op(name=f"grad_reduce_{k}", kind="collective_start", phase="backward", deps=deps,
                             collective=coll))
        inserts.setdefault(last, []).append(starts[-1])
        if offload:
            to_host(k, last, starts[-1], numel)
    for k, start in enumerate(starts):
        if k not in waited:
            tail.append(new_op(name=f"wait_{start.name}", kind="collective_wait", phase="backward",
                               collective=start.collective))
    states = OPTIMIZER_STATES[cfg.optimizer]
    lp = _BYTES[cfg.precision] if cfg.wrapper != "torch" else 0
    n = plan.shard_elements
    if offload and not copies and ops:  # gradients reduced by the workload itself (the ZeRO-3 rewrite): all at once
        copies.append(new_op(name="grad_to_host_0", kind="collective_start", phase="optimizer", deps=(ops[-1].id,),
                             collective=Collective(kind="to_host", group=HOST_GROUP, key="grad_to_host_0",
                                                   message_bytes=down * n)))
        tail.insert(0, copies[-1])
    for copy in copies:
        tail.append(new_op(name=f"wait_{copy.name}", kind="collective_wait", phase="optimizer",
                           collective=copy.collective))
    if offload:  # the step runs on the CPU (host_optimizer_time_s); the updated partition comes back
        tail.append(new_op(name="params_from_host", kind="collective", phase="optimizer",
                           collective=Collective(kind="from_host", group=HOST_GROUP, key="params_from_host",
                                                 message_bytes=_BYTES[cfg.precision] * n)))
    else:
        tail.append(new_op(name="optimizer_step", kind="compute", op_class="elementwise", phase="optimizer",
                           flops=(4 + 3 * states) * n, bytes_read=(8 + 4 * states) * n,
                           bytes_written=(4 + 4 * states + lp) * n))
    if plan.gather_after_step:
        flat = plan.shard_elements * cfg.dp_world_size
        shards = max(1, flat // cfg.allgather_bucket_size)
        for k in range(shards):
            size = plan.shard_elements // shards + (1 if k < plan.shard_elements % shards else 0)
            tail.append(new_op(name=f"param_all_gather_{k}", kind="collective", phase="optimizer",
                               collective=Collective(kind="all_gather", group=group, key=f"param_all_gather_{k}",
                                                     message_bytes=_BYTES[cfg.precision] * size)))
    out: list[Op] = []
    for i, op in enumerate(ops):
        out.append(op)
        out.extend(inserts.get(i, ()))
    return dataclasses.replace(program, ops=tuple(out + tail))


def add_training_step(workload: Workload, gradients: Sequence[GradientReady] | Mapping[int, Sequence[GradientReady]],
                      cfg: TrainingConfig, *, group: str = "dp",
                      group_instances: Sequence[Sequence[int]] | None = None, name: str | None = None) -> Workload:
    """``workload`` followed by DeepSpeed's gradient reduction and optimizer step for ``cfg`` (see Note [DeepSpeed
    gradient reduction]).

    ``gradients``: the gradient-producing ops, for every rank (a sequence) or per rank (a mapping). Collectives run
    on process group ``group`` (the data-parallel group ZeRO partitions over, of ``cfg.dp_world_size`` ranks);
    ``group_instances`` adds it when the workload does not have it.
    """
    groups = dict(workload.groups)
    if group_instances is not None:
        groups[group] = group_instances
        groups = dataclasses.replace(workload, groups=groups).groups  # normalised like any workload's
    if group not in groups:
        raise WorkloadError(f"workload has no process group {group!r}; pass group_instances or another group "
                            f"(has: {sorted(groups)})")
    sizes = {len(inst) for inst in groups[group]}
    if sizes != {cfg.dp_world_size}:
        raise WorkloadError(f"group {group!r} has {sorted(sizes)} ranks per instance but dp_world_size is "
                            f"{cfg.dp_world_size}; they must agree")
    plan = reduction_plan(cfg)
    if cfg.offload_optimizer:
        groups[HOST_GROUP] = [[r] for r in range(workload.world_size)]
        groups = dataclasses.replace(workload, groups=groups).groups
    per_rank = gradients if isinstance(gradients, Mapping) else {r: gradients for r in workload.ranks}
    ranks = {r: _program_with_step(p, per_rank[r], cfg, plan, group) for r, p in workload.ranks.items()}
    return dataclasses.replace(workload, name=name or f"{workload.name}+step", groups=groups, ranks=ranks,
                               metadata={**workload.metadata, "training_step": {
                                   "wrapper": cfg.wrapper, "zero_stage": cfg.zero_stage,
                                   "reduction": plan.kind, "overlapped": plan.overlapped,
                                   "offload_optimizer": cfg.offload_optimizer,
                                   "host_optimizer_s": host_optimizer_time_s(cfg)}})
