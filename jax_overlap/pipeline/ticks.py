"""How long the executor takes to run a schedule table when actions cost F, B, W and a
stage-to-stage transfer costs C: the tick timing the simulator's ``timing="ticks"`` plays.

The executor is a loop over ticks; in a tick each stage runs its entry (a paired entry: lane 0,
an F or a W, then lane 1, a B or a W) and the stages exchange activations and gradients with
permutes on the +1 / -1 rings. A permute completes on a stage once the stage it sends to and
the stage it receives from have both reached it:

* unpaired at latency 1 (:func:`tick_rings`): a transfer read at the next tick goes on a
  permute after the action whose pairs are that tick's such transfers only, so a stage that
  sends or receives one ends its tick at the latest action end among itself and the stages
  it trades with, plus the transfer, and any other stage at its own action's end; a transfer
  read later goes on the slack ring, issued before the next tick's action (below);
* latency 2, each lane of a paired tick, and an unpaired latency-1 tick's slack ring: the
  permute carrying the previous (half-)tick's output is issued before the action, so a
  stage's lane ends at its own action's end or, if later, its partners' start plus the
  transfer.

One implementation: :func:`lane_partners` and :func:`lane_meet` are the rule
:func:`jax_overlap.analysis.simulate.simulate` applies with TP collectives, head phases and
FSDP gathers around it; :func:`executed_bubble` applies it to bare action costs (what
``jax-overlap schedule --costs F,B,W,C`` reports as ``weighted_bubble``). Pure Python, and
below :mod:`jax_overlap.pipeline.table` and :mod:`jax_overlap.pipeline.pairing` (which ranks
tables with it): a ``schedule`` here is anything shaped like a ``Schedule``.
"""

from __future__ import annotations

from collections import Counter
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import numpy as np

# The action times a table is timed at when none are given: F = B = W (a non-split B two).
UNIT_COST: Mapping[str, float] = MappingProxyType({"F": 1.0, "B": 1.0, "W": 1.0})


def action_cost(kind: str, split_backward: bool, cost: dict[str, float]) -> float:
    """Time one action takes: a non-split ``B`` also does the ``W`` work."""
    if kind == "B" and not split_backward:
        return cost["B"] + cost["W"]
    return cost[kind]


def _cell_actions(cell: Any) -> tuple:
    """A table entry's actions: none (idle), one action (a 3-field tuple) or a pair's two."""
    if cell is None:
        return ()
    return tuple(cell) if len(cell) == 2 else (cell,)


def lane_of(kind: str, paired: bool) -> int:
    """The lane a single (unpaired) action runs in: in a paired table a lone forward runs in
    lane 0, a lone B or W in lane 1."""
    return int(paired and kind != "F")


def cell_lanes(cell: Any, paired: bool) -> tuple[tuple[int, Any], ...]:
    """A table entry's ``(lane, action)``s. A pair's actions run in their positions: the first
    (``F`` or ``W``) in lane 0, the second (``B`` or ``W``) in lane 1; a lone action in
    :func:`lane_of`'s lane."""
    acts = _cell_actions(cell)
    if len(acts) == 2:
        return ((0, acts[0]), (1, acts[1]))
    return tuple((lane_of(a.kind, paired), a) for a in acts)


def _target(schedule: Any, stage: int, action: Any, stage_of: list[int]) -> int | None:
    """The virtual stage an action's output goes to on another stage (an ``F``'s next, a
    ``B``'s previous), or None: a W, the ends of the model, a hand-off on the same stage."""
    vs = schedule.virtual_stage(stage, action.chunk)
    target = vs + 1 if action.kind == "F" else vs - 1 if action.kind == "B" else None
    if target is None or not 0 <= target < len(stage_of) or stage_of[target] == stage:
        return None
    return target


def lane_partners(schedule: Any) -> tuple[tuple[frozenset[int], ...], ...]:
    """Per lane, per stage: the stages it exchanges data with on that lane's rings.

    A lane's rings are the (sender, receiver) stage pairs its actions use anywhere in the step
    (an ``F`` sends to the next virtual stage's stage, a ``B`` to the previous one's; a hand-off
    on the same stage uses no ring), as the executor's program compiles them
    (``TickProgram.lane_rings``).

    Args:
      schedule: the table.

    Returns:
      ``partners[lane][stage]``: one lane, or two for a paired table.
    """
    s = schedule
    lanes = s.lanes
    stage_of = [pos[0] for pos in s.placement]
    out = [[set() for _ in range(s.stages)] for _ in range(lanes)]
    seen = set()
    for d, row in enumerate(s.grid):
        for cell in row:
            for lane, a in cell_lanes(cell, s.paired):
                key = (d, lane, a.kind, a.chunk)
                if key in seen:
                    continue
                seen.add(key)
                target = _target(s, d, a, stage_of)
                if target is None:
                    continue
                out[lane][d].add(stage_of[target])
                out[lane][stage_of[target]].add(d)
    return tuple(tuple(frozenset(x) for x in lane) for lane in out)


def permute_partners(schedule: Any) -> tuple[tuple[frozenset[int], ...], ...]:
    """Per lane, per stage: whom the lane's permute waits for. A paired lane's half-tick
    carries the other lane's last output (the executor's skewed lanes), so it is on the other
    lane's rings."""
    rings = lane_partners(schedule)
    if schedule.paired:
        return (rings[1], rings[0])
    return rings


def tick_rings(schedule: Any) -> bool:
    """Whether the executor runs the table with per-tick rings (unpaired, latency 1:
    `jax_overlap.pipeline.program.TickProgram.patterns`)."""
    return not schedule.paired and schedule.transfer_latency == 1


# The slack ring runs only where it shortens the step by at least this share, timed at
# `NOMINAL_COST` (W about half of B and a transfer about 1/20 of an action, as the zero-bubble
# paper profiled them): elsewhere its permutes would cost bandwidth every tick for nothing.
# There it gains 8-15% on ZB-H1 and 2.5-5% on interleaved (p 2-16), at most 0.4% on 1F1B and
# ZB-V. GPT-1.3B pp4 x dp2 unpaired, deviceless 8 x H100: with a ring, 1F1B 1514 ms and ZB-V
# 1294 against 1510 and 1279 without; ZB-H1 1161 and interleaved 1251 with it, against 1287
# and 1387 on the fixed rings every tick used to meet.
SLACK_RING_GAIN = 0.01
NOMINAL_COST: Mapping[str, float] = MappingProxyType({"F": 1.0, "B": 1.0, "W": 0.5})
NOMINAL_TRANSFER = 0.05


def tick_transfers(schedule: Any, slack_ring: bool | None = None
                   ) -> tuple[list[list[tuple[int, int]]], frozenset]:
    """An unpaired latency-1 table's transfers between stages, by when they are sent.

    A transfer read at the next tick is urgent: it goes on its tick's own permute. One read
    later may go on the slack ring, sent at the top of the next tick under its action.

    Args:
      schedule: the table.
      slack_ring: whether the later-read transfers use the slack ring; None: where it pays
        (`SLACK_RING_GAIN`), else they go on their tick's permute as the urgent ones do.

    Returns:
      (per tick, the ``(src, dst)`` stage pairs of the transfers sent on that tick's own
      permute; the slack ring's pairs, empty without one).
    """
    s = schedule
    stage_of = [pos[0] for pos in s.placement]
    tick_of: dict[tuple[str, int, int], int] = {}
    sends = []  # (tick, src, the reader's task)
    for d, row in enumerate(s.grid):
        for t, cell in enumerate(row):
            for a in _cell_actions(cell):
                tick_of[(a.kind, a.microbatch, s.virtual_stage(d, a.chunk))] = t
                target = _target(s, d, a, stage_of)
                if target is not None:
                    sends.append((t, d, (a.kind, a.microbatch, target)))
    urgent: list[list[tuple[int, int]]] = [[] for _ in range(s.ticks)]
    every: list[list[tuple[int, int]]] = [[] for _ in range(s.ticks)]
    slack = set()
    for t, d, reader in sends:
        pair = (d, stage_of[reader[2]])
        every[t].append(pair)
        if tick_of[reader] == t + 1:
            urgent[t].append(pair)
        else:
            slack.add(pair)
    urgent, every = _bounded(urgent), _bounded(every)
    if slack_ring is None and slack:
        work = _lane_work(s, NOMINAL_COST)[0][0]
        slack_ring = (max(_rendezvous_run(work, NOMINAL_TRANSFER, urgent, slack))
                      <= (1 - SLACK_RING_GAIN)
                      * max(_rendezvous_run(work, NOMINAL_TRANSFER, every, set())))
    return (urgent, frozenset(slack)) if slack_ring else (every, frozenset())


# At most this many distinct ring patterns per table (the branches of the executor's switch
# over them): at p = 8 a table has 27-85 whatever m, but ZB-V at p = 24 has one a tick.
MAX_TICK_PATTERNS = 64


def _bounded(sent: list[list[tuple[int, int]]]) -> list[list[tuple[int, int]]]:
    """``sent`` (per tick, the pairs its permute carries) with at most `MAX_TICK_PATTERNS`
    distinct pair sets: the most used are kept with their union, and every other tick
    permutes the smallest kept set that holds its pairs (a pair with nothing to carry sends
    what the receiver then files nowhere)."""
    keys = [frozenset(pairs) for pairs in sent]
    counts = Counter(keys)
    if len(counts) <= MAX_TICK_PATTERNS:
        return sent
    union = frozenset().union(*keys)
    kept = [k for k, _ in counts.most_common(MAX_TICK_PATTERNS - 1) if k != union] + [union]
    chosen = {k: k if k in kept else min((c for c in kept if k <= c), key=len) for k in counts}
    return [pairs if chosen[k] == k else sorted(chosen[k]) for pairs, k in zip(sent, keys)]


def _partners(pairs, stages: int) -> list[frozenset[int]]:
    """Per stage, the stages it trades with over ``pairs`` (either direction)."""
    out = [set() for _ in range(stages)]
    for a, b in pairs:
        out[a].add(b)
        out[b].add(a)
    return [frozenset(x) for x in out]


def rendezvous_partners(schedule: Any) -> tuple[list[list[frozenset[int]]],
                                                list[frozenset[int]]]:
    """What each permute of a :func:`tick_rings` table waits for: (per tick, per stage, the
    stages it trades urgent transfers with at that tick; per stage, its slack ring's
    partners)."""
    urgent, slack = tick_transfers(schedule)
    return ([_partners(pairs, schedule.stages) for pairs in urgent],
            _partners(slack, schedule.stages))


def skewed(schedule: Any) -> bool:
    """Whether each lane's permute is issued before its action (paired, or latency 2)."""
    return schedule.paired or schedule.transfer_latency == 2


def lane_meet(begin: Sequence[float], done: Sequence[float],
              partners: Sequence[frozenset[int]], transfer: float,
              skew: bool) -> list[float | None]:
    """When each stage's permute at the end of one lane completes.

    Args:
      begin: per stage, when the lane started.
      done: per stage, when its action (if any) ended.
      partners: per stage, the ring partners it exchanges with in this lane.
      transfer: seconds of one transfer.
      skew: the permute was issued before the action (it waits for the partners' starts)
        rather than after it (their ends).

    Returns:
      Per stage, the completion time, or ``None`` for a stage with no partner (no permute).
      The stage's lane then ends at ``max(done, meet)``.
    """
    ref = begin if skew else done
    return [max(ref[d], *(ref[e] for e in partners[d])) + transfer if partners[d] else None
            for d in range(len(done))]


def tick_clocks(schedule: Any, cost: dict[str, float] | None = None,
                transfer: float = 0.0) -> list[float]:
    """Per stage, when it finishes the step's last lane.

    Args:
      schedule: the table.
      cost: seconds of ``F``, ``B`` and ``W`` (a non-split ``B`` costs ``B + W``); default 1
        each.
      transfer: seconds of one stage-to-stage transfer.

    Returns:
      One end time per stage.
    """
    return _clocks_and_work(schedule, cost, transfer)[0]


def _clocks_and_work(schedule: Any, cost: dict[str, float] | None,
                     transfer: float) -> tuple[list[float], float]:
    """`tick_clocks`, and the seconds of every action of the table summed (in the order of
    ``schedule.actions()``)."""
    s = schedule
    work, spent = _lane_work(s, cost or UNIT_COST)
    if tick_rings(s):
        return _rendezvous_run(work[0], transfer, *tick_transfers(s)), spent
    near = permute_partners(s)
    skew = skewed(s)
    group, alone = zip(*(_groups(partners) for partners in near))
    clock = np.zeros(s.stages)
    for t in range(s.ticks):
        for lane in range(len(near)):
            done = clock + work[lane, t]
            meet = (clock if skew else done)[group[lane]].max(axis=1) + transfer
            clock = np.where(alone[lane], done, np.maximum(done, meet))
    return clock.tolist(), spent


def _lane_work(schedule: Any, cost: Mapping[str, float]) -> tuple[np.ndarray, float]:
    """(per lane, per tick, per stage: the seconds of the action that stage runs in that lane;
    the seconds of every action of the table summed, in the order of ``schedule.actions()``)."""
    s = schedule
    seconds = {k: action_cost(k, s.split_backward, cost) for k in ("F", "B", "W")}
    # `cell_lanes`, unrolled: this runs over every entry of tables with millions.
    work = np.zeros((s.lanes, s.ticks, s.stages))
    spent: list[float] = []  # every action's seconds, summed at the end as `sum` does
    for d, row in enumerate(s.grid):
        first, second = work[0, :, d], work[-1, :, d]
        for t, cell in enumerate(row):
            if cell is None:
                continue
            if len(cell) == 2:  # a pair: its positions are its lanes
                a, b = seconds[cell[0][0]], seconds[cell[1][0]]
                first[t] += a
                second[t] += b
                spent += (a, b)
            else:
                a = seconds[cell[0]]
                (first if cell[0] == "F" else second)[t] += a
                spent.append(a)
    return work, sum(spent)


def _groups(partners: Sequence[frozenset[int]]) -> tuple[np.ndarray, np.ndarray]:
    """`lane_meet`'s rule over all stages at once: (per stage, itself and its partners, padded
    with itself to one width; per stage, whether it has no partner and so just runs)."""
    stages = len(partners)
    width = max([len(x) for x in partners] + [0])
    group = np.array([[d, *sorted(partners[d])] + [d] * (width - len(partners[d]))
                      for d in range(stages)], dtype=np.int64).reshape(stages, width + 1)
    return group, np.array([not x for x in partners])


def _rendezvous_run(work: np.ndarray, transfer: float, urgent: list[list[tuple[int, int]]],
                    slack) -> list[float]:
    """Per stage, when an unpaired table whose ticks take ``work`` (per tick, per stage) ends:
    per tick, the slack ring (`slack`'s pairs, issued before the action), then the tick's own
    permute (`urgent[t]`, after it, only the stages trading on it)."""
    stages = work.shape[1]
    group, alone = _groups(_partners(slack, stages))
    clock = np.zeros(stages)
    for t in range(work.shape[0]):
        done = clock + work[t]
        if slack:
            done = np.where(alone, done, np.maximum(done, clock[group].max(axis=1) + transfer))
        if urgent[t]:
            src, dst = np.array(urgent[t]).T
            meet = done.copy()
            np.maximum.at(meet, src, done[dst])
            np.maximum.at(meet, dst, done[src])
            touched = np.zeros(stages, bool)
            touched[src] = touched[dst] = True
            done = np.where(touched, meet + transfer, done)
        clock = done
    return clock.tolist()


def executed_bubble(schedule: Any, cost: dict[str, float] | None = None,
                    transfer: float = 0.0) -> float:
    """Idle share of ``stages x step time`` when the executor runs the table at these costs
    (the zero-bubble paper's bubble rate: 1 - work / (stages x step time)).

    Args:
      schedule: the table.
      cost: seconds of ``F``, ``B``, ``W`` (default 1 each).
      transfer: seconds of one stage-to-stage transfer.

    Returns:
      A fraction in ``[0, 1)``; 0 for an empty table.
    """
    clock, work = _clocks_and_work(schedule, cost, transfer)
    span = max(clock, default=0.0) * schedule.stages
    return (span - work) / span if span else 0.0
