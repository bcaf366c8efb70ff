"""What the benches' `--quick` modes share (not a bench: no `--quick` of its own).

`--quick` runs a bench on a tiny model, once, so the test suite (tests/test_benches.py) can
check that every bench still works; its numbers mean nothing.
"""

from __future__ import annotations

import os

# LLVM at -O0: the tiny models' CPU compiles spend most of their time in codegen (a train
# step of configs/tiny.yaml: 5.8 s -> 2.5 s), and a quick run times nothing worth optimising.
# Deviceless GPU compiles don't get faster with it (their time is XLA's GPU passes), so the
# benches that only do those leave it alone.
FAST_CPU_COMPILE_FLAG = "--xla_backend_optimization_level=0"

# Overrides of configs/gpt_1p3b.yaml for the quick deviceless GPU compiles (overlap.py --goal,
# gpu.py's analysis): 2 layers of small widths (~0.2 MiB of gradients per layer, so 0.05 MiB
# buckets make several). A GPT step's GPU compile still costs ~10 s of CPU: XLA's passes,
# not the sizes, dominate.
SMALL_GPT = ["model.layers=2", "model.d_model=64", "model.heads=4", "model.d_ff=256",
             "model.vocab=256", "model.seq_len=32", "train.global_batch=16",
             "pipeline.microbatches=2", "overlap.grad_bucket_mb=0.05"]


def fast_cpu_compiles(environ: dict | None = None) -> None:
    """Adds `FAST_CPU_COMPILE_FLAG` to XLA_FLAGS (before JAX starts), unless a level is set."""
    environ = os.environ if environ is None else environ
    flags = environ.get("XLA_FLAGS", "").split()
    if not any(f.startswith("--xla_backend_optimization_level=") for f in flags):
        environ["XLA_FLAGS"] = " ".join(flags + [FAST_CPU_COMPILE_FLAG])
