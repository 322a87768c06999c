"""AutoSP through DeepSpeed: ``autosp.deepspeed_initialize`` and the engine it returns.

A DeepSpeed user keeps their training loop::

    engine, optimizer, _, _ = autosp.deepspeed_initialize(model=model, optimizer=optimizer, config=ds_config)
    loss = engine(**autosp.prepare_inputs(input_ids, labels=labels)).loss
    engine.backward(loss)
    engine.step()

with ``"sequence_parallel_size": P`` in the DeepSpeed config (and, optionally,
DeepSpeed's own spelling of the compile settings, ``"compile": {"deepcompile":
true, "passes": ["autosp"]}``, which this project's pass then serves).  The
engine's module is the `SequenceParallelModel`; DeepSpeed's ZeRO stages 0, 1 and 2
reduce its gradients, and ZeRO stage 3 is AutoSP's own parameter sharding under the
same engine.

See Note [DeepSpeed gradient reduction under AutoSP] and Note [ZeRO 3 through DeepSpeed].
"""

from __future__ import annotations

import copy
import json
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autosp.api import compile as compile_model
from autosp.config import AutoSPConfig, with_job_setup
from autosp.errors import AutoSPError
from autosp.groups import SequenceParallelGroups
from autosp.model import SequenceParallelModel
from autosp.parameter_sharding import original_name

log = logging.getLogger(__name__)

SUPPORTED_ZERO_STAGES = (0, 1, 2, 3)
"""ZeRO stages that compose exactly with AutoSP: 0-2 reduced by DeepSpeed, 3 by AutoSP's sharded parameters (Note
[ZeRO 3 through DeepSpeed])."""

AUTOSP_SECTION = "autosp"
"""Optional DeepSpeed-config section with `AutoSPConfig` options (``compiler``, ``pad_to_multiple``, ...)."""

# DeepSpeed config optimizers that run as plain torch code on a CPU machine.  Every other
# "type" builds a C++/CUDA extension on first use (FusedAdam, FusedLamb, CPU Adam, ...), which
# takes minutes or fails without a compiler toolchain.
_CPU_SAFE_OPTIMIZERS = ("adagrad",)
_TORCH_ADAM_OPTIMIZERS = ("adam", "adamw")

# Note [DeepSpeed gradient reduction under AutoSP]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# AutoSP's loss on every rank is the full-sequence loss; each rank's backward gives the
# part of the gradient that flows through its tokens.  The single-device gradient is the
# SUM of those parts over the SP group, and data-parallel replicas (SP groups training
# different samples) are AVERAGED.  DeepSpeed's engine does exactly this when it is told
# about sequence parallelism through an mpu with DeepSpeed-Ulysses' interface
# (deepspeed.runtime.sequence_parallel.parallel_state_sp):
#   - ZeRO 0: buffered all-reduce over the "sequence data parallel" group (every rank:
#     SP x DP), divided by world / sequence_parallel_size = the number of replicas;
#   - ZeRO 1/2: reduce(-scatter) of each partition over the same group, divided by the
#     same factor (stage_1_and_2.average_tensor / allreduce_bucket);
#   - parameters and optimizer state are partitioned over that group, so every rank
#     holds one partition of the one replicated model.
# So gradients are reduced once, by DeepSpeed: building the mpu from the compiled model
# turns the model's own in-backward reduction off (Note [Gradient reduction in backward]
# in autosp.gradients), and `autosp.sync_gradients` refuses to run on top.  Without the
# mpu (plain ``deepspeed.initialize``, accelerate's DeepSpeed plugin) the model's own
# reduction stays on and DeepSpeed averages gradients that are already equal on every
# rank over all ranks, which leaves them unchanged (tests/autosp/test_deepspeed.py).  Gradient-norm clipping also counts each SP group once: the "model
# parallel" group is aliased to the SP group (as DeepSpeed's Ulysses mpu does), and the
# ZeRO 0 norm counts only model-parallel rank 0's (identical, already reduced) copy.

# Note [ZeRO 3 through DeepSpeed]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# DeepSpeed's ZeRO 3 gathers parameters in per-module hooks that Dynamo cannot trace, so they
# would cut the one graph AutoSP analyses.  A config with "stage": 3 is served instead by
# AutoSP's own sharding (``shard_parameters=True``, Note [Parameters gathered in the graph]
# in autosp/parameter_sharding.py): every rank keeps 1/N of each parameter, N the whole
# DP x SP world as ZeRO 3 and ALST partition them, gathered layer by layer inside the compiled
# program and released after use; the gather's backward reduce-scatters the gradients.
# DeepSpeed's engine keeps everything else it does (optimizer step over the shards, gradient
# clipping, accumulation, the learning-rate schedule, optimizer offload, checkpoints, the data
# loader), and must reduce nothing, since every gradient arrives reduced.  So it is given a
# Megatron-style mpu (`ShardedParametersMPU`) in which
#   - the "data-parallel" group for reduction and partitioning is the rank alone (DeepSpeed's
#     all-reduce and its ZeRO 1/2 partitions span one rank; its broadcast of the model at start
#     leaves each rank's shards alone), while the data-parallel size and rank it reports for
#     batch arithmetic and the data loader are the replicas' (SP groups training different samples);
#   - the "model-parallel" group is the whole group and every shard is marked as a model-parallel
#     parameter, so DeepSpeed's gradient norm sums each shard's squares over the ranks once and
#     counts a parameter left whole (tied embeddings, reduced by the model) on rank 0 only;
#   - no sequence parallelism is reported: AutoSP's program already is the SP program.
# The engine runs ZeRO 0 in fp32, and ZeRO 2 over its one-rank group in bf16 or fp16 or when the config
# offloads the optimizer (its states then live in host memory, as under ZeRO 3's offload): DeepSpeed's ZeRO 0
# wrapper for low precision (FP16_UnfusedOptimizer, DeepSpeed 0.19.8) takes a real optimizer step with zero
# gradients when it is built, which under AdamW decays every weight once and starts Adam's step count at 1, so
# every later update is off (the first by a factor of about 0.74); its ZeRO 2 steps exactly
# (tests/autosp/test_deepspeed.py checks each update against AdamW by hand, and pins the fault as released).  Parameter offload
# ("offload_param") is refused: the shards stay on the device and are gathered in the program.
# Options that tune DeepSpeed's ZeRO 3 hooks ("stage3_*", "sub_group_size", ...) do not apply and
# are logged and dropped.  tests/autosp/test_deepspeed.py trains HF Llama, Qwen2 and a MoE model
# this way against a single device, on 2 and 4 ranks.


class _ReplicasMPU:
    """What both of AutoSP's mpus tell DeepSpeed's batch arithmetic and data loader: the replicas (SP groups that
    train different samples)."""

    groups: SequenceParallelGroups  # the model's, set by each subclass

    def get_data_parallel_world_size(self) -> int:
        """Replicas: SP groups that train different samples."""
        return self.groups.dp_size

    def get_data_parallel_rank(self) -> int:
        return self.groups.dp_rank


class SequenceParallelMPU(_ReplicasMPU):
    """AutoSP's groups in the "mpu" interface DeepSpeed uses for Ulysses sequence parallelism.

    Built from the model of `autosp.compile` and handed to
    ``deepspeed.initialize(model=sp_model, mpu=SequenceParallelMPU(sp_model))``;
    `deepspeed_initialize` does both.  DeepSpeed then reduces the gradients over the
    SP group, so the model's own reduction is turned off here (gradients are reduced
    exactly once).  The method names are DeepSpeed's (``parallel_state_sp``); the
    data-parallel methods give the replicas (SP groups), which DeepSpeed's data loader
    and batch-size arithmetic use.
    """

    def __init__(self, model: SequenceParallelModel):
        if not isinstance(model, SequenceParallelModel):
            raise AutoSPError(
                f"SequenceParallelMPU takes the model from autosp.compile (got a {type(model).__name__}): DeepSpeed "
                "given this mpu reduces gradients over the SP group, so the model must stop reducing them itself, "
                "which it does when the mpu is built from it")
        model._gradients.hand_to_engine("DeepSpeed (given AutoSP's mpu)")
        self.groups = model.groups

    # DeepSpeed recognises a Ulysses mpu by this method's presence.
    def initialize_sequence_parallel(self, sequence_parallel_size: int) -> None:
        if sequence_parallel_size != self.groups.sp_size:
            raise AutoSPError(
                f"the SP groups were built for sequence_parallel_size={self.groups.sp_size}, "
                f"not {sequence_parallel_size}"
            )

    def get_sequence_parallel_group(self) -> dist.ProcessGroup:
        return self.groups.sp_group

    def get_sequence_parallel_world_size(self) -> int:
        return self.groups.sp_size

    def get_sequence_parallel_rank(self) -> int:
        return self.groups.sp_rank

    def get_sequence_data_parallel_group(self) -> dist.ProcessGroup:
        return self.groups.group

    def get_sequence_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self.groups.group)

    def get_sequence_data_parallel_rank(self) -> int:
        return dist.get_rank(self.groups.group)

    # As in DeepSpeed's Ulysses mpu: "model parallel" is the SP group.
    get_model_parallel_group = get_sequence_parallel_group
    get_model_parallel_world_size = get_sequence_parallel_world_size
    get_model_parallel_rank = get_sequence_parallel_rank


class ShardedParametersMPU(_ReplicasMPU):
    """AutoSP's groups as DeepSpeed's engine sees them when AutoSP shards the parameters (ZeRO 3): a Megatron-style
    mpu whose "model-parallel" group is the whole group, each shard marked as a model-parallel parameter, and whose
    "data-parallel" group is the rank alone, so that DeepSpeed reduces and partitions nothing (Note [ZeRO 3 through
    DeepSpeed]).  Built by `deepspeed_initialize` from the model of ``autosp.compile(..., shard_parameters=True)``;
    every rank of the group builds it (each makes its one-rank group)."""

    def __init__(self, model: SequenceParallelModel):
        if not isinstance(model, SequenceParallelModel) or not model.parameter_shards:
            raise AutoSPError("ShardedParametersMPU takes the model of autosp.compile(..., shard_parameters=True)")
        self.groups = model.groups
        for shard in model.parameter_shards:  # DeepSpeed's norms sum a model-parallel parameter over the group
            shard.tensor_model_parallel = True
        self._alone = dist.new_group([dist.get_rank()], use_local_synchronization=True)

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self.groups.group

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size(self.groups.group)

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank(self.groups.group)

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        """The rank alone: the gradients arrive reduced, and the optimizer state is the rank's own shards'."""
        return self._alone

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank


def _optimizer_over_shards(optimizer: Any, names_before: dict[int, str], sp_model: SequenceParallelModel) -> None:
    """Point a torch optimizer built over the model's whole parameters at the shards that replaced them
    (``shard_parameters=True`` swaps each parameter for this rank's shard), in place: its parameter groups and
    settings stay, and so does a learning-rate schedule bound to it.  Anything else (None, a callable DeepSpeed
    calls with the parameters) is left alone."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return
    if optimizer.state:
        raise AutoSPError("the optimizer has stepped already; under ZeRO stage 3 AutoSP points it at the parameter "
                          "shards, so pass a fresh optimizer (or none, with an \"optimizer\" entry)")
    now = {original_name(name): p for name, p in sp_model.module.named_parameters()}
    for group in optimizer.param_groups:
        try:
            group["params"] = [now[names_before[id(p)]] for p in group["params"]]
        except KeyError:
            raise AutoSPError("the optimizer holds a tensor that is not a parameter of the model; under ZeRO stage 3 "
                              "build it over model.parameters() only") from None


def _load_config(config: dict | str | os.PathLike) -> dict:
    if isinstance(config, dict):
        return copy.deepcopy(config)
    with open(config) as f:
        return json.load(f)


def _on_cpu_accelerator() -> bool:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu"


def _check_optimizer_entry(ds_config: dict, optimizer: Any) -> None:
    entry = ds_config.get("optimizer")
    if entry is None:
        return
    if optimizer is not None:
        raise AutoSPError(
            "both an optimizer argument and an \"optimizer\" entry in the DeepSpeed config were given; "
            "keep one (a torch optimizer is recommended)"
        )
    kind = str(entry.get("type", "")).lower()
    params = entry.get("params", {}) or {}
    if not _on_cpu_accelerator():
        return
    if kind in _CPU_SAFE_OPTIMIZERS or (kind in _TORCH_ADAM_OPTIMIZERS and params.get("torch_adam")):
        return
    raise AutoSPError(
        f"the DeepSpeed config's optimizer type {entry.get('type')!r} JIT-builds a C++/CUDA extension "
        "(FusedAdam, FusedLamb, CPU Adam...) on first use, which takes minutes on a CPU machine; pass a torch "
        "optimizer instead, e.g. autosp.deepspeed_initialize(..., optimizer=torch.optim.AdamW("
        "model.parameters(), lr=...)) and drop the \"optimizer\" entry, or set \"params\": "
        "{\"torch_adam\": true} for Adam/AdamW"
    )


def _zero_stage(ds_config: dict) -> int:
    stage = int((ds_config.get("zero_optimization") or {}).get("stage", 0))
    if stage not in SUPPORTED_ZERO_STAGES:
        raise AutoSPError(f"ZeRO stage {stage} does not exist: use \"zero_optimization\": {{\"stage\": S}} with S in "
                          f"{list(SUPPORTED_ZERO_STAGES)} (3: AutoSP's sharded parameters, Note [ZeRO 3 through DeepSpeed])")
    return stage


_HOOK_ONLY_ZERO_OPTIONS = ("sub_group_size", "zero_hpz_partition_size", "zero_quantized_weights", "mics_shard_size",
                           "mics_hierarchical_params_gather", "memory_efficient_linear", "module_granularity_threshold")
"""ZeRO 3 options that tune DeepSpeed's parameter hooks (besides every "stage3_*" one), which AutoSP's gather in
the program replaces: dropped with a log line."""


def _offload_device(section: dict | None) -> str:
    return str((section or {}).get("device", "none")).lower()


def _low_precision(ds_config: dict) -> bool:
    """Whether the config trains in bf16 or fp16 (DeepSpeed's ``"bf16"`` / ``"fp16"`` sections)."""
    return any((ds_config.get(key) or {}).get("enabled") for key in ("bf16", "fp16"))


def _engine_config_for_shards(ds_config: dict) -> dict:
    """The config DeepSpeed's engine gets when AutoSP shards the parameters (Note [ZeRO 3 through DeepSpeed]):
    ZeRO 0 in fp32, ZeRO 2 over one rank in bf16 or fp16 or where the optimizer is offloaded; no sequence
    parallelism."""
    zero = dict(ds_config.get("zero_optimization") or {})
    if _offload_device(zero.get("offload_param")) != "none":
        raise AutoSPError(
            "\"offload_param\" does not compose with AutoSP's ZeRO 3: its parameter shards stay on the device and are "
            "gathered inside the compiled program; drop \"offload_param\" (keep \"offload_optimizer\" to hold the "
            "optimizer states in host memory)")
    dropped = sorted(k for k in zero if k.startswith("stage3_") or k in (*_HOOK_ONLY_ZERO_OPTIONS, "offload_param"))
    if dropped:
        log.info("ZeRO 3 through AutoSP: %s tune DeepSpeed's parameter hooks, which AutoSP's gathers in the compiled "
                 "program replace; dropped", ", ".join(dropped))
    kept = {k: v for k, v in zero.items() if k not in dropped}
    offload = _offload_device(zero.get("offload_optimizer")) != "none"
    engine = {k: v for k, v in ds_config.items() if k != "sequence_parallel_size"}
    engine["zero_optimization"] = {**kept, "stage": 2 if offload or _low_precision(ds_config) else 0}
    if not offload:
        engine["zero_optimization"].pop("offload_optimizer", None)
    return engine


def _planned_setup(ds_config: dict, optimizer: Any) -> dict:
    """The `autosp.plan.TrainingSetup` fields this DeepSpeed job fixes, for ``plan_setup`` (the ones it cannot tell
    are left to the planner's defaults): the ZeRO stage, the micro-batch, the accumulation steps, optimizer offload
    and the optimizer's kind (from the config's ``"optimizer"`` entry, else the torch optimizer passed)."""
    zero = ds_config.get("zero_optimization") or {}
    offload = _offload_device(zero.get("offload_optimizer"))
    setup = {"zero_stage": _zero_stage(ds_config), "offload": "optimizer" if offload in ("cpu", "nvme") else "none"}
    if setup["zero_stage"] == 3:  # the shards stepped by DeepSpeed's engine (Note [ZeRO 3 through DeepSpeed])
        setup["engine"] = "deepspeed"
    for field, key in (("micro_batch", "train_micro_batch_size_per_gpu"), ("grad_accum", "gradient_accumulation_steps")):
        if isinstance(ds_config.get(key), int):  # not an unresolved "auto"
            setup[field] = ds_config[key]
    entry = ds_config.get("optimizer")
    if entry is not None:
        kind, momentum = str(entry.get("type", "")).lower(), (entry.get("params") or {}).get("momentum", 0)
    elif isinstance(optimizer, torch.optim.Optimizer):
        kind, momentum = type(optimizer).__name__.lower(), optimizer.defaults.get("momentum", 0)
    else:
        kind, momentum = "", 0
    if kind == "sgd" and momentum:
        kind = "sgd_momentum"
    from autosp.plan.setup import OPTIMIZERS  # the planner's ledger (called only when something is planned)

    if kind in OPTIMIZERS:
        setup["optimizer"] = kind
    return setup


def _take_compile_section(ds_config: dict) -> None:
    """Accept DeepSpeed's spelling ``"compile": {"deepcompile": true, "passes": ["autosp"]}``.

    This project's pass replaces DeepCompile's AutoSP, so the section is removed
    before DeepSpeed sees it; DeepCompile passes other than "autosp" do not compose.
    """
    section = ds_config.get("compile")
    if not section:
        return
    if section.get("deepcompile"):
        passes = list(section.get("passes") or [])
        others = [p for p in passes if p != "autosp"]
        if others or not passes:
            raise AutoSPError(
                f"DeepCompile passes {others or ['(default ZeRO passes)']} do not compose with AutoSP; use "
                "\"compile\": {\"deepcompile\": true, \"passes\": [\"autosp\"]} (or drop the \"compile\" section) "
                "and choose the ZeRO stage in \"zero_optimization\""
            )
        ignored = sorted(set(section) - {"deepcompile", "passes"})
        if ignored:
            log.warning("DeepCompile options %s do not apply to AutoSP's compile and are ignored", ignored)
    del ds_config["compile"]


def _sp_size(ds_config: dict, sp_size: int | None) -> int:
    in_config = ds_config.get("sequence_parallel_size")
    if in_config is None and sp_size is None:
        raise AutoSPError(
            "the DeepSpeed config has no \"sequence_parallel_size\"; add \"sequence_parallel_size\": P "
            "(the ranks that share one sequence; it must divide the world size)"
        )
    if in_config is not None and sp_size is not None and int(in_config) != sp_size:
        raise AutoSPError(
            f"sp_size={sp_size} disagrees with the DeepSpeed config's sequence_parallel_size={in_config}; give one"
        )
    size = int(in_config if in_config is not None else sp_size)
    ds_config["sequence_parallel_size"] = size
    return size


def _check_data_parallel_size(ds_config: dict, dp_size: int) -> None:
    # With both sizes in the config DeepSpeed builds its own device mesh; AutoSP's groups are
    # the single source of truth, so the entry is checked and removed.
    dp = ds_config.pop("data_parallel_size", None)
    if dp is not None and int(dp) != dp_size:
        raise AutoSPError(
            f"data_parallel_size={dp} in the DeepSpeed config, but world / sequence_parallel_size = "
            f"{dp_size}; drop data_parallel_size or make it {dp_size}"
        )


def deepspeed_initialize(
    *,
    model: nn.Module,
    config: dict | str | os.PathLike,
    optimizer: Any = None,
    sp_size: int | None = None,
    compiler: str | None = None,
    planner: Any = None,
    **kwargs: Any,
) -> tuple:
    """``deepspeed.initialize`` with AutoSP sequence parallelism; returns what it returns.

    ``model`` is the unmodified single-device model and ``config`` a DeepSpeed config
    (dict or JSON path) with ``"sequence_parallel_size"`` (or pass ``sp_size``).  An
    optional ``"autosp"`` section holds `AutoSPConfig` options; ``compiler`` overrides
    its ``compiler``.  The model is compiled by `autosp.compile` (so ``strategy`` ``"ring"``,
    ``"hybrid"`` with ``ulysses_size``, and ``"auto"`` with ``plan_seq_len`` work as there);
    ``planner`` is its ``planner=`` (a process from ``autosp.start_planner()``, started before
    the model was loaded).  Other keyword arguments (``lr_scheduler``, ``training_data``,
    ``model_parameters``, ...) go to ``deepspeed.initialize``; ``training_data`` gets a
    loader in which all ranks of an SP group see the same samples.

    Returns ``(engine, optimizer, training_dataloader, lr_scheduler)``; ``engine.module``
    is the `SequenceParallelModel`.  Call the engine with ``**autosp.prepare_inputs(...)``
    (the full-length sample on every rank of the SP group), then ``engine.backward(loss)``
    and ``engine.step()``; the engine reduces the gradients (``autosp.sync_gradients`` refuses to run on top;
    ``engine.compile()`` is harmless and unnecessary).
    """
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if "mpu" in kwargs:
        raise AutoSPError("deepspeed_initialize builds the mpu from AutoSP's SP groups; do not pass mpu")
    ds_config = _load_config(config)
    size = _sp_size(ds_config, sp_size)
    stage = _zero_stage(ds_config)
    sharded = stage == 3
    if stage == 0 and _low_precision(ds_config):
        log.warning("ZeRO stage 0 in bf16/fp16: DeepSpeed's wrapper for it (FP16_UnfusedOptimizer) steps the "
                    "optimizer once with zero gradients when it is built, so AdamW decays every weight once and "
                    "Adam's bias correction runs a step ahead (Note [ZeRO 3 through DeepSpeed]); ZeRO 1 or 2 step "
                    "exactly")
    _check_optimizer_entry(ds_config, optimizer)
    _take_compile_section(ds_config)
    options = dict(ds_config.pop(AUTOSP_SECTION, None) or {})
    if compiler is not None:
        options["compiler"] = compiler
    compiler = options.pop("compiler", "inductor")
    if sharded:  # Note [ZeRO 3 through DeepSpeed]
        if options.get("shard_parameters") is False:
            raise AutoSPError("ZeRO stage 3 is AutoSP's shard_parameters=True: drop \"shard_parameters\": false from "
                              "the \"autosp\" section, or choose ZeRO stage 0-2")
        options["shard_parameters"] = True
    options = with_job_setup(options, lambda: _planned_setup(ds_config, optimizer))  # what is priced is what runs
    AutoSPConfig.from_options(sp_size=size, compiler=compiler, options=options)  # a bad option refused early

    import deepspeed.comm as ds_comm

    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    if "LOCAL_RANK" not in os.environ:
        raise AutoSPError(
            "DeepSpeed needs the LOCAL_RANK environment variable (this rank's index on its node); launch with "
            "torchrun or the deepspeed launcher, or set LOCAL_RANK in each process before deepspeed_initialize"
        )
    if not ds_comm.is_initialized():
        # Make deepspeed.comm wrap the user's process group (and its backend: gloo on CPU).
        ds_comm.init_distributed(dist_backend=dist.get_backend(), verbose=False)
    # The one way a model is compiled: the strategy decided (strategy="auto") and its groups built (a hybrid's
    # Ulysses and ring groups too) as autosp.compile does; it checks that sequence_parallel_size divides the world.
    if dist.get_world_size() % size == 0:  # else autosp.compile says what to change
        _check_data_parallel_size(ds_config, dist.get_world_size() // size)
    names_before = {id(p): name for name, p in model.named_parameters()}
    sp_model = compile_model(model, sp_size=size, compiler=compiler, planner=planner, **options)
    groups = sp_model.groups
    log.info(
        "AutoSP + DeepSpeed: sp_size=%d x data-parallel replicas=%d, ZeRO stage %d, strategy=%s, compiler=%s",
        groups.sp_size, groups.dp_size, stage, sp_model.config.strategy, sp_model.config.compiler,
    )
    if sharded:
        _optimizer_over_shards(optimizer, names_before, sp_model)
        return deepspeed.initialize(model=sp_model, optimizer=optimizer, config=_engine_config_for_shards(ds_config),
                                    mpu=ShardedParametersMPU(sp_model), **kwargs)
    return deepspeed.initialize(
        model=sp_model, optimizer=optimizer, config=ds_config, mpu=SequenceParallelMPU(sp_model), **kwargs
    )
