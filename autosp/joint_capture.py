"""A trace's joint graph kept before the checkpointing tags (`capture_joint`): what the backend records when
``TraceContext.capture_joint`` is set, so that the graph can be re-sized to other lengths and partitioned again
(Note [The joint graph at another length] in autosp/joint_template.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.utils import _pytree as pytree

from autosp.passes.graph_utils import graph_copy


@dataclass(frozen=True)
class InputSpec:
    """Shape, strides, dtype and device of one joint-graph input."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class JointCapture:
    """AOTAutograd's joint graph of one trace before the checkpointing tags, with what partitioning it needs."""

    seq_len: int
    graph: fx.GraphModule
    inputs: tuple[InputSpec, ...]
    partition_kwargs: dict
    traced: tuple | None = field(default=None, compare=False, repr=False)
    """(fake mode, inputs) of the trace whose fake tensors the graph's nodes hold (`capture_joint`: the joint
    trace's own, Note [The trace's fake tensors] in autosp/joint_template.py); None for a graph without them (`joint_at`)."""


def capture_joint(joint: fx.GraphModule, joint_inputs, partition_kwargs: dict, *, seq_len: int,
                  copy_graph: bool = True) -> JointCapture:
    """A copy of ``joint`` (before it is tagged) and the specs of its inputs; ``copy_graph=False``: ``joint``
    itself, for a compile that stops at the capture (``TraceContext.joint_only``: nothing tags it after)."""
    graph = graph_copy(joint) if copy_graph else joint
    tensors = [t for t in pytree.tree_leaves(joint_inputs) if isinstance(t, torch.Tensor)]
    specs = tuple(InputSpec(tuple(t.shape), tuple(t.stride()), t.dtype, t.device) for t in tensors)
    traced = _trace_fake_tensors(graph, tensors)
    return JointCapture(seq_len=seq_len, graph=graph, inputs=specs, partition_kwargs=dict(partition_kwargs),
                        traced=traced)


def _trace_fake_tensors(graph: fx.GraphModule, inputs: list) -> tuple | None:
    """(fake mode, inputs) of the joint trace when ``inputs`` are its fake tensors and every node of ``graph`` holds
    its ``val`` (each tensor value given its ``tensor_meta`` where it has none, and the output the values it returns,
    as `propagate_fake` would: the constants'); else None (Note [The trace's fake tensors] in autosp/joint_template.py)."""
    modes = {id(t.fake_mode): t.fake_mode for t in inputs if isinstance(t, FakeTensor)}
    nodes = [n for n in graph.graph.nodes if n.op != "output"]
    if len(modes) != 1 or not all(isinstance(t, FakeTensor) for t in inputs) or \
            not all("val" in n.meta for n in nodes):
        return None
    for node in nodes:
        if isinstance(node.meta["val"], torch.Tensor) and "tensor_meta" not in node.meta:
            node.meta["tensor_meta"] = _extract_tensor_metadata(node.meta["val"])
    output = graph.graph.output_node()
    if "val" not in output.meta:  # the values it returns, as the propagation records them
        output.meta["val"] = fx.node.map_arg(output.args[0], lambda n: n.meta["val"])
    return next(iter(modes.values())), inputs
