"""The train step: loss and gradients (`grads` at pp = 1, the pipeline executor at pp > 1),
then the optimizer update on the global (sharded) arrays; the state's shardings and its
initial value.

Everything parallel comes from the `ParallelPlan` (`jax_overlap.plan`), built once per run.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_overlap.overlap import slow_strategy
from jax_overlap.parallel.mesh import DP, PP, data_spec, rules_for, tree_specs
from jax_overlap.pipeline import executor, layout
from jax_overlap.training import grads
from jax_overlap.training import loss_scale as loss_scale_lib
from jax_overlap.training import moe_stats
from jax_overlap.training.state import TrainState, new_state


def compute_dtype(precision: str):
    return {"bf16": jnp.bfloat16, "fp16": jnp.float16}.get(precision, jnp.float32)


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


def batch_specs(batch: Any, mesh=None) -> Any:
    """Every batch leaf split over the data axes of `mesh` ((dcn, dp), or dp)."""
    spec = P(DP) if mesh is None else data_spec(dict(mesh.shape))
    return jax.tree.map(lambda _: spec, batch)


def make_loss_and_grads(model, plan, mesh) -> Callable:
    """(params, batch) -> (mean loss, grads), both global: the pipeline executor when the plan
    has stages (pp > 1), else `grads.make_loss_and_grads`."""
    if plan.pipelined:
        return executor.make_pipeline_loss_and_grads(model, plan, mesh)
    return grads.make_loss_and_grads(model, plan, mesh)


def grad_out_specs(plan) -> Any:
    """Specs of the gradients `make_loss_and_grads` returns: the layout's gradient specs
    (ZeRO-1 splits) at pp = 1, the parameter specs from the pipeline executor."""
    return plan.layout.param_specs if plan.pipelined else plan.layout.grad_specs


def _global_norm(tree) -> jax.Array:
    tree_utils = getattr(optax, "tree", None)
    if tree_utils is not None and hasattr(tree_utils, "norm"):
        return tree_utils.norm(tree)
    return optax.global_norm(tree)


def make_train_step(model, plan, mesh, optimizer: optax.GradientTransformation,
                    lr: optax.Schedule | None = None, fault_hook: Callable | None = None,
                    jit: bool = True, loss_scale_growth_interval: int = 2000) -> Callable:
    """Returns `step(state, batch) -> (state, metrics)`.

    Args:
      plan: the run's `ParallelPlan` (built with `model`).
      lr: the learning-rate schedule, reported as the `lr` metric (omitted when None).
      fault_hook: `(state, loss, grads) -> (loss, grads)` applied before the update (fault
        injection for drills and tests).
      jit: return the jitted step with the state donated; False gives the traceable function
        so callers (guards) can wrap it inside their own jit.
      loss_scale_growth_interval: fp16 (a state with a `loss_scale`): clean steps before the
        scale doubles. An overflow step leaves params, optimizer state, `step` and `version`
        as they were, halves the scale and reports `overflow` (see `training.loss_scale`).
    """
    loss_and_grads = make_loss_and_grads(model, plan, mesh)
    # ZeRO-1 / FSDP: the gradients arrive split over dp and the optimizer state is stored
    # split the same way, so GSPMD runs the (elementwise) update on 1/dp of every leaf and
    # the constraint below all-gathers the updated parameters that are stored replicated.
    abstract_params = jax.eval_shape(model.init, jax.random.key(0))
    shardings = state_shardings(model, mesh, optimizer, abstract_params, plan.layout, plan)
    synchronous = partial(_synchronous_step, model, plan, mesh, optimizer, loss_and_grads,
                          shardings, lr, fault_hook, jit, loss_scale_growth_interval)
    parts = slow_strategy.StepParts(model, plan, mesh, optimizer, loss_and_grads, shardings,
                                    lr, fault_hook, jit, grad_out_specs(plan), synchronous)
    return slow_strategy.of(plan).make_train_step(parts)


def _synchronous_step(model, plan, mesh, optimizer, loss_and_grads, shardings, lr, fault_hook,
                      jit: bool, loss_scale_growth_interval: int,
                      exchange: slow_strategy.Exchange) -> Callable:
    """The step of one shared optimizer state (slow modes sync and delay): the gradient, the
    slow axis's `exchange` around the update, fp16 loss scaling, MoE statistics."""
    experts = getattr(getattr(model, "moe", None), "experts", 0)

    def step(state: TrainState, batch):
        ls = state.loss_scale
        if ls is None:
            loss, grads = loss_and_grads(state.params, batch)
        else:  # fp16: the backward of S x loss, divided back by S
            scaled = make_loss_and_grads(loss_scale_lib.ScaledLoss(model, ls.scale), plan, mesh)
            loss, grads = loss_scale_lib.unscale(*scaled(state.params, batch), ls.scale)
            finite = loss_scale_lib.all_finite(loss, grads)
            grads = jax.tree.map(lambda g: jnp.where(finite, g, jnp.zeros_like(g)), grads)
        # MoE router statistics (models/moe.py), out of the update
        grads, moe_metrics = moe_stats.take(grads, experts)
        if fault_hook is not None:
            loss, grads = fault_hook(state, loss, grads)
        # Delay: the norm of this step's own gradient (its per-dcn-group copies), so the
        # guard sees a bad gradient before it ever goes in flight.
        grad_norm = _global_norm(grads)
        fresh = grads
        grads, token = exchange.receive(state, grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        applied = jnp.ones((), jnp.int32)
        if ls is not None:  # an overflow step applies nothing
            params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                             (params, opt_state), (state.params, state.opt_state))
            applied = finite.astype(jnp.int32)
        params, opt_state, slow, slow_metrics = exchange.commit(state, token, fresh, updates,
                                                                params, opt_state)
        params = jax.lax.with_sharding_constraint(params, shardings.params)
        opt_state = jax.lax.with_sharding_constraint(opt_state, shardings.opt_state)
        if slow is not None:
            slow = jax.lax.with_sharding_constraint(slow, shardings.slow)
        new_state = state._replace(step=state.step + applied, params=params, opt_state=opt_state,
                                   version=state.version + applied, slow=slow)
        metrics = {"loss": loss, "grad_norm": grad_norm, **moe_metrics}
        if ls is not None:
            new_state = new_state._replace(loss_scale=loss_scale_lib.update(
                ls, finite, loss_scale_growth_interval))
            metrics.update(overflow=~finite, loss_scale=ls.scale)
        metrics.update(slow_metrics)
        if lr is not None:
            metrics["lr"] = lr(state.step)
        return new_state, metrics

    if not jit:
        return step
    # On a GPU the step fits (plan.compiler_options): XLA's remat pass would only clone GEMMs.
    return jax.jit(step, donate_argnums=(0,), compiler_options=plan.compiler_options() or None)


def param_shardings(model, mesh, layout=None) -> Any:
    """NamedSharding per parameter leaf: the plan's `layout` (fsdp adds dp), or the logical
    rules of the mesh when None."""
    if layout is not None:
        specs = layout.param_specs
    else:
        specs = tree_specs(model.param_axes(), rules_for(mesh.shape[PP]))
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs)


def state_shardings(model, mesh, optimizer, abstract_params, layout=None, plan=None,
                    loss_scaled: bool = False) -> TrainState:
    """NamedShardings for every leaf of the train state.

    The optimizer state mirrors the gradients: like the parameters, except that ZeRO-1
    (`plan.overlap.zero1`, in `layout.grad_specs`) splits every leaf's moments over dp. With
    pp > 1 the executor's gradients arrive whole (psum) and GSPMD slices them for the split
    update. With a `plan` whose slow axis carries state (`plan.slow_mode` delay / local), its
    shardings too.
    """
    param_sh = param_shardings(model, mesh, layout)
    grad_sh = param_sh
    if layout is not None:
        grad_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), layout.grad_specs)
    replicated = NamedSharding(mesh, P())
    opt_abstract = jax.eval_shape(optimizer.init, abstract_params)
    opt_sh = optax.tree_map_params(optimizer, lambda _, s: s, opt_abstract, grad_sh,
                                   transform_non_params=lambda _: replicated)
    slow = slow_strategy.of(plan)
    opt_sh = slow.opt_shardings(mesh, optimizer, abstract_params, grad_sh, opt_sh)
    scale_sh = (loss_scale_lib.LossScale(replicated, replicated, replicated) if loss_scaled
                else None)
    return TrainState(step=replicated, params=param_sh, opt_state=opt_sh, rng=replicated,
                      data_offset=replicated, version=replicated, loss_scale=scale_sh,
                      slow=slow.shardings(plan, mesh, optimizer, abstract_params, param_sh,
                                          None if plan is None else grad_out_specs(plan)))


def init_state(model, plan, mesh, optimizer, seed: int,
               loss_scale: loss_scale_lib.LossScale | None = None) -> TrainState:
    """Initial state, created directly in its sharded layout (never whole on one device):
    the logical init (same values on every mesh), then the plan's staged layer order.
    `loss_scale`: fp16's initial `LossScale` (`loss_scale.initial(cfg.train)`)."""
    abstract_params = jax.eval_shape(model.init, jax.random.key(seed))
    shardings = state_shardings(model, mesh, optimizer, abstract_params, plan.layout, plan,
                                loss_scaled=loss_scale is not None)

    slow = slow_strategy.of(plan)

    def build():
        params = layout.to_staged(model.init(jax.random.key(seed)), plan.layer_perm)
        return new_state(params, slow.init_opt(plan, params, optimizer), seed, loss_scale,
                         slow.init(plan, params, optimizer))

    return jax.jit(build, out_shardings=shardings)()


def put_batch(batch_np: dict, mesh) -> dict:
    """Global numpy batch -> arrays split over (dcn, dp); each process keeps its addressable
    shards."""
    sharding = NamedSharding(mesh, data_spec(dict(mesh.shape)))
    return {k: jax.make_array_from_callback(v.shape, sharding, partial(_index, v))
            for k, v in batch_np.items()}


def _index(array, idx):
    return array[idx]
