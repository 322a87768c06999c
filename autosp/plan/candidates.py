"""The memory planner's candidates: every combination of one setting per memory technique (checkpointing, SAC
budget, tiled loss, tiled MLP, activation offload), named, with the tiled ops' chunks sized for the target memory.

`candidate_plans` enumerates them from the technique registry (`autosp.config.MEMORY_TECHNIQUES`);
`sized_candidate_plans` and `candidates_for` size the chunks by `chunk_tokens`.  The decision among them, each
predicted, is autosp/plan/planner.py's (`plan_memory`).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autosp.config import MEMORY_TECHNIQUES
from autosp.costs import LOSS_SCRATCH_ROWS
from autosp.errors import AutoSPError
from autosp.plan.setup import TrainingSetup
from autosp.techniques import MemoryTechnique


@dataclass(frozen=True)
class MemoryPlan:
    """One candidate: a name and the `autosp.compile` options it sets."""

    name: str
    options: Mapping


def plan_name(options: Mapping, techniques: tuple[MemoryTechnique, ...] = MEMORY_TECHNIQUES) -> str:
    """A plan's name from its options: each technique's part (`MemoryTechnique.label`), in registry order:
    checkpointing (and SAC budget), tiled loss, tiled MLP (and chunks), and ", offload" when activation offload is
    on."""
    return ", ".join(part for technique in techniques if (part := technique.label(options)))


def _with_fixed(options: dict, fixed: Mapping, techniques: tuple[MemoryTechnique, ...] = MEMORY_TECHNIQUES) -> dict:
    """``options`` overridden by ``fixed``, less the candidate's settings that no longer apply (the companions of
    a technique not active: a SAC budget without SAC, a tiled op's chunk and return_logits without the tiling),
    unless fixed too."""
    options = {**options, **fixed}
    unused = {name for t in techniques if not t.is_active(options) for name in t.companions}
    return {k: v for k, v in options.items() if k in fixed or k not in unused}


def _settings(technique: MemoryTechnique, names: Sequence[str] | None, chunks, deciding: bool) -> list[dict]:
    """The options of each candidate of ``technique`` named in ``names`` (None: all), in the technique's order; an
    active one once per chunk size of ``chunks`` (its ``chunk_option``: one size or several; None: the pass's
    default); ``deciding``: its option named in each ("auto" fixed, `MemoryTechnique.planner_decides`)."""
    known = [c.name for c in technique.candidates]
    if names is not None and set(names) - set(known):
        raise AutoSPError(f"{technique.option} candidate(s) {sorted(set(names) - set(known))}: choose among "
                          f"{tuple(known)}")
    sizes = (chunks,) if chunks is None or isinstance(chunks, int) else tuple(chunks)
    found = []
    for candidate in technique.candidates:
        if names is not None and candidate.name not in names:
            continue
        options = {technique.option: candidate.name, **candidate.options} if deciding else dict(candidate.options)
        chunked = technique.chunk_option is not None and technique.is_active(options)
        for chunk in sizes if chunked else (None,):
            found.append({**options, **({technique.chunk_option: chunk} if chunk is not None else {})})
    return found


def candidate_plans(*, fixed: Mapping | None = None, techniques: tuple[MemoryTechnique, ...] = MEMORY_TECHNIQUES,
                    **choices) -> tuple[MemoryPlan, ...]:
    """The candidates: every combination of one candidate per technique of ``techniques`` (the registry,
    `autosp.config.MEMORY_TECHNIQUES`), named by `plan_name`.  ``choices``, keyed by a technique's option: the
    names of its candidates to try (default: all), e.g. ``checkpointing=("none", "sac@0.5")``,
    ``tiled_loss=("on",)``; keyed by its ``chunk_option``: the chunk sizes of its active candidates (one or several;
    None, the default: the pass's own, e.g. ``loss_chunk_tokens=16``, ``mlp_chunk_tokens=(None, 64)``).

    The built-in candidates: checkpointing in {none, sac x `autosp.config.SAC_BUDGETS`, full, layer} ("layer" is
    per-layer checkpointing as hand-written baselines run it: the residual stream kept, everything else recomputed,
    the all-to-alls included) x tiled loss off/on x tiled MLP off/on ("on" once per chunk size; None: one chunk's
    input-projection outputs within 64 MiB, autosp.passes.dynamo.tiled_mlp.MLP_CHUNK_BYTES) x activation offload
    off/on.  The tiled loss runs with ``return_logits=False`` (else a Hugging Face model's returned logits are
    materialised anyway) and ``loss_chunk_tokens`` (default None: one chunk's fp32 logits within 64 MiB,
    autosp.passes.dynamo.tiled_loss.LOSS_CHUNK_BYTES).  Activation offload moves the tensors saved for backward to
    host memory: the plan then also needs host memory, `autosp.plan.prediction.Prediction.host_fits`.  The
    techniques vary in registry order, the first slowest, but checkpointing fastest (``innermost``).

    ``fixed``: options the user set, which every candidate takes over its own (candidates that become equal are
    listed once); ``activation_offload="auto"`` among them leaves the choice to the planner
    (`MemoryTechnique.planner_decides`)."""
    fixed = dict(fixed or {})
    known = {name for t in techniques for name in (t.option, t.chunk_option) if name is not None}
    if set(choices) - known:
        raise TypeError(f"candidate_plans() got unexpected keyword argument(s) {sorted(set(choices) - known)}: "
                        f"choose among {sorted(known)}")
    deciding = {t.option for t in techniques if t.planner_decides and fixed.get(t.option) == "auto"}
    fixed = {k: v for k, v in fixed.items() if k not in deciding}  # "off" is named, to replace the "auto"
    settings = {t.option: _settings(t, choices.get(t.option), choices.get(t.chunk_option) if t.chunk_option else None,
                                    t.option in deciding) for t in techniques}
    varying = [t.option for t in techniques if not t.innermost] + [t.option for t in techniques if t.innermost]
    plans, seen = [], set()
    for combination in itertools.product(*(settings[option] for option in varying)):
        chosen = dict(zip(varying, combination, strict=True))
        options = _with_fixed({k: v for t in techniques for k, v in chosen[t.option].items()}, fixed, techniques)
        key = tuple(sorted((k, repr(v)) for k, v in options.items()))
        if key not in seen:
            seen.add(key)
            plans.append(MemoryPlan(plan_name(options, techniques), options))
    return tuple(plans)


def sized_candidate_plans(model_config: Mapping, *, itemsize: int, target_memory: int,
                          **choices) -> tuple[MemoryPlan, ...]:
    """`candidate_plans` (``choices``: its keyword arguments but the chunk sizes) with the tiled ops' chunks sized
    for ``target_memory`` bytes per rank by `chunk_tokens`: the candidates both ``autosp.compile(...,
    memory_plan="auto")`` and ``python -m autosp.plan --memory-plan auto`` predict.  ``model_config``: the Hugging
    Face config as a dict; ``itemsize``: bytes per element of the model's dtype (the MLP's intermediates; the
    logits are fp32)."""
    from autosp.passes.dynamo.tiled_loss import LOSS_CHUNK_BYTES
    from autosp.passes.dynamo.tiled_mlp import MLP_CHUNK_BYTES

    vocab = int(model_config["vocab_size"])
    intermediate = int(model_config.get("intermediate_size") or model_config.get("n_inner")
                       or 4 * model_config.get("n_embd", model_config.get("hidden_size", 0)))
    return candidate_plans(  # two input projections (gated MLPs), fp32 logits
        loss_chunk_tokens=chunk_tokens(target_memory, 4 * vocab, LOSS_CHUNK_BYTES, LOSS_SCRATCH_ROWS * 4 * vocab),
        mlp_chunk_tokens=(chunk_tokens(target_memory, 2 * intermediate * itemsize, MLP_CHUNK_BYTES,
                                       MLP_SCRATCH_ROWS * intermediate * itemsize),), **choices)


def candidates_for(model: str, setup: TrainingSetup, target_memory: int, **choices) -> tuple[MemoryPlan, ...]:
    """`sized_candidate_plans` of ``model`` (a preset of `autosp.presets` or a config.json, as `predict` takes it)
    in ``setup``'s dtype: `plan_memory`'s default candidates and the CLI's."""
    from autosp.plan.model_source import ModelSource

    return sized_candidate_plans(ModelSource(model).config(seq_len=setup.seq_len).to_dict(),
                                 itemsize=setup.torch_dtype.itemsize, target_memory=target_memory, **choices)


CHUNK_SHARE = 16
"""One chunk of a tiled op may hold at most 1/CHUNK_SHARE of ``target_memory`` (see `chunk_tokens`)."""


def chunk_tokens(target: int, row_bytes: int, default_bytes: int, scratch_bytes: int | None = None) -> int | None:
    """Tokens per chunk of a tiled op whose chunk holds ``row_bytes`` per token (what its ``default_bytes``
    budget counts) and allocates ``scratch_bytes`` per token while it runs (default ``row_bytes``): the passes'
    default (None, a chunk of ``default_bytes``) unless one chunk's scratch then exceeds ``target / CHUNK_SHARE``,
    else as many tokens as keep it there.

    A rule, not a search: the export prices a tiled op by its matmuls, the same for any chunk, and its scratch by
    one chunk, so among chunk sizes the smallest would always win; the rule keeps chunks large (fewer, larger
    matmuls on the device) while their scratch stays a small share of the target.  The scratch is what one chunk
    really allocates (`autosp.costs.LOSS_SCRATCH_ROWS`, `MLP_SCRATCH_ROWS`), not only the buffers the default budget names:
    counting those alone, the tiled MLP's chunk took a quarter of the target (Note [Chunk scratch in the rule])."""
    row_bytes = max(1, row_bytes)
    scratch_bytes = max(1, scratch_bytes or row_bytes)
    cap = target // CHUNK_SHARE // scratch_bytes
    if default_bytes // row_bytes <= cap:
        return None
    return max(1, cap)


# Note [Chunk scratch in the rule]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# `chunk_tokens` bounds what one chunk of a tiled op allocates while it runs, which `autosp.costs.workspace_bytes`
# prices: the tiled loss two fp32 [chunk, vocab] buffers (`LOSS_SCRATCH_ROWS`), the tiled MLP in backward
# (2k + 2 + steps) [chunk, intermediate] values for k input projections and an activation expression of ``steps``
# steps: 8 for a gated MLP's act(gate) * up (`MLP_SCRATCH_ROWS`; GPT-2's single projection needs fewer, so its chunk
# is smaller than it could be, never larger).  The rule first counted the input projections' outputs only (what
# `MLP_CHUNK_BYTES` counts), a quarter of the tiled MLP's backward scratch: on the CPU memory-cap table (16 MiB per
# rank) a 1,024-token chunk then held 4 MiB, measured, at the peak inside the MLP's backward.
MLP_SCRATCH_ROWS = 8
"""[chunk, intermediate] values one chunk of a gated tiled MLP allocates in backward (`autosp.costs`)."""
