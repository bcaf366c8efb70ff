"""Fault tolerance with two JAX processes x 4 CPU devices on loopback (gloo).

Processes are started through test_resume's DRIVER, so faults can be given to one process
only (raise or SIGKILL at a step). Output goes to files: a full pipe would stall a process.
"""

import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import REPO, TINY, last_json_line
from test_resume import DRIVER, cli_env, read_metrics, step_records

from jax_overlap.resilience.watchdog import EXIT_FAILED, EXIT_PEER_FAILED

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ended:
    def __init__(self, rc, out, err, at):
        self.rc, self.out, self.err, self.at = rc, out, err, at


def launch(args, logs, cache_dir, drills=None, n=2, timeout=600) -> list[Ended]:
    """Runs n CLI processes on one coordinator; returns how and when each ended."""
    port = free_port()
    procs, files = [], []
    for i in range(n):
        out, err = open(logs / f"p{i}.out", "w+"), open(logs / f"p{i}.err", "w+")
        files.append((out, err))
        procs.append(subprocess.Popen(
            [sys.executable, "-c", DRIVER, *args, "--coordinator", f"127.0.0.1:{port}",
             "--num-processes", str(n), "--process-id", str(i)],
            cwd=REPO, env=cli_env(cache_dir, **(drills or {}).get(i, {})), stdout=out,
            stderr=err, text=True))
    ended: dict[int, float] = {}
    deadline = time.time() + timeout
    while len(ended) < n and time.time() < deadline:
        for i, p in enumerate(procs):
            if i not in ended and p.poll() is not None:
                ended[i] = time.time()
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    results = []
    for i, (p, (out, err)) in enumerate(zip(procs, files)):
        out.seek(0), err.seek(0)
        results.append(Ended(p.returncode, out.read(), err.read(), ended.get(i)))
        out.close(), err.close()
    assert len(ended) == n, f"processes still running after {timeout} s: {results[0].err[-2000:]}"
    return results


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("jax_cache_mp")


FAULTY = ["train.steps=10", "fault.nan_at_step=5", "fault.spike_at_step=7", "guard.window=4",
          "guard.max_skips=1", "guard.skip_batches=1", "checkpoint.every_steps=2"]


@pytest.mark.slow
def test_two_processes_roll_back_together_and_finish(tmp_path, jax_cache):
    run_dir = tmp_path / "run"
    args = ["train", "--config", TINY, "--no-progress", "--run-dir", str(run_dir),
            *sum((["--set", s] for s in FAULTY), [])]
    p0, p1 = launch(args, tmp_path, jax_cache)
    assert p0.rc == 0 and p1.rc == 0, p0.err[-3000:] + p1.err[-3000:]
    s = last_json_line(p0.out)
    assert not any(line.startswith('{"run_dir"') for line in p1.out.splitlines())
    assert s["final_step"] == 10 and np.isfinite(s["last_loss"])
    assert s["rollbacks"] == 2 and s["skipped_steps"] == 4 and s["steps_lost"] <= 4
    records = read_metrics(run_dir)
    events = [(r["from_step"], r["to_step"]) for r in records if r.get("event") == "rollback"]
    assert events == [(5, 4), (7, 6)]  # the single-process run's decisions, on both processes
    assert all(np.isfinite(r["loss"]) for r in step_records(records))


@pytest.mark.slow
def test_failed_or_lost_process_stops_the_other_and_a_restart_resumes(tmp_path, jax_cache):
    run_dir = tmp_path / "run"
    timeout_s = 20  # JAX's heartbeat timeout is then max(10, timeout_s // 10) = 10 s
    args = ["train", "--config", TINY, "--no-progress", "--run-dir", str(run_dir),
            "--set", "train.steps=30", "--set", "checkpoint.every_steps=4",
            "--set", f"distributed.timeout_s={timeout_s}"]

    # 1. Process 1 raises: the watchdog stops process 0 within about a poll, not after JAX's
    #    300 s shutdown barrier.
    logs = tmp_path / "raise"
    logs.mkdir()
    p0, p1 = launch(args, logs, jax_cache, drills={1: {"raise_at": 10}})
    assert p1.rc == EXIT_FAILED and "injected failure at step 10" in p1.err
    assert p0.rc == EXIT_PEER_FAILED, p0.err[-3000:]
    assert re.search(r"error: process 1 failed \(RuntimeError: injected failure at step 10\); "
                     r"stopping process 0 too", p0.err)
    assert p0.at - p1.at < 10

    # 2. Process 1 is killed outright: process 0's next collective fails (gloo) and its
    #    watchdog names the process whose beat stopped (JAX's heartbeats would abort it,
    #    naming task 1, where the collective hangs instead).
    logs = tmp_path / "kill"
    logs.mkdir()
    p0, p1 = launch(args, logs, jax_cache, drills={1: {"kill_at": 16}})
    assert p1.rc == -9
    assert re.search(r"resuming from checkpoint step (4|8) in ", p0.out), p0.out[-2000:]
    assert p0.rc != 0 and p0.at - p1.at < timeout_s, (p0.rc, p0.at - p1.at)
    assert re.search(r"error: lost process 1 \(no sign of life|stopped sending heartbeats\):"
                     r"\s*1\b", p0.err), p0.err[-3000:]

    # 3. The same command on both processes resumes from the last committed step.
    logs = tmp_path / "resume"
    logs.mkdir()
    p0, p1 = launch(args, logs, jax_cache)
    assert p0.rc == 0 and p1.rc == 0, p0.err[-3000:] + p1.err[-3000:]
    s = last_json_line(p0.out)
    assert s["final_step"] == 30 and s["resumed_from"] >= 8
    assert f"resuming from checkpoint step {s['resumed_from']} in " in p0.out
