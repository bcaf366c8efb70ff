"""What `jax-overlap tune` prints and writes: tables, JSON, the best plan's config."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import yaml

from jax_overlap import config as configlib
from jax_overlap.analysis.tune.measure import (
    Measured,
    estimate_top,
    format_estimated,
    measure_top,
)
from jax_overlap.analysis.tune.predict import TABLE_ROWS
from jax_overlap.analysis.tune.search import CALIBRATED_PROFILE, TuneResult, tune
from jax_overlap.analysis.tune.slow_search import format_slow_table, slow_axis_search
from jax_overlap.config import Config

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
