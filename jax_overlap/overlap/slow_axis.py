"""The slow axis: data parallelism across hosts (or slices) whose link is far slower than the
links inside one.

The mesh gains an outermost 'dcn' axis (`mesh.dcn > 1`); the batch is split over (dcn, dp).
Every gradient reduction of the step -- buckets, ZeRO-1's scatter, FSDP's reduce-scatter, the
pipeline's after-the-loop reduction -- goes through `buckets.reduce_flat`, which calls
`reduce` here: when the buffer varies over dcn (its gradients are per dcn group), the sum is
hierarchical, with explicit collectives

    psum_scatter over the fast axes (dp, and tp for TP-replicated leaves)   N -> N/f
    psum over dcn, on the 1/f slice                                         N/f crosses dcn
    all_gather over the fast axes                                           N/f -> N

and a ZeRO-1 / FSDP scatter simply stops after the dcn psum of its slice (the optimizer
state is split over dp and replicated over dcn). Only 1/f of the bytes cross the slow link.

Two modes leave the dcn reduction out of the step (`slow_mode` of the plan):

* "delay" (`overlap.dcn_delay: 1`): the step returns its gradients reduced over the fast axes
  only, one copy per dcn group (a leading dcn dim); the train step sums the previous step's
  copies over dcn (`dcn_sum`, a psum with no data dependency on this step's compute, so XLA
  runs it under the forward and backward) and applies them one step late (`delay.py`).
* "local" (Streaming DiLoCo, `diloco.py`): every dcn group has its own parameters (leading
  dcn dim); the step never reduces over dcn, the outer sync moves parameters instead.

`slow_strategy.py` puts the modes behind one interface that the train step calls.

Tracing under `deferred(True)` is what makes `reduce` skip the dcn psum; `wrap_step`
applies it, and the leading-dim plumbing, to a step's per-device body.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_overlap.parallel.compat import (
    all_gather_invariant,
    axis_size,
    shard_map,
    varying_axes,
)
from jax_overlap.parallel.mesh import DCN

_DEFER = contextvars.ContextVar("jax_overlap_defer_dcn", default=False)
_DTYPE = contextvars.ContextVar("jax_overlap_dcn_dtype", default="fp32")


@contextlib.contextmanager
def deferred(flag: bool = True, dtype: str | None = None):
    """While tracing inside it, gradient reductions leave out dcn (see the module docstring);
    `dtype` ("fp32" / "bf16"): what the bytes crossing dcn travel in."""
    token = _DEFER.set(bool(flag))
    dtoken = _DTYPE.set(dtype or _DTYPE.get())
    try:
        yield
    finally:
        _DEFER.reset(token)
        _DTYPE.reset(dtoken)


def deferring() -> bool:
    return _DEFER.get()


def _over_dcn(x: jax.Array) -> jax.Array:
    """psum over dcn, in the slow axis's dtype (`deferred(dtype=...)`)."""
    if _DTYPE.get() == "bf16" and x.dtype == jnp.float32:
        return jax.lax.psum(x.astype(jnp.bfloat16), DCN).astype(jnp.float32)
    return jax.lax.psum(x, DCN)


def crosses_dcn(x: jax.Array) -> bool:
    """Whether a gradient buffer still has to be summed over dcn in this step."""
    return DCN in varying_axes(x) and not deferring()


def over_dcn(x: jax.Array) -> jax.Array:
    """A gradient already summed over the fast axes (rows stored split over dp: the
    experts), summed over dcn where it still crosses it (`crosses_dcn`)."""
    return _over_dcn(x) if crosses_dcn(x) else x


def reduce(x: jax.Array, axes, scatter: bool) -> jax.Array:
    """The sum of `x` over the fast `axes` (and dcn where `crosses_dcn`), hierarchically.

    Args:
      x: (N,) to psum, or (parts, N/parts) to psum_scatter over `axes` (row r to rank r).
      axes: the fast axes of the reduction (never dcn).
      scatter: psum_scatter (ZeRO-1, FSDP) instead of psum.

    Returns:
      (N,) summed, or this rank's (N/parts,) row summed.
    """
    slow = crosses_dcn(x)
    if scatter:
        x = jax.lax.psum_scatter(x, axes, scatter_dimension=0, tiled=False)  # (N/parts,), fast
        return _over_dcn(x) if slow else x  # (N/parts,) per device, over dcn
    if not slow:
        return jax.lax.psum(x, axes)  # (N,) per device, over the fast axes
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    fast = math.prod(axis_size(a) for a in axes)
    if fast == 1:
        return _over_dcn(jax.lax.psum(x, axes))  # (N,), over dcn
    n = x.shape[0]
    pad = (-n) % fast
    rows = jnp.pad(x, (0, pad)).reshape(fast, (n + pad) // fast)
    part = jax.lax.psum_scatter(rows, axes, scatter_dimension=0, tiled=False)  # (N/f,), fast
    part = _over_dcn(part)  # (N/f,) per device, over dcn: the only slow bytes
    full = all_gather_invariant(part, axes, axis=0, tiled=True)  # (N,), over the fast axes
    return full[:n]


def sink_axes(marked: tuple[str, ...]) -> tuple[str, ...]:
    """The axes a reduced bucket still varies over, of the `marked` ones it is not summed
    over: dcn drops out unless the reduction is deferred."""
    return tuple(a for a in marked if a != DCN or deferring())


# ---------------------------------------------------------------------------------------------
# The step's shard_map in the slow modes


def stacked_spec(spec: P) -> P:
    """The spec of a per-dcn-group copy of a leaf: a leading dim split over dcn."""
    return P(DCN, *tuple(spec))


def wrap_step(body: Callable, mesh, param_specs: Any, grad_specs: Any, batch_specs: Any,
              mode: str, dtype: str = "fp32") -> Callable:
    """`shard_map` of a step body `(params, batch) -> (loss, grads)` for the plan's slow mode.

    Args:
      body: the per-device step (traced under `deferred` in the modes without a dcn
        reduction).
      mesh: the mesh; param_specs, grad_specs, batch_specs: the body's own specs.
      mode: "none" / "sync": the plain shard_map; "delay": grads come out with a leading
        dcn dim (one copy per dcn group); "local": params go in and grads come out with it.
      dtype: what the bytes crossing dcn travel in ("sync").
    """
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    if mode in ("none", "sync"):
        def synced(params, batch):
            with deferred(False, dtype):
                return body(params, batch)

        return shard_map(synced, mesh, in_specs=(param_specs, batch_specs),
                         out_specs=(P(), grad_specs))
    out_grads = jax.tree.map(stacked_spec, grad_specs, is_leaf=is_spec)
    in_params = (jax.tree.map(stacked_spec, param_specs, is_leaf=is_spec) if mode == "local"
                 else param_specs)

    def per_device(params, batch):
        if mode == "local":
            params = jax.tree.map(lambda x: x[0], params)  # (1, ...) -> this group's copy
        with deferred(True):
            loss, grads = body(params, batch)
        return loss, jax.tree.map(lambda g: g[None], grads)

    return shard_map(per_device, mesh, in_specs=(in_params, batch_specs),
                     out_specs=(P(), out_grads))


def dcn_sum(tree: Any, mesh, specs: Any, comm_dtype: str = "fp32") -> Any:
    """Per-dcn-group copies (leading dcn dim) -> their sum over dcn, hierarchically.

    Leaves of one type (the axes they vary over) go into one flat buffer. A buffer that is
    replicated over dp (a psum'd gradient) is cut into dp slices; each rank sums its own
    slice over dcn and the slices are all-gathered over dp, so 1/dp of the bytes cross dcn.
    A buffer already split over dp (ZeRO-1) is psum'd over dcn as it is.

    Args:
      tree: leaves (dcn, ...) laid out as `stacked_spec(spec)`.
      mesh: the mesh; specs: each leaf's spec without the dcn dim.
      comm_dtype: "fp32" or "bf16", what crosses dcn.
    """
    from jax_overlap.parallel.mesh import DP

    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    dp = dict(mesh.shape).get(DP, 1)

    def per_device(t):
        leaves, treedef = jax.tree.flatten(t)
        leaves = [x[0] for x in leaves]  # (1, ...) -> this group's copy
        groups: dict[frozenset, list[int]] = {}
        for i, x in enumerate(leaves):
            groups.setdefault(varying_axes(x), []).append(i)
        out: list[Any] = [None] * len(leaves)
        for axes, members in groups.items():
            flat = jnp.concatenate([leaves[i].reshape(-1) for i in members])
            if comm_dtype == "bf16":
                flat = flat.astype(jnp.bfloat16)
            if DP in axes or dp == 1:
                summed = jax.lax.psum(flat, DCN)  # (N,) per device, over dcn
            else:
                n = flat.shape[0]
                pad = (-n) % dp
                rows = jnp.pad(flat, (0, pad)).reshape(dp, (n + pad) // dp)
                mine = rows[jax.lax.axis_index(DP)]  # (N/dp,): this dp rank's slice
                mine = jax.lax.psum(mine, DCN)  # (N/dp,) per device, over dcn
                summed = all_gather_invariant(mine, DP, axis=0, tiled=True)[:n]  # (N,), dp
            start = 0
            for i in members:
                size = leaves[i].size
                out[i] = summed[start:start + size].reshape(leaves[i].shape).astype(
                    leaves[i].dtype)
                start += size
        return jax.tree.unflatten(treedef, out)

    return shard_map(per_device, mesh,
                     in_specs=(jax.tree.map(stacked_spec, specs, is_leaf=is_spec),),
                     out_specs=specs)(tree)


def slow_bytes(grad_bytes: int, dp_fast: int, dcn: int) -> float:
    """Bytes one device sends across dcn per full gradient reduction (ring all-reduce over
    dcn of its 1/dp_fast slice): 2 (dcn - 1) / dcn of the slice."""
    if dcn <= 1:
        return 0.0
    return 2.0 * (dcn - 1) / dcn * grad_bytes / max(1, dp_fast)


def exposed_s(plan, step_time_s: float) -> float:
    """Estimated seconds per step the slow link adds to the step: the transfer time of
    `plan.slow_bytes_per_step` at `plan.dcn_bytes_per_s`, less the compute it hides under
    (none for the synchronous reduction, which follows the backward; the whole step for the
    delayed reduction and DiLoCo's outer sync, which depend on no compute of the step)."""
    transfer = plan.slow_bytes_per_step / plan.dcn_bytes_per_s
    if plan.slow_mode == "sync":
        return transfer
    return max(0.0, transfer - step_time_s)


def step_record(plan, step_time_s: float, metrics: dict) -> dict:
    """The slow-axis fields of a step's metrics.jsonl record (empty without dcn)."""
    if plan.dcn == 1:
        return {}
    out = {"dcn_delay": plan.overlap.dcn_delay if plan.diloco is None else 0,
           "dcn_exposed_s": exposed_s(plan, step_time_s)}
    for key in ("dcn_applied", "diloco_issued", "diloco_landed"):
        if key in metrics:
            out[key] = metrics[key].item() if hasattr(metrics[key], "item") else metrics[key]
    return out


# ---------------------------------------------------------------------------------------------
# Staleness, decided: does each bucket's dcn transfer fit under the compute after it?


def bucket_timeline(ready_s: list[float], transfer_s: list[float], backward_end_s: float
                    ) -> list[float]:
    """Per bucket (in issue order), how long before the backward's end its dcn transfer
    finishes (negative: after it, exposed), on one FIFO stream over the slow link."""
    out, free = [], 0.0
    for ready, t in zip(ready_s, transfer_s):
        free = max(free, ready) + t
        out.append(backward_end_s - free)
    return out


def decide(ready_s: list[float], nbytes: list[float], dcn: int, bytes_per_s: float,
           backward_end_s: float, step_s: float, dtype: str, delay) -> tuple[str, int, list]:
    """The slow axis's dtype and delay for `auto` knobs, with one line per decision.

    Each bucket's dcn bytes (`nbytes`, the 1/dp slice, fp32) travel at `bytes_per_s` as a
    ring all-reduce over dcn, queued behind the buckets before it. If the last one finishes
    after the backward, bf16 halves the bytes (dtype auto); if even that is exposed and it
    fits under a whole step, the reduction goes one step late (delay auto).
    """
    ring = 2 * (dcn - 1) / dcn

    def slack(size):
        return bucket_timeline(ready_s, [ring * b * size / 4 / bytes_per_s for b in nbytes],
                               backward_end_s)

    lines = []
    fp32 = slack(4)
    late = [i for i, s in enumerate(fp32) if s < 0]
    chosen = dtype
    if dtype == "auto":
        chosen = "bf16" if late else "fp32"
        lines.append(
            f"dcn_comm_dtype={chosen}: " + (
                f"{len(late)} of {len(nbytes)} buckets' fp32 dcn transfers end after the "
                f"backward (worst {-min(fp32) * 1e3:.2f} ms)" if late else
                f"every bucket's fp32 dcn transfer ends under the backward (least slack "
                f"{min(fp32) * 1e3:.2f} ms)"))
    chosen_delay = delay
    if delay == "auto":
        left = slack(2 if chosen == "bf16" else 4)
        total = ring * sum(nbytes) * (2 if chosen == "bf16" else 4) / 4 / bytes_per_s
        chosen_delay = 1 if min(left) < 0 else 0
        lines.append(
            f"dcn_delay={chosen_delay}: " + (
                f"still {-min(left) * 1e3:.2f} ms exposed in {chosen}; one step late the "
                f"{total * 1e3:.2f} ms transfer runs under a {step_s * 1e3:.2f} ms step"
                if chosen_delay else f"nothing exposed in {chosen}"))
    return chosen, int(chosen_delay), lines
