"""`Table`: one reproduce table as one object (docs/design.md, "Adding a reproduce table")."""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from experiments.reproduction.run import RunConfig, Runner

HELP_INDENT = 18
"""Column of a table's description in ``--help`` (a longer name goes on a line of its own)."""


@dataclass(frozen=True)
class Table:
    """A reproduce table: written as ``NAME.csv`` and ``NAME.md`` (`experiments.tables.write_table`), its plot as
    ``NAME.png``, its summary into run.json under ``record``."""

    name: str
    """The table's name: its files, ``--only NAME``, the key of run.json's ``tables``."""
    help: str
    """What ``--help`` says it shows (lines broken as they are printed, no indentation)."""
    build: Callable[[RunConfig, Runner], list[dict]]
    """The table's rows (dicts with the same keys, in column order) for one run."""
    simulated: bool
    """Simulated at paper scale (its tasks run on the worker pool); False: measured on gloo ranks, with the pool
    shut down so that idle workers do not share the CPU with them."""
    on_request: bool = False
    """Built only when ``--only`` names it (each such table is several times the max-seq-len table's time)."""
    record: str | None = None
    """run.json key of the table's `summary` (None: no summary); kept from an earlier run.json when a run does not
    rebuild the table."""
    summary: Callable[[list[dict]], dict] | None = None
    """The run.json record of the rows."""
    footer: Callable[[list[dict], dict | None], Sequence[str]] | None = None
    """Lines below the Markdown table, from the rows and the `summary` (None without one)."""
    plot: Callable[[list[dict], pathlib.Path], None] | None = None
    """Writes the table's figure to the path given (``NAME.png``)."""

    def __post_init__(self):
        if (self.record is None) != (self.summary is None):
            raise ValueError(f"table {self.name}: give both a run.json record key and its summary, or neither")

    def help_lines(self) -> list[str]:
        """The table's entry in ``--help``: its name, then its description from column `HELP_INDENT`."""
        first, *rest = self.help.splitlines()
        head = (f"  {self.name:<{HELP_INDENT - 2}}{first}" if len(self.name) < HELP_INDENT - 2
                else f"  {self.name}\n{' ' * HELP_INDENT}{first}")
        return [head, *(" " * HELP_INDENT + line for line in rest)]
