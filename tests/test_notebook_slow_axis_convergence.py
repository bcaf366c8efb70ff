"""notebooks/slow_axis_convergence.ipynb runs top to bottom offline from the saved bench
results and shows every variant's gap to sync."""

import json
import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "slow_axis_convergence.ipynb"
RESULTS = ROOT / "bench" / "results" / "slow_axis_convergence.json"


def _text(nb) -> str:
    return "".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                   for out in cell.get("outputs", []) if out.output_type == "stream")


def _check(nb) -> None:
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert [o for o in outputs if o.output_type == "error"] == []
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 1
    text = _text(nb)
    with open(RESULTS) as f:
        runs = json.load(f)["variants"]
    base = runs["sync"]["final"]
    for name, r in runs.items():  # the table shows the saved numbers
        assert f"{name:14s} {r['final']:8.4f} {100 * (r['final'] / base - 1):+7.2f}%" in text


def test_notebook_executes_from_the_saved_results(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT),
                                                                   os.environ.get("PYTHONPATH")])))
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    _check(nb)


def test_stored_notebook_has_outputs():
    _check(nbformat.read(NOTEBOOK, as_version=4))
