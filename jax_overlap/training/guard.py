"""Step guards: reject updates whose loss or gradients are non-finite or spike.

In-graph part, optax-style: `guard_init` makes a `GuardState`, `guard_update` decides
whether this step's update may be applied and advances the state. When it may not,
the step applies nothing (`select_tree(ok, new, old)` keeps params and optimizer moments
as they were) and only `consecutive_bad` moves. Host part: `RollbackPolicy` says when
skipping is no longer enough and the run should go back to the last good checkpoint.

A spike is `loss > mean + spike_sigma * std` over the last `window` *accepted* losses
(rejected ones never enter the window, so one spike cannot raise the bar for the next).
It is only judged once `min_history` losses are in the window, and `std` is floored at
`min_std_frac * |mean|` so that a near-constant loss does not turn noise into "spikes".
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp


class GuardState(NamedTuple):
    losses: jax.Array  # f32[window]: ring buffer of accepted losses
    count: jax.Array  # int32: accepted losses so far (next write goes to count % window)
    consecutive_bad: jax.Array  # int32: rejected steps since the last accepted one


def guard_init(window: int) -> GuardState:
    """An empty guard remembering the last `window` accepted losses.

    Args:
      window: ring-buffer length, >= 2.

    Returns:
      GuardState with nothing accepted yet.
    """
    if window < 2:
        raise ValueError(f"window must be >= 2, got {window}")
    return GuardState(
        losses=jnp.zeros((window,), jnp.float32),
        count=jnp.zeros((), jnp.int32),
        consecutive_bad=jnp.zeros((), jnp.int32),
    )


def loss_spike(
    state: GuardState,
    loss: jax.Array,
    spike_sigma: float,
    min_history: Optional[int] = None,
    min_std_frac: float = 0.01,
) -> jax.Array:
    """Whether `loss` is a spike relative to the accepted-loss window (bool scalar).

    Args:
      state: the guard state holding the window.
      loss: this step's loss.
      spike_sigma: how many standard deviations above the mean counts as a spike.
      min_history: accepted losses needed before spikes are judged; default window // 2.
      min_std_frac: floor on std as a fraction of |mean|.

    Returns:
      bool scalar; False while the window holds fewer than `min_history` losses.
    """
    window = state.losses.shape[0]
    need = max(2, window // 2) if min_history is None else min(max(2, min_history), window)
    n = jnp.minimum(state.count, window)
    valid = jnp.arange(window) < n  # ring slots written so far (all once full)
    nf = jnp.maximum(n, 1).astype(jnp.float32)
    mean = jnp.sum(jnp.where(valid, state.losses, 0.0)) / nf
    var = jnp.sum(jnp.where(valid, (state.losses - mean) ** 2, 0.0)) / nf
    std = jnp.maximum(jnp.sqrt(var), min_std_frac * jnp.abs(mean))
    return (n >= need) & (loss.astype(jnp.float32) > mean + spike_sigma * std)


def guard_update(
    state: GuardState,
    loss: jax.Array,
    grad_norm: Optional[jax.Array],
    spike_sigma: float = 6.0,
    min_history: Optional[int] = None,
    min_std_frac: float = 0.01,
) -> tuple[jax.Array, GuardState]:
    """Judge one step; jit-compatible, no host sync.

    Args:
      state: current guard state.
      loss: scalar loss of the step.
      grad_norm: global gradient norm (None to check the loss only). A NaN/inf anywhere
        in the gradients makes the norm non-finite, so one scalar covers every gradient.
      spike_sigma, min_history, min_std_frac: see `loss_spike`.

    Returns:
      (ok, new_state): ok is a bool scalar, True when the update may be applied. An
      accepted loss enters the window and resets `consecutive_bad`; a rejected one
      only increments `consecutive_bad`.
    """
    loss = jnp.asarray(loss, jnp.float32)
    finite = jnp.isfinite(loss)
    if grad_norm is not None:
        finite = finite & jnp.isfinite(jnp.asarray(grad_norm, jnp.float32))
    ok = finite & ~loss_spike(state, loss, spike_sigma, min_history, min_std_frac)
    window = state.losses.shape[0]
    pushed = state.losses.at[state.count % window].set(loss)
    new_state = GuardState(
        losses=jnp.where(ok, pushed, state.losses),
        count=state.count + ok.astype(jnp.int32),
        consecutive_bad=jnp.where(ok, 0, state.consecutive_bad + 1).astype(jnp.int32),
    )
    return ok, new_state


def select_tree(ok: jax.Array, new: Any, old: Any) -> Any:
    """Leaf-wise `new if ok else old`, for params and optimizer state alike.

    Used so a rejected step leaves parameters *and* optimizer moments/counters untouched
    (a skipped step must not advance Adam's bias correction either).

    Args:
      ok: bool scalar.
      new, old: pytrees of the same structure.

    Returns:
      The selected pytree.
    """
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


@dataclasses.dataclass(frozen=True)
class RollbackPolicy:
    """When and how to roll back after repeated rejected steps (host side).

    Args:
      max_skips: consecutive rejected steps tolerated; one more triggers a rollback.
      skip_batches: batches to skip after restoring, to step over the bad data.
      lr_scale: factor applied to the learning rate after a rollback.
    """

    max_skips: int = 3
    skip_batches: int = 1
    lr_scale: float = 1.0

    def __post_init__(self):
        if self.max_skips < 0 or self.skip_batches < 0 or self.lr_scale <= 0:
            raise ValueError(f"invalid RollbackPolicy {self}")

    def should_roll_back(self, consecutive_bad: Any) -> bool:
        """True once more than `max_skips` steps in a row were rejected."""
        return int(consecutive_bad) > self.max_skips
