"""Streaming DiLoCo over the slow axis (Douillard et al. 2023; Streaming DiLoCo,
arXiv 2501.18512).

Every dcn group trains its own copy of the parameters (the *local* parameters, a leading
dcn dim, in `OuterState.local`) with the inner optimizer; inside a group dp / pp / tp work
as always, and no gradient ever crosses dcn. `TrainState.params` holds the *global*
parameters, the same in every group; `TrainState.opt_state` the groups' inner optimizer
states (leading dcn dim).

The parameters are split into `fragments` (each device's stacked block layers cut into F
equal runs; the embedding goes with fragment 0, the head with the last). Fragment f is
synced every H = `inner_steps` steps, fragment f + 1 `H / F` steps after it:

  issue  at step t (t > 0, t % (H/F) == 0, f = (t / (H/F) - 1) mod F): the outer gradient
         Delta = mean over dcn of (global - local) on f, taken from the state's values, so it
         depends on nothing step t computes; then outer Nesterov SGD on the global
         fragment (momentum mu, lr):  m = mu m + Delta;  global -= lr (Delta + mu m).
  land   at step t + tau, after that step's inner update: local = mix local + (1 - mix)
         global on f (tau = `delay`; `mix` is the paper's alpha).

The mean over dcn is hierarchical: a fragment buffer replicated over dp is cut into dp slices,
each rank sends its slice across dcn, and the slices are all-gathered over dp. The outer
gradient crosses in fp32, bf16, or int8: a scale per fragment buffer (the absmax over dcn /
127), each group's int8 values all-gathered over dcn and summed in fp32. The int8 error per
element is at most scale / 2 per group, so |mean error| <= absmax(Delta) / 254.

Which fragment a step issues / lands is data (`lax.switch` on the traced step), so one
program serves every step; its collectives sit in the switch's branch. On a CPU target the
step's compute waits for the sync (an optimization barrier): XLA's CPU runtime may otherwise
run the branch's collectives and the step's in different orders on different devices, a
rendezvous deadlock.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_overlap.overlap import slow_axis
from jax_overlap.parallel.compat import all_gather_invariant, shard_map, varying_axes
from jax_overlap.parallel.mesh import DCN, DP

_is_spec = lambda x: isinstance(x, P)  # noqa: E731


class OuterState(NamedTuple):
    """DiLoCo's part of the train state.

    Attributes:
      local: each dcn group's parameters (leading dcn dim), staged layout.
      momentum: the outer Nesterov momentum, parameter layout (same in every group).
    """

    local: Any
    momentum: Any


# ------------------------------------------------------------------------------ the schedule


def issued(d, t):
    """Fragment issued at step `t` (an int, or traced), -1 for none."""
    period = d.period
    if isinstance(t, int):
        return (t // period - 1) % d.fragments if t > 0 and t % period == 0 else -1
    on = (t > 0) & (t % period == 0)
    return jnp.where(on, (t // period - 1) % d.fragments, -1).astype(jnp.int32)


def landed(d, t):
    """Fragment whose sync lands at step `t` (issued at t - delay), -1 for none."""
    return issued(d, t - d.delay)


# ------------------------------------------------------------------------ state and layout


def _stacked(mesh, spec: P) -> NamedSharding:
    return NamedSharding(mesh, slow_axis.stacked_spec(spec))


def shardings(plan, mesh, optimizer, abstract_params, param_sh) -> OuterState:
    """Shardings of `OuterState` (the inner optimizer state's: `opt_shardings`)."""
    del optimizer, abstract_params
    local = jax.tree.map(lambda s: _stacked(mesh, s.spec), param_sh)
    return OuterState(local, param_sh)


def opt_shardings(mesh, optimizer, abstract_params, grad_sh) -> Any:
    """The groups' inner optimizer states: the usual shardings with a leading dcn dim."""
    opt_abstract = jax.eval_shape(optimizer.init, abstract_params)
    stacked_grad = jax.tree.map(lambda s: _stacked(mesh, s.spec), grad_sh)
    return optax.tree_map_params(optimizer, lambda _, s: s, opt_abstract, stacked_grad,
                                 transform_non_params=lambda _: NamedSharding(mesh, P(DCN)))


def init(plan, params, optimizer) -> OuterState:
    """Every group starts from the global parameters; momentum zero."""
    local = jax.tree.map(lambda p: jnp.broadcast_to(p, (plan.dcn, *p.shape)), params)
    return OuterState(local, jax.tree.map(jnp.zeros_like, params))


def init_opt(plan, params, optimizer) -> Any:
    local = jax.tree.map(lambda p: jnp.broadcast_to(p, (plan.dcn, *p.shape)), params)
    return jax.vmap(optimizer.init)(local)


# ------------------------------------------------------------------------------- fragments


def _pieces(tree: dict, f: int, fragments: int) -> list[tuple[tuple, Any]]:
    """(path, index) of fragment f's pieces of a per-device {'embed','blocks','head'} tree:
    a run of the stacked layers of every 'blocks' leaf, the embedding with fragment 0, the
    head with the last."""
    out = []
    for key in sorted(tree):
        leaves = jax.tree.leaves(tree[key])
        for i, leaf in enumerate(leaves):
            if key == "blocks":
                n = leaf.shape[0] // fragments
                out.append(((key, i), (f * n, n)))
            elif (key == "embed" and f == 0) or (key == "head" and f == fragments - 1) or (
                    key not in ("embed", "blocks", "head") and f == 0):
                out.append(((key, i), None))
    return out


def _get(tree, path, index):
    leaf = jax.tree.leaves(tree[path[0]])[path[1]]
    return leaf if index is None else jax.lax.dynamic_slice_in_dim(leaf, index[0], index[1], 0)


def _set(tree, path, index, value):
    key, i = path
    leaves, treedef = jax.tree.flatten(tree[key])
    leaves = list(leaves)
    leaves[i] = value if index is None else jax.lax.dynamic_update_slice_in_dim(
        leaves[i], value.astype(leaves[i].dtype), index[0], 0)
    return {**tree, key: jax.tree.unflatten(treedef, leaves)}


def dcn_mean(flat: jax.Array, dp: int, dcn: int, dtype: str) -> jax.Array:
    """Mean over dcn of a flat per-group buffer, hierarchically over dp when it is
    replicated over dp; in `dtype` ("fp32", "bf16", "int8") across dcn."""
    n = flat.shape[0]
    sliced = DP not in varying_axes(flat) and dp > 1
    if sliced:
        pad = (-n) % dp
        flat = jnp.pad(flat, (0, pad)).reshape(dp, (n + pad) // dp)[jax.lax.axis_index(DP)]
    if dtype == "int8":
        scale = jax.lax.pmax(jnp.max(jnp.abs(flat)), DCN) / 127.0 + 1e-30  # () over dcn
        q = jnp.round(flat / scale).astype(jnp.int8)
        every = all_gather_invariant(q, DCN, axis=0, tiled=False)  # (dcn, n) int8, over dcn
        mean = every.astype(jnp.float32).sum(0) * scale / dcn
    else:
        x = flat.astype(jnp.bfloat16) if dtype == "bf16" else flat
        mean = jax.lax.psum(x, DCN).astype(jnp.float32) / dcn  # (n,) per device, over dcn
    if sliced:
        mean = all_gather_invariant(mean, DP, axis=0, tiled=True)[:n]  # (N,), over dp
    return mean


def _outer_sync(d, dp: int, dcn: int, f: int, params, local, momentum):
    """Issue fragment f: outer gradient over dcn, Nesterov step on the global fragment."""
    pieces = _pieces(params, f, d.fragments)
    deltas = [(_get(params, p, i) - _get(local, p, i)) for p, i in pieces]
    groups: dict[frozenset, list[int]] = {}
    for k, x in enumerate(deltas):
        groups.setdefault(varying_axes(x) - {DCN}, []).append(k)
    for members in groups.values():
        flat = jnp.concatenate([deltas[k].reshape(-1).astype(jnp.float32) for k in members])
        mean = dcn_mean(flat, dp, dcn, d.outer_dtype)
        start = 0
        for k in members:
            (p, i), size = pieces[k], deltas[k].size
            g = mean[start:start + size].reshape(deltas[k].shape)
            start += size
            m = d.outer_momentum * _get(momentum, p, i) + g
            new = _get(params, p, i) - d.outer_lr * (g + d.outer_momentum * m)
            params = _set(params, p, i, new)
            momentum = _set(momentum, p, i, m)
    return params, momentum


def _land(d, f: int, params, local):
    for p, i in _pieces(params, f, d.fragments):
        merged = d.mix * _get(local, p, i) + (1.0 - d.mix) * _get(params, p, i)
        local = _set(local, p, i, merged)
    return local


def make_outer(plan, mesh) -> tuple[Callable, Callable]:
    """(issue, land) on the global arrays: `issue(step, params, local, momentum) -> (params,
    momentum)`, `land(step, params, local) -> local`, each one shard_map with a
    `lax.switch` over the fragments (branch 0: nothing this step)."""
    d = plan.diloco
    sizes = dict(mesh.shape)
    dp, dcn = sizes.get(DP, 1), sizes[DCN]
    pspecs = plan.layout.param_specs
    lspecs = jax.tree.map(slow_axis.stacked_spec, pspecs, is_leaf=_is_spec)

    def issue_body(f, params, local, momentum):
        local = jax.tree.map(lambda x: x[0], local)
        branches = [lambda p, l, m: (p, m)] + [
            (lambda k: lambda p, l, m: _outer_sync(d, dp, dcn, k, p, l, m))(k)
            for k in range(d.fragments)]
        return jax.lax.switch(f + 1, branches, params, local, momentum)

    def land_body(f, params, local):
        local = jax.tree.map(lambda x: x[0], local)
        branches = [lambda p, l: l] + [(lambda k: lambda p, l: _land(d, k, p, l))(k)
                                        for k in range(d.fragments)]
        out = jax.lax.switch(f + 1, branches, params, local)
        return jax.tree.map(lambda x: x[None], out)

    issue_sm = shard_map(issue_body, mesh, in_specs=(P(), pspecs, lspecs, pspecs),
                         out_specs=(pspecs, pspecs))
    land_sm = shard_map(land_body, mesh, in_specs=(P(), pspecs, lspecs), out_specs=lspecs)

    def issue(step, params, local, momentum):
        return issue_sm(issued(d, step), params, local, momentum)

    def land(step, params, local):
        return land_sm(landed(d, step), params, local)

    return issue, land


# ------------------------------------------------------------------------------ the step


def make_train_step(model, plan, mesh, optimizer, loss_and_grads, shardings, lr, fault_hook,
                    jit: bool) -> Callable:
    """The DiLoCo train step (same contract as `step.make_train_step`'s): inner step on each
    group's local parameters, the fragment sync of the step issued from the state's values,
    the landing after the inner update. Metrics add `diloco_issued` / `diloco_landed`
    (fragment, -1 for none)."""
    del model
    issue, land = make_outer(plan, mesh)
    d = plan.diloco
    ordered = not plan.target.accelerator

    def step(state, batch):
        outer: OuterState = state.slow
        # The sync: from the state only, so it depends on nothing this step computes.
        params, momentum = issue(state.step, state.params, outer.local, outer.momentum)
        local_in = outer.local
        if ordered:
            # XLA's CPU runtime may run a conditional's collectives and the step's own in a
            # different order on different devices (a rendezvous deadlock): there the step
            # waits for the sync. Accelerators keep them independent.
            params, momentum, local_in = jax.lax.optimization_barrier(
                (params, momentum, local_in))
        loss, grads = loss_and_grads(local_in, batch)  # grads: (dcn, ...) per group
        # Scaled to the global batch; the inner optimizer steps on the group's own mean
        # gradient (clipping sees one group's gradient, as on one device on its data).
        grads = jax.tree.map(lambda g: g * plan.dcn, grads)
        if fault_hook is not None:
            loss, grads = fault_hook(state, loss, grads)
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32)))
                                 for g in jax.tree.leaves(grads)) / plan.dcn)
        updates, opt_state = jax.vmap(optimizer.update)(grads, state.opt_state, outer.local)
        local = optax.apply_updates(outer.local, updates)
        local = land(state.step, params, local)
        local = jax.lax.with_sharding_constraint(local, shardings.slow.local)
        params = jax.lax.with_sharding_constraint(params, shardings.params)
        opt_state = jax.lax.with_sharding_constraint(opt_state, shardings.opt_state)
        new_state = state._replace(step=state.step + 1, params=params, opt_state=opt_state,
                                   version=state.version + 1,
                                   slow=OuterState(local, momentum))
        metrics = {"loss": loss, "grad_norm": grad_norm,
                   "diloco_issued": issued(d, state.step), "diloco_landed": landed(d, state.step)}
        if lr is not None:
            metrics["lr"] = lr(state.step)
        return new_state, metrics

    return jax.jit(step, donate_argnums=(0,)) if jit else step
