"""Shallow traces checkpointed as the full model: how the planner decides fast (docs/design.md, "Deciding fast").

Note [Shallow traces checkpointed for the full depth]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Most of a decision's time is tracing the full model once per candidate (Dynamo, AOTAutograd's joint trace, the
min-cut partition and the export all grow with the depth).  Under a checkpointing setting that tags every decoder
layer alike ("none", "full", "layer", "long-context") the step of L layers is the straight line through the steps
traced at 1 and 2 layers (`simulator.max_length.extrapolate_depth`, Note [Depth extrapolation] there, which
refuses a line that falls with the depth).  SAC does not tag layers alike: its recompute budget is a share of the
whole forward's FLOPs and it takes matmuls cheapest per byte first, ties broken by node name (Note
[Sequence-aware checkpointing]), so a one- or two-layer graph, its LM head a large share of its FLOPs, recomputes
a different part of each layer than the full graph does.

So the planner's shallow traces do not let SAC decide for their own graph: they take the full model's decision.
That decision is a pure function of per-node costs (`choose_recomputation`), and a two-layer graph gives the full
graph's candidates: the ops outside the decoder layers as they are, each layer's ops L times, with the names the
full graph gives them (torch.fx names a node by its op's base name and a counter per base, so layer j's copy of a
node named ``mm_n`` in layer 0 is ``mm_{n + j·Δ}``, Δ the count of that base per layer, read off layers 0 and 1;
a node after the layers moves up by (L - 2)·Δ), and the forward FLOPs as the ops outside plus L times a layer's.
`full_depth_sac` runs SAC's own `choose_recomputation` on that list (same limit, same budget, same order).

The full model's layers need not all decide alike: the budget usually ends inside a tie (q, k, v, o, gate and up of
every layer cost the same per byte when the hidden size is their reduction dimension), so some layers recompute a
matmul that others keep.  A shallow program cannot recompute a fraction of a layer, so two of them bracket the
full one: ``every`` (the matmuls that every layer of the full model recomputes) and ``some`` (those that any layer
recomputes), each partitioned from the same 1- and 2-layer joint graphs, tagged alike in every layer, and
extrapolated; the step is their mix by `FullDepthSAC.share`, the fraction of the bytes between the two that the
full model recomputes (tied matmuls cost the same FLOPs per byte, so which of them a layer recomputes changes the
step little, how many bytes does).  The planner falls back to tracing every layer, and logs it, when the shallow
graphs do not have the structure this assumes (`DepthExtrapolationError`) or a line falls with the depth.
experiments/bench_planner.py --compare measures the decisions and predictions against full-depth traces.

Activation offload is not extrapolated by a line: a reload's device buffer is allocated when its copy is issued,
and how many reloads are in flight at once depends on how far the host link lags the backward over the whole
depth, which a line through 1 and 2 layers does not see (Llama-3.1-8B, 8 ranks, 131,072 tokens: 39.41 GiB
extrapolated against 42.62 GiB traced for SAC with offload, -7.5 %).  Its plans are traced at
`simulator.depth_unroll.UNROLL_LAYERS` (six) layers, the trace's middle layer replicated to the full depth, and that
whole program simulated (Note [Unrolling a traced workload to the model's depth] in simulator/depth_unroll.py;
`autosp.plan.step._unrolled_step`): the host link's lag over the whole depth is simulated, not extrapolated.  Under
SAC the six-layer joint graph takes the full model's decision from the two-layer one as above, ``every`` and
``some`` are each unrolled and simulated, and mixed by `FullDepthSAC.share`.  A model of at most six layers is traced
whole; where the trace lacks the structure the unrolling needs (`DepthExtrapolationError`) the full depth is
traced, logged.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from torch import fx

from autosp.passes.graph_utils import layer_of
from autosp.passes.joint.checkpointing import Candidate, choose_recomputation, tag_recomputation
from simulator.max_length import DepthExtrapolationError

EVERY, SOME = "every", "some"
"""The two shallow programs that bracket the full model's SAC decision (Note [Shallow traces checkpointed for the
full depth])."""

_NAME = re.compile(r"^([a-zA-Z_][0-9a-zA-Z_]*?)(?:_(\d+))?$")
"""torch.fx's rule for a node name: a base and a counter (none for the first)."""


def _named(name: str, layers: int, deltas: Mapping[str, int]) -> str:
    """``name`` of a node moved up by ``layers`` layers (Δ per base: ``deltas``)."""
    base, number = _NAME.match(name).groups()
    number = int(number or 0) + layers * deltas.get(base, 0)
    return base if number == 0 else f"{base}_{number}"


def _split(candidates: Mapping[fx.Node, Candidate]) -> tuple[dict[int, list[Candidate]], list[Candidate]]:
    """The candidates by layer and those outside the layers, each in program order."""
    layers: dict[int, list[Candidate]] = {}
    outside = []
    for node, candidate in candidates.items():
        layer = layer_of(node)
        (outside if layer is None else layers.setdefault(layer, [])).append(candidate)
    return layers, outside


def _matmuls(candidates: list[Candidate]) -> list[Candidate]:
    return [c for c in candidates if c.op_class == "matmul"]


@dataclass(frozen=True)
class FullDepthSAC:
    """SAC's decision for the full model, per layer (`full_depth_sac`).  A layer's matmuls are named by their
    position among its matmuls (the last layer may have other cheap candidates than the rest: its output is not
    read across an attention, so it is not kept as the residual stream between layers is)."""

    model_layers: int
    matmul_bytes: tuple[int, ...]
    """Output bytes of each matmul of one layer, by position."""
    per_layer: tuple[frozenset[int], ...]
    """For each layer of the full model: the positions of the matmuls it recomputes."""
    outside: frozenset[int]
    """Positions, among the matmuls outside the layers (the LM head), of those recomputed."""
    outside_count: int
    """Matmuls outside the layers."""

    @property
    def every(self) -> frozenset[int]:
        return frozenset.intersection(*self.per_layer)

    @property
    def some(self) -> frozenset[int]:
        return frozenset.union(*self.per_layer)

    @property
    def patterns(self) -> tuple[str, ...]:
        return (EVERY,) if self.every == self.some else (EVERY, SOME)

    @property
    def share(self) -> float:
        """The fraction of the bytes between ``every`` and ``some`` that the full model recomputes (0 when
        they are equal)."""
        def size(positions):
            return sum(self.matmul_bytes[p] for p in positions)

        between = size(self.some) - size(self.every)
        if between == 0:
            return 0.0
        return (sum(size(p) for p in self.per_layer) - len(self.per_layer) * size(self.every)) / (
            len(self.per_layer) * between)

    def names(self, candidates: Mapping[fx.Node, Candidate], pattern: str) -> set[str]:
        """What a shallow graph with these ``candidates`` recomputes under ``pattern`` (`EVERY` or `SOME`): its
        cheap ops, in each of its layers the matmuls of the pattern, outside them the full model's choice."""
        layers, outside = _split(candidates)
        positions = self.every if pattern == EVERY else self.some
        if len(_matmuls(outside)) != self.outside_count or any(len(_matmuls(c)) != len(self.matmul_bytes)
                                                               for c in layers.values()):
            raise DepthExtrapolationError("the shallow graphs differ in the matmuls of a layer or outside the "
                                          "layers: no depth template")
        chosen = {c.name for c in candidates.values() if c.op_class != "matmul"}
        for layer in layers.values():
            chosen |= {c.name for p, c in enumerate(_matmuls(layer)) if p in positions}
        return chosen | {c.name for i, c in enumerate(_matmuls(outside)) if i in self.outside}


def full_depth_sac(candidates: Mapping[fx.Node, Candidate], flops: Mapping[fx.Node, int], *, model_layers: int,
                   recompute_limit: float, memory_budget: float | None) -> FullDepthSAC:
    """SAC's decision for ``model_layers`` layers from the candidates and forward FLOPs of a two-layer joint graph
    (`autosp.passes.joint.checkpointing.tag_recomputation`'s ``decide`` arguments; Note [Shallow traces
    checkpointed for the full depth]): layers 0 to L - 2 as its layer 0, layer L - 1 as its layer 1 (the last);
    `DepthExtrapolationError` when the graph is not two layers with the same matmuls."""
    layers, outside = _split(candidates)
    if sorted(layers) != [0, 1]:
        raise DepthExtrapolationError(f"the depth template needs a graph of layers 0 and 1, not {sorted(layers)}")
    first, last = layers[0], layers[1]
    if [(c.flops, c.nbytes) for c in _matmuls(first)] != [(c.flops, c.nbytes) for c in _matmuls(last)]:
        raise DepthExtrapolationError("the two layers' matmuls differ: no depth template")
    layer_flops = {0: 0, 1: 0}
    outside_flops = 0
    for node, f in flops.items():
        layer = layer_of(node)
        if layer is None:
            outside_flops += f
        else:
            layer_flops[layer] += f
    deltas: dict[str, int] = {}
    for a, b in zip(_matmuls(first), _matmuls(last), strict=True):
        (base, n), (base_b, m) = _NAME.match(a.name).groups(), _NAME.match(b.name).groups()
        delta = int(m or 0) - int(n or 0)
        if base != base_b or deltas.setdefault(base, delta) != delta:
            raise DepthExtrapolationError(f"node names {a.name} and {b.name} of the two layers are not one counter "
                                          "apart: no depth template")
    order = {node: i for i, node in enumerate(flops)}
    nodes = {c.name: node for node, c in candidates.items()}
    end = max(order[nodes[c.name]] for c in last)
    full = [replace(c, name=_named(c.name, model_layers - 2, deltas)) if order[nodes[c.name]] > end else c
            for c in outside]
    middle = [[replace(c, name=_named(c.name, j, deltas)) for c in first] for j in range(model_layers - 1)]
    final = [replace(c, name=_named(c.name, model_layers - 2, deltas)) for c in last]
    full += [c for layer in middle for c in layer] + final
    if len({c.name for c in full if c.op_class == "matmul"}) != sum(c.op_class == "matmul" for c in full):
        raise DepthExtrapolationError("the full model's matmul names would collide: no depth template")
    chosen = choose_recomputation(
        full, forward_flops=outside_flops + (model_layers - 1) * layer_flops[0] + layer_flops[1],
        recompute_limit=recompute_limit, memory_budget=memory_budget)
    per_layer = tuple(frozenset(p for p, c in enumerate(_matmuls(layer)) if c.name in chosen)
                      for layer in (*middle, final))
    return FullDepthSAC(model_layers=model_layers, matmul_bytes=tuple(c.nbytes for c in _matmuls(first)),
                        per_layer=per_layer,
                        outside=frozenset(i for i, c in enumerate(_matmuls(full[:len(outside)])) if c.name in chosen),
                        outside_count=len(_matmuls(outside)))


class FullDepthTagger:
    """SAC's tags for the shallow graphs of one program: the first graph tagged (two layers) decides for
    ``model_layers`` (`full_depth_sac`), every graph is then tagged by ``pattern`` of that decision."""

    def __init__(self, *, model_layers: int, recompute_limit: float, memory_budget: float | None):
        self.model_layers, self.recompute_limit, self.memory_budget = model_layers, recompute_limit, memory_budget
        self.decision: FullDepthSAC | None = None

    def tagger(self, pattern: str) -> Callable[[fx.Graph], None]:
        def decide(candidates: dict[fx.Node, Candidate], flops: dict[fx.Node, int]) -> set[str]:
            if self.decision is None:
                self.decision = full_depth_sac(candidates, flops, model_layers=self.model_layers,
                                               recompute_limit=self.recompute_limit, memory_budget=self.memory_budget)
            return self.decision.names(candidates, pattern)

        def tag(graph: fx.Graph) -> None:
            tag_recomputation(graph, setting="sac", recompute_limit=self.recompute_limit,
                              memory_budget=self.memory_budget, decide=decide)

        return tag
