"""The ordered list of AutoSP passes and a generic runner that logs what each pass changed."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from torch import fx

from autosp.context import TraceContext
from autosp.passes.attention import insert_all_to_all_pass
from autosp.passes.cleanup import eliminate_dead_code_pass, refresh_metadata_pass
from autosp.passes.graph_utils import op_counts
from autosp.passes.loss import exact_causal_lm_loss_pass
from autosp.passes.positions import offset_positions_pass
from autosp.passes.tag_inputs import tag_sequence_inputs_pass

log = logging.getLogger(__name__)

Pass = Callable[..., fx.GraphModule]

SEQUENCE_PARALLEL_PASSES: tuple[Pass, ...] = (
    tag_sequence_inputs_pass,
    offset_positions_pass,
    insert_all_to_all_pass,
    exact_causal_lm_loss_pass,
    eliminate_dead_code_pass,
    refresh_metadata_pass,
)
"""Dynamo graph (one rank's shard, single-device semantics) -> exact sequence-parallel graph."""


def run_passes(
    gm: fx.GraphModule, example_inputs, *, ctx: TraceContext, passes: Sequence[Pass] = SEQUENCE_PARALLEL_PASSES
) -> fx.GraphModule:
    for graph_pass in passes:
        before = op_counts(gm)
        gm = graph_pass(gm, example_inputs, ctx=ctx)
        after = op_counts(gm)
        delta = {k: after[k] - before[k] for k in set(before) | set(after) if after[k] != before[k]}
        ctx.report.pass_op_deltas.append((graph_pass.__name__, delta))
        if delta:
            log.debug("%s changed op counts: %s", graph_pass.__name__, delta)
    return gm
