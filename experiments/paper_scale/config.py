"""The paper's training configuration, stated once.

Where each choice comes from (read off the installed DeepSpeed package):

* Precision ``bf16`` with ``data_types.grad_accum_dtype`` left unset.  Nothing
  under ``deepspeed/compile`` (DeepCompile, ``init_sp.py``/AutoSP) sets
  ``grad_accum_dtype``; ``DeepSpeedEngine.get_data_types`` then takes the model
  dtype, and ``_do_optimizer_sanity_check`` returns ``BFLOAT16`` (the
  ``BF16_Optimizer`` with an unpartitioned fp32 gradient buffer) only for
  ``bf16`` + ``fp32`` accumulation + ZeRO 1.  With the default, ZeRO 1 uses
  ``DeepSpeedZeroOptimizer``.  So the paper's runs are modelled without
  ``BF16_Optimizer``; that is an assumption about an unpublished config file.
* ZeRO stage 1 for AutoSP, Ulysses, Ulysses+checkpointing and ring attention:
  ``DeepSpeedEngine.get_autosp_backend`` refuses AutoSP unless the ZeRO stage
  is 0 or 1, and the baselines are run under the same engine settings.
* ZeRO stage 3 for the ZeRO-3 baseline (its definition).
* Adam, 8 ranks (one node of 8×A100-80GB, the paper's hardware), micro-batch 1.

No constant here is fitted to the published figures.

Note [The public configurations of the published runs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The published figures were made with the authors' research fork of DeepSpeed 0.16.3 (GitHub
spikerheado1234/AutoSP, commit fd542b43619e03c7454abfcff3b5aaeef05c5318; README: torch 2.7.0 + CUDA 12.8,
transformers 4.50.3 -- its ``need_to_copy_paste/req.txt`` lists torch 2.5.1 and transformers 4.50.0.dev0 instead:
the fork's own files disagree).  Its benchmark, ``bench_dc_ulysses/``, states (paths under that folder):

* ``run_acc_lm.py``: accelerate + DeepSpeed, ``--batch_size`` 1, ``--gradient_accumulation_steps`` 1,
  ``torch.optim.AdamW``, ``--sp_size`` 2 and ``--dp_size`` 1 by default (``get_args``); every sample padded to
  the full length (``padding='max_length'``); ``--activation_checkpointing`` off unless passed; ``accelerator.
  backward`` runs DeepSpeed's ``engine.backward`` and ``engine.step`` (accelerate's ``DeepSpeedEngineWrapper``).
  The baselines' SP groups are built by the script (``sp_dp_registry.populate_registry``) and never handed to
  DeepSpeed, so DeepSpeed's data-parallel group -- the one ``BF16_Optimizer`` partitions over -- is every rank.
* ``run_ulysses.sh``: ``SP_SIZE=${3:-2}``, ``DP_SIZE=${4:-1}``: SP 2 is the script's default.
* ``configs/*.json``: every public config has ``"zero_optimization": {"stage": 0}`` and ``bf16``; the baselines'
  stage-1 change (commit 3ef4233, 2026-01-26 02:24 UTC, "working zero-1 for all baselines") was set back to 0 the
  same day (b1d1db1, 07:14 UTC).
* The fork's AutoSP shards over the whole world, whatever ``--sp_size`` says: ``deepspeed/compile/custom_ops/
  all_to_all.py`` runs its all-to-alls on ``dist.group.WORLD`` (lines 28, 38) and ``deepspeed/compile/passes/
  autosp.py`` divides the sequence by ``dist.get_world_size()`` (lines 39, 86).

So the figures' SP x DP split is not stated; the candidates are the splits of 8 GPUs the script supports (SP 8,
SP 4 x DP 2, SP 2 x DP 4 -- the last one has the script's default SP), under stage 0, which in 0.16.3 with bf16
runs ``BF16_Optimizer`` (Note [DeepSpeed 0.16.3 as the AutoSP fork ran it] in simulator/ledger.py).  The PyTorch
blog's usage example (2026-04-29) sets ``sequence_parallel_size`` 4 and ZeRO stage 1 (seen in a quotation of
the blog, 24-ai.news 2026-04-30; it is written for the merged DeepSpeed AutoSP, whose SP group follows that
setting, while the fork's spans every rank): SP 4 x DP 2 on 8 GPUs.  The earlier
stated configuration of this project (ZeRO 1, SP 8) is kept as a candidate too: under 0.16.3 ZeRO 1 with bf16
accumulates in bf16 and runs ``DeepSpeedZeroOptimizer``, as 0.19.8 does.  :data:`PUBLIC_CONFIGS` lists them;
:data:`BAND_CONFIGS` are those a source states for the published runs; current DeepSpeed's stage 0 is listed
for comparison only (it did not make the figures: the merged AutoSP needs torch >= 2.9).

What the fork ran that changes the traced workload, not the ledger, is each fork configuration's ``fork``
(`experiments.paper_scale.fork.FORK_TRACE`, Note [The traced workloads of the AutoSP research fork] in
experiments/paper_scale/fork.py): AutoSP under the fork's checkpointing rule (``need_to_copy_paste/
partitioners.py`` line 1081: a tensor needed in backward may be recomputed only when its dim 1 >= 4096) with K/V
repeated to every head before SDPA (transformers 4.50.3), and the Ulysses baseline with the kernel its SDPA call
got (``enable_gqa=False`` since commit f97a5a6: the math kernel where a GQA model's per-rank heads broadcast, SP 8
for the Llama-3 models; the fused kernel of commit 181c2c5 elsewhere).  Not modelled: the patched partitioner
replaces torch's (README step 6), so baselines run with ``torch.compile`` are partitioned by the same rule; they
are traced without checkpointing, as the issue's source (``--activation_checkpointing`` off) states.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from experiments.paper_scale.fork import FORK, FORK_TRACE, ForkTrace
from simulator.strategies import STRATEGIES

PAPER_CLUSTER, PAPER_RANKS = "a100-80gb-sxm", 8
"""The AutoSP paper's machine: 8 A100-80GB (SXM) in one node."""


@dataclass(frozen=True)
class PaperConfig:
    precision: str = "bf16"
    grad_accum_dtype: str | None = None
    optimizer: str = "adam"
    world_size: int = 8
    micro_batch_size: int = 1
    sp_zero_stage: int = 1
    zero3_zero_stage: int = 3
    sp_size: int | None = None
    """Ranks the hand-written baselines split one sequence over (``None``: all of them); the rest of the world
    is data parallel.  AutoSP always shards over every rank and ZeRO-3 over none (`sp_size_of`)."""
    deepspeed: str = "0.19.8"
    """DeepSpeed version whose code the ledger follows (`simulator.ledger.TrainingConfig.deepspeed`)."""
    provenance: str = ""
    """Where the configuration is stated."""
    fork: ForkTrace = field(default_factory=ForkTrace)
    """What of the authors' fork the traces model (Note [The traced workloads of the AutoSP research fork] in
    experiments/paper_scale/fork.py); the default: nothing (this project's AutoSP and fused attention)."""

    def __post_init__(self) -> None:
        if self.sp_size is not None and (self.sp_size < 1 or self.world_size % self.sp_size):
            raise ValueError(f"sp_size {self.sp_size} must divide world_size {self.world_size}")

    def zero_stage(self, system: str) -> int:
        """ZeRO stage of strategy ``system`` (a name of `simulator.strategies.STRATEGIES`): ``zero3_zero_stage``
        for a strategy that trains under ZeRO 3 by definition, this configuration's ``sp_zero_stage`` for the
        others."""
        return self.zero3_zero_stage if STRATEGIES[system].zero_stage == 3 else self.sp_zero_stage

    def sp_size_of(self, system: str, ranks: int) -> int:
        """Ranks one sequence of strategy ``system`` is split over on ``ranks`` ranks: ``sp_size`` for the
        hand-written baselines, whose SP groups the authors' benchmark script builds from its ``--sp_size``; the
        strategy's own for the others (`simulator.strategies.Strategy.sp_size`: 1 under ZeRO-3, every rank for
        AutoSP, whose fork's all-to-alls run on the whole world, Note [The public configurations of the
        published runs])."""
        strategy = STRATEGIES[system]
        if strategy.implementation != "hand-written" or self.sp_size is None:
            return strategy.sp_size(ranks)
        if ranks % self.sp_size:
            raise ValueError(f"sp_size {self.sp_size} must divide ranks {ranks}")
        return self.sp_size

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas of the baselines (``world_size / sp_size``)."""
        return self.world_size // (self.sp_size or self.world_size)

    @property
    def label(self) -> str:
        sp = self.sp_size or self.world_size
        split = f"SP {sp}" if sp == self.world_size else f"SP {sp} x DP {self.dp_size}"
        traced = f"; traced: {self.fork.label}" if self.fork.label else ""
        return f"DeepSpeed {self.deepspeed} ZeRO {self.sp_zero_stage}, {split}{traced}"


PAPER_CONFIG = PaperConfig(provenance="this project's earlier stated configuration (ZeRO 1, SP 8, DeepSpeed 0.19.8)")

_FORK = FORK + " "
_STAGE0 = _FORK + "bench_dc_ulysses/configs/*.json: zero_optimization.stage 0, bf16"
_TRACED = ("; traced as the fork ran it: need_to_copy_paste/partitioners.py line 1081 (checkpointing), "
           "transformers 4.50.3 integrations/sdpa_attention.py lines 29-31 (K/V repetition), bench_dc_ulysses/"
           "distributed_attention.py enable_gqa=False since f97a5a6 (Ulysses kernel)")
PUBLIC_CONFIGS: dict[str, PaperConfig] = {
    "fork-z0-sp8": PaperConfig(deepspeed="0.16.3", sp_zero_stage=0, sp_size=8, fork=FORK_TRACE,
                               provenance=_STAGE0 + "; SP 8 = the whole node (run_ulysses.sh SP_SIZE argument)"
                               + _TRACED),
    "fork-z0-sp4xdp2": PaperConfig(deepspeed="0.16.3", sp_zero_stage=0, sp_size=4, fork=FORK_TRACE,
                                   provenance=_STAGE0 + "; run_ulysses.sh SP_SIZE=4 DP_SIZE=2" + _TRACED),
    "fork-z0-sp2xdp4": PaperConfig(deepspeed="0.16.3", sp_zero_stage=0, sp_size=2, fork=FORK_TRACE,
                                   provenance=_STAGE0 + "; run_ulysses.sh default SP_SIZE=${3:-2} (run_acc_lm.py "
                                   "--sp_size default 2), DP 4 to fill 8 GPUs" + _TRACED),
    "fork-z1-sp4xdp2": PaperConfig(deepspeed="0.16.3", sp_zero_stage=1, sp_size=4, fork=FORK_TRACE,
                                   provenance="PyTorch blog 'Introducing AutoSP' (2026-04-29) usage example: "
                                   "sequence_parallel_size 4, zero_optimization.stage 1 (quoted by 24-ai.news, "
                                   "2026-04-30); written for the merged DeepSpeed AutoSP, 8 GPUs give DP 2" + _TRACED),
    "fork-z1-sp8": PaperConfig(deepspeed="0.16.3", sp_zero_stage=1, sp_size=8, fork=FORK_TRACE,
                               provenance=_FORK + "commit 3ef4233 (baselines at ZeRO 1, reverted the same day) and "
                               "this project's earlier stated configuration" + _TRACED),
    "current-z0-sp8": PaperConfig(deepspeed="0.19.8", sp_zero_stage=0, sp_size=8,
                                  provenance="current DeepSpeed stage 0 (FP16_UnfusedOptimizer; did not make the "
                                  "figures)"),
}
"""Every configuration a public source states or allows for the published runs (Note [The public configurations
of the published runs]), by name."""
BAND_CONFIGS = ("fork-z0-sp8", "fork-z0-sp4xdp2", "fork-z0-sp2xdp4", "fork-z1-sp4xdp2", "fork-z1-sp8")
"""The configurations whose band the max-seq-len-configs table reports (those that could have made the
figures)."""
SCRIPT_DEFAULT = "fork-z0-sp2xdp4"
"""The authors' script default (stage 0, SP 2) on the paper's 8 GPUs."""


def training_config(model, system: str, config: PaperConfig = PAPER_CONFIG):
    """The ledger's :class:`~simulator.ledger.TrainingConfig` for ``model`` (a ``PaperModel``) under ``system``."""
    return model.training_config(
        optimizer=config.optimizer, precision=config.precision, grad_accum_dtype=config.grad_accum_dtype,
        zero_stage=config.zero_stage(system), dp_world_size=config.world_size,
        micro_batch_size=config.micro_batch_size, deepspeed=config.deepspeed)


def static_memory_bytes(model, system: str, which: str = "nominal", config: PaperConfig = PAPER_CONFIG) -> int:
    """Per-rank static memory inside backward (parameters, gradients, optimizer state, buffers, device reserve)."""
    return peak_memory_bytes(model, system, 0, which, config)


def peak_memory_bytes(model, system: str, activation_bytes: int, which: str = "nominal",
                      config: PaperConfig = PAPER_CONFIG) -> int:
    """Per-rank peak: the ledger inside backward with ``activation_bytes`` of simulated activations (the
    workload's peak above static memory), which also adds their allocator rounding and fragmentation band
    (`simulator.max_length.ledger_peak`)."""
    from simulator.max_length import ledger_peak

    return ledger_peak(training_config(model, system, config), activation_bytes, which)


def ledger_lines(model, system: str, activation_bytes: int = 0, config: PaperConfig = PAPER_CONFIG):
    """The ledger lines behind `peak_memory_bytes` (for tables and the notebook)."""
    from simulator.ledger import memory_ledger

    return memory_ledger(training_config(model, system, config), at="backward", activation_bytes=int(activation_bytes))


ALTERNATIVE_CONFIG = PaperConfig(grad_accum_dtype="fp32")
"""Not the stated configuration: the same runs with ``data_types.grad_accum_dtype = "fp32"``, which under ZeRO 1
and bf16 selects DeepSpeed's ``BF16_Optimizer`` and its unpartitioned fp32 gradient buffer (and fp32 gradient
partitions under ZeRO 3).  The max-seq-len table shows it as an explanation of the gap to the published figures,
never as the configuration the lengths are reported for."""


def configuration_band(published: list[dict], lengths: dict, *, band: tuple[str, ...] = BAND_CONFIGS,
                       script_default: str = SCRIPT_DEFAULT, granularity: dict[str, int] | None = None) -> list[dict]:
    """One row per published max length: the simulated length under every configuration of ``lengths``
    ({config name: {(model, system): tokens or None (nothing fits)}}), the script default's, the band the
    ``band`` configurations span, whether the published figure lies inside it, and the configuration whose length
    is closest to it (a choice among stated configurations, not a prediction).  ``published``: rows with
    ``model``, ``system`` and ``value`` (tokens).  ``granularity`` ({system: tokens}): the searches' step; a
    search answers the longest fitting multiple of it, so the longest fitting length lies below the next
    multiple, and the band's upper end extends to it for ``inside_band``."""
    rows = []
    for row in published:
        key, value = (row["model"], row["system"]), float(row["value"])
        found = {name: per[key] for name, per in lengths.items() if key in per}
        in_band = {name: found[name] or 0 for name in band if name in found}
        low = min(in_band.values()) if in_band else None
        high = max(in_band.values()) if in_band else None
        closest = min(in_band, key=lambda name: abs(in_band[name] / value - 1)) if in_band else ""
        rows.append({
            "model": row["model"], "system": row["system"], "published": int(value),
            **{f"config:{name}": "" if found.get(name) is None else found[name] for name in lengths},
            "script_default": "" if found.get(script_default) is None else found[script_default],
            "band_low": "" if low is None else low, "band_high": "" if high is None else high,
            "inside_band": "" if low is None else
            str(low <= value < high + max(1, (granularity or {}).get(row["system"], 1))).lower(),
            "closest_config": closest,
            "closest_error": "" if not closest else f"{100 * (in_band[closest] / value - 1):+.0f}",
        })
    return rows


def consistent_configs(rows: list[dict], names: tuple[str, ...], tolerance: float) -> list[str]:
    """The configurations among ``names`` whose simulated length is within ``tolerance`` (relative) of every
    published figure in ``rows`` (rows of `configuration_band`); empty when none is."""
    def ok(name: str, row: dict) -> bool:
        got = row.get(f"config:{name}")
        return got not in ("", None) and abs(float(got) / row["published"] - 1) <= tolerance

    return [name for name in names if rows and all(ok(name, row) for row in rows)]



def outside_evidence(row: dict, results: dict, model, *, capacity_bytes: int) -> str:
    """For a `configuration_band` row whose published figure lies outside the band: the ledger item and the
    simulated evidence that leave it there, read off the band configuration closest to the figure (``results``:
    {config name: `experiments.paper_scale.simulate.MaxLength` of this row's model (``model``, a ``PaperModel``)
    and system}): at the published length (activations linear between the search's probes around it, else its
    nearest probe), the nominal peak against the capacity and its two largest ledger items (the simulated
    activations are one).  Empty inside the band."""
    from simulator.ledger import memory_ledger
    from simulator.max_length import ledger_peak

    name = row.get("closest_config")
    if row.get("inside_band") != "false" or not name or name not in results:
        return ""
    result, published = results[name], row["published"]
    if not result.steps:
        return f"{name}: no simulated step"
    below = [n for n in result.steps if n <= published]
    above = [n for n in result.steps if n >= published]
    if below and above:  # activations between the two probes around the figure, linearly
        lo, hi = max(below), min(above)
        a, b = result.steps[lo].dynamic_memory_bytes, result.steps[hi].dynamic_memory_bytes
        activations = a if hi == lo else a + (b - a) * (published - lo) / (hi - lo)
        where = f"{published} tokens ({'simulated' if hi == lo else f'between its probes at {lo} and {hi}'})"
    else:
        nearest = min(result.steps, key=lambda n: (abs(n - published), n))
        activations, where = result.steps[nearest].dynamic_memory_bytes, f"{nearest} tokens (its probe nearest " \
            f"{published})"
    cfg = training_config(model, row["system"], PUBLIC_CONFIGS[name])
    peak = ledger_peak(cfg, int(activations))
    lines = memory_ledger(cfg, at="backward", activation_bytes=int(activations))
    top = sorted(lines, key=lambda ln: -ln.bytes)[:2]
    verb = "over" if peak > capacity_bytes else "under"
    side = "shorter" if published >= (row["band_high"] or 0) else "longer"
    return (f"every band configuration simulates a {side} maximum; closest {name} at {where}: peak "
            f"{peak / 2**30:.1f} GiB, {abs(peak - capacity_bytes) / 2**30:.1f} GiB {verb} the "
            f"{capacity_bytes / 2**30:.0f} GiB capacity; largest ledger items: "
            + "; ".join(f"{ln.name} {ln.bytes / 2**30:.1f} GiB" for ln in top))


def explain_outside(rows: list[dict], results: dict) -> list[dict]:
    """``rows`` of `configuration_band` with an ``outside_evidence`` column (`outside_evidence`); ``results``:
    {(model, system): {config name: MaxLength}} of the searches behind them, on the paper's cluster."""
    from experiments.models import PAPER_MODELS
    from simulator import Cluster

    capacity = int(Cluster.from_preset(PAPER_CLUSTER).device.memory_bytes)
    return [{**row, "outside_evidence": outside_evidence(row, results.get((row["model"], row["system"]), {}),
                                                         PAPER_MODELS[row["model"]], capacity_bytes=capacity)}
            for row in rows]
