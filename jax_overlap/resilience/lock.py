"""One training per run dir: an exclusive lock file, `<run_dir>/LOCK`.

Two trainings on one run dir interleave their `metrics.jsonl` lines and delete each other's
temporary checkpoint files. The lock makes the second one stop at once with one line naming
the holder (pid, host, start time, run id).

How it holds:

* The lock is an `fcntl.flock` on the file `<run_dir>/LOCK`, which holds the holder's JSON
  description. The kernel drops a flock when its process dies, SIGKILL included, so a stale
  lock (holder dead) is simply free: the next run takes it, atomically, and rewrites the
  description. The file is removed on release; the inode is checked after locking, so a
  run that locked a file just removed by its releaser tries again instead of holding a ghost.
* Where the filesystem has no flock (some network filesystems answer ENOLCK), the file is
  created with O_EXCL instead and a leftover file is taken over only when it names this
  host and a pid that is no longer alive.
* Multi-process: process 0 takes the lock and broadcasts a run id; every other process
  checks that the lock file it sees (when the run dir is shared) names the same run id. If
  process 0 is refused, every process is refused.

Time, host and pid liveness are injectable for tests.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import random
import socket
from dataclasses import dataclass
from typing import Callable, Optional

LOCK_NAME = "LOCK"


class LockHeld(Exception):
    """The run dir is held by another live training; `line` says by whom."""

    def __init__(self, line: str):
        self.line = line
        super().__init__(line)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


@dataclass
class Holder:
    pid: int
    host: str
    started: str
    run_id: int

    def line(self, path: str) -> str:
        return (f"--run-dir {os.path.dirname(path)}: another training holds it (pid "
                f"{self.pid} on {self.host}, started {self.started}, run id {self.run_id}); "
                f"wait for it to finish, stop it, or pass another --run-dir")


def read_holder(path: str) -> Optional[Holder]:
    """The holder the lock file names (None: no file or unreadable)."""
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        return Holder(int(d["pid"]), str(d["host"]), str(d["started"]), int(d["run_id"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


class RunDirLock:
    """The exclusive lock of one run dir, taken by `acquire` and dropped by `release`.

    Args:
      run_dir: the directory (must exist).
      run_id: this run's id (default: random); every process of one run uses process 0's.
      host, pid, clock: who we are and what time it is (injectable for tests).
      alive: whether a pid on this host lives (used only without flock).
    """

    def __init__(self, run_dir: str, run_id: Optional[int] = None, *, host: Optional[str] = None,
                 pid: Optional[int] = None, clock: Callable[[], str] = _now,
                 alive: Callable[[int], bool] = pid_alive):
        self.path = os.path.join(run_dir, LOCK_NAME)
        self.run_id = run_id if run_id is not None else random.SystemRandom().randrange(1, 2**31 - 1)
        self.host = host or socket.gethostname()
        self.pid = pid if pid is not None else os.getpid()
        self._clock = clock
        self._alive = alive
        self._fd: Optional[int] = None
        self._flock = True

    @property
    def held(self) -> bool:
        return self._fd is not None

    def _description(self) -> str:
        return json.dumps({"pid": self.pid, "host": self.host, "started": self._clock(),
                           "run_id": self.run_id})

    def acquire(self) -> None:
        """Take the lock or raise `LockHeld` naming the live holder."""
        for _ in range(20):  # only a releaser racing us makes it loop
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise OSError(e.errno, f"cannot create the run-dir lock: {e.strerror}",
                              self.path) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    holder = read_holder(self.path)
                    raise LockHeld(holder.line(self.path) if holder else
                                   f"--run-dir {os.path.dirname(self.path)}: another training "
                                   f"holds it (it is starting up); pass another --run-dir"
                                   ) from None
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    self._flock = False
                    return self._acquire_exclusive()
                raise
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # released and removed between our open and our lock
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, self._description().encode(), 0)
            os.fsync(fd)
            self._fd = fd
            return
        raise LockHeld(f"--run-dir {os.path.dirname(self.path)}: its lock keeps changing "
                       f"hands; pass another --run-dir")

    def _acquire_exclusive(self) -> None:
        """Without flock: O_EXCL create; a leftover file of a dead pid on this host is taken."""
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = read_holder(self.path)
                if holder and (holder.host != self.host or self._alive(holder.pid)):
                    raise LockHeld(holder.line(self.path)) from None
                # Stale (dead holder on this host, or unreadable): move it aside atomically;
                # only one newcomer's rename succeeds.
                try:
                    os.rename(self.path, f"{self.path}.stale-{self.pid}")
                    os.remove(f"{self.path}.stale-{self.pid}")
                except FileNotFoundError:
                    pass
                continue
            os.write(fd, self._description().encode())
            os.fsync(fd)
            self._fd = fd
            return
        raise LockHeld(f"--run-dir {os.path.dirname(self.path)}: its lock keeps changing "
                       f"hands; pass another --run-dir")

    def release(self) -> None:
        """Drop the lock and remove the file (a no-op when not held)."""
        if self._fd is None:
            return
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass
        if self._flock:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "RunDirLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def holder_problem(run_dir: str) -> Optional[str]:
    """A quick look without taking anything: the line `acquire` would refuse with, if the run
    dir is held right now (None: free, or no lock file). Touches nothing."""
    path = os.path.join(run_dir, LOCK_NAME)
    if not os.path.isfile(path):
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        # A shared lock conflicts with the holder's exclusive one and is dropped at once.
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        holder = read_holder(path)
        return holder.line(path) if holder else None
    finally:
        os.close(fd)


def acquire_for_job(run_dir: str, process_index: int, broadcast: Callable[[int], int],
                    all_true: Callable[[bool], bool]) -> Optional[RunDirLock]:
    """Every process of one job: process 0 takes the lock, the others check the run id.

    Collective. Returns the held lock on process 0, None on the others.

    Args:
      run_dir: the run dir (exists).
      process_index: this process.
      broadcast: every process gets process 0's int.
      all_true: True everywhere iff True on every process.

    Raises:
      LockHeld: on every process, when process 0 was refused or another process sees a lock
        file of another run.
    """
    lock, refusal = None, None
    if process_index == 0:
        lock = RunDirLock(run_dir)
        try:
            lock.acquire()
        except LockHeld as e:
            lock, refusal = None, e.line
    run_id = broadcast(lock.run_id if lock is not None else 0)
    if run_id == 0:
        raise LockHeld(refusal or f"--run-dir {run_dir}: process 0 was refused the run-dir "
                                  f"lock (another training holds it); pass another --run-dir")
    ok = True
    if process_index != 0:
        holder = read_holder(os.path.join(run_dir, LOCK_NAME))
        ok = holder is None or holder.run_id == run_id  # None: run dir not shared
    if not all_true(ok):
        if lock is not None:
            lock.release()
        raise LockHeld(f"--run-dir {run_dir}: processes of this job see the lock of another "
                       f"run; pass another --run-dir")
    return lock
