"""The named pipeline schedules, each a priority or a per-stage program for the list scheduler.

GPipe, 1F1B, Megatron's interleaved 1F1B, ZB-H1 and ZB-V (:data:`SCHEDULES`), and the filled
paired tables of the zero-bubble ones (lanes as positions). :func:`build` dispatches a checked
name (:func:`checked_key`, which refuses what cannot be built in bounded time and memory in
one line naming the config field); :func:`bubble_formula` gives the closed forms. In the unit
tick model GPipe and 1F1B give exactly ``(p-1)/(m+p-1)``, interleaved 1F1B
``(p-1)/(v*m+p-1)`` (``m`` a multiple of ``p``) and ZB-H1 ``(p-1)/(3m+p-1)`` (``m >= p``):
below 1F1B because deferred ``W`` actions fill the cool-down, leaving only the ``p-1``-tick
start-up ramp. ZB-V cannot beat ``(p-1)/(6m+p-1)`` (stage ``d`` cannot start before tick ``d``)
and reaches it for ``p <= 4`` and most larger ``p, m``.
"""

from __future__ import annotations

import difflib
from typing import Sequence

from jax_overlap.pipeline.list_scheduler import (
    KIND_RANK,
    Policy,
    capped,
    list_schedule,
    program_policy,
)
from jax_overlap.pipeline.table import (
    Schedule,
    Task,
    linear_placement,
    round_robin_placement,
    v_placement,
)

SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")


def multiples_near(value: int, multiple: int) -> str:
    """The multiples of ``multiple`` around ``value`` to suggest in an error: ``"8 or 16"``
    for 12 and 8, just ``"8"`` below the first."""
    lower = value // multiple * multiple
    return f"{lower} or {lower + multiple}" if lower else f"{multiple}"


def require(ok: bool, message: str) -> None:
    """Raises ValueError(`message`) unless `ok` (one line naming the config field and the fix)."""
    if not ok:
        raise ValueError(message)


# Bounds on what `make_schedule` builds in bounded time and memory. Building takes time and
# memory linear in the tasks (stages x microbatches x virtual stages x 3) and the table
# (stages x ticks): p = 64, m = 1024, v = 4 (262,144 stage-microbatch-chunks) builds in about
# 5 s on one core; past four times that (about 20 s, some hundred MB) a request is refused in
# one line instead.
MAX_STAGES = 512
MAX_SCHEDULE_CELLS = 1 << 20


def checked_key(name: str, stages: int, microbatches: int, virtual_stages: int,
                lat: int) -> str:
    """The schedule's key (``_`` spelled ``-``), once its sizes are checked; raises
    ValueError naming the config field and the fix (see `make_schedule`)."""
    key = name.strip().lower().replace("_", "-")
    if key not in SCHEDULES:
        close = difflib.get_close_matches(key, SCHEDULES, n=1, cutoff=0.4)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(
            f"pipeline.schedule: unknown schedule {name!r}; {hint}"
            f"choose one of {', '.join(SCHEDULES)}"
        )
    require(
        isinstance(stages, int) and stages >= 1,
        f"pipeline.stages: must be an integer >= 1, got {stages!r}",
    )
    require(
        isinstance(microbatches, int) and microbatches >= 1,
        f"pipeline.microbatches: must be an integer >= 1, got {microbatches!r}",
    )
    require(
        isinstance(stages, int) and stages <= MAX_STAGES,
        f"pipeline.stages: {stages} is more than {MAX_STAGES}, the most a schedule is built "
        f"for; use fewer stages",
    )
    cells = stages * microbatches * max(1, virtual_stages if isinstance(virtual_stages, int) else 1)
    most = max(1, MAX_SCHEDULE_CELLS // (stages * max(1, virtual_stages)))
    require(
        cells <= MAX_SCHEDULE_CELLS,
        f"pipeline.microbatches: stages x microbatches x virtual stages = {cells} is more than "
        f"{MAX_SCHEDULE_CELLS}, the most a schedule is built for in bounded time and memory; "
        f"use at most {most} microbatches",
    )
    require(
        lat in (1, 2),
        f"pipeline.transfer_latency: must be 1 (transfers between ticks) or 2 (transfers "
        f"under the next tick's compute), got {lat!r}",
    )
    if key == "interleaved":
        require(
            isinstance(virtual_stages, int) and virtual_stages >= 2,
            f"pipeline.virtual_stages: interleaved needs >= 2 chunks per stage, got "
            f"{virtual_stages!r}; set pipeline.virtual_stages to 2 or more (or use 1f1b)",
        )
        group = stages * lat
        fix = multiples_near(microbatches, group)
        what = (f"pipeline.stages={stages}" if lat == 1 else
                f"2 x pipeline.stages={group} with pipeline.transfer_latency=2")
        require(
            microbatches % group == 0,
            f"pipeline.microbatches: interleaved needs a multiple of {what} (at least "
            f"{group}), got {microbatches}; set pipeline.microbatches to {fix}",
        )
        return key
    if key == "zb-v":
        require(
            virtual_stages in (1, 2),
            f"pipeline.virtual_stages: zb-v always uses 2 chunks per stage, got "
            f"{virtual_stages!r}; set pipeline.virtual_stages to 2 (or leave it at 1)",
        )
        return key
    require(
        virtual_stages == 1,
        f"pipeline.virtual_stages: {key} uses one chunk per stage, got {virtual_stages!r}; "
        f"set pipeline.virtual_stages to 1 (or use interleaved / zb-v)",
    )
    return key


def build(key: str, stages: int, microbatches: int, virtual_stages: int, lat: int,
          paired: bool = False, caps: Sequence[int] | None = None,
          quorum: float | Sequence[float] = 0.0) -> Schedule:
    """The generator of a checked schedule name."""
    if key == "interleaved":
        return interleaved(stages, microbatches, virtual_stages, lat, paired, caps, quorum)
    builder = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zb_h1, "zb-v": zb_v}[key]
    return builder(stages, microbatches, lat, paired, caps, quorum)


# Schedules with a filled paired table (`filled_table`): lanes are positions, W's fill free slots.
FILLED: tuple[str, ...] = ("zb-h1", "zb-v")


def gpipe(stages: int, microbatches: int, transfer_latency: int = 1, paired: bool = False,
          caps: Sequence[int] | None = None,
          quorum: float | Sequence[float] = 0.0) -> Schedule:
    """GPipe: all forwards, then all backwards (Huang et al. 2019).

    Greedy, forward first: every stage holds all ``m`` activations at the turn-around.

    Args:
      stages: ``p``.
      microbatches: ``m``.
      transfer_latency: ``L``, ticks between stages.

    Returns:
      The schedule; bubble ``L(p-1)/(m+L(p-1))``.
    """
    policy = Policy(
        priority=lambda t, d: (t.kind != "F", t.microbatch),
        cap=lambda d: microbatches,
    )
    return list_schedule("gpipe", stages, microbatches, linear_placement(stages), False,
                         capped(policy, caps), transfer_latency, paired, quorum)


def one_f_one_b(stages: int, microbatches: int, transfer_latency: int = 1,
                paired: bool = False, caps: Sequence[int] | None = None,
                quorum: float | Sequence[float] = 0.0) -> Schedule:
    """1F1B / PipeDream-flush (Narayanan et al. 2021).

    Greedy, backward first whenever one is ready, stage ``d`` holding at most ``p - d``
    activations: this yields the warm-up of ``p-d-1`` forwards, the steady
    one-forward-one-backward phase and the cool-down. With ``L`` ticks between stages a
    microbatch's round trip from stage ``d`` is ``L`` times longer, so the cap is
    ``L(p-d-1) + 1``: the least that keeps the steady phase free of stalls.

    Args:
      stages: ``p``.
      microbatches: ``m``.
      transfer_latency: ``L``, ticks between stages.

    Returns:
      The schedule; bubble ``L(p-1)/(m+L(p-1))``, stage 0 holds ``min(L(p-1)+1, m)``
      activations.
    """
    lat = transfer_latency
    policy = Policy(
        priority=lambda t, d: (KIND_RANK[t.kind], t.microbatch),
        cap=lambda d: lat * (stages - d - 1) + 1,
        rank="kind-microbatch",
    )
    return list_schedule("1f1b", stages, microbatches, linear_placement(stages), False,
                         capped(policy, caps), lat, paired, quorum)


def megatron_chunk_order(
    microbatches: int, stages: int, virtual_stages: int, transfer_latency: int = 1
) -> list[tuple[int, int]]:
    """Megatron's interleaved forward order on every stage, as (microbatch, chunk).

    Microbatches go in groups of ``p`` (the last group may be smaller); each group runs
    through chunk 0, then chunk 1, ... -- ``p`` microbatches are exactly enough to keep
    a stage busy while the group's first microbatch travels round the pipeline. With
    ``L`` ticks between stages the round trip is ``L`` times longer: groups of ``L*p``.

    Args:
      microbatches: ``m``.
      stages: ``p``.
      virtual_stages: ``v``.
      transfer_latency: ``L``.

    Returns:
      ``m * v`` pairs; the backward order is the same with chunk ``c`` read as
      ``v - 1 - c``.
    """
    order = []
    size = stages * transfer_latency
    for start in range(0, microbatches, size):
        group = range(start, min(start + size, microbatches))
        order.extend((mb, chunk) for chunk in range(virtual_stages) for mb in group)
    return order


def interleaved(stages: int, microbatches: int, virtual_stages: int,
                transfer_latency: int = 1, paired: bool = False,
                caps: Sequence[int] | None = None,
          quorum: float | Sequence[float] = 0.0) -> Schedule:
    """Megatron interleaved 1F1B with ``v`` chunks per stage (Narayanan et al. 2021).

    Placement is round-robin (virtual stage ``c*p + d`` on stage ``d``, chunk ``c``).
    Stage ``d`` runs Megatron's program in order: ``2(p-d-1) + (v-1)p`` warm-up
    forwards, then alternating forward/backward, then the remaining backwards, with
    forwards in :func:`megatron_chunk_order` and backwards in the same order with the
    chunks reversed. With ``L`` ticks between stages every transfer takes ``L`` times
    longer, so the warm-up is ``L`` times Megatron's and microbatches go in groups of
    ``L*p``.

    Args:
      stages: ``p``.
      microbatches: a multiple of ``p``: a group of ``p`` microbatches exactly covers
        the round trip; with a smaller last group the in-order program stalls (or, e.g.
        for ``p=4, m=5``, deadlocks), so :func:`make_schedule` rejects such ``m``.
      virtual_stages: ``v >= 2``.
      transfer_latency: ``L``, ticks between stages.

    Returns:
      The schedule; bubble ``L(p-1)/(v*m+L(p-1))`` when ``m`` is a multiple of ``L*p``.
    """
    p, v, m, lat = stages, virtual_stages, microbatches, transfer_latency
    order = megatron_chunk_order(m, p, v, lat)
    forwards = [Task("F", mb, c * p) for mb, c in order]
    backwards = [Task("B", mb, (v - 1 - c) * p) for mb, c in order]
    programs = []
    for d in range(p):
        fwd = [Task(k, mb, vs + d) for k, mb, vs in forwards]
        bwd = [Task(k, mb, vs + d) for k, mb, vs in backwards]
        warmup = min(lat * (2 * (p - d - 1) + (v - 1) * p), m * v)
        program = fwd[:warmup]
        for k in range(m * v - warmup):
            program += [fwd[warmup + k], bwd[k]]
        programs.append(program + bwd[m * v - warmup :])
    placement = round_robin_placement(p, v)
    return list_schedule("interleaved", p, m, placement, False,
                         capped(program_policy(programs), caps), lat, paired, quorum)


def zb_h1(stages: int, microbatches: int, transfer_latency: int = 1, paired: bool = False,
          caps: Sequence[int] | None = None,
          quorum: float | Sequence[float] = 0.0) -> Schedule:
    """ZB-H1 zero-bubble schedule (Qi et al. 2023), as the paper's program.

    The backward is split into ``B`` (input gradients, on the critical path) and ``W``
    (weight gradients, needed only by the optimizer step). Stage ``d`` runs, in order,
    ``p - d`` forwards, then for each ``k``: ``B(k)``, ``W(k - d)``, ``F(k + p - d)``
    (skipping out-of-range ones), then its last ``d`` weight gradients. Delaying ``W``
    by ``d`` fills the cool-down; every stage holds at most ``p`` activations (each
    until its ``W``), the same peak as 1F1B's stage 0. With ``L`` ticks between stages
    the warm-up is ``L(p-d-1) + 1`` forwards and ``W`` is delayed by ``L*d``: every
    stage then holds ``L(p-1) + 1`` activations, as 1F1B's stage 0 does at that latency.

    Args:
      stages: ``p``.
      microbatches: ``m``.
      transfer_latency: ``L``, ticks between stages.

    Returns:
      The schedule; bubble ``L(p-1)/(3m+L(p-1))`` when ``m >= 2p``.
    """
    p, m, lat = stages, microbatches, transfer_latency
    programs = []
    for d in range(p):
        warmup, delay = min(lat * (p - d - 1) + 1, m), lat * d
        program = [Task("F", mb, d) for mb in range(warmup)]
        for k in range(m):
            program.append(Task("B", k, d))
            if k - delay >= 0:
                program.append(Task("W", k - delay, d))
            if k + warmup < m:
                program.append(Task("F", k + warmup, d))
        program += [Task("W", mb, d) for mb in range(max(m - delay, 0), m)]
        programs.append(program)
    return list_schedule("zb-h1", p, m, linear_placement(p), True,
                         capped(program_policy(programs), caps), lat, paired, quorum)


def zb_v(stages: int, microbatches: int, transfer_latency: int = 1, paired: bool = False,
         caps: Sequence[int] | None = None,
          quorum: float | Sequence[float] = 0.0) -> Schedule:
    """ZB-V zero-bubble schedule with a V-shaped placement (Qi et al. 2024).

    Stage ``d`` holds virtual stages ``d`` (chunk 0) and ``2p-1-d`` (chunk 1), so each
    microbatch goes down the stages and back up, and stage 0 both starts the forward
    and starts the backward. Backward is split into ``B`` and ``W``. Greedy, priority
    ``B > F > W``, older microbatches and later virtual stages first.

    Memory: each stage holds at most ``2p`` (microbatch, chunk) activations. A chunk
    is half a stage's layers, so that equals ``p`` full-stage microbatches -- the same
    activation memory as 1F1B's stage 0, but every stage (not just stage 0) reaches it.

    With ``L`` ticks between stages the cap is ``2pL``: a smaller one lets a stage fill
    up with chunk-0 activations while the chunk-1 forwards that would start the backward
    wait for room (the greedy deadlocks, e.g. ``p=4, m=8, L=2`` at ``2p``).

    Args:
      stages: ``p``.
      microbatches: ``m``.
      transfer_latency: ``L``, ticks between stages.

    Returns:
      The schedule. Its bubble is at least ``(p-1)/(6m+p-1)`` -- stage ``d`` idles
      ``d`` ticks at the start and ``p-1-d`` at the end -- and equals it for ``p <= 4``
      and most larger ``p, m`` (a few ticks over otherwise); for ``m >= p`` it is never
      above ZB-H1's.
    """

    def priority(task: Task, stage: int) -> tuple:
        return (KIND_RANK[task.kind], task.microbatch, -task.virtual_stage)

    policy = Policy(priority=priority, cap=lambda d: 2 * stages * transfer_latency,
                    rank="kind-microbatch-late-chunk")
    return list_schedule("zb-v", stages, microbatches, v_placement(stages), True,
                         capped(policy, caps), transfer_latency, paired, quorum)


def filled_table(key: str, stages: int, microbatches: int, caps: Sequence[int],
                 guard: tuple | None) -> Schedule:
    """A paired ZB-H1 / ZB-V table whose lanes are positions (``list_schedule``'s ``fill``).

    Greedy with the schedule's priorities (``B`` first, then ``F``, then ``W``; older
    microbatches, for ZB-V later virtual stages first), the forwards held to `caps`
    activations per stage. A stage runs ``{F, B}`` in the steady state and the delayed
    ``W``'s fill the free lane of the other ticks, so every stage does the same work between
    transfers; the ramps fill with pending ``W``'s as ZB-H1 and ZB-V do.

    Args:
      key: ``zb-h1`` or ``zb-v``.
      stages, microbatches: ``p``, ``m``.
      caps: per-stage activation caps ((microbatch, chunk)s held from F to W).
      guard: ``list_schedule``'s ``guard``, or None.

    Returns:
      The table.

    Raises:
      RuntimeError: if the greedy deadlocks.
    """
    if key == "zb-h1":
        policy = Policy(priority=lambda t, d: (KIND_RANK[t.kind], t.microbatch),
                        cap=lambda d: caps[d], rank="kind-microbatch")
        placement = linear_placement(stages)
    else:
        policy = Policy(priority=lambda t, d: (KIND_RANK[t.kind], t.microbatch,
                                               -t.virtual_stage),
                        cap=lambda d: caps[d], rank="kind-microbatch-late-chunk")
        placement = v_placement(stages)
    return list_schedule(key, stages, microbatches, placement, True, policy, 1, True, 0.0,
                         True, guard)


def bubble_formula(name: str, stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Closed-form bubble fraction of a schedule in the unit-tick model.

    Args:
      name: ``gpipe``, ``1f1b``, ``interleaved`` or ``zb-h1``.
      stages: ``p``.
      microbatches: ``m`` (a multiple of ``p`` for interleaved, ``>= p`` for zb-h1).
      virtual_stages: ``v`` for interleaved.

    Returns:
      The fraction the generators achieve exactly.

    Raises:
      ValueError: for schedules without a closed form (zb-v).
    """
    p, m, v = stages, microbatches, virtual_stages
    # GPipe/1F1B/interleaved stages idle p-1 ticks while the forward fills the pipe and
    # p-1 while the backward drains it, beside 2x(forwards per stage) busy ticks: the
    # ratio reduces to (p-1)/(forwards + p-1). ZB-H1 fills the drain with W, so it idles
    # p-1 ticks once beside 3m busy ones.
    busy_per_ramp = {"gpipe": m, "1f1b": m, "interleaved": v * m, "zb-h1": 3 * m}
    if name not in busy_per_ramp:
        raise ValueError(f"pipeline.schedule: no closed-form bubble for {name!r}")
    return (p - 1) / (busy_per_ramp[name] + p - 1)
