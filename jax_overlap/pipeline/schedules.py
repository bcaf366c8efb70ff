"""Pipeline schedules as data: build one by name (:func:`make_schedule`), print it
(``jax-overlap schedule``), and the names a user reaches for, in one place.

A schedule is a table ``grid[stage][tick]`` (:class:`~jax_overlap.pipeline.table.Schedule`)
of which stage runs which action at which tick. The modules below this one each own a part:

* :mod:`~jax_overlap.pipeline.table`: the table, its entries and its metrics (bubble,
  activation peaks, the lockstep bubble at unequal costs);
* :mod:`~jax_overlap.pipeline.list_scheduler`: the one lockstep list scheduler every table
  comes from;
* :mod:`~jax_overlap.pipeline.generators`: GPipe, 1F1B, interleaved, ZB-H1 and ZB-V as its
  priorities or programs, and the checks on their sizes;
* :mod:`~jax_overlap.pipeline.pairing`: paired tables, chosen for the costs the executor
  runs them at.
"""

from __future__ import annotations

import json
from typing import Sequence

from jax_overlap.pipeline import pairing
from jax_overlap.pipeline.generators import (
    FILLED,
    MAX_SCHEDULE_CELLS,
    SCHEDULES,
    bubble_formula,
    build,
    checked_key,
    require,
    zb_v,
)
from jax_overlap.pipeline.table import (
    KINDS,
    Action,
    Pair,
    Schedule,
    Task,
    bubble_fraction,
    dependencies,
    format_entry,
    linear_placement,
    parse_entry,
    peak_activations,
    weighted_bubble_fraction,
)
from jax_overlap.pipeline.ticks import executed_bubble

# What a user names: the builders here, and the table, its metrics and the named schedules
# from the modules below (library code imports those from their own modules).
__all__ = [
    "FILLED", "KINDS", "MAX_SCHEDULE_CELLS", "SCHEDULES", "Action", "Pair", "Schedule", "Task",
    "bubble_formula", "bubble_fraction", "dependencies", "filled_schedule", "format_entry",
    "linear_placement", "make_schedule", "parse_entry", "peak_activations", "schedule_command",
    "summary_line", "weighted_bubble_fraction", "zb_v",
]


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
        require(transfer_latency == 1,
                f"pipeline.transfer_latency: paired ticks hide each transfer under the "
                f"tick's other action and take latency 1, got {transfer_latency!r}; set "
                f"pipeline.transfer_latency=1 or pipeline.paired=false")
        # A paired tick runs two actions, so a round trip from a stage takes as many ticks
        # but keeps twice the work in flight: twice the unpaired peak per stage keeps the
        # steady state paired (at the unpaired peak, pairs starve for forwards).
        key = checked_key(name, stages, microbatches, virtual_stages, 1)  # at full size
        proxy = pairing.PAIRED_PROXY_STAGES * stages
        chunks = 2 if key == "zb-v" else virtual_stages
        if (not search and microbatches > proxy
                and stages * microbatches * chunks > pairing.PAIRED_PROXY_CELLS):
            # Large tables: the variants differ in the ramps, which a table of `proxy`
            # microbatches has too, and run the same steady state; the proxy's best variant
            # is built once at full size. Its caps carry over where the pipeline's depth, not
            # the microbatch count, bounds the unpaired peaks (every schedule but GPipe).
            small = build(key, stages, proxy, virtual_stages, 1)
            peaks = peak_activations(small)
            if max(peaks) < proxy * small.virtual_stages:
                variant = pairing.best_paired(small, peaks, cost, 0, transfer)[1]
                v = small.virtual_stages
                caps = pairing.paired_caps(peaks, microbatches * v, variant.doubled)
                return pairing.build_variant(small.name, stages, microbatches, v, caps, variant,
                                             cost, transfer)
        base = build(key, stages, microbatches, virtual_stages, 1)
        return pairing.best_paired(base, peak_activations(base), cost, search, transfer)[0]
    key = checked_key(name, stages, microbatches, virtual_stages, transfer_latency)
    return build(key, stages, microbatches, virtual_stages, transfer_latency)


def filled_schedule(name: str, stages: int, microbatches: int, caps: Sequence[int] | None,
                    cost: dict[str, float] | None = None,
                    transfer: float = 0.0) -> list[Schedule]:
    """The best filled paired table (lanes as positions, see `filled`) at these costs.

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
        caps = pairing.paired_caps(peak_activations(base), microbatches * v, True)
    return [table for table, _ in pairing.filled_variants(name, stages, microbatches, v, caps,
                                                          cost, transfer)]


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
