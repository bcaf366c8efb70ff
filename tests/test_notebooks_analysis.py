"""notebooks/overlap.ipynb and notebooks/tuning.ipynb run top to bottom and show their numbers."""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


def _outputs(nb) -> list:
    return [out for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])]


def _text(nb) -> str:
    return "".join(out.get("text", "") for out in _outputs(nb) if out.output_type == "stream")


def _images(nb) -> int:
    return sum("image/png" in out.get("data", {}) for out in _outputs(nb))


def _check_overlap(nb) -> None:
    assert [o for o in _outputs(nb) if o.output_type == "error"] == []
    text = _text(nb)
    for header in ("bucket MB", "window", "microbatches"):
        assert header in text
    for profile in ("h100_8x_nvlink", "a100_8x_nvlink", "pcie_8x"):
        assert profile in text
    # The measured trace: 8 CPU devices, two steps, and why overlap is 0 there.
    assert "profile: 2 traced steps, mesh dp=2 pp=1 tp=4 on 8 cpu devices" in text
    assert "collectives are synchronous" in text
    assert _images(nb) == 4  # bucket, window and microbatch sweeps, measured timeline


def _check_tuning(nb) -> None:
    assert [o for o in _outputs(nb) if o.output_type == "error"] == []
    text = _text(nb)
    assert "valid plans for 8 devices on h100_8x_nvlink (flops costs)" in text
    assert "valid plans for 32 devices on h100_4x8_infiniband (flops costs)" in text
    # The winners the markdown explains (FLOP-based costs are deterministic).
    assert "  1 dp8 tp1 pp1 m16 1f1b b64 repl" in text
    assert "  1 dp8 tp2 pp2 m16 interleaved/v4 L2 split-4,4,3,3,3,3,3,1 b64 repl" in text
    assert "tuned winner dp8 tp1 pp1 m16 1f1b b64 repl" in text
    for label in ("baseline 1F1B, reduce after bwd", "interleaved v3, 64 MB buckets",
                  "ZB-V, 64 MB buckets"):
        assert label in text


def _execute(name: str, monkeypatch):
    # The kernel inherits this environment: the repository on PYTHONPATH, and no forced
    # device count from the test process (each notebook sets what it needs).
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []  # check only what this run produces
    NotebookClient(nb, timeout=180, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return nb


@pytest.mark.parametrize("name,check", [
    ("overlap.ipynb", _check_overlap),
    # Ranks ~38,000 plans (about 4 minutes on 2 cores): `make test-slow`; its stored outputs
    # are checked below in the default suite.
    pytest.param("tuning.ipynb", _check_tuning, marks=pytest.mark.slow)])
def test_notebook_executes(name, check, monkeypatch):
    check(_execute(name, monkeypatch))


@pytest.mark.parametrize("name,check", [("overlap.ipynb", _check_overlap),
                                        ("tuning.ipynb", _check_tuning)])
def test_stored_notebook_has_outputs(name, check):
    # Committed executed, so they read without running.
    check(nbformat.read(NOTEBOOKS / name, as_version=4))
