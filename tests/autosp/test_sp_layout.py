"""One rank layout per sequence-parallel kind (`simulator.workload.SPLayout`), read by every consumer.

(a) The layout's rank tuples are the process groups `autosp.groups.build_groups` makes (on fake groups, every rank),
the registry's `Strategy.sp_groups` and the export's groups and ring neighbours (one traced hybrid and ring program);
(b) the first step of docs/design.md, "Adding a sequence-parallel kind", followed with a toy layout: a subclass that
places the ranks otherwise in one method, and the groups built from it follow with no other change.
"""

from __future__ import annotations

import pytest
import torch

from simulator.sp_layout import COMPILED_STRATEGIES, MEMORY_PLANNED_STRATEGIES, ZIGZAG_STRATEGIES
from simulator.workload import SPKind, SPLayout, SPLayoutError
from tests.harness.fake_group import fake_process_group

COMBINATIONS = [(4, 2, 4), (4, 2, 8), (8, 2, 8), (8, 4, 16), (6, 3, 12), (4, 1, 8), (4, 4, 8), (2, 1, 2)]
"""(sp_size, ulysses_size, world_size) of hybrids: 1 is the ring alone, sp_size Ulysses over a ring of one."""


def _process_groups(world: int, sp: int, **kw) -> dict[int, tuple[tuple[int, ...], ...]]:
    """Rank -> the global ranks of its SP, Ulysses and ring groups (None: none made), as `build_groups` makes them
    on that rank."""
    import torch.distributed as dist

    from autosp.groups import build_groups

    found = {}
    for rank in range(world):
        with fake_process_group(world, rank):
            groups = build_groups(sp, **kw)
            found[rank] = tuple(None if g is None else tuple(dist.get_process_group_ranks(g))
                                for g in (groups.sp_group, groups.ulysses_group, groups.ring_group))
    return found


def _holding(groups: tuple[tuple[int, ...], ...], rank: int) -> tuple[int, ...]:
    (group,) = [g for g in groups if rank in g]
    return group


@pytest.mark.parametrize(("sp", "u", "world"), COMBINATIONS)
def test_sp_layout_is_what_build_groups_and_the_registry_make(sp, u, world):
    from simulator.strategies import hybrid

    layout = SPLayout.from_options("hybrid", sp, ulysses_size=u)
    assert (layout.ulysses_size, layout.ring_size, layout.zigzag, layout.memory_planned) == (u, sp // u, True, True)
    ulysses, ring = layout.ulysses_groups(world), layout.ring_groups(world)
    assert ulysses == tuple(tuple(range(s, s + u)) for s in range(0, world, u))  # Note [Hybrid rank layout]
    assert ring == tuple(tuple(range(b + i, b + sp, u)) for b in range(0, world, sp) for i in range(u))
    for rank, made in _process_groups(world, sp, ulysses_size=u).items():
        assert made == (_holding(layout.sp_groups(world), rank), _holding(ulysses, rank), _holding(ring, rank))
        previous, following = layout.ring_neighbours(rank)
        group = _holding(ring, rank)
        at = group.index(rank)
        assert (previous, following) == (group[at - 1], group[(at + 1) % len(group)])
    groups = hybrid(u, sp // u).sp_groups(sp)  # the registry's: the layout's over one SP group
    assert groups == {"ulysses": [list(g) for g in layout.ulysses_groups()],
                      "ring": [list(g) for g in layout.ring_groups()]}


@pytest.mark.parametrize("strategy", ["ulysses", "ring"])
def test_sp_layout_of_the_whole_group_kinds(strategy):
    layout = SPLayout.from_options(strategy, 4)
    assert layout.kind is SPKind(strategy) and layout.zigzag == (strategy == "ring") and layout.memory_planned
    assert layout.ulysses_size == (4 if strategy == "ulysses" else 1) and not layout.kind.grouped
    assert _process_groups(8, 4, layout=layout)[5] == ((4, 5, 6, 7), None, None)  # both run on the SP group
    assert (layout.heads_rule(6) is None) == (strategy == "ring")  # the ring takes any number of heads


def test_sp_layout_declares_the_kinds_and_their_sets_once():
    import autosp.config

    assert COMPILED_STRATEGIES == ("ulysses", "ring", "hybrid") == tuple(SPKind)
    assert (ZIGZAG_STRATEGIES, MEMORY_PLANNED_STRATEGIES) == (("ring", "hybrid"), ("ulysses", "ring", "hybrid"))
    assert autosp.config.ZIGZAG_STRATEGIES is ZIGZAG_STRATEGIES
    config = autosp.config.AutoSPConfig(sp_size=8, strategy="hybrid", ring_size=2)
    assert config.layout == SPLayout(SPKind.HYBRID, 8, 4) and config.layout_ulysses_size == 4
    assert autosp.config.AutoSPConfig(sp_size=8, strategy="auto", plan_seq_len=64).layout is None
    assert SPLayout(SPKind.HYBRID, 8, 2).heads_rule(6) is None
    assert "not divisible by ulysses_size=4" in SPLayout(SPKind.HYBRID, 8, 4).heads_rule(6)
    assert SPLayout(SPKind.HYBRID, 8, 4).ulysses_degrees(6) == (1, 2) and "(one of [1, 2];" in \
        SPLayout(SPKind.HYBRID, 8, 4).heads_rule(6)
    assert SPLayout(SPKind.ULYSSES, 8, 8).ulysses_degrees(28) == (1, 2, 4)
    for bad, message in [(("hybrid", 8, 3), "ulysses_size=3 does not divide sp_size=8"),
                         (("ring", 8, 2), "strategy='ring' has ulysses_size=1")]:
        with pytest.raises(SPLayoutError, match=message):
            SPLayout(*bad)
    with pytest.raises(SPLayoutError, match="sp_size=4 does not divide the process group's 6 ranks"):
        SPLayout(SPKind.RING, 4, 1).sp_groups(6)


@pytest.mark.parametrize(("strategy", "u"), [("hybrid", 2), ("ring", 1)])
def test_sp_layout_is_what_the_export_writes(strategy, u):
    from autosp.export import export_workload
    from autosp.tracing import trace_fake_step
    from experiments.models import build_model
    from simulator.workload import RING_GROUPS

    sp = 4
    options = {"strategy": strategy, **({"ulysses_size": u} if strategy == "hybrid" else {})}
    layout = SPLayout.from_options(strategy, sp, ulysses_size=options.get("ulysses_size"))
    torch._dynamo.reset()
    compiled, parameter_bytes = trace_fake_step(lambda: build_model("hf-mistral", layers=1, vocab=256), seq_len=32,
                                                sp_size=sp, vocab_size=256, **options)
    workload = export_workload(compiled.report.aot_graphs, name=strategy, sp_size=sp, parameter_bytes=parameter_bytes)
    assert all(workload.groups[g] == layout.ring_groups() for g in RING_GROUPS)
    assert workload.groups.get("ulysses") == (layout.ulysses_groups() if strategy == "hybrid" else None)
    for rank, program in workload.ranks.items():
        peers = {(c.kind, c.peer) for op in program.ops if (c := op.collective) is not None and c.kind in ("send", "recv")}
        previous, following = layout.ring_neighbours(rank)
        assert peers == {("send", following), ("recv", previous)}


class RingInnermost(SPLayout):
    """A toy layout (docs/design.md, "Adding a sequence-parallel kind", step 1): the ring groups consecutive ranks
    and the Ulysses groups the ranks ``ring_size`` apart, written in the one method that places the ranks."""

    def sp_rank(self, ring_rank: int, ulysses_rank: int) -> int:
        return ulysses_rank * self.ring_size + ring_rank


def test_sp_layout_a_new_layout_is_one_method_and_the_groups_follow():
    toy = RingInnermost(SPKind.HYBRID, 6, 2)  # 2 Ulysses ranks x a ring of 3
    assert toy.ring_groups(12) == ((0, 1, 2), (3, 4, 5), (6, 7, 8), (9, 10, 11))
    assert toy.ulysses_groups(12) == ((0, 3), (1, 4), (2, 5), (6, 9), (7, 10), (8, 11))
    assert [toy.coordinates(r) for r in range(6)] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert [toy.ring_neighbours(r) for r in (0, 4, 8)] == [(2, 1), (3, 5), (7, 6)]
    for rank, made in _process_groups(12, 6, layout=toy).items():  # the process groups follow it, nothing else changed
        assert made == (_holding(toy.sp_groups(12), rank), _holding(toy.ulysses_groups(12), rank),
                        _holding(toy.ring_groups(12), rank))

    class Scrambled(SPLayout):
        def sp_rank(self, ring_rank: int, ulysses_rank: int) -> int:
            return (self.sp_size - 1 - ring_rank * self.ulysses_size - ulysses_rank)

    with pytest.raises(SPLayoutError, match="increasing"):  # torch numbers a group's members in increasing order
        Scrambled(SPKind.HYBRID, 4, 2).ring_groups()
