"""The ``torch.compile`` backend: AutoSP passes on the Dynamo graph, then a code generator.

`make_backend` returns a backend closed over one model's `TraceContext` and
`AutoSPConfig`; Dynamo calls it with the graph of one rank's shard.  After the
pass pipeline the graph goes through AOTAutograd, which derives the backward
(including the all-to-alls' own backward) as one joint graph.  Activation
checkpointing tags that joint graph (autosp.passes.joint.checkpointing) before the
min-cut partitioner splits it into forward and backward; the pair's rewrites (`rewrite_pair`, in this order) then
run on the partitioned pair: with ``activation_offload="on"`` the offload pass (autosp.passes.partitioned.offload),
where the forward's saved outputs and the backward's inputs are both visible, then the overlap pass
(autosp.passes.partitioned.overlap), which splits each all-to-all into start and wait.  The graphs go to Inductor
or to eager kernels (`AutoSPConfig.compiler`) and are recorded in the model's `CompileReport` for tests and for the
schedule export.

Extension points used: AOTAutograd's ``partition_fn`` and compiler callbacks
(aot_eager), Inductor's ``inner_compile``, its ``joint_custom_pre_pass`` and its ``custom_partitioner_fn`` (the
min-cut, then `rewrite_pair`) set through ``config_patches`` for this one compile (inductor).  Nothing global is
changed, so two compiles in one process do not interact.
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from collections.abc import Callable, Sequence

from torch import fx
from torch._functorch import config as functorch_config

from autosp.config import CHECKPOINTING, AutoSPConfig
from autosp.context import CompiledProgram, CompileReport, TraceContext
from autosp.errors import AutoSPError
from autosp.guards import ProgramGuard
from autosp.joint_capture import capture_joint
from autosp.passes.graph_utils import graph_copy, lazy_graph_modules
from autosp.passes.joint.checkpointing import make_recompute_tagger, tag_recomputation
from autosp.passes.partitioned.offload import offload_saved_activations
from autosp.passes.partitioned.overlap import overlap_all_to_alls_pass
from autosp.pipeline import SEQUENCE_PARALLEL_PASSES, Pass, run_passes

log = logging.getLogger(__name__)

JointGraphPass = Callable[[fx.Graph], None]


class JointCaptured(Exception):  # noqa: N818 - a signal, not an error
    """Raised out of a compile with ``TraceContext.joint_only`` once its joint graph is captured."""


def rewrite_inference(graph: fx.GraphModule, config: AutoSPConfig) -> fx.GraphModule:
    """The rewrites of a forward compiled without a backward (no partition: nothing is saved for backward, so
    activation offload has nothing to move): the overlap pass (``overlap_communication``)."""
    return overlap_all_to_alls_pass(graph) if config.overlap_communication else graph


def rewrite_pair(fw: fx.GraphModule, bw: fx.GraphModule, *, config: AutoSPConfig, num_fwd_outputs: int,
                 record: Callable[[object], None] | None = None) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The rewrites of one partitioned forward/backward pair, in their one order: the activation offload pass on the
    pair (``activation_offload="on"``; ``num_fwd_outputs``: the partitioner's count of the forward's user outputs,
    the rest of its outputs being saved for backward; the offload plan goes to ``record``), then the overlap pass on
    each graph (``overlap_communication``).  Used by the backend for every partition it makes and by the planner for
    copies of partitions traced without the rewrites (`autosp.plan.traces.partitioned_rewrites`)."""
    if config.activation_offload == "on":  # "auto" unresolved by a plan: off
        plan = offload_saved_activations(fw, bw, num_fwd_outputs=num_fwd_outputs)
        if record is not None:
            record(plan)
    if config.overlap_communication:
        fw, bw = overlap_all_to_alls_pass(fw), overlap_all_to_alls_pass(bw)
    return fw, bw


def partition_pair(joint: fx.GraphModule, joint_inputs, partition_kwargs: dict, *, config: AutoSPConfig,
                   record: Callable[[object], None] | None = None) -> tuple[fx.GraphModule, fx.GraphModule]:
    """AOTAutograd's min-cut partition, then the pair's rewrites (`rewrite_pair`; the offload plan goes to
    ``record``): every partition of the backend (its own, the checkpointing variants', the joint graph at another
    length's: autosp.joint_template.partition_at) goes through here."""
    from functorch.compile import min_cut_rematerialization_partition

    fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **partition_kwargs)
    return rewrite_pair(fw, bw, config=config, num_fwd_outputs=partition_kwargs["num_fwd_outputs"], record=record)


def _partition_variants(joint: fx.GraphModule, joint_inputs, partition_kwargs: dict, *, config: AutoSPConfig,
                        report: CompileReport, variants: Sequence[tuple[str, float | None]]) -> None:
    """Partition copies of ``joint`` under each checkpointing variant ``(setting, sac_memory_budget)`` into
    ``report.variant_graphs`` (docs/design.md, "Trace reuse").  A variant whose tags equal an earlier one's (or the
    compile's own setting's) has the same partition: it gets that one's graphs and is named in
    ``report.variant_same_as``.  The copies are taken before ``joint`` is tagged."""
    own = (config.checkpointing, config.sac_memory_budget)
    copies = {v: graph_copy(joint) for v in variants if v != own}
    own_plan = tag_recomputation(joint.graph, setting=own[0],  # the same tags the compile's own pass sets next
                                 recompute_limit=config.sac_recompute_limit, memory_budget=own[1])
    decided = {(own_plan.saved, own_plan.recomputed): own}
    for variant, graph in copies.items():
        plan = tag_recomputation(graph.graph, setting=variant[0], recompute_limit=config.sac_recompute_limit,
                                 memory_budget=variant[1])
        same = decided.setdefault((plan.saved, plan.recomputed), variant)
        report.variant_plans[variant] = plan
        if same != variant:
            report.variant_same_as[variant] = same
            log.info("checkpointing %s tags the joint graph as %s does: same partition", variant, same)
            continue
        fw, bw = partition_pair(graph, joint_inputs, partition_kwargs, config=config)
        report.partitions += 1
        report.variant_graphs[variant] = [("forward", fw), ("backward", bw)]
    if own in variants:
        report.variant_plans[own] = own_plan


def partition_joint(joint: fx.GraphModule, joint_inputs, partition_kwargs: dict, *, config: AutoSPConfig,
                    report: CompileReport, variants: Sequence[tuple[str, float | None]] = (),
                    tag_joint: JointGraphPass | None = None) -> tuple[fx.GraphModule, fx.GraphModule]:
    """What the backend does with an untagged joint graph (aot_eager): the checkpointing variants' partitions into
    ``report`` (`_partition_variants`), the compile's own checkpointing tags (``tag_joint``, default: ``config``'s,
    their plan recorded in ``report``), the min-cut and the pair's rewrites (`partition_pair`).  The joint graph at
    another length goes through here too (autosp.joint_template.partition_at)."""
    if variants:
        _partition_variants(joint, joint_inputs, partition_kwargs, config=config, report=report, variants=variants)
    if tag_joint is None:
        tag_joint = make_recompute_tagger(setting=config.checkpointing, recompute_limit=config.sac_recompute_limit,
                                          memory_budget=config.sac_memory_budget,
                                          record=report.checkpoint_plans.append)
    tag_joint(joint.graph)
    report.partitions += 1
    report.num_fwd_outputs = partition_kwargs["num_fwd_outputs"]
    return partition_pair(joint, joint_inputs, partition_kwargs, config=config, record=report.offload_plans.append)


# Note [Boxed graphs free their inputs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# AOTAutograd hands a compiled graph its inputs as one list (the boxed calling convention) and lets go of it, so
# that the graph alone owns them: the backward's inputs are the tensors the forward saved, and each should die at
# its last reader (the generated code sets the name to None there).  ``make_boxed_func(graph.forward)`` calls
# ``graph.forward(*args)`` with the list still referenced until the call returns, so every saved activation lived
# to the end of the backward: the residual stream that per-layer checkpointing keeps, offloaded tensors reloaded
# for one layer, the final norm's inputs, all held at the last layer's backward, where the peak is.  The graph run
# is a copy of the recorded graph generated with torch.fx's boxed code (it takes the list, unpacks it and clears
# it); the recorded graph (``report.aot_graphs``, what the export reads) keeps its positional signature.
# Measured on CPU (PeakMemory; hf-llama hidden 64, 2 layers, 6,144 tokens on 2 gloo ranks, per-layer
# checkpointing, tiled loss and MLP): the peak held every tensor the forward saved.


def _boxed_runner(graph: fx.GraphModule):
    """A function of AOTAutograd's boxed calling convention running ``graph`` that frees each input at its last
    reader (Note [Boxed graphs free their inputs])."""
    from torch.fx.graph import _BoxedCodeGen

    runner = fx.GraphModule(graph, copy.deepcopy(graph.graph))
    runner.graph.set_codegen(_BoxedCodeGen())
    runner.recompile()

    def run(args: list):
        return runner.forward(args)

    run._boxed_call = True
    return run


def _aot_eager(gm: fx.GraphModule, example_inputs, *, config: AutoSPConfig, report: CompileReport,
               tag_joint: JointGraphPass, variants: Sequence[tuple[str, float | None]] = (),
               capture_seq_len: int | None = None, joint_only: bool = False):
    from torch._dynamo.backends.common import aot_autograd

    def compiler(kind: str, *, inference: bool = False):
        def compile_graph(graph: fx.GraphModule, inputs):
            if inference:
                graph = rewrite_inference(graph, config)  # a training pair is rewritten in partition_pair
            report.aot_graphs.append((kind, graph))
            return _boxed_runner(graph)

        return compile_graph

    def partition(joint: fx.GraphModule, joint_inputs, **kwargs):
        report.joint_graphs += 1
        if capture_seq_len is not None:  # Note [The joint graph at another length] in autosp/joint_template.py
            report.joint_capture = capture_joint(joint, joint_inputs, kwargs, seq_len=capture_seq_len,
                                                 copy_graph=not joint_only)
            if joint_only:
                raise JointCaptured
        return partition_joint(joint, joint_inputs, kwargs, config=config, report=report, variants=variants,
                               tag_joint=tag_joint)

    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                        inference_compiler=compiler("forward", inference=True), partition_fn=partition)(gm, example_inputs)


def _joint_pass_for_inductor(tag_joint: JointGraphPass, config: AutoSPConfig):
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class RecomputeTags(CustomGraphPass):
        """Inductor's hook for a pass over the joint graph, before its min-cut partitioner."""

        def __call__(self, graph: fx.Graph) -> None:
            tag_joint(graph)

        def uuid(self):
            return ("autosp-recompute-tags", repr(config))  # every option: two configs never share a cache entry

    return RecomputeTags()


def _partitioner_for_inductor(config: AutoSPConfig, report: CompileReport):
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class PairPartitioner(CustomPartitionerFn):
        """Inductor's hook for the partitioner: its min-cut (after its joint passes), then the pair's rewrites."""

        def __call__(self, gm: fx.GraphModule, joint_inputs, **kwargs):
            report.num_fwd_outputs = kwargs["num_fwd_outputs"]
            return partition_pair(gm, joint_inputs, kwargs, config=config, record=report.offload_plans.append)

        def uuid(self):
            return ("autosp-pair-partitioner", repr(config))

    return PairPartitioner()


def _inductor(gm: fx.GraphModule, example_inputs, *, config: AutoSPConfig, report: CompileReport,
              tag_joint: JointGraphPass):
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(graph: fx.GraphModule, inputs, **kwargs):
        if kwargs.get("is_inference"):  # a training pair is rewritten in the partitioner
            graph = rewrite_inference(graph, config)
        report.aot_graphs.append(("backward" if kwargs.get("is_backward") else "forward", graph))
        return compile_fx_inner(graph, inputs, **kwargs)

    # No AOTAutograd cache for this compile: a hit would skip inner_compile, leaving the report (and the
    # export) without graphs.  The patch is scoped to this call.
    patches = {"joint_custom_pre_pass": _joint_pass_for_inductor(tag_joint, config), "fx_graph_cache": False,
               "custom_partitioner_fn": _partitioner_for_inductor(config, report)}
    with functorch_config.patch(enable_autograd_cache=False):
        return compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches)


CODE_GENERATORS = {"aot_eager": _aot_eager, "inductor": _inductor}


def autosp_backend(gm: fx.GraphModule, example_inputs, *, ctx: TraceContext, config: AutoSPConfig,
                   passes: Sequence[Pass] = SEQUENCE_PARALLEL_PASSES, documents: bool = False):
    if len(ctx.programs) >= config.max_programs:
        raise AutoSPError(
            f"this model already holds max_programs={config.max_programs} compiled programs (one per distinct "
            f"shard shape: {sorted({(p.batch_size, p.local_seq_len) for p in ctx.programs})} as (batch, tokens per "
            "rank)); pass length_bucket=N to autosp.compile so that lengths share programs (pads each sequence to "
            "a multiple of N), or raise max_programs")
    start = time.perf_counter()
    ctx.document_attention_compiles = config.compiler != "inductor"  # read by the mask pass
    ctx.mask_probe_tokens = config.mask_probe_tokens
    ctx.documents_program = documents  # Note [Document program] in autosp/model.py
    ctx.report = CompileReport()  # the report describes the latest compile (a recompile starts it afresh)
    gm = run_passes(gm, example_inputs, ctx=ctx, passes=passes)
    ctx.report.forward_graphs.append(gm)
    log.info(
        "AutoSP rewrote %d attention call(s) for sp_size=%d in %.2f s", len(ctx.report.attention_sites),
        ctx.sp_size, time.perf_counter() - start,
    )
    tag_joint = make_recompute_tagger(
        setting=config.checkpointing, recompute_limit=config.sac_recompute_limit,
        memory_budget=config.sac_memory_budget, record=ctx.report.checkpoint_plans.append,
    )
    for setting, _ in ctx.checkpointing_variants:
        if setting not in CHECKPOINTING:
            raise AutoSPError(f"checkpointing variant {setting!r}: choose one of {CHECKPOINTING}")
    if ctx.checkpointing_variants and config.compiler != "aot_eager":
        raise AutoSPError("checkpointing variants (the planner's trace reuse) partition the joint graph through "
                          "AOTAutograd's partition_fn: trace with compiler='aot_eager'")
    if ctx.capture_joint and config.compiler != "aot_eager":
        raise AutoSPError("capturing the joint graph (trace reuse across lengths) goes through AOTAutograd's "
                          "partition_fn: trace with compiler='aot_eager'")
    if ctx.checkpointing_variants or ctx.capture_joint:
        generate = functools.partial(_aot_eager, variants=ctx.checkpointing_variants,
                                     capture_seq_len=ctx.layout.seq_len if ctx.capture_joint else None,
                                     joint_only=ctx.capture_joint and ctx.joint_only)
    else:
        generate = CODE_GENERATORS[config.compiler]
    with lazy_graph_modules():  # Note [Graph modules generate their code when first called] in graph_utils
        program = generate(gm, example_inputs, config=config, report=ctx.report, tag_joint=tag_joint)
    _record_program(ctx, config.compiler, time.perf_counter() - start, documents)
    return ProgramGuard(program, ctx)  # its assumptions checked on every call (autosp.guards)


def _record_program(ctx: TraceContext, compiler: str, seconds: float, documents: bool) -> None:
    layout = ctx.layout
    program = CompiledProgram(seq_len=layout.seq_len if layout else 0,
                              local_seq_len=layout.local_seq_len if layout else 0, batch_size=ctx.batch_size,
                              seconds=seconds, compiler=compiler, documents=documents,
                              why_documents=ctx.why_documents if documents else "")
    ctx.programs.append(program)
    log.info("AutoSP compiled program %d of this model%s: %d tokens (%d per rank), batch %d, with %s in %.1f s",
             len(ctx.programs), " (its document program)" if documents else "", program.seq_len,
             program.local_seq_len, program.batch_size, compiler, seconds)


def make_backend(ctx: TraceContext, config: AutoSPConfig, *, passes: Sequence[Pass] = SEQUENCE_PARALLEL_PASSES,
                 documents: bool = False):
    """The backend of one compiled model; ``passes=()`` compiles without sequence parallelism (sp_size=1) but
    still through AOTAutograd with the configured checkpointing, recording the graphs in the report.
    ``documents``: the backend of the model's document program (Note [Document program] in autosp/model.py)."""
    return functools.partial(autosp_backend, ctx=ctx, config=config, passes=passes, documents=documents)
