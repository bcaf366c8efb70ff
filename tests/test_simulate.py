"""Timeline simulator and hardware profiles."""

import dataclasses
from pathlib import Path

import pytest

from jax_overlap.hardware.link_profiles import (
    ProfileError,
    load_profile,
    measure_local,
    profile_from_dict,
)
from jax_overlap.hardware.machine import AxisLink, HardwareProfile, Link
from jax_overlap.analysis.plan_costs import costs_from_measurement, costs_from_model
from jax_overlap.analysis.simulate import (
    Costs,
    Plan,
    all_gather_time,
    all_reduce_time,
    even_buckets,
    events_to_chrome_trace,
    p2p_time,
    simulate,
)
from jax_overlap.analysis.trace import parse_trace
from jax_overlap.pipeline.schedules import (
    Action,
    Schedule,
    bubble_formula,
    make_schedule,
)

PROFILES = ("a100_8x_nvlink", "h100_8x_nvlink", "h100_4x8_infiniband", "pcie_8x", "cpu_here")


def _hw(bandwidth: float = 1e12, latency: float = 0.0) -> HardwareProfile:
    """One link for every axis."""
    link = Link("l", bandwidth, latency)
    return HardwareProfile(
        "test",
        "",
        "chip",
        1e12,
        1e12,
        8,
        1,
        {"l": link},
        {a: AxisLink("l", False) for a in ("dp", "pp", "tp")},
    )


def _unit_costs(schedule: Schedule, w: float | None = None) -> Costs:
    """F = B = W = 1; a non-split B costs 1 in total unless ``w`` is given."""
    n = schedule.stages * schedule.virtual_stages
    weight = w if w is not None else (1.0 if schedule.split_backward else 0.0)
    return Costs.uniform(n, 1.0, 1.0, weight)


@pytest.mark.parametrize(
    "name,p,m,v",
    [
        ("gpipe", 4, 8, 1),
        ("1f1b", 4, 8, 1),
        ("1f1b", 3, 5, 1),
        ("interleaved", 4, 8, 2),
        ("interleaved", 2, 6, 3),
        ("zb-h1", 4, 8, 1),
    ],
)
def test_zero_comm_bubble_matches_formula(name, p, m, v):
    s = make_schedule(name, p, m, v)
    r = simulate(Plan(s), _unit_costs(s), _hw(latency=0.0))
    assert r.bubble_rate == pytest.approx(bubble_formula(name, p, m, v), abs=1e-12)
    if name in ("gpipe", "1f1b"):
        assert r.bubble_rate == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    if name == "interleaved":
        assert r.bubble_rate == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    assert r.exposed_comm_s == 0 and r.ccor == 0


def test_zb_h1_below_1f1b_at_equal_work():
    p, m = 4, 8
    one = simulate(Plan(make_schedule("1f1b", p, m)), Costs.uniform(p, 1.0, 1.0, 1.0), _hw())
    zb = simulate(Plan(make_schedule("zb-h1", p, m)), Costs.uniform(p, 1.0, 1.0, 1.0), _hw())
    assert zb.bubble_rate < one.bubble_rate
    assert zb.step_time_s < one.step_time_s


def test_slow_link_increases_exposed_comm_and_step_time():
    s = make_schedule("1f1b", 4, 8)
    costs = Costs.uniform(4, 1.0, 1.0, 1.0, act_bytes=1e9, tp_bytes=1e9)
    base = load_profile("h100_8x_nvlink")
    results = []
    for bw in (1e12, 1e10, 3e9, 1e9, 3e8):
        slow = Link("slow", bw, 1e-3)
        hw = base.with_link("pp", slow).with_link("tp", slow)
        assert hw.link("pp") == slow and hw.link("dp").name == "nvlink"
        results.append(simulate(Plan(s, tp=2), costs, hw))
    steps = [r.step_time_s for r in results]
    exposed = [r.exposed_comm_s for r in results]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    assert exposed == sorted(exposed) and len(set(exposed)) == len(exposed)


def test_dp_buckets_overlap_last_backward_but_one_late_bucket_is_exposed():
    s = make_schedule("1f1b", 4, 8)
    costs = Costs.uniform(4, 1.0, 1.0, 1.0)
    hw = _hw(bandwidth=4e9)
    four = simulate(Plan(s, dp=2, grad_buckets=(1e9,) * 4), costs, hw)
    assert four.ccor > 0
    # Only the last bucket, produced at the very end of the backward, is exposed.
    assert four.exposed_comm_s == pytest.approx(all_reduce_time(1e9, 2, hw.link("dp")))
    one = simulate(Plan(s, dp=2, grad_buckets=(4e9,)), costs, hw)
    late = simulate(
        Plan(s, dp=2, grad_buckets=(1e9,) * 4, bucket_issue="after_backward"), costs, hw
    )
    for r in (one, late):
        assert r.ccor == 0
        assert r.exposed_comm_s == pytest.approx(all_reduce_time(4e9, 2, hw.link("dp")))
        assert r.step_time_s > four.step_time_s
    assert simulate(Plan(s, dp=1, grad_buckets=(4e9,)), costs, hw).exposed_comm_s == 0


def test_fsdp_window_hides_all_gathers():
    s = make_schedule("1f1b", 4, 8)
    costs = Costs.uniform(4, 1.0, 1.0, 1.0, param_bytes=1e9)
    hw = _hw(bandwidth=4e9)
    gather = all_gather_time(1e9, 4, hw.link("dp"))
    assert 0 < gather < 1.0  # shorter than an action, so one action can hide it
    on_demand = simulate(Plan(s, dp=4, fsdp=True, fsdp_window=0), costs, hw)
    prefetch = simulate(Plan(s, dp=4, fsdp=True, fsdp_window=1), costs, hw)
    actions_per_stage = 2 * 8  # every F and B gathers its stage's parameters
    assert on_demand.exposed_comm_s == pytest.approx(actions_per_stage * gather)
    # Only the very first gather, issued at t=0 with nothing to run under it, shows.
    assert prefetch.exposed_comm_s == pytest.approx(gather)
    assert prefetch.step_time_s < on_demand.step_time_s
    assert prefetch.peak_memory_bytes > on_demand.peak_memory_bytes  # one more buffer


def test_collective_matmul_hides_tp_comm():
    s = make_schedule("1f1b", 2, 4)
    costs = Costs.uniform(2, 1.0, 1.0, 1.0, tp_bytes=1e9)
    hw = _hw(bandwidth=4e9)
    plain = simulate(Plan(s, tp=4), costs, hw)
    cm = simulate(Plan(s, tp=4, tp_comm="collective_matmul"), costs, hw)
    per_action = all_reduce_time(1e9, 4, hw.link("tp"))
    assert plain.metrics.overlap_s == 0
    assert plain.exposed_comm_s == pytest.approx(2 * 4 * per_action)  # 4 F + 4 B per stage
    assert cm.exposed_comm_s < plain.exposed_comm_s and cm.ccor > 0
    # Ring steps of 1e9/4 bytes (0.0625 s) fit under each 1/8 s matmul chunk: fully hidden.
    assert cm.exposed_comm_s == 0
    assert cm.step_time_s < plain.step_time_s


def test_pipeline_sends_overlap_and_delay():
    p, m = 4, 8
    send = p2p_time(1e9, _hw(4e9).link("pp"))
    assert send == pytest.approx(0.25)
    free_costs = Costs.uniform(p, 1.0, 1.0, 0.0)
    costs = Costs.uniform(p, 1.0, 1.0, 0.0, act_bytes=1e9)
    for name in ("gpipe", "1f1b"):
        s = make_schedule(name, p, m)
        free = simulate(Plan(s), free_costs, _hw())
        slow = simulate(Plan(s), costs, _hw(bandwidth=4e9))
        assert slow.ccor > 0  # sends run while the stage computes its next action
        assert slow.step_time_s > free.step_time_s
        if name == "gpipe":
            # GPipe's critical path crosses each stage boundary once per direction:
            # 2(p-1) transfers; all other sends hide under the streaming microbatches.
            assert slow.step_time_s == pytest.approx(free.step_time_s + 2 * (p - 1) * send)


def test_simulated_events_round_trip_through_trace_parser():
    s = make_schedule("interleaved", 2, 4, 2)
    costs = Costs.uniform(4, 1.0, 1.5, 0.5, act_bytes=1e8, tp_bytes=1e8, param_bytes=5e8)
    plan = Plan(s, dp=2, tp=2, grad_buckets=even_buckets(1e9, 3e8), fsdp=True, fsdp_window=1)
    r = simulate(plan, costs, _hw(bandwidth=1e9, latency=1e-3), record_events=True)
    kinds = {(e.stream, e.kind) for e in r.events}
    assert {
        ("compute", "compute"),
        ("pp", "comm"),
        ("dp", "comm"),
        ("fsdp", "comm"),
        ("tp", "comm"),
    } <= kinds
    parsed = parse_trace(events_to_chrome_trace(r.events))
    assert parsed.step_time_s == pytest.approx(r.step_time_s)
    for key in ("compute_s", "comm_s", "overlap_s", "idle_s", "ccor", "bubble_rate"):
        assert getattr(parsed, key) == pytest.approx(getattr(r.metrics, key), abs=1e-9), key


def test_activation_memory_follows_schedule():
    p, m = 4, 8
    costs = Costs.uniform(p, 1.0, 1.0, 0.0, act_bytes=1.0, stash_bytes=10.0, param_bytes=100.0)
    gpipe = simulate(Plan(make_schedule("gpipe", p, m)), costs, _hw())
    one = simulate(Plan(make_schedule("1f1b", p, m)), costs, _hw())
    assert gpipe.memory[0].activations == 10.0 * m
    assert [mem.activations for mem in one.memory] == [10.0 * (p - d) for d in range(p)]
    assert one.memory[0].params == 100.0 and one.memory[0].optimizer == 200.0
    assert one.peak_memory_bytes == 100.0 + 100.0 + 200.0 + 10.0 * p
    sharded = simulate(Plan(make_schedule("1f1b", p, m), dp=4, fsdp=True), costs, _hw())
    assert sharded.memory[0].params == 25.0 and sharded.memory[0].gathered == 100.0


def test_deadlocking_order_is_reported():
    bad = Schedule(
        name="bad",
        stages=2,
        microbatches=1,
        virtual_stages=1,
        split_backward=False,
        placement=((0, 0), (1, 0)),
        grid=((Action("F", 0), None, Action("B", 0)), (None, Action("B", 0), Action("F", 0))),
    )
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(Plan(bad), Costs.uniform(2, 1.0, 1.0, 0.0), _hw())
    with pytest.raises(ValueError, match="virtual stages"):
        simulate(Plan(make_schedule("1f1b", 2, 2)), Costs.uniform(3, 1.0, 1.0, 0.0), _hw())


def test_costs_from_model_flops():
    layers, d, heads, dff, vocab, seq, mb = 4, 64, 4, 256, 1000, 32, 2
    c = costs_from_model(
        layers,
        d,
        heads,
        dff,
        vocab,
        seq,
        mb,
        tp=2,
        dtype_bytes=2,
        chip_flops=1e12,
        efficiency=0.5,
        num_virtual_stages=2,
    )
    tokens = mb * seq
    params = 4 * d * d + 2 * d * dff
    f_layer = 2 * params * tokens + 4 * seq * seq * d * mb
    rate = 1e12 * 0.5 * 2  # per-device rate times tp (work is split over tp ranks)
    assert c.forward_s[0] == pytest.approx(2 * f_layer / rate)
    assert c.backward_s[0] + c.weight_s[0] == pytest.approx(2 * c.forward_s[0])
    head = 2 * d * vocab * tokens
    assert c.forward_s[1] == pytest.approx((2 * f_layer + head) / rate)
    assert c.act_bytes == tokens * d * 2
    assert c.tp_bytes[0] == 2 * 2 * tokens * d * 2
    assert c.param_bytes[0] == pytest.approx((2 * params + vocab * d) * 2 / 2)
    assert costs_from_model(layers, d, heads, dff, vocab, seq, mb, 1, 2, 1e12, 0.5).tp_bytes == (
        0.0,
    )


def test_costs_from_measurement_times_callables():
    import jax
    import jax.numpy as jnp

    x = jnp.ones((128, 128))
    small = jax.jit(lambda: x @ x)
    big = jax.jit(lambda: (x @ x) @ (x @ x) @ x)
    c = costs_from_measurement([small, small], [big, big], act_bytes=64.0, repeats=3)
    assert c.num_virtual_stages == 2
    assert all(t > 0 for t in c.forward_s + c.backward_s)
    assert c.weight_s == (0.0, 0.0)
    assert simulate(Plan(make_schedule("1f1b", 2, 2)), c, _hw()).step_time_s > 0


@pytest.mark.parametrize("name", PROFILES)
def test_profiles_load_with_sources(name):
    hw = load_profile(name)
    assert hw.name == name and hw.chip_flops > 0 and hw.memory_bytes > 0
    for axis in ("dp", "pp", "tp"):
        assert hw.link(axis).effective_bandwidth > 0
    assert {"chip.flops", "chip.memory_bytes"} <= set(hw.sources)
    assert all(src.strip() for src in hw.sources.values())
    if name == "cpu_here":
        assert "measured here" in hw.sources["chip.flops"]
    if name == "h100_4x8_infiniband":
        assert hw.axes["tp"].link == "nvlink" and not hw.axes["tp"].crosses_hosts
        assert hw.axes["dp"].crosses_hosts and hw.link("dp").bandwidth_bytes_per_s == 50e9


def test_profile_errors_are_one_line(tmp_path):
    with pytest.raises(ProfileError, match="no such file") as err:
        load_profile("no_such_profile")
    assert "\n" not in str(err.value)
    broken = tmp_path / "broken.yaml"
    text = (Path(__file__).parents[1] / "configs" / "hardware" / "h100_8x_nvlink.yaml").read_text()
    broken.write_text(text.replace("    latency_s:", "    latency_z:"))
    with pytest.raises(ProfileError, match=r"missing field 'links\.nvlink\.latency_s'") as err:
        load_profile(broken)
    assert "\n" not in str(err.value)
    with pytest.raises(ProfileError, match="not a number"):
        profile_from_dict(
            {"links": {"l": {"bandwidth_bytes_per_s": {"value": "fast", "source": "x"}}}}
        )


def test_synchronous_collectives_serialise_communication():
    s = make_schedule("1f1b", 1, 4)  # one stage: F, B, F, B, ...
    costs = Costs.uniform(1, 1.0, 1.0, 0.0)
    plan = Plan(s, dp=2, grad_buckets=(1e9,) * 4)
    hw = _hw(bandwidth=4e9)
    bucket = all_reduce_time(1e9, 2, hw.link("dp"))
    overlapped = simulate(plan, costs, hw)
    assert overlapped.step_time_s == pytest.approx(8.0 + bucket)  # only the last bucket shows
    sync = simulate(plan, costs, dataclasses.replace(hw, synchronous_collectives=True))
    assert sync.ccor == 0 and sync.metrics.synchronous_collectives
    assert sync.step_time_s == pytest.approx(8.0 + 4 * bucket)
    assert load_profile("cpu_here").synchronous_collectives
    assert not load_profile("h100_8x_nvlink").synchronous_collectives


def test_measure_local_runs_on_forced_devices():
    m = measure_local(matmul_n=64, psum_bytes=1 << 14, loop=2, repeats=2)
    assert m.devices == 8
    assert m.matmul_flops > 0 and m.psum_bus_bandwidth > 0 and m.psum_latency_s > 0


# ------------------------------------------------------------- tick timing, vocab-parallel


@pytest.mark.parametrize("name,paired", [("zb-v", False), ("zb-v", True), ("1f1b", False),
                                         ("zb-h1", True)])
def test_tick_timing_lies_between_event_driven_and_global_lockstep(name, paired):
    """The executor's ticks: each stage waits for its ring neighbours at every permute. At
    equal costs that is the table's bubble; with unequal ones it is at least the event-driven
    bubble (which never waits for a neighbour it takes nothing from) and at most the global
    lockstep one (every tick as long as the slowest stage's, `weighted_bubble_fraction`)."""
    from jax_overlap.pipeline.schedules import bubble_fraction, weighted_bubble_fraction

    v = 2 if name == "zb-v" else 1
    s = make_schedule(name, 4, 8, v, 1, paired)
    n = 4 * v
    equal = simulate(Plan(s), Costs.uniform(n, 1.0, 1.0, 1.0), _hw(), timing="ticks")
    if not paired and s.split_backward:
        assert equal.bubble_rate == pytest.approx(bubble_fraction(s), abs=1e-9)
    cost = {"F": 1.0, "B": 1.4, "W": 0.6}  # a non-split B costs B + W
    costs = Costs.uniform(n, cost["F"], cost["B"], cost["W"])
    events = simulate(Plan(s), costs, _hw()).bubble_rate
    ticks = simulate(Plan(s), costs, _hw(), timing="ticks").bubble_rate
    lockstep = weighted_bubble_fraction(s, cost)
    assert events - 1e-9 <= ticks <= lockstep + 1e-9, (events, ticks, lockstep)
    with pytest.raises(ValueError, match="timing"):
        simulate(Plan(s), costs, _hw(), timing="lockstep")


def test_tick_timing_waits_for_a_slow_neighbour_only():
    """One slow action delays the stage's ring neighbours at that tick's permute; a stage two
    hops away feels it only a tick later, through its neighbour."""
    s = make_schedule("1f1b", 3, 3)
    fast = simulate(Plan(s), Costs.uniform(3, 1.0, 1.0, 0.0), _hw(), timing="ticks",
                    record_events=True)
    slow_f = Costs(forward_s=(3.0, 1.0, 1.0), backward_s=(1.0,) * 3, weight_s=(0.0,) * 3)
    slow = simulate(Plan(s), slow_f, _hw(), timing="ticks", record_events=True)
    # Tick 0: only stage 0 runs (its F costs 3); stage 1 is its neighbour and waits, stage 2
    # is not on a permute with stage 0 (1f1b sends +1 and -1 only between neighbours).
    def first_start(r, stage):
        return min(e.start_s for e in r.events if e.stage == stage and e.kind == "compute")
    assert first_start(fast, 1) == pytest.approx(1.0)
    assert first_start(slow, 1) == pytest.approx(3.0)
    assert slow.step_time_s > fast.step_time_s


@pytest.mark.parametrize("timing", ["events", "ticks"])
def test_vocab_parallel_head_phase_runs_on_every_stage_at_once(timing):
    """Under a vocabulary-parallel head each last-stage F is followed by one head phase on
    every stage, all starting together, and that microbatch's last B starts after it."""
    s = make_schedule("zb-v", 4, 4, 2)
    costs = dataclasses.replace(Costs.uniform(8, 1.0, 1.0, 1.0, act_bytes=1e6), head_s=0.5)
    r = simulate(Plan(s, vocab_parallel=True), costs, _hw(), record_events=True, timing=timing)
    heads = [e for e in r.events if e.name.startswith("H ")]
    assert len(heads) == 4 * s.microbatches  # one per microbatch, on each of the 4 stages
    for mb in range(s.microbatches):
        mine = [e for e in heads if e.name == f"H mb{mb}"]
        assert {e.stage for e in mine} == {0, 1, 2, 3}
        assert len({round(e.start_s, 12) for e in mine}) == 1
        last_b = next(e for e in r.events if e.name == f"B mb{mb} vs7")
        assert last_b.start_s >= max(e.end_s for e in mine) - 1e-12
    without = simulate(Plan(s), costs, _hw(), timing=timing)
    assert r.step_time_s > without.step_time_s  # the phases' compute is extra here


def test_costs_from_model_spreads_a_vocab_parallel_head():
    """vocab_shards: the last virtual stage costs what a middle one does and every stage's
    head phase is the head's three passes over the shards."""
    args = (8, 64, 4, 256, 50000, 32, 2, 1, 2, 1e12, 0.5)
    whole = costs_from_model(*args, num_virtual_stages=4)
    spread = costs_from_model(*args, num_virtual_stages=4, vocab_shards=4)
    assert whole.head_s == 0.0
    assert spread.forward_s[3] == pytest.approx(spread.forward_s[2])
    head = whole.forward_s[3] - whole.forward_s[2]  # one pass of the head
    assert spread.head_s == pytest.approx(3 * head / 4)
