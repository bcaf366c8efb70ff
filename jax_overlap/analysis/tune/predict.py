"""The tuner's prediction of one plan: simulated on a hardware profile from FLOP or
calibrated costs, ranked, and its layer split searched by simulation."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from jax_overlap.analysis import calibrate as cal_lib
from jax_overlap.analysis import plan_costs, plan_shape
from jax_overlap.analysis.plan_costs import FLOP_EFFICIENCY
from jax_overlap.analysis.simulate import Costs, Plan, simulate
from jax_overlap.analysis.tune.candidates import Candidate, apply_candidate, plan_of
from jax_overlap.config import Config, ConfigError
from jax_overlap.hardware.machine import HardwareProfile
from jax_overlap.plan import ParallelPlan

TABLE_ROWS = 20


def flop_costs(cfg: Config, hw: HardwareProfile, efficiency: float = FLOP_EFFICIENCY) -> Costs:
    """FLOP-based costs of the plan `cfg` (`plan_costs.flop_costs` of its `ParallelPlan`)."""
    return plan_costs.flop_costs(cfg, plan_of(cfg), hw, efficiency)


def memory_budget(hw: HardwareProfile) -> float:
    """Bytes one device may use: its own memory, or its share of host RAM on a CPU host."""
    source = hw.sources.get("chip.memory_bytes", "")
    if "shared by all devices" in source:
        return hw.memory_bytes / max(1, hw.devices_per_host * hw.hosts)
    return hw.memory_bytes


@dataclass(frozen=True)
class Prediction:
    """What the simulator predicts for one plan.

    Attributes:
      candidate: the plan.
      config: its validated config.
      step_time_s: predicted step time (simulated step + tick loop + optimizer update).
      simulated_s: the simulated loss-and-gradients step.
      optimizer_s: the optimizer update plus the step's one launch (0 for FLOP-based
        costs: not modelled there).
      tick_loop_s: a pipeline's ticks (lanes, where paired) times the calibrated cost of
        one outside its actions (`Calibration.tick_s`); every stage pays it in lockstep, so
        it adds to the step. 0 unpipelined, or for FLOP-based costs.
      ccor: overlap / (compute + comm).
      hidden_comm: overlap / comm, the share of communication under compute.
      bubble_rate: idle / step.
      exposed_comm_s: communication not under compute.
      memory_bytes: peak memory per device.
      fits: whether ``memory_bytes`` fits the device's budget.
      flop_fallback: the calibrated pieces that came out <= 0 at this plan's shape
        (`plan_costs.nonpositive_pieces`), for which the plan was priced by FLOPs instead;
        such plans rank after the calibrated ones (their times are not comparable).
    """

    candidate: Candidate
    config: Config = field(repr=False, compare=False)
    step_time_s: float
    simulated_s: float
    optimizer_s: float
    ccor: float
    hidden_comm: float
    bubble_rate: float
    exposed_comm_s: float
    memory_bytes: float
    fits: bool
    flop_fallback: tuple[str, ...] = ()
    tick_loop_s: float = 0.0

    def sort_key(self) -> tuple:
        """Fitting plans first, calibrated before FLOP-priced ones, then step time, CCOR
        (higher first), plan key."""
        return (not self.fits, bool(self.flop_fallback), significant(self.step_time_s),
                -round(self.ccor, 3), self.candidate.key())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready row."""
        return {
            "plan": self.candidate.label(),
            **dataclasses.asdict(self.candidate),
            "step_time_s": self.step_time_s,
            "simulated_s": self.simulated_s,
            "optimizer_s": self.optimizer_s,
            "tick_loop_s": self.tick_loop_s,
            "ccor": self.ccor,
            "hidden_comm": self.hidden_comm,
            "bubble_rate": self.bubble_rate,
            "exposed_comm_s": self.exposed_comm_s,
            "memory_bytes": self.memory_bytes,
            "fits": self.fits,
            "flop_fallback": list(self.flop_fallback),
        }


def significant(x: float, digits: int = 3) -> float:
    """``x`` rounded to ``digits`` significant digits."""
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - int(math.floor(math.log10(abs(x)))))


def plan_for(cfg: Config) -> Plan:
    """The simulator :class:`Plan` of a config (schedule with its transfer latency)."""
    return sim_plan(cfg, plan_of(cfg))


def sim_plan(cfg: Config, plan: ParallelPlan) -> Plan:
    """The simulator :class:`Plan` of a `ParallelPlan`."""
    buckets, issue = plan_shape.grad_buckets(cfg, plan)
    fsdp = plan.overlap.fsdp
    return Plan(
        schedule=plan.schedule,
        dp=plan.dp,
        tp=plan.tp,
        grad_buckets=buckets,
        bucket_issue=issue,
        fsdp=fsdp,
        fsdp_window=plan.overlap.window if fsdp else 0,
        tp_comm="plain",
        vocab_parallel=plan.vocab_parallel,
    )


def predict(
    cand: Candidate,
    cfg: Config,
    hw: HardwareProfile,
    calibration: cal_lib.Calibration | None = None,
    efficiency: float = FLOP_EFFICIENCY,
    timing: str | None = None,
) -> Prediction:
    """Simulate one plan.

    Args:
      cand: the plan.
      cfg: its validated config.
      hw: hardware profile.
      calibration: measured costs of the model (None: FLOP-based costs).
      efficiency: FLOP efficiency for FLOP-based costs.
      timing: how the simulator plays the pipeline (`simulate`'s ``timing``): ``events``
        (each stage's row as soon as its inputs are there) or ``ticks`` (the executor's
        ticks, each stage waiting for its ring neighbours at every permute). None: ``ticks``
        for a pipelined plan on a device with asynchronous collectives (a GPU), else
        ``events`` (what `docs/results.md` checks against CPU steps).

    Returns:
      The :class:`Prediction`.
    """
    plan = plan_of(cfg)
    fallback = (tuple(plan_costs.nonpositive_pieces(calibration, cfg, plan))
                if calibration is not None else ())
    if calibration is not None and not fallback:
        hw = calibration.profile(hw, plan)  # links measured with the compute
        costs = plan_costs.costs_for_config(calibration, cfg, plan, hw)
        # The update and the one launch of the whole step, outside the simulated part.
        opt = (calibration.optimizer_s(plan_shape.stage_param_elements(cfg, plan))
               + calibration.dispatch_s)
        # A paired tick runs two lanes, each its own switch and permutes.
        lanes = plan.schedule.lanes
        loop = (plan.schedule.ticks * lanes * calibration.tick_s(plan.pp, costs.act_bytes)
                if plan.pp > 1 else 0.0)
    else:
        costs = plan_costs.flop_costs(cfg, plan, hw, efficiency)
        opt = loop = 0.0
    if timing is None:
        timing = "ticks" if plan.pp > 1 and not hw.synchronous_collectives else "events"
    r = simulate(sim_plan(cfg, plan), costs, hw, timing=timing)
    memory = r.peak_memory_bytes + plan_shape.transient_bytes(cfg, plan)
    m = r.metrics
    return Prediction(
        candidate=cand,
        config=cfg,
        step_time_s=r.step_time_s + loop + opt,
        simulated_s=r.step_time_s,
        optimizer_s=opt,
        tick_loop_s=loop,
        ccor=r.ccor,
        hidden_comm=m.overlap_s / m.comm_s if m.comm_s > 0 else 0.0,
        bubble_rate=r.bubble_rate,
        exposed_comm_s=r.exposed_comm_s,
        memory_bytes=memory,
        fits=memory <= memory_budget(hw),
        flop_fallback=fallback,
    )


def rank(predictions: Sequence[Prediction]) -> list[Prediction]:
    """Predictions in ranking order (see :meth:`Prediction.sort_key`)."""
    return sorted(predictions, key=Prediction.sort_key)


# The leading pipelined plans whose layer split is searched by simulation after ranking.
SEARCH_SPLITS = 3


def search_split(pred: Prediction, hw: HardwareProfile,
                 calibration: cal_lib.Calibration | None = None,
                 efficiency: float = FLOP_EFFICIENCY, max_rounds: int = 8,
                 timing: str | None = None) -> Prediction:
    """The plan with its layer split improved by simulation: starting from its split, move
    one layer between two virtual stages while the simulated step gets shorter.

    `auto` balances the stages' FLOPs; what the simulator rewards also depends on where in
    the schedule the heavier virtual stages run (e.g. at ZB-V's turn), which this finds.

    Args:
      pred: a ranked prediction of a pipelined plan.
      hw, calibration, efficiency, timing: as for :func:`predict`.
      max_rounds: most improving moves.

    Returns:
      The best prediction found (``pred`` itself when no move helps); its candidate's
      ``stage_layers`` is the explicit split.
    """
    if pred.candidate.pp == 1:
        return pred
    best = pred
    split = list(plan_of(pred.config).stage_layers)
    for _ in range(max_rounds):
        improved = None
        for i in range(len(split)):
            for j in range(len(split)):
                if i == j or split[i] <= 1:
                    continue
                trial = list(split)
                trial[i] -= 1
                trial[j] += 1
                cand = dataclasses.replace(pred.candidate,
                                           stage_layers=",".join(str(n) for n in trial))
                try:
                    conf = apply_candidate(pred.config, cand)
                except ConfigError:
                    continue
                p = predict(cand, conf, hw, calibration, efficiency, timing)
                if p.step_time_s < (improved or best).step_time_s * (1 - 1e-9):
                    improved, found = p, trial
        if improved is None:
            break
        best, split = improved, found
    return best

