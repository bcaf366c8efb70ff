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


def remat_block_in_order(block: Callable, name: str) -> Callable:
    """`remat_block` for unrolled layers: under `full`, each block's backward recomputes its
    forward only once its output gradient exists.

    In a scan the loop orders the recomputes; unrolled (the last microbatch with in-backward
    gradient buckets), `jax.checkpoint`'s recompute depends only on the block's input, so XLA
    may schedule every layer's recompute ahead of the backward and hold all their
    activations at once, which is what `full` is chosen to avoid. Here the recompute reads
    the input through an optimization barrier that also takes the output gradient. Other
    policies are `remat_block`'s. `block(params, x)`.
    """
    if name != "full":
        return remat_block(block, name)

    @jax.custom_vjp
    def run(params, x):
        return block(params, x)

    def forward(params, x):
        return block(params, x), (params, x)

    def backward(saved, ct):
        params, x, ct = jax.lax.optimization_barrier((*saved, ct))
        return jax.vjp(block, params, x)[1](ct)

    run.defvjp(forward, backward)
    return run
