"""The fault drill with two JAX processes x 4 CPU devices (gloo): kills of one process, then
both restart from the newest step every process's local tier (or the persistent tier) holds,
and end bit-identical to an uninterrupted run. Slow (every launch starts two JAX processes);
the full drill is `python bench/fault_drill.py --processes 2 --kills 5`
(docs/guides/fault_tolerance.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def test_two_process_drill_resumes_bit_exact(tmp_path):
    out = tmp_path / "drill.json"
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "bench/fault_drill.py", "--processes", "2",
                           "--kills", "2", "--steps", "24", "--every", "4", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["processes"] == 2 and result["kills"] >= 1
    assert result["committed_steps_lost"] == 0
    assert result["final_params_equal"] and result["final_state_equal"]
