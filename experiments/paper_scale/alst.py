"""ALST's feature breakdown, simulated: Snowflake's Arctic Long Sequence Training configuration modelled row by row
beside its published figures, then AutoSP's techniques added in turn on the same machine.

Note [ALST's published breakdown and configuration]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Source: Bekman et al., "Arctic Long Sequence Training: Scalable And Efficient Training For Multi-Million Token
Sequences", arXiv 2506.13996v1 (16 June 2025), section 5.4 "Feature Ablations", Table 1 (Llama-3.1-8B-Instruct,
one node of 8x H100 80GB, batch size 1): baseline 32K tokens (iteration 0:00:17, 231.6 TFLOPS); + tiled logits
and loss 160K (0:02:03, 514.4); + Ulysses SP 1.1M (0:09:24, 576.1); + tiled MLP 1.2M (0:11:43, 548.7);
+ activation checkpoint offload instead of tiled MLP 2.4M (0:43:30, 585.8); everything 3.7M (1:47:35, 590.6).
The baseline (section 5.4): DeepSpeed ZeRO stage 3, gradient/activation checkpointing, optimizer states offloaded
to the CPU, ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, Flash Attention 2. Section 5.2: torch
2.8.0.dev20250507, flash_attn 2.7.4, transformers 4.51.3, deepspeed 0.17.0; NVLink-4 inside the node.

Their recipes (GitHub snowflakedb/ArcticTraining, ``projects/sequence-parallelism/``, commit
2771b4b1b9c8cbb54895ccb940dcaa76d33bf7ef): ``run-h100-sp8-llama-8b-no-ulysses-no-liger-no-extras.yml`` (32_000),
``...-no-ulysses-yes-liger-no-extras.yml`` (160_000, ``sequence_parallel_size: 1``; commit 04f192eb),
``...-no-mlp-no-act-offload.yml`` (1_100_000), ``...-yes-mlp.yml`` (1_200_000, ``attn_implementation: sdpa``),
``...-yes-act-offload.yml`` (2_400_000), ``run-h100-sp8-llama-8b.yml`` (3_800_000: the recipe's length, 3.7M in
the paper); every one ``zero_optimization: {stage: 3, offload_optimizer: {device: cpu}}``, ``optimizer: cpu_adam``,
``micro_batch_size: 1``, bf16. The baseline recipe says ``sequence_parallel_size: 8`` at that commit but 1 at
commit 115740a9670853cd482ad76ca9ceffe9ac81849d (``run-sp8-llama-8b-no-ulysses-no-liger-no-extras.yml``) and the
paper's baseline has no Ulysses: modelled with SP 1 (8 ranks, each its own sequence, ZeRO 3 over all 8).
The project README there: H100 80GB nodes, 1.9TB CPU memory.

How each technique is modelled (the trace is this project's AutoSP program of the Hugging Face model on fake
tensors, `experiments.paper_scale.simulate.trace_workload`; nothing is fitted):

* activation checkpointing: ArcticTraining's ``HFModelFactory.post_create_model_callback`` calls
  ``model.gradient_checkpointing_enable()`` (``arctic_training/model/hf_factory.py``): one checkpoint per decoder
  layer, which keeps the layer's input and recomputes the rest, its all-to-alls included: ``checkpointing="layer"``
  (Note [Sequence-aware checkpointing] in autosp/passes/joint/checkpointing.py);
* tiled logits and loss (Liger-Kernel's fused linear cross entropy): ``tiled_loss="on"`` with Liger's chunk,
  ``next_power_of_2(ceil(tokens / ceil(vocab / hidden)))`` tokens of this rank (liger_kernel
  ``ops/fused_linear_cross_entropy.py``), `liger_chunk_tokens`, its memory made Liger's (Note [ALST's kernels]);
* Ulysses SP: ``strategy="ulysses"`` over the 8 ranks, blocking all-to-alls (ALST's are not overlapped);
* tiled MLP: ``tiled_mlp="on"`` with ArcticTraining's shard count ``ceil(tokens / hidden)`` of this rank
  (``arctic_training/model/tiled_compute.py tiled_mlp_forward_common``), `tiled_mlp_chunk_tokens`;
* activation checkpoint offload: ``activation_offload="on"``: under per-layer checkpointing what the forward saves
  is the layers' inputs, which is what ALST's patched ``CheckpointFunction`` sends to the CPU;
* ZeRO 3 with optimizer offload: the ZeRO-3 rewrite of the trace (Note [ZeRO-3 as a rewrite of the single-device
  trace] in simulator/workload_rewrites.py, also over a sequence-parallel trace), DeepSpeed's host copies and CPU
  Adam (Note [Optimizer offload traffic] in simulator/training_step.py) and the ledger's ZeRO-3 offload lines
  (Note [Optimizer offload] in simulator/ledger.py);
* the machine: the ``h100-sxm`` preset (80 GB, 2 TB of host memory per node: 256 GiB per rank).

Note [ALST's kernels]
~~~~~~~~~~~~~~~~~~~~~
ALST ran eagerly: ArcticTraining (commit 2771b4b1) calls ``torch.compile`` nowhere, so what is not a library kernel
is one CUDA kernel per op, each output allocated. Its SFT loss calls ``self.model(**batch, use_cache=False)``
(``arctic_training/trainer/sft_trainer.py``): no KV cache (`TRAINING`). Three kinds of rows follow:

* the baseline (no Liger): Hugging Face's ``LlamaForCausalLM`` as it is, whose loss (``ForCausalLMLoss``) upcasts
  the [tokens, vocab] logits to fp32 before cross entropy, and whose backward allocates the fp32 gradient of the
  log-softmax and of the upcast: ``eager=True``, simulated on the device without fused pointwise kernels
  (`row_cluster`; :mod:`simulator.fusion` prices Inductor's fusion, which ALST did not run);
* the rows with ``model.type: liger`` (`BreakdownRow.liger`): ``AutoLigerKernelForCausalLM``
  (``arctic_training/model/liger_factory.py``) patches Llama with Liger's RoPE, RMSNorm, SwiGLU (not with the
  tiled MLP) and fused linear cross entropy (``apply_liger_kernel_to_llama`` defaults, linkedin/Liger-Kernel
  ``src/liger_kernel/transformers/monkey_patch.py``, commit 05b43a14): fused kernels, so these rows are simulated
  with fusion; the RMSNorm is traced with Liger's saved tensors (Note [Liger's RMSNorm in a trace] in
  experiments/paper_scale/liger.py) and the loss's memory is Liger's (`liger_loss_workload`): the forward forms
  the gradient in place in one bf16 [chunk, vocab] logits block and allocates the [tokens, hidden] and
  [vocab, hidden] gradients it returns in backward (``fused_linear_cross_entropy_forward``), where AutoSP's op
  holds two fp32 [chunk, vocab] buffers, recomputes its forward under layer checkpointing and sums the weight's
  gradient in fp32;
* AutoSP's rows: torch.compile, fused.

What each correction moves is `cause_effects` (:data:`SWITCHES`). Checked and not a cause: DeepSpeed 0.17.0 (what
ALST ran) and the 0.19 line the ledger follows allocate the same ZeRO-3 device buffers for a one-dtype model: one
ipg bucket of ``reduce_bucket_size`` (default 5e8 in both ``runtime/zero/config.py``), prefetch 5e7, persistence
threshold 1e5 (deepspeedai/DeepSpeed tag v0.17.0 and commit edaa7221, ``runtime/zero/stage3.py
_setup_for_real_optimizer``: one flat buffer then, one per dtype now).

What differs from ALST's run, named in the table's ``items`` column (:data:`ITEMS`), is what a miss is read
against; ``peak_at_published_gib`` is the simulated peak at the published length with its largest ledger lines.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import pathlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from experiments.models import PAPER_MODELS, PaperModel
from experiments.paper_scale.fork import CAUSAL_ATTENTION
from experiments.paper_scale.simulate import PLAIN, ModelVariant, TraceCache, trace_workload
from simulator import Cluster, simulate
from simulator.ledger import TrainingConfig, memory_ledger
from simulator.max_length import (
    ModelStep,
    extrapolate_depth,
    extrapolate_or_trace_full,
    ledger_host_peak,
    ledger_peak,
)
from simulator.max_length import max_length as search_max_length
from simulator.strategies import WorkloadRecipe
from simulator.training_step import add_training_step, host_optimizer_time_s
from simulator.workload import Workload
from simulator.workload_rewrites import zero3_workload

log = logging.getLogger(__name__)

MODEL = "llama-3.1-8b"
CLUSTER = "h100-sxm"
RANKS = 8
PAPER = "arXiv 2506.13996v1 section 5.4 Table 1"
RECIPES = "snowflakedb/ArcticTraining projects/sequence-parallelism (commit 2771b4b1b9c8cbb54895ccb940dcaa76d33bf7ef)"
TRAINING = ModelVariant(attention=CAUSAL_ATTENTION, use_cache=False)
"""How every row's model is traced (a Liger row's with Liger's RMSNorm, `trace_variant`): without a KV cache (ArcticTraining's SFT loss calls ``model(**batch,
use_cache=False)``, ``arctic_training/trainer/sft_trainer.py``; AutoSP's Trainer integration sets
``config.use_cache = False``, autosp/integrations/hf.py) and without a dense [S, S] mask (flash_attention_2, which
ALST ran, gets none; `CAUSAL_ATTENTION`)."""
TOLERANCE = 0.20
"""The reproduction's acceptance: simulated within +-20 % of the published length (issue 20)."""

ITEMS: dict[str, str] = {
    "liger-loss": "the tiled loss's memory is Liger's fused linear cross entropy (`liger_loss_workload`), its time "
                  "AutoSP's op (the forward recomputed in backward, the logits recomputed for the gradient): Liger "
                  "forms the gradient in the forward and recomputes nothing",
    "liger-rms-norm": "the trace's RMSNorm keeps a bf16 normalised copy of its input for the weight's gradient, "
                      "which Liger's kernel recomputes (Note [Liger's RMSNorm in a trace] in "
                      "experiments/paper_scale/liger.py)",
    "eager-non-liger": "a Liger row is simulated with fused pointwise kernels; ALST ran the ops Liger does not "
                       "replace (residual adds, the attention's and Ulysses' copies) eagerly, each output allocated; "
                       "sized as the whole row run unfused, a bound (it unfuses Liger's kernels too)",
    "fragmentation": "the ledger's allocator fragmentation (simulator/device_reserve.py, fragmentation_fraction) is "
                     "the default caching allocator's; ALST ran expandable_segments:True, which fragments less",
    "zero3-gathers": "the ZeRO-3 rewrite keeps each gathered layer until its last read and prefetches one module "
                     "ahead; DeepSpeed's max_live_parameters/max_reuse_distance and the ledger's prefetch line "
                     "are not reconciled (Note [ZeRO-3 as a rewrite of the single-device trace])",
    "attention-kernel": "the trace runs SDPA's fused kernel with GQA (K/V not repeated); ALST ran flash_attn 2.7.4, "
                        "which keeps the same output and log-sum-exp for the backward, except in the tiled-MLP "
                        "recipe (attn_implementation: sdpa), where transformers repeats K/V to every query head "
                        "before SDPA (sized in the miss_item column)",
    "last-layer-on-device": "AutoSP's offload keeps the activations the backward reads before its first attention "
                            "(the last layer's) on the device; ALST offloads every checkpointed layer input",
    "host-memory": "host memory is the h100-sxm preset's 2 TiB per node (256 GiB per rank); ALST's node had 1.9TB",
    "published-is-a-run": "the published figure is a length ALST ran, not a searched maximum (commented-out lengths "
                          "in an earlier recipe, commit 115740a9, mark 2.5M 'close to oom' and 3M 'oom'): the true "
                          "maximum is at or above it",
    "planner-depth": "the planner's own depth under every preset, as autosp.compile decides: extrapolated from 1- "
                     "and 2-layer traces with SAC deciding as for the full model (Note [Shallow traces checkpointed "
                     "for the full depth] in autosp/plan/depth.py), offload "
                     "plans unrolled from a 6-layer trace (simulator/depth_unroll.py); its own ZeRO 1 or 2 ledger, not "
                     "the ZeRO-3 rewrite",
    "depth-extrapolated": "depth extrapolated from 2- and 3-layer traces (`DEPTHS`; Note [Depth extrapolation] in "
                          "simulator/max_length.py): exact in the depth for per-layer checkpointing, not for SAC",
}


@dataclass(frozen=True, kw_only=True)
class BreakdownRow:
    """One row of the breakdown: a training configuration on 8 H100s and, for ALST's, its published figure."""

    name: str
    system: str
    """``alst`` (ALST's configuration as modelled) or ``autosp`` (AutoSP's techniques)."""
    sp_size: int
    checkpointing: str
    tiled_loss: bool = False
    tiled_mlp: bool = False
    offload: bool = False
    zero_stage: int = 3
    offload_optimizer: bool = True
    """DeepSpeed's optimizer offload (CPU Adam), as every ALST recipe ran; the AutoSP paper's rows run without."""
    chunks: str = "alst"
    """``alst``: the tiled loss and MLP chunk as Liger and ArcticTraining do; ``autosp``: AutoSP's defaults."""
    overlap: bool = False
    attention: str = "flash_attention_2"
    """The recipe's ``attn_implementation`` (the trace runs SDPA's fused kernel either way; `miss_items`)."""
    eager: bool = False
    """Pointwise ops run one kernel each (no torch.compile, no Liger kernels), not fused (Note [ALST's kernels])."""
    switched: frozenset[str] = frozenset()
    """Keys of :data:`SWITCHES`: what this row models as it was modelled before a sourced fact corrected it (to
    measure what each correction moves, `cause_effects`); empty in the table."""
    published_tokens: int | None = None
    published_iteration_s: float | None = None
    published_tflops: float | None = None
    source: str = ""
    items: tuple[str, ...] = ()
    """Keys of :data:`ITEMS`: how this row's model differs from ALST's run."""

    @property
    def liger(self) -> bool:
        """ALST's model with Liger's kernels (``model.type: liger`` in every recipe with the tiled loss): Liger's
        fused linear cross entropy and RMSNorm (Note [ALST's kernels])."""
        return self.system == "alst" and self.tiled_loss and self.chunks == "alst"


_COMMON = ("fragmentation", "zero3-gathers", "attention-kernel", "published-is-a-run")
_LIGER = ("liger-loss", "liger-rms-norm", "eager-non-liger", *_COMMON)
ALST_ROWS: tuple[BreakdownRow, ...] = (
    BreakdownRow(name="baseline", system="alst", sp_size=1, checkpointing="layer", eager=True, published_tokens=32_000,
                 published_iteration_s=17, published_tflops=231.6,
                 source=f"{PAPER} row 1; recipe run-h100-sp8-llama-8b-no-ulysses-no-liger-no-extras.yml",
                 items=_COMMON),
    BreakdownRow(name="+ tiled logits & loss", system="alst", sp_size=1, checkpointing="layer", tiled_loss=True,
                 published_tokens=160_000, published_iteration_s=123, published_tflops=514.4,
                 source=f"{PAPER} row 2; recipe ...-no-ulysses-yes-liger-no-extras.yml (commit 04f192eb)",
                 items=_LIGER),
    BreakdownRow(name="+ Ulysses SP 8", system="alst", sp_size=8, checkpointing="layer", tiled_loss=True,
                 published_tokens=1_100_000, published_iteration_s=564, published_tflops=576.1,
                 source=f"{PAPER} row 3; recipe ...-no-mlp-no-act-offload.yml", items=_LIGER),
    BreakdownRow(name="+ tiled MLP", system="alst", sp_size=8, checkpointing="layer", tiled_loss=True,
                 tiled_mlp=True, attention="sdpa", published_tokens=1_200_000, published_iteration_s=703,
                 published_tflops=548.7,
                 source=f"{PAPER} row 4; recipe ...-yes-mlp.yml", items=_LIGER),
    BreakdownRow(name="+ act. offload (no tiled MLP)", system="alst", sp_size=8, checkpointing="layer",
                 tiled_loss=True, offload=True, published_tokens=2_400_000, published_iteration_s=2610,
                 published_tflops=585.8, source=f"{PAPER} row 5; recipe ...-yes-act-offload.yml",
                 items=("last-layer-on-device", "host-memory", *_LIGER)),
    BreakdownRow(name="everything", system="alst", sp_size=8, checkpointing="layer", tiled_loss=True,
                 tiled_mlp=True, offload=True, published_tokens=3_700_000, published_iteration_s=6455,
                 published_tflops=590.6, source=f"{PAPER} row 6; recipe run-h100-sp8-llama-8b.yml (max_length "
                 "3_800_000; the published TFLOPS match 3.8M tokens, `tflops_per_gpu`)", items=("last-layer-on-device", "host-memory", *_LIGER)),
)
"""ALST's Table 1, each row its configuration as modelled (Note [ALST's published breakdown and configuration])."""

AUTOSP_ROWS: tuple[BreakdownRow, ...] = (
    BreakdownRow(name="AutoSP SAC", system="autosp", sp_size=8, checkpointing="sac", chunks="autosp", overlap=True),
    BreakdownRow(name="+ tiled loss", system="autosp", sp_size=8, checkpointing="sac", tiled_loss=True,
                 chunks="autosp", overlap=True),
    BreakdownRow(name="+ tiled MLP", system="autosp", sp_size=8, checkpointing="sac", tiled_loss=True,
                 tiled_mlp=True, chunks="autosp", overlap=True),
    BreakdownRow(name="+ activation offload", system="autosp", sp_size=8, checkpointing="sac", tiled_loss=True,
                 tiled_mlp=True, offload=True, chunks="autosp", overlap=True),
    BreakdownRow(name="all, per-layer checkpointing", system="autosp", sp_size=8, checkpointing="layer",
                 tiled_loss=True, tiled_mlp=True, offload=True, chunks="autosp", overlap=True),
)
"""AutoSP's techniques added in turn on ALST's machine and ZeRO setting (ZeRO 3, optimizer offload): Ulysses SP 8
with overlapped all-to-alls and AutoSP's own chunk sizes. AutoSP does not compose with ZeRO 3 today (DeepSpeed's
AutoSP backend refuses it): these rows price the AutoSP program under ALST's ZeRO setting, so that only the
techniques differ; `autosp_zero2_row` is what AutoSP runs today."""


def autosp_zero2_row() -> BreakdownRow:
    """Every AutoSP technique under ZeRO 2 with optimizer offload, the configuration AutoSP composes with today."""
    return replace(AUTOSP_ROWS[3], name="all, ZeRO 2 + optimizer offload", zero_stage=2)


def liger_chunk_tokens(tokens: int, hidden: int, vocab: int) -> int:
    """Liger-Kernel's fused linear cross-entropy chunk: ``next_power_of_2(ceil(tokens / ceil(vocab / hidden)))``
    (liger_kernel ops/fused_linear_cross_entropy.py), at most ``tokens``."""
    return min(tokens, 1 << max(0, math.ceil(math.log2(-(-tokens // -(-vocab // hidden))))))


def tiled_mlp_chunk_tokens(tokens: int, hidden: int) -> int:
    """ArcticTraining's TiledMLP chunk: ``ceil(tokens / hidden)`` shards of this rank's tokens
    (arctic_training/model/tiled_compute.py tiled_mlp_forward_common)."""
    return -(-tokens // -(-tokens // hidden))


def compile_options(row: BreakdownRow, seq_len: int, model: PaperModel) -> dict:
    """The `autosp.compile` options the row's step is traced with at ``seq_len`` tokens."""
    local = seq_len // row.sp_size
    options: dict = {"checkpointing": row.checkpointing, "overlap_communication": row.overlap}
    if row.sp_size > 1:
        options["strategy"] = "ulysses"
    if row.tiled_loss:
        options.update(tiled_loss="on", return_logits=False)
        if row.chunks == "alst":
            options["loss_chunk_tokens"] = liger_chunk_tokens(local, model.hidden_size, model.vocab_size)
    if row.tiled_mlp:
        options["tiled_mlp"] = "on"
        if row.chunks == "alst":
            options["mlp_chunk_tokens"] = tiled_mlp_chunk_tokens(local, model.hidden_size)
    if row.offload:
        options["activation_offload"] = "on"
    return options


def training_config(row: BreakdownRow, model: PaperModel, layers: int | None = None) -> TrainingConfig:
    """The ledger's configuration of ``row`` (``layers``: the depth of a traced step; None: the whole model): bf16,
    Adam, ZeRO over all 8 ranks, the optimizer offloaded to the CPU where the row says so."""
    return TrainingConfig.for_llama(
        hidden=model.hidden_size, ffn_hidden=model.intermediate_size, layers=layers or model.num_layers,
        heads=model.num_heads, kv_heads=model.num_kv_heads, vocab=model.vocab_size,
        tied_embeddings=model.tie_word_embeddings, optimizer="adam", precision="bf16", zero_stage=row.zero_stage,
        dp_world_size=RANKS, nccl_communicators=2 if row.sp_size > 1 else 1,
        offload_optimizer=row.offload_optimizer)


def liger_loss_workload(workload: Workload, *, chunk_tokens: int, vocab: int) -> Workload:
    """``workload`` with the memory of its tiled loss made Liger's fused linear cross entropy (Note [ALST's
    kernels]): the forward holds one bf16 ``[chunk, vocab]`` logits block (the gradient is formed in place) and
    allocates the gradients of the hidden states and of the output weight that the backward returns; the
    backward and a recomputed forward allocate no workspace."""
    def rewrite(program):
        ops = list(program.ops)
        tensors = dict(program.tensors)
        forward = next((i for i, op in enumerate(ops) if op.name == "forward.linear_cross_entropy"), None)
        backward = next((i for i, op in enumerate(ops) if op.name == "backward.linear_cross_entropy_backward"), None)
        if forward is None or backward is None:
            raise ValueError(f"{workload.name}: no tiled loss to price as Liger's")
        for i, op in enumerate(ops):
            if op.name in ("forward.linear_cross_entropy", "backward.linear_cross_entropy",
                           "backward.linear_cross_entropy_backward"):
                for t in set(op.allocates) & set(op.frees):  # the op's own workspace
                    tensors[t] = 2 * chunk_tokens * vocab if i == forward else 0
        returned = tuple(t for t in ops[backward].allocates if t not in ops[backward].frees)
        ops[backward] = replace(ops[backward], allocates=tuple(t for t in ops[backward].allocates
                                                               if t not in returned))
        ops[forward] = replace(ops[forward], allocates=ops[forward].allocates + returned)
        return replace(program, ops=tuple(ops), tensors=tensors)

    return replace(workload, ranks={r: rewrite(p) for r, p in workload.ranks.items()})


def trace_variant(row: BreakdownRow) -> ModelVariant:
    """How ``row``'s model is traced: `TRAINING`, with Liger's RMSNorm in a Liger row."""
    variant = PLAIN if "kv-cache" in row.switched else TRAINING
    return replace(variant, rms_norm="liger") if row.liger and "hf-rms-norm" not in row.switched else variant


def row_cluster(row: BreakdownRow, cluster: Cluster) -> Cluster:
    """The machine as ``row`` runs on it: ``cluster``, or for an eager row its device without fused pointwise
    kernels (Note [ALST's kernels])."""
    if not row.eager or "fused-baseline" in row.switched:
        return cluster
    preset = dataclasses.replace(cluster.preset, device=dataclasses.replace(cluster.preset.device,
                                                                         fuses_pointwise=False))
    return Cluster.from_preset(preset, nodes=cluster.nodes, devices_per_node=cluster.devices_per_node,
                               network=cluster.network, all_to_all=cluster.all_to_all)


def step_at_depth(row: BreakdownRow, seq_len: int, layers: int, *, model: PaperModel, cluster: Cluster,
                  cache: TraceCache | None = None) -> tuple[float, int, int]:
    """(simulated step time, device peak above static memory, host peak) of ``layers`` layers of ``row`` at
    ``seq_len`` tokens: the trace, ZeRO's rewrite or gradient step with optimizer offload, simulated."""
    options = compile_options(row, seq_len, model)
    traced = trace_workload(model, seq_len, layers, sp_size=row.sp_size, autosp_options=options, cache=cache,
                            variant=trace_variant(row))
    workload = traced.workload
    if row.liger and "autosp-loss" not in row.switched:
        workload = liger_loss_workload(workload, chunk_tokens=options["loss_chunk_tokens"], vocab=model.vocab_size)
    cfg = training_config(row, model, layers)
    if row.zero_stage == 3:
        workload = zero3_workload(workload, traced.modules, world_size=RANKS)
        workload = add_training_step(workload, [], cfg, group="dp_reduce")
    else:
        workload = WorkloadRecipe(trace_sequence_parallel=True).build(workload, traced.modules, cfg)
    result = simulate(workload, row_cluster(row, cluster))
    dynamic = max(r.peak_memory_bytes - r.static_memory_bytes for r in result.ranks)
    return result.step_time_s, dynamic, result.host_peak_memory_bytes


DEPTHS = (2, 3)
"""The depths a step is extrapolated from (Note [Depth extrapolation] in simulator/max_length.py).  Not 1 and 2:
under ZeRO 3 the backward of the last layer holds its own gathered parameters and the next layer's, prefetched
(Note [ZeRO-3 as a rewrite of the single-device trace]); one layer has no next layer, so a line through 1 and 2
layers adds a gathered layer per layer (0.41 GiB each for Llama-3.1-8B: 12 GiB at 32 layers) where 32 layers hold
two.  From 2 layers on each layer adds only its checkpointed input."""


def model_step(row: BreakdownRow, seq_len: int, *, model: PaperModel, cluster: Cluster, layers: str = "extrapolated",
               cache: TraceCache | None = None) -> ModelStep:
    """The whole model's step of ``row`` at ``seq_len``: traced at full depth or extrapolated from `DEPTHS`
    (Note [Depth extrapolation] in simulator/max_length.py), plus the CPU Adam step of optimizer offload."""

    @functools.cache
    def at(depth: int) -> tuple[float, int, int]:
        return step_at_depth(row, seq_len, depth, model=model, cluster=cluster, cache=cache)

    depths = (model.num_layers, model.num_layers) if layers == "full" else (
        (1, 2) if "depths-1-2" in row.switched else DEPTHS)
    time_s, dynamic, depths = extrapolate_or_trace_full(lambda d: at(d)[:2], model.num_layers, depths,
                                                        what=f"{row.name} at {seq_len} tokens")
    _, host = extrapolate_depth(lambda d: (0.0, at(d)[2]), model.num_layers, depths)
    return ModelStep(seq_len=seq_len, step_time_s=time_s + host_optimizer_time_s(training_config(row, model)),
                     dynamic_memory_bytes=dynamic, host_dynamic_memory_bytes=host,
                     extrapolated_from=None if depths[0] == depths[1] else depths)


SWITCHES: dict[str, str] = {
    "kv-cache": "traced with transformers' default use_cache=True: every layer's keys and values kept in a "
                "DynamicCache to the end of the step (ALST calls the model with use_cache=False)",
    "depths-1-2": "depth extrapolated from 1 and 2 layers: the prefetched gathered layer counted once per layer "
                  "(`DEPTHS`)",
    "autosp-loss": "AutoSP's tiled loss: two fp32 [chunk, vocab] buffers, the forward recomputed in backward and "
                   "an fp32 [vocab, hidden] weight-gradient accumulator, in place of Liger's bf16 chunk",
    "hf-rms-norm": "transformers' LlamaRMSNorm in place of Liger's: autograd keeps the fp32 copy of its input",
    "fused-baseline": "the baseline's pointwise ops fused as Inductor would (the fp32 logits copy and the loss "
                      "backward's [tokens, vocab] intermediates never allocated); ALST ran it eagerly",
}
"""What a row modelled before a sourced correction (:attr:`BreakdownRow.switched`), to measure each correction."""


def switch_applies(row: BreakdownRow, key: str) -> bool:
    """Whether switching ``key`` changes ``row``."""
    return {"autosp-loss": row.liger, "hf-rms-norm": row.liger, "fused-baseline": row.eager}.get(key, True)


def cause_effects(row: BreakdownRow, *, model: PaperModel | None = None, cluster: str = CLUSTER,
                  cache: TraceCache | None = None, keys: Sequence[str] = tuple(SWITCHES)) -> list[dict]:
    """Each correction of :data:`SWITCHES` that applies to ``row``, switched back one at a time: the simulated
    peak at the published length as modelled and switched, and the length it moves, estimated from the modelled
    row's peak per token between the published length and 90 % of it (one probe each, not a search)."""
    model = model or PAPER_MODELS[MODEL]
    machine = Cluster.from_preset(cluster)
    cfg = training_config(row, model)
    published = row.published_tokens - row.published_tokens % row.sp_size
    shorter = int(published * 0.9) - int(published * 0.9) % row.sp_size

    def peak(r: BreakdownRow, seq_len: int) -> int:
        return ledger_peak(cfg, model_step(r, seq_len, model=model, cluster=machine, cache=cache).dynamic_memory_bytes)

    base = peak(row, published)
    per_token = (base - peak(row, shorter)) / (published - shorter)
    out = []
    for key in keys:
        if not switch_applies(row, key):
            continue
        switched = peak(replace(row, switched=frozenset({key})), published)
        moved = (base - switched) / per_token
        out.append({"row": row.name, "switch": key, "peak_gib": round(base / 2**30, 2),
                    "switched_peak_gib": round(switched / 2**30, 2), "delta_gib": round((switched - base) / 2**30, 2),
                    "tokens_moved": int(moved), "pct_of_published": round(100 * moved / row.published_tokens, 1)})
    return out


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
        head_dim = model.hidden_size // model.num_heads
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


# Note [Narrowing the longest search]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A peak grows with the length, so only a plan that fits at a length L can train longer than L, and the longest
# search over the plans that fit at L gives the answer of the search over every candidate.  At ALST's 3.7M one plan
# of 48 fits.  At a short published length (the AutoSP paper's 45,000 tokens on A100s) every plan fits, and 48
# longest searches of an 8B model take most of an hour; fastest decisions (one length each) at 2L, 4L, ... narrow
# the plans to at most `NARROWED` (or to those of the last length where any fits) first.

NARROWED = 4
"""The most plans the planner row's longest search runs over when doubling the length can narrow them further
(`planner_row`'s default)."""


def fitting_plans(report) -> list:
    """The plans of a fastest decision that fit: those predicted to fit, and the offload plans not predicted because
    their twins fit (Note [Offload only where it is needed] in autosp/plan/planner.py), which fit as well."""
    from autosp.plan.planner import NEEDLESS_OFFLOAD

    return [c.plan for c in report.candidates if c.fits or c.refused == NEEDLESS_OFFLOAD]


def _over(fitting: Sequence, narrowed: Sequence, fit_at: int) -> str:
    """What the planner row's longest search ran over, for its source column."""
    if not fitting:
        return "over every candidate"
    if narrowed is fitting:
        return "over those"
    return f"over the {len(narrowed)} of those that fit at {fit_at:,} tokens (Note [Narrowing the longest search])"


PLANNER_ROW = "planner: memory_plan='auto', DeepSpeed setup chosen"
"""The planner row: no AutoSP setting, and the DeepSpeed setup (ZeRO 1 or 2, optimizer offload) chosen by the
planner as well (`autosp.plan.plan_job`); AutoSP composes with ZeRO 2, not with ALST's ZeRO 3."""


def _tried(report) -> str:
    """", with no plan under ZeRO 1 and ZeRO 2" when `plan_job` passed over setups before the one it chose."""
    from autosp.plan.planner import job_name

    before = [job_name(j) for j in report.jobs_without_plan]
    return f", with no plan under {' and '.join(before)}" if before else ""


def planner_row(*, model: PaperModel, cluster: str = CLUSTER, search: Search | None = None,
                plans: Sequence | None = None, seq_len: int | None = None,
                beside: BreakdownRow | None = None, items: tuple[str, ...] = ("host-memory",),
                narrow_to: int = NARROWED) -> dict:
    """AutoSP's memory planner on ``cluster`` (ALST's machine unless given) with no AutoSP setting
    (`autosp.plan.plan_memory`, the code ``autosp.compile(memory_plan="auto")`` runs; every candidate of
    `autosp.plan.candidates_for`, or ``plans``): objective ``fastest`` at the published length of ``beside``
    (ALST's longest row unless given; or ``seq_len``; its step beside the published iteration there) and
    objective ``longest`` from there (``items``: the keys of the table's items the row is read against, with
    ``planner-depth`` added; ``narrow_to``: Note [Narrowing the longest search]) (the longest length, its plan and
    step; over the plans that fit at ``seq_len`` when any does, since no other can train longer).  The planner
    predicts at its own depth (`autosp.plan.setup.DECIDING_DEPTH`) whatever depth the table's other rows take:
    the row is what ``autosp.compile`` decides, and the technique row with the same options checks its choice at the
    table's depth.  The model is traced as ALST
    calls it (no KV cache) from ``model``'s config; the DeepSpeed setup the first decision chose (`plan_job`: the
    first of ZeRO 1, ZeRO 2, ZeRO 2 with optimizer offload under which a plan fits), kept for the second."""
    import json
    import tempfile

    from autosp.plan import TrainingSetup, load_cluster, plan_job, plan_memory
    from autosp.plan.planner import job_name
    from autosp.plan.setup import DECIDING_DEPTH

    everything = beside or ALST_ROWS[-1]
    at = seq_len or everything.published_tokens - everything.published_tokens % RANKS
    search = search or default_search(AUTOSP_ROWS[0])
    setup = TrainingSetup(seq_len=at, sp_size=RANKS)  # depth None: the planner's own, DECIDING_DEPTH
    machine = load_cluster(cluster, world_size=RANKS)
    config = json.loads(model.hf_config().to_json_string(use_diff=False))
    config.update(use_cache=False)  # as ALST calls the model (`TRAINING`)
    with tempfile.TemporaryDirectory(prefix="alst-planner-") as folder:
        path = pathlib.Path(folder, "config.json")
        path.write_text(json.dumps(config))
        fastest = plan_job(str(path), setup, machine, objective="fastest", plans=plans)
        setup = replace(setup, **fastest.job)
        # Only a plan that fits at ``at`` can train longer than ``at`` (a peak grows with the length), so when one
        # fits the longest search needs those alone: the same answer as over every candidate, for a fraction of
        # the time (each candidate's search traces or re-sizes up to max_probes lengths of an 8B model).  An offload
        # plan the fastest decision did not predict because its twin fits (Note [Offload only where it is needed] in
        # autosp/plan/planner.py) is searched too: it may train longer than its twin.
        fitting = fitting_plans(fastest)
        narrowed, fit_at = fitting, at
        # Where many fit (a short published length), the same argument at doubled lengths narrows them to at most
        # ``narrow_to`` before the longest search, which is the expensive part (Note [Narrowing the longest search]).
        while len(narrowed) > narrow_to and 2 * fit_at <= search.high:
            longer = fitting_plans(plan_memory(str(path), replace(setup, seq_len=2 * fit_at), machine,
                                               objective="fastest", plans=narrowed))
            if not longer:
                break
            narrowed, fit_at = longer, 2 * fit_at
        longest = plan_memory(str(path), replace(setup, seq_len=fit_at), machine, objective="longest",
                              plans=narrowed or plans, granularity=search.granularity, max_length_high=search.high,
                              max_probes=search.max_probes)
    out = table_row(system="autosp", row=PLANNER_ROW, sp_size=RANKS, zero_stage=setup.zero_stage,
               published_tokens=everything.published_tokens, published_iteration_s=everything.published_iteration_s or "",
               published_tflops=everything.published_tflops or "", depth=DECIDING_DEPTH,
               items=" ".join(items + ("planner-depth",)),
               source=f"autosp.plan.plan_job, {len(fastest.candidates)} candidates: objective fastest at {at:,} "
                      f"tokens chose {_chosen_name(fastest)} ({len(fitting)} fit) under {job_name(fastest.job)}"
                      f"{_tried(fastest)}; objective longest "
                      f"({_over(fitting, narrowed, fit_at)}) chose {_chosen_name(longest)}")
    if fastest.chosen is not None:
        chosen = fastest.candidates[fastest.chosen].prediction
        out.update(peak_at_published_gib=round(chosen.peak_bytes / 2**30, 1),
                   simulated_step_at_published_s=figures(chosen.step.step_time_s))
    if longest.chosen is not None:
        chosen = longest.candidates[longest.chosen]
        options, found = chosen.plan.options, chosen.prediction.max_length
        best = found["max_seq_len"]
        out.update(checkpointing=options.get("checkpointing", "sac"), tiled_loss=options.get("tiled_loss") == "on",
                   tiled_mlp=options.get("tiled_mlp") == "on", activation_offload=options.get("activation_offload") == "on",
                   simulated_tokens=best, band_tokens=" - ".join(found["band"]), stopped=found["stopped"],
                   simulated_step_s=figures(found["step_time_s"]),
                   simulated_tflops=figures(tflops_per_gpu(best, found["step_time_s"], RANKS, model)),
                   host_peak_gib=round((found["host_peak_bytes"] or 0) / 2**30, 1))
    log.info("autosp %s: %s tokens (fastest at %s: %s)", PLANNER_ROW, out["simulated_tokens"], at,
             out["simulated_step_at_published_s"])
    return out


def _chosen_name(report) -> str:
    return report.candidates[report.chosen].plan.name if report.chosen is not None else "nothing (none fits)"


def alst_rows(**settings) -> list[dict]:
    """Every row of `row_tasks` (the same ``settings``), in order."""
    return [task() for _, task in row_tasks(**settings)]


def row_tasks(*, layers: str = "extrapolated", cache: TraceCache | None = None,
              rows: Sequence[BreakdownRow] | None = None, searches: Mapping[str, Search] | None = None,
              cluster: str = CLUSTER, model: PaperModel | None = None,
              planner: bool | None = None) -> list[tuple[str, Callable[[], dict]]]:
    """The breakdown table as (row name, call that returns the row) pairs, in order, for a caller that runs them
    one at a time (progress): ALST's rows (:data:`ALST_ROWS`) then AutoSP's (:data:`AUTOSP_ROWS` and
    `autosp_zero2_row`), or ``rows``, then the planner's (`planner_row`; ``planner``: default only without
    ``rows``); ``searches`` overrides a row's search settings by row name; ``layers``:
    ``full`` or ``extrapolated`` depth (Note [Depth extrapolation] in simulator/max_length.py); ``model``:
    Llama-3.1-8B unless given (tests pass a small one)."""
    model = model or PAPER_MODELS[MODEL]
    cache = cache if cache is not None else TraceCache(interpolate_lengths=True)
    machine = Cluster.from_preset(cluster)
    chosen = rows if rows is not None else (*ALST_ROWS, *AUTOSP_ROWS, autosp_zero2_row())
    tasks = [(f"{row.system}: {row.name}", functools.partial(row_result, row, model=model, cluster=machine,
                                                             layers=layers, cache=cache,
                                                             search=(searches or {}).get(row.name)))
             for row in chosen]
    if planner is None:
        planner = rows is None
    if planner:
        tasks.append((PLANNER_ROW, functools.partial(planner_row, model=model, cluster=cluster,
                                                     search=(searches or {}).get(PLANNER_ROW))))
    return tasks


def footer(rows: Sequence[dict]) -> list[str]:
    """The table's footer: the reproduction's verdict, the items its misses are read against, what AutoSP adds."""
    alst = [r for r in rows if r["system"] == "alst" and r["error_pct"] != ""]
    inside = sum(1 for r in alst if r["within_tolerance"] is True)
    lines = [f"ALST's configuration reproduced within +-{TOLERANCE:.0%} on {inside} of {len(alst)} published "
             f"lengths ({PAPER}; recipes: {RECIPES}); nothing fitted (Note [ALST's published breakdown and "
             "configuration] in experiments/paper_scale/alst.py)."]
    for r in alst:
        if r["within_tolerance"] is not True:
            found = f"{r['simulated_tokens']:,}" if r["simulated_tokens"] else "nothing fits"
            lines.append(f"- miss: {r['row']}: {found} vs {r['published_tokens']:,} "
                         f"({r['error_pct']} %); peak at the published length {r['peak_at_published_gib']} GiB "
                         f"(largest ledger lines, GiB: {r['largest_ledger_lines_gib']}); explained by "
                         f"{r['miss_item'] or 'nothing sized'}; items: {r['items']}")
    used = sorted({item for r in rows for item in str(r["items"]).split()})
    lines += ["", "Items (what the model of a row differs in from ALST's run):"]
    lines += [f"- {key}: {ITEMS[key]}" for key in used]
    best = {r["system"]: max((int(x["simulated_tokens"] or 0) for x in rows if x["system"] == r["system"]), default=0)
            for r in rows}
    if best.get("autosp") and best.get("alst"):
        lines += ["", f"Longest simulated: ALST's configuration {best['alst']:,} tokens, AutoSP's techniques "
                  f"{best['autosp']:,} ({best['autosp'] / best['alst']:.2f}x). AutoSP rows at ZeRO 3 price the AutoSP "
                  "program under ALST's ZeRO setting (AutoSP refuses ZeRO 3 today); the ZeRO 2 row is what it runs."]
    for r in rows:
        if r["row"] == PLANNER_ROW:
            lines += ["", "The planner (no AutoSP or DeepSpeed setting): "
                      f"{r['source']}. Step at the published length: "
                      f"{r['simulated_step_at_published_s'] or 'does not fit'} s simulated against "
                      f"{r['published_iteration_s']} s published; longest {planner_longest(r)}."]
    return lines


def planner_longest(row: dict) -> str:
    """The planner row's longest length for a footer, beside the published length it planned at.  The row has no
    ``error_pct``: it reproduces no published run, and its length over the published one is a gain."""
    if not row["simulated_tokens"]:
        return "nothing fits"
    return (f"{row['simulated_tokens']:,} tokens, {row['simulated_tokens'] / row['published_tokens']:.2f}x the "
            f"published {row['published_tokens']:,}")


def plot_alst(rows: Sequence[dict], path: pathlib.Path) -> None:
    """Published and simulated longest lengths per row (log scale)."""
    plot_lengths(rows, path, published="published (ALST)",
                 title="Llama-3.1-8B on 8x H100-80GB: ALST's breakdown and AutoSP's techniques")


def plot_lengths(rows: Sequence[dict], path: pathlib.Path, *, published: str, title: str) -> None:
    """A breakdown table's published (labelled ``published``) and simulated longest lengths per row, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    names = [f"{r['system']}: {r['row']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [float(r["published_tokens"] or 0) for r in rows], 0.4, label=published)
    ax.bar([i + 0.2 for i in x], [float(r["simulated_tokens"] or 0) for r in rows], 0.4, label="simulated",
           color="white", edgecolor="C1", hatch="//")
    ax.set_yscale("log")
    ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("longest trainable sequence (tokens)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
