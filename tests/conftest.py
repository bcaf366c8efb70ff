"""Test setup: 8 forced CPU devices, set before JAX initialises its backends."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    # What `force_host_devices` sets too: the pipeline executor's in-place updates stay in
    # place on XLA:CPU (jax_overlap/parallel/mesh.py).
    + " --xla_cpu_copy_insertion_use_region_analysis=true"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compiled executables are cached outside the repository (shared by the xdist workers and by
# the CLI subprocesses the tests start, which inherit the variable): reruns skip most compiles.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(os.path.expanduser("~"), ".cache", "jax_overlap", "xla"))

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
