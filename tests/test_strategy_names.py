"""One name per system across the tree (issue 21): every system the tables, the published figures, the write-up, the
notebooks, the CLIs and the docs name is a name of `simulator.strategies.STRATEGIES`, spelled as there, and no module
keeps its own list of them.

Read from the files themselves: the ``system`` column of every CSV under experiments/data; the ``system=`` and
``compare`` placeholders of paper/*.md; every quoted or backticked word that is a registry name spelled otherwise
(separators, a ``+``, an ``attention`` suffix: ``ring_attention``, ``zero-3``, ``ulysses_ckpt``); and every bracketed
list of two or more registry names in experiments/ and simulator/ outside the registry itself.
"""

from __future__ import annotations

import csv
import json
import pathlib
import re

import pytest

from simulator.strategies import STRATEGIES

ROOT = pathlib.Path(__file__).resolve().parent.parent
MISSPELLED_ON_PURPOSE = ("tests/simulator/test_strategies.py", "tests/test_strategy_names.py", "tests/autosp/test_ring.py")
"""Tests that spell names wrong to check that the registry refuses them."""
QUOTED = re.compile(r"""\\?[`'"]([A-Za-z][\w+\-]*)\\?[`'"]""")
NAME_LIST = re.compile(r"""[\[(]\s*(?:\\?["'][^"'\n]+\\?["']\s*,\s*)+\\?["'][^"'\n]+\\?["']\s*,?\s*[\])]""")
NOTEBOOK_BUILDER = "experiments/notebooks/build.py"


def _files(*patterns: str) -> list[pathlib.Path]:
    return sorted({p for pattern in patterns for p in ROOT.glob(pattern) if ".venv" not in p.parts})


def _text(path: pathlib.Path) -> str:
    """The file's text; a notebook's cell sources (its outputs are not the tree's spelling)."""
    if path.suffix == ".ipynb":
        return "\n".join("".join(cell["source"]) for cell in json.loads(path.read_text())["cells"])
    return path.read_text()


def _key(word: str) -> str:
    """``word`` without separators and an ``attention`` suffix: equal keys are one system spelled two ways."""
    key = re.sub(r"[-_+ ]", "", word)
    return key[: -len("attention")] if key.endswith("attention") and key != "attention" else key


KEYS = {_key(name): name for name in STRATEGIES}


def _misspelled(text: str) -> list[str]:
    return sorted({f"{w} (the registry spells it {KEYS[_key(w)]})" for w in QUOTED.findall(text)
                   if w not in STRATEGIES and _key(w) in KEYS})


def _name_lists(text: str) -> list[str]:
    """Bracketed literals of two or more strategy names."""
    return [m.group(0) for m in NAME_LIST.finditer(text)
            if sum(w.strip("\\\"' ") in STRATEGIES for w in m.group(0)[1:-1].split(",")) >= 2]


def test_strategy_names_the_registry_is_listable_and_the_checks_see_other_spellings():
    assert {"autosp", "ulysses", "ulysses+ckpt", "ring", "zero3"} <= set(STRATEGIES)
    assert _misspelled('x = "ring_attention"; `zero-3`, "ulysses_ckpt", "ring", "ring_send"') == [
        "ring_attention (the registry spells it ring)", "ulysses_ckpt (the registry spells it ulysses+ckpt)",
        "zero-3 (the registry spells it zero3)"]
    assert _name_lists('S = ("zero3", "ring")\nT = [\\"autosp\\", \\"ulysses\\"]\nU = ("ring", "sp")') == [
        '("zero3", "ring")', '[\\"autosp\\", \\"ulysses\\"]']


@pytest.mark.parametrize("path", _files("experiments/data/*.csv"), ids=lambda p: p.name)
def test_strategy_names_in_the_system_column_of_every_data_table(path):
    lines = [ln for ln in path.read_text().splitlines() if ln and not ln.startswith("#")]
    systems = {row["system"] for row in csv.DictReader(lines) if "system" in row}
    assert systems - set(STRATEGIES) == set()


def test_strategy_names_published_figures_are_the_registrys_published_strategies():
    from experiments.reproduction.common import published_systems

    assert set(published_systems()) == {name for name in STRATEGIES if STRATEGIES[name].published}


def test_strategy_names_in_the_placeholders_of_the_write_up():
    named = []  # {{cell:TABLE:COL=VALUE,...:COLUMN}} and {{compare:TABLE:COL=VALUE,...:COLUMN:A:B}}
    for kind, arg in re.findall(r"\{\{(cell|compare):([^}]*)\}\}", (ROOT / "paper" / "paper.md").read_text()):
        parts = arg.split(":")
        named += [v for c, _, v in (kv.partition("=") for kv in parts[1].split(",")) if c == "system"]
        named += parts[3:5] if kind == "compare" else []
    assert "ring" in named and sorted(set(named) - set(STRATEGIES)) == []


def test_strategy_names_one_spelling_per_system():
    tree = _files("README.md", "docs/**/*.md", "paper/*.md", "experiments/**/*.py", "experiments/**/*.ipynb",
                  "experiments/data/*.csv", "simulator/**/*.py", "tests/**/*.py")
    found = {str(p.relative_to(ROOT)): _misspelled(_text(p)) for p in tree
             if p.relative_to(ROOT).as_posix() not in MISSPELLED_ON_PURPOSE}
    assert {path: words for path, words in found.items() if words} == {}


NOTEBOOKS = (NOTEBOOK_BUILDER, "experiments/notebooks/*.ipynb")
"""The notebook builder and the notebooks it writes (checked on their own below)."""


def test_strategy_names_the_compiled_strategies_are_declared_once():
    """The pass's strategy names: the members of simulator.workload.SPKind (declared in simulator/sp_layout.py,
    re-exported by simulator.workload), whose names autosp.config (which may import only that module of the
    simulator) and the registry's SEQUENCE_PARALLEL read; no module spells them as a list."""
    import ast

    import autosp.config
    import simulator.strategies
    import simulator.workload

    assert autosp.config.STRATEGIES is simulator.workload.COMPILED_STRATEGIES == ("ulysses", "ring", "hybrid")
    assert simulator.workload.COMPILED_STRATEGIES == tuple(kind.value for kind in simulator.workload.SPKind)
    kinds = simulator.strategies.SEQUENCE_PARALLEL
    assert kinds == (*simulator.workload.COMPILED_STRATEGIES, *simulator.workload.CHOSEN_STRATEGIES, "none")
    declared = []
    for path in _files("autosp/**/*.py", "simulator/**/*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                words = {e.value for e in node.elts if isinstance(e, ast.Constant)}
                if {"ulysses", "ring"} <= words:
                    declared.append(str(path.relative_to(ROOT)))
    assert declared == []


def test_strategy_names_no_module_keeps_its_own_list_of_systems():
    # simulator/sp_layout.py declares the kinds of sequence parallelism the pass compiles (SPKind), two of which
    # are also the names of hand-written baselines; it lists no systems.
    exempt = {ROOT / "simulator/strategies.py", ROOT / "simulator/sp_layout.py"}
    found = {str(p.relative_to(ROOT)): _name_lists(_text(p))
             for p in _files("experiments/**/*.py", "simulator/**/*.py") if p not in exempt}
    assert {path: lists for path, lists in found.items() if lists} == {}, \
        "read the systems from simulator.strategies.STRATEGIES (its .table(...))"


def test_strategy_names_the_notebooks_keep_no_list_of_systems():
    found = {str(p.relative_to(ROOT)): _name_lists(_text(p)) for pattern in NOTEBOOKS for p in _files(pattern)}
    assert {path: lists for path, lists in found.items() if lists} == {}
