"""Side-by-side CPU measurements of sequence-parallel systems on real gloo ranks.

`measure_on_rank` runs on every rank (see `experiments.launch.run_on_ranks`): it
builds one tiny model, a single-device reference of a training step on the full
sequence, and every requested system (`experiments.baselines`) from copies of
the same weights.  It records each system's compile (first-step) time, its loss
and gradient error against the reference, the rank's peak tensor memory of one
untimed step (`experiments.cpu.peak_memory`), and then times steps of
all systems interleaved, rotating the order every round, so machine noise hits
every system alike and ratios measured in one run are meaningful.

With one system in ``spec.systems`` the process measures it alone: compiled from a
fresh state (`fresh_compile_state`), with Dynamo's graph-break, graph and
recompile counts of its compilation reported (`compile_counts`).

The memory-cap search is `experiments.cpu.memory_cap`.
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


def _measured_step(system, ids, labels) -> int:
    """One untimed step; this rank's peak tensor bytes during it."""
    system.zero_grad()
    from experiments.cpu.peak_memory import PeakMemory

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
        results[name]["peak_memory_bytes"] = _measured_step(systems[name], ids, labels)
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
