"""The workload of a model's full depth from one traced with fewer decoder layers: the middle layer's ops replicated.

Note [Unrolling a traced workload to the model's depth]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
An exported program of a decoder-only model (autosp/export.py) is, op for op, the ops before the layers, each
layer's forward, the ops between (the last layer's end, the head and loss and their backward), each layer's
backward in reverse, and the ops after.  `unroll_depth` builds the program of L layers from one traced with K
(`UNROLL_LAYERS` or more, fewer than L) without tracing the other L - K, and the simulator then runs it whole, so
whatever depends on the whole depth (how far the host link lags the backward under activation offload: the
reloads in flight, the device peak) is simulated, not extrapolated.

Where the layers are cut.  The workload does not label a layer's ops, and the passes put some of a layer's ops
among its neighbours' (activation offload copies a tensor out after its last forward reader and reloads it ahead of
the attention before its first backward reader: Note [Activation offload] in autosp/passes/partitioned/offload.py).
The cuts are right after each layer's last attention op (the ``n / K``-th of a phase's ``n``): the K - 1 forward
units run from one layer's attention to the next one's, the K - 1 backward units likewise in the backward's order,
and forward unit t and backward unit K - 2 - t sit at layer position t.  What is before the first forward cut (the
head), between the last forward cut and the first backward one (the middle) and after the last backward cut (the
tail) is fixed, placed once.  Fixed segments may still hold per-layer items, found by what they read: a run of
ops, one group per position (a pass that copies each layer's tensor out at the forward's end; the offload pass did
so with attention outputs until it stopped counting the partitioner's trailing ``detach`` as a reader), and a
fixed op's allocations, one group per position (the
zero tangents of each layer's KV-cache outputs, which the backward's first op allocates); each is expanded to every
position.  A reference (an op's ``deps``, each freed tensor's allocating op, a wait's start) is read as (container,
position, index): relative to the reader's position where the reader has one, else the head and tail count
positions from the first layer and the middle from the last; items read at every layer's position (the forward's
last op frees every layer's KV-cache outputs) are expanded; a far read of a unit that differs from the middle
layers' (the first backward unit reloads the rotary tables every layer reads) is a read of its one image.

What is replicated.  The units of position 1 (the source), whose references reach the middle layers' units two
positions either way (a reload is issued two layers ahead of its last reader), hence K >= 6: the first forward
unit and the first and last backward units differ from the rest.  The result keeps the trace's other positions at
the ends (0, and K - 2 - j at L - 2 - j) and L - K + 1 copies of the source between them; a reference lands on the
same offset, and must find there a unit whose ops have the same signatures (kind, class, FLOPs, bytes,
collective, allocation sizes, counts of deps and frees) as the trace's target.  Tensors get fresh ids in
allocation order and ops ids in program order, as the export numbers them; a copy's collective keys and op names
get ``@position``.

Where the trace lacks this structure the result would be quietly wrong, so `unroll_depth` refuses
(`simulator.max_length.DepthExtrapolationError`, and the planner traces the full depth, logged): the forward ops
not all before the backward ones; attention ops per phase not a multiple of K; a reference that finds no unit of the
same signatures at its offset; a source op that would free a fixed tensor or read every position (once per copy).
tests/autosp/test_depth_unroll.py compares unrolled programs with traced ones, op for op, and their simulations.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from simulator.max_length import DepthExtrapolationError
from simulator.training_step import GradientReady
from simulator.workload import Op, RankProgram, StaticMemory, Workload

UNROLL_LAYERS = 6
"""The fewest traced layers `unroll_depth` takes: the source units' neighbours up to two positions away are middle
layers' units (Note [Unrolling a traced workload to the model's depth])."""

HEAD, FORWARD, MIDDLE, BACKWARD, TAIL = "head", "forward", "middle", "backward", "tail"
_UNITS = (FORWARD, BACKWARD)
_SOURCE = 1
"""The position of the units that are replicated (Note [Unrolling a traced workload to the model's depth])."""
_COUNTER = re.compile(r"_\d+$")
_LAYER_INDEX = re.compile(r"\.\d+(?=\.|$)")
"""A module index inside an op's name (``forward.all_gather.model.layers.3``: the ZeRO-3 rewrite names its
gathers by module), which corresponding units differ in."""


def _refuse(why: str):
    return DepthExtrapolationError(f"{why}: no layer template (Note [Unrolling a traced workload to the model's depth])")


@dataclass(frozen=True)
class _Segment:
    kind: str
    position: int
    """Its layer position (Note [Unrolling a traced workload to the model's depth])."""
    start: int
    stop: int


def _segments(program: RankProgram, layers: int) -> list[_Segment]:
    """The trace's segments in program order."""
    ops = program.ops
    forward = sum(op.phase == "forward" for op in ops)
    if any(op.phase != "forward" for op in ops[:forward]):
        raise _refuse("the forward's ops are not all before the backward's")
    anchors = {}
    for phase in ("forward", "backward"):
        found = [i for i, op in enumerate(ops) if op.phase == phase and op.kind == "compute"
                 and op.op_class == "attention"]
        if not found or len(found) % layers:
            raise _refuse(f"{len(found)} {phase} attention ops in {layers} layers")
        anchors[phase] = [i + 1 for i in found[len(found) // layers - 1::len(found) // layers]]
    f, b = anchors["forward"], anchors["backward"]  # each just after a layer's last attention op
    return ([_Segment(HEAD, -1, 0, f[0])]
            + [_Segment(FORWARD, t, f[t], f[t + 1]) for t in range(layers - 1)]
            + [_Segment(MIDDLE, layers - 1, f[-1], b[0])]
            + [_Segment(BACKWARD, layers - 2 - j, b[j], b[j + 1]) for j in range(layers - 1)]
            + [_Segment(TAIL, -1, b[-1], len(ops))])


def _signature(op: Op, program: RankProgram, counts: bool = True) -> tuple:
    """What two ops of corresponding units must share (everything but ids, names' counters and keys; ``counts``:
    also how many deps and frees)."""
    c = op.collective
    return (_LAYER_INDEX.sub(".#", _COUNTER.sub("", op.name)), op.kind, op.op_class, op.phase, op.flops, op.bytes_read, op.bytes_written,
            op.attention_scores, None if c is None else (c.kind, c.group, c.message_bytes, c.peer),
            tuple((program.tensors[t], t in program.host_tensors) for t in op.allocates),
            (len(op.frees), len(op.deps)) if counts else None)


@dataclass
class _Template:
    """One rank's trace: its segments, what sits at a layer position, and every reference (`_read`).

    A position's items are in containers: ``("unit", kind)`` (a unit's ops), ``("run", segment)`` (a fixed
    segment's ops that belong to one layer each) and ``("slots", op)`` (a fixed op's allocations that belong to one
    layer each); an item's label is (container, position, index).  A reference is ``("fixed", op[, slot])``,
    ``("pos", container, position, index[, slot])`` or ``("every", positions, container, index[, slot])``."""

    program: RankProgram
    layers: int
    segments: list[_Segment]
    segment_of: list[int] = field(default_factory=list)
    label: dict[int, tuple] = field(default_factory=dict)
    slot_label: dict[tuple[int, int], tuple] = field(default_factory=dict)
    members: dict[tuple, list[int]] = field(default_factory=dict)
    classes: dict[tuple, tuple] = field(default_factory=dict)
    deps: list[tuple] = field(default_factory=list)
    frees: list[tuple] = field(default_factory=list)
    started: dict[int, tuple] = field(default_factory=dict)
    """A ``collective_wait``'s op index -> the reference to its ``collective_start`` (whose key it takes)."""


def _grouped(items: dict[int, int], positions: range) -> list[list[int]] | None:
    """``items`` (index -> position) as one contiguous block of per-position groups in monotone position order,
    each position once; None when they are not."""
    if sorted(set(items.values())) != list(positions) or not items:
        return None
    order = sorted(items)
    if order[-1] - order[0] + 1 != len(order):
        return None
    groups: list[list[int]] = []
    for i in order:
        if groups and items[groups[-1][-1]] == items[i]:
            groups[-1].append(i)
        else:
            groups.append([i])
    steps = {items[b[0]] - items[a[0]] for a, b in zip(groups, groups[1:], strict=False)}
    return groups if len(groups) == len(positions) and len(steps) <= 1 else None


def _read(program: RankProgram, layers: int) -> _Template:
    ops = program.ops
    t = _Template(program=program, layers=layers, segments=_segments(program, layers))
    positions = range(layers - 1)
    t.segment_of = [0] * len(ops)
    for k, s in enumerate(t.segments):
        t.segment_of[s.start:s.stop] = [k] * (s.stop - s.start)
        for i in range(s.start, s.stop) if s.kind in _UNITS else ():
            t.label[i] = (("unit", s.kind), s.position, i - s.start)
    index = {op.id: i for i, op in enumerate(ops)}
    made: dict[int, tuple[int, int]] = {}
    for i, op in enumerate(ops):
        made.update({tensor: (i, slot) for slot, tensor in enumerate(op.allocates)})
    if set(program.tensors) - set(made) or any(x not in made for op in ops for x in op.frees):
        raise _refuse("tensors that no op allocates")

    def targets(i: int) -> list[tuple[int, int | None]]:
        return [(index[d], None) for d in ops[i].deps] + [made[x] for x in ops[i].frees]

    def layer_position(i: int) -> int | None:
        """The layer position op ``i`` of a fixed segment belongs to: the later of the one or two adjacent unit
        positions its deps are in, leaving out what it reads at every layer's."""
        by_item: dict[int, set[int]] = {}
        for d in ops[i].deps:
            if (y := index[d]) in t.label:
                by_item.setdefault(t.label[y][2], set()).add(t.label[y][1])
        found = {q for qs in by_item.values() if not _every(qs) for q in qs}
        return max(found) if found and max(found) - min(found) <= 1 else None

    for k, s in enumerate(t.segments):  # a fixed segment's ops that belong to one layer each
        if s.kind in _UNITS:
            continue
        candidates = {i: q for i in range(s.start, s.stop) if (q := layer_position(i)) is not None}
        blocks: list[dict[int, int]] = []
        for i in sorted(candidates):
            if not blocks or i - 1 not in blocks[-1]:
                blocks.append({})
            blocks[-1][i] = candidates[i]
        for block in blocks:
            groups = _grouped(block, positions)
            if groups and len({tuple(_signature(ops[i], program, False) for i in g) for g in groups}) == 1:
                for g in groups:
                    t.label.update({i: (("run", k), block[i], n) for n, i in enumerate(g)})
                break

    freed_by = {made[x]: i for i, op in enumerate(ops) for x in op.frees}
    for i, op in enumerate(ops):  # a fixed op's allocations that belong to one layer each
        if i in t.label or len(op.allocates) < 2:
            continue
        owners = {slot: t.label[f][1] for slot in range(len(op.allocates))
                  if (f := freed_by.get((i, slot))) is not None and f in t.label}
        groups = _grouped(owners, positions)
        if groups and len({tuple(program.tensors[op.allocates[x]] for x in g) for g in groups}) == 1:
            for g in groups:
                t.slot_label.update({(i, x): (("slots", i), owners[x], n) for n, x in enumerate(g)})
    for i, (c, q, _) in t.label.items():
        t.members.setdefault((c, q), []).append(i)
    for (_, x), (c, q, _) in t.slot_label.items():
        t.members.setdefault((c, q), []).append(x)
    for key, items in t.members.items():
        t.classes[key] = tuple(program.tensors[ops[key[0][1]].allocates[x]] for x in items) if key[0][0] == "slots" \
            else tuple(_signature(ops[i], program, key[0][0] == "unit") for i in items)
    starts = {op.collective.key: i for i, op in enumerate(ops) if op.kind == "collective_start"}
    for i in range(len(ops)):
        if ops[i].kind == "collective_wait":
            t.started[i] = _refs(t, i, [(starts[ops[i].collective.key], None)], deps=True)
        t.deps.append(_refs(t, i, [(index[d], None) for d in ops[i].deps], deps=True))
        t.frees.append(_refs(t, i, [made[x] for x in ops[i].frees], deps=False))
    return t


def _every(qs: set[int]) -> bool:
    """Whether an item read at positions ``qs`` is read at every layer's (the source's and its neighbours')."""
    return {_SOURCE - 1, _SOURCE, _SOURCE + 1} <= qs


def _special(t: _Template, c: tuple, q: int) -> bool:
    """Whether position ``q`` of container ``c`` is not a middle layer's (it differs from the source's)."""
    return t.classes[(c, q)] != t.classes[(c, _SOURCE)]


def _refs(t: _Template, i: int, found: list[tuple[int, int | None]], *, deps: bool) -> tuple:
    """Op ``i``'s references to ``found`` ((op, slot) pairs) in `_Template`'s terms, each once."""
    refs, spread, at = [], {}, t.label.get(i)
    for y, slot in found:
        if y in t.label:
            c, q, j = t.label[y]
            item = (c, j) if deps else (c, j, slot)
        elif (y, slot) in t.slot_label:
            c, q, j = t.slot_label[(y, slot)]
            item = (c, j, None)
        else:
            refs.append(("fixed", y) if deps else ("fixed", y, slot))
            continue
        spread.setdefault(item, {})[q] = (y, slot)
    for item, qs in spread.items():
        if _every(set(qs)):
            refs.append(("every", tuple(sorted(qs)), *item))
            continue
        for q, (y, slot) in sorted(qs.items()):
            if at is not None and abs(q - at[1]) > 1 and _special(t, item[0], q):
                refs.append(("fixed", y) if deps else ("fixed", y, slot))  # a far op of a unit placed once
                continue
            refs.append(("pos", item[0], q, *item[1:]))
    if at is not None and at[1] == _SOURCE and any(r[0] == "every" or r[0] == "fixed" and not deps for r in refs):
        raise _refuse(f"a middle layer's op {t.program.ops[i].name!r} frees or reads what every copy would")
    return tuple(refs)

class _Builder:
    """The ``layers``-layer program from a `_Template` (Note [Unrolling a traced workload to the model's depth])."""

    def __init__(self, t: _Template, layers: int, static: StaticMemory | None):
        self.t, self.layers, self.extra = t, layers, layers - t.layers
        self.ops: list[Op] = []
        self.tensors: dict[int, int] = {}
        self.host: set[int] = set()
        self.allocated: list[tuple[int, ...]] = []
        self.fixed_at: dict[int, int] = {}
        self.fixed_tensor: dict[tuple[int, int], int] = {}
        self.instances: dict[tuple, list[int]] = {}
        self.images: dict[int, list[int]] = {}
        segments = t.segments
        for k, s in enumerate(segments):
            if s.kind == HEAD:
                self._fixed(k)
                for q in range(layers - 1):
                    self._unit(FORWARD, q)
            elif s.kind == MIDDLE:
                self._fixed(k)
                for q in range(layers - 2, -1, -1):
                    self._unit(BACKWARD, q)
            elif s.kind == TAIL:
                self._fixed(k)
        self.program = RankProgram(ops=tuple(self.ops), tensors=self.tensors, host_tensors=frozenset(self.host),
                                   static_memory=static or t.program.static_memory)

    def template_position(self, q: int) -> int:
        """The trace's position whose items the result's position ``q`` copies."""
        return q if q < _SOURCE else _SOURCE if q <= _SOURCE + self.extra else q - self.extra

    def _unit(self, kind: str, q: int) -> None:
        self._instance(("unit", kind), q)

    def _instance(self, c: tuple, q: int) -> None:
        """Emit position ``q``'s ops of container ``c`` (the trace's `template_position`'s)."""
        self.instances[(c, q)] = found = []
        for i in self.t.members[(c, self.template_position(q))]:
            self._emit(i, q, into=found)

    def _fixed(self, k: int) -> None:
        s, t = self.t.segments[k], self.t
        run = ("run", k)
        i = s.start
        while i < s.stop:
            if i in t.label:  # the run: one group per position, in the trace's order of positions
                first, last = t.label[i][1], t.label[max(x for x in range(s.start, s.stop) if x in t.label)][1]
                order = range(self.layers - 1) if first < last else range(self.layers - 2, -1, -1)
                for q in order:
                    self._instance(run, q)
                i = max(x for x in range(s.start, s.stop) if x in t.label) + 1
                continue
            self._emit(i, None)
            i += 1

    def _new_tensor(self, op: Op, slot: int) -> int:
        new = len(self.tensors)
        self.tensors[new] = self.t.program.tensors[op.allocates[slot]]
        if op.allocates[slot] in self.t.program.host_tensors:
            self.host.add(new)
        return new

    def _emit(self, i: int, q: int | None, into: list[int] | None = None) -> None:
        """Append traced op ``i`` at position ``q`` (None: a fixed op), and its index to ``into``."""
        t, op, n = self.t, self.t.program.ops[i], len(self.ops)
        fresh, slots = [], [x for x in range(len(op.allocates)) if (i, x) in t.slot_label]
        for x in range(len(op.allocates)):
            if (i, x) not in t.slot_label:
                fresh.append(self._new_tensor(op, x))
                self.fixed_tensor[(i, x)] = fresh[-1]
            elif x == slots[0]:  # every position's allocations, in the trace's order of positions
                c = ("slots", i)
                first, last = (t.slot_label[(i, y)][1] for y in (slots[0], slots[-1]))
                for p in range(self.layers - 1) if first < last else range(self.layers - 2, -1, -1):
                    self.instances[(c, p)] = [self._new_tensor(op, y) for y in t.members[(c, self.template_position(p))]]
                    fresh += self.instances[(c, p)]
        self.allocated.append(tuple(fresh))
        if into is not None:
            into.append(n)
        if q is None or self.template_position(q) != _SOURCE:  # placed once
            self.fixed_at[i] = n
            self.fixed_tensor.update({(i, x): fresh[x] for x in range(len(op.allocates)) if not slots})
        copy = q is not None and self.template_position(q) == _SOURCE
        frees = sorted(x for r in t.frees[i] for x in self._resolve(r, i, q, tensor=True))
        deps = sorted({x for r in t.deps[i] for x in self._resolve(r, i, q, tensor=False)})
        renamed = copy and q != _SOURCE
        collective = op.collective
        if i in t.started:  # a wait takes its start's key
            collective = self.ops[self._resolve(t.started[i][0], i, q, tensor=False)[0]].collective
        elif renamed and collective is not None:
            collective = dataclasses.replace(collective, key=f"{collective.key}@{q}")
        self.ops.append(dataclasses.replace(op, id=n, name=f"{op.name}@{q}" if renamed else op.name,
                                            deps=tuple(deps), allocates=tuple(fresh), frees=tuple(frees),
                                            collective=collective))
        self.images.setdefault(i, []).append(n)

    def _resolve(self, ref: tuple, i: int, q: int | None, *, tensor: bool) -> list[int]:
        t = self.t
        if ref[0] == "fixed":
            return [self.fixed_tensor[ref[1:]] if tensor else self.fixed_at[ref[1]]]
        if ref[0] == "every":  # each kept position's one image, and every copy of the source
            qs, c, j, slot = (*ref[1:], None)[:4]
            return [self._target(c, at, j, slot, tensor) for at in range(self.layers - 1)
                    if self.template_position(at) in qs]
        c, p, j, slot = (*ref[1:], None)[:4]
        if q is not None:
            at = q + p - t.label[i][1]
        elif _special(t, c, p):  # a fixed op reads a unit placed once
            at = p if p < _SOURCE else p + self.extra
        else:  # or a middle layer's: the middle counts its layers from the last, the head and tail from the first
            at = p + self.extra if t.segments[t.segment_of[i]].kind == MIDDLE else p
        if (c, at) not in self.instances or t.classes[(c, self.template_position(at))] != t.classes[(c, p)]:
            raise _refuse(f"op {t.program.ops[i].name!r} reads an item of layer position {p} that has no "
                          f"counterpart at {self.layers} layers")
        return [self._target(c, at, j, slot, tensor)]

    def _target(self, c: tuple, p: int, j: int, slot: int | None, tensor: bool) -> int:
        found = self.instances[(c, p)][j]
        return found if c[0] == "slots" or not tensor else self.allocated[found][slot]


def unroll_depth(workload: Workload, *, traced_layers: int, layers: int,
                 gradients: Mapping[int, Sequence[GradientReady]] | None = None,
                 static_memory: StaticMemory | None = None, name: str | None = None
                 ) -> tuple[Workload, dict[int, tuple[GradientReady, ...]]]:
    """The workload of ``layers`` decoder layers from ``workload``, traced with ``traced_layers`` (Note [Unrolling a
    traced workload to the model's depth]), and ``gradients`` (per rank: the ops producing the parameters'
    gradients, `simulator.training_step.add_training_step`'s) at their ops there; ``static_memory``: every rank's
    at the full depth (default: the trace's).  `DepthExtrapolationError` where the trace lacks the structure."""
    if traced_layers < UNROLL_LAYERS or layers <= traced_layers:
        raise ValueError(f"unrolling needs {UNROLL_LAYERS} <= traced_layers < layers, got {traced_layers} and "
                         f"{layers}")
    ranks, found = {}, {}
    for rank, program in workload.ranks.items():
        built = _Builder(_read(program, traced_layers), layers, static_memory)
        ranks[rank] = built.program
        position = {op.id: i for i, op in enumerate(program.ops)}
        found[rank] = tuple(sorted((GradientReady(op_id=n, numel=g.numel) for g in (gradients or {}).get(rank, ())
                                    for n in built.images[position[g.op_id]]), key=lambda g: g.op_id))
    return dataclasses.replace(workload, name=name or f"{workload.name}/unrolled to {layers} layers", ranks=ranks,
                               metadata={**workload.metadata, "unrolled_from_layers": traced_layers}), found
