"""The run-dir lock (jax_overlap/resilience/lock.py): one holder, named when refused; a dead
holder's lock is taken over; every process of a job shares one lock. No JAX here; the
two-trainings-at-once check through the CLI is in tests/test_user_errors.py (`trained`)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from jax_overlap.resilience import lock as locklib
from jax_overlap.resilience.lock import LockHeld, RunDirLock
from tests.helpers import REPO


def test_second_holder_is_refused_with_pid_host_and_start(tmp_path):
    first = RunDirLock(str(tmp_path), run_id=7, host="hostA", clock=lambda: "2026-12-01T10:00:00")
    first.acquire()
    with pytest.raises(LockHeld) as e:
        RunDirLock(str(tmp_path)).acquire()
    assert f"pid {os.getpid()} on hostA" in e.value.line
    assert "started 2026-12-01T10:00:00" in e.value.line and "run id 7" in e.value.line
    assert locklib.holder_problem(str(tmp_path)) == e.value.line
    first.release()
    assert not (tmp_path / "LOCK").exists()
    assert locklib.holder_problem(str(tmp_path)) is None
    with RunDirLock(str(tmp_path)) as again:
        assert again.held


HOLD_AND_DIE = textwrap.dedent("""
    import os, signal, sys
    from jax_overlap.resilience.lock import RunDirLock
    RunDirLock(sys.argv[1], run_id=99).acquire()
    print("held", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_stale_lock_of_a_killed_holder_is_taken_over(tmp_path):
    proc = subprocess.run([sys.executable, "-c", HOLD_AND_DIE, str(tmp_path)], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == -signal.SIGKILL and "held" in proc.stdout
    stale = json.loads((tmp_path / "LOCK").read_text())
    assert stale["run_id"] == 99  # the dead holder's file is still there...
    assert locklib.holder_problem(str(tmp_path)) is None  # ...but nobody holds it
    lock = RunDirLock(str(tmp_path), run_id=5)
    lock.acquire()
    assert json.loads((tmp_path / "LOCK").read_text())["run_id"] == 5
    lock.release()


def _no_flock(monkeypatch):
    def flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(locklib.fcntl, "flock", flock)


def test_without_flock_a_dead_pid_on_this_host_is_stale(tmp_path, monkeypatch):
    _no_flock(monkeypatch)
    (tmp_path / "LOCK").write_text(json.dumps(
        {"pid": 4242, "host": "here", "started": "then", "run_id": 1}))
    lock = RunDirLock(str(tmp_path), host="here", alive=lambda pid: False)
    lock.acquire()
    assert json.loads((tmp_path / "LOCK").read_text())["pid"] == os.getpid()
    with pytest.raises(LockHeld, match="pid"):  # now live: refused
        RunDirLock(str(tmp_path), host="here", alive=lambda pid: True).acquire()
    lock.release()
    assert not (tmp_path / "LOCK").exists()


def test_without_flock_another_hosts_lock_is_never_taken(tmp_path, monkeypatch):
    _no_flock(monkeypatch)
    (tmp_path / "LOCK").write_text(json.dumps(
        {"pid": 4242, "host": "elsewhere", "started": "then", "run_id": 1}))
    with pytest.raises(LockHeld, match="on elsewhere"):
        RunDirLock(str(tmp_path), host="here", alive=lambda pid: False).acquire()


def test_job_lock_shared_by_processes_and_refused_for_another_run(tmp_path):
    """Two processes of a job, simulated: process 0 takes it, process 1 checks the run id."""
    held = {}

    def as_process(index, broadcast_value):
        return locklib.acquire_for_job(str(tmp_path), index, lambda v: broadcast_value(v),
                                       lambda ok: ok)

    lock0 = as_process(0, lambda v: held.setdefault("id", v))
    assert lock0.held and held["id"] == lock0.run_id
    assert as_process(1, lambda v: held["id"]) is None  # same run id: shares it
    with pytest.raises(LockHeld, match="another run"):
        as_process(1, lambda v: held["id"] + 1)  # a process of another job
    # Another job's process 0 is refused; its other processes learn it through the broadcast.
    with pytest.raises(LockHeld, match=f"pid {os.getpid()}"):
        as_process(0, lambda v: v)
    with pytest.raises(LockHeld, match="process 0 was refused"):
        as_process(1, lambda v: 0)
    lock0.release()
