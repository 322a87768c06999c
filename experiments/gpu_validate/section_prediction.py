"""Section (c), prediction: each case's measured step and peak memory beside the simulator's step and peak of the
same compiled graphs on the matching preset, errors printed, not judged; a planned case's chosen plan must fit its
target.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from experiments.gpu_validate.case_set import PLAIN, Case, Judged
from experiments.gpu_validate.presets import simulate_on


def plan_facts(plan: dict | None) -> dict | None:
    """What section (c) reads of a compiled model's memory-plan decision (``report.memory_plan``)."""
    if not plan:
        return None
    chosen = plan["candidates"][plan["chosen"]] if plan.get("chosen") is not None else None
    return {"target_bytes": plan.get("target_memory_bytes"), "reason": plan.get("reason"),
            "options": plan.get("options"), "plan": chosen and chosen["plan"],
            "fits": bool(chosen and chosen["fits"]), "predicted_peak_bytes": chosen and chosen["peak_bytes"],
            "predicted_step_s": chosen and chosen["step_time_s"], "candidates": len(plan["candidates"])}


@dataclass
class Prediction(Judged):
    """Section (c) for one case: measured beside simulated, and the plan's fit."""

    case: str
    world: int
    preset: str
    measured_step_s: float
    simulated_step_s: float
    step_error_pct: float
    measured_peak_bytes: int
    simulated_peak_bytes: int
    peak_error_pct: float
    plan: dict | None
    """A planned case's decision (`plan_facts`); the errors above are printed, never judged."""
    problems: list[str]


def _error_pct(simulated: float, measured: float) -> float:
    return 100.0 * (simulated - measured) / measured if measured > 0 else math.nan


def prediction(case: Case, per_rank: list[dict], preset: str, document: dict, *, on_gpu: bool) -> Prediction:
    """The measured step (median of the slowest rank's) and peak (the largest rank's) beside the simulation of
    rank 0's exported graphs on ``document``; a planned case's plan must fit."""
    measured_s = statistics.median(max(r["step_s"][i] for r in per_rank) for i in range(case.steps))
    measured_peak = max(r["peak_bytes"] for r in per_rank)
    result = simulate_on(per_rank[0]["workload"], document, case.world)
    simulated_peak = max(r.peak_memory_bytes for r in result.ranks)
    plan, problems = per_rank[0]["plan"], []
    if case.plan_below_plain:
        if plan is None or plan["plan"] is None:
            problems.append(f"no plan chosen: {plan and plan['reason']}")
        else:
            if not plan["fits"]:
                problems.append(f"the chosen plan {plan['plan']} does not fit by its own prediction")
            if all(plan["options"].get(k) == v for k, v in PLAIN.items()) and plan["options"].get(
                    "activation_offload", "off") == "off":
                problems.append(f"the target is below the plain step's peak and the plan chose no technique: "
                                f"{plan['options']}")
            if on_gpu and measured_peak > plan["target_bytes"]:
                problems.append(f"the chosen plan {plan['plan']} measured {measured_peak:,} bytes at its peak, above "
                                f"its target of {plan['target_bytes']:,}")
    return Prediction(case=case.name, world=case.world, preset=preset, measured_step_s=measured_s,
                      simulated_step_s=result.step_time_s, step_error_pct=_error_pct(result.step_time_s, measured_s),
                      measured_peak_bytes=measured_peak, simulated_peak_bytes=simulated_peak,
                      peak_error_pct=_error_pct(simulated_peak, measured_peak), plan=plan,
                      problems=problems)
