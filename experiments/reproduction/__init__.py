"""The reproduce tables (``python -m experiments.reproduce``), one module each, and `TABLES`, their one registry.

Each module declares its table as one `Table` (``TABLE``): its name, how it is built from the run's settings
(`RunConfig`) and working state (`Runner`), whether it is simulated or measured, whether it runs only on
request (``--only``), its footer, its plot and its run.json summary.  The command line (its ``--only``
choices and ``--help``), the run loop and the run.json writer read `TABLES`; adding a table is a module here,
its entry below and its test (docs/design.md, "Adding a reproduce table").
"""

from __future__ import annotations

from experiments.reproduction import (
    alst,
    breakdown_a100,
    external_fidelity,
    max_seq_len,
    max_seq_len_configs,
    measured_cpu,
    memory_cap,
    strategies,
    throughput,
)
from experiments.reproduction.run import RunConfig, Runner
from experiments.reproduction.table import Table

TABLES: tuple[Table, ...] = (
    max_seq_len.TABLE, max_seq_len_configs.TABLE, external_fidelity.TABLE, strategies.TABLE, alst.TABLE,
    breakdown_a100.TABLE, throughput.TABLE,
    measured_cpu.TABLE, memory_cap.TABLE,
)
"""Every reproduce table, in the order a run builds them (the max-seq-len search simulates the throughput
table's steps: Note [Throughput steps from the search's traces] in experiments/reproduction/max_seq_len.py)."""

BY_NAME: dict[str, Table] = {table.name: table for table in TABLES}
RECORDS: tuple[str, ...] = tuple(table.record for table in TABLES if table.record)
"""The run.json keys of the tables' summaries."""


def selected(only: str | None) -> tuple[str, ...]:
    """The tables a run builds, in order: ``only``, or every table not run on request."""
    return tuple(t.name for t in TABLES if t.name == only or (not only and not t.on_request))


__all__ = ["BY_NAME", "RECORDS", "TABLES", "RunConfig", "Runner", "Table", "selected"]
