"""The longest length of a row of the ALST breakdown, searched on the simulator, beside its published figure: the
table's columns (`COLUMNS`, `table_row`), each row's search (`Search`), ALST's TFLOPS count, and the item that
explains a miss (`miss_items`, `miss_item`; the rows and items: `experiments.paper_scale.alst_breakdown`, the
modelling: experiments/paper_scale/alst.py).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

from experiments.models import PaperModel
from experiments.paper_scale.alst import model_step, training_config
from experiments.paper_scale.alst_breakdown import TOLERANCE, BreakdownRow
from experiments.paper_scale.simulate import TraceCache
from simulator import Cluster
from simulator.ledger import TrainingConfig, memory_ledger
from simulator.max_length import ModelStep, ledger_host_peak, ledger_peak
from simulator.max_length import max_length as search_max_length

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Search:
    """Search settings of one row (tokens)."""

    granularity: int
    start: int
    high: int
    max_probes: int = 10


def default_search(row: BreakdownRow) -> Search:
    """Steps of 1/64 of a power of two near where a configuration of this shape lands; the same for every row of a
    shape (never the published figure)."""
    if row.sp_size == 1:
        return Search(granularity=2048, start=65_536, high=1 << 20)
    return Search(granularity=16_384, start=1 << 20, high=1 << 23)


def tflops_per_gpu(seq_len: int, step_time_s: float, sp_size: int, model: PaperModel) -> float:
    """Model TFLOPS per GPU of one step as ALST counts them (section 5.4: "the standard Megatron-LM flos estimation
    formulae taking into account repeated forwards"): ``96 s l h^2 (1 + s / 6h + V / 16 l h)`` per sample of ``s``
    tokens (Narayanan et al. 2021, with activation checkpointing), over the GPUs sharing it. With their published
    lengths and iteration times this gives their TFLOPS column (231.6 at 32,000 tokens and 17 s; the last row's
    590.6 at the recipe's 3,800,000 tokens, not the paper's 3.7M)."""
    h, layers, vocab = model.hidden_size, model.num_layers, model.vocab_size
    per_sample = 96 * seq_len * layers * h * h * (1 + seq_len / (6 * h) + vocab / (16 * layers * h))
    return per_sample / sp_size / step_time_s / 1e12


def figures(value: float) -> float:
    """``value`` to four significant figures."""
    return float(f"{value:.4g}")


def _largest_lines(cfg: TrainingConfig, dynamic: int, count: int = 3) -> str:
    lines = memory_ledger(cfg, at="backward", activation_bytes=dynamic)
    top = sorted((ln for ln in lines if ln.pool == "device"), key=lambda ln: -ln.bytes)[:count]
    return "; ".join(f"{ln.name} {ln.bytes / 2**30:.1f}" for ln in top)


def miss_items(row: BreakdownRow, cfg: TrainingConfig, model: PaperModel, capacity: int, dynamic: int,
               per_token: float, eager_dynamic: int | None = None) -> list[tuple[str, int, int]]:
    """What the model of ``row`` still differs in from ALST's run and can be sized, as (item, device bytes it
    frees at the published length, tokens it moves the simulated length) (``dynamic``: the simulated activations there; ``per_token``: the
    row's simulated peak per token): the ledger's fragmentation line, which ALST's expandable segments do not
    pay (`fragmentation`, the band's low end, 0); for the recipe with ``attn_implementation: sdpa``, the K/V
    that transformers 4.50.3's ``sdpa_attention_forward`` repeats to every query head before SDPA (Note [The
    traced workloads of the AutoSP research fork] in experiments/paper_scale/fork.py), kept for the backward of
    the recomputed layer (`attention-kernel`); for a Liger row, what running it unfused adds
    (``eager_dynamic``: its simulated activations on the device without fused kernels; `eager-non-liger`, a bound);
    and, where ALST's figure fits with room, the room (`published-is-a-run`)."""
    lines = memory_ledger(cfg, at="backward", activation_bytes=dynamic)
    items = [("fragmentation", sum(ln.bytes for ln in lines if ln.name == "fragmentation"))]
    if row.attention == "sdpa":
        local_heads = (model.num_heads - model.num_kv_heads) // row.sp_size
        head_dim = model.effective_head_dim
        items.append(("attention-kernel", -2 * row.published_tokens * local_heads * head_dim * 2))
    if eager_dynamic is not None:
        items.append(("eager-non-liger", ledger_peak(cfg, dynamic) - ledger_peak(cfg, eager_dynamic)))
    room = capacity - ledger_peak(cfg, dynamic)
    if room > 0:
        items.append(("published-is-a-run", room))
    return [(key, freed, int(freed / per_token)) for key, freed in items]


def miss_item(row: BreakdownRow, items: Sequence[tuple[str, int, int]], simulated: int) -> str:
    """The item of `miss_items` that explains the miss of ``simulated`` from the published length (the largest
    moving the simulated length towards it; where the simulation is longer and no modelling difference moves it
    back, ``published-is-a-run``: ALST's figure is a run that fitted), with its size and the error left after
    it."""
    short = simulated < row.published_tokens
    toward = [it for it in items if (it[2] > 0) == short and it[0] != "published-is-a-run"]
    if not short and not toward:
        toward = [it for it in items if it[0] == "published-is-a-run"]
    if not toward:
        return "none sized"
    key, freed, tokens = max(toward, key=lambda it: abs(it[2]))
    if key == "published-is-a-run":
        return (f"{key}: the published length fits with {freed / 2**30:.1f} GiB to spare, room for {tokens:+,} "
                f"tokens ({100 * tokens / row.published_tokens:+.1f} %)")
    left = 100 * ((simulated + tokens) / row.published_tokens - 1)
    return (f"{key}: {freed / 2**30:+.1f} GiB at the published length, {tokens:+,} tokens "
            f"({100 * tokens / row.published_tokens:+.1f} %); error after it {left:+.1f} %")


COLUMNS = ("system", "row", "sp_size", "zero_stage", "checkpointing", "tiled_loss", "tiled_mlp", "activation_offload",
           "simulated_tokens", "band_tokens", "stopped", "published_tokens", "error_pct", "within_tolerance",
           "simulated_step_s", "published_iteration_s", "simulated_tflops", "published_tflops", "host_peak_gib",
           "peak_at_published_gib", "simulated_step_at_published_s", "largest_ledger_lines_gib", "miss_item", "depth",
           "items", "source")
"""The table's columns, one per key of every row."""


def table_row(**fields) -> dict:
    """A table row: ``fields``, every other column empty."""
    unknown = set(fields) - set(COLUMNS)
    if unknown:
        raise KeyError(f"not columns of the alst table: {sorted(unknown)}")
    return {**dict.fromkeys(COLUMNS, ""), **fields}


def row_result(row: BreakdownRow, *, model: PaperModel, cluster: Cluster, layers: str = "extrapolated",
               cache: TraceCache | None = None, search: Search | None = None) -> dict:
    """One table row: the simulated longest length of ``row`` (nominal ledger, and its band), its step time,
    beside the published figure, the error, and the peak at the published length."""
    search = search or default_search(row)
    cfg = training_config(row, model)
    capacity = int(cluster.device.memory_bytes)
    host_capacity = cluster.host_memory_per_rank_bytes

    @functools.cache
    def step(seq_len: int) -> ModelStep:
        return model_step(row, seq_len, model=model, cluster=cluster, layers=layers, cache=cache)

    found = search_max_length(step, cfg, capacity_bytes=capacity, low=search.granularity, high=search.high,
                              granularity=search.granularity, start=search.start, max_probes=search.max_probes,
                              host_capacity_bytes=host_capacity)
    best = found.nominal.max_seq_len
    out = table_row(system=row.system, row=row.name, sp_size=row.sp_size, zero_stage=row.zero_stage,
               checkpointing=row.checkpointing, tiled_loss=row.tiled_loss, tiled_mlp=row.tiled_mlp,
               activation_offload=row.offload, simulated_tokens=best or "",
               band_tokens=f"{found.high_memory.display()} - {found.low_memory.display()}",
               stopped=found.nominal.stopped, published_tokens=row.published_tokens or "",
               published_iteration_s=row.published_iteration_s or "", published_tflops=row.published_tflops or "",
               depth=layers, items=" ".join(row.items + (("depth-extrapolated",) if layers != "full" else ())),
               source=row.source)
    if best:
        at_best = step(best)
        out.update(simulated_step_s=figures(at_best.step_time_s),
                   simulated_tflops=figures(tflops_per_gpu(best, at_best.step_time_s, row.sp_size, model)),
                   host_peak_gib=round(ledger_host_peak(cfg, at_best.host_dynamic_memory_bytes) / 2**30, 1))
    if row.published_tokens:
        published = row.published_tokens - row.published_tokens % row.sp_size
        at_published = step(published)
        if best:
            error = best / row.published_tokens - 1
            out.update(error_pct=round(100 * error, 1), within_tolerance=abs(error) <= TOLERANCE)
        if best and best != published:
            per_token = (ledger_peak(cfg, at_published.dynamic_memory_bytes) -
                         ledger_peak(cfg, step(best).dynamic_memory_bytes)) / (published - best)
            eager = None
            if row.liger and not row.eager:
                eager = model_step(replace(row, eager=True), published, model=model, cluster=cluster, layers=layers,
                                   cache=cache).dynamic_memory_bytes
            items = miss_items(row, cfg, model, capacity, at_published.dynamic_memory_bytes, per_token, eager)
            out.update(miss_item=miss_item(row, items, best))
        out.update(peak_at_published_gib=round(ledger_peak(cfg, at_published.dynamic_memory_bytes) / 2**30, 1),
                   largest_ledger_lines_gib=_largest_lines(cfg, at_published.dynamic_memory_bytes),
                   simulated_step_at_published_s=figures(at_published.step_time_s))
    log.info("%s %s: %s tokens (published %s)", row.system, row.name, best, row.published_tokens)
    return out

