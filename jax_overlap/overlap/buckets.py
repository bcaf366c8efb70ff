"""Gradient buckets: the data-parallel reduction as a few large collectives issued in backward.

A `BucketPlan` is pure data, built from the parameter tree before tracing: which gradient
*units* (a whole leaf, or one layer's slice of a stacked 'blocks' leaf) go into which bucket,
and the bytes of each. Units are taken in the order the backward pass finishes them (head,
last layer ... first layer, embedding) and packed greedily until a bucket reaches
`overlap.grad_bucket_mb`; `bucket_order: largest_first` packs the biggest units first
instead (buckets then mix layers and complete late: the contrast case).

Each bucket is reduced by ONE collective on a flat buffer (the concatenation of its units):
`psum`, or with ZeRO-1 `psum_scatter`, after which every rank holds one slice of each unit
(see `split_dim`). To let the collective start while the rest of the backward runs,
`BucketHooks` wraps the parameters of the last microbatch in identity functions with a
custom VJP, one per bucket, placed where the bucket's units are first used in the forward.
The VJP fires as soon as every unit of the bucket has its cotangent (i.e. when the backward
has passed the bucket's earliest layer), adds the gradients accumulated over the earlier
microbatches, reduces the flat buffer and hands the result out through a "sink": a zero input
of the reduced buffer's shape whose gradient *is* the reduced buffer. Sinks decouple the
reduced shape (a slice with ZeRO-1) from the parameter shape autodiff would impose.

Types. Inside `shard_map` every value carries the mesh axes it varies over, and a
concatenation takes the union. The in-backward path therefore marks every parameter as
varying over dp *and* tp before differentiating: a TP-replicated leaf (LayerNorm, biases,
position embedding) then gets a per-device *partial* gradient (autodiff no longer inserts
its tp psum), so its bucket reduces over ('dp', 'tp') while TP-split leaves reduce over 'dp'.
A bucket holds units of one reduction (`Unit.axes`); all flat buffers have the same type,
which lets each bucket's collective be ordered after the previous one by a real data
dependency (`_after`) - XLA's combiners would otherwise merge the independent buckets into
one collective at the end of the backward, the opposite of the point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_overlap.overlap import slow_axis
from jax_overlap.parallel.compat import axis_size, to_varying, varying_axes

MIB = 1 << 20


# ---------------------------------------------------------------------------------------------
# The plan (pure data)


@dataclass(frozen=True)
class Unit:
    """One gradient piece that buckets are made of.

    Attributes:
      leaf: index of the parameter leaf in `jax.tree.leaves(params)` order.
      path: the leaf's path, for display ('blocks/w_in').
      layer: which layer of a stacked leaf this unit is; None for a whole leaf.
      shape: per-device gradient shape of the unit (without the layer dim).
      nbytes: per-device bytes of the unit's fp32 gradient.
      axes: mesh axes the gradient is summed over, e.g. ('dp',) or ('dp', 'tp').
      segment: where the forward first uses it: 0 embedding, 1 + l block l, L + 1 head.
      split_dim: ZeRO-1 only: the dim of `shape` split over `axes`; None reduces with psum.
      group: extra packing key keeping a bucket's values of one type (see reduce_gradients).
      rank: order of first use within the segment's forward (None: the leaf index); the
        backward finishes the later-used units of a segment first.
    """

    leaf: int
    path: str
    layer: int | None
    shape: tuple[int, ...]
    nbytes: int
    axes: tuple[str, ...]
    segment: int
    split_dim: int | None = None
    group: tuple = ()
    rank: int | None = None

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Bucket:
    """Units reduced by one collective.

    Attributes:
      index: position in `BucketPlan.buckets` (issue order: the order they become ready).
      units: indices into `BucketPlan.units`.
      nbytes: per-device fp32 bytes of the flat buffer.
      axes: the shared `Unit.axes` (the collective's replica groups).
      scatter: psum_scatter (ZeRO-1) instead of psum.
      ready_segment: the forward segment whose backward completes the bucket (the smallest
        segment of its units); its hook sits just before that segment's forward.
      detached: issued after the bucket before it, but the bucket after it does not wait
        for it (see `pack_units`' embed_before_first_layer).
    """

    index: int
    units: tuple[int, ...]
    nbytes: int
    axes: tuple[str, ...]
    scatter: bool
    ready_segment: int
    detached: bool = False


@dataclass(frozen=True)
class BucketPlan:
    """Which gradient units are reduced together, in the order the reductions are issued."""

    units: tuple[Unit, ...]
    buckets: tuple[Bucket, ...]
    cap_bytes: int
    order: str

    @property
    def total_bytes(self) -> int:
        return sum(u.nbytes for u in self.units)

    def leaves(self) -> set[int]:
        """Parameter leaves whose gradients this plan reduces."""
        return {u.leaf for u in self.units}

    @property
    def per_segment(self) -> bool:
        """No bucket spans two segments (every layer's units are reduced on their own)."""
        return all(len({self.units[i].segment for i in b.units}) == 1 for b in self.buckets)

    def only(self, segments: Sequence[int]) -> BucketPlan:
        """The buckets ready at `segments`, renumbered, over their own units only."""
        keep = [b for b in self.buckets if b.ready_segment in set(segments)]
        order = [i for b in keep for i in b.units]
        new = {i: n for n, i in enumerate(order)}
        buckets = tuple(Bucket(k, tuple(new[i] for i in b.units), b.nbytes, b.axes, b.scatter,
                               b.ready_segment, b.detached) for k, b in enumerate(keep))
        return BucketPlan(tuple(self.units[i] for i in order), buckets, self.cap_bytes,
                          self.order)

    def describe(self) -> list[dict[str, Any]]:
        """One JSON-ready record per bucket (for reports and the bench)."""
        def name(u):
            return u.path + (f"[{u.layer}]" if u.layer is not None else "")

        return [{"bucket": b.index, "bytes": b.nbytes, "axes": list(b.axes),
                 "op": "psum_scatter" if b.scatter else "psum", "ready_segment": b.ready_segment,
                 "units": [name(self.units[i]) for i in b.units]} for b in self.buckets]


def pack_units(units: Sequence[Unit], cap_bytes: int, order: str = "backward",
               embed_before_first_layer: bool = False, per_segment: bool = False
               ) -> BucketPlan:
    """Packs units into buckets of about `cap_bytes` (0: one bucket per unit).

    Args:
      units: every unit, in any order.
      cap_bytes: a bucket is closed once it holds at least this many bytes.
      order: 'backward' (the order the backward finishes units: highest segment first) or
        'largest_first' (biggest units first, whatever their layer).
      embed_before_first_layer: 'backward' order with the embedding's units (segment 0)
        taken before the first layer's (segment 1). Both complete at the very end of the
        backward, but only the first layer's need GEMMs (its weight gradients) that do not
        feed the embedding's cotangent: reduced first, the embedding's buckets can run
        under those GEMMs instead of after them, when nothing is left to hide under. The
        embedding's units then never share a bucket with another segment's, and their
        buckets are `detached` from the issue order: the first layer's buckets do not wait
        for them, so they stay in flight beside them over all of those GEMMs (in a chain,
        each GEMM could sit under only one of the collectives left at the end).
      per_segment: no bucket spans two segments ('backward' order): every layer's units
        are packed alike, so a layer scan's body can reduce one layer's buckets
        (`training.grads` at pp = 1).

    Returns:
      The plan; buckets are listed in the order they are closed. Units with different
      reductions (`axes`, scatter, `group`) never share a bucket; each kind fills its own.
    """
    units = tuple(units)
    # Within a segment the backward finishes the later-used leaves first.
    def rank(u):
        return u.leaf if u.rank is None else u.rank

    def segment(u):
        if embed_before_first_layer and u.segment in (0, 1):
            return 1 - u.segment
        return u.segment

    seq = sorted(range(len(units)), key=lambda i: (-segment(units[i]), -rank(units[i])))
    if order == "largest_first":
        seq = sorted(seq, key=lambda i: -units[i].nbytes)
        per_segment = False
    elif order != "backward":
        raise ValueError(f"overlap.bucket_order: unknown order {order!r}")
    open_: dict[tuple, list[int]] = {}
    closed: list[list[int]] = []
    pos = {u: p for p, u in enumerate(seq)}

    def flush():
        # What is open, in the order of each bucket's last unit.
        closed.extend(sorted(open_.values(), key=lambda m: pos[m[-1]]))
        open_.clear()

    alone = embed_before_first_layer and order == "backward"
    for n, i in enumerate(seq):
        u = units[i]
        if per_segment and n and u.segment != units[seq[n - 1]].segment:
            flush()
        elif alone and n and (u.segment == 0) != (units[seq[n - 1]].segment == 0):
            # The embedding's units get buckets of their own: shared with a later layer's
            # they would hold its reduction back to the end, with the first layer's they
            # would wait for its weight gradients.
            flush()
        members = open_.setdefault((u.axes, u.split_dim is not None, u.group), [])
        members.append(i)
        if sum(units[j].nbytes for j in members) >= cap_bytes:
            closed.append(open_.pop((u.axes, u.split_dim is not None, u.group)))
    flush()
    buckets = tuple(
        Bucket(index=k, units=tuple(m), nbytes=sum(units[i].nbytes for i in m),
               axes=units[m[0]].axes, scatter=units[m[0]].split_dim is not None,
               ready_segment=min(units[i].segment for i in m),
               detached=alone and all(units[i].segment == 0 for i in m))
        for k, m in enumerate(closed))
    return BucketPlan(units, buckets, cap_bytes, order)


def local_shape(global_shape: Sequence[int], spec: Sequence[Any], axis_sizes: dict[str, int]
                ) -> tuple[int, ...]:
    """Per-device shape of an array with this PartitionSpec on a mesh of these axis sizes."""
    out = []
    for i, n in enumerate(global_shape):
        entry = spec[i] if i < len(spec) else None
        names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        out.append(n // math.prod(axis_sizes[a] for a in names))
    return tuple(out)


def spec_axes(spec: Sequence[Any]) -> tuple[str, ...]:
    """Mesh axes a PartitionSpec mentions, in order, without repeats."""
    names: list[str] = []
    for entry in spec:
        for a in (() if entry is None else (entry if isinstance(entry, tuple) else (entry,))):
            if a not in names:
                names.append(a)
    return tuple(names)


def split_dim(shape: Sequence[int], spec: Sequence[Any], parts: int) -> int | None:
    """The dim of a per-device array that ZeRO-1 / FSDP split into `parts`, or None.

    The largest dim divisible by `parts`, preferring dims not already split over another
    axis (their PartitionSpec then just gains the new axes); None when no dim divides.
    """
    def free(i):
        return i >= len(spec) or spec[i] is None

    candidates = [i for i, n in enumerate(shape) if n % parts == 0 and n >= parts]
    if not candidates:
        return None
    return max(candidates, key=lambda i: (free(i), shape[i], -i))


def with_axes(spec: Sequence[Any], dim: int | None, axes: Sequence[str], ndim: int):
    """`spec` with mesh `axes` added (as the minor parts) to `dim`; unchanged for dim None."""
    from jax.sharding import PartitionSpec as P

    entries = list(spec) + [None] * (ndim - len(spec))
    if dim is not None:
        e = entries[dim]
        have = () if e is None else (e if isinstance(e, tuple) else (e,))
        new = (*have, *axes)
        entries[dim] = new[0] if len(new) == 1 else new
    return P(*entries)


def reduction_axes(spec: Sequence[Any], dp_axis: str, replicated_axes: Sequence[str]
                   ) -> tuple[str, ...]:
    """dp plus every axis of `replicated_axes` the leaf is stored replicated over (on those
    its per-device gradient is a partial sum once the parameter is marked varying)."""
    present = spec_axes(tuple(spec))
    # A leaf stored split over dp (expert parallelism) holds its own rows: no dp sum.
    own = () if dp_axis in present else (dp_axis,)
    return (*own, *(a for a in replicated_axes if a not in present and a != dp_axis))


def plan_for_params(abstract_params: Any, specs: Any, axis_sizes: dict[str, int], overlap,
                    dp_axis: str, num_layers: int, skip_leaves: frozenset[int] = frozenset(),
                    replicated_axes: Sequence[str] = (),
                    use_rank: dict[int, int] | None = None,
                    per_segment: bool = False) -> BucketPlan:
    """The bucket plan of a {'embed', 'blocks', 'head'} parameter tree.

    Args:
      abstract_params: global parameter shapes (e.g. `jax.eval_shape(model.init, key)`).
      specs: PartitionSpec per leaf (same tree).
      axis_sizes: mesh axis name -> size.
      overlap: the plan's `OverlapPlan` (grad_bucket_bytes, bucket_order, zero1,
        embed_before_first_layer).
      dp_axis: the data-parallel axis name.
      num_layers: L, the leading dim of every 'blocks' leaf.
      skip_leaves: leaves reduced elsewhere (FSDP blocks reduce-scatter in their backward).
      replicated_axes: axes (e.g. ('tp',)) that leaves stored replicated over are marked
        varying over, so their gradients are also summed over them.
      use_rank: leaf -> order of first use in its segment's forward (see `Unit.rank`).
      per_segment: buckets never span two layers (`pack_units`).

    Returns:
      The plan; 'blocks' leaves contribute one unit per layer.
    """
    paths_leaves = jax.tree_util.tree_flatten_with_path(abstract_params)[0]
    spec_leaves = jax.tree.leaves(specs,
                                  is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    itemsize = np.dtype(np.float32).itemsize
    units: list[Unit] = []
    for leaf, ((path, arr), spec) in enumerate(zip(paths_leaves, spec_leaves)):
        if leaf in skip_leaves:
            continue
        keys = path_name(path).split("/")
        spec = tuple(spec)
        shape = local_shape(arr.shape, spec, axis_sizes)
        axes = reduction_axes(spec, dp_axis, replicated_axes)
        parts = math.prod(axis_sizes[a] for a in axes)
        name = "/".join(keys)
        zero1 = overlap.zero1 and dp_axis in axes  # a dp-split leaf's state is split already
        if keys[0] == "blocks":
            unit_shape = shape[1:]
            dim = split_dim(unit_shape, spec[1:], parts) if zero1 else None
            units += [Unit(leaf, name, layer, unit_shape, math.prod(unit_shape) * itemsize,
                           axes, 1 + layer, dim, rank=(use_rank or {}).get(leaf))
                      for layer in range(num_layers)]
        else:
            segment = 0 if keys[0] == "embed" else num_layers + 1
            dim = split_dim(shape, spec, parts) if zero1 else None
            units.append(Unit(leaf, name, None, shape, math.prod(shape) * itemsize, axes,
                              segment, dim, rank=(use_rank or {}).get(leaf)))
    return pack_units(units, overlap.grad_bucket_bytes, overlap.bucket_order,
                      overlap.embed_before_first_layer, per_segment)


# ---------------------------------------------------------------------------------------------
# Flat buffers: one collective per bucket


def pack(values: Sequence[jax.Array], units: Sequence[Unit], parts: int, scatter: bool
         ) -> jax.Array:
    """A bucket's gradients as one buffer: (N,), or (parts, N/parts) to scatter, where row r
    holds the r-th slice (along `split_dim`) of every unit."""
    if scatter:
        return jnp.concatenate([jnp.moveaxis(v, u.split_dim, 0).reshape(parts, -1)
                                for v, u in zip(values, units)], axis=1)
    return jnp.concatenate([v.reshape(-1) for v in values])


def unpack(flat: jax.Array, units: Sequence[Unit], parts: int, scattered: bool
           ) -> list[jax.Array]:
    """Splits a reduced buffer back into per-unit arrays (this rank's slice if scattered)."""
    out, start = [], 0
    for u in units:
        n = u.size // parts if scattered else u.size
        piece = flat[start:start + n]
        start += n
        if scattered:
            moved = (u.shape[u.split_dim] // parts,) + tuple(
                s for i, s in enumerate(u.shape) if i != u.split_dim)
            out.append(jnp.moveaxis(piece.reshape(moved), 0, u.split_dim))
        else:
            out.append(piece.reshape(u.shape))
    return out


def reduce_flat(flat: jax.Array, axes: str | tuple[str, ...], scatter: bool, comm_dtype: str
                ) -> jax.Array:
    """The bucket's one collective, optionally on a bf16 copy; the result is fp32.

    With a slow 'dcn' axis the buffer varies over, the sum also covers dcn, hierarchically
    (`slow_axis.reduce`: reduce-scatter over `axes`, psum over dcn, all-gather).
    """
    x = flat.astype(jnp.bfloat16) if comm_dtype == "bf16" else flat
    # (parts, N/parts) -> (N/parts,) with scatter, else (N,) -> (N,); summed over axes (+ dcn)
    x = slow_axis.reduce(x, axes, scatter)
    return x.astype(jnp.float32)


def bucket_parts(bucket: Bucket, axis_sizes: dict[str, int]) -> int:
    """How many ranks a bucket's collective spans."""
    return math.prod(axis_sizes[a] for a in bucket.axes)


def reduced_shape(bucket: Bucket, units: Sequence[Unit], axis_sizes: dict[str, int]
                  ) -> tuple[int, ...]:
    n = sum(units[i].size for i in bucket.units)
    return (n // bucket_parts(bucket, axis_sizes),) if bucket.scatter else (n,)


# ---------------------------------------------------------------------------------------------
# Issue inside the backward


def vary_to(x: jax.Array, axes: Sequence[str]) -> jax.Array:
    """`x` marked varying over every axis of `axes` it does not already vary over."""
    have = varying_axes(x)
    return to_varying(x, tuple(a for a in axes if a not in have))


def _after(flat: jax.Array, token: jax.Array) -> jax.Array:
    """`flat`, made data-dependent on `token`.

    XLA drops optimization barriers before its collective combiners run, and the combiners
    merge any two collectives with no data path between them. Adding `0 * token` to one
    element is exact for every finite token; a non-finite token (the previous bucket already
    holds inf/NaN gradients) turns that one element into NaN, in a step whose gradient norm
    is non-finite anyway.
    """
    tied = flat.reshape(-1)[:1] + 0.0 * token.astype(flat.dtype)
    return flat.reshape(-1).at[:1].set(tied).reshape(flat.shape)


def reduce_bucket(bucket: Bucket, units: Sequence[Unit], parts: int, grads, accs,
                  comm_dtype: str, token: jax.Array | None = None) -> jax.Array:
    """One bucket's collective: its units' gradients plus the earlier microbatches'
    (`accs`), packed into one fp32 buffer, made to depend on `token` (the bucket reduced
    before it: `_after`) and reduced (`reduce_flat`)."""
    total = [g.astype(jnp.float32) + acc for g, acc in zip(grads, accs)]
    flat = pack(total, units, parts, bucket.scatter)
    if token is not None:
        flat = _after(flat, token)
    return reduce_flat(flat, bucket.axes, bucket.scatter, comm_dtype)


def _bucket_hook(bucket: Bucket, units: tuple[Unit, ...], parts: int, comm_dtype: str,
                 token_axes: tuple[str, ...]):
    """Identity on a bucket's parameters whose VJP reduces the bucket into the sink's grad.

    It also passes a one-element token through, from the hook applied before it in the
    forward to the one applied after it. In the backward the token's cotangent runs the
    other way: the bucket reduced first hands a slice of its result to the next one, which
    ties it into its own buffer (`_after`). That keeps the buckets separate collectives in
    issue order, constraining nothing but the order of reductions that share one
    communication stream anyway.
    """

    @jax.custom_vjp
    def hook(sink, token, accs, params):
        del sink, accs
        return params, token

    def fwd(sink, token, accs, params):
        del sink
        return (params, token), accs

    def bwd(accs, cts):
        cts_params, ct_token = cts
        reduced = reduce_bucket(bucket, units, parts, cts_params, accs, comm_dtype, ct_token)
        # The parameters' own cotangent is dropped: the sink carries the result, and the
        # token's cotangent carries the ordering to the bucket reduced next (a detached
        # bucket passes on the one it got, so the next bucket does not wait for it).
        ct_next = ct_token if bucket.detached else vary_to(reduced[:1], token_axes)
        return reduced, ct_next, None, None

    hook.defvjp(fwd, bwd)
    return hook


def make_sinks(plan: BucketPlan, axis_sizes: dict[str, int], marked_axes: Sequence[str]
               ) -> list[jax.Array]:
    """Zero inputs, one per bucket, typed like its reduced buffer: a psum result no longer
    varies over the summed axes, a psum_scatter result is each rank's own slice."""
    sinks = []
    marked_axes = slow_axis.sink_axes(tuple(marked_axes))
    for b in plan.buckets:
        axes = tuple(marked_axes) if b.scatter else tuple(a for a in marked_axes
                                                          if a not in b.axes)
        sinks.append(to_varying(jnp.zeros(reduced_shape(b, plan.units, axis_sizes),
                                          jnp.float32), axes))
    return sinks


def unit_values(plan: BucketPlan, leaves: Sequence[jax.Array]) -> list[jax.Array]:
    """Each unit's value from the parameter leaves (a layer slice for stacked leaves)."""
    return [leaves[u.leaf] if u.layer is None else leaves[u.leaf][u.layer] for u in plan.units]


class BucketHooks:
    """The last microbatch's parameters, per unit, with bucket hooks applied as the forward
    reaches each bucket's first use. Used while tracing one forward; not a pytree.

    Hooks are applied in reverse plan order so that the backward, which meets them
    last-applied first, reduces the buckets in plan order: a bucket is wrapped before its
    segment's forward, together with every bucket after it in the plan that is not wrapped
    yet (with `embed_before_first_layer` the first layer's buckets follow the embedding's in
    the plan, so they are wrapped at segment 0, before the embedding's).

    Args:
      plan: the bucket plan.
      leaves: local parameter leaves, in `jax.tree.leaves` order, varying over `marked_axes`.
      acc_leaves: gradients accumulated over the earlier microbatches (same tree).
      sinks: `make_sinks(plan, axis_sizes, marked_axes)` (the values being differentiated).
      axis_sizes: mesh axis name -> size.
      marked_axes: the axes every parameter was marked varying over, e.g. ('dp', 'tp').
      comm_dtype: 'fp32' | 'bf16'.
    """

    def __init__(self, plan: BucketPlan, leaves, acc_leaves, sinks, axis_sizes: dict[str, int],
                 marked_axes: Sequence[str], comm_dtype: str):
        self.plan = plan
        self.values = unit_values(plan, leaves)
        self._accs = unit_values(plan, acc_leaves)
        self._sinks = list(sinks)
        self._sizes, self._comm = axis_sizes, comm_dtype
        self._by_leaf_layer = {(u.leaf, u.layer): i for i, u in enumerate(plan.units)}
        self._token_axes = tuple(marked_axes)
        self._token = to_varying(jnp.zeros((1,), jnp.float32), self._token_axes)
        self._applied: set[int] = set()

    def enter(self, segment: int) -> list[int]:
        """Wraps every bucket that completes at `segment`, and every later one in the plan
        not wrapped yet (call before the segment's forward). Returns the indices wrapped, in
        the order they were."""
        first = min((b.index for b in self.plan.buckets
                     if b.ready_segment == segment and b.index not in self._applied),
                    default=None)
        if first is None:
            return []
        wrapped = []
        for b in reversed(self.plan.buckets[first:]):
            if b.index in self._applied:
                continue
            self._applied.add(b.index)
            wrapped.append(b.index)
            members = tuple(self.plan.units[i] for i in b.units)
            hook = _bucket_hook(b, members, bucket_parts(b, self._sizes), self._comm,
                                self._token_axes)
            outs, self._token = hook(self._sinks[b.index], self._token,
                                     [self._accs[i] for i in b.units],
                                     [self.values[i] for i in b.units])
            for i, v in zip(b.units, outs):
                self.values[i] = v
        return wrapped

    def value(self, leaf: int, layer: int | None = None) -> jax.Array:
        return self.values[self._by_leaf_layer[(leaf, layer)]]


def assemble(plan: BucketPlan, reduced: Sequence[jax.Array], axis_sizes: dict[str, int]
             ) -> dict[int, jax.Array]:
    """Reduced bucket buffers -> gradient per leaf index (stacked leaves re-stacked)."""
    pieces: dict[tuple[int, int | None], jax.Array] = {}
    for b, flat in zip(plan.buckets, reduced):
        members = [plan.units[i] for i in b.units]
        for u, v in zip(members, unpack(flat, members, bucket_parts(b, axis_sizes), b.scatter)):
            pieces[(u.leaf, u.layer)] = v
    out: dict[int, jax.Array] = {}
    for leaf in sorted(plan.leaves()):
        layers = sorted(k[1] for k in pieces if k[0] == leaf and k[1] is not None)
        out[leaf] = (jnp.stack([pieces[(leaf, l)] for l in layers]) if layers
                     else pieces[(leaf, None)])
    return out


# ---------------------------------------------------------------------------------------------
# After the backward (pp > 1 executor, and the bucket-less baseline)


def path_name(path) -> str:
    """'blocks/moe/w_experts_down' for a tree path of dict keys (or sequence indices)."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def reduce_gradients(grads: Any, bucket_bytes: int, comm_dtype: str, axis: str,
                     split_dims: Any = None, own: frozenset[str] = frozenset()) -> Any:
    """Sums per-replica gradients over `axis` after the backward, bucketed by size.

    `bucket_bytes: 0` is one collective per leaf. Otherwise whole leaves are packed into
    buckets (reverse tree order; after the backward every gradient is ready anyway), leaves
    of one type (the other mesh axes they vary over) per bucket, and each bucket is one
    collective on a flat buffer. `grad_comm_dtype: bf16` reduces a bf16 copy.

    Args:
      grads: per-device gradient tree (values varying over `axis`).
      bucket_bytes: bucket size; 0 = one collective per leaf.
      comm_dtype: 'fp32' or 'bf16', the dtype the gradients travel in.
      axis: the data-parallel mesh axis name.
      split_dims: optional tree (same structure, int or None leaves) of dims to
        reduce-scatter over `axis` (ZeRO-1); None everywhere reduces with psum.
      own: paths ('blocks/moe/w_experts_down', `path_name`) of leaves stored split over
        `axis` (`DpLayout.own_rows`): each rank holds its own rows and their gradient is
        already summed where rows are shared, so they are returned as they are.

    Returns:
      The reduced gradients: full leaves, or each rank's slice along its split dim.
    """
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(grads)
    leaves = [g for _, g in paths_leaves]
    dims = ([None] * len(leaves) if split_dims is None
            else treedef.flatten_up_to(split_dims))
    dp = axis_size(axis)
    out: list[Any] = [None] * len(leaves)
    units = []
    for i, ((path, g), d) in enumerate(zip(paths_leaves, dims)):
        if own and path_name(path) in own:  # stored split over dp: summed over dcn only
            out[i] = slow_axis.over_dcn(g)
            continue
        units.append(Unit(i, str(i), None, tuple(g.shape), g.size * 4, (axis,), i, d,
                          group=tuple(sorted(varying_axes(g) - {axis}))))
    plan = pack_units(units, bucket_bytes, "backward")
    for b in plan.buckets:
        members = [plan.units[i] for i in b.units]
        values = [leaves[u.leaf].astype(jnp.float32) for u in members]
        flat = reduce_flat(pack(values, members, dp, b.scatter), axis, b.scatter,
                           comm_dtype)
        for u, v in zip(members, unpack(flat, members, dp, b.scatter)):
            out[u.leaf] = v.astype(leaves[u.leaf].dtype)
    return jax.tree.unflatten(treedef, out)
