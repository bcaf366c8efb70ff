"""The train step: per-device loss and gradients in one `shard_map`, then the optimizer.

Data flow of one step on a (dp, pp, tp) mesh:
  batch (B, ...) split over dp -> microbatches -> model (TP collectives inside blocks)
  -> gradients, explicitly summed over dp -> optax update on the global (sharded) arrays.

The DP reduction is ours, not autodiff's: parameters are marked dp-varying before
differentiation, so JAX's implicit reductions do not fire and we choose where each `psum` goes.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_overlap.parallel.collectives import Parallel
from jax_overlap.parallel.compat import shard_map, to_varying
from jax_overlap.parallel.mesh import DP, PP, TP, rules_for, tree_specs
from jax_overlap.training.state import TrainState


def compute_dtype(precision: str):
    return jnp.bfloat16 if precision == "bf16" else jnp.float32


def parallel_context(cfg) -> Parallel:
    return Parallel(tp_axis=TP, tp=cfg.mesh.tp, compute_dtype=compute_dtype(cfg.train.precision),
                    tp_comm=cfg.overlap.tp_comm, cm_direction=cfg.overlap.collective_matmul_direction)


def lr_schedule(t) -> optax.Schedule:
    decay = max(1, t.steps - t.warmup_steps)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.lr, warmup_steps=t.warmup_steps,
        decay_steps=t.warmup_steps + decay, end_value=t.lr * t.min_lr_ratio)


def make_optimizer(t, lr_scale: float = 1.0) -> optax.GradientTransformation:
    """AdamW or LAMB with warmup + cosine decay and global-norm clipping."""
    schedule = lr_schedule(t)
    scaled = (lambda s: schedule(s) * lr_scale) if lr_scale != 1.0 else schedule
    if t.optimizer == "lamb":
        core = optax.lamb(scaled, weight_decay=t.weight_decay)
    else:
        core = optax.adamw(scaled, b1=0.9, b2=0.95, weight_decay=t.weight_decay)
    parts = [optax.clip_by_global_norm(t.grad_clip)] if t.grad_clip > 0 else []
    return optax.chain(*parts, core)


def batch_specs(batch: Any) -> Any:
    return jax.tree.map(lambda _: P(DP), batch)


def microbatched(tree: Any, microbatches: int) -> Any:
    """(B, ...) -> (M, B/M, ...): microbatch i takes rows [i*B/M, (i+1)*B/M)."""
    return jax.tree.map(lambda x: x.reshape(microbatches, x.shape[0] // microbatches,
                                            *x.shape[1:]), tree)


def tree_zeros_like(tree):
    return jax.tree.map(jnp.zeros_like, tree)


def tree_add(a, b):
    return jax.tree.map(jnp.add, a, b)


def _scan_layers(model, par: Parallel) -> Callable:
    """The plain layer stack: one scan over the stacked 'blocks' parameters."""

    def run(blocks, x):
        def layer(x, p_layer):
            return model.block(p_layer, x, par), None

        return jax.lax.scan(layer, x, blocks)[0]

    return run


def _loss_sum(model, params, batch, par: Parallel, layers: Callable | None = None):
    x = model.embed(params["embed"], batch["inputs"], par)
    x = (layers or _scan_layers(model, par))(params["blocks"], x)
    return model.head_loss(params["embed"], params["head"], x, batch["targets"], par)


def reference_loss(model, params, batch) -> jax.Array:
    """Mean loss on one device, no collectives: the ground truth every mesh must reproduce."""
    return _loss_sum(model, params, batch, Parallel()) / model.loss_count(batch["targets"])


def reduce_grads_dp(grads, cfg, split_dims: Any = None) -> Any:
    """Sums per-replica gradients over dp after the backward (ZeRO-1: `split_dims` scatter)."""
    from jax_overlap.overlap import buckets

    return buckets.reduce_gradients(grads, cfg.overlap, DP, split_dims)


class DpLayout(NamedTuple):
    """How every parameter leaf relates to dp, derived from `cfg.overlap` (the in-backward
    buckets exist on the pp=1 path only; FSDP storage and ZeRO-1's state split on every path).

    Attributes:
      param_specs: storage; `param_sharding: fsdp` splits 'blocks' leaves over dp too.
      grad_specs: gradients leaving the shard_map, and the optimizer state: `zero1` splits
        every other leaf over dp (ZeRO-1), fsdp blocks keep their storage split.
      split_dims: ZeRO-1 split dim per leaf of the whole (stacked) leaf, or None.
      fsdp: the block layout under fsdp, else None.
      plan: the in-backward bucket plan when `grad_bucket_mb > 0`, else None.
    """

    param_specs: Any
    grad_specs: Any
    split_dims: Any
    fsdp: Any
    plan: Any


def dp_layout(model, overlap, axis_sizes: dict[str, int]) -> DpLayout:
    """The `DpLayout` of a model for an `OverlapConfig` on a mesh with these axis sizes."""
    from jax_overlap.overlap import buckets, fsdp

    pp = axis_sizes.get(PP, 1)
    specs = tree_specs(model.param_axes(), rules_for(pp))
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    block_layout = None
    if overlap.param_sharding == "fsdp":
        block_layout, block_specs = fsdp.block_layout(abstract["blocks"], specs["blocks"],
                                                      axis_sizes, DP)
        specs = {**specs, "blocks": block_specs}
    fsdp_leaves = _leaf_indices(specs, "blocks") if block_layout is not None else frozenset()
    leaves, treedef = jax.tree.flatten(abstract)
    spec_leaves = treedef.flatten_up_to(specs)
    stacked = _leaf_indices(specs, "blocks")
    split = [None] * len(leaves)
    grad_specs = list(spec_leaves)
    plan = None
    # pp=1 with tp=1: the size-1 tp axis splits nothing; the step leaves it out (below).
    drop_tp = pp == 1 and axis_sizes.get(TP, 1) == 1
    if overlap.grad_bucket_mb > 0 and pp == 1:
        # In-backward buckets: TP-replicated leaves are reduced over (dp, tp) (see buckets).
        plan = buckets.plan_for_params(abstract, specs, axis_sizes, overlap, DP,
                                       model.num_layers, fsdp_leaves,
                                       replicated_axes=() if drop_tp else (TP,),
                                       use_rank=_block_use_order(model, abstract))
        for u in plan.units:
            if u.split_dim is not None:
                grad_specs[u.leaf] = buckets.with_axes(
                    spec_leaves[u.leaf], u.split_dim + int(u.layer is not None), u.axes,
                    len(leaves[u.leaf].shape))
    elif overlap.zero1:
        for i, (arr, spec) in enumerate(zip(leaves, spec_leaves)):
            if i in fsdp_leaves:
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
    return DpLayout(specs, grad_specs, jax.tree.unflatten(treedef, split), block_layout, plan)


def without_axis(specs: Any, axis: str) -> Any:
    """Every PartitionSpec of a tree with mesh `axis` left out of its entries."""

    def entry(e):
        kept = tuple(a for a in (() if e is None else e if isinstance(e, tuple) else (e,))
                     if a != axis)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return jax.tree.map(lambda s: P(*(entry(e) for e in s)), specs,
                        is_leaf=lambda x: isinstance(x, P))


def _block_use_order(model, abstract: dict) -> dict[int, int] | None:
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
    offset = min(_leaf_indices(abstract, "blocks"))
    return {offset + i: first.get(i, -1) for i in position.values()}


def _leaf_indices(tree: dict, key: str) -> frozenset[int]:
    """Indices (in `jax.tree.leaves` order) of the leaves under top-level `key`."""
    start = 0
    for k in sorted(tree):
        n = len(jax.tree.leaves(tree[k], is_leaf=lambda x: isinstance(x, P)))
        if k == key:
            return frozenset(range(start, start + n))
        start += n
    return frozenset()


def _mark_varying(tree: Any, specs: Any, axes: tuple[str, ...], dp_only=frozenset()) -> Any:
    """Leaves marked varying over each of `axes` they are stored replicated over (a leaf
    split over an axis already varies over it); leaves in `dp_only` over dp at most."""
    leaves, treedef = jax.tree.flatten(tree)
    spec_leaves = treedef.flatten_up_to(specs)
    out = []
    for i, (x, s) in enumerate(zip(leaves, spec_leaves)):
        present = _spec_axes(s)
        todo = tuple(a for a in ((DP,) if i in dp_only else axes) if a not in present)
        out.append(to_varying(x, todo))
    return jax.tree.unflatten(treedef, out)


def _spec_axes(spec) -> set[str]:
    from jax_overlap.overlap.buckets import spec_axes

    return set(spec_axes(tuple(spec)))


def make_loss_and_grads(model, cfg, mesh) -> Callable:
    """(params, batch) -> (mean loss, grads), both global; one shard_map over the mesh.

    pp > 1 runs the pipeline executor. Otherwise microbatches are accumulated with a scan and
    the dp reduction follows `cfg.overlap`:
      grad_bucket_mb 0: one reduction per leaf after the whole backward (the baseline);
      grad_bucket_mb > 0: the last microbatch runs with its layers unrolled and a bucket hook
        per bucket (`buckets.BucketHooks`), so each bucket's collective is issued inside that
        backward as soon as its last gradient exists;
      zero1: reductions are psum_scatter, gradients leave split over dp (`DpLayout`);
      param_sharding fsdp: blocks run through `fsdp.windowed_blocks` and are reduce-scattered
        per block in their backward; only embedding/head gradients go through buckets.
    """
    par = parallel_context(cfg)
    microbatches = cfg.pipeline.microbatches

    if cfg.mesh.pp > 1:
        from jax_overlap.pipeline import executor

        return executor.make_pipeline_loss_and_grads(model, cfg, mesh, par)

    from jax_overlap.overlap import fsdp

    ov = cfg.overlap
    axis_sizes = dict(mesh.shape)
    dp = axis_sizes[DP]
    layout = dp_layout(model, ov, axis_sizes)
    layers = _scan_layers(model, par)
    if layout.fsdp is not None:
        layers = fsdp.windowed_blocks(lambda p, x: model.block(p, x, par), layout.fsdp,
                                      ov.window, DP, dp, ov.grad_comm_dtype)
    fsdp_leaves = _leaf_indices(layout.param_specs, "blocks") if layout.fsdp else frozenset()
    # (tp=1: the layout names no tp, so nothing varies over it and no TP collective is left.)
    marked = (DP, TP) if layout.plan is not None and axis_sizes[TP] > 1 else (DP,)

    def per_device(params, batch):
        # Global divisor first, so every partial loss is already scaled to the global mean.
        count = _global_count(model, batch["targets"], dp)
        # Marked varying, parameters get per-device gradients and no implicit reduction:
        # over dp always; over tp too for in-backward buckets (TP-replicated leaves then
        # get partial sums that their bucket reduces over (dp, tp)).
        local_params = _mark_varying(params, layout.param_specs, marked, fsdp_leaves)

        def microbatch_step(carry, mb):
            loss_acc, grads_acc = carry
            loss, grads = jax.value_and_grad(
                lambda p: _loss_sum(model, p, mb, par, layers) / count)(local_params)
            return (loss_acc + loss, tree_add(grads_acc, grads)), None

        zero = (to_varying(jnp.zeros((), jnp.float32), (DP,)), tree_zeros_like(local_params))
        mbs = microbatched(batch, microbatches)
        if layout.plan is None:
            (loss, grads), _ = jax.lax.scan(microbatch_step, zero, mbs)
            leaves, treedef = jax.tree.flatten(grads)
            dims = treedef.flatten_up_to(layout.split_dims)
            todo = [i for i in range(len(leaves)) if i not in fsdp_leaves]
            reduced = reduce_grads_dp([leaves[i] for i in todo], cfg, [dims[i] for i in todo])
            for i, g in zip(todo, reduced):
                leaves[i] = g
            return jax.lax.psum(loss, DP), jax.tree.unflatten(treedef, leaves)

        earlier = jax.tree.map(lambda x: x[:-1], mbs)
        last = jax.tree.map(lambda x: x[-1], mbs)
        (loss, acc), _ = (jax.lax.scan(microbatch_step, zero, earlier) if microbatches > 1
                          else (zero, None))
        # The last microbatch's forward does not depend on the earlier ones; without the
        # barrier XLA may run it first and keep its activations alive through them.
        acc, local_params, last = jax.lax.optimization_barrier((acc, local_params, last))
        loss_last, grads = _bucketed_last_microbatch(
            model, par, layout, layers, local_params, acc, last, count, axis_sizes, marked,
            ov.grad_comm_dtype)
        return jax.lax.psum(loss + loss_last, DP), grads

    batch_in = {"inputs": P(DP), "targets": P(DP)}
    return shard_map(per_device, mesh, in_specs=(layout.param_specs, batch_in),
                     out_specs=(P(), layout.grad_specs))


def _global_count(model, targets, dp: int) -> jax.Array:
    """`model.loss_count` summed over dp. A count the data does not decide (tokens per
    batch) is a constant: dp times it, not an all-reduce that every rank waits on before its
    first loss; a data-dependent one (masked tokens) is psum'd."""
    with jax.ensure_compile_time_eval():
        local = model.loss_count(targets)
    return jax.lax.psum(local, DP) if isinstance(local, jax.core.Tracer) else local * dp


def _bucketed_last_microbatch(model, par, layout: DpLayout, layers, params, acc, mb, count,
                              axis_sizes: dict[str, int], marked: tuple[str, ...],
                              comm_dtype: str):
    """Loss and fully reduced gradients of the last microbatch, buckets issued in its backward.

    The layers are unrolled so that each bucket hook sits at its own layer (a scan body is
    one computation per layer and would have to finish each reduction inside it). The
    gradient is taken with respect to the bucket sinks (their gradients are the reduced
    buffers) and, under fsdp, the stored block shards (their gradients are reduce-scattered
    inside `fsdp.windowed_blocks`).
    """
    from jax_overlap.overlap import buckets

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
                x = model.block(subtree("blocks", layer), x, par)
        hooks.enter(model.num_layers + 1)
        return model.head_loss(subtree("embed"), subtree("head"), x, mb["targets"], par) / count

    sinks = buckets.make_sinks(plan, axis_sizes, marked)
    loss, (reduced, g_direct) = jax.value_and_grad(loss_fn, argnums=(0, 1))(sinks, direct)
    by_leaf = buckets.assemble(plan, reduced, axis_sizes)
    if layout.fsdp is not None:
        for i, g in enumerate(jax.tree.leaves(g_direct)):
            by_leaf[offsets["blocks"] + i] = acc_leaves[offsets["blocks"] + i] + g
    return loss, jax.tree.unflatten(treedef, [by_leaf[i] for i in range(len(leaves))])


def _global_norm(tree) -> jax.Array:
    tree_utils = getattr(optax, "tree", None)
    if tree_utils is not None and hasattr(tree_utils, "norm"):
        return tree_utils.norm(tree)
    return optax.global_norm(tree)


def make_train_step(model, cfg, mesh, optimizer: optax.GradientTransformation,
                    fault_hook: Callable | None = None, jit: bool = True) -> Callable:
    """Returns `step(state, batch) -> (state, metrics)`.

    Args:
      fault_hook: `(state, loss, grads) -> (loss, grads)` applied before the update (fault
        injection for drills and tests).
      jit: return the jitted step with the state donated; False gives the traceable function
        so callers (guards) can wrap it inside their own jit.
    """
    loss_and_grads = make_loss_and_grads(model, cfg, mesh)
    schedule = lr_schedule(cfg.train)
    # ZeRO-1 / FSDP: the gradients arrive split over dp and the optimizer state is stored
    # split the same way, so GSPMD runs the (elementwise) update on 1/dp of every leaf and
    # the constraint below all-gathers the updated parameters that are stored replicated.
    abstract_params = jax.eval_shape(model.init, jax.random.key(0))
    shardings = state_shardings(model, mesh, optimizer, abstract_params, cfg.overlap)

    def step(state: TrainState, batch):
        loss, grads = loss_and_grads(state.params, batch)
        if fault_hook is not None:
            loss, grads = fault_hook(state, loss, grads)
        grad_norm = _global_norm(grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        params = jax.lax.with_sharding_constraint(params, shardings.params)
        opt_state = jax.lax.with_sharding_constraint(opt_state, shardings.opt_state)
        new_state = state._replace(step=state.step + 1, params=params, opt_state=opt_state,
                                   version=state.version + 1)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state.step)}
        return new_state, metrics

    return jax.jit(step, donate_argnums=(0,)) if jit else step


def param_shardings(model, mesh, overlap=None) -> Any:
    """NamedSharding per parameter leaf; `overlap.param_sharding: fsdp` adds dp."""
    if overlap is not None:
        specs = dp_layout(model, overlap, dict(mesh.shape)).param_specs
    else:
        specs = tree_specs(model.param_axes(), rules_for(mesh.shape[PP]))
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs)


def state_shardings(model, mesh, optimizer, abstract_params, overlap=None) -> TrainState:
    """NamedShardings for every leaf of the train state.

    The optimizer state mirrors the gradients: like the parameters, except that ZeRO-1
    (`overlap.zero1`) splits every leaf's moments over dp. With pp > 1 the executor's
    gradients arrive whole (psum) and GSPMD slices them for the split update.
    """
    param_sh = param_shardings(model, mesh, overlap)
    grad_sh = param_sh
    if overlap is not None:
        grad_sh = jax.tree.map(lambda s: NamedSharding(mesh, s),
                               dp_layout(model, overlap, dict(mesh.shape)).grad_specs)
    replicated = NamedSharding(mesh, P())
    opt_abstract = jax.eval_shape(optimizer.init, abstract_params)
    opt_sh = optax.tree_map_params(optimizer, lambda _, s: s, opt_abstract, grad_sh,
                                   transform_non_params=lambda _: replicated)
    return TrainState(step=replicated, params=param_sh, opt_state=opt_sh, rng=replicated,
                      data_offset=replicated, version=replicated)


def init_state(model, cfg, mesh, optimizer) -> TrainState:
    """Initial state, created directly in its sharded layout (never whole on one device)."""
    from jax_overlap.training.state import new_state

    key = jax.random.key(cfg.train.seed)
    abstract_params = jax.eval_shape(model.init, key)
    shardings = state_shardings(model, mesh, optimizer, abstract_params, cfg.overlap)

    from jax_overlap.pipeline import layout

    perm = layout.layer_permutation(cfg, model.num_layers)

    def build():
        # Logical init (same values on every mesh), then the pipeline's staged layer order.
        params = layout.to_staged(model.init(jax.random.key(cfg.train.seed)), perm)
        return new_state(params, optimizer.init(params), cfg.train.seed)

    return jax.jit(build, out_shardings=shardings)()


def put_batch(batch_np: dict, mesh) -> dict:
    """Global numpy batch -> arrays split over dp; each process keeps its addressable shards."""
    sharding = NamedSharding(mesh, P(DP))
    return {k: jax.make_array_from_callback(v.shape, sharding, partial(_index, v))
            for k, v in batch_np.items()}


def _index(array, idx):
    return array[idx]
