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

Uneven chunks (`pipeline.stage_layers`): every chunk is padded to the largest, n = max
layers per virtual stage, and virtual stage vs fills the first `stage_layers[vs]` of its n
positions; the padded positions hold zeros (perm = -1), which the executor skips
(`chunk_mask`) and `to_logical` drops, so a checkpoint never sees them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

BLOCKS = "blocks"


def staged_permutation(num_layers: int, schedule, stage_layers=None) -> np.ndarray:
    """Logical layer index of every staged position (-1 for a padded position).

    Args:
      num_layers: layers in the model; a multiple of `stages * virtual_stages` when
        `stage_layers` is None.
      schedule: anything with `stages`, `virtual_stages` and `placement` (virtual stage ->
        (stage, chunk)), e.g. a `jax_overlap.pipeline.table.Schedule`.
      stage_layers: layers per virtual stage in model order (`plan.stage_layers`); None:
        even. Uneven chunks are padded to the largest one, so every device holds
        `virtual_stages x max(stage_layers)` staged layers.

    Returns:
      int array `perm` of `stages * virtual_stages * max(stage_layers)` entries with
      `staged_blocks[i] = logical_blocks[perm[i]]` (zeros where `perm[i] == -1`).

    Raises:
      ValueError: if the layers do not split evenly into virtual stages (no `stage_layers`)
        or `stage_layers` does not sum to `num_layers`.
    """
    placement = schedule.placement
    if stage_layers is None:
        if num_layers % len(placement):
            raise ValueError(f"model.layers: {num_layers} is not divisible by stages x "
                             f"virtual stages = {len(placement)}")
        stage_layers = (num_layers // len(placement),) * len(placement)
    if len(stage_layers) != len(placement) or sum(stage_layers) != num_layers:
        raise ValueError(f"pipeline.stage_layers: {list(stage_layers)} does not split "
                         f"{num_layers} layers into {len(placement)} virtual stages")
    v = schedule.virtual_stages
    n = max(stage_layers)
    perm = np.full(len(placement) * n, -1, np.int32)
    first = np.concatenate([[0], np.cumsum(stage_layers)])
    for vs, (stage, chunk) in enumerate(placement):
        start = (stage * v + chunk) * n
        perm[start:start + stage_layers[vs]] = np.arange(first[vs], first[vs + 1])
    return perm


def chunk_mask(stage_layers, placement, stages: int, virtual_stages: int) -> np.ndarray:
    """(stages, chunks, max layers) bools: which staged positions hold a real layer."""
    n = max(stage_layers)
    mask = np.zeros((stages, virtual_stages, n), bool)
    for vs, (stage, chunk) in enumerate(placement):
        mask[stage, chunk, :stage_layers[vs]] = True
    return mask


def _permute_blocks(tree: Any, index: np.ndarray | None, length: int | None = None) -> Any:
    """Gathers axis 0 of every leaf under a 'blocks' key (params, grads, optimizer moments):
    `out[i] = leaf[index[i]]`, zeros where `index[i] == -1` (padding); `length`: the leading
    axis the leaves must have (default `len(index)`)."""
    if index is None:
        return tree
    index = np.asarray(index)
    length = len(index) if length is None else length
    pad = index < 0
    safe = np.where(pad, 0, index)

    def apply(path, leaf):
        under_blocks = any(getattr(k, "key", None) == BLOCKS for k in path)
        if not under_blocks or not hasattr(leaf, "shape") or not leaf.shape:
            return leaf
        if leaf.shape[0] != length:
            raise ValueError(f"{jax.tree_util.keystr(path)}: leading axis {leaf.shape[0]} is not "
                             f"the {length} layers of the permutation")
        keep = (~pad).reshape(-1, *([1] * (leaf.ndim - 1)))
        if isinstance(leaf, np.ndarray):
            out = leaf[safe]
            return np.where(keep, out, np.zeros((), leaf.dtype)) if pad.any() else out
        out = jnp.take(leaf, jnp.asarray(safe), axis=0)
        return jnp.where(jnp.asarray(keep), out, jnp.zeros((), leaf.dtype)) if pad.any() else out

    return jax.tree_util.tree_map_with_path(apply, tree)


def logical_index(perm: np.ndarray) -> np.ndarray:
    """Staged position of every logical layer: the inverse of `perm` over its real entries."""
    perm = np.asarray(perm)
    real = np.nonzero(perm >= 0)[0]
    out = np.empty(len(real), np.int64)
    out[perm[real]] = real
    return out


def to_staged(tree: Any, perm: np.ndarray | None) -> Any:
    """Logical -> staged layer order for every leaf under a 'blocks' key (padded layers of
    an uneven split are zeros, and stay zero in training: zero gradients, zero moments).

    Works on a params tree, a gradient tree, optimizer state or a whole `TrainState`
    (leaves outside 'blocks', e.g. Adam's step count, are left alone).

    Args:
      tree: pytree in logical order.
      perm: from `staged_permutation` (the plan's `layer_perm`); None is the identity.

    Returns:
      The same tree with blocks in staged order.
    """
    if perm is None:
        return tree
    return _permute_blocks(tree, perm, int((np.asarray(perm) >= 0).sum()))


def to_logical(tree: Any, perm: np.ndarray | None) -> Any:
    """Staged -> logical layer order; the inverse of `to_staged` (padding dropped).

    Args:
      tree: pytree in staged order.
      perm: the permutation the tree was staged with; None is the identity.

    Returns:
      The same tree with blocks in model order.
    """
    if perm is None:
        return tree
    return _permute_blocks(tree, logical_index(perm), len(perm))
