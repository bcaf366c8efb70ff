"""notebooks/custom_model.ipynb trains its own model on 2x2x2 CPU devices, equal to one device."""

import os
import re
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "custom_model.ipynb"


def _check_outputs(nb) -> None:
    outputs = [out for cell in nb.cells if cell.cell_type == "code"
               for out in cell.get("outputs", [])]
    assert [out for out in outputs if out.output_type == "error"] == []
    text = "".join(out.get("text", "") for out in outputs if out.output_type == "stream")
    assert "8 devices: cpu" in text
    assert "single device:" in text and "dp x pp x tp = 2x2x2:" in text
    match = re.search(r"max relative difference: ([0-9.e+-]+)", text)
    assert match, text
    assert float(match.group(1)) < 1e-4


def test_custom_model_notebook_executes(monkeypatch):
    # The kernel is a child process and inherits this environment: the repository on
    # PYTHONPATH, and exactly 8 host devices (the notebook's own request is then a no-op).
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []  # check only what this run produces, not the stored outputs
    client = NotebookClient(nb, timeout=90, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError on the first failing cell
    assert time.perf_counter() - start < 90
    _check_outputs(nb)


def test_stored_notebook_has_outputs():
    # Committed executed, so it reads without running.
    _check_outputs(nbformat.read(NOTEBOOK, as_version=4))
