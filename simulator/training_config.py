"""The training configuration the memory ledger (:mod:`simulator.ledger`) reads: one rank's setup as far as memory
is concerned, validated against the DeepSpeed code paths the ledger follows (Note [Which DeepSpeed path holds
what] in simulator/ledger.py). Standard library only."""

from __future__ import annotations

from dataclasses import dataclass

DEEPSPEED_VERSIONS = ("0.19.8", "0.16.3")
"""DeepSpeed versions whose code the ledger follows (Note [DeepSpeed 0.16.3 as the AutoSP fork ran it])."""
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 1}
"""fp32 state tensors per optimized element (torch.optim: exp_avg and exp_avg_sq; momentum_buffer)."""
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of each precision name."""


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """One rank's training setup, as far as memory is concerned (DeepSpeed config names in parentheses)."""

    parameter_numels: tuple[int, ...]
    """Element count of every trainable parameter tensor, in module order (flat-buffer padding depends on it).
    :meth:`from_parameter_count` builds a one-tensor approximation from a total."""
    optimizer: str = "adam"
    """One of :data:`OPTIMIZER_STATES`."""
    precision: str = "bf16"
    """Model dtype: ``fp32``, ``bf16`` (``bf16.enabled``) or ``fp16``."""
    grad_accum_dtype: str | None = None
    """``data_types.grad_accum_dtype``; ``None``: the model dtype (DeepSpeed's default)."""
    zero_stage: int = 1
    dp_world_size: int = 1
    """Ranks over which ZeRO partitions (the sequence-data-parallel group)."""
    gradient_accumulation_steps: int = 1
    micro_batch_size: int = 1
    reduce_bucket_size: int = 500_000_000
    """``zero_optimization.reduce_bucket_size`` (elements; default 5e8 in runtime/zero/config.py)."""
    allgather_bucket_size: int = 500_000_000
    """``zero_optimization.allgather_bucket_size`` (elements)."""
    overlap_comm: bool | None = None
    """``zero_optimization.overlap_comm``; ``None``: DeepSpeed's default (on for ZeRO 3 only)."""
    prefetch_bucket_size: int = 50_000_000
    """``stage3_prefetch_bucket_size`` (elements)."""
    param_persistence_threshold: int = 100_000
    """``stage3_param_persistence_threshold`` (elements)."""
    nccl_communicators: int = 2
    """NCCL communicators this rank creates (e.g. the data-parallel and the sequence-parallel group)."""
    compute_streams: int = 1
    deepspeed: str = "0.19.8"
    """DeepSpeed version whose code paths the ledger follows (:data:`DEEPSPEED_VERSIONS`)."""
    offload_optimizer: bool = False
    """``zero_optimization.offload_optimizer.device = "cpu"``: fp32 master weights, gradient partitions and
    optimizer state in host memory, the optimizer step on the CPU (Note [Optimizer offload] in
    simulator/ledger.py). ZeRO 1-3 only."""
    sharded_parameters: bool = False
    """AutoSP's ``shard_parameters=True`` under a plain torch optimizer (no DeepSpeed engine; ``zero_stage`` 0): each
    of the ``dp_world_size`` ranks holds a 1/dp_world_size shard of every parameter, of its gradient and of its
    optimizer state, in the parameters' dtype (the workload gathers each layer's parameters inside the step:
    Note [ZeRO-3 as a rewrite of the single-device trace] in simulator/workload_rewrites.py)."""
    gpu_process: bool = True
    """The rank is a GPU process: it also holds what no tensor accounts for (CUDA context, NCCL buffers,
    library workspaces, the caching allocator's rounding and fragmentation, and under offload the host process's
    own memory; :mod:`simulator.device_reserve`). False for a CPU process (``cpu-gloo``), whose memory the ledger
    counts as its tensors alone, as ``experiments.cpu.peak_memory.PeakMemory`` measures it."""

    def __post_init__(self) -> None:
        if self.deepspeed not in DEEPSPEED_VERSIONS:
            raise ValueError(f"deepspeed must be one of {DEEPSPEED_VERSIONS}, got {self.deepspeed!r}")
        if self.deepspeed == "0.16.3" and self.zero_stage == 0 and self.precision != "bf16":
            raise ValueError("the ledger follows DeepSpeed 0.16.3 only for ZeRO >= 1 or ZeRO 0 with bf16 (the AutoSP "
                             "fork's configurations); use deepspeed='0.19.8' for fp32/fp16 without ZeRO")
        if self.deepspeed == "0.16.3" and self.zero_stage == 0 and self.accum_dtype != "fp32":
            raise ValueError("DeepSpeed 0.16.3 refuses bf16 without ZeRO and bf16 gradient accumulation (engine.py "
                             "_do_optimizer_sanity_check: 'Bfloat16 wrapper must use a gradient accumulation type "
                             "of fp32'); leave grad_accum_dtype unset")
        if not self.parameter_numels or min(self.parameter_numels) < 1:
            raise ValueError("parameter_numels must list at least one positive element count")
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, got {self.optimizer!r}")
        if self.precision not in DTYPE_BYTES or (self.grad_accum_dtype or "fp32") not in DTYPE_BYTES:
            raise ValueError(f"precision and grad_accum_dtype must be one of {sorted(DTYPE_BYTES)}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0-3, got {self.zero_stage}")
        if min(self.dp_world_size, self.gradient_accumulation_steps, self.micro_batch_size) < 1:
            raise ValueError("dp_world_size, gradient_accumulation_steps and micro_batch_size must be >= 1")
        if (self.deepspeed == "0.19.8" and self.zero_stage == 0 and self.precision != "fp32"
                and self.accum_dtype != self.precision):
            raise ValueError("DeepSpeed rejects ZeRO 0 with low-precision parameters and a different gradient "
                             "accumulation dtype (engine.py _do_optimizer_sanity_check: unsupported mix); use "
                             "ZeRO 1 for BF16_Optimizer")

        if self.sharded_parameters and (self.zero_stage != 0 or self.offload_optimizer):
            raise ValueError("sharded_parameters is AutoSP's own sharding under a plain optimizer: zero_stage 0, no "
                             "optimizer offload")
        if self.offload_optimizer:
            self._check_offload()

    def _check_offload(self) -> None:
        if self.zero_stage == 0:
            raise ValueError("optimizer offload is a ZeRO feature (zero_optimization.offload_optimizer); use "
                             "zero_stage 1, 2 or 3")
        if self.deepspeed != "0.19.8":
            raise ValueError("the ledger follows optimizer offload in DeepSpeed 0.19.8 only; use deepspeed='0.19.8'")
        if self.zero_stage in (1, 2) and self.accum_dtype != self.precision:
            raise ValueError("optimizer offload with ZeRO 1/2 and a gradient accumulation dtype other than the model "
                             "dtype (DeepSpeedZeroOptimizer's compact fp32 partition buffer) is not in the ledger; "
                             "leave grad_accum_dtype unset")

    @classmethod
    def from_parameter_count(cls, parameter_count: int, **kwargs) -> TrainingConfig:
        """A config whose parameters are one tensor of ``parameter_count`` elements (per-tensor padding and
        allocator rounding then count once instead of per tensor: at most a few MiB per tensor)."""
        return cls(parameter_numels=(int(parameter_count),), **kwargs)

    @classmethod
    def for_llama(cls, *, hidden: int, ffn_hidden: int, layers: int, heads: int, kv_heads: int, vocab: int,
                  tied_embeddings: bool = False, head_dim: int | None = None, **kwargs) -> TrainingConfig:
        """A config with a Llama decoder's parameter tensors in Hugging Face's module order (embedding; per
        layer q, k, v, o, gate, up, down projections and two RMSNorm weights; final norm; LM head).  ``head_dim``:
        the width of one attention head where the model sets one (Qwen3, Gemma), else ``hidden // heads`` (Hugging
        Face's default); q and o are ``heads * head_dim`` by ``hidden``, k and v ``kv_heads * head_dim`` by it."""
        d = head_dim if head_dim is not None else hidden // heads
        q, kv = heads * d, kv_heads * d
        layer = (q * hidden, kv * hidden, kv * hidden, hidden * q, ffn_hidden * hidden,
                 ffn_hidden * hidden, hidden * ffn_hidden, hidden, hidden)
        numels = (vocab * hidden, *layer * layers, hidden) + (() if tied_embeddings else (vocab * hidden,))
        return cls(parameter_numels=numels, **kwargs)

    @property
    def parameter_count(self) -> int:
        return sum(self.parameter_numels)

    @property
    def accum_dtype(self) -> str:
        """Gradient accumulation dtype: as set, else DeepSpeed's default (``get_data_types``; 0.16.3 accumulates
        bf16 in fp32 without ZeRO, Note [DeepSpeed 0.16.3 as the AutoSP fork ran it])."""
        if self.grad_accum_dtype is not None:
            return self.grad_accum_dtype
        if self.deepspeed == "0.16.3" and self.zero_stage == 0 and self.precision == "bf16":
            return "fp32"
        return self.precision

    @property
    def wrapper(self) -> str:
        """The DeepSpeed optimizer class this configuration gets (see Note [Which DeepSpeed path holds what]);
        ``"torch, sharded"`` for `sharded_parameters`."""
        if self.sharded_parameters:
            return "torch, sharded"
        if self.zero_stage == 3:
            return "DeepSpeedZeroOptimizer_Stage3"
        if self.zero_stage in (1, 2):
            if self.zero_stage == 1 and self.precision == "bf16" and self.accum_dtype == "fp32":
                return "BF16_Optimizer"
            return "DeepSpeedZeroOptimizer"
        if self.deepspeed == "0.16.3":  # checked in __post_init__: bf16 with fp32 accumulation
            return "BF16_Optimizer"
        return "torch" if self.precision == "fp32" else "FP16_UnfusedOptimizer"

    @property
    def gradients_in_program(self) -> bool:
        """Whether the parameters' gradients are the backward's own output tensors from the op that makes each one
        to the optimizer step, so a simulated program holds them over time rather than the ledger whole (Note
        [Gradients the program holds] in simulator/training_step.py): ZeRO 0 under the torch optimizer or
        ``FP16_UnfusedOptimizer`` (``param.grad`` is autograd's tensor, reduced in place after backward), one
        micro-step per step (with accumulation the previous micro-steps' gradients are held through the forward)."""
        return self.wrapper in ("torch", "FP16_UnfusedOptimizer") and self.gradient_accumulation_steps == 1
