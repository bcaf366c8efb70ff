"""Bounded staleness over the slow axis: the cross-dcn reduction one step late
(`overlap.dcn_delay: 1`).

Step t computes its gradient reduced over the fast axes only (one copy per dcn group, a
leading dcn dim; `slow_axis.wrap_step`) and leaves it *in flight* in the train state. Step
t + 1 sums the in-flight copies over dcn (`slow_axis.dcn_sum`): nothing in that psum depends
on step t + 1's forward or backward, so XLA is free to run it beside them. The sum is
applied as step t + 1's update, and step t + 1's own gradient takes its place in flight.

Two-phase commit: the in-flight gradient carries the version of the state it was meant for
(`InFlight.version`: the state's version after the step that computed it). The update
applies it only when the state's version still matches; any other timeline -- a rollback
bumps the version past every version used, a fresh start has version -1 in flight -- drops
it and applies nothing for that step. A rejected step (guard) keeps the in-flight gradient
and the version, so the retry applies it.

Delay compensation (`overlap.dcn_delay_compensation`, lambda; DC-ASGD, Zheng et al. 2017):
the late gradient g was taken at the parameters before the previous update u; its
first-order correction to the current parameters is g + lambda * g * g * u (the diagonal
of g g^T approximating the Hessian). u is kept in the state too (0: not kept).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_overlap.overlap import slow_axis


class InFlight(NamedTuple):
    """The gradient crossing dcn, as part of the train state.

    Attributes:
      grads: the fast-reduced gradient, one copy per dcn group (leading dcn dim).
      version: int32, the state version it may be applied at; -1: none in flight.
      last_update: with delay compensation, the update applied by the previous step
        (parameter layout); else None.
    """

    grads: Any
    version: jax.Array
    last_update: Any = None


def init(abstract_grads: Any, dcn: int, abstract_params: Any = None) -> InFlight:
    """Nothing in flight: zeros, version -1 (so the first step applies no update)."""
    grads = jax.tree.map(lambda a: jnp.zeros((dcn, *a.shape), jnp.float32), abstract_grads)
    update = (None if abstract_params is None
              else jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract_params))
    return InFlight(grads, jnp.full((), -1, jnp.int32), update)


def shardings(mesh, grad_specs: Any, param_shardings: Any, compensated: bool) -> InFlight:
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    grads = jax.tree.map(lambda s: NamedSharding(mesh, slow_axis.stacked_spec(s)), grad_specs,
                         is_leaf=is_spec)
    return InFlight(grads, NamedSharding(mesh, P()), param_shardings if compensated else None)


def arrived(inflight: InFlight, version: jax.Array, mesh, grad_specs: Any,
            comm_dtype: str = "fp32", compensation: float = 0.0) -> tuple[Any, jax.Array]:
    """The in-flight gradient summed over dcn, and whether this state may apply it.

    Args:
      inflight: the state's `InFlight`.
      version: the state's version.
      mesh, grad_specs: the mesh and the gradients' specs (without the dcn dim).
      comm_dtype: what crosses dcn.
      compensation: DC-ASGD lambda (0: the gradient as it is).

    Returns:
      (gradient tree, valid): valid is False for a gradient of another timeline.
    """
    summed = slow_axis.dcn_sum(inflight.grads, mesh, grad_specs, comm_dtype)
    if compensation and inflight.last_update is not None:
        summed = jax.tree.map(lambda g, u: g + compensation * g * g * u.astype(g.dtype),
                              summed, inflight.last_update)
    return summed, inflight.version == version


def select(valid: jax.Array, new: Any, old: Any) -> Any:
    """`new` where the in-flight gradient was applied, else `old` (leaf by leaf)."""
    return jax.tree.map(lambda a, b: jnp.where(valid, a, b), new, old)


def launch(fresh: Any, next_version: jax.Array, update: Any = None) -> InFlight:
    """The step's own fast-reduced gradient, put in flight for the state `next_version`."""
    return InFlight(jax.tree.map(lambda g: g.astype(jnp.float32), fresh),
                    next_version.astype(jnp.int32), update)


# ------------------------------------------------- the exchange of the shared step (strategy)


def receive(state, grads, *, mesh, grad_specs, comm_dtype: str = "fp32",
            compensation: float = 0.0) -> tuple[Any, jax.Array]:
    """`Exchange.receive`: the in-flight gradient (summed over dcn) replaces the step's own
    `grads`, which `commit` puts in flight; the token is whether it may be applied."""
    del grads
    return arrived(state.slow, state.version, mesh, grad_specs, comm_dtype, compensation)


def commit(state, valid, fresh, updates, params, opt_state):
    """`Exchange.commit`: a gradient of another timeline is dropped (no update this step);
    the step's own gradient `fresh` goes in flight. Metrics add `dcn_applied`."""
    params = select(valid, params, state.params)
    opt_state = select(valid, opt_state, state.opt_state)
    last = None
    if state.slow.last_update is not None:
        last = select(valid, updates, jax.tree.map(jnp.zeros_like, updates))
    return params, opt_state, launch(fresh, state.version + 1, last), {"dcn_applied": valid}
