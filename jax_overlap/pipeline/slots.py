"""The small array operations every action and tick uses: varying types (`shard_map`'s
replication checks) and reads, writes and adds at a stash slot or accumulator.
"""

from __future__ import annotations

from typing import Any

import jax

from jax_overlap.parallel.compat import to_varying
from jax_overlap.parallel.compat import varying_axes as _varying_axes


# ----------------------------------------------------------------------- varying types


def vary(x, axes) -> jax.Array:
    """Marks `x` varying over `axes`, skipping the ones it already varies over."""
    missing = tuple(a for a in axes if a not in _varying_axes(x))
    return to_varying(x, missing)


# ------------------------------------------------------------------ slots and accumulators
# Every index the executor uses comes from the tick table, a chunk count or the stage's
# axis index and is in range, so plain dynamic slices do: `x.at[i].set(v)` and `x[i]` would
# add a negative-index wrap and a bounds check (three more kernels each, every tick).


def at(x, i):
    """`x[i]` along the leading axis."""
    return jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)


def set_at(x, i, v):
    """`x` with `x[i] = v` (in place where XLA can)."""
    return jax.lax.dynamic_update_index_in_dim(x, v.astype(x.dtype), i, 0)


def add_at(x, i, v):
    """`x` with `v` added to `x[i]`: a scatter-add in place, without the bounds check (a
    dynamic slice, add and update costs XLA:GPU a copy of the slice first)."""
    return x.at[i].add(v.astype(x.dtype), mode="promise_in_bounds", indices_are_sorted=True,
                       unique_indices=True)


def like(tree, ref) -> Any:
    """Casts every leaf to its reference leaf's varying axes (switch branches must agree)."""
    return jax.tree.map(lambda x, r: vary(x, sorted(_varying_axes(r))), tree, ref)
