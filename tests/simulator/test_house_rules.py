"""House rules of the simulator package, checked on its source with ast (docs/design.md, "The packages and who may import whom")."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "simulator"
SOURCES = sorted(PACKAGE.rglob("*.py"))
ALLOWED_THIRD_PARTY = {"simpy", "networkx", "numpy", "matplotlib"}


def _tree(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _imported(tree: ast.Module) -> list[tuple[ast.AST, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node, node.module))
    return found


def test_house_rules_simulator_never_imports_torch():
    offenders = [(p.name, m) for p in SOURCES for _, m in _imported(_tree(p)) if m.split(".")[0] == "torch"]
    assert offenders == []


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_house_rules_only_the_standard_library_and_allowed_packages(path):
    import sys

    for _, module in _imported(_tree(path)):
        top = module.split(".")[0]
        assert top in sys.stdlib_module_names or top in ALLOWED_THIRD_PARTY or top == "simulator", module


def test_house_rules_matplotlib_is_imported_lazily_and_only_for_plots():
    for path in SOURCES:
        tree = _tree(path)
        top_level = {id(n) for n in tree.body}
        for node, module in _imported(tree):
            if module.split(".")[0] == "matplotlib":
                assert path.name == "plots.py", path.name
                assert id(node) not in top_level, "matplotlib must be imported inside a function"


@pytest.mark.parametrize("path", [p for p in SOURCES if p.name != "__main__.py"], ids=lambda p: p.name)
def test_house_rules_library_code_logs_instead_of_printing(path):
    calls = [n for n in ast.walk(_tree(path)) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "print"]
    assert calls == []


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_house_rules_modules_are_short_and_documented(path):
    tree = _tree(path)
    assert ast.get_docstring(tree), f"{path.name} needs a module docstring"
    assert len(path.read_text().splitlines()) <= 420, f"{path.name} is too long: split it"


def test_house_rules_public_names_resolve_lazily():
    import simulator

    assert sorted(simulator.__all__) == sorted(simulator._EXPORTS)
    for name in simulator.__all__:
        assert getattr(simulator, name) is not None
    with pytest.raises(AttributeError):
        simulator.does_not_exist  # noqa: B018
