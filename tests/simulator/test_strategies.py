"""The strategy registry: one object and one spelling per system, the hybrid family, degrees and rank layouts."""

from __future__ import annotations

import dataclasses

import pytest

from simulator.strategies import (
    REWRITES,
    STRATEGIES,
    TABLES,
    Strategy,
    UnknownStrategyError,
    WorkloadRecipe,
    get_strategy,
    hybrid,
    sp_candidates,
)

# Some fields of autosp.AutoSPConfig, and with those the strategy options (strategy, ulysses_size, ring_size).
PASS_TODAY = {"sp_size", "compiler", "checkpointing", "overlap_communication", "sac_recompute_limit"}
PASS_WITH_STRATEGIES = PASS_TODAY | {"strategy", "ulysses_size", "ring_size"}


def test_strategies_every_name_resolves_to_its_one_frozen_object():
    assert len(STRATEGIES) == len(set(STRATEGIES)) >= 7
    for name, strategy in STRATEGIES.items():
        assert strategy.name == name and get_strategy(name) is strategy
        assert hash(strategy) == hash(STRATEGIES[name])
        with pytest.raises(dataclasses.FrozenInstanceError):
            strategy.name = "other"


@pytest.mark.parametrize("spelling", ["ring_attention", "zero-3", "ZeRO3", "Ulysses", "autosp_nosac", "hybrid",
                                      "autosp-hybrid-0x4", "autosp-hybrid-2x", "autosp-hybrid-2x4x1", "", None])
def test_strategies_other_spellings_are_refused_with_the_valid_names(spelling):
    assert spelling not in STRATEGIES
    with pytest.raises(UnknownStrategyError) as info:
        STRATEGIES[spelling]
    assert isinstance(info.value, ValueError) and isinstance(info.value, KeyError)
    message = str(info.value)
    assert all(name in message for name in STRATEGIES) and "autosp-hybrid-UxR" in message
    assert STRATEGIES.get(spelling) is None


def test_strategies_tables_list_the_systems_in_registry_order():
    assert STRATEGIES.table("measured-cpu") == (
        "autosp", "autosp-nosac", "ulysses", "ulysses+ckpt", "ring", "zero3", "deepspeed-autosp", "alst",
        "autosp-ring", "autosp-hybrid-2x2")
    assert STRATEGIES.table("paper-scale") == ("autosp", "ulysses", "ulysses+ckpt", "ring", "zero3")
    # the memory-cap table: the measured systems and AutoSP unplanned (SAC alone); `autosp` is the default compile,
    # which plans where the table gives it a memory size; the pass's other rows keep their options (memory_plan off)
    assert STRATEGIES.table("memory-cap") == (*STRATEGIES.table("measured-cpu"), "autosp-sac")
    assert [n for n in STRATEGIES if STRATEGIES[n].memory_planned] == ["autosp"]
    assert STRATEGIES["autosp"].compile_options == {"strategy": "ulysses"}
    assert STRATEGIES["autosp-sac"].compile_options == {"strategy": "ulysses", "memory_plan": "off"}
    assert not STRATEGIES["autosp-auto"].memory_planned and not STRATEGIES["autosp-hybrid-4x2"].memory_planned
    # a pass without the planner runs the unplanned rows as they are (it never plans)
    assert STRATEGIES["autosp-sac"].options_for(PASS_TODAY) == {}
    assert STRATEGIES["autosp-ring"].options_for(PASS_WITH_STRATEGIES) == {"strategy": "ring"}
    with pytest.raises(ValueError, match="paper-scale"):
        STRATEGIES.table("simulated")
    for name in STRATEGIES.table("paper-scale"):  # every simulated system says how its workload is built
        assert STRATEGIES[name].workload is not None
    assert {n for n in STRATEGIES if STRATEGIES[n].published} == {"autosp", "ulysses", "ring", "zero3"}


@pytest.mark.parametrize(("u", "r"), [(1, 1), (2, 1), (1, 4), (2, 4), (4, 2), (8, 2), (3, 5)])
def test_strategies_hybrid_family_degrees_and_rank_layout(u, r):
    sp = u * r
    strategy = STRATEGIES[f"autosp-hybrid-{u}x{r}"]
    assert strategy == hybrid(u, r) and strategy.name == f"autosp-hybrid-{u}x{r}"
    assert strategy.degrees(sp) == (u, r) and strategy.sp_size(2 * sp) == sp
    groups = strategy.sp_groups(sp)
    assert len(groups["ulysses"]) == r and all(len(g) == u for g in groups["ulysses"])
    assert len(groups["ring"]) == u and all(len(g) == r for g in groups["ring"])
    for kind in ("ulysses", "ring"):  # each rank in exactly one group of each kind
        assert sorted(x for g in groups[kind] for x in g) == list(range(sp))
    for ug in groups["ulysses"]:  # Ulysses groups are consecutive ranks; a ring and a Ulysses group meet once
        assert ug == list(range(ug[0], ug[0] + u))
        for rg in groups["ring"]:
            assert len(set(ug) & set(rg)) == 1
    assert strategy.compile_options == {"strategy": "hybrid", "ulysses_size": u, "ring_size": r,
                                        "memory_plan": "off"}
    with pytest.raises(ValueError, match="sp_size"):
        strategy.degrees(sp + 1)


def test_strategies_the_ranks_a_strategy_runs_on_are_declared_by_it():
    listed = STRATEGIES["autosp-hybrid-2x2"]  # the measured table's hybrid: the registry's own, from either name
    assert hybrid(2, 2) is listed and listed.tables == ("measured-cpu", "memory-cap") and hybrid(2, 4).tables == ()
    assert [listed.min_ranks, hybrid(2, 4).min_ranks, STRATEGIES["autosp"].min_ranks] == [4, 8, 1]
    assert [listed.cannot_run_on(n) for n in (2, 3, 4)] == ["needs 4 ranks", "needs 4 ranks", None]
    assert "exactly 4 ranks" in listed.cannot_run_on(8)  # the measured tables split one sequence over every rank
    for name in ("autosp", "ulysses", "ring", "zero3", "autosp-ring"):
        assert STRATEGIES[name].cannot_run_on(2) is STRATEGIES[name].cannot_run_on(8) is None


def test_strategies_hybrid_layout_keeps_ulysses_on_a_node_and_the_ring_on_a_rail():
    groups = hybrid(8, 2).sp_groups(16)
    assert groups == {"ulysses": [list(range(8)), list(range(8, 16))], "ring": [[j, j + 8] for j in range(8)]}


@pytest.mark.parametrize(("name", "sp", "degrees"), [("autosp", 8, (8, 1)), ("ulysses", 4, (4, 1)),
                                                     ("ulysses+ckpt", 2, (2, 1)), ("ring", 8, (1, 8)),
                                                     ("autosp-ring", 16, (1, 16)), ("zero3", 1, (1, 1))])
def test_strategies_degrees_of_the_fixed_strategies(name, sp, degrees):
    strategy = STRATEGIES[name]
    assert strategy.degrees(sp) == degrees
    groups = strategy.sp_groups(sp)
    assert sorted(x for g in groups["ulysses"] for x in g) == list(range(sp))


def test_strategies_sp_size_and_refusals():
    assert STRATEGIES["zero3"].sp_size(8) == 1 and STRATEGIES["autosp"].sp_size(8) == 8
    with pytest.raises(ValueError, match="does not split"):
        STRATEGIES["zero3"].degrees(8)
    with pytest.raises(ValueError, match="chooses the degrees"):
        STRATEGIES["autosp-auto"].degrees(8)
    with pytest.raises(ValueError, match="multiple"):
        hybrid(3, 1).sp_size(8)
    with pytest.raises(ValueError, match="positive"):
        hybrid(0, 2)
    assert [STRATEGIES[n].zero_stage for n in ("autosp", "ulysses", "ring", "zero3")] == [1, 1, 1, 3]


def test_strategies_options_for_drop_tuning_options_and_refuse_strategy_options_the_pass_lacks():
    assert STRATEGIES["autosp"].options_for(PASS_TODAY) == {}  # the pass does Ulysses anyway
    assert STRATEGIES["ulysses"].options_for(PASS_TODAY) == {"checkpointing": "none", "overlap_communication": False}
    assert STRATEGIES["ulysses+ckpt"].options_for({"sp_size"}) == {}  # a pass without SAC or overlap options
    assert STRATEGIES["zero3"].options_for(PASS_TODAY) == {"checkpointing": "none"}
    for name in ("autosp-ring", "autosp-auto", "autosp-hybrid-2x4"):
        with pytest.raises(ValueError, match="update autosp"):
            STRATEGIES[name].options_for(PASS_TODAY)
        # memory_plan="off" (autosp-ring's) is what a pass without the planner does anyway
        assert STRATEGIES[name].options_for(PASS_WITH_STRATEGIES | {"memory_plan"}) == \
            STRATEGIES[name].compile_options
    assert STRATEGIES["ring"].options_for(PASS_WITH_STRATEGIES) == {
        "strategy": "ulysses", "checkpointing": "none", "overlap_communication": False}  # rewritten afterwards


def test_strategies_workload_recipes():
    assert STRATEGIES["ring"].workload.rewrite == "ring" and STRATEGIES["zero3"].workload.rewrite == "zero3"
    assert not STRATEGIES["zero3"].workload.trace_sequence_parallel
    assert STRATEGIES["zero3"].workload.gradient_step == "in-rewrite"
    for name in ("autosp", "ulysses", "ulysses+ckpt", "autosp-ring", "autosp-hybrid-2x2"):
        recipe = STRATEGIES[name].workload  # exported from what the pass emits, not rewritten
        assert recipe.trace_sequence_parallel and recipe.rewrite is None and recipe.gradient_step == "deepspeed"
    assert STRATEGIES["deepspeed-autosp"].workload is None
    assert set(REWRITES) == {"ring", "zero3"} and set(TABLES) == {"measured-cpu", "memory-cap", "paper-scale"}
    with pytest.raises(ValueError, match="rewrite"):
        WorkloadRecipe(trace_sequence_parallel=True, rewrite="ring_attention")
    with pytest.raises(ValueError, match="hybrid"):
        Strategy(name="x", description="", implementation="autosp", sequence_parallel="hybrid", zero_stage=1,
                 workload=None)


@pytest.mark.parametrize(("sp", "heads", "expected"), [
    (8, 32, ["autosp", "autosp-hybrid-2x4", "autosp-hybrid-4x2", "autosp-ring"]),
    (8, 4, ["autosp-hybrid-2x4", "autosp-hybrid-4x2", "autosp-ring"]),
    (8, 6, ["autosp-hybrid-2x4", "autosp-ring"]),
    (16, 8, ["autosp-hybrid-2x8", "autosp-hybrid-4x4", "autosp-hybrid-8x2", "autosp-ring"]),
    (2, 3, ["autosp-ring"]),
])
def test_strategies_sp_candidates(sp, heads, expected):
    candidates = sp_candidates(sp, heads=heads)
    assert [s.name for s in candidates] == expected
    for s in candidates:
        u, r = s.degrees(sp)
        assert u * r == sp and heads % u == 0
    with pytest.raises(ValueError, match="divide"):
        sp_candidates(sp, heads=heads, kv_heads=heads + 1)


def test_strategies_trace_groups_put_a_rewrite_beside_the_trace_it_rewrites():
    assert STRATEGIES.trace_groups(STRATEGIES.table("paper-scale")) == (
        ("autosp",), ("ulysses", "ring"), ("ulysses+ckpt",), ("zero3",))
    assert STRATEGIES.trace_groups(["ring", "autosp-hybrid-2x2", "ulysses"]) == (("ring", "ulysses"),
                                                                                ("autosp-hybrid-2x2",))
    with pytest.raises(ValueError, match="never simulated"):
        STRATEGIES.trace_groups(["autosp", "deepspeed-autosp"])
