"""How every parameter leaf relates to dp: storage specs, gradient specs, ZeRO-1 split dims,
the FSDP block layout and the in-backward bucket plans.

Derived once per (model, overlap choices, mesh) by `ParallelPlan.build`; the step, the
executor and the state shardings read it from the plan.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_overlap.overlap import buckets, fsdp
from jax_overlap.parallel.collectives import Parallel
from jax_overlap.parallel.mesh import DP, PP, TP, rules_for, tree_specs


class DpLayout(NamedTuple):
    """How every parameter leaf relates to dp, derived from the plan's overlap choices (the
    in-backward buckets exist on the pp=1 path only; FSDP storage and ZeRO-1's state split on
    every path).

    Attributes:
      param_specs: storage; fsdp splits 'blocks' leaves over dp too.
      grad_specs: gradients leaving the shard_map, and the optimizer state: `zero1` splits
        every other leaf over dp (ZeRO-1), fsdp blocks keep their storage split.
      split_dims: ZeRO-1 split dim per leaf of the whole (stacked) leaf, or None.
      fsdp: the block layout under fsdp, else None.
      plan: the in-backward bucket plan when `grad_bucket_bytes > 0` (pp = 1), else None.
      own_rows: paths ('blocks/moe/w_experts_down') of the leaves the model stores split
        over dp itself (expert parallelism: each rank its own experts). Their gradients are
        summed over the ranks sharing those rows inside the model; the step's dp reduction,
        ZeRO-1 and FSDP leave them alone.
    """

    param_specs: Any
    grad_specs: Any
    split_dims: Any
    fsdp: Any
    plan: Any
    own_rows: frozenset[str] = frozenset()

    def own_leaves(self) -> frozenset[int]:
        """Indices (in `jax.tree.leaves` order) of the `own_rows` leaves."""
        paths = jax.tree_util.tree_flatten_with_path(
            self.param_specs, is_leaf=lambda x: isinstance(x, P))[0]
        return frozenset(i for i, (p, _) in enumerate(paths)
                         if buckets.path_name(p) in self.own_rows)


def dp_layout(model, overlap, axis_sizes: dict[str, int]) -> DpLayout:
    """The `DpLayout` of a model for the plan's `OverlapPlan` on a mesh with these axis
    sizes (built once, by `ParallelPlan.build`)."""
    pp = axis_sizes.get(PP, 1)
    specs = tree_specs(model.param_axes(), rules_for(pp))
    own = frozenset(buckets.path_name(p) for p, s in jax.tree_util.tree_flatten_with_path(
        specs, is_leaf=lambda x: isinstance(x, P))[0] if DP in buckets.spec_axes(tuple(s)))
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    block_layout = None
    if overlap.fsdp:
        block_layout, block_specs = fsdp.block_layout(abstract["blocks"], specs["blocks"],
                                                      axis_sizes, DP)
        specs = {**specs, "blocks": block_specs}
    fsdp_leaves = leaf_indices(specs, "blocks") if block_layout is not None else frozenset()
    leaves, treedef = jax.tree.flatten(abstract)
    spec_leaves = treedef.flatten_up_to(specs)
    stacked = leaf_indices(specs, "blocks")
    split = [None] * len(leaves)
    grad_specs = list(spec_leaves)
    plan = None
    # pp=1 with tp=1: the size-1 tp axis splits nothing; the step leaves it out (below).
    drop_tp = pp == 1 and axis_sizes.get(TP, 1) == 1
    if overlap.grad_bucket_bytes > 0 and pp == 1:
        # In-backward buckets: TP-replicated leaves are reduced over (dp, tp) (see buckets).
        plan = buckets.plan_for_params(abstract, specs, axis_sizes, overlap, DP,
                                       model.num_layers, fsdp_leaves,
                                       replicated_axes=() if drop_tp else (TP,),
                                       use_rank=block_use_order(model, abstract),
                                       per_segment=True)
        for u in plan.units:
            if u.split_dim is not None:
                grad_specs[u.leaf] = buckets.with_axes(
                    spec_leaves[u.leaf], u.split_dim + int(u.layer is not None), u.axes,
                    len(leaves[u.leaf].shape))
    elif overlap.zero1:
        for i, (arr, spec) in enumerate(zip(leaves, spec_leaves)):
            if i in fsdp_leaves or DP in buckets.spec_axes(tuple(spec)):
                continue
            lead = int(i in stacked)
            shape = buckets.local_shape(arr.shape, tuple(spec), axis_sizes)[lead:]
            dim = buckets.split_dim(shape, tuple(spec)[lead:], axis_sizes[DP])
            if dim is not None:
                split[i] = dim + lead
                grad_specs[i] = buckets.with_axes(spec, dim + lead, (DP,), len(arr.shape))
    grad_specs = jax.tree.unflatten(treedef, grad_specs)
    if drop_tp:
        # Named in a spec, even a size-1 axis makes a value vary over it inside shard_map,
        # and each TP psum then stays in the program as a real (one-rank) all-reduce. Left
        # out (after the split dims were chosen, so they do not change), nothing varies over
        # tp and the TP collectives drop out (`collectives.psum_tp`). The shardings are the
        # same as with 'tp' named.
        specs, grad_specs = without_axis(specs, TP), without_axis(grad_specs, TP)
    return DpLayout(specs, grad_specs, jax.tree.unflatten(treedef, split), block_layout, plan,
                    own)


def without_axis(specs: Any, axis: str) -> Any:
    """Every PartitionSpec of a tree with mesh `axis` left out of its entries."""

    def entry(e):
        kept = tuple(a for a in (() if e is None else e if isinstance(e, tuple) else (e,))
                     if a != axis)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return jax.tree.map(lambda s: P(*(entry(e) for e in s)), specs,
                        is_leaf=lambda x: isinstance(x, P))


def block_use_order(model, abstract: dict) -> dict[int, int] | None:
    """'blocks' leaf index -> order in which one block's forward first uses it.

    Traced once (single-device semantics) on a dummy sequence; the backward finishes the
    gradients of the last-used parameters first, so buckets follow this order reversed.
    None (tree order) for a model whose embedding input cannot be guessed.
    """
    try:
        ids = jax.ShapeDtypeStruct((1, model.seq_len), jnp.int32)
        x = jax.eval_shape(lambda e, i: model.embed(e, i, Parallel()), abstract["embed"], ids)
        one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype),
                           abstract["blocks"])
        closed = jax.make_jaxpr(lambda p, x: model.block(p, x, Parallel()))(one, x)
    except Exception:  # noqa: BLE001 - only an ordering hint; tree order still works
        return None
    position = {id(v): i for i, v in enumerate(closed.jaxpr.invars[:len(jax.tree.leaves(one))])}
    first: dict[int, int] = {}
    for n, eqn in enumerate(closed.jaxpr.eqns):
        for v in eqn.invars:
            first.setdefault(position.get(id(v), -1), n)
    offset = min(leaf_indices(abstract, "blocks"))
    return {offset + i: first.get(i, -1) for i in position.values()}


def leaf_indices(tree: dict, key: str) -> frozenset[int]:
    """Indices (in `jax.tree.leaves` order) of the leaves under top-level `key`."""
    start = 0
    for k in sorted(tree):
        n = len(jax.tree.leaves(tree[k], is_leaf=lambda x: isinstance(x, P)))
        if k == key:
            return frozenset(range(start, start + n))
        start += n
    return frozenset()


def chunk_bucket_plan(model, overlap, axis_sizes: dict[str, int], layers_per_chunk: int):
    """The bucket plan of one chunk's layers (`buckets.BucketPlan`, segment 1 + layer).

    Units are (leaf, layer) of the chunk's stacked 'blocks' leaves with their per-device
    shapes; TP-replicated leaves are reduced over ('dp', 'tp') (they are marked tp-varying
    in the sync branch, as on the pp=1 path), the others over 'dp'. Always psum: ZeRO-1's
    split of the optimizer state happens in the update, as without buckets.
    """
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    specs = tree_specs(model.param_axes(), rules_for(axis_sizes.get(PP, 1)))["blocks"]
    chunk = jax.tree.map(lambda a: jax.ShapeDtypeStruct((layers_per_chunk, *a.shape[1:]),
                                                        a.dtype), abstract["blocks"])
    chunk_specs = jax.tree.map(lambda sp: P(None, *tuple(sp)[1:]), specs,
                               is_leaf=lambda x: isinstance(x, P))
    order = block_use_order(model, abstract)
    rank = {k - min(order): r for k, r in order.items()} if order else None
    return buckets.plan_for_params({"blocks": chunk}, {"blocks": chunk_specs}, axis_sizes,
                                   dataclasses.replace(overlap, zero1=False), DP,
                                   layers_per_chunk, replicated_axes=(TP,), use_rank=rank)
