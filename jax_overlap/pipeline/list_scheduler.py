"""The lockstep list scheduler every schedule table comes from.

An action is *ready* when its dependencies finished at an earlier tick and, for an ``F``, the
stage holds fewer activations than its cap. Each tick every stage either runs its
highest-priority ready action (greedy: GPipe, 1F1B, ZB-V) or runs its program strictly
in order, idling until the next action is ready (Megatron interleaved and ZB-H1, which
their papers define as per-stage programs). A schedule is therefore just a priority
(or program) plus a cap (:class:`Policy`): any ``p, m`` works and every table meets the
dependencies by construction. The named schedules are in
:mod:`jax_overlap.pipeline.generators`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Sequence

from jax_overlap.pipeline.table import KINDS, Action, Cell, Pair, Schedule, Task
from jax_overlap.pipeline.ticks import action_cost


@dataclass(frozen=True)
class Policy:
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


# Priorities that depend on the task alone, by name (`Policy.rank`): the kind (B, then F, then
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
                    keyed.append(((KIND_RANK[kind], mb, -vs if late else 0, kind, vs),
                                  (vs * microbatches + mb) * 3 + kid))
        keyed.sort()
        order.append(tuple(tid for _, tid in keyed))
    return tuple(order)


def list_schedule(
    name: str,
    stages: int,
    microbatches: int,
    placement: tuple[tuple[int, int], ...],
    split_backward: bool,
    policy: Policy,
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
    """`list_schedule`'s state: ranked tasks, ready heaps, arrival and finish ticks, and the
    table rows built so far; one method per step of a tick."""

    def __init__(self, name: str, stages: int, microbatches: int,
                 placement: tuple[tuple[int, int], ...], split_backward: bool, policy: Policy,
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

    def _ranked(self, policy: Policy, kinds: tuple[str, ...]) -> list[list[int]]:
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


def program_policy(programs: Sequence[Sequence[Task]]) -> Policy:
    """An in-order policy that runs ``programs[stage]`` front to back."""
    return Policy(  # the scheduler runs `programs` as they are; `priority` says the same
        priority=lambda t, d: (programs[d].index(t),),
        cap=lambda d: len(programs[d]),
        in_order=True,
        programs=programs,
    )


def capped(policy: Policy, caps: Sequence[int] | None) -> Policy:
    """``policy`` with per-stage activation caps replaced by ``caps`` (None: unchanged)."""
    if caps is None:
        return policy
    return Policy(policy.priority, lambda d: caps[d], policy.in_order, policy.programs,
                  policy.rank)


KIND_RANK = {"B": 0, "F": 1, "W": 2}
