"""Staged parameter layout: which layers each pipeline stage holds, stored contiguously.

The model's blocks are stacked over a leading layer axis in model (logical) order, and the
mesh splits that axis over 'pp' in contiguous blocks (`mesh.rules_for`). With one chunk per
stage (gpipe, 1f1b, zb-h1) contiguous blocks are exactly the stages' layers. Interleaved and
ZB-V give a stage several non-adjacent virtual stages (round-robin: stage d holds virtual
stages d, d+p, ...; V: d and 2p-1-d), so the train state keeps blocks in *staged* order:

    staged index (d * v + c) * n + j  <->  logical layer vs * n + j,  (d, c) = placement[vs]

with n = layers per virtual stage. Device d's contiguous shard of the staged stack is then
its v chunks, chunk-major. Checkpoints store the logical order (`to_logical` before saving,
`to_staged` after loading), so a checkpoint restores onto any mesh and schedule.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

BLOCKS = "blocks"


def staged_permutation(num_layers: int, schedule) -> np.ndarray:
    """Logical layer index of every staged position.

    Args:
      num_layers: layers in the model; a multiple of `stages * virtual_stages`.
      schedule: anything with `virtual_stages` and `placement` (virtual stage ->
        (stage, chunk)), e.g. a `jax_overlap.pipeline.schedules.Schedule`.

    Returns:
      int array `perm` of length `num_layers` with `staged_blocks = logical_blocks[perm]`.

    Raises:
      ValueError: if the layers do not split evenly into virtual stages.
    """
    return _permutation(num_layers, schedule.placement, schedule.virtual_stages)


def _permutation(num_layers: int, placement, virtual_stages: int) -> np.ndarray:
    if num_layers % len(placement):
        raise ValueError(f"model.layers: {num_layers} is not divisible by stages x virtual "
                         f"stages = {len(placement)}")
    n = num_layers // len(placement)
    perm = np.empty(num_layers, np.int32)
    for vs, (stage, chunk) in enumerate(placement):
        start = (stage * virtual_stages + chunk) * n
        perm[start:start + n] = np.arange(vs * n, (vs + 1) * n)
    return perm


def _permute_blocks(tree: Any, index: np.ndarray | None) -> Any:
    """Reorders axis 0 of every leaf under a 'blocks' key (params, grads, optimizer moments)."""
    if index is None:
        return tree
    index = np.asarray(index)

    def apply(path, leaf):
        under_blocks = any(getattr(k, "key", None) == BLOCKS for k in path)
        if not under_blocks or not hasattr(leaf, "shape") or not leaf.shape:
            return leaf
        if leaf.shape[0] != len(index):
            raise ValueError(f"{jax.tree_util.keystr(path)}: leading axis {leaf.shape[0]} is not "
                             f"the {len(index)} layers of the permutation")
        if isinstance(leaf, np.ndarray):
            return leaf[index]
        return jnp.take(leaf, jnp.asarray(index), axis=0)

    return jax.tree_util.tree_map_with_path(apply, tree)


def to_staged(tree: Any, perm: np.ndarray | None) -> Any:
    """Logical -> staged layer order for every leaf under a 'blocks' key.

    Works on a params tree, a gradient tree, optimizer state or a whole `TrainState`
    (leaves outside 'blocks', e.g. Adam's step count, are left alone).

    Args:
      tree: pytree in logical order.
      perm: from `staged_permutation` (the plan's `layer_perm`); None is the identity.

    Returns:
      The same tree with blocks in staged order.
    """
    return _permute_blocks(tree, perm)


def to_logical(tree: Any, perm: np.ndarray | None) -> Any:
    """Staged -> logical layer order; the inverse of `to_staged`.

    Args:
      tree: pytree in staged order.
      perm: the permutation the tree was staged with; None is the identity.

    Returns:
      The same tree with blocks in model order.
    """
    return _permute_blocks(tree, None if perm is None else np.argsort(perm))
