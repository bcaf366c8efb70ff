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
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from jax_overlap import config as configlib
from jax_overlap.analysis import calibrate as cal_lib
from jax_overlap.hardware.link_profiles import load_profile
from jax_overlap.hardware.machine import HardwareProfile
from jax_overlap.hardware.memory import dtype_bytes
from jax_overlap.analysis.simulate import Costs, Plan, costs_from_model, simulate
from jax_overlap.config import Config, ConfigError
from jax_overlap.pipeline.schedules import SCHEDULES
from jax_overlap.plan import ParallelPlan

CALIBRATED_PROFILE = "cpu_here"
# Calibration times the model's own layers on this host's CPU devices: past this many
# parameters that takes hours (GPT-1.3B: 80 s a measurement, 44 of them), so larger models
# are priced by FLOPs. Only the transformer blocks calibration knows how to feed are timed.
CALIBRATED_MAX_PARAMS = 1e8
CALIBRATED_KINDS = ("gpt", "bert", "llama")


def calibration_skipped(cfg: Config) -> str | None:
    """Why `tune` prices `cfg`'s plans by FLOPs on the calibrated profile, or None when it
    can calibrate them here."""
    from jax_overlap.hardware.memory import param_elements

    m = cfg.model
    if m.kind not in CALIBRATED_KINDS:
        return f"model.kind={m.kind}: calibration times transformer blocks only"
    embed, block = param_elements(m)
    params = embed + m.layers * block
    if params > CALIBRATED_MAX_PARAMS:
        return (f"{params / 1e9:.2f}e9 parameters: timing its layers on this CPU would take "
                f"hours (calibration is for models up to {CALIBRATED_MAX_PARAMS:.0e})")
    return None
# Assumed model-FLOPs utilisation of the compute for FLOP-based costs: an assumption,
# not a measurement; it scales every compute time alike, so it moves the balance between
# compute and communication, not the order of plans with equal communication.
FLOP_EFFICIENCY = 0.5
DEFAULT_BUCKETS_MB: tuple[float, ...] = (0.0, 1.0, 4.0, 16.0, 64.0, 256.0)
# Bucket sizes that cut one stage's gradients into more pieces than this are skipped:
# per-bucket latency dominates there, and each bucket is an event to simulate.
MAX_BUCKETS = 256
DEFAULT_WINDOWS: tuple[int, ...] = (1, 2, 3)
MAX_MICROBATCHES = 64
MAX_VIRTUAL_STAGES = 4
# Calibrated tuning measures the exact shapes of this many leading plans after a first
# ranking with interpolated costs, then ranks again.
REFINE_PLANS = 5
TABLE_ROWS = 20


# ------------------------------------------------------------------------- candidates


@dataclass(frozen=True, order=True)
class Candidate:
    """One parallel plan, in config terms.

    Attributes:
      dp: data-parallel degree.
      tp: tensor-parallel degree.
      pp: pipeline stages.
      virtual_stages: chunks per stage.
      microbatches: microbatches per replica per step.
      schedule: pipeline schedule name.
      grad_bucket_mb: gradient bucket size (0: one reduction per array after the
        backward).
      fsdp: parameters sharded over dp and all-gathered before use.
      window: FSDP prefetch depth (1 when not sharded).
      transfer_latency: ticks between pipeline stages (1, or 2: every stage-to-stage transfer
        under the next tick's compute, for a longer ramp); 1 when pp = 1.
      stage_layers: ``even`` or ``auto`` (`pipeline.stage_layers`: layers balanced by cost,
        counting the embedding and the LM head), or an explicit split found by
        :func:`search_split` written ``"7,6,6,5"``; ``even`` when pp = 1.
      paired: paired F+B ticks (`pipeline.paired`, latency 1); False when pp = 1.
      remat: the `model.remat` policy: what every layer keeps for its backward (memory)
        against what it recomputes (time).
      dcn: `mesh.dcn`, the slow axis between hosts (1: none; ``dp`` is then the dp inside
        one host).
      slow: how the gradient crosses dcn (``flat`` with dcn = 1): ``hierarchical``,
        ``delay1`` (one step late) or ``diloco:H,F,tau,dtype`` (Streaming DiLoCo).
      vocab_parallel: the LM head split over the pipeline stages (`pipeline.vocab_parallel`);
        False when pp = 1.
    """

    dp: int
    tp: int
    pp: int
    virtual_stages: int
    microbatches: int
    schedule: str
    grad_bucket_mb: float
    fsdp: bool
    window: int
    transfer_latency: int = 1
    stage_layers: str = "even"
    paired: bool = False
    remat: str = "none"
    dcn: int = 1
    slow: str = "flat"
    vocab_parallel: bool = False

    def key(self) -> tuple:
        """Stable tie-break key (the fields in order)."""
        return dataclasses.astuple(self)

    def label(self) -> str:
        """Short human-readable name, e.g. ``dp2 tp4 pp1 m2 1f1b b0 repl``."""
        sched = self.schedule + (f"/v{self.virtual_stages}" if self.virtual_stages > 1 else "")
        if self.transfer_latency > 1:
            sched += f" L{self.transfer_latency}"
        if self.paired:
            sched += " paired"
        if self.stage_layers != "even":
            sched += f" split-{self.stage_layers}"
        if self.remat != "none":
            sched += f" remat-{self.remat}"
        if self.vocab_parallel:
            sched += " vocab"
        shard = f"fsdp w{self.window}" if self.fsdp else "repl"
        hosts = f"dcn{self.dcn} " if self.dcn > 1 else ""
        slow = f" {self.slow}" if self.dcn > 1 else ""
        return (
            f"{hosts}dp{self.dp} tp{self.tp} pp{self.pp} m{self.microbatches} {sched} "
            f"b{self.grad_bucket_mb:g} {shard}{slow}"
        )

    @property
    def stale(self) -> bool:
        """Trains with stale gradients (one step late, or DiLoCo): not one device's training."""
        return self.slow == "delay1" or self.slow.startswith("diloco")


def apply_candidate(cfg: Config, cand: Candidate) -> Config:
    """``cfg`` with the plan's fields set, validated.

    Args:
      cfg: the base config.
      cand: the plan.

    Returns:
      A new validated :class:`Config`.

    Raises:
      ConfigError: if the plan is not valid for this config.
    """
    c = cand
    out = dataclasses.replace(
        cfg,
        mesh=dataclasses.replace(cfg.mesh, dp=c.dp, tp=c.tp, pp=c.pp),
        pipeline=dataclasses.replace(cfg.pipeline, schedule=c.schedule,
                                     microbatches=c.microbatches,
                                     virtual_stages=c.virtual_stages,
                                     transfer_latency=c.transfer_latency,
                                     stage_layers=_split_value(c.stage_layers),
                                     paired=c.paired, vocab_parallel=c.vocab_parallel),
        model=dataclasses.replace(cfg.model, remat=c.remat),
        overlap=dataclasses.replace(cfg.overlap, grad_bucket_mb=float(c.grad_bucket_mb),
                                    param_sharding="fsdp" if c.fsdp else "replicated",
                                    window=c.window),
    )
    if c.dcn > 1 or cfg.mesh.dcn > 1:
        h, f, tau, dtype = _diloco_setting(c.slow)
        out = dataclasses.replace(
            out, mesh=dataclasses.replace(out.mesh, dcn=c.dcn),
            overlap=dataclasses.replace(out.overlap, dcn_delay=int(c.slow == "delay1")),
            diloco=dataclasses.replace(cfg.diloco, inner_steps=h, fragments=f, delay=tau,
                                       outer_dtype=dtype))
    configlib.validate(out)
    return out


def _diloco_setting(slow: str) -> tuple[int, int, int, str]:
    """``diloco:H,F,tau,dtype`` -> (H, F, tau, dtype); (0, 1, 0, bf16) for other modes."""
    if not slow.startswith("diloco:"):
        return 0, 1, 0, "bf16"
    h, f, tau, dtype = slow.split(":", 1)[1].split(",")
    return int(h), int(f), int(tau), dtype


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _split_value(text: str):
    """A candidate's `stage_layers` as the config takes it ("7,6,6,5" -> [7, 6, 6, 5])."""
    if text in ("even", "auto"):
        return text
    return [int(n) for n in text.split(",")]


def plan_of(cfg: Config) -> ParallelPlan:
    """The `ParallelPlan` of a candidate config (no model: the analytic costs need none)."""
    return ParallelPlan.build(cfg)


def _layouts(pp: int) -> list[tuple[str, int]]:
    """``(schedule, virtual stages)`` pairs worth trying with ``pp`` stages."""
    if pp == 1:
        # One stage: every schedule is the same microbatch loop; keep one.
        return [("1f1b", 1)]
    out = []
    for name in SCHEDULES:
        if name == "interleaved":
            out += [(name, v) for v in range(2, MAX_VIRTUAL_STAGES + 1)]
        elif name == "zb-v":
            out.append((name, 2))
        else:
            out.append((name, 1))
    return out


def _bucket_sizes(cfg: Config, dp: int, tp: int, pp: int, sizes: Sequence[float]) -> list[float]:
    """Bucket sizes that give distinct, sensible plans for one layout.

    Sizes past the whole gradient are all one plan (the smallest is kept); sizes that
    make more than :data:`MAX_BUCKETS` buckets are dropped.
    """
    if dp == 1:
        return [0.0]  # nothing to reduce over dp
    probe = dataclasses.replace(cfg, mesh=configlib.MeshConfig(dp=dp, pp=pp, tp=tp),
                                pipeline=dataclasses.replace(cfg.pipeline, schedule="gpipe",
                                                             virtual_stages=1,
                                                             transfer_latency=1,
                                                             stage_layers="auto"))
    grad_mb = cal_lib.stage_param_elements(probe, plan_of(probe)) * 4 / 2**20
    out, whole = [], False
    for s in sorted(set(float(x) for x in sizes)):
        if s > 0 and grad_mb / s > MAX_BUCKETS:
            continue
        if s > 0 and s >= grad_mb:
            if whole:
                continue
            whole = True
        out.append(s)
    return out


def _vocab_parallel_head(cfg: Config) -> bool:
    """Whether the config's model can run its head vocabulary-parallel (it declares
    `vocab_parallel_head`, as the plan requires)."""
    from jax_overlap.model_api import build_model

    return bool(getattr(build_model(cfg), "vocab_parallel_head", False))


def _pipeline_options(cfg: Config, pp: int, v: int, schedule: str, m: int,
                      vocab_parallel: bool = False) -> list[tuple[int, str, bool, bool]]:
    """``(transfer latency, stage split, paired, vocab-parallel head)`` worth trying: both
    latencies, paired ticks (latency 1) and, where the balanced split differs from the even
    one (or the layers do not split evenly), ``auto``; and, with ``vocab_parallel`` (the
    model's head supports it), unpaired at both latencies, the head split over the stages
    (its balanced split is the even one)."""
    if pp == 1:
        return [(1, "even", False, False)]
    splits = ["even"]
    try:
        even = apply_candidate(cfg, Candidate(1, 1, pp, v, m, schedule, 0.0, False, 1, 1))
        auto = dataclasses.replace(even, pipeline=dataclasses.replace(even.pipeline,
                                                                       stage_layers="auto"))
        if plan_of(auto).stage_layers != plan_of(even).stage_layers:
            splits.append("auto")
    except (ConfigError, ValueError):
        splits = ["auto"]  # even is impossible (layers not a multiple): auto may still fit
    lanes = ((1, False), (2, False), (1, True))
    out = [(latency, split, paired, False) for latency, paired in lanes for split in splits]
    if vocab_parallel:  # unpaired: a paired tick's lanes both wait around the head phase
        out += [(latency, splits[0], False, True) for latency in (1, 2)]
    return out


def enumerate_candidates(
    cfg: Config,
    devices: int,
    *,
    bucket_sizes_mb: Sequence[float] = DEFAULT_BUCKETS_MB,
    windows: Sequence[int] = DEFAULT_WINDOWS,
    max_microbatches: int = MAX_MICROBATCHES,
    remats: Sequence[str] | None = None,
) -> list[tuple[Candidate, Config]]:
    """Every valid plan of ``cfg``'s model and batch on ``devices`` devices.

    Args:
      cfg: the base config (model, batch, precision, optimizer are kept).
      devices: devices the plan must use exactly (dp x tp x pp).
      bucket_sizes_mb: gradient bucket sizes to try (sizes past the whole gradient are
        one plan).
      windows: FSDP prefetch depths to try (FSDP only when dp > 1).
      max_microbatches: most microbatches tried.
      remats: `model.remat` policies to try (default: the configured one and ``full``).

    Returns:
      ``(candidate, validated config)`` pairs in a fixed order.
    """
    if devices < 1:
        raise ValueError(f"--devices: must be >= 1, got {devices}")
    # The configured policy, and `full` (the least activation memory) when that differs.
    # (`auto`, the default, is `none` where the tuner's cost model decides.)
    policies = list(dict.fromkeys("none" if r == "auto" else r
                                  for r in (remats or (cfg.model.remat, "full"))))
    out = []
    vocab = _vocab_parallel_head(cfg)
    for tp in _divisors(devices):
        for pp in _divisors(devices // tp):
            dp = devices // (tp * pp)
            buckets = None
            for schedule, v in _layouts(pp):
                for m in _divisors(max(1, cfg.train.global_batch // dp)):
                    if m > max_microbatches:
                        break
                    for latency, split, paired, head in _pipeline_options(cfg, pp, v,
                                                                          schedule, m, vocab):
                        base = Candidate(dp, tp, pp, v, m, schedule, 0.0, False, 1, latency,
                                         split, paired, vocab_parallel=head)
                        try:
                            plan_of(apply_candidate(cfg, base))
                        except (ConfigError, ValueError):
                            continue
                        if buckets is None:
                            buckets = _bucket_sizes(cfg, dp, tp, pp, bucket_sizes_mb)
                        shardings = [(False, 1)] + ([(True, w) for w in windows] if dp > 1
                                                    else [])
                        for bucket, (fsdp, window), remat in itertools.product(
                                buckets, shardings, policies):
                            cand = dataclasses.replace(
                                base, grad_bucket_mb=bucket, fsdp=fsdp, window=window,
                                remat=remat)
                            try:
                                out.append((cand, apply_candidate(cfg, cand)))
                            except ConfigError:
                                continue
    return out


# ------------------------------------------------------------------------------ costs


def flop_costs(cfg: Config, hw: HardwareProfile, efficiency: float = FLOP_EFFICIENCY) -> Costs:
    """FLOP-based :class:`Costs` of the plan ``cfg`` on the chip ``hw`` describes.

    Compute times come from :func:`costs_from_model` at ``efficiency`` of the chip's
    peak, per virtual stage from the plan's layer split (`pipeline.stage_layers`), the
    embedding on the first and the LM head on the last. The backward is priced the way the
    executor runs it: an F stashes its residuals, so no backward re-runs the forward except
    what the remat policy (`model.remat`) recomputes per layer -- ``full`` the block's
    forward, ``minimal`` its attention scores, ``none`` / ``save_dots`` nothing. Split: B
    is the input gradients (plus the recompute), W only the weight-gradient GEMMs (what B
    kept), virtual stage 0's alike (its B ends in the embedding's gradient). The structure --
    TP collective count, parameter bytes per stage, stash -- is the same as for calibrated
    costs.

    Args:
      cfg: the candidate config.
      hw: the hardware profile.
      efficiency: achieved fraction of peak FLOP/s.

    Returns:
      The :class:`Costs`.
    """
    m = cfg.model
    plan = plan_of(cfg)
    s = plan.schedule
    layers = cal_lib.layers_per_virtual_stage(cfg, plan)
    base = costs_from_model(
        m.layers, m.d_model, m.heads, m.d_ff, m.vocab, m.seq_len, plan.micro_batch,
        plan.tp, dtype_bytes(cfg.train.precision), hw.chip_flops, efficiency,
        num_virtual_stages=plan.num_virtual_stages, stage_layers=layers,
        vocab_shards=plan.pp if plan.vocab_parallel else 1,
    )
    fwd, bwd, wgt = list(base.forward_s), list(base.backward_s), list(base.weight_s)
    tokens = plan.micro_batch * m.seq_len
    attn = 4 * m.seq_len ** 2 * m.d_model * plan.micro_batch
    per_layer = {"full": 2 * (4 * m.d_model ** 2 + 2 * m.d_model * m.d_ff) * tokens + attn,
                 "minimal": attn}.get(plan.remat, 0.0)
    redo = [n * per_layer / plan.tp / (hw.chip_flops * efficiency) for n in layers]
    if plan.pp == 1 or not s.split_backward:
        # A non-split B does both gradients: costs_from_model splits them into B and W.
        bwd = [b + w + r for b, w, r in zip(bwd, wgt, redo)]
        wgt = [0.0] * len(wgt)
    else:
        bwd = [b + r for b, r in zip(bwd, redo)]
    return cal_lib.assemble_costs(cfg, plan, hw, s.placement, fwd, bwd, wgt, base.head_s)


def memory_budget(hw: HardwareProfile) -> float:
    """Bytes one device may use: its own memory, or its share of host RAM on a CPU host."""
    source = hw.sources.get("chip.memory_bytes", "")
    if "shared by all devices" in source:
        return hw.memory_bytes / max(1, hw.devices_per_host * hw.hosts)
    return hw.memory_bytes


# ------------------------------------------------------------------------ prediction


@dataclass(frozen=True)
class Prediction:
    """What the simulator predicts for one plan.

    Attributes:
      candidate: the plan.
      config: its validated config.
      step_time_s: predicted step time (simulated step + optimizer update).
      simulated_s: the simulated loss-and-gradients step.
      optimizer_s: the optimizer update plus the step's one launch (0 for FLOP-based
        costs: not modelled there).
      ccor: overlap / (compute + comm).
      hidden_comm: overlap / comm, the share of communication under compute.
      bubble_rate: idle / step.
      exposed_comm_s: communication not under compute.
      memory_bytes: peak memory per device.
      fits: whether ``memory_bytes`` fits the device's budget.
      flop_fallback: the calibrated pieces that came out <= 0 at this plan's shape
        (`calibrate.nonpositive_pieces`), for which the plan was priced by FLOPs instead;
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

    def sort_key(self) -> tuple:
        """Fitting plans first, calibrated before FLOP-priced ones, then step time, CCOR
        (higher first), plan key."""
        return (not self.fits, bool(self.flop_fallback), _sig(self.step_time_s),
                -round(self.ccor, 3), self.candidate.key())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready row."""
        return {
            "plan": self.candidate.label(),
            **dataclasses.asdict(self.candidate),
            "step_time_s": self.step_time_s,
            "simulated_s": self.simulated_s,
            "optimizer_s": self.optimizer_s,
            "ccor": self.ccor,
            "hidden_comm": self.hidden_comm,
            "bubble_rate": self.bubble_rate,
            "exposed_comm_s": self.exposed_comm_s,
            "memory_bytes": self.memory_bytes,
            "fits": self.fits,
            "flop_fallback": list(self.flop_fallback),
        }


def _sig(x: float, digits: int = 3) -> float:
    """``x`` rounded to ``digits`` significant digits."""
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - int(math.floor(math.log10(abs(x)))))


def plan_for(cfg: Config) -> Plan:
    """The simulator :class:`Plan` of a config (schedule with its transfer latency)."""
    return sim_plan(cfg, plan_of(cfg))


def sim_plan(cfg: Config, plan: ParallelPlan) -> Plan:
    """The simulator :class:`Plan` of a `ParallelPlan`."""
    buckets, issue = cal_lib.grad_buckets(cfg, plan)
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
    fallback = (tuple(cal_lib.nonpositive_pieces(calibration, cfg, plan))
                if calibration is not None else ())
    if calibration is not None and not fallback:
        hw = calibration.profile(hw, plan)  # links measured with the compute
        costs = cal_lib.costs_for_config(calibration, cfg, plan, hw)
        # The update and the one launch of the whole step, outside the simulated part.
        opt = (calibration.optimizer_s(cal_lib.stage_param_elements(cfg, plan))
               + calibration.dispatch_s)
    else:
        costs = flop_costs(cfg, hw, efficiency)
        opt = 0.0
    if timing is None:
        timing = "ticks" if plan.pp > 1 and not hw.synchronous_collectives else "events"
    r = simulate(sim_plan(cfg, plan), costs, hw, timing=timing)
    memory = r.peak_memory_bytes + cal_lib.transient_bytes(cfg, plan)
    m = r.metrics
    return Prediction(
        candidate=cand,
        config=cfg,
        step_time_s=r.step_time_s + opt,
        simulated_s=r.step_time_s,
        optimizer_s=opt,
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


def _needs(cfg: Config) -> tuple[str, ...]:
    """The calibration pieces one plan's costs are made of."""
    plan = plan_of(cfg)
    return cal_lib.quantities_for(cfg, plan, plan.split_backward)


def calibration_for(
    cfg: Config,
    candidates: Sequence[tuple[Candidate, Config]],
    devices: Sequence[Any] | None = None,
    repeats: int = 5,
    calibrator: cal_lib.Calibrator | None = None,
) -> cal_lib.Calibration:
    """Calibrate ``cfg``'s model over the shapes and pieces the candidates need.

    Args:
      cfg: the base config.
      candidates: from :func:`enumerate_candidates`.
      devices: the devices the plans run on (default: all).
      repeats: timed calls per point.
      calibrator: measure with this :class:`~jax_overlap.analysis.calibrate.Calibrator`
        (kept by the caller to refine later); None makes one.

    Returns:
      The :class:`~jax_overlap.analysis.calibrate.Calibration`.
    """
    b = [cal_lib.micro_batch_size(c, plan_of(c)) for _, c in candidates]
    k = [c.mesh.tp for _, c in candidates]
    quantities = {q for _, c in candidates for q in _needs(c)}
    groups = {n for _, c in candidates for n in (c.mesh.dp, c.mesh.tp, c.mesh.pp)}
    return cal_lib.calibrate(cfg, cal_lib.corner_shapes(b, k), devices=devices,
                             quantities=sorted(quantities), groups=sorted(groups),
                             repeats=repeats, calibrator=calibrator)


def refine(
    calibrator: cal_lib.Calibrator,
    calibration: cal_lib.Calibration,
    ranked: Sequence[Prediction],
    plans: int = REFINE_PLANS,
) -> cal_lib.Calibration:
    """Measure the exact shapes of the leading plans, so their predictions are not fits.

    Args:
      calibrator: the calibrator that made ``calibration``.
      calibration: the first, interpolating calibration.
      ranked: predictions ranked with it.
      plans: how many leading fitting plans to make exact.

    Returns:
      The extended calibration.
    """
    points = set()
    for p in [p for p in ranked if p.fits][:plans]:
        b, k = plan_of(p.config).micro_batch, p.config.mesh.tp
        points.update((q, b, k) for q in _needs(p.config) if q not in cal_lib.SPLIT_QUANTITIES)
    return cal_lib.extend(calibrator, calibration, sorted(points))


@dataclass(frozen=True)
class TuneResult:
    """A ranked sweep.

    Attributes:
      hardware: the profile name.
      devices: devices planned for.
      costs: ``calibrated`` or ``flops``.
      plans: ranked predictions.
      calibration: the calibration used, if any.
    """

    hardware: str
    devices: int
    costs: str
    plans: tuple[Prediction, ...]
    calibration: cal_lib.Calibration | None = field(default=None, repr=False)
    pruned: int = 0
    allow_stale: bool = False

    @property
    def best(self) -> Prediction:
        """The top plan that fits (the top plan when none fits); one that trains like one
        device (not one step late, not DiLoCo) unless `allow_stale`."""
        pool = [p for p in self.plans if self.allow_stale or not p.candidate.stale]
        return next((p for p in pool if p.fits), pool[0])


def tune(
    cfg: Config,
    devices: int,
    hardware: str | HardwareProfile = CALIBRATED_PROFILE,
    *,
    calibration: cal_lib.Calibration | None = None,
    jax_devices: Sequence[Any] | None = None,
    efficiency: float = FLOP_EFFICIENCY,
    bucket_sizes_mb: Sequence[float] = DEFAULT_BUCKETS_MB,
    windows: Sequence[int] = DEFAULT_WINDOWS,
    max_microbatches: int = MAX_MICROBATCHES,
    allow_stale: bool = False,
    progress: bool = False,
) -> TuneResult:
    """Enumerate, predict and rank every valid plan of ``cfg`` for ``devices`` devices.

    Args:
      cfg: the base config.
      devices: devices to plan for.
      hardware: profile name or path, or a loaded profile. ``cpu_here`` uses measured
        costs (unless ``calibration`` is given: calibrating now at the corners of the
        plans' shapes, ranking, measuring the exact shapes of the leading
        :data:`REFINE_PLANS` plans and ranking again); others use FLOPs.
      calibration: measured costs to use instead of calibrating.
      jax_devices: devices to calibrate on (default: the first ``devices``).
      efficiency: FLOP efficiency for FLOP-based costs.
      bucket_sizes_mb: gradient bucket sizes to sweep.
      windows: FSDP windows to sweep.
      max_microbatches: most microbatches swept.
      allow_stale: the best plan may train with stale gradients (overlap.dcn_delay = 1 or
        Streaming DiLoCo); they are ranked either way.
      progress: progress bars on stderr over the calibration's measurements and over the
        plans predicted.

    Returns:
      The :class:`TuneResult`. Plans whose TP group would span more devices than one
      host has are left out when the profile keeps TP inside a host. When the devices fill
      the hosts of a profile with a slow 'dcn' link (`slow_link_profile`), dp is what
      crosses the hosts: every layout is tried flat (its dp reduction on the slow link)
      and with mesh.dcn = hosts in each way of crossing them (`slow_link_search`).

    Raises:
      ValueError: if no plan is valid.
    """
    hw = hardware if isinstance(hardware, HardwareProfile) else load_profile(hardware)
    candidates = enumerate_candidates(cfg, devices, bucket_sizes_mb=bucket_sizes_mb,
                                      windows=windows, max_microbatches=max_microbatches)
    if not hw.axes["tp"].crosses_hosts:
        # The profile puts TP on an intra-host link: a TP group larger than a host would
        # in fact cross hosts, which the profile does not describe.
        candidates = [(c, conf) for c, conf in candidates if c.tp <= hw.devices_per_host]
    if not candidates:
        raise ValueError(
            f"--devices: no valid plan of this model and batch uses exactly {devices} devices"
        )
    if calibration is None and slow_link_profile(hw, devices):
        preds, pruned = slow_link_search(candidates, hw, efficiency)
        if not preds:
            raise ValueError(f"--devices: no plan of this model and batch splits its dp "
                             f"over the {hw.hosts} hosts of {hw.name}")
        return TuneResult(hardware=hw.name, devices=devices, costs="flops",
                          plans=tuple(preds), pruned=pruned, allow_stale=allow_stale)
    refine_with = None
    skipped = calibration_skipped(cfg) if hw.name == CALIBRATED_PROFILE else None
    if calibration is None and skipped:
        print(f"tune: FLOP costs, no calibration: {skipped}", file=sys.stderr)
    if calibration is None and hw.name == CALIBRATED_PROFILE and not skipped:
        import jax

        chosen = list(jax_devices) if jax_devices is not None else jax.devices()[:devices]
        refine_with = cal_lib.Calibrator(cfg, chosen)
        with _bar("calibrate", "measurement", progress) as refine_with.progress:
            calibration = calibration_for(cfg, candidates, calibrator=refine_with)
    if calibration is not None and not calibration.matches(cfg):
        raise ValueError("calibration: it was measured for another model, precision or optimizer")

    def predict_all(desc: str) -> list[Prediction]:
        with _bar(desc, "plan", progress, total=len(candidates)) as bar:
            out = []
            for c, conf in candidates:
                out.append(predict(c, conf, hw, calibration, efficiency))
                bar.update(1)
        return rank(out)

    preds = predict_all("plans")
    if refine_with is not None:
        with _bar("measure leaders", "measurement", progress) as refine_with.progress:
            calibration = refine(refine_with, calibration, preds)  # the leaders' exact shapes
        refine_with.progress = None
        preds = predict_all("plans (refined)")
    preds = _with_searched_splits(preds, hw, calibration, efficiency)
    return TuneResult(
        hardware=hw.name,
        devices=devices,
        costs="calibrated" if calibration is not None else "flops",
        plans=tuple(preds),
        calibration=calibration,
        allow_stale=allow_stale,
    )


def _bar(desc: str, unit: str, enabled: bool, total: int | None = None):
    """A progress bar on stderr (`tqdm`); a silent one when not `enabled`."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, leave=False,
                dynamic_ncols=True)


# ------------------------------------------------------------------------ stage splits

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


def _with_searched_splits(preds: list[Prediction], hw, calibration, efficiency
                          ) -> list[Prediction]:
    """`preds` plus the searched split of the leading :data:`SEARCH_SPLITS` fitting pipelined
    plans where it simulates faster, ranked again."""
    leading = [p for p in preds if p.fits and p.candidate.pp > 1][:SEARCH_SPLITS]
    known = {p.candidate for p in preds}
    extra = []
    for p in leading:
        found = search_split(p, hw, calibration, efficiency)
        if found is not p and found.candidate not in known:
            extra.append(found)
            known.add(found.candidate)
    return rank(list(preds) + extra) if extra else preds


# ------------------------------------------------------------------------- measuring


@dataclass(frozen=True)
class Measured:
    """A plan run for real.

    Attributes:
      prediction: what was predicted.
      measured_s: median step after the first (compiling) one -- a median, like the
        calibration's timings, so both see the same share of a shared machine.
      fastest_s: fastest of those steps.
      steps: steps run.
    """

    prediction: Prediction
    measured_s: float
    fastest_s: float
    steps: int

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.prediction.step_time_s - self.measured_s) / self.measured_s

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready row."""
        return {
            "plan": self.prediction.candidate.label(),
            "predicted_s": self.prediction.step_time_s,
            "measured_s": self.measured_s,
            "fastest_s": self.fastest_s,
            "error": self.error,
            "steps": self.steps,
        }


def measure_step_time(cfg: Config, devices: Sequence[Any], steps: int = 6) -> tuple[float, float]:
    """Train ``steps`` steps of ``cfg`` on ``devices``; median and fastest later step.

    Args:
      cfg: a validated config with ``dp x tp x pp == len(devices)``.
      devices: the devices.
      steps: steps to run (the first compiles and is not counted).

    Returns:
      ``(median, fastest)`` seconds.
    """
    import statistics

    from jax_overlap.training import loop as train

    run_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps))
    with tempfile.TemporaryDirectory(prefix="jax_overlap_tune_") as run_dir:
        train.run(run_cfg, run_dir, progress=False, devices=list(devices))
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            times = [json.loads(line)["step_time_s"] for line in f][1:]
    return statistics.median(times), min(times)


def measure_top(result: TuneResult, k: int, steps: int = 6,
                jax_devices: Sequence[Any] | None = None) -> list[Measured]:
    """Run the top ``k`` fitting plans for real and pair them with their predictions.

    Args:
      result: a :class:`TuneResult`.
      k: plans to run.
      steps: steps per plan (the first compiles).
      jax_devices: devices (default: the first ``result.devices``).

    Returns:
      One :class:`Measured` per plan, in ranking order.
    """
    import jax

    devices = list(jax_devices) if jax_devices is not None else jax.devices()[: result.devices]
    out = []
    for p in [p for p in result.plans if p.fits][:k]:
        median, fastest = measure_step_time(p.config, devices, steps)
        out.append(Measured(p, median, fastest, steps))
    return out


@dataclass(frozen=True)
class Estimated:
    """A plan compiled for a GPU without one, and its compiled step's estimate
    (`analysis.step_estimate`).

    Attributes:
      prediction: what the simulator predicted.
      estimate: the compiled step's `StepEstimate` as JSON (`step_ms`, `mfu`, ...).
    """

    prediction: Prediction
    estimate: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready row."""
        return {"plan": self.prediction.candidate.label(),
                "predicted_s": self.prediction.step_time_s, **self.estimate}


def estimate_top(result: TuneResult, k: int, target: str) -> list[Estimated]:
    """Compile the top ``k`` fitting plans for ``target`` GPUs (deviceless) and rank them by
    the estimate of their compiled step, fastest first.

    Args:
      result: a :class:`TuneResult`.
      k: plans to compile.
      target: ``a100``, ``h100`` or ``h200``.

    Returns:
      One :class:`Estimated` per plan, fastest estimated step first.
    """
    from tqdm.auto import tqdm

    from jax_overlap.analysis import analyze

    out = []
    plans = [p for p in result.plans if p.fits][:k]
    for p in tqdm(plans, desc="compiling for " + target, unit="plan", leave=False):
        built = analyze.build_plan(p.config, target)
        texts: list[str] = []
        analyze.analyze(p.config, target, built, texts)
        est = analyze.step_estimate(p.config, built.plan, built.model, target, texts[0])
        out.append(Estimated(p, est.to_json()))
    return sorted(out, key=lambda e: e.estimate["step_ms"])


def format_estimated(rows: Sequence[Estimated], target: str) -> str:
    """The plans ranked by their compiled step's estimate."""
    lines = [f"{'plan':48s} {'predicted ms':>12s} {target + ' est. ms':>13s} {'MFU':>6s}"]
    for r in rows:
        lines.append(f"{r.prediction.candidate.label()[:48]:48s} "
                     f"{r.prediction.step_time_s * 1e3:12.3f} {r.estimate['step_ms']:13.1f} "
                     f"{r.estimate['mfu']:6.3f}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- output


def write_config(cfg: Config, path: str, header: Sequence[str] = ()) -> str:
    """Write ``cfg`` as YAML that :func:`jax_overlap.config.load` reads back.

    Args:
      cfg: a validated config.
      path: output file (parent directories are created).
      header: comment lines written first.

    Returns:
      The path written.
    """
    configlib.validate(cfg)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    text = "".join(f"# {line}\n" for line in header)
    text += yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=None, width=100)
    with open(path, "w") as f:
        f.write(text)
    return path


def _mb(x: float) -> str:
    return f"{x / 2**20:,.1f}"


def format_table(result: TuneResult, rows: int = TABLE_ROWS) -> str:
    """The ranked plans as a text table (the first ``rows``)."""
    lines = [
        f"tune: {len(result.plans)} valid plans for {result.devices} devices on "
        f"{result.hardware} ({result.costs} costs); fitting plans first, by step time, "
        f"then CCOR",
        f"{'#':>3} {'plan':<40}{'step ms':>10}{'CCOR':>7}{'bubble':>8}{'exposed ms':>11}"
        f"{'mem/dev MiB':>13}{'fits':>6}",
    ]
    for i, p in enumerate(result.plans[:rows], 1):
        lines.append(
            f"{i:>3} {p.candidate.label():<40}{p.step_time_s * 1e3:>10.3f}{p.ccor * 100:>6.1f}%"
            f"{p.bubble_rate * 100:>7.1f}%{p.exposed_comm_s * 1e3:>11.3f}"
            f"{_mb(p.memory_bytes):>13}{'yes' if p.fits else 'no':>6}"
        )
    if len(result.plans) > rows:
        lines.append(f"    ... {len(result.plans) - rows} more (--json lists all)")
    fallback = [p for p in result.plans if p.flop_fallback]
    if fallback:
        pieces = sorted({q for p in fallback for q in p.flop_fallback})
        lines.append(f"    note: {len(fallback)} plans priced by FLOPs, ranked after the "
                     f"calibrated ones: their calibrated {', '.join(pieces)} came out <= 0 at their shapes")
    if result.pruned:
        lines.append(f"    ({result.pruned} more layouts not simulated in full: one host's share "
                     f"of the step alone is slower than plan {rows})")
    return "\n".join(lines)


def format_measured(measured: Sequence[Measured]) -> str:
    """Predicted vs measured step times as a text table."""
    lines = [f"{'plan':<40}{'predicted ms':>14}{'measured ms':>13}{'error':>8}"]
    for m in measured:
        lines.append(
            f"{m.prediction.candidate.label():<40}{m.prediction.step_time_s * 1e3:>14.3f}"
            f"{m.measured_s * 1e3:>13.3f}{m.error * 100:>+7.1f}%"
        )
    return "\n".join(lines)


def tune_command(
    cfg: Config,
    devices: int,
    hardware: str = CALIBRATED_PROFILE,
    measure: int = 0,
    out: str = "",
    as_json: bool = False,
    allow_stale: bool = False,
    estimate: int = 0,
    target: str = "h100",
    progress: bool = False,
) -> str:
    """What ``jax-overlap tune`` prints; writes the best plan's config to ``out`` if given.

    Args:
      cfg: the base config (the CLI has forced at least ``devices`` host devices).
      devices: devices to plan for.
      hardware: profile name or path.
      measure: run the top this many plans for real and compare.
      out: where to write the best config (empty: nowhere; the text says how).
      as_json: print one JSON document (with a ``plans`` list) instead of tables.
      allow_stale: the best plan may be one that trains with stale gradients.
      estimate: compile the top this many plans for ``target`` GPUs (deviceless) and rank
        them by their compiled step's estimate (`estimate_top`).
      target: the GPU ``estimate`` compiles for.
      progress: progress bars on stderr (`tune`).

    Returns:
      The text to print.
    """
    if measure < 0:
        raise ValueError(f"--measure: must be >= 0, got {measure}")
    result = tune(cfg, devices, hardware, allow_stale=allow_stale, progress=progress)
    best = result.best
    slow_rows, slow_best, best_cfg = slow_axis_search(best.config, hardware)
    path = None
    if out:
        path = write_config(
            best_cfg,
            out,
            header=[
                f"Written by `jax-overlap tune --devices {devices} --hardware {hardware}`: "
                f"best of {len(result.plans)} plans ({result.costs} costs).",
                f"Plan: {best.candidate.label()}; predicted step {best.step_time_s * 1e3:.3f} "
                f"ms, CCOR {best.ccor * 100:.1f}%, bubble {best.bubble_rate * 100:.1f}%.",
            ],
        )
    measured = measure_top(result, measure) if measure else []
    estimated = estimate_top(result, estimate, target) if estimate else []
    if as_json:
        doc = {
            "hardware": result.hardware,
            "devices": result.devices,
            "costs": result.costs,
            "best": best.to_dict(),
            "out": path,
            "plans": [p.to_dict() for p in result.plans],
            "pruned": result.pruned,
            "measured": [m.to_dict() for m in measured],
            "estimated": [e.to_dict() for e in estimated],
        }
        if result.calibration is not None:
            doc["calibration"] = result.calibration.to_dict()
        if slow_rows:
            doc["slow_axis"] = {"modes": slow_rows, "best": slow_best["mode"]}
        return json.dumps(doc, sort_keys=True)
    text = format_table(result)
    text += (f"\nbest: {best.candidate.label()} -> {path}" if path else
             f"\nbest: {best.candidate.label()} (--out FILE writes its config)")
    stale = next((p for p in result.plans if p.fits and p.candidate.stale), None)
    if not allow_stale and stale is not None and stale.step_time_s < best.step_time_s:
        text += (f"\nfaster with stale gradients: {stale.candidate.label()} "
                 f"({stale.step_time_s * 1e3:.3f} ms; --allow-stale to pick it: it changes "
                 f"the optimisation, docs/guides/slow_links.md)")
    if slow_rows:
        text += ("\n\nacross hosts (mesh.dcn = hosts; dp inside a host):\n"
                 + format_slow_table(slow_rows)
                 + f"\nbest exact: {slow_best['mode']} (delay1 / diloco: opt-in, "
                   f"they change the optimisation)")
    if estimated:
        text += (f"\n\nranked by the estimate of the compiled step on one {target} "
                 f"(analyze's roofline over the optimized HLO):\n")
        text += format_estimated(estimated, target)
    if measured:
        text += "\n\npredicted vs measured (median step after compilation):\n"
        text += format_measured(measured)
        if result.costs != "calibrated":
            text += (f"\nnote: measured on this machine's devices, predicted for "
                     f"{result.hardware}; the two only agree on the machine the profile describes")
    return text


# ---------------------------------------------------------------------------------------------
# The slow axis: flat vs hierarchical vs one step late vs Streaming DiLoCo


SLOW_MODES: tuple[str, ...] = ("flat", "hierarchical", "delay1", "diloco")


def _without_dcn(cfg: Config, dp: int, batch_share: int = 1) -> Config:
    """`cfg` on a mesh without dcn: mesh.dp = dp, 1/batch_share of the batch (the same work
    per device), no delay / DiLoCo."""
    return dataclasses.replace(
        cfg, mesh=dataclasses.replace(cfg.mesh, dcn=1, dp=dp),
        train=dataclasses.replace(cfg.train, global_batch=cfg.train.global_batch // batch_share),
        overlap=dataclasses.replace(cfg.overlap, dcn_delay=0),
        diloco=dataclasses.replace(cfg.diloco, inner_steps=0))


def slow_axis_modes(cfg: Config, hw: HardwareProfile,
                    efficiency: float = FLOP_EFFICIENCY, fast: Any = None,
                    dilocos: Sequence[Any] | None = None) -> list[dict[str, Any]]:
    """Simulated step time and exposed slow-axis communication of `cfg`'s mesh (dcn > 1) in
    each way of crossing dcn (`SLOW_MODES`), on a profile with a 'dcn' axis link.

    flat: one dp axis of dcn x dp ranks whose all-reduce runs on the slow link (the
      simulator's bucketed dp stream on it). hierarchical: the fast step (dp inside a host)
      plus what the dcn all-reduce of 1/dp of every bucket, simulated as a bucket stream on
      the slow link beside the same compute, leaves exposed. delay1: the fast step, with the whole dcn
      all-reduce (1/dp of the gradient) hidden under the next step: exposed only where it is
      longer. diloco: the fast step; one fragment's outer gradient (1/F of the parameters,
      1/dp per device, in diloco.outer_dtype) crosses every H/F steps under tau + 1 steps.

    Every mode's step is at least the fast step (the same compute, more communication):
    the tuner's search (`slow_link_search`) relies on it to prune.

    Args:
      fast: the simulator's result for one host's share (`_without_dcn(cfg, dp, dcn)`),
        when the caller has it already.
      dilocos: the `DilocoPlan`s to give a diloco row each (default: the config's, else
        H = 8, 2 fragments, tau = 1, bf16).

    Returns:
      One row per mode: {"mode", "step_time_s", "exposed_dcn_s", "dcn_bytes_per_step",
      "fast_step_time_s"}; the flat row also has its simulated "memory_bytes", "ccor",
      "bubble_rate" and "exposed_comm_s", the diloco rows their "diloco" settings.
    """
    from jax_overlap.analysis.simulate import all_reduce_time

    if "dcn" not in hw.axes:
        raise ConfigError([f"--hardware {hw.name}: the profile has no 'dcn' axis link (see "
                           f"configs/hardware/h100_2x8_100g.yaml)"])
    plan = plan_of(cfg)
    dcn, dp = plan.dcn, plan.dp
    slow = hw.link("dcn")
    fast_cfg = _without_dcn(cfg, dp, dcn)  # one host's share of the step
    fast_plan = plan_of(fast_cfg)
    if fast is None:
        fast = simulate(sim_plan(fast_cfg, fast_plan), flop_costs(fast_cfg, hw, efficiency), hw)
    t_fast = fast.step_time_s
    buckets, issue = cal_lib.grad_buckets(fast_cfg, fast_plan)
    grad = float(sum(buckets))
    rows = []
    # flat: every dp byte on the slow link
    flat_cfg = _without_dcn(cfg, dcn * dp)
    flat_plan = plan_of(flat_cfg)
    flat_hw = hw.with_link("dp", slow)
    r = simulate(sim_plan(flat_cfg, flat_plan), flop_costs(flat_cfg, flat_hw, efficiency),
                 flat_hw)
    rows.append({"mode": "flat", "step_time_s": r.step_time_s,
                 "exposed_dcn_s": max(0.0, r.step_time_s - t_fast),
                 "dcn_bytes_per_step": 2 * (dcn * dp - 1) / (dcn * dp) * grad,
                 "memory_bytes": r.peak_memory_bytes + cal_lib.transient_bytes(flat_cfg,
                                                                                flat_plan),
                 "ccor": r.ccor, "bubble_rate": r.bubble_rate,
                 "exposed_comm_s": r.exposed_comm_s, "hidden_comm": _hidden(r)})
    # hierarchical: a second bucket stream of 1/dp of each bucket over dcn
    slow_plan = dataclasses.replace(sim_plan(fast_cfg, fast_plan), dp=dcn,
                                    grad_buckets=tuple(b / dp for b in buckets))
    slow_hw = hw.with_link("dp", slow)
    r = simulate(slow_plan, flop_costs(fast_cfg, slow_hw, efficiency), slow_hw)
    # What the slow stream leaves exposed comes on top of the fast step (its fast reduce-
    # scatter / all-gather are in the fast step already): conservative, they do not overlap.
    t_hier = t_fast + r.exposed_comm_s
    per_step = 2 * (dcn - 1) / dcn * grad / dp
    rows.append({"mode": "hierarchical", "step_time_s": t_hier,
                 "exposed_dcn_s": t_hier - t_fast, "dcn_bytes_per_step": per_step})
    t_all = all_reduce_time(grad / dp, dcn, slow)
    rows.append({"mode": "delay1", "step_time_s": max(t_fast, t_all),
                 "exposed_dcn_s": max(0.0, t_all - t_fast), "dcn_bytes_per_step": per_step})
    if dilocos is None:
        dilocos = [plan.diloco or dataclasses.replace(_default_diloco(), outer_dtype="bf16")]
    for d in dilocos:
        # outer-gradient bytes per gradient byte (the buckets are in overlap.grad_comm_dtype)
        size = ({"fp32": 4, "bf16": 2, "int8": 1}[d.outer_dtype]
                / (2 if fast_plan.overlap.grad_comm_dtype == "bf16" else 4))
        frag = grad * size / d.fragments / dp
        t_frag = all_reduce_time(frag, dcn, slow)
        exposed = max(0.0, t_frag - (d.delay + 1) * t_fast) / d.period
        rows.append({"mode": "diloco", "step_time_s": t_fast + exposed,
                     "exposed_dcn_s": exposed,
                     "dcn_bytes_per_step": 2 * (dcn - 1) / dcn * frag / d.period,
                     "diloco": dataclasses.asdict(d)})
    for row in rows:
        row["fast_step_time_s"] = t_fast
    return rows


# DiLoCo settings the tuner's search tries (H, fragments, tau, outer dtype): the one the
# convergence bench measures, and a sparser one with int8 outer gradients.
DILOCO_SETTINGS: tuple[tuple[int, int, int, str], ...] = ((8, 2, 1, "bf16"), (32, 4, 1, "int8"))


def _hidden(r) -> float:
    """overlap / comm of a simulator result."""
    m = r.metrics
    return m.overlap_s / m.comm_s if m.comm_s > 0 else 0.0


def slow_link_profile(hw: HardwareProfile, devices: int) -> bool:
    """Whether `devices` fill the profile's hosts joined by a slow 'dcn' link: then the
    tuner's search lays dp across the hosts (flat, or mesh.dcn = hosts)."""
    return ("dcn" in hw.axes and hw.hosts > 1
            and devices == hw.hosts * hw.devices_per_host)


def _slow_candidates(cand: Candidate, hosts: int) -> list[Candidate]:
    """The dcn = hosts versions of a flat candidate: hierarchical, one step late, DiLoCo."""
    base = dataclasses.replace(cand, dcn=hosts, dp=cand.dp // hosts)
    modes = ["hierarchical", "delay1"] + [
        "diloco:" + ",".join(str(x) for x in d) for d in DILOCO_SETTINGS]
    return [dataclasses.replace(base, slow=m) for m in modes]


def _slow_state_bytes(cfg: Config, cand: Candidate) -> float:
    """Per-device bytes the slow axis adds to the train state: the in-flight gradient
    (delay 1), or the local copy and outer momentum (DiLoCo), fp32."""
    plan = plan_of(cfg)
    elems = cal_lib.stage_param_elements(cfg, plan)
    if cand.slow == "delay1":
        split = plan.dp if (plan.overlap.zero1 or plan.overlap.fsdp) else 1
        return 4.0 * elems / split
    if cand.stale:
        return 8.0 * elems / (plan.dp if plan.overlap.fsdp else 1)
    return 0.0


def slow_link_search(candidates: Sequence[tuple[Candidate, Config]], hw: HardwareProfile,
                     efficiency: float = FLOP_EFFICIENCY, keep: int = TABLE_ROWS
                     ) -> tuple[list[Prediction], int]:
    """The search on a profile of hosts joined by a slow link: every flat layout (dp over
    all hosts, its reduction on the slow link) and its dcn = hosts versions (hierarchical,
    one step late, DiLoCo settings of `DILOCO_SETTINGS`).

    Each layout's host share (dp / hosts, 1 / hosts of the batch) is simulated first: every
    way of crossing hosts is at least that fast step. Layouts are then simulated in full in
    the order of their fast step, until the next fast step is slower than the `keep`-th
    fitting plan found: no layout left can rank above it, so the leading `keep` plans are
    exact.

    Returns:
      (the predictions of the layouts simulated in full, how many layouts were pruned).
    """
    hosts = hw.hosts
    shares = []
    for c, conf in candidates:
        if c.dp % hosts:
            continue  # tp / pp would span the hosts, which the profile does not describe
        fast_cfg = _without_dcn(conf, c.dp // hosts, hosts)
        try:
            configlib.validate(fast_cfg)
        except ConfigError:
            continue
        fast_plan = plan_of(fast_cfg)
        r = simulate(sim_plan(fast_cfg, fast_plan), flop_costs(fast_cfg, hw, efficiency), hw)
        shares.append((r.step_time_s, c.key(), c, conf, fast_cfg, fast_plan, r))
    shares.sort(key=lambda x: (x[0], x[1]))
    out: list[Prediction] = []
    fitting: list[float] = []
    done = 0
    for t_fast, _, c, conf, fast_cfg, fast_plan, r in shares:
        if len(fitting) >= keep and _sig(t_fast) > _sig(sorted(fitting)[keep - 1]):
            break
        done += 1
        split_cfgs = []
        for sc in _slow_candidates(c, hosts):
            try:
                split_cfgs.append((sc, apply_candidate(conf, sc)))
            except ConfigError:
                continue
        if not split_cfgs:
            continue
        dilocos = [plan_of(k).diloco for sc, k in split_cfgs if sc.slow.startswith("diloco")]
        rows = slow_axis_modes(split_cfgs[0][1], hw, efficiency, fast=r, dilocos=dilocos)
        flat = rows[0]
        by_mode = {"hierarchical": rows[1], "delay1": rows[2]}
        by_mode.update({sc.slow: row for (sc, _), row in zip(
            [x for x in split_cfgs if x[0].slow.startswith("diloco")], rows[3:])})
        fast_memory = r.peak_memory_bytes + cal_lib.transient_bytes(fast_cfg, fast_plan)
        entries = [(c, conf, flat["step_time_s"], flat["memory_bytes"], flat["ccor"],
                    flat["hidden_comm"], flat["bubble_rate"], flat["exposed_comm_s"])]
        for sc, k in split_cfgs:
            row = by_mode[sc.slow]
            entries.append((sc, k, row["step_time_s"], fast_memory + _slow_state_bytes(k, sc),
                            r.ccor, _hidden(r), r.bubble_rate,
                            r.exposed_comm_s + row["exposed_dcn_s"]))
        for cand, k, step, memory, ccor, hidden, bubble, exposed in entries:
            fits = memory <= memory_budget(hw)
            out.append(Prediction(candidate=cand, config=k, step_time_s=step, simulated_s=step,
                                  optimizer_s=0.0, ccor=ccor, hidden_comm=hidden,
                                  bubble_rate=bubble, exposed_comm_s=exposed,
                                  memory_bytes=memory, fits=fits))
            if fits:
                fitting.append(step)
    return rank(out), len(shares) - done


def slow_axis_search(cfg: Config, hardware: str):
    """For a profile with several hosts and a 'dcn' link: the slow-axis modes of `cfg` with
    its dp split as mesh.dcn = hosts x dp / hosts, and the config to write (dcn set when
    the hierarchical reduction wins). ([], None, cfg) otherwise."""
    hw = load_profile(hardware)
    if "dcn" not in hw.axes or hw.hosts < 2 or cfg.mesh.dcn > 1 or cfg.mesh.dp % hw.hosts:
        if "dcn" in hw.axes and cfg.mesh.dcn > 1:
            rows = slow_axis_modes(cfg, hw)
            return rows, best_slow_mode(rows), cfg
        return [], None, cfg
    split = dataclasses.replace(cfg, mesh=dataclasses.replace(
        cfg.mesh, dcn=hw.hosts, dp=cfg.mesh.dp // hw.hosts))
    try:
        configlib.validate(split)
    except ConfigError:
        return [], None, cfg
    rows = slow_axis_modes(split, hw)
    best = best_slow_mode(rows)
    return rows, best, split if best["mode"] == "hierarchical" else cfg


def _default_diloco():
    from jax_overlap.plan import DilocoPlan

    return DilocoPlan(inner_steps=8, fragments=2, delay=1)


def best_slow_mode(rows: Sequence[dict[str, Any]], exact: bool = True) -> dict[str, Any]:
    """The fastest mode; `exact` keeps to the ones that train like one device (flat,
    hierarchical) -- delay and DiLoCo change the optimisation and are opt-in."""
    pool = [r for r in rows if not exact or r["mode"] in ("flat", "hierarchical")]
    return min(pool, key=lambda r: (_sig(r["step_time_s"]), SLOW_MODES.index(r["mode"])))


def format_slow_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [f"{'mode':14s} {'step ms':>10s} {'exposed dcn ms':>15s} {'dcn MB/step':>12s}"]
    for r in rows:
        lines.append(f"{r['mode']:14s} {r['step_time_s'] * 1e3:10.1f} "
                     f"{r['exposed_dcn_s'] * 1e3:15.1f} {r['dcn_bytes_per_step'] / 1e6:12.1f}")
    return "\n".join(lines)
