"""Two JAX processes x 4 CPU devices on loopback train on one (dp=2, tp=4) mesh."""

import socket
import subprocess
import sys

import pytest
from helpers import REPO, TINY, last_json_line, rel, run_cli

pytestmark = pytest.mark.multiprocess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, n, tmp_path, env_extra=None):
    """Starts n CLI processes sharing one coordinator; returns their CompletedProcess-likes."""
    import os

    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu", **(env_extra or {})}
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen(
        [sys.executable, "-m", "jax_overlap.cli", *args, "--coordinator", f"127.0.0.1:{port}",
         "--num-processes", str(n), "--process-id", str(i)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(n)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, out, err))
    return outs


def test_two_processes_match_single_process(tmp_path):
    common = ["train", "--config", TINY, "--no-progress", "--set", "train.steps=3"]
    outs = launch(common + ["--run-dir", str(tmp_path / "mp")], 2, tmp_path)
    for rc, out, err in outs:
        assert rc == 0, err[-3000:]
    multi = last_json_line(outs[0][1])
    # Only process 0 prints the summary (gloo may log its own lines to stdout).
    assert not any(line.startswith('{"run_dir"') for line in outs[1][1].splitlines())
    single = run_cli(*common, "--run-dir", str(tmp_path / "sp"))
    assert single.returncode == 0, single.stderr[-3000:]
    single = last_json_line(single.stdout)
    assert multi["steps"] == single["steps"] == 3
    assert rel(multi["first_loss"], single["first_loss"]) <= 1e-5
    assert rel(multi["last_loss"], single["last_loss"]) <= 1e-4
