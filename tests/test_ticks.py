"""The executor's tick timing at given action and transfer costs (`schedule --costs`), and
schedules at real pipeline sizes."""

import dataclasses
import json
import time

import numpy as np
import pytest

from helpers import run_cli
from jax_overlap.hardware.machine import AxisLink, HardwareProfile, Link
from jax_overlap.analysis.simulate import Costs, Plan, simulate
from jax_overlap.pipeline.program import compile_program
from jax_overlap.pipeline.schedules import (
    Action,
    Pair,
    Schedule,
    bubble_fraction,
    linear_placement,
    make_schedule,
    schedule_command,
)
from jax_overlap.pipeline import ticks
from jax_overlap.pipeline.ticks import (executed_bubble, lane_partners, tick_clocks,
                                        tick_transfers)
from jax_overlap.pipeline.validate import validate

PAPER_1P5B = {"F": 18.5, "B": 18.1, "W": 9.3}  # zero-bubble paper, Table 9, ms


def _hw() -> HardwareProfile:
    """A pp link whose transfer of `act_bytes` bytes takes `act_bytes` seconds."""
    link = Link("l", 1.0, 0.0)
    return HardwareProfile("t", "", "chip", 1e12, 1e12, 8, 1, {"l": link},
                           {a: AxisLink("l", False) for a in ("dp", "pp", "tp")})


CASES = [("1f1b", 4, 8, 1, False), ("zb-h1", 4, 8, 1, False), ("zb-h1", 4, 8, 1, True),
         ("zb-v", 4, 8, 2, False), ("zb-v", 4, 8, 2, True), ("interleaved", 4, 8, 2, False),
         ("zb-h1", 4, 8, 1, "filled"), ("zb-v", 4, 8, 2, "filled")]


def _table(name, p, m, v, paired):
    """The case's table; "filled": the paired table chosen at the paper's costs, whose lanes
    are positions (W's in lane 0 too)."""
    if paired != "filled":
        return make_schedule(name, p, m, v, 1, paired)
    s = make_schedule(name, p, m, v, 1, True, PAPER_1P5B, 0, 0.6)
    assert any(isinstance(c, Pair) and c.forward.kind == "W" for row in s.grid for c in row)
    return s


def test_a_pairs_lanes_are_its_positions():
    """By hand: a W first in a pair runs in lane 0 (before the B beside it), a lone W in lane
    1; each lane ends at its work or at the partners' start plus the transfer."""
    F, B, W = Action("F", 0), Action("B", 0), Action("W", 0)
    F1, B1, W1 = Action("F", 1), Action("B", 1), Action("W", 1)
    s = Schedule("hand", 2, 2, 1, True, linear_placement(2), (
        (F, F1, None, B, Pair(W, B1), W1),
        (None, F, Pair(F1, B), Pair(W, B1), W1, None)))
    validate(s)
    assert lane_partners(s) == ((frozenset({1}), frozenset({0})),) * 2
    cost = {"F": 2.0, "B": 3.0, "W": 1.0}
    assert tick_clocks(s, cost, 0.5) == pytest.approx([19.0, 18.5])  # worked out by hand
    assert executed_bubble(s, cost, 0.5) == pytest.approx((2 * 19 - 24) / 38)


@pytest.mark.parametrize("name,p,m,v,paired", CASES)
def test_executed_bubble_is_the_simulators_tick_timing(name, p, m, v, paired):
    """One implementation: the bare tick timing ends every stage where the simulator's
    `timing="ticks"` does, for the same action and transfer costs."""
    s = _table(name, p, m, v, paired)
    costs = Costs.uniform(p * v, 1.3, 1.7, 0.6, act_bytes=0.25)
    sim = simulate(Plan(s), costs, _hw(), timing="ticks")
    ends = tick_clocks(s, {"F": 1.3, "B": 1.7, "W": 0.6}, 0.25)
    assert max(ends) == pytest.approx(sim.step_time_s, rel=1e-12)
    work = sum(1.3 if a.kind == "F" else 1.7 if a.kind == "B" else 0.6
               for _, _, a in s.actions()) + (0 if s.split_backward else 0.6 * m * p * v)
    assert executed_bubble(s, {"F": 1.3, "B": 1.7, "W": 0.6}, 0.25) == pytest.approx(
        1 - work / (p * max(ends)))


def test_equal_costs_without_transfer_give_the_tables_bubble():
    for name, p, m, v in [("1f1b", 4, 8, 1), ("zb-h1", 4, 8, 1), ("zb-v", 4, 8, 2)]:
        s = make_schedule(name, p, m, v)
        one = {"F": 1.0, "B": 1.0, "W": 1.0}
        if s.split_backward:
            assert executed_bubble(s, one, 0.0) == pytest.approx(bubble_fraction(s))
        # Unpaired, a tick pays at most one transfer, and only where it carries one.
        longest = 1.0 if s.split_backward else 2.0  # a B that also does the W
        assert max(tick_clocks(s, one, 0.5)) <= s.ticks * (longest + 0.5) + 1e-9


def test_unpaired_ticks_meet_only_where_data_moves():
    """By hand: an unpaired latency-1 table's transfers meet only the two stages that trade
    them, after the action (GPU, `TickProgram.patterns`). One read two ticks later may go on
    the slack ring instead, in flight under the next tick's action: here that gains under
    `SLACK_RING_GAIN` at the nominal costs, so the program leaves it on its tick's permute."""
    F0, F1, B0, B1, W0, W1 = (Action(k, mb) for k, mb in
                              (("F", 0), ("F", 1), ("B", 0), ("B", 1), ("W", 0), ("W", 1)))
    s = Schedule("hand", 2, 2, 1, True, linear_placement(2), (
        (F0, F1, None, B0, None, B1, W0, W1),
        (None, F0, B0, F1, B1, W0, W1, None)))
    validate(s)
    cost = {"F": 2.0, "B": 3.0, "W": 1.0}
    # F1's output (tick 1) is read at tick 3: slack; the others at the next tick.
    urgent, slack = tick_transfers(s, slack_ring=True)
    assert urgent == [[(0, 1)], [], [(1, 0)], [], [(1, 0)], [], [], []]
    assert slack == {(0, 1)}
    work = ticks._lane_work(s, cost)[0][0]
    assert ticks._rendezvous_run(work, 0.5, urgent, slack) == pytest.approx([18.5, 18.0])
    # Without the ring (what pays here), tick 1's transfer waits for both F's.
    assert tick_transfers(s) == ([[(0, 1)], [(0, 1)], [(1, 0)], [], [(1, 0)], [], [], []],
                                 frozenset())
    assert tick_clocks(s, cost, 0.5) == pytest.approx([19.0, 16.0])  # worked out by hand
    assert executed_bubble(s, cost, 0.5) == pytest.approx((2 * 19 - 24) / 38)
    sim = simulate(Plan(s), Costs.uniform(2, 2.0, 3.0, 1.0, act_bytes=0.5), _hw(),
                   timing="ticks")
    assert sim.step_time_s == pytest.approx(19.0)
    program = compile_program(s)
    assert program.tick_rings and program.slack_pairs == ((), ())
    # Two stages: both neighbours are +1, one ring.
    assert [program.patterns[i] for i in program.column("ring_pattern")[:, 0, 0]] == [
        (tuple(u), ()) for u in tick_transfers(s)[0]]


def test_the_slack_ring_runs_where_it_pays():
    """ZB-H1 and interleaved tables read many transfers two or more ticks after they were
    sent and run a slack ring; 1F1B and ZB-V gain too little from one to pay its permutes."""
    for name, v, ring in (("zb-h1", 1, True), ("interleaved", 2, True), ("1f1b", 1, False),
                          ("zb-v", 2, False)):
        s = make_schedule(name, 4, 8, v)
        assert bool(tick_transfers(s)[1]) == ring, name
        assert bool(compile_program(s).slack_pairs != ((), ())) == ring, name
        # Where it runs, it is faster at the paper's costs than the tick's own permutes.
        if ring:
            paper = dict(PAPER_1P5B)
            assert max(tick_clocks(s, paper, 0.6)) < max(ticks._rendezvous_run(
                ticks._lane_work(s, paper)[0][0], 0.6, tick_transfers(s, slack_ring=False)[0],
                set()))


@pytest.mark.parametrize("name,p,m,v,paired", [c for c in CASES if c[-1] is False])
def test_per_tick_rings_file_each_arrival_once(name, p, m, v, paired):
    """The program's urgent and slack columns split its arrivals: each filed once, into the
    slot the fixed-ring program files it in, and its pair on the ring it travels."""
    program = compile_program(_table(name, p, m, v, paired))
    _check_filing(program)


def test_ring_patterns_are_bounded(monkeypatch):
    """A table with a ring pattern per tick (ZB-V at p = 24) compiles to at most
    `MAX_TICK_PATTERNS`; a tick whose own is not kept permutes a kept superset of it, and
    every arrival is still filed once, from a permute that carries it."""
    s = make_schedule("zb-v", 24, 48, 2)
    with monkeypatch.context() as m:
        m.setattr(ticks, "MAX_TICK_PATTERNS", 10**6)
        assert len({frozenset(x) for x in tick_transfers(s, slack_ring=False)[0]}) > 200
    program = compile_program(s)
    assert len(program.patterns) == ticks.MAX_TICK_PATTERNS
    _check_filing(program)


def _check_filing(program):
    p = program.schedule.stages
    assert program.tick_rings
    patterns = program.column("ring_pattern")[:, 0, 0]
    for route, ring in (("down", 0), ("up", 1)):
        every = program.column("file_" + route)[..., 0]
        urgent = program.column("file_urgent_" + route)[..., 0]
        slack = program.column("file_slack_" + route)[..., 0]
        trash = program.trash
        assert not ((urgent != trash) & (slack != trash)).any()
        assert (np.where(urgent != trash, urgent, slack) == every).all()
        for t, d in zip(*np.nonzero(urgent != trash)):
            src = (d - 1) % p if route == "down" else (d + 1) % p
            assert (src, d) in program.patterns[patterns[t - 1]][ring]
        for t, d in zip(*np.nonzero(slack != trash)):
            src = (d - 1) % p if route == "down" else (d + 1) % p
            assert (src, d) in program.slack_pairs[ring]


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 8, 24, 1), ("zb-h1", 8, 24, 1),
                                        ("interleaved", 4, 16, 2), ("zb-v", 8, 24, 2)])
def test_per_tick_rings_never_cost_more_than_fixed_rings(name, p, m, v):
    """Meeting only where data moves is never slower than every ring partner every tick (the
    CPU program's rule, which the simulator plays on synchronous collectives), and at the
    paper's unequal costs it is much faster for 1F1B and ZB-H1."""
    s = make_schedule(name, p, m, v)
    costs = Costs.uniform(p * v, 18.5, 18.1, 9.3, act_bytes=0.6)
    fixed = simulate(Plan(s), costs, _hw_synchronous(), timing="ticks").step_time_s
    mine = max(tick_clocks(s, PAPER_1P5B, 0.6))
    assert mine <= fixed + 1e-9
    if name in ("1f1b", "zb-h1"):
        assert mine < 0.9 * fixed


def _hw_synchronous() -> HardwareProfile:
    return dataclasses.replace(_hw(), synchronous_collectives=True)


@pytest.mark.parametrize("name,p,m,v,paired", CASES)
def test_lane_partners_are_the_programs_rings(name, p, m, v, paired):
    s = _table(name, p, m, v, paired)
    rings = compile_program(s).lane_rings
    for lane, partners in enumerate(lane_partners(s)):
        down, up, _ = rings[lane]
        want = [set() for _ in range(p)]
        for src, dst in (*down, *up):
            want[src].add(dst)
            want[dst].add(src)
        assert [set(x) for x in partners] == want


def test_schedule_costs_reports_weighted_bubble():
    """`--costs F,B,W,C` adds `weighted_bubble`; a paired table is chosen for those costs
    and runs with less bubble than the unpaired one (ZB-H1 at the paper's 1.5B costs)."""
    plain = json.loads(schedule_command("zb-h1", 8, 32, as_json=True,
                                        costs="18.5,18.1,9.3,0.6"))
    paired = json.loads(schedule_command("zb-h1", 8, 32, as_json=True, paired=True,
                                         costs="18.5,18.1,9.3,0.6"))
    assert plain["costs"] == {**PAPER_1P5B, "C": 0.6}
    assert plain["weighted_bubble"] == pytest.approx(
        executed_bubble(make_schedule("zb-h1", 8, 32), PAPER_1P5B, 0.6))
    assert paired["paired"] and paired["weighted_bubble"] < plain["weighted_bubble"] - 0.03
    # The transfer is exposed once per tick: a dearer one can only cost more.
    dearer = json.loads(schedule_command("zb-h1", 8, 32, as_json=True,
                                         costs="18.5,18.1,9.3,3"))
    assert dearer["weighted_bubble"] > plain["weighted_bubble"]


def test_schedule_costs_cli_and_bad_values():
    proc = run_cli("schedule", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8",
                   "--costs", "1,2,1,0.1", "--json")
    assert proc.returncode == 0, proc.stderr
    assert 0 < json.loads(proc.stdout)["weighted_bubble"] < 1
    for bad in ("1,2,1", "1,2,x,0", "1,0,1,0", "1,1,1,-1"):
        proc = run_cli("schedule", "--schedule", "1f1b", "--stages", "4", "--microbatches",
                       "8", "--costs", bad)
        assert proc.returncode == 2
        assert proc.stderr.strip().count("\n") == 0 and "--costs" in proc.stderr


def test_real_sizes_build_and_the_bound_refuses_only_past_them():
    """The paper's 14.6B ZB-V setting (p = 24, m = 96) builds, valid, in seconds; the bound is
    on what cannot be built in bounded time, in one line."""
    start = time.perf_counter()
    s = make_schedule("zb-v", 24, 96, 2)
    assert time.perf_counter() - start < 10
    validate(s)
    with pytest.raises(ValueError, match=r"^pipeline.microbatches: .* 1048576"):
        make_schedule("1f1b", 2, 1 << 20)


@pytest.mark.slow
def test_largest_tables_build_in_ten_seconds():
    """p = 64, m = 1024 (v = 4 interleaved, ZB-V, ZB-H1) build in <= 10 s each."""
    for name, v in (("interleaved", 4), ("zb-v", 2), ("zb-h1", 1), ("1f1b", 1)):
        start = time.perf_counter()
        s = make_schedule(name, 64, 1024, v)
        assert time.perf_counter() - start < 10, name
        assert s.ticks >= 3 * 1024 * v if s.split_backward else 2 * 1024 * v


@pytest.mark.parametrize("name,p,m,v,paired", [c for c in CASES if c[4]]
                         + [("interleaved", 4, 16, 3, True), ("1f1b", 4, 32, 1, True)])
def test_spans_leave_out_only_what_their_ticks_do_not_use(name, p, m, v, paired):
    """`TickProgram.spans` cuts the table into the fill, the steady state and the drain: each
    tick's parts (a lane's action, what it sends, what arrives, the head) are all in its
    span's loop, and the fill's loop runs no backward lane or ring, the drain's no forward
    ring and no head."""
    from jax_overlap.pipeline.program import MIN_SPAN_TICKS

    program = compile_program(_table(name, p, m, v, paired), vocab_parallel=True)
    for stop in (program.ticks, program.ticks - 1):  # the last tick run apart, or not
        spans = program.spans(stop)
        assert [s.start for s in spans] == [0] + [s.stop for s in spans[:-1]]
        assert spans[-1].stop == stop and len(spans) == 3
        assert all(s.stop - s.start >= MIN_SPAN_TICKS for s in spans)
        for s in spans:
            flags = [*s.acts, *s.sends, *s.receives, s.head, s.head_before]
            assert (program.tick_parts[s.start:s.stop] <= flags).all(), s
        fill, _, drain = spans
        assert not (fill.acts[1] or fill.sends[1] or fill.receives[1] or fill.head_before)
        assert not (drain.sends[0] or drain.head), drain


def test_a_skewed_table_runs_as_one_span_of_every_part():
    """At transfer latency 2 a tick sends the previous tick's output: one loop, every part."""
    from jax_overlap.pipeline.program import TickSpan

    program = compile_program(make_schedule("1f1b", 4, 8, 1, 2, False))
    assert program.spans() == (TickSpan.every(0, program.ticks, 1),)
