"""The device mesh: named axes for data (dp), pipeline (pp) and tensor (tp) parallelism, and
the slow data axis (dcn) between hosts or slices.

Also the two things that must happen before JAX starts its backends: forcing enough host
devices when there is no accelerator, and `jax.distributed.initialize` for multi-process runs.
Logical parameter axes ('vocab', 'heads', 'mlp', 'layers', ...) are bound to mesh axes here and
nowhere else.
"""

from __future__ import annotations

import os
from typing import Any

DP, PP, TP = "dp", "pp", "tp"
AXES = (DP, PP, TP)
# The slow axis: data-parallel groups on different hosts (or slices) whose link is far slower
# than the links inside one. Outermost, and only in the mesh when mesh.dcn > 1.
DCN = "dcn"

# Logical axis -> mesh axis. Model code names logical axes only.
LOGICAL_RULES: dict[str, str | None] = {
    "batch": DP,
    "layers": None,  # see rules_for: stacked layers are split over pp only when pp > 1
    "vocab": TP,
    "heads": TP,
    "mlp": TP,
    "embed": None,
    "seq": None,
    "head_dim": None,
    "qkv": None,
    # Expert parallelism (mesh.ep > 1): the experts' dim is stored split over dp, each rank
    # holding E/dp experts of its ep slot (models/moe.py names this axis only then).
    "experts": DP,
}


def rules_for(pp: int) -> dict[str, str | None]:
    """The logical rules for a mesh with `pp` stages: stacked layers go to pp when pp > 1."""
    return {**LOGICAL_RULES, "layers": PP if pp > 1 else None}


# XLA:CPU's region-based copy insertion (`force_host_devices`).
HOST_COPY_ANALYSIS = "--xla_cpu_copy_insertion_use_region_analysis"


def force_host_devices(count: int, environ: dict | None = None) -> None:
    """Asks XLA for `count` host (CPU) devices; must run before JAX initialises.

    Also turns on XLA:CPU's region-based copy insertion: without it XLA:CPU copies a
    pipeline's residual pools and gradient accumulators through the tick switch that updates
    them in place, every tick (`pipeline.tick_loop.run_ticks`; ZB-V on pp4 x dp2 took 1.8x as
    long). Both flags only affect the CPU platform, so they are harmless on a GPU host. A
    value the user already set in XLA_FLAGS is respected (a device count mismatch then fails
    with a clear mesh error).
    """
    environ = os.environ if environ is None else environ
    flags = environ.get("XLA_FLAGS", "").split()
    for name, value in (("--xla_force_host_platform_device_count", count),
                        (HOST_COPY_ANALYSIS, "true")):
        if not any(f.startswith(name + "=") for f in flags):
            flags.append(f"{name}={value}")
    environ["XLA_FLAGS"] = " ".join(flags)


def init_distributed(coordinator: str = "", num_processes: int = 1, process_id: int = 0,
                     timeout_s: int = 300, environ: dict | None = None) -> bool:
    """Starts `jax.distributed` when the launch asks for several processes.

    Explicit arguments win; otherwise JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
    JAX_PROCESS_ID are read. On CPU, collectives across processes go through gloo.

    Returns:
      True when a multi-process runtime was started.
    """
    import jax

    environ = os.environ if environ is None else environ
    coordinator = coordinator or environ.get("JAX_COORDINATOR_ADDRESS", "")
    if num_processes <= 1:
        num_processes = int(environ.get("JAX_NUM_PROCESSES", "1"))
        process_id = int(environ.get("JAX_PROCESS_ID", str(process_id)))
    if num_processes <= 1 or not coordinator:
        return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs: dict[str, Any] = dict(coordinator_address=coordinator, num_processes=num_processes,
                                  process_id=process_id)
    try:
        jax.distributed.initialize(**kwargs, initialization_timeout=timeout_s,
                                   heartbeat_timeout_seconds=max(10, timeout_s // 10))
    except TypeError:  # older signatures lack the timeout knobs
        jax.distributed.initialize(**kwargs)
    return True


def make_mesh(dp: int, pp: int, tp: int, devices: list | None = None, dcn: int = 1):
    """A (dp, pp, tp) mesh, or (dcn, dp, pp, tp) with dcn > 1; tp varies fastest so TP groups
    share the fastest links, dcn slowest so each dcn group is a run of consecutive devices (one
    host's, in a multi-process job)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devices = list(jax.devices() if devices is None else devices)
    needed = dcn * dp * pp * tp
    if len(devices) < needed:
        from jax_overlap.errors import ConfigError
        raise ConfigError([f"mesh: dcn x dp x pp x tp = {needed} devices, but only "
                           f"{len(devices)} are available; shrink mesh.dcn/dp/pp/tp"])
    if dcn > 1:
        grid = np.array(devices[:needed], dtype=object).reshape(dcn, dp, pp, tp)
        return Mesh(grid, (DCN, *AXES))
    grid = np.array(devices[:needed], dtype=object).reshape(dp, pp, tp)
    return Mesh(grid, AXES)


def data_axes(axis_sizes) -> tuple[str, ...]:
    """The axes the batch is split over: (dcn, dp) when the mesh has a slow axis, else (dp,).

    Args:
      axis_sizes: mesh axis name -> size (`dict(mesh.shape)`, `plan.axis_sizes`).
    """
    return (DCN, DP) if DCN in axis_sizes else (DP,)


def data_spec(axis_sizes):
    """PartitionSpec of a batch (leading dim split over `data_axes`)."""
    from jax.sharding import PartitionSpec as P

    axes = data_axes(axis_sizes)
    return P(axes if len(axes) > 1 else axes[0])


def microbatched(tree: Any, microbatches: int) -> Any:
    """(B, ...) -> (M, B/M, ...): microbatch i takes rows [i*B/M, (i+1)*B/M)."""
    import jax

    return jax.tree.map(lambda x: x.reshape(microbatches, x.shape[0] // microbatches,
                                            *x.shape[1:]), tree)


def logical_to_spec(logical_axes: tuple[str | None, ...], rules: dict | None = None):
    """PartitionSpec for an array whose dimensions carry these logical axis names."""
    from jax.sharding import PartitionSpec as P

    rules = LOGICAL_RULES if rules is None else rules
    return P(*(rules.get(a) if a is not None else None for a in logical_axes))


def tree_specs(axes_tree: Any, rules: dict | None = None) -> Any:
    """Maps a pytree of logical-axis tuples to a pytree of PartitionSpecs."""
    import jax

    return jax.tree.map(lambda a: logical_to_spec(a, rules), axes_tree,
                        is_leaf=lambda x: isinstance(x, tuple))


def tree_shardings(mesh, axes_tree: Any, rules: dict | None = None) -> Any:
    import jax
    from jax.sharding import NamedSharding

    return jax.tree.map(lambda s: NamedSharding(mesh, s), tree_specs(axes_tree, rules))
