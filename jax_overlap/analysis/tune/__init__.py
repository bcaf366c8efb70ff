"""`jax-overlap tune`: rank every valid parallel plan for N devices with the simulator.

A plan is a config that differs from the user's only in how the step is laid out: data,
tensor and pipeline degrees, virtual stages, microbatches, schedule, gradient bucket
size and, for sharded parameters, the all-gather prefetch window. Each candidate is a
real :class:`~jax_overlap.config.Config`, kept only if it passes
:func:`jax_overlap.config.validate` and its schedule can be built.

Each plan is predicted by :func:`jax_overlap.analysis.simulate.simulate` on a hardware
profile. Compute costs come from measuring the model here
(:mod:`jax_overlap.analysis.calibrate`) when the profile is ``cpu_here`` -- the machine
this runs on -- and from FLOP counts at an assumed fraction of the chip's peak otherwise
(no device is needed then). The predicted step time is the simulated loss-and-gradients
step plus, when calibrated, the measured optimizer update.

Plans that fit in device memory come first, each group ordered by step time, then CCOR
(higher first), then a stable key of the plan, so the ranking is deterministic. Times
are compared at three significant digits: measurement noise below that cannot reorder
plans whose predictions agree.

The package: `candidates` (the plan space), `predict` (one plan simulated, ranking, the
layer-split search), `search` (`tune`: calibrate, predict, rank), `slow_search` (hosts
joined by a slow link), `measure` (run or compile the leaders), `report` (what the CLI
prints and writes). Their public names are re-exported here: `tune.X` works for all of them.
"""

from __future__ import annotations

from jax_overlap.analysis.tune.candidates import (
    Candidate,
    DEFAULT_BUCKETS_MB,
    DEFAULT_WINDOWS,
    MAX_BUCKETS,
    MAX_MICROBATCHES,
    MAX_VIRTUAL_STAGES,
    apply_candidate,
    enumerate_candidates,
    plan_of,
)
from jax_overlap.analysis.tune.predict import (
    FLOP_EFFICIENCY,
    Prediction,
    SEARCH_SPLITS,
    TABLE_ROWS,
    flop_costs,
    memory_budget,
    plan_for,
    predict,
    rank,
    search_split,
    significant,
    sim_plan,
)
from jax_overlap.analysis.tune.search import (
    CALIBRATED_KINDS,
    CALIBRATED_MAX_PARAMS,
    CALIBRATED_PROFILE,
    REFINE_PLANS,
    TuneResult,
    calibration_for,
    calibration_skipped,
    refine,
    tune,
    with_searched_splits,
)
from jax_overlap.analysis.tune.slow_search import (
    DILOCO_SETTINGS,
    SLOW_MODES,
    best_slow_mode,
    format_slow_table,
    slow_axis_modes,
    slow_axis_search,
    slow_link_profile,
    slow_link_search,
)
from jax_overlap.analysis.tune.measure import (
    Estimated,
    Measured,
    estimate_top,
    format_estimated,
    measure_step_time,
    measure_top,
)
from jax_overlap.analysis.tune.report import (
    format_measured,
    format_table,
    tune_command,
    write_config,
)

__all__ = [
    "CALIBRATED_KINDS",
    "CALIBRATED_MAX_PARAMS",
    "CALIBRATED_PROFILE",
    "Candidate",
    "DEFAULT_BUCKETS_MB",
    "DEFAULT_WINDOWS",
    "DILOCO_SETTINGS",
    "Estimated",
    "FLOP_EFFICIENCY",
    "MAX_BUCKETS",
    "MAX_MICROBATCHES",
    "MAX_VIRTUAL_STAGES",
    "Measured",
    "Prediction",
    "REFINE_PLANS",
    "SEARCH_SPLITS",
    "SLOW_MODES",
    "TABLE_ROWS",
    "TuneResult",
    "apply_candidate",
    "best_slow_mode",
    "calibration_for",
    "calibration_skipped",
    "enumerate_candidates",
    "estimate_top",
    "flop_costs",
    "format_estimated",
    "format_measured",
    "format_slow_table",
    "format_table",
    "measure_step_time",
    "measure_top",
    "memory_budget",
    "plan_for",
    "plan_of",
    "predict",
    "rank",
    "refine",
    "search_split",
    "significant",
    "sim_plan",
    "slow_axis_modes",
    "slow_axis_search",
    "slow_link_profile",
    "slow_link_search",
    "tune",
    "tune_command",
    "with_searched_splits",
    "write_config",
]
