"""FSDP communication window: block parameters stored split over dp, gathered k blocks ahead.

With `overlap.param_sharding: fsdp` every 'blocks' leaf is stored split over dp as well
(along the dim `buckets.split_dim` picks for one layer's per-device slice). With pp > 1 the
pipeline executor gathers a stage's blocks once per step and reduce-scatters their gradients
at the end (every tick uses them; see `pipeline.executor`). With pp = 1 the layer stack runs
as one custom-VJP function:

  forward   gather blocks 0..k-1 into a ring of k slots; for block l: start the all-gather
            of block l+k, compute block l from slot l mod k, then write block l+k into that
            slot (the gathered copy of block l is dropped as it is overwritten).
  backward  the mirror image from the last block down, starting from the ring the forward
            left (the last k blocks: nothing to re-gather before the first backward
            block): gather block l-k while block l's backward runs (the block's forward is
            recomputed from its saved input), and reduce-scatter block l's parameter
            gradients over dp straight into its shard.

Under bf16 / fp16 compute the weight matrices are gathered in that dtype (`gather_rows`):
half the bytes and the ring's memory of fp32, and the same numbers, since the models cast
every matrix to the compute dtype where they use it.

So k + 1 gathered blocks exist (the ring and the one arriving; plus the unpacked copy of
the block computing), never all L, and one block's gradient exists unsharded at a time.
Only the block inputs are saved for the backward (per-block rematerialisation, the usual
companion of FSDP). Optimization barriers pin the order XLA's scheduler would otherwise
relax: no gather before the stack's input (or, in the backward, its cotangent) exists, the
prologue's gathers one at a time, and each slot read before it is rewritten.

Each block moves as ONE all-gather (forward) and ONE reduce-scatter (backward) per gradient
group: leaves split over tp and leaves replicated over tp carry different types inside
shard_map and are not concatenated (see `buckets`), so with tp in the mesh a block is 2+2
collectives (XLA may combine each pair). Leaves with no dim divisible by dp stay replicated;
their gradients leave the stack as this device's (dp-varying, unreduced) and the step sums
them over dp with the embedding's and head's, as any replicated parameter's (`replicated`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from jax_overlap.overlap import buckets
from jax_overlap.parallel.compat import to_varying, varying_axes


@dataclass(frozen=True)
class BlockLayout:
    """How one layer's parameters are split over dp.

    Attributes:
      treedef: tree structure of one block's parameters.
      units: per leaf, a `buckets.Unit` with the per-device (tp-local) shape of one layer
        and `split_dim` (None: stored replicated over dp).
      groups: (leaf indices, split) per collective: leaves of one gradient group that are
        split (all-gather / reduce-scatter) or replicated (psum of the gradient).
    """

    treedef: Any
    units: tuple[buckets.Unit, ...]
    groups: tuple[tuple[tuple[int, ...], bool], ...]

    @property
    def gathered_bytes(self) -> int:
        """Bytes of one gathered block per device (fp32)."""
        return sum(u.nbytes for u in self.units)

    @property
    def replicated(self) -> frozenset[int]:
        """Indices (in one block's leaf order) of the leaves stored whole: no dim divisible
        by dp. Their gradients come out of `reduce_scatter_layer` unreduced."""
        return frozenset(u.leaf for u in self.units if u.split_dim is None)


def block_layout(abstract_blocks: Any, block_specs: Any, axis_sizes: dict[str, int],
                 dp_axis: str) -> tuple[BlockLayout, Any]:
    """The dp split of the stacked 'blocks' leaves.

    Args:
      abstract_blocks: global (L, ...) shapes of the 'blocks' subtree.
      block_specs: their PartitionSpecs without dp (layer dim first).
      axis_sizes: mesh axis name -> size.
      dp_axis: the data-parallel axis name.

    Returns:
      (layout, storage specs): the specs gain dp on each leaf's split dim (+1 for the layer).
    """
    dp = axis_sizes[dp_axis]
    leaves, treedef = jax.tree.flatten(abstract_blocks)
    specs = treedef.flatten_up_to(block_specs)
    units, storage = [], []
    for i, (arr, spec) in enumerate(zip(leaves, specs)):
        spec = tuple(spec)
        shape = buckets.local_shape(arr.shape, spec, axis_sizes)[1:]
        # A leaf the model stores split over dp already (expert parallelism) stays as it is.
        dim = None if dp_axis in buckets.spec_axes(spec) else buckets.split_dim(shape, spec[1:], dp)
        group = tuple(a for a in buckets.spec_axes(spec) if a != dp_axis)
        units.append(buckets.Unit(i, str(i), None, shape, math.prod(shape) * 4, (dp_axis,), 0,
                                  dim, group))
        storage.append(buckets.with_axes(spec, None if dim is None else dim + 1, (dp_axis,),
                                         len(arr.shape)))
    groups: dict[tuple, list[int]] = {}
    for u in units:
        groups.setdefault((u.group, u.split_dim is not None), []).append(u.leaf)
    layout = BlockLayout(treedef, tuple(units),
                         tuple((tuple(v), k[1]) for k, v in groups.items()))
    return layout, jax.tree.unflatten(treedef, storage)


def _bitcast(unit: buckets.Unit, dtype: Any) -> bool:
    """Whether `gather_rows` moves this leaf's fp32 bits as pairs of `dtype` values (a
    vector -- norm scale, bias -- under a 16-bit gather dtype) rather than cast to it."""
    return dtype is not None and len(unit.shape) < 2


def gather_rows(shards: Sequence[jax.Array], layout: BlockLayout, axis: str,
                dtype: Any = None) -> tuple[jax.Array, ...]:
    """One layer's shards -> per split group, the gathered (dp, N/dp) buffer; one
    all-gather per group. Row r is rank r's shards of the group, concatenated.

    `dtype` (bf16 / fp16, the compute dtype): the group travels in it. Weight matrices are
    cast to it: the models cast every matrix to the compute dtype where they use it, so the
    numbers are the same and the bytes half of fp32. Vectors (norm scales, biases, which
    the models may use in fp32) travel bit for bit, each fp32 as two 16-bit words, so the
    group is still one all-gather."""
    out = []
    for members, split in layout.groups:
        if not split:
            continue
        units = [layout.units[i] for i in members]
        pieces = []
        for u in units:
            piece = jnp.moveaxis(shards[u.leaf], u.split_dim, 0).reshape(-1)
            if _bitcast(u, dtype):
                piece = jax.lax.bitcast_convert_type(piece.astype(jnp.float32),
                                                     dtype).reshape(-1)
            elif dtype is not None:
                piece = piece.astype(dtype)
            pieces.append(piece)
        flat = jnp.concatenate(pieces)
        out.append(jax.lax.all_gather(flat, axis, axis=0, tiled=False))  # (dp, N/dp), over dp
    return tuple(out)


def unpack_rows(rows: Sequence[jax.Array], shards: Sequence[jax.Array], layout: BlockLayout,
                dp: int, dtype: Any = None) -> list[jax.Array]:
    """`gather_rows` output (with the same `dtype`) -> the layer's full (tp-local) leaves;
    replicated leaves are taken from `shards` as they are."""
    full: list[Any] = list(shards)
    split_groups = [members for members, split in layout.groups if split]
    for members, group_rows in zip(split_groups, rows):
        start = 0
        for u in (layout.units[i] for i in members):
            n = u.size // dp
            moved = (u.shape[u.split_dim],) + tuple(
                s for d, s in enumerate(u.shape) if d != u.split_dim)
            if _bitcast(u, dtype):
                words = group_rows[:, start:start + 2 * n].reshape(-1, n, 2)
                piece = jax.lax.bitcast_convert_type(words, jnp.float32).reshape(moved)
                start += 2 * n
            else:
                piece = group_rows[:, start:start + n].reshape(moved)
                start += n
            full[u.leaf] = jnp.moveaxis(piece, 0, u.split_dim)
    return full


def gather_layer(shards: Sequence[jax.Array], layout: BlockLayout, axis: str, dp: int
                 ) -> list[jax.Array]:
    """One layer's shards -> the tp-local full leaves; one all-gather per split group."""
    return unpack_rows(gather_rows(shards, layout, axis), shards, layout, dp)


def reduce_scatter_layer(grads: Sequence[jax.Array], layout: BlockLayout, axis: str, dp: int,
                         comm_dtype: str) -> list[jax.Array]:
    """One layer's full gradients -> summed over dp, each rank's shard; one op per split
    group. Leaves stored whole (`layout.replicated`) keep this device's gradient: a psum
    here would be dp-invariant in value but typed dp-varying (a cotangent has its primal's
    type), which no replicated out spec accepts; the step reduces them instead."""
    out: list[Any] = [None] * len(grads)
    for members, split in layout.groups:
        units = [layout.units[i] for i in members]
        if not split:
            for u in units:
                g = grads[u.leaf].astype(jnp.float32)
                out[u.leaf] = g if axis in varying_axes(g) else to_varying(g, (axis,))
            continue
        values = [grads[u.leaf].astype(jnp.float32) for u in units]
        flat = buckets.reduce_flat(buckets.pack(values, units, dp, split), axis, split, comm_dtype)
        for u, v in zip(units, buckets.unpack(flat, units, dp, split)):
            out[u.leaf] = v
    return out


def windowed_blocks(block_fn: Callable[[Any, jax.Array], jax.Array], layout: BlockLayout,
                    window: int, axis: str, dp: int, comm_dtype: str = "fp32",
                    gather_dtype: Any = None) -> Callable:
    """The layer stack over dp-split parameters, with a k-block gather window.

    The gathered blocks live in a ring of k slots (per split group, one (k, dp, N/dp)
    buffer carried by the layer loop): block l is read from slot l mod k, and the gather of
    block l+k (l-k in the backward) is written into that same slot once block l is done
    with it. Updating one slot in place keeps the ring at k blocks; rotating a tuple of k
    buffers instead makes XLA copy every slot on every iteration (and double the memory).

    Args:
      block_fn: (one block's parameter tree, x) -> x, per device (may use TP collectives).
      layout: from `block_layout`.
      window: k, how many blocks ahead the all-gather runs (1..3).
      axis: the dp axis name; dp: its size.
      comm_dtype: 'fp32' | 'bf16' for the gradient reduce-scatter.
      gather_dtype: the dtype the weight matrices are gathered in (the compute dtype; None
        or fp32: as stored). Their gradients come back in it and are reduced in fp32 (or
        `comm_dtype`).

    Returns:
      `f(shards, x) -> x`: `shards` is the stacked (L, ...) 'blocks' subtree as stored
      (this rank's split), differentiable in both arguments; the gradient of `shards` is
      already summed over dp (and in the same split), but for `layout.replicated` leaves:
      this device's, for the caller to sum.
    """

    def layer_shards(stacked: Sequence[jax.Array], layer) -> list[jax.Array]:
        return [jax.lax.dynamic_index_in_dim(s, layer, 0, keepdims=False) for s in stacked]

    def gather(stacked, layer) -> tuple[jax.Array, ...]:
        return gather_rows(layer_shards(stacked, layer), layout, axis, gather_dtype)

    def read(stacked, ring, layer):
        """(block `layer`'s full leaves, ring): the leaves are unpacked out of the slot
        before the ring is returned, so that writing the ring afterwards can happen in
        place (without the barrier XLA cannot order the read before the write and copies
        the whole ring every layer)."""
        slot = layer % len_ring(ring)
        rows = [jax.lax.dynamic_index_in_dim(r, slot, 0, keepdims=False) for r in ring]
        full = unpack_rows(rows, layer_shards(stacked, layer), layout, dp, gather_dtype)
        return jax.lax.optimization_barrier((full, ring))

    def write(ring, rows, slot):
        return tuple(jax.lax.dynamic_update_index_in_dim(r, new, slot, 0)
                     for r, new in zip(ring, rows))

    def len_ring(ring):
        return ring[0].shape[0] if ring else 1

    def new_ring(stacked, layers):
        """The ring holding `layers`, each at slot layer mod k (written one by one into a
        zero ring, so no more than one gathered block exists outside it)."""
        k = len(layers)
        ring = None
        for layer in layers:
            if ring is not None:  # one gather at a time: each waits for the previous write
                ring, stacked = jax.lax.optimization_barrier((ring, stacked))
            rows = gather(stacked, layer)
            if ring is None:
                ring = tuple(jnp.zeros((k,) + r.shape, r.dtype) for r in rows)
            ring = write(ring, rows, layer % k)
        return ring

    def apply(full: Sequence[jax.Array], x):
        return block_fn(jax.tree.unflatten(layout.treedef, list(full)), x)

    def run(stacked, x, save: bool):
        num_layers = stacked[0].shape[0]
        k = min(window, num_layers)
        # Nothing is gathered before the stack's input exists (the scheduler would otherwise
        # hoist the independent gathers as early as it likes, each holding a block).
        x, stacked = jax.lax.optimization_barrier((x, stacked))
        ring = new_ring(stacked, range(k))

        def body(carry, layer, prefetch: bool):
            x, ring = carry
            if prefetch:
                nxt = gather(stacked, layer + k)  # in flight while block `layer` computes
            full, ring = read(stacked, ring, layer)
            y = apply(full, x)
            if prefetch:
                ring = write(ring, nxt, layer % k)
            return (y, ring), (x if save else None)

        # The last k blocks are already in the ring: a second loop without prefetch (a
        # loop, not unrolled, so their temporaries are not live at the same time).
        saved = []
        for lo, hi, prefetch in ((0, num_layers - k, True), (num_layers - k, num_layers, False)):
            if hi > lo:
                (x, ring), xs = jax.lax.scan(partial(body, prefetch=prefetch), (x, ring),
                                             jnp.arange(lo, hi))
                saved.append(xs)
        return x, (jnp.concatenate(saved) if save else None), ring

    def layer_backward(full, x, dy):
        _, vjp = jax.vjp(apply, full, x)
        g_full, dx = vjp(dy)
        return tuple(reduce_scatter_layer(g_full, layout, axis, dp, comm_dtype)), dx

    @jax.custom_vjp
    def layer_stack(stacked, x):
        return run(stacked, x, save=False)[0]

    def fwd(stacked, x):
        y, xs, ring = run(stacked, x, save=True)
        # The forward ends with the last k blocks in the ring, at the slots the backward
        # reads them from: kept, the backward starts computing at once instead of
        # re-gathering them with nothing to hide under.
        return y, (stacked, xs, ring)

    def bwd(res, dy):
        stacked, xs, ring = res
        num_layers = stacked[0].shape[0]
        k = min(window, num_layers)
        # The backward's gathers wait for its cotangent: otherwise they may be hoisted into
        # the forward and hold a second ring during it.
        dy, stacked, ring = jax.lax.optimization_barrier((dy, stacked, ring))

        def body(carry, inputs, prefetch: bool):
            dx, ring, grads = carry
            layer, x = inputs
            if prefetch:
                nxt = gather(stacked, layer - k)  # in flight while block `layer`'s backward runs
            full, ring = read(stacked, ring, layer)
            g, dx = layer_backward(full, x, dx)
            if prefetch:
                ring = write(ring, nxt, layer % k)
            # Written in place into the stacked result (no per-loop stacks to concatenate).
            grads = tuple(jax.lax.dynamic_update_index_in_dim(acc, gi, layer, 0)
                          for acc, gi in zip(grads, g))
            return (dx, ring, grads), None

        # Mirror of the forward, last layer first; the first k blocks end up in the ring.
        carry = (dy, ring, tuple(jnp.zeros_like(s) for s in stacked))
        for lo, hi, prefetch in ((k, num_layers, True), (0, k, False)):
            if hi > lo:
                carry, _ = jax.lax.scan(partial(body, prefetch=prefetch), carry,
                                        (jnp.arange(lo, hi), xs[lo:hi]), reverse=True)
        dx, _, grads = carry
        return list(grads), dx

    layer_stack.defvjp(fwd, bwd)

    def apply_stack(shards_tree, x):
        return layer_stack(jax.tree.leaves(shards_tree), x)

    return apply_stack
