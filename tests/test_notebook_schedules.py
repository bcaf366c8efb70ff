"""notebooks/schedules.ipynb runs top to bottom and shows the numbers it claims."""

import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "schedules.ipynb"


def _outputs(nb) -> list:
    return [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
    ]


def _check_outputs(nb) -> None:
    outputs = _outputs(nb)
    assert [out for out in outputs if out.output_type == "error"] == []
    text = "".join(out.get("text", "") for out in outputs if out.output_type == "stream")
    for name, bubble in [("gpipe", 0.2727), ("1f1b", 0.2727), ("zb-h1", 0.1111), ("zb-v", 0.0588)]:
        assert f"{name}: stages=4 microbatches=8" in text
        assert f"bubble_fraction={bubble:.4f}" in text
    assert "interleaved: stages=4 microbatches=8 virtual_stages=2" in text
    images = [out for out in outputs if "image/png" in out.get("data", {})]
    assert len(images) == 6  # one timeline per schedule plus the bubble curves


def test_schedules_notebook_executes(monkeypatch):
    # The kernel is a child process and inherits this environment, so the repository
    # root on PYTHONPATH makes jax_overlap importable even without an editable install.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []  # check only what this run produces, not the stored outputs
    client = NotebookClient(
        nb,
        timeout=120,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute()  # raises CellExecutionError on the first failing cell
    _check_outputs(nb)


def test_stored_notebook_has_outputs():
    # The notebook is committed executed so it reads without running.
    _check_outputs(nbformat.read(NOTEBOOK, as_version=4))
