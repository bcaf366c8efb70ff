"""A pipeline schedule compiled into the int tables the executor indexes.

`compile_program` turns a schedule table (`jax_overlap.pipeline.table`) into small int
tables -- per tick, per stage: which branch (idle, or F/B/W of the first / a middle / the last
virtual stage), microbatch, chunk, which stash slots the action reads, and which slots this
tick's arrivals are filed into. Slots are assigned statically from the table's lifetimes
(greedy interval colouring), so a stage holds `peak live (microbatch, chunk) tensors` slots,
not `microbatches x chunks`. Pure numpy: no JAX.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from jax_overlap.pipeline.table import Schedule, Task, dependency_gap
from jax_overlap.pipeline.ticks import cell_lanes, tick_transfers
from jax_overlap.pipeline.validate import validate

IDLE = 0  # branch 0 of every program
KIND_ORDER = ("F", "B", "W")
ROLE_ORDER = ("first", "mid", "last")
# Columns of the per-(tick, stage) table.
FIELDS = ("branch", "microbatch", "chunk", "x_slot", "g_slot", "file_down", "file_up",
          "file_self", "r_slot", "e_slot", "z_slot", "head_mb", "head_slot",
          "file_urgent_down", "file_urgent_up", "file_slack_down", "file_slack_up", "ring_pattern")
COL = {name: i for i, name in enumerate(FIELDS)}
# Named scopes the executor puts around each lane's action switches (`pp_lane0`, `pp_lane1`:
# both indexed by the table's branch) and the head phase; the compiled conditionals keep them
# in their `op_name`, which is how `jax_overlap.analysis.step_estimate` finds the switches to
# replay the table on.
LANE_SCOPE = "pp_lane"
HEAD_SCOPE = "pp_head"
# Around the step's last tick where it runs after the loop (`tick_loop.DeferredEmbedding`): its
# switches take the last row of the table, the loop's the others
# (`analysis.analyze.switch_weights`).
LAST_TICK_SCOPE = "pp_last_tick"
# Around the switch over an unpaired accelerator tick's ring patterns (`TickProgram.patterns`):
# `analysis.step_estimate` weights its branches by the table's `ring_pattern` column.
RING_SCOPE = "pp_rings"
# Around each loop over a span of the table's ticks (`TickSpan`): `pp_ticks{start}_{stop}`.
SPAN_SCOPE = "pp_ticks"
RESIDUAL_POOLS = ("first", "chunk", "last", "dz")
ROUTES = ("down", "up", "self")


class TickSpan(NamedTuple):
    """A run of ticks `[start, stop)` the executor compiles as one loop, with only the parts
    of a tick that one of them uses (`TickProgram.spans`). Flags per lane:

    Attributes:
      acts: some stage runs an action in the lane.
      sends: what the lane's actions make at one of these ticks arrives somewhere.
      receives: what the lane's actions made at the tick before one of these arrives.
      head: a vocabulary-parallel head phase at one of these ticks.
      head_before: one at the tick before one of these (a paired tick sums its gradient
        over pp at the next tick).
    """

    start: int
    stop: int
    acts: tuple[bool, ...]
    sends: tuple[bool, ...]
    receives: tuple[bool, ...]
    head: bool
    head_before: bool

    @classmethod
    def every(cls, start: int, stop: int, lanes: int) -> "TickSpan":
        """Ticks `[start, stop)` running every part of a tick."""
        return cls(start, stop, (True,) * lanes, (True,) * lanes, (True,) * lanes, True, True)


# A span is split off the table's ends only if it has at least this many ticks: each span is
# one more loop body to compile.
MIN_SPAN_TICKS = 2


class Branch(NamedTuple):
    """What one `lax.switch` branch runs.

    Attributes:
      kind: 'F', 'B' or 'W'.
      role: 'first' (virtual stage 0: embeds), 'last' (head and loss) or 'mid'.
      sync: the action that completes its chunk's weight gradients on this stage (the last
        microbatch's B, or W when split) and, with in-loop buckets, reduces them over dp
        inside its backward, layer by layer.
    """

    kind: str
    role: str
    sync: bool = False


@dataclass(frozen=True)
class TickProgram:
    """A schedule compiled into the int tables the executor indexes.

    Attributes:
      schedule: the schedule it was compiled from.
      branches: the `Branch` of branch 1, 2, ...; branch 0 is idle.
      table: int32 `(ticks, stages, lanes, len(FIELDS))`; unused slot columns hold `trash`.
        One lane per action a stage runs in a tick: 1, or 2 for a paired schedule (lane 0
        a pair's first action, F or W; lane 1 its second, B or W). A lane's `file_*`
        columns say where the arrivals sent by the neighbours' same lane go.
      slots: stash slots per stage; the pool has `slots + 1` entries, the last (`trash`)
        absorbs writes of arrivals that carry nothing.
      down_pairs: `(src, dst)` pairs of the +1 ring that carry data at some tick.
      up_pairs: same for the -1 ring.
      local_handoff: whether an output is consumed on the stage that produced it (ZB-V).
      res_slots: residual slots per pool: what an F keeps for its backward (`jax.vjp`
        residuals under the remat policy) lives from the F's tick to its last backward
        action's, the chunk's in slot `r_slot` of the "chunk" pool, the embedding's (virtual
        stage 0) and the head's (the last) in slot `e_slot` of the "first" / "last" pool.
        With a split backward, each weight matmul's output gradient lives from B to W in
        slot `z_slot` of the "dz" pool (so W is only the weight-gradient matmuls).
      lane_rings: per lane, `(down_pairs, up_pairs, local_handoff)` of what that lane's
        actions send (a paired 1F1B's forwards use only the +1 ring, its backwards only -1).
      vocab_parallel: the head runs vocabulary-parallel on every stage (`pipeline.
        vocab_parallel`). The last virtual stage is then a middle one: its F's output goes to
        the head phase, and its B reads its output gradient from slot `g_slot`. At a tick
        where that F runs, every stage's lane-0 row holds `head_mb` = its microbatch + 1 (0
        elsewhere): after the forward lane (a paired tick: after the backward lane), all
        stages run the head phase together (the hidden state broadcast over pp, each stage's
        share of the logits and loss, the hidden state's gradient summed over pp), and the
        stage that ran the F files that gradient into its slot `head_slot` (`trash` on the
        others) before its B can read it (a paired tick files it at the next tick, before
        the backward lane; a fused one at the same tick, after its switch).
      fused: a paired table's two lanes run as one switch over the (lane 0, lane 1) branch
        pairs the table takes (`lane_pairs`), so each lane's collectives (tensor- or
        expert-parallel) can run under the other lane's GEMMs; the ring transfers then run
        between ticks. Unfused, each lane is its own switch and the transfers run under the
        other lane (`pipeline.fused_pairs`).
      patterns: an unpaired table at latency 1, as an accelerator runs it (`tick_rings`):
        the distinct `(down pairs, up pairs)` of the transfers a tick sends on its own
        permutes (`ticks.tick_transfers`: those read at the next tick, and the others unless
        the slack ring takes them), `ring_pattern` (the same on every stage's row) indexing
        them. Each tick's permutes then meet only the stages that trade data at that tick;
        their arrivals are filed at the start of the next (`file_urgent_down` / `file_urgent_up`).
        Empty for every other table.
      slack_pairs: `(down pairs, up pairs)` of the slack ring: transfers read two or more
        ticks after they were sent, where a ring for them pays. The accelerator sends them
        at the top of the next tick, under its action, and files them after it
        (`file_slack_down` / `file_slack_up`).
    """

    schedule: Schedule
    branches: tuple[Branch, ...]
    table: np.ndarray
    slots: int
    down_pairs: tuple[tuple[int, int], ...]
    up_pairs: tuple[tuple[int, int], ...]
    local_handoff: bool
    res_slots: tuple[tuple[str, int], ...] = ()
    lane_rings: tuple[tuple[tuple, tuple, bool], ...] = ()
    vocab_parallel: bool = False
    fused: bool = False
    patterns: tuple[tuple[tuple, tuple], ...] = ()
    slack_pairs: tuple[tuple, tuple] = ((), ())

    @property
    def ticks(self) -> int:
        return self.table.shape[0]

    @property
    def trash(self) -> int:
        return self.slots

    @property
    def lanes(self) -> int:
        """Actions per stage per tick: 2 for a paired schedule, else 1."""
        return self.table.shape[2]

    @property
    def tick_rings(self) -> bool:
        """Whether the program has per-tick rings (`patterns`): an unpaired table at latency 1
        with a transfer."""
        return bool(self.patterns)

    @property
    def skewed(self) -> bool:
        """Whether each tick sends the previous tick's output (`transfer_latency` 2)."""
        return self.schedule.transfer_latency == 2

    def column(self, name: str) -> np.ndarray:
        """One field of the table, `(ticks, stages, lanes)`."""
        return self.table[:, :, :, COL[name]]

    @functools.cached_property
    def lane_pairs(self) -> tuple[tuple[tuple[int, int], ...], np.ndarray]:
        """(the distinct (lane 0, lane 1) branch pairs of a paired table, sorted; int
        `(ticks, stages)` the index of each entry's pair): a fused program's one switch."""
        branch = self.column("branch")
        pairs = tuple(sorted({(int(a), int(b)) for a, b in branch.reshape(-1, 2)}))
        index = np.zeros(branch.shape[:2], np.int32)
        for i, pair in enumerate(pairs):
            index[(branch == pair).all(axis=-1)] = i
        return pairs, index

    def switch_table(self) -> np.ndarray:
        """int `(ticks, stages, switches)`: the branch each of a tick's switches takes -- one
        switch per lane, indexed by the table's branch; fused, one indexed by `lane_pairs`."""
        if self.fused:
            return self.lane_pairs[1][..., None]
        return self.column("branch")

    def switch_names(self) -> tuple[str, ...]:
        """A label per branch of the switches (`idle`, `F first`, `B mid sync`; fused,
        `F first + B first`...)."""
        names = ("idle",) + tuple(f"{b.kind} {b.role}{' sync' if b.sync else ''}"
                                  for b in self.branches)
        if not self.fused:
            return names
        return tuple(" + ".join(names[b] for b in pair if b) or "idle"
                     for pair in self.lane_pairs[0])

    def fills(self, pool: str) -> tuple[bool, ...]:
        """Per switch branch (idle first), whether it fills its slot of a residual pool: an
        F the chunk's pool and, on the first / last virtual stage, the embedding's /
        head's; a split B (but a sync one, whose W is the whole backward) the "dz" pool of
        its weight matmuls' output gradients."""
        if pool == "dz":
            return (False,) + tuple(b.kind == "B" and not b.sync for b in self.branches)
        return (False,) + tuple(b.kind == "F" and pool in ("chunk", b.role)
                                for b in self.branches)

    def residual_slots(self, pool: str) -> int:
        """Slots of a residual pool ("chunk", "first", "last"); at least 1."""
        return max(1, dict(self.res_slots).get(pool, 0))

    @functools.cached_property
    def tick_parts(self) -> np.ndarray:
        """bool `(ticks, 3 lanes + 2)`: per tick, the `TickSpan` flags of that tick alone
        (acts, sends, receives per lane, head, head before), at latency 1."""
        lanes, ticks = self.lanes, self.ticks
        files = self.table[..., [COL["file_down"], COL["file_up"], COL["file_self"]]]
        arrives = (files != self.trash).any(axis=(1, 3))  # (ticks, lanes): filed at t
        sends = np.zeros((ticks, lanes), bool)
        sends[:-1] = arrives[1:]  # latency 1: what t makes is filed at t + 1
        head = (self.column("head_mb")[:, 0, 0] > 0) if self.vocab_parallel \
            else np.zeros(ticks, bool)
        head_before = np.concatenate([[False], head[:-1]])
        acts = (self.column("branch") != IDLE).any(axis=1)
        return np.concatenate([acts, sends, arrives, head[:, None], head_before[:, None]],
                              axis=1)

    def spans(self, stop: int | None = None) -> tuple[TickSpan, ...]:
        """The ticks `[0, stop)` as at most three `TickSpan`s -- the fill, the steady state and
        the drain -- so that a loop over the fill runs no backward lane, no backward ring
        and no head, and one over the drain no forward ring: a collective that would only
        carry zeros is not compiled into that loop. The two cuts are the ones that leave
        the fewest (tick, part) units run in all, each end span at least `MIN_SPAN_TICKS`
        long. One span, every part, at a transfer latency other than 1."""
        stop = self.ticks if stop is None else stop
        if self.skewed or stop < 1:
            return (TickSpan.every(0, stop, self.lanes),)
        parts = self.tick_parts[:stop]
        seen = np.cumsum(parts, axis=0)  # (ticks, parts): uses up to and including t

        def used(a: int, b: int) -> np.ndarray:  # which parts ticks [a, b) use
            return (seen[b - 1] - (seen[a - 1] if a else 0)) > 0

        # Between two ticks that add a part to what the fill (from the start) or the drain
        # (from the end) uses, a span's parts are the same: its best cut is at one end.
        grows = [t for t in range(1, stop) if (parts[t] & ~used(0, t)).any()]
        shrinks = [t for t in range(1, stop) if (parts[t - 1] & ~used(t, stop)).any()]
        firsts = sorted({0, *grows, *(t + 1 for t in grows if t + 1 < stop)})
        lasts = sorted({stop, *shrinks, *(t - 1 for t in shrinks if t > 1)})
        best = None
        for a in firsts:
            for b in lasts:
                if b < a or 0 < a < MIN_SPAN_TICKS or 0 < stop - b < MIN_SPAN_TICKS:
                    continue
                cuts = (0, a, b, stop)
                runs = [(x, y) for x, y in zip(cuts, cuts[1:]) if y > x]
                cost = sum((y - x) * used(x, y).sum() for x, y in runs)
                if best is None or cost < best[0]:
                    best = (cost, runs)
        lanes = self.lanes
        out = []
        for x, y in best[1]:
            u = used(x, y).tolist()
            out.append(TickSpan(x, y, tuple(u[:lanes]), tuple(u[lanes:2 * lanes]),
                                tuple(u[2 * lanes:3 * lanes]), u[-2], u[-1]))
        return tuple(out)

    def idle_fraction(self) -> float:
        """Idle stage-ticks / (stages x ticks) of the table the executor runs, with each
        action one unit and a tick as long as its busiest stage (2 units where one pairs, at
        least 1: a tick where every stage idles still runs)."""
        busy = (self.column("branch") != IDLE).sum(axis=2)  # (ticks, stages)
        width = np.maximum(busy.max(axis=1, initial=0), 1)  # an all-idle tick still runs
        total = width.sum() * busy.shape[1]
        return float((total - busy.sum()) / total) if total else 0.0


def _role(virtual_stage: int, num_virtual_stages: int, vocab_parallel: bool = False) -> str:
    if virtual_stage == 0:
        return "first"
    last = virtual_stage == num_virtual_stages - 1 and not vocab_parallel
    return "last" if last else "mid"


def _route(src: int, dst: int, stages: int) -> str:
    """Which ring a message from stage `src` to `dst` travels on."""
    delta = (dst - src) % stages
    if delta == 0:
        return "self"
    if delta == 1:  # checked first: with 2 stages +1 and -1 are the same neighbour
        return "down"
    if delta == stages - 1:
        return "up"
    raise ValueError(f"schedule placement sends from stage {src} to stage {dst}, which is not a "
                     f"neighbour on the pp ring; the executor only moves data by +-1 stage")


def _allocate(intervals: list[tuple[int, int, Any]]) -> tuple[dict[Any, int], int]:
    """Greedy interval colouring: a slot is reused once its last reader's tick has passed.

    Args:
      intervals: `(first tick, last tick, key)`, inclusive; a value filed at the start of
        tick t may reuse a slot whose last read was at tick t-1 or earlier.

    Returns:
      (key -> slot, number of slots).
    """
    slot_of: dict[Any, int] = {}
    busy_until: list[int] = []
    for start, end, key in sorted(intervals, key=lambda iv: (iv[0], iv[1], repr(iv[2]))):
        free = [i for i, until in enumerate(busy_until) if until < start]
        slot = free[0] if free else len(busy_until)
        if slot == len(busy_until):
            busy_until.append(end)
        else:
            busy_until[slot] = end
        slot_of[key] = slot
    return slot_of, len(busy_until)


def _messages(s: Schedule, tick_of: dict[Task, int], vocab_parallel: bool = False):
    """Every transfer of a step: when and where it arrives, its ring, how long it is kept.

    ('x', mb, vs) is the input of virtual stage vs, sent by F(mb, vs-1); ('g', mb, vs) is the
    gradient of vs's output, sent by B(mb, vs+1) (the last virtual stage's, under a
    vocabulary-parallel head, filed by the head phase of F(mb, vs)'s tick). Each becomes
    readable `transfer_latency` ticks after it was sent (the next tick on the same stage) and
    stays in a slot of its receiver until the last backward action of (mb, vs) -- B, or W
    when split -- has read it.

    Returns:
      (arrivals: (tick, stage, route, sender's lane) -> key, per-stage lifetimes
       [(first, last, key)], (route, sender's lane) -> set of (src, dst) stage pairs used).
    """
    p, n_vs = s.stages, s.stages * s.virtual_stages
    last_kind = "W" if s.split_backward else "B"
    arrivals: dict[tuple[int, int, str], tuple] = {}
    lifetimes: list[list] = [[] for _ in range(p)]
    pairs: dict[tuple[str, int], set] = {(route, lane): set() for route in ROUTES
                                         for lane in (0, 1)}
    for (kind, mb, vs), t in tick_of.items():
        if vocab_parallel and kind == "F" and vs == n_vs - 1:
            # Filed by the head phase of the F's tick (a paired tick's at the next tick,
            # before the backward lane; the F's B runs a tick later at the earliest): the
            # slot is taken from t on.
            dst = s.placement[vs][0]
            lifetimes[dst].append((t, tick_of[Task(last_kind, mb, vs)], ("g", mb, vs)))
            continue
        if kind == "F" and vs < n_vs - 1:
            key, target = ("x", mb, vs + 1), vs + 1
        elif kind == "B" and vs > 0:
            key, target = ("g", mb, vs - 1), vs - 1
        else:
            continue
        src, dst = s.placement[vs][0], s.placement[target][0]
        route, lane = _route(src, dst, p), lane_of(kind, s)
        pairs[(route, lane)].add((src, dst))
        readable = t + dependency_gap(src, dst, s.transfer_latency)
        arrivals[(readable, dst, route, lane)] = key
        lifetimes[dst].append((readable, tick_of[Task(last_kind, mb, target)], key))
    return arrivals, lifetimes, pairs


def lane_of(kind: str, schedule: Schedule) -> int:
    """The lane an action that sends runs in: paired tables run forwards in lane 0 and B's in
    lane 1 (a W, which sends nothing, runs in its pair position: see `action_lanes`); unpaired
    ones have the one lane."""
    return int(schedule.paired and kind != "F")


def action_lanes(schedule: Schedule) -> dict[tuple[int, Any], int]:
    """(stage, action) -> the lane it runs in: a pair's first action (F or W) in lane 0, its
    second (B or W) in lane 1; a lone action in `lane_of`'s."""
    return {(d, a): lane for d, row in enumerate(schedule.grid) for cell in row
            for lane, a in cell_lanes(cell, schedule.paired)}


def _residual_lifetimes(s: Schedule, tick_of: dict[Task, int], vocab_parallel: bool = False
                        ) -> dict[tuple[int, str], list]:
    """Per (stage, pool), `(F tick, last backward tick, key)` of every (microbatch, chunk):
    how long what the F keeps for its backward stays on the stage. Every F fills a slot of
    the "chunk" pool; virtual stage 0's also one of "first", the last one's one of "last"."""
    n_vs = s.stages * s.virtual_stages
    last_kind = "W" if s.split_backward else "B"
    out: dict[tuple[int, str], list] = {}
    for (kind, mb, vs), t in tick_of.items():
        if kind == "F":
            d, life = s.placement[vs][0], (t, tick_of[Task(last_kind, mb, vs)], ("r", mb, vs))
            out.setdefault((d, "chunk"), []).append(life)
            role = _role(vs, n_vs, vocab_parallel)
            if role != "mid":
                out.setdefault((d, role), []).append(life)
        elif kind == "B" and s.split_backward:
            d = s.placement[vs][0]
            out.setdefault((d, "dz"), []).append((t, tick_of[Task("W", mb, vs)], ("z", mb, vs)))
    return out


def _sync_actions(s: Schedule, tick_of: dict[Task, int]) -> set[Task]:
    """Per (stage, chunk), the last action that adds weight gradients (B, or W when split)."""
    kind = "W" if s.split_backward else "B"
    last: dict[int, Task] = {}
    for task, t in tick_of.items():
        if task.kind == kind and (task.virtual_stage not in last
                                  or t > tick_of[last[task.virtual_stage]]):
            last[task.virtual_stage] = task
    return set(last.values())


def compile_program(schedule: Schedule, sync_in_loop: bool = False,
                    vocab_parallel: bool = False, fused: bool = False) -> TickProgram:
    """Turns a schedule table into the executor's int tables.

    Args:
      schedule: a valid schedule (checked with `validate`).
      sync_in_loop: give each chunk's last weight-gradient action its own branch
        (`Branch.sync`), where the executor reduces the chunk's gradients over dp.
      vocab_parallel: run the head vocabulary-parallel on every stage (see `TickProgram`).
      fused: run a paired table's lanes as one switch (see `TickProgram`); ignored unpaired.

    Returns:
      The `TickProgram`.

    Raises:
      ScheduleError: if the table is not valid; ValueError if the placement needs a
        transfer between non-neighbouring stages.
    """
    validate(schedule)
    s = schedule
    if s.paired and s.transfer_latency != 1:
        raise ValueError("pipeline.transfer_latency: paired ticks run at latency 1 (each "
                         "transfer hides under the tick's other action); set it to 1")
    p, n_vs = s.stages, s.stages * s.virtual_stages
    lanes = s.lanes
    tick_of = {s.task(d, a): t for d, t, a in s.actions()}
    arrivals, lifetimes, pairs = _messages(s, tick_of, vocab_parallel)
    slot_of: dict[tuple[int, tuple], int] = {}
    slots = 0
    for d in range(p):
        assigned, used = _allocate(lifetimes[d])
        slot_of.update({(d, key): slot for key, slot in assigned.items()})
        slots = max(slots, used)
    trash = slots

    res_slot: dict[tuple[int, str, tuple], int] = {}
    res_slots: dict[str, int] = {}
    for (d, pool), intervals in sorted(_residual_lifetimes(s, tick_of, vocab_parallel).items()):
        assigned, used = _allocate(intervals)
        res_slot.update({(d, pool, key): slot for key, slot in assigned.items()})
        res_slots[pool] = max(res_slots.get(pool, 0), used)

    roles = {(d, a): _role(s.virtual_stage(d, a.chunk), n_vs, vocab_parallel)
             for d, _, a in s.actions()}
    syncs = _sync_actions(s, tick_of) if sync_in_loop else set()
    branch_of = {(d, a): Branch(a.kind, role, s.task(d, a) in syncs)
                 for (d, a), role in roles.items()}
    used = set(branch_of.values())
    branches = tuple(b for k in KIND_ORDER for r in ROLE_ORDER for sync in (False, True)
                     if (b := Branch(k, r, sync)) in used)
    branch_id = {b: i + 1 for i, b in enumerate(branches)}
    table = np.full((s.ticks, p, lanes, len(FIELDS)), trash, np.int32)
    table[..., [COL["branch"], COL["microbatch"], COL["chunk"], COL["r_slot"],
                COL["e_slot"], COL["z_slot"], COL["head_mb"], COL["ring_pattern"]]] = 0  # idle
    lane_at = action_lanes(s)
    for (d, a), role in roles.items():
        entry = table[tick_of[s.task(d, a)], d, lane_at[(d, a)]]
        vs = s.virtual_stage(d, a.chunk)
        entry[COL["branch"]] = branch_id[branch_of[(d, a)]]
        entry[COL["microbatch"]], entry[COL["chunk"]] = a.microbatch, a.chunk
        entry[COL["x_slot"]] = slot_of.get((d, ("x", a.microbatch, vs)), trash)
        entry[COL["g_slot"]] = slot_of.get((d, ("g", a.microbatch, vs)), trash)
        key = ("r", a.microbatch, vs)
        entry[COL["r_slot"]] = res_slot[(d, "chunk", key)]
        entry[COL["e_slot"]] = res_slot.get((d, role, key), 0)
        entry[COL["z_slot"]] = res_slot.get((d, "dz", ("z", a.microbatch, vs)), 0)
    for (t, d, route, lane), key in arrivals.items():
        table[t, d, lane, COL["file_" + route]] = slot_of[(d, key)]
    patterns, slack_pairs = (), ((), ())
    if lanes == 1 and s.transfer_latency == 1:
        patterns, slack_pairs = _tick_rings(s, arrivals, slot_of, table)
    if vocab_parallel:
        for (kind, mb, vs), t in tick_of.items():
            if kind == "F" and vs == n_vs - 1:
                d = s.placement[vs][0]
                table[t, :, 0, COL["head_mb"]] = mb + 1
                table[t, d, 0, COL["head_slot"]] = slot_of[(d, ("g", mb, vs))]
    def used(route, lanes_):
        return tuple(sorted(set().union(*(pairs[(route, lane)] for lane in lanes_))))

    lane_rings = tuple((used("down", (lane,)), used("up", (lane,)), bool(used("self", (lane,))))
                       for lane in range(lanes))
    return TickProgram(s, branches, table, slots, used("down", (0, 1)), used("up", (0, 1)),
                       bool(used("self", (0, 1))), tuple(sorted(res_slots.items())), lane_rings,
                       vocab_parallel, fused and lanes == 2, patterns, slack_pairs)


def _tick_rings(s: Schedule, arrivals: dict, slot_of: dict, table: np.ndarray
                ) -> tuple[tuple, tuple]:
    """An unpaired latency-1 table's per-tick rings (`TickProgram.patterns`): fills the
    `urgent_*`, `slack_*` and `ring_pattern` columns of `table` in place.

    A transfer sent at tick t on its tick's own permute (`ticks.tick_transfers`: read at t + 1,
    or later where the slack ring does not pay) is filed at the start of t + 1; one on the
    slack ring travels at the top of t + 1, under that tick's action, and is filed at its end
    (its slot is the receiver's from t + 1 on either way).

    Returns:
      (the distinct (down pairs, up pairs) of the ticks' own permutes, (down pairs, up pairs)
      of the slack ring).
    """
    p = s.stages
    urgent, slack = tick_transfers(s)
    if not any(urgent) and not slack:
        return (), ((), ())
    sent_now = [set(pairs) for pairs in urgent]
    for (t, d, route, _), key in arrivals.items():
        if route == "self":
            continue
        src = (d - 1) % p if route == "down" else (d + 1) % p
        kind = "urgent_" if (src, d) in sent_now[t - 1] else "slack_"
        table[t, d, 0, COL["file_" + kind + route]] = slot_of[(d, key)]

    def rings(pairs) -> tuple[tuple, tuple]:
        return tuple(tuple(sorted(x for x in pairs if _route(*x, p) == route))
                     for route in ("down", "up"))

    patterns: dict[tuple, int] = {}
    for t, pairs in enumerate(urgent):
        table[t, :, 0, COL["ring_pattern"]] = patterns.setdefault(rings(pairs), len(patterns))
    return tuple(patterns), rings(slack)
