"""One traced program at other sequence lengths: the joint graph re-sized, not traced again.

Note [The joint graph at another length]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A paper-scale trace of a 32-layer model spends most of its time in Dynamo and in AOTAutograd's joint trace
(together about three quarters; partitioning and export the rest), yet the joint graph it produces is the same
program at every sequence length: the same nodes, targets, names and edges, with the length entering only
through integer arguments (view and expand sizes, split sizes, ``arange`` ends) and the shapes of the inputs.
Activation checkpointing is what does depend on the length (SAC's recompute budget is a share of the whole graph's
FLOPs, whose attention part grows quadratically: Note [Sequence-aware checkpointing] in
autosp/passes/joint/checkpointing.py), and it runs *after* the joint graph exists.

So a trace can capture its joint graph before the checkpointing tags (`autosp.joint_capture.capture_joint`, the backend does it when
``TraceContext.capture_joint`` is set, aot_eager only), and two captures at lengths S1 < S2 give the joint graph
at any length S (`joint_at`): every integer argument that differs between them is affine in the length, and is
set to its value on the line through the two (refused unless that value is an integer); every other argument,
every target and name, and every constant must be equal, or there is no template.  `partition_at` then does
what the backend does after the joint trace, on that graph: fake tensors of the new shapes propagated through
it (the shapes, FLOPs and bytes every later step reads), the compile's own checkpointing tags, torch's min-cut
partitioner and the rewrites of partitioned graphs.  The length-dependent decisions are therefore made afresh,
on the new shapes, exactly as a trace would make them.

This is an assumption about the program (no length-dependent branch between S1 and the length asked for), so
it is checked: a `LengthClass` (used by experiments/paper_scale/simulate.py, Note [One trace per length class]
there, and by the planner's TraceReuse in autosp/plan/prediction.py) exports the re-sized program at a third traced
length and requires it to equal the trace; a class that fails is traced at every length.  Only lengths inside the
traced range are re-sized.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TypeVar

import torch
from torch import fx
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module
from torch.utils import _pytree as pytree

from autosp.backend import partition_joint
from autosp.config import AutoSPConfig
from autosp.context import CompileReport
from autosp.joint_capture import InputSpec, JointCapture

log = logging.getLogger(__name__)
T = TypeVar("T")


class _NoTemplate(Exception):
    """The two captures are not one program with length-affine integers."""


def _affine(a, b, s1: int, s2: int, seq_len: int):
    """The value at ``seq_len`` of an argument that is ``a`` at ``s1`` and ``b`` at ``s2``."""
    if a == b and type(a) is type(b):
        return a
    if type(a) is int and type(b) is int:
        value = a + Fraction(b - a, s2 - s1) * (seq_len - s1)
        if value.denominator != 1:
            raise _NoTemplate(f"{a} at {s1} and {b} at {s2} give {value} at {seq_len}")
        return int(value)
    raise _NoTemplate(f"arguments {a!r} and {b!r} differ")


def _leaves(values, s1: int, s2: int, seq_len: int, first, second):
    a, spec = pytree.tree_flatten(first)
    b, spec_b = pytree.tree_flatten(second)
    if spec != spec_b:
        raise _NoTemplate("argument structures differ")
    out = []
    for x, y in zip(a, b, strict=True):
        if isinstance(x, fx.Node):
            if not isinstance(y, fx.Node) or x.name != y.name:
                raise _NoTemplate(f"edges differ at {x}")
            out.append(values[x])
        else:
            out.append(_affine(x, y, s1, s2, seq_len))
    return pytree.tree_unflatten(out, spec)


def _attribute(module: torch.nn.Module, target: str):
    for name in target.split("."):
        module = getattr(module, name)
    return module


def _shape(value) -> tuple | None:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def joint_at(first: JointCapture, second: JointCapture, seq_len: int) -> JointCapture | None:
    """The joint graph at ``seq_len`` from captures at two other lengths (Note [The joint graph at another
    length]); None when they are not one program whose integers are affine in the length."""
    s1, s2 = first.seq_len, second.seq_len
    try:
        if s1 == s2 or len(first.graph.graph.nodes) != len(second.graph.graph.nodes):
            raise _NoTemplate("different node counts")
        graph = fx.Graph()
        values: dict[fx.Node, fx.Node] = {}
        for x, y in zip(first.graph.graph.nodes, second.graph.graph.nodes, strict=True):
            if (x.op, x.target, x.name) != (y.op, y.target, y.name):
                raise _NoTemplate(f"node {x.name} differs from {y.name}")
            if x.op == "get_attr" and _shape(_attribute(first.graph, x.target)) != \
                    _shape(_attribute(second.graph, y.target)):
                raise _NoTemplate(f"constant {x.target} changes shape")
            node = graph.node_copy(x, lambda n: values[n])
            node.args = _leaves(values, s1, s2, seq_len, x.args, y.args)
            node.kwargs = _leaves(values, s1, s2, seq_len, x.kwargs, y.kwargs)
            node.meta.pop("val", None)
            node.meta.pop("tensor_meta", None)
            values[x] = node
        inputs = tuple(InputSpec(tuple(_affine(a, b, s1, s2, seq_len) for a, b in zip(p.shape, q.shape, strict=True)),
                                 tuple(_affine(a, b, s1, s2, seq_len) for a, b in zip(p.stride, q.stride, strict=True)),
                                 p.dtype, p.device)
                       for p, q in zip(first.inputs, second.inputs, strict=True))
    except (_NoTemplate, ValueError) as why:
        log.info("no joint-graph template between %d and %d tokens: %s", s1, s2, why)
        return None
    graph.lint()
    with _use_lazy_graph_module(True):  # no Python code generated: the graph is interpreted, never called
        module = _make_graph_module(first.graph, graph)
    return JointCapture(seq_len=seq_len, graph=module, inputs=inputs, partition_kwargs=first.partition_kwargs)


# Note [The trace's fake tensors]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A joint graph re-sized by `joint_at` holds no tensor metadata, so `partition_at` propagates fake tensors of the
# new shapes through it first (`propagate_fake`).  A joint graph captured from a trace (`capture_joint`) already
# holds them: AOTAutograd's joint trace ran on fake tensors of one fake mode and left each node's ``val`` (and
# ``tensor_meta``, but for the constants' ``get_attr`` nodes, which get theirs from their ``val`` as the
# propagation would give it), the values the same kernels give on the same inputs (but for ``requires_grad``: the
# trace's parameters require grad, as in the backend's own partition, the propagated ones do not; the min-cut reads
# it only to match graphs across real ranks).  So the capture keeps that mode
# and its inputs (`JointCapture.traced`) and `propagate_fake` hands them back instead of propagating again: the
# planner's shallow traces partition every captured joint graph (each strategy's, each depth's) this way
# (`autosp.plan.step._shallow_sac_step`), and the predictions are the same floats as with the propagation.


def propagate_fake(capture: JointCapture) -> tuple:
    """Fake tensors of ``capture``'s shapes propagated through its joint graph (each node's ``val`` and
    ``tensor_meta``): (fake mode, inputs), for `partition_at`; the trace's own for a graph captured from a trace
    (Note [The trace's fake tensors])."""
    if capture.traced is not None:  # Note [The trace's fake tensors]
        return capture.traced
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    from torch.fx.passes.shape_prop import _extract_tensor_metadata

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        inputs = [torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device=s.device) for s in capture.inputs]
    FakeTensorProp(capture.graph, mode).propagate_dont_convert_inputs(*inputs)
    for node in capture.graph.graph.nodes:
        if isinstance(node.meta.get("val"), torch.Tensor):
            node.meta["tensor_meta"] = _extract_tensor_metadata(node.meta["val"])
    return mode, inputs


def partition_at(capture: JointCapture, config: AutoSPConfig, variants: Sequence[tuple[str, float | None]] = (),
                 tag_joint: Callable[[fx.Graph], None] | None = None, propagated: tuple | None = None):
    """What the backend makes from the joint graph of ``capture`` (a `autosp.context.CompileReport` with its
    ``aot_graphs``, and with ``variants``, (checkpointing, sac_memory_budget) pairs, each variant's partition as
    checkpointing variants of a trace have them): fake tensors of its shapes propagated (`propagate_fake`;
    ``propagated``: its answer for a graph whose nodes' metadata it already holds, a copy of the one propagated),
    then `autosp.backend.partition_joint` (the checkpointing tags of ``config``, or ``tag_joint``'s, the min-cut
    partitioner, the pair's rewrites; Note [The joint graph at another length])."""
    mode, inputs = propagate_fake(capture) if propagated is None else propagated
    report = CompileReport()
    # Lazy graph modules (torch's own switch, scoped to this block): the partitioned graphs are exported, never
    # called, so their Python code is not generated.
    with mode, _use_lazy_graph_module(True):
        fw, bw = partition_joint(capture.graph, inputs, capture.partition_kwargs, config=config, report=report,
                                 variants=tuple(variants), tag_joint=tag_joint)
    report.joint_graphs = 1
    report.aot_graphs = [("forward", fw), ("backward", bw)]
    return report


RESIZED, INTERPOLATED = "resized", "interpolated"


@dataclass
class LengthClass:
    """The traces of one program (one model, depth, rank count and option set) at several lengths, and when a
    length is traced or built from them (Note [One trace per length class] in experiments/paper_scale/simulate.py,
    Note [The joint graph at another length] here).  ``how``: `RESIZED` (the joint graphs of the first two traces
    re-sized, `resize`) or `INTERPOLATED` (the caller's own build from its first three traces).  The first
    ``anchors`` lengths asked for are traced, the next one too, where the built program must equal the trace
    (``==``, `get`), or every length is traced; after that a length strictly inside the traced range is built and
    one outside it traced (the range widens).  The callers: the paper-scale experiments' ``TraceCache`` and the
    planner's ``TraceReuse`` (autosp/plan/prediction.py)."""

    how: str = RESIZED
    lengths: list[int] = field(default_factory=list)
    """Lengths traced, in the order asked for: the first `anchors` are the anchors, the next one the check."""
    checked: bool | None = None
    """Whether the program built at the check length equalled its trace (None: not yet)."""
    captures: list[JointCapture] = field(default_factory=list)
    """`RESIZED`: the joint graphs of the two anchors."""
    config: AutoSPConfig | None = None
    """`RESIZED`: the configuration the first capturing trace compiled with."""
    facts: object = None
    """What the caller needs from the first capturing trace to export a re-sized program (its own type)."""

    @property
    def anchors(self) -> int:
        return 3 if self.how == INTERPOLATED else 2

    def traces(self, seq_len: int) -> bool:
        """Whether ``seq_len`` is traced (not built): an anchor, the check, unchecked, or outside the range."""
        return seq_len in self.lengths or not (self.checked and min(self.lengths) < seq_len < max(self.lengths))

    def add_capture(self, capture: JointCapture, config: AutoSPConfig, facts: object = None) -> None:
        """Keep the joint graph of a trace `get` asked to capture (its ``trace(True)``)."""
        self.captures.append(capture)
        if self.config is None:
            self.config, self.facts = config, facts

    def resize(self, seq_len: int, config: AutoSPConfig | None = None,
               variants: Sequence[tuple[str, float | None]] = ()):
        """`partition_at` of the joint graph at ``seq_len`` re-sized from the two captures (``config``: default the
        captured trace's); None when they are not one re-sizable program."""
        capture = joint_at(*self.captures, seq_len) if len(self.captures) == 2 else None
        return None if capture is None else partition_at(capture, config or self.config, variants)

    def get(self, seq_len: int, *, trace: Callable[[bool], T], build: Callable[[], T | None],
            what: str = "") -> tuple[T, bool]:
        """The program at ``seq_len`` and whether it was built (True) or traced: ``trace(capture)`` traces it
        (with ``capture``, handing its joint graph to `add_capture`), ``build()`` builds it from the anchors (None:
        not this class's program at this length)."""
        if self.traces(seq_len):
            traced = trace(self.how == RESIZED and len(self.captures) < 2 and seq_len not in self.lengths)
            if seq_len not in self.lengths:
                self.lengths.append(seq_len)
            if len(self.lengths) == self.anchors + 1 and self.checked is None:
                self.checked = build() == traced
                if not self.checked:
                    log.warning("%s: the program %s at %d tokens differs from its trace; tracing every length "
                                "instead", what, self.how, seq_len)
            return traced, False
        found = build()
        if found is None:  # not this class's program at this length (a number that is not an integer)
            log.warning("%s: not %s at %d tokens; traced", what, self.how, seq_len)
            return trace(False), False
        return found, True
