"""``build_system("deepspeed-autosp", ...)``: DeepSpeed's own AutoSP pass, run as it is, faults included.

DeepSpeed 0.18.9+ ships AutoSP as a DeepCompile pass (``deepspeed/compile/passes/
sp_compile.py``).  We call it the way DeepSpeed's backend does, without the engine
(whose backward prologue needs CUDA): a ``torch.compile`` backend that runs
``apply_autosp`` on the Dynamo graph (shard the tagged inputs, all-to-all around
each SDPA) and then compiles the result with ``compiler``.  Inputs are tagged by
DeepSpeed's ``prepare_autosp_inputs`` (full-length; the graph slices them).
Gradients are then averaged over the world, as DeepSpeed's engine does with the
configuration of DeepSpeed's AutoSP examples (``sequence_parallel_size`` set, no
``data_parallel_size``, so no SP mesh: the gradient all-reduce averages every rank).

What this reproduces, on purpose (see docs/design.md): labels are sliced before the
model shifts them, so each shard border loses its target, and each rank's loss is
its local mean, unweighted by valid tokens; `step` returns that local loss and the
gradients are wrong accordingly.  A model that builds its position ids inside
``forward`` (the project's PlainLlama) is not sharded consistently and fails to
compile (a RoPE shape error); `step` raises `BaselineUnsupported` with the reason.
With ``sac=True`` and ``compiler="inductor"`` DeepSpeed's complete backend
(``init_autosp``) is used, which also patches torch's min-cut partitioner for the
whole process (sequence-aware checkpointing); it is off by default so that other
systems compiled in the same process are not affected.  DeepSpeed keeps its SP
mesh in a process-wide registry: one SP size per process.
"""

from __future__ import annotations

import inspect
import logging
import types

import torch
import torch.distributed as dist
from torch import nn

from experiments.baselines.common import (
    BaselineUnsupported,
    ensure_deepspeed_comm,
    loss_of,
    named_gradients,
    sync_gradients,
)

log = logging.getLogger(__name__)


def _accepts_position_ids(model: nn.Module) -> bool:
    params = inspect.signature(model.forward).parameters
    return "position_ids" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def make_backend(sp_size: int, dp_size: int, compiler: str, *, sac: bool = False):
    """A ``torch.compile`` backend: DeepSpeed's ``apply_autosp`` then ``compiler`` (or DeepSpeed's own backend)."""
    if sac:
        if compiler != "inductor":
            raise ValueError("sac=True uses DeepSpeed's own backend, which compiles with inductor; pass compiler='inductor'")
        from deepspeed.compile.init_sp import init_autosp

        return init_autosp(types.SimpleNamespace(_param_dict={"sequence_parallel_size": sp_size}))

    from deepspeed.compile.passes.sp_compile import apply_autosp

    def deepspeed_autosp_backend(gm: torch.fx.GraphModule, example_inputs):
        apply_autosp(gm, example_inputs, sp_size=sp_size, dp_size=dp_size)
        if compiler == "inductor":
            return torch._inductor.compile(gm, example_inputs)  # what DeepSpeed's init_autosp does
        if compiler == "eager":
            return gm.forward
        return torch._dynamo.lookup_backend(compiler)(gm, example_inputs)

    return deepspeed_autosp_backend


class DeepSpeedAutoSPSystem:
    """Runs; known to be inexact (see the module docstring).  `step` returns this rank's local-mean loss."""

    name = "deepspeed-autosp"

    def __init__(
        self, model: nn.Module, *, sp_size: int, process_group: dist.ProcessGroup | None = None,
        compiler: str = "aot_eager", sac: bool = False,
    ):
        if process_group is not None and process_group != dist.group.WORLD:
            raise BaselineUnsupported("deepspeed-autosp: DeepSpeed's AutoSP meshes the whole world; pass process_group=None")
        world = dist.get_world_size()
        if world % sp_size:
            raise ValueError(f"sp_size={sp_size} does not divide the world of {world} ranks")
        ensure_deepspeed_comm()
        self.model = model
        self._world = world
        self._positions = _accepts_position_ids(model)
        backend = make_backend(sp_size, world // sp_size, compiler, sac=sac)
        self._compiled = torch.compile(model, backend=backend, fullgraph=True)
        log.info("deepspeed-autosp: sp_size=%d, compiler=%s, sac=%s", sp_size, compiler, sac)

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from deepspeed.compile.passes.sp_compile import prepare_autosp_inputs

        # Fresh tensors: prepare_autosp_inputs tags them and marks the sequence dimension dynamic.
        ids, lab = input_ids.clone(), labels.clone()
        positions = torch.arange(ids.shape[1], device=ids.device)[None].expand_as(ids).clone() if self._positions else None
        ids, lab, positions, _ = prepare_autosp_inputs(ids, lab, positions, seq_dim=1)
        kwargs = {"input_ids": ids, "labels": lab}
        if positions is not None:
            kwargs["position_ids"] = positions
        try:
            loss = loss_of(self._compiled(**kwargs))
        except torch._dynamo.exc.BackendCompilerFailed as err:
            hint = "" if self._positions else (
                f" {type(self.model).__name__}.forward takes no position_ids, so DeepSpeed's pass cannot shard the "
                "positions the model builds itself (torch.arange over the sequence) and RoPE sees the full "
                "length against sharded queries and keys."
            )
            raise BaselineUnsupported(f"DeepSpeed's AutoSP failed to compile {type(self.model).__name__}.{hint} "
                                      f"DeepSpeed's error: {_first_line(err.inner_exception)}") from err
        loss.backward()
        sync_gradients(self.model, dist.group.WORLD, divide_by=self._world)  # the engine's average
        return loss.detach()

    def gradients(self) -> dict[str, torch.Tensor]:
        return named_gradients(self.model)

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

