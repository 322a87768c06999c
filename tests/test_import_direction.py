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


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _runtime_imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The project modules ``path`` imports when it runs: at module level or inside a function (a function-local
    import is an edge all the same), not in an ``if TYPE_CHECKING:`` block (annotations only)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()

    def resolve(module: str) -> str | None:
        while module and module not in modules:
            module = module.rpartition(".")[0]
        return module or None

    def visit(node: ast.AST) -> None:
        if _type_checking_block(node):
            return
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                stem = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(stem + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        for target in targets:
            resolved = resolve(target)
            if resolved is not None and resolved != name:
                found.add(resolved)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return found


def import_graph(packages=("autosp", "simulator", "experiments")) -> dict[str, set[str]]:
    """Module -> the project modules it imports at run time (`_runtime_imports`)."""
    paths = [p for package in packages for p in sorted((ROOT / package).rglob("*.py"))]
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _runtime_imports(p, modules) for p in paths}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    circles.append(sorted(group))
    return circles


def test_import_direction_no_import_circles():
    # Function-local imports count: one placed in a function to break a circle at import time still closes it.
    assert import_circles(import_graph()) == []


def test_import_direction_circle_finder_finds_a_circle():
    # Guard against a finder that cannot fail: a circle through a function-local import, and one of three modules.
    assert import_circles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = import_graph()
    assert "autosp.model" in graph["autosp.api"]  # the scanner resolves the front door's import of the core
    assert "autosp.plan.planner" in graph["autosp.plan.auto"]  # and a function-local import
