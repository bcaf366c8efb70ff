"""The slow axis's modes behind one interface, chosen once from the plan (`of(plan)`).

`plan.slow_mode` names how gradients cross dcn; each mode is a `SlowAxis`: what it keeps in
`TrainState.slow` (init, shardings), what the optimizer state looks like (one per dcn group
for the local modes), and how it builds the train step.

* "none" / "sync" (`SYNC`): the gradient is reduced over dcn inside the step; nothing is kept.
* "delay" (`DELAY`, `delay.py`): the shared step with an `Exchange` that applies the previous
  step's gradient, summed over dcn, and puts this step's in flight.
* "local", `overlap.dcn_delay_mode: local` (`LOCAL_DELAY`, `local_delay.py`): each group steps
  on its own gradient; the mean of the updates lands one step late.
* "local", DiLoCo (`DILOCO`, `diloco.py`): each group trains its own parameters; fragments of
  the outer gradient cross dcn.

The synchronous-shaped step (sync and delay) lives in `training/step.py`; it reaches the
strategy as `StepParts.synchronous(exchange)`, so this floor never imports the one above.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, NamedTuple

import optax

from jax_overlap.overlap import delay, diloco, local_delay


class Exchange(NamedTuple):
    """How a synchronous-shaped step's gradient crosses dcn.

    Attributes:
      receive: `(state, grads) -> (grads to apply, token)`, after the step's own gradient
        (and its norm) is known.
      commit: `(state, token, fresh, updates, params, opt_state) -> (params, opt_state, slow,
        metrics)`, after the optimizer update: the state's new values, its new `slow` and the
        mode's extra metrics.
    """

    receive: Callable
    commit: Callable


class StepParts(NamedTuple):
    """What every mode's step is built from (`training.step.make_train_step`).

    Attributes:
      loss_and_grads: `(params, batch) -> (loss, grads)` (global arrays).
      shardings: the `TrainState` shardings (`state_shardings`).
      lr, fault_hook, jit: as `make_train_step`'s arguments.
      grad_specs: specs of the gradients `loss_and_grads` returns.
      synchronous: `exchange -> step`, the shared step around an `Exchange`.
    """

    model: Any
    plan: Any
    mesh: Any
    optimizer: optax.GradientTransformation
    loss_and_grads: Callable
    shardings: Any
    lr: Callable | None
    fault_hook: Callable | None
    jit: bool
    grad_specs: Any
    synchronous: Callable[[Exchange], Callable]


class SlowAxis(NamedTuple):
    """One slow-axis mode.

    Attributes:
      mode: `plan.slow_mode`'s value(s) it serves ("sync", "delay", "local").
      make_train_step: `StepParts -> step(state, batch) -> (state, metrics)`.
      init: `(plan, params, optimizer) -> TrainState.slow` for the initial (staged) params.
      shardings: `(plan, mesh, optimizer, abstract_params, param_sh, grad_specs) ->` the
        shardings of `TrainState.slow`.
      init_opt: `(plan, params, optimizer) ->` the initial optimizer state.
      opt_shardings: `(mesh, optimizer, abstract_params, grad_sh, default) ->` the optimizer
        state's shardings (`default`: those of one optimizer state laid out like the grads).
    """

    mode: str
    make_train_step: Callable
    init: Callable
    shardings: Callable
    init_opt: Callable
    opt_shardings: Callable


# ---------------------------------------------------------------------------- shared pieces


def _nothing(*_args) -> None:
    return None


def _one_opt_init(plan, params, optimizer) -> Any:
    del plan
    return optimizer.init(params)


def _one_opt_shardings(mesh, optimizer, abstract_params, grad_sh, default) -> Any:
    del mesh, optimizer, abstract_params, grad_sh
    return default


def _per_group_opt_init(plan, params, optimizer) -> Any:
    return diloco.init_opt(plan, params, optimizer)


def _per_group_opt_shardings(mesh, optimizer, abstract_params, grad_sh, default) -> Any:
    del default
    return diloco.opt_shardings(mesh, optimizer, abstract_params, grad_sh)


# ------------------------------------------------------------------------------------- sync


def _sync_receive(state, grads):
    del state
    return grads, None


def _sync_commit(state, token, fresh, updates, params, opt_state):
    del token, fresh, updates
    return params, opt_state, state.slow, {}


SYNC_EXCHANGE = Exchange(_sync_receive, _sync_commit)

SYNC = SlowAxis("sync", lambda parts: parts.synchronous(SYNC_EXCHANGE), _nothing, _nothing,
                _one_opt_init, _one_opt_shardings)


# ------------------------------------------------------------------------------------ delay


def _delay_step(parts: StepParts) -> Callable:
    ov = parts.plan.overlap
    receive = partial(delay.receive, mesh=parts.mesh, grad_specs=parts.grad_specs,
                      comm_dtype=ov.dcn_comm_dtype, compensation=ov.dcn_delay_compensation)
    return parts.synchronous(Exchange(receive, delay.commit))


def _delay_init(plan, params, optimizer) -> delay.InFlight:
    del optimizer
    # Gradients have the parameters' global shapes (ZeRO-1 only shards them otherwise).
    return delay.init(params, plan.dcn,
                      params if plan.overlap.dcn_delay_compensation > 0 else None)


def _delay_shardings(plan, mesh, optimizer, abstract_params, param_sh, grad_specs):
    del optimizer, abstract_params
    return delay.shardings(mesh, grad_specs, param_sh, plan.overlap.dcn_delay_compensation > 0)


DELAY = SlowAxis("delay", _delay_step, _delay_init, _delay_shardings, _one_opt_init,
                 _one_opt_shardings)


# ------------------------------------------------------------------------ local (one late)


def _local_delay_step(parts: StepParts) -> Callable:
    return local_delay.make_train_step(parts.plan, parts.mesh, parts.optimizer,
                                       parts.loss_and_grads, parts.shardings, parts.lr,
                                       parts.fault_hook, parts.jit)


def _local_delay_init(plan, params, optimizer) -> delay.InFlight:
    del optimizer
    return local_delay.init(plan, params)


def _local_delay_shardings(plan, mesh, optimizer, abstract_params, param_sh, grad_specs):
    del plan, optimizer, abstract_params, grad_specs
    return local_delay.shardings(mesh, param_sh)


LOCAL_DELAY = SlowAxis("local", _local_delay_step, _local_delay_init, _local_delay_shardings,
                       _per_group_opt_init, _per_group_opt_shardings)


# ----------------------------------------------------------------------------------- DiLoCo


def _diloco_step(parts: StepParts) -> Callable:
    return diloco.make_train_step(parts.model, parts.plan, parts.mesh, parts.optimizer,
                                  parts.loss_and_grads, parts.shardings, parts.lr,
                                  parts.fault_hook, parts.jit)


def _diloco_shardings(plan, mesh, optimizer, abstract_params, param_sh, grad_specs):
    del grad_specs
    return diloco.shardings(plan, mesh, optimizer, abstract_params, param_sh)


DILOCO = SlowAxis("local", _diloco_step, diloco.init, _diloco_shardings, _per_group_opt_init,
                  _per_group_opt_shardings)


def of(plan) -> SlowAxis:
    """The strategy of `plan.slow_mode` (SYNC for no plan, no dcn axis, or "sync")."""
    mode = "none" if plan is None else plan.slow_mode
    if mode == "local":
        return LOCAL_DELAY if plan.diloco is None else DILOCO
    return DELAY if mode == "delay" else SYNC

