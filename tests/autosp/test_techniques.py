"""The registry of memory techniques (`autosp.config.MEMORY_TECHNIQUES`, `autosp.techniques`): what it derives
matches the `AutoSPConfig` fields it names, and a new technique added as docs/design.md's recipe "Adding a memory
technique" says (three files) is taken up by the option list, the checks, the passes and the planner's candidates
with no other change.  No compile, no trace: runs in seconds."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import ClassVar

import pytest

from autosp.config import MEMORY_PLAN_OPTIONS, MEMORY_TECHNIQUES, AutoSPConfig
from autosp.errors import AutoSPError
from autosp.pipeline import passes_for
from autosp.plan import candidate_plans
from autosp.plan.candidates import plan_name
from autosp.techniques import CandidateSetting, MemoryTechnique, memory_plan_options, setting_label

ROOT = Path(__file__).resolve().parents[2]


def _recipe() -> str:
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    start = text.index("### Adding a memory technique")
    return text[start:text.index("\n#", start + 1)]


# --- Step 1 of the recipe: the pass module (here this test module) with its pass factory. ---

MADE: list[tuple] = []
"""The arguments each `make_toy_tiling_pass` call got."""


def make_toy_tiling_pass(mode: str, toy_chunk_tokens: int | None):
    """The toy's pass factory: called with the option's value and its companion's."""
    MADE.append((mode, toy_chunk_tokens))

    def toy_tiling_pass(gm, example_inputs, *, ctx):
        return gm

    return toy_tiling_pass


# --- Step 2: its fields on AutoSPConfig (here a subclass) and its entry in the registry (here a copy). ---

TOY = MemoryTechnique(
    option="toy_tiling", values=("off", "on", "auto"), default="off", active=("on", "auto"),
    companions=("toy_chunk_tokens",), chunk_option="toy_chunk_tokens",
    pass_factory=f"{__name__}:make_toy_tiling_pass",
    label=setting_label("toy tiling", "toy_tiling", "toy_chunk_tokens"),
    candidates=(CandidateSetting("off", {"toy_tiling": "off"}), CandidateSetting("on", {"toy_tiling": "on"})))
TECHNIQUES = (*MEMORY_TECHNIQUES, TOY)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToyConfig(AutoSPConfig):
    TECHNIQUES: ClassVar[tuple[MemoryTechnique, ...]] = TECHNIQUES
    toy_tiling: str = "off"
    toy_chunk_tokens: int | None = None


# --- Step 3: the tests. ---


def test_techniques_recipe_adds_a_dynamo_stage_technique_in_at_most_three_files():
    recipe = _recipe()
    steps = re.findall(r"^\d+\. (.+)$", recipe, re.MULTILINE)
    assert 1 <= len(steps) <= 3, steps
    assert steps[0].startswith("`autosp/passes/dynamo/NAME.py`") and steps[1].startswith("`autosp/config.py`")
    assert "`tests/autosp/`" in steps[2]
    assert "`tests/autosp/test_techniques.py` follows these steps" in recipe.replace("\n", " ")


def test_techniques_toy_technique_is_taken_up_by_options_checks_passes_and_candidates():
    # the option list and the checks
    assert memory_plan_options(TECHNIQUES) == (*MEMORY_PLAN_OPTIONS, "toy_tiling", "toy_chunk_tokens")
    assert ToyConfig.from_options(sp_size=2, compiler="aot_eager", options={"toy_tiling": "on"}).toy_tiling == "on"
    with pytest.raises(AutoSPError, match=r"toy_tiling must be one of \('off', 'on', 'auto'\), got 'sideways'"):
        ToyConfig(sp_size=2, toy_tiling="sideways")
    with pytest.raises(AutoSPError, match="toy_chunk_tokens must be None or a positive number of tokens, got 0"):
        ToyConfig(sp_size=2, toy_chunk_tokens=0)

    # the passes: after the loss rule, in registry order (after the tiled MLP); alone at sp_size=1
    MADE.clear()
    names = [p.__name__ for p in passes_for(ToyConfig(sp_size=2, tiled_mlp="on", toy_tiling="on",
                                                      toy_chunk_tokens=8), TECHNIQUES)]
    assert names[names.index("exact_causal_lm_loss_pass") + 1:][:3] == [
        "tiled_mlp_pass", "toy_tiling_pass", "sequence_sharding_pass"]
    assert [p.__name__ for p in passes_for(ToyConfig(sp_size=1, toy_tiling="auto"), TECHNIQUES)] == [
        "tag_sequence_inputs_pass", "toy_tiling_pass", "eliminate_dead_code_pass"]
    assert MADE == [("on", 8), ("auto", None)]
    assert passes_for(ToyConfig(sp_size=2), TECHNIQUES) == passes_for(AutoSPConfig(sp_size=2))

    # the candidates: every built-in one with the toy off and on, named by the registry
    built_in, toy = candidate_plans(), candidate_plans(techniques=TECHNIQUES)
    assert len(toy) == 2 * len(built_in)
    assert {p.name for p in toy} == {f"{p.name}, toy tiling {v}" for p in built_in for v in ("off", "on")}
    plans = candidate_plans(techniques=TECHNIQUES, checkpointing=("none",), tiled_loss=("off",), tiled_mlp=("off",),
                            activation_offload=("off",), toy_chunk_tokens=(None, 32))
    assert [(p.name, p.options) for p in plans] == [
        ("none, tiled loss off, tiled mlp off, toy tiling off",
         {"checkpointing": "none", "tiled_loss": "off", "tiled_mlp": "off", "toy_tiling": "off"}),
        ("none, tiled loss off, tiled mlp off, toy tiling on",
         {"checkpointing": "none", "tiled_loss": "off", "tiled_mlp": "off", "toy_tiling": "on"}),
        ("none, tiled loss off, tiled mlp off, toy tiling on/32",
         {"checkpointing": "none", "tiled_loss": "off", "tiled_mlp": "off", "toy_tiling": "on",
          "toy_chunk_tokens": 32})]
    assert plan_name(plans[2].options, TECHNIQUES) == plans[2].name
    # a fixed "off" drops the chunk its "on" candidates had (a companion of a technique not active), unless fixed
    fixed = candidate_plans(techniques=TECHNIQUES, checkpointing=("none",), tiled_loss=("off",), tiled_mlp=("off",),
                            activation_offload=("off",), toy_chunk_tokens=32, fixed={"toy_tiling": "off"})
    assert [p.options.get("toy_chunk_tokens") for p in fixed] == [None]

    # the built-in registry is unchanged
    assert TOY not in MEMORY_TECHNIQUES and "toy_tiling" not in MEMORY_PLAN_OPTIONS
    assert not any("toy" in p.name for p in candidate_plans())


def test_techniques_registry_names_the_config_fields_with_their_defaults():
    defaults = {f.name: f.default for f in dataclasses.fields(AutoSPConfig)}
    assert set(MEMORY_PLAN_OPTIONS) <= set(defaults)
    for technique in MEMORY_TECHNIQUES:
        assert defaults[technique.option] == technique.default and technique.default in technique.values
        assert set(technique.active) <= set(technique.values)
        assert all(set(c.options) <= set(technique.options) for c in technique.candidates)
    assert [t.option for t in MEMORY_TECHNIQUES if t.stage == "dynamo"] == ["tiled_loss", "tiled_mlp"]


def test_techniques_candidate_order_is_the_planners():
    # The planner breaks ties by candidate order: checkpointing varies fastest, then the offload, the tiled MLP,
    # the tiled loss slowest.
    names = [p.name for p in candidate_plans()]
    assert names[:8] == ["none, tiled loss off, tiled mlp off", "sac, tiled loss off, tiled mlp off",
                         "sac@0.5, tiled loss off, tiled mlp off", "sac@0.2, tiled loss off, tiled mlp off",
                         "full, tiled loss off, tiled mlp off", "layer, tiled loss off, tiled mlp off",
                         "none, tiled loss off, tiled mlp off, offload", "sac, tiled loss off, tiled mlp off, offload"]
    assert names[12] == "none, tiled loss off, tiled mlp on" and names[24] == "none, tiled loss on, tiled mlp off"
    with pytest.raises(AutoSPError, match="tiled_mlp candidate"):
        candidate_plans(tiled_mlp=("sideways",))
    with pytest.raises(TypeError, match="toy_tiling"):
        candidate_plans(toy_tiling=("on",))
