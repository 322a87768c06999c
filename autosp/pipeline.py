"""The ordered list of AutoSP's Dynamo-stage passes and a generic runner that logs what each pass changed."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from torch import fx

from autosp.config import MEMORY_TECHNIQUES, AutoSPConfig
from autosp.context import TraceContext
from autosp.passes.dynamo.cleanup import eliminate_dead_code_pass, refresh_metadata_pass
from autosp.passes.dynamo.loss import exact_causal_lm_loss_pass
from autosp.passes.dynamo.masks import attention_mask_pass
from autosp.passes.dynamo.sharding import sequence_sharding_pass
from autosp.passes.dynamo.tag_inputs import tag_sequence_inputs_pass
from autosp.passes.graph_utils import op_counts
from autosp.techniques import MemoryTechnique

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


def passes_for(config: AutoSPConfig, techniques: tuple[MemoryTechnique, ...] = MEMORY_TECHNIQUES) -> tuple[Pass, ...]:
    """The Dynamo-stage passes of one compile: the sequence-parallel passes with, after the loss rule, the pass of
    each Dynamo-stage memory technique of ``techniques`` active in ``config``, in registry order
    (`MemoryTechnique.make_pass`): the tiled loss (Note [Tiled loss pass]; it tiles the local loss sum the loss
    rule leaves), then the tiled MLP (Note [Tiled MLP pass]).  They run before the analysis, which classifies their
    ops like any other.  Without sequence parallelism (sp_size=1) only those passes run, when enabled."""
    tiled = tuple(t.make_pass(config) for t in techniques
                  if t.stage == "dynamo" and getattr(config, t.option) in t.active)
    if not tiled:
        return () if config.sp_size == 1 else SEQUENCE_PARALLEL_PASSES
    if config.sp_size == 1:
        return (tag_sequence_inputs_pass, *tiled, eliminate_dead_code_pass)
    at = SEQUENCE_PARALLEL_PASSES.index(exact_causal_lm_loss_pass) + 1
    return SEQUENCE_PARALLEL_PASSES[:at] + tiled + SEQUENCE_PARALLEL_PASSES[at:]


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
