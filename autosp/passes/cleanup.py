"""Remove what the rewrites left dead and refresh every node's fake-tensor metadata.

Rewrites change shapes (a removed label shift, a gathered sequence), so each
node's ``example_value`` is recomputed by running the graph on fake tensors: the
metadata later passes and the exporter read is always the graph's truth.
"""

from __future__ import annotations

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from autosp.context import TraceContext
from autosp.passes.graph_utils import EXAMPLE_VALUE


def eliminate_dead_code_pass(gm: fx.GraphModule, example_inputs, *, ctx: TraceContext) -> fx.GraphModule:
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm


def refresh_metadata_pass(gm: fx.GraphModule, example_inputs, *, ctx: TraceContext) -> fx.GraphModule:
    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        fake_mode = detect_fake_mode([n.meta.get(EXAMPLE_VALUE) for n in placeholders])
    if fake_mode is None:
        return gm
    with fake_mode:
        fake_inputs = [
            fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) and not isinstance(x, torch._subclasses.FakeTensor)
            else x
            for x in example_inputs
        ]
    FakeTensorProp(gm, fake_mode).propagate_dont_convert_inputs(*fake_inputs)
    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta[EXAMPLE_VALUE] = node.meta["val"]
    return gm
