"""Every notebook under experiments/notebooks goes through the public API, explains each plot, and executes.

The execution test runs each notebook on a small model through its parameter cell
(`experiments.notebooks.build.with_parameters`, papermill's mechanism): the defaults (paper models at full
depth) are what a user runs and take minutes.
"""

from __future__ import annotations

import pathlib
import re

import nbformat
import pytest

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "notebooks"

SMALL = {
    # tiny-llama on 2 gloo ranks by default; here one variant (one compile and one trace fewer)
    "equivalence_and_overhead.ipynb": {"STEPS": 2, "VARIANTS": {"autosp": {}}},
    "simulated_timeline.ipynb": {"MODEL": "tiny-llama", "SEQ_LEN": 256, "SP_SIZE": 2},
    "max_sequence_length.ipynb": {"MODEL": "tiny-llama", "SP_SIZE": 2, "START": 1024, "GRANULARITY": 1024,
                                  "CEILING": 4096, "MAX_PROBES": 3},
}
"""Parameters each notebook is executed with here (a tiny model, a short search)."""

INTERNAL = re.compile(r"^\s*(?:from|import)\s+experiments\.(?:paper_scale|cpu|reproduce|reproduction|models|baselines)\b",
                      re.MULTILINE)
"""Imports of the reproduction's internals, which a notebook pointed at your model must not need."""


def _parameters(cells) -> tuple[int, dict]:
    from experiments.notebooks.build import PARAMETERS_TAG

    tagged = [i for i, c in enumerate(cells) if PARAMETERS_TAG in c.get("metadata", {}).get("tags", ())]
    assert len(tagged) == 1, "one parameter cell, tagged 'parameters'"
    values: dict = {}
    exec(cells[tagged[0]].source, {}, values)  # noqa: S102 - literals only
    return tagged[0], values


def test_notebooks_are_stored_without_outputs_and_match_their_builder(tmp_path):
    from experiments.notebooks.build import NOTEBOOKS as CELLS
    from experiments.notebooks.build import build

    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(CELLS) == sorted(SMALL)
    build(tmp_path)
    for path in NOTEBOOKS.glob("*.ipynb"):
        stored = nbformat.read(path, as_version=4)
        assert all(not c.get("outputs") for c in stored.cells if c.cell_type == "code"), path.name
        rebuilt = nbformat.read(tmp_path / path.name, as_version=4)
        assert [(c.source, c.metadata) for c in stored.cells] == [(c.source, c.metadata) for c in rebuilt.cells], (
            f"{path.name} differs from experiments/notebooks/build.py: run python -m experiments.notebooks.build"
        )


@pytest.mark.parametrize("name", sorted(SMALL))
def test_notebook_takes_model_and_cluster_uses_the_public_api_and_explains_each_plot(name):
    from experiments.notebooks.build import NOTEBOOKS as CELLS

    cells = CELLS[name]
    at, values = _parameters(cells)
    assert at == next(i for i, c in enumerate(cells) if c.cell_type == "code"), "parameters come first"
    assert {"MODEL", "CLUSTER"} <= set(values)
    assert values.get("DEPTH", "full") == "full", "depth extrapolation underestimates memory: full by default"
    code = "\n".join(c.source for c in cells if c.cell_type == "code")
    assert not INTERNAL.findall(code), f"{name} imports the reproduction's internals"
    plots = [i for i, c in enumerate(cells) if c.cell_type == "code" and re.search(r"plt\.show\(\)|display\(Image",
                                                                                     c.source)]
    assert plots
    for i in plots:
        assert i + 1 < len(cells) and cells[i + 1].cell_type == "markdown", f"{name}: cell {i} plots unexplained"


def test_with_parameters_sets_values_after_the_parameter_cell_and_refuses_unknown_names():
    from experiments.notebooks.build import with_parameters

    nb = nbformat.read(NOTEBOOKS / "max_sequence_length.ipynb", as_version=4)
    at, _ = _parameters(nb.cells)
    changed = with_parameters(nb, MODEL="docs/examples/config.json", SP_SIZE=2)
    assert changed.cells[at + 1].source.splitlines()[1:] == ["MODEL = 'docs/examples/config.json'", "SP_SIZE = 2"]
    assert len(changed.cells) == len(nb.cells) + 1
    with pytest.raises(ValueError, match="MODLE"):
        with_parameters(nb, MODLE="tiny-llama")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SMALL))
def test_notebook_executes_and_plots(name, tmp_path):
    from nbclient import NotebookClient

    from experiments.notebooks.build import with_parameters

    values = dict(SMALL[name])
    if name == "max_sequence_length.ipynb":
        values["RESULTS"] = str(tmp_path)  # no reproduction results: the cell says how to make them
    nb = with_parameters(nbformat.read(NOTEBOOKS / name, as_version=4), **values)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{name} drew no plot"
