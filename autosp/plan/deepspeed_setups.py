"""The DeepSpeed setups the planner tries for a job (ZeRO stage, optimizer offload), what each is called and the
``zero_optimization`` section that runs it; `autosp.plan.planner.plan_job` plans under them in order."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from autosp.errors import AutoSPError
from autosp.plan.candidates import MemoryPlan
from autosp.plan.setup import TrainingSetup

# Note [The DeepSpeed setup only as far as memory needs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# At long context the model states can leave no room for any plan: Llama-3.1-8B on 8 H100s holds 43 GiB a rank in
# bf16 parameters and gradients and fp32 AdamW state under ZeRO 1, and ALST's 3.7M tokens fit only with the
# optimizer in host memory (docs/design.md, "Memory planner").  The compile cannot change where the optimizer
# lives (DeepSpeed's config does), but the planner can say what the job needs.  `plan_job` (autosp/plan/planner.py) plans under the
# DeepSpeed setups of `JOB_SETUPS` in order: ZeRO 1, ZeRO 2 (gradients partitioned too), ZeRO 2 with DeepSpeed's
# optimizer offload (fp32 master weights, gradient partitions and optimizer state in host memory, the optimizer
# step on the CPU: slower).  Each may free device memory the one before holds and may add time, so the first setup
# under which a plan is chosen is the job's, and the report names it with the DeepSpeed config to use; the setups
# tried before are in its notes.  A setup whose ledger (every line but the activations, inside backward, where the
# peak is) holds no less on the device than one already without a plan is not planned at all: no plan can fit
# there either.  At one micro-step per optimizer step the ledger of ZeRO 2 equals ZeRO 1's (both reduce the
# gradients in backward and keep their partition, as the DeepSpeed engines the ledger is checked against do:
# tests/simulator/test_ledger_deepspeed.py), so ZeRO 2 is skipped there.  What the user fixed (``--zero-stage``, ``--offload``) is kept in every setup
# (`job_setups`).  Last come ZeRO 3, AutoSP's sharded parameters (each rank holds 1/N of the parameters too;
# each layer gathered inside the step, a DeepSpeed config with "stage": 3 under `autosp.deepspeed_initialize`,
# Note [ZeRO 3 through DeepSpeed] in autosp/integrations/deepspeed_engine.py), then ZeRO 3 with the optimizer
# offloaded (ALST's setup), both priced as DeepSpeed's engine steps the shards.  ZeRO 3 is priced for Ulysses
# programs, so only those plans are planned under it (`plans_for_job`).  Under objective longest a setup counts as
# having a plan when its plan reaches the length asked; one that stops short is passed over for the next (leaner)
# setup, and where none reaches it the one that reaches furthest is the job's.

JOB_SETUPS = ({"zero_stage": 1, "offload": "none"}, {"zero_stage": 2, "offload": "none"},
              {"zero_stage": 2, "offload": "optimizer"}, {"zero_stage": 3, "offload": "none", "engine": "deepspeed"},
              {"zero_stage": 3, "offload": "optimizer", "engine": "deepspeed"})
"""The DeepSpeed setups `plan_job` tries, in order (Note [The DeepSpeed setup only as far as memory needs])."""


def job_name(job: Mapping) -> str:
    """``ZeRO 2 with optimizer offload`` for {"zero_stage": 2, "offload": "optimizer"}."""
    return f"ZeRO {job['zero_stage']}" + (" with optimizer offload" if job.get("offload", "none") != "none" else "")


def deepspeed_config(job: Mapping) -> dict:
    """The ``zero_optimization`` section of a DeepSpeed config that runs the setup ``job``."""
    section = {"stage": job["zero_stage"]}
    if job.get("offload", "none") == "optimizer":
        section["offload_optimizer"] = {"device": "cpu"}
    return {"zero_optimization": section}


def job_setups(setup: TrainingSetup, fixed: Mapping | None = None) -> list[dict]:
    """The setups of `JOB_SETUPS` with the fields of ``fixed`` (of ``zero_stage``, ``offload``) kept, each once and
    each one ``setup`` can train with (`TrainingSetup.check`), in order."""
    found = []
    for job in JOB_SETUPS:
        job = {**job, **(fixed or {})}
        try:
            dataclasses.replace(setup, **job).check()
        except AutoSPError:
            continue
        if job not in found:
            found.append(job)
    return found


def plans_for_job(plans: Sequence[MemoryPlan] | None, job: Mapping) -> tuple[MemoryPlan, ...] | None:
    """The plans of ``plans`` priced under the DeepSpeed setup ``job``: under ZeRO 3 (AutoSP's sharded parameters)
    the Ulysses plans (Note [The DeepSpeed setup only as far as memory needs]); None
    (`plan_memory`'s default candidates) stays None."""
    if plans is None or job["zero_stage"] != 3:
        return None if plans is None else tuple(plans)
    return tuple(p for p in plans if p.options.get("strategy", "ulysses") == "ulysses")
