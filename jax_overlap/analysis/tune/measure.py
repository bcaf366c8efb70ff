"""The tuner's leading plans run for real (`measure_top`) or compiled for a GPU without one
(`estimate_top`), beside their predictions."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jax_overlap.analysis.tune.predict import Prediction
from jax_overlap.analysis.tune.search import TuneResult
from jax_overlap.config import Config

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
        report = analyze.analyze(p.config, target, built, texts)
        est = analyze.step_estimate(p.config, built.plan, built.model, target, texts[0],
                                    report)
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
