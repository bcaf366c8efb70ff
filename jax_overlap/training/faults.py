"""Fault injection: NaN and loss-spike faults at chosen steps, for drills and tests.

`fault.nan_at_step=k` / `fault.spike_at_step=j` make every attempt at that step produce a NaN
loss and gradients / a loss and gradients `SPIKE_FACTOR` times too large, until the run has
rolled back once per fault up to and including this one. Each fault therefore forces exactly
one rollback (with guards on), and the plan is a pure function of the state, so a killed and
resumed drill replays it exactly.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from jax_overlap.training.state import TrainState

NAN, SPIKE = "nan", "spike"
SPIKE_FACTOR = 100.0  # far above any plausible spike_sigma threshold of a healthy window


class Fault(NamedTuple):
    step: int
    kind: str  # NAN or SPIKE


def planned_faults(fault_cfg) -> tuple[Fault, ...]:
    """The faults a `FaultConfig` asks for, in step order (ties: NaN first)."""
    faults = [Fault(fault_cfg.nan_at_step, NAN), Fault(fault_cfg.spike_at_step, SPIKE)]
    return tuple(sorted((f for f in faults if f.step >= 0), key=lambda f: (f.step, f.kind)))


def make_fault_hook(faults: tuple[Fault, ...], rollbacks: jax.Array) -> Optional[Callable]:
    """A `fault_hook` for `make_train_step` that plays `faults`, or None when there are none.

    Fault i (in step order) is live at its step while `rollbacks <= i`, i.e. until the run has
    rolled back past it. Without faults the step is compiled without a hook at all; with them,
    a step with no live fault multiplies by exactly 1, so values are unchanged bit for bit.

    Args:
      faults: from `planned_faults`.
      rollbacks: the (traced) rollback count of the state being stepped.

    Returns:
      `(state, loss, grads) -> (loss, grads)`, or None.
    """
    if not faults:
        return None

    def hook(state: TrainState, loss, grads):
        nan = jnp.zeros((), bool)
        spike = jnp.zeros((), bool)
        for i, fault in enumerate(faults):
            live = (state.step == fault.step) & (rollbacks <= i)
            if fault.kind == NAN:
                nan = nan | live
            else:
                spike = spike | live
        factor = jnp.where(spike, SPIKE_FACTOR, 1.0).astype(jnp.float32)
        loss = jnp.where(nan, jnp.nan, loss * factor.astype(loss.dtype))
        grads = jax.tree.map(
            lambda g: jnp.where(nan, jnp.asarray(jnp.nan, g.dtype), g * factor.astype(g.dtype)),
            grads)
        return loss, grads

    return hook
