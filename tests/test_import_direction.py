"""The import direction of the packages (see docs/design.md): checked on the source with ast."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _imports(package: str) -> list[tuple[str, str]]:
    """(file, imported module) for every import statement under ``package``."""
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [(str(path.relative_to(ROOT)), alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.append((str(path.relative_to(ROOT)), node.module))
    return found


def _top(module: str) -> str:
    return module.split(".")[0]


@pytest.mark.parametrize("package", ["autosp", "simulator", "experiments"])
def test_import_direction_packages_exist_and_are_scanned(package):
    assert (ROOT / package / "__init__.py").exists()


def test_import_direction_simulator_never_imports_torch():
    offenders = [(f, m) for f, m in _imports("simulator") if _top(m) in {"torch", "deepspeed", "transformers"}]
    assert offenders == []


PLANNER = "autosp/plan/"
"""The planner (python -m autosp.plan) uses the simulator to price its choices: the one part of autosp that may
import the simulator beyond its workload schema (docs/design.md, "The packages and who may import whom")."""


def test_import_direction_autosp_imports_only_the_workload_schema_from_simulator():
    offenders = [(f, m) for f, m in _imports("autosp")
                 if _top(m) == "simulator" and m != "simulator.workload" and not f.startswith(PLANNER)]
    assert offenders == []


def test_import_direction_only_the_planner_imports_the_simulator_and_it_does():
    beyond = {f for f, m in _imports("autosp") if _top(m) == "simulator" and m != "simulator.workload"}
    assert beyond and all(f.startswith(PLANNER) for f in beyond)


@pytest.mark.parametrize("package", ["autosp", "simulator"])
def test_import_direction_libraries_never_import_experiments_or_tests(package):
    offenders = [(f, m) for f, m in _imports(package) if _top(m) in {"experiments", "tests"}]
    assert offenders == []


def test_import_direction_scanner_sees_imports():
    # Guard against a scanner that silently finds nothing: the rank launcher imports torch.
    assert ("experiments/launch.py", "torch") in _imports("experiments")


def test_import_direction_experiments_never_imports_tests():
    # The tests may import experiments (the rank launcher, model presets); never the other way.
    offenders = [(f, m) for f, m in _imports("experiments") if _top(m) == "tests"]
    assert offenders == []
