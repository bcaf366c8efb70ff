"""Event-driven timeline simulator of one training step of a DP x PP x TP plan.

The pipeline schedule is data (:class:`jax_overlap.pipeline.table.Schedule`). The
executor runs its table in lockstep; the simulator instead plays it event-driven: each
stage runs its row's actions in order (idle entries skipped), each action starting as
soon as the stage is free and its inputs have arrived. That is what the hardware would
do with the same per-stage order, so the simulated bubble is a lower bound of the
lockstep one and equals it when all actions cost the same.

Every device (one per pipeline stage; DP replicas and TP ranks behave identically and
are not simulated separately) has one compute stream and one FIFO stream per kind of
communication:

* ``pp``: activation / gradient sends to the neighbouring stage (overlappable);
* ``dp``: gradient-bucket all-reduces (reduce-scatters under FSDP), issued as the last
  microbatch's backward produces each bucket (overlappable);
* ``fsdp``: parameter all-gathers, prefetched ``window`` actions ahead (overlappable
  when ``window >= 1``; ``window = 0`` gathers on demand, exposed);
* ``tp``: tensor-parallel collectives; ``plain`` all-reduces block the compute stream
  (always exposed), ``collective_matmul`` splits each one into ring steps that run
  under the matmul chunks.

Transfers cost ``latency + bytes / (bandwidth x efficiency)`` per hop on the link the
hardware profile assigns to the mesh axis; collectives use ring algorithms
(:func:`jax_overlap.hardware.collective_cost.collective_seconds`). Streams
that share a physical link do not slow each other down (a simplification). On a
profile with ``synchronous_collectives`` (the XLA CPU backend) every transfer also
occupies the compute stream, so nothing overlaps -- which is what a CPU trace shows.

Metrics come from :func:`jax_overlap.analysis.trace.metrics_from_timelines`, the same
interval arithmetic as the measured-trace metrics, over the window ``[0, step end]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from jax_overlap.hardware.collective_cost import collective_seconds
from jax_overlap.hardware.machine import HardwareProfile, Link
from jax_overlap.analysis.trace import TraceMetrics, metrics_from_timelines
from jax_overlap.pipeline import ticks
from jax_overlap.pipeline.table import Schedule, Task, cell_actions, dependencies

TP_COMM_MODES: tuple[str, ...] = ("plain", "collective_matmul")
BUCKET_ISSUE_MODES: tuple[str, ...] = ("during_backward", "after_backward")
TIMINGS: tuple[str, ...] = ("events", "ticks")

# --------------------------------------------------------------- collective cost model


def p2p_time(nbytes: float, link: Link) -> float:
    """One point-to-point transfer: latency + bytes / effective bandwidth (0 if no bytes)."""
    return collective_seconds("collective-permute", nbytes, None, link)


def all_reduce_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of ``nbytes`` per device over ``n`` devices.

    ``2(n-1)`` hops, each moving ``nbytes / n``: reduce-scatter then all-gather.

    Args:
      nbytes: bytes each device contributes (and receives).
      n: devices in the group.
      link: the group's link.

    Returns:
      Seconds; 0 for ``n <= 1`` or no bytes.
    """
    return collective_seconds("all-reduce", nbytes, n, link)


def all_gather_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather (or reduce-scatter) of a ``nbytes`` full buffer over ``n`` devices.

    ``n-1`` hops, each moving one ``nbytes / n`` shard.

    Args:
      nbytes: size of the gathered (reduce-scatter: input) buffer per device.
      n: devices in the group.
      link: the group's link.

    Returns:
      Seconds; 0 for ``n <= 1`` or no bytes.
    """
    return collective_seconds("all-gather", nbytes, n, link)


reduce_scatter_time = all_gather_time

# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Costs:
    """Per-virtual-stage costs of one microbatch, as seen by one device.

    Bytes are per device, i.e. already divided by the TP degree where TP shards them.

    Attributes:
      forward_s: ``F`` compute seconds per virtual stage.
      backward_s: ``B`` (input-gradient) compute seconds per virtual stage.
      weight_s: ``W`` (weight-gradient) compute seconds per virtual stage; a non-split
        schedule's ``B`` costs ``backward_s + weight_s``.
      act_bytes: bytes of the activation (and of its gradient) one microbatch sends
        across a stage boundary.
      tp_bytes: per virtual stage, bytes all-reduced over the TP axis by one ``F`` and
        again by one ``B`` (Megatron's conjugate collectives); empty means none.
      param_bytes: per virtual stage, parameter bytes on one device (unsharded by FSDP);
        empty means zero.
      stash_bytes: per virtual stage, activation bytes one microbatch holds from its
        ``F`` until its last backward action; empty means ``act_bytes`` each.
      optimizer_factor: optimizer-state bytes per parameter byte (Adam's two moments
        in the parameter dtype: 2).
      head_s: a vocabulary-parallel head's phase on one device (its 1/pp of the head's
        forward, input- and weight-gradient work), run by every stage at once after the last
        virtual stage's F; the last virtual stage's costs then leave the head out. 0 when the
        head is part of the last virtual stage.
    """

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    weight_s: tuple[float, ...]
    act_bytes: float = 0.0
    tp_bytes: tuple[float, ...] = ()
    param_bytes: tuple[float, ...] = ()
    stash_bytes: tuple[float, ...] = ()
    optimizer_factor: float = 2.0
    head_s: float = 0.0

    @property
    def num_virtual_stages(self) -> int:
        """Virtual stages these costs describe."""
        return len(self.forward_s)

    @classmethod
    def uniform(
        cls,
        num_virtual_stages: int,
        forward_s: float,
        backward_s: float,
        weight_s: float,
        *,
        tp_bytes: float = 0.0,
        param_bytes: float = 0.0,
        stash_bytes: float | None = None,
        **kwargs: Any,
    ) -> Costs:
        """The same costs for every virtual stage.

        Args:
          num_virtual_stages: ``p * v``.
          forward_s: ``F`` seconds.
          backward_s: ``B`` seconds (input gradients).
          weight_s: ``W`` seconds.
          tp_bytes: TP bytes per ``F`` / ``B``.
          param_bytes: parameter bytes per virtual stage.
          stash_bytes: held activation bytes per microbatch (None: ``act_bytes``).
          **kwargs: other :class:`Costs` fields (``act_bytes``, ``optimizer_factor``).

        Returns:
          The :class:`Costs`.
        """
        n = num_virtual_stages
        return cls(
            forward_s=(float(forward_s),) * n,
            backward_s=(float(backward_s),) * n,
            weight_s=(float(weight_s),) * n,
            tp_bytes=(float(tp_bytes),) * n,
            param_bytes=(float(param_bytes),) * n,
            stash_bytes=() if stash_bytes is None else (float(stash_bytes),) * n,
            **kwargs,
        )

    def compute_s(self, kind: str, vs: int, split_backward: bool) -> float:
        """Compute seconds of one action on virtual stage ``vs``."""
        if kind == "F":
            return self.forward_s[vs]
        if kind == "B":
            return self.backward_s[vs] + (0.0 if split_backward else self.weight_s[vs])
        return self.weight_s[vs]

    def _at(self, values: tuple[float, ...], vs: int, default: float) -> float:
        return values[vs] if values else default

    def tp(self, vs: int) -> float:
        """TP bytes of one ``F`` or ``B`` on ``vs``."""
        return self._at(self.tp_bytes, vs, 0.0)

    def params(self, vs: int) -> float:
        """Parameter bytes of ``vs`` on one device."""
        return self._at(self.param_bytes, vs, 0.0)

    def stash(self, vs: int) -> float:
        """Activation bytes one microbatch holds on ``vs``."""
        return self._at(self.stash_bytes, vs, self.act_bytes)


@dataclass(frozen=True)
class Plan:
    """How one training step is laid out and where its communication goes.

    Attributes:
      schedule: the pipeline schedule (its ``stages`` is the PP degree).
      dp: data-parallel degree.
      tp: tensor-parallel degree.
      grad_buckets: gradient bucket sizes in bytes, in issue order, for each pipeline
        stage: one flat sequence (every stage alike) or one sequence per stage.
      bucket_issue: ``during_backward`` -- each bucket is all-reduced as soon as the last
        microbatch's backward has produced it; ``after_backward`` -- all buckets wait
        for that backward to finish.
      fsdp: shard parameters over ``dp`` and all-gather them before each ``F`` / ``B``
        (gradient buckets then reduce-scatter instead of all-reduce).
      fsdp_window: prefetch distance, in actions, of the FSDP all-gathers; 0 gathers on
        demand (no prefetch).
      tp_comm: ``plain`` (blocking all-reduce) or ``collective_matmul``.
      vocab_parallel: the head runs vocabulary-parallel (`pipeline.vocab_parallel`): after
        each last-virtual-stage F, every stage joins a head phase (``costs.head_s`` of
        compute between two blocking all-reduces over pp of one activation: the hidden state
        out, its gradient back), and that microbatch's last B waits for it.
    """

    schedule: Schedule
    dp: int = 1
    tp: int = 1
    grad_buckets: tuple[float, ...] | tuple[tuple[float, ...], ...] = ()
    bucket_issue: str = "during_backward"
    fsdp: bool = False
    fsdp_window: int = 0
    tp_comm: str = "plain"
    vocab_parallel: bool = False

    @property
    def pp(self) -> int:
        """Pipeline-parallel degree (the schedule's stages)."""
        return self.schedule.stages

    def buckets(self, stage: int) -> tuple[float, ...]:
        """Gradient bucket sizes of ``stage``, in issue order."""
        b = tuple(self.grad_buckets)
        if b and isinstance(b[0], (tuple, list)):
            return tuple(float(x) for x in b[stage])
        return tuple(float(x) for x in b)


def even_buckets(total_bytes: float, bucket_bytes: float) -> tuple[float, ...]:
    """Split ``total_bytes`` of gradients into buckets of at most ``bucket_bytes``.

    Args:
      total_bytes: gradient bytes of one stage.
      bucket_bytes: bucket capacity (> 0).

    Returns:
      Bucket sizes in issue order; the last one may be smaller.
    """
    if total_bytes <= 0:
        return ()
    full, rest = divmod(float(total_bytes), float(bucket_bytes))
    return (float(bucket_bytes),) * int(full) + ((rest,) if rest > 0 else ())


def _check(plan: Plan, costs: Costs) -> None:
    s = plan.schedule
    n_vs = s.stages * s.virtual_stages
    if costs.num_virtual_stages != n_vs:
        raise ValueError(
            f"simulate: costs describe {costs.num_virtual_stages} virtual stages, "
            f"schedule {s.name!r} has {n_vs} (stages x virtual_stages)"
        )
    for name in ("backward_s", "weight_s", "tp_bytes", "param_bytes", "stash_bytes"):
        values = getattr(costs, name)
        if values and len(values) != n_vs:
            raise ValueError(f"simulate: costs.{name} has {len(values)} entries, expected {n_vs}")
    if plan.tp_comm not in TP_COMM_MODES:
        raise ValueError(
            f"simulate: plan.tp_comm must be one of {TP_COMM_MODES}, got {plan.tp_comm!r}"
        )
    if plan.bucket_issue not in BUCKET_ISSUE_MODES:
        raise ValueError(
            f"simulate: plan.bucket_issue must be one of {BUCKET_ISSUE_MODES}, "
            f"got {plan.bucket_issue!r}"
        )
    if plan.dp < 1 or plan.tp < 1 or plan.fsdp_window < 0:
        raise ValueError("simulate: plan.dp and plan.tp must be >= 1 and plan.fsdp_window >= 0")
    b = tuple(plan.grad_buckets)
    if b and isinstance(b[0], (tuple, list)) and len(b) != s.stages:
        raise ValueError(
            f"simulate: plan.grad_buckets has {len(b)} per-stage lists, expected {s.stages}"
        )


# -------------------------------------------------------------------------- outputs


@dataclass(frozen=True)
class SimEvent:
    """One interval on one device's timeline.

    Attributes:
      stage: pipeline stage (device) index.
      stream: ``compute``, ``pp``, ``dp``, ``fsdp`` or ``tp``.
      kind: ``compute`` or ``comm``.
      name: what ran, e.g. ``F mb3 vs1`` or ``all-reduce grad bucket 0``.
      start_s: start, seconds from the step's start.
      end_s: end, seconds.
    """

    stage: int
    stream: str
    kind: str
    name: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak memory of one device, in bytes.

    Attributes:
      params: parameters held (sharded over dp under FSDP).
      grads: gradient accumulators (unsharded: accumulated over microbatches before
        they are reduced).
      optimizer: optimizer state (``optimizer_factor`` x sharded params).
      gathered: FSDP all-gather buffers in flight (current plus ``window`` prefetched).
      activations: peak of the activations held between ``F`` and the last backward.
    """

    params: float
    grads: float
    optimizer: float
    gathered: float
    activations: float

    @property
    def total(self) -> float:
        """Sum of all parts."""
        return self.params + self.grads + self.optimizer + self.gathered + self.activations


@dataclass(frozen=True)
class SimResult:
    """What one simulated step looks like.

    Attributes:
      step_time_s: time until the last compute or communication ends.
      ccor: overlap / (compute + comm), device mean.
      bubble_rate: idle / step time, device mean.
      exposed_comm_s: communication not under compute, per device (mean).
      peak_memory_bytes: the largest per-device :attr:`MemoryEstimate.total`.
      memory: per-stage memory estimates.
      metrics: the full metrics (per device too), comparable with a measured trace's.
      events: the timeline, when requested.
    """

    step_time_s: float
    ccor: float
    bubble_rate: float
    exposed_comm_s: float
    peak_memory_bytes: float
    memory: tuple[MemoryEstimate, ...]
    metrics: TraceMetrics
    events: tuple[SimEvent, ...] | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (without the event list)."""
        return {
            "step_time_s": self.step_time_s,
            "ccor": self.ccor,
            "bubble_rate": self.bubble_rate,
            "exposed_comm_s": self.exposed_comm_s,
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory": [{**asdict(m), "total": m.total} for m in self.memory],
            "metrics": self.metrics.to_dict(),
        }


# ------------------------------------------------------------------------ simulator


def _device(stage: int) -> str:
    return f"/device:SIM:{stage}"


class _Timeline:
    """Mutable bookkeeping of one simulation: streams, events, finish times."""

    def __init__(self, stages: int, synchronous: bool = False):
        self.compute_free = [0.0] * stages
        self.stream_free: dict[tuple[int, str], float] = {}
        self.events: list[SimEvent] = []
        self.synchronous = synchronous

    def add(self, stage: int, stream: str, kind: str, name: str, start: float, end: float) -> None:
        if end > start:
            self.events.append(SimEvent(stage, stream, kind, name, start, end))

    def enqueue(self, stage: int, stream: str, name: str, ready: float, duration: float) -> float:
        """Run a transfer on a FIFO comm stream once ``ready``; returns its end."""
        start = max(ready, self.stream_free.get((stage, stream), 0.0))
        if self.synchronous and duration > 0:
            # The transfer runs on the op thread: after the current compute, blocking it.
            start = max(start, self.compute_free[stage])
            self.compute_free[stage] = start + duration
        end = start + duration
        self.stream_free[(stage, stream)] = end
        self.add(stage, stream, "comm", name, start, end)
        return end


def _run_action(
    tl: _Timeline,
    stage: int,
    label: str,
    start: float,
    compute: float,
    tp_bytes: float,
    plan: Plan,
    link: Link,
) -> float:
    """Place one action's compute (and its TP collectives) from ``start``; returns its end."""
    n = plan.tp
    if n <= 1 or tp_bytes <= 0:
        tl.add(stage, "compute", "compute", label, start, start + compute)
        return start + compute
    if plan.tp_comm == "plain":
        # The matmul's output is needed right away, so the all-reduce blocks compute.
        t = start + compute
        tl.add(stage, "compute", "compute", label, start, t)
        end = t + all_reduce_time(tp_bytes, n, link)
        tl.add(stage, "tp", "comm", f"all-reduce tp {label}", t, end)
        return end
    # Collective matmul: the all-reduce becomes a reduce-scatter and an all-gather, each
    # n-1 ring steps of one shard; step i's transfer runs under matmul chunk i, and the
    # last chunk of each phase has nothing left to hide.
    chunk = compute / (2 * n)
    step = p2p_time(tp_bytes / n, link)
    t = start
    for _phase in range(2):
        for i in range(n - 1):
            tl.add(stage, "compute", "compute", label, t, t + chunk)
            if tl.synchronous:  # the ring step waits for the chunk instead of running under it
                tl.add(
                    stage,
                    "tp",
                    "comm",
                    f"collective-permute tp {label} step {i}",
                    t + chunk,
                    t + chunk + step,
                )
                t += chunk + step
                continue
            tl.add(stage, "tp", "comm", f"collective-permute tp {label} step {i}", t, t + step)
            t += max(chunk, step)
        tl.add(stage, "compute", "compute", label, t, t + chunk)
        t += chunk
    return t


def _bucket_ready_times(
    spans: Sequence[tuple[float, float]], buckets: Sequence[float], issue: str
) -> list[float]:
    """When each gradient bucket is complete.

    Gradients of the last microbatch are produced at a uniform rate over the spans of
    the stage's final weight-gradient actions (taken back to back); bucket ``i`` is
    ready once the share of that work equal to its cumulative byte share is done.

    Args:
      spans: ``(start, end)`` of the final weight-gradient actions, in order.
      buckets: bucket bytes in issue order.
      issue: ``during_backward`` or ``after_backward``.

    Returns:
      One ready time per bucket.
    """
    end_all = spans[-1][1]
    if issue == "after_backward":
        return [end_all] * len(buckets)
    work = sum(e - s for s, e in spans)
    total_bytes = sum(buckets)
    times, cum = [], 0.0
    for b in buckets:
        cum += b
        target = work * cum / total_bytes
        t, done = end_all, 0.0
        for s, e in spans:
            if done + (e - s) >= target - 1e-15:
                t = s + (target - done)
                break
            done += e - s
        times.append(min(t, end_all))
    return times


def simulate(
    plan: Plan, costs: Costs, hw: HardwareProfile, *, record_events: bool = False,
    timing: str = "events",
) -> SimResult:
    """Simulate one training step.

    Args:
      plan: schedule, parallel degrees and communication choices.
      costs: per-virtual-stage compute times and message sizes.
      hw: hardware profile; links for the ``dp``, ``pp`` and ``tp`` axes are used.
      record_events: return the timeline (for plotting or :func:`events_to_chrome_trace`).
      timing: ``events`` -- each stage runs its row's actions in order, each as soon as its
        inputs are there (what an MPMD runtime does with the table's per-stage order);
        ``ticks`` -- the executor's program: tick by tick, every stage's tick ending with
        the stage-to-stage permutes, which complete only when both neighbours on the ring
        have reached them (:func:`_play_ticks`).

    Returns:
      The :class:`SimResult`.

    Raises:
      ValueError: inconsistent inputs, or a schedule whose order deadlocks.
    """
    _check(plan, costs)
    if timing not in TIMINGS:
        raise ValueError(f"simulate: timing must be one of {TIMINGS}, got {timing!r}")
    s = plan.schedule
    p = s.stages
    # A paired tick's two actions run back to back on their stage, forward first. Under a
    # vocabulary-parallel head every stage runs the head phase H at the tick where the last
    # virtual stage's F runs, as the executor does: after the tick's action, or after both
    # lanes of a paired tick.
    heads = _head_ticks(s) if plan.vocab_parallel else {}
    rows = []
    for d, row in enumerate(s.grid):
        tasks = []
        for t, cell in enumerate(row):
            acts = [s.task(d, a) for a in cell_actions(cell)]
            if t in heads:
                acts.append(Task("H", heads[t], -1))
            tasks.extend(acts)
        rows.append(tasks)
    link = {axis: hw.link(axis) for axis in ("dp", "pp", "tp")}
    release = "W" if s.split_backward else "B"

    tl = _Timeline(p, hw.synchronous_collectives)
    starts: list[list[float]] = [[] for _ in range(p)]
    ends: list[list[float]] = [[] for _ in range(p)]
    held: list[list[tuple[float, float]]] = [[] for _ in range(p)]  # (time, +/- bytes)

    if timing == "ticks":
        _play_ticks(plan, costs, heads, tl, link, starts, ends, held)
    else:
        _play_events(plan, costs, rows, heads, tl, link, starts, ends, held)

    # Gradient buckets: reduced over dp once the last microbatch's weight gradients exist.
    if plan.dp > 1:
        for d in range(p):
            buckets = [b for b in plan.buckets(d) if b > 0]
            if not buckets:
                continue
            last: dict[int, int] = {}
            for j, task in enumerate(rows[d]):
                if task.kind == release:
                    last[task.virtual_stage] = j
            spans = [(starts[d][j], ends[d][j]) for j in sorted(last.values())]
            ready = _bucket_ready_times(spans, buckets, plan.bucket_issue)
            op, cost = (
                ("reduce-scatter", reduce_scatter_time)
                if plan.fsdp
                else ("all-reduce", all_reduce_time)
            )
            for i, (b, t) in enumerate(zip(buckets, ready)):
                tl.enqueue(d, "dp", f"{op} grad bucket {i}", t, cost(b, plan.dp, link["dp"]))

    step_end = max([e.end_s for e in tl.events] + tl.compute_free + [0.0])
    timelines = {
        _device(d): (
            [(e.start_s, e.end_s) for e in tl.events if e.stage == d and e.kind == "compute"],
            [(e.start_s, e.end_s) for e in tl.events if e.stage == d and e.kind == "comm"],
        )
        for d in range(p)
    }
    metrics = metrics_from_timelines(
        timelines,
        (0.0, step_end),
        1,
        synchronous_collectives=hw.synchronous_collectives,
        collective_ops=sorted({e.name.split(" ")[0] for e in tl.events if e.kind == "comm"}),
        notes=(f"simulated {s.name}: pp={p} dp={plan.dp} tp={plan.tp} on {hw.name}",),
        source="simulation",
    )
    memory = tuple(_memory(d, plan, costs, held[d]) for d in range(p))
    return SimResult(
        step_time_s=step_end,
        ccor=metrics.ccor,
        bubble_rate=metrics.bubble_rate,
        exposed_comm_s=metrics.exposed_comm_s,
        peak_memory_bytes=max(m.total for m in memory),
        memory=memory,
        metrics=metrics,
        events=tuple(tl.events) if record_events else None,
    )


def _place_action(tl: _Timeline, plan: Plan, costs: Costs, link: dict[str, Link], d: int,
                  task: Task, start: float, starts, ends, held) -> float:
    """Places one action on stage `d` from `start` (its compute and TP collectives), records
    its span in `starts` / `ends` and what it holds or releases in `held`; returns its end."""
    s = plan.schedule
    vs = task.virtual_stage
    tp_bytes = costs.tp(vs) if task.kind in ("F", "B") else 0.0
    end = _run_action(tl, d, f"{task.kind} mb{task.microbatch} vs{vs}", start,
                      costs.compute_s(task.kind, vs, s.split_backward), tp_bytes, plan,
                      link["tp"])
    starts[d].append(start)
    ends[d].append(end)
    if task.kind == "F":
        held[d].append((start, costs.stash(vs)))
    if task.kind == ("W" if s.split_backward else "B"):
        held[d].append((end, -costs.stash(vs)))
    return end


def _place_head(tl: _Timeline, costs: Costs, link: dict[str, Link], mb: int, start: float,
                starts, ends, hidden: bool = False) -> float:
    """Places microbatch `mb`'s vocabulary-parallel head phase on every stage from `start`:
    an all-reduce over pp of the hidden state, ``costs.head_s`` of compute, an all-reduce of
    its gradient. Blocking, but `hidden` (a paired tick on a GPU: the executor runs the first
    under the backward lane before the phase and the second under the next forward lane).
    Records its span on every stage; returns its end."""
    reduce_s = all_reduce_time(costs.act_bytes, len(starts), link["pp"])
    for d in range(len(starts)):
        t = start
        if hidden:
            tl.add(d, "pp", "comm", f"all-reduce head input mb{mb}", t - reduce_s, t)
        else:  # blocking: the logits need the hidden state
            tl.add(d, "pp", "comm", f"all-reduce head input mb{mb}", t, t + reduce_s)
            t += reduce_s
        tl.add(d, "compute", "compute", f"H mb{mb}", t, t + costs.head_s)
        t += costs.head_s
        tl.add(d, "pp", "comm", f"all-reduce head gradient mb{mb}", t, t + reduce_s)
        if not hidden:  # the B needs its gradient
            t += reduce_s
        starts[d].append(start)
        ends[d].append(t)
    return t


def _play_events(plan: Plan, costs: Costs, rows, heads: dict[int, int], tl: _Timeline,
                 link: dict[str, Link], starts, ends, held) -> None:
    """Plays the table event-driven: each stage runs `rows[stage]` in order, each action as
    soon as the stage is free and its inputs have arrived; a head phase waits for every
    stage to reach it. Fills `tl`, `starts` / `ends` (one entry per element of each row)
    and `held`.

    Raises:
      ValueError: a schedule whose order deadlocks.
    """
    s = plan.schedule
    p, n_vs = s.stages, s.stages * s.virtual_stages
    stage_of = [pos[0] for pos in s.placement]
    gather = plan.fsdp and plan.dp > 1
    finish: dict[Task, float] = {}
    arrival: dict[Task, float] = {}
    gathers: dict[tuple[int, int], float] = {}  # (stage, action index) -> gather end

    def ready_at(dep: Task, stage: int) -> float | None:
        if dep not in finish:
            return None
        if dep.kind == "H" or stage_of[dep.virtual_stage] == stage:
            return finish[dep]
        return arrival[dep]

    def issue_gather(d: int, j: int, issue: float) -> None:
        task = rows[d][j]
        if task.kind == "W":  # weight gradients need activations and output grads only
            return
        vs = task.virtual_stage
        gathers[(d, j)] = tl.enqueue(
            d,
            "fsdp",
            f"all-gather params vs{vs} for {task.kind} mb{task.microbatch}",
            issue,
            all_gather_time(costs.params(vs), plan.dp, link["dp"]),
        )

    if gather and plan.fsdp_window > 0:
        for d in range(p):
            for j in range(min(plan.fsdp_window, len(rows[d]))):
                issue_gather(d, j, 0.0)

    def run_head(mb: int) -> bool:
        """The head phase of `mb` on every stage at once, if all have reached it."""
        h = Task("H", mb, -1)
        made = Task("F", mb, n_vs - 1)
        if made not in finish or any(nxt[d] >= len(rows[d]) or rows[d][nxt[d]] != h
                                     for d in range(p)):
            return False
        end = _place_head(tl, costs, link, mb, max([*tl.compute_free, finish[made]]), starts,
                          ends)
        for d in range(p):
            tl.compute_free[d] = end
            nxt[d] += 1
        finish[h] = end
        return True

    nxt = [0] * p
    remaining = sum(len(r) for r in rows)
    while remaining:
        progressed = False
        for d in range(p):
            while nxt[d] < len(rows[d]):
                j, task = nxt[d], rows[d][nxt[d]]
                if task.kind == "H":
                    if not run_head(task.microbatch):
                        break
                    remaining -= p
                    progressed = True
                    continue
                deps = dependencies(task, n_vs)
                if heads and task.kind == "B" and task.virtual_stage == n_vs - 1:
                    deps = (*deps, Task("H", task.microbatch, -1))
                times = [ready_at(dep, d) for dep in deps]
                if any(t is None for t in times):
                    break
                inputs = max(times, default=0.0)
                if gather and plan.fsdp_window == 0:
                    issue_gather(d, j, max(tl.compute_free[d], inputs))
                start = max(tl.compute_free[d], inputs, gathers.get((d, j), 0.0))
                vs, mb = task.virtual_stage, task.microbatch
                end = _place_action(tl, plan, costs, link, d, task, start, starts, ends, held)
                tl.compute_free[d] = end
                finish[task] = end
                if gather and plan.fsdp_window > 0 and j + plan.fsdp_window < len(rows[d]):
                    issue_gather(d, j + plan.fsdp_window, start)
                # Hand the output to the next stage in model order (F) or back (B).
                nxt_vs = vs + 1 if task.kind == "F" else vs - 1 if task.kind == "B" else None
                if nxt_vs is not None and 0 <= nxt_vs < n_vs and stage_of[nxt_vs] != d:
                    what = "act" if task.kind == "F" else "grad"
                    sent = tl.enqueue(
                        d,
                        "pp",
                        f"send {what} mb{mb} vs{vs}->vs{nxt_vs}",
                        end,
                        p2p_time(costs.act_bytes, link["pp"]),
                    )
                    if s.transfer_latency >= 2:
                        # Sent beside the stage's next tick, readable after it: the transfer
                        # hides under a tick of compute (the action's own length stands in
                        # for the tick's).
                        arrival[task] = max(sent, end + (end - start))
                    else:
                        arrival[task] = sent
                else:
                    arrival[task] = end
                nxt[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [f"stage {d}: {rows[d][nxt[d]]}" for d in range(p) if nxt[d] < len(rows[d])]
            raise ValueError(
                f"simulate: schedule {s.name!r} deadlocks; waiting: {'; '.join(stuck)}"
            )


def _play_ticks(plan: Plan, costs: Costs, heads: dict[int, int], tl: _Timeline,
                link: dict[str, Link], starts, ends, held) -> None:
    """Plays the table the way the executor's SPMD program runs it on a GPU.

    The program is a loop over ticks. In a tick each stage runs its entry (a pair: the
    forward lane, then the backward lane), and the stages exchange activations and
    gradients with `ppermute`s on the +1 / -1 rings. A permute completes on a stage only
    once the stage it sends to and the stage it receives from have both reached it, so
    no stage runs ahead of its ring neighbours by more than the permute's slack:

    * latency 1, unpaired: a tick's permutes follow its action; a stage's tick ends at the
      latest action end among itself and its ring partners, plus the transfer. On a GPU
      (`ticks.tick_rings`) those permutes carry only the transfers read at the next tick and
      meet only the stages that trade them at this tick; the others go on the slack ring,
      issued before the next tick's action as a skewed permute is.
    * latency 2 (skewed) and each lane of a paired tick: the permute carrying the previous
      (half-)tick's output is issued before the action and finishes after it, so a stage's
      tick ends at its own action's end or, if later, its partners' start plus the transfer.
    * a vocabulary-parallel head phase (at the end of the tick where the last virtual
      stage's F runs) is a collective over every stage: it starts when the last of them gets
      there, then two blocking all-reduces of one activation around ``head_s`` -- in a
      paired tick on a GPU they run under the lanes beside it, leaving ``head_s``.

    The FSDP gather of a stage's blocks happens once per step under the pipeline (the
    executor gathers them before the loop): one blocking all-gather at the start.
    Fills `tl`, and per stage `starts` / `ends` (in the order `simulate` lists the stage's
    actions and head phases) and the activation `held` events.
    """
    s = plan.schedule
    p = s.stages
    xfer = p2p_time(costs.act_bytes, link["pp"])
    # The ring partners each lane's permute waits for, and the rendezvous rule, are
    # `jax_overlap.pipeline.ticks`' (what `schedule --costs` reports as weighted_bubble).
    near = ticks.permute_partners(s)
    lanes = len(near)
    per_tick = ticks.tick_rings(s) and not tl.synchronous
    if per_tick:
        urgent, slack = ticks.rendezvous_partners(s)
    clock = [0.0] * p
    if plan.fsdp and plan.dp > 1:
        for d in range(p):
            mine = [vs for vs, (st, _) in enumerate(s.placement) if st == d]
            clock[d] = tl.enqueue(d, "fsdp", "all-gather stage params", 0.0,
                                  all_gather_time(sum(costs.params(vs) for vs in mine),
                                                  plan.dp, link["dp"]))
    for t in range(s.ticks):
        for lane in range(lanes):
            begin = list(clock)
            done = list(clock)
            for d in range(p):
                for at, a in ticks.cell_lanes(s.grid[d][t], s.paired):
                    if at == lane or not s.paired:
                        done[d] = _place_action(tl, plan, costs, link, d, s.task(d, a),
                                                done[d], starts, ends, held)
            # Synchronous collectives (a CPU) cannot run under the action: the permute
            # waits for it, as an unskewed one does.
            if per_tick:  # the slack ring under the action, then the tick's own permutes
                rounds = [(slack, True, "slack ring"), (urgent[t], False, "permute")]
            else:
                rounds = [(near[lane], ticks.skewed(s) and not tl.synchronous, "permute")]
            for partners, skew, what in rounds:
                meet = ticks.lane_meet(begin, done, partners, xfer, skew)
                for d in range(p):
                    if meet[d] is None:
                        continue
                    # The wait for the partners is idle; the transfer is the last `xfer` of it.
                    tl.add(d, "pp", "comm", f"{what} tick {t} lane {lane}", meet[d] - xfer,
                           meet[d])
                    done[d] = max(done[d], meet[d])
            clock = list(done)
            # A paired tick on a GPU runs the head after its backward lane, its all-reduces
            # under the lanes; elsewhere the head runs after the forward lane (the executor's
            # `paired_tick`).
            hidden = s.paired and not tl.synchronous
            if lane == (lanes - 1 if hidden else 0) and t in heads:
                clock = [_place_head(tl, costs, link, heads[t], max(clock), starts, ends,
                                     hidden=hidden)] * p
    for d in range(p):
        tl.compute_free[d] = clock[d]


def _head_ticks(s: Schedule) -> dict[int, int]:
    """Tick -> microbatch of every last-virtual-stage F (where a vocabulary-parallel head
    phase runs)."""
    last = s.stages * s.virtual_stages - 1
    return {t: a.microbatch for d, t, a in s.actions()
            if a.kind == "F" and s.virtual_stage(d, a.chunk) == last}


def _memory(
    stage: int, plan: Plan, costs: Costs, held: list[tuple[float, float]]
) -> MemoryEstimate:
    """Peak memory of ``stage`` from its parameter sizes and activation hold events."""
    s = plan.schedule
    mine = [vs for vs, (d, _) in enumerate(s.placement) if d == stage]
    full = sum(costs.params(vs) for vs in mine)
    shard = full / plan.dp if plan.fsdp else full
    gathered = 0.0
    if plan.fsdp and plan.dp > 1:
        gathered = (plan.fsdp_window + 1) * max((costs.params(vs) for vs in mine), default=0.0)
    # At equal times frees sort first: one stage's actions are sequential, so an action
    # ending at t has released its activations before the next one starts at t.
    level = peak = 0.0
    for _, delta in sorted(held):
        level += delta
        peak = max(peak, level)
    return MemoryEstimate(
        params=shard,
        grads=full,
        optimizer=costs.optimizer_factor * shard,
        gathered=gathered,
        activations=peak,
    )


def events_to_chrome_trace(events: Sequence[SimEvent]) -> dict[str, Any]:
    """A simulated timeline as a Chrome/Perfetto trace document.

    One process per stage (named ``/device:SIM:<stage>``, so :func:`parse_trace` reads
    it like a device trace) and one thread per stream.

    Args:
      events: from ``simulate(..., record_events=True).events``.

    Returns:
      A dict with ``traceEvents``; ``json.dump`` it to open in Perfetto.
    """
    streams = ("compute", "pp", "dp", "fsdp", "tp")
    out: list[dict[str, Any]] = []
    for stage in sorted({e.stage for e in events}):
        out.append(
            {"ph": "M", "pid": stage, "name": "process_name", "args": {"name": _device(stage)}}
        )
        for tid, stream in enumerate(streams):
            out.append(
                {
                    "ph": "M",
                    "pid": stage,
                    "tid": tid,
                    "name": "thread_name",
                    "args": {"name": stream},
                }
            )
    for e in events:
        out.append(
            {
                "ph": "X",
                "pid": e.stage,
                "tid": streams.index(e.stream),
                "name": e.name,
                "ts": e.start_s * 1e6,
                "dur": (e.end_s - e.start_s) * 1e6,
                "args": {"kind": e.kind},
            }
        )
    return {"traceEvents": out, "displayTimeUnit": "ms"}
