"""Simulated paper-scale runs on 8×A100-80GB for the paper's Llama models: every system, its whole training step,
its memory from the ledger, and one maximum-sequence-length search.

`simulate_step` simulates one training step of a system (a strategy of `simulator.strategies.STRATEGIES` with a
workload recipe: those of ``STRATEGIES.table("paper-scale")``; see Note [Baselines as AutoSP variants] in
experiments.paper_scale.baselines): the traced forward and backward, rewritten and followed by DeepSpeed's
gradient reduction and optimizer step as the strategy's `simulator.strategies.WorkloadRecipe.build` says (Note
[DeepSpeed gradient reduction] in simulator/training_step.py); its peak memory is the
simulated activations plus the memory ledger of the paper's configuration (`experiments.paper_scale.config`),
with the ledger's low/high band.  `max_length` finds the longest sequence with `simulator.search.search_max_length`
and the band's ends from the same simulated steps (The band of the longest length and the alternative configuration come from one set of simulated steps
(Note [Max-length band from one set of steps] in simulator/max_length.py); each step's traces are cached in a
`TraceCache`.

Note [One trace per length class]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Tracing a 32-layer model on fake tensors takes tens of seconds (Dynamo and AOTAutograd; exporting and
simulating take under a second), and a max-length search probes a dozen lengths.  Under ``checkpointing="none"``,
``"full"`` or ``"layer"`` (Ulysses, ring attention, Ulysses+ckpt, ZeRO-3) what is saved or recomputed does not depend on the
length, and the exported workload is the same program at every length: the same ops, dependencies, tensor
lifetimes and collectives, with every FLOP, byte and score count a polynomial of degree at most two in the length
(attention scores and FLOPs quadratic, everything else linear or constant).  So a `TraceCache` with
``interpolate_lengths`` traces such a system at the first three lengths a caller asks for (the anchors: a
search's first probes, which it would trace anyway) and at the fourth, where it checks once per model, depth,
rank count and option set (a length class: `autosp.joint_template.LengthClass`, which the planner's trace reuse
shares) that exact integer Lagrange interpolation from the anchors gives the
traced workload: every op, tensor and module equal (``==``).  After that a length strictly inside the traced
range is interpolated, one outside it is traced (and widens the range).  If the check fails, or a number does
not come out an integer, that class is traced at every length (and the log says so).  Selective checkpointing
(AutoSP's SAC) is never interpolated: its recompute budget is a share of the whole graph's FLOPs, whose
attention part grows quadratically, so which matmuls it recomputes changes with the length (Note
[Sequence-aware checkpointing] in autosp/passes/joint/checkpointing.py).  Its joint graph, before the
checkpointing tags, is one program at every length, though: such a class keeps the joint graphs of its first two
traces and builds a length from them (Note [The joint graph at another length] in autosp/joint_template.py:
the joint graph re-sized, then tagged, partitioned and exported as a trace would be, skipping Dynamo and the joint
trace); the third traced length checks that the re-sized program equals the trace (``==``), and after that a
length inside the traced range is re-sized, one outside it traced.  The
AutoSP fork's ``"long-context"`` rule depends on the length only through which side of 4096 a shard's tokens lie
(Note [The long-context rule of the AutoSP research fork]): its length classes are split there
(`_length_side`), so a class's program is one program again.  The math attention kernel (Note [The traced
workloads of the AutoSP research fork] in experiments/paper_scale/fork.py) holds [S, S] scores, a degree-two term
like attention's FLOPs.
tests/experiments/test_length_interpolation.py checks the interpolated workloads equal real traces.
"""

from __future__ import annotations

import functools
import logging
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from fractions import Fraction

from autosp.export import ModuleParameters, export_workload, module_parameters
from autosp.joint_template import INTERPOLATED, RESIZED, LengthClass
from autosp.tracing import trace_fake_step
from experiments.baselines.autosp_system import autosp_options as strategy_options
from experiments.models import PAPER_MODELS, PaperModel
from experiments.paper_scale.config import (
    PAPER_CLUSTER,
    PAPER_CONFIG,
    PaperConfig,
    peak_memory_bytes,
    training_config,
)
from experiments.paper_scale.fork import build_llama, sdpa_backends, ulysses_kernel
from simulator import Cluster, simulate
from simulator.max_length import BANDS, ModelStep, extrapolate_or_trace_full
from simulator.max_length import MaxLength as BandedMaxLength
from simulator.max_length import max_length as search_with_band
from simulator.strategies import STRATEGIES, Strategy
from simulator.workload import Workload

log = logging.getLogger(__name__)



@dataclass(frozen=True, kw_only=True)
class SimulatedStep(ModelStep):
    """One full-model training step of ``system`` (traced at full depth or extrapolated, Note [Depth
    extrapolation]) with the ledger's memory: what `simulator.max_length.max_length` searches over."""

    model: str
    system: str
    sp_size: int
    """Ranks one sequence is split over (8 for the SP systems, 1 for ZeRO-3: each rank its own sequence)."""
    static: tuple[int, int, int]
    """The ledger's (low, nominal, high) static memory inside backward."""
    peak: tuple[int, int, int]
    """The ledger's (low, nominal, high) peak: static memory, activations and their fragmentation."""
    capacity_bytes: int

    @property
    def static_memory_bytes(self) -> int:
        return self.static[1]

    @property
    def peak_memory_bytes(self) -> int:
        return self.peak[1]

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.capacity_bytes

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """Tokens one GPU trains per second: each rank holds ``seq_len / sp_size`` tokens of a step."""
        return self.seq_len / self.sp_size / self.step_time_s


LENGTH_INVARIANT_CHECKPOINTING = ("none", "full", "layer", "long-context")
"""Checkpointing settings whose plan does not depend on the length within a length class (Note [One trace per
length class]; "long-context": on one side of its threshold, `_length_side`)."""


def _length_side(options: dict, seq_len: int, sp_size: int) -> bool | None:
    """Which side of the fork's recompute threshold this length's shard lies on (None: no such threshold)."""
    from autosp.passes.joint.checkpointing import LONG_CONTEXT_MIN_DIM

    return seq_len // sp_size >= LONG_CONTEXT_MIN_DIM if options.get("checkpointing") == "long-context" else None


@dataclass
class TraceCache:
    """Exported workloads of one run, keyed by everything that determines the trace.

    Owned by a caller (one reproduction run) and passed down explicitly; the searches of
    different systems probe some of the same lengths (ring attention reuses the Ulysses
    trace: `simulator.strategies.STRATEGIES.trace_groups`), each of which is traced once."""

    workloads: dict = field(default_factory=dict)
    hits: int = 0
    misses: int = 0
    """Real traces (each a Dynamo and AOTAutograd compile on fake tensors)."""
    interpolate_lengths: bool = False
    """Build the workloads of length-invariant systems by interpolation between traces at three lengths (Note
    [One trace per length class]) instead of tracing every length."""
    interpolated: int = 0
    """Workloads built by interpolation."""
    resized: int = 0
    """Workloads built from a re-sized joint graph (Note [One trace per length class])."""
    length_classes: dict = field(default_factory=dict)
    """`autosp.joint_template.LengthClass` per (model, depth, ranks, options, variant, side)."""

    def get(self, key, make: Callable[[], TracedStep]) -> TracedStep:
        found = self.workloads.get(key)
        if found is None:
            self.misses += 1
            found = self.workloads[key] = make()
        else:
            self.hits += 1
        return found


@dataclass(frozen=True)
class TracedStep:
    """One traced and exported forward and backward (see `trace_workload`)."""

    workload: Workload
    modules: tuple[ModuleParameters, ...] = ()
    """Which ops read which module's parameters and produce its gradients (`autosp.export.module_parameters`)."""


@dataclass(frozen=True)
class ModelVariant:
    """How the traced model computes attention (Note [The traced workloads of the AutoSP research fork] in
    experiments/paper_scale/fork.py): its transformers attention implementation and the SDPA kernel; and whether
    it keeps a KV cache."""

    attention: str = "sdpa"
    kernel: str = "fused"
    use_cache: bool = True
    """The Hugging Face config's ``use_cache``: True (its default) keeps every layer's keys and values in a
    ``DynamicCache`` to the end of the step; a trainer that calls the model with ``use_cache=False`` (ArcticTraining's
    SFT loss, AutoSP's Trainer integration) keeps none."""
    rms_norm: str = "hf"
    """``hf``: transformers' ``LlamaRMSNorm``; ``liger``: Liger-Kernel's (Note [Liger's RMSNorm in a trace] in
    experiments/paper_scale/liger.py)."""


PLAIN = ModelVariant()


def _trace_key(model: PaperModel, seq_len: int, layers: int, sp_size: int, options: dict,
               variant: ModelVariant = PLAIN) -> tuple:
    return model.name, seq_len, layers, sp_size, tuple(sorted(options.items())), variant


def _trace_name(model: PaperModel, sp_size: int, layers: int, seq_len: int) -> str:
    return f"{model.name}/{'autosp' if sp_size > 1 else 'single'}/L={layers}/S={seq_len}"


def trace_workload(model: PaperModel, seq_len: int, layers: int, *, sp_size: int,
                   autosp_options: dict | None = None, cache: TraceCache | None = None,
                   variant: ModelVariant = PLAIN) -> TracedStep:
    """``layers`` decoder layers of ``model`` compiled by AutoSP for ``sp_size`` ranks (1: without sequence
    parallelism) on fake tensors, exported as a workload (its static memory is not used: the ledger's is);
    ``variant``: how the model computes attention.
    With a cache that ``interpolate_lengths``, a length-invariant system is traced at the first four lengths asked
    for and interpolated between them after that (Note [One trace per length class])."""
    options = dict(autosp_options or {})
    if cache is None or not cache.interpolate_lengths:
        return _traced(model, seq_len, layers, sp_size=sp_size, options=options, cache=cache, variant=variant)
    resize = options.get("checkpointing") not in LENGTH_INVARIANT_CHECKPOINTING
    lengths = cache.length_classes.setdefault(
        (model.name, layers, sp_size, tuple(sorted(options.items())), variant,
         _length_side(options, seq_len, sp_size)), LengthClass(how=RESIZED if resize else INTERPOLATED))
    name = _trace_name(model, sp_size, layers, seq_len)
    key = (lengths.how, *_trace_key(model, seq_len, layers, sp_size, options, variant))
    if not lengths.traces(seq_len) and key in cache.workloads:
        cache.hits += 1
        return cache.workloads[key]

    def build() -> TracedStep | None:
        if lengths.how == INTERPOLATED:
            return interpolate_trace({n: cache.workloads[_trace_key(model, n, layers, sp_size, options, variant)]
                                      for n in lengths.lengths[:3]}, seq_len, name=name)
        return _resized(lengths, seq_len, name=name, sp_size=sp_size)

    def trace(capture: bool) -> TracedStep:
        return _traced(model, seq_len, layers, sp_size=sp_size, options=options, cache=cache, variant=variant,
                       capture_into=lengths if capture else None)

    found, built = lengths.get(seq_len, trace=trace, build=build, what=f"{model.name} at {layers} layers ({options})")
    if built:
        if lengths.how == INTERPOLATED:
            cache.interpolated += 1
        else:
            cache.resized += 1
        cache.workloads[key] = found
    return found


def _resized(lengths: LengthClass, seq_len: int, *, name: str, sp_size: int) -> TracedStep | None:
    """The traced step at ``seq_len`` from the joint graphs of the class's two anchors (Note [The joint graph at
    another length] in autosp/joint_template.py); None when they are not one re-sizable program."""
    report = lengths.resize(seq_len)
    if report is None:
        return None
    forward_graph, parameter_bytes = lengths.facts
    return TracedStep(workload=export_workload(report.aot_graphs, name=name, sp_size=sp_size,
                                               parameter_bytes=parameter_bytes),
                      modules=module_parameters(report.aot_graphs, forward_graph))


def _build(model: PaperModel, layers: int, variant: ModelVariant):
    """The Hugging Face model of ``layers`` layers of ``model`` as ``variant`` traces it."""
    from experiments.paper_scale.liger import use_liger_rms_norm

    config = model.hf_config(num_layers=layers)
    config.use_cache = variant.use_cache
    built = build_llama(config, variant.attention)
    if variant.rms_norm == "liger":
        use_liger_rms_norm(built)
    elif variant.rms_norm != "hf":
        raise ValueError(f"rms_norm {variant.rms_norm!r}: choose hf or liger")
    return built


def _traced(model: PaperModel, seq_len: int, layers: int, *, sp_size: int, options: dict,
            cache: TraceCache | None, variant: ModelVariant = PLAIN,
            capture_into: LengthClass | None = None) -> TracedStep:
    """`trace_workload` by a real trace (once per key with a cache); with ``capture_into``, its joint graph is kept
    there (Note [One trace per length class])."""
    key = _trace_key(model, seq_len, layers, sp_size, options, variant)

    def make() -> TracedStep:
        import torch

        # Each trace compiles the same model code again with a new backend; drop the previous
        # traces' compiled code (it is for fake tensors and never runs again) so Dynamo's
        # per-function recompile limit is not reached.  This clears every compiled function
        # in the process: the paper-scale experiments own theirs.
        torch._dynamo.reset()
        with warnings.catch_warnings(), sdpa_backends(variant.kernel):
            warnings.filterwarnings("ignore", message="autosp.compile with sp_size=1")
            compiled, parameter_bytes = trace_fake_step(
                lambda: _build(model, layers, variant),
                seq_len=seq_len, sp_size=sp_size, vocab_size=model.vocab_size, capture_joint=capture_into is not None,
                **options,
            )
        graphs = compiled.report.aot_graphs
        if capture_into is not None:
            capture_into.add_capture(compiled.report.joint_capture, compiled.config,
                                     (compiled.report.forward_graphs[-1], parameter_bytes))
        workload = export_workload(graphs, name=_trace_name(model, sp_size, layers, seq_len), sp_size=sp_size,
                                   parameter_bytes=parameter_bytes)
        return TracedStep(workload=workload, modules=module_parameters(graphs, compiled.report.forward_graphs[-1]))

    return make() if cache is None else cache.get(key, make)


_OP_NUMBERS = ("flops", "bytes_read", "bytes_written", "attention_scores")


def _skeleton(traced: TracedStep) -> tuple:
    """Everything of a trace but its length-dependent numbers and its name."""
    (rank, program), = traced.workload.ranks.items()
    ops = tuple(replace(op, **dict.fromkeys(_OP_NUMBERS, 0),
                        collective=op.collective and replace(op.collective, message_bytes=0)) for op in program.ops)
    return (rank, ops, tuple(program.tensors), program.static_memory, traced.modules,
            replace(traced.workload, name="", ranks={}))


def interpolate_trace(anchors: dict[int, TracedStep], seq_len: int, *, name: str) -> TracedStep | None:
    """The trace at ``seq_len`` from traces of the same program at three lengths: every op, tensor and collective
    number by exact Lagrange interpolation in the length (Note [One trace per length class]); None when the
    anchors are not the same program or a number is not an integer."""
    lengths = sorted(anchors)
    if len(lengths) != 3 or any(_skeleton(anchors[n]) != _skeleton(anchors[lengths[0]]) for n in lengths[1:]):
        return None
    weights = [math.prod(Fraction(seq_len - m, n - m) for m in lengths if m != n) for n in lengths]
    scale = math.lcm(*(w.denominator for w in weights))
    numerators = [int(w * scale) for w in weights]
    exact = True

    def at(values) -> int:
        nonlocal exact
        total = sum(c * v for c, v in zip(numerators, values, strict=True))
        exact = exact and total % scale == 0
        return total // scale

    programs = [anchors[n].workload.ranks for n in lengths]
    (rank, first), = programs[0].items()
    ops = []
    for i, op in enumerate(first.ops):
        same = [p[rank].ops[i] for p in programs]
        numbers = {f: at([getattr(o, f) for o in same]) for f in _OP_NUMBERS}
        collective = op.collective and replace(op.collective,
                                               message_bytes=at([o.collective.message_bytes for o in same]))
        ops.append(replace(op, **numbers, collective=collective))
    tensors = {t: at([p[rank].tensors[t] for p in programs]) for t in first.tensors}
    if not exact:
        return None
    workload = replace(anchors[lengths[0]].workload, name=name,
                       ranks={rank: replace(first, ops=tuple(ops), tensors=tensors)})
    return TracedStep(workload=workload, modules=anchors[lengths[0]].modules)


def step_workload(system: str, model: PaperModel, seq_len: int, layers: int, *, ranks: int = 8,
                  cache: TraceCache | None = None, config: PaperConfig = PAPER_CONFIG,
                  autosp_options: dict | None = None) -> Workload:
    """The whole training step of ``layers`` decoder layers of ``model`` under strategy ``system``: traced, then
    built by its `simulator.strategies.WorkloadRecipe` (for ring attention and ZeRO-3 a rewrite; gradient
    reduction and the optimizer step of that many layers' parameters, Note [DeepSpeed gradient reduction] in
    simulator/training_step.py).  ``autosp_options`` replaces the strategy's `autosp.compile` options (e.g.
    another checkpointing policy for AutoSP)."""
    strategy = simulated_strategy(system)
    options = autosp_options if autosp_options is not None else strategy_options(system)
    sp = config.sp_size_of(system, ranks)
    options, variant = fork_trace_options(system, model, options, sp, config)
    traced = trace_workload(model, seq_len, layers, sp_size=sp if strategy.workload.trace_sequence_parallel else 1,
                            autosp_options=options, cache=cache, variant=variant)
    cfg = training_config(replace(model, num_layers=layers), system, replace(config, world_size=ranks))
    if strategy.workload.trace_sequence_parallel and sp < ranks:
        # One data-parallel replica (sp ranks) is simulated; its step reduces over those ranks.  Memory is the
        # ledger's over every rank (DeepSpeed's data-parallel group, see experiments.paper_scale.config).
        cfg = replace(cfg, dp_world_size=sp)
    return strategy.workload.build(traced.workload, traced.modules, cfg)


def fork_trace_options(system: str, model: PaperModel, options: dict, sp_size: int,
                       config: PaperConfig) -> tuple[dict, ModelVariant]:
    """``system``'s trace options and model variant under ``config``'s `~experiments.paper_scale.fork.ForkTrace`
    (Note [The traced workloads of the AutoSP research fork] in experiments/paper_scale/fork.py): AutoSP with the
    fork's checkpointing and K/V repetition, the hand-written Ulysses (not the ring rewrite of its trace) with the
    kernel the fork's SDPA call got."""
    from experiments.paper_scale.fork import REPEAT_KV_ATTENTION

    strategy, fork = STRATEGIES[system], config.fork
    if strategy.implementation == "autosp":
        if fork.checkpointing is not None:
            options = {**options, "checkpointing": fork.checkpointing}
        return options, ModelVariant(attention=REPEAT_KV_ATTENTION) if fork.repeat_kv else PLAIN
    if strategy.implementation == "hand-written" and strategy.sequence_parallel == "ulysses":
        kernel = ulysses_kernel(fork, heads=model.num_heads, kv_heads=model.num_kv_heads, sp_size=sp_size)
        return options, ModelVariant(kernel=kernel)
    return options, PLAIN


def simulated_strategy(system: str) -> Strategy:
    """The strategy ``system`` names, refused unless it has a workload recipe (is simulated)."""
    strategy = STRATEGIES[system]
    if strategy.workload is None:
        raise ValueError(f"{system} is not simulated (no workload recipe); simulated at paper scale: "
                         f"{', '.join(STRATEGIES.table('paper-scale'))}")
    return strategy


def simulate_dynamic(workload: Workload, cluster: Cluster) -> tuple[float, int]:
    """Step time and peak memory above static memory (the busiest simulated rank) of one workload."""
    result = simulate(workload, cluster)
    return result.step_time_s, max(r.peak_memory_bytes - r.static_memory_bytes for r in result.ranks)


def extrapolate_layers(system: str, model_name: str, seq_len: int, per_layers: Callable[[int], tuple[float, int]],
                       *, sp_size: int, cluster: Cluster, config: PaperConfig = PAPER_CONFIG,
                       depths: tuple[int, int] = (1, 2)) -> SimulatedStep:
    """The full model's step from ``per_layers(L)`` = (step time, dynamic memory) of L = ``depths`` layers (see
    Note [Depth extrapolation] in simulator/max_length.py; equal depths: the full model traced directly) and the full model's ledger."""
    model = PAPER_MODELS[model_name]
    step_time_s, dynamic, depths = extrapolate_or_trace_full(per_layers, model.num_layers, depths,
                                                             what=f"{system} {model_name} at {seq_len} tokens")
    static = tuple(peak_memory_bytes(model, system, 0, which, config) for which in BANDS)
    peak = tuple(peak_memory_bytes(model, system, dynamic, which, config) for which in BANDS)
    return SimulatedStep(model=model_name, system=system, seq_len=seq_len, sp_size=sp_size,
                         step_time_s=step_time_s, dynamic_memory_bytes=dynamic, static=static, peak=peak,
                         capacity_bytes=int(cluster.device.memory_bytes),
                         extrapolated_from=None if depths[0] == depths[1] else depths)


LAYER_MODES = ("full", "extrapolated")
"""How deep the simulated step is traced (Note [Depth extrapolation] in simulator/max_length.py)."""


def simulate_step(system: str, model_name: str, seq_len: int, *, ranks: int = 8, cluster: Cluster | None = None,
                  cache: TraceCache | None = None, config: PaperConfig = PAPER_CONFIG,
                  autosp_options: dict | None = None, layers: str = "full") -> SimulatedStep:
    """One whole training step of ``system`` for a paper model, traced at full depth or extrapolated from one
    and two layers (``layers``, Note [Depth extrapolation] in simulator/max_length.py)."""
    if layers not in LAYER_MODES:
        raise ValueError(f"layers={layers!r}: choose one of {LAYER_MODES}")
    simulated_strategy(system)
    model = PAPER_MODELS[model_name]
    cluster = cluster or Cluster.from_preset(PAPER_CLUSTER)
    @functools.cache
    def per_layers(depth: int) -> tuple[float, int]:
        return simulate_dynamic(step_workload(system, model, seq_len, depth, ranks=ranks, cache=cache, config=config,
                                              autosp_options=autosp_options), cluster)

    depths = (model.num_layers, model.num_layers) if layers == "full" else (1, 2)
    return extrapolate_layers(system, model_name, seq_len, per_layers, sp_size=config.sp_size_of(system, ranks),
                              cluster=cluster, config=config, depths=depths)


@dataclass(frozen=True, kw_only=True)
class MaxLength(BandedMaxLength):
    """Longest trainable sequence of one model and system, with the ledger's band (see `max_length`)."""

    model: str
    system: str


def max_length(system: str, model_name: str, *, granularity: int = 1024, low: int | None = None,
               high: int = 262144, start: int = 8192, max_probes: int | None = 10, ranks: int = 8,
               cluster: Cluster | None = None, cache: TraceCache | None = None, config: PaperConfig = PAPER_CONFIG,
               alternative: PaperConfig | None = None, autosp_options: dict | None = None,
               layers: str = "full") -> MaxLength:
    """Longest multiple of ``granularity`` tokens in ``[low, high]`` whose simulated whole step fits in device
    memory, and the lengths at the ledger's low and high ends, by `simulator.max_length.max_length` (a secant
    search on peak memory above static memory, from ``start``).  Each result's ``stopped`` says whether it
    converged, stopped at the ceiling ``high`` or on the probe budget ``max_probes``, or found nothing that
    fits."""
    cluster = cluster or Cluster.from_preset(PAPER_CLUSTER)
    model = PAPER_MODELS[model_name]

    def step(length: int) -> SimulatedStep:
        return simulate_step(system, model_name, length, ranks=ranks, cluster=cluster, cache=cache, config=config,
                             autosp_options=autosp_options, layers=layers)

    found = search_with_band(step, training_config(model, system, config),
                             capacity_bytes=int(cluster.device.memory_bytes), low=low or granularity, high=high,
                             granularity=granularity, start=start, max_probes=max_probes,
                             alternative=None if alternative is None else training_config(model, system, alternative))
    log.info("%s %s: %s tokens (%s), band %s-%s, %d lengths simulated", system, model_name, found.nominal.display(),
             found.nominal.stopped, found.high_memory.display(), found.low_memory.display(), len(found.steps))
    return MaxLength(model=model_name, system=system, **{f.name: getattr(found, f.name) for f in fields(found)})
