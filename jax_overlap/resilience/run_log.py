"""Where library noise goes: a log file in the run dir, not the terminal.

Warnings (Python `warnings`), library log records (Orbax, absl, JAX) and "Exception ignored"
messages of background threads (TensorStore reading a truncated file prints hundreds) are not
the user's business on the terminal; the one-line messages of the CLI and the loop are. The
CLI `install`s one `RunLog` per training process; it keeps records in memory until the loop
`arm`s it -- the run dir accepted (lock held, resume decided) -- and from then on appends
them to `<run_dir>/logs/error.log` (process 0; `error.p<N>.log` for process N). A run
refused before that leaves the run dir as it was: its buffered records are dropped with it.
An unexpected error's traceback goes to the same file (`write_traceback`), and the terminal
gets one line naming it.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
import warnings
from typing import Optional

_ACTIVE: Optional["RunLog"] = None
_MAX_BUFFERED = 10_000


def log_path(run_dir: str, process_index: int = 0) -> str:
    name = "error.log" if process_index == 0 else f"error.p{process_index}.log"
    return os.path.join(run_dir, "logs", name)


class RunLog(logging.Handler):
    """A logging handler that buffers until armed, then appends to the run's log file."""

    def __init__(self, run_dir: str, process_index: int = 0):
        super().__init__(level=logging.WARNING)
        self.path = log_path(run_dir, process_index)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self._buffer: list[str] = []
        self._file = None
        self.armed = False

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.write_text(self.format(record) + "\n")
        except Exception:  # noqa: BLE001 - a logging failure must not end the run
            pass

    def write_text(self, text: str) -> None:
        if self.armed:
            self._open()
            self._file.write(text)
            self._file.flush()
        elif len(self._buffer) < _MAX_BUFFERED:
            self._buffer.append(text)

    def _open(self) -> None:
        if self._file is None:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")

    def arm(self) -> None:
        """From now on write to the file (created at the first record; what was buffered
        goes first)."""
        self.armed = True
        if self._buffer:
            self._open()
            self._file.write("".join(self._buffer))
            self._buffer.clear()
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        super().close()


def _unraisable(hook_args) -> None:
    """sys.unraisablehook: "Exception ignored in ..." goes to the log, not stderr."""
    log = _ACTIVE
    if log is None:
        return sys.__unraisablehook__(hook_args)
    lines = traceback.format_exception(hook_args.exc_type, hook_args.exc_value,
                                       hook_args.exc_traceback)
    where = f" in {hook_args.object!r}" if hook_args.object is not None else ""
    log.write_text(f"Exception ignored{where}: {hook_args.err_msg or ''}\n" + "".join(lines))


def install(run_dir: str, process_index: int = 0) -> RunLog:
    """Route warnings, library log records and unraisable exceptions to a `RunLog`."""
    global _ACTIVE
    log = RunLog(run_dir, process_index)
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(log)
    if root.level > logging.WARNING or root.level == logging.NOTSET:
        root.setLevel(logging.WARNING)
    logging.captureWarnings(True)
    warnings.simplefilter("default")
    try:  # absl (Orbax's logger) writes to stderr through its own handler once initialised
        from absl import logging as absl_logging

        absl_logging.get_absl_handler().setLevel(logging.CRITICAL + 1)
        logging.getLogger("absl").propagate = True
    except Exception:  # noqa: BLE001 - absl is optional
        pass
    sys.unraisablehook = _unraisable
    _ACTIVE = log
    return log


def arm() -> None:
    """Called by the loop once the run dir is accepted: the log may now be written."""
    if _ACTIVE is not None:
        _ACTIVE.arm()


def active() -> Optional[RunLog]:
    return _ACTIVE


def write_traceback(exc: BaseException) -> Optional[str]:
    """Append `exc`'s traceback to the active log (arming it); returns the path or None."""
    log = _ACTIVE
    if log is None:
        return None
    try:
        log.arm()
        log.write_text("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        return log.path
    except OSError:
        return None
