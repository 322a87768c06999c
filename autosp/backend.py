"""The ``torch.compile`` backend: AutoSP passes on the Dynamo graph, then a code generator.

`make_backend` returns a backend closed over one model's `TraceContext`; Dynamo
calls it with the graph of one rank's shard.  After the pass pipeline the graph
goes to AOTAutograd with Inductor or eager kernels (`AutoSPConfig.compiler`).
"""

from __future__ import annotations

import functools
import logging
import time

from torch import fx

from autosp.context import TraceContext
from autosp.pipeline import run_passes

log = logging.getLogger(__name__)


def _code_generator(compiler: str):
    if compiler == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx
    from torch._dynamo.backends.debugging import aot_eager

    return aot_eager


def autosp_backend(gm: fx.GraphModule, example_inputs, *, ctx: TraceContext, compiler: str):
    start = time.perf_counter()
    gm = run_passes(gm, example_inputs, ctx=ctx)
    ctx.report.forward_graphs.append(gm)
    log.info(
        "AutoSP rewrote %d attention call(s) for sp_size=%d in %.2f s", len(ctx.report.attention_sites),
        ctx.sp_size, time.perf_counter() - start,
    )
    return _code_generator(compiler)(gm, example_inputs)


def make_backend(ctx: TraceContext, compiler: str):
    return functools.partial(autosp_backend, ctx=ctx, compiler=compiler)
