"""Every notebook under experiments/notebooks executes without error and draws its plot."""

from __future__ import annotations

import pathlib

import nbformat
import pytest

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "notebooks"


def test_notebooks_are_stored_without_outputs_and_match_their_builder(tmp_path):
    from experiments.notebooks.build import NOTEBOOKS as CELLS
    from experiments.notebooks.build import build

    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(CELLS)
    build(tmp_path)
    for path in NOTEBOOKS.glob("*.ipynb"):
        stored = nbformat.read(path, as_version=4)
        assert all(not c.get("outputs") for c in stored.cells if c.cell_type == "code"), path.name
        rebuilt = nbformat.read(tmp_path / path.name, as_version=4)
        assert [c.source for c in stored.cells] == [c.source for c in rebuilt.cells], (
            f"{path.name} differs from experiments/notebooks/build.py: run python -m experiments.notebooks.build"
        )


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")))
def test_notebook_executes_and_plots(name):
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{name} drew no plot"
