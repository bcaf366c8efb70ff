"""`tune`: enumerate, predict and rank every valid plan of a config for N devices,
calibrating on this machine (`cpu_here`) or pricing by FLOPs."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from jax_overlap.analysis import calibrate as cal_lib
from jax_overlap.analysis import plan_costs, plan_shape
from jax_overlap.analysis.tune.candidates import (
    DEFAULT_BUCKETS_MB,
    DEFAULT_WINDOWS,
    MAX_MICROBATCHES,
    Candidate,
    enumerate_candidates,
    plan_of,
)
from jax_overlap.analysis.tune.predict import (
    FLOP_EFFICIENCY,
    Prediction,
    predict,
    SEARCH_SPLITS,
    rank,
    search_split,
)
from jax_overlap.analysis.tune.slow_search import slow_link_profile, slow_link_search
from jax_overlap.config import Config
from jax_overlap.hardware.link_profiles import load_profile
from jax_overlap.hardware.machine import HardwareProfile

CALIBRATED_PROFILE = "cpu_here"
# Calibration times the model's own layers on this host's CPU devices: past this many
# parameters that takes hours (GPT-1.3B: 80 s a measurement, 44 of them), so larger models
# are priced by FLOPs. Only the transformer blocks calibration knows how to feed are timed.
CALIBRATED_MAX_PARAMS = 1e8
CALIBRATED_KINDS = ("gpt", "bert", "llama")


def calibration_skipped(cfg: Config) -> str | None:
    """Why `tune` prices `cfg`'s plans by FLOPs on the calibrated profile, or None when it
    can calibrate them here."""
    from jax_overlap.model_api import param_elements

    m = cfg.model
    if m.kind not in CALIBRATED_KINDS:
        return f"model.kind={m.kind}: calibration times transformer blocks only"
    embed, block = param_elements(cfg)
    params = embed + m.layers * block
    if params > CALIBRATED_MAX_PARAMS:
        return (f"{params / 1e9:.2f}e9 parameters: timing its layers on this CPU would take "
                f"hours (calibration is for models up to {CALIBRATED_MAX_PARAMS:.0e})")
    return None

# Calibrated tuning measures the exact shapes of this many leading plans after a first
# ranking with interpolated costs, then ranks again.
REFINE_PLANS = 5


def _needs(cfg: Config) -> tuple[str, ...]:
    """The calibration pieces one plan's costs are made of."""
    plan = plan_of(cfg)
    return plan_shape.quantities_for(cfg, plan, plan.split_backward)


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
    b = [plan_shape.micro_batch_size(c, plan_of(c)) for _, c in candidates]
    k = [c.mesh.tp for _, c in candidates]
    quantities = {q for _, c in candidates for q in _needs(c)}
    groups = {n for _, c in candidates for n in (c.mesh.dp, c.mesh.tp, c.mesh.pp)}
    pipelines: dict[int, float] = {}
    for _, c in candidates:
        if c.mesh.pp > 1:
            act = plan_costs.activation_bytes(c, plan_of(c))
            pipelines[c.mesh.pp] = max(pipelines.get(c.mesh.pp, 0.0), act)
    return cal_lib.calibrate(cfg, cal_lib.corner_shapes(b, k), devices=devices,
                             quantities=sorted(quantities), groups=sorted(groups),
                             pipelines=pipelines, repeats=repeats,
                             calibrator=calibrator)


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
    preds = with_searched_splits(preds, hw, calibration, efficiency)
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


def with_searched_splits(preds: list[Prediction], hw, calibration, efficiency
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
