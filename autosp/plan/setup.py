"""The training setup a prediction is made for (`TrainingSetup`) and its closed sets of values.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from autosp.errors import AutoSPError
from autosp.parameter_sharding import shard_numel
from simulator.ledger import OPTIMIZER_STATES, TrainingConfig

log = logging.getLogger(__name__)

DTYPES = ("bf16", "fp32")
OPTIMIZERS = tuple(OPTIMIZER_STATES)
OFFLOADS = ("none", "optimizer")
ENGINES = ("torch", "deepspeed")
COMPILERS = ("inductor", "aot_eager")
DEPTHS = ("full", "extrapolated")
PLAIN_TRAINING_LOOP = {"zero_stage": 0}
"""What a job compiled by `autosp.compile` alone is priced at where nothing describes it (no ``plan_setup``): no
ZeRO, so every rank holds its optimizer's whole state, as a plain training loop does (`TrainingSetup`'s own
default, ZeRO 1, would count an eighth of it on 8 ranks and could choose a plan that does not fit).
`autosp.deepspeed_initialize` and `AutoSPTrainer` describe their jobs through ``plan_setup``; the planner CLI
answers for this loop unless told otherwise."""
DECIDING_DEPTH = "extrapolated"
"""The depth the decisions among candidates (the memory planner, ``strategy="auto"``) predict them at when the
setup leaves it open (``depth=None``): Note [Shallow traces checkpointed for the full depth] in
autosp/plan/depth.py."""


@dataclass(frozen=True, kw_only=True)
class TrainingSetup:
    """The training configuration a prediction is for (the flags of ``python -m autosp.plan``)."""

    seq_len: int
    """Tokens per sample, the full sequence before sharding."""
    sp_size: int = 1
    """Ranks sharing one sequence (contiguous ranks, inside a node where possible)."""
    dp_size: int = 1
    """Data-parallel replicas; the world is ``sp_size * dp_size`` ranks and ZeRO partitions over all of them."""
    zero_stage: int = 1
    """DeepSpeed's ZeRO stage (0-2), or 3: AutoSP's own sharded parameters (``shard_parameters=True``: each rank holds
    1/N of the parameters, gradients and optimizer state, layers gathered inside the step; priced by the ZeRO-3
    rewrite, Note [ZeRO-3 as a rewrite of the single-device trace] in simulator/workload_rewrites.py); with
    ``offload="optimizer"`` the shards under DeepSpeed's engine, its optimizer states in host memory (a DeepSpeed
    config with ``"stage": 3`` and ``"offload_optimizer"`` under `autosp.deepspeed_initialize`)."""
    micro_batch: int = 1
    """Samples per SP group per micro-step."""
    grad_accum: int = 1
    """Micro-steps per optimizer step."""
    dtype: str = "bf16"
    optimizer: str = "adamw"
    offload: str = "none"
    engine: str | None = None
    """What steps the optimizer over the shards of ``zero_stage`` 3: "torch" (a plain optimizer over
    ``compiled.parameters()``) or "deepspeed" (`autosp.deepspeed_initialize` with ``"stage": 3``: DeepSpeed's ZeRO 0 over
    each rank's shards alone in fp32, its ZeRO 2 over them in bf16 (fp32 master copies) or with the optimizer
    offloaded; Note [ZeRO 3 through DeepSpeed] in autosp/integrations/deepspeed_engine.py); None: "deepspeed" with
    optimizer offload, else "torch".  Stages 0-2 are DeepSpeed's engine always."""
    compiler: str = "inductor"
    """The backend the graphs run under: Inductor frees each saved activation after its last backward use,
    ``aot_eager`` holds them to the end of backward (see Note [Tensor lifetimes in the export])."""
    depth: str | None = None
    """``full``: trace every layer; ``extrapolated``: trace 1 and 2 layers and extrapolate, SAC deciding as for
    the full model (Note [Shallow traces checkpointed for the full depth] in autosp/plan/depth.py; the full depth
    where extrapolation is refused); None: the caller's default, ``full`` for `predict` and ``extrapolated`` for
    the decisions among candidates (`autosp.plan.plan_memory`, `choose_strategy`), `DECIDING_DEPTH`."""

    @property
    def torch_dtype(self):
        """``dtype`` as a torch dtype."""
        return torch_dtype(self.dtype)

    @property
    def world_size(self) -> int:
        return self.sp_size * self.dp_size

    def check(self) -> None:
        """Refuse what cannot be predicted, naming what is missing."""
        for name in ("seq_len", "sp_size", "dp_size", "micro_batch", "grad_accum"):
            if getattr(self, name) < 1:
                raise AutoSPError(f"--{name.replace('_', '-')} {getattr(self, name)}: give a positive number")
        choices = {"dtype": DTYPES, "optimizer": OPTIMIZERS, "offload": OFFLOADS, "compiler": COMPILERS,
                   "depth": (*DEPTHS, None), "zero_stage": (0, 1, 2, 3), "engine": (*ENGINES, None)}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise AutoSPError(f"--{name.replace('_', '-')} {getattr(self, name)!r}: choose one of {allowed}")
        if self.seq_len % self.sp_size:
            raise AutoSPError(f"--seq-len {self.seq_len} is not divisible by --sp-size {self.sp_size}; give a "
                              "multiple of the SP degree")
        if self.engine is not None and self.zero_stage != 3:
            raise AutoSPError(f"engine={self.engine!r} says what steps the shards of ZeRO 3; ZeRO {self.zero_stage} is "
                              "DeepSpeed's engine: drop engine, or use zero_stage 3")
        if self.engine == "torch" and self.offload != "none":
            raise AutoSPError("optimizer offload under ZeRO 3 is DeepSpeed's (autosp.deepspeed_initialize with "
                              "\"offload_optimizer\"); a plain torch optimizer steps the shards on the device: drop "
                              "the offload, or use engine='deepspeed'")
        if self.offload != "none" and self.zero_stage == 0:
            raise AutoSPError(f"--offload {self.offload} with --zero-stage 0: DeepSpeed's offload_optimizer is a "
                              "ZeRO feature; use --zero-stage 1 or 2")
        if self.offload != "none" and self.grad_accum > 1:
            raise AutoSPError(f"--offload {self.offload} with --grad-accum > 1: DeepSpeed then accumulates each "
                              "gradient through host memory every micro-step (stage_1_and_2.py "
                              "async_accumulate_grad_in_cpu_via_gpu), traffic the simulator does not build; use "
                              "--grad-accum 1")
        if self.zero_stage == 1 and self.grad_accum > 1:
            raise AutoSPError("--zero-stage 1 with --grad-accum > 1: DeepSpeed's ZeRO 1 keeps every parameter's "
                              "unreduced gradient between micro-steps (it reduces at the accumulation boundary "
                              "only), which the memory ledger does not list; use --grad-accum 1, or ZeRO 2 (it "
                              "reduces each micro-step)")

    @property
    def shard_engine(self) -> str:
        """What steps the shards of ZeRO 3: ``engine``, else "deepspeed" with optimizer offload, else "torch"."""
        return self.engine or ("deepspeed" if self.offload != "none" else "torch")

    def training_config(self, parameter_numels: tuple[int, ...]) -> TrainingConfig:
        """The ledger's configuration (ZeRO partitions over all ``world_size`` ranks: the sequence-data-parallel
        group)."""
        if self.zero_stage == 3 and self.shard_engine == "deepspeed":
            # AutoSP's shards under DeepSpeed's engine: its ZeRO 0 over each rank alone, of its shards, or ZeRO 2 with
            # the optimizer offloaded (Note [ZeRO 3 through DeepSpeed] in autosp/integrations/deepspeed_engine.py)
            shards = tuple(shard_numel(n, self.world_size) for n in parameter_numels)
            offload = self.offload == "optimizer"
            return TrainingConfig(parameter_numels=shards, optimizer=self.optimizer, precision=self.dtype,
                                  zero_stage=2 if offload or self.dtype != "fp32" else 0, dp_world_size=1,
                                  gradient_accumulation_steps=self.grad_accum, micro_batch_size=self.micro_batch,
                                  nccl_communicators=2 if self.sp_size > 1 else 1, offload_optimizer=offload)
        sharded = self.zero_stage == 3  # AutoSP's shard_parameters=True under a plain optimizer
        return TrainingConfig(parameter_numels=parameter_numels, optimizer=self.optimizer, precision=self.dtype,
                              zero_stage=0 if sharded else self.zero_stage, sharded_parameters=sharded,
                              dp_world_size=self.world_size,
                              gradient_accumulation_steps=self.grad_accum, micro_batch_size=self.micro_batch,
                              nccl_communicators=2 if self.sp_size > 1 else 1,
                              offload_optimizer=self.offload == "optimizer")

def torch_dtype(dtype: str):
    import torch

    return {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
