"""What the training loop carries and checkpoints: `LoopState`, its shardings, its initial value.

`LoopState` = the `TrainState`, the step guard's `GuardState` and the number of rollbacks in
the run's history. It is also what a checkpoint holds, so a resumed run makes the same
accept/reject decisions, uses the same learning-rate scale and replays the same injected faults
as a run that was never interrupted (the guard's loss window is a few floats; rebuilding it
empty instead would switch spike detection off for `window // 2` steps after every restart and
make resumed runs diverge from uninterrupted ones whenever a spike is near).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_overlap.training.guard import GuardState, guard_init
from jax_overlap.training import loss_scale as loss_scale_lib
from jax_overlap.training import step as steplib
from jax_overlap.training.state import TrainState


class LoopState(NamedTuple):
    """The train state plus everything else a bit-exact resume needs.

    `step` and `version` forward to the train state, which is what `Checkpointer` keys on.
    """

    train: TrainState
    guard: GuardState
    rollbacks: jax.Array  # int32 scalar: rollbacks in this run's history

    @property
    def step(self) -> jax.Array:
        return self.train.step

    @property
    def version(self) -> jax.Array:
        return self.train.version


def _replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def loop_shardings(model, cfg, plan, mesh, optimizer) -> LoopState:
    """NamedSharding of every leaf of the `LoopState` on `mesh` (extras are replicated).

    Args:
      model, plan, mesh, optimizer: as for `step.init_state`; cfg: the run's config.

    Returns:
      A LoopState of shardings.
    """
    abstract_params = jax.eval_shape(model.init, jax.random.key(cfg.train.seed))
    train = steplib.state_shardings(model, mesh, optimizer, abstract_params, plan.layout, plan,
                                    loss_scaled=cfg.train.precision == "fp16")
    rep = _replicated(mesh)
    guard = GuardState(losses=rep, count=rep, consecutive_bad=rep)
    return LoopState(train=train, guard=guard, rollbacks=rep)


def abstract_loop_state(model, cfg, plan, mesh, optimizer) -> LoopState:
    """ShapeDtypeStructs with the current mesh's shardings: the target a checkpoint restores to.

    Shapes come from tracing `init_state` (so they follow whatever layout it builds) and
    shardings from `loop_shardings`; nothing is allocated.
    """
    train = jax.eval_shape(lambda: steplib.init_state(model, plan, mesh, optimizer,
                                                      cfg.train.seed,
                                                      loss_scale_lib.initial(cfg.train)))
    shapes = LoopState(train=train, guard=jax.eval_shape(lambda: guard_init(cfg.guard.window)),
                       rollbacks=jax.ShapeDtypeStruct((), jnp.int32))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, loop_shardings(model, cfg, plan, mesh, optimizer))


def shardings_of(abstract: Any) -> Any:
    return jax.tree.map(lambda a: a.sharding, abstract)


def make_initializer(model, cfg, plan, mesh, optimizer) -> Callable[[], LoopState]:
    """`() -> LoopState`: the run's initial state, compiled once however often it is called.

    `init_state` plus an empty guard and no rollbacks, built directly in its sharded layout.
    A rollback with no checkpoint to go back to calls it again, hence the single compile.
    """
    def build():
        train = steplib.init_state(model, plan, mesh, optimizer, cfg.train.seed,
                                   loss_scale_lib.initial(cfg.train))
        return LoopState(train, guard_init(cfg.guard.window), jnp.zeros((), jnp.int32))

    return jax.jit(build, out_shardings=loop_shardings(model, cfg, plan, mesh, optimizer))


def init_loop_state(model, cfg, plan, mesh, optimizer) -> LoopState:
    """The run's initial state (see `make_initializer`)."""
    return make_initializer(model, cfg, plan, mesh, optimizer)()


def lr_scale(guard_cfg, rollbacks: int) -> float:
    """The learning-rate factor after `rollbacks` rollbacks (compounding)."""
    return float(guard_cfg.lr_scale_on_rollback) ** int(rollbacks)
