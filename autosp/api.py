"""The compile front door: `compile`, and `sync_gradients` (re-exported from the model core).

`compile` resolves the options (`AutoSPConfig`), asks the planner for a strategy when ``strategy="auto"``, builds
the process groups and returns the model core, `autosp.model.SequenceParallelModel`, given a first-batch plan
(`autosp.plan.auto.PlanAtFirstBatch`) when its memory is planned.  The core never imports the planner; the planner
traces through the core (`autosp.tracing`), never through this door.  docs/design.md, "The compile path".
"""

from __future__ import annotations

import dataclasses
import warnings

import torch.distributed as dist
from torch import nn

from autosp.config import MEMORY_PLAN_OPTIONS, PLANNING_OPTIONS, AutoSPConfig
from autosp.errors import AutoSPError
from autosp.groups import build_groups
from autosp.model import MemoryMeter, SequenceParallelModel, sync_gradients
from autosp.plan.auto import (
    PlanAtFirstBatch,
    check_plannable,
    decide_strategy,
    resolve_memory_plan,
    strategy_with_memory,
)
from autosp.plan.process import PlannerProcess

__all__ = ["SequenceParallelModel", "compile", "sync_gradients"]


def compile(  # noqa: A001 - mirrors torch.compile
    model: nn.Module,
    *,
    sp_size: int,
    process_group: dist.ProcessGroup | None = None,
    compiler: str = "inductor",
    planner: PlannerProcess | None = None,
    memory_meter: MemoryMeter | None = None,
    **options,
) -> SequenceParallelModel:
    """Compile ``model`` for sequence parallelism over ``sp_size`` ranks (Ulysses, ``strategy="ring"``,
    ``strategy="hybrid"`` with ``ulysses_size``, or ``strategy="auto"`` with ``plan_seq_len``: the planner's
    choice among them, `autosp.plan.auto.decide_strategy`).

    ``process_group`` (default: the world) is split into SP groups of ``sp_size``
    contiguous ranks; the groups are data-parallel replicas.  ``options`` are the
    other fields of `AutoSPConfig`.  Every rank of the group must call this.

    ``planner``: this rank's planner process for ``strategy="auto"`` or ``memory_plan="auto"``, started by the
    script before it loaded its model (``autosp.start_planner()``), so that its imports are not waited for
    (Note [Planner process started ahead] in autosp/plan/process.py).

    ``memory_meter``: what measures the device memory of a ``memory_plan="auto"`` model's first steps, checked
    against ``target_memory`` (Note [The plan's promise checked] in autosp/model.py); default: the CUDA
    allocator's peak on a GPU, nothing on a CPU.
    """
    config = AutoSPConfig.from_options(sp_size=sp_size, compiler=compiler, options=options)
    owned = planner  # closed on the way out (a no-op once it answered) unless the compiled model takes it over
    try:
        config = resolve_memory_plan(model, config)  # Note [The default memory plan] in autosp/plan/auto.py
        if planner is not None and config.memory_plan != "auto" and config.strategy != "auto":
            raise AutoSPError("planner= is the planner process of strategy='auto' or memory_plan='auto', and this "
                              "compile plans nothing: drop it, or ask for one of them")
        explicit = {k: v for k, v in options.items() if k in MEMORY_PLAN_OPTIONS}
        if config.memory_plan == "auto" or config.strategy == "auto":
            check_plannable(model, config)
        strategy_plan, first_batch_plan = None, None
        if config.strategy == "auto" and config.memory_plan == "auto":  # one decision, before compiling
            strategy_plan, first_batch_plan = strategy_with_memory(model, config, process_group, explicit=explicit,
                                                                   planner=planner)
            config = dataclasses.replace(config, **strategy_plan["options"])
        elif config.strategy == "auto":  # the planner chooses; every rank compiles its choice (autosp.plan.auto)
            strategy_plan = decide_strategy(model, config, process_group, explicit=explicit, planner=planner)
            planned = {f.name: f.default for f in dataclasses.fields(config) if f.name in PLANNING_OPTIONS}
            config = dataclasses.replace(config, **strategy_plan["options"], **planned)
        check_heads(model, config)
        groups = build_groups(sp_size, process_group, layout=config.layout)
        if sp_size == 1:
            warnings.warn("autosp.compile with sp_size=1 compiles the model without sequence parallelism "
                          "(the checkpointing, tiled_loss and tiled_mlp options still apply)", stacklevel=2)
        if config.memory_plan != "auto":
            return SequenceParallelModel(model, config, groups, strategy_plan=strategy_plan)
        first_batch_plan = first_batch_plan or PlanAtFirstBatch(groups.group, explicit, planner)
        owned = None
        try:
            return SequenceParallelModel(model, config, groups, strategy_plan=strategy_plan,
                                         first_batch_plan=first_batch_plan, memory_meter=memory_meter)
        except BaseException:
            first_batch_plan.close()  # else the compiled model closes it after its plan
            raise
    finally:
        if owned is not None:
            owned.close()


def check_heads(model: nn.Module, config: AutoSPConfig) -> None:
    """The strategy's heads rule (`simulator.workload.SPLayout.heads_rule`) on the model's own config, at compile:
    a Hugging Face model whose ``num_attention_heads`` its layout cannot split is refused here, before any rank
    traces (the attention rule refuses the same at trace time for a model without such a config)."""
    try:
        heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
    except Exception:  # noqa: BLE001 - a config whose heads vary by layer refuses the global read (transformers'
        heads = None  # AmbiguousGlobalPerLayerAttributeError); the attention rule checks each layer when traced
    layout = config.layout
    if not isinstance(heads, int) or isinstance(heads, bool) or layout is None:
        return
    why = layout.heads_rule(heads)
    if why is not None:
        raise AutoSPError(f"{type(model).__name__}'s config (num_attention_heads) has {why}")
