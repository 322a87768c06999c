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
the simulator beyond its workload schema (docs/design.md, "Import direction").
"""

from autosp.plan.cluster_file import cluster_from_dict, cluster_names, load_cluster
from autosp.plan.model_source import ModelSource
from autosp.plan.planner import MemoryPlan, PlanReport, candidate_plans, choose_options, plan_job, plan_memory
from autosp.plan.predict import (
    Prediction,
    StepPrediction,
    StrategyDecision,
    TrainingSetup,
    choose_strategy,
    peak_by_category,
    predict,
)
from autosp.plan.process import PlannerProcess, start_planner

__all__ = ["MemoryPlan", "ModelSource", "PlanReport", "PlannerProcess", "Prediction", "StepPrediction",
           "StrategyDecision", "TrainingSetup", "candidate_plans", "choose_options", "choose_strategy", "cluster_from_dict",
           "cluster_names", "load_cluster", "peak_by_category", "plan_job", "plan_memory", "predict", "start_planner"]
