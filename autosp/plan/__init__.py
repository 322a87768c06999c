"""The planner: predict a training configuration for a model on a cluster (``python -m autosp.plan``).

`predict` traces the model's AutoSP step on fake tensors, adds DeepSpeed's gradient reduction and optimizer step,
simulates it on a cluster (a preset or a cluster file, `load_cluster`) and prices memory with the ledger: fits or
not, peak per rank by ledger category, step time, and the longest sequence that fits (with the peak by category
there); the answer keeps the simulated step (``Prediction.step.simulated``) for `simulator.plots`.  `ModelSource`
is the model a name or a config.json stands for (the model ``python -m autosp.train --model`` builds).
`plan_memory` predicts every candidate memory plan (checkpointing, SAC budget, tiled loss, tiled MLP) and chooses
one, `plan_job` also the DeepSpeed setup (ZeRO stage, optimizer offload) the plan needs; `choose_options` returns the chosen plan's `autosp.compile` options; `choose_strategy` predicts every strategy
and hybrid degree and chooses one; `autosp.plan.auto` runs them for a compiled model (``autosp.compile(...,
memory_plan="auto")``, ``autosp.compile(..., strategy="auto")``) in a planner process, which `start_planner`
starts ahead of the request (autosp/plan/process.py).  It is the one package of autosp that uses
the simulator beyond its workload schema (docs/design.md, "The packages and who may import whom").
"""

import importlib

_PUBLIC = {
    "cluster_from_dict": "cluster_file", "cluster_names": "cluster_file", "load_cluster": "cluster_file",
    "ModelSource": "model_source",
    "MemoryPlan": "candidates", "candidate_plans": "candidates",
    "PlanReport": "planner", "choose_options": "planner",
    "plan_job": "planner", "plan_memory": "planner",
    "Prediction": "prediction", "peak_by_category": "prediction", "predict": "prediction",
    "PlannerProcess": "process", "start_planner": "process",
    "TrainingSetup": "setup", "StepPrediction": "step",
    "StrategyDecision": "strategy_choice", "choose_strategy": "strategy_choice",
}
"""Each public name -> the module of this package that defines it, imported on first use: `autosp.compile` imports
`autosp.plan.auto`, and a plain compile should not pay for the simulator the predictions import."""

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'autosp.plan' has no attribute {name!r}")
    return getattr(importlib.import_module(f"autosp.plan.{_PUBLIC[name]}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
