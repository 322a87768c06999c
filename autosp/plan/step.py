"""The simulated training step of a traced program: the data-parallel replicas, DeepSpeed's gradient reduction
and optimizer step added, simulated on a cluster, and its depth extrapolated from shallow traces
(`simulate_step`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from autosp.errors import AutoSPError
from autosp.plan.model_source import ModelSource
from autosp.plan.setup import TrainingSetup, torch_dtype
from autosp.plan.traces import (
    OFFLOAD_OPTION,
    CaptureKeeper,
    Traced,
    TraceFacts,
    TraceReuse,
    checkpointing_variant,
    partitioned_steps,
    sharded_training_step,
    trace_step,
)
from simulator.cluster import Cluster
from simulator.engine import simulate
from simulator.ledger import TrainingConfig
from simulator.max_length import (
    DepthExtrapolationError,
    ModelStep,
    extrapolate_depth,
)
from simulator.result import Result
from simulator.training_step import (
    add_training_step,
)
from simulator.workload import Workload

log = logging.getLogger(__name__)

def _without_optimizer(workload: Workload) -> Workload:
    return dataclasses.replace(workload, ranks={
        r: dataclasses.replace(p, ops=tuple(op for op in p.ops if op.phase != "optimizer"))
        for r, p in workload.ranks.items()})


@dataclass(frozen=True, kw_only=True)
class StepPrediction(ModelStep):
    """A simulated step of the whole model at one length (what the max-length search runs over)."""

    micro_step_time_s: float
    """One micro-step: forward and backward (and ZeRO 2's reduction); the optimizer step is in ``step_time_s``."""
    simulated: Result | None = field(default=None, compare=False, repr=False)
    """The simulator's result of the traced training step (with depth extrapolation: of the deeper trace), for
    `simulator.plots` (timeline, memory over time)."""
    unrolled_from: int | None = None
    """The traced depth whose middle layer was replicated to the full depth, which was then simulated whole (Note
    [Unrolling a traced workload to the model's depth] in simulator/depth_unroll.py); None: not unrolled."""


def _simulated(traced: Traced, setup: TrainingSetup, cluster: Cluster,
               reuse: TraceReuse | None) -> tuple[float, float, int, Result, int]:
    """(step time, micro-step time, activations, result, host activations) of one traced step simulated."""
    start = time.perf_counter()
    result = simulate(traced.step, cluster) if reuse is None else reuse.simulate(traced, traced.step, cluster)
    dynamic = max(r.peak_memory_bytes - r.static_memory_bytes for r in result.ranks)
    host = result.host_peak_memory_bytes  # offloaded activations (Note [Host tensors] in simulator/workload_types.py)
    step_s = micro_s = result.step_time_s
    # the CPU optimizer step under offload, outside the simulated step (Note [Optimizer offload traffic])
    step_s += traced.step.metadata["training_step"]["host_optimizer_s"]
    if setup.grad_accum > 1:
        # ZeRO 2 reduces its gradients every micro-step; ZeRO 0 (and 1) at the accumulation boundary only.
        if setup.zero_stage == 2:
            micro_s = simulate(_without_optimizer(traced.step), cluster).step_time_s
        else:
            micro_s = (simulate(traced.backward, cluster) if reuse is None
                       else reuse.simulate(traced, traced.backward, cluster)).step_time_s
        step_s += (setup.grad_accum - 1) * micro_s
    log.info("simulated on %s in %.1f s: step %.3f s, activations %.2f GiB (host %.2f GiB)",
             cluster.preset.name, time.perf_counter() - start, step_s, dynamic / 2**30, host / 2**30)
    return step_s, micro_s, dynamic, result, host


def _extrapolated(values: Mapping[int, tuple], model_layers: int) -> tuple[float, float, int, int]:
    """(step time, micro-step time, activations, host activations) of ``model_layers`` layers from `_simulated`'s
    answers at 1 and 2 layers (`simulator.max_length.extrapolate_depth`, which refuses a line that falls)."""
    step_s, dynamic = extrapolate_depth(lambda d: (values[d][0], values[d][2]), model_layers, (1, 2))
    micro_s, host = extrapolate_depth(lambda d: (values[d][1], values[d][4]), model_layers, (1, 2))
    return step_s, micro_s, dynamic, host


def _partition_copy(capture, facts: TraceFacts, propagated: tuple, *, checkpointing: str, budget: float | None,
                    tag_joint) -> object:
    """`autosp.joint_template.partition_at` of a copy of ``capture``'s joint graph under ``checkpointing`` and
    ``budget`` with ``tag_joint``'s recomputation tags, so that each pattern partitions its own copy.
    ``propagated``: `propagate_fake` of ``capture``, taken before any copy: the copy takes its nodes' metadata, which
    a capture re-sized to this length (not traced at it) has only once propagated."""
    from autosp.joint_template import partition_at
    from autosp.passes.graph_utils import graph_copy

    graph = graph_copy(capture.graph)  # partitioned, never called
    sac = dataclasses.replace(facts.compiled_with, checkpointing=checkpointing, sac_memory_budget=budget)
    return partition_at(dataclasses.replace(capture, graph=graph), sac, tag_joint=tag_joint, propagated=propagated)


def _captures(source: ModelSource, setup: TrainingSetup, depths, *, seq_len: int, config: TrainingConfig,
              options: Mapping | None, reuse: TraceReuse | None) -> dict[int, tuple]:
    """For each of ``depths`` layers, (joint graph capture, `TraceFacts`, reused?) of the step: from ``reuse``'s
    captures where there is one, else from a trace of its own."""
    captured = {}
    for layers in depths:
        if reuse is not None:
            captured[layers] = reuse.captured(source, setup, seq_len=seq_len, layers=layers, config=config,
                                              options=options)
        else:
            into = CaptureKeeper()
            trace_step(source, setup, seq_len=seq_len, layers=layers, config=config, options=options,
                       capture_into=into)
            captured[layers] = (into.capture, into.facts, False)
    return captured


def _shallow_sac_step(source: ModelSource, setup: TrainingSetup, cluster: Cluster, config: TrainingConfig,
                      model_layers: int, seq_len: int, options: Mapping | None,
                      reuse: TraceReuse | None) -> StepPrediction:
    """The step of ``model_layers`` layers under SAC from traces of 1 and 2 layers whose joint graphs are tagged
    with the full model's SAC decision (Note [Shallow traces checkpointed for the full depth] in
    autosp/plan/depth.py); `DepthExtrapolationError` where that does not hold."""


    from autosp.joint_template import propagate_fake
    from autosp.plan.depth import FullDepthTagger

    captured = _captures(source, setup, (2, 1), seq_len=seq_len, config=config, options=options, reuse=reuse)
    checkpointing, budget = checkpointing_variant(options)
    facts = captured[2][1]
    tags = FullDepthTagger(model_layers=model_layers, recompute_limit=facts.compiled_with.sac_recompute_limit,
                           memory_budget=budget)
    values: dict[str, dict[int, tuple]] = {}
    start = time.perf_counter()
    # The fake tensors of each joint graph, once (the trace's own: Note [The trace's fake tensors] in
    # autosp/joint_template.py), before any copy (`_partition_copy`).
    propagated = {layers: propagate_fake(captured[layers][0]) for layers in (2, 1)}
    patterns = ["every"]
    while patterns:
        pattern = patterns.pop(0)
        for layers in (2, 1):
            capture, facts, rewrites_here = captured[layers]
            report = _partition_copy(capture, facts, propagated[layers], checkpointing=checkpointing, budget=budget,
                                     tag_joint=tags.tagger(pattern))
            if reuse is not None:
                reuse.partitions += 1
            traced = partitioned_steps(source, setup, report, facts, seq_len=seq_len, layers=layers, config=config,
                            options=options, rewrites_here=rewrites_here)[(checkpointing, budget)]
            if rewrites_here and (options or {}).get(OFFLOAD_OPTION) == "on":
                traced = traced.rebuild(traced.graphs, offload=True)
            values.setdefault(pattern, {})[layers] = _simulated(traced, setup, cluster, reuse)
        if pattern == "every":
            patterns = [p for p in tags.decision.patterns if p != "every"]
    share = tags.decision.share
    lines = {p: _extrapolated(v, model_layers) for p, v in values.items()}
    mixed = [sum((share if p == "some" else 1 - share if len(lines) > 1 else 1) * line[i] for p, line in lines.items())
             for i in range(4)]
    log.info("SAC for %d layers from 1 and 2 (%d program(s), %.0f%% of the bytes between them recomputed) in "
             "%.1f s", model_layers, len(lines), 100 * share, time.perf_counter() - start)
    return StepPrediction(seq_len=seq_len, step_time_s=mixed[0], micro_step_time_s=mixed[1],
                          dynamic_memory_bytes=int(mixed[2]), host_dynamic_memory_bytes=int(mixed[3]),
                          simulated=values["every"][2][3], extrapolated_from=(1, 2))


def _unrolled_step(source: ModelSource, setup: TrainingSetup, cluster: Cluster, config: TrainingConfig,
                   model_layers: int, seq_len: int, options: Mapping | None,
                   reuse: TraceReuse | None) -> StepPrediction:
    """The step of ``model_layers`` layers with activation offload from a trace of `UNROLL_LAYERS` layers whose
    middle layer is replicated to the full depth, then simulated whole (Note [Unrolling a traced workload to the
    model's depth] in simulator/depth_unroll.py); under SAC the trace is tagged with the full model's decision
    (Note [Shallow traces checkpointed for the full depth] in autosp/plan/depth.py), each of its bracketing programs
    unrolled and simulated, and the two mixed.  `DepthExtrapolationError` where that does not hold."""


    from autosp.joint_template import propagate_fake
    from autosp.plan.depth import EVERY, SOME, FullDepthTagger
    from simulator.depth_unroll import UNROLL_LAYERS, unroll_depth

    start = time.perf_counter()
    checkpointing, budget = checkpointing_variant(options)
    hf = source.config(seq_len=seq_len)
    programs: dict[str, Traced] = {}
    share = 0.0
    if checkpointing != "sac":
        programs[EVERY] = (trace_step(source, setup, seq_len=seq_len, layers=UNROLL_LAYERS, config=config,
                                      options=options) if reuse is None else
                           reuse.trace(source, setup, seq_len=seq_len, layers=UNROLL_LAYERS, config=config,
                                       options=options))
    else:
        captured = _captures(source, setup, (2, UNROLL_LAYERS), seq_len=seq_len, config=config, options=options,
                             reuse=reuse)
        tags = FullDepthTagger(model_layers=model_layers,
                               recompute_limit=captured[2][1].compiled_with.sac_recompute_limit, memory_budget=budget)

        # The fake tensors of each joint graph, once, before any copy (`_partition_copy`).
        propagated = {layers: propagate_fake(captured[layers][0]) for layers in captured}

        def partitioned(layers: int, pattern: str):
            capture, facts, _ = captured[layers]
            if reuse is not None:
                reuse.partitions += 1
            return _partition_copy(capture, facts, propagated[layers], checkpointing=checkpointing, budget=budget,
                                   tag_joint=tags.tagger(pattern))

        partitioned(2, EVERY)  # the two-layer graph decides for the full depth (`FullDepthTagger`)
        for pattern in tags.decision.patterns:
            _, facts, rewrites_here = captured[UNROLL_LAYERS]
            traced = partitioned_steps(source, setup, partitioned(UNROLL_LAYERS, pattern), facts, seq_len=seq_len,
                            layers=UNROLL_LAYERS, config=config, options=options,
                            rewrites_here=rewrites_here)[(checkpointing, budget)]
            if rewrites_here:
                traced = traced.rebuild(traced.graphs, offload=True)
            programs[pattern] = traced
        share = tags.decision.share
    values = {}
    for pattern, traced in programs.items():
        static = traced.backward.program(0).static_memory
        full = sum(source.parameter_numels(hf)) * torch_dtype(setup.dtype).itemsize
        static = dataclasses.replace(static, **{f: getattr(static, f) * full // static.parameter_bytes
                                                for f in ("parameter_bytes", "gradient_bytes", "optimizer_bytes")})
        backward, gradients = unroll_depth(traced.backward, traced_layers=UNROLL_LAYERS, layers=model_layers,
                                           gradients=traced.gradients, static_memory=static,
                                           name=f"{source.spec}/L={model_layers}/S={seq_len}")
        if setup.zero_stage == 3:  # gathered and reduce-scattered in the program (`zero3_workload`)
            step = sharded_training_step(backward, config)
        else:
            step = add_training_step(backward, gradients, config, group="dp",
                                     group_instances=[list(range(setup.world_size))])
        values[pattern] = _simulated(Traced(layers=model_layers, backward=backward, step=step), setup, cluster,
                                     reuse)
    mixed = [sum((share if p == SOME else 1 - share if len(values) > 1 else 1) * v[i] for p, v in values.items())
             for i in (0, 1, 2, 4)]
    log.info("activation offload at %d layers from %d, middle layer replicated (%d program(s)) in %.1f s",
             model_layers, UNROLL_LAYERS, len(values), time.perf_counter() - start)
    return StepPrediction(seq_len=seq_len, step_time_s=mixed[0], micro_step_time_s=mixed[1],
                          dynamic_memory_bytes=int(mixed[2]), host_dynamic_memory_bytes=int(mixed[3]),
                          simulated=values[EVERY][3], unrolled_from=UNROLL_LAYERS)


def simulate_step(source: ModelSource, setup: TrainingSetup, cluster: Cluster, config: TrainingConfig,
                  model_layers: int, seq_len: int, options: Mapping | None = None,
                  reuse: TraceReuse | None = None) -> StepPrediction:
    """Step time and activations of the whole model at ``seq_len`` tokens (full depth, or extrapolated: SAC as
    `_shallow_sac_step`, other settings by a straight line); ``reuse``: traces and simulations shared with other
    plans."""
    if cluster.world_size < setup.world_size:
        raise AutoSPError(f"the cluster has {cluster.world_size} devices but SP {setup.sp_size} x DP "
                          f"{setup.dp_size} needs {setup.world_size}; give a bigger cluster or fewer ranks")
    shallow = setup.depth == "extrapolated" and model_layers > 3  # 1 + 2 traced layers: no fewer than the model's
    if shallow and (options or {}).get(OFFLOAD_OPTION) == "on":
        # Note [Shallow traces checkpointed for the full depth] in autosp/plan/depth.py: activation offload is
        # unrolled, not extrapolated (a model no deeper than the unrolled trace is traced whole)
        from simulator.depth_unroll import UNROLL_LAYERS

        if model_layers > UNROLL_LAYERS:
            try:
                return _unrolled_step(source, setup, cluster, config, model_layers, seq_len, options, reuse)
            except DepthExtrapolationError as exc:
                log.warning("%d tokens, activation offload: %s; tracing all %d layers", seq_len, exc, model_layers)
        shallow = False
    if shallow and checkpointing_variant(options)[0] == "sac":
        try:
            return _shallow_sac_step(source, setup, cluster, config, model_layers, seq_len, options, reuse)
        except DepthExtrapolationError as exc:  # Note [Shallow traces checkpointed for the full depth]
            log.warning("%d tokens: %s; tracing all %d layers", seq_len, exc, model_layers)
            shallow = False

    memo: dict[int, tuple[float, float, int, Result, int]] = {}

    def cached(layers: int) -> tuple[float, float, int, Result, int]:
        if layers not in memo:
            depth = None if layers == model_layers else layers
            if reuse is None:
                traced = trace_step(source, setup, seq_len=seq_len, layers=depth, config=config, options=options)
            else:
                traced = reuse.trace(source, setup, seq_len=seq_len, layers=depth, config=config, options=options)
            memo[layers] = _simulated(traced, setup, cluster, reuse)
        return memo[layers]

    if shallow:
        try:
            step_s, micro_s, dynamic, host = _extrapolated({d: cached(d) for d in (1, 2)}, model_layers)
            return StepPrediction(seq_len=seq_len, step_time_s=step_s, dynamic_memory_bytes=dynamic,
                                  host_dynamic_memory_bytes=host, micro_step_time_s=micro_s, simulated=memo[2][3],
                                  extrapolated_from=(1, 2))
        except DepthExtrapolationError as exc:  # Note [Depth extrapolation] in simulator/max_length.py
            log.warning("%d tokens: %s; tracing all %d layers", seq_len, exc, model_layers)
    step_s, micro_s, dynamic, result, host = cached(model_layers)
    return StepPrediction(seq_len=seq_len, step_time_s=step_s, dynamic_memory_bytes=dynamic,
                          host_dynamic_memory_bytes=host, micro_step_time_s=micro_s, simulated=result)
