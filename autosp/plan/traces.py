"""Shape-only traces of a training step for the planner: one trace per program, re-sized to other lengths and
reused across candidates (`TraceReuse`; docs/design.md, "Trace reuse"), one Dynamo capture for every strategy
(`trace_strategies`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from autosp.config import MEMORY_TECHNIQUES
from autosp.errors import AutoSPError
from autosp.plan.model_source import ModelSource
from autosp.plan.setup import TrainingSetup, torch_dtype
from autosp.techniques import technique
from simulator.cluster import Cluster
from simulator.engine import simulate
from simulator.ledger import TrainingConfig
from simulator.max_length import (
    DepthExtrapolationError,
)
from simulator.replicas import data_parallel_replicas
from simulator.training_step import (
    GradientReady,
    add_training_step,
    gradients_from_modules,
    place_gradients,
)
from simulator.workload import Workload

log = logging.getLogger(__name__)

@dataclass(frozen=True, kw_only=True)
class Traced:
    """One traced micro-step (forward and backward) of ``layers`` layers, and its whole training step."""

    layers: int
    backward: Workload
    """Forward and backward of every rank, gradients released into the ledger's buffers."""
    step: Workload
    """``backward`` followed by the gradient reduction and the optimizer step."""
    graphs: tuple = field(default=(), compare=False, repr=False)
    """The traced forward and backward graphs, as partitioned (before `partitioned_rewrites` when the trace left
    them out: `trace_step`'s ``rewrites_here``)."""
    rebuild: Callable[..., Traced] | None = field(default=None, compare=False, repr=False)
    """``rebuild(graphs, offload=True)``: the step of ``graphs`` with activation offload on (`TraceReuse`)."""
    gradients: Mapping[int, tuple[GradientReady, ...]] = field(default_factory=dict, compare=False, repr=False)
    """Per rank of ``backward``: the ops that produce the parameters' gradients, which the training step reduces
    (`simulator.training_step.add_training_step`; `simulator.depth_unroll.unroll_depth` carries them to a deeper
    program)."""


OFFLOAD_OPTION = technique("activation_offload", MEMORY_TECHNIQUES).option
"""The `autosp.compile` option of activation offload: a rewrite of the partitioned graphs, so a plan with it on
reuses the trace (and the partition) of the same plan without it (`TraceReuse`, docs/design.md "Trace reuse")."""


def partitioned_rewrites(graphs: Sequence, *, config, num_fwd_outputs: int) -> list:
    """Copies of a partitioned forward and backward (``graphs``: (kind, graph) pairs, as partitioned) rewritten as
    the backend rewrites a partition compiled with ``config`` (`autosp.backend.rewrite_pair`; ``num_fwd_outputs``:
    the partitioner's, `autosp.context.CompileReport.num_fwd_outputs` of the trace).  For traces taken without
    those rewrites (`trace_step`'s ``rewrites_here``)."""
    from autosp.backend import rewrite_pair
    from autosp.passes.graph_utils import graph_copy, lazy_graph_modules

    graphs = dict(graphs)
    with lazy_graph_modules():  # the copies are exported, never called
        fw, bw = rewrite_pair(graph_copy(graphs["forward"]), graph_copy(graphs["backward"]), config=config,
                              num_fwd_outputs=num_fwd_outputs)
    return [("forward", fw), ("backward", bw)]




CHECKPOINTING_OPTIONS = technique("checkpointing", MEMORY_TECHNIQUES).options
"""The `autosp.compile` options that act only after AOTAutograd builds the joint graph: plans differing only in
these share one trace (`TraceReuse`)."""


def checkpointing_variant(options: Mapping | None) -> tuple[str, float | None]:
    """``options``' (checkpointing, sac_memory_budget), with `autosp.compile`'s defaults."""
    options = options or {}
    return options.get("checkpointing", "sac"), options.get("sac_memory_budget")


@dataclass(frozen=True, kw_only=True)
class TraceFacts:
    """What building a step needs from a trace besides its partitioned graphs: the same at every length of a
    `autosp.joint_template.LengthClass` (`TraceReuse`)."""

    parameter_bytes: int
    forward_graph: object
    """The Dynamo graph (`autosp.export.module_parameters` reads its parameter names)."""
    attention_kept_fraction: float | None
    compiled_with: object
    """The `autosp.config.AutoSPConfig` of the trace (with ``rewrites_here``: without the pair's rewrites)."""
    num_fwd_outputs: int
    """The partitioner's count of the forward's user outputs (`autosp.backend.rewrite_pair`)."""


def trace_step(source: ModelSource, setup: TrainingSetup, *, seq_len: int, layers: int | None,
               config: TrainingConfig, options: Mapping | None = None,
               variants: tuple[tuple[str, float | None], ...] = (),
               rewrites_here: bool = False, capture_into=None, mask_rules: dict | None = None
               ) -> Traced | dict[tuple, Traced]:
    """Trace ``layers`` decoder layers (None: all) at ``seq_len`` tokens and build the whole step of ``setup``
    (``config``: the ledger's configuration of the whole model; ``options``: `autosp.compile` options, e.g. the
    memory plan's checkpointing and tiled loss).  With ``variants`` ((checkpointing, sac_memory_budget) pairs) the
    one trace also partitions the joint graph under each (docs/design.md, "Trace reuse") and the answer maps each
    variant, and ``options``' own, to its step; variants with the same program share one `Traced`.
    ``rewrites_here``: the trace leaves out the partitioned-graph rewrites (activation offload, overlap), which
    `partitioned_rewrites` then applies to copies, so that one trace also builds the step with activation offload
    (`Traced.rebuild` on `Traced.graphs`, as partitioned).  ``capture_into``: a
    `autosp.joint_template.LengthClass` that keeps the trace's joint graph (`resized_steps`).  ``mask_rules``: the
    decision's shared mask rules (`TraceReuse.mask_rules`)."""
    import torch

    from autosp.tracing import trace_fake_step

    hf = source.config(seq_len=seq_len, num_layers=layers)
    depth = hf.num_hidden_layers
    traced_options = dict(options or {})
    if rewrites_here:
        traced_options.update(overlap_communication=False, **{OFFLOAD_OPTION: "off"})
    dtype = torch_dtype(setup.dtype)
    start = time.perf_counter()
    log.info("tracing %s: %d layers, %s x %d tokens over %d SP ranks", source.spec, depth, setup.micro_batch,
             seq_len, setup.sp_size)
    # Each trace compiles the model's code afresh on fake tensors; forget the previous traces' compiled code so
    # Dynamo's recompile limit is never reached (the planner owns the compiled functions of its process).
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="autosp.compile with sp_size=1")
        compiled, parameter_bytes = trace_fake_step(lambda: source.build(hf, dtype), seq_len=seq_len,
                                                    sp_size=setup.sp_size, vocab_size=hf.vocab_size, dtype=dtype,
                                                    micro_batch=setup.micro_batch, checkpointing_variants=variants,
                                                    capture_joint=capture_into is not None,
                                                    mask_rules=mask_rules, **traced_options)
    report = compiled.report
    log.info("traced in %.1f s: %d joint graph(s), %d partition(s)", time.perf_counter() - start,
             report.joint_graphs, report.partitions)
    facts = TraceFacts(parameter_bytes=parameter_bytes, forward_graph=report.forward_graphs[-1],
                        attention_kept_fraction=report.attention_kept_fraction, compiled_with=compiled.config,
                        num_fwd_outputs=report.num_fwd_outputs)
    if capture_into is not None:
        capture_into.add_capture(report.joint_capture, compiled.config, facts)
    found = partitioned_steps(source, setup, report, facts, seq_len=seq_len, layers=layers, config=config, options=options,
                   rewrites_here=rewrites_here)
    return found if variants else found[checkpointing_variant(options)]


STRATEGY_OPTIONS = ("strategy", "ulysses_size", "ring_size")
"""The `autosp.compile` options that select a sequence-parallel strategy: they act in the Dynamo-stage passes, after
Dynamo's capture, so strategies share that capture (`trace_strategies`)."""


def strategy_options(options: Mapping) -> dict:
    """The `STRATEGY_OPTIONS` of `autosp.compile` options (of a registry strategy's ``compile_options``: not its
    other ones, such as ``memory_plan="off"``, which `strategy="auto"` leaves as the job gave them)."""
    return {k: v for k, v in options.items() if k in STRATEGY_OPTIONS}


class _EveryStrategyCaptured(Exception):
    """Raised out of Dynamo's backend call once every strategy's joint graph is captured (`trace_strategies`)."""


# Note [One Dynamo capture for every strategy]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A strategy enters the program in the Dynamo-stage passes (autosp/passes/dynamo, run by the backend on the graph
# Dynamo hands it), not before: Dynamo's capture is the model's code on one rank's shard, which depends on the
# shard's shapes only, the same for Ulysses, the ring and every hybrid (the zig-zag layout changes which tokens a
# rank holds, not how many).  So `trace_strategies` captures once per depth and length: the first strategy's compiled
# model is called on the sample, its backend receives Dynamo's graph, and inside that call each strategy's compiled
# model is called on the same sample (its forward shards the sample and records the layout, as for its own trace)
# with its program compiled by its own backend (`autosp.backend.make_backend`: the passes, AOTAutograd's joint
# graph, captured, and its partition) from a copy of that graph.  Nothing then runs: the shallow traces of a decision
# need the joint graphs only (Note [Shallow traces checkpointed for the full depth] in autosp/plan/depth.py).  A
# strategy whose shard has other shapes is refused (its own trace).  The joint graphs equal those of separate traces
# but for the process groups' names (tests/autosp/test_strategy_auto.py).  In the compiled model each rank's planner
# process captures once for the strategies it predicts (`predict_strategies`' ``only``; Note [Candidates spread over
# the ranks] in autosp/plan/auto.py), with the same numbers.


def trace_strategies(source: ModelSource, setup: TrainingSetup, *, seq_len: int, layers: int | None,
                     strategies: Sequence[Mapping], options: Mapping | None = None,
                     mask_rules: dict | None = None) -> list:
    """For each of ``strategies`` (`STRATEGY_OPTIONS` of `autosp.compile`, on top of ``options``), (joint graph,
    `TraceFacts`) of ``layers`` layers at ``seq_len`` tokens from one Dynamo capture (Note [One Dynamo capture for
    every strategy]), or the `AutoSPError` that refused it.  ``mask_rules``: the decision's shared mask rules
    (`TraceReuse.mask_rules`; a strategy changes no rule of a shape-only trace, only the check of a real batch)."""
    import torch
    from torch import fx

    from autosp.backend import JointCaptured, make_backend
    from autosp.model import TraceHooks
    from autosp.passes.graph_utils import graph_copy, lazy_graph_modules
    from autosp.pipeline import passes_for
    from autosp.tracing import compile_for_trace, fake_training_sample

    hf = source.config(seq_len=seq_len, num_layers=layers)
    dtype = torch_dtype(setup.dtype)
    start = time.perf_counter()
    log.info("tracing %s: %d layers, %s x %d tokens over %d SP ranks, one Dynamo capture for %d strategies",
             source.spec, hf.num_hidden_layers, setup.micro_batch, seq_len, setup.sp_size, len(strategies))
    torch._dynamo.reset()  # as trace_step: the planner owns the compiled functions of its process
    with fake_training_sample(lambda: source.build(hf, dtype), seq_len=seq_len, sp_size=setup.sp_size,
                              vocab_size=hf.vocab_size, dtype=dtype, micro_batch=setup.micro_batch) as (
            fake_mode, model, inputs):
        parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        found: list = [None] * len(strategies)
        capture: dict = {}  # the one Dynamo capture, once made: its graph, example inputs, their roles and shapes

        def compile_from_capture(m, **local):
            """A core's program: its backend run on a copy of the shared capture, up to the joint graph."""
            gm, example_inputs, roles, shapes = capture["graph"], capture["inputs"], capture["roles"], capture["shapes"]
            shard = [local[r] if r else x for r, x in zip(roles, example_inputs, strict=True)]
            if [tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in shard] != shapes:
                raise AutoSPError("its shard has other shapes than the shared Dynamo capture's")
            # nothing compiled here is called (Note [Graph modules generate their code when first called] in
            # autosp/passes/graph_utils.py)
            with lazy_graph_modules():
                try:
                    make_backend(m._ctx, m.config, passes=passes_for(m.config))(graph_copy(gm), shard)
                except JointCaptured:
                    pass

        def program_for(m):
            def run(**local):  # the first core's call makes the capture; every core then runs from it
                return dynamo_capture(**local) if not capture else compile_from_capture(m, **local)
            return run

        compiled = []
        hooks = TraceHooks(capture_joint=True, joint_only=True, mask_rules=mask_rules)
        for i, strategy in enumerate(strategies):
            try:  # as autosp.tracing.trace_fake_step compiles its one model
                compiled.append(compile_for_trace(model, sp_size=setup.sp_size, hooks=hooks, program_for=program_for,
                                                  **{**(options or {}), **strategy}))
            except AutoSPError as err:
                found[i] = err
                compiled.append(None)
        first = next((m for m in compiled if m is not None), None)
        if first is None:
            return found

        def capture_every_strategy(gm: fx.GraphModule, example_inputs):
            capture.update(graph=gm, inputs=example_inputs,
                           roles=[first._ctx.input_roles.get(id(x)) for x in example_inputs],
                           shapes=[tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in example_inputs])
            for i, m in enumerate(compiled):
                if m is None:
                    continue
                try:
                    m(**inputs)
                    report = m._ctx.report
                    found[i] = (report.joint_capture, TraceFacts(
                        parameter_bytes=parameter_bytes, forward_graph=report.forward_graphs[-1],
                        attention_kept_fraction=report.attention_kept_fraction, compiled_with=m.config,
                        num_fwd_outputs=report.joint_capture.partition_kwargs["num_fwd_outputs"]))
                except AutoSPError as err:
                    found[i] = err
            raise _EveryStrategyCaptured

        dynamo_capture = torch.compile(model, backend=capture_every_strategy, fullgraph=True, dynamic=False)
        with fake_mode:
            try:
                first(**inputs)
            except torch._dynamo.exc.BackendCompilerFailed as err:
                if not isinstance(err.inner_exception, _EveryStrategyCaptured):
                    raise
    log.info("traced in %.1f s: one Dynamo capture, %d joint graph(s)", time.perf_counter() - start,
             sum(isinstance(f, tuple) for f in found))
    return found


def resized_steps(length_class, source: ModelSource, setup: TrainingSetup, *, seq_len: int, layers: int | None,
                  config: TrainingConfig, options: Mapping | None = None,
                  variants: tuple[tuple[str, float | None], ...] = (),
                  rewrites_here: bool = False) -> dict[tuple, Traced] | None:
    """`trace_step`'s answer (as a map, ``options``' own variant included) from the joint graph re-sized to
    ``seq_len`` from the two captures of ``length_class`` (`autosp.joint_template.LengthClass.resize`; Note [The
    joint graph at another length] in autosp/joint_template.py), skipping Dynamo and the joint trace; None when
    they are not one re-sizable program."""
    facts: TraceFacts = length_class.facts
    checkpointing, budget = checkpointing_variant(options)
    own = dataclasses.replace(facts.compiled_with, checkpointing=checkpointing, sac_memory_budget=budget)
    start = time.perf_counter()
    report = length_class.resize(seq_len, own, variants)
    if report is None:
        return None
    log.info("re-sized %s to %d tokens in %.1f s: %d partition(s)", source.spec, seq_len,
             time.perf_counter() - start, report.partitions)
    return partitioned_steps(source, setup, report, facts, seq_len=seq_len, layers=layers, config=config, options=options,
                  rewrites_here=rewrites_here)


def partitioned_steps(source: ModelSource, setup: TrainingSetup, report, facts: TraceFacts, *, seq_len: int,
           layers: int | None, config: TrainingConfig, options: Mapping | None,
           rewrites_here: bool) -> dict[tuple, Traced]:
    """The step of each partition of ``report`` (its own and its checkpointing variants'), by variant."""
    hf = source.config(seq_len=seq_len, num_layers=layers)
    overlap = (options or {}).get("overlap_communication", True)  # AutoSPConfig's default

    def build(graphs, offload: bool = False) -> Traced:
        partitioned = graphs
        if rewrites_here:
            rewrites = dataclasses.replace(facts.compiled_with, overlap_communication=overlap,
                                           activation_offload="on" if offload else "off")
            graphs = partitioned_rewrites(partitioned, config=rewrites, num_fwd_outputs=facts.num_fwd_outputs)
        built = _build_step(source, setup, hf, graphs, facts=facts, config=config, layers=layers, seq_len=seq_len,
                            dtype=torch_dtype(setup.dtype))
        return dataclasses.replace(built, graphs=tuple(partitioned), rebuild=build)

    found = {checkpointing_variant(options): build(report.aot_graphs)}
    for variant, graphs in report.variant_graphs.items():
        found[variant] = build(graphs)
    for variant, same in report.variant_same_as.items():
        found[variant] = found[same]
    return found


def sharded_training_step(backward: Workload, config: TrainingConfig) -> Workload:
    """The optimizer step after a ZeRO-3 backward (`zero3_workload`: every gradient reduce-scattered in it, none
    left to reduce): over the ``dp_reduce`` group of all ranks, or, under DeepSpeed's engine, over each rank alone
    (``config.dp_world_size`` 1: Note [ZeRO 3 through DeepSpeed] in autosp/integrations/deepspeed_engine.py)."""
    if config.dp_world_size == 1 and backward.world_size > 1:
        return add_training_step(backward, [], config, group="optimizer_rank",
                                 group_instances=[[r] for r in range(backward.world_size)])
    return add_training_step(backward, [], config, group="dp_reduce")


def _build_step(source: ModelSource, setup: TrainingSetup, hf, graphs, *, facts: TraceFacts,
                config: TrainingConfig, layers: int | None, seq_len: int, dtype) -> Traced:
    """Export one traced program (forward and backward ``graphs``) and build its whole training step."""
    from autosp.export import export_workload, module_parameters

    depth = hf.num_hidden_layers
    exported = export_workload(graphs, name=f"{source.spec}/L={depth}/S={seq_len}", sp_size=setup.sp_size,
                               parameter_bytes=facts.parameter_bytes,
                               saved_freed_at_last_use=True,  # Note [Boxed graphs free their inputs], backend.py
                               attention_kept_fraction=facts.attention_kept_fraction)
    modules = module_parameters(graphs, facts.forward_graph)
    world = setup.world_size
    # A shallower trace (depth extrapolation) reduces and updates only its own layers' parameters.
    step_config = config if layers is None else dataclasses.replace(
        config, parameter_numels=setup.training_config(source.parameter_numels(hf)).parameter_numels)
    if setup.zero_stage == 3:  # AutoSP's sharded parameters: each module gathered before its reads, forward and
        # backward, its gradients reduce-scattered (Note [Parameters gathered in the graph] in
        # autosp/parameter_sharding.py, priced as Note [ZeRO-3 as a rewrite of the single-device trace])
        from simulator.workload_rewrites import zero3_workload

        try:
            backward = zero3_workload(data_parallel_replicas(exported, setup.dp_size), modules, world_size=world,
                                      prefetch=False)  # the compiled program gathers each weight at its use
        except ValueError as err:
            raise AutoSPError(f"ZeRO 3 (shard_parameters=True) is priced for Ulysses programs only: {err}") from None
        return Traced(layers=depth, backward=backward, step=sharded_training_step(backward, step_config))
    placed = place_gradients(exported, [n for m in modules for n in m.gradients], step_config)
    backward = data_parallel_replicas(placed, setup.dp_size)  # a ring program: one program per rank
    element = dtype.itemsize
    sizes = [(m.gradients, m.parameter_bytes // element) for m in modules]
    gradients = {r: gradients_from_modules(p, sizes) for r, p in backward.ranks.items()}
    step = add_training_step(backward, gradients, step_config, group="dp", group_instances=[list(range(world))])
    return Traced(layers=depth, backward=backward, step=step, gradients={r: tuple(g) for r, g in gradients.items()})


class CaptureKeeper:
    """Keeps the joint graph a trace hands to `add_capture` (and hands it on to ``then``, a length class)."""

    def __init__(self, then=None):
        self.then, self.capture, self.facts = then, None, None

    def add_capture(self, capture, config, facts) -> None:
        self.capture, self.facts = capture, facts
        if self.then is not None:
            self.then.add_capture(capture, config, facts)


def rank_share(units: Sequence, rank: int, ranks: int) -> list:
    """Of ``units`` (in candidate order), those rank ``rank`` of ``ranks`` predicts: every ``ranks``-th from the
    ``rank``-th (Note [Candidates spread over the ranks] in autosp/plan/auto.py)."""
    return list(units[rank::ranks])


def trace_group(options: Mapping | None) -> tuple:
    """The trace group of compile options: the options less `CHECKPOINTING_OPTIONS` and `OFFLOAD_OPTION`, which
    one trace serves (`TraceReuse`)."""
    return tuple(sorted((k, repr(v)) for k, v in (options or {}).items()
                        if k not in CHECKPOINTING_OPTIONS and k != OFFLOAD_OPTION))


class TraceReuse:
    """Traces shared between the memory plans of one decision (docs/design.md, "Trace reuse").

    Plans that differ only in `CHECKPOINTING_OPTIONS` and `OFFLOAD_OPTION` form a group: the first trace of any of
    them (at one length and depth) partitions the joint graph for the whole group, a group member whose
    recomputation tags equal another's reuses that one's program and its simulation, and a plan with activation
    offload on gets its program by the offload pass on the partition of the same plan without it (the group's trace
    leaves the partitioned-graph rewrites to `partitioned_rewrites`)."""

    def __init__(self, plans: Sequence[Mapping], *, resize_lengths: bool = False):
        self._plans = [dict(p) for p in plans]
        self.resize_lengths = resize_lengths
        """Build a group's program at a length inside its traced range from the joint graphs of two traces
        (`autosp.joint_template.LengthClass`, docs/design.md "Trace reuse across lengths") instead of tracing it:
        for callers that ask for many lengths (the max-length searches), since each of the first two traces of a
        group also copies its joint graph."""
        self.length_classes: dict[tuple, object] = {}
        """`autosp.joint_template.LengthClass` per group (the trace key less the length)."""
        self._traced: dict[tuple, Traced] = {}
        self._offloaded: dict[int, Traced] = {}
        self._simulated: dict[tuple[int, int], tuple] = {}
        self._captures: dict[tuple, tuple] = {}
        self._sources: dict[str, ModelSource] = {}
        self.strategies: tuple[dict, ...] = ()
        """Option sets (`STRATEGY_OPTIONS`) whose shallow traces share one Dynamo capture per depth and length
        (`trace_strategies`; `choose_strategy` sets them)."""
        self.mask_rules: dict = {}
        """Attention-mask rules learnt by this decision's shape-only traces, taken by its later traces of the same
        mask program (Note [Mask rules shared between a decision's traces] in autosp/passes/dynamo/mask_learner.py)."""
        self.traces = 0
        """Fake-tensor traces (Dynamo captures) taken."""
        self.resized = 0
        """Lengths whose programs were built from a re-sized joint graph instead of a trace."""
        self.joint_graphs = 0
        self.partitions = 0
        self.simulations = 0

    def source(self, model: str) -> ModelSource:
        """The one `ModelSource` of ``model`` for this decision's predictions (it keeps the parameter counts)."""
        if model not in self._sources:
            self._sources[model] = ModelSource(model)
        return self._sources[model]

    @staticmethod
    def _variant(options: Mapping | None) -> tuple:
        return checkpointing_variant(options), (options or {}).get(OFFLOAD_OPTION) == "on"

    def trace(self, source: ModelSource, setup: TrainingSetup, *, seq_len: int, layers: int | None,
              config: TrainingConfig, options: Mapping | None) -> Traced:
        group = trace_group(options)
        # Everything the traced step depends on: one TraceReuse may serve several setups (ranks, batch, ZeRO).
        key = (source.spec, repr(setup), repr(config), seq_len, layers, group)
        own = checkpointing_variant(options)
        if (*key, own, False) not in self._traced:
            plain = {k: v for k, v in (options or {}).items() if k != OFFLOAD_OPTION}
            variants = tuple(dict.fromkeys(checkpointing_variant(p) for p in self._plans
                                           if trace_group(p) == group and checkpointing_variant(p) != own))
            offloads = any(trace_group(p) == group and self._variant(p)[1] for p in self._plans)
            asked = dict(seq_len=seq_len, layers=layers, config=config, options=plain, variants=variants,
                         rewrites_here=offloads)

            lengths = None

            def trace(capture: bool) -> dict[tuple, Traced]:
                # A shallow trace keeps its joint graph for SAC's full-depth tags (`captured`).
                into = CaptureKeeper(lengths if capture else None) if layers is not None else \
                    (lengths if capture else None)
                found = trace_step(source, setup, capture_into=into, mask_rules=self.mask_rules, **asked)
                if layers is not None:
                    self._captures[key] = (into.capture, into.facts, offloads)
                self.traces += 1
                self.joint_graphs += 1  # one Dynamo graph (fullgraph), one joint graph
                return found if variants else {own: found}

            if self.resize_lengths:
                from autosp.joint_template import LengthClass

                lengths = self.length_classes.setdefault(key[:3] + key[4:], LengthClass())
                found, built = lengths.get(seq_len, trace=trace, what=f"{source.spec} ({plain})",
                                           build=lambda: resized_steps(lengths, source, setup, **asked))
                self.resized += built
            else:
                found = trace(False)
            self.partitions += len({id(t) for t in found.values()})
            for variant, traced in found.items():
                self._traced[(*key, variant, False)] = traced
        traced = self._traced[(*key, own, False)]
        if self._variant(options)[1]:
            if id(traced) not in self._offloaded:  # one offloaded program per program
                self._offloaded[id(traced)] = traced.rebuild(traced.graphs, offload=True)
            traced = self._traced[(*key, own, True)] = self._offloaded[id(traced)]
        return traced

    def captured(self, source: ModelSource, setup: TrainingSetup, *, seq_len: int, layers: int,
                 config: TrainingConfig, options: Mapping | None) -> tuple:
        """(joint graph, `TraceFacts`, ``rewrites_here``) of the shallow trace of ``options`` at ``seq_len`` and
        ``layers`` (traced if not yet; re-sized from its length class's two joint graphs when its program was),
        for SAC's full-depth tags (`_shallow_sac_step`)."""
        key = (source.spec, repr(setup), repr(config), seq_len, layers, trace_group(options))
        if key not in self._captures and self._shares_capture(options):
            self._capture_strategies(source, setup, seq_len=seq_len, layers=layers, config=config, options=options)
        if key not in self._captures:
            self.trace(source, setup, seq_len=seq_len, layers=layers, config=config, options=options)
        if key in self._captures:
            found = self._captures[key]
            if isinstance(found, AutoSPError):
                raise found
            return found
        from autosp.joint_template import joint_at

        lengths = self.length_classes.get(key[:3] + key[4:])
        capture = joint_at(*lengths.captures, seq_len) if lengths is not None and len(lengths.captures) == 2 \
            else None
        if capture is None:
            raise DepthExtrapolationError(f"no joint graph of the {layers}-layer program at {seq_len} tokens")
        offloads = any(trace_group(p) == key[-1] and self._variant(p)[1] for p in self._plans)
        return capture, lengths.facts, offloads

    def _shares_capture(self, options: Mapping | None) -> bool:
        """Whether the shallow trace of ``options`` is one of `strategies`' shared capture: a strategy of them, no
        length classes, and no other plan of its group (no checkpointing variants, no offload rewrites)."""
        options = dict(options or {})
        strategy = strategy_options(options)
        return (not self.resize_lengths and strategy in self.strategies
                and not any(trace_group(p) == trace_group(options) for p in self._plans))

    def _capture_strategies(self, source: ModelSource, setup: TrainingSetup, *, seq_len: int, layers: int,
                            config: TrainingConfig, options: Mapping | None) -> None:
        """`trace_strategies` for every strategy of `strategies` on top of ``options``' other options: their
        captures (or refusals) kept as `captured` answers them."""
        base = {k: v for k, v in (options or {}).items() if k not in STRATEGY_OPTIONS}
        found = trace_strategies(source, setup, seq_len=seq_len, layers=layers, strategies=self.strategies,
                                 options=base, mask_rules=self.mask_rules)
        self.traces += 1
        for strategy, answer in zip(self.strategies, found, strict=True):
            self.joint_graphs += isinstance(answer, tuple)
            key = (source.spec, repr(setup), repr(config), seq_len, layers, trace_group({**base, **strategy}))
            self._captures[key] = (*answer, False) if isinstance(answer, tuple) else answer

    def same_program(self, options: Mapping, other: Mapping) -> bool:
        """Whether ``options`` and ``other`` traced to the same program at every length and depth traced for both
        (one shared `Traced`: their recomputation tags are equal, and activation offload is on in both or in
        neither)."""
        mine, theirs = (trace_group(options), *self._variant(options)), (trace_group(other), *self._variant(other))
        found = [(traced, self._traced.get((*key[:-3], *theirs))) for key, traced in self._traced.items()
                 if tuple(key[-3:]) == mine]
        return bool(found) and all(a is b for a, b in found)

    def simulate(self, traced: Traced, workload: Workload, cluster: Cluster):
        """``simulate(workload, cluster)``, once per ``workload`` object (``traced`` keeps it alive)."""
        key = (id(workload), id(cluster))
        if key not in self._simulated:
            self._simulated[key] = (traced, cluster, simulate(workload, cluster))
            self.simulations += 1
        return self._simulated[key][2]
