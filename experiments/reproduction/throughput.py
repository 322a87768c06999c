"""The ``throughput`` table: simulated tokens/s per GPU of every system at the published lengths, beside the
published iteration seconds."""

from __future__ import annotations

from experiments.reproduction.common import TRACE_GROUPS, UNPUBLISHED, published_figures, throughput_lengths
from experiments.reproduction.run import RunConfig, Runner, trace_counts
from experiments.reproduction.table import Table


def simulate_steps_task(model: str, seq_len: int, systems: tuple[str, ...], layers: str = "full", cache=None):
    """Simulated whole steps of ``systems`` for one model and length ({system: SimulatedStep}), and (traced,
    reused) trace counts.  One task of the throughput table."""
    from experiments.paper_scale.simulate import TraceCache, simulate_step

    cache = cache if cache is not None else TraceCache(interpolate_lengths=True)
    before = trace_counts(cache)
    steps = {system: simulate_step(system, model, seq_len, cache=cache, layers=layers) for system in systems}
    return steps, trace_counts(cache, before)


def build(run: RunConfig, runner: Runner) -> list[dict]:
    rows = []
    published = [r for r in published_figures() if r["figure"] == "iteration_s"]
    lengths = throughput_lengths()
    published += [{"seq_len": str(length), "system": system, "value": ""} for length in lengths
                  for system in UNPUBLISHED]
    # simulated by the max-seq-len table's tasks when it ran (Note [Throughput steps from the search's traces] in
    # experiments/reproduction/max_seq_len.py)
    sims = dict(runner.simulated_steps)
    tasks = [(simulate_steps_task, (run.iteration_model, seq_len, systems, run.layers))
             for seq_len in lengths for systems in TRACE_GROUPS
             if any((system, seq_len) not in sims for system in systems)]
    for (_, (_, seq_len, *_)), steps in zip(tasks, runner.run_tasks(tasks, f"throughput (simulated "
                                                                         f"{run.iteration_model})"), strict=True):
        sims.update({(system, seq_len): step for system, step in steps.items()})
    for row in published:
        seq_len = int(row["seq_len"])
        sim = sims.get((row["system"], seq_len))
        fits = sim is not None and sim.fits
        rows.append({
            "seq_len": seq_len, "system": row["system"],
            "simulated_tokens_per_s_per_gpu": f"{sim.tokens_per_s_per_gpu:.0f}" if fits else "",
            "simulated_step_s": f"{sim.step_time_s:.3f}" if fits else "",
            "simulated_peak_gib": "" if sim is None else f"{sim.peak_memory_bytes / 2**30:.1f}",
            "published_iteration_s": row["value"],
            "note": "simulated OOM" if sim is not None and not fits else "not simulated yet" if sim is None else "",
        })
    return rows


THROUGHPUT_UNKNOWN = ("The published iteration times come without their batch size, gradient-accumulation steps or "
                      "what the timer covers (data loading, optimizer step, logging), so they are shown beside the "
                      "simulated throughput, not divided by it.")
"""What is unknown about the published iteration (the throughput table's note and the paper say it)."""


def footer(rows: list[dict], summary: None) -> list[str]:
    return [THROUGHPUT_UNKNOWN + " Simulated: one whole step (forward, backward, gradient reduction, optimizer) of "
            "one sequence split over the ranks (ZeRO-3: one sequence per rank), micro-batch 1."]


TABLE = Table(
    name="throughput",
    help="simulated tokens/s per GPU of every system at the published lengths, beside the\n"
         "published iteration seconds (whose batch and timer are not published: no ratio)",
    build=build, simulated=True, footer=footer)
