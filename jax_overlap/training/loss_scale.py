"""Dynamic loss scaling for fp16 compute (`train.precision: fp16`).

fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero. The loss is multiplied by a
scale S before the backward, so every fp16 cotangent is S times larger, and the fp32
gradients are divided by S afterwards. S adapts: halved (and the step skipped) when any
gradient overflows to inf/NaN, doubled after `growth_interval` clean steps in a row.

The scaling enters the step without touching the gradient code: `ScaledLoss` wraps the model
so that its loss count (the mean's divisor) is divided by S, and both the pp = 1 step and the
pipeline executor divide every partial loss by the global count, so their backward seeds are
S / count instead of 1 / count. The scale is part of the `TrainState` (checkpointed, restored
on resume). optax has no loss scaling and jmp is unmaintained, hence this small module.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class LossScale(NamedTuple):
    scale: jax.Array  # fp32 scalar: the current loss scale S
    good_steps: jax.Array  # int32 scalar: clean steps since the last change of S
    overflows: jax.Array  # int32 scalar: steps skipped for overflow over the run


def initial(train_cfg) -> LossScale | None:
    """The starting loss-scale state for `train.precision: fp16`; None for bf16 / fp32."""
    if train_cfg.precision != "fp16":
        return None
    return LossScale(jnp.asarray(train_cfg.loss_scale_init, jnp.float32),
                     jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))


def all_finite(*trees: Any) -> jax.Array:
    """True when every element of every leaf is finite (a bool scalar)."""
    leaves = [leaf for tree in trees for leaf in jax.tree.leaves(tree)]
    return jnp.stack([jnp.isfinite(x).all() for x in leaves]).all()


def unscale(loss: jax.Array, grads: Any, scale: jax.Array) -> tuple[jax.Array, Any]:
    """Loss and gradients of the scaled loss, divided back by S (in fp32)."""
    inv = (1.0 / scale).astype(jnp.float32)
    return loss * inv, jax.tree.map(lambda g: g * inv.astype(g.dtype), grads)


def update(state: LossScale, finite: jax.Array, growth_interval: int,
           min_scale: float = 1.0) -> LossScale:
    """The next state: x2 after `growth_interval` clean steps, /2 on overflow (>= min_scale)."""
    good = jnp.where(finite, state.good_steps + 1, 0)
    grow = finite & (good >= growth_interval)
    scale = jnp.where(finite, jnp.where(grow, state.scale * 2.0, state.scale),
                      jnp.maximum(state.scale * 0.5, min_scale))
    return LossScale(scale.astype(jnp.float32), jnp.where(grow, 0, good).astype(jnp.int32),
                     state.overflows + jnp.where(finite, 0, 1).astype(jnp.int32))


class ScaledLoss:
    """A StagedModel whose loss is S times the wrapped model's (see the module docstring).

    Every other member is the wrapped model's, so plans, layouts and the executor see the
    same model. Built inside the traced step, around the state's (traced) scale.
    """

    def __init__(self, model: Any, scale: jax.Array):
        self._model = model
        self._scale = scale

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def loss_count(self, targets: jax.Array) -> jax.Array:
        return self._model.loss_count(targets) / self._scale
