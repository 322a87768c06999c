"""Shape-only traces of a training step: the real AutoSP passes and AOTAutograd on fake tensors and a fake
process group, so that paper-scale graphs need no paper-scale memory.  The planner (`autosp.plan.predict`) and the
export's users (`autosp.export.export_workload` on ``report.aot_graphs``) trace here; a trace builds the model core
(`autosp.model.SequenceParallelModel`) with the options it predicts and `TraceHooks`, never through the compile
front door, so nothing here plans.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from autosp.config import AutoSPConfig
from autosp.errors import AutoSPError
from autosp.groups import build_groups
from autosp.inputs import prepare_inputs
from autosp.model import SequenceParallelModel, TraceHooks

FAKE_TRACE_OPTIONS = {"check_same_sample": False, "memory_plan": "off"}
"""`autosp.compile` options every fake trace compiles with under the options it predicts (which win).  The fake
group's collectives carry no data, so the same-sample check (autosp.guards.check_same_sample) would compare fake
tensors by value, and the trace has one sample by construction; and a trace predicts the memory options it is
given, so it plans nothing itself (Note [The default memory plan] in autosp/plan/auto.py)."""


def compile_for_trace(model: nn.Module, *, sp_size: int, compiler: str = "aot_eager", hooks: TraceHooks | None = None,
                      program_for: Callable[[SequenceParallelModel], Callable] | None = None,
                      **options) -> SequenceParallelModel:
    """The model core for a shape-only trace of ``model`` with ``options`` (`autosp.compile`'s, on top of
    `FAKE_TRACE_OPTIONS`), over the fake group of `fake_training_sample`.  ``program_for``: given the core, the
    callable that stands for its compiled program (the planner's one Dynamo capture for every strategy)."""
    config = AutoSPConfig.from_options(sp_size=sp_size, compiler=compiler,
                                       options={**FAKE_TRACE_OPTIONS, **options})
    if config.memory_plan == "auto" or config.strategy == "auto":
        raise AutoSPError("a trace compiles the options it predicts: pass memory_plan='off' and a named strategy")
    groups = build_groups(sp_size, None, layout=config.layout)
    return SequenceParallelModel(model, config, groups, trace=hooks or TraceHooks(), program_for=program_for)


def trace_fake_step(build_model, *, seq_len: int, sp_size: int, vocab_size: int, rank: int = 0,
                    dtype: torch.dtype = torch.bfloat16, compiler: str = "aot_eager", document_lengths=None,
                    micro_batch: int = 1, checkpointing_variants=(), capture_joint: bool = False,
                    mask_rules: dict | None = None, **options):
    """Compile and run one training step of ``build_model()`` on fake tensors and a fake group.

    Paper-scale graphs without paper-scale memory: the model is built inside a
    FakeTensorMode (parameters have shapes, no storage) and the collectives run on
    a fake process group of ``sp_size`` ranks, so the real AutoSP passes and
    AOTAutograd produce the real forward and backward graphs.  Returns the
    compiled model (its ``report.aot_graphs`` feed `export_workload`) and the
    parameter bytes.  ``options`` are `autosp.compile` options (e.g. checkpointing).
    ``document_lengths``: the sample packs documents of these lengths (real position ids, so a model
    that masks documents is traced with the layout and the report's attention_kept_fraction set).
    ``micro_batch``: samples per step (the rows of ``input_ids``; each row is a full ``seq_len`` sequence).
    ``checkpointing_variants``: (checkpointing, sac_memory_budget) pairs whose programs the same trace also
    partitions, into ``report.variant_graphs`` (docs/design.md, "Trace reuse"; aot_eager only).
    ``capture_joint``: keep the joint graph in ``report.joint_capture`` (Note [The joint graph at another length]
    in autosp/joint_template.py).
    ``mask_rules``: mask rules shared with the other traces of one planner decision (Note [Mask rules shared between
    a decision's traces] in autosp/passes/dynamo/mask_learner.py).
    The process must not have a process group of its own.
    """
    positions = None
    if document_lengths is not None:  # real values (a few integers per token), outside the fake mode
        positions = torch.cat([torch.arange(int(n)) for n in document_lengths])[None].expand(micro_batch, -1)
        if positions.shape[1] != seq_len:
            raise ValueError(f"document_lengths sum to {positions.shape[1]} tokens, not seq_len={seq_len}")
    with fake_training_sample(build_model, seq_len=seq_len, sp_size=sp_size, vocab_size=vocab_size, rank=rank,
                              dtype=dtype, micro_batch=micro_batch, position_ids=positions) as (fake_mode, model,
                                                                                                inputs):
        compiled = compile_for_trace(model, sp_size=sp_size, compiler=compiler, hooks=TraceHooks(
            checkpointing_variants=tuple(checkpointing_variants), capture_joint=capture_joint, mask_rules=mask_rules),
            **options)
        # The step runs in the fake mode too: a graph's factory ops (the zeros a loss backward fills, a
        # [S, vocab] buffer) would otherwise allocate real memory, gigabytes at paper scale.
        with fake_mode:
            out = compiled(**inputs)
            (out if isinstance(out, torch.Tensor) else out.loss).backward()
        parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return compiled, parameter_bytes


@contextlib.contextmanager
def fake_training_sample(build_model, *, seq_len: int, sp_size: int, vocab_size: int, rank: int = 0,
                         dtype: torch.dtype = torch.bfloat16, micro_batch: int = 1, position_ids=None):
    """A fake process group of ``sp_size`` ranks (this process ``rank``) for the block, and in a FakeTensorMode
    ``build_model()`` (parameters of ``dtype``, no storage) with one sample of ``micro_batch`` rows of
    ``seq_len`` random tokens (labels the tokens, ``position_ids`` if given): yields (fake mode, model, inputs)
    for `trace_fake_step` and the planner's shared capture (`autosp.plan.traces.trace_strategies`).  The process
    must not have a process group of its own."""
    if dist.is_initialized():
        raise RuntimeError("tracing on fake tensors needs a process without a process group (it creates a fake one)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=sp_size)
    try:
        previous = torch.get_default_dtype()
        # Non-fake constants (e.g. an empty KV-cache tensor created in forward) may mix with fakes.
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        with fake_mode:
            torch.set_default_dtype(dtype)
            try:
                model = build_model()
            finally:
                torch.set_default_dtype(previous)
            ids = torch.randint(0, vocab_size, (micro_batch, seq_len))
            inputs = prepare_inputs(ids, labels=ids, position_ids=position_ids)
        yield fake_mode, model, inputs
    finally:
        dist.destroy_process_group()
