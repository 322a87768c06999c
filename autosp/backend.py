"""The ``torch.compile`` backend: AutoSP passes on the Dynamo graph, then a code generator.

`make_backend` returns a backend closed over one model's `TraceContext` and
`AutoSPConfig`; Dynamo calls it with the graph of one rank's shard.  After the
pass pipeline the graph goes through AOTAutograd, which derives the backward
(including the all-to-alls' own backward) as one joint graph.  Activation
checkpointing tags that joint graph (autosp.passes.joint.checkpointing) before the
min-cut partitioner splits it into forward and backward; the overlap pass
(autosp.passes.partitioned.overlap) then splits each all-to-all into start and wait.  The
graphs go to Inductor or to eager kernels (`AutoSPConfig.compiler`) and are
recorded in the model's `CompileReport` for tests and for the schedule export.

Extension points used: AOTAutograd's ``partition_fn`` and compiler callbacks
(aot_eager), Inductor's ``inner_compile`` and its ``joint_custom_pre_pass`` set
through ``config_patches`` for this one compile (inductor).  Nothing global is
changed, so two compiles in one process do not interact.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence

from torch import fx
from torch._functorch import config as functorch_config

from autosp.config import AutoSPConfig
from autosp.context import CompileReport, TraceContext
from autosp.guards import ProgramGuard
from autosp.passes.joint.checkpointing import make_recompute_tagger
from autosp.passes.partitioned.overlap import overlap_all_to_alls_pass
from autosp.pipeline import SEQUENCE_PARALLEL_PASSES, Pass, run_passes

log = logging.getLogger(__name__)

JointGraphPass = Callable[[fx.Graph], None]


def _finish(kind: str, graph: fx.GraphModule, config: AutoSPConfig, report: CompileReport) -> fx.GraphModule:
    """Last rewrites of one partitioned graph, then record it."""
    if config.overlap_communication:
        graph = overlap_all_to_alls_pass(graph)
    report.aot_graphs.append((kind, graph))
    return graph


def _aot_eager(gm: fx.GraphModule, example_inputs, *, config: AutoSPConfig, report: CompileReport,
               tag_joint: JointGraphPass):
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    def compiler(kind: str):
        def compile_graph(graph: fx.GraphModule, inputs):
            return make_boxed_func(_finish(kind, graph, config, report).forward)

        return compile_graph

    def partition(joint: fx.GraphModule, joint_inputs, **kwargs):
        tag_joint(joint.graph)
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                        partition_fn=partition)(gm, example_inputs)


def _joint_pass_for_inductor(tag_joint: JointGraphPass, config: AutoSPConfig):
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class RecomputeTags(CustomGraphPass):
        """Inductor's hook for a pass over the joint graph, before its min-cut partitioner."""

        def __call__(self, graph: fx.Graph) -> None:
            tag_joint(graph)

        def uuid(self):
            return ("autosp-recompute-tags", repr(config))  # every option: two configs never share a cache entry

    return RecomputeTags()


def _inductor(gm: fx.GraphModule, example_inputs, *, config: AutoSPConfig, report: CompileReport,
              tag_joint: JointGraphPass):
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(graph: fx.GraphModule, inputs, **kwargs):
        graph = _finish("backward" if kwargs.get("is_backward") else "forward", graph, config, report)
        return compile_fx_inner(graph, inputs, **kwargs)

    # No AOTAutograd cache for this compile: a hit would skip inner_compile, leaving the report (and the
    # export) without graphs.  The patch is scoped to this call.
    with functorch_config.patch(enable_autograd_cache=False):
        return compile_fx(gm, example_inputs, inner_compile=inner_compile,
                          config_patches={"joint_custom_pre_pass": _joint_pass_for_inductor(tag_joint, config),
                                          "fx_graph_cache": False})


CODE_GENERATORS = {"aot_eager": _aot_eager, "inductor": _inductor}


def autosp_backend(gm: fx.GraphModule, example_inputs, *, ctx: TraceContext, config: AutoSPConfig,
                   passes: Sequence[Pass] = SEQUENCE_PARALLEL_PASSES):
    start = time.perf_counter()
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
    program = CODE_GENERATORS[config.compiler](gm, example_inputs, config=config, report=ctx.report,
                                               tag_joint=tag_joint)
    return ProgramGuard(program, ctx)  # its assumptions checked on every call (autosp.guards)


def make_backend(ctx: TraceContext, config: AutoSPConfig, *, passes: Sequence[Pass] = SEQUENCE_PARALLEL_PASSES):
    """The backend of one compiled model; ``passes=()`` compiles without sequence parallelism (sp_size=1) but
    still through AOTAutograd with the configured checkpointing, recording the graphs in the report."""
    return functools.partial(autosp_backend, ctx=ctx, config=config, passes=passes)
