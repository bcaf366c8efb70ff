"""What the training loop does around a run so that a refusal changes nothing and a restart
loses at most a step: pre-flight checks, the run-dir lock, both checkpoint tiers, and the
decision of where to resume from.

The loop calls these in order:

1. `refusals_leave_no_trace(cfg, run_dir)` around everything: path checks first; a run
   refused later (a `ConfigError` or `LockHeld`) removes the directories it created, so the
   run dir is as it was (a missing one stays missing).
2. `check_memory(cfg, plan)` before any state is allocated.
3. `locked(run_dir)`: the run-dir lock, held until the run returns (`lock.py`).
4. `open_tiers`: the persistent `Checkpointer` and, with `checkpoint.local_every` > 0, the
   `LocalTier`.
5. `restore_newest`: the newest step that verifies in either tier; with committed
   checkpoints none of which verifies, a refusal naming `checkpoint.on_unreadable`.
   Changes nothing on disk.
6. `accepted(...)`: the run is on; the run log may be written, the local tier is bound to
   this checkpoint dir.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
from typing import Any, NamedTuple, Optional

import jax

from jax_overlap.config import ConfigError
from jax_overlap.resilience import checkpoint as ckptlib
from jax_overlap.resilience import lock as locklib
from jax_overlap.resilience import preflight, run_log
from jax_overlap.resilience.local_tier import LocalTier

TOKEN_NAME = "LOCAL_TIER"  # in the checkpoint dir: which local tier belongs to it


@contextlib.contextmanager
def refusals_leave_no_trace(cfg, run_dir: str):
    """Path checks, then: a refused run removes the (empty) directories it created."""
    ckpt_dir = cfg.checkpoint.dir or os.path.join(run_dir, "checkpoints")
    problems = preflight.path_problems(run_dir, ckpt_dir, cfg.checkpoint.every_steps > 0)
    if problems:
        raise ConfigError(problems)
    created = [d for d in (ckpt_dir, run_dir) if not os.path.exists(d)]
    os.makedirs(run_dir, exist_ok=True)
    try:
        yield
    except (ConfigError, locklib.LockHeld):
        for d in created:  # child first
            _remove_if_empty(d)
        raise


def _remove_if_empty(path: str) -> None:
    # Orbax may leave an empty metadata-free tree; remove only directories with no files.
    for root, _, files in os.walk(path):
        if files:
            return
    shutil.rmtree(path, ignore_errors=True)


def check_memory(cfg, plan) -> None:
    """Refuse a step that cannot fit, before anything is allocated (`preflight`)."""
    problems = preflight.memory_problems(
        cfg.model, cfg.train, cfg.data, plan, device_bytes=plan.target.memory_bytes,
        local_devices=jax.local_device_count(), host_bytes=preflight.host_memory_bytes())
    if problems:
        raise ConfigError(problems)


@contextlib.contextmanager
def locked(run_dir: str):
    """Hold the run-dir lock (every process of the job; collective)."""
    coll = ckptlib.default_collectives()
    lock = locklib.acquire_for_job(run_dir, coll.process_index,
                                   lambda v: coll.broadcast_ints([v])[0], coll.all_true)
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()


def _read_token(ckpt_dir: str) -> int:
    try:
        with open(os.path.join(ckpt_dir, TOKEN_NAME), encoding="utf-8") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0


def open_tiers(cfg, ckpt_dir: str, mesh) -> tuple[Optional[ckptlib.Checkpointer],
                                                   Optional[LocalTier]]:
    """The persistent checkpointer and the local tier the config asks for."""
    ck = cfg.checkpoint
    if ck.every_steps <= 0:
        return None, None
    persistent = ckptlib.Checkpointer(
        ckptlib.CheckpointOptions(dir=ckpt_dir, every_steps=ck.every_steps, keep=ck.keep,
                                  async_save=ck.async_save,
                                  disk_full_at_step=cfg.fault.disk_full_at_step,
                                  commit_delay_s=cfg.fault.commit_delay_s), mesh)
    local = None
    if ck.local_every > 0:
        coll = ckptlib.default_collectives()
        token = coll.broadcast_ints([_read_token(ckpt_dir) if coll.process_index == 0 else 0])[0]
        local = LocalTier(ckpt_dir, ck.local_every, ck.local_keep, ck.local_dir,
                          cfg.fault.commit_delay_s, token=token)
    return persistent, local


class Found(NamedTuple):
    state: Any  # None: start from step 0
    step: int
    tier: Optional[str]  # "local", "persistent" or None
    skipped: list  # [(step, reason)]


def restore_newest(ckpt: ckptlib.Checkpointer, local: Optional[LocalTier], abstract: Any,
                   on_unreadable: str, ckpt_dir: str) -> Found:
    """The newest step that verifies in either tier (collective; changes nothing on disk).

    Raises:
      ConfigError: committed checkpoints exist, none verifies, and on_unreadable=refuse.
    """
    committed = ckpt.committed_steps()
    newest = committed[-1] if committed else 0
    skipped: list = []
    if local is not None:
        got, local_skipped = local.restore(abstract, min_step=newest)
        skipped += [(s, f"local tier: {r}") for s, r in local_skipped]
        if got is not None:
            return Found(got.state, got.step, "local", skipped)
    result = ckpt.latest_good(abstract, quarantine=False)
    skipped += ckpt.last_skipped
    if result is not None:
        return Found(result.state, result.step, "persistent", skipped)
    if committed and on_unreadable == "refuse":
        why = "; ".join(f"step {s}: {r[:90]}" for s, r in ckpt.last_skipped[:3])
        raise ConfigError([
            f"checkpoint.dir: {ckpt_dir}: none of the {len(committed)} committed checkpoints "
            f"verifies ({why}); set checkpoint.on_unreadable=restart to start over from step 0 "
            f"on purpose (they are moved to quarantine/), or pass a fresh --run-dir"])
    return Found(None, 0, None, skipped)


def accepted(ckpt_dir: str, local: Optional[LocalTier]) -> None:
    """The run is on: the run log may be written and the local tier is bound to this
    checkpoint dir (a fresh dir gets a new token, so an old run's local steps never load)."""
    run_log.arm()
    if local is None:
        return
    coll = ckptlib.default_collectives()
    token = 0
    if coll.process_index == 0:
        token = _read_token(ckpt_dir)
        if token == 0:
            token = random.SystemRandom().randrange(1, 2**31 - 1)
            ckptlib.LocalFS().write_atomic(os.path.join(ckpt_dir, TOKEN_NAME), str(token))
    local.bind(coll.broadcast_ints([token])[0])
