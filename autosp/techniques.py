"""What a memory technique is: its `autosp.compile` option, the values the option takes, the options that go with
it, the candidates the memory planner tries, how plan names show it and the pass that applies it.

The techniques themselves are one registry, `autosp.config.MEMORY_TECHNIQUES`, beside the `AutoSPConfig` fields
they set; everything else is derived from it: the accepted values and their checks (`AutoSPConfig`),
``MEMORY_PLAN_OPTIONS`` (`memory_plan_options`), the Dynamo-stage passes of a compile (`autosp.pipeline.passes_for`),
and the memory planner's candidates, their names and fixed options (`autosp.plan.candidates.candidate_plans`,
`plan_name`).  Adding one: docs/design.md, "Adding a memory technique".

This module imports nothing of AutoSP but its errors: `autosp.config` imports it, and a pass module (which imports
torch and the trace context, which imports the config) is named by a dotted name and imported only when a
compile builds its passes (`MemoryTechnique.make_pass`).
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from autosp.errors import AutoSPError

Stage = Literal["dynamo", "joint", "partitioned"]
"""Where a technique's pass runs (docs/design.md, "The pass stages and their contracts"): on the Dynamo graph
(`autosp.pipeline.passes_for` adds it), on the joint graph (the checkpointing's tagger) or on the partitioned pair
(`autosp.backend.rewrite_pair`: the activation offload); the backend applies the last two itself."""


@dataclass(frozen=True)
class CandidateSetting:
    """One setting of a technique that the memory planner tries: its name (what `candidate_plans` is given to
    choose it: "on", "sac@0.5") and the `autosp.compile` options it sets ({} sets none: the default)."""

    name: str
    options: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class MemoryTechnique:
    """One memory technique of `autosp.config.MEMORY_TECHNIQUES`."""

    option: str
    """The `AutoSPConfig` field that switches it (its name too): "tiled_mlp"."""
    values: tuple[str, ...]
    """What the option accepts (`check` refuses anything else)."""
    default: str
    """The option's `AutoSPConfig` default: its value where a plan leaves it out."""
    active: tuple[str, ...]
    """The values under which it applies: its pass runs (``stage="dynamo"``) and its ``companions`` take effect."""
    companions: tuple[str, ...] = ()
    """Further `AutoSPConfig` fields that go with it ("mlp_chunk_tokens"): memory options the planner chooses
    (`memory_plan_options`), dropped from a plan where the technique is not active, and the pass factory's
    arguments after the option's value."""
    chunk_option: str | None = None
    """A companion counting tokens per chunk: a positive integer or None (`check`), and the planner's argument of
    the same name gives the chunk sizes it tries (one candidate per size of each active candidate)."""
    candidates: tuple[CandidateSetting, ...]
    """What the planner tries, in this order (`autosp.plan.candidates.candidate_plans`)."""
    label: Callable[[Mapping], str | None]
    """Its part of a plan's name (`autosp.plan.candidates.plan_name`) from the plan's options; None: nothing
    (`setting_label`, `flag_label`)."""
    stage: Stage = "dynamo"
    pass_factory: str | None = None
    """``stage="dynamo"``: "module:function" of the factory of its pass, called with the option's value and its
    companions' (`make_pass`); imported only then (`pkgutil.resolve_name`)."""
    planner_decides: bool = False
    """The value "auto" leaves the choice to the memory planner (only with ``memory_plan="auto"``; unplanned it is
    the default): the planner then names the option in every candidate, off included, to replace the "auto"."""
    innermost: bool = False
    """Its candidates vary fastest in the planner's candidate list (checkpointing: plans differing only in it share
    one trace, `autosp.plan.traces.TraceReuse`, and sit together); the others vary in registry order."""

    def __post_init__(self) -> None:
        if (self.stage == "dynamo") != (self.pass_factory is not None):
            raise AutoSPError(f"memory technique {self.option}: a Dynamo-stage technique names its pass_factory, "
                              f"others none (the backend applies them); got stage={self.stage!r}, "
                              f"pass_factory={self.pass_factory!r}")
        if self.chunk_option is not None and self.chunk_option not in self.companions:
            raise AutoSPError(f"memory technique {self.option}: its chunk_option {self.chunk_option!r} must be one "
                              f"of its companions {self.companions}")

    @property
    def options(self) -> tuple[str, ...]:
        """The `autosp.compile` options it owns: the option, then its companions."""
        return (self.option, *self.companions)

    def is_active(self, options: Mapping) -> bool:
        """Whether it applies under ``options`` (compile options; its default where they leave it out)."""
        return options.get(self.option, self.default) in self.active

    def check(self, config) -> None:
        """Refuse ``config`` (an `AutoSPConfig`) where it sets this technique's options wrong."""
        value = getattr(config, self.option)
        if value not in self.values:
            raise AutoSPError(f"{self.option} must be one of {self.values}, got {value!r}")
        if self.chunk_option is not None:
            chunk = getattr(config, self.chunk_option)
            if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
                raise AutoSPError(f"{self.chunk_option} must be None or a positive number of tokens, got {chunk!r}")
        if self.planner_decides and value == "auto" and config.memory_plan == "off":
            raise AutoSPError(f"{self.option}='auto' lets the memory planner decide: pass memory_plan='auto' (and "
                              f"target_memory) too, or choose {self.option}='on' or 'off' yourself")

    def make_pass(self, config):
        """Its Dynamo-stage pass for ``config``: ``pass_factory(value, *companion values)``."""
        if self.pass_factory is None:
            raise AutoSPError(f"memory technique {self.option} runs at the {self.stage} stage: the backend applies it")
        factory = pkgutil.resolve_name(self.pass_factory)
        return factory(*(getattr(config, name) for name in self.options))


def setting_label(words: str, option: str, chunk_option: str | None = None) -> Callable[[Mapping], str | None]:
    """A plan-name part showing a setting where the plan sets ``option``: "tiled mlp on", with "/CHUNK" where the
    plan also sets ``chunk_option`` and the value is not "off" ("tiled mlp on/1024")."""

    def label(options: Mapping) -> str | None:
        if option not in options:
            return None
        chunk = options.get(chunk_option) if chunk_option is not None and options[option] != "off" else None
        return f"{words} {options[option]}" + (f"/{chunk}" if chunk is not None else "")

    return label


def flag_label(words: str, option: str) -> Callable[[Mapping], str | None]:
    """A plan-name part showing ``words`` ("offload") where the plan sets ``option`` "on", nothing otherwise."""
    return lambda options: words if options.get(option) == "on" else None


def memory_plan_options(techniques: tuple[MemoryTechnique, ...]) -> tuple[str, ...]:
    """The options of ``techniques`` (each technique's option, then its companions), in registry order."""
    return tuple(name for technique in techniques for name in technique.options)


def technique(option: str, techniques: tuple[MemoryTechnique, ...]) -> MemoryTechnique:
    """The technique of ``techniques`` switched by ``option``."""
    found = {t.option: t for t in techniques}
    if option not in found:
        raise AutoSPError(f"no memory technique {option!r}: choose one of {tuple(found)}")
    return found[option]
