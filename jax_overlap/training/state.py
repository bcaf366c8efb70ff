"""The train state: everything a resume needs, as one pytree.

Data position and RNG are pure functions of the state (`batch_index`, `step_rng`), so
restoring a state continues the exact same stream of batches and random numbers.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: optimizer updates applied so far
    params: Any  # parameter pytree in the logical (un-staged) layout
    opt_state: Any  # optax state, same layout as params
    rng: jax.Array  # uint32[2] base key; per-step keys are folded from it
    data_offset: jax.Array  # int32 scalar: batches skipped by rollbacks
    version: jax.Array  # int32 scalar: bumped on every accepted update and every rollback
    # fp16 only: the dynamic loss scale (`training.loss_scale.LossScale`); None otherwise.
    loss_scale: Any = None
    # What the slow axis carries between steps (overlap.delay.InFlight, overlap.diloco
    # OuterState), None without one.
    slow: Any = None


def batch_index(state: TrainState) -> jax.Array:
    """Which batch of the data stream the next step consumes."""
    return state.step + state.data_offset


def step_rng(state: TrainState) -> jax.Array:
    """The RNG key for the next step: a pure function of the base key and the step."""
    return jax.random.fold_in(state.rng, state.step)


def new_state(params: Any, opt_state: Any, seed: int, loss_scale: Any = None,
              slow: Any = None) -> TrainState:
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=opt_state,
        rng=jax.random.key_data(jax.random.key(seed)).astype(jnp.uint32),
        data_offset=jnp.zeros((), jnp.int32),
        version=jnp.zeros((), jnp.int32),
        loss_scale=loss_scale,
        slow=slow,
    )
