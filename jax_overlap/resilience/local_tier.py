"""The fast local checkpoint tier: each process's own shards, every few steps, in RAM disk.

A persistent checkpoint every N steps loses up to N steps per crash. This tier keeps the
newest one or two steps of each process's *addressable shards* (no cross-process traffic,
no Orbax) in a local directory, by default under `/dev/shm`, written in a background thread,
so a SIGKILL costs at most the step in flight. It restores only onto the same mesh and
process layout that wrote it (same shard indices per process); anything else falls back to
the persistent tier (`checkpoint.py`), which restores onto any mesh.

Why not `orbax.checkpoint.experimental.emergency` (orbax-checkpoint 0.12.8): its manager
counts replicas along the mesh's data-parallel axis; with one replica (dp = 1, e.g. a pure
TP or PP mesh) it drops the local directory and is a plain persistent manager, and with two
or more it restores a local step by broadcasting from a peer replica's processes (built for
multi-slice TPU jobs). Neither keeps a checksum of the array contents, and its local steps
know nothing of our commit marker. Megatron's local checkpoints are the model here: one file
set per process, its own marker, the persistent tier as fallback.

Layout, per process (`<root>/<run key>/p<process index>/`)::

    <step>/arrays.npz     every unique addressable shard of every leaf (uncompressed)
    <step>/meta.json      {"step", "version", "leaves": [{"name", "shape", "dtype",
                            "shards": [{"index", "checksum"}]}]}
    <step>/COMMITTED      the same JSON, written last (temp file + rename)
    OWNER                 the checkpoint dir this tier belongs to (for sweeping)

A step counts only with its marker, and restores only if every shard's checksum (CRC-32 of its
bytes, `shard_checksum`) matches. Multi-process: `restore` is collective; all
processes agree on the newest step that verifies on every one of them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import zlib
from typing import Any, Callable, NamedTuple, Optional

import jax
import numpy as np

from jax_overlap.resilience.checkpoint import (
    MARKER_NAME,
    Collectives,
    LocalFS,
    default_collectives,
)

logger = logging.getLogger(__name__)

OWNER_NAME = "OWNER"


def default_root() -> str:
    """/dev/shm/jax_overlap-<uid> where /dev/shm is a writable directory, else the temp dir."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else (
        tempfile.gettempdir())
    return os.path.join(base, f"jax_overlap-{os.getuid()}")


def run_key(checkpoint_dir: str) -> str:
    """The tier's directory name for a run: its checkpoint dir's absolute path, hashed."""
    return hashlib.sha1(os.path.abspath(checkpoint_dir).encode()).hexdigest()[:16]


def shard_checksum(data: np.ndarray) -> str:
    """CRC-32 of a shard's raw bytes, its dtype and shape. Local steps restore only onto the
    layout that wrote them, so the persistent tier's mesh-independent checksum is not needed;
    CRC-32 catches any flipped byte or truncation and costs microseconds per shard."""
    data = np.ascontiguousarray(data)
    head = f"{data.dtype.str}{data.shape}".encode()
    return f"{zlib.crc32(memoryview(data).cast('B'), zlib.crc32(head)):08x}"


def _norm_index(index: tuple, shape: tuple) -> list:
    """A shard's index as [[start, stop], ...] (JSON-able, None bounds resolved)."""
    return [list(s.indices(n)[:2]) for s, n in zip(index, shape)]


def _key(norm: list) -> str:
    return ";".join(f"{a}:{b}" for a, b in norm)


class LocalRestore(NamedTuple):
    state: Any
    step: int
    skipped: list  # [(step, reason)] local steps passed over


class LocalTier:
    """Save and restore one process's shards of the loop state; see the module docstring.

    Args:
      checkpoint_dir: the persistent checkpoint dir (keys the tier to the run).
      every: save every this many accepted steps.
      keep: local steps kept (1 or 2).
      root: where tiers live (default `default_root()`).
      commit_delay_s: wait this long between the data and the marker (drills).
      collectives: cross-process agreement (default: JAX's when there are processes).
      token: the checkpoint dir's local-tier token (0: it has none yet). Local steps are
        restored only when the tier was bound to the same token, so a fresh run dir at an
        old path never loads the old run's local steps.
    """

    def __init__(self, checkpoint_dir: str, every: int, keep: int = 2, root: str = "",
                 commit_delay_s: float = 0.0, collectives: Optional[Collectives] = None,
                 sleep: Callable[[float], None] = time.sleep, token: int = 0):
        self.every = every
        self.keep = keep
        self._coll = collectives or default_collectives()
        self.root = root or default_root()
        self.run_root = os.path.join(self.root, run_key(checkpoint_dir))
        self.dir = os.path.join(self.run_root, f"p{self._coll.process_index}")
        self._owner = os.path.abspath(checkpoint_dir)
        self._delay = commit_delay_s
        self._sleep = sleep
        self._fs = LocalFS()
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self.token = token
        os.makedirs(self.dir, exist_ok=True)
        owner = os.path.join(self.run_root, OWNER_NAME)
        if not os.path.exists(owner):
            with open(owner, "w", encoding="utf-8") as f:
                f.write(self._owner)
        sweep_orphans(self.root, keep=self.run_root)

    # ---- binding to the run --------------------------------------------------------

    def _stored_token(self) -> int:
        try:
            with open(os.path.join(self.dir, "TOKEN"), encoding="utf-8") as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return 0

    def bound(self) -> bool:
        """Whether the local steps here belong to the checkpoint dir's current run."""
        return self.token != 0 and self._stored_token() == self.token

    def bind(self, token: int) -> None:
        """Belong to `token`'s run from now on; local steps of another one are removed."""
        self.token = token
        if self._stored_token() != token:
            for s in self.steps():
                self._remove(s)
            self._fs.write_atomic(os.path.join(self.dir, "TOKEN"), str(token))

    # ---- listing -------------------------------------------------------------------

    def _step_dir(self, step: int) -> str:
        return os.path.join(self.dir, str(step))

    def steps(self) -> list[int]:
        """Local step directories, committed or not, ascending."""
        try:
            return sorted(int(s) for s in os.listdir(self.dir) if s.isdigit())
        except FileNotFoundError:
            return []

    def committed_steps(self) -> list[int]:
        return [s for s in self.steps() if os.path.exists(os.path.join(self._step_dir(s),
                                                                       MARKER_NAME))]

    # ---- saving --------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def save(self, tree: Any, step: int, version: int) -> None:
        """Start writing `tree` (the checkpoint-layout loop state) as `step` in the background.

        Waits for the previous local save first (one in flight). The host copy of the shards
        is taken here, so the caller may donate or overwrite the arrays right after.
        """
        self.wait()
        leaves, names = [], []
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            names.append(jax.tree_util.keystr(path))
            leaves.append(leaf)
        host, pending = [], []
        for leaf in leaves:
            shape = tuple(np.shape(leaf))
            shards = {}
            if isinstance(leaf, jax.Array):
                for shard in leaf.addressable_shards:
                    norm = _norm_index(shard.index, shape)
                    if _key(norm) not in shards:
                        shards[_key(norm)] = [norm, None]
                        pending.append((shards[_key(norm)], shard.data))
            else:
                norm = [[0, n] for n in shape]
                shards[_key(norm)] = [norm, np.array(leaf, copy=True)]
            host.append((shape, str(np.dtype(getattr(leaf, "dtype", np.asarray(leaf).dtype))),
                         list(shards.values())))
        # One transfer of every unique shard (copied: the step may donate the buffers next).
        for slot, data in zip(pending, jax.device_get([d for _, d in pending])):
            slot[0][1] = np.array(data, copy=True)
        self._thread = threading.Thread(target=self._write, args=(names, host, step, version),
                                        name=f"local-ckpt-{step}", daemon=True)
        self._thread.start()

    def _write(self, names, host, step: int, version: int) -> None:
        try:
            for old in self.steps():  # another timeline's steps at or past this one
                if old >= step:
                    self._remove(old)
            tmp = os.path.join(self.dir, f".tmp-{step}")
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            arrays, leaves = {}, []
            for i, (name, (shape, dtype, shards)) in enumerate(zip(names, host)):
                entry = {"name": name, "shape": list(shape), "dtype": dtype, "shards": []}
                for j, (norm, data) in enumerate(shards):
                    arrays[f"a{i}_{j}"] = data
                    entry["shards"].append({"index": norm, "checksum": shard_checksum(data)})
                leaves.append(entry)
            np.savez(os.path.join(tmp, "arrays.npz"), **arrays)
            meta = {"step": step, "version": version, "leaves": leaves}
            text = json.dumps(meta, sort_keys=True)
            with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, self._step_dir(step))
            if self._delay:
                self._sleep(self._delay)
            self._fs.write_atomic(os.path.join(self._step_dir(step), MARKER_NAME), text)
            for old in self.committed_steps()[:-self.keep]:
                self._remove(old)
        except BaseException as e:  # noqa: BLE001 - reported by the next wait()
            self._error = e

    def _remove(self, step: int) -> None:
        marker = os.path.join(self._step_dir(step), MARKER_NAME)
        if os.path.exists(marker):
            os.remove(marker)  # un-commit first: a torn delete is an ignored step
        shutil.rmtree(self._step_dir(step), ignore_errors=True)

    def wait(self) -> None:
        """Block until the save in flight is written and committed; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def discard_after(self, step: int) -> None:
        """Drop every local step past `step` (a rollback left them on another timeline)."""
        self.wait()
        for s in self.steps():
            if s > step:
                self._remove(s)

    # ---- restoring -----------------------------------------------------------------

    def _load(self, step: int, abstract: Any) -> tuple[Any, Optional[str]]:
        """Restore `step` onto `abstract`'s shardings, verified (local to this process)."""
        d = self._step_dir(step)
        try:
            with open(os.path.join(d, MARKER_NAME), encoding="utf-8") as f:
                meta = json.load(f)
        except FileNotFoundError:
            return None, f"no {MARKER_NAME} marker (local save never committed)"
        except (OSError, ValueError) as e:
            return None, f"unreadable local marker: {e}"
        if meta.get("step") != step:
            return None, f"local marker is for step {meta.get('step')}"
        flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
        if [jax.tree_util.keystr(p) for p, _ in flat] != [e["name"] for e in meta["leaves"]]:
            return None, "local step holds another state layout"
        try:
            npz = np.load(os.path.join(d, "arrays.npz"))
            out = []
            for i, ((_, target), entry) in enumerate(zip(flat, meta["leaves"])):
                shape = tuple(target.shape)
                if list(shape) != entry["shape"] or str(np.dtype(target.dtype)) != entry["dtype"]:
                    return None, f"local step: {entry['name']} has another shape or dtype"
                by_key = {_key(s["index"]): (j, s) for j, s in enumerate(entry["shards"])}
                sharding = target.sharding
                pieces = []
                for device, index in sharding.addressable_devices_indices_map(shape).items():
                    norm = _norm_index(index, shape)
                    if _key(norm) not in by_key:
                        return None, "local step was written on another mesh or process layout"
                    j, s = by_key[_key(norm)]
                    data = npz[f"a{i}_{j}"]
                    if shard_checksum(data) != s["checksum"]:
                        return None, f"local step: checksum mismatch in {entry['name']}"
                    pieces.append(jax.device_put(data, device))
                out.append(jax.make_array_from_single_device_arrays(shape, sharding, pieces))
        except Exception as e:  # noqa: BLE001 - any failure to read means "not this step"
            return None, f"local step unreadable: {type(e).__name__}: {str(e)[:200]}"
        state = jax.tree_util.tree_unflatten(treedef, out)
        return (state, meta["version"]), None

    def restore(self, abstract: Any, min_step: int = 0) -> tuple[Optional[LocalRestore], list]:
        """The newest local step >= `min_step` that verifies on every process (collective).

        Args:
          abstract: restore target with shardings (the loop state's, checkpoint layout).
          min_step: older local steps are not worth restoring (a newer persistent one exists).

        Returns:
          (LocalRestore or None, [(step, reason)] local steps passed over).
        """
        self.wait()
        mine = self.steps() if self.bound() else []
        steps = self._coll.broadcast_ints([s for s in sorted(mine, reverse=True)
                                           if s >= min_step])
        skipped = []
        for step in steps:
            loaded, reason = self._load(step, abstract) if step in mine else (
                None, "missing on this process")
            if self._coll.all_true(reason is None):
                state, _version = loaded
                return LocalRestore(state, step, skipped), skipped
            skipped.append((step, reason or "a local shard failed on another process"))
        return None, skipped

    def close(self, remove: bool = False) -> None:
        """Finish the save in flight; `remove` deletes this run's tier (the persistent tier
        holds the final state)."""
        try:
            self.wait()
        finally:
            if remove:
                shutil.rmtree(self.dir, ignore_errors=True)
                try:
                    rest = [n for n in os.listdir(self.run_root) if n != OWNER_NAME]
                    if not rest:
                        shutil.rmtree(self.run_root, ignore_errors=True)
                except FileNotFoundError:
                    pass


def sweep_orphans(root: str, keep: str = "") -> list[str]:
    """Remove the tiers under `root` whose checkpoint dir no longer exists; returns them."""
    removed = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return removed
    for name in names:
        path = os.path.join(root, name)
        if path == keep or not os.path.isdir(path):
            continue
        try:
            with open(os.path.join(path, OWNER_NAME), encoding="utf-8") as f:
                owner = f.read().strip()
        except OSError:
            continue
        if owner and not os.path.exists(owner):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
