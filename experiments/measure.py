"""Side-by-side CPU measurements of sequence-parallel systems on real gloo ranks.

`measure_on_rank` runs on every rank (see `experiments.spawn.run_ranks`): it
builds one tiny model, a single-device reference of a training step on the full
sequence, and every requested system (`experiments.baselines`) from copies of
the same weights.  It records each system's compile (first-step) time, its loss
and gradient error against the reference, the rank's peak tensor memory of one
untimed step (`experiments.peak_memory`, where present), and then times steps of
all systems interleaved, rotating the order every round, so machine noise hits
every system alike and ratios measured in one run are meaningful.

With one system in ``spec.systems`` the process measures it alone: compiled from a
fresh state (`fresh_compile_state`), with Dynamo's graph-break, graph and
recompile counts of its compilation reported (`compile_counts`).

`max_seq_len_on_rank` searches, per system, the longest sequence whose measured
peak memory stays under a per-rank cap (see Note [Memory-cap search]).
"""

from __future__ import annotations

import copy
import logging
import os
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class MeasureSpec:
    model: str
    """Tiny model preset (experiments.models.TINY_MODELS)."""
    seq_len: int
    """Tokens per sample."""
    systems: tuple[str, ...]
    """Systems to compare (experiments.baselines names)."""
    steps: int = 5
    """Timed steps per system after the first (compile) step and the warm-up steps."""
    warmup: int = 1
    """Untimed rounds of steps of every system after all are built (a later build may make an
    earlier system recompile); peak memory is then measured on one more untimed step."""
    compiler: str = "aot_eager"
    """Code generator for the compiled systems."""
    layers: int = 2
    hidden: int = 64
    model_options: dict = field(default_factory=dict)
    """Further size overrides for the preset (e.g. ``{"kv_heads": 4}``)."""


def _sample(seq_len: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, vocab, (1, seq_len), generator=g)
    labels = ids.clone()
    labels[0, : seq_len // 4] = -100  # ignored targets spread unevenly over the shards
    return ids, labels


def _errors(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """Largest relative gradient error: max |g - g_ref| / max |g_ref| over parameters."""
    worst = 0.0
    for name, ref in reference.items():
        got = grads.get(name)
        if got is None:
            return float("inf")
        worst = max(worst, float((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12)))
    return worst


def peak_memory_available() -> bool:
    """Whether `experiments.peak_memory` (the per-rank CPU peak-memory tracker) is installed."""
    try:
        import experiments.peak_memory  # noqa: F401
    except ImportError:
        return False
    return True


def _resident_tensors(system) -> list[torch.Tensor]:
    """Parameters and gradients a system holds on this rank before a step (ZeRO-3: its partitions and the
    engine's preallocated buffers, `ZeRO3System.resident_tensors`)."""
    if hasattr(system, "resident_tensors"):
        return system.resident_tensors()
    model = getattr(system, "model", None)
    if model is None and hasattr(system, "engine"):
        model = system.engine.module
    tensors = []
    for p in model.parameters() if model is not None else ():
        tensors.append(getattr(p, "ds_tensor", p))
        tensors.append(p.grad)
    return [t for t in tensors if isinstance(t, torch.Tensor)]


_RNG_OPS_REGISTERED = False


def _register_rng_ops_for(mode_class) -> None:
    """Let ``mode_class`` (a dispatch mode) run the RNG-state higher-order ops that compiled activation
    checkpointing puts in a graph (they otherwise refuse unknown modes): run them under the mode, so the
    tensors their inner op creates are seen as any other op's."""
    global _RNG_OPS_REGISTERED
    if _RNG_OPS_REGISTERED:
        return
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    @run_and_save_rng_state.py_impl(mode_class)
    def _save(mode, op, *args, **kwargs):
        with mode:
            return torch.get_rng_state(), op(*args, **kwargs)

    @run_with_rng_state.py_impl(mode_class)
    def _replay(mode, rng_state, op, *args, **kwargs):
        current = torch.get_rng_state()
        torch.set_rng_state(rng_state)
        try:
            with mode:
                return op(*args, **kwargs)
        finally:
            torch.set_rng_state(current)

    _RNG_OPS_REGISTERED = True


def _measured_step(system, ids, labels, measure_memory: bool) -> int | None:
    """One untimed step; this rank's peak tensor bytes during it (None without the tracker)."""
    system.zero_grad()
    if not measure_memory:
        system.step(ids, labels)
        return None
    from experiments.peak_memory import PeakMemory

    _register_rng_ops_for(PeakMemory)
    with PeakMemory(static=_resident_tensors(system), keep_breakdown=False) as pm:
        system.step(ids, labels)
    return int(pm.peak_bytes)


def fresh_compile_state() -> None:
    """Forget every compiled graph, Dynamo's counters and compilation metrics, and turn off the on-disk
    compile caches, so that what is compiled next is compiled from scratch and counted alone."""
    from torch._dynamo import utils as dynamo_utils

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    dynamo_utils.clear_compilation_metrics()
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False


def compile_counts() -> dict[str, int]:
    """Dynamo's tally since the last `fresh_compile_state`: graph breaks (``counters["graph_break"]``), graphs
    compiled, and recompiles (frames compiled again after a guard failed)."""
    from torch._dynamo import utils as dynamo_utils

    metrics = dynamo_utils.get_compilation_metrics()
    return {
        "graph_breaks": int(sum(dynamo_utils.counters["graph_break"].values())),
        "graphs": int(dynamo_utils.counters["stats"]["unique_graphs"]),
        "recompiles": sum(1 for m in metrics if m.recompile_reason),
    }


def _quiet_rank() -> None:
    # DeepSpeed calls deprecated torch.distributed functions (reduce_scatter_tensor, ...) on every step.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)


def time_interleaved(systems: dict, ids, labels, *, steps: int) -> dict[str, list[float]]:
    """Seconds of ``steps`` training steps of every system, barrier-aligned on all ranks, interleaved:
    each round steps every system once, the order rotating by one every round, so machine noise hits
    every system alike and ratios measured in one run mean something."""
    names = list(systems)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(steps):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            systems[name].zero_grad()
            dist.barrier()
            start = time.perf_counter()
            systems[name].step(ids, labels)
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    return times


def measure_on_rank(rank: int, world: int, spec_dict: dict) -> dict:
    from experiments.baselines import BaselineUnsupported, build_system
    from experiments.models import build_model, vocab_size

    spec = MeasureSpec(**{**spec_dict, "systems": tuple(spec_dict["systems"])})
    os.environ.setdefault("LOCAL_RANK", str(rank))  # what a launcher sets; deepspeed.initialize (zero3) needs it
    _quiet_rank()
    measure_memory = peak_memory_available()
    torch.manual_seed(0)
    base = build_model(spec.model, layers=spec.layers, hidden=spec.hidden, **spec.model_options)
    ids, labels = _sample(spec.seq_len, vocab_size(base))

    reference = copy.deepcopy(base)
    out = reference(input_ids=ids, labels=labels)
    ref_loss = out if isinstance(out, torch.Tensor) else out.loss
    ref_loss.backward()
    ref_loss = ref_loss.detach()
    ref_grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters() if p.grad is not None}

    systems, results = {}, {}
    isolated = len(spec.systems) == 1
    for name in spec.systems:
        if isolated:
            fresh_compile_state()
        dist.barrier()
        start = time.perf_counter()
        try:
            system = build_system(name, copy.deepcopy(base), sp_size=world, compiler=spec.compiler)
        except BaselineUnsupported as err:  # a result (the same on every rank), not a failure
            results[name] = {"unsupported": str(err)}
            continue
        loss = system.step(ids, labels)
        first_step_s = time.perf_counter() - start
        systems[name] = system
        results[name] = {
            "first_step_s": first_step_s,
            "loss": float(loss),
            "loss_error": abs(float(loss) - float(ref_loss)),
            "grad_max_rel_error": _errors(system.gradients(), ref_grads),
            "step_s": [],
            "peak_memory_bytes": None,
        }
    names = list(systems)
    # Warm-up rounds after every system is built: building one (ZeRO-3 above all) can change global
    # state that another's compiled code guards on, so the first step after it may recompile.
    for _ in range(spec.warmup):
        for name in names:
            systems[name].zero_grad()
            systems[name].step(ids, labels)
    for name in names:
        results[name]["peak_memory_bytes"] = _measured_step(systems[name], ids, labels, measure_memory)
    for name, step_s in time_interleaved(systems, ids, labels, steps=spec.steps).items():
        results[name]["step_s"] = step_s
    if isolated:  # counts of the one system this process compiled (with several, they mix)
        for name in names:
            results[name].update(compile_counts())
    for r in results.values():
        if "step_s" in r:
            r["median_step_s"] = statistics.median(r["step_s"]) if r["step_s"] else float("nan")
    return {"rank": rank, "ref_loss": float(ref_loss), "systems": results, "spec": asdict(spec)}


# --- the longest sequence under a memory cap ------------------------------------------------------------

# Note [Memory-cap search]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# A CPU has no out-of-memory point worth hitting, so the cap is virtual: a sequence "fits" when the
# largest per-rank peak tensor memory of one training step (PeakMemory, measured on the step after
# the compiling one, maximum over ranks by all_reduce) stays at or under ``cap_bytes``.  Every
# probe builds the system afresh on a fresh Dynamo cache (no recompile limits, no dynamic shapes),
# so a probe costs a compile: the search must need few.  Peak memory grows about linearly with the
# length (activations; attention is flash-style, O(S) memory), so the next length is where a
# straight line crosses the cap: through the first probe and the origin at first, then through the
# two longest fitting (or two shortest failing) probes, and once the cap is bracketed through the
# bracket's ends (regula falsi), clamped so that the bracket shrinks by at least a quarter per probe
# (robust to memory that is not quite linear, or not monotone at short lengths); rounded to
# ``granularity`` and kept strictly between the longest length that fitted and the shortest that did not.  It stops when those two are
# ``granularity`` apart, at ``max_len``, or after ``max_probes`` probes (bounded run time); the
# answer is always a length that was measured to fit.  Monotone growth of peak memory with length,
# true for every system here, is what makes the bracket valid.


def next_probe(probes: list[tuple[int, int]], cap_bytes: int, *, granularity: int, max_len: int) -> int | None:
    """The next length to probe given ``probes`` [(seq_len, peak_bytes)], or None when the search is done.

    A pure function (see Note [Memory-cap search]); lengths are multiples of ``granularity``.
    """
    peak = dict(probes)
    fits = [s for s, p in probes if p <= cap_bytes]
    fails = [s for s, p in probes if p > cap_bytes]
    lo = max(fits, default=0)
    hi = min(fails, default=max_len + granularity)
    if hi - lo <= granularity or (not fails and lo >= max_len):
        return None
    if fits and fails:  # bracketed: interpolate, but shrink the bracket by at least a quarter
        slope = (peak[hi] - peak[lo]) / (hi - lo)
        guess = lo + (cap_bytes - peak[lo]) / slope if slope > 0 else (lo + hi) / 2
        guess = min(max(guess, lo + (hi - lo) / 4), hi - (hi - lo) / 4)
    elif len(probes) == 1:
        (s0, p0), = probes
        guess = s0 * cap_bytes / max(p0, 1)
    else:  # all fit (extrapolate from the two longest) or all fail (from the two shortest)
        (s0, p0), (s1, p1) = sorted(probes)[-2:] if not fails else sorted(probes)[:2]
        slope = (p1 - p0) / (s1 - s0)
        guess = s1 + (cap_bytes - p1) / slope if slope > 0 else (2 * s1 if not fails else s0 / 2)
    length = int(guess // granularity) * granularity
    return max(lo + granularity, min(length, hi - granularity, max_len))


@dataclass(frozen=True, kw_only=True)
class MemoryCapSpec:
    model: str
    """Tiny model preset (experiments.models.TINY_MODELS)."""
    systems: tuple[str, ...]
    """Systems to search (experiments.baselines names)."""
    cap_bytes: int
    """Per-rank memory cap: a length fits when every rank's peak stays at or under it."""
    start: int = 512
    """First length probed (a multiple of ``granularity``)."""
    max_len: int = 65536
    """The search stops here even if this length still fits."""
    granularity: int = 256
    """The search stops at this many tokens (a multiple of 2 × ranks, for ring attention's chunks)."""
    max_probes: int = 5
    """Probes per system at most (each compiles the system afresh)."""
    compiler: str = "aot_eager"
    layers: int = 2
    hidden: int = 64
    model_options: dict = field(default_factory=dict)
    """Further size overrides for the preset (e.g. ``{"kv_heads": 4}``)."""


def _probe(name: str, base, seq_len: int, world: int, spec: MemoryCapSpec) -> int:
    """Largest peak bytes over the ranks of one step of ``name`` at ``seq_len``."""
    from experiments.baselines import build_system
    from experiments.models import vocab_size

    torch._dynamo.reset()
    ids, labels = _sample(seq_len, vocab_size(base))
    system = build_system(name, copy.deepcopy(base), sp_size=world, compiler=spec.compiler)
    system.step(ids, labels)
    peak = torch.tensor([_measured_step(system, ids, labels, True)], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    del system
    return int(peak.item())


def max_seq_len_on_rank(rank: int, world: int, spec_dict: dict) -> dict:
    """Per system: the longest length that fitted under the cap, and every probe ``[seq_len, peak_bytes]``."""
    from experiments.baselines import BaselineUnsupported
    from experiments.models import build_model

    spec = MemoryCapSpec(**{**spec_dict, "systems": tuple(spec_dict["systems"])})
    os.environ.setdefault("LOCAL_RANK", str(rank))
    _quiet_rank()
    if not peak_memory_available():
        raise RuntimeError("the memory-cap search needs experiments.peak_memory")
    torch.manual_seed(0)
    base = build_model(spec.model, layers=spec.layers, hidden=spec.hidden, **spec.model_options)
    results = {}
    for name in spec.systems:
        start_s = time.perf_counter()
        probes: list[tuple[int, int]] = []
        try:
            length = spec.start
            while length is not None and len(probes) < spec.max_probes:
                probes.append((length, _probe(name, base, length, world, spec)))
                length = next_probe(probes, spec.cap_bytes, granularity=spec.granularity, max_len=spec.max_len)
        except BaselineUnsupported as err:
            results[name] = {"unsupported": str(err), "probes": probes}
            continue
        fit = max((s for s, p in probes if p <= spec.cap_bytes), default=0)
        fail = min((s for s, p in probes if p > spec.cap_bytes), default=None)
        results[name] = {"max_seq_len": fit, "first_failure": fail, "probes": probes,
                         "search_s": time.perf_counter() - start_s}
        log.info("memory cap %s: %d tokens fit (%d probes)", name, fit, len(probes))
    return {"rank": rank, "systems": results, "spec": asdict(spec)}
