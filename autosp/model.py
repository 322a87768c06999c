"""The sequence-parallel model core: `SequenceParallelModel`, what `autosp.compile` returns.

On each call it takes the full-length batch from `prepare_inputs`, cuts out this rank's shard (padding, global
positions, labels shifted over the whole sequence) and runs the module compiled by the AutoSP backend.  The loss it
returns is the single-device loss of the full sequence on every rank; ``loss.backward()`` makes every gradient the
single-device gradient (the model reduces them over the SP group in backward: autosp.gradients).

The core knows nothing of the planner.  Under ``memory_plan="auto"`` it is given a `FirstBatchPlan` (the compile
front door's, `autosp.api`) that it asks once, on the first batch, for the options to compile with; a trace of the
planner (`autosp.tracing`) builds it with a `TraceHooks` saying what to keep of the compile.  docs/design.md, "The
compile path".
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from autosp.backend import make_backend
from autosp.config import AutoSPConfig
from autosp.context import CompiledProgram, CompileReport, TraceContext
from autosp.diagnostics import graph_break_error, install_output_capture_hooks, with_attention_hint
from autosp.errors import AutoSPError, DocumentAttentionUnavailable
from autosp.gradients import GradientReduction
from autosp.groups import SequenceParallelGroups
from autosp.guards import check_same_sample, sliding_window_layers
from autosp.inputs import PREPARED_KEY, positions_are_plain, shard_batch, shard_layout
from autosp.parameter_sharding import clip_grad_norm_, full_parameters, shard_parameters
from autosp.passes.dynamo.tiled_loss import mark_dropped_logits
from autosp.pipeline import passes_for

log = logging.getLogger(__name__)


class FirstBatchPlan(Protocol):
    """How a ``memory_plan="auto"`` model learns its options on its first batch (a collective over the SP group);
    `autosp.api` gives one built on `autosp.plan.auto.decide`."""

    def decide(self, module: nn.Module, config: AutoSPConfig, *, seq_len: int, micro_batch: int,
               device: torch.device) -> dict:
        """The decision (``options`` to compile with, and what the report shows: `TraceContext.memory_plan`)."""

    def close(self) -> None:
        """Release what the plan holds (this rank's planner process); called once, after ``decide`` or unasked."""


@dataclass(frozen=True)
class TraceHooks:
    """What a shape-only trace keeps of the compile besides its program (the planner's and the export's traces,
    `autosp.tracing`); the defaults are a plain compile's."""

    checkpointing_variants: tuple[tuple[str, float | None], ...] = ()
    """(checkpointing, sac_memory_budget) pairs the same joint graph is also partitioned with
    (`TraceContext.checkpointing_variants`)."""
    capture_joint: bool = False
    """Keep the joint graph in ``report.joint_capture`` (`TraceContext.capture_joint`)."""
    joint_only: bool = False
    """With ``capture_joint``: stop once the joint graph is captured (`TraceContext.joint_only`)."""
    mask_rules: dict | None = None
    """Mask rules shared between one decision's traces (`TraceContext.mask_rules`)."""


def _accepts(forward, name: str) -> bool:
    params = inspect.signature(forward).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


class MemoryMeter(Protocol):
    """What measures the device memory a planned model's first steps use (Note [The plan's promise checked])."""

    def reset(self) -> None:
        """Start a new peak."""

    def peak_bytes(self) -> int:
        """The peak since the last ``reset``."""


@dataclass(frozen=True)
class CudaAllocatorMeter:
    """The CUDA caching allocator's peak of allocated bytes on ``device``."""

    device: torch.device

    def reset(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))


PROMISE_CHECKED_CALLS = 3
"""Calls after the planned first one whose start reads the meter (Note [The plan's promise checked]): the first
step's backward and optimizer step (whose states an optimizer allocates on its first step) are behind the second
call; two more cover a gradient-accumulation step."""


# Note [The plan's promise checked]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# memory_plan="auto" promises the fastest plan whose predicted peak fits ``target_memory``; a prediction that is
# wrong by more than the margin between them is an out-of-memory crash on a GPU, the worst thing a planner can
# ship.  So the promise is checked where it can be measured: the model resets its memory meter just before the
# first (planned) call runs its program, and at the start of each of the next `PROMISE_CHECKED_CALLS` calls reads
# the peak since then -- the first step's forward, backward and optimizer step.  A peak above ``target_memory``
# stops the job with an `AutoSPError` naming the plan, its prediction, the measurement and what to change, before
# a later, longer step runs out of memory; the largest peak of the SP group decides, so every rank stops together.
# The meter is the CUDA allocator's on a GPU (`CudaAllocatorMeter`) or the one passed to `autosp.compile`
# (``memory_meter=``); a CPU has no allocator peak, so nothing is checked there unless a meter is given
# (tests/autosp/test_memory_promise.py gives one).


# Note [One program per length]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A compiled model trains on any mix of sequence lengths with no setting.  Each call runs a program
# specialised to its shard's shapes; torch.compile guards every program on those shapes, so a new length
# (or batch size) compiles one more program and a length seen before reuses its own.  The sequence
# dimension is deliberately not symbolic: the sequence-sharding analysis, the mask probes and the rank's
# position offset read concrete shard lengths.  Under a symbolic length those reads would either install
# guards that specialise the program anyway, or -- for a value computed from the shard layout rather than
# from a traced shape, like the offset of this rank's positions -- bake one length's constant into a
# program that Dynamo would then reuse, unguarded, at other lengths: a silently wrong result.  A program per
# shape keeps every program exact by construction.  What the default needs instead is room: torch.compile
# recompiles one function at most 8 times (recompile_limit), so the model's calls raise that limit to
# ``max_programs`` (scoped to the call), each compile is logged and listed in `SequenceParallelModel.programs`,
# and past ``max_programs`` a call is refused naming length_bucket, which pads lengths to shared programs.
# The cost is one compile per distinct length; the step time of every program is that of static shapes.


# Note [Document program]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# A compiled model holds its own program (its configured code generator) and, built on the first batch that needs
# it, a document program: a second wrapper of the same module compiled by aot_eager, which applies every mask it
# learns over the whole sequence with `autosp.document_attention` (flex_attention: packed documents, padding, a
# sliding window, chunks shorter than the sequence).  One rule for every code generator: in the model's own program
# a mask that separates documents by position only (Hugging Face's packed-sequence mask, built from the position ids
# when no KV cache is passed), traced while the positions are 0..S-1 in every row, is the causal mask and compiles
# as causal SDPA, exact only while the positions stay plain: autosp.guards.ProgramGuard checks them on every call,
# before any collective.  A batch that the own program cannot run raises `DocumentAttentionUnavailable`: a packed
# batch reaching the causal program (the guard), or, under Inductor, which does not compile document_attention yet,
# any batch whose trace needs a document mask (the mask pass).  The compiled model catches it and runs the batch
# through the document program, logging a warning that names the reason; under aot_eager a program traced from a
# packed (or padded, windowed) first batch applies document attention itself, exact for plain rows too.
# torch.compile keeps the two wrappers' programs apart (its guards match the backend), and both count towards
# ``max_programs``; `SequenceParallelModel.programs` names each program's code generator and marks the document
# program's (``documents``, ``why_documents``).  Once a kind of batch (its shard shapes, whether its positions are
# plain, whether it carries a padding mask) went to the document program, later batches of that kind go there
# directly, so the own program does not trace or refuse them again.  The document program is exact for every batch,
# so this routing can cost speed, never exactness.  What it saves: aot_eager's flex_attention is the reference
# implementation, which scores every pair densely (O(S^2) memory that the planner's memory measurement does not
# see); plain rows keep causal SDPA under every code generator, and packed rows at long context on a GPU want
# Inductor's flex_attention lowering, the next step.  strategy="ring" and "hybrid" apply packed documents
# themselves (the mask pass's `_check_ring_rule`): their programs never assume plain positions.


def _batch_kind(local: dict, full_inputs: dict, positions_plain: bool) -> tuple:
    """What decides whether the model's own program can run a batch (Note [Document program]): the shard's shapes,
    whether the positions are 0..S-1 in every row, and whether a padding mask is passed."""
    shapes = tuple((k, tuple(v.shape)) for k, v in sorted(local.items()) if isinstance(v, torch.Tensor))
    return shapes, positions_plain, full_inputs.get("attention_mask") is not None


def _describe(kind: tuple) -> str:
    _, plain, masked = kind
    return ("" if plain else ", packed documents") + (", a padding mask" if masked else "")


class SequenceParallelModel(nn.Module):
    """A model compiled for sequence parallelism; call it with ``**autosp.prepare_inputs(...)``."""

    def __init__(self, module: nn.Module, config: AutoSPConfig, groups: SequenceParallelGroups, *,
                 strategy_plan: dict | None = None, first_batch_plan: FirstBatchPlan | None = None,
                 trace: TraceHooks = TraceHooks(),
                 program_for: Callable[[SequenceParallelModel], Callable] | None = None,
                 memory_meter: MemoryMeter | None = None):
        super().__init__()
        self.module = module
        self.config = config
        self.groups = groups
        self._ctx = TraceContext(
            sp_size=config.sp_size, sp_rank=groups.sp_rank, group_name=groups.sp_group_name,
            ignore_index=config.ignore_index, strategy=config.strategy, strategy_plan=strategy_plan,
            checkpointing_variants=tuple(trace.checkpointing_variants), capture_joint=trace.capture_joint,
            joint_only=trace.joint_only, mask_rules=trace.mask_rules,
        )
        if config.strategy == "hybrid":  # Note [Hybrid attention] in autosp/passes/dynamo/attention.py
            self._ctx.ulysses_size = config.ulysses_size
            self._ctx.ulysses_group_name = groups.ulysses_group.group_name
            self._ctx.ring_group_name = groups.ring_group.group_name
        install_output_capture_hooks(module)  # HF's lazy hook installation would break the graph
        # Note [Parameters gathered in the graph]: before the first trace, so Dynamo records the gathers
        shards = shard_parameters(module, groups.group) if config.shard_parameters else None
        self.__dict__["_shards"] = shards
        # memory_plan="auto": compiled on the first call, once ``first_batch_plan`` decided the options (it is asked
        # once, then closed; closed unasked if the model goes first).
        if (config.memory_plan == "auto") != (first_batch_plan is not None):
            raise AutoSPError("internal: a memory_plan='auto' model needs a first_batch_plan, and only it takes one")
        self.__dict__["_first_batch_plan"] = first_batch_plan
        if first_batch_plan is not None:
            weakref.finalize(self, first_batch_plan.close)
        self._warned_past_plan = False
        self.__dict__["_memory_meter"] = memory_meter  # Note [The plan's promise checked]
        self._promise_calls_left = 0
        if program_for is not None:  # a trace's stand-in for the compiled program (autosp.tracing)
            self.__dict__["_compiled"] = program_for(self)
        else:
            self.__dict__["_compiled"] = None if config.memory_plan == "auto" else self._compile(config)
        # The same module compiled by aot_eager with document attention, for the batches the own program cannot
        # run (Note [Document program]); built on the first such batch.
        self.__dict__["_compiled_documents"] = None
        self._document_batches: set[tuple] = set()
        self._accepts_positions = _accepts(module.forward, "position_ids")
        self._accepts_attention_mask = _accepts(module.forward, "attention_mask")
        self._ctx.sliding_window = sliding_window_layers(module)
        self.__dict__["_gradients"] = GradientReduction(  # Note [Gradient reduction in backward]
            module, groups, sharded=shards.shard_ids if shards is not None else frozenset())

    @property
    def programs(self) -> tuple[CompiledProgram, ...]:
        """Every program compiled for this model so far (one per distinct shard shape), in order."""
        return tuple(self._ctx.programs)

    @property
    def report(self) -> CompileReport:
        """What the AutoSP passes found and did (attention sites, per-pass op changes, graphs), the memory
        plan (``memory_plan="auto"``) and the strategy decision (``strategy="auto"``)."""
        report = self._ctx.report
        if report.memory_plan is None:  # each compile starts a new report; the plans are the model's
            report.memory_plan = self._ctx.memory_plan
        if report.strategy_plan is None:
            report.strategy_plan = self._ctx.strategy_plan
        return report

    def full_parameters(self, *, grads: bool = False) -> dict[str, torch.Tensor]:
        """Every parameter (``grads=True``: every gradient that is set) whole, by the uncompiled model's names;
        under ``shard_parameters=True`` gathered from the shards, a collective every rank must call (Note
        [Parameters gathered in the graph] in autosp/parameter_sharding.py)."""
        return full_parameters(self.module, grads=grads)

    @property
    def parameter_shards(self) -> tuple[nn.Parameter, ...]:
        """The parameters that are this rank's shards (``shard_parameters=True``: each holds a disjoint piece of a
        parameter, its gradient already reduced over the group); empty when the parameters are whole."""
        shards = self._shards
        if shards is None:
            return ()
        return tuple(p for p in self.module.parameters() if id(p) in shards.shard_ids)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` as on one device, also where the
        parameters are shards (``shard_parameters=True``: the norm is summed over the ranks, a collective every rank
        must call); returns the total norm before clipping."""
        shards = self._shards
        if shards is None:
            return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)
        return clip_grad_norm_(self.module, max_norm, self.groups.group, shards.shard_ids)

    def state_dict(self, *args, **kwargs):
        """The wrapped model's own state dict (its keys, loadable into the uncompiled model)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    # Dynamo does not trace into this method: an outer torch.compile (or DeepSpeed's engine.compile())
    # of the compiled model would otherwise unwrap it to the original module and drop the SP program.
    @torch.compiler.disable
    def forward(self, *args, **kwargs):
        refuse_outer_wrappers(self)
        batch = kwargs.pop(PREPARED_KEY, None)
        if batch is None or args:
            raise AutoSPError(
                "inputs were not prepared: call the compiled model as model(**autosp.prepare_inputs(input_ids, "
                "labels=labels)) with the full-length sample on every rank of the SP group"
            )
        cfg = self.config
        if cfg.check_same_sample and cfg.sp_size > 1:
            check_same_sample(kwargs, self.groups.sp_group, cfg.sp_size, kwargs["input_ids"].device)
        if self._promise_calls_left:  # Note [The plan's promise checked]
            self._check_promise(kwargs["input_ids"].device)
        if self._compiled is None:  # memory_plan="auto", first call
            padded = shard_layout(batch.seq_len, sp_size=cfg.sp_size, sp_rank=self.groups.sp_rank,
                                  pad_to_multiple=cfg.pad_to_multiple, length_bucket=cfg.length_bucket,
                                  zigzag=cfg.zigzag, ulysses_size=cfg.layout_ulysses_size).padded_seq_len
            device = kwargs["input_ids"].device
            self._plan_memory(padded, int(kwargs["input_ids"].shape[0]), device)
            cfg = self.config
            if self._memory_meter is None and device.type == "cuda":
                self.__dict__["_memory_meter"] = CudaAllocatorMeter(device)
            if self._memory_meter is not None and self._ctx.memory_plan.get("target_memory_bytes"):
                self._memory_meter.reset()
                self._promise_calls_left = PROMISE_CHECKED_CALLS
        layout = shard_layout(batch.seq_len, sp_size=cfg.sp_size, sp_rank=self.groups.sp_rank,
                              pad_to_multiple=cfg.pad_to_multiple, length_bucket=cfg.length_bucket,
                              zigzag=cfg.zigzag, ulysses_size=cfg.layout_ulysses_size)
        planned = (self._ctx.memory_plan or {}).get("setup", {}).get("seq_len")
        if planned is not None and layout.padded_seq_len > planned and not self._warned_past_plan:
            self._warned_past_plan = True
            log.warning("a batch of %d tokens is longer than the %d the memory plan was made for: it may not fit "
                        "target_memory; pass plan_seq_len= the longest length trained", layout.padded_seq_len,
                        planned)
        if "attention_mask" in kwargs and not self._accepts_attention_mask:
            raise AutoSPError(
                f"the batch has a padding mask but {type(self.module).__name__}.forward takes no attention_mask; "
                "pad at the end, set those labels to ignore_index and drop the mask (exact under causal attention)"
            )
        if cfg.sp_size == 1:
            local = dict(kwargs)  # plain compile: the model sees the whole sample as it is
        else:
            local = shard_batch(kwargs, layout, ignore_index=cfg.ignore_index, pad_token_id=cfg.pad_token_id)
        if not self._accepts_positions:
            local.pop("position_ids")
        ctx = self._ctx
        ctx.layout = layout
        ctx.batch_size = int(local["input_ids"].shape[0])
        ctx.labels_passed = local.get("labels") is not None
        ctx.positions_passed = "position_ids" in local
        ctx.full_inputs = {k: kwargs.get(k) for k in ("position_ids", "attention_mask")}
        positions = kwargs.get("position_ids")  # values where they have some (Note [Document program])
        ctx.positions_plain = (batch.plain_positions if isinstance(positions, FakeTensor)
                               else positions_are_plain(positions))
        ctx.input_roles = {id(local[k]): k for k in ("input_ids", "labels", "position_ids", "attention_mask")
                           if local.get(k) is not None}
        # Note [Document program]: no per-step check until some kind of batch went there.
        kind = _batch_kind(local, ctx.full_inputs, ctx.positions_plain) if self._document_batches else None
        try:
            if kind is not None and kind in self._document_batches:
                out = self._run(self._document_program(), local)
            else:
                try:
                    out = self._run(self._compiled, local)
                except DocumentAttentionUnavailable as why:  # Note [Document program]
                    kind = _batch_kind(local, ctx.full_inputs, ctx.positions_plain)
                    self._document_batches.add(kind)
                    log.warning("AutoSP runs this batch (%d rows of %d tokens%s) through the model's document "
                                "program (aot_eager) instead of its %s program: %s", ctx.batch_size, layout.seq_len,
                                _describe(kind), self.config.compiler, why)
                    ctx.why_documents = str(why)
                    out = self._run(self._document_program(), local)
            self._gradients.attach(ctx.program_outputs)
            return mark_dropped_logits(out, self.config, ctx)  # Note [Dropped logits] in autosp/passes/dynamo/tiled_loss.py
        finally:
            ctx.input_roles, ctx.full_inputs, ctx.program_outputs, ctx.why_documents = {}, {}, (), ""

    def _compile(self, config: AutoSPConfig):
        # sp_size=1: no sequence-parallel passes (only the tiled loss and MLP, when enabled), but the same
        # AOTAutograd path (checkpointing option, graphs recorded in the report for autosp.export).
        backend = make_backend(self._ctx, config, passes=passes_for(config))
        # Kept out of the module tree (not a registered submodule): the compiled wrapper holds the same
        # parameters as ``module``, and state_dict/parameters must list them once.
        return torch.compile(self.module, backend=backend, fullgraph=True, dynamic=False)

    def _plan_memory(self, seq_len: int, rows: int, device: torch.device) -> None:
        """memory_plan="auto": ask the first-batch plan for the options (a collective), then compile."""
        plan, self.__dict__["_first_batch_plan"] = self._first_batch_plan, None
        try:
            decision = plan.decide(self.module, self.config, seq_len=seq_len, micro_batch=rows, device=device)
        finally:
            plan.close()
        self.config = dataclasses.replace(self.config, **decision["options"])
        self._ctx.memory_plan = decision
        self.__dict__["_compiled"] = self._compile(self.config)

    def _check_promise(self, device: torch.device) -> None:
        """Refuse to go on when the meter saw more than the plan's target on any rank of the SP group (Note [The
        plan's promise checked]): the largest peak is every rank's, so all stop together, none left waiting in a
        collective."""
        self._promise_calls_left -= 1
        plan = self._ctx.memory_plan
        target, peak = int(plan["target_memory_bytes"]), self._memory_meter.peak_bytes()
        if self.config.sp_size > 1:
            largest = torch.tensor([peak], dtype=torch.int64, device=device)
            dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self.groups.group)
            peak = int(largest.item())
        if peak <= target:
            return
        self._promise_calls_left = 0
        chosen = plan["candidates"][plan["chosen"]]
        raise AutoSPError(
            f"memory_plan='auto' chose {chosen['plan']!r}, predicted at {chosen['peak_bytes'] / 2**30:.2f} GiB per "
            f"rank within target_memory={target / 2**30:.2f} GiB, and its first step measured "
            f"{peak / 2**30:.2f} GiB: stopping before a longer step runs out of memory.  Pass a lower target_memory "
            "(the planner then chooses a plan with more room), or choose the options with memory_plan='off'")

    def _document_program(self):
        """The model's document program (Note [Document program]), compiled on first use."""
        if self._compiled_documents is None:
            config = dataclasses.replace(self.config, compiler="aot_eager")
            backend = make_backend(self._ctx, config, passes=passes_for(config), documents=True)
            self.__dict__["_compiled_documents"] = torch.compile(self.module, backend=backend, fullgraph=True,
                                                                 dynamic=False)
        return self._compiled_documents

    def _run(self, compiled, local: dict):
        """Call one compiled wrapper of the module, translating torch.compile's errors into AutoSP's."""
        cfg = self.config
        try:
            # Padding, packed positions and outputs are checked per compiled program (autosp.guards.ProgramGuard).
            with torch._dynamo.config.patch(recompile_limit=max(cfg.max_programs, torch._dynamo.config.recompile_limit)):
                return compiled(**local)  # Note [One program per length]
        except torch._dynamo.exc.BackendCompilerFailed as err:
            if isinstance(err.inner_exception, AutoSPError):
                raise with_attention_hint(err.inner_exception, self.module) from None
            raise
        except torch._dynamo.exc.FailOnRecompileLimitHit as err:
            raise AutoSPError(
                f"torch.compile's recompile limit for {type(self.module).__name__}.forward was reached "
                f"(max_programs={cfg.max_programs}, shared by every compiled instance of this class: each instance "
                "and each new input shape compiles that code again).  Call torch._dynamo.reset() between compiles "
                "of throwaway models, pass length_bucket=N so that lengths share programs, or raise max_programs"
            ) from err
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as err:
            raise graph_break_error(err, type(self.module).__name__) from err

    def sync_gradients(self) -> None:
        """See `sync_gradients`."""
        sync_gradients(self)

    @property
    def reduces_gradients(self) -> bool:
        """Whether backward reduces the gradients over the SP group (False once an engine that knows the SP
        group, DeepSpeed given AutoSP's mpu, does it instead)."""
        return self._gradients.engine is None


def sync_gradients(model: SequenceParallelModel) -> None:
    """Kept for compatibility: checks that nothing is left to do, and does nothing.

    The compiled model reduces every gradient in backward (summed over the SP group,
    averaged over data-parallel replicas; Note [Gradient reduction in backward] in
    autosp.gradients), so after ``loss.backward()`` the gradients are already the
    single-device ones and a second sum would multiply them by sp_size.  Raises when
    the gradients are reduced by an engine instead (autosp.deepspeed_initialize).
    """
    if not isinstance(model, SequenceParallelModel):
        raise AutoSPError("sync_gradients expects the model returned by autosp.compile")
    engine = model._gradients.engine
    if engine is not None:
        raise AutoSPError(
            f"the gradients of this model are reduced by {engine}, which sums them over the SP group itself; "
            "calling autosp.sync_gradients on top would sum them again.  Remove the call")
    log.debug("sync_gradients: nothing to do, the compiled model reduced its gradients in backward")


# Note [FSDP2 on the AutoSP model]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``fully_shard(compiled)`` (PyTorch FSDP2) on the model `autosp.compile` returns makes the whole model one FSDP
# unit: between steps each rank holds 1/N of every parameter, its gradient and (the optimizer being built over the
# sharded ``compiled.parameters()``) its optimizer state; FSDP's pre-forward hook gathers the parameters before the
# compiled program runs, its pre-backward hook gathers them again, and its post-backward hook reduce-scatters the
# gradients.  The hooks sit on this wrapper, outside the compiled program, so Dynamo never meets them and the SP
# program is the one compiled without FSDP.  FSDP averages the gradients over its mesh, SP ranks included, which
# alone would make them sp_size times too small; but the compiled model has already reduced each gradient in
# backward (Note [Gradient reduction in backward] in autosp/gradients.py: summed over the SP group, averaged over
# replicas), so every rank hands FSDP the same gradient, whose average over any mesh is itself (exactly where the
# mesh's size is a power of two; else to the rounding of one sum), at the price of the redundant reduce-scatter's
# traffic.  What stays refused, each in one line: ``fully_shard`` on a module
# inside the model (its hooks would run inside the traced forward: a graph break, the layer-by-layer gathering
# being ``shard_parameters=True``'s), FSDP together with ``shard_parameters=True`` (two shardings of one
# parameter), and a memory plan made on the first batch (the planner does not price FSDP's layout yet; ZeRO 3's,
# ``shard_parameters=True``, it does).


def refuse_outer_wrappers(model: SequenceParallelModel) -> None:
    """DDP around an AutoSP model averages gradients over every rank, SP ranks included; FSDP2 composes only as
    one unit around the whole model (Note [FSDP2 on the AutoSP model])."""
    from torch.nn.parallel import DistributedDataParallel

    if DistributedDataParallel._get_active_ddp_module() is not None:
        raise AutoSPError(
            "the AutoSP model is wrapped in DistributedDataParallel, which averages gradients over every rank "
            "(the SP ranks of one sequence too, making gradients sp_size times too small); do not wrap it: the "
            "compiled model already sums its gradients over the SP group and averages them over data-parallel "
            "replicas during backward (or use autosp.deepspeed_initialize)"
        )
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if any(isinstance(m, FSDPModule) for m in model.module.modules()):
        raise AutoSPError(
            "a module inside the AutoSP model is sharded with fully_shard, whose hooks would run inside the compiled "
            "forward; apply fully_shard to the model autosp.compile returns (one FSDP unit), or compile with "
            "shard_parameters=True, which gathers the parameters layer by layer inside the compiled step")
    if not isinstance(model, FSDPModule):
        if any(isinstance(p, DTensor) for p in model.module.parameters()):
            raise AutoSPError(
                "the AutoSP model's parameters are DTensors (tensor parallelism or a sharding AutoSP does not know): "
                "compile a model with plain parameters; for FSDP2 apply fully_shard to the model autosp.compile "
                "returns")
        return
    if model._shards is not None:
        raise AutoSPError("fully_shard and shard_parameters=True would both shard every parameter: drop fully_shard "
                          "(shard_parameters=True is ZeRO 3's layout inside the compiled step), or compile without "
                          "shard_parameters")
    if model._compiled is None:  # memory_plan="auto", about to plan on this first batch
        raise AutoSPError("the memory planner does not price FSDP's layout on the AutoSP model yet: compile with "
                          "memory_plan=\"off\" before fully_shard, or drop fully_shard and compile with "
                          "shard_parameters=True (ZeRO 3's layout, which the planner prices)")
