"""The JAX APIs whose spelling changed between 0.11 and 0.12, in one place.

Everything else in the package calls these instead of probing `jax` itself, so supporting a new
JAX release means editing this module only.
"""

from __future__ import annotations

import functools
from typing import Any

import jax


def shard_map(f, mesh, in_specs, out_specs):
    """`jax.shard_map` (0.12) or its experimental home (0.11)."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    from jax.experimental.shard_map import shard_map as legacy

    return legacy(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


def to_varying(tree: Any, axes: tuple[str, ...]) -> Any:
    """Marks values as device-varying over `axes` (so autodiff leaves their reductions to us).

    jax >= 0.12 spells it `pcast(..., to='varying')`; 0.11 has `pvary`.
    """
    if not axes:
        return tree
    if hasattr(jax.lax, "pcast"):
        return jax.tree.map(lambda x: jax.lax.pcast(x, axes, to="varying"), tree)
    return jax.tree.map(lambda x: jax.lax.pvary(x, axes), tree)


def varying_axes(x: jax.Array) -> frozenset[str]:
    """Mesh axes a value inside shard_map varies over (`aval.mat.varying` on jax 0.12,
    `aval.vma` before)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    if mat is not None and hasattr(mat, "varying"):
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", frozenset()))


def vary_like(x: jax.Array, *refs: jax.Array) -> jax.Array:
    """`x` marked varying over every axis any of `refs` varies over (a loop carry created
    from constants must have the type the loop body gives it)."""
    want = frozenset().union(*(varying_axes(r) for r in refs))
    return to_varying(x, tuple(sorted(want - varying_axes(x))))


def sum_to_type(ct: jax.Array, primal: jax.Array) -> jax.Array:
    """A cotangent summed over the mesh axes it varies over and its primal does not (what
    autodiff does for an implicit pvary), so a custom VJP returns the primal's type."""
    extra = tuple(sorted(varying_axes(ct) - varying_axes(primal)))
    return jax.lax.psum(ct, extra) if extra else ct


def axis_size(axis: str) -> int:
    """Static size of a mesh axis inside shard_map (`axis_size` is missing on old JAX)."""
    if hasattr(jax.lax, "axis_size"):
        return jax.lax.axis_size(axis)
    return jax.lax.psum(1, axis)


def bind_eqn(eqn, invals):
    """Binds one jaxpr equation's primitive to `invals`, as `jax.core.eval_jaxpr` does
    (`get_bind_params` returns the params on 0.12, `(subfuns, params)` on 0.11)."""
    bound = eqn.primitive.get_bind_params(eqn.params)
    subfuns = []
    if isinstance(bound, tuple) and len(bound) == 2 and isinstance(bound[1], dict):
        subfuns, bound = bound
    with eqn.ctx.manager:
        return eqn.primitive.bind(*subfuns, *invals, **bound)


def all_gather_invariant(x: jax.Array, axes, axis: int = 0, tiled: bool = True) -> jax.Array:
    """`all_gather` whose result is typed invariant over `axes` (every rank holds the same
    value), so it can leave a shard_map replicated: `to="invarying"` on jax 0.12,
    `all_gather_invariant` before."""
    try:
        return jax.lax.all_gather(x, axes, axis=axis, tiled=tiled, to="invarying")
    except TypeError:  # jax 0.11: no `to`
        pass
    gather = getattr(jax.lax, "all_gather_invariant", None)
    if gather is None:
        from jax._src.lax.parallel import all_gather_invariant as gather
    return gather(x, axes, axis=axis, tiled=tiled)


# cuDNN the fused attention is traced for when the process has no cuDNN library to ask (a GPU
# step compiled deviceless from a CPU host): jax-cuda12-plugin's `with-cuda` extra requires
# nvidia-cudnn-cu12 >= 9.10.2 (`analysis.xla_targets.GpuDeviceInfo.dnn_version`). JAX reads the
# version only to refuse features older cuDNNs lack; the custom call it emits is the same.
ASSUMED_CUDNN_VERSION = 91002


@functools.lru_cache(maxsize=1)
def _installed_cudnn_version() -> int | None:
    """The cuDNN version JAX's fused attention sees, or None when it finds no cuDNN."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa

        return int(fa.check_cudnn_version())
    except Exception:  # noqa: BLE001 - no plugin, no library: both mean "none here"
        return None


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, is_causal: bool,
                          scale: float, implementation: str) -> jax.Array:
    """`jax.nn.dot_product_attention` (`(B, T, N, H)` layout) with `implementation` "cudnn"
    or "xla", also for "cudnn" where this process has no cuDNN: the GPU program compiled
    without a GPU (`analysis.deviceless`, a CPU backend). There JAX's trace-time version check
    (`fused_attention_stablehlo.check_cudnn_version`, jax 0.11 and 0.12 alike) is answered
    with `ASSUMED_CUDNN_VERSION` for the duration of the call; the compiler gets the same
    `__cudnn$fmha*` custom calls a GPU host traces."""
    call = functools.partial(jax.nn.dot_product_attention, q, k, v, scale=scale,
                             is_causal=is_causal, implementation=implementation)
    if (implementation != "cudnn" or jax.default_backend() == "gpu"
            or _installed_cudnn_version() is not None):
        return call()
    from jax._src.cudnn import fused_attention_stablehlo as fa

    original = getattr(fa, "check_cudnn_version", None)
    if original is None:  # a JAX that checks elsewhere: let it say what it needs
        return call()
    fa.check_cudnn_version = lambda: ASSUMED_CUDNN_VERSION
    try:
        return call()
    finally:
        fa.check_cudnn_version = original
