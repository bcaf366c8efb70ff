"""The parallel plan: every decision about the mesh, the pipeline and the overlap, made once.

`ParallelPlan.build(cfg, model, target)` reads the config's `mesh`, `pipeline` and `overlap`
sections -- the only module below the CLI, the training loop and the tuner that does -- and
resolves them into plain values: the axis sizes, the microbatch count, the schedule with its
transfer latency and its compiled tick program, the staged layer order, the overlap choices
(bucket size in bytes, ZeRO-1, FSDP window, TP communication) and, given a model, the DP
layout with its bucket plans. The step, the executor, the checkpoint code and the analysis take
the plan (or plain values from it) and never look at the config's parallel sections again.

Knobs left at `auto` are chosen here for the target the step runs on (`Target`): with tp > 1
on a GPU, collective matmul (bidirectional when the local sequence chunk splits in two), and
together the fewest microbatches whose GEMMs stay within their row budget (`gemm_tokens`),
whose pipeline bubble stays within `PIPELINE_BUBBLE`, and whose estimated step
(`hardware.memory`, remat `full`: `GPU_REMAT_WHY`) fits `MEMORY_BUDGET` of the device's
memory; on a CPU, where every collective is synchronous and wall time follows total work, plain
TP, no extra microbatches and no recompute. `ParallelPlan.choices` says what was picked and
why; `resolved_config` writes the choices back into the config (the run's config.json holds
them).

The package, lowest first (each module imports only those before it):

* `values`: the plain values a plan holds (`Target`, `OverlapPlan`, `DilocoPlan`, `Choice`);
* `derived`: what the config alone gives, before any choice (its schedule table, head, ring
  steps);
* `memory`: the memory estimate, and remat, microbatches and attention decided against it;
* `schedule`: the pipeline's knobs; `comm`: the communication's;
* `parallel_plan`: `ParallelPlan.build`, which runs them all once, in order.
"""

from jax_overlap.plan.comm import auto_xla_preset
from jax_overlap.plan.derived import cached_schedule
from jax_overlap.plan.memory import (
    GPU_REMAT_WHY,
    MEMORY_BUDGET,
    PIPELINE_REMAT_WHY,
    RING_REMAT_WHY,
    estimated_step_bytes,
    fits_memory,
    microbatch_fits,
)
from jax_overlap.plan.parallel_plan import (
    PIPELINE_COPY_ANALYSIS,
    PIPELINE_SCHEDULER_SLOP,
    SCHEDULER_SLOP_FLAG,
    ParallelPlan,
    mesh_from_config,
)
from jax_overlap.plan.values import Choice, DilocoPlan, OverlapPlan, Target

__all__ = [
    "GPU_REMAT_WHY", "MEMORY_BUDGET", "PIPELINE_COPY_ANALYSIS", "PIPELINE_REMAT_WHY",
    "PIPELINE_SCHEDULER_SLOP", "RING_REMAT_WHY", "SCHEDULER_SLOP_FLAG", "Choice", "DilocoPlan",
    "OverlapPlan", "ParallelPlan", "Target", "auto_xla_preset", "cached_schedule",
    "estimated_step_bytes", "fits_memory", "mesh_from_config", "microbatch_fits",
]
