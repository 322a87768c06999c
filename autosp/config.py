"""AutoSP's user-facing configuration: one frozen dataclass, validated on creation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import ClassVar

from autosp.errors import AutoSPError
from autosp.techniques import (
    CandidateSetting,
    MemoryTechnique,
    flag_label,
    memory_plan_options,
    setting_label,
    technique,
)
from simulator.workload import (
    CHOSEN_STRATEGIES,
    COMPILED_STRATEGIES,
    ZIGZAG_STRATEGIES,
    SPLayout,
    SPLayoutError,
)

STRATEGIES = COMPILED_STRATEGIES
"""The sequence-parallel strategies the pass implements: simulator.workload.COMPILED_STRATEGIES, the names of
simulator.workload.SPKind (the one declaration of them, which simulator.strategies.SEQUENCE_PARALLEL reads too)."""
ACCEPTED_STRATEGIES = (*COMPILED_STRATEGIES, *CHOSEN_STRATEGIES)
"""What ``strategy=`` accepts: a strategy of STRATEGIES, or "auto", which `autosp.compile` resolves to one of them
(and its degrees) before compiling (autosp.plan.auto.decide_strategy)."""
# ZIGZAG_STRATEGIES (imported above): the strategies whose tokens follow the zig-zag layout (Note [Zig-zag layout]
# in autosp/inputs.py), apply packed documents in the ring and refuse what the ring refuses (padding masks, sliding
# windows, chunked attention): the kinds of `simulator.workload.SPKind` that run a ring.

COMPILERS = ("inductor", "aot_eager")
SAC_BUDGETS = (None, 0.5, 0.2)
"""SAC's ``sac_memory_budget`` values the memory planner tries: None (SAC's default: recompute within
``sac_recompute_limit``), then keeping at most half and a fifth of the recomputable bytes."""


def _checkpointing_label(options) -> str:
    budget = options.get("sac_memory_budget")
    return options.get("checkpointing", "sac") + ("" if budget is None else f"@{budget:g}")


MEMORY_TECHNIQUES: tuple[MemoryTechnique, ...] = (
    MemoryTechnique(  # Note [Sequence-aware checkpointing] in autosp/passes/joint/checkpointing.py
        option="checkpointing", values=("sac", "none", "default", "full", "long-context", "layer"), default="sac",
        active=("sac",), companions=("sac_memory_budget",), stage="joint", innermost=True, label=_checkpointing_label,
        candidates=(CandidateSetting("none", {"checkpointing": "none"}),
                    *(CandidateSetting("sac" if b is None else f"sac@{b:g}",
                                {"checkpointing": "sac", **({} if b is None else {"sac_memory_budget": b})})
                      for b in SAC_BUDGETS),
                    CandidateSetting("full", {"checkpointing": "full"}),
                    CandidateSetting("layer", {"checkpointing": "layer"}))),  # what per-layer checkpointing runs
    MemoryTechnique(  # Note [Tiled loss pass] in autosp/passes/dynamo/tiled_loss.py
        option="tiled_loss", values=("off", "on", "auto"), default="off", active=("on", "auto"),
        companions=("loss_chunk_tokens", "return_logits"), chunk_option="loss_chunk_tokens",
        pass_factory="autosp.passes.dynamo.tiled_loss:make_tiled_loss_pass",
        label=setting_label("tiled loss", "tiled_loss", "loss_chunk_tokens"),
        candidates=(CandidateSetting("off", {"tiled_loss": "off"}),  # "on": HF's logits not computed, else exist anyway
                    CandidateSetting("on", {"tiled_loss": "on", "return_logits": False}))),
    MemoryTechnique(  # Note [Tiled MLP pass] in autosp/passes/dynamo/tiled_mlp.py
        option="tiled_mlp", values=("off", "on", "auto"), default="off", active=("on", "auto"),
        companions=("mlp_chunk_tokens",), chunk_option="mlp_chunk_tokens",
        pass_factory="autosp.passes.dynamo.tiled_mlp:make_tiled_mlp_pass",
        label=setting_label("tiled mlp", "tiled_mlp", "mlp_chunk_tokens"),
        candidates=(CandidateSetting("off", {"tiled_mlp": "off"}), CandidateSetting("on", {"tiled_mlp": "on"}))),
    MemoryTechnique(  # Note [Activation offload] in autosp/passes/partitioned/offload.py
        option="activation_offload", values=("off", "on", "auto"), default="off", active=("on",),
        stage="partitioned", planner_decides=True, label=flag_label("offload", "activation_offload"),
        candidates=(CandidateSetting("off"), CandidateSetting("on", {"activation_offload": "on"}))),
)
"""The memory techniques, in their order (of plan names, of the Dynamo-stage passes; `autosp.techniques`): what
``memory_plan="auto"`` chooses among, each with its `AutoSPConfig` fields below.  Adding one: docs/design.md,
"Adding a memory technique"."""
CHECKPOINTING = technique("checkpointing", MEMORY_TECHNIQUES).values
TILED_LOSS = technique("tiled_loss", MEMORY_TECHNIQUES).values
TILED_MLP = technique("tiled_mlp", MEMORY_TECHNIQUES).values
ACTIVATION_OFFLOAD = technique("activation_offload", MEMORY_TECHNIQUES).values
MEMORY_PLAN = ("off", "auto")
MEMORY_PLAN_OPTIONS = memory_plan_options(MEMORY_TECHNIQUES)
"""The options ``memory_plan="auto"`` chooses (autosp.plan.candidates.candidate_plans); one passed explicitly wins."""
PLAN_TIMEOUT_S = 540.0
"""The default ``plan_timeout_s``: torch's default NCCL collective timeout (10 minutes) less a minute, so that a
stuck planner process is every rank's error with its stacks, never a collective timeout without them."""
MASK_PROBE_TOKENS = 512
"""The default ``mask_probe_tokens``: a probe block of 2^18 booleans, checked at 7,200 offsets of a 3.7M-token
sequence in seconds (Note [Mask programs probed on shorter blocks] in autosp/passes/dynamo/mask_probes.py)."""
PLANNING_OPTIONS = ("target_memory", "plan_seq_len", "plan_cluster", "plan_setup", "plan_timeout_s")
"""The options only the planner reads (``memory_plan="auto"``, ``strategy="auto"``): refused where nothing is
planned, and reset to their defaults once ``strategy="auto"`` has decided."""
PLAN_SETUP = ("zero_stage", "optimizer", "grad_accum", "offload", "depth", "micro_batch", "engine")
"""The `autosp.plan.TrainingSetup` fields ``plan_setup`` may set (the rest come from the job itself; ``micro_batch``,
the rows per batch, from the first batch under memory_plan="auto", else 1 under strategy="auto", which decides
before any batch)."""


def with_job_setup(options: dict, job_setup: Callable[[], dict]) -> dict:
    """``options`` of `autosp.compile` whose ``plan_setup`` defaults to what a training framework knows of the job
    (``job_setup()``: its ZeRO stage, batch, optimizer, ...; called unless ``memory_plan="off"`` without
    ``strategy="auto"``: the default plans where it can); the keys the user gave win.  The DeepSpeed and Trainer integrations pass their configs through it."""
    if options.get("memory_plan") == "off" and options.get("strategy") != "auto":
        return dict(options)
    return {**options, "plan_setup": {**job_setup(), **(options.get("plan_setup") or {})}}


@dataclass(frozen=True, kw_only=True)
class AutoSPConfig:
    """How `autosp.compile` makes a model sequence-parallel."""

    TECHNIQUES: ClassVar[tuple[MemoryTechnique, ...]] = MEMORY_TECHNIQUES
    """The memory techniques whose options it checks (`MemoryTechnique.check`)."""
    sp_size: int
    """Ranks that share one sequence (the Ulysses or ring degree); must divide the process group's size."""
    strategy: str = "ulysses"
    """How attention runs over the sequence: "ulysses" (all-to-alls around every attention; heads divisible by
    sp_size), "ring" (zig-zag ring attention, any number of heads: Note [Ring attention] in
    autosp/ring_attention.py; packed documents exact, padding masks and sliding windows refused), "hybrid"
    (all-to-alls inside groups of ``ulysses_size`` consecutive ranks, the ring across the groups: Note [Hybrid
    attention] in autosp/passes/dynamo/attention.py; heads divisible by ulysses_size, refusals as for "ring") or
    "auto" (`autosp.compile` asks the planner which of these, and which ulysses_size, is fastest and fits for
    ``plan_seq_len`` tokens on ``plan_cluster`` within ``target_memory``, and compiles that: docs/design.md,
    "Choosing a strategy"; the decision is in ``report.strategy_plan``)."""
    ulysses_size: int | None = None
    """strategy="hybrid": ranks of one Ulysses group (a divisor of sp_size); the ring runs over
    ``ring_size = sp_size // ulysses_size`` groups.  Give ulysses_size or ring_size (or both, consistent)."""
    ring_size: int | None = None
    """strategy="hybrid": the ring degree, ``sp_size // ulysses_size``; None: derived from ulysses_size."""
    compiler: str = "inductor"
    """Code generator after the AutoSP passes: "inductor" (fast kernels) or "aot_eager" (quick to compile)."""
    ignore_index: int = -100
    """Label value that does not count in the loss (PyTorch and Hugging Face use -100)."""
    pad_to_multiple: bool = True
    """Pad a sequence whose length is not a multiple of sp_size at its end (with ignored labels; exact
    under causal attention).  False raises an error for such a sequence instead."""
    length_bucket: int | None = None
    """Pad every sequence to a multiple of this many tokens (itself a multiple of sp_size) instead of
    sp_size, so that sequences of different lengths share compiled programs: training on lengths up to
    N compiles at most ceil(N / length_bucket) programs (see max_programs).  The padding costs at most
    length_bucket - 1 tokens per sequence; like all padding it is exact under causal attention with
    reductions over the sequence refused.  None: pad to a multiple of sp_size only."""
    max_programs: int = 64
    """Compiled programs this model may hold (Note [One program per length]): each distinct shard shape (a new
    sequence length, a new batch size) compiles one program, specialised to its shapes and guarded by them, so
    any mix of lengths trains with no setting; the first call at a new length pays its compile
    (`SequenceParallelModel.programs` lists them).  A call that would compile one more is refused, naming
    length_bucket (which makes lengths share programs).  It also raises torch.compile's per-function recompile
    limit (8 by default) to this many for the model's calls."""
    pad_token_id: int = 0
    """Token id used for that padding (its outputs never reach the loss)."""
    checkpointing: str = "sac"
    """Which forward activations the backward recomputes instead of keeping:
    "sac" (sequence-aware: keep attention outputs and collective results, recompute
    cheap ops, and matmuls within ``sac_recompute_limit``/``sac_memory_budget``),
    "none" (keep everything the backward reads), "default" (PyTorch's min-cut
    partitioner heuristics), "full" (recompute every op except collectives), "long-context" (the
    rule the authors' research fork of DeepSpeed ran: a tensor the backward reads is recomputed only when its
    dim 1 is at least 4096; Note [The long-context rule of the AutoSP research fork] in
    autosp/passes/joint/checkpointing.py), "layer" (per-layer checkpointing as torch.utils.checkpoint around
    each decoder layer runs it: inside the layers keep only the residual stream between them and recompute
    everything else, the attention and all-to-alls included; keep what runs outside them; Note
    [Sequence-aware checkpointing])."""
    sac_recompute_limit: float = 0.25
    """SAC recomputes matmuls, cheapest per byte freed first, while the extra FLOPs stay
    within this fraction of the forward pass's FLOPs (attention included; at long
    sequences attention dominates, so more matmuls qualify)."""
    sac_memory_budget: float | None = None
    """If set, SAC keeps at most this fraction (0..1) of the bytes of the tensors it may
    recompute, recomputing further matmuls past ``sac_recompute_limit`` to get there."""
    overlap_communication: bool = True
    """Issue the all-to-alls asynchronously (start early, wait late) so they run while
    independent computation proceeds, forward and backward; numerics are unchanged."""
    check_same_sample: bool = True
    """On every call, check that all ranks of the SP group were given the same sample (input ids, labels,
    positions, mask), with one all-gather of a few checksums; a mismatch (e.g. a plain DistributedSampler
    over all ranks) is refused on every rank.  False skips the check (autosp.guards.check_same_sample)."""
    shard_parameters: bool = False
    """True: every rank keeps 1/N of each parameter (N: the ranks of the compile's whole group, data-parallel
    replicas times the SP group, as ZeRO-3 partitions them), gathered where it is used inside the compiled program
    and gathered again in its backward, so no rank holds the whole model between uses (Note [Parameters gathered in
    the graph] in autosp/parameter_sharding.py).  ``model.parameters()`` are then the shards (give them to the
    optimizer); ``compiled.full_parameters()`` gathers them whole.  The memory planner prices it as ZeRO 3 (under
    strategy "ulysses"; its ledger is DeepSpeed's Stage 3, fp32 master weights and Adam state included, so a bf16
    model under a plain optimizer holds less than priced)."""
    tiled_loss: str = "off"
    """Compute the output projection and the causal-LM loss in token chunks, forward and backward, so the
    [tokens, vocab] logits and their fp32 copies never exist (Note [Tiled logits and loss] in
    autosp/tiled_ops.py): "on" (an error if the model's loss is not cross-entropy over a linear projection),
    "auto" (on when this rank's logits span more than one chunk, and the model's loss has that form), "off"."""
    loss_chunk_tokens: int | None = None
    """Tokens per chunk of the tiled loss; None: as many as keep one chunk's fp32 logits within 64 MiB
    (autosp.passes.dynamo.tiled_loss.LOSS_CHUNK_BYTES)."""
    tiled_mlp: str = "off"
    """Compute each MLP-shaped chain (linear -> elementwise ops [x linear] -> linear, e.g. Llama's
    ``down(act(gate(x)) * up(x))``) in token chunks, recomputing a chunk's intermediates in backward, so its
    [tokens, intermediate] values exist one chunk at a time (Note [Tiled MLP pass] in
    autosp/passes/dynamo/tiled_mlp.py): "on" (an error if the model has no such chain), "auto" (on for each
    chain whose rows on this rank span more than one chunk), "off"."""
    mlp_chunk_tokens: int | None = None
    """Tokens per chunk of the tiled MLP; None: as many as keep one chunk's input-projection outputs within
    64 MiB (autosp.passes.dynamo.tiled_mlp.MLP_CHUNK_BYTES)."""
    return_logits: bool = True
    """False (with tiled_loss "on" or "auto"): when labels are passed, a model that returns its logits beside the
    loss (Hugging Face) does not compute them, so that the tiled loss need not materialise them: its output holds
    a placeholder there that raises an AutoSPError naming this option on any use (Note [Dropped logits] in
    autosp/passes/dynamo/tiled_loss.py).  The memory plan's tiled-loss plans set it.  True keeps them (and
    tiled_loss then cannot apply to such a model: "on" is refused, "auto" keeps the plain loss)."""
    activation_offload: str = "off"
    """Move the tensors saved for backward to host memory after their last forward use and copy them back ahead of
    their backward use, asynchronously (Note [Activation offload] in autosp/passes/partitioned/offload.py; exact: the
    values are copied, never changed): "on", "off", or "auto" (the memory planner decides; only with
    memory_plan="auto"; a plan that does not set it leaves it off)."""
    memory_plan: str | None = None
    """"auto": before its first program compiles, the model runs the memory planner (autosp.plan.plan_memory) for
    itself at its first batch's length (or ``plan_seq_len``) and compiles with the fastest candidate's checkpointing, SAC budget, tiled
    loss and tiled MLP that fits ``target_memory`` (options passed explicitly win; docs/design.md, "Memory
    planner"); the decision and every candidate are in ``report.memory_plan``.  "off": the options as given.
    None (the default): "auto" wherever the planner can plan the compile (a Hugging Face causal LM in fp32 or
    bf16 with a memory size to plan for: a GPU's, or ``target_memory``), else "off", saying why in the log
    (`autosp.plan.auto.resolve_memory_plan`); ``compiled.config.memory_plan`` shows which."""
    target_memory: int | None = None
    """Bytes per rank the plan must fit (the planner's peak: the memory ledger plus the simulated activations);
    None: the GPU's memory (memory_plan="auto" requires it on CPU; strategy="auto" then takes the cluster preset's
    device memory)."""
    plan_seq_len: int | None = None
    """Tokens per sample the plan is made for; None: the longest first batch of the process group (required with
    strategy="auto", which decides before the first batch)."""
    plan_cluster: str | None = None
    """Hardware the plan is predicted on: a preset or cluster file of ``python -m autosp.plan --cluster``; None:
    cpu-gloo on CPU, the preset of the GPU's name."""
    plan_setup: dict | None = None
    """Training settings the model cannot see, for the planner's memory ledger: any of ``PLAN_SETUP`` (e.g.
    {"zero_stage": 2, "optimizer": "adamw"}); the others: no ZeRO (a plain training loop holds its optimizer's whole
    state on every rank) and `autosp.plan.TrainingSetup`'s defaults.  `autosp.deepspeed_initialize` and
    `AutoSPTrainer` fill it from their configs (keys given here win)."""
    mask_probe_tokens: int = MASK_PROBE_TOKENS
    """Tokens per block on which an attention mask the model builds from its inputs is learnt (Note [Mask programs
    probed on shorter blocks] in autosp/passes/dynamo/mask_probes.py): shards longer than this have their mask
    program resized to such blocks, so that learning it costs O(S x this) instead of O(S x shard).  The rule then
    holds on pairs of tokens fewer than this apart at every offset, and on the traced batch.  A mask whose program
    cannot be resized is learnt on the shard itself only on shards of at most 64 times this (else refused, saying
    what to change): raise it to the shard's length to probe a longer shard anyway."""
    plan_timeout_s: float = PLAN_TIMEOUT_S
    """Seconds a rank waits for its planner process (memory_plan="auto", strategy="auto") before the process is
    stopped and every rank raises an `AutoSPError` holding its output and Python stacks.  The other ranks wait in a
    collective meanwhile, so keep it under the process group's timeout (torch's defaults: 10 minutes with NCCL, 30
    with gloo); the default is the NCCL one less a minute's margin."""

    def __post_init__(self) -> None:
        if not isinstance(self.sp_size, int) or self.sp_size < 1:
            raise AutoSPError(f"sp_size must be a positive integer, got {self.sp_size!r}")
        if self.strategy not in ACCEPTED_STRATEGIES:
            raise AutoSPError(f"strategy must be one of {ACCEPTED_STRATEGIES}, got {self.strategy!r}")
        if self.compiler not in COMPILERS:
            raise AutoSPError(f"compiler must be one of {COMPILERS}, got {self.compiler!r}")
        for memory_technique in self.TECHNIQUES:  # values, chunk sizes, "auto" left to the planner
            memory_technique.check(self)
        if not 0 <= self.sac_recompute_limit:
            raise AutoSPError(f"sac_recompute_limit must be >= 0 (a fraction of forward FLOPs), got "
                              f"{self.sac_recompute_limit!r}")
        if self.length_bucket is not None and (
                not isinstance(self.length_bucket, int) or self.length_bucket < 1 or self.length_bucket % self.sp_size):
            raise AutoSPError(f"length_bucket must be a positive multiple of sp_size={self.sp_size}, got "
                              f"{self.length_bucket!r}")
        self._check_hybrid()
        if self.zigzag and self.length_bucket is not None and self.length_bucket % (2 * self.sp_size):
            raise AutoSPError(f"length_bucket must be a multiple of 2 * sp_size = {2 * self.sp_size} under "
                              f"strategy={self.strategy!r} (its zig-zag layout cuts the sequence into that many "
                              f"equal pieces), got {self.length_bucket!r}")
        if not isinstance(self.max_programs, int) or self.max_programs < 1:
            raise AutoSPError(f"max_programs must be a positive number of compiled programs, got {self.max_programs!r}")
        if not self.return_logits and self.tiled_loss == "off":
            raise AutoSPError("return_logits=False takes effect only with the tiled loss: pass tiled_loss='on' or "
                              "'auto' too (or leave return_logits=True)")
        self._check_memory_plan()
        if not isinstance(self.shard_parameters, bool):
            raise AutoSPError(f"shard_parameters must be True or False, got {self.shard_parameters!r}")
        if self.sac_memory_budget is not None and not 0 <= self.sac_memory_budget <= 1:
            raise AutoSPError(f"sac_memory_budget must be None or a fraction in [0, 1], got {self.sac_memory_budget!r}")

    @property
    def zigzag(self) -> bool:
        """Whether the tokens are laid out in zig-zag chunks (Note [Zig-zag layout] in autosp/inputs.py): under the
        ring and the hybrid."""
        return self.strategy in ZIGZAG_STRATEGIES

    @property
    def layout(self) -> SPLayout | None:
        """The strategy's rank layout over sp_size ranks (`simulator.workload.SPLayout`: its degrees, groups and
        heads rule); None under strategy="auto", which decides it before compiling."""
        return SPLayout.from_options(self.strategy, self.sp_size, ulysses_size=self.ulysses_size)

    @property
    def layout_ulysses_size(self) -> int:
        """Ranks that split one zig-zag pair of chunks (Note [Zig-zag layout]): ulysses_size under the hybrid, else 1."""
        layout = self.layout
        return 1 if layout is None else layout.zigzag_ulysses_size

    def _check_hybrid(self) -> None:
        """The strategy's degrees (`SPLayout.from_options`), ``ulysses_size`` and ``ring_size`` filled in."""
        try:
            layout = SPLayout.from_options(self.strategy, self.sp_size, ulysses_size=self.ulysses_size,
                                           ring_size=self.ring_size)
        except SPLayoutError as err:
            raise AutoSPError(str(err)) from None
        if layout is not None and layout.kind.grouped:
            object.__setattr__(self, "ulysses_size", layout.ulysses_size)
            object.__setattr__(self, "ring_size", layout.ring_size)

    def _check_memory_plan(self) -> None:
        if self.memory_plan is not None and self.memory_plan not in MEMORY_PLAN:
            raise AutoSPError(f"memory_plan must be one of {MEMORY_PLAN} (or None, the default: planned where it "
                              f"can be), got {self.memory_plan!r}")
        defaults = {f.name: f.default for f in fields(self) if f.name in PLANNING_OPTIONS}
        given = [name for name, default in defaults.items() if getattr(self, name) != default]
        if self.memory_plan == "off" and self.strategy != "auto" and given:
            raise AutoSPError(f"{', '.join(given)} take(s) effect only with the planner: pass memory_plan='auto' or "
                              "strategy='auto' too (or leave them out)")
        if self.strategy == "auto" and self.sp_size < 2:
            raise AutoSPError("strategy='auto' chooses how a sequence is split over ranks: give sp_size >= 2")
        if self.strategy == "auto" and self.plan_seq_len is None:
            raise AutoSPError("strategy='auto' chooses the strategy before compiling, for one sequence length: pass "
                              "plan_seq_len= the (padded) tokens per sample the job trains at")
        for name in ("target_memory", "plan_seq_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                unit = "bytes per rank" if name == "target_memory" else "tokens"
                raise AutoSPError(f"{name} must be None or a positive integer ({unit}), got {value!r}")
        if self.plan_seq_len is not None and self.plan_seq_len % self.sp_size:
            raise AutoSPError(f"plan_seq_len={self.plan_seq_len} is not a multiple of sp_size={self.sp_size}; "
                              "give the padded length the job trains at")
        if self.plan_cluster is not None and not isinstance(self.plan_cluster, str):
            raise AutoSPError(f"plan_cluster must be a preset name or the path of a cluster file, got "
                              f"{self.plan_cluster!r}")
        if isinstance(self.plan_timeout_s, bool) or not isinstance(self.plan_timeout_s, (int, float)) \
                or not self.plan_timeout_s > 0:
            raise AutoSPError(f"plan_timeout_s must be a positive number of seconds, got {self.plan_timeout_s!r}")
        if isinstance(self.mask_probe_tokens, bool) or not isinstance(self.mask_probe_tokens, int) \
                or self.mask_probe_tokens < 4:
            raise AutoSPError(f"mask_probe_tokens must be an integer of at least 4, got {self.mask_probe_tokens!r}")
        if self.plan_setup is not None:
            unknown = sorted(set(self.plan_setup) - set(PLAN_SETUP)) if isinstance(self.plan_setup, dict) else None
            if unknown is None or unknown:
                raise AutoSPError(f"plan_setup must be a dict of {PLAN_SETUP}, got {self.plan_setup!r}")

    @classmethod
    def from_options(cls, *, sp_size: int, compiler: str, options: dict) -> AutoSPConfig:
        """Build a config from `autosp.compile`'s keyword options; unknown names are an error."""
        known = {f.name for f in fields(cls)} - {"sp_size", "compiler"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise AutoSPError(f"unknown autosp.compile option(s) {unknown}; valid options are {sorted(known)}")
        return cls(sp_size=sp_size, compiler=compiler, **options)
