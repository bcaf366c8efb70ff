"""Parameters a function only reads in the compute dtype, cast once instead of at every use.

Under mixed precision a block keeps its weights in fp32 and casts each one to the compute
dtype where it enters a matmul (`w.astype(bf16)`). Inside a pipeline's tick loop that cast
runs once per layer per action -- and again in the backward's recompute under
`jax.checkpoint` -- each time reading the fp32 weight and writing a bf16 copy: on GPT-1.3B
pp4 x dp2 (32 microbatches) about 5% of the compiled H100 step (docs/results.md).

Casting such a leaf once per step, before the loop, gives the same numbers: the function
only ever sees the bf16 value, and the gradient it returns for the bf16 leaf is exactly the
one autodiff gave the fp32 leaf before widening (the transpose of a cast is the cast back,
which the caller's fp32 accumulation does). A leaf is cast only where *every* read of it is
such a cast, possibly after operations that only move elements (reshape, slicing,
concatenation, ...), which commute with it. One read in fp32 (a router's logits, a norm's
scale) keeps the leaf as it is.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
from jax.extend.core import Var

# Operations that only select, move or relabel elements: a cast after them equals the cast
# before. (A concatenation with an fp32 operand promotes the cast leaf back to fp32, exactly,
# and rounds it again at the cast after: the same bf16 values.)
_MOVES_ELEMENTS = frozenset({"reshape", "squeeze", "expand_dims", "transpose",
                             "broadcast_in_dim", "concatenate", "slice", "dynamic_slice",
                             "pvary", "pbroadcast", "copy", "copy_p"})


def cast_on_use(fn: Callable, params: Any, *args, dtype) -> list[bool]:
    """Per leaf of `params` (in `jax.tree.leaves` order), whether `fn(params, *args)` only
    reads it converted to `dtype`.

    Traces `fn` once (abstractly; inside `shard_map` its collectives trace too). A leaf that is
    an output, is never read, or meets any other operation (including a nested call, which
    this does not look into) counts as read as it is.
    """
    want = np.dtype(dtype)
    closed = jax.make_jaxpr(fn)(params, *args)
    jaxpr = closed.jaxpr
    uses: dict[Any, list] = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if isinstance(v, Var):
                uses.setdefault(v, []).append(eqn)
    outs = {v for v in jaxpr.outvars if isinstance(v, Var)}

    def only_cast(v) -> bool:
        if v in outs or not uses.get(v):
            return False
        for eqn in uses[v]:
            name = eqn.primitive.name
            if name == "convert_element_type" and np.dtype(eqn.params["new_dtype"]) == want:
                continue
            if name in _MOVES_ELEMENTS and all(only_cast(o) for o in eqn.outvars):
                continue
            return False
        return True

    n = len(jax.tree.leaves(params))
    return [only_cast(v) for v in jaxpr.invars[:n]]


def cast_leaves(tree: Any, mask: list[bool], dtype) -> Any:
    """`tree` with the leaves `mask` marks cast to `dtype`."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [leaf.astype(dtype) if cast else leaf
                                        for leaf, cast in zip(leaves, mask)])
