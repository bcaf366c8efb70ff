"""Pipeline schedules as data: generators, validator, metrics, JSON, text and plots."""

import dataclasses
import json
import re

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from jax_overlap.pipeline.plot import plot_bubble_vs_microbatches, plot_schedule  # noqa: E402
from jax_overlap.pipeline.schedules import (  # noqa: E402
    SCHEDULES,
    Action,
    Schedule,
    bubble_formula,
    bubble_fraction,
    make_schedule,
    parse_entry,
    peak_activations,
    schedule_command,
    weighted_bubble_fraction,
)
from jax_overlap.pipeline.validate import ScheduleError, validate  # noqa: E402

GRID = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 3 * p)]


def all_configs():
    for p, m in GRID:
        for name in SCHEDULES:
            for v in (2, 3) if name == "interleaved" else (1,):
                yield name, p, m, v


_CACHE: dict = {}


def sched(name, p, m, v=1) -> Schedule:
    """Generated schedules are pure functions of their arguments; build each once."""
    key = (name, p, m, v)
    if key not in _CACHE:
        _CACHE[key] = make_schedule(name, p, m, v)
    return _CACHE[key]


# --------------------------------------------------------------------------- generators


@pytest.mark.parametrize("name,p,m,v", list(all_configs()))
def test_every_generated_schedule_validates(name, p, m, v):
    s = sched(name, p, m, v)
    validate(s)
    assert (s.stages, s.microbatches) == (p, m)
    assert s.virtual_stages == (2 if name == "zb-v" else v)
    assert s.split_backward == name.startswith("zb")
    per_stage = (3 if s.split_backward else 2) * m * s.virtual_stages
    for row in s.grid:
        assert sum(a is not None for a in row) == per_stage


@pytest.mark.parametrize("name,p,m,v", [c for c in all_configs() if c[0] != "zb-v"])
def test_bubble_matches_closed_form(name, p, m, v):
    expected = bubble_formula(name, p, m, v)
    assert bubble_fraction(sched(name, p, m, v)) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("p,m", GRID)
def test_textbook_formulas_and_ordering(p, m):
    assert bubble_fraction(sched("gpipe", p, m)) == pytest.approx((p - 1) / (m + p - 1))
    assert bubble_fraction(sched("1f1b", p, m)) == pytest.approx((p - 1) / (m + p - 1))
    for v in (2, 3):
        expected = (p - 1) / (v * m + p - 1)
        assert bubble_fraction(sched("interleaved", p, m, v)) == pytest.approx(expected)
    h1 = bubble_fraction(sched("zb-h1", p, m))
    zbv = bubble_fraction(sched("zb-v", p, m))
    assert h1 < bubble_fraction(sched("1f1b", p, m))
    assert zbv <= h1
    # Stage d cannot start before tick d, so this is a floor; on this grid it is reached.
    assert zbv == pytest.approx((p - 1) / (6 * m + p - 1))


def test_one_f_one_b_and_gpipe_work_for_fewer_microbatches_than_stages():
    for name in ("gpipe", "1f1b", "zb-h1", "zb-v"):
        s = make_schedule(name, 4, 2)
        validate(s)
    assert bubble_fraction(make_schedule("1f1b", 4, 2)) == pytest.approx(3 / 5)


def test_one_f_one_b_shape_p2_m2():
    s = sched("1f1b", 2, 2)
    assert s.to_json()["table"] == [
        ["F0", "F1", None, "B0", None, "B1"],
        [None, "F0", "B0", "F1", "B1", None],
    ]


def test_zb_h1_defers_weight_gradients_into_the_cool_down():
    s = sched("zb-h1", 4, 8)
    for d, row in enumerate(s.to_json()["table"]):
        kinds = [e[0] for e in row if e is not None]
        # Stage d delays each W by d microbatches: d+1 B's before the first W ...
        assert kinds[: kinds.index("W")].count("B") == d + 1
        # ... and the last d+1 W's fill the cool-down after the final B.
        tail = kinds[len(kinds) - 1 - kinds[::-1].index("B") + 1 :]
        assert tail == ["W"] * (d + 1)


# ------------------------------------------------------------------------------ memory


@pytest.mark.parametrize("p,m", GRID)
def test_peak_activations(p, m):
    assert peak_activations(sched("gpipe", p, m)) == [m] * p
    assert peak_activations(sched("1f1b", p, m)) == [p - d for d in range(p)]
    assert peak_activations(sched("zb-h1", p, m))[0] <= p
    assert max(peak_activations(sched("zb-h1", p, m))) <= p
    # Chunk activations: 2p halves of a stage = 1F1B's p full-stage microbatches.
    assert max(peak_activations(sched("zb-v", p, m))) <= 2 * p


def test_peak_activations_counts_until_last_backward_action():
    table = {
        "name": "hand",
        "stages": 1,
        "microbatches": 3,
        "split_backward": True,
        "table": [["F0", "F1", "B0", "F2", "W0", "B1", "W1", "B2", "W2"]],
    }
    # F0, F1 and F2 are all held at tick 3: W0 (which releases F0) only runs at tick 4.
    assert peak_activations(Schedule.from_json(table)) == [3]
    table["split_backward"] = False
    table["table"] = [["F0", "F1", "B0", "F2", "B1", "B2"]]
    assert peak_activations(Schedule.from_json(table)) == [2]


# ---------------------------------------------------------------------------- placement


def test_placements():
    s = sched("interleaved", 4, 4, 3)
    for stage in range(4):
        for chunk in range(3):
            assert s.virtual_stage(stage, chunk) == chunk * 4 + stage
    v = sched("zb-v", 4, 4)
    for stage in range(4):
        assert v.virtual_stage(stage, 0) == stage
        assert v.virtual_stage(stage, 1) == 7 - stage
    assert [s.virtual_stage(*pos) for pos in s.placement] == list(range(12))


# ------------------------------------------------------------------------ JSON and text


def test_json_keys_and_entries():
    d = sched("interleaved", 2, 2, 2).to_json()
    keys = {"name", "stages", "microbatches", "virtual_stages", "ticks", "bubble_fraction"}
    assert keys | {"peak_activations", "table"} <= d.keys()
    assert d["ticks"] == len(d["table"][0])
    entries = {e for row in d["table"] for e in row if e is not None}
    assert entries == {f"{k}{mb}.{c}" for k in "FB" for mb in range(2) for c in range(2)}
    assert d["table"][0][0] == "F0.0"
    one = sched("1f1b", 2, 2).to_json()
    assert {e for row in one["table"] for e in row} == {None, "F0", "F1", "B0", "B1"}
    assert "memory_note" not in one
    zbv = sched("zb-v", 4, 8).to_json()
    assert "2p" in zbv["memory_note"] and "1F1B" in zbv["memory_note"]
    json.dumps(zbv)


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 1)])
def test_json_round_trip(name, v):
    s = sched(name, 4, 8, v)
    again = Schedule.from_json(json.loads(json.dumps(s.to_json())))
    assert again == s
    assert again.to_json() == s.to_json()


def test_parse_entry():
    assert parse_entry("F3.1") == Action("F", 3, 1)
    assert parse_entry("W12") == Action("W", 12, 0)
    assert parse_entry(None) is None
    for bad in ("F3.", "X3", "F", "F-1", "f3"):
        with pytest.raises(ValueError, match="bad schedule entry"):
            parse_entry(bad)


def test_schedule_command_text():
    out = schedule_command("1f1b", 2, 2)
    assert out.splitlines() == [
        "tick    | 0  1  2  3  4  5",
        "stage 0 | F0 F1 .  B0 .  B1",
        "stage 1 | .  F0 B0 F1 B1 .",
        "1f1b: stages=2 microbatches=2 virtual_stages=1 ticks=6 bubble_fraction=0.3333 "
        "peak_activations=[2, 1]",
    ]
    wide = schedule_command("interleaved", 2, 2, virtual=2).splitlines()
    assert wide[1].startswith("stage 0 | F0.0 F1.0 F0.1")
    # Aligned columns: every grid line has the same cell boundaries.
    assert len({len(line.split(" | ")[0]) for line in wide[:3]}) == 1


def test_schedule_command_json():
    d = json.loads(schedule_command("zb-h1", 4, 8, as_json=True))
    assert d == sched("zb-h1", 4, 8).to_json()
    assert d["bubble_fraction"] == pytest.approx(3 / 27)


def test_weighted_bubble_fraction():
    # Unit costs on a split schedule: every tick lasts 1, so it is the tick bubble.
    s = sched("zb-h1", 4, 8)
    assert weighted_bubble_fraction(s) == pytest.approx(bubble_fraction(s))
    # 1F1B p=2 m=2 with a non-split B costing B+W=2: ticks last 1,1,2,2,2,2 (10 in all),
    # busy time 4 F x 1 + 4 B x 2 = 12 of 2 x 10.
    assert weighted_bubble_fraction(sched("1f1b", 2, 2)) == pytest.approx(8 / 20)
    assert weighted_bubble_fraction(sched("1f1b", 2, 2), {"F": 1, "B": 1, "W": 0}) == pytest.approx(
        bubble_fraction(sched("1f1b", 2, 2))
    )


# ---------------------------------------------------------------------------- validator


def broken(name, p, m, v=1, edit=None, **overrides) -> Schedule:
    d = sched(name, p, m, v).to_json()
    d.update(overrides)
    if edit:
        edit(d["table"])
    return Schedule.from_json(d)


def rejects(schedule, message):
    with pytest.raises(ScheduleError, match="^" + re.escape(message)):
        validate(schedule)


# 1f1b p=2 m=2 is:   stage 0 | F0 F1 .  B0 .  B1
#                    stage 1 | .  F0 B0 F1 B1 .
def test_rejects_missing_action():
    def drop_last_b(t):
        t[0][5] = None

    s = broken("1f1b", 2, 2, edit=drop_last_b)
    rejects(s, "missing: B1 (virtual stage 0) never runs on stage 0")


def test_rejects_missing_w_when_split():
    def drop_w(t):
        t[1][t[1].index("W1")] = None

    s = broken("zb-h1", 2, 2, edit=drop_w)
    rejects(s, "missing: W1 (virtual stage 1) never runs on stage 1")


def test_rejects_duplicate():
    def dup(t):
        t[0][2] = "F0"

    rejects(broken("1f1b", 2, 2, edit=dup), "tick 2, stage 0: F0 already ran at tick 0")


def test_rejects_dependency_violated_by_latency():
    def early_b(t):
        t[0][2], t[0][3] = "B0", None  # same tick as stage 1's B0: no time to transfer

    rejects(
        broken("1f1b", 2, 2, edit=early_b),
        "tick 2, stage 0: B0 needs B0 from stage 1 by tick 1 (it runs at tick 2)",
    )


def test_rejects_forward_before_input_arrives():
    def early_f(t):
        t[1][0], t[1][1] = "F0", None

    s = broken("1f1b", 2, 2, edit=early_f)
    rejects(s, "tick 0, stage 1: F0 needs F0 from stage 0 at an earlier tick (it runs at tick 0)")


def test_rejects_w_before_b():
    # zb-h1 p=2 m=2:  stage 0 | F0 F1 .  B0 W0 B1 W1
    def swap(t):
        t[0][3], t[0][4] = t[0][4], t[0][3]

    s = broken("zb-h1", 2, 2, edit=swap)
    rejects(s, "tick 3, stage 0: W0 needs B0 from stage 0 by tick 2 (it runs at tick 4)")


def test_rejects_w_in_unsplit_schedule():
    def add_w(t):
        t[0][2] = "W0"

    rejects(broken("1f1b", 2, 2, edit=add_w), "tick 2, stage 0: W0 but split_backward is False")


def test_rejects_bad_chunk_and_microbatch():
    def bad_chunk(t):
        t[1][0] = "F0.2"

    s = broken("interleaved", 2, 2, 2, edit=bad_chunk)
    rejects(s, "tick 0, stage 1: F0.2 has chunk 2, expected 0..1")

    def bad_mb(t):
        t[0][2] = "F7"

    s = broken("1f1b", 2, 2, edit=bad_mb)
    rejects(s, "tick 2, stage 0: F7 has microbatch 7, expected 0..1")


def test_rejects_non_action_entries():
    s = sched("1f1b", 2, 2)
    grid = (s.grid[0][:2] + (("F", 1, 0),) + s.grid[0][3:], s.grid[1])
    rejects(dataclasses.replace(s, grid=grid), "tick 2, stage 0: entry ('F', 1, 0) is not an")
    grid = (s.grid[0][:2] + (Action("X", 1),) + s.grid[0][3:], s.grid[1])
    rejects(dataclasses.replace(s, grid=grid), "tick 2, stage 0: entry Action(kind='X'")


def test_reports_first_violation_in_tick_order():
    def two_faults(t):
        t[0][5] = "B0"  # duplicate at tick 5
        t[1][3] = "F0"  # duplicate at tick 3, stage 1: reported first

    rejects(broken("1f1b", 2, 2, edit=two_faults), "tick 3, stage 1: F0 already ran at tick 1")

    def same_tick(t):
        t[0][3] = "F0"
        t[1][3] = "F0"

    rejects(broken("1f1b", 2, 2, edit=same_tick), "tick 3, stage 0: F0 already ran at tick 0")


def test_rejects_structural_faults():
    rejects(broken("interleaved", 2, 2, 2, placement=[[0, 0], [1, 0], [0, 0], [1, 1]]),
            "placement: virtual stages 0 and 2 both map to (stage 0, chunk 0)")
    rejects(broken("1f1b", 2, 2, placement=[[0, 0]]), "placement: 1 virtual stages, expected")

    def ragged(t):
        t[1].pop()

    rejects(broken("1f1b", 2, 2, edit=ragged), "grid: stage 1 has 5 ticks but stage 0 has 6")

    def missing_row(t):
        t.pop()

    rejects(broken("1f1b", 2, 2, edit=missing_row), "grid: 1 rows, expected one per stage (2)")


def test_hand_written_table_round_trips_and_validates():
    d = {
        "name": "hand",
        "stages": 2,
        "microbatches": 1,
        "table": [["F0", None, None, "B0"], [None, "F0", "B0", None]],
    }
    s = Schedule.from_json(d)
    validate(s)
    assert not s.split_backward and s.placement == ((0, 0), (1, 0))
    assert bubble_fraction(s) == pytest.approx(0.5)


# ------------------------------------------------------------------------ bad arguments


@pytest.mark.parametrize(
    "args,field,hint",
    [
        (("1f1c", 4, 8), "pipeline.schedule", "did you mean '1f1b'"),
        (("zbh1", 4, 8), "pipeline.schedule", "did you mean 'zb-h1'"),
        (("interleaved", 4, 2, 2), "pipeline.microbatches", "set pipeline.microbatches to 4"),
        (("interleaved", 4, 6, 2), "pipeline.microbatches", "to 4 or 8"),
        (("interleaved", 4, 8, 1), "pipeline.virtual_stages", "2 or more"),
        (("1f1b", 4, 8, 2), "pipeline.virtual_stages", "to 1"),
        (("zb-v", 4, 8, 3), "pipeline.virtual_stages", "to 2"),
        (("gpipe", 0, 8), "pipeline.stages", ">= 1"),
        (("gpipe", 4, 0), "pipeline.microbatches", ">= 1"),
    ],
)
def test_bad_arguments_name_the_field(args, field, hint):
    with pytest.raises(ValueError) as info:
        make_schedule(*args)
    message = str(info.value)
    assert message.startswith(field + ":")
    assert hint in message
    assert "\n" not in message


# ------------------------------------------------------------- two-tick transfer latency

LATENCY2 = [(name, p, m, v) for p in (2, 4) for m in (2 * p, 4 * p) for name in SCHEDULES
            for v in ((2, 3) if name == "interleaved" else (1,))]


def _cross_stage_gaps(s: Schedule) -> list[int]:
    """Ticks between every cross-stage dependency and its consumer."""
    from jax_overlap.pipeline.schedules import dependencies

    tick_of = {s.task(d, a): (t, d) for d, row in enumerate(s.grid)
               for t, a in enumerate(row) if a is not None}
    gaps = []
    for task, (t, d) in tick_of.items():
        for dep in dependencies(task, s.stages * s.virtual_stages):
            dep_tick, dep_stage = tick_of[dep]
            if dep_stage != d:
                gaps.append(t - dep_tick)
    return gaps


@pytest.mark.parametrize("name,p,m,v", LATENCY2)
def test_latency2_schedules_validate_and_leave_a_tick_for_every_transfer(name, p, m, v):
    s = make_schedule(name, p, m, v, transfer_latency=2)
    validate(s)
    assert s.transfer_latency == 2
    gaps = _cross_stage_gaps(s)
    assert gaps and min(gaps) >= 2
    # The same table read with one tick of latency is legal too: latency 2 only adds ticks.
    validate(dataclasses.replace(s, transfer_latency=1))
    # Every action still runs once.
    per_stage = (3 if s.split_backward else 2) * m * s.virtual_stages
    assert all(sum(a is not None for a in row) == per_stage for row in s.grid)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16)])
def test_latency2_bubbles_follow_the_longer_ramp(p, m):
    ramp = 2 * (p - 1)  # L (p - 1) with L = 2
    for name, busy in (("gpipe", m), ("1f1b", m), ("zb-h1", 3 * m)):
        got = bubble_fraction(make_schedule(name, p, m, transfer_latency=2))
        assert got == pytest.approx(ramp / (busy + ramp), abs=1e-12), name
    got = bubble_fraction(make_schedule("interleaved", p, m, 2, transfer_latency=2))
    assert got == pytest.approx(ramp / (2 * m + ramp), abs=1e-12)
    # The price of hiding transfers: never less bubble than one tick of latency.
    for name in SCHEDULES:
        v = 2 if name in ("interleaved", "zb-v") else 1
        assert (bubble_fraction(make_schedule(name, p, m, v, transfer_latency=2))
                >= bubble_fraction(make_schedule(name, p, m, v)) - 1e-12)


def test_latency2_one_f_one_b_holds_l_times_more_in_flight():
    # Stage d holds L(p-d-1)+1 microbatches: enough to cover a round trip twice as long.
    assert peak_activations(make_schedule("1f1b", 4, 16, transfer_latency=2)) == [7, 5, 3, 1]
    assert peak_activations(make_schedule("zb-h1", 4, 16, transfer_latency=2)) == [7] * 4


def test_validator_applies_the_schedules_latency():
    s = make_schedule("1f1b", 2, 2)  # stage 1 runs F0 at tick 1, one tick after stage 0
    with pytest.raises(ScheduleError) as info:
        validate(dataclasses.replace(s, transfer_latency=2))
    assert str(info.value) == ("tick 1, stage 1: F0 needs F0 from stage 0 at an earlier tick "
                               "(it runs at tick 0)")
    s = make_schedule("gpipe", 2, 4)
    delayed = tuple((None, *row) for row in s.grid)  # everything one tick later
    validate(dataclasses.replace(s, grid=delayed))
    with pytest.raises(ScheduleError) as info:
        validate(dataclasses.replace(s, grid=delayed, transfer_latency=2))
    assert str(info.value) == ("tick 2, stage 1: F0 needs F0 from stage 0 by tick 0 "
                               "(it runs at tick 1)")


def test_latency_is_in_json_text_and_cli():
    s = make_schedule("zb-v", 2, 4, 2, transfer_latency=2)
    data = s.to_json()
    assert data["transfer_latency"] == 2
    assert Schedule.from_json(json.loads(json.dumps(data))) == s
    assert json.loads(schedule_command("1f1b", 4, 8, as_json=True,
                                       transfer_latency=2))["transfer_latency"] == 2
    assert "transfer_latency=2" in schedule_command("1f1b", 4, 8, transfer_latency=2)


@pytest.mark.parametrize(
    "args,field,hint",
    [
        (("1f1b", 4, 8, 1, 3), "pipeline.transfer_latency", "got 3"),
        (("interleaved", 4, 12, 2, 2), "pipeline.microbatches", "to 8 or 16"),
    ],
)
def test_bad_latency_arguments_name_the_field(args, field, hint):
    with pytest.raises(ValueError) as info:
        make_schedule(*args)
    assert str(info.value).startswith(field + ":") and hint in str(info.value)


def test_names_are_normalised():
    assert make_schedule("ZB_H1", 2, 2) == sched("zb-h1", 2, 2)
    assert make_schedule("zb-v", 2, 2, 2) == sched("zb-v", 2, 2)


# -------------------------------------------------------------------------------- plots


def test_plot_schedule_draws_one_box_per_action():
    s = sched("interleaved", 4, 8, 2)
    ax = plot_schedule(s)
    boxes = [p for p in ax.patches if isinstance(p, Rectangle)]
    assert len(boxes) == sum(a is not None for row in s.grid for a in row)
    labels = sorted(int(t.get_text()) for t in ax.texts)
    assert labels == sorted(a.microbatch for row in s.grid for a in row if a is not None)
    # Chunk 1 is drawn lighter than chunk 0 of the same kind.
    colors = {(a.kind, a.chunk): None for row in s.grid for a in row if a is not None}
    by_pos = {(round(b.get_x()), round(b.get_y() + 0.4)): b.get_facecolor() for b in boxes}
    for d, row in enumerate(s.grid):
        for t, a in enumerate(row):
            if a is not None:
                colors[(a.kind, a.chunk)] = by_pos[(t, d)]
    assert sum(colors[("F", 1)][:3]) > sum(colors[("F", 0)][:3])
    matplotlib.pyplot.close("all")


def test_plot_bubble_vs_microbatches():
    names = ["1f1b", "interleaved", "zb-h1"]
    ax = plot_bubble_vs_microbatches(names, 4, [2, 4, 6, 8])
    lines = ax.get_lines()
    assert len(lines) == 3
    assert list(lines[0].get_xdata()) == [2, 4, 6, 8]
    assert list(lines[1].get_xdata()) == [4, 8]  # interleaved needs a multiple of p
    assert list(lines[2].get_ydata())[-1] == pytest.approx(3 / 27)
    matplotlib.pyplot.close("all")


@pytest.mark.parametrize("paired", [False, True])
@pytest.mark.parametrize("name,v,split", [("1f1b", 1, False), ("zb-h1", 1, True),
                                          ("zb-v", 2, True), ("interleaved", 2, False)])
def test_residual_slots_never_overlap_while_live(name, v, split, paired):
    """What an F keeps for its backward stays in its slot until the last backward action of
    the same (microbatch, chunk) has read it: no other F of the stage writes it meanwhile
    (paired ticks: the forward's lane runs before the backward's)."""
    from jax_overlap.pipeline.program import COL, action_lanes, compile_program

    s = make_schedule(name, 4, 8, v, paired=paired)
    assert s.split_backward == split and s.paired == paired
    program = compile_program(s)
    assert program.lanes == (2 if paired else 1)
    lane = action_lanes(s)  # a pair's first action runs in lane 0 (F or W), its second in 1
    last = "W" if split else "B"
    for d in range(s.stages):
        owner = {}  # (pool, slot) -> (mb, chunk) whose residuals it holds
        for _, t, a in sorted((x for x in s.actions() if x[0] == d),
                              key=lambda x: (x[1], lane[(d, x[2])])):
            vs = s.virtual_stage(d, a.chunk)
            entry = program.table[t, d, lane[(d, a)]]
            r, e = entry[COL["r_slot"]], entry[COL["e_slot"]]
            pools = [("chunk", r)] + ([("edge", (vs, e))] if vs in (0, 4 * v - 1) else [])
            for key in pools:
                if a.kind == "F":
                    assert key not in owner, (name, d, t, key)
                    owner[key] = (a.microbatch, a.chunk)
                else:
                    assert owner[key] == (a.microbatch, a.chunk), (name, d, t, key)
                    if a.kind == last:
                        del owner[key]
        assert not owner  # every residual freed by its last backward
    sizes = dict(program.res_slots)
    assert sizes["chunk"] >= max(sizes["first"], sizes["last"]) >= 1


# ------------------------------------------------------------------------ paired ticks


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2),
                                     ("zb-h1", 1), ("zb-v", 2)])
def test_paired_schedules_are_valid_and_round_trip(name, v):
    from jax_overlap.pipeline.schedules import Pair, Schedule, peak_activations

    for m in (8, 16):
        base = make_schedule(name, 4, m, v)
        s = make_schedule(name, 4, m, v, paired=True)
        validate(s)
        assert s.paired and any(isinstance(c, Pair) for row in s.grid for c in row)
        # Pairs never cost the table its bubble (the generator keeps the quorum that wastes
        # least in lockstep), and never need the latency-2 ramp.
        assert bubble_fraction(s) <= bubble_fraction(base) + 1e-12
        assert bubble_fraction(s) < bubble_fraction(make_schedule(name, 4, m, v,
                                                                  transfer_latency=2))
        # Every action of the step runs exactly once, as in the unpaired table.
        assert sorted(s.task(d, a) for d, _, a in s.actions()) == sorted(
            base.task(d, a) for d, _, a in base.actions())
        # The cap: at most twice the unpaired peak per stage.
        assert all(p2 <= 2 * p1 for p1, p2 in zip(peak_activations(base), peak_activations(s)))
        data = json.loads(json.dumps(s.to_json()))
        assert data["paired"] is True and Schedule.from_json(data).grid == s.grid
        assert any("+" in e for row in data["table"] for e in row if e)


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2),
                                     ("zb-h1", 1), ("zb-v", 2)])
def test_large_paired_tables_take_the_proxy_variant(monkeypatch, name, v):
    """Past `PAIRED_PROXY_CELLS`, a paired table is the variant that wins on a table of
    2 x stages microbatches, built once at full size: valid, every action once, the caps of
    the full-size search, and within 0.01 of its executed bubble (GPipe, whose peaks grow
    with m, keeps the full search)."""
    from jax_overlap.pipeline import pairing
    from jax_overlap.pipeline.schedules import MAX_SCHEDULE_CELLS, peak_activations
    from jax_overlap.pipeline.ticks import executed_bubble

    cost, transfer = {"F": 14.4, "B": 14.4, "W": 9.7}, 1.6
    full = make_schedule(name, 4, 24, v, 1, True, cost, 0, transfer)
    monkeypatch.setattr(pairing, "PAIRED_PROXY_CELLS", 64)
    built = []
    real = pairing.build_variant
    monkeypatch.setattr(pairing, "build_variant",
                        lambda *a, **k: built.append(a[2]) or real(*a, **k))
    s = make_schedule(name, 4, 24, v, 1, True, cost, 0, transfer)
    validate(s)
    base = make_schedule(name, 4, 24, v)
    assert sorted(s.task(d, a) for d, _, a in s.actions()) == sorted(
        base.task(d, a) for d, _, a in base.actions())
    assert all(p2 <= 2 * p1 for p1, p2 in zip(peak_activations(base), peak_activations(s)))
    assert executed_bubble(s, cost, transfer) <= executed_bubble(full, cost, transfer) + 0.01
    # One full-size build (the rest at the proxy's 8 microbatches), except for GPipe.
    assert built.count(24) == (len(built) if name == "gpipe" else 1)
    if name == "gpipe":
        assert s.grid == full.grid
    # The full size is checked before the proxy is built.
    with pytest.raises(ValueError, match="pipeline.microbatches"):
        make_schedule(name, 4, MAX_SCHEDULE_CELLS, v, 1, True, cost, 0, transfer)
    if name == "interleaved":
        with pytest.raises(ValueError, match="multiple of pipeline.stages=4"):
            make_schedule(name, 4, 26, v, 1, True, cost, 0, transfer)


def test_paired_entry_spelling():
    from jax_overlap.pipeline.schedules import Action, Pair, format_entry, parse_entry

    pair = Pair(Action("F", 3), Action("B", 1))
    assert format_entry(pair, 1) == "F3+B1"
    assert parse_entry("F3+B1") == pair
    assert parse_entry("F3.1+W0.0") == Pair(Action("F", 3, 1), Action("W", 0, 0))
    # Lanes are positions: lane 0 runs F or W, lane 1 B or W.
    assert parse_entry("W2+B4") == Pair(Action("W", 2), Action("B", 4))
    assert parse_entry("W2.1+W3.0") == Pair(Action("W", 2, 1), Action("W", 3, 0))
    assert format_entry(Pair(Action("W", 2, 1), Action("W", 3, 0)), 2) == "W2.1+W3.0"
    for bad in ("B1+F3", "F1+F2", "F1+B2+W3", "B1+W2", "W1+F2"):
        with pytest.raises(ValueError, match="paired entry"):
            parse_entry(bad)


def test_paired_1f1b_steady_state_pairs_every_stage():
    """In the steady state each stage runs one forward and one backward per tick, so a
    lockstep tick costs F + B on every stage and the weighted bubble falls to the table's."""
    from jax_overlap.pipeline.schedules import Pair, weighted_bubble_fraction

    s = make_schedule("1f1b", 4, 16, paired=True)
    steady = [t for t in range(s.ticks) if all(isinstance(row[t], Pair) for row in s.grid)]
    assert len(steady) >= 16 - 2 * 4
    cost = {"F": 1.0, "B": 1.0, "W": 1.0}  # non-split B costs B + W = 2F
    unpaired = make_schedule("1f1b", 4, 16)
    assert weighted_bubble_fraction(s, cost) < weighted_bubble_fraction(unpaired, cost) - 0.1
    assert bubble_fraction(s) == pytest.approx(bubble_fraction(unpaired))


def test_validator_names_bad_pairs():
    from jax_overlap.pipeline.schedules import Action, Pair, Schedule, linear_placement

    def table(cells):
        return Schedule("hand", 1, 2, 1, False, linear_placement(1), (tuple(cells),))

    same = table([Action("F", 0), Pair(Action("F", 1), Action("B", 1)), Action("B", 0)])
    with pytest.raises(ScheduleError,
                       match=r"tick 1, stage 0: pair F1\+B1 runs two actions of one"):
        validate(same)
    swapped = table([Action("F", 0), Pair(Action("B", 0), Action("F", 1)), Action("B", 1)])
    with pytest.raises(ScheduleError, match="must be a forward or W then a B or W"):
        validate(swapped)
    ok = table([Action("F", 0), Pair(Action("F", 1), Action("B", 0)), Action("B", 1)])
    validate(ok)
    # W's run in either lane; a pair's two actions never depend on each other.
    def split(cells):
        return Schedule("hand", 1, 2, 1, True, linear_placement(1), (tuple(cells),))

    validate(split([Action("F", 0), Action("F", 1), Action("B", 0),
                    Pair(Action("W", 0), Action("B", 1)), Action("W", 1)]))
    validate(split([Action("F", 0), Action("F", 1), Action("B", 0), Action("B", 1),
                    Pair(Action("W", 0), Action("W", 1))]))
    with pytest.raises(ScheduleError,
                       match=r"tick 3, stage 0: pair W0\+B0 runs two actions of one"):
        validate(split([Action("F", 0), Action("F", 1), Action("B", 1),
                        Pair(Action("W", 0), Action("B", 0)), Action("W", 1)]))
    with pytest.raises(ScheduleError, match="must be a forward or W then a B or W"):
        validate(split([Action("F", 0), Action("F", 1), Action("B", 0),
                        Pair(Action("B", 1), Action("W", 0)), Action("W", 1)]))
    assert bubble_fraction(ok) == pytest.approx(1 - 4 / 4)  # 1 + 2 + 1 units, all busy


def test_paired_program_idle_fraction_is_the_table_bubble():
    from jax_overlap.pipeline.program import compile_program

    for name, v in (("1f1b", 1), ("zb-v", 2), ("interleaved", 2)):
        s = make_schedule(name, 4, 8, v, paired=True)
        program = compile_program(s)
        assert program.idle_fraction() == pytest.approx(bubble_fraction(s), abs=1e-12)


def test_paired_generator_balances_lockstep_cost():
    """Cost-aware pairing: at B = 2F (a non-split backward) pairing removes the lockstep
    waste of 1F1B and interleaved; where it would lengthen ticks (ZB at small m) it
    pairs less, down to not at all."""
    from jax_overlap.pipeline.schedules import weighted_bubble_fraction

    cost = {"F": 1.0, "B": 1.0, "W": 1.0}
    for name, v in (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2)):
        for m in (4, 8, 16):
            plain = make_schedule(name, 4, m, v)
            paired = make_schedule(name, 4, m, v, paired=True, cost=cost)
            assert (weighted_bubble_fraction(paired, cost)
                    <= weighted_bubble_fraction(plain, cost) + 1e-12), (name, m)
    assert not make_schedule("zb-v", 4, 4, 2, paired=True).paired  # nothing to gain at m=4


def test_per_tick_quorums_and_the_pairing_search():
    """A per-tick quorum sequence that repeats one share builds that share's table; the search
    (deterministic for its seed) keeps every task once and the generator's activation caps,
    and balances lockstep ticks at unequal costs better than any single quorum."""
    from jax_overlap.pipeline.generators import build
    from jax_overlap.pipeline.pairing import PAIR_QUORUMS, search_pairings
    from jax_overlap.pipeline.schedules import peak_activations, weighted_bubble_fraction

    cost = {"F": 15.2, "B": 18.8, "W": 18.6}  # bench/pipeline.py's CPU tick costs
    base = make_schedule("zb-v", 4, 8, 2)
    caps = [2 * p for p in peak_activations(base)]
    for q in PAIR_QUORUMS:
        assert (build("zb-v", 4, 8, 2, 1, True, caps, (q,) * 5).grid
                == build("zb-v", 4, 8, 2, 1, True, caps, q).grid)
    # The search refines the quorum tables (make_schedule may still pick a filled one).
    fixed, q = min(((build("zb-v", 4, 8, 2, 1, True, caps, q), q) for q in PAIR_QUORUMS),
                   key=lambda c: weighted_bubble_fraction(c[0], cost))
    searched = search_pairings("zb-v", 4, 8, 2, caps, cost, q, 40)
    validate(searched)
    assert searched.grid == search_pairings("zb-v", 4, 8, 2, caps, cost, q, 40).grid
    assert sorted(searched.task(d, a) for d, _, a in searched.actions()) == sorted(
        base.task(d, a) for d, _, a in base.actions())
    assert all(got <= cap for got, cap in zip(peak_activations(searched), caps))
    assert (weighted_bubble_fraction(searched, cost)
            < weighted_bubble_fraction(fixed, cost) - 0.005)
    # No step improves a 1F1B table that pairs every steady tick: the start table comes back.
    assert search_pairings("1f1b", 4, 8, 1, [8, 6, 4, 2], cost, 0.0, 10).grid == make_schedule(
        "1f1b", 4, 8, paired=True, cost=cost).grid


def test_pairing_search_options_are_checked():
    from helpers import TINY

    from jax_overlap import config
    from jax_overlap.pipeline.schedules import schedule_command

    with pytest.raises(ValueError, match="--pair-search: .*add --paired"):
        schedule_command("zb-v", 4, 8, 2, pair_search=5)
    with pytest.raises(ValueError, match="--tick-costs: three positive numbers"):
        schedule_command("zb-v", 4, 8, 2, paired=True, tick_costs="1,x,2")
    for bad, field in ((["pipeline.pair_search=5", "pipeline.paired=false"],
                        "pipeline.pair_search"),
                       (["pipeline.pair_search=-1", "pipeline.paired=true"],
                        "pipeline.pair_search"),
                       (["pipeline.tick_costs=[1,2]"], "pipeline.tick_costs"),
                       (["pipeline.tick_costs=[1,0,2]"], "pipeline.tick_costs")):
        with pytest.raises(config.ConfigError, match=field):
            config.load(TINY, bad)
    # null (equal costs) is a value, as a config written out by `tune` holds it.
    assert config.load(TINY, ["pipeline.tick_costs=null"]).pipeline.tick_costs is None
    import dataclasses
    cfg = config.load(TINY, ["pipeline.tick_costs=[1,2,3]"])
    assert config.from_dict(dataclasses.asdict(cfg)).pipeline.tick_costs == [1.0, 2.0, 3.0]
    assert config.from_dict(dataclasses.asdict(config.load(TINY))).pipeline.tick_costs is None


def test_paired_refuses_latency_2():
    with pytest.raises(ValueError, match="pipeline.transfer_latency"):
        make_schedule("1f1b", 4, 8, transfer_latency=2, paired=True)


def test_plot_draws_pairs_side_by_side_and_ticks_at_their_cost():
    from jax_overlap.pipeline.plot import tick_spans

    s = make_schedule("1f1b", 4, 8, paired=True)
    ax = plot_schedule(s)
    boxes = [p for p in ax.patches if isinstance(p, Rectangle)]
    assert len(boxes) == sum(1 for _ in s.actions())
    spans = tick_spans(s)
    assert spans[-1] == pytest.approx(ax.get_xlim()[1])
    cost = {"F": 1.0, "B": 2.0, "W": 1.0}
    ax = plot_schedule(s, cost=cost)
    widths = sorted({round(p.get_width(), 6) for p in ax.patches if isinstance(p, Rectangle)})
    assert widths == [1.0, 3.0]  # F, and a non-split B (= B + W)
    assert "weighted bubble" in ax.get_title()
    matplotlib.pyplot.close("all")


@pytest.mark.parametrize("name,v", [("zb-h1", 1), ("zb-v", 2)])
def test_filled_tables_are_valid_within_twice_the_activations(name, v):
    """Lanes as positions: every filled table runs each task once, meets the dependencies,
    holds at most twice the plain table's activations per stage and compiles; W's run in
    lane 0 beside B's and two in one tick. At the paper's costs it is the paired choice and
    beats the lockstep-quorum table as the executor runs it."""
    from jax_overlap.pipeline.program import compile_program
    from jax_overlap.pipeline.schedules import Pair, Schedule, filled_schedule, peak_activations
    from jax_overlap.pipeline.ticks import executed_bubble

    paper = {"F": 14.4, "B": 14.4, "W": 9.7}
    for p, m in ((1, 3), (2, 1), (3, 5), (4, 8), (5, 13)):
        base = make_schedule(name, p, m, v)
        for cost, c in ((None, 0.0), (paper, 1.6)):
            (s,) = filled_schedule(name, p, m, None, cost, c)
            validate(s)
            compile_program(s)
            assert sorted(s.task(d, a) for d, _, a in s.actions()) == sorted(
                base.task(d, a) for d, _, a in base.actions())
            assert all(got <= 2 * was for got, was in zip(peak_activations(s),
                                                          peak_activations(base)))
    s = make_schedule(name, 8, 24, v, 1, True, paper, 0, 1.6)
    kinds = {(c.forward.kind, c.backward.kind) for row in s.grid for c in row
             if isinstance(c, Pair)}
    assert {("F", "B"), ("F", "W"), ("W", "B"), ("W", "W")} <= kinds
    assert s.grid == filled_schedule(name, 8, 24, None, paper, 1.6)[0].grid
    data = json.loads(json.dumps(s.to_json()))  # spelled e.g. "W3+B5", "W1+W2", and back
    assert any(e.startswith("W") and "+" in e for row in data["table"] for e in row if e)
    assert Schedule.from_json(data).grid == s.grid
    unfilled = min((_quorum_table(name, 8, 24, v, q) for q in (0.0, 0.5, 0.75, 1.0)),
                   key=lambda t: executed_bubble(t, paper, 1.6))
    assert executed_bubble(s, paper, 1.6) < executed_bubble(unfilled, paper, 1.6) - 0.05


def _quorum_table(name, p, m, v, quorum):
    from jax_overlap.pipeline.generators import build
    from jax_overlap.pipeline.schedules import peak_activations

    caps = [2 * x for x in peak_activations(make_schedule(name, p, m, v))]
    return build(name, p, m, v, 1, True, caps, quorum)
