"""ALST's feature breakdown, modelled: how a row of Snowflake's Arctic Long Sequence Training configuration (and of
AutoSP's techniques on the same machine) becomes a simulated step of the whole model: its compile options, trace,
ZeRO rewrite and ledger configuration (`model_step`), and what each sourced correction moves (`cause_effects`).
The rows: `experiments.paper_scale.alst_breakdown`; their longest lengths beside the published ones:
`experiments.paper_scale.alst_longest`; the planner's row: `experiments.paper_scale.alst_planner`; the table:
`experiments.paper_scale.alst_table`.

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

What each correction moves is `cause_effects` (`alst_breakdown.SWITCHES`). Checked and not a cause: DeepSpeed
0.17.0 (what ALST ran) and the 0.19 line the ledger follows allocate the same ZeRO-3 device buffers for a one-dtype
model: one ipg bucket of ``reduce_bucket_size`` (default 5e8 in both ``runtime/zero/config.py``), prefetch 5e7,
persistence threshold 1e5 (deepspeedai/DeepSpeed tag v0.17.0 and commit edaa7221, ``runtime/zero/stage3.py
_setup_for_real_optimizer``: one flat buffer then, one per dtype now).

What differs from ALST's run, named in the table's ``items`` column (`alst_breakdown.ITEMS`), is what a miss is
read against; ``peak_at_published_gib`` is the simulated peak at the published length with its largest ledger
lines (`experiments.paper_scale.alst_longest`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import replace

from experiments.models import PAPER_MODELS, PaperModel
from experiments.paper_scale.alst_breakdown import CLUSTER, MODEL, RANKS, SWITCHES, BreakdownRow
from experiments.paper_scale.fork import CAUSAL_ATTENTION
from experiments.paper_scale.simulate import PLAIN, ModelVariant, TraceCache, trace_workload
from simulator import Cluster, simulate
from simulator.ledger import TrainingConfig
from simulator.max_length import ModelStep, extrapolate_depth, extrapolate_or_trace_full, ledger_peak
from simulator.strategies import WorkloadRecipe
from simulator.training_step import add_training_step, host_optimizer_time_s
from simulator.workload import Workload
from simulator.workload_rewrites import zero3_workload

TRAINING = ModelVariant(attention=CAUSAL_ATTENTION, use_cache=False)
"""How every row's model is traced (a Liger row's with Liger's RMSNorm, `trace_variant`): without a KV cache (ArcticTraining's SFT loss calls ``model(**batch,
use_cache=False)``, ``arctic_training/trainer/sft_trainer.py``; AutoSP's Trainer integration sets
``config.use_cache = False``, autosp/integrations/hf.py) and without a dense [S, S] mask (flash_attention_2, which
ALST ran, gets none; `CAUSAL_ATTENTION`)."""


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
    return model.training_config(
        layers=layers, optimizer="adam", precision="bf16", zero_stage=row.zero_stage, dp_world_size=RANKS,
        nccl_communicators=2 if row.sp_size > 1 else 1, offload_optimizer=row.offload_optimizer)


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

