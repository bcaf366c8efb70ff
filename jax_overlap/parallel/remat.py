"""Rematerialisation policies: what a block keeps for its backward, by name (`model.remat`).

A policy is applied per block with `jax.checkpoint`, on the pp = 1 path and inside every
pipeline chunk alike; what the block then keeps is exactly what its `jax.vjp` residuals hold,
which is what the pipeline executor stashes between a microbatch's F and its backward.

  none       keep everything: no recompute (the default)
  full       keep only each block's input; the backward recomputes the block's forward
  save_dots  keep every matmul output (attention scores included); recompute the elementwise
             work between them
  minimal    keep the matmul outputs without batch dimensions (the weight matmuls'), recompute
             attention scores and the elementwise work
"""

from __future__ import annotations

from typing import Callable

import jax

POLICIES = ("none", "full", "save_dots", "minimal")


def checkpoint_policy(name: str):
    """The `jax.checkpoint` policy of a remat name (None for `none`: no checkpoint at all)."""
    cp = jax.checkpoint_policies
    table = {"none": None, "full": cp.nothing_saveable, "save_dots": cp.dots_saveable,
             "minimal": cp.dots_with_no_batch_dims_saveable}
    if name not in table:
        raise ValueError(f"model.remat: unknown policy {name!r}; use one of {', '.join(POLICIES)}")
    return table[name]


def remat_block(block: Callable, name: str) -> Callable:
    """`block(...)` under the named policy (unchanged for `none`); any arguments."""
    policy = checkpoint_policy(name)
    if policy is None:
        return block
    return jax.checkpoint(block, policy=policy)
