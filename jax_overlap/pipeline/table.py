"""A pipeline schedule's table: which stage runs which action at which tick, and its metrics.

A schedule is a table ``grid[stage][tick]`` of :class:`Action` (or a :class:`Pair` on a paired
tick, or ``None`` for idle), plus the placement of the model's virtual stages onto
(stage, chunk) pairs. The executor and the timeline simulator both read this table; nothing
here runs a model, and nothing here builds one (:mod:`jax_overlap.pipeline.schedules` does).

Time model
----------
The executor runs the table in lockstep, one tick per action: every action -- ``F``,
``B``, ``W`` or a non-split ``B`` (which also computes weight gradients) -- takes one
tick. A value produced at tick ``t`` on one stage can be consumed on another stage at
tick ``t + 1`` at the earliest (one tick of transfer latency); on the same stage the
consumer simply runs at a later tick. A schedule built with ``transfer_latency = L``
asks for ``L`` ticks between stages instead: with ``L = 2`` the executor sends tick
``t``'s output at the start of tick ``t + 1``, beside that tick's compute, so every
transfer can hide under a whole tick of GEMMs (see ``jax_overlap.pipeline.executor``).
Dependencies, for microbatch ``mb`` and virtual stage ``vs`` (model order,
``0 .. p*v - 1``):

* ``F(mb, vs)`` needs ``F(mb, vs - 1)``;
* ``B(mb, vs)`` needs ``F(mb, vs)`` and ``B(mb, vs + 1)`` (the last virtual stage needs
  only its own ``F``);
* ``W(mb, vs)`` needs ``B(mb, vs)``.

Activations are counted per (microbatch, chunk): held from its ``F`` tick through the
tick of its last backward action (``W`` when the backward is split, else ``B``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

from jax_overlap.pipeline.ticks import UNIT_COST, action_cost

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
    cost = cost or UNIT_COST
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
    cost = cost or UNIT_COST
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
