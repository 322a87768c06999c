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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from autosp.errors import AutoSPError
from autosp.plan.model_source import ModelSource
from autosp.plan.setup import TrainingSetup
from autosp.plan.step import StepPrediction, simulate_step
from autosp.plan.traces import TraceReuse
from simulator.cluster import Cluster
from simulator.ledger import LedgerLine, memory_ledger, summarize
from simulator.max_length import (
    BANDS,
    ledger_host_peak,
    ledger_peak,
)
from simulator.max_length import max_length as search_max_length
from simulator.training_step import (
    host_optimizer_time_s,
)

log = logging.getLogger(__name__)

log = logging.getLogger(__name__)

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
               f"({'shard_parameters=True: ' if s.zero_stage == 3 else ''}{self.wrapper}); {s.dtype}; {s.optimizer}; micro-batch {s.micro_batch} x {s.seq_len:,} tokens; "
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


def ledger_config(source: ModelSource, hf, setup: TrainingSetup, cluster: Cluster):
    """The `simulator.training_config.TrainingConfig` the memory ledger prices ``setup`` of ``source`` (Hugging Face
    config ``hf``) at on ``cluster``."""
    # a node without a GPU architecture (cpu-gloo) runs CPU processes: the ledger counts their tensors only
    return dataclasses.replace(setup.training_config(source.parameter_numels(hf)),
                               gpu_process=bool(cluster.preset.architecture))


def held_before_activations(model: str, setup: TrainingSetup, cluster: Cluster, *,
                            source: ModelSource | None = None) -> dict[str, int]:
    """Device bytes per rank by ledger category that every plan of ``setup`` holds inside backward before any
    activation (the ledger without the simulated lines: model states, buffers, runtime) for ``model`` on
    ``cluster``: a lower bound of every plan's peak, so no plan fits a target at or below their sum.  ``source``:
    ``model``'s `ModelSource` where the caller holds one (its meta model is built once)."""
    source = ModelSource(model) if source is None else source
    held: dict[str, int] = {}
    for line in memory_ledger(ledger_config(source, source.config(seq_len=setup.seq_len), setup, cluster),
                              at="backward"):
        if line.pool == "device":
            held[line.category] = held.get(line.category, 0) + line.bytes
    return held


def predict(model: str, setup: TrainingSetup, cluster: Cluster, *, max_length: bool = False,
            max_length_high: int | None = None, granularity: int = 1024, max_probes: int = 8,
            progress: Callable[[str], None] | None = None, options: Mapping | None = None,
            capacity_bytes: int | None = None, reuse: TraceReuse | None = None,
            max_length_low: int | None = None) -> Prediction:
    """Predict ``setup`` for ``model`` (a preset of `autosp.presets` or a config.json) on ``cluster``; with
    ``max_length`` also search the longest length that fits (each probe is one more trace).  ``options``: the
    `autosp.compile` options the step is traced with; ``capacity_bytes``: the memory a rank may use (default: the
    cluster's device memory); ``reuse``: traces shared with other plans' predictions (`TraceReuse`);
    ``max_length_low``: the search's floor, where it starts (lengths below it are not searched: the answer is
    then ``< max_length_low`` when that does not fit; Note [The longest plan bounds the others' searches] in
    autosp/plan/planner.py)."""
    start = time.perf_counter()
    setup.check()
    source = ModelSource(model) if reuse is None else reuse.source(model)
    hf = source.config(seq_len=setup.seq_len)
    config = ledger_config(source, hf, setup, cluster)
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
        low = max(grain, -(-(max_length_low or 0) // grain) * grain)
        found_ml = search_max_length(step, config, capacity_bytes=capacity, low=low, high=max(high, low),
                                     granularity=grain, start=max(low, setup.seq_len - setup.seq_len % grain),
                                     max_probes=max_probes, host_capacity_bytes=cluster.host_memory_per_rank_bytes)
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
    return Prediction(model=model, parameters=sum(source.parameter_numels(hf)), layers=hf.num_hidden_layers, setup=setup,
                      cluster=cluster.describe(), wrapper=config.wrapper, capacity_bytes=capacity, step=at,
                      lines=lines, peak_band=band, max_length=found,
                      max_length_step=longest,
                      seconds=time.perf_counter() - start,
                      notes=tuple(notes), host_capacity_bytes=cluster.host_memory_per_rank_bytes)


# --- strategy="auto": the strategy chosen by simulating each candidate on its own trace -----------------------
