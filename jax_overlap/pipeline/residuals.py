"""What an F keeps for its backward: a `jax.vjp`'s residuals, stashed in slots and rebuilt.

`jax.vjp(f, *args)` returns a pullback that is a pytree (`jax.tree_util.Partial`) whose leaves
are the residuals the backward needs -- under a `jax.checkpoint` policy, exactly what the
policy saves -- and whose structure is static. The executor's F runs the vjp and files the
residual leaves into per-stage slot pools; its B and W rebuild the pullback from the slots and
call it, so the backward runs without re-running the forward (unless the remat policy asks).

Residuals that the backward can be handed again (the chunk's weights, which do not change
within a step; an input activation that stays in its own stash slot) are not copied: the
caller names them (`reuse`). `Layout` records, per residual leaf, whether it is reused value
k or pool leaf j, with the pool leaves' shapes, dtypes and varying mesh axes (found once by
tracing the vjp on a probe).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from jax_overlap.parallel.compat import to_varying, varying_axes


class Layout(NamedTuple):
    """The static shape of one vjp's residuals.

    Attributes:
      treedef: the pullback's pytree structure.
      kinds: per residual leaf, ("in", k) for the k-th reused value, or ("pool", j) for
        the j-th stashed leaf.
      avals: per stashed leaf, (shape, dtype, varying axes).
      out: (shape, dtype, varying axes) of the function's output (the backward's cotangent).
    """

    treedef: Any
    kinds: tuple
    avals: tuple
    out: tuple

    @property
    def nbytes(self) -> int:
        """Bytes one slot of this layout holds (per device)."""
        return sum(int(jnp.dtype(dt).itemsize) * _size(shape) for shape, dt, _ in self.avals)


def _size(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _aval(x) -> tuple:
    return tuple(x.shape), x.dtype, tuple(sorted(varying_axes(x)))


def vjp_with_layout(f: Callable, args: tuple, reuse: Any, has_aux: bool = False
                    ) -> tuple[Any, Any, Layout, list]:
    """`jax.vjp(f, *args)` plus the residuals' layout and the leaves to stash.

    Args:
      f, args, has_aux: as for `jax.vjp` (with `has_aux`, the output is `(y, aux)`).
      reuse: a pytree of values the backward will pass again (`pullback(..., reuse)`);
        residuals that are one of them are not stashed.

    Returns:
      (output, pullback, layout, stashed leaves).
    """
    if has_aux:
        y, pull, aux = jax.vjp(f, *args, has_aux=True)
    else:
        y, pull = jax.vjp(f, *args)
    leaves, treedef = jax.tree.flatten(pull)
    inputs = jax.tree.leaves(reuse)
    kinds, stash = [], []
    for leaf in leaves:
        k = next((i for i, a in enumerate(inputs) if a is leaf), None)
        if k is None:
            kinds.append(("pool", len(stash)))
            stash.append(leaf)
        else:
            kinds.append(("in", k))
    layout = Layout(treedef, tuple(kinds), tuple(_aval(x) for x in stash), _aval(y))
    return ((y, aux) if has_aux else y), pull, layout, stash


def empty_pool(layout: Layout, slots: int) -> list:
    """Zeroed slot arrays for `slots` residual sets of this layout (typed like the leaves).
    The executor keeps the pools in its loop carry and hands an action only its slot."""
    return [to_varying(jnp.zeros((slots, *shape), dtype), axes)
            for shape, dtype, axes in layout.avals]


def pullback(layout: Layout, stashed: list, reuse: Any) -> Callable:
    """The pullback an F stashed (`stashed`: its slot's leaves), rebuilt with the same
    `reuse` values."""
    inputs = jax.tree.leaves(reuse)
    leaves = [inputs[k] if kind == "in" else stashed[k] for kind, k in layout.kinds]
    return jax.tree.unflatten(layout.treedef, leaves)


def ones_cotangent(layout: Layout) -> jax.Array:
    """A cotangent of ones shaped and typed like the function's output (d loss / d loss)."""
    shape, dtype, axes = layout.out
    return to_varying(jnp.ones(shape, dtype), axes)
