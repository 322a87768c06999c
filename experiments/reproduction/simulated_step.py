"""One simulated whole AutoSP step of the iteration model, written on a full run: its workload, a Perfetto trace,
timeline and memory plots (not a table: run.json's ``simulated_step`` says what it shows)."""

from __future__ import annotations

import pathlib

from experiments.reproduction.common import PAPER_CLUSTER, PAPER_RANKS
from experiments.reproduction.run import RunConfig, Runner

STEP_FILES = {"workload": "step-workload.json", "trace": "step-trace.json", "timeline": "step-timeline.png",
              "memory": "step-memory.png"}
"""Outputs of `write_simulated_step` (what they show is in run.json's ``simulated_step``)."""


def write_simulated_step(run: RunConfig, runner: Runner, out: pathlib.Path) -> dict:
    """Workload, Perfetto trace, timeline and memory plots of one simulated whole AutoSP step (gradient reduction
    and optimizer step included) of ``run.step_layers`` layers of ``run.iteration_model`` at
    ``run.step_seq_len`` tokens; what it simulated, for run.json."""
    from experiments.models import PAPER_MODELS
    from experiments.paper_scale.simulate import step_workload
    from simulator import Cluster, simulate
    from simulator.plots import plot_memory, plot_timeline
    from simulator.trace import write_chrome_trace

    cluster = Cluster.from_preset(PAPER_CLUSTER)
    workload = step_workload("autosp", PAPER_MODELS[run.iteration_model], run.step_seq_len, run.step_layers,
                             ranks=PAPER_RANKS, cache=runner.cache)
    result = simulate(workload, cluster)
    workload.to_json(out / STEP_FILES["workload"])
    write_chrome_trace(result, out / STEP_FILES["trace"])
    plot_timeline(result, out / STEP_FILES["timeline"])
    plot_memory(result, out / STEP_FILES["memory"])
    return {"model": run.iteration_model, "layers": run.step_layers, "seq_len": run.step_seq_len,
            "ranks": PAPER_RANKS, "cluster": PAPER_CLUSTER, "files": STEP_FILES}
