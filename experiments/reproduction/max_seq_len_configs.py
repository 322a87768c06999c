"""The ``max-seq-len-configs`` table: the published max lengths beside the simulated ones under every public
configuration of the authors' runs, their band and the closest configuration (Note [The public configurations
of the published runs] in experiments/paper_scale/config.py)."""

from __future__ import annotations

from experiments.reproduction.common import DISAGREEMENT, TRACE_GROUPS, published_figures, published_systems
from experiments.reproduction.run import RunConfig, Runner, trace_counts
from experiments.reproduction.table import Table


def search_configs_task(model: str, systems: tuple[str, ...], configs: tuple[str, ...], granularity: dict[str, int],
                        max_probes: int, ceiling: int, layers: str = "full", cache=None) -> tuple[dict, dict]:
    """Longest simulated sequence of ``systems`` for one model under each public configuration ``configs``
    ({(config, system): MaxLength}) and the trace counts; traces of equal SP degree are shared through
    ``cache``."""
    from experiments.paper_scale.config import PUBLIC_CONFIGS
    from experiments.paper_scale.simulate import TraceCache, max_length

    cache = cache if cache is not None else TraceCache(interpolate_lengths=True)
    before = trace_counts(cache)
    found = {}
    for name in configs:
        for system in systems:  # the later systems of a trace group start at the first's length (as max-seq-len)
            first = found.get((name, systems[0]))
            start = first.nominal.max_seq_len if first else None
            found[name, system] = max_length(system, model, granularity=granularity[system], high=ceiling,
                                             start=start or 8192, max_probes=max_probes, cache=cache,
                                             config=PUBLIC_CONFIGS[name], layers=layers)
    return found, trace_counts(cache, before)


def _band() -> tuple[str, ...]:
    """The configurations whose lengths span the band."""
    from experiments.paper_scale.config import BAND_CONFIGS, PUBLIC_CONFIGS

    return tuple(name for name in BAND_CONFIGS if name in PUBLIC_CONFIGS)


def build(run: RunConfig, runner: Runner) -> list[dict]:
    from experiments.paper_scale.config import PUBLIC_CONFIGS, configuration_band, explain_outside

    published = [r for r in published_figures() if r["figure"] == "max_seq_len"]
    published = [r for r in published if not run.models or r["model"] in run.models]
    configs = tuple(PUBLIC_CONFIGS)
    published_only = published_systems()
    granularity = run.granularities(published_only)
    groups = [g for g in TRACE_GROUPS if set(g) <= set(published_only)]
    tasks = [(search_configs_task, (model, systems, configs, granularity, run.search_probes,
                                    run.max_seq_len_ceiling, run.layers))
             for model in sorted({r["model"] for r in published}) for systems in groups]
    lengths: dict = {name: {} for name in configs}
    results: dict = {}
    for (_, (model, *_)), found in zip(tasks, runner.run_tasks(tasks, "max-seq-len-configs"), strict=True):
        for (name, system), result in found.items():
            lengths[name][model, system] = result.nominal.max_seq_len
            results.setdefault((model, system), {})[name] = result
    return explain_outside(configuration_band(published, lengths, band=_band(), granularity=granularity), results)


def summary(rows: list[dict]) -> dict:
    from experiments.paper_scale.config import PUBLIC_CONFIGS, consistent_configs

    configs = tuple(PUBLIC_CONFIGS)
    return {
        "configs": {name: {"label": PUBLIC_CONFIGS[name].label, "provenance": PUBLIC_CONFIGS[name].provenance}
                    for name in configs},
        "band": list(_band()), "inside_band": sum(r["inside_band"] == "true" for r in rows), "compared": len(rows),
        "consistent_with_all": consistent_configs(rows, configs, DISAGREEMENT)}


def footer(rows: list[dict], summary: dict) -> list[str]:
    consistent = ", ".join(summary["consistent_with_all"]) or "none"
    return [
        f"{summary['inside_band']} of {summary['compared']} published lengths inside the band of "
        f"{', '.join(summary['band'])} (its upper end extended by the search granularity: a search answers the "
        f"longest fitting multiple of it). Configuration within {DISAGREEMENT:.0%} of every published length: "
        f"{consistent}. closest_config is a choice among stated configurations, not a prediction; nothing is "
        "fitted. The fork configurations trace what the authors' fork ran (AutoSP's checkpointing rule, K/V repeated "
        "before SDPA, the Ulysses baseline's attention kernel: Note [The traced workloads of the AutoSP research "
        "fork]); outside_evidence names, for a figure outside the band, the closest configuration's peak at the "
        "published length and its largest ledger items.",
        "", *[f"{name}: {c['label']} -- {c['provenance']}" for name, c in summary["configs"].items()],
    ]


TABLE = Table(
    name="max-seq-len-configs",
    help="the published max lengths beside the simulated ones under every public configuration\n"
         "of the authors' runs (DeepSpeed 0.16.3 stage 0 / ZeRO 1, SP 8, SP 4 x DP 2, SP 2 x DP 4),\n"
         "the script default, the band they span and the closest configuration",
    build=build, simulated=True, on_request=True, record="max_seq_len_configs_summary", summary=summary,
    footer=footer)
