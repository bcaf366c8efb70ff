"""Compute/communication overlap metrics from profiler traces.

Reads what ``jax.profiler.trace(logdir)`` writes -- the XSpace protobuf
``plugins/profile/<run>/<host>.xplane.pb`` (through ``jax.profiler.ProfileData``, the
reader that ships with jaxlib) -- or a Chrome/Perfetto trace JSON (``traceEvents``,
optionally gzipped, e.g. the ``.trace.json.gz`` next to it), and reduces it to per-device
timelines of *compute* and *communication* intervals over a window of whole steps.

Metric definitions (per device, over the window; ``C`` = union of compute intervals,
``M`` = union of collective intervals, both clipped to the window):

* compute = ``|C|``, comm = ``|M|``, overlap = ``|C ∩ M|``;
* idle = window − ``|C ∪ M|``; exposed comm = ``|M \\ C|`` = comm − overlap;
* CCOR = overlap / (compute + comm); bubble rate = idle / window.

Times are reported per step (window / steps). The overall numbers are the mean over
devices, and the overall ratios are taken from the summed times. The simulator
(:mod:`jax_overlap.analysis.simulate`) feeds its own timelines through
:func:`metrics_from_timelines` so measured and simulated numbers mean the same thing.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

Interval = tuple[float, float]

# ----------------------------------------------------------------- interval arithmetic


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Merge intervals into a sorted list of disjoint ones.

    Args:
      intervals: ``(start, end)`` pairs in any order; empty ones are dropped.

    Returns:
      Sorted, non-overlapping, non-touching intervals covering the same points.
    """
    merged: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def total(intervals: Iterable[Interval]) -> float:
    """Summed length of intervals (call on a :func:`union` to avoid double counting)."""
    return sum(end - start for start, end in intervals)


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """Intersection of two disjoint sorted interval lists (outputs of :func:`union`).

    Args:
      a: disjoint sorted intervals.
      b: disjoint sorted intervals.

    Returns:
      Disjoint sorted intervals covered by both.
    """
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        # Advance whichever interval ends first; the other may still meet the next one.
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def clip(intervals: Iterable[Interval], window: Interval) -> list[Interval]:
    """Restrict intervals to ``window`` (returned disjoint and sorted)."""
    lo, hi = window
    return union((max(s, lo), min(e, hi)) for s, e in intervals)


# ----------------------------------------------------------------- classification

# Substrings (after lower-casing and mapping "_" to "-") that mark an XLA op or GPU kernel
# as communication. HLO names ("all-reduce.3", "all-gather-start"), JAX primitive names
# that survive into CPU op names ("psum_invariant.7", "ppermute") and NCCL/RCCL kernels.
COLLECTIVE_PATTERNS: tuple[str, ...] = (
    "all-reduce",
    "allreduce",
    "all-gather",
    "allgather",
    "reduce-scatter",
    "reducescatter",
    "collective-permute",
    "collective-broadcast",
    "all-to-all",
    "alltoall",
    "ragged-all-to-all",
    "nccl",
    "rccl",
    "ppermute",
    "psum",
    "pmax",
    "pmin",
    "memcpyp2p",
)
# Point-to-point HLO ops ("send.2", "recv-done.1") as whole words only, so that e.g.
# "transcendental" does not count.
_SEND_RECV = re.compile(r"(?:^|[^a-z])(?:send|recv)(?:[^a-z]|$)")


def is_collective(*names: str) -> bool:
    """Whether an op/kernel is communication, judged by any of its names.

    Args:
      *names: the event name and, when known, its ``hlo_op`` / ``hlo_category`` stats.

    Returns:
      True if any name contains a collective pattern or a send/recv word.
    """
    for name in names:
        key = name.lower().replace("_", "-")
        if any(p in key for p in COLLECTIVE_PATTERNS) or _SEND_RECV.search(key):
            return True
    return False


# ----------------------------------------------------------------- trace records


@dataclass(frozen=True)
class OpEvent:
    """One device-side op or kernel execution.

    Attributes:
      device: device label, e.g. ``/device:GPU:0`` or ``/device:CPU:3``.
      line: the stream/thread it ran on (kept for plotting and debugging).
      name: op or kernel name.
      start_ns: start time in nanoseconds (trace clock).
      end_ns: end time in nanoseconds.
      collective: True for communication, False for compute.
    """

    device: str
    line: str
    name: str
    start_ns: float
    end_ns: float
    collective: bool


@dataclass(frozen=True)
class _Record:
    """A raw trace event, source-format independent."""

    process: str
    line: str
    name: str
    start_ns: float
    end_ns: float
    args: Mapping[str, Any]


@dataclass(frozen=True)
class Trace:
    """A parsed trace: device op events plus step markers.

    Attributes:
      events: device-side op events, sorted by start.
      steps: ``(start_ns, end_ns)`` of each marked step, in order; empty if unmarked.
      synchronous_collectives: True when ops came from the CPU backend, whose
        collectives block the op thread (a rendezvous), so overlap is 0 by construction.
      source: where the trace was read from.
    """

    events: tuple[OpEvent, ...]
    steps: tuple[Interval, ...]
    synchronous_collectives: bool
    source: str


# Lines that XProf derives from the kernel streams (or that hold host-side launch
# info). Counting them as well would double count the same device time.
_DERIVED_LINES = frozenset(
    {
        "Steps",
        "XLA Modules",
        "Async XLA Ops",
        "Launch Stats",
        "Source code",
        "TensorFlow Name Scope",
        "TensorFlow Ops",
        "Framework Name Scope",
        "Framework Ops",
        "XLA TraceMe",
        "SparseCore Steps",
    }
)
_DEVICE_PREFIX = "/device:"


def _select_ops(records: Sequence[_Record]) -> tuple[list[OpEvent], bool]:
    """Pick device-side op events out of all trace records.

    Accelerator traces carry ``/device:*`` planes whose stream lines hold the kernels;
    their host planes also carry thunk/launch events tagged with ``hlo_op``, which are
    *not* device time and are ignored. CPU traces have no device planes: the ops run on
    host threads, tagged with ``hlo_op`` and ``device_ordinal``.

    Args:
      records: every event of the trace.

    Returns:
      ``(events, from_host)``; ``from_host`` is True for CPU-backend traces.
    """
    device_records = [
        r for r in records if r.process.startswith(_DEVICE_PREFIX) and r.line not in _DERIVED_LINES
    ]
    if device_records:
        # "XLA Ops" duplicates the stream lines when both exist; keep the kernel streams,
        # which show when the collective kernels really ran.
        by_device: dict[str, set[str]] = {}
        for r in device_records:
            by_device.setdefault(r.process, set()).add(r.line)
        keep = [
            r for r in device_records if r.line != "XLA Ops" or by_device[r.process] == {"XLA Ops"}
        ]
        events = [
            OpEvent(
                r.process,
                r.line,
                r.name,
                r.start_ns,
                r.end_ns,
                is_collective(
                    r.name, str(r.args.get("hlo_op", "")), str(r.args.get("hlo_category", ""))
                ),
            )
            for r in keep
            if r.end_ns > r.start_ns
        ]
        return _leaves(events), False
    events = []
    for r in records:
        if "hlo_op" not in r.args or r.end_ns <= r.start_ns:
            continue
        ordinal = r.args.get("device_ordinal")
        device = f"{_DEVICE_PREFIX}CPU:{int(ordinal)}" if ordinal is not None else r.process
        events.append(
            OpEvent(
                device,
                r.line,
                r.name,
                r.start_ns,
                r.end_ns,
                is_collective(r.name, str(r.args["hlo_op"])),
            )
        )
    return _leaves(events), True


def _leaves(events: list[OpEvent]) -> list[OpEvent]:
    """Drop op events that enclose another op event on the same line.

    Control-flow ops (while, conditional, call) are traced around the ops they run; a
    ``while`` enclosing a collective would otherwise count as compute overlapping it.

    Args:
      events: op events.

    Returns:
      The innermost events, sorted by start.
    """
    by_line: dict[tuple[str, str], list[OpEvent]] = {}
    for e in events:
        by_line.setdefault((e.device, e.line), []).append(e)
    kept: list[OpEvent] = []
    for line_events in by_line.values():
        line_events.sort(key=lambda e: (e.start_ns, -e.end_ns))
        has_child = [False] * len(line_events)
        stack: list[int] = []
        for i, e in enumerate(line_events):
            while stack and line_events[stack[-1]].end_ns <= e.start_ns:
                stack.pop()
            if stack and e.end_ns <= line_events[stack[-1]].end_ns:
                has_child[stack[-1]] = True
            stack.append(i)
        kept.extend(e for e, parent in zip(line_events, has_child) if not parent)
    kept.sort(key=lambda e: (e.start_ns, e.device))
    return kept


def _steps(records: Sequence[_Record], step_name: str | None) -> tuple[Interval, ...]:
    """Step windows from ``StepTraceAnnotation`` events (those with a ``step_num`` arg).

    Args:
      records: every event of the trace.
      step_name: only markers with this name count; None accepts any name.

    Returns:
      One ``(start, end)`` per step number, sorted by step number.
    """
    spans: dict[int, Interval] = {}
    for r in records:
        if "step_num" not in r.args or (step_name is not None and r.name != step_name):
            continue
        try:
            num = int(r.args["step_num"])
        except (TypeError, ValueError):
            continue
        lo, hi = spans.get(num, (r.start_ns, r.end_ns))
        spans[num] = (min(lo, r.start_ns), max(hi, r.end_ns))
    return tuple(spans[k] for k in sorted(spans))


def _xspace_records(path: Path) -> list[_Record]:
    """Events of an ``.xplane.pb`` file, read with jaxlib's ``ProfileData``."""
    from jax.profiler import ProfileData  # jaxlib's XSpace reader; imported lazily

    data = ProfileData.from_file(str(path))
    records = []
    with warnings.catch_warnings():
        # jaxlib's stats iterator type warns about a missing __module__ on iteration.
        warnings.filterwarnings("ignore", "builtin type .* has no __module__", DeprecationWarning)
        for plane in data.planes:
            for line in plane.lines:
                for event in line.events:
                    start = float(event.start_ns)
                    records.append(
                        _Record(
                            plane.name,
                            line.name,
                            event.name,
                            start,
                            start + float(event.duration_ns),
                            dict(event.stats),
                        )
                    )
    return records


def _chrome_records(doc: Mapping[str, Any]) -> list[_Record]:
    """Events of a Chrome/Perfetto trace document (``ts``/``dur`` in microseconds).

    Complete events (``ph: X``) and begin/end pairs (``B``/``E``, matched per thread)
    are read; process and thread names come from ``M`` metadata events.
    """
    raw = doc["traceEvents"] if isinstance(doc, Mapping) else doc
    processes: dict[Any, str] = {}
    threads: dict[tuple[Any, Any], str] = {}
    for e in raw:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e.get("pid")] = str(e.get("args", {}).get("name", e.get("pid")))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", e.get("tid")))

    def names(e: Mapping[str, Any]) -> tuple[str, str]:
        pid, tid = e.get("pid"), e.get("tid")
        return processes.get(pid, str(pid)), threads.get((pid, tid), str(tid))

    records: list[_Record] = []
    open_events: dict[tuple[Any, Any], list[Mapping[str, Any]]] = {}
    for e in raw:
        ph = e.get("ph")
        if ph == "X":
            start = float(e["ts"]) * 1e3
            process, line = names(e)
            records.append(
                _Record(
                    process,
                    line,
                    str(e.get("name", "")),
                    start,
                    start + float(e.get("dur", 0.0)) * 1e3,
                    e.get("args", {}) or {},
                )
            )
        elif ph == "B":
            open_events.setdefault((e.get("pid"), e.get("tid")), []).append(e)
        elif ph == "E":
            stack = open_events.get((e.get("pid"), e.get("tid")))
            if stack:
                begin = stack.pop()
                process, line = names(begin)
                args = {**(begin.get("args") or {}), **(e.get("args") or {})}
                records.append(
                    _Record(
                        process,
                        line,
                        str(begin.get("name", "")),
                        float(begin["ts"]) * 1e3,
                        float(e["ts"]) * 1e3,
                        args,
                    )
                )
    return records


def find_trace_file(path: str | os.PathLike) -> Path:
    """Locate the trace file to read under a profiler log directory.

    Args:
      path: a trace file, a run directory, or the ``logdir`` given to
        ``jax.profiler.trace`` (the newest run under ``plugins/profile`` is used).

    Returns:
      An ``.xplane.pb`` file when one exists, else a ``.json``/``.json.gz`` trace.

    Raises:
      FileNotFoundError: if nothing readable is found.
    """
    p = Path(path)
    if p.is_file():
        return p
    if not p.is_dir():
        raise FileNotFoundError(f"trace: no such file or directory: {p}")
    runs = p / "plugins" / "profile"
    if runs.is_dir():
        dirs = [d for d in runs.iterdir() if d.is_dir()]
        if dirs:
            p = max(dirs, key=lambda d: (d.stat().st_mtime, d.name))
    for pattern in ("*.xplane.pb", "*.trace.json.gz", "*.json.gz", "*.json"):
        found = sorted(p.glob(pattern))
        if found:
            return found[0]
    raise FileNotFoundError(f"trace: no .xplane.pb or trace JSON under {p}")


def load_trace(
    source: str | os.PathLike | Mapping[str, Any], step_name: str | None = None
) -> Trace:
    """Read a trace into device op events and step windows.

    Args:
      source: a path accepted by :func:`find_trace_file`, or an already loaded Chrome
        trace document (a dict with ``traceEvents``).
      step_name: only step markers with this name count (None: any ``step_num`` event).

    Returns:
      The parsed :class:`Trace`.
    """
    if isinstance(source, Mapping):
        records, where = _chrome_records(source), "<chrome trace dict>"
    else:
        path = find_trace_file(source)
        where = str(path)
        if path.name.endswith(".pb"):
            records = _xspace_records(path)
        else:
            opener = gzip.open if path.name.endswith(".gz") else open
            with opener(path, "rt") as f:
                records = _chrome_records(json.load(f))
    events, from_host = _select_ops(records)
    return Trace(tuple(events), _steps(records, step_name), from_host, where)


# ----------------------------------------------------------------- metrics


@dataclass(frozen=True)
class DeviceMetrics:
    """Per-step times of one device (or the device mean), in seconds.

    Attributes:
      step_time_s: window length / steps.
      compute_s: time any compute op runs.
      comm_s: time any collective runs.
      overlap_s: time both run at once.
      idle_s: time neither runs.
    """

    step_time_s: float
    compute_s: float
    comm_s: float
    overlap_s: float
    idle_s: float

    @property
    def exposed_comm_s(self) -> float:
        """Communication time not hidden under compute."""
        return self.comm_s - self.overlap_s

    @property
    def ccor(self) -> float:
        """Compute-communication overlap ratio: overlap / (compute + comm)."""
        denom = self.compute_s + self.comm_s
        return self.overlap_s / denom if denom > 0 else 0.0

    @property
    def bubble_rate(self) -> float:
        """Idle fraction of the step."""
        return self.idle_s / self.step_time_s if self.step_time_s > 0 else 0.0

    def to_dict(self) -> dict[str, float]:
        """Fields plus the derived ratios, JSON-ready."""
        return {
            **asdict(self),
            "exposed_comm_s": self.exposed_comm_s,
            "ccor": self.ccor,
            "bubble_rate": self.bubble_rate,
        }


@dataclass(frozen=True)
class TraceMetrics:
    """Overlap metrics of a traced (or simulated) window of whole steps.

    Times are per step and averaged over devices; ratios come from the summed times.

    Attributes:
      steps: number of whole steps in the window.
      step_time_s: window length / steps.
      compute_s: compute time per device per step.
      comm_s: communication time per device per step.
      overlap_s: time compute and communication run at once.
      idle_s: time neither runs.
      exposed_comm_s: communication not under compute.
      ccor: overlap / (compute + comm).
      bubble_rate: idle / step time.
      devices: per-device metrics, keyed by device label.
      synchronous_collectives: True on the CPU backend, where collectives block the op
        thread and overlap 0 is expected.
      collective_ops: distinct names of the collective ops found.
      notes: caveats about how the numbers were obtained.
      source: trace file (or ``"simulation"``).
    """

    steps: int
    step_time_s: float
    compute_s: float
    comm_s: float
    overlap_s: float
    idle_s: float
    exposed_comm_s: float
    ccor: float
    bubble_rate: float
    devices: dict[str, DeviceMetrics] = field(default_factory=dict)
    synchronous_collectives: bool = False
    collective_ops: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict, per-device entries expanded with their ratios."""
        out = {k: v for k, v in asdict(self).items() if k != "devices"}
        out["devices"] = {name: m.to_dict() for name, m in self.devices.items()}
        out["collective_ops"] = list(self.collective_ops)
        out["notes"] = list(self.notes)
        return out

    def to_json(self, indent: int | None = 2) -> str:
        """The metrics as a JSON string."""
        return json.dumps(self.to_dict(), indent=indent)


def device_metrics(
    compute: Iterable[Interval], comm: Iterable[Interval], window: Interval, steps: int = 1
) -> DeviceMetrics:
    """Interval-union metrics of one device's timeline.

    Args:
      compute: compute intervals (seconds), possibly overlapping each other.
      comm: communication intervals (seconds).
      window: ``(start, end)`` of the whole steps measured.
      steps: number of steps in the window; times are divided by it.

    Returns:
      Per-step :class:`DeviceMetrics`.
    """
    c, m = clip(compute, window), clip(comm, window)
    busy = total(union(c + m))
    span = window[1] - window[0]
    return DeviceMetrics(
        step_time_s=span / steps,
        compute_s=total(c) / steps,
        comm_s=total(m) / steps,
        overlap_s=total(intersect(c, m)) / steps,
        idle_s=(span - busy) / steps,
    )


def metrics_from_timelines(
    timelines: Mapping[str, tuple[Iterable[Interval], Iterable[Interval]]],
    window: Interval,
    steps: int = 1,
    *,
    synchronous_collectives: bool = False,
    collective_ops: Sequence[str] = (),
    notes: Sequence[str] = (),
    source: str = "",
) -> TraceMetrics:
    """Combine per-device compute/comm timelines into :class:`TraceMetrics`.

    Args:
      timelines: device label -> ``(compute intervals, comm intervals)`` in seconds.
      window: the measured window in seconds.
      steps: whole steps in the window.
      synchronous_collectives: recorded as is (see :class:`TraceMetrics`).
      collective_ops: recorded as is.
      notes: recorded as is.
      source: recorded as is.

    Returns:
      The metrics; overall times are device means, ratios from summed times.
    """
    devices = {
        name: device_metrics(compute, comm, window, steps)
        for name, (compute, comm) in sorted(timelines.items())
    }
    n = max(len(devices), 1)
    mean = DeviceMetrics(
        step_time_s=(window[1] - window[0]) / steps,
        compute_s=sum(d.compute_s for d in devices.values()) / n,
        comm_s=sum(d.comm_s for d in devices.values()) / n,
        overlap_s=sum(d.overlap_s for d in devices.values()) / n,
        idle_s=sum(d.idle_s for d in devices.values()) / n
        if devices
        else (window[1] - window[0]) / steps,
    )
    return TraceMetrics(
        steps=steps,
        step_time_s=mean.step_time_s,
        compute_s=mean.compute_s,
        comm_s=mean.comm_s,
        overlap_s=mean.overlap_s,
        idle_s=mean.idle_s,
        exposed_comm_s=mean.exposed_comm_s,
        ccor=mean.ccor,
        bubble_rate=mean.bubble_rate,
        devices=devices,
        synchronous_collectives=synchronous_collectives,
        collective_ops=tuple(collective_ops),
        notes=tuple(notes),
        source=source,
    )


_SYNC_NOTE = (
    "CPU backend: collectives run synchronously inside the op thread (a rendezvous), so "
    "compute/communication overlap of 0 is expected here; waiting for slower devices "
    "is counted as communication time."
)


def trace_metrics(trace: Trace, skip_steps: int = 0) -> TraceMetrics:
    """Metrics of a parsed trace over its marked steps.

    Args:
      trace: from :func:`load_trace`.
      skip_steps: leading marked steps to leave out (e.g. a warm-up traced by mistake).

    Returns:
      The metrics. Without step markers the span of all device ops is one step.

    Raises:
      ValueError: if the trace holds no device ops, or ``skip_steps`` leaves no step.
    """
    if not trace.events:
        raise ValueError(f"trace: no device-side XLA op events found in {trace.source}")
    notes: list[str] = []
    steps = trace.steps[skip_steps:]
    if trace.steps and not steps:
        raise ValueError(f"trace: skip_steps={skip_steps} leaves none of {len(trace.steps)} steps")
    if steps:
        window_ns = (steps[0][0], steps[-1][1])
        n_steps = len(steps)
    else:
        window_ns = (min(e.start_ns for e in trace.events), max(e.end_ns for e in trace.events))
        n_steps = 1
        notes.append("no step markers (step_num) found: the span of all device ops is one step")
    if trace.synchronous_collectives:
        notes.append(_SYNC_NOTE)
    timelines: dict[str, tuple[list[Interval], list[Interval]]] = {}
    for e in trace.events:
        compute, comm = timelines.setdefault(e.device, ([], []))
        (comm if e.collective else compute).append((e.start_ns * 1e-9, e.end_ns * 1e-9))
    collectives = sorted({_base_name(e.name) for e in trace.events if e.collective})
    return metrics_from_timelines(
        timelines,
        (window_ns[0] * 1e-9, window_ns[1] * 1e-9),
        n_steps,
        synchronous_collectives=trace.synchronous_collectives,
        collective_ops=collectives,
        notes=notes,
        source=trace.source,
    )


def _base_name(name: str) -> str:
    """Op name without XLA's numeric suffix (``all-reduce.3`` -> ``all-reduce``)."""
    return re.sub(r"\.\d+$", "", name)


def parse_trace(
    source: str | os.PathLike | Mapping[str, Any],
    *,
    step_name: str | None = None,
    skip_steps: int = 0,
) -> TraceMetrics:
    """Read a trace and compute its overlap metrics.

    Args:
      source: trace file, run directory, profiler ``logdir``, or a Chrome trace dict.
      step_name: step marker name to use (None: any event carrying ``step_num``).
      skip_steps: leading marked steps to leave out.

    Returns:
      The :class:`TraceMetrics`.
    """
    return trace_metrics(load_trace(source, step_name), skip_steps)


def profile_steps(
    step_fn: Callable[..., Any],
    args: Sequence[Any],
    steps: int,
    logdir: str | os.PathLike,
    *,
    warmup: int = 1,
    step_name: str = "train",
    update_args: Callable[[Sequence[Any], Any], Sequence[Any]] | None = None,
) -> TraceMetrics:
    """Trace ``steps`` calls of ``step_fn`` and return their overlap metrics.

    Warm-up calls run untraced first, so compilation and first-touch allocation stay
    out of the window. Each traced call is wrapped in a ``StepTraceAnnotation`` and
    blocked on, so one step's device work lies inside its marker.

    Args:
      step_fn: the (jitted) step.
      args: positional arguments of the first call.
      steps: number of traced steps (>= 1).
      logdir: profiler output directory (the trace is left there for XProf/Perfetto).
      warmup: untraced calls before tracing.
      step_name: name of the step markers.
      update_args: ``(args, output) -> next args``, for steps that consume their state
        (e.g. donated buffers); None calls every step with the same ``args``.

    Returns:
      The :class:`TraceMetrics` of the traced steps.
    """
    import jax  # imported here so parsing traces does not initialise a backend

    if steps < 1:
        raise ValueError(f"profile_steps: steps must be >= 1, got {steps}")
    args = tuple(args)
    for _ in range(warmup):
        out = jax.block_until_ready(step_fn(*args))
        if update_args is not None:
            args = tuple(update_args(args, out))
    before = set(_run_dirs(logdir))
    # The .xplane.pb is what TensorBoard's profile plugin (XProf) opens; the Perfetto JSON
    # next to it opens at https://ui.perfetto.dev.
    with jax.profiler.trace(str(logdir), create_perfetto_trace=True):
        for i in range(steps):
            with jax.profiler.StepTraceAnnotation(step_name, step_num=i):
                out = jax.block_until_ready(step_fn(*args))
            if update_args is not None:
                args = tuple(update_args(args, out))
    new_runs = [d for d in _run_dirs(logdir) if d not in before]
    target = max(new_runs, key=lambda d: d.stat().st_mtime) if new_runs else Path(logdir)
    return parse_trace(target, step_name=step_name)


def _run_dirs(logdir: str | os.PathLike) -> list[Path]:
    runs = Path(logdir) / "plugins" / "profile"
    return [d for d in runs.iterdir() if d.is_dir()] if runs.is_dir() else []
