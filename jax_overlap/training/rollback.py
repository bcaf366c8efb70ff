"""Rollback: where a run that keeps rejecting steps goes back to, and the state it resumes from.

After more than `guard.max_skips` rejected steps in a row the loop restores the newest good
checkpoint (or, with none, the initial state, which the seed reproduces exactly: it is the
implicit checkpoint at step 0) and moves the data position `guard.skip_batches` past the last
batch consumed, so the replayed steps never see the batches around the blow-up again
(`plan_rollback`). `version` moves past every version the run has used, the guard keeps its
restored window with the bad streak cleared, `rollbacks` +1 (`apply_rollback`), and the
learning rate is scaled by `guard.lr_scale_on_rollback ** rollbacks`.

In a multi-process run the decision to roll back follows from replicated step metrics, so
every process takes it identically; the step to restore is agreed by
`Checkpointer.latest_good`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_overlap.training.loop_state import LoopState


class Rollback(NamedTuple):
    from_step: int  # the step the run was stuck at
    to_step: int  # the step restored
    resume_batch: int  # the first batch the restored run consumes
    data_offset: int  # the restored state's new data_offset
    steps_lost: int  # accepted updates discarded
    reason: str


def plan_rollback(from_step: int, next_batch: int, to_step: int, skip_batches: int,
                  reason: str) -> Rollback:
    """Where a rollback resumes the data stream.

    The run goes back to `to_step` but not back in the data: it continues `skip_batches` past
    `next_batch`, the first batch it has not consumed (the rejected attempts already consumed
    the bad ones). With `batch_index = step + data_offset` that fixes the new offset.

    Args:
      from_step: the state's step when the rollback was decided.
      next_batch: `batch_index` of that state.
      to_step: the step of the state being restored.
      skip_batches: `guard.skip_batches`.
      reason: for the log.

    Returns:
      The Rollback record.
    """
    if to_step > from_step:
        raise ValueError(f"rollback to step {to_step} is ahead of step {from_step}")
    resume = next_batch + skip_batches
    return Rollback(from_step, to_step, resume, resume - to_step, from_step - to_step, reason)


# A run that keeps rolling back without getting past the step it last rolled back from is
# not recovering; after this many such rollbacks in a row the loop stops with an error.
MAX_ROLLBACKS_WITHOUT_PROGRESS = 3


class RollbackStreak(NamedTuple):
    furthest: int = -1  # the furthest step any rollback of this run started from
    stalled: int = 0  # rollbacks in a row that did not start past the previous furthest


def note_rollback(streak: RollbackStreak, from_step: int) -> RollbackStreak:
    """The streak after a rollback from `from_step`; see MAX_ROLLBACKS_WITHOUT_PROGRESS.

    Two faults at different steps each roll back once and count as progress; the same spot
    failing again and again does not.
    """
    if from_step > streak.furthest:
        return RollbackStreak(from_step, 1)
    return RollbackStreak(streak.furthest, streak.stalled + 1)


def apply_rollback(restored: LoopState, rollback: Rollback, version: int, rollbacks: int,
                   shardings: LoopState) -> LoopState:
    """The state to continue from: `restored` with the new data position, version and count.

    Args:
      restored: the checkpointed (or initial) loop state, in the runtime layout.
      rollback: from `plan_rollback`.
      version: the new version; callers pass one above every version used so far, so no
        later save can be mistaken for an earlier timeline's.
      rollbacks: the new rollback count.
      shardings: the loop state's shardings.

    Returns:
      The new LoopState; the guard keeps its window, its bad streak is cleared.
    """

    def update(loop, data_offset, version, rollbacks):
        train = loop.train._replace(data_offset=data_offset, version=version)
        guard = loop.guard._replace(consecutive_bad=jnp.zeros_like(loop.guard.consecutive_bad))
        return LoopState(train, guard, rollbacks)

    return jax.jit(update, out_shardings=shardings, donate_argnums=(0,))(
        restored, np.int32(rollback.data_offset), np.int32(version), np.int32(rollbacks))
