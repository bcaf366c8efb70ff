"""Calibration and the tuner: valid plans, deterministic ranking, configs that train."""

import dataclasses
import json

import jax
import pytest
from helpers import TINY, run_cli

from jax_overlap import config
from jax_overlap.analysis import calibrate as cal_lib
from jax_overlap.analysis import plan_costs, plan_shape
from jax_overlap.analysis import tune
from jax_overlap.hardware.link_profiles import load_profile
from jax_overlap.analysis.simulate import simulate
from jax_overlap.training import loop as train

H100 = "h100_8x_nvlink"


@pytest.fixture(scope="module")
def tiny():
    return config.load(TINY)


@pytest.fixture(scope="module")
def calibration(tiny):
    """The pieces the tiny model's plans need, at one shape (compiling dominates)."""
    quantities = set()
    for _, cfg in tune.enumerate_candidates(tiny, 8, bucket_sizes_mb=(0.0,), windows=(2,)):
        plan = tune.plan_of(cfg)
        quantities.update(plan_shape.quantities_for(cfg, plan, plan.split_backward))
    return cal_lib.calibrate(tiny, [(2, 1)], devices=jax.devices()[:8],
                             quantities=sorted(quantities), groups=(2, 4, 8), pipelines={2: 8192},
                             repeats=2)


def test_candidates_are_valid_and_cover_the_space(tiny):
    cands = tune.enumerate_candidates(tiny, 8)
    assert len(cands) == len({c for c, _ in cands})  # no duplicates
    for cand, cfg in cands:
        config.validate(cfg)
        assert cfg.mesh.dp * cfg.mesh.tp * cfg.mesh.pp == 8
        assert (cfg.mesh.dp, cfg.mesh.tp, cfg.mesh.pp) == (cand.dp, cand.tp, cand.pp)
    meshes = {(c.dp, c.tp, c.pp) for c, _ in cands}
    # tiny: heads=4 caps tp at 4, two layers cap pp at 2.
    assert meshes == {(8, 1, 1), (4, 2, 1), (2, 4, 1), (4, 1, 2), (2, 2, 2), (1, 4, 2)}
    # Two layers leave no room for a second chunk per stage (interleaved, zb-v).
    assert {c.schedule for c, _ in cands if c.pp > 1} == {"gpipe", "1f1b", "zb-h1"}
    assert {c.schedule for c, _ in cands if c.pp == 1} == {"1f1b"}
    assert any(c.fsdp for c, _ in cands) and any(c.grad_bucket_mb > 0 for c, _ in cands)
    assert not any(c.fsdp for c, _ in cands if c.dp == 1)


def test_flop_ranking_is_deterministic_and_sorted(tiny):
    a = tune.tune(tiny, 8, H100)
    b = tune.tune(tiny, 8, H100)
    assert [p.candidate for p in a.plans] == [p.candidate for p in b.plans]
    keys = [p.sort_key() for p in a.plans]
    assert keys == sorted(keys)
    fits = [p.fits for p in a.plans]
    assert fits == sorted(fits, reverse=True)  # fitting plans first
    assert a.costs == "flops" and a.best.fits


def _slow_link(hw, axis: str, factor: float):
    link = hw.link(axis)
    return hw.with_link(axis, dataclasses.replace(
        link, name=f"slow_{axis}", bandwidth_bytes_per_s=link.bandwidth_bytes_per_s / factor))


def test_a_slow_pp_link_moves_the_best_plan_off_the_pipeline(tiny):
    """Known answer (FLOP-priced, no measuring): on 8 H100s over NVLink the tiny model's best
    plan is pipelined (dp2 tp2 pp2). With the pp axis on a link 10^4 times slower, only
    pipelined plans pay (every pp=1 prediction is unchanged, every pp>1 one grows) and the
    tuner's best plan has pp=1, which the simulator, run directly, finds faster there than the
    old winner."""
    hw = load_profile(H100)
    slow = _slow_link(hw, "pp", 1e4)
    sweep = dict(bucket_sizes_mb=(0.0,), windows=(2,))
    fast_r, slow_r = tune.tune(tiny, 8, hw, **sweep), tune.tune(tiny, 8, slow, **sweep)
    fast_t = {p.candidate: p.step_time_s for p in fast_r.plans}
    slow_t = {p.candidate: p.step_time_s for p in slow_r.plans}
    assert set(fast_t) == set(slow_t)
    assert all(slow_t[c] == pytest.approx(fast_t[c], rel=1e-12) for c in fast_t if c.pp == 1)
    assert all(slow_t[c] > fast_t[c] for c in fast_t if c.pp > 1)
    old, new = fast_r.best, slow_r.best
    assert old.candidate.pp == 2 and new.candidate.pp == 1

    def simulated(pred):
        plan = tune.plan_of(pred.config)
        return simulate(tune.sim_plan(pred.config, plan), tune.flop_costs(pred.config, slow),
                        slow).step_time_s

    assert simulated(new) < simulated(old)
    assert simulated(new) == pytest.approx(new.step_time_s, rel=1e-12)


def test_calibration_costs_are_positive(tiny, calibration):
    assert calibration.matches(tiny) and calibration.devices == 8
    assert 1.0 <= calibration.parallel_capacity <= 8.0
    for q in ("block_f", "block_fb", "block1_fb", "embed_fb", "head_fb"):
        assert calibration.seconds(q, 2, 1) > 0, q
    assert calibration.optimizer_s(10_000) > 0
    assert set(calibration.links) >= {2, 4, 8}
    for link in calibration.links.values():
        assert link.latency_s > 0 and link.bandwidth_bytes_per_s > 0
    hw = load_profile("cpu_here")
    for cand in [tune.Candidate(2, 4, 1, 1, 2, "1f1b", 0.0, False, 1),
                 tune.Candidate(2, 2, 2, 1, 4, "zb-h1", 0.0, False, 1)]:
        cfg = tune.apply_candidate(tiny, cand)
        costs = plan_costs.costs_for_config(calibration, cfg, tune.plan_of(cfg), hw)
        assert all(f > 0 for f in costs.forward_s)
        assert all(b >= 0 for b in costs.backward_s) and sum(costs.backward_s) > 0
        assert all(t > 0 for t in costs.tp_bytes)
        r = simulate(tune.plan_for(cfg), costs, calibration.profile(hw, tune.plan_of(cfg)))
        assert r.step_time_s > sum(costs.forward_s) / cfg.mesh.pp
        assert r.ccor == 0  # synchronous CPU collectives never overlap


def test_calibrated_ranking_is_deterministic(tiny, calibration):
    a = tune.tune(tiny, 8, "cpu_here", calibration=calibration)
    b = tune.tune(tiny, 8, "cpu_here", calibration=calibration)
    assert a.costs == "calibrated"
    assert [p.candidate for p in a.plans] == [p.candidate for p in b.plans]
    assert all(p.optimizer_s > 0 for p in a.plans)


def test_a_pipelined_prediction_pays_the_measured_tick_loop(tiny, calibration):
    """Every tick of the executor's loop costs its switch and its permutes' rendezvous
    whatever the action (on a CPU host, most of a small model's pipeline step): a pipelined
    plan's prediction adds its ticks (lanes, where paired) times the measured tick."""
    tick = calibration.ticks[2]
    assert set(calibration.ticks) == {2} and tick.fixed_s > 0 and tick.per_byte_s >= 0
    assert calibration.tick_s(2, 8192) == pytest.approx(tick.fixed_s + 8192 * tick.per_byte_s)
    assert calibration.tick_s(4, 8192) == 0.0  # not measured
    hw = load_profile("cpu_here")
    for cand, lanes in [(tune.Candidate(4, 1, 2, 1, 4, "1f1b", 0.0, False, 1), 1),
                        (tune.Candidate(4, 1, 2, 1, 4, "1f1b", 0.0, False, 1, paired=True), 2),
                        (tune.Candidate(2, 2, 2, 1, 4, "zb-h1", 0.0, False, 1), 1)]:
        cfg = tune.apply_candidate(tiny, cand)
        schedule = tune.plan_of(cfg).schedule
        assert schedule.paired == (lanes == 2)
        p = tune.predict(cand, cfg, hw, calibration)
        act = plan_costs.activation_bytes(cfg, tune.plan_of(cfg))
        assert p.tick_loop_s == pytest.approx(schedule.ticks * lanes * calibration.tick_s(2, act))
        assert p.step_time_s == pytest.approx(p.simulated_s + p.tick_loop_s + p.optimizer_s)
        without = tune.predict(cand, cfg, hw, dataclasses.replace(calibration, ticks={}))
        assert without.tick_loop_s == 0.0
        assert p.step_time_s - without.step_time_s == pytest.approx(p.tick_loop_s)
    flat = tune.Candidate(8, 1, 1, 1, 2, "1f1b", 0.0, False, 1)
    assert tune.predict(flat, tune.apply_candidate(tiny, flat), hw, calibration).tick_loop_s == 0


def test_pieces_fitted_to_zero_fall_back_to_flops(tiny, calibration):
    """A calibration whose split pieces come out 0 (what crashed `tune` on default.yaml with
    a ZeroDivisionError): those plans are priced by FLOPs, ranked after the calibrated ones,
    and the table says so."""
    split = set(cal_lib.SPLIT_QUANTITIES)
    zero = dataclasses.replace(
        calibration, split_ratios={q: 0.0 for q in split},
        samples=tuple(s for s in calibration.samples if s.quantity not in split))
    result = tune.tune(tiny, 8, "cpu_here", calibration=zero)
    fell = [p for p in result.plans if p.flop_fallback]
    split_plans = [p for p in result.plans if p.candidate.pp > 1
                   and tune.plan_of(p.config).schedule.split_backward]
    assert split_plans and {id(p) for p in fell} == {id(p) for p in split_plans}
    assert all(set(p.flop_fallback) <= split and len(p.flop_fallback) == 2 for p in fell)
    assert all(p.step_time_s > 0 for p in fell)
    fitting = [p for p in result.plans if p.fits]
    assert [bool(p.flop_fallback) for p in fitting] == sorted(
        bool(p.flop_fallback) for p in fitting)  # calibrated first
    assert not result.best.flop_fallback
    table = tune.format_table(result)
    assert f"note: {len(fell)} plans priced by FLOPs" in table and "block" in table


def test_calibration_is_checked_against_the_model(tiny, calibration):
    other = config.load(TINY, ["model.d_model=64"])
    with pytest.raises(ValueError, match="calibration"):
        tune.tune(other, 8, "cpu_here", calibration=calibration)


def test_fit_reproduces_affine_costs():
    pts = [(b, k, 1e-3 + 2e-4 * b + 3e-3 * b / k) for b, k in [(1, 1), (8, 1), (8, 4), (2, 2)]]
    fit = cal_lib.fit_points(pts)
    assert (fit.c0, fit.c1, fit.c2) == pytest.approx((1e-3, 2e-4, 3e-3), rel=1e-6)
    assert fit.at(4, 2) == pytest.approx(1e-3 + 8e-4 + 6e-3)


def test_tp_collectives_fold_latency_exactly():
    from jax_overlap.analysis.simulate import all_reduce_time

    link = load_profile("cpu_here").link("tp")
    sizes = [1e5, 3e5, 2e4]
    separate = sum(all_reduce_time(b, 4, link) for b in sizes)
    folded = plan_costs.latency_equivalent_bytes(len(sizes), sum(sizes), 4, link)
    assert all_reduce_time(folded, 4, link) == pytest.approx(separate)


def test_written_configs_validate_and_train(tiny, tmp_path):
    result = tune.tune(tiny, 8, H100)
    paths = []
    for i, p in enumerate(result.plans[:5]):
        paths.append(tune.write_config(p.config, str(tmp_path / f"plan{i}.yaml"),
                                       header=[p.candidate.label()]))
    loaded = [config.load(path) for path in paths]  # raises if any fails validation
    for p, cfg in zip(result.plans, loaded):
        assert cfg == p.config
    best = dataclasses.replace(loaded[0], train=dataclasses.replace(loaded[0].train, steps=2))
    run = train.run(best, str(tmp_path / "run"), progress=False, devices=jax.devices()[:8])
    assert run.steps == 2 and all(l == l for l in run.losses)  # finite (not NaN)


def test_tune_cli_json_writes_a_valid_config(tmp_path):
    out = tmp_path / "tuned.yaml"
    from jax_overlap.analysis import deviceless

    estimate = ["--estimate", "2"] if deviceless.plugin_available() else []
    proc = run_cli("tune", "--config", TINY, "--devices", "8", "--hardware", H100, "--json",
                   "--out", str(out), *estimate)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["costs"] == "flops" and doc["devices"] == 8
    if estimate:  # the top two plans compiled for 8 H100s, ranked by their step estimate
        rows = doc["estimated"]
        fitting = [p["plan"] for p in doc["plans"] if p["fits"]][:2]
        assert sorted(r["plan"] for r in rows) == sorted(fitting)
        assert rows[0]["step_ms"] <= rows[1]["step_ms"] and all(r["mfu"] > 0 for r in rows)
    plans = doc["plans"]
    assert len(plans) > 10 and plans[0]["plan"] == doc["best"]["plan"]
    times = [tune.significant(p["step_time_s"]) for p in plans if p["fits"]]
    assert times == sorted(times)
    cfg = config.load(str(out))
    assert cfg.num_devices == 8
    assert (cfg.mesh.dp, cfg.mesh.tp, cfg.mesh.pp) == (plans[0]["dp"], plans[0]["tp"],
                                                       plans[0]["pp"])


def test_tune_cli_rejects_impossible_device_count():
    proc = run_cli("tune", "--config", TINY, "--devices", "3", "--hardware", H100)
    assert proc.returncode == 2
    assert "--devices" in proc.stderr
