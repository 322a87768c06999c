"""The rows of ALST's feature breakdown, as data: ALST's published rows (figures, recipes, sources), AutoSP's
technique rows beside them on the same machine, and the vocabularies a row is read with (:data:`ITEMS`, what its
model differs in from ALST's run; :data:`SWITCHES`, what it modelled before a sourced correction).

How the rows are modelled: experiments/paper_scale/alst.py (Note [ALST's published breakdown and configuration]
and Note [ALST's kernels]); their longest lengths: `experiments.paper_scale.alst_longest`; the planner's row:
`experiments.paper_scale.alst_planner`; the table: `experiments.paper_scale.alst_table`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

MODEL = "llama-3.1-8b"
CLUSTER = "h100-sxm"
RANKS = 8
PAPER = "arXiv 2506.13996v1 section 5.4 Table 1"
RECIPES = "snowflakedb/ArcticTraining projects/sequence-parallelism (commit 2771b4b1b9c8cbb54895ccb940dcaa76d33bf7ef)"
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
    """The recipe's ``attn_implementation`` (the trace runs SDPA's fused kernel either way;
    `experiments.paper_scale.alst_longest.miss_items`)."""
    eager: bool = False
    """Pointwise ops run one kernel each (no torch.compile, no Liger kernels), not fused (Note [ALST's kernels] in
    experiments/paper_scale/alst.py)."""
    switched: frozenset[str] = frozenset()
    """Keys of :data:`SWITCHES`: what this row models as it was modelled before a sourced fact corrected it (to
    measure what each correction moves, `experiments.paper_scale.alst.cause_effects`); empty in the table."""
    published_tokens: int | None = None
    published_iteration_s: float | None = None
    published_tflops: float | None = None
    source: str = ""
    items: tuple[str, ...] = ()
    """Keys of :data:`ITEMS`: how this row's model differs from ALST's run."""

    @property
    def liger(self) -> bool:
        """ALST's model with Liger's kernels (``model.type: liger`` in every recipe with the tiled loss): Liger's
        fused linear cross entropy and RMSNorm (Note [ALST's kernels] in experiments/paper_scale/alst.py)."""
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
"""ALST's Table 1, each row its configuration as modelled (Note [ALST's published breakdown and configuration] in
experiments/paper_scale/alst.py)."""

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
with overlapped all-to-alls and AutoSP's own chunk sizes. These rows price the AutoSP program under ALST's ZeRO
setting as DeepSpeed's ZeRO 3 hooks run it (prefetch one module ahead), so that only the techniques differ; AutoSP's
own ZeRO 3 (its shards gathered at their use inside the compiled step, Note [ZeRO 3 through DeepSpeed] in
autosp/integrations/deepspeed_engine.py) is what the planner row prices; `autosp_zero2_row` is ZeRO 2."""


def autosp_zero2_row() -> BreakdownRow:
    """Every AutoSP technique under ZeRO 2 with optimizer offload."""
    return replace(AUTOSP_ROWS[3], name="all, ZeRO 2 + optimizer offload", zero_stage=2)

