"""How one memory-plan decision's candidates are spread over processes: by trace group (`plan_groups`), halved
where processes are spare (`plan_units`), a share to each process (`plan_shares`) and the answers put back in the
candidates' order (`in_plan_order`), the longest length found so far kept where every process reads it
(`LengthBoard`), and how many processes the planner CLI starts by default (`auto_workers`).  Used by
`autosp.plan.planner` (its ``workers``), `autosp.plan.auto` (the ranks of a job) and the planner CLI."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from autosp.entry import positive_int
from autosp.plan.candidates import MemoryPlan
from autosp.plan.traces import checkpointing_variant, rank_share, trace_group

WORKERS_AUTO = "auto"
"""``python -m autosp.plan --workers auto`` (the default): `auto_workers`."""
AUTO_WORKERS_MAX = 4
"""The most processes `auto_workers` gives (each traces and simulates on a core of its own)."""


def auto_workers(objective: str, cores: int | None = None) -> int:
    """The planner CLI's default ``--workers`` for a decision of ``objective`` where this process may run on
    ``cores`` cores (None: those of its CPU affinity): the longest-length search (the slow question: a search per
    candidate) spreads over the cores, at most `AUTO_WORKERS_MAX`; a decision at one length stays in this process,
    where a worker's start (its imports) would cost more than it shares."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(AUTO_WORKERS_MAX, cores)) if objective == "longest" else 1


def workers_argument(value: str) -> int | str:
    """An argparse type for ``--workers``: a positive number, or `WORKERS_AUTO`."""
    if value == WORKERS_AUTO:
        return WORKERS_AUTO
    try:
        return positive_int(value)
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(f"{err}; give a positive number of processes or {WORKERS_AUTO}") from None


def workers_for(requested: int | str, objective: str) -> int:
    """The processes a decision of ``objective`` runs in, for ``--workers`` ``requested``."""
    return auto_workers(objective) if requested == WORKERS_AUTO else int(requested)


def plan_groups(plans: Sequence[MemoryPlan]) -> list[list[int]]:
    """The indices of ``plans`` by trace group (`autosp.plan.traces.trace_group`: the plans that share traces, and
    whose offload candidates `plan_memory` skips by their twins' predictions), groups in the order of their first
    plan: the units a decision can spread over processes without changing a prediction or a skip."""
    groups: dict[tuple, list[int]] = {}
    for i, plan in enumerate(plans):
        groups.setdefault(trace_group(plan.options), []).append(i)
    return list(groups.values())


# Note [Trace groups halved for spare processes]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A decision spreads over processes by trace groups (`plan_groups`), the units inside which a prediction and the
# offload skip (Note [Offload only where it is needed] in autosp/plan/planner.py) are the same as in one process.  With more processes than
# groups (8 ranks, 4 groups of tiled loss x tiled MLP at 8B) the spare ones would wait.  So where there are spare
# processes, `plan_units` halves that many groups by checkpointing variant, each half with its plans' offload twins:
# both halves trace the group's shallow program (a duplicated trace), each partitions and simulates its own
# variants, and only the half whose offload candidate memory needs traces the deeper program the offload plans are
# unrolled from.  A twin and its offload candidate stay in one unit, so the skip is decided as in one process, and
# each candidate's prediction, fit and refusal, the choice and its reason are the one process's; the trace and
# partition counts (summed over the processes) include the duplicated traces, and ``same_program_as`` names only a
# candidate of the same unit.  Measured on Llama-3.1-8B's first group at 65,536 tokens on h100-sxm, SP 8 (one
# warmed process each, 2-core machine): the whole group 23.6 s of CPU, its halves 17.8 and 14.2 s
# (`experiments/bench_planner.py --ranks` takes the whole decision).


def plan_units(plans: Sequence[MemoryPlan], ranks: int) -> list[list[int]]:
    """The units of ``plans`` that ``ranks`` processes share (`plan_shares`): the trace groups (`plan_groups`),
    the first of them halved by checkpointing variant (each half with its offload twins) while there are more
    processes than units (Note [Trace groups halved for spare processes])."""
    units, spare = [], ranks - len(groups := plan_groups(plans))
    for group in groups:
        variants = list(dict.fromkeys(checkpointing_variant(plans[i].options) for i in group))
        if spare > 0 and len(variants) > 1:
            first = set(variants[:(len(variants) + 1) // 2])
            units += [[i for i in group if checkpointing_variant(plans[i].options) in first],
                      [i for i in group if checkpointing_variant(plans[i].options) not in first]]
            spare -= 1
        else:
            units.append(group)
    return units


def plan_shares(units: Sequence[Sequence[int]], ranks: int) -> list[list[int]]:
    """The plan indices each of ``ranks`` processes predicts, given the units ``units`` (`plan_units`, or the
    trace groups of `plan_groups`): whole units, spread by `autosp.plan.traces.rank_share`, each share in the
    plans' order of its units."""
    return [[i for unit in rank_share(units, rank, ranks) for i in unit] for rank in range(ranks)]


def in_plan_order(shares: Sequence[Sequence[int]], found: Sequence[Sequence], count: int) -> list:
    """The ``count`` plans' results in the plans' order, given each share's plan indices (`plan_shares`) and its
    results (``found[k]`` for ``shares[k]``, in the same order); None where no share held the plan."""
    merged: list = [None] * count
    for share, results in zip(shares, found, strict=True):
        for i, result in zip(share, results, strict=True):
            merged[i] = result
    return merged


@dataclass(frozen=True)
class LengthBoard:
    """The longest length a plan of any process of one decision fits so far (Note [The longest plan bounds the
    others' searches] in autosp/plan/planner.py): a folder in which each process keeps its own longest in a file of
    its own, replaced whole, so that a reader sees every process's last value and no write is lost."""

    folder: str

    def keep(self, name: str, length: int) -> None:
        """Record ``length`` as process ``name``'s longest."""
        staged = Path(self.folder, f".{name}")
        staged.write_text(str(length))
        os.replace(staged, Path(self.folder, name))

    def longest(self) -> int | None:
        """The longest length any process has recorded (None: none yet)."""
        return max((int(path.read_text()) for path in Path(self.folder).iterdir() if not path.name.startswith(".")),
                   default=None)
