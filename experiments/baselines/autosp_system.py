"""``build_system("autosp", ...)``: this project's compiler pass behind the common `System` interface.

A thin adapter: `autosp.compile` makes the sequence-parallel program from the
unmodified model, `autosp.prepare_inputs` hands it the full-length sample (it
cuts out the rank's shard itself), and `autosp.sync_gradients` sums gradients
over the SP group.  The loss it returns is already the full-sample loss on every
rank.  Extra ``options`` are `autosp.AutoSPConfig` fields.

Every strategy the pass implements (``autosp``, ``autosp-nosac``, ... in
`simulator.strategies.STRATEGIES`) runs here with its registry options
(`autosp_options`): ``autosp-nosac`` is the same system with
``checkpointing="none"``; with an `autosp.AutoSPConfig` that has no
``checkpointing`` field (no SAC to turn off) it is plain ``autosp``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

import autosp
from experiments.baselines.common import loss_of, named_gradients
from simulator.strategies import STRATEGIES


def autosp_options(name: str) -> dict:
    """The `autosp.compile` options of strategy ``name`` (`simulator.strategies.STRATEGIES`) that the installed
    pass accepts (`simulator.strategies.Strategy.options_for`): what an AutoSP strategy runs with here and what
    every simulated workload is traced with.  Raises ``ValueError`` for a strategy the installed pass cannot
    run (a ``strategy`` option it lacks)."""
    return STRATEGIES[name].options_for({f.name for f in dataclasses.fields(autosp.AutoSPConfig)})


class AutoSPSystem:
    """Exact: loss and gradients equal single-device training (tested in tests/autosp and tests/experiments)."""

    name = "autosp"

    def __init__(
        self, model: nn.Module, *, sp_size: int, process_group: dist.ProcessGroup | None = None,
        compiler: str = "aot_eager", **options,
    ):
        self.model = model
        config = getattr(model, "config", None)
        if getattr(config, "use_cache", False):
            # Trained without a KV cache, as every baseline calls the model (`adapters.local_logits`) and as
            # AutoSPTrainer sets it: a cache would hold every layer's keys and values to the end of the step, in
            # AutoSP's memory and not in the baselines'.  The model config says so (not a call argument), so that
            # memory_plan="auto", which rebuilds the model from its config, plans what runs.
            config.use_cache = False
        self.compiled = autosp.compile(model, sp_size=sp_size, process_group=process_group, compiler=compiler,
                                       **options)

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = loss_of(self.compiled(**autosp.prepare_inputs(input_ids, labels=labels)))
        loss.backward()
        autosp.sync_gradients(self.compiled)
        return loss.detach()

    def gradients(self) -> dict[str, torch.Tensor]:
        return named_gradients(self.model)

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)
