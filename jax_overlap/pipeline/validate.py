"""Check a schedule table against the time model of :mod:`jax_overlap.pipeline.table`.

The validator is independent of the generators: it replays the table tick by tick and
reports the first thing the lockstep executor could not do, so hand-written or
loaded tables can be trusted before they drive a training step.
"""

from __future__ import annotations

from jax_overlap.pipeline.table import (
    KINDS,
    Action,
    Pair,
    Schedule,
    Task,
    cell_actions,
    dependencies,
    dependency_gap,
    format_entry,
)


class ScheduleError(ValueError):
    """A schedule table the executor cannot run; the message names the first violation."""


def _check_header(s: Schedule) -> None:
    for field in ("stages", "microbatches", "virtual_stages", "transfer_latency"):
        value = getattr(s, field)
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"schedule: {field} must be an integer >= 1, got {value!r}")


def _check_placement(s: Schedule) -> None:
    expected = s.stages * s.virtual_stages
    if len(s.placement) != expected:
        raise ScheduleError(
            f"placement: {len(s.placement)} virtual stages, expected stages x virtual_stages "
            f"= {expected}"
        )
    seen: dict[tuple[int, int], int] = {}
    for vs, pos in enumerate(s.placement):
        stage, chunk = pos
        if not (0 <= stage < s.stages and 0 <= chunk < s.virtual_stages):
            raise ScheduleError(
                f"placement: virtual stage {vs} -> (stage {stage}, chunk {chunk}) is outside "
                f"{s.stages} stages x {s.virtual_stages} chunks"
            )
        if (stage, chunk) in seen:
            raise ScheduleError(
                f"placement: virtual stages {seen[(stage, chunk)]} and {vs} both map to "
                f"(stage {stage}, chunk {chunk})"
            )
        seen[(stage, chunk)] = vs


def _check_grid_shape(s: Schedule) -> None:
    if len(s.grid) != s.stages:
        raise ScheduleError(f"grid: {len(s.grid)} rows, expected one per stage ({s.stages})")
    for d, row in enumerate(s.grid):
        if len(row) != len(s.grid[0]):
            raise ScheduleError(
                f"grid: stage {d} has {len(row)} ticks but stage 0 has {len(s.grid[0])}; "
                f"rows must have equal length"
            )


def _field_error(s: Schedule, action: object) -> str | None:
    """Why ``action`` is not a legal entry of ``s``, or ``None`` if it is."""
    if not isinstance(action, Action):
        return f"entry {action!r} is not an Action"
    kind, mb, chunk = action
    if kind not in KINDS:
        return f"entry {action!r} has kind {kind!r}, expected one of {', '.join(KINDS)}"
    name = format_entry(Action(kind, mb, chunk), max(s.virtual_stages, 2 if chunk else 1))
    if kind == "W" and not s.split_backward:
        return f"{name} but split_backward is False (B already computes weight gradients)"
    if not isinstance(mb, int) or not 0 <= mb < s.microbatches:
        return f"{name} has microbatch {mb!r}, expected 0..{s.microbatches - 1}"
    if not isinstance(chunk, int) or not 0 <= chunk < s.virtual_stages:
        return (
            f"{name} has chunk {chunk!r}, expected 0..{s.virtual_stages - 1} "
            f"(virtual_stages={s.virtual_stages})"
        )
    return None


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` naming the first violation, in tick order.

    Checks, in this order: header fields; placement is a bijection onto
    (stage, chunk); grid has one equal-length row per stage; then, replaying ticks in
    order (stages in order within a tick), that every entry is a legal
    :class:`Action` (``W`` only when ``split_backward``), runs once, and has its
    dependencies (own ``F`` before ``B``, ``B`` before ``W``, neighbours' outputs) done
    at an earlier tick -- ``transfer_latency`` ticks earlier when the dependency ran on
    another stage; finally that every ``F`` and ``B`` -- and every ``W`` when the
    backward is split -- appears.

    Args:
      schedule: the table to check.

    Raises:
      ScheduleError: e.g. ``"tick 5, stage 2: B3 needs B3 from stage 3 by tick 4
        (it runs at tick 5)"``.
    """
    s = schedule
    _check_header(s)
    _check_placement(s)
    _check_grid_shape(s)

    def name(task: Task) -> str:
        chunk = s.placement[task.virtual_stage][1]
        return format_entry(Action(task.kind, task.microbatch, chunk), s.virtual_stages)

    def stage_of(task: Task) -> int:
        return s.placement[task.virtual_stage][0]

    # Where each legal task first appears, so a dependency message can say whether the
    # input comes too late or not at all.
    first_run: dict[Task, int] = {}
    for tick in range(s.ticks):
        for d, row in enumerate(s.grid):
            for action in cell_actions(row[tick]):
                if _field_error(s, action) is None:
                    first_run.setdefault(s.task(d, action), tick)

    done: dict[Task, int] = {}
    for tick in range(s.ticks):
        for d, row in enumerate(s.grid):
            where = f"tick {tick}, stage {d}"
            problem = _pair_error(s, row[tick])
            if problem:
                raise ScheduleError(f"{where}: {problem}")
            for action in cell_actions(row[tick]):
                _check_action(s, d, tick, action, where, done, first_run, name, stage_of)
    _check_complete(s, done, name, stage_of)


def _pair_error(s: Schedule, cell) -> str | None:
    """Why a paired entry is not a first-lane action (``F`` or ``W``) then a second-lane one
    (``B`` or ``W``) of another (microbatch, chunk)."""
    if not isinstance(cell, Pair):
        return None
    fwd, bwd = cell
    if not (isinstance(fwd, Action) and isinstance(bwd, Action)):
        return f"pair {cell!r} does not hold two Actions"
    spelled = format_entry(cell, max(s.virtual_stages, 2 if fwd.chunk or bwd.chunk else 1))
    if fwd.kind not in ("F", "W") or bwd.kind not in ("B", "W"):
        return (f"pair {spelled} must be a forward or W then a B or W (lane 0 runs F or W, "
                f"lane 1 B or W)")
    if (fwd.microbatch, fwd.chunk) == (bwd.microbatch, bwd.chunk):
        return (f"pair {spelled} runs two actions of one (microbatch, chunk) in one tick; "
                f"each needs the one before it at an earlier tick")
    return None


def _check_action(s, d, tick, action, where, done, first_run, name, stage_of) -> None:
    """One entry: legal, runs once, its dependencies done early enough."""
    n_vs = s.stages * s.virtual_stages
    problem = _field_error(s, action)
    if problem:
        raise ScheduleError(f"{where}: {problem}")
    task = s.task(d, action)
    if task in done:
        raise ScheduleError(f"{where}: {name(task)} already ran at tick {done[task]}")
    for dep in dependencies(task, n_vs):
        gap = dependency_gap(stage_of(dep), d, s.transfer_latency)
        if dep not in done or done[dep] + gap > tick:
            by = f"by tick {tick - gap}" if tick >= gap else "at an earlier tick"
            ran = first_run.get(dep)
            when = "it never runs" if ran is None else f"it runs at tick {ran}"
            raise ScheduleError(
                f"{where}: {name(task)} needs {name(dep)} from stage "
                f"{stage_of(dep)} {by} ({when})"
            )
    done[task] = tick


def _check_complete(s: Schedule, done, name, stage_of) -> None:
    """Every F and B -- and W when the backward is split -- appears."""
    n_vs = s.stages * s.virtual_stages
    kinds = KINDS if s.split_backward else ("F", "B")
    for kind in kinds:
        for mb in range(s.microbatches):
            for vs in range(n_vs):
                task = Task(kind, mb, vs)
                if task not in done:
                    raise ScheduleError(
                        f"missing: {name(task)} (virtual stage {vs}) never runs on stage "
                        f"{stage_of(task)}"
                    )
