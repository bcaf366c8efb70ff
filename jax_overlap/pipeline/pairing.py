"""Paired tables: which of a schedule's paired variants the executor runs fastest, and the
search over where pairs run.

A paired tick runs a forward and a backward (or W's) on one stage in two lanes. Which ticks
pair is a choice: a pairing quorum for the whole step (:data:`PAIR_QUORUMS`), activation caps
of once or twice the unpaired table's peaks, or, for the zero-bubble schedules, lanes as
positions (filled tables, tried under each of :data:`FILL_GUARDS`). :func:`best_paired` builds
the variants and ranks them at the given action and transfer costs; :func:`search_pairings`
hill-climbs per-tick quorums from the best one.
"""

from __future__ import annotations

import random
from typing import NamedTuple, Sequence

from jax_overlap.pipeline.generators import FILLED, build, filled_table
from jax_overlap.pipeline.table import Pair, Schedule, tick_waste, weighted_bubble_fraction
from jax_overlap.pipeline.ticks import UNIT_COST, executed_bubble

# Shares of stages that must be able to pair before a tick runs pairs, tried by
# `make_schedule(paired=True)` (see `list_schedule`): 0 pairs wherever possible, 1 only
# where every stage can.
PAIR_QUORUMS = (0.0, 0.5, 0.75, 1.0)


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


def paired_caps(peaks: Sequence[int], most: int, doubled: bool) -> list[int]:
    """Per-stage activation caps of a paired table from the unpaired table's `peaks`: twice
    them (at most `most`, every (microbatch, chunk) of the step) or the peaks themselves."""
    return [min(2 * peak, most) for peak in peaks] if doubled else list(peaks)


def build_variant(name: str, p: int, m: int, v: int, caps: Sequence[int],
                  variant: _PairedVariant, cost: dict[str, float] | None,
                  transfer: float | None) -> Schedule:
    """The paired table of `variant` for schedule `name` at `p` stages, `m` microbatches
    and `v` chunks per stage."""
    if not variant.filled:
        return build(name, p, m, v, 1, True, caps, variant.quorum)
    cost = cost or UNIT_COST
    guard = variant.guard
    return filled_table(name, p, m, caps, None if guard is None else
                        (cost, 0.0 if transfer is None else transfer, *guard))


def best_paired(base: Schedule, peaks: Sequence[int], cost: dict[str, float] | None,
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
        caps = paired_caps(peaks, m * v, doubled)
        for q in PAIR_QUORUMS:
            variant = _PairedVariant(False, doubled, q)
            try:
                candidates.append((build_variant(base.name, p, m, v, caps, variant, cost,
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
    lanes = filled_variants(base.name, p, m, v, paired_caps(peaks, m * v, True), cost, timed)
    return min([(table, variant), *lanes],
               key=lambda c: (*_pairing_key(c[0], cost, timed)[:1], *_pairing_key(c[0], cost)))


# (share, late) guards `make_schedule` tries for a filled table (see `list_schedule`'s
# `guard`); None: no guard. At the zero-bubble paper's costs no one setting is best on every
# row (ZB-H1 at p = 8 likes the guard everywhere, ZB-V at p = 24 only in the cool-down).
FILL_GUARDS: tuple[tuple[float, bool] | None, ...] = (None, (0.0, False), (0.5, False),
                                                      (0.5, True))


def filled_variants(name: str, p: int, m: int, v: int, caps: Sequence[int],
                    cost: dict[str, float] | None,
                    transfer: float) -> list[tuple[Schedule, _PairedVariant]]:
    """`[(table, variant)]`: of the :data:`FILL_GUARDS` filled tables of `name` at `p`
    stages, `m` microbatches and `v` chunks per stage, the one with the least executed
    bubble; `[]` if every one deadlocks."""
    tables = []
    for guard in FILL_GUARDS:
        variant = _PairedVariant(True, True, guard=guard)
        try:
            tables.append((build_variant(name, p, m, v, caps, variant, cost, transfer),
                           variant))
        except RuntimeError:  # pragma: no cover - the greedy has not deadlocked so far
            continue
    unit = cost or UNIT_COST
    return sorted(tables, key=lambda c: round(executed_bubble(c[0], unit, transfer), 9))[:1]


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
    (:func:`list_schedule`), starting from `start` everywhere; each step re-draws one to
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
    first = build(name, stages, microbatches, virtual_stages, 1, True, caps, (start,))
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
            table = build(name, stages, microbatches, virtual_stages, 1, True, caps,
                          tuple(trial))
        except RuntimeError:  # this pairing deadlocks the greedy: keep the last table
            continue
        trial_key = _pairing_key(table, cost, transfer)
        if trial_key <= key:
            best, key = table, trial_key
            shares = (trial + [trial[-1]] * table.ticks)[:max(table.ticks, 1)]
            weights = draw_weights(table)
    return best
