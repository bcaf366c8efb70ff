"""`jax-overlap profile`: trace a config's real train step and report its overlap metrics.

Builds the same step `jax-overlap train` runs (model, mesh, optimizer, sharded state, one
global batch), runs warm-up steps untraced, traces N steps with the JAX profiler and reduces
the trace with :func:`jax_overlap.analysis.trace.profile_steps`: per device and overall
compute, communication, overlap, idle time, CCOR, bubble rate, exposed communication and
step time. The trace stays in ``logdir`` for XProf / Perfetto.

On the XLA CPU backend collectives run inline on the op thread (a rendezvous of all
devices), so overlap is 0 by construction and time spent waiting for slower devices is
counted as communication; the summary says so.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Any

from jax_overlap.analysis.trace import DeviceMetrics, TraceMetrics
from jax_overlap.config import Config

DEFAULT_LOGDIR = os.path.join("runs", "profile")


@dataclass(frozen=True)
class ProfileResult:
    """What one profiling run measured.

    Attributes:
      metrics: the trace metrics of the traced steps.
      logdir: where the profiler trace was written.
      mesh: ``{"dp", "pp", "tp"}`` degrees of the profiled config.
      platform: JAX platform of the devices (``cpu``, ``gpu``, ...).
      tokens_per_step: global batch x sequence length.
    """

    metrics: TraceMetrics
    logdir: str
    mesh: dict[str, int]
    platform: str
    tokens_per_step: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the metrics' fields at top level plus the run description."""
        return {
            **self.metrics.to_dict(),
            "logdir": self.logdir,
            "mesh": dict(self.mesh),
            "platform": self.platform,
            "tokens_per_step": self.tokens_per_step,
            "trace_files": trace_files(self.logdir),
        }


def build_step(cfg: Config, devices: list | None = None) -> tuple[Any, tuple[Any, Any]]:
    """The jitted train step of ``cfg`` and its first arguments.

    Args:
      cfg: a validated config.
      devices: devices for the mesh (default: all of the job's; must match the mesh size).

    Returns:
      ``(step, (state, batch))``; ``step(state, batch) -> (state, metrics)`` donates the
      state, so callers must feed each output state into the next call.
    """
    from jax_overlap.data import streams as datalib
    from jax_overlap.training.assemble import assemble

    run = assemble(cfg, devices)
    step = run.train_step()
    batch = run.put_batch(datalib.stream_from_config(cfg).batch(0))
    state = run.init_state()
    return step, (state, batch)


def _next_args(args, out):
    # The step donates its state: the next call must take the state it returned.
    return (out[0], args[1])


def profile_config(
    cfg: Config,
    steps: int = 3,
    logdir: str = "",
    *,
    warmup: int = 2,
    devices: list | None = None,
) -> ProfileResult:
    """Trace ``steps`` train steps of ``cfg`` after ``warmup`` untraced ones.

    Args:
      cfg: a validated config.
      steps: traced steps (>= 1).
      logdir: profiler output directory (empty: ``runs/profile``).
      warmup: untraced steps first (the first one compiles).
      devices: devices for the mesh (default: all of the job's).

    Returns:
      The :class:`ProfileResult`.
    """
    import jax

    from jax_overlap.analysis.trace import profile_steps

    logdir = logdir or DEFAULT_LOGDIR
    os.makedirs(logdir, exist_ok=True)
    step, args = build_step(cfg, devices)
    mesh_sizes = dict(args[1]["inputs"].sharding.mesh.shape)
    metrics = profile_steps(
        step, args, steps, logdir, warmup=max(1, warmup), update_args=_next_args
    )
    used = devices if devices is not None else jax.devices()
    return ProfileResult(
        metrics=metrics,
        logdir=os.path.abspath(logdir),
        mesh={k: mesh_sizes[k] for k in ("dp", "pp", "tp")},
        platform=used[0].platform,
        tokens_per_step=cfg.train.global_batch * cfg.model.seq_len,
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:9.3f}"


def _row(label: str, d: DeviceMetrics) -> str:
    return (
        f"{label:<18}{_ms(d.step_time_s)}{_ms(d.compute_s)}{_ms(d.comm_s)}{_ms(d.overlap_s)}"
        f"{_ms(d.idle_s)}{_ms(d.exposed_comm_s)}{d.ccor * 100:8.1f}%{d.bubble_rate * 100:8.1f}%"
    )


def format_summary(result: ProfileResult) -> str:
    """A readable table of the per-device and overall metrics.

    Args:
      result: from :func:`profile_config`.

    Returns:
      Multi-line text: a header naming the run, one row per device, the overall row
      (device mean) and the notes (e.g. why CPU overlap is 0).
    """
    m = result.metrics
    mesh = result.mesh
    lines = [
        f"profile: {m.steps} traced steps, mesh dp={mesh['dp']} pp={mesh['pp']} tp={mesh['tp']} "
        f"on {len(m.devices)} {result.platform} devices; trace in {result.logdir}",
        "times are ms per step; CCOR = overlap / (compute + comm), bubble = idle / step",
        f"{'device':<18}{'step':>9}{'compute':>9}{'comm':>9}{'overlap':>9}{'idle':>9}"
        f"{'exposed':>9}{'CCOR':>9}{'bubble':>9}",
    ]
    for name, d in m.devices.items():
        lines.append(_row(name.replace("/device:", ""), d))
    overall = DeviceMetrics(m.step_time_s, m.compute_s, m.comm_s, m.overlap_s, m.idle_s)
    lines.append(_row("overall (mean)", overall))
    lines.append(
        f"step time {m.step_time_s * 1e3:.3f} ms, {result.tokens_per_step / m.step_time_s:,.0f} "
        f"tokens/s; CCOR {m.ccor * 100:.1f}%, bubble {m.bubble_rate * 100:.1f}%, exposed comm "
        f"{m.exposed_comm_s * 1e3:.3f} ms"
    )
    if m.collective_ops:
        lines.append(f"collectives: {', '.join(m.collective_ops)}")
    if m.synchronous_collectives:
        lines.append(
            "note: on the CPU backend collectives are synchronous (they block the op thread), "
            "so overlap 0 / CCOR 0% is expected here, not a bug."
        )
    lines.extend(f"note: {n}" for n in m.notes if "CPU backend" not in n)
    lines.extend(how_to_open(result.logdir))
    return "\n".join(lines)


def trace_files(logdir: str) -> dict[str, str | None]:
    """The newest run's XSpace (`xplane`, for TensorBoard's profile plugin) and Perfetto
    trace (`perfetto`) under `logdir/plugins/profile/<run>/`, None where absent."""
    runs = sorted(glob.glob(os.path.join(logdir, "plugins", "profile", "*")),
                  key=os.path.getmtime)
    found: dict[str, str | None] = {"xplane": None, "perfetto": None}
    if runs:
        xplane = glob.glob(os.path.join(runs[-1], "*.xplane.pb"))
        perfetto = glob.glob(os.path.join(runs[-1], "*perfetto_trace.json.gz"))
        found = {"xplane": xplane[0] if xplane else None,
                 "perfetto": perfetto[0] if perfetto else None}
    return found


def how_to_open(logdir: str) -> list[str]:
    """The lines that say how to open the trace in TensorBoard and in Perfetto."""
    files = trace_files(logdir)
    out = []
    if files["xplane"]:
        out.append(f"open: tensorboard --logdir {logdir} -> Profile tab (needs "
                   f"`pip install tensorboard-plugin-profile`); or xprof --logdir {logdir}")
    if files["perfetto"]:
        out.append(f"open: https://ui.perfetto.dev -> Open trace file -> {files['perfetto']}")
    return out


def profile_command(cfg: Config, steps: int = 3, as_json: bool = False, logdir: str = "") -> str:
    """What ``jax-overlap profile`` prints.

    Args:
      cfg: the resolved config (the CLI has already forced the host devices it needs).
      steps: traced steps.
      as_json: print the metrics as one JSON document instead of the table.
      logdir: profiler output directory (empty: ``runs/profile``).

    Returns:
      The text to print.
    """
    if steps < 1:
        raise ValueError(f"--steps: must be >= 1, got {steps}")
    result = profile_config(cfg, steps, logdir)
    if as_json:
        return json.dumps(result.to_dict(), sort_keys=True)
    return format_summary(result)
