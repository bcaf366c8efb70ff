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

A weight matmul whose backward is written out (`collectives.local_matmul`, the collective-matmul
rings) is a custom VJP, which no policy sees as a dot: its output is named with `kept_matmul`,
and `save_dots` / `minimal` keep what is so named as well.
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.ad_checkpoint import checkpoint_name

POLICIES = ("none", "full", "save_dots", "minimal")


# The name a custom-VJP weight matmul's output carries (`kept_matmul`).
WEIGHT_MATMUL = "weight_matmul"


def kept_matmul(y):
    """A weight matmul's output `y` (array or pytree), named so that the policies that keep
    matmul outputs keep it though it comes out of a custom VJP (see the module docstring)."""
    return jax.tree.map(lambda a: checkpoint_name(a, WEIGHT_MATMUL), y)


def checkpoint_policy(name: str):
    """The `jax.checkpoint` policy of a remat name (None for `none`: no checkpoint at all)."""
    cp = jax.checkpoint_policies
    named = cp.save_only_these_names(WEIGHT_MATMUL)
    table = {"none": None, "full": cp.nothing_saveable,
             "save_dots": cp.save_from_both_policies(cp.dots_saveable, named),
             "minimal": cp.save_from_both_policies(cp.dots_with_no_batch_dims_saveable, named)}
    if name not in table:
        raise ValueError(f"model.remat: unknown policy {name!r}; use one of {', '.join(POLICIES)}")
    return table[name]


def remat_block(block: Callable, name: str, prevent_cse: bool = True) -> Callable:
    """`block(...)` under the named policy (unchanged for `none`); any arguments.

    `prevent_cse=False` where the forward and the backward's recompute never share one
    computation, so XLA's CSE cannot merge them: a layer scan's body (JAX's own advice for
    `jax.checkpoint` under `scan`) and a pipeline's F and B, which run in different branches
    of the tick switch (`pipeline.actions._cse_barrier`). Without the optimization barrier
    that `prevent_cse` puts around the recompute's inputs, the backward reads the kept
    residuals where they lie instead of copying them out first: out of their stash slots in
    a pipeline (GPT-1.3B pp4 x dp2 interleaved under `minimal`, deviceless 8 x H100: 1045 ->
    1006 ms), out of the stacked scan outputs at pp = 1 (dp2 x tp4: 1113 -> 1093 ms).
    """
    policy = checkpoint_policy(name)
    if policy is None:
        return block
    return jax.checkpoint(block, policy=policy, prevent_cse=prevent_cse)
