"""The watchdog: every process of a multi-process job stops promptly, naming the culprit.

What JAX offers for lost processes (as seen on JAX 0.12), and what the `Watchdog` adds:

* a process killed outright: the coordination service notices missing heartbeats after
  `heartbeat_timeout_seconds` (`mesh.init_distributed` passes `max(10, timeout_s // 10)`) and
  aborts every other process with "The following tasks are unhealthy (stopped sending
  heartbeats): <ids>". On CPU, gloo fails the next collective sooner ("Connection closed by
  peer <address>", no process id); the watchdog then names the process whose beat stopped;
* a process that raised: its peers would wait in the next collective until JAX's shutdown
  barrier times out (300 s, measured on JAX 0.12) and then abort; the watchdog publishes the
  error and every other process stops within a poll, naming it;
* a process alive but stuck: the watchdog stops the others after `distributed.timeout_s`
  without progress, naming the processes that are elsewhere.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from typing import Callable, Optional

EXIT_PEER_FAILED = 3  # exit status of a process stopped because another one failed or was lost
EXIT_FAILED = 1  # exit status of the process whose own code raised (multi-process runs)

# Phases in which a stall counts. Compiling (the first step after (re)building the step
# function), restoring and saving can legitimately take long and are left to JAX's heartbeats.
TIMED_PHASES = frozenset({"step"})

_FAILED_KEY = "jax_overlap/failed"
_PROGRESS_KEY = "jax_overlap/progress/{}"


class MemoryBoard:
    """A status board in a dict: one process's view, for tests and single-process runs."""

    def __init__(self):
        self.values: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value

    def get(self, key: str) -> Optional[str]:
        return self.values.get(key)


class KeyValueBoard:
    """A status board over `jax.distributed`'s key-value store (one RPC per call)."""

    def __init__(self, client):
        self._client = client

    def set(self, key: str, value: str) -> None:
        self._client.key_value_set(key, value, allow_overwrite=True)

    def get(self, key: str) -> Optional[str]:
        try:
            return self._client.key_value_try_get(key)
        except Exception:  # noqa: BLE001 - NOT_FOUND is an exception, and so is a lost service
            return None


def jax_board() -> Optional[KeyValueBoard]:
    """The board of the running `jax.distributed` job, or None when there is none."""
    from jax._src import (
        distributed,  # no public accessor for the client in JAX 0.11/0.12
    )

    client = getattr(distributed.global_state, "client", None)
    return KeyValueBoard(client) if client is not None else None


def hard_exit(message: str, code: int) -> None:
    """Print "error: <message>" and leave now, without JAX's shutdown barrier.

    A normal exit would wait in that barrier for peers that wait for us in a collective
    (measured on JAX 0.12: 300 s, then an abort), and a thread cannot make the main thread
    leave one.
    """
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


class Watchdog:
    """Makes every process of a job stop promptly, with a message naming the culprit.

    Each process publishes its progress (phase, step and a beat counter) on a shared board
    every `poll_s`, from a thread, so the beat goes on while the main thread sits in a
    collective. The main thread reports progress with `beat`. The thread stops the process:

    * at once when another process published a failure;
    * when a timed phase (a steady-state step) has lasted more than `timeout_s`, naming the
      processes whose published progress differs from ours (we wait for them in a collective).

    When the main thread raises (leaving the `with` block with an exception), `__exit__`
    works out whose fault it is, because a lost peer makes collectives fail here too (gloo:
    "Connection closed by peer"): a failure another process published wins; otherwise peers
    whose beat stays frozen for `grace_s` are lost (killed, OOM, machine gone); otherwise the
    error is ours, and is published so the others stop. Then it exits: EXIT_PEER_FAILED with
    a message naming the other process, or EXIT_FAILED after the traceback. `grace_s` must stay
    below JAX's heartbeat timeout, after which the runtime aborts the process itself.

    With a single process nobody waits for anybody: no thread, no board, exceptions propagate.

    Args:
      board: shared status board (`jax_board()`, or a `MemoryBoard` in tests); None disables.
      process_index, process_count: this process and how many there are.
      timeout_s: `distributed.timeout_s`.
      clock: monotonic clock.
      sleep: how to wait (tests fake it).
      poll_s: polling period.
      grace_s: how long a peer's beat must stay frozen to count as lost.
      exit_fn: `(message, exit_code)`, called once to stop the process (default `hard_exit`).
    """

    def __init__(self, board, process_index: int, process_count: int, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, poll_s: float = 1.0,
                 grace_s: float = 5.0, exit_fn: Callable[[str, int], None] = hard_exit):
        self._board = board
        self._me = process_index
        self._n = process_count
        self._timeout = float(timeout_s)
        self._clock = clock
        self._sleep = sleep
        self._poll = poll_s
        self._grace = grace_s
        self._exit = exit_fn
        self._phase, self._step, self._since = "start", 0, clock()
        self._beats = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def active(self) -> bool:
        return self._board is not None and self._n > 1

    def beat(self, phase: str, step: int) -> None:
        """The main thread entered `phase` at `step` (cheap: no communication)."""
        with self._lock:
            self._phase, self._step, self._since = phase, int(step), self._clock()

    def publish(self) -> None:
        """Put our progress and a fresh beat on the board."""
        with self._lock:
            self._beats += 1
            record = [self._phase, self._step, self._beats]
        self._board.set(_PROGRESS_KEY.format(self._me), json.dumps(record))

    def _peer(self, p: int) -> Optional[list]:
        raw = self._board.get(_PROGRESS_KEY.format(p))
        return None if raw is None else json.loads(raw)

    def fail(self, process: int, reason: str) -> None:
        """Publish that `process` failed, unless a failure is already known (the first wins)."""
        if self._board.get(_FAILED_KEY) is None:
            self._board.set(_FAILED_KEY, json.dumps({"process": process, "reason": reason}))

    def peer_failure(self) -> Optional[str]:
        """The message for a failure another process published, or None."""
        raw = self._board.get(_FAILED_KEY)
        if raw is None:
            return None
        info = json.loads(raw)
        if info["process"] == self._me:
            return None
        return (f"process {info['process']} failed ({info['reason']}); stopping process "
                f"{self._me} too. Restart all processes to resume from the last committed "
                f"checkpoint")

    def check(self) -> Optional[str]:
        """One poll: publish our progress, then return a fatal message or None."""
        self.publish()
        failed = self.peer_failure()
        if failed is not None:
            return failed
        with self._lock:
            phase, step, since = self._phase, self._step, self._since
        stalled = self._clock() - since
        if phase not in TIMED_PHASES or stalled <= self._timeout:
            return None
        behind = []
        for p in range(self._n):
            if p == self._me:
                continue
            record = self._peer(p)
            if record is None:
                behind.append(f"process {p} never reported")
            elif record[:2] != [phase, step]:
                behind.append(f"process {p} is stuck in {record[0]} at step {record[1]}")
        who = "; ".join(behind) if behind else (
            f"every process reports {phase} at step {step}: a collective is stuck")
        return (f"process {self._me}: no progress for {stalled:.0f} s (distributed.timeout_s="
                f"{self._timeout:.0f}) in {phase} at step {step}; {who}. Restart all processes "
                f"to resume from the last committed checkpoint")

    def lost_peers(self) -> list[int]:
        """Peers whose beat stays frozen for `grace_s` (ours keeps going meanwhile).

        Returns early, with no one lost, as soon as some process publishes a failure.
        """
        before = {p: self._peer(p) for p in range(self._n) if p != self._me}
        waited = 0.0
        while waited < self._grace:
            self.publish()
            if self._board.get(_FAILED_KEY) is not None:
                return []
            self._sleep(self._poll)
            waited += self._poll
        return [p for p, record in before.items() if self._peer(p) == record]

    def diagnose(self, exc: BaseException) -> tuple[str, int]:
        """Whose fault an exception of the main thread is: (message, exit code).

        May wait up to `grace_s`. Publishes our own failure when it is ours, or the lost
        peers when there are some, so every other process gives the same cause.
        """
        summary = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        message = self.peer_failure()
        if message is not None:
            return message, EXIT_PEER_FAILED
        lost = self.lost_peers()
        message = self.peer_failure()  # published while we were waiting
        if message is not None:
            return message, EXIT_PEER_FAILED
        if lost:
            self.fail(lost[0], f"lost: no sign of life for {self._grace:.0f} s")
            names = ", ".join(str(p) for p in lost)
            return (f"lost process {names} (no sign of life for {self._grace:.0f} s; here: "
                    f"{summary}); stopping process {self._me}. Restart all processes to resume "
                    f"from the last committed checkpoint", EXIT_PEER_FAILED)
        self.fail(self._me, summary)
        return f"process {self._me} failed: {summary}", EXIT_FAILED

    def _run(self) -> None:
        while not self._stop.wait(self._poll):
            try:
                message = self.check()
            except Exception:  # noqa: BLE001 - a lost coordinator: JAX's heartbeats handle it
                continue
            if message is not None:
                self._exit(message, EXIT_PEER_FAILED)
                return

    def __enter__(self) -> "Watchdog":
        if self.active:
            self.publish()
            self._thread = threading.Thread(target=self._run, name="jax_overlap-watchdog",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self._poll)
        if exc is None or not self.active or isinstance(exc, KeyboardInterrupt):
            return
        message, code = self.diagnose(exc)
        if code == EXIT_FAILED:
            traceback.print_exception(exc_type, exc, tb, file=sys.stderr)
        self._exit(message, code)
