"""One step late, own update first (`overlap.dcn_delay: 1`, `overlap.dcn_delay_mode: local`).

The plain delayed reduction (`delay.py`) applies every step's gradient one step late to the
shared parameters. With Adam near its edge of stability that is expensive: in a linear
model of one sharp direction, the EMA momentum (b1 = 0.9) stays stable up to a step 38x
larger with a fresh gradient than with one a step old (docs/guides/slow_links.md). Here the fresh
part of the gradient -- the dcn group's own, reduced exactly over the fast axes -- is applied
at once, and only what crosses dcn is late:

    theta^k_t     = theta_t + u^k_{t-1}                    group k's parameters
    u^k_t         = optimizer(g^k(theta^k_t))              its own update, its own state
    theta_{t+1}   = theta_t + mean_j u^j_{t-1}             the shared parameters

so every group steps from its fresh gradient, and one step later its own update is replaced
by the mean of all groups' (the sum over steps is the same for every group). The groups'
parameters differ by their last own update only (for AdamW: about lr per element), never
more. `theta` (`TrainState.params`) is the same on every group: what is checkpointed,
evaluated and exported. The in-flight `u^k` (an `delay.InFlight`, leading dcn dim) carries
the version it may be applied at, as in `delay.py`: an update of another timeline (after a
rollback, or at a fresh start) is dropped, and the groups start again from `theta`.

What crosses dcn is the update (parameter-shaped, 1/dp per device, hierarchically), issued
from the state at the start of the step with no dependency on its compute. Each group keeps
its own optimizer state (leading dcn dim, as DiLoCo's inner state).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_overlap.overlap import delay, slow_axis


def _is_spec(x) -> bool:
    return isinstance(x, P)


def init(plan, params) -> delay.InFlight:
    """Nothing in flight: zero updates, version -1."""
    return delay.init(params, plan.dcn)


def shardings(mesh, param_sh: Any) -> delay.InFlight:
    ups = jax.tree.map(lambda s: NamedSharding(mesh, slow_axis.stacked_spec(s.spec)), param_sh)
    return delay.InFlight(ups, NamedSharding(mesh, P()), None)


def make_train_step(plan, mesh, optimizer, loss_and_grads, shardings, lr, fault_hook,
                    jit: bool) -> Callable:
    """The step (same contract as `step.make_train_step`'s). `loss_and_grads` takes the
    groups' parameters (leading dcn dim) and returns each group's gradient (leading dcn
    dim), summed over the fast axes and scaled to the global batch; it is rescaled here by
    dcn to the group's own mean gradient (so clipping sees one group's gradient, as a
    synchronous step sees the global one). Metrics add `dcn_applied`."""
    specs = plan.layout.param_specs
    dcn = plan.dcn
    dtype = plan.overlap.dcn_comm_dtype

    def step(state, batch):
        inflight: delay.InFlight = state.slow
        valid = inflight.version == state.version
        # The cross-dcn part: from the state only, so XLA may run it under the compute.
        mean = jax.tree.map(lambda s: s / dcn,
                            slow_axis.dcn_sum(inflight.grads, mesh, specs, dtype))
        own = delay.select(valid, inflight.grads, jax.tree.map(jnp.zeros_like, inflight.grads))
        local = jax.tree.map(lambda p, u: p[None].astype(u.dtype) + u, state.params, own)
        local = jax.tree.map(lambda x, p: x.astype(p.dtype), local, state.params)
        local = jax.lax.with_sharding_constraint(local, shardings.slow.grads)
        loss, grads = loss_and_grads(local, batch)  # (dcn, ...) per group
        grads = jax.tree.map(lambda g: g * dcn, grads)
        if fault_hook is not None:
            loss, grads = fault_hook(state, loss, grads)
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32)))
                                 for g in jax.tree.leaves(grads)) / dcn)
        updates, opt_state = jax.vmap(optimizer.update)(grads, state.opt_state, local)
        params = jax.tree.map(lambda p, m: jnp.where(valid, p + m.astype(p.dtype), p),
                              state.params, mean)
        params = jax.lax.with_sharding_constraint(params, shardings.params)
        opt_state = jax.lax.with_sharding_constraint(opt_state, shardings.opt_state)
        slow = jax.lax.with_sharding_constraint(
            delay.launch(updates, state.version + 1), shardings.slow)
        new_state = state._replace(step=state.step + 1, params=params, opt_state=opt_state,
                                   version=state.version + 1, slow=slow)
        metrics = {"loss": loss, "grad_norm": grad_norm, "dcn_applied": valid}
        if lr is not None:
            metrics["lr"] = lr(state.step)
        return new_state, metrics

    return jax.jit(step, donate_argnums=(0,)) if jit else step
