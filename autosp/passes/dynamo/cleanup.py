"""Remove what the rewrites left dead and refresh every node's fake-tensor metadata.

Rewrites change shapes (a removed label shift, a gathered sequence), so each
node's ``example_value`` is recomputed by running the graph on fake tensors: the
metadata later passes and the exporter read is always the graph's truth.
"""

from __future__ import annotations

import logging

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from autosp.context import TraceContext
from autosp.passes.graph_utils import EXAMPLE_VALUE, eliminate_dead_code

log = logging.getLogger(__name__)


def eliminate_dead_code_pass(gm: fx.GraphModule, example_inputs, *, ctx: TraceContext) -> fx.GraphModule:
    eliminate_dead_code(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return gm


def refresh_metadata_pass(gm: fx.GraphModule, example_inputs, *, ctx: TraceContext) -> fx.GraphModule:
    # Re-run on the placeholders' own fake values: they belong to Dynamo's fake mode,
    # whatever the example inputs are (real tensors, or fakes of a user's mode).
    fake_inputs = [n.meta.get(EXAMPLE_VALUE) for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode([v for v in fake_inputs if isinstance(v, torch.Tensor)])
    if fake_mode is None or any(v is None for v in fake_inputs):
        return gm
    try:
        FakeTensorProp(gm, fake_mode).propagate_dont_convert_inputs(*fake_inputs)
    except AssertionError as err:
        # Constants captured from a user's own FakeTensorMode (paper-scale tracing) cannot be
        # mixed with Dynamo's; AOTAutograd re-derives all shapes anyway.
        log.debug("metadata not refreshed: %s", err)
        return gm
    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta[EXAMPLE_VALUE] = node.meta["val"]
    return gm
