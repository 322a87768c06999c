"""The ``external-fidelity`` table: published per-GPU memory of runs whose whole configuration is published, beside
the simulated one (the rows: `experiments.paper_scale.external_fidelity`)."""

from __future__ import annotations

from experiments.reproduction.run import RunConfig, Runner
from experiments.reproduction.table import Table


def build(run: RunConfig, runner: Runner) -> list[dict]:
    from experiments.paper_scale.external_fidelity import external_fidelity_rows

    return external_fidelity_rows(layers=run.layers, cache=runner.cache)


def summary(rows: list[dict]) -> dict:
    from experiments.paper_scale.external_fidelity import median_abs_error_pct

    return {"median_abs_error_pct": median_abs_error_pct(rows), "figures": len(rows),
            "sources": sorted({r["source"] for r in rows})}


def footer(rows: list[dict], summary: dict) -> list[str]:
    return [
        f"Median |simulated / published - 1|: {summary['median_abs_error_pct']} % over "
        f"{summary['figures']} figures from "
        f"{', '.join(summary['sources'])}; nothing fitted. Memory is torch's "
        "max_memory_reserved (no CUDA context, no NCCL buffers); how each configuration is modelled is in "
        "modelled_as (Note [What the external figures measure and how they are modelled])."]


TABLE = Table(
    name="external-fidelity",
    help="published per-GPU memory of runs whose whole configuration is published (torchtitan's\n"
         "Llama-3.1-8B benchmarks), beside the simulated one, with each configuration's provenance",
    build=build, simulated=True, on_request=True, record="external_fidelity_summary", summary=summary,
    footer=footer)
