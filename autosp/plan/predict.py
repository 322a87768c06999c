"""Predict one training configuration on one cluster: fits or not, peak per rank by ledger category, step time,
and the longest sequence that fits.

The step is built from the real AutoSP program: the model is traced on fake tensors
(`autosp.tracing.trace_fake_step`) and exported (`autosp.export.export_workload`), the data-parallel replicas and
DeepSpeed's gradient reduction and optimizer step are added (`simulator.training_step.add_training_step`), and
the simulator runs it on the cluster.  Memory has one definition (docs/design.md, "One memory
definition"): the ledger of the training configuration inside backward (`simulator.ledger.memory_ledger`,
device reserve included) with the simulated activations as its ``activations`` line, i.e.
`simulator.max_length.ledger_peak` - what ``python -m simulator --max-length`` reports.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from autosp.config import MEMORY_TECHNIQUES
from autosp.errors import AutoSPError
from autosp.plan.model_source import ModelSource
from autosp.techniques import technique
from simulator.cluster import Cluster
from simulator.engine import simulate
from simulator.ledger import OPTIMIZER_STATES, LedgerLine, TrainingConfig, memory_ledger, summarize
from simulator.max_length import (
    BANDS,
    DepthExtrapolationError,
    ModelStep,
    extrapolate_depth,
    ledger_host_peak,
    ledger_peak,
)
from simulator.max_length import max_length as search_max_length
from simulator.replicas import data_parallel_replicas
from simulator.result import Result
from simulator.strategies import SEQUENCE_PARALLEL, STRATEGIES, Strategy, sp_candidates
from simulator.training_step import (
    GradientReady,
    add_training_step,
    gradients_from_modules,
    host_optimizer_time_s,
    release_gradients,
)
from simulator.workload import CHOSEN_STRATEGIES, COMPILED_STRATEGIES, SPKind, Workload

log = logging.getLogger(__name__)

DTYPES = ("bf16", "fp32")
OPTIMIZERS = tuple(OPTIMIZER_STATES)
OFFLOADS = ("none", "optimizer")
COMPILERS = ("inductor", "aot_eager")
DEPTHS = ("full", "extrapolated")
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
    micro_batch: int = 1
    """Samples per SP group per micro-step."""
    grad_accum: int = 1
    """Micro-steps per optimizer step."""
    dtype: str = "bf16"
    optimizer: str = "adamw"
    offload: str = "none"
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
        return _torch_dtype(self.dtype)

    @property
    def world_size(self) -> int:
        return self.sp_size * self.dp_size

    def check(self) -> None:
        """Refuse what cannot be predicted, naming what is missing."""
        for name in ("seq_len", "sp_size", "dp_size", "micro_batch", "grad_accum"):
            if getattr(self, name) < 1:
                raise AutoSPError(f"--{name.replace('_', '-')} {getattr(self, name)}: give a positive number")
        choices = {"dtype": DTYPES, "optimizer": OPTIMIZERS, "offload": OFFLOADS, "compiler": COMPILERS,
                   "depth": (*DEPTHS, None), "zero_stage": (0, 1, 2, 3)}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise AutoSPError(f"--{name.replace('_', '-')} {getattr(self, name)!r}: choose one of {allowed}")
        if self.seq_len % self.sp_size:
            raise AutoSPError(f"--seq-len {self.seq_len} is not divisible by --sp-size {self.sp_size}; give a "
                              "multiple of the SP degree")
        if self.zero_stage == 3:
            raise AutoSPError("--zero-stage 3: AutoSP does not compose with ZeRO 3 (DeepSpeed's AutoSP backend "
                              "refuses it), and the planner does not price the ZeRO-3 baseline's step (its per-layer "
                              "parameter gathers: simulator/workload_rewrites.py, used by the paper-scale tables). "
                              "Use ZeRO 0, 1 or 2")
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

    def training_config(self, parameter_numels: tuple[int, ...]) -> TrainingConfig:
        """The ledger's configuration (ZeRO partitions over all ``world_size`` ranks: the sequence-data-parallel
        group)."""
        return TrainingConfig(parameter_numels=parameter_numels, optimizer=self.optimizer, precision=self.dtype,
                              zero_stage=self.zero_stage, dp_world_size=self.world_size,
                              gradient_accumulation_steps=self.grad_accum, micro_batch_size=self.micro_batch,
                              nccl_communicators=2 if self.sp_size > 1 else 1,
                              offload_optimizer=self.offload == "optimizer")


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
    import copy

    from torch import fx

    from autosp.backend import rewrite_pair

    graphs = dict(graphs)
    with warnings.catch_warnings():  # deep-copying the graph's pytree codegen warns about a deprecated spelling
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec")
        fw, bw = (fx.GraphModule(graphs[k], copy.deepcopy(graphs[k].graph)) for k in ("forward", "backward"))
    fw, bw = rewrite_pair(fw, bw, config=config, num_fwd_outputs=num_fwd_outputs)
    return [("forward", fw), ("backward", bw)]


def _torch_dtype(dtype: str):
    import torch

    return {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]


CHECKPOINTING_OPTIONS = technique("checkpointing", MEMORY_TECHNIQUES).options
"""The `autosp.compile` options that act only after AOTAutograd builds the joint graph: plans differing only in
these share one trace (`TraceReuse`)."""


def checkpointing_variant(options: Mapping | None) -> tuple[str, float | None]:
    """``options``' (checkpointing, sac_memory_budget), with `autosp.compile`'s defaults."""
    options = options or {}
    return options.get("checkpointing", "sac"), options.get("sac_memory_budget")


@dataclass(frozen=True, kw_only=True)
class _TraceFacts:
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
    dtype = _torch_dtype(setup.dtype)
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
    facts = _TraceFacts(parameter_bytes=parameter_bytes, forward_graph=report.forward_graphs[-1],
                        attention_kept_fraction=report.attention_kept_fraction, compiled_with=compiled.config,
                        num_fwd_outputs=report.num_fwd_outputs)
    if capture_into is not None:
        capture_into.add_capture(report.joint_capture, compiled.config, facts)
    found = _steps(source, setup, report, facts, seq_len=seq_len, layers=layers, config=config, options=options,
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
    `_TraceFacts`) of ``layers`` layers at ``seq_len`` tokens from one Dynamo capture (Note [One Dynamo capture for
    every strategy]), or the `AutoSPError` that refused it.  ``mask_rules``: the decision's shared mask rules
    (`TraceReuse.mask_rules`; a strategy changes no rule of a shape-only trace, only the check of a real batch)."""
    import copy

    import torch
    from torch import fx
    from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module

    from autosp.backend import JointCaptured, make_backend
    from autosp.model import TraceHooks
    from autosp.pipeline import passes_for
    from autosp.tracing import compile_for_trace, fake_training_sample

    hf = source.config(seq_len=seq_len, num_layers=layers)
    dtype = _torch_dtype(setup.dtype)
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
            # Lazy graph modules (torch's own switch, scoped to this block): nothing compiled here is
            # called, so no graph's Python code is generated.
            with warnings.catch_warnings(), _use_lazy_graph_module(True):
                warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec")
                graph = _make_graph_module(gm, copy.deepcopy(gm.graph))
                try:
                    make_backend(m._ctx, m.config, passes=passes_for(m.config))(graph, shard)
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
                    found[i] = (report.joint_capture, _TraceFacts(
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
    facts: _TraceFacts = length_class.facts
    checkpointing, budget = checkpointing_variant(options)
    own = dataclasses.replace(facts.compiled_with, checkpointing=checkpointing, sac_memory_budget=budget)
    start = time.perf_counter()
    report = length_class.resize(seq_len, own, variants)
    if report is None:
        return None
    log.info("re-sized %s to %d tokens in %.1f s: %d partition(s)", source.spec, seq_len,
             time.perf_counter() - start, report.partitions)
    return _steps(source, setup, report, facts, seq_len=seq_len, layers=layers, config=config, options=options,
                  rewrites_here=rewrites_here)


def _steps(source: ModelSource, setup: TrainingSetup, report, facts: _TraceFacts, *, seq_len: int,
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
                            dtype=_torch_dtype(setup.dtype))
        return dataclasses.replace(built, graphs=tuple(partitioned), rebuild=build)

    found = {checkpointing_variant(options): build(report.aot_graphs)}
    for variant, graphs in report.variant_graphs.items():
        found[variant] = build(graphs)
    for variant, same in report.variant_same_as.items():
        found[variant] = found[same]
    return found


def _build_step(source: ModelSource, setup: TrainingSetup, hf, graphs, *, facts: _TraceFacts,
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
    names = [n for m in modules for n in m.gradients]
    released = dataclasses.replace(exported, ranks={r: release_gradients(p, names) for r, p in exported.ranks.items()})
    backward = data_parallel_replicas(released, setup.dp_size)  # a ring program: one program per rank
    element = dtype.itemsize
    sizes = [(m.gradients, m.parameter_bytes // element) for m in modules]
    gradients = {r: gradients_from_modules(p, sizes) for r, p in backward.ranks.items()}
    # A shallower trace (depth extrapolation) reduces and updates only its own layers' parameters.
    step_config = config if layers is None else dataclasses.replace(config, parameter_numels=source.parameter_numels(hf))
    step = add_training_step(backward, gradients, step_config, group="dp", group_instances=[list(range(world))])
    return Traced(layers=depth, backward=backward, step=step, gradients={r: tuple(g) for r, g in gradients.items()})


class _Captured:
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
        mask program (Note [Mask rules shared between a decision's traces] in autosp/passes/dynamo/masks.py)."""
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
                into = _Captured(lengths if capture else None) if layers is not None else \
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
        """(joint graph, `_TraceFacts`, ``rewrites_here``) of the shallow trace of ``options`` at ``seq_len`` and
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
    host = result.host_peak_memory_bytes  # offloaded activations (Note [Host tensors] in simulator/workload.py)
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


def _partition_copy(capture, facts: _TraceFacts, propagated: tuple, *, checkpointing: str, budget: float | None,
                    tag_joint) -> object:
    """`autosp.joint_template.partition_at` of a copy of ``capture``'s joint graph under ``checkpointing`` and
    ``budget`` with ``tag_joint``'s recomputation tags, so that each pattern partitions its own copy.
    ``propagated``: `propagate_fake` of ``capture``, taken before any copy: the copy takes its nodes' metadata, which
    a capture re-sized to this length (not traced at it) has only once propagated."""
    import copy

    from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module

    from autosp.joint_template import partition_at

    # the copy is partitioned, never called, so its Python code is not generated (torch's lazy graph modules);
    # deep-copying the graph's pytree codegen warns about a deprecated spelling
    with warnings.catch_warnings(), _use_lazy_graph_module(True):
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec")
        graph = _make_graph_module(capture.graph, copy.deepcopy(capture.graph.graph))
    sac = dataclasses.replace(facts.compiled_with, checkpointing=checkpointing, sac_memory_budget=budget)
    return partition_at(dataclasses.replace(capture, graph=graph), sac, tag_joint=tag_joint, propagated=propagated)


def _shallow_sac_step(source: ModelSource, setup: TrainingSetup, cluster: Cluster, config: TrainingConfig,
                      model_layers: int, seq_len: int, options: Mapping | None,
                      reuse: TraceReuse | None) -> StepPrediction:
    """The step of ``model_layers`` layers under SAC from traces of 1 and 2 layers whose joint graphs are tagged
    with the full model's SAC decision (Note [Shallow traces checkpointed for the full depth] in
    autosp/plan/depth.py); `DepthExtrapolationError` where that does not hold."""


    from autosp.joint_template import propagate_fake
    from autosp.plan.depth import FullDepthTagger

    captured = {}
    for layers in (2, 1):
        if reuse is not None:
            captured[layers] = reuse.captured(source, setup, seq_len=seq_len, layers=layers, config=config,
                                              options=options)
        else:
            into = _Captured()
            trace_step(source, setup, seq_len=seq_len, layers=layers, config=config, options=options,
                       capture_into=into)
            captured[layers] = (into.capture, into.facts, False)
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
            traced = _steps(source, setup, report, facts, seq_len=seq_len, layers=layers, config=config,
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
        captured = {}
        for layers in (2, UNROLL_LAYERS):
            if reuse is not None:
                captured[layers] = reuse.captured(source, setup, seq_len=seq_len, layers=layers, config=config,
                                                  options=options)
            else:
                into = _Captured()
                trace_step(source, setup, seq_len=seq_len, layers=layers, config=config, options=options,
                           capture_into=into)
                captured[layers] = (into.capture, into.facts, False)
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
            traced = _steps(source, setup, partitioned(UNROLL_LAYERS, pattern), facts, seq_len=seq_len,
                            layers=UNROLL_LAYERS, config=config, options=options,
                            rewrites_here=rewrites_here)[(checkpointing, budget)]
            if rewrites_here:
                traced = traced.rebuild(traced.graphs, offload=True)
            programs[pattern] = traced
        share = tags.decision.share
    values = {}
    for pattern, traced in programs.items():
        static = traced.backward.program(0).static_memory
        full = sum(source.parameter_numels(hf)) * _torch_dtype(setup.dtype).itemsize
        static = dataclasses.replace(static, **{f: getattr(static, f) * full // static.parameter_bytes
                                                for f in ("parameter_bytes", "gradient_bytes", "optimizer_bytes")})
        backward, gradients = unroll_depth(traced.backward, traced_layers=UNROLL_LAYERS, layers=model_layers,
                                           gradients=traced.gradients, static_memory=static,
                                           name=f"{source.spec}/L={model_layers}/S={seq_len}")
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


def peak_by_category(lines: Sequence[LedgerLine]) -> dict[str, int]:
    """Nominal bytes per ledger category of ``lines`` (categories with nothing in them left out): the peak by
    category that ``python -m autosp.plan`` prints."""
    return {c: v[1] for c, v in summarize(lines).by_category.items() if v[2]}


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """The answer of ``python -m autosp.plan`` for one model, configuration, cluster and length."""

    model: str
    parameters: int
    layers: int
    setup: TrainingSetup
    cluster: dict
    """`simulator.cluster.Cluster.describe` of the cluster."""
    wrapper: str
    """The DeepSpeed optimizer path (see Note [Which DeepSpeed path holds what] in simulator/ledger.py)."""
    capacity_bytes: int
    step: StepPrediction
    lines: tuple[LedgerLine, ...]
    """The ledger inside backward with the simulated activations as its ``activations`` line: the peak is their
    sum (docs/design.md, "One memory definition")."""
    peak_band: tuple[int, int, int]
    """(low, nominal, high) peak bytes per rank, from the ledger's band."""
    max_length: dict | None = None
    """With ``--max-length``: the longest length that fits (``max_seq_len``, ``display``, ``stopped``), the band's
    ends, the step time and the peak by ledger category there (``peak_by_category_bytes``), and every probe of the
    search (``probes``: seq_len, fits, peak_bytes, step_time_s)."""
    max_length_step: StepPrediction | None = None
    """With ``--max-length``: the simulated step at the longest length that fits (None when none fits)."""
    host_capacity_bytes: int | None = None
    """Host memory a rank may use (the node's shared by its devices); None: the cluster does not say."""
    seconds: float = 0.0
    """Wall time the prediction took."""
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def peak_bytes(self) -> int:
        return self.peak_band[1]

    @property
    def host_peak_bytes(self) -> int:
        """Host memory a rank holds (the ledger's ``pool="host"`` lines: optimizer offload, and the simulated
        offloaded activations); 0 without offload."""
        return summarize(self.lines, "host").nominal

    @property
    def host_fits(self) -> bool:
        return self.host_capacity_bytes is None or self.host_peak_bytes <= self.host_capacity_bytes

    @property
    def fits(self) -> bool:
        """Device peak within the device's memory and host peak within the rank's host memory."""
        return self.peak_bytes <= self.capacity_bytes and self.host_fits

    @property
    def by_category(self) -> dict[str, int]:
        return peak_by_category(self.lines)

    @property
    def tokens_per_s(self) -> float:
        return self.setup.seq_len * self.setup.micro_batch * self.setup.grad_accum * self.setup.dp_size \
            / self.step.step_time_s

    def to_dict(self) -> dict:
        return {
            "model": self.model, "parameters": self.parameters, "layers": self.layers,
            "setup": dataclasses.asdict(self.setup), "world_size": self.setup.world_size, "cluster": self.cluster,
            "deepspeed_path": self.wrapper, "capacity_bytes": self.capacity_bytes, "fits": self.fits,
            "peak_bytes": self.peak_bytes, "peak_band_bytes": {b: v for b, v in zip(BANDS, self.peak_band, strict=True)},
            "peak_by_category_bytes": self.by_category,
            "host_peak_bytes": self.host_peak_bytes, "host_capacity_bytes": self.host_capacity_bytes,
            "host_fits": self.host_fits,
            "host_peak_by_category_bytes": {c: v[1] for c, v in summarize(self.lines, "host").by_category.items()
                                            if v[2]},
            "activation_bytes": self.step.dynamic_memory_bytes,
            "ledger": [dataclasses.asdict(ln) for ln in self.lines],
            "step_time_s": self.step.step_time_s, "micro_step_time_s": self.step.micro_step_time_s,
            "tokens_per_s": self.tokens_per_s, "depth_extrapolated_from": self.step.extrapolated_from,
            "max_length": self.max_length, "seconds": self.seconds,
            "memory_definition": "ledger inside backward (parameters, gradients, optimizer state, communication "
                                 "buffers, CUDA context/NCCL/workspaces, allocator rounding and fragmentation) plus "
                                 "the simulated activations: simulator.max_length.ledger_peak",
            "notes": list(self.notes),
        }

    def format(self) -> str:
        gib = 2**30

        def size(b: int) -> str:
            return f"{b / gib:9.3f} GiB" if b >= gib else f"{b / 2**20:9.3f} MiB"

        s = self.setup
        out = [f"{self.model}: {self.parameters / 1e9:.3g} B parameters, {self.layers} layers",
               f"  setup       SP {s.sp_size} x DP {s.dp_size} = {s.world_size} ranks; ZeRO {s.zero_stage} "
               f"({self.wrapper}); {s.dtype}; {s.optimizer}; micro-batch {s.micro_batch} x {s.seq_len:,} tokens; "
               f"grad accum {s.grad_accum}; {s.compiler}",
               f"  cluster     {self.cluster['nodes']} x {self.cluster['devices_per_node']} {self.cluster['device']} "
               f"({self.cluster['preset']}), {self.capacity_bytes / gib:.2f} GiB per device",
               f"  fits        {'yes' if self.fits else 'NO'}: peak {self.peak_bytes / gib:.2f} GiB per rank "
               f"[band {self.peak_band[0] / gib:.2f} - {self.peak_band[2] / gib:.2f}] of "
               f"{self.capacity_bytes / gib:.2f}",
               "  peak by category, per rank (the ledger's lines summed; activations simulated):"]
        out += [f"    {cat:24s} {size(b)}" for cat, b in self.by_category.items()]
        if self.host_peak_bytes:
            cap = self.host_capacity_bytes
            what = " and ".join(w for w, on in (("optimizer", s.offload != "none"),
                                                 ("activations", self.step.host_dynamic_memory_bytes)) if on)
            out.append(f"  host memory {self.host_peak_bytes / gib:.2f} GiB per rank of "
                       f"{'unknown' if cap is None else f'{cap / gib:.2f}'}"
                       + ("" if self.host_fits else ": host-memory OOM") + f" (offloaded: {what}):")
            out += [f"    {cat:24s} {size(v[1])}" for cat, v in summarize(self.lines, "host").by_category.items()
                    if v[2]]
        extrapolated = self.step.extrapolated_from
        t = self.step.step_time_s
        out.append(f"  step time   {f'{t:.3f} s' if t >= 1 else f'{t * 1e3:.3f} ms'} ({self.tokens_per_s:,.0f} tokens/s)"
                   + (f"; depth extrapolated from {extrapolated[0]} and {extrapolated[1]} layers" if extrapolated
                      else ""))
        if self.max_length is not None:
            m = self.max_length
            out.append(f"  max length  {m['display']} tokens ({m['stopped']}), band {m['band'][0]} - {m['band'][1]}"
                       f"; {len(m['lengths_simulated'])} lengths simulated")
            if m["peak_by_category_bytes"]:
                there = m["peak_by_category_bytes"]
                out.append(f"  at max      peak {sum(there.values()) / gib:.2f} GiB per rank, of which activations "
                           f"{there.get('activations', 0) / gib:.2f} GiB (--json: by category)")
        out += [f"  note        {n}" for n in self.notes]
        out.append(f"  ({self.seconds:.1f} s)")
        return "\n".join(out)


def predict(model: str, setup: TrainingSetup, cluster: Cluster, *, max_length: bool = False,
            max_length_high: int | None = None, granularity: int = 1024, max_probes: int = 8,
            progress: Callable[[str], None] | None = None, options: Mapping | None = None,
            capacity_bytes: int | None = None, reuse: TraceReuse | None = None) -> Prediction:
    """Predict ``setup`` for ``model`` (a preset of `autosp.presets` or a config.json) on ``cluster``; with
    ``max_length`` also search the longest length that fits (each probe is one more trace).  ``options``: the
    `autosp.compile` options the step is traced with; ``capacity_bytes``: the memory a rank may use (default: the
    cluster's device memory); ``reuse``: traces shared with other plans' predictions (`TraceReuse`)."""
    start = time.perf_counter()
    setup.check()
    source = ModelSource(model) if reuse is None else reuse.source(model)
    hf = source.config(seq_len=setup.seq_len)
    numels = source.parameter_numels(hf)
    # a node without a GPU architecture (cpu-gloo) runs CPU processes: the ledger counts their tensors only
    config = dataclasses.replace(setup.training_config(numels), gpu_process=bool(cluster.preset.architecture))
    capacity = int(cluster.device.memory_bytes if capacity_bytes is None else capacity_bytes)
    offloading = [what for what, on in (
        (f"--offload {setup.offload}", config.offload_optimizer),
        ("activation_offload='on'", (options or {}).get("activation_offload") == "on")) if on]
    if offloading and cluster.preset.host_memory_link is None:
        raise AutoSPError(f"{' and '.join(offloading)}: the cluster's node ({cluster.preset.name}) has no link to host "
                          "memory; use a GPU preset or give host_memory_link (and host_memory_gib) in a cluster file "
                          "(docs/design.md, Cluster files)")
    steps: dict[int, StepPrediction] = {}

    def step(seq_len: int) -> StepPrediction:
        if seq_len not in steps:
            if progress:
                progress(f"{seq_len:,} tokens")
            steps[seq_len] = simulate_step(source, setup, cluster, config, hf.num_hidden_layers, seq_len, options,
                                           reuse)
        return steps[seq_len]

    at = step(setup.seq_len)
    lines = tuple(memory_ledger(config, at="backward", activation_bytes=at.dynamic_memory_bytes,
                                host_activation_bytes=at.host_dynamic_memory_bytes))
    band = tuple(ledger_peak(config, at.dynamic_memory_bytes, which) for which in BANDS)
    found = longest = None
    if max_length:
        grain = -(-granularity // setup.sp_size) * setup.sp_size
        high = max_length_high or 8 * setup.seq_len
        if reuse is not None and reuse.resize_lengths and high // grain * grain > setup.seq_len:
            # The search's ceiling as the second anchor: the probes above the start then lie inside the traced
            # range and are re-sized, not traced (docs/design.md, "Trace reuse across lengths").
            step(high // grain * grain)
        found_ml = search_max_length(step, config, capacity_bytes=capacity, low=grain, high=high, granularity=grain,
                                     start=setup.seq_len - setup.seq_len % grain or grain, max_probes=max_probes,
                                     host_capacity_bytes=cluster.host_memory_per_rank_bytes)
        longest = found_ml.nominal.result
        found = {"max_seq_len": found_ml.nominal.max_seq_len, "display": found_ml.nominal.display(),
                 "stopped": found_ml.nominal.stopped,
                 "band": [found_ml.high_memory.display(), found_ml.low_memory.display()],
                 "step_time_s": found_ml.nominal.step_time_s, "granularity": grain,
                 "peak_by_category_bytes": None if longest is None else peak_by_category(
                     memory_ledger(config, at="backward", activation_bytes=longest.dynamic_memory_bytes)),
                 "host_peak_bytes": None if longest is None else ledger_host_peak(
                     config, longest.host_dynamic_memory_bytes),
                 "probes": [{"seq_len": t.seq_len, "fits": t.fits, "peak_bytes": t.peak_memory_bytes,
                             "step_time_s": t.step_time_s} for t in found_ml.nominal.trials],
                 "lengths_simulated": sorted(steps)}
    notes = []
    if at.unrolled_from:
        notes.append(f"activation offload at full depth from a trace of {at.unrolled_from} layers, its middle layer "
                     "replicated and the whole depth simulated (Note [Unrolling a traced workload to the model's "
                     "depth] in simulator/depth_unroll.py)")
    if at.extrapolated_from:
        notes.append("depth extrapolated from 1 and 2 layers, SAC deciding as for the full model (Note [Shallow "
                     "traces checkpointed for the full depth] in autosp/plan/depth.py)")
    if not cluster.preset.architecture:
        notes.append("a CPU process (no GPU architecture): no device reserve (CUDA context, NCCL, workspaces, "
                     "allocator); the peak is the tensors' memory")
    if config.offload_optimizer:
        notes.append(f"optimizer step on the CPU: {host_optimizer_time_s(config) * 1e3:.1f} ms per step (assumption "
                     "host_cpu.adam_elements_per_s in simulator/gpu_constants.py), included in the step time")
    return Prediction(model=model, parameters=sum(numels), layers=hf.num_hidden_layers, setup=setup,
                      cluster=cluster.describe(), wrapper=config.wrapper, capacity_bytes=capacity, step=at,
                      lines=lines, peak_band=band, max_length=found,
                      max_length_step=longest,
                      seconds=time.perf_counter() - start,
                      notes=tuple(notes), host_capacity_bytes=cluster.host_memory_per_rank_bytes)


# --- strategy="auto": the strategy chosen by simulating each candidate on its own trace -----------------------

AUTO_STRATEGIES = COMPILED_STRATEGIES
"""The compiled strategies ``strategy="auto"`` simulates (``simulator.workload``'s ``COMPILED_STRATEGIES``): Ulysses,
the ring and every hybrid Ulysses degree that runs (`strategy_candidates`)."""
STRATEGY_CHOICES = tuple(kind for kind in SEQUENCE_PARALLEL
                         if kind in AUTO_STRATEGIES and not SPKind(kind).grouped or kind in CHOSEN_STRATEGIES)
"""``--strategy``: a strategy of `AUTO_STRATEGIES` that needs no degree (the hybrid needs its Ulysses degree, which
the CLI has no flag for), or ``auto`` (`choose_strategy`); read from the registry."""


@dataclass(frozen=True, kw_only=True)
class StrategyCandidate:
    """One strategy's prediction (traced with its ``autosp.compile`` options, exported, simulated), or why it
    cannot run."""

    strategy: str
    """The pass's strategy (a name of `AUTO_STRATEGIES`)."""
    system: str
    """Its name in the registry (``simulator.strategies.STRATEGIES``): ``autosp``, ``autosp-ring`` or
    ``autosp-hybrid-UxR``; what the decision names."""
    options: dict = field(default_factory=dict)
    """The ``autosp.compile`` options that select it (``strategy``, and a hybrid's ``ulysses_size`` and
    ``ring_size``): `strategy_options` of the registry's."""
    prediction: Prediction | None
    refused: str | None = None

    @property
    def fits(self) -> bool:
        return self.prediction is not None and self.prediction.fits

    def to_dict(self) -> dict:
        p = self.prediction
        return {"strategy": self.strategy, "system": self.system, "options": dict(self.options),
                "refused": self.refused, "fits": self.fits, "step_time_s": None if p is None else p.step.step_time_s,
                "peak_bytes": None if p is None else p.peak_bytes}


@dataclass(frozen=True, kw_only=True)
class StrategyDecision:
    """What ``strategy="auto"`` predicted for each candidate, what it chose and why."""

    candidates: tuple[StrategyCandidate, ...]
    chosen: str | None
    """The registry name (`StrategyCandidate.system`) of the fastest candidate that fits; None when none fits
    (``reason`` says so)."""
    reason: str
    capacity_bytes: int
    seconds: float = 0.0

    @property
    def chosen_candidate(self) -> StrategyCandidate | None:
        return next((c for c in self.candidates if c.system == self.chosen), None)

    @property
    def options(self) -> dict:
        """The `autosp.compile` options of the chosen strategy (``autosp.compile(model, sp_size=P,
        **decision.options)``); an error when none fits."""
        if self.chosen is None:
            raise AutoSPError(f"no strategy fits {self.capacity_bytes / 2**30:.3f} GiB per rank: {self.reason}")
        return dict(self.chosen_candidate.options)

    @property
    def prediction(self) -> Prediction | None:
        """The chosen candidate's prediction."""
        chosen = self.chosen_candidate
        return None if chosen is None else chosen.prediction

    def to_dict(self) -> dict:
        chosen = self.prediction
        return {"strategy": "auto", "chosen": self.chosen, "reason": self.reason,
                "options": None if self.chosen is None else self.options,
                "capacity_bytes": self.capacity_bytes, "seconds": self.seconds,
                "candidates": [c.to_dict() for c in self.candidates],
                "prediction": None if chosen is None else chosen.to_dict()}

    def format(self) -> str:
        gib = 2**30
        out = [f"strategy auto: {len(self.candidates)} candidates, each traced and simulated on its own "
               f"({self.seconds:.1f} s); capacity {self.capacity_bytes / gib:.3f} GiB per rank",
               f"  {'strategy':10s} {'system':18s} {'fits':4s} {'peak GiB':>9s} {'step ms':>10s}"]
        for c in self.candidates:
            mark = "*" if c.system == self.chosen else " "
            if c.prediction is None:
                out.append(f"{mark} {c.strategy:10s} {c.system:18s} refused: {c.refused}")
                continue
            p = c.prediction
            out.append(f"{mark} {c.strategy:10s} {c.system:18s} {'yes' if c.fits else 'NO':4s} "
                       f"{p.peak_bytes / gib:9.3f} {p.step.step_time_s * 1e3:10.3f}")
        out.append(f"  chosen      {self.chosen or 'none'}: {self.reason}")
        if self.prediction is not None:
            out += ["", self.prediction.format()]
        return "\n".join(out)


def strategy_candidates(model, setup: TrainingSetup) -> list[tuple[Strategy, str | None]]:
    """(registry entry, why it cannot run) for every candidate of ``strategy="auto"``: Ulysses (refused when the
    heads do not divide over ``setup.sp_size``), then the registry's `simulator.strategies.sp_candidates` for the
    model's heads and ``setup.sp_size`` (every hybrid ``U x R`` whose Ulysses degree divides the heads, then the
    ring).  ``model``: a preset or config.json (`ModelSource`), or a Hugging Face config object (what the job's
    ranks hold: `autosp.plan.auto.decide_strategy`)."""
    hf = ModelSource(model).config(seq_len=setup.seq_len) if isinstance(model, str) else model
    heads = int(hf.num_attention_heads)
    kv_heads = int(getattr(hf, "num_key_value_heads", None) or heads)
    runnable = sp_candidates(setup.sp_size, heads=heads, kv_heads=kv_heads)
    ulysses = STRATEGIES["autosp"]
    found = [] if ulysses in runnable else [
        (ulysses, f"{heads} attention heads are not divisible by sp_size {setup.sp_size}")]
    return found + [(s, None) for s in runnable if s.sequence_parallel in AUTO_STRATEGIES]


def strategy_choice(candidates: Sequence[Mapping], capacity_bytes: int) -> dict:
    """The rule of ``strategy="auto"`` on the candidates' rows (`StrategyCandidate.to_dict`, in the order of
    `strategy_candidates`): the fastest candidate that fits (``fits``: its peak within ``capacity_bytes`` and its
    host peak within the host's) is chosen, ties to the earlier candidate.  The answer has the keys of
    `StrategyDecision.to_dict` but ``seconds`` and ``prediction``: ``strategy`` ("auto"), ``chosen`` (a registry name
    or None), ``reason``, ``options`` (the chosen row's), ``capacity_bytes`` and ``candidates`` (the rows).  One rule
    for the decision taken in one process (`choose_strategy`) and the one whose candidates were predicted on the
    process group's ranks (`autosp.plan.auto.decide_strategy`, Note [Candidates spread over the ranks] in
    autosp/plan/auto.py)."""
    rows = [dict(c) for c in candidates]
    fitting = [c for c in rows if c["fits"]]
    if fitting:
        best = min(fitting, key=lambda c: c["step_time_s"])  # min keeps the first of equal times
        others = [c for c in rows if c["step_time_s"] is not None and c is not best]
        reason = f"the fastest that fits ({best['step_time_s'] * 1e3:.3f} ms per step" + "".join(
            f"; {c['system']} {c['step_time_s'] * 1e3:.3f} ms"
            + ("" if c["fits"] else f", peak {c['peak_bytes'] / 2**30:.3f} GiB does not fit") for c in others) + ")"
        chosen = best
    else:
        chosen = None
        reason = f"no strategy fits {capacity_bytes / 2**30:.3f} GiB per rank" + "".join(
            f"; {c['system']} peaks at {c['peak_bytes'] / 2**30:.3f} GiB" for c in rows if c["peak_bytes"] is not None)
    return {"strategy": "auto", "chosen": None if chosen is None else chosen["system"], "reason": reason,
            "options": None if chosen is None else dict(chosen["options"]), "capacity_bytes": int(capacity_bytes),
            "candidates": rows}


def predict_strategies(model: str, setup: TrainingSetup, cluster: Cluster, *, options: Mapping | None = None,
                       capacity_bytes: int | None = None, reuse: TraceReuse | None = None,
                       progress: Callable[[str], None] | None = None, share_capture: bool = True,
                       only: Collection[str] | None = None) -> tuple[list[StrategyCandidate], int]:
    """Every candidate of `strategy_candidates` predicted (traced with its strategy, exported from what its pass
    emits and simulated on ``cluster``: `predict`), or why it cannot run, and the capacity a rank has
    (``capacity_bytes``, default: the device's memory); ``only``: the registry names of the runnable candidates to
    predict (the others are left out of the answer; refused ones are listed).  The arguments as `choose_strategy`'s."""
    setup.check()
    setup = dataclasses.replace(setup, depth=setup.depth or DECIDING_DEPTH)
    if setup.sp_size < 2:
        raise AutoSPError("strategy 'auto' chooses how a sequence is split over ranks: give sp_size >= 2")
    options = dict(options or {})
    fixed = sorted(set(options) & {"strategy", "ulysses_size", "ring_size"})
    if fixed:
        raise AutoSPError(f"strategy 'auto' chooses the strategy and its degrees; do not pass {', '.join(fixed)} too")
    capacity = int(cluster.device.memory_bytes if capacity_bytes is None else capacity_bytes)
    found = [(s, why) for s, why in strategy_candidates(model, setup)
             if only is None or why is not None or s.name in only]
    reuse = TraceReuse([]) if reuse is None else reuse
    # Note [One Dynamo capture for every strategy]: the runnable candidates' shallow traces share Dynamo's capture
    reuse.strategies = tuple(strategy_options(s.compile_options) for s, why in found if why is None) \
        if share_capture else ()
    candidates = []
    for strategy, why in found:
        prediction, selected = None, strategy_options(strategy.compile_options)
        if why is None:
            try:
                prediction = predict(model, setup, cluster, options={**options, **selected},
                                     capacity_bytes=capacity, reuse=reuse, progress=progress)
            except AutoSPError as err:
                why = str(err)
        candidates.append(StrategyCandidate(strategy=strategy.sequence_parallel, system=strategy.name,
                                            options=selected, prediction=prediction, refused=why))
        if prediction is None:
            log.info("strategy %s: refused (%s)", strategy.name, why)
        else:
            log.info("strategy %s: step %.6f s, peak %.3f GiB per rank (%s)", strategy.name,
                     prediction.step.step_time_s, prediction.peak_bytes / 2**30,
                     "fits" if prediction.fits else "does not fit")
    return candidates, capacity


def choose_strategy(model: str, setup: TrainingSetup, cluster: Cluster, *, options: Mapping | None = None,
                    capacity_bytes: int | None = None, reuse: TraceReuse | None = None,
                    progress: Callable[[str], None] | None = None, share_capture: bool = True) -> StrategyDecision:
    """``strategy="auto"``: predict ``setup`` under every candidate strategy and degree the pass compiles
    (`predict_strategies`: `strategy_candidates`, each traced with that strategy, exported from what its pass emits
    and simulated on ``cluster``), and choose by `strategy_choice`: the fastest whose peak fits ``capacity_bytes``
    (default: the device's memory); ties go to the earlier candidate.  ``options``: further `autosp.compile` options
    (not the strategy or its degrees); ``reuse``: traces shared with other calls (`TraceReuse`); ``share_capture``:
    the candidates' shallow traces share one Dynamo capture per depth (Note [One Dynamo capture for every
    strategy]; False: each traced on its own, for comparison)."""
    start = time.perf_counter()
    candidates, capacity = predict_strategies(model, setup, cluster, options=options, capacity_bytes=capacity_bytes,
                                              reuse=reuse, progress=progress, share_capture=share_capture)
    choice = strategy_choice([c.to_dict() for c in candidates], capacity)
    log.info("strategy auto chose %s: %s", choice["chosen"], choice["reason"])
    return StrategyDecision(candidates=tuple(candidates), chosen=choice["chosen"], reason=choice["reason"],
                            capacity_bytes=capacity, seconds=time.perf_counter() - start)
