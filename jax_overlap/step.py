"""The train step: per-device loss and gradients in one `shard_map`, then the optimizer.

Data flow of one step on a (dp, pp, tp) mesh:
  batch (B, ...) split over dp -> microbatches -> model (TP collectives inside blocks)
  -> gradients, explicitly summed over dp -> optax update on the global (sharded) arrays.

The DP reduction is ours, not autodiff's: parameters are marked dp-varying before
differentiation, so JAX's implicit reductions do not fire and we choose where each `psum` goes.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_overlap.collectives import Parallel, to_varying
from jax_overlap.mesh import DP, PP, TP, rules_for, tree_specs
from jax_overlap.train_state import TrainState, step_rng


def shard_map(f, mesh, in_specs, out_specs):
    """`jax.shard_map` (0.12) or its experimental home (0.11)."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    from jax.experimental.shard_map import shard_map as legacy

    return legacy(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


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


def _loss_sum(model, params, batch, par: Parallel):
    x = model.embed(params["embed"], batch["inputs"], par)

    def layer(x, p_layer):
        return model.block(p_layer, x, par), None

    x, _ = jax.lax.scan(layer, x, params["blocks"])
    return model.head_loss(params["embed"], params["head"], x, batch["targets"], par)


def reference_loss(model, params, batch) -> jax.Array:
    """Mean loss on one device, no collectives: the ground truth every mesh must reproduce."""
    return _loss_sum(model, params, batch, Parallel()) / model.loss_count(batch["targets"])


def reduce_grads_dp(grads, cfg) -> Any:
    """Sums per-replica gradients over dp (the overlap engine may replace this by buckets)."""
    from jax_overlap import buckets

    return buckets.reduce_gradients(grads, cfg.overlap, DP)


def make_loss_and_grads(model, cfg, mesh) -> Callable:
    """(params, batch) -> (mean loss, grads), both global; one shard_map over the mesh.

    pp > 1 runs the pipeline executor; otherwise microbatches are accumulated with a scan.
    """
    par = parallel_context(cfg)
    param_specs = tree_specs(model.param_axes(), rules_for(cfg.mesh.pp))
    microbatches = cfg.pipeline.microbatches

    if cfg.mesh.pp > 1:
        from jax_overlap.pipeline import executor

        return executor.make_pipeline_loss_and_grads(model, cfg, mesh, par)

    def per_device(params, batch):
        # Global divisor first, so every partial loss is already scaled to the global mean.
        count = jax.lax.psum(model.loss_count(batch["targets"]), DP)
        local_params = to_varying(params, (DP,))

        def microbatch_step(carry, mb):
            loss_acc, grads_acc = carry
            loss, grads = jax.value_and_grad(
                lambda p: _loss_sum(model, p, mb, par) / count)(local_params)
            return (loss_acc + loss, tree_add(grads_acc, grads)), None

        zero = (to_varying(jnp.zeros((), jnp.float32), (DP,)), tree_zeros_like(local_params))
        (loss, grads), _ = jax.lax.scan(microbatch_step, zero, microbatched(batch, microbatches))
        return jax.lax.psum(loss, DP), reduce_grads_dp(grads, cfg)

    batch_in = {"inputs": P(DP), "targets": P(DP)}
    return shard_map(per_device, mesh, in_specs=(param_specs, batch_in),
                     out_specs=(P(), param_specs))


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

    def step(state: TrainState, batch):
        loss, grads = loss_and_grads(state.params, batch)
        if fault_hook is not None:
            loss, grads = fault_hook(state, loss, grads)
        grad_norm = _global_norm(grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new_state = state._replace(step=state.step + 1, params=params, opt_state=opt_state,
                                   version=state.version + 1)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state.step)}
        return new_state, metrics

    return jax.jit(step, donate_argnums=(0,))


def param_shardings(model, mesh) -> Any:
    rules = rules_for(mesh.shape[PP])
    return jax.tree.map(lambda s: NamedSharding(mesh, s), tree_specs(model.param_axes(), rules))


def state_shardings(model, mesh, optimizer, abstract_params) -> TrainState:
    """NamedShardings for every leaf of the train state (optimizer state mirrors params)."""
    param_sh = param_shardings(model, mesh)
    replicated = NamedSharding(mesh, P())
    opt_abstract = jax.eval_shape(optimizer.init, abstract_params)
    opt_sh = optax.tree_map_params(optimizer, lambda _, s: s, opt_abstract, param_sh,
                                   transform_non_params=lambda _: replicated)
    return TrainState(step=replicated, params=param_sh, opt_state=opt_sh, rng=replicated,
                      data_offset=replicated, version=replicated)


def init_state(model, cfg, mesh, optimizer) -> TrainState:
    """Initial state, created directly in its sharded layout (never whole on one device)."""
    from jax_overlap.train_state import new_state

    key = jax.random.key(cfg.train.seed)
    abstract_params = jax.eval_shape(model.init, key)
    shardings = state_shardings(model, mesh, optimizer, abstract_params)

    from jax_overlap.pipeline import layout

    perm = layout.layer_permutation(cfg)

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
