"""Per-model compile state shared by the compiled model and its passes.

`TraceContext` says what the passes need to know about the call being traced
(the shard layout, which inputs were passed, the SP group).  It is owned by one
`SequenceParallelModel`: nothing here is global, so two compiled models in one
process never see each other's state.  `CompileReport` collects what the passes
found (attention layers, collectives inserted) for logs, tests and export.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autosp.config import MASK_PROBE_TOKENS
from autosp.errors import AutoSPError
from autosp.inputs import ShardLayout
from simulator.workload import SPKind, SPLayout


@dataclass
class AttentionSite:
    """One attention call the pass rewrote."""

    module: str
    """Qualified name of the module that called scaled_dot_product_attention."""
    num_heads: int
    num_kv_heads: int
    """Key/value heads as the model computes them (before any replication)."""
    kv_replication: int
    """Factor by which key/value heads were replicated so each rank gets whole GQA groups (1: none)."""
    is_causal: bool


@dataclass
class CompileReport:
    """What one compiled model's passes did, graph by graph (appended on every trace)."""

    attention_sites: list[AttentionSite] = field(default_factory=list)
    pass_op_deltas: list[tuple[str, dict[str, int]]] = field(default_factory=list)
    pass_seconds: dict[str, float] = field(default_factory=dict)
    """Wall time of each Dynamo-stage pass in the latest compile."""
    forward_graphs: list[object] = field(default_factory=list)
    """Post-pass Dynamo graphs (torch.fx.GraphModule), latest last."""
    aot_graphs: list[tuple[str, object]] = field(default_factory=list)
    """("forward" | "backward", aten-level torch.fx.GraphModule) as AOTAutograd partitioned them
    (after the overlap pass, i.e. as they run)."""
    checkpoint_plans: list[object] = field(default_factory=list)
    """autosp.passes.joint.checkpointing.CheckpointPlan of each joint graph, latest last."""
    offload_plans: list[object] = field(default_factory=list)
    """autosp.passes.partitioned.offload.OffloadPlan of each partition with activation_offload="on" (what moved to
    host memory: names, count, bytes), latest last."""
    num_fwd_outputs: int | None = None
    """The partitioner's count of the forward's user outputs in the latest partition (the forward's other outputs
    are the tensors saved for backward): what `autosp.backend.rewrite_pair` needs to rewrite a copy of the pair."""
    joint_graphs: int = 0
    """Joint graphs AOTAutograd built (one per compiled graph with a backward)."""
    partitions: int = 0
    """Min-cut partitions run (the compile's own, plus one per distinct checkpointing variant)."""
    variant_graphs: dict[tuple, list[tuple[str, object]]] = field(default_factory=dict)
    """(checkpointing, sac_memory_budget) of each `TraceContext.checkpointing_variants` entry -> its forward and
    backward graphs, like ``aot_graphs`` (docs/design.md, "Trace reuse"); absent for a variant in
    ``variant_same_as`` and for the compile's own setting (its graphs are ``aot_graphs``)."""
    variant_plans: dict[tuple, object] = field(default_factory=dict)
    """Each variant -> its CheckpointPlan."""
    joint_capture: object = None
    """With ``TraceContext.capture_joint``: the joint graph before the checkpointing tags
    (autosp.joint_template.JointCapture; Note [The joint graph at another length] there)."""
    variant_same_as: dict[tuple, tuple] = field(default_factory=dict)
    """A variant whose recomputation tags equal an earlier variant's (or the compile's own setting's) -> that
    one: the same partition, so the same program."""
    op_classes: dict[str, str] = field(default_factory=dict)
    """Each op the sequence-sharding analysis met -> the rule class that handled it."""
    causal_masks_replaced: int = 0
    """Attention masks recognised as the plain causal mask (Note [Attention masks built from the inputs])."""
    document_masks: list[object] = field(default_factory=list)
    """autosp.passes.dynamo.mask_learner.MaskRule of every attention given a mask over the whole sequence."""
    mask_probe_blocks: list[tuple[str, int, int]] = field(default_factory=list)
    """(module, tokens per probe block, tokens per shard) of every attention mask learnt from the inputs: a block
    shorter than the shard when the mask program was resized (Note [Mask programs probed on shorter blocks] in
    autosp/passes/dynamo/mask_probes.py)."""
    requires_plain_positions: bool = False
    """The program assumed one unpacked sequence per row (position ids 0..S-1): checked on every call."""
    padding_refusals: list[str] = field(default_factory=list)
    """Why this program is not exact on a padded sequence (a reduction over the sequence, non-causal attention):
    refused while tracing a padded batch, and re-checked on every call (autosp.guards.ProgramGuard)."""
    output_placements: tuple = ()
    """Placement of each output of the Dynamo graph (autosp.passes.dynamo.placements), in output order."""
    attention_kept_fraction: float | None = None
    """Fraction of the causal attention scores the traced batch's masks keep (1.0: plain causal; None: not
    known, a shape-only trace), what the export prices masked attention at."""
    document_ids: object = None
    """A ring or hybrid program over packed documents: the traced batch's document ids over the whole padded
    sequence ([B, S] tensor, Note [Document masks] in autosp/document_attention.py), from which the export skips
    the chunk pairs the ring skips (Note [Ring attention in the export] in autosp/export_ring.py); None otherwise."""

    memory_plan: dict | None = None
    """With ``memory_plan="auto"``: the planner's decision (autosp.plan.auto.decide): ``options`` (what the model
    compiled with), ``explicit`` (options passed to autosp.compile, which won over the plan), ``setup`` (seq_len,
    micro_batch, ... planned for), ``cluster``, ``target_memory_bytes``, ``chosen`` (an index into
    ``candidates``), ``reason``, ``candidates`` (each: plan, options, fits, peak_bytes, peak_by_category_bytes,
    step_time_s, refused, and the rank that predicted it), ``traces``, ``partitions``, ``seconds`` (the whole
    decision), ``planner_seconds`` (the slowest rank's wait for its planner process), ``planner_seconds_by_rank``
    and ``planner_started_before_s_by_rank`` (how long before the first call's request each rank's planner process
    was started, at compile; None where a rank predicted nothing: `autosp.plan.auto.memory_plan_on_ranks`, Note
    [Planner process started ahead] in autosp/plan/process.py).  None when not planned."""

    strategy_plan: dict | None = None
    """With ``strategy="auto"``: the planner's decision (autosp.plan.auto.decide_strategy): ``chosen`` (the
    registry name, e.g. ``autosp-hybrid-2x4``), ``options`` (the strategy and degrees the model compiled with),
    ``reason``, ``candidates`` (each: strategy, system, options, fits, peak_bytes, step_time_s, refused, and the
    rank that predicted it), ``setup``, ``cluster``, ``capacity_bytes``, ``seconds`` and ``planner_seconds``
    (`autosp.plan.auto.strategy_on_ranks`).  None when not chosen."""

    @property
    def all_attention_causal(self) -> bool:
        return all(site.is_causal for site in self.attention_sites)


@dataclass(frozen=True)
class CompiledProgram:
    """One program a compiled model holds (Note [One program per length] in autosp.model)."""

    seq_len: int
    """Tokens of the sample that compiled it (before padding; later calls of the program may differ within
    the same padded length)."""
    local_seq_len: int
    """Tokens per rank: the shard length the program is specialised to."""
    batch_size: int
    seconds: float
    """Wall time of the compile (the AutoSP passes and code generation of forward and, for Inductor, backward)."""
    compiler: str = "inductor"
    """The code generator that compiled it: the configured one, or aot_eager for the model's document program."""
    documents: bool = False
    """A program of the model's document program (Note [Document program] in autosp.model), compiled for a batch the
    model's own program could not run (packed documents, padding, a window or chunks)."""
    why_documents: str = ""
    """Why its batch went to the document program ("" for the model's own programs)."""


@dataclass
class TraceContext:
    """Facts about the call being traced; updated by the compiled model before each call."""

    sp_size: int
    sp_rank: int
    group_name: str
    ignore_index: int
    strategy: str = "ulysses"
    """AutoSPConfig.strategy: "ulysses", "ring" (zig-zag layout, Note [Ring attention] in autosp/ring_attention.py)
    or "hybrid" (Note [Hybrid attention] in autosp/passes/dynamo/attention.py)."""
    ulysses_size: int = 1
    """strategy="hybrid": ranks of a Ulysses group (the all-to-alls' group); the ring runs over
    sp_size // ulysses_size groups."""
    ulysses_group_name: str = ""
    """strategy="hybrid": the c10d name of this rank's Ulysses group (autosp.groups)."""
    ring_group_name: str = ""
    """strategy="hybrid": the c10d name of this rank's ring group."""

    @property
    def sp_layout(self) -> SPLayout:
        """The strategy's rank layout over the SP group (`simulator.workload.SPLayout`): its degrees, groups and
        heads rule."""
        kind = SPKind(self.strategy)
        return SPLayout.from_options(kind, self.sp_size, ulysses_size=self.ulysses_size if kind.grouped else None)
    layout: ShardLayout | None = None
    batch_size: int = 0
    """Rows of the call's batch."""
    labels_passed: bool = False
    positions_passed: bool = True
    full_inputs: dict[str, object] = field(default_factory=dict)
    """The call's full-length position_ids and attention_mask (the same on every rank; None when not passed),
    while it is traced: what the mask pass checks the model's mask against."""
    positions_plain: bool = False
    """The call's position ids are 0..S-1 in every row: checked on their values, or, in a shape-only trace (fake
    tensors, no values), generated so by `prepare_inputs` (Note [Document program] in autosp.model)."""
    document_attention_compiles: bool = True
    """Whether the backend compiles `autosp.document_attention` (not Inductor yet; see the mask pass); set by
    the backend from its code generator."""
    documents_program: bool = False
    """Whether the program being traced is the model's document program, which applies every mask it learns
    (otherwise a mask over documents by position, traced on plain positions, compiles as causal attention checked
    on every call); set by the backend.  Note [Document program] in autosp.model."""
    why_documents: str = ""
    """Why the call runs on the model's document program ("" when it does not): Note [Document program] in
    autosp.api."""
    sliding_window: object = None
    """autosp.guards.SlidingWindow of the model's config, or None."""
    mask_probe_tokens: int = MASK_PROBE_TOKENS
    """AutoSPConfig.mask_probe_tokens of the compile; set by the backend, read by the mask pass."""
    input_roles: dict[int, str] = field(default_factory=dict)
    """id() of each local input tensor -> its role ("input_ids", "labels", "position_ids", "attention_mask")."""
    checkpointing_variants: tuple[tuple[str, float | None], ...] = ()
    """(checkpointing, sac_memory_budget) pairs to partition the same joint graph with besides the compile's own
    setting, into ``report.variant_graphs`` (the planner's trace reuse; aot_eager only)."""
    mask_rules: dict | None = None
    """Mask rules learnt by earlier shape-only traces of one planner decision, shared with this one (`autosp.plan.
    predict.TraceReuse`; Note [Mask rules shared between a decision's traces] in autosp/passes/dynamo/mask_learner.py);
    None: every mask is learnt."""
    capture_joint: bool = False
    """Keep a copy of the joint graph in ``report.joint_capture`` (trace reuse across lengths; aot_eager only)."""
    joint_only: bool = False
    """With ``capture_joint``: stop the compile once the joint graph is captured (`autosp.backend.JointCaptured`
    raised out of it: no partition, no program), for the planner's captures that need the joint graph only (Note
    [One Dynamo capture for every strategy] in autosp/plan/prediction.py)."""
    report: CompileReport = field(default_factory=CompileReport)
    memory_plan: dict | None = None
    """The memory plan the model compiled with (``memory_plan="auto"``), what ``report.memory_plan`` shows."""
    strategy_plan: dict | None = None
    """The strategy decision the model compiled with (``strategy="auto"``), what ``report.strategy_plan`` shows."""
    programs: list[CompiledProgram] = field(default_factory=list)
    """Every program compiled for this model, in order."""
    program_outputs: tuple = ()
    """The flat outputs of the program that ran in the current call (autosp.gradients attaches to them)."""

    def require_unpadded(self, reason: str) -> None:
        """Record that the program being traced is exact only without padding (``reason`` says why, naming the op
        and module), and refuse the traced batch if it is padded.  Every later call of the program is checked
        again (autosp.guards.ProgramGuard): a padded batch can share an unpadded one's shapes (length_bucket)."""
        self.report.padding_refusals.append(reason)
        refuse_padding(self.report.padding_refusals, self.layout, self.sp_size)


def refuse_padding(reasons: list[str], layout: ShardLayout | None, sp_size: int) -> None:
    """Raise if ``layout`` pads the sequence and a program is exact only without padding (``reasons``)."""
    if reasons and layout is not None and layout.pad_tokens:
        raise AutoSPError(
            f"{reasons[0]}, and this sequence ({layout.seq_len} tokens) is padded to {layout.padded_seq_len} "
            f"(a multiple of sp_size={sp_size}, or of length_bucket): the padding tokens would count.  Pass a "
            f"multiple of {sp_size} tokens (of length_bucket, if set), e.g. pad with the labels ignored and "
            "an attention_mask"
        )
