"""Pre-emption: turn SIGTERM/SIGINT into a flag the training loop polls.

A signal handler must not raise into the middle of a train step or an async checkpoint
write, so the handler only records the request; the loop checks `stop_requested()` at a
step boundary, saves and exits. With several processes, the request (which may reach only
some of them, or reach them at different steps) is agreed with `agree_to_stop`, so every
process leaves at the same step and the final save stays collective.
"""

from __future__ import annotations

import signal as _signal
import threading
from typing import Any, Callable, Optional, Sequence

import numpy as np


class PreemptionWatcher:
    """Context manager installing flag-setting handlers, restoring the old ones on exit.

    Args:
      signals: signal numbers to watch.
      signal_module: anything with `signal(num, handler) -> previous` (tests fake it).
      interrupt_on_repeat: a second SIGINT raises KeyboardInterrupt, so a person at the
        terminal can still force a stop that the loop would otherwise defer.
    """

    def __init__(
        self,
        signals: Sequence[int] = (_signal.SIGTERM, _signal.SIGINT),
        signal_module: Any = _signal,
        interrupt_on_repeat: bool = True,
    ):
        self._signals = tuple(signals)
        self._signal_module = signal_module
        self._interrupt_on_repeat = interrupt_on_repeat
        self._previous: dict[int, Any] = {}
        self._event = threading.Event()
        self.received: Optional[int] = None  # the first signal number that arrived

    def _handle(self, signum: int, frame: Any) -> None:
        if self._event.is_set() and self._interrupt_on_repeat and signum == _signal.SIGINT:
            raise KeyboardInterrupt
        if self.received is None:
            self.received = signum
        self._event.set()

    def stop_requested(self) -> bool:
        """Whether a watched signal (or `request_stop`) has arrived."""
        return self._event.is_set()

    def request_stop(self) -> None:
        """Ask for a stop without a signal (e.g. from a watchdog thread)."""
        self._event.set()

    def __enter__(self) -> "PreemptionWatcher":
        for signum in self._signals:
            self._previous[signum] = self._signal_module.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        # Restore in reverse order so nested watchers unwind cleanly.
        for signum in reversed(self._signals):
            if signum in self._previous:
                self._signal_module.signal(signum, self._previous.pop(signum))


def any_process(flag: bool) -> bool:
    """True on every process iff `flag` is True on at least one (collective).

    One process alone needs no communication; with several, the flags are gathered with
    `multihost_utils.process_allgather`.
    """
    import jax  # local: the single-process path should not need a backend

    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils

    return bool(np.asarray(multihost_utils.process_allgather(np.int32(bool(flag)))).any())


def agree_to_stop(
    local_request: bool,
    step: int,
    every_steps: int = 1,
    all_agree: Callable[[bool], bool] = any_process,
) -> bool:
    """Agree across processes whether to stop after `step` (collective on check steps).

    The exchange is made only when `step % every_steps == 0`, so a large job pays for it
    once in a while; every process computes the same `step`, so they all take part in the
    same exchanges. A request seen by any process stops all of them.

    Args:
      local_request: this process's `stop_requested()`.
      step: the step just finished, identical on every process.
      every_steps: how often to exchange.
      all_agree: combines the local flags into one answer shared by all processes.

    Returns:
      True when every process should stop now.
    """
    if step % every_steps != 0:
        return False
    return bool(all_agree(bool(local_request)))
