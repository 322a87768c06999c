"""What several reproduce tables read: the published figures, the systems of the simulated and measured tables,
the paper's cluster, the CPU model of the measured tables, and the small formatters of their cells."""

from __future__ import annotations

import csv
import pathlib

from experiments.paper_scale.config import PAPER_CLUSTER, PAPER_RANKS  # noqa: F401 - the tables read them here
from simulator.strategies import STRATEGIES

REFERENCE_CSV = pathlib.Path(__file__).resolve().parents[1] / "data" / "autosp-paper-figures.csv"
DISAGREEMENT = 0.20
"""A simulated value further than this from its published counterpart is flagged in the ``note`` column."""
CPU_MODEL, CPU_MODEL_OPTIONS = "hf-llama", {"kv_heads": 4}  # 8 query heads, 4 kv heads: GQA splits over 4 ranks
EXACT_GRAD_ERROR = 1e-3  # above this relative gradient error a system is flagged inexact
MEASUREMENT_TIMEOUT_S = 3600.0  # deadline of one gloo run of the measured tables (all systems)
COLLECTIVE_TIMEOUT_S = 600.0  # how long a collective waits for a rank still compiling


def published_figures() -> list[dict[str, str]]:
    lines = [ln for ln in REFERENCE_CSV.read_text().splitlines() if ln and not ln.startswith("#")]
    return list(csv.DictReader(lines))


def published_systems() -> tuple[str, ...]:
    """The strategies with a published figure, in the order of the published-figures table (its ``system``
    column spells them as `simulator.strategies.STRATEGIES` does)."""
    return tuple(dict.fromkeys(STRATEGIES[r["system"]].name for r in published_figures()))


def paper_models() -> list[str]:
    """The models of the published max-seq-len figure: what ``--models`` and ``--iteration-model`` accept."""
    return list(dict.fromkeys(r["model"] for r in published_figures() if r["figure"] == "max_seq_len"))


def throughput_lengths() -> tuple[int, ...]:
    """The lengths of the published iteration times (the throughput table's rows)."""
    return tuple(sorted({int(r["seq_len"]) for r in published_figures() if r["figure"] == "iteration_s"}))


SIMULATED = STRATEGIES.table("paper-scale")
"""The systems of the simulated tables."""
UNPUBLISHED = tuple(s for s in SIMULATED if not STRATEGIES[s].published)
"""Simulated beside the published systems, with no published figure."""
MEASURED = STRATEGIES.table("measured-cpu")
"""The systems of the measured CPU tables."""
CPU_SYSTEMS = tuple(dict.fromkeys((*MEASURED, *STRATEGIES.table("memory-cap"))))
"""Every system a CPU-measured table (measured-cpu, memory-cap) has a row for: what ``--cpu-systems`` chooses from."""
TRACE_GROUPS = STRATEGIES.trace_groups(SIMULATED)
"""Systems simulated by one task: ring attention rewrites the Ulysses traces, so they share a task (a cache).
AutoSP first (first in the registry): its selective checkpointing is re-sized from the joint graphs of two traces,
the others are interpolated between a few traces (Note [One trace per length class] in experiments/paper_scale/simulate.py)."""


def error_pct(simulated: int | None, published: str) -> float | None:
    """Signed error of ``simulated`` against a published number, in percent (None: either is missing)."""
    if simulated is None or not published.replace(".", "").isdigit():  # 0: nothing fits (-100 %)
        return None
    return 100.0 * (simulated - float(published)) / float(published)


def tokens(result) -> str:
    """A search's length as the table shows it (``≥ N`` for a lower bound, ``< N`` when nothing fitted)."""
    return result.display().replace(",", "")


def length_of(result) -> str:
    """The number behind a search's display (a lower bound's bound; empty when nothing fitted)."""
    return "" if result is None or result.max_seq_len is None else str(result.max_seq_len)


def fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)
