"""Numbers only from runs: the paper source and the notebooks' Markdown cells type no number by hand, and the user
documents (README.md, the user guide in docs/) type no measurement.

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

The user documents (README.md and every page of docs/, the design notes included) follow a narrower rule, since
their prose names inputs and specifications by number (ranks, layers, lengths, option defaults, section numbers):
they type no *measurement* of this project.  A measurement is a number with a unit of measurement, or a number
with a fractional part, outside code spans, fenced blocks and HTML comments (see `typed_measurements`):

- a time (``93.5 s``, ``16 min 41 s``, ``10-minute``, ``about a minute``, ``two hours``), a size or data rate
  (``69.3 GiB``, ``3.41 GB/s``, ``400 Gb/s``), a percentage (``13.7 %``), a ratio (``7.00x``, ``0.98×``,
  ``1.7 times``), a rate (``tokens/s``, ``TFLOPS``);
- a token count (``3,200 tokens``, ``2,048-token``) unless it is a length given as an input, listed in
  `INPUT_LENGTHS` with where it is an input;
- a number with a fractional part (``1.14``, ``0.110``), a ratio or a time without its unit.

Allowed: a value written as an option default (``default 540 s``, ``(default: 64 MiB``), a number inside a word
that begins with a letter or after a hyphen (``Llama-3.1-8B``, ``A100-80GB``), ``8×A100`` (a count times a
device), a version with two dots (``0.16.3``) and the specifications in `ALLOWED`, each with its reason.  A
measurement is named by the command or run record that produces it (``results/memory-cap.md``, ``results/run.json``,
a benchmark's command line), never typed.
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


BARE_EXAMPLES = [  # (text, whether `bare_numbers` finds a number in it)
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
]


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


# --- The user documents: no typed measurement (module docstring, second rule) ---

USER_DOCS = ("README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")))
"""README.md and every page of docs/ (the user guide and docs/design.md): none is exempt."""

_NUM = r"(?<![\w.\-/])\d[\d,]*(?:\.\d+)?"
_WORD_COUNT = (r"(?:two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|fifteen|twenty|thirty|forty|fifty|"
               r"sixty|ninety|a\s+few|few|several)")
_TOKEN_COUNT = re.compile(rf"(?P<count>{_NUM}[KM]?)(?:\s+|-)tokens?\b")
_MEASUREMENT = [
    ("time", re.compile(rf"{_NUM}\s?-?(?:ms|µs|us|s|sec|secs|seconds?|min|mins|minutes?|h|hrs?|hours?|days?)\b")),
    ("time", re.compile(rf"\b(?:(?:a|an|one|half\s+an?)\s+(?:minute|hour)|{_WORD_COUNT}\s+(?:seconds|minutes|hours))\b",
                        re.IGNORECASE)),
    ("size or rate", re.compile(rf"{_NUM}\s?(?:[KMGTP]i?B|[KMGT]b)(?:/s)?\b")),
    ("percentage", re.compile(rf"{_NUM}\s?%")),
    ("ratio", re.compile(rf"{_NUM}[x×](?![\w-])|{_NUM}\s+times\b|\b{_WORD_COUNT}\s+times\s+(?:faster|slower|longer|"
                         r"shorter|more|less|fewer|as)\b", re.IGNORECASE)),
    ("rate", re.compile(rf"{_NUM}\s?(?:(?:tokens?|samples?|steps?|it)/s|[KMGTP]?FLOPS|[KMGTP]?FLOP/s)\b")),
    ("token count", _TOKEN_COUNT),
    ("fraction", re.compile(r"(?<![\w.\-/])\d+\.\d+(?!\.?\d)(?![A-Za-z])")),
]
_DEFAULT = re.compile(r"default:?\s*$")

INPUT_LENGTHS = {
    "256": "measured-cpu's --quick length (experiments/reproduction/run.py, PRESETS)",
    "768": "the calibration's reference step (experiments/calibrate_cpu.py)",
    "1024": "measured-cpu's length (PRESETS); the validation's longest configuration",
    "65536": "experiments.bench_planner's default --seq-len",
    "1048576": "the longest length of the strategies table's grid (experiments/paper_scale/strategy_table.py)",
    "3.7M": "ALST's published length (arXiv 2506.13996), the planner example's input",
}
"""Token counts that are inputs (a command's length, a table's grid), never a length reached."""

ALLOWED = {
    "400 Gb/s": "the cluster presets' NIC rate, a hardware spec sourced in simulator/cluster_presets.py",
    "within 5 %": "the strategies table's column definition (auto_within_5pct in experiments/paper_scale/"
                  "strategy_table.py)",
    "at least 4 KiB": "activation offload's size threshold, a constant of the pass",
    "arXiv 2506.13996": "a paper's identifier",
}
"""Specifications that read as measurements: the phrase, and why it is not one."""


def typed_measurements(markdown: str) -> list[str]:
    """Every typed measurement of ``markdown`` (module docstring, second rule), each with a little of its context."""
    for pattern in _IGNORED[:4]:  # comments, fenced blocks, placeholders, code spans
        markdown = pattern.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), markdown)
    allowed = [(m.start(), m.end()) for phrase in ALLOWED for m in re.finditer(re.escape(phrase), markdown)]
    found = {}
    for kind, pattern in _MEASUREMENT:
        for match in pattern.finditer(markdown):
            start, end = match.span()
            if any(a <= start and end <= b for a, b in allowed) or _DEFAULT.search(markdown[max(0, start - 12):start]):
                continue
            if kind == "token count" and match.group("count").replace(",", "") in INPUT_LENGTHS:
                continue
            if any(s <= start < e or start <= s < end for s, e in found):
                continue  # one report per figure (93.5 s is a time, not also a fraction)
            line = markdown[:start].count("\n") + 1
            context = markdown[max(0, start - 30): end + 30].replace("\n", " ")
            found[start, end] = f"line {line}: {kind} {match.group()!r} in ...{context.strip()}..."
    return [found[k] for k in sorted(found)]


TYPED_EXAMPLES = [  # (text, whether `typed_measurements` finds a measurement in it)
    ("reaches 3,200 tokens in 93.5 s", True),
    ("pytest took 29 min 20 s", True),
    ("a 10-minute run", True),
    ("a prediction takes about a minute", True),
    ("69.3 GiB of 80 per rank", True),
    ("copies at 3.41 GB/s here", True),
    ("median |error| 13.7 % over 11 figures", True),
    ("**7.00x** the baseline", True),
    ("`autosp` 0.98× the step of `ulysses`", True),
    ("1.7 times the baseline", True),
    ("two times faster", True),
    ("logs 2,400 tokens/s", True),
    ("step-time ratios of 1.75 and 1.90", True),
    ("in 1,024-token steps", False),
    ("searches in 2,048-token steps", True),
    ("SP 4 x DP 2 on 8 ranks, ZeRO 0–2, 2 × 2 on 4 ranks, 5 steps", False),
    ("Llama-3.1-8B on 8×A100-80GB, an 8B model, Qwen2-1.5B, DeepSpeed 0.16.3", False),
    ("at 65,536 tokens, ALST's 3.7M tokens", False),
    ("`plan_timeout_s` (default 540 s, chunks (default: 64 MiB of logits), (default 0.25)", False),
    ("`--seq-len 256 --steps 5`, <!-- 42 s -->, {{cell:t:a=1:b}}", False),
    ("a rail-optimised 400 Gb/s network; auto within 5 % of it", False),
    ("## 3. Results\n\n1. first pass, Note [DeepSpeed 0.16.3 as the AutoSP fork ran it]", False),
    ("the attention runs twice; a second model", False),
]


@pytest.mark.parametrize(("rule", "text", "found"), [(bare_numbers, *e) for e in BARE_EXAMPLES]
                         + [(typed_measurements, *e) for e in TYPED_EXAMPLES])
def test_rule_examples(rule, text, found):
    assert bool(rule(text)) is found, rule(text)


def test_every_allowed_figure_is_used():
    """The exceptions stay as few as the documents need: each one is used by some user document."""
    texts = [(ROOT / doc).read_text(encoding="utf-8") for doc in USER_DOCS]
    counts = {m.group("count").replace(",", "") for text in texts for m in _TOKEN_COUNT.finditer(text)}
    stale = [k for k in INPUT_LENGTHS if k not in counts] + [k for k in ALLOWED if not any(k in t for t in texts)]
    assert stale == [], f"no user document needs these exceptions any more; remove them: {stale}"


@pytest.mark.parametrize("doc", USER_DOCS)
def test_user_docs_type_no_measurement(doc):
    found = typed_measurements((ROOT / doc).read_text(encoding="utf-8"))
    assert found == [], (f"{doc}: name the command or run record that produces the figure (results/TABLE.md, "
                         "results/run.json, a benchmark's command) instead of typing it, or, for an input or a "
                         "specification, add it to INPUT_LENGTHS or ALLOWED with its reason:\n" + "\n".join(found))
