"""The systems the paper compares AutoSP against, behind one interface so a benchmark can run them side by side.

Every system is built by `build_system` from a model (which it takes over: it may
install its attention in it, wrap or partition it) and trains one step at a time
through the `System` protocol: ``step(input_ids, labels)`` gets the same
full-length sample on every rank of a sequence-parallel (SP) group, runs forward,
backward and the gradient synchronisation, and returns the loss; ``gradients()``
gives each parameter's gradient as single-device training would have it, for
error measurement.  Systems: ``autosp`` (this project's compiler pass, default
settings), ``autosp-nosac`` (the same with sequence-aware activation
checkpointing off: ``checkpointing="none"``),
``ulysses`` (hand-written DeepSpeed-Ulysses on ``DistributedAttention``),
``ulysses+ckpt`` (the same with per-layer activation checkpointing),
``ring`` (hand-written exact, load-balanced ring attention), ``zero3`` (DeepSpeed
ZeRO-3 data parallelism, no SP) and ``deepspeed-autosp`` (DeepSpeed's own AutoSP
pass, run as it is, faults included).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from experiments.baselines.common import BaselineUnsupported


@runtime_checkable
class System(Protocol):
    """One training system; every rank of every SP group drives it with the same calls."""

    name: str
    """The name it was built under (a key of `SYSTEMS`)."""

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


SYSTEMS = ("autosp", "autosp-nosac", "ulysses", "ulysses+ckpt", "ring", "zero3", "deepspeed-autosp")
"""Names `build_system` accepts."""


def build_system(
    name: str,
    model: nn.Module,
    *,
    sp_size: int,
    process_group: dist.ProcessGroup | None = None,
    compiler: str = "aot_eager",
    **options,
) -> System:
    """Build the system ``name`` around ``model`` on every rank of ``process_group`` (default: the world).

    ``process_group`` is split into SP groups of ``sp_size`` contiguous ranks (the
    groups are data-parallel replicas); ``compiler`` is the ``torch.compile``
    backend (``"aot_eager"``, ``"inductor"``, or ``"eager"`` for none).
    ``options`` go to the system's constructor (e.g. ``load_balance=False`` for
    ``ring``).  The system owns ``model`` from now on; pass a copy to keep one.
    Raises `BaselineUnsupported` (a ``NotImplementedError``) where a system cannot
    run this model, with the reason.
    """
    if name in ("autosp", "autosp-nosac"):
        from experiments.baselines.autosp_system import AutoSPSystem, autosp_options

        options = {**autosp_options(name), **options}
        return _checked(AutoSPSystem, name, model, sp_size, process_group, compiler, options)
    elif name in ("ulysses", "ulysses+ckpt"):
        from experiments.baselines.ulysses import UlyssesSystem as cls

        if name == "ulysses+ckpt":
            options = {"activation_checkpointing": True, **options}
    elif name == "ring":
        from experiments.baselines.ring import RingSystem as cls
    elif name == "zero3":
        from experiments.baselines.zero3 import ZeRO3System as cls
    elif name == "deepspeed-autosp":
        from experiments.baselines.deepspeed_autosp import DeepSpeedAutoSPSystem as cls
    else:
        raise ValueError(f"unknown system {name!r}; choose one of {list(SYSTEMS)}")
    return _checked(cls, name, model, sp_size, process_group, compiler, options)


def _checked(cls, name, model, sp_size, process_group, compiler, options) -> System:
    if sp_size < 1:
        raise ValueError(f"sp_size must be a positive number of ranks, got {sp_size}")
    system = cls(model, sp_size=sp_size, process_group=process_group, compiler=compiler, **options)
    system.name = name
    return system


__all__ = ["SYSTEMS", "BaselineUnsupported", "System", "build_system"]
