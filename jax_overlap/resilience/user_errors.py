"""Which exceptions are the user's to fix, and the one line that says how.

The CLI prints that line and exits with code 2; anything else is a bug, whose traceback goes
to the run's log file (`run_log`) while the terminal gets one line naming it. Library
exceptions arrive wrapped (Orbax re-raises a background write's OSError inside its own, XLA's
out-of-memory is an `XlaRuntimeError`), so the whole cause/context chain is searched.
"""

from __future__ import annotations

import errno
from typing import Iterator, Optional

# ValueErrors whose message starts with a config section or flag name are bad user input
# (schedules, presets, plan checks); others are bugs.
FIELD_PREFIXES = ("pipeline.", "overlap.", "model.", "mesh.", "train.", "data.", "checkpoint.",
                  "guard.", "fault.", "distributed.", "--", "hardware", "target")

_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def user_error_line(exc: BaseException) -> Optional[str]:
    """The one line to print for a user error (without "error: "), or None for a bug."""
    from jax_overlap.resilience.lock import LockHeld

    chain = list(_chain(exc))
    for e in chain:
        if isinstance(e, LockHeld):
            return e.line
    for e in chain:  # disk full first: it often arrives inside another error
        no_space = (isinstance(e, OSError) and e.errno in _DISK_FULL) or (
            "No space left on device" in str(e) or "Disk quota exceeded" in str(e))
        if no_space:
            where = getattr(e, "filename", None) or "a checkpoint or log file"
            return (f"{where}: no space left on device; free space there or point "
                    f"checkpoint.dir at a larger disk, then rerun the same command to resume "
                    f"from the last committed checkpoint")
    for e in chain:
        if isinstance(e, MemoryError):
            return ("train.global_batch: out of host memory (MemoryError); lower "
                    "train.global_batch or shrink the model")
        if "RESOURCE_EXHAUSTED" in str(e) or "Out of memory" in str(e):
            return (f"train.global_batch: out of device memory ({_first_line(e)[:160]}); lower "
                    f"train.global_batch, raise pipeline.microbatches, set model.remat=full or "
                    f"split the model further (mesh.pp, mesh.tp)")
    if isinstance(exc, OSError) and exc.filename:
        name = exc.filename
        if isinstance(exc, FileNotFoundError):
            return f"{name}: file not found"
        if isinstance(exc, IsADirectoryError):
            return f"{name}: is a directory, a file is needed here"
        if isinstance(exc, FileExistsError):  # os.makedirs over a file
            return f"{name}: a file is in the way where a directory is needed; pick another path"
        if isinstance(exc, NotADirectoryError):
            return f"{name}: a part of this path is a file, a directory is needed"
        if exc.errno in _DENIED:
            what = "read-only filesystem" if exc.errno == errno.EROFS else "permission denied"
            return f"{name}: {what}; use a writable location"
    if isinstance(exc, ValueError) and str(exc).startswith(FIELD_PREFIXES):
        return str(exc).splitlines()[0]
    return None
