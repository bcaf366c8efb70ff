"""Loss and gradients of one step without a pipeline (pp = 1), in one `shard_map`.

Data flow on a (dp, 1, tp) mesh:
  batch (B, ...) split over dp -> microbatches -> model (TP collectives inside blocks)
  -> gradients, explicitly summed over dp (buckets, ZeRO-1 scatter, FSDP reduce-scatter).
With a slow axis, (dcn, dp, 1, tp): the batch is split over (dcn, dp) and every reduction
also covers dcn, hierarchically (`overlap.slow_axis`), or leaves it to the train step.

The DP reduction is ours, not autodiff's: parameters are marked dp-varying before
differentiation, so JAX's implicit reductions do not fire and we choose where each `psum` goes.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jax_overlap.overlap import buckets, fsdp, slow_axis
from jax_overlap.overlap.dp_layout import DpLayout, leaf_indices
from jax_overlap.parallel.collectives import Parallel
from jax_overlap.parallel.compat import to_varying, varying_axes
from jax_overlap.parallel.mesh import DP, TP, data_axes, data_spec, microbatched
from jax_overlap.parallel.remat import checkpoint_policy, remat_block
from jax_overlap.pipeline import residuals


def tree_zeros_like(tree):
    return jax.tree.map(jnp.zeros_like, tree)


def tree_add(a, b):
    return jax.tree.map(jnp.add, a, b)


def _scan_layers(model, par: Parallel, remat: str = "none") -> Callable:
    """The plain layer stack: one scan over the stacked 'blocks' parameters, each block under
    the remat policy (no CSE barrier: the scan keeps the recompute apart from the forward)."""
    block = remat_block(lambda p, x: model.block(p, x, par), remat, prevent_cse=False)

    def run(blocks, x):
        def layer(x, p_layer):
            return block(p_layer, x), None

        return jax.lax.scan(layer, x, blocks)[0]

    return run


def loss_sum(model, params, batch, par: Parallel, layers: Callable | None = None):
    """Sum of the per-example losses of `batch` (embed, the layer stack, head)."""
    x = model.embed(params["embed"], batch["inputs"], par)
    x = (layers or _scan_layers(model, par))(params["blocks"], x)
    return model.head_loss(params["embed"], params["head"], x, batch["targets"], par)


def reference_loss(model, params, batch) -> jax.Array:
    """Mean loss on one device, no collectives: the ground truth every mesh must reproduce."""
    return loss_sum(model, params, batch, Parallel()) / model.loss_count(batch["targets"])


def _mark_varying(tree: Any, specs: Any, axes: tuple[str, ...], dp_only=frozenset(),
                  data: tuple[str, ...] = (DP,)) -> Any:
    """Leaves marked varying over each of `axes` they are stored replicated over (a leaf
    split over an axis already varies over it, and so does one that came in as a dcn
    group's own copy); leaves in `dp_only` over the `data` axes at most."""
    leaves, treedef = jax.tree.flatten(tree)
    spec_leaves = treedef.flatten_up_to(specs)
    out = []
    for i, (x, s) in enumerate(zip(leaves, spec_leaves)):
        present = _spec_axes(s) | set(varying_axes(x))
        todo = tuple(a for a in (data if i in dp_only else axes) if a not in present)
        out.append(to_varying(x, todo))
    return jax.tree.unflatten(treedef, out)


def _spec_axes(spec) -> set[str]:
    return set(buckets.spec_axes(tuple(spec)))


def make_loss_and_grads(model, plan, mesh) -> Callable:
    """(params, batch) -> (mean loss, grads), both global; one shard_map over the mesh (pp = 1).

    Microbatches are accumulated with a scan and the dp reduction follows `plan.overlap`:
      grad_bucket_bytes 0: one reduction per leaf after the whole backward (the baseline);
      grad_bucket_bytes > 0: each bucket's collective is issued inside the last
        microbatch's backward as soon as its last gradient exists: a layer's buckets in the
        layer scan's backward body (`_scanned_last_microbatch`; XLA pipelines each layer's
        reductions under the next layer's backward), the embedding's and the head's through
        bucket hooks (`buckets.BucketHooks`); buckets that mix layers (`bucket_order:
        largest_first`) run with the layers unrolled (`_bucketed_last_microbatch`);
      zero1: reductions are psum_scatter, gradients leave split over dp (`DpLayout`);
      fsdp: blocks run through `fsdp.windowed_blocks` and are reduce-scattered per block in
        their backward; only embedding/head gradients go through buckets;
      pair_microbatches: microbatch i+1's forward runs beside microbatch i's backward, the
        layers unrolled (`_paired_microbatches`); with buckets, the last paired backward
        beside the last microbatch's forward (`_bucketed_last_microbatch`).

    Args:
      model: a `StagedModel`.
      plan: a `ParallelPlan` built with this model (its `layout` is used).
      mesh: the (dp, pp, tp) mesh.
    """
    par = plan.parallel()
    microbatches = plan.microbatches
    ov = plan.overlap
    axis_sizes = dict(mesh.shape)
    dp = axis_sizes[DP]
    data = data_axes(axis_sizes)  # (dcn, dp) with a slow axis, else (dp,)
    replicas = math.prod(axis_sizes[a] for a in data)
    mode = plan.slow_mode
    layout = plan.layout
    layers = _scan_layers(model, par, plan.remat)
    block = remat_block(lambda p, x: model.block(p, x, par), plan.remat)
    paired = ov.pair_microbatches  # the plan pairs only two microbatches or more
    if paired:
        # Unrolled: a scan over layers is one loop op, which XLA cannot interleave with the
        # other microbatch's loop.
        layers = _unrolled_layers(block, model.num_layers)
    if layout.fsdp is not None:
        # Weight matrices travel in the compute dtype (the model casts them to it anyway).
        low = None if par.compute_dtype == jnp.float32 else par.compute_dtype
        layers = fsdp.windowed_blocks(block, layout.fsdp,
                                      ov.window, DP, dp, ov.grad_comm_dtype, low)
    fsdp_leaves = leaf_indices(layout.param_specs, "blocks") if layout.fsdp else frozenset()
    # Of those, the ones stored whole: their gradients leave the FSDP stack unreduced.
    own = layout.own_leaves()  # stored split over dp (experts): summed in the model
    fsdp_whole = _fsdp_whole(fsdp_leaves, layout.fsdp) - own
    # (tp=1: the layout names no tp, so nothing varies over it and no TP collective is left.)
    marked = (*data, TP) if layout.plan is not None and axis_sizes[TP] > 1 else data
    # FSDP blocks: their reduce-scatter sits in a custom VJP, whose cotangent varies over dcn
    # when the dcn reduction is left to the train step; their primal must then too.
    fsdp_marked = data if mode in ("delay", "local") else (DP,)

    def per_device(params, batch):
        # Global divisor first, so every partial loss is already scaled to the global mean.
        count = _global_count(model, batch["targets"], data, replicas)
        # Marked varying, parameters get per-device gradients and no implicit reduction:
        # over dp (and dcn) always; over tp too for in-backward buckets (TP-replicated leaves
        # then get partial sums that their bucket reduces over (dp, tp)).
        local_params = _mark_varying(params, layout.param_specs, marked, fsdp_leaves,
                                     fsdp_marked)

        def microbatch_step(carry, mb):
            loss_acc, grads_acc = carry
            loss, grads = jax.value_and_grad(
                lambda p: loss_sum(model, p, mb, par, layers) / count)(local_params)
            return (loss_acc + loss, tree_add(grads_acc, grads)), None

        zero = (to_varying(jnp.zeros((), jnp.float32), data), tree_zeros_like(local_params))
        mbs = microbatched(batch, microbatches)

        def loss_of(p, mb):
            return loss_sum(model, p, mb, par, layers) / count

        if layout.plan is None:
            if paired:
                loss, grads, pending = _paired_microbatches(loss_of, local_params, zero, mbs)
                grads = tree_add(grads, pending.backward(pending.stash))
            else:
                (loss, grads), _ = jax.lax.scan(microbatch_step, zero, mbs)
            leaves, treedef = jax.tree.flatten(grads)
            dims = treedef.flatten_up_to(layout.split_dims)
            todo = [i for i in range(len(leaves))
                    if (i not in fsdp_leaves or i in fsdp_whole) and i not in own]
            reduced = buckets.reduce_gradients([leaves[i] for i in todo], ov.grad_bucket_bytes,
                                                ov.grad_comm_dtype, DP, [dims[i] for i in todo])
            for i, g in zip(todo, reduced):
                leaves[i] = g
            grads = _own_over_dcn(jax.tree.unflatten(treedef, leaves), own)
            return jax.lax.psum(loss, data), grads

        earlier = jax.tree.map(lambda x: x[:-1], mbs)
        last = jax.tree.map(lambda x: x[-1], mbs)
        if paired:
            # The earlier microbatches' last backward runs beside the last one's forward:
            # its gradient joins the accumulator only in the bucket hooks of the backward.
            loss, acc, pending = _paired_microbatches(loss_of, local_params, zero, earlier)
            acc, stash, local_params, last = jax.lax.optimization_barrier(
                (acc, pending.stash, local_params, last))
            acc = tree_add(acc, pending.backward(stash))
        else:
            (loss, acc), _ = (jax.lax.scan(microbatch_step, zero, earlier)
                              if microbatches > 1 else (zero, None))
            # The last microbatch's forward does not depend on the earlier ones; without the
            # barrier XLA may run it first and keep its activations alive through them.
            acc, local_params, last = jax.lax.optimization_barrier((acc, local_params, last))
        # The layer scan needs two trips or more (layers 1 .. L-1): a one-trip loop leaves
        # its layer's reductions nothing to run under (XLA pipelines them into the next trip).
        # Paired, the layers run unrolled, beside the last paired backward.
        last_step = (functools.partial(_scanned_last_microbatch, remat=plan.remat)
                     if layout.fsdp is None and layout.plan.per_segment and not paired
                     and model.num_layers > 2 else _bucketed_last_microbatch)
        loss_last, grads = last_step(model, par, block, layout, layers, local_params, acc, last,
                                     count, axis_sizes, marked, ov.grad_comm_dtype)
        if fsdp_whole:  # FSDP block leaves stored whole: summed over dp after the backward
            leaves, treedef = jax.tree.flatten(grads)
            whole = sorted(fsdp_whole)
            for i, g in zip(whole, buckets.reduce_gradients(
                    [leaves[i] for i in whole], ov.grad_bucket_bytes, ov.grad_comm_dtype, DP)):
                leaves[i] = g
            grads = jax.tree.unflatten(treedef, leaves)
        return jax.lax.psum(loss + loss_last, data), _own_over_dcn(grads, own)

    batch_in = {"inputs": data_spec(axis_sizes), "targets": data_spec(axis_sizes)}
    return slow_axis.wrap_step(per_device, mesh, layout.param_specs, layout.grad_specs,
                               batch_in, mode, ov.dcn_comm_dtype)


def _unrolled_layers(block: Callable, num_layers: int) -> Callable:
    """The layer stack as `num_layers` calls of `block` on the stacked 'blocks' parameters."""

    def run(blocks, x):
        for layer in range(num_layers):
            x = block(jax.tree.map(lambda a, i=layer: a[i], blocks), x)
        return x

    return run


def _own_over_dcn(grads, own: frozenset[int]):
    """`grads` with the leaves `own` (stored split over dp, their gradients summed there by
    the model: the experts) summed over dcn too (`slow_axis.over_dcn`)."""
    if not own:
        return grads
    leaves, treedef = jax.tree.flatten(grads)
    for i in own:
        leaves[i] = slow_axis.over_dcn(leaves[i])
    return jax.tree.unflatten(treedef, leaves)


class _Pending(NamedTuple):
    """A forward's residuals whose backward is still to run (`_paired_microbatches`):
    `backward(stash)` runs it."""

    stash: list
    backward: Callable


def _paired_microbatches(loss_of: Callable, params, zero, mbs):
    """(loss, grads, pending) of a microbatch loop that runs microbatch i+1's forward beside
    microbatch i's backward.

    The first forward runs alone, then a scan whose trip does the next microbatch's forward
    and the previous one's backward, one computation with no data between the two: each
    one's collectives (expert all-to-alls, TP gathers) can run under the other's GEMMs. The
    forward keeps its vjp's residuals (`pipeline.residuals`; the parameters are handed again,
    not kept) and the carry holds them until the next trip's backward. The last microbatch's
    backward is returned undone (`pending`), for the caller to pair it with what comes next.

    Args:
      loss_of: `(params, microbatch) -> loss`.
      params: what the gradients are taken with respect to.
      zero: the (loss, gradients) accumulators' zeros.
      mbs: the microbatches, stacked (at least one).
    """
    def forward(mb):
        loss, _, layout, stash = residuals.vjp_with_layout(lambda p: loss_of(p, mb),
                                                             (params,), (params,))
        return loss, layout, stash

    first = jax.tree.map(lambda x: x[0], mbs)
    rest = jax.tree.map(lambda x: x[1:], mbs)
    loss0, layout, stash0 = forward(first)

    def backward(stash):
        pull = residuals.pullback(layout, stash, (params,))
        (grads,) = pull(residuals.ones_cotangent(layout))
        return grads

    def trip(carry, mb):
        loss_acc, grads_acc, stash = carry
        loss, again, stash_next = forward(mb)
        if (again.kinds, again.avals) != (layout.kinds, layout.avals):
            raise AssertionError("pair_microbatches: a microbatch's residuals differ from "
                                 "the first one's")
        grads = backward(stash)
        return (loss_acc + loss, tree_add(grads_acc, grads), stash_next), None

    carry = (zero[0] + loss0, zero[1], stash0)
    if jax.tree.leaves(rest)[0].shape[0]:
        carry, _ = jax.lax.scan(trip, carry, rest)
    loss, grads, stash = carry
    return loss, grads, _Pending(stash, backward)


def _fsdp_whole(fsdp_leaves: frozenset[int], block_layout) -> frozenset[int]:
    """The FSDP block leaves (indices in the whole tree) stored whole: no dim divisible by
    dp (`fsdp.BlockLayout.replicated`, indexed within one block)."""
    if block_layout is None:
        return frozenset()
    ordered = sorted(fsdp_leaves)
    return frozenset(ordered[i] for i in block_layout.replicated)


def _global_count(model, targets, data: tuple[str, ...], replicas: int) -> jax.Array:
    """`model.loss_count` summed over the data axes. A count the data does not decide
    (tokens per batch) is a constant: `replicas` times it, not an all-reduce that every rank
    waits on before its first loss; a data-dependent one (masked tokens) is psum'd."""
    with jax.ensure_compile_time_eval():
        local = model.loss_count(targets)
    return jax.lax.psum(local, data) if isinstance(local, jax.core.Tracer) else local * replicas


def _bucketed_last_microbatch(model, par, block, layout: DpLayout, layers, params, acc, mb,
                              count, axis_sizes: dict[str, int], marked: tuple[str, ...],
                              comm_dtype: str):
    """Loss and fully reduced gradients of the last microbatch, buckets issued in its backward.

    The layers are unrolled so that each bucket hook sits at its own layer (a scan body is
    one computation per layer and would have to finish each reduction inside it). The
    gradient is taken with respect to the bucket sinks (their gradients are the reduced
    buffers) and, under fsdp, the stored block shards (their gradients are reduce-scattered
    inside `fsdp.windowed_blocks`).
    """
    plan = layout.plan
    leaves, treedef = jax.tree.flatten(params)
    acc_leaves = jax.tree.leaves(acc)
    sub_defs = {k: jax.tree.structure(params[k]) for k in params}
    offsets, start = {}, 0
    for k in sorted(params):
        offsets[k] = start
        start += sub_defs[k].num_leaves
    direct = params["blocks"] if layout.fsdp is not None else {}

    def loss_fn(sinks, direct):
        hooks = buckets.BucketHooks(plan, leaves, acc_leaves, sinks, axis_sizes, marked,
                                    comm_dtype)

        def subtree(key, layer=None):
            n = sub_defs[key].num_leaves
            return jax.tree.unflatten(sub_defs[key], [hooks.value(offsets[key] + i, layer)
                                                      for i in range(n)])

        hooks.enter(0)
        x = model.embed(subtree("embed"), mb["inputs"], par)
        if layout.fsdp is not None:
            x = layers(direct, x)
        else:
            for layer in range(model.num_layers):
                hooks.enter(1 + layer)
                x = block(subtree("blocks", layer), x)
        hooks.enter(model.num_layers + 1)
        return model.head_loss(subtree("embed"), subtree("head"), x, mb["targets"], par) / count

    sinks = buckets.make_sinks(plan, axis_sizes, marked)
    loss, (reduced, g_direct) = jax.value_and_grad(loss_fn, argnums=(0, 1))(sinks, direct)
    by_leaf = buckets.assemble(plan, reduced, axis_sizes)
    if layout.fsdp is not None:
        for i, g in enumerate(jax.tree.leaves(g_direct)):
            by_leaf[offsets["blocks"] + i] = acc_leaves[offsets["blocks"] + i] + g
    return loss, jax.tree.unflatten(treedef, [by_leaf[i] for i in range(len(leaves))])


def _scanned_last_microbatch(model, par, block, layout: DpLayout, layers, params, acc, mb,
                             count, axis_sizes: dict[str, int], marked: tuple[str, ...],
                             comm_dtype: str, remat: str):
    """Loss and fully reduced gradients of the last microbatch, a layer's buckets reduced in
    the layer scan's backward (the plan packs every layer alike: `BucketPlan.per_segment`).

    The layer scan (layers 1 .. L-1) carries, per layer, one sink per bucket of that layer
    (stacked over layers) and the layer's index: a custom VJP takes the layer's parameters
    from the whole stacks, and in the backward reduces its buckets (with the earlier
    microbatches' gradients) as the body leaves the layer, handing them out as the sinks'
    gradients. The backward stays a loop: a layer's residuals are rebuilt one layer at a
    time, as in the earlier microbatches (unrolled, XLA's GPU scheduler ran the recomputes of
    many layers ahead of the backward), and XLA's pipelined all-reduce (the `gpu_overlap`
    presets) overlaps each layer's reductions with the next layer's backward. The embedding's,
    the first layer's and the head's buckets go through `buckets.BucketHooks`, as in
    `_bucketed_last_microbatch`: outside the loop, the embedding's reduction can run under the
    first layer's weight-gradient GEMMs. Needs 3 layers or more (a scan of two trips or more;
    the caller takes `_bucketed_last_microbatch` otherwise).
    """
    del layers
    plan = layout.plan
    L = model.num_layers
    leaves, treedef = jax.tree.flatten(params)
    acc_leaves = jax.tree.leaves(acc)
    first_block = _leaf_range(params, "blocks").start
    # The first layer runs outside the scan, its buckets hooked like the embedding's: the
    # embedding's gradient is ready as soon as that layer's input gradient is, and with
    # `embed_before_first_layer` its reduction runs under the layer's weight-gradient GEMMs.
    ends = plan.only([0, 1, L + 1])
    stacked = plan.only(range(2, L + 1))
    # Layer l's buckets, in issue order: the same units (leaf, shape) for every layer.
    per_layer = [[b for b in stacked.buckets if b.ready_segment == 1 + l] for l in range(1, L)]
    template = per_layer[0]
    units = stacked.units
    for row in per_layer:
        assert [[units[i].leaf for i in b.units] for b in row] == \
            [[units[i].leaf for i in b.units] for b in template], "buckets differ by layer"
    parts = [buckets.bucket_parts(b, axis_sizes) for b in template]
    members = [tuple(units[i] for i in b.units) for b in template]
    flat_sinks = buckets.make_sinks(stacked, axis_sizes, marked)
    sinks = [jnp.stack([flat_sinks[row[k].index] for row in per_layer])
             for k in range(len(template))]

    @jax.custom_vjp
    def layer_params(sinks_l, blocks, acc_blocks, i):
        del sinks_l, acc_blocks
        return jax.tree.map(lambda a: a[i], blocks)

    def fwd(sinks_l, blocks, acc_blocks, i):
        del sinks_l
        return jax.tree.map(lambda a: a[i], blocks), (acc_blocks, i)

    def bwd(res, ct):
        acc_blocks, i = res
        cts, accs = jax.tree.leaves(ct), [a[i] for a in jax.tree.leaves(acc_blocks)]
        # No order between a layer's buckets (no `reduce_bucket` token): a result that feeds
        # nothing but the sink's gradient is what XLA's pipelined all-reduce moves under the
        # next layer's backward. (XLA's combiners may merge a layer's buckets below their
        # threshold: on a GPU the preset's 64 MiB.)
        out = [buckets.reduce_bucket(b, us, n, [cts[u.leaf - first_block] for u in us],
                                     [accs[u.leaf - first_block] for u in us], comm_dtype)
               for b, us, n in zip(template, members, parts)]
        # The parameters' own cotangent is dropped: the sinks carry the result.
        return out, None, None, None

    layer_params.defvjp(fwd, bwd)

    # Layer i's parameters are taken from the whole stacks inside the scan body, under the
    # remat policy's checkpoint that never saves them: the stacks are the scan's
    # loop-invariant operands, where `a[1:]` as the scan's xs would copy every parameter and
    # accumulator. (The body is the bare block: this checkpoint is its remat.)
    @functools.partial(jax.checkpoint, policy=_never_saving_layer_params(remat))
    def scanned_block(sinks_l, i, x):
        p = layer_params(sinks_l, params["blocks"], acc["blocks"], i)
        return model.block(jax.tree.map(lambda a: checkpoint_name(a, "layer_params"), p), x, par)

    def loss_fn(block_sinks, end_sinks):
        hooks = buckets.BucketHooks(ends, leaves, acc_leaves, end_sinks, axis_sizes, marked,
                                    comm_dtype)

        def subtree(key):
            return jax.tree.unflatten(jax.tree.structure(params[key]),
                                      [hooks.value(i) for i in _leaf_range(params, key)])

        hooks.enter(0)
        x = model.embed(subtree("embed"), mb["inputs"], par)
        hooks.enter(1)
        first = jax.tree.unflatten(jax.tree.structure(params["blocks"]),
                                   [hooks.value(i, 0) for i in _leaf_range(params, "blocks")])
        x = block(first, x)
        x = jax.lax.scan(lambda x, xs: (scanned_block(*xs, x), None), x,
                         (block_sinks, jnp.arange(1, L)))[0]
        hooks.enter(L + 1)
        return model.head_loss(subtree("embed"), subtree("head"), x, mb["targets"], par) / count

    end_sinks = buckets.make_sinks(ends, axis_sizes, marked)
    loss, (got_blocks, got_ends) = jax.value_and_grad(loss_fn, argnums=(0, 1))(sinks, end_sinks)
    by_leaf = buckets.assemble(ends, got_ends, axis_sizes)
    flat = [None] * len(stacked.buckets)
    for k in range(len(template)):
        for l, row in enumerate(per_layer):
            flat[row[k].index] = got_blocks[k][l]
    for leaf, g in buckets.assemble(stacked, flat, axis_sizes).items():
        by_leaf[leaf] = jnp.concatenate([by_leaf[leaf], g])  # layer 0's, then the scan's
    return loss, jax.tree.unflatten(treedef, [by_leaf[i] for i in range(len(leaves))])


def _never_saving_layer_params(remat: str):
    """The remat policy `remat`, except that values named `layer_params` are never saved."""
    base = checkpoint_policy(remat) or jax.checkpoint_policies.everything_saveable

    def policy(prim, *args, **kwargs):
        return kwargs.get("name") != "layer_params" and base(prim, *args, **kwargs)

    return policy


def _leaf_range(params: dict, key: str) -> range:
    """Indices of `params[key]`'s leaves in `jax.tree.leaves(params)` (sorted keys)."""
    start = 0
    for k in sorted(params):
        n = len(jax.tree.leaves(params[k]))
        if k == key:
            return range(start, start + n)
        start += n
    raise KeyError(key)
