"""Numbers only from runs: the paper source and the notebooks' Markdown cells type no number by hand.

The rule.  Ignored first: ``{{placeholders}}`` (filled from a results folder by
``python -m experiments.paper``), code spans and fenced code blocks, HTML comments,
the number of a numbered section heading (``## 3. Results``) and the marker of an
ordered-list item (``1. ``).  In what is left, a *bare number* is

- a run of digits (with its decimal point, thousands separators, ``K``/``M``/``×``/
  ``%`` suffixes) that begins a word: ``8``, ``2.7``, ``8K``, ``100K+``, ``30×``,
  ``8×A100`` — unless the word begins with a letter, which makes the digits part of
  a name (``Llama-3.1-8B``, ``ZeRO-3``, ``A100-80GB``, ``fp32``, ``GPT-2``);
- a number word used as a quantity: ``twice``, ``a third``, ``half``, ``two to four
  times``, ``eight times fewer``, ``a dozen``, ``hundreds``.

Such a number is either computed (a placeholder, or in a notebook a code cell that
prints it) or cut.
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "experiments" / "notebooks").glob("*.ipynb"))

_IGNORED = [
    re.compile(r"<!--.*?-->", re.DOTALL),           # HTML comments
    re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE),  # fenced code blocks
    re.compile(r"\{\{[^{}]*\}\}"),                  # placeholders
    re.compile(r"`[^`\n]*`"),                       # code spans
    re.compile(r"^#+\s+\d+(?:\.\d+)*\.?(?=\s)", re.MULTILINE),  # section number of a heading
    re.compile(r"^\s*\d+\.(?=\s)", re.MULTILINE),   # ordered-list marker
]
_NUMBER_WORDS = r"(?:a|an|one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|twenty|thirty|forty|fifty|hundred)"
_BARE = [
    # digits that begin a word (a word that begins with a letter is a name)
    re.compile(r"(?<![\w.\-/])\d[\d.,]*"),
    re.compile(rf"\b{_NUMBER_WORDS}\s+(?:times|fold|half|third|thirds|quarter|quarters)\b", re.IGNORECASE),
    re.compile(r"\b(?:twice|thrice|half|halves|thirds?|quarters?|dozens?|hundreds|thousands|millions)\b",
               re.IGNORECASE),
]


def bare_numbers(markdown: str) -> list[str]:
    """Every bare number of ``markdown`` (see the module docstring), each with a little of its context."""
    for pattern in _IGNORED:
        markdown = pattern.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), markdown)
    found = []
    for pattern in _BARE:
        for match in pattern.finditer(markdown):
            line = markdown[: match.start()].count("\n") + 1
            context = markdown[max(0, match.start() - 30): match.end() + 30].replace("\n", " ")
            found.append(f"line {line}: {match.group()!r} in ...{context.strip()}...")
    return found


@pytest.mark.parametrize("text, bare", [
    ("Llama-3.1-8B and ZeRO-3 on A100-80GB with fp32 and GPT-2", False),
    ("## 3. Results\n\n1. first pass", False),
    ("{{cell:t:a=1:b}} tokens, `python -m x --seq-len 256`, <!-- 42 -->", False),
    ("```bash\nrun --steps 5\n```", False),
    ("at 100K+ tokens", True),
    ("a step runs about a third slower", True),
    ("two to four times more", True),
    ("about 3× Ulysses", True),
    ("on 8×A100-80GB", True),
    ("differs by 20 %", True),
    ("PyTorch 2.7", True),
])
def test_bare_number_rule(text, bare):
    assert bool(bare_numbers(text)) is bare, bare_numbers(text)


def test_paper_source_types_no_number():
    found = bare_numbers((ROOT / "paper" / "paper.md").read_text())
    assert found == [], "paper/paper.md: use a placeholder (paper/README.md) or cut the claim:\n" + "\n".join(found)


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_markdown_types_no_number(notebook):
    cells = json.loads(notebook.read_text())["cells"]
    found = [f"cell {i}: {hit}" for i, cell in enumerate(cells) if cell["cell_type"] == "markdown"
             for hit in bare_numbers("".join(cell["source"]))]
    assert found == [], (f"{notebook.name} (built by experiments/notebooks/build.py): compute the number in a "
                         "code cell or cut it:\n" + "\n".join(found))
