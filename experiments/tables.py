"""The one writer of result tables and bar plots: a table is a list of dict rows, written as ``NAME.csv``
(every column, raw values) and ``NAME.md`` (a Markdown table, optionally with chosen columns, headers and
formats, and lines below it)."""

from __future__ import annotations

import csv
import pathlib
from collections.abc import Sequence

Column = tuple[str, str, str]
"""(row key, header, format string such as ``"{:.2f}"``)."""


def markdown_table(rows: list[dict], columns: Sequence[Column] | None = None) -> str:
    """``rows`` as a Markdown table (no trailing newline); ``columns`` default to every key of the first row."""
    columns = columns or [(key, key, "{}") for key in rows[0]]
    lines = ["| " + " | ".join(header for _, header, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt.format(row[key]) for key, _, fmt in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_table(name: str, rows: list[dict], out: pathlib.Path, *, columns: Sequence[Column] | None = None,
                footer: Sequence[str] = ()) -> None:
    """``out/NAME.csv`` and ``out/NAME.md`` (with ``footer`` lines below the table); nothing for no rows."""
    if not rows:
        return
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{name}.csv", "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    text = markdown_table(rows, columns) + "\n"
    if footer:
        text += "\n" + "\n".join(footer) + "\n"
    (out / f"{name}.md").write_text(text, encoding="utf-8")


def bar_plot(rows: list[dict], value: str, ylabel: str, title: str, path: pathlib.Path, *,
             group: str = "ranks", group_label: str = "{} ranks") -> None:
    """Grouped bars of column ``value`` per system, one bar per value of column ``group`` (rank counts, or any
    column's values in the rows' order; rows without a value are left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys(str(r[group]) for r in rows))  # in the rows' order; rank counts ascending
    if all(g.isdigit() for g in groups):
        groups.sort(key=int)
    systems = list(dict.fromkeys(r["system"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / max(len(groups), 1)
    for i, g in enumerate(groups):
        values = [next((float(r[value]) for r in rows if r["system"] == s and str(r[group]) == g and r[value] != ""),
                       0.0) for s in systems]
        ax.bar([x + i * width for x in range(len(systems))], values, width, label=group_label.format(g))
    ax.set_xticks([x + width * (len(groups) - 1) / 2 for x in range(len(systems))], systems, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
