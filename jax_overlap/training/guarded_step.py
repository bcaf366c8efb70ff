"""The guarded train step: the train step plus the step guard and fault injection.

One call of `make_guarded_step`'s step consumes exactly one batch, accepted or not:

* accepted: `step` and `version` +1, params and optimizer state updated, the loss enters the
  guard's window;
* rejected (non-finite loss or gradients, or a loss spike): params, optimizer state (moments and
  Adam's count, hence the LR schedule), `step` and `version` are untouched; `data_offset` +1, so
  the next attempt at the same step reads the next batch; `guard.consecutive_bad` +1.

So `step` always counts applied updates (`train.steps` is the number of updates a run applies)
and `batch_index = step + data_offset` counts batches consumed.

Accept/reject is computed in-graph from replicated values, so every process of a multi-process
run takes the same decision without exchanging anything.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_overlap.training.faults import make_fault_hook, planned_faults
from jax_overlap.training.guard import guard_update, select_tree
from jax_overlap.training.loop_state import LoopState
from jax_overlap.training import step as steplib
from jax_overlap.training.state import batch_index


def make_guarded_step(model, cfg, plan, mesh, optimizer) -> Callable:
    """`step(loop, batch) -> (loop, metrics)`: the train step with guards and fault injection.

    See the module docstring for what accepted and rejected steps do (an fp16 overflow is
    rejected with `overflow` set and the guard untouched). Metrics are the train
    step's plus `accepted` (bool), `consecutive_bad`, and the new state's `step`, `next_batch`
    (= `batch_index`) and `version`, so the host needs no other transfer.

    Args:
      model, plan, mesh: as for `make_train_step`; cfg: the run's config (guard, faults,
        learning-rate schedule).
      optimizer: the optimizer to step with (rebuilt with another LR scale after rollbacks).

    Returns:
      The jitted step; the loop state is donated.
    """
    faults = planned_faults(cfg.fault)
    g = cfg.guard

    def guarded(loop: LoopState, batch):
        # The hook closes over this trace's rollback count, so it is built per trace.
        hook = make_fault_hook(faults, loop.rollbacks)
        inner = steplib.make_train_step(
            model, plan, mesh, optimizer, lr=steplib.lr_schedule(cfg.train), fault_hook=hook,
            jit=False, loss_scale_growth_interval=cfg.train.loss_scale_growth_interval)
        updated, metrics = inner(loop.train, batch)
        # fp16: an overflow step is skipped (its batch consumed) and halves the loss scale,
        # but is no fault: the guard neither counts it nor sees its loss.
        overflow = metrics.get("overflow", jnp.zeros((), bool))
        if g.enabled:
            ok, guard = guard_update(loop.guard, metrics["loss"], metrics["grad_norm"],
                                     g.spike_sigma)
            guard = select_tree(~overflow, guard, loop.guard)
        else:
            ok, guard = jnp.ones((), bool), loop.guard
        ok = ok & ~overflow
        rejected = loop.train._replace(data_offset=loop.train.data_offset + 1,
                                       loss_scale=updated.loss_scale)
        train = select_tree(ok, updated, rejected)
        out = {**metrics, "accepted": ok, "consecutive_bad": guard.consecutive_bad,
               "step": train.step, "next_batch": batch_index(train), "version": train.version}
        return loop._replace(train=train, guard=guard), out

    return jax.jit(guarded, donate_argnums=(0,),
                   compiler_options=plan.compiler_options() or None)


def rejection_reason(loss: float, grad_norm: float) -> str:
    """Why the guard rejected a step, from its host-side metrics."""
    return "non_finite" if not (np.isfinite(loss) and np.isfinite(grad_norm)) else "spike"
