"""The ordered list of AutoSP's Dynamo-stage passes and a generic runner that logs what each pass changed."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from torch import fx

from autosp.context import TraceContext
from autosp.passes.dynamo.cleanup import eliminate_dead_code_pass, refresh_metadata_pass
from autosp.passes.dynamo.loss import exact_causal_lm_loss_pass
from autosp.passes.dynamo.masks import attention_mask_pass
from autosp.passes.dynamo.sharding import sequence_sharding_pass
from autosp.passes.dynamo.tag_inputs import tag_sequence_inputs_pass
from autosp.passes.graph_utils import op_counts

log = logging.getLogger(__name__)

Pass = Callable[..., fx.GraphModule]

SEQUENCE_PARALLEL_PASSES: tuple[Pass, ...] = (
    tag_sequence_inputs_pass,
    attention_mask_pass,
    exact_causal_lm_loss_pass,
    sequence_sharding_pass,
    eliminate_dead_code_pass,
    refresh_metadata_pass,
)
"""Stage 1 (autosp.passes.dynamo): Dynamo graph of one rank's shard, single-device semantics -> exact
sequence-parallel graph.  The loss rule runs before the analysis (it removes the model's own label shift,
which would otherwise read as a slice of the token axis); the analysis applies the other rules."""


def run_passes(
    gm: fx.GraphModule, example_inputs, *, ctx: TraceContext, passes: Sequence[Pass] = SEQUENCE_PARALLEL_PASSES
) -> fx.GraphModule:
    for graph_pass in passes:
        before = op_counts(gm)
        start = time.perf_counter()
        gm = graph_pass(gm, example_inputs, ctx=ctx)
        ctx.report.pass_seconds[graph_pass.__name__] = time.perf_counter() - start
        after = op_counts(gm)
        delta = {k: after[k] - before[k] for k in set(before) | set(after) if after[k] != before[k]}
        ctx.report.pass_op_deltas.append((graph_pass.__name__, delta))
        if delta:
            log.debug("%s changed op counts: %s", graph_pass.__name__, delta)
    return gm
