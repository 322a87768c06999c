"""``build_system("zero3", ...)``: DeepSpeed ZeRO-3 data parallelism, no sequence parallelism.

The memory baseline of the paper: parameters, gradients and optimizer state are
partitioned over the ranks, but every rank runs the *full* sequence of its own
sample.  Under the common interface the ranks of an SP group receive the same
sample, so the replica-averaged gradient equals the single-device gradient of
that sample, and the loss each rank returns is its full-sample loss (exact).
Built with ``deepspeed.initialize`` and a torch optimizer (never a DeepSpeed
``"optimizer"`` entry: that JIT-builds CUDA ops); the optimizer never steps here (AdamW, a ZeRO-supported torch optimizer).
``compiler`` goes to ``engine.compile(backend=...)``; Dynamo then also traces
ZeRO-3's per-module parameter gather/release hooks, which recompile per module
until Dynamo's recompile limit (8) sends them back to eager (noisy warnings in the
log; results stay exact).  ``gradients()`` all-gathers each parameter's partitions:
call it on every rank.  ``resident_tensors()`` lists what the engine holds between
steps, preallocated buffers included, for peak-memory measurements.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch import nn

from experiments.baselines.common import BaselineUnsupported, ensure_deepspeed_comm, loss_of

log = logging.getLogger(__name__)


class ZeRO3System:
    """Exact (every rank trains a whole sample); ``sp_size`` only says which ranks share a sample."""

    name = "zero3"

    def __init__(
        self, model: nn.Module, *, sp_size: int, process_group: dist.ProcessGroup | None = None,
        compiler: str = "aot_eager", micro_batch_size: int = 1,
    ):
        import deepspeed

        if process_group is not None and process_group != dist.group.WORLD:
            raise BaselineUnsupported(
                "zero3: deepspeed.initialize partitions over the whole world; pass process_group=None"
            )
        world = dist.get_world_size()
        if world % sp_size:
            raise ValueError(f"sp_size={sp_size} does not divide the world of {world} ranks")
        if "LOCAL_RANK" not in os.environ:
            raise ValueError(
                "zero3: deepspeed.initialize needs the LOCAL_RANK environment variable (this node's index of the "
                "rank); launch with torchrun or the deepspeed launcher, or set it in each rank before build_system"
            )
        ensure_deepspeed_comm()
        config = {
            "train_micro_batch_size_per_gpu": micro_batch_size,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3},
            "steps_per_print": 10**9,
        }
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)  # a ZeRO-supported torch optimizer
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        if compiler != "eager":
            self.engine.compile(backend=compiler)
        log.info("zero3: world=%d, compiler=%s", world, compiler)

    def resident_tensors(self) -> list[torch.Tensor]:
        """Every tensor this rank holds between steps: the parameter partitions and their gradients, and the
        buffers the engine and its ZeRO-3 optimizer preallocate (flat fp32/partition buffers, gradient
        buckets, optimizer state), found by walking the optimizer's and the engine's attributes (two levels of
        lists, tuples and dicts).  Gathered full parameters are released between steps (empty storages)."""
        found: list[torch.Tensor] = []

        def walk(value, depth: int) -> None:
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif depth > 0 and isinstance(value, (list, tuple)):
                for item in value:
                    walk(item, depth - 1)
            elif depth > 0 and isinstance(value, dict):
                for item in value.values():
                    walk(item, depth - 1)

        for p in self.engine.module.parameters():
            walk(getattr(p, "ds_tensor", None), 0)
            walk(p.grad, 0)
        for owner in (self.engine.optimizer, getattr(self.engine.optimizer, "optimizer", None), self.engine):
            for value in vars(owner).values() if owner is not None else ():
                walk(value, 2)
        inner = getattr(self.engine.optimizer, "optimizer", None)
        if inner is not None:
            walk(list(inner.state.values()), 2)
        return [t for t in found if t.device.type != "meta"]

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = loss_of(self.engine(input_ids=input_ids, labels=labels))
        self.engine.backward(loss)
        return loss.detach()

    def gradients(self) -> dict[str, torch.Tensor]:
        from deepspeed.utils import safe_get_full_grad

        grads = {}
        for name, p in self.engine.module.named_parameters():
            g = safe_get_full_grad(p)  # gathers this parameter's partitions (a collective: all ranks call it)
            if g is not None:
                grads[name] = g.detach().clone().reshape(p.ds_shape if hasattr(p, "ds_shape") else p.shape)
        return grads

    def zero_grad(self) -> None:
        # The ZeRO-3 optimizer owns the reduced gradient partitions; its zero_grad also restarts
        # gradient accumulation (the engine's own zero_grad only drops param.grad).
        self.engine.optimizer.zero_grad(set_to_none=True)
