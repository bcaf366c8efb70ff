"""Pipeline schedules as data: which stage runs which action at which tick.

A schedule is a table ``grid[stage][tick]`` of :class:`Action` (or ``None`` for idle),
plus the placement of the model's virtual stages onto (stage, chunk) pairs. The executor
and the timeline simulator both read this table; nothing here runs a model.

Time model
----------
The executor runs the table in lockstep, one tick per action: every action -- ``F``,
``B``, ``W`` or a non-split ``B`` (which also computes weight gradients) -- takes one
tick. A value produced at tick ``t`` on one stage can be consumed on another stage at
tick ``t + 1`` at the earliest (one tick of transfer latency); on the same stage the
consumer simply runs at a later tick. A schedule built with ``transfer_latency = L``
asks for ``L`` ticks between stages instead: with ``L = 2`` the executor sends tick
``t``'s output at the start of tick ``t + 1``, beside that tick's compute, so every
transfer can hide under a whole tick of GEMMs (see ``jax_overlap.pipeline.executor``),
at the price of a longer ramp (GPipe and 1F1B idle ``2(p-1)`` ticks per stage instead of
``p-1``). Dependencies, for microbatch ``mb`` and virtual
stage ``vs`` (model order, ``0 .. p*v - 1``):

* ``F(mb, vs)`` needs ``F(mb, vs - 1)``;
* ``B(mb, vs)`` needs ``F(mb, vs)`` and ``B(mb, vs + 1)`` (the last virtual stage needs
  only its own ``F``);
* ``W(mb, vs)`` needs ``B(mb, vs)``.

``bubble_fraction`` is idle stage-ticks / (stages x ticks). In this model GPipe and
1F1B give exactly ``(p-1)/(m+p-1)``, interleaved 1F1B ``(p-1)/(v*m+p-1)`` (``m`` a
multiple of ``p``; a tick is one virtual-stage action) and ZB-H1 ``(p-1)/(3m+p-1)``
(``m >= p``): below 1F1B because deferred ``W`` actions fill the cool-down, leaving only
the ``p-1``-tick start-up ramp. ZB-V cannot beat ``(p-1)/(6m+p-1)`` (stage ``d`` cannot
start before tick ``d``) and reaches it for ``p <= 4`` and most larger ``p, m``.

Activations are counted per (microbatch, chunk): held from its ``F`` tick through the
tick of its last backward action (``W`` when the backward is split, else ``B``).

Generators
----------
All schedules come from one lockstep list scheduler (:func:`_list_schedule`). An action
is *ready* when its dependencies finished at an earlier tick and, for an ``F``, the
stage holds fewer activations than its cap. Each tick every stage either runs its
highest-priority ready action (greedy: GPipe, 1F1B, ZB-V) or runs its program strictly
in order, idling until the next action is ready (Megatron interleaved and ZB-H1, which
their papers define as per-stage programs). A schedule is therefore just a priority
(or program) plus a cap: any ``p, m`` works and every table meets the dependencies by
construction.
"""

from __future__ import annotations

import difflib
import heapq
import json
import re
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Callable, NamedTuple, Sequence

from jax_overlap.pipeline.ticks import action_cost, executed_bubble

KINDS: tuple[str, ...] = ("F", "B", "W")


class Action(NamedTuple):
    """One unit of work in a schedule table.

    Attributes:
      kind: ``'F'`` forward, ``'B'`` backward w.r.t. inputs (also weight gradients when
        the schedule has ``split_backward=False``), ``'W'`` weight-gradient backward.
      microbatch: microbatch index, ``0 .. m-1``.
      chunk: which of this stage's virtual stages, ``0 .. v-1``.
    """

    kind: str
    microbatch: int
    chunk: int = 0


class Task(NamedTuple):
    """An action named by model position rather than by (stage, chunk).

    Attributes:
      kind: ``'F'``, ``'B'`` or ``'W'``.
      microbatch: microbatch index.
      virtual_stage: index in model order, ``0 .. p*v - 1``.
    """

    kind: str
    microbatch: int
    virtual_stage: int


class Pair(NamedTuple):
    """A paired tick's entry: two actions of different (microbatch, chunk)s that one stage
    runs in the same tick, in two lanes: ``forward`` in lane 0 (an ``F``, or a ``W``),
    then ``backward`` in lane 1 (a ``B``, or a ``W``). Lanes are positions: a W runs in
    whichever lane it is placed in, so ``F+B``, ``F+W``, ``W+B`` and ``W+W`` ticks exist
    (``F`` only ever runs in lane 0 and ``B`` in lane 1: their outputs travel on those
    lanes' rings).

    Pairing is what makes a tick cost alike on every stage in the steady state (each runs
    an F and a backward), and it gives each transfer compute to hide under: the forward's
    output travels while lane 1 runs, and the backward's while the next tick's lane 0 runs
    (see ``jax_overlap.pipeline.executor``).

    Attributes:
      forward: lane 0's action: ``F`` or ``W``.
      backward: lane 1's action: ``B`` or ``W``.
    """

    forward: Action
    backward: Action


Cell = Action | Pair | None


def cell_actions(cell: Cell) -> tuple[Action, ...]:
    """The actions of one table entry, in the order a stage runs them (a pair's lane 0
    first)."""
    if cell is None:
        return ()
    if isinstance(cell, Pair):
        return (cell.forward, cell.backward)
    return (cell,)


def dependencies(task: Task, num_virtual_stages: int) -> tuple[Task, ...]:
    """The tasks that must finish at an earlier tick before ``task`` may run.

    Args:
      task: the task to run.
      num_virtual_stages: ``p * v``, the number of virtual stages in the model.

    Returns:
      The direct dependencies (empty for the first forward).
    """
    kind, mb, vs = task
    if kind == "F":
        return (Task("F", mb, vs - 1),) if vs > 0 else ()
    if kind == "B":
        own = Task("F", mb, vs)
        return (own,) if vs == num_virtual_stages - 1 else (own, Task("B", mb, vs + 1))
    return (Task("B", mb, vs),)


def dependency_gap(producer_stage: int, consumer_stage: int, transfer_latency: int) -> int:
    """Ticks from a dependency's tick to the earliest tick its consumer may run.

    Args:
      producer_stage: stage that runs the dependency.
      consumer_stage: stage that runs the consumer.
      transfer_latency: ticks a value takes between two different stages.

    Returns:
      1 on the same stage (the next tick), else ``transfer_latency``.
    """
    return 1 if producer_stage == consumer_stage else transfer_latency


# Extra facts a schedule's JSON carries, keyed by schedule name.
MEMORY_NOTES: dict[str, str] = {
    "zb-v": (
        "peak_activations counts (microbatch, chunk) pairs; a ZB-V chunk holds half of a "
        "stage's layers, so the cap of 2p chunk activations per stage equals p full-stage "
        "microbatches: the same activation memory as 1F1B's stage 0 (at the cost of "
        "holding each activation until its W)."
    ),
}


# Table entry spelling: kind, microbatch, optional ".chunk".
_ENTRY = re.compile(r"([FBW])(\d+)(?:\.(\d+))?")


def format_entry(action: Cell, virtual_stages: int) -> str | None:
    """The JSON/text spelling of one table entry.

    Args:
      action: the entry: an action, a :class:`Pair`, or ``None`` for idle.
      virtual_stages: chunks per stage; the chunk is spelled only when this exceeds 1.

    Returns:
      ``None`` for idle, else e.g. ``"F3"``, ``"F3.1"`` or, paired, ``"F3+B1"``.
    """
    if action is None:
        return None
    if isinstance(action, Pair):
        return "+".join(format_entry(a, virtual_stages) for a in action)
    base = f"{action.kind}{action.microbatch}"
    return f"{base}.{action.chunk}" if virtual_stages > 1 else base


def parse_entry(entry: str | None) -> Cell:
    """Parse a table entry such as ``"F3"``, ``"W0"``, ``"B3.1"`` or ``"F3+B1"``.

    Args:
      entry: the spelling produced by :func:`format_entry`, or ``None``.

    Returns:
      The :class:`Action` (chunk 0 when omitted), a :class:`Pair`, or ``None``.

    Raises:
      ValueError: if the string is not ``<F|B|W><microbatch>[.<chunk>]``, or a pair is
        not a forward followed by a backward.
    """
    if entry is None:
        return None
    if isinstance(entry, str) and "+" in entry:
        parts = [parse_entry(e) for e in entry.split("+")]
        if len(parts) != 2 or parts[0].kind not in ("F", "W") or parts[1].kind not in ("B", "W"):
            raise ValueError(f"bad paired entry {entry!r}: expected lane 0's F or W then lane "
                             f"1's B or W, e.g. 'F3+B1', 'F3.1+W0.0' or 'W2+B4'")
        return Pair(parts[0], parts[1])
    match = _ENTRY.fullmatch(entry) if isinstance(entry, str) else None
    if match is None:
        raise ValueError(f"bad schedule entry {entry!r}: expected e.g. 'F3', 'W0' or 'B3.1'")
    kind, mb, chunk = match.groups()
    return Action(kind, int(mb), int(chunk) if chunk is not None else 0)


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule table.

    Attributes:
      name: schedule name, e.g. ``'1f1b'``.
      stages: ``p``, devices on the pipeline axis.
      microbatches: ``m``.
      virtual_stages: ``v``, chunks per stage.
      split_backward: whether B and W are separate actions.
      placement: virtual stage (model order) -> (stage, chunk).
      grid: ``grid[stage][tick]``: an :class:`Action`, a :class:`Pair` (paired ticks) or
        ``None`` for idle; rows have equal length.
      transfer_latency: ticks between a value's producer and a consumer on another
        stage (1: the next tick; 2: the executor overlaps every transfer with a tick).
    """

    name: str
    stages: int
    microbatches: int
    virtual_stages: int
    split_backward: bool
    placement: tuple[tuple[int, int], ...]
    grid: tuple[tuple[Cell, ...], ...]
    transfer_latency: int = 1

    @property
    def ticks(self) -> int:
        """Length of the table (ticks from first action to last)."""
        return len(self.grid[0]) if self.grid else 0

    @cached_property
    def paired(self) -> bool:
        """Whether any tick runs a forward and a backward on one stage (a :class:`Pair`)."""
        return any(isinstance(c, Pair) for row in self.grid for c in row)

    @property
    def lanes(self) -> int:
        """Actions a stage runs per tick: two in a paired table (forward, then backward)."""
        return 2 if self.paired else 1

    def actions(self):
        """Every ``(stage, tick, action)`` of the table, pairs unpacked forward first."""
        for d, row in enumerate(self.grid):
            for t, cell in enumerate(row):
                for a in cell_actions(cell):
                    yield d, t, a

    @cached_property
    def _inverse_placement(self) -> dict[tuple[int, int], int]:
        return {pos: vs for vs, pos in enumerate(self.placement)}

    def virtual_stage(self, stage: int, chunk: int) -> int:
        """Model-order index of the virtual stage held as ``chunk`` on ``stage``.

        Args:
          stage: pipeline stage (device) index.
          chunk: chunk index on that stage.

        Returns:
          The virtual stage index.

        Raises:
          KeyError: if no virtual stage is placed there.
        """
        return self._inverse_placement[(stage, chunk)]

    def task(self, stage: int, action: Action) -> Task:
        """The model-order :class:`Task` that ``action`` on ``stage`` performs."""
        return Task(action.kind, action.microbatch, self.virtual_stage(stage, action.chunk))

    def entry(self, action: Cell) -> str | None:
        """``action`` spelled as in the JSON table (see :func:`format_entry`)."""
        return format_entry(action, self.virtual_stages)

    def to_json(self) -> dict:
        """A JSON-ready dict: the table plus its metrics.

        Returns:
          Keys ``name, stages, microbatches, virtual_stages, split_backward, placement,
          transfer_latency, paired, ticks, bubble_fraction, peak_activations, table`` and, for
          schedules with a memory caveat (zb-v), ``memory_note``. ``table[stage][tick]`` is
          ``None`` or an entry string such as ``"F3"`` / ``"F3.1"`` / paired ``"F3+B1"``.
        """
        out = {
            "name": self.name,
            "stages": self.stages,
            "microbatches": self.microbatches,
            "virtual_stages": self.virtual_stages,
            "split_backward": self.split_backward,
            "placement": [list(pos) for pos in self.placement],
            "transfer_latency": self.transfer_latency,
            "paired": self.paired,
            "ticks": self.ticks,
            "bubble_fraction": bubble_fraction(self),
            "peak_activations": peak_activations(self),
            "table": [[self.entry(a) for a in row] for row in self.grid],
        }
        if self.name in MEMORY_NOTES:
            out["memory_note"] = MEMORY_NOTES[self.name]
        return out

    @classmethod
    def from_json(cls, data: dict) -> "Schedule":
        """Rebuild a schedule from :meth:`to_json` output (or a hand-written table).

        Args:
          data: needs ``name, stages, microbatches, table``; ``virtual_stages`` defaults
            to 1, ``split_backward`` to whether any ``W`` appears, ``placement`` to
            the named schedule's own (round-robin for unknown names) and
            ``transfer_latency`` to 1.

        Returns:
          The schedule, unvalidated (call ``validate`` on hand-written tables).
        """
        p, v = int(data["stages"]), int(data.get("virtual_stages", 1))
        grid = tuple(tuple(parse_entry(e) for e in row) for row in data["table"])
        split = data.get("split_backward")
        if split is None:
            split = any(a.kind == "W" for row in grid for c in row for a in cell_actions(c))
        if "placement" in data:
            placement = tuple((int(s), int(c)) for s, c in data["placement"])
        else:
            placement = default_placement(data["name"], p, v)
        return cls(data["name"], p, int(data["microbatches"]), v, bool(split), placement, grid,
                   int(data.get("transfer_latency", 1)))

    def to_text(self) -> str:
        """The table as aligned text: a tick header, then one row per stage.

        Returns:
          e.g. ``"stage 0 | F0 F1 .  B0 ..."``; idle ticks print as ``.``.
        """
        cells = [[self.entry(a) or "." for a in row] for row in self.grid]
        width = max([len(str(self.ticks - 1))] + [len(c) for row in cells for c in row])
        label = len(f"stage {self.stages - 1}")
        header = "tick".ljust(label) + " | " + " ".join(
            str(t).ljust(width) for t in range(self.ticks)
        )
        rows = [
            f"stage {d}".ljust(label) + " | " + " ".join(c.ljust(width) for c in row)
            for d, row in enumerate(cells)
        ]
        return "\n".join(line.rstrip() for line in [header, *rows])


# --------------------------------------------------------------------------- placement


def linear_placement(stages: int) -> tuple[tuple[int, int], ...]:
    """One chunk per stage: virtual stage ``d`` lives on stage ``d``."""
    return tuple((d, 0) for d in range(stages))


def round_robin_placement(stages: int, virtual_stages: int) -> tuple[tuple[int, int], ...]:
    """Megatron interleaving: virtual stage ``c*p + d`` lives on stage ``d``, chunk ``c``."""
    return tuple((vs % stages, vs // stages) for vs in range(stages * virtual_stages))


def v_placement(stages: int) -> tuple[tuple[int, int], ...]:
    """ZB-V: stage ``d`` holds virtual stages ``d`` (chunk 0) and ``2p-1-d`` (chunk 1).

    The model runs down the stages and back up, so the first and last virtual stages
    share stage 0 and the turn-around at stage ``p-1`` needs no transfer.
    """
    down = [(d, 0) for d in range(stages)]
    up = [(d, 1) for d in reversed(range(stages))]
    return tuple(down + up)


def default_placement(name: str, stages: int, virtual_stages: int) -> tuple[tuple[int, int], ...]:
    """The placement a named schedule uses (round-robin for names it does not know).

    Args:
      name: schedule name.
      stages: ``p``.
      virtual_stages: ``v``.

    Returns:
      Virtual stage -> (stage, chunk).
    """
    if name == "zb-v" and virtual_stages == 2:
        return v_placement(stages)
    return round_robin_placement(stages, virtual_stages)


# ------------------------------------------------------------------- list scheduler


@dataclass(frozen=True)
class _Policy:
    """How a stage picks its next task.

    Attributes:
      priority: ``(task, stage) -> key``; the smallest key goes first.
      cap: ``stage -> most activations the stage may hold``; an ``F`` is not ready
        while the stage holds this many.
      in_order: run tasks strictly in priority order (the key is a position in the
        stage's program, as Megatron and the zero-bubble paper define their
        schedules), idling until the next one is ready; otherwise run the best
        ready task.
      programs: with ``in_order``, each stage's program itself (its order is the
        priority), so the scheduler need not sort.
      rank: names `priority` where it is one of :data:`_RANKS` (a function of the task
        alone): the ranking is then computed from integers and cached, not sorted with
        `priority` on every build (a paired build at p = 64, m = 1024 ranks 400k tasks
        nine times).
    """

    priority: Callable[[Task, int], tuple]
    cap: Callable[[int], int]
    in_order: bool = False
    programs: Sequence[Sequence[Task]] | None = None
    rank: str | None = None


# Priorities that depend on the task alone, by name (`_Policy.rank`): the kind (B, then F, then
# W), then the older microbatch, and for "late-chunk" the later virtual stage.
_RANKS = ("kind-microbatch", "kind-microbatch-late-chunk")


@lru_cache(maxsize=16)
def _ranked_tasks(rank: str, stages: int, microbatches: int,
                  placement: tuple[tuple[int, int], ...], kinds: tuple[str, ...]
                  ) -> tuple[tuple[int, ...], ...]:
    """Every stage's task ids (``(vs * m + mb) * 3 + kind``) in `rank` order (`_RANKS`);
    ties, as `_ListScheduler._ranked` breaks them, by the task (kind, microbatch, vs)."""
    late = rank == "kind-microbatch-late-chunk"
    order = []
    for d in range(stages):
        keyed = []
        for vs, (stage, _) in enumerate(placement):
            if stage != d:
                continue
            for k, kind in enumerate(kinds):
                kid = KINDS.index(kind)
                for mb in range(microbatches):
                    keyed.append(((_KIND_RANK[kind], mb, -vs if late else 0, kind, vs),
                                  (vs * microbatches + mb) * 3 + kid))
        keyed.sort()
        order.append(tuple(tid for _, tid in keyed))
    return tuple(order)


def _list_schedule(
    name: str,
    stages: int,
    microbatches: int,
    placement: tuple[tuple[int, int], ...],
    split_backward: bool,
    policy: _Policy,
    transfer_latency: int = 1,
    paired: bool = False,
    quorum: float | Sequence[float] = 0.0,
    fill: bool = False,
    guard: tuple[dict[str, float], float, float, bool] | None = None,
) -> Schedule:
    """Lockstep list scheduling of every task of one training step.

    Args:
      name: schedule name to record.
      stages: ``p``.
      microbatches: ``m``.
      placement: virtual stage -> (stage, chunk).
      split_backward: emit separate ``W`` tasks.
      policy: priority order, activation cap and selection mode.
      transfer_latency: ticks between stages (see :func:`dependency_gap`).
      paired: let a stage run one ready forward and one ready backward (``B``/``W``) in the
        same tick (a :class:`Pair`); in-order programs then keep their order per kind.
      quorum: with ``paired``, the least share of stages that must be able to pair for a
        tick to run pairs; below it every stage runs its best-ranked task alone (a pair
        makes the whole lockstep tick two actions long). A sequence gives one share per
        tick (its last entry for the ticks past its end): see :func:`search_pairings`.
      fill: with ``paired`` (greedy policies only): lanes are positions, not kinds. Lane 0
        runs the best ready forward or, without one, the oldest ready ``W``; lane 1 the best
        ready ``B`` or, without one, the next ready ``W``. So a stage runs ``{F, B}``,
        ``{F, W}``, ``{W, B}`` or ``{W, W}`` ticks and pending weight gradients fill the
        slots the critical path leaves free; ``quorum`` is not used.
      guard: with ``fill``, ``(cost, transfer, share, late)``: the scheduler plays the
        executor's tick timing (:mod:`jax_overlap.pipeline.ticks`) as it goes, and a ``W``
        goes in lane 0 ahead of a ready ``B`` only if it delays that ``B`` by at most
        ``share`` of a ``W`` (it mostly fills the wait for the ``B``'s transfer and the
        neighbours); with ``late``, only once the stage has run all its forwards (the
        cool-down, where the ``B`` chain is the critical path).

    Returns:
      The schedule table.

    Raises:
      RuntimeError: if the policy deadlocks (no stage can run anything).

    Each stage's tasks are ranked once; a task enters its stage's ready heaps (one for
    forwards, one for B/W) at the tick its last input arrives, so a tick costs a few heap
    operations per stage: p = 64, m = 1024 builds in seconds (scanning every pending task
    each tick took minutes). Tasks are ints inside: ``(vs * m + mb) * 3 + kind``.
    """
    return _ListScheduler(name, stages, microbatches, placement, split_backward, policy,
                          transfer_latency, paired, quorum, fill, guard).run()


class _ListScheduler:
    """`_list_schedule`'s state: ranked tasks, ready heaps, arrival and finish ticks, and the
    table rows built so far; one method per step of a tick."""

    def __init__(self, name: str, stages: int, microbatches: int,
                 placement: tuple[tuple[int, int], ...], split_backward: bool, policy: _Policy,
                 lat: int, paired: bool, quorum: float | Sequence[float], fill: bool,
                 guard: tuple[dict[str, float], float, float, bool] | None):
        self.name, self.stages, self.m, self.lat = name, stages, microbatches, lat
        self.placement, self.split_backward = placement, split_backward
        self.paired, self.quorum, self.fill, self.guard = paired, quorum, fill, guard
        self.n_vs = n_vs = len(placement)
        kinds = ("F", "B", "W") if split_backward else ("F", "B")
        self.release = len(kinds) - 1
        self.stage_of = [pos[0] for pos in placement]
        self.caps = [policy.cap(d) for d in range(stages)]
        self.in_order = policy.in_order
        self.order = self._ranked(policy, kinds)
        self.rank = [0] * (n_vs * microbatches * 3)
        for row in self.order:
            for i, tid in enumerate(row):
                self.rank[tid] = i
        # In-order programs run each lane's tasks front to back (one lane unless paired).
        self.lane_of = [0, int(paired), int(paired)]
        lanes = 2 if paired else 1
        self.programs = [[[i for i, tid in enumerate(self.order[d])
                           if self.lane_of[tid % 3] == lane] for lane in range(lanes)]
                         for d in range(stages)]
        self.cursor = [[0] * lanes for _ in range(stages)]
        self.ready_f: list[list[int]] = [[] for _ in range(stages)]
        self.ready_o: list[list[int]] = [[] for _ in range(stages)]
        self.ready_w: list[list[int]] = [[] for _ in range(stages)]  # fill: the W's, apart
        self.future: list[list[tuple[int, int]]] = [[] for _ in range(stages)]
        self.arrive = [1 << 62] * (n_vs * microbatches * 3)
        self.done = [-1] * (n_vs * microbatches * 3)
        for mb in range(microbatches):  # the first forwards need nothing
            self.arrive[mb * 3] = 0
            heapq.heappush(self.future[self.stage_of[0]], (0, self.rank[mb * 3]))
        arrive, future, rank, stage_of = self.arrive, self.future, self.rank, self.stage_of

        def became_ready(tid: int, tick: int) -> None:
            """`tid`'s inputs are all on its stage from `tick` on."""
            arrive[tid] = tick
            heapq.heappush(future[stage_of[tid // 3 // microbatches]], (tick, rank[tid]))

        self.became_ready = became_ready
        self.held = [0] * stages
        self.rows: list[list[Cell]] = [[] for _ in range(stages)]
        self.remaining = sum(len(row) for row in self.order)
        self.actions: dict[tuple[int, int, int], Action] = {}
        if guard is not None:
            self._init_guard(guard)

    def _ranked(self, policy: _Policy, kinds: tuple[str, ...]) -> list[list[int]]:
        """Every stage's task ids in rank order; heaps and program pointers hold ranks
        (positions in that order). The task itself breaks ties so the result never depends
        on set order."""
        if policy.rank is not None and policy.programs is None:
            return _ranked_tasks(policy.rank, self.stages, self.m, self.placement, kinds)
        m, order = self.m, []
        for d in range(self.stages):
            if policy.programs is not None:
                mine = policy.programs[d]
            else:
                mine = [Task(kinds[k], mb, vs) for vs in range(self.n_vs)
                        if self.stage_of[vs] == d for mb in range(m) for k in range(len(kinds))]
                mine.sort(key=lambda t, d=d: (policy.priority(t, d), t))
            order.append([(t.virtual_stage * m + t.microbatch) * 3 + KINDS.index(t.kind)
                          for t in mine])
        return order

    def _init_guard(self, guard) -> None:
        g_cost, self.g_transfer, self.g_share, self.g_late = guard
        self.g_sec = [action_cost(k, self.split_backward, g_cost) for k in KINDS]
        near = [set() for _ in range(self.stages)]
        for vs in range(self.n_vs - 1):
            a, b = self.stage_of[vs], self.stage_of[vs + 1]
            if a != b:
                near[a].add(b)
                near[b].add(a)
        self.near = [sorted(x) for x in near]
        self.clock = [0.0] * self.stages
        self.forwards_left = [sum(tid % 3 == 0 for tid in row) for row in self.order]

    def action(self, tid: int) -> Action:
        vs, mb = divmod(tid // 3, self.m)
        key = (tid % 3, mb, self.placement[vs][1])
        a = self.actions.get(key)
        if a is None:
            a = self.actions[key] = Action(KINDS[key[0]], mb, key[2])
        return a

    def finish(self, tid: int, tick: int) -> None:
        """Marks `tid` done at `tick`; its dependents whose inputs are all done get their
        arrival tick (the last input's tick plus its gap)."""
        done, m, stage_of, lat = self.done, self.m, self.stage_of, self.lat
        became_ready = self.became_ready
        done[tid] = tick
        kind, vs = tid % 3, tid // 3 // m
        src = stage_of[vs]
        if kind == 0:  # F: the next forward, and this stage's own B
            if vs + 1 < self.n_vs:
                became_ready(tid + 3 * m, tick + (1 if stage_of[vs + 1] == src else lat))
            if vs == self.n_vs - 1:
                became_ready(tid + 1, tick + 1)
            elif done[tid + 1 + 3 * m] >= 0:  # B of the next virtual stage already ran
                later = done[tid + 1 + 3 * m] + (1 if stage_of[vs + 1] == src else lat)
                became_ready(tid + 1, max(tick + 1, later))
        elif kind == 1:  # B: the previous virtual stage's B, and this one's W
            if self.split_backward:
                became_ready(tid + 1, tick + 1)
            if vs > 0 and done[tid - 3 * m - 1] >= 0:  # F of the previous virtual stage ran
                gap = 1 if stage_of[vs - 1] == src else lat
                became_ready(tid - 3 * m, max(tick + gap, done[tid - 3 * m - 1] + 1))

    def head(self, d: int, lane: int, tick: int) -> int | None:
        """The next task of an in-order lane, if its inputs are here and the cap allows."""
        program, k = self.programs[d][lane], self.cursor[d][lane]
        if k == len(program):
            return None
        i = program[k]
        tid = self.order[d][i]
        if self.arrive[tid] > tick or (tid % 3 == 0 and self.held[d] >= self.caps[d]):
            return None
        return i

    def pick(self, d: int, tick: int) -> tuple[int, ...]:
        """The ranks stage `d` runs at `tick` (before the quorum rule)."""
        if self.in_order:
            i = self.head(d, 0, tick)
            picks = () if i is None else (i,)
            if self.paired and (j := self.head(d, 1, tick)) is not None:
                picks = (*picks, j)
            return picks
        fut, order = self.future[d], self.order[d]
        while fut and fut[0][0] <= tick:
            i = heapq.heappop(fut)[1]
            k = order[i] % 3
            heapq.heappush(self.ready_f[d] if k == 0 else
                           self.ready_w[d] if self.fill and k == 2 else self.ready_o[d], i)
        f = self.ready_f[d][0] if self.ready_f[d] and self.held[d] < self.caps[d] else None
        o = self.ready_o[d][0] if self.ready_o[d] else None
        if self.fill:
            return self.fill_picks(d, f, o)
        if self.paired:  # one forward and one backward per tick, forward first
            return (f, o) if f is not None and o is not None else (
                (f,) if f is not None else (o,) if o is not None else ())
        if f is None:
            return () if o is None else (o,)
        return (f,) if o is None or f < o else (o,)

    def fill_picks(self, d: int, f: int | None, o: int | None) -> tuple[int, ...]:
        """Lanes as positions: lane 0 the forward, else the oldest W; lane 1 the B, else the
        next W (with the guard, a W ahead of a ready B only if it holds that B up little)."""
        ws = heapq.nsmallest(2, self.ready_w[d]) if f is None or o is None else []
        first = f if f is not None else (ws.pop(0) if ws else None)
        second = o if o is not None else (ws[0] if ws else None)
        if (self.guard is not None and f is None and o is not None and first is not None
                and (not self.g_late or not self.forwards_left[d])):
            clock = self.clock
            meet = max([clock[d]] + [clock[e] for e in self.near[d]]) + self.g_transfer
            if clock[d] + self.g_sec[2] - meet > self.g_share * self.g_sec[2]:
                first = None  # the W would hold up the B: lane 0 waits instead
        if first is None:
            return () if second is None else (second,)
        return (first,) if second is None else (first, second)

    def run_tick(self, chosen: list[tuple[int, ...]], tick: int) -> None:
        """Runs the chosen ranks: finishes their tasks and appends the table's cells."""
        rows, order, held, release, fill = self.rows, self.order, self.held, self.release, self.fill
        finish, action = self.finish, self.action
        for d, picks in enumerate(chosen):
            if not picks:
                rows[d].append(None)
                continue
            cell = []
            for i in picks:
                tid = order[d][i]
                kind = tid % 3
                if self.in_order:
                    self.cursor[d][self.lane_of[kind]] += 1
                else:
                    heapq.heappop(self.ready_f[d] if kind == 0 else
                                  self.ready_w[d] if fill and kind == 2 else self.ready_o[d])
                finish(tid, tick)
                held[d] += (kind == 0) - (kind == release)
                cell.append(action(tid))
            self.remaining -= len(picks)
            rows[d].append(cell[0] if len(cell) == 1 else Pair(*cell))

    def advance_clocks(self, chosen: list[tuple[int, ...]]) -> None:
        """The executor's clocks after a tick (the guard's view): `ticks.lane_meet`'s rule."""
        stages, near = self.stages, self.near
        work = ([0.0] * stages, [0.0] * stages)
        for d, picks in enumerate(chosen):
            for j, i in enumerate(picks):
                kind = self.order[d][i] % 3
                work[j if len(picks) == 2 else int(kind != 0)][d] += self.g_sec[kind]
                self.forwards_left[d] -= kind == 0
        for lane_work in work:
            begin = self.clock
            self.clock = [max(begin[d] + lane_work[d],
                              max([begin[d]] + [begin[e] for e in near[d]]) + self.g_transfer)
                          if near[d] else begin[d] + lane_work[d] for d in range(stages)]

    def run(self) -> Schedule:
        tick, stalled = 0, 0
        pick, stages = self.pick, range(self.stages)
        while self.remaining:
            chosen = [pick(d, tick) for d in stages]
            q = self.quorum
            share = q if isinstance(q, (int, float)) else q[min(tick, len(q) - 1)]
            if (self.paired and not self.fill
                    and 0 < sum(len(c) == 2 for c in chosen) < share * self.stages):
                # Too few stages can pair: a pair would make the whole lockstep tick two
                # actions long while most stages run one. Each runs its better-ranked task.
                chosen = [(min(c),) if len(c) == 2 else c for c in chosen]
            stalled = stalled + 1 if not any(chosen) else 0
            if stalled >= self.lat:  # nothing in flight can make a task ready
                raise RuntimeError(f"{self.name}: list scheduler deadlocked at tick {tick}")
            self.run_tick(chosen, tick)
            if self.guard is not None:
                self.advance_clocks(chosen)
            tick += 1
        return Schedule(
            name=self.name,
            stages=self.stages,
            microbatches=self.m,
            virtual_stages=self.n_vs // self.stages,
            split_backward=self.split_backward,
            placement=self.placement,
            grid=tuple(tuple(row) for row in self.rows),
            transfer_latency=self.lat,
        )


def _program_policy(programs: Sequence[Sequence[Task]]) -> _Policy:
    """An in-order policy that runs ``programs[stage]`` front to back."""
    return _Policy(  # the scheduler runs `programs` as they are; `priority` says the same
        priority=lambda t, d: (programs[d].index(t),),
        cap=lambda d: len(programs[d]),
        in_order=True,
        programs=programs,
    )


# Shares of stages that must be able to pair before a tick runs pairs, tried by
# `make_schedule(paired=True)` (see `_list_schedule`): 0 pairs wherever possible, 1 only
# where every stage can.
PAIR_QUORUMS = (0.0, 0.5, 0.75, 1.0)


def _capped(policy: _Policy, caps: Sequence[int] | None) -> _Policy:
    """``policy`` with per-stage activation caps replaced by ``caps`` (None: unchanged)."""
    if caps is None:
        return policy
    return _Policy(policy.priority, lambda d: caps[d], policy.in_order, policy.programs,
                   policy.rank)


_KIND_RANK = {"B": 0, "F": 1, "W": 2}


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
    policy = _Policy(
        priority=lambda t, d: (t.kind != "F", t.microbatch),
        cap=lambda d: microbatches,
    )
    return _list_schedule("gpipe", stages, microbatches, linear_placement(stages), False,
                          _capped(policy, caps), transfer_latency, paired, quorum)


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
    policy = _Policy(
        priority=lambda t, d: (_KIND_RANK[t.kind], t.microbatch),
        cap=lambda d: lat * (stages - d - 1) + 1,
        rank="kind-microbatch",
    )
    return _list_schedule("1f1b", stages, microbatches, linear_placement(stages), False,
                          _capped(policy, caps), lat, paired, quorum)


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
    return _list_schedule("interleaved", p, m, placement, False,
                          _capped(_program_policy(programs), caps), lat, paired, quorum)


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
    return _list_schedule("zb-h1", p, m, linear_placement(p), True,
                          _capped(_program_policy(programs), caps), lat, paired, quorum)


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
        return (_KIND_RANK[task.kind], task.microbatch, -task.virtual_stage)

    policy = _Policy(priority=priority, cap=lambda d: 2 * stages * transfer_latency,
                     rank="kind-microbatch-late-chunk")
    return _list_schedule("zb-v", stages, microbatches, v_placement(stages), True,
                          _capped(policy, caps), transfer_latency, paired, quorum)


# ------------------------------------------------------------------------- metrics


def bubble_fraction(schedule: Schedule) -> float:
    """Idle stage-ticks over ``stages x ticks``, with every action one unit of work.

    A paired tick is two units long wherever one stage runs a pair (a lockstep tick lasts
    as long as its longest entry), so a stage running a single action beside it idles one
    unit. A tick where every stage idles (a transfer in flight) is still one unit. Without
    pairs this is the plain count of idle entries.

    Args:
      schedule: the table.

    Returns:
      A fraction in ``[0, 1]``; 0 for an empty table.
    """
    total = busy = 0
    for tick in range(schedule.ticks):
        counts = [len(cell_actions(row[tick])) for row in schedule.grid]
        total += max(1, *counts) * schedule.stages
        busy += sum(counts)
    return (total - busy) / total if total else 0.0


def peak_activations(schedule: Schedule) -> list[int]:
    """Most (microbatch, chunk) activations each stage holds at once.

    An activation is held from its ``F`` tick through the tick of its last backward
    action (``W`` when split, else ``B``), both inclusive.

    Args:
      schedule: the table.

    Returns:
      One count per stage.
    """
    release = "W" if schedule.split_backward else "B"
    peaks = []
    for row in schedule.grid:
        held = peak = 0
        for action in (a for cell in row for a in cell_actions(cell)):
            if action.kind == "F":
                held += 1
                peak = max(peak, held)
            elif action.kind == release:
                held -= 1
        peaks.append(peak)
    return peaks


def tick_waste(schedule: Schedule, cost: dict[str, float] | None = None) -> list[float]:
    """Per tick, the device-time the lockstep executor idles: each stage's gap to the tick's
    slowest entry (see :func:`weighted_bubble_fraction`; ``cost`` defaults to 1 each)."""
    cost = cost or {"F": 1.0, "B": 1.0, "W": 1.0}
    out = []
    for tick in range(schedule.ticks):
        costs = [sum(action_cost(a.kind, schedule.split_backward, cost)
                     for a in cell_actions(row[tick])) for row in schedule.grid]
        out.append(max(costs) * len(costs) - sum(costs))
    return out


def weighted_bubble_fraction(
    schedule: Schedule, cost: dict[str, float] | None = None
) -> float:
    """Bubble fraction of the lockstep executor when actions have unequal costs.

    Lockstep means a tick lasts as long as its slowest action, so a stage running a
    cheap action (or nothing) beside an expensive one idles for the difference. This
    is exactly what the table-driven executor does; for event-driven timing with
    transfers, use the simulator instead.

    Args:
      schedule: the table.
      cost: time of ``'F'``, ``'B'`` and ``'W'`` (a non-split ``B`` costs ``B + W``);
        defaults to 1 each. A paired entry costs the sum of its two actions.

    Returns:
      Idle device-time over ``stages x`` total time.
    """
    cost = cost or {"F": 1.0, "B": 1.0, "W": 1.0}
    split = schedule.split_backward
    total = busy = 0.0
    for tick in range(schedule.ticks):
        costs = [
            sum(action_cost(a.kind, split, cost) for a in cell_actions(row[tick]))
            for row in schedule.grid
            if row[tick] is not None
        ]
        total += max(costs, default=0.0)
        busy += sum(costs)
    span = schedule.stages * total
    return (span - busy) / span if span else 0.0


# ----------------------------------------------------------------------- dispatch

SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")


def multiples_near(value: int, multiple: int) -> str:
    """The multiples of ``multiple`` around ``value`` to suggest in an error: ``"8 or 16"``
    for 12 and 8, just ``"8"`` below the first."""
    lower = value // multiple * multiple
    return f"{lower} or {lower + multiple}" if lower else f"{multiple}"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


# Bounds on what `make_schedule` builds in bounded time and memory. Building takes time and
# memory linear in the tasks (stages x microbatches x virtual stages x 3) and the table
# (stages x ticks): p = 64, m = 1024, v = 4 (262,144 stage-microbatch-chunks) builds in about
# 5 s on one core; past four times that (about 20 s, some hundred MB) a request is refused in
# one line instead.
MAX_STAGES = 512
MAX_SCHEDULE_CELLS = 1 << 20


def make_schedule(
    name: str, stages: int, microbatches: int, virtual_stages: int = 1,
    transfer_latency: int = 1, paired: bool = False, cost: dict[str, float] | None = None,
    search: int = 0, transfer: float | None = None,
) -> Schedule:
    """Build a named schedule.

    Args:
      name: one of :data:`SCHEDULES` (``_`` is accepted for ``-``).
      stages: ``p >= 1``.
      microbatches: ``m >= 1``; interleaved needs a multiple of ``p``.
      virtual_stages: chunks per stage: ``>= 2`` for interleaved; 1 for gpipe, 1f1b and
        zb-h1; zb-v always uses 2 and accepts 1 (the default) or 2.
      transfer_latency: ticks between stages, 1 or 2 (2: the executor hides every
        transfer under the next tick's compute); interleaved then needs ``m`` to be a
        multiple of ``2p``.
      paired: paired ticks (:class:`Pair`), capped at twice the unpaired table's
        per-stage activation peak; 1 is the only latency pairs take: each transfer hides
        under the tick's other action instead. For zb-h1 and zb-v the filled table (lanes
        as positions, :func:`filled_schedule`) is chosen where the executor runs it faster
        at `cost` and `transfer` (none without one).
      cost: F/B/W times the paired generator balances lockstep ticks for (default equal).
      search: paired only: steps of :func:`search_pairings` from the best pairing quorum's
        table (0: that table).
      transfer: paired only: the time of one stage-to-stage transfer, in `cost`'s unit. Given,
        tables are ranked by the bubble the executor's ticks give at these costs
        (:func:`jax_overlap.pipeline.ticks.executed_bubble`: ring neighbours wait for each
        other, one transfer per lane); None: by the global lockstep bubble at `cost`.

    Returns:
      The schedule.

    Raises:
      ValueError: one line naming the config field (``pipeline.schedule``,
        ``pipeline.stages``, ``pipeline.microbatches``, ``pipeline.virtual_stages``)
        and the fix.
    """
    if paired:
        _require(transfer_latency == 1,
                 f"pipeline.transfer_latency: paired ticks hide each transfer under the "
                 f"tick's other action and take latency 1, got {transfer_latency!r}; set "
                 f"pipeline.transfer_latency=1 or pipeline.paired=false")
        # A paired tick runs two actions, so a round trip from a stage takes as many ticks
        # but keeps twice the work in flight: twice the unpaired peak per stage keeps the
        # steady state paired (at the unpaired peak, pairs starve for forwards).
        key = _checked_key(name, stages, microbatches, virtual_stages, 1)  # at full size
        proxy = PAIRED_PROXY_STAGES * stages
        chunks = 2 if key == "zb-v" else virtual_stages
        if (not search and microbatches > proxy
                and stages * microbatches * chunks > PAIRED_PROXY_CELLS):
            # Large tables: the variants differ in the ramps, which a table of `proxy`
            # microbatches has too, and run the same steady state; the proxy's best variant
            # is built once at full size. Its caps carry over where the pipeline's depth, not
            # the microbatch count, bounds the unpaired peaks (every schedule but GPipe).
            small = _build(key, stages, proxy, virtual_stages, 1)
            peaks = peak_activations(small)
            if max(peaks) < proxy * small.virtual_stages:
                variant = _best_paired(small, peaks, cost, 0, transfer)[1]
                caps = _paired_caps(peaks, microbatches * small.virtual_stages, variant.doubled)
                return _build_variant(small.name, stages, microbatches, small.virtual_stages,
                                      caps, variant, cost, transfer)
        base = _build(key, stages, microbatches, virtual_stages, 1)
        return _best_paired(base, peak_activations(base), cost, search, transfer)[0]
    key = _checked_key(name, stages, microbatches, virtual_stages, transfer_latency)
    return _build(key, stages, microbatches, virtual_stages, transfer_latency)


def _checked_key(name: str, stages: int, microbatches: int, virtual_stages: int,
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
    _require(
        isinstance(stages, int) and stages >= 1,
        f"pipeline.stages: must be an integer >= 1, got {stages!r}",
    )
    _require(
        isinstance(microbatches, int) and microbatches >= 1,
        f"pipeline.microbatches: must be an integer >= 1, got {microbatches!r}",
    )
    _require(
        isinstance(stages, int) and stages <= MAX_STAGES,
        f"pipeline.stages: {stages} is more than {MAX_STAGES}, the most a schedule is built "
        f"for; use fewer stages",
    )
    cells = stages * microbatches * max(1, virtual_stages if isinstance(virtual_stages, int) else 1)
    most = max(1, MAX_SCHEDULE_CELLS // (stages * max(1, virtual_stages)))
    _require(
        cells <= MAX_SCHEDULE_CELLS,
        f"pipeline.microbatches: stages x microbatches x virtual stages = {cells} is more than "
        f"{MAX_SCHEDULE_CELLS}, the most a schedule is built for in bounded time and memory; "
        f"use at most {most} microbatches",
    )
    _require(
        lat in (1, 2),
        f"pipeline.transfer_latency: must be 1 (transfers between ticks) or 2 (transfers "
        f"under the next tick's compute), got {lat!r}",
    )
    if key == "interleaved":
        _require(
            isinstance(virtual_stages, int) and virtual_stages >= 2,
            f"pipeline.virtual_stages: interleaved needs >= 2 chunks per stage, got "
            f"{virtual_stages!r}; set pipeline.virtual_stages to 2 or more (or use 1f1b)",
        )
        group = stages * lat
        fix = multiples_near(microbatches, group)
        what = (f"pipeline.stages={stages}" if lat == 1 else
                f"2 x pipeline.stages={group} with pipeline.transfer_latency=2")
        _require(
            microbatches % group == 0,
            f"pipeline.microbatches: interleaved needs a multiple of {what} (at least "
            f"{group}), got {microbatches}; set pipeline.microbatches to {fix}",
        )
        return key
    if key == "zb-v":
        _require(
            virtual_stages in (1, 2),
            f"pipeline.virtual_stages: zb-v always uses 2 chunks per stage, got "
            f"{virtual_stages!r}; set pipeline.virtual_stages to 2 (or leave it at 1)",
        )
        return key
    _require(
        virtual_stages == 1,
        f"pipeline.virtual_stages: {key} uses one chunk per stage, got {virtual_stages!r}; "
        f"set pipeline.virtual_stages to 1 (or use interleaved / zb-v)",
    )
    return key


# Paired tables of more cells (stages x microbatches x chunks) than this, with more
# microbatches than PAIRED_PROXY_STAGES x stages, choose their variant (pairing quorum, caps,
# filled lanes and guard) on a table of PAIRED_PROXY_STAGES x stages microbatches and build
# only it at full size: p = 64, m = 1024 ZB-V in seconds instead of a minute.
PAIRED_PROXY_CELLS = 1 << 15
PAIRED_PROXY_STAGES = 2


class _PairedVariant(NamedTuple):
    """How a paired table is generated: lanes as positions (`filled`, with a `guard` of
    :data:`FILL_GUARDS`) or pairs above a `quorum`; caps twice the unpaired table's peak
    per stage (`doubled`) or the peak itself."""

    filled: bool
    doubled: bool
    quorum: float = 0.0
    guard: tuple[float, bool] | None = None


def _paired_caps(peaks: Sequence[int], most: int, doubled: bool) -> list[int]:
    """Per-stage activation caps of a paired table from the unpaired table's `peaks`: twice
    them (at most `most`, every (microbatch, chunk) of the step) or the peaks themselves."""
    return [min(2 * peak, most) for peak in peaks] if doubled else list(peaks)


def _build_variant(name: str, p: int, m: int, v: int, caps: Sequence[int],
                   variant: _PairedVariant, cost: dict[str, float] | None,
                   transfer: float | None) -> Schedule:
    """The paired table of `variant` for schedule `name` at `p` stages, `m` microbatches
    and `v` chunks per stage."""
    if not variant.filled:
        return _build(name, p, m, v, 1, True, caps, variant.quorum)
    cost = cost or {"F": 1.0, "B": 1.0, "W": 1.0}
    guard = variant.guard
    return _filled(name, p, m, caps, None if guard is None else
                   (cost, 0.0 if transfer is None else transfer, *guard))


def _best_paired(base: Schedule, peaks: Sequence[int], cost: dict[str, float] | None,
                 search: int, transfer: float | None) -> tuple[Schedule, _PairedVariant]:
    """The best paired table at the unpaired `base`'s size (`peaks`: its activation peaks),
    and its variant (see `make_schedule`)."""
    p, m, v = base.stages, base.microbatches, base.virtual_stages
    # Cost-aware: of the pairing quorums, the table whose ticks waste least at `cost`
    # (default: F = B = W, so a non-split B costs two), then the one with most pairs (most
    # transfers hidden under the other lane). Timed as the executor runs it (`transfer`
    # given), the unpaired table's own caps are tried too.
    candidates = []
    for doubled in ((True, False) if transfer is not None else (True,)):
        caps = _paired_caps(peaks, m * v, doubled)
        for q in PAIR_QUORUMS:
            variant = _PairedVariant(False, doubled, q)
            try:
                candidates.append((_build_variant(base.name, p, m, v, caps, variant, cost,
                                                  transfer), caps, variant))
            except RuntimeError:  # a tighter cap can deadlock the greedy
                continue
    table, caps, variant = min(candidates, key=lambda c: _pairing_key(c[0], cost, transfer))
    if search:
        table = search_pairings(base.name, p, m, v, caps, cost, variant.quorum, search,
                                transfer=transfer)
    if base.name not in FILLED:
        return table, variant
    # Lanes as positions (W's in either lane): if better at these costs as the executor
    # runs it (ring neighbours wait for each other, one transfer per lane; none without
    # `transfer`), it wins. Ties (e.g. F = B = W without a transfer) keep the table that
    # wastes least in global lockstep, the one chosen so far.
    timed = 0.0 if transfer is None else transfer
    filled = _filled_variants(base.name, p, m, v, _paired_caps(peaks, m * v, True), cost, timed)
    return min([(table, variant), *filled],
               key=lambda c: (*_pairing_key(c[0], cost, timed)[:1], *_pairing_key(c[0], cost)))


def _build(key: str, stages: int, microbatches: int, virtual_stages: int, lat: int,
           paired: bool = False, caps: Sequence[int] | None = None,
           quorum: float | Sequence[float] = 0.0) -> Schedule:
    """The generator of a checked schedule name."""
    if key == "interleaved":
        return interleaved(stages, microbatches, virtual_stages, lat, paired, caps, quorum)
    builder = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zb_h1, "zb-v": zb_v}[key]
    return builder(stages, microbatches, lat, paired, caps, quorum)


# Schedules with a filled paired table (`_filled`): lanes are positions, W's fill free slots.
FILLED: tuple[str, ...] = ("zb-h1", "zb-v")
# (share, late) guards `make_schedule` tries for a filled table (see `_list_schedule`'s
# `guard`); None: no guard. At the zero-bubble paper's costs no one setting is best on every
# row (ZB-H1 at p = 8 likes the guard everywhere, ZB-V at p = 24 only in the cool-down).
FILL_GUARDS: tuple[tuple[float, bool] | None, ...] = (None, (0.0, False), (0.5, False),
                                                      (0.5, True))


def filled_schedule(name: str, stages: int, microbatches: int, caps: Sequence[int] | None,
                    cost: dict[str, float] | None = None,
                    transfer: float = 0.0) -> list[Schedule]:
    """The best filled paired table (lanes as positions, see `_filled`) at these costs.

    Args:
      name: ``zb-h1`` or ``zb-v``.
      stages, microbatches: ``p``, ``m``.
      caps: per-stage activation caps; None: twice the unpaired table's peak per stage (what
        ``make_schedule(paired=True)`` uses).
      cost: F/B/W times (default equal).
      transfer: one stage-to-stage transfer's time.

    Returns:
      ``[table]``, the least executed bubble (:func:`executed_bubble`) of the
      :data:`FILL_GUARDS` tables, or ``[]`` if every one deadlocks.
    """
    v = 2 if name == "zb-v" else 1
    if caps is None:
        base = make_schedule(name, stages, microbatches, v)
        caps = _paired_caps(peak_activations(base), microbatches * v, True)
    return [table for table, _ in _filled_variants(name, stages, microbatches, v, caps, cost,
                                                   transfer)]


def _filled_variants(name: str, p: int, m: int, v: int, caps: Sequence[int],
                     cost: dict[str, float] | None,
                     transfer: float) -> list[tuple[Schedule, _PairedVariant]]:
    """`[(table, variant)]`: of the :data:`FILL_GUARDS` filled tables of `name` at `p`
    stages, `m` microbatches and `v` chunks per stage, the one with the least executed
    bubble; `[]` if every one deadlocks."""
    tables = []
    for guard in FILL_GUARDS:
        variant = _PairedVariant(True, True, guard=guard)
        try:
            tables.append((_build_variant(name, p, m, v, caps, variant, cost, transfer),
                           variant))
        except RuntimeError:  # pragma: no cover - the greedy has not deadlocked so far
            continue
    unit = cost or {"F": 1.0, "B": 1.0, "W": 1.0}
    return sorted(tables, key=lambda c: round(executed_bubble(c[0], unit, transfer), 9))[:1]


def _filled(key: str, stages: int, microbatches: int, caps: Sequence[int],
            guard: tuple | None) -> Schedule:
    """A paired ZB-H1 / ZB-V table whose lanes are positions (``_list_schedule``'s ``fill``).

    Greedy with the schedule's priorities (``B`` first, then ``F``, then ``W``; older
    microbatches, for ZB-V later virtual stages first), the forwards held to `caps`
    activations per stage. A stage runs ``{F, B}`` in the steady state and the delayed
    ``W``'s fill the free lane of the other ticks, so every stage does the same work between
    transfers; the ramps fill with pending ``W``'s as ZB-H1 and ZB-V do.

    Args:
      key: ``zb-h1`` or ``zb-v``.
      stages, microbatches: ``p``, ``m``.
      caps: per-stage activation caps ((microbatch, chunk)s held from F to W).
      guard: ``_list_schedule``'s ``guard``, or None.

    Returns:
      The table.

    Raises:
      RuntimeError: if the greedy deadlocks.
    """
    if key == "zb-h1":
        policy = _Policy(priority=lambda t, d: (_KIND_RANK[t.kind], t.microbatch),
                         cap=lambda d: caps[d], rank="kind-microbatch")
        placement = linear_placement(stages)
    else:
        policy = _Policy(priority=lambda t, d: (_KIND_RANK[t.kind], t.microbatch,
                                                -t.virtual_stage),
                         cap=lambda d: caps[d], rank="kind-microbatch-late-chunk")
        placement = v_placement(stages)
    return _list_schedule(key, stages, microbatches, placement, True, policy, 1, True, 0.0,
                          True, guard)


def _pairing_key(schedule: Schedule, cost: dict[str, float] | None,
                 transfer: float | None = None) -> tuple:
    """How a paired table ranks: least waste at `cost` (the executor's ticks with `transfer`
    per lane, or, without one, the global lockstep), then most pairs (most transfers hidden
    under the other lane)."""
    pairs = sum(isinstance(c, Pair) for row in schedule.grid for c in row)
    if transfer is None:
        return round(weighted_bubble_fraction(schedule, cost), 9), -pairs
    return round(executed_bubble(schedule, cost, transfer), 9), -pairs


def search_pairings(name: str, stages: int, microbatches: int, virtual_stages: int,
                    caps: Sequence[int], cost: dict[str, float] | None, start: float,
                    steps: int, seed: int = 0, transfer: float | None = None) -> Schedule:
    """A paired table whose ticks cost alike at `cost`, by hill climbing on where pairs run.

    One pairing quorum for the whole step is a compromise: in the ramp pairs must run
    wherever they can, while in a memory-capped steady state a pair beside single actions
    makes the whole lockstep tick two actions long. Here each tick has its own quorum
    (:func:`_list_schedule`), starting from `start` everywhere; each step re-draws one to
    three ticks' quorums, mostly where the table wastes time, and keeps the table when its
    cost-weighted bubble (then its pair count) is no worse. The steps are split over
    :data:`PAIR_SEARCH_RESTARTS` independent climbs, and the best table wins. Every
    table comes from the list scheduler with the same caps, so it meets the dependencies and
    the per-stage activation caps by construction. Deterministic for a `seed`; about 30 ms a
    step at p = 4, m = 16.

    Args:
      name: schedule name (a checked key).
      stages, microbatches, virtual_stages: as for :func:`make_schedule`.
      caps: per-stage activation caps of the paired generator.
      cost: F/B/W times (default equal).
      start: the quorum every tick starts from (the best single quorum's).
      steps: tables to try.
      seed: the draws' seed.
      transfer: rank tables by the executor's tick timing with this transfer time (see
        :func:`make_schedule`); None: by the global lockstep bubble.

    Returns:
      The best table found (the start table if no step improves on it).
    """
    first = _build(name, stages, microbatches, virtual_stages, 1, True, caps, (start,))
    climbs = [_climb(name, stages, microbatches, virtual_stages, caps, cost, start, first,
                     steps // PAIR_SEARCH_RESTARTS + (r < steps % PAIR_SEARCH_RESTARTS),
                     seed * PAIR_SEARCH_RESTARTS + r, transfer)
              for r in range(PAIR_SEARCH_RESTARTS)]
    return min(climbs, key=lambda t: _pairing_key(t, cost, transfer))


# Independent climbs `search_pairings` splits its steps into: the landscape is rugged (at
# p = 4, m = 16, 150-step climbs from different seeds end between 0.058 and 0.064), so a few
# short climbs beat one long one.
PAIR_SEARCH_RESTARTS = 4


def _climb(name: str, stages: int, microbatches: int, virtual_stages: int,
           caps: Sequence[int], cost: dict[str, float] | None, start: float,
           first: Schedule, steps: int, seed: int,
           transfer: float | None = None) -> Schedule:
    """One hill climb of :func:`search_pairings` from `first` (every tick at `start`)."""
    import random

    rng = random.Random(seed)
    def draw_weights(table):
        # Re-draw where the table wastes time (every tick a little, so each can be drawn).
        waste = tick_waste(table, cost)
        floor = sum(waste) / len(waste) / 10 + 1e-9
        return [w + floor for w in waste]

    best, key = first, _pairing_key(first, cost, transfer)
    shares, weights = [start] * best.ticks, draw_weights(first)
    for _ in range(steps):
        trial = list(shares)
        # A wasteful tick, or up to three ticks before it (the choice that lets a tick pair,
        # or not, is made a little earlier).
        for _ in range(rng.randint(1, 3)):
            k = rng.choices(range(len(weights)), weights=weights)[0]
            trial[min(max(k - rng.randint(0, 3), 0), len(trial) - 1)] = rng.choice(PAIR_QUORUMS)
        try:
            table = _build(name, stages, microbatches, virtual_stages, 1, True, caps,
                           tuple(trial))
        except RuntimeError:  # this pairing deadlocks the greedy: keep the last table
            continue
        trial_key = _pairing_key(table, cost, transfer)
        if trial_key <= key:
            best, key = table, trial_key
            shares = (trial + [trial[-1]] * table.ticks)[:max(table.ticks, 1)]
            weights = draw_weights(table)
    return best


def summary_line(schedule: Schedule) -> str:
    """One line of metrics: ticks, bubble fraction and per-stage peak activations."""
    s = schedule
    return (
        f"{s.name}: stages={s.stages} microbatches={s.microbatches} "
        f"virtual_stages={s.virtual_stages} "
        + (f"transfer_latency={s.transfer_latency} " if s.transfer_latency != 1 else "")
        + ("paired " if s.paired else "")
        + f"ticks={s.ticks} "
        f"bubble_fraction={bubble_fraction(s):.4f} peak_activations={peak_activations(s)}"
    )


def schedule_command(
    schedule: str,
    stages: int,
    microbatches: int,
    virtual: int = 1,
    as_json: bool = False,
    transfer_latency: int = 1,
    paired: bool = False,
    tick_costs: str | None = None,
    pair_search: int = 0,
    costs: str | None = None,
) -> str:
    """What ``jax-overlap schedule`` prints.

    Args:
      schedule: schedule name.
      stages: ``--stages``.
      microbatches: ``--microbatches``.
      virtual: ``--virtual`` (chunks per stage).
      as_json: ``--json``: print ``json.dumps(to_json())`` instead of the text grid.
      transfer_latency: ``--transfer-latency``.
      paired: ``--paired``: paired F+B ticks.
      tick_costs: ``--tick-costs``: ``"F,B,W"`` tick times the pairing balances.
      pair_search: ``--pair-search``: steps of :func:`search_pairings`.
      costs: ``--costs``: ``"F,B,W,C"``, the action times and one stage-to-stage transfer's:
        the output adds ``weighted_bubble``, the bubble of the executor's ticks at these costs
        (:func:`jax_overlap.pipeline.ticks.executed_bubble`), and a paired table is chosen
        (and searched) for it.

    Returns:
      The text grid and a summary line, or the JSON document.

    Raises:
      ValueError: bad arguments, as in :func:`make_schedule`.
    """
    cost = None
    if tick_costs is not None:
        try:
            values = [float(v) for v in tick_costs.split(",")]
        except ValueError:
            values = []
        if len(values) != 3 or min(values) <= 0:
            raise ValueError(f"--tick-costs: three positive numbers F,B,W, e.g. "
                             f"15.2,18.8,18.6; got {tick_costs!r}")
        cost = dict(zip(KINDS, values))
    transfer = None
    if costs is not None:
        if tick_costs is not None:
            raise ValueError("--tick-costs: --costs F,B,W,C already gives the action times; "
                             "drop --tick-costs")
        try:
            values = [float(v) for v in costs.split(",")]
        except ValueError:
            values = []
        if len(values) != 4 or min(values[:3]) <= 0 or values[3] < 0:
            raise ValueError(f"--costs: four numbers F,B,W,C (F, B, W > 0, transfer C >= 0), "
                             f"e.g. 18.5,18.1,9.3,0.6; got {costs!r}")
        cost, transfer = dict(zip(KINDS, values[:3])), values[3]
    if pair_search and not paired:
        raise ValueError("--pair-search: searches where paired ticks run; add --paired")
    if pair_search < 0:
        raise ValueError(f"--pair-search: must be >= 0, got {pair_search}")
    s = make_schedule(schedule, stages, microbatches, virtual, transfer_latency, paired, cost,
                      pair_search, transfer)
    weighted = None
    if transfer is not None:
        weighted = executed_bubble(s, cost, transfer)
    if as_json:
        out = s.to_json()
        if weighted is not None:
            out["costs"] = {**cost, "C": transfer}
            out["weighted_bubble"] = weighted
        return json.dumps(out)
    extra = "" if weighted is None else f" weighted_bubble={weighted:.4f}"
    return s.to_text() + "\n" + summary_line(s) + extra


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
