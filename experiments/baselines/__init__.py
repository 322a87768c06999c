"""The systems the paper compares AutoSP against, behind one interface so a benchmark can run them side by side.

Every system is built by `build_system` from a model (which it takes over: it may
install its attention in it, wrap or partition it) and trains one step at a time
through the `System` protocol: ``step(input_ids, labels)`` gets the same
full-length sample on every rank of a sequence-parallel (SP) group, runs forward,
backward and the gradient synchronisation, and returns the loss; ``gradients()``
gives each parameter's gradient as single-device training would have it, for
error measurement.  Systems: the strategies of `simulator.strategies.STRATEGIES`,
by the registry's name; who implements one says which class runs it: ``autosp``
(this project's compiler pass with the strategy's options, e.g. ``autosp`` and
``autosp-nosac``), ``hand-written`` Ulysses on ``DistributedAttention``
(``ulysses``; ``ulysses+ckpt`` with per-layer activation checkpointing) or exact,
load-balanced ring attention (``ring``), and ``deepspeed``: ZeRO-3 data
parallelism, no SP (``zero3``), DeepSpeed's own AutoSP pass, run as it is,
faults included (``deepspeed-autosp``), or DeepSpeed's ALST components as ArcticTraining
puts them together (``alst``, experiments/baselines/alst.py).  The measured tables list
``STRATEGIES.table("measured-cpu")``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from experiments.baselines.common import BaselineUnsupported
from simulator.strategies import STRATEGIES


@runtime_checkable
class System(Protocol):
    """One training system; every rank of every SP group drives it with the same calls."""

    name: str
    """The name it was built under (a name of `simulator.strategies.STRATEGIES`)."""

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward, backward and gradient sync on a full-length [B, S] sample (the same on every rank of
        an SP group; unshifted labels, -100 where ignored); returns the loss as a detached scalar."""
        ...

    def gradients(self) -> dict[str, torch.Tensor]:
        """Parameter name (as in the model passed in) -> gradient after sync, as single-device training has it.

        May be collective (zero3 gathers partitions): call it on every rank."""
        ...

    def zero_grad(self) -> None:
        """Drop the gradients, so that the next `step` starts from none."""
        ...


def build_system(
    name: str,
    model: nn.Module,
    *,
    sp_size: int,
    process_group: dist.ProcessGroup | None = None,
    compiler: str = "aot_eager",
    **options,
) -> System:
    """Build the system ``name`` (a strategy of `simulator.strategies.STRATEGIES`) around ``model`` on every
    rank of ``process_group`` (default: the world).

    ``process_group`` is split into SP groups of ``sp_size`` contiguous ranks (the
    groups are data-parallel replicas); ``compiler`` is the ``torch.compile``
    backend (``"aot_eager"``, ``"inductor"``, or ``"eager"`` for none).
    ``options`` go to the system's constructor (e.g. ``load_balance=False`` for
    ``ring``).  The system owns ``model`` from now on; pass a copy to keep one.
    Raises `simulator.strategies.UnknownStrategyError` (a ``ValueError``) for a name
    that is no strategy, and `BaselineUnsupported` (a ``NotImplementedError``) where a
    system cannot run this model or here, with the reason.
    """
    strategy = STRATEGIES[name]
    kind = (strategy.implementation, strategy.sequence_parallel)
    if strategy.implementation == "autosp":
        from experiments.baselines.autosp_system import AutoSPSystem as cls
        from experiments.baselines.autosp_system import autosp_options

        try:
            options = {**autosp_options(name), **options}
        except ValueError as e:  # a strategy option the installed pass lacks
            raise BaselineUnsupported(str(e)) from None
    elif name == "alst":
        from experiments.baselines.alst import ALSTSystem as cls
    elif kind == ("hand-written", "ulysses"):
        from experiments.baselines.ulysses import UlyssesSystem as cls

        # Note [Ulysses with per-layer checkpointing] in experiments/paper_scale/baselines.py: "layer" is what it runs
        if strategy.compile_options.get("checkpointing") == "layer":
            options = {"activation_checkpointing": True, **options}
    elif kind == ("hand-written", "ring"):
        from experiments.baselines.ring import RingSystem as cls
    elif kind == ("deepspeed", "none"):
        from experiments.baselines.zero3 import ZeRO3System as cls
    elif kind == ("deepspeed", "ulysses"):
        from experiments.baselines.deepspeed_autosp import DeepSpeedAutoSPSystem as cls
    else:
        raise BaselineUnsupported(f"no runnable system for {name} ({strategy.implementation}, "
                                  f"{strategy.sequence_parallel})")
    return _checked(cls, name, model, sp_size, process_group, compiler, options)


def _checked(cls, name, model, sp_size, process_group, compiler, options) -> System:
    if sp_size < 1:
        raise ValueError(f"sp_size must be a positive number of ranks, got {sp_size}")
    system = cls(model, sp_size=sp_size, process_group=process_group, compiler=compiler, **options)
    system.name = name
    return system


__all__ = ["BaselineUnsupported", "System", "build_system"]
