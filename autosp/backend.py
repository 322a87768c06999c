"""The ``torch.compile`` backend: AutoSP passes on the Dynamo graph, then a code generator.

`make_backend` returns a backend closed over one model's `TraceContext`; Dynamo
calls it with the graph of one rank's shard.  After the pass pipeline the graph
goes through AOTAutograd (which derives the backward, including the all-to-alls'
own backward) to Inductor or to eager kernels (`AutoSPConfig.compiler`).  The
forward and backward graphs AOTAutograd produces are recorded in the model's
`CompileReport` for tests and for the schedule export.
"""

from __future__ import annotations

import functools
import logging
import time

from torch import fx

from autosp.context import CompileReport, TraceContext
from autosp.pipeline import run_passes

log = logging.getLogger(__name__)


def _aot_eager(gm: fx.GraphModule, example_inputs, report: CompileReport):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def recorder(kind: str):
        def compiler(graph: fx.GraphModule, inputs):
            report.aot_graphs.append((kind, graph))
            return make_boxed_func(graph.forward)

        return compiler

    return aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))(gm, example_inputs)


def _inductor(gm: fx.GraphModule, example_inputs, report: CompileReport):
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(graph: fx.GraphModule, inputs, **kwargs):
        report.aot_graphs.append(("backward" if kwargs.get("is_backward") else "forward", graph))
        return compile_fx_inner(graph, inputs, **kwargs)

    return compile_fx(gm, example_inputs, inner_compile=inner_compile)


CODE_GENERATORS = {"aot_eager": _aot_eager, "inductor": _inductor}


def autosp_backend(gm: fx.GraphModule, example_inputs, *, ctx: TraceContext, compiler: str):
    start = time.perf_counter()
    gm = run_passes(gm, example_inputs, ctx=ctx)
    ctx.report.forward_graphs.append(gm)
    log.info(
        "AutoSP rewrote %d attention call(s) for sp_size=%d in %.2f s", len(ctx.report.attention_sites),
        ctx.sp_size, time.perf_counter() - start,
    )
    return CODE_GENERATORS[compiler](gm, example_inputs, ctx.report)


def make_backend(ctx: TraceContext, compiler: str):
    return functools.partial(autosp_backend, ctx=ctx, compiler=compiler)
