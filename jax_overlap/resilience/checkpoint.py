"""Versioned, verified checkpoints on top of Orbax's `CheckpointManager`.

What Orbax gives us: an atomic *per-process* save (files land in a temporary directory that
is renamed once every process has written its shards), async writes and a standard layout.
What it does not give us, and this module adds:

* **Two-phase commit.** A step counts only once process 0 has seen Orbax finalise it and
  has written a `COMMITTED` marker (temp file + rename, so it is never half-written). A
  step that Orbax finalised but that has no marker (killed between the two) is ignored.
* **Data checksums.** Orbax stores no checksum of array contents; a flipped byte in a
  compressed chunk restores silently as wrong numbers. We record one 64-bit checksum per
  array (see `array_checksums`) in the marker and in a `meta` item, and compare them
  with the restored arrays.
* **Fallback restore.** `latest_good` walks committed steps newest first and returns the
  first one that restores and verifies; every step it passes over is reported (warning +
  `RestoreResult.skipped`) and moved aside into `quarantine/`, never deleted.
* **Safe retention.** Old steps are deleted only right after a newer step was committed;
  the `keep` newest committed steps, the one just committed and the last step verified by
  a restore ("last known good") always survive.

On-disk layout (standard Orbax, readable without this package)::

    <dir>/<step>/state/...          TrainState, Orbax PyTree (OCDBT) format
    <dir>/<step>/config/metadata    resolved run config, JSON
    <dir>/<step>/meta/metadata      {"format", "step", "version", "checksums"}, JSON
    <dir>/<step>/_CHECKPOINT_METADATA, commit_success.txt   (Orbax's own)
    <dir>/<step>/COMMITTED          our commit marker, JSON, same fields as meta
    <dir>/quarantine/<step>.<n>/    steps that failed verification, kept for inspection

Multi-process: `latest_good`, `wait`, `close` and any `maybe_save` that saves are collective
(call them on every process at the same step); `committed_steps` is local. Only process 0
writes markers, moves or deletes files.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import shutil
import time
import warnings
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

logger = logging.getLogger(__name__)

MARKER_NAME = "COMMITTED"
QUARANTINE_DIR = "quarantine"
FORMAT_VERSION = 1
_STATE, _CONFIG, _META = "state", "config", "meta"


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """What to save, where and how often.

    Args:
      dir: root directory of the run's checkpoints (local or shared filesystem).
      every_steps: save when `state.step % every_steps == 0` (or when forced).
      keep: how many of the newest committed steps retention keeps (the last known-good
        and the newest committed step are kept in addition, whatever this is).
      async_save: write in the background; the step is committed once the write ends.
      disk_full_at_step: injected fault: the write of this step fails as on a full disk
        (OSError ENOSPC when it is committed), leaving the step uncommitted.
      commit_delay_s: injected delay between a finished write and its commit marker.
    """

    dir: str
    every_steps: int = 1000
    keep: int = 3
    async_save: bool = True
    disk_full_at_step: int = -1  # fault drill: the save of this step fails with ENOSPC
    commit_delay_s: float = 0.0  # fault drill: pause between the data and the marker

    def __post_init__(self):
        if self.every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {self.every_steps}")
        if self.keep < 1:
            raise ValueError(f"keep must be >= 1, got {self.keep}")


class RestoreResult(NamedTuple):
    state: Any  # the restored pytree, shaped and sharded like the abstract target
    step: int
    config: Any  # the JSON config saved with the step
    skipped: list  # [(step, reason)] newer steps that were passed over, newest first


# --------------------------------------------------------------------------------------
# Checksums
# --------------------------------------------------------------------------------------
#
# checksum(array) = sum over every 64-bit word w at global word index i of
#                   mix(w ^ (i * G))   (mod 2**64)
#
# `mix` is the splitmix64 finaliser, a bijection on 64-bit integers, and G an odd
# constant. Consequences:
# * Mesh-independent: the value depends only on (global index, bits) pairs, and a
#   modular sum does not care in which order or on which process the pairs are added.
#   Each process sums the shards it holds with `replica_id == 0` (so replicated data is
#   counted once) and the partial sums are added across processes.
# * Any change confined to one word (a flipped bit or byte) changes the sum for certain:
#   for a fixed index, w -> mix(w ^ i * G) is a bijection, so that term changes and the
#   others do not. Larger corruptions collide with probability about 2**-64, and moved
#   data is caught because each term is keyed by its position.
# * Bit-exact: we hash the raw bits, so -0.0 != 0.0 and NaN payloads count.
# * Cost: a few passes over the host copy (~45M items/s on one core in numpy), done in chunks.

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # odd: i -> i * _GOLDEN spreads indices over 64 bits
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array (wrapping arithmetic, a bijection)."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * _M1
        x = x ^ (x >> np.uint64(27))
        x = x * _M2
        return x ^ (x >> np.uint64(31))


def _as_words(block: np.ndarray) -> tuple[np.ndarray, int]:
    """The raw bits of `block` as uint64 words, shape block.shape + (words_per_item,)."""
    block = np.ascontiguousarray(block)
    size = block.dtype.itemsize
    if size in (1, 2, 4, 8):
        words = block.view(np.dtype(f"u{size}")).astype(np.uint64)
        return words[..., None], 1
    # Wide or odd-sized items (complex128, ...): zero-pad each item to whole 64-bit words.
    per = -(-size // 8)
    raw = block.view(np.uint8).reshape(block.shape + (size,))
    padded = np.zeros(block.shape + (per * 8,), np.uint8)
    padded[..., :size] = raw
    return padded.view(np.uint64), per


# Items hashed per pass: bounds the host temporaries (a few uint64 copies of each chunk).
_CHUNK_ITEMS = 1 << 22


def _terms_sum(block: np.ndarray, starts: Sequence[int], global_shape: tuple) -> int:
    """Sum of the hash terms of `block`, whose first item sits at `starts` globally."""
    words, per = _as_words(block)
    # Global flat element index of every item, built by broadcasting per-dimension ranges.
    flat = np.zeros(words.shape[:-1], np.uint64)
    stride = 1
    with np.errstate(over="ignore"):
        for dim in reversed(range(len(global_shape))):
            extent = words.shape[dim]
            shape = [1] * len(global_shape)
            shape[dim] = extent
            ramp = np.arange(starts[dim], starts[dim] + extent, dtype=np.uint64) * np.uint64(stride)
            flat = flat + ramp.reshape(shape)
            stride *= global_shape[dim]
        word_index = flat[..., None] * np.uint64(per) + np.arange(per, dtype=np.uint64)
        return int(_mix64(words ^ (word_index * _GOLDEN)).sum(dtype=np.uint64))


def block_checksum(block: np.ndarray, index: tuple, global_shape: tuple) -> int:
    """The checksum contribution of one block of a global array.

    Args:
      block: host data of the block.
      index: the block's position in the global array, one slice per dimension (as in
        `jax.Shard.index`); slices with `None` bounds cover the whole dimension.
      global_shape: shape of the whole array.

    Returns:
      The block's term of the array checksum, an int in [0, 2**64).
    """
    block = np.asarray(block)
    if block.ndim == 0:
        block, index, global_shape = block.reshape(1), (slice(0, 1),), (1,)
    starts = [(index[d].start or 0) if d < len(index) else 0 for d in range(block.ndim)]
    rows_per_pass = max(1, _CHUNK_ITEMS // max(1, int(np.prod(block.shape[1:]))))
    total = 0
    for row in range(0, block.shape[0], rows_per_pass):
        chunk = block[row : row + rows_per_pass]
        total += _terms_sum(chunk, [starts[0] + row, *starts[1:]], tuple(global_shape))
    return total & _MASK64


def _local_checksum(leaf: Any, is_lead_process: bool) -> int:
    """This process's part of a leaf's checksum (the sum over processes is the checksum)."""
    if isinstance(leaf, jax.Array):
        total = 0
        for shard in leaf.addressable_shards:
            if shard.replica_id == 0:  # count replicated data once, on its first replica
                total += block_checksum(np.asarray(shard.data), shard.index, leaf.shape)
        return total & _MASK64
    # Host values (numpy arrays, Python scalars) are the same everywhere: count once.
    if not is_lead_process:
        return 0
    host = np.asarray(leaf)
    return block_checksum(host, tuple(slice(None) for _ in host.shape), host.shape)


def _leaf_names(tree: Any) -> list[str]:
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def array_checksums(tree: Any, collectives: Optional["Collectives"] = None) -> dict[str, dict]:
    """Mesh-independent checksums of every leaf of `tree` (collective across processes).

    Args:
      tree: a pytree of jax.Arrays (any sharding) and/or host arrays.
      collectives: how processes combine partial sums; defaults to `default_collectives()`.

    Returns:
      {leaf path: {"checksum": 16 hex digits, "shape": [...], "dtype": str}}.
    """
    coll = collectives or default_collectives()
    leaves = jax.tree_util.tree_leaves(tree)
    partial = [_local_checksum(leaf, coll.process_index == 0) for leaf in leaves]
    totals = coll.sum_u64(partial)
    out = {}
    for name, leaf, total in zip(_leaf_names(tree), leaves, totals):
        arr_shape = list(np.shape(leaf))
        dtype = str(leaf.dtype) if hasattr(leaf, "dtype") else str(np.asarray(leaf).dtype)
        out[name] = {"checksum": f"{total:016x}", "shape": arr_shape, "dtype": dtype}
    return out


# --------------------------------------------------------------------------------------
# Cross-process agreement (injected so single-process tests need no distributed runtime)
# --------------------------------------------------------------------------------------


class Collectives(NamedTuple):
    """The few cross-process operations the checkpointer needs.

    Fields:
      process_index: this process's index (0 writes markers and deletes files).
      broadcast_ints: every process gets process 0's list of ints.
      sum_u64: element-wise sum (mod 2**64) of every process's list of ints.
      all_true: True on every process iff the flag is True on every process.
    """

    process_index: int
    broadcast_ints: Callable[[Sequence[int]], list]
    sum_u64: Callable[[Sequence[int]], list]
    all_true: Callable[[bool], bool]


def local_collectives() -> Collectives:
    """Collectives for a single process: every operation is the identity."""
    return Collectives(
        process_index=0,
        broadcast_ints=lambda values: [int(v) for v in values],
        sum_u64=lambda values: [int(v) & _MASK64 for v in values],
        all_true=bool,
    )


def _jax_broadcast_ints(values: Sequence[int]) -> list:
    # Lengths may differ per process; agree on process 0's length first. int32 suffices
    # for steps, and is what JAX carries with x64 disabled.
    n = int(multihost_utils.broadcast_one_to_all(np.int32(len(values))))
    buf = np.zeros((max(n, 1),), np.int32)
    if jax.process_index() == 0:
        buf[:n] = np.asarray(values, np.int64)
    out = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    return [int(v) for v in out[:n]]


def _jax_sum_u64(values: Sequence[int]) -> list:
    # JAX (x64 off) cannot carry uint64, so ship each value as two uint32 halves.
    vals = np.asarray([int(v) & _MASK64 for v in values], np.uint64)
    halves = np.stack([(vals >> np.uint64(32)).astype(np.uint32), (vals & np.uint64(0xFFFFFFFF)).astype(np.uint32)], -1)
    gathered = np.asarray(multihost_utils.process_allgather(halves)).astype(np.uint64)
    with np.errstate(over="ignore"):
        per_process = (gathered[..., 0] << np.uint64(32)) | gathered[..., 1]
        total = per_process.sum(axis=0, dtype=np.uint64)
    return [int(v) for v in np.atleast_1d(total)]


def _jax_all_true(flag: bool) -> bool:
    return bool(np.asarray(multihost_utils.process_allgather(np.int32(bool(flag)))).all())


def jax_collectives() -> Collectives:
    """Collectives over all JAX processes (needs `jax.distributed.initialize`)."""
    return Collectives(
        process_index=jax.process_index(),
        broadcast_ints=_jax_broadcast_ints,
        sum_u64=_jax_sum_u64,
        all_true=_jax_all_true,
    )


def default_collectives() -> Collectives:
    return jax_collectives() if jax.process_count() > 1 else local_collectives()


# --------------------------------------------------------------------------------------
# Filesystem operations of our own (markers, quarantine, deletion)
# --------------------------------------------------------------------------------------


class LocalFS:
    """POSIX file operations for markers and retention; swap it out to fake failures."""

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def read_text(self, path: str) -> str:
        with open(path, encoding="utf-8") as f:
            return f.read()

    def write_atomic(self, path: str, text: str) -> None:
        """Write `text` so readers see either no file or the whole file."""
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        # Persist the rename itself, or a power cut could lose the marker.
        fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def remove(self, path: str) -> None:
        os.remove(path)

    def rmtree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def move(self, src: str, dst: str) -> None:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.replace(src, dst)


# --------------------------------------------------------------------------------------
# Abstract targets
# --------------------------------------------------------------------------------------


def abstract_target(tree: Any, mesh: Optional[Mesh] = None) -> Any:
    """Turn a pytree of arrays / ShapeDtypeStructs into a restore target with shardings.

    Leaves that already carry a sharding keep it (that is how a caller restores onto a
    given layout); leaves without one are fully replicated over `mesh` (or put on the
    first local device when there is no mesh).

    Args:
      tree: pytree of jax.Array, np.ndarray or jax.ShapeDtypeStruct.
      mesh: the current mesh, used for leaves without a sharding.

    Returns:
      The same pytree of jax.ShapeDtypeStruct, each with a sharding.
    """
    if mesh is not None:
        default = NamedSharding(mesh, PartitionSpec())
    else:
        default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def one(leaf):
        sharding = getattr(leaf, "sharding", None)
        if not isinstance(sharding, jax.sharding.Sharding):
            sharding = default
        return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype, sharding=sharding)

    return jax.tree.map(one, tree)


# --------------------------------------------------------------------------------------
# The checkpointer
# --------------------------------------------------------------------------------------


def _scalar(x: Any) -> int:
    return int(np.asarray(x))


class Checkpointer:
    """Save, commit, verify and restore `TrainState`s; see the module docstring.

    Args:
      options: where/how often/how many.
      mesh: the current mesh; replicated fallback sharding for restore targets.
      clock: monotonic clock, used to time the blocking part of saves.
      fs: file operations for markers/retention (tests inject failures here).
      collectives: cross-process agreement; defaults to JAX's when there are processes.
    """

    def __init__(
        self,
        options: CheckpointOptions,
        mesh: Optional[Mesh] = None,
        clock: Callable[[], float] = time.monotonic,
        fs: Optional[LocalFS] = None,
        collectives: Optional[Collectives] = None,
    ):
        self.options = options
        self.mesh = mesh
        self._clock = clock
        self._fs = fs or LocalFS()
        self._coll = collectives or default_collectives()
        self._dir = os.path.abspath(options.dir)
        self._manager = ocp.CheckpointManager(
            self._dir,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=None,  # retention is ours: Orbax knows nothing of markers
                enable_async_checkpointing=options.async_save,
                create=True,
                cleanup_tmp_directories=True,  # drop half-written temp dirs of killed runs
            ),
        )
        self._pending: Optional[dict] = None  # marker of the save in flight, not committed
        self._last_saved: Optional[tuple[int, int]] = None  # (step, version) last saved
        self.last_known_good: Optional[int] = None  # newest step verified by a restore
        self.last_skipped: list = []  # [(step, reason)] of the last `latest_good`
        self.last_save_blocking_s: float = 0.0  # how long the last save held the caller

    # ---- paths and markers -----------------------------------------------------------

    def _step_dir(self, step: int) -> str:
        return os.path.join(self._dir, str(step))

    def _marker_path(self, step: int) -> str:
        return os.path.join(self._step_dir(step), MARKER_NAME)

    def _read_marker(self, step: int) -> dict:
        """The step's commit marker; raises if it is missing or unreadable."""
        return json.loads(self._fs.read_text(self._marker_path(step)))

    def _step_dirs(self) -> list[int]:
        """Every finalised step directory, committed or not (Orbax's view, re-read)."""
        self._manager.reload()
        return sorted(int(s) for s in self._manager.all_steps())

    def committed_steps(self) -> list[int]:
        """Steps that have a commit marker, ascending (local, not collective)."""
        return [s for s in self._step_dirs() if self._fs.exists(self._marker_path(s))]

    # ---- saving ----------------------------------------------------------------------

    def maybe_save(
        self, state: Any, config: Mapping[str, Any], force: bool = False, *, step: Optional[int] = None
    ) -> bool:
        """Save `state` if its step is due (or `force`); commits an earlier finished save.

        Collective: call on every process with the same step.

        Args:
          state: the TrainState (or any pytree with `step` and `version` fields).
          config: the resolved run config, JSON-serialisable.
          force: save whatever the step (e.g. on pre-emption or at the end).
          step: `state.step` if the caller already knows it on the host; saves reading
            it from the device, which would wait for the step in flight to finish.

        Returns:
          True iff a save of this step was started.
        """
        self._poll()
        step = _scalar(state.step) if step is None else int(step)
        if not force and step % self.options.every_steps != 0:
            return False
        version = _scalar(state.version)
        if (step, version) == self._last_saved:
            return False  # e.g. a forced save right after the interval save of this step
        start = self._clock()
        self._finish_pending()  # one save in flight at a time; commit the previous one
        checksums = array_checksums(state, self._coll)
        meta = {"format": FORMAT_VERSION, "step": step, "version": version, "checksums": checksums}
        self._last_saved = (step, version)
        if not self._make_room(step, meta):
            return False
        self._manager.save(
            step,
            args=ocp.args.Composite(
                **{
                    _STATE: ocp.args.StandardSave(state),
                    _CONFIG: ocp.args.JsonSave(dict(config)),
                    _META: ocp.args.JsonSave(meta),
                }
            ),
            force=True,  # the save decision is ours, not Orbax's interval policy
        )
        self._pending = meta
        if not self.options.async_save:
            self._finish_pending()
        self.last_save_blocking_s = self._clock() - start
        return True

    def _make_room(self, step: int, meta: dict) -> bool:
        """Clear the way for saving `step`; False when an identical commit already exists.

        A directory for `step` can exist after a resume (a run killed before committing
        it) or after a rollback (another timeline's state). Process 0 decides, so that all
        processes act alike: 0 = nothing there, 1 = identical committed copy, 2 = moved away.
        """
        action = 0
        if self._coll.process_index == 0 and step in self._step_dirs():
            try:
                same = self._read_marker(step) == meta
            except (OSError, ValueError):
                same = False
            action = 1 if same else 2
            if action == 2:
                self._quarantine(step, "replaced by a new save of the same step")
        action = self._coll.broadcast_ints([action])[0]
        self._manager.reload()
        return action != 1

    def _poll(self) -> None:
        """Commit the in-flight save if Orbax has finished it, without blocking.

        Local to process 0 (no collective), so a finished step is committed at the next
        call rather than at the next save.
        """
        if self._pending is None or self._coll.process_index != 0:
            return
        in_progress = getattr(self._manager, "is_saving_in_progress", None)
        if in_progress is not None and not in_progress():
            self._commit_pending()

    def _commit_pending(self) -> None:
        """Wait for the in-flight save, then commit it (process 0) and apply retention.

        Orbax finalises a step (renames its temp directory) only after every process has
        written its shards, so once process 0's manager reports it finished, the data of
        all processes is on disk and process 0 alone may write the marker.
        """
        if self._pending is None:
            return
        meta, self._pending = self._pending, None
        # Raises if the background write failed: the step then stays uncommitted.
        self._manager.wait_until_finished()
        if meta["step"] == self.options.disk_full_at_step:
            raise OSError(errno.ENOSPC, "No space left on device (injected: "
                          "fault.disk_full_at_step)", self._step_dir(meta["step"]))
        if self.options.commit_delay_s:
            time.sleep(self.options.commit_delay_s)
        if self._coll.process_index == 0:
            step = meta["step"]
            self._fs.write_atomic(self._marker_path(step), json.dumps(meta, sort_keys=True))
            logger.info("committed checkpoint step %d (version %d)", step, meta["version"])
            self._retain(newest=step)

    def _finish_pending(self) -> None:
        """Collective: commit the in-flight save, if any, then line every process up.

        The barrier runs whether or not this process still had a save pending (process 0
        may have committed it in `_poll` already), so every process makes the same calls.
        """
        self._commit_pending()
        self._coll.broadcast_ints([0])  # barrier: every process now sees the marker

    def _retain(self, newest: int) -> None:
        """Delete steps older than the just-committed `newest` that are no longer needed."""
        steps = self._step_dirs()
        committed = [s for s in steps if self._fs.exists(self._marker_path(s))]
        keep = set(committed[-self.options.keep :]) | {newest}
        if self.last_known_good is not None:
            keep.add(self.last_known_good)
        for step in steps:
            # Only ever delete *older* steps: a newer committed step may be the good one.
            if step < newest and step not in keep:
                self._delete(step)
        self._manager.reload()

    def _delete(self, step: int) -> None:
        # Un-commit first: a crash mid-delete leaves an uncommitted (ignored) step, never
        # a committed one with files missing.
        marker = self._marker_path(step)
        if self._fs.exists(marker):
            self._fs.remove(marker)
        self._fs.rmtree(self._step_dir(step))
        logger.info("deleted checkpoint step %d", step)

    def _quarantine(self, step: int, reason: str) -> None:
        base = os.path.join(self._dir, QUARANTINE_DIR, str(step))
        n = 0
        while self._fs.exists(f"{base}.{n}"):
            n += 1
        self._fs.move(self._step_dir(step), f"{base}.{n}")
        logger.warning("moved checkpoint step %d to %s.%d: %s", step, base, n, reason)

    def wait(self) -> None:
        """Block until the in-flight save is written and committed (collective)."""
        self._finish_pending()

    # ---- restoring -------------------------------------------------------------------

    def latest_good(self, abstract_state: Any, quarantine: bool = True) -> Optional[RestoreResult]:
        """Restore the newest step that is committed and verifies; None if there is none.

        Collective. Steps passed over are warned about, returned in `skipped` and moved
        to `quarantine/` (so a later save of the same step number does not collide).

        Args:
          abstract_state: target pytree (ShapeDtypeStructs or arrays) whose shardings
            say how to lay the state out on the *current* mesh; see `abstract_target`.
          quarantine: move the skipped steps aside now; False leaves the directory as it
            was (the caller decides first, then calls `quarantine_skipped`).

        Returns:
          RestoreResult, or None when no step verifies (`last_skipped` then holds what was
          passed over).
        """
        self.wait()
        target = abstract_target(abstract_state, self.mesh)
        # Process 0's listing is the one everybody walks, newest first.
        steps = self._coll.broadcast_ints(sorted(self._step_dirs(), reverse=True))
        skipped: list = []
        result = None
        for step in steps:
            restored, reason = self._try_restore(step, target)
            if self._coll.all_true(reason is None):
                reason = self._verify_checksums(step, restored)
            elif reason is None:
                reason = "restore failed on another process"
            if reason is None:
                result = RestoreResult(restored[_STATE], step, restored[_CONFIG], skipped)
                break
            warnings.warn(f"skipping checkpoint step {step}: {reason}", RuntimeWarning, stacklevel=2)
            skipped.append((step, reason))
        self.last_skipped = skipped
        if quarantine:
            self.quarantine_skipped(skipped)
        if result is not None:
            self.last_known_good = result.step
        return result

    def quarantine_skipped(self, skipped: Sequence[tuple[int, str]]) -> None:
        """Move the steps `latest_good` passed over to `quarantine/` (collective)."""
        if self._coll.process_index == 0:
            for step, reason in skipped:
                if os.path.isdir(self._step_dir(step)):
                    self._quarantine(step, reason)
        self._coll.broadcast_ints([0])  # barrier: quarantine done before anyone saves
        self._manager.reload()

    def _try_restore(self, step: int, target: Any) -> tuple[Any, Optional[str]]:
        """Restore one step and check everything but checksums (local to this process)."""
        try:
            marker = self._read_marker(step)
        except FileNotFoundError:
            return None, f"no {MARKER_NAME} marker (save never committed)"
        except (OSError, ValueError) as e:
            return None, f"unreadable {MARKER_NAME} marker: {e}"
        if marker.get("format") != FORMAT_VERSION or marker.get("step") != step:
            return None, f"marker is for step {marker.get('step')} format {marker.get('format')}"
        try:
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    **{
                        _STATE: ocp.args.StandardRestore(target),
                        _CONFIG: ocp.args.JsonRestore(),
                        _META: ocp.args.JsonRestore(),
                    }
                ),
            )
        except Exception as e:  # noqa: BLE001 - any failure to read means "not this step"
            return None, f"restore failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
        if restored[_META] != marker:
            return None, "meta item disagrees with the commit marker"
        state = restored[_STATE]
        got = (_scalar(state.step), _scalar(state.version))
        if got != (step, marker["version"]):
            return None, f"restored (step, version) {got} != marker ({step}, {marker['version']})"
        return {_STATE: state, _CONFIG: restored[_CONFIG], _META: marker}, None

    def _verify_checksums(self, step: int, restored: dict) -> Optional[str]:
        """Compare restored arrays with the marker's checksums (collective)."""
        expected = restored[_META]["checksums"]
        actual = array_checksums(restored[_STATE], self._coll)
        if set(actual) != set(expected):
            return f"array set differs: {sorted(set(actual) ^ set(expected))[:5]}"
        bad = [name for name in sorted(expected) if actual[name] != expected[name]]
        if bad:
            return f"checksum mismatch in {len(bad)} array(s), e.g. {bad[0]}"
        return None

    def close(self) -> None:
        """Commit the in-flight save and release Orbax's resources (collective)."""
        try:
            self.wait()
        finally:
            self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
