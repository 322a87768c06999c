"""Per-rank memory ledger of a DeepSpeed training configuration: which buffer holds how many bytes, and why.

:class:`TrainingConfig` describes the run (optimizer, precision, ZeRO stage, data-parallel degree, bucket sizes,
the parameters' element counts); :func:`memory_ledger` lists the :class:`LedgerLine` s a rank holds, each with a
category, bytes, a low/high band and the source it follows; :func:`summarize` sums them into a per-category
:class:`LedgerSummary` with low / nominal / high totals (``.static_memory()`` turns it into the workload's
:class:`simulator.workload.StaticMemory`). Standard library only.

Note [Which DeepSpeed path holds what]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Followed in the code of deepspeed 0.19.8 with a client torch optimizer (``deepspeed.initialize(optimizer=...)``).
``runtime/engine.py DeepSpeedEngine._do_optimizer_sanity_check`` picks the wrapper:

* ZeRO 0, fp32: none; the torch optimizer updates the module's parameters, ``param.grad`` is freed after the step.
* ZeRO 0, bf16 with bf16 gradient accumulation (the default): ``FP16_UnfusedOptimizer`` (``DDP_BFLOAT16``):
  per-parameter fp32 master copies and optimizer state, unpartitioned, created at initialisation. ZeRO 0 with
  bf16 and fp32 accumulation is rejected by DeepSpeed (``unsupported mix``), so :class:`TrainingConfig` rejects it.
* ZeRO 1, bf16, ``data_types.grad_accum_dtype=fp32``: ``BF16_Optimizer``: one flat bf16 copy of the parameters,
  the fp32 master partition, and an *unpartitioned* fp32 gradient accumulation buffer.
* ZeRO 1/2 otherwise: ``DeepSpeedZeroOptimizer``: flat low-precision parameters, fp32 master partition; gradients
  live only from backward to the step (ipg bucket buffers, reduced partitions).
* ZeRO 3: ``DeepSpeedZeroOptimizer_Stage3``: per-parameter partitions (each padded to the data-parallel degree),
  a flat gradient-partition buffer and one ipg bucket of ``reduce_bucket_size`` elements kept for the run;
  parameters at or under ``param_persistence_threshold`` elements stay gathered after the first forward.

Optimizer state (two fp32 moments for Adam, one momentum buffer for SGD with momentum) is created lazily by the
torch optimizer at the first step, except under ``FP16_UnfusedOptimizer`` (``initialize_optimizer_states`` steps
once at initialisation). Torch's Adam also keeps a 4-byte step counter per parameter tensor it optimizes.
Scalars of a few bytes (overflow flags, norms) are not listed. ``at`` selects the instant: ``"initialize"``
(right after ``deepspeed.initialize``), ``"step"`` (between steps, from the first one on) or ``"backward"`` (inside
a backward pass: plus the gradients that live from backward to the optimizer step, and the buffers that live
only inside backward, ``when="in_backward"``). The test ``tests/simulator/test_ledger_deepspeed.py`` checks all
three against real engines on CPU (``backward`` at the end of a backward pass, without the ``in_backward``
lines).
Device-side lines (CUDA context, NCCL, workspaces, allocator) follow :mod:`simulator.device_reserve`.

Note [Optimizer offload]
~~~~~~~~~~~~~~~~~~~~~~~
``zero_optimization.offload_optimizer.device = "cpu"`` (``TrainingConfig(offload_optimizer=True)``; ZeRO-Offload,
and with ZeRO 3 as ALST ran it) in deepspeed 0.19.8. Lines in host memory have ``pool="host"``; the rest stay on
the device. ZeRO 1/2 (``DeepSpeedZeroOptimizer`` with ``cpu_offload``, ``self.device = 'cpu'``): on the device
the flat low-precision parameters, the ipg buckets (``contiguous_gradients`` is forced on) and one staging buffer of
the largest parameter (``temp_grad_buffer_for_gpu_offload``); each reduced gradient is copied into the host's fp32
gradient partition and its device copy freed (``async_inplace_copy_grad_to_fp32_buffer_from_gpu``), so no
gradient partition stays on the device. On the host the fp32 master partition, its fp32 gradient (allocated at
initialisation and kept), a low-precision copy of the partition (``param_buffer_of_bit16_for_cpu_offload_groups``:
the step writes the updated fp32 partition into it, then copies it to the device), a staging buffer of the
largest parameter (``temp_grad_buffer_for_cpu_offload``), the optimizer state, and with gradient accumulation one
low-precision accumulator per parameter overlapping the partition (``accumulated_grads_in_cpu``). ZeRO 3
(``DeepSpeedZeroOptimizer_Stage3`` with ``offload_optimizer``): on the device the parameter partitions, the
persistent parameters, the ipg bucket and the prefetched parameters; on the host the fp32 master partitions
(``_create_fp32_partitions``), the gradient partitions (``grad_partitions_flat_buffer`` on ``self.device =
'cpu'``), one fp32 gradient buffer per sub-group (``initialize_optimizer_states``) and the optimizer state.
The optimizer is DeepSpeed's CPU Adam (``ops/adam/cpu_adam.py DeepSpeedCPUAdam``: fp32 ``exp_avg`` and
``exp_avg_sq`` like torch's Adam); the test measures it with torch's Adam (``zero_force_ds_cpu_optimizer:
false``), whose state has the same bytes plus a 4-byte step tensor. Pinned host memory (``pin_memory``) is not
modelled (torch's host caching allocator rounds pinned blocks up to a power of two).

Note [DeepSpeed 0.16.3 as the AutoSP fork ran it]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``TrainingConfig(deepspeed="0.16.3")`` follows the DeepSpeed the paper's runs used: the authors' research fork
(GitHub spikerheado1234/AutoSP, commit fd542b43619e03c7454abfcff3b5aaeef05c5318, ``version.txt`` 0.16.3). Its
``runtime/engine.py`` differs from 0.19.8 where it matters here:

* ``get_data_types`` (lines 953-968): without ``data_types.grad_accum_dtype``, bf16 *without ZeRO* accumulates in
  fp32; with ZeRO (stage >= 1) in the model dtype, as 0.19.8 does for every stage.
* ``_do_optimizer_sanity_check`` (lines 1243-1295): ZeRO 0 with bf16 and fp32 accumulation returns ``BFLOAT16``
  (line 1290-1291), so ZeRO 0 + bf16 runs ``BF16_Optimizer`` (``_configure_bf16_optimizer``, lines 1535-1556,
  partitioning over ``seq_data_parallel_group``: every rank when no ``mpu`` is given); ZeRO 0 + bf16 + bf16
  accumulation is refused (lines 1276-1285).
* ``_take_model_step`` (lines 2191-2196): under bf16 without ZeRO it never zeroes gradients, and
  ``BF16_Optimizer.backward`` (``runtime/bf16_optimizer.py`` lines 316-329) frees the bf16 ``param.grad`` only at
  the start of the *next* backward (``clear_lp_grads``), after ``update_hp_grads`` copied them into the fp32
  buffer. So the bf16 gradients are resident between steps and through the next forward (``when="step"``).

``deepspeed="0.19.8"`` (the default) is the installed one, and current DeepSpeed (deepspeedai/DeepSpeed commit
edaa7221267243c7be7fb49c5d5f5c4fb97b4641, ``runtime/engine.py`` ``get_data_types`` lines 1485-1496 and
``_do_optimizer_sanity_check`` line 2019) selects the same wrappers: ZeRO 0 + bf16 gets ``FP16_UnfusedOptimizer``
with unpartitioned fp32 masters and Adam state. Its ``step`` (``runtime/fp16/unfused_optimizer.py`` lines
215-231) converts every gradient to fp32 before the update and frees them after it: that instant is
``at="optimizer_step"`` (lines ``when="in_step"``), about 20 bytes per parameter with Adam.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from simulator.device_reserve import ALLOCATOR_PROVENANCE, UNCERTAIN, Uncertain, reserved_bytes
from simulator.training_config import DTYPE_BYTES, OPTIMIZER_STATES, TrainingConfig
from simulator.workload import StaticMemory

DS = "deepspeed 0.19.8 "
DS016 = "deepspeed 0.16.3 (spikerheado1234/AutoSP fd542b4) "
POOLS = ("device", "host")
CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "logits/loss", "communication buffers",
              "runtime", "allocator")
_AT = ("initialize", "step", "backward", "optimizer_step")


@dataclass(frozen=True, kw_only=True)
class LedgerLine:
    """One buffer (or family of same-purpose tensors) a rank holds."""

    category: str
    """One of :data:`CATEGORIES`."""
    name: str
    bytes: int
    """Nominal bytes."""
    low: int
    high: int
    provenance: str
    """The code or public source the line follows (or ``assumption: ...``)."""
    when: str = "initialize"
    """Allocated at ``initialize``, at the first ``step`` (then resident), during ``backward`` (alive at its end,
    freed by the step), ``in_backward`` (alive only inside backward: ipg buckets, prefetched parameters) or
    ``in_step`` (alive only inside the optimizer step)."""
    tensor_bytes: tuple[int, ...] = ()
    """Sizes of the individual allocations (for allocator rounding); empty for non-tensor memory."""
    pool: str = "device"
    """``device`` (accelerator memory) or ``host`` (CPU memory: Note [Optimizer offload])."""
    in_workload: bool = False
    """Held over time by a simulated workload's program when there is one (Note [Gradients the program holds] in
    simulator/training_step.py)."""


@dataclass(frozen=True, kw_only=True)
class LedgerSummary:
    """Totals of a ledger."""

    by_category: Mapping[str, tuple[int, int, int]]
    """Category -> (low, nominal, high) bytes, for every category in :data:`CATEGORIES`."""
    low: int
    nominal: int
    high: int

    def static_memory(self, which: str = "nominal") -> StaticMemory:
        """The totals as a workload's static memory (``which``: low, nominal or high)."""
        idx = ("low", "nominal", "high").index(which)
        get = {c: v[idx] for c, v in self.by_category.items()}
        other = sum(v for c, v in get.items() if c not in ("parameters", "gradients", "optimizer"))
        return StaticMemory(parameter_bytes=get["parameters"], gradient_bytes=get["gradients"],
                            optimizer_bytes=get["optimizer"], other_bytes=other)


def _line(category: str, name: str, tensors: Sequence[int], provenance: str, when: str = "initialize",
          pool: str = "device", in_workload: bool = False) -> LedgerLine:
    total = int(sum(tensors))
    return LedgerLine(category=category, name=name, bytes=total, low=total, high=total, provenance=provenance,
                      when=when, tensor_bytes=tuple(int(t) for t in tensors), pool=pool, in_workload=in_workload)


def _ceil_to(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _overlapping_numel(numels: Sequence[int], partition: int) -> int:
    """Largest, over ranks, total element count of the parameters overlapping a rank's flat partition."""
    offset, ranks = 0, {}
    for numel in numels:
        for r in range(offset // partition, (offset + numel - 1) // partition + 1):
            ranks[r] = ranks.get(r, 0) + numel
        offset += numel
    return max(ranks.values(), default=0)


def _framework_lines(cfg: TrainingConfig) -> list[LedgerLine]:
    lp, acc, d = DTYPE_BYTES[cfg.precision], DTYPE_BYTES[cfg.accum_dtype], cfg.dp_world_size
    numels, n, states = cfg.parameter_numels, cfg.parameter_count, OPTIMIZER_STATES[cfg.optimizer]
    counter = cfg.optimizer in ("adam", "adamw")
    wrapper = cfg.wrapper
    lines: list[LedgerLine] = []

    def optimizer_state(partition: Sequence[int], where: str, when: str = "step", pool: str = "device",
                        dtype: str = "fp32") -> None:
        for k in range(states):
            lines.append(_line("optimizer", f"optimizer state {k + 1}/{states} ({dtype})",
                               [DTYPE_BYTES[dtype] * e for e in partition],
                               f"torch.optim.{cfg.optimizer}: lazily created state on {where}", when, pool))
        if counter:
            lines.append(_line("optimizer", "Adam step counters", [4] * len(partition),
                               "torch.optim.Adam: one fp32 scalar 'step' tensor per optimized tensor", when, pool))

    if wrapper == "torch, sharded":
        shards = [-(-e // d) for e in numels]
        lines.append(_line("parameters", f"{cfg.precision} parameter shards", [lp * e for e in shards],
                           "autosp/parameter_sharding.py: each parameter a flat 1/N shard, padded to a multiple of N"))
        lines.append(_line("gradients", f"{cfg.precision} shard .grad", [lp * e for e in shards],
                           "autosp/parameter_sharding.py: the gather's reduce-scatter leaves each rank its shard's "
                           "gradient; set to None by the loop's zero_grad", "backward"))
        optimizer_state(shards, "each shard, in its dtype", dtype=cfg.precision)
    elif wrapper == "torch":
        lines.append(_line("parameters", "fp32 parameters", [4 * e for e in numels], "the module's parameters"))
        lines.append(_line("gradients", "fp32 param.grad", [4 * e for e in numels],
                           DS + "runtime/engine.py DeepSpeedEngine.allreduce_gradients reduces param.grad in place; "
                           "_take_model_step -> DeepSpeedEngine.zero_grad sets it to None", "backward",
                           in_workload=cfg.gradients_in_program))
        optimizer_state(numels, "each parameter")
    elif wrapper == "FP16_UnfusedOptimizer":
        lines.append(_line("parameters", f"{cfg.precision} parameters", [lp * e for e in numels],
                           "the module's parameters (cast by DeepSpeedEngine._configure_distributed_model)"))
        lines.append(_line("optimizer", "fp32 master parameters (unpartitioned)", [4 * e for e in numels],
                           DS + "runtime/fp16/unfused_optimizer.py FP16_UnfusedOptimizer.__init__: fp32_groups = "
                           "p.clone().float() per parameter"))
        optimizer_state(numels, "the fp32 masters, created by FP16_UnfusedOptimizer.initialize_optimizer_states",
                        "initialize")
        lines.append(_line("gradients", f"{cfg.precision} param.grad", [lp * e for e in numels],
                           DS + "runtime/fp16/unfused_optimizer.py FP16_UnfusedOptimizer.step: fp16 grads set to None "
                           "after the update", "backward", in_workload=cfg.gradients_in_program))
        lines.append(_line("gradients", "fp32 copies of the gradients (optimizer step)", [4 * e for e in numels],
                           DS + "runtime/fp16/unfused_optimizer.py FP16_UnfusedOptimizer.step: fp32_param.grad = "
                           "fp16_param.grad.to(fp32) for every parameter before optimizer.step, set to None after "
                           "(deepspeedai/DeepSpeed edaa722 lines 215-231)", "in_step"))
    elif wrapper == "BF16_Optimizer":
        flat = _ceil_to(n, 2 * d)
        fork = cfg.deepspeed == "0.16.3"
        source = DS016 if fork else DS
        where = source + "runtime/bf16_optimizer.py BF16_Optimizer._setup_for_real_optimizer: "
        lines.append(_line("parameters", "flat bf16 parameters (unpartitioned)", [2 * flat],
                           where + "bf16_groups_flat, aligned to nccl_start_alignment_factor(2) x dp"))
        lines.append(_line("optimizer", "fp32 master partition", [4 * flat // d],
                           where + "fp32_groups_flat_partition = bf16 partition .clone().float()"))
        lines.append(_line("gradients", "fp32 gradient accumulation buffer (unpartitioned)", [4 * flat],
                           where + "fp32_groups_gradients_flat = zeros_like(bf16_groups_flat, grad_acc_dtype)"))
        optimizer_state([flat // d], "the fp32 master partition")
        if fork and cfg.zero_stage == 0:
            lines.append(_line("gradients", "bf16 param.grad (kept until the next backward)", [2 * e for e in numels],
                               DS016 + "runtime/engine.py _take_model_step lines 2191-2196 (bf16 without ZeRO: no "
                               "zero_grad); runtime/bf16_optimizer.py BF16_Optimizer.backward lines 316-329 frees them "
                               "by clear_lp_grads at the start of the next backward", "step"))
        else:
            lines.append(_line("gradients", "bf16 param.grad", [2 * e for e in numels],
                               source + "runtime/bf16_optimizer.py BF16_Optimizer.update_hp_grads accumulates them "
                               "into the fp32 buffer; DeepSpeedEngine.zero_grad frees them after the step", "backward"))
    elif wrapper == "DeepSpeedZeroOptimizer" and cfg.offload_optimizer:
        lines += _zero12_offload_lines(cfg)
        optimizer_state([_ceil_to(n, 2 * d) // d], "the fp32 master partition in host memory (DeepSpeedCPUAdam: "
                        "ops/adam/cpu_adam.py step)", pool="host")
    elif wrapper == "DeepSpeedZeroOptimizer":
        flat = _ceil_to(n, 2 * d)
        where = DS + "runtime/zero/stage_1_and_2.py DeepSpeedZeroOptimizer.__init__: "
        lines.append(_line("parameters", f"flat {cfg.precision} parameters (unpartitioned)", [lp * flat],
                           where + "bit16_groups_flat, aligned to nccl_start_alignment_factor(2) x dp"))
        lines.append(_line("optimizer", "fp32 master partition", [4 * flat // d],
                           where + "single_partition_of_fp32_groups"))
        optimizer_state([flat // d], "the fp32 master partition")
        buffers = 2 if cfg.overlap_comm else 1
        lines.append(_line("communication buffers", "ipg gradient bucket(s)",
                           [lp * min(cfg.reduce_bucket_size, flat)] * buffers,
                           DS + "runtime/zero/stage_1_and_2.py DeepSpeedZeroOptimizer.setup_buckets: "
                           "reduce_bucket_size elements, doubled under overlap_comm; released by the end of "
                           "backward (_release_ipg_buffers)", "in_backward"))
        if cfg.accum_dtype == "fp32" and cfg.precision != "fp32":
            lines.append(_line("gradients", "fp32 gradient partition", [4 * flat // d],
                               DS + "runtime/zero/stage_1_and_2.py DeepSpeedZeroOptimizer."
                               "_build_compact_grad_partition_buffer (fp32 accumulation); freed by the step",
                               "backward"))
        else:
            lines.append(_line("gradients", "gradients of the parameters overlapping the partition",
                               [lp * _overlapping_numel(numels, flat // d)],
                               DS + "runtime/zero/stage_1_and_2.py DeepSpeedZeroOptimizer.copy_grads_in_partition: "
                               "grads_in_partition holds every parameter that overlaps the rank's partition "
                               "(worst rank); freed by the step", "backward"))
    else:
        parts = [-(-e // d) for e in numels]
        flat = sum(parts)
        where = DS + "runtime/zero/stage3.py DeepSpeedZeroOptimizer_Stage3."
        lines.append(_line("parameters", f"{cfg.precision} parameter partitions", [lp * flat],
                           where + "_create_fp16_partitions_with_defragmentation: lp_param_buffer, each parameter "
                           "padded to a multiple of dp (partition_numel)"))
        persistent = [lp * p * d for e, p in zip(numels, parts, strict=True) if e <= cfg.param_persistence_threshold]
        lines.append(_line("parameters", "persistent parameters, gathered", persistent,
                           DS + "runtime/zero/parameter_offload.py mark_persistent_parameters: ds_numel <= "
                           "param_persistence_threshold stay gathered after the first forward", "step"))
        host = "host" if cfg.offload_optimizer else "device"
        on = " on self.device = 'cpu' (offload_optimizer)" if cfg.offload_optimizer else ""
        lines.append(_line("optimizer", "fp32 master partition", [4 * flat],
                           where + "_create_fp32_partitions: fp32_partitioned_groups_flat" + on, pool=host))
        lines.append(_line("gradients", f"{cfg.accum_dtype} gradient partitions", [acc * flat],
                           where + "_setup_for_real_optimizer: grad_partitions_flat_buffer "
                           "(gradient_accumulation_dtype)" + on, pool=host))
        if cfg.offload_optimizer:
            lines.append(_line("gradients", "fp32 gradient of the master partition", [4 * flat],
                               where + "initialize_optimizer_states: subgroup_gradient_buffer per sub-group, kept "
                               "as fp32_partitioned_groups_flat[i].grad under offload_optimizer", pool=host))
        lines.append(_line("communication buffers", "ipg gradient bucket", [lp * cfg.reduce_bucket_size],
                           where + "_setup_for_real_optimizer: ipg bucket buffer of reduce_bucket_size elements"))
        optimizer_state([flat], "the fp32 master partition", pool=host)
        lines.append(_line("communication buffers", "gathered parameters in flight",
                           [lp * min(cfg.prefetch_bucket_size, n)],
                           DS + "runtime/zero/partitioned_param_coordinator.py: prefetch up to "
                           "stage3_prefetch_bucket_size elements (not checked by the test)", "in_backward"))
    return [ln for ln in lines if ln.bytes or ln.tensor_bytes]


def _zero12_offload_lines(cfg: TrainingConfig) -> list[LedgerLine]:
    """ZeRO 1/2 with ``offload_optimizer`` (Note [Optimizer offload])."""
    lp, d, numels = DTYPE_BYTES[cfg.precision], cfg.dp_world_size, cfg.parameter_numels
    flat = _ceil_to(cfg.parameter_count, 2 * d)
    part, largest = flat // d, max(numels)
    where = DS + "runtime/zero/stage_1_and_2.py DeepSpeedZeroOptimizer."
    lines = [
        _line("parameters", f"flat {cfg.precision} parameters (unpartitioned)", [lp * flat],
              where + "__init__: bit16_groups_flat, aligned to nccl_start_alignment_factor(2) x dp"),
        _line("communication buffers", "ipg gradient bucket(s)",
              [lp * min(cfg.reduce_bucket_size, flat)] * (2 if cfg.overlap_comm else 1),
              where + "setup_buckets: reduce_bucket_size elements (contiguous_gradients forced on by cpu_offload); "
              "released by the end of backward", "in_backward"),
        _line("gradients", "gradient staging buffer (largest parameter)", [lp * largest],
              where + "__init__: temp_grad_buffer_for_gpu_offload, largest parameter's numel, on the accelerator"),
        _line("optimizer", "fp32 master partition", [4 * part],
              where + "__init__: single_partition_of_fp32_groups on self.device = 'cpu' (cpu_offload)", pool="host"),
        _line("gradients", "fp32 gradient partition", [4 * part],
              where + "initialize_optimizer_states: single_partition_of_fp32_groups[i].grad, kept under cpu_offload; "
              "async_inplace_copy_grad_to_fp32_buffer_from_gpu copies each reduced gradient into it", pool="host"),
        _line("parameters", f"{cfg.precision} partition staging buffer", [lp * part],
              where + "__init__: param_buffer_of_bit16_for_cpu_offload_groups (step: fp32 partition -> it -> the "
              "device's bit16 partition)", pool="host"),
        _line("gradients", "host gradient staging buffer (largest parameter)", [lp * largest],
              where + "__init__: temp_grad_buffer_for_cpu_offload, largest parameter's numel", pool="host"),
    ]
    if cfg.gradient_accumulation_steps > 1:
        lines.append(_line("gradients", "gradient accumulators of the partition's parameters",
                           [lp * _overlapping_numel(numels, part)],
                           where + "async_accumulate_grad_in_cpu_via_gpu: accumulated_grads_in_cpu, one buffer per "
                           "parameter overlapping the partition (whole parameter), kept across steps", "step",
                           pool="host"))
    return lines


def _band_line(category: str, name: str, u: Uncertain, count: float, when: str = "initialize",
               pool: str = "device") -> LedgerLine:
    return LedgerLine(category=category, name=name, bytes=int(u.nominal * count), low=int(u.low * count),
                      high=int(u.high * count), provenance=u.provenance, when=when, pool=pool)


def memory_ledger(cfg: TrainingConfig, *, at: str = "step", device: bool = True,
                  activation_bytes: int | None = None, logits_bytes: int = 0,
                  uncertain: Mapping[str, Uncertain] | None = None, host_activation_bytes: int = 0) -> list[LedgerLine]:
    """Every buffer one rank holds at instant ``at`` (``initialize``, ``step``, ``backward`` or ``optimizer_step``,
    inside the optimizer step with the gradients; Note [Which DeepSpeed path holds what]).

    ``device=False`` (or ``cfg.gpu_process=False``: a CPU process) leaves out what only a GPU process holds (CUDA
    context, NCCL, workspaces, allocator, the host process allowance). ``activation_bytes`` / ``logits_bytes`` (a
    simulated workload's peak above static memory) add lines the fragmentation band applies to; given
    ``activation_bytes`` (0 included), lines such a workload holds itself are left out (``LedgerLine.in_workload``).
    ``host_activation_bytes`` (a simulated workload's host peak: Note [Host tensors] in
    simulator/workload_types.py) adds a host line; under optimizer offload some lines are in host memory too
    (Note [Optimizer offload]). :func:`summarize` sums one pool; the allocator lines count device tensors only.
    ``uncertain`` replaces :data:`simulator.device_reserve.UNCERTAIN` (sensitivity studies).
    """
    if at not in _AT:
        raise ValueError(f"at must be one of {_AT}, got {at!r}")
    keep = {"initialize": ("initialize",), "step": ("initialize", "step"), "backward": ("initialize", "step",
            "backward", "in_backward"), "optimizer_step": ("initialize", "step", "backward", "in_step")}[at]
    framework = [ln for ln in _framework_lines(cfg) if ln.when in keep]
    lines = [ln for ln in framework if activation_bytes is None or not ln.in_workload]
    if activation_bytes:
        held = " and parameter gradients" if len(lines) < len(framework) else ""
        lines.append(_line("activations", f"activations{held} (simulated workload)", [activation_bytes],
                           f"simulated workload: peak live tensors above static memory{held}", "backward"))
    if logits_bytes:
        lines.append(_line("logits/loss", "logits and loss (simulated workload)", [logits_bytes],
                           "simulated workload", "backward"))
    if host_activation_bytes:
        lines.append(_line("activations", "offloaded activations (simulated workload)", [host_activation_bytes],
                           "simulated workload: peak live host tensors", "backward", pool="host"))
    if not device or not cfg.gpu_process:
        return lines
    table = UNCERTAIN if uncertain is None else uncertain
    lines.append(_band_line("runtime", "CUDA context and kernel images", table["cuda_context_bytes"], 1))
    lines.append(_band_line("communication buffers", "NCCL communicator buffers",
                            table["nccl_bytes_per_communicator"], cfg.nccl_communicators))
    lines.append(_band_line("runtime", "cuBLAS workspaces", table["workspace_bytes_per_stream"], cfg.compute_streams))
    tensors = [t for ln in lines if ln.pool == "device" for t in ln.tensor_bytes]
    rounding = sum(reserved_bytes(t) - t for t in tensors)
    lines.append(LedgerLine(category="allocator", name="caching-allocator rounding", bytes=rounding, low=rounding,
                            high=rounding, provenance=ALLOCATOR_PROVENANCE, when="initialize"))
    churn = sum(ln.bytes for ln in lines if ln.when in ("backward", "in_backward") and ln.pool == "device")
    lines.append(_band_line("allocator", "fragmentation", table["fragmentation_fraction"], churn, "backward"))
    if cfg.offload_optimizer or host_activation_bytes:
        lines.append(_band_line("runtime", "host process (Python, PyTorch, CUDA libraries)",
                                table["host_process_bytes"], 1, pool="host"))
    return lines


def summarize(lines: Sequence[LedgerLine], pool: str = "device") -> LedgerSummary:
    """Per-category (low, nominal, high) bytes and the totals of the lines in ``pool`` (``device``, ``host`` or
    ``all``: both, as one process on a CPU holds them)."""
    if pool not in (*POOLS, "all"):
        raise ValueError(f"pool must be one of {(*POOLS, 'all')}, got {pool!r}")
    by = {c: [0, 0, 0] for c in CATEGORIES}
    for ln in lines:
        if ln.category not in by:
            raise ValueError(f"unknown ledger category {ln.category!r}; use one of {CATEGORIES}")
        if pool not in ("all", ln.pool):
            continue
        for i, v in enumerate((ln.low, ln.bytes, ln.high)):
            by[ln.category][i] += v
    totals = [sum(v[i] for v in by.values()) for i in range(3)]
    return LedgerSummary(by_category={c: tuple(v) for c, v in by.items()}, low=totals[0], nominal=totals[1],
                         high=totals[2])


def format_ledger(lines: Sequence[LedgerLine]) -> str:
    """A plain-text table: one row per line (host-memory lines marked), then the per-category summary of each
    pool (GiB)."""
    rows = [f"{ln.category:22s} {ln.name + (' [host]' if ln.pool == 'host' else ''):48s} {ln.bytes / 2**30:9.3f} "
            f"[{ln.low / 2**30:.3f}, {ln.high / 2**30:.3f}]" for ln in lines]
    for pool in POOLS:
        if pool == "host" and not any(ln.pool == "host" for ln in lines):
            continue
        summary = summarize(lines, pool)
        rows.append("-" * 96)
        for cat, (lo, nom, hi) in summary.by_category.items():
            if hi:
                rows.append(f"{cat:71s} {nom / 2**30:9.3f} [{lo / 2**30:.3f}, {hi / 2**30:.3f}]")
        rows.append(f"{'total' if pool == 'device' else 'host total':71s} {summary.nominal / 2**30:9.3f} "
                    f"[{summary.low / 2**30:.3f}, {summary.high / 2**30:.3f}]")
    return "\n".join(rows)
