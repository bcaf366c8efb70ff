"""Matplotlib pictures of schedule tables: a timeline per schedule and bubble curves."""

from __future__ import annotations

from typing import Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.colors import to_rgb
from matplotlib.patches import Patch, Rectangle

from jax_overlap.pipeline.schedules import make_schedule
from jax_overlap.pipeline.table import (
    Schedule,
    bubble_fraction,
    cell_actions,
    weighted_bubble_fraction,
)
from jax_overlap.pipeline.ticks import action_cost

KIND_COLORS: dict[str, str] = {"F": "#4c72b0", "B": "#55a868", "W": "#dd8452"}
KIND_LABELS: dict[str, str] = {"F": "F forward", "B": "B backward", "W": "W weight grad"}


def chunk_color(kind: str, chunk: int, virtual_stages: int) -> tuple[float, float, float]:
    """Colour of an action box: the kind's colour, lightened for later chunks.

    Args:
      kind: ``'F'``, ``'B'`` or ``'W'``.
      chunk: the action's chunk.
      virtual_stages: chunks per stage (sets the shade step).

    Returns:
      An RGB triple.
    """
    # Blend towards white, at most 55% so the kind stays recognisable.
    mix = 0.55 * chunk / max(virtual_stages - 1, 1)
    return tuple(c + (1.0 - c) * mix for c in to_rgb(KIND_COLORS[kind]))


def tick_spans(schedule: Schedule, cost: dict[str, float] | None = None) -> list[float]:
    """Start of every tick and the end of the last, in the units of ``cost``.

    Without costs a tick is one unit per action of its busiest stage (2 where one pairs, at
    least 1). With costs it lasts as long as its most expensive entry, as in the lockstep
    executor (a tick where every stage idles takes no time).
    """
    starts = [0.0]
    for t in range(schedule.ticks):
        cells = [row[t] for row in schedule.grid]
        if cost is None:
            width = max(1, *(len(cell_actions(c)) for c in cells))
        else:
            width = max((sum(action_cost(a.kind, schedule.split_backward, cost)
                             for a in cell_actions(c)) for c in cells), default=0.0)
        starts.append(starts[-1] + width)
    return starts


def plot_schedule(schedule: Schedule, ax: Axes | None = None,
                  cost: dict[str, float] | None = None) -> Axes:
    """Draw the table as a timeline: one row per stage, one box per action.

    Boxes are coloured by kind and lightened by chunk; each carries its microbatch
    number; idle ticks stay blank. A paired tick draws its forward then its backward side
    by side. With ``cost`` (F/B/W times) every box is as wide as its action costs and every
    tick as long as its slowest entry: the lockstep executor's timeline, whose white space
    is the weighted bubble.

    Args:
      schedule: the table.
      ax: axes to draw on; a new figure sized to the table when ``None``.

    Returns:
      The axes.
    """
    s = schedule
    spans = tick_spans(s, cost)
    if ax is None:
        _, ax = plt.subplots(figsize=(max(6.0, 0.28 * s.ticks), 0.45 * s.stages + 1.2))
    # Size the microbatch labels to the boxes as drawn, whatever axes we were given.
    unit = spans[-1] / max(sum(len(cell_actions(c)) for row in s.grid for c in row)
                           / max(s.stages, 1), 1)
    box_points = ax.get_window_extent().width / ax.figure.dpi * 72.0 * unit / max(spans[-1], 1)
    font = max(4.0, min(9.0, 0.45 * box_points))
    kinds_seen: set[str] = set()
    for d, row in enumerate(s.grid):
        for t, cell in enumerate(row):
            x = spans[t]
            for action in cell_actions(cell):
                width = 1.0 if cost is None else action_cost(action.kind, s.split_backward, cost)
                kinds_seen.add(action.kind)
                color = chunk_color(action.kind, action.chunk, s.virtual_stages)
                box = Rectangle((x, d - 0.4), width, 0.8, facecolor=color, edgecolor="white",
                                lw=0.6)
                ax.add_patch(box)
                ax.text(x + width / 2, d, str(action.microbatch), ha="center", va="center",
                        fontsize=font)
                x += width
    ax.set_xlim(0, max(spans[-1], 1))
    ax.set_ylim(s.stages - 0.5, -0.5)
    ax.set_yticks(range(s.stages), [f"stage {d}" for d in range(s.stages)])
    ax.set_xlabel("tick" if cost is None else "time (lockstep, action costs)")
    bubble = bubble_fraction(s) if cost is None else weighted_bubble_fraction(s, cost)
    ax.set_title(
        f"{s.name}{' paired' if s.paired else ''}: p={s.stages}, m={s.microbatches}, "
        f"v={s.virtual_stages}, {s.ticks} ticks, "
        f"{'bubble' if cost is None else 'weighted bubble'} {bubble:.1%}",
        fontsize=10,
    )
    handles = [
        Patch(color=KIND_COLORS[k], label=KIND_LABELS[k]) for k in KIND_COLORS if k in kinds_seen
    ]
    if s.virtual_stages > 1:
        handles += [
            Patch(color=chunk_color("F", c, s.virtual_stages), label=f"chunk {c}")
            for c in range(s.virtual_stages)
        ]
    ax.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False
    )
    return ax


def plot_bubble_vs_microbatches(
    names: Sequence[str],
    stages: int,
    microbatch_values: Sequence[int],
    ax: Axes | None = None,
    virtual_stages: int = 2,
) -> Axes:
    """Plot each schedule's bubble fraction against the number of microbatches.

    Args:
      names: schedule names.
      stages: ``p``.
      microbatch_values: the ``m`` to evaluate; values a schedule rejects (e.g. an
        interleaved ``m`` that is not a multiple of ``p``) are left out of its line.
      ax: axes to draw on; a new figure when ``None``.
      virtual_stages: chunks per stage for ``interleaved`` (other schedules use their
        own).

    Returns:
      The axes.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 4.0))
    styles = ("-", "--", "-.", ":")
    for i, name in enumerate(names):
        v = virtual_stages if name == "interleaved" else 1
        points = []
        for m in microbatch_values:
            try:
                points.append((m, bubble_fraction(make_schedule(name, stages, m, v))))
            except ValueError:
                continue
        label = f"{name} (v={v})" if name == "interleaved" else name
        # Line styles cycle so coinciding curves (GPipe and 1F1B) both stay visible.
        xs, ys = [m for m, _ in points], [b for _, b in points]
        ax.plot(xs, ys, styles[i % len(styles)], marker="o", ms=3, label=label)
    ax.set_xlabel("microbatches m")
    ax.set_ylabel("bubble fraction")
    ax.set_title(f"bubble fraction vs microbatches, p={stages}", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax
