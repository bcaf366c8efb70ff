"""The GPU suite is selected only by `-m gpu` and skips cleanly without a GPU."""

import subprocess
import sys

from helpers import REPO


def test_gpu_suite_skips_cleanly_on_cpu():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu",
                           "-p", "no:cacheprovider"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "skipped" in proc.stdout and "failed" not in proc.stdout
