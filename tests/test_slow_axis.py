"""The slow axis (mesh.dcn): hierarchical reduction is exact, crosses dcn with 1/dp of the
bytes, restores across a dcn change; the one-step-late reduction (overlap.dcn_delay) and its
two-phase commit."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY, gpt_reference, max_rel_err, rel

from jax_overlap import config
from jax_overlap.analysis import analyze as an
from jax_overlap.analysis.dcn_traffic import dcn_bytes_of_hlo
from jax_overlap.overlap import delay, slow_axis
from jax_overlap.parallel import mesh as meshlib
from jax_overlap.pipeline import layout
from jax_overlap.training.assemble import assemble
from jax_overlap.training import loop as train
from jax_overlap.training import step as steplib

MESH = ["mesh.dcn=2", "mesh.dp=2", "mesh.tp=2"]
PP = ["mesh.dcn=2", "mesh.pp=2", "mesh.dp=2", "mesh.tp=1", "pipeline.microbatches=2"]
CASES = {
    "plain": MESH,
    "zero1_buckets": pytest.param(MESH + ["overlap.zero1=true", "overlap.grad_bucket_mb=0.01"],
                                  marks=pytest.mark.slow),
    "buckets": pytest.param(MESH + ["overlap.grad_bucket_mb=0.01"], marks=pytest.mark.slow),
    "zero1": pytest.param(MESH + ["overlap.zero1=true"], marks=pytest.mark.slow),
    "fsdp": pytest.param(MESH + ["overlap.param_sharding=fsdp"], marks=pytest.mark.slow),
    "pp": pytest.param(PP, marks=pytest.mark.slow),
    "pp_buckets": pytest.param(PP + ["overlap.grad_bucket_mb=0.01"], marks=pytest.mark.slow),
    "pp_fsdp": pytest.param(PP + ["overlap.param_sharding=fsdp"], marks=pytest.mark.slow),
}


@pytest.fixture(scope="module")
def reference():
    return gpt_reference()


@pytest.mark.parametrize("overrides", list(CASES.values()), ids=list(CASES))
def test_hierarchical_reduction_matches_single_device(reference, overrides):
    model, params, batch, ref_loss, ref_grads = reference
    cfg = config.load(TINY, overrides)
    run = assemble(cfg, jax.devices()[:8], model=model)
    plan, mesh = run.plan, run.mesh
    assert plan.slow_mode == "sync" and plan.axis_sizes["dcn"] == 2
    assert mesh.axis_names == ("dcn", "dp", "pp", "tp")
    loss, grads = jax.jit(run.loss_and_grads())(run.place_params(params), run.put_batch(batch))
    assert rel(float(loss), ref_loss) <= 1e-5
    assert max_rel_err(layout.to_logical(grads, plan.layer_perm), ref_grads) <= 1e-5


@pytest.mark.parametrize("extra", [
    [], pytest.param(["overlap.zero1=true", "overlap.grad_bucket_mb=0.01"],
                     marks=pytest.mark.slow),
    pytest.param(["overlap.param_sharding=fsdp"], marks=pytest.mark.slow)],
    ids=["plain", "zero1_buckets", "fsdp"])
def test_delayed_gradient_summed_over_dcn_matches_single_device(reference, extra):
    """overlap.dcn_delay=1: the step's per-dcn-group gradients (reduced over dp only), summed
    over dcn as the next step does, are the single-device gradients."""
    model, params, batch, ref_loss, ref_grads = reference
    cfg = config.load(TINY, MESH + ["overlap.dcn_delay=1", "overlap.dcn_delay_mode=gradient",
                                    *extra])
    run = assemble(cfg, jax.devices()[:8], model=model)
    plan, mesh = run.plan, run.mesh
    assert plan.slow_mode == "delay"
    loss_and_grads = run.loss_and_grads()

    def step(p, b):
        loss, copies = loss_and_grads(p, b)
        return loss, copies, slow_axis.dcn_sum(copies, mesh, steplib.grad_out_specs(plan))

    loss, copies, grads = jax.jit(step)(run.place_params(params), run.put_batch(batch))
    assert copies["embed"]["wte"].shape == (2, *params["embed"]["wte"].shape)
    assert rel(float(loss), ref_loss) <= 1e-5
    assert max_rel_err(grads, ref_grads) <= 1e-5
    assert max_rel_err(jax.tree.map(lambda c: c[0], copies), ref_grads) > 1e-3  # one group's


def _dcn_bytes(overrides):
    cfg = config.load(TINY, overrides)
    built = an.build_plan(cfg)
    text = an.lower_train_step(cfg, jax.devices()[:8], "cpu", built).compile().as_text()
    # Gradient-sized collectives only: the loss and count scalars cross in every layout.
    return dcn_bytes_of_hlo(text, 4), built.plan


def test_hierarchical_reduction_sends_one_dp_th_of_the_flat_bytes_across_dcn():
    """From the compiled HLO: with the same 8 devices as 2 hosts x 4, a flat dp=4 all-reduce
    crosses hosts with the whole gradient; dcn=2 x dp=2 with half of it."""
    flat, _ = _dcn_bytes(["mesh.dp=4", "mesh.tp=2"])
    hier, plan = _dcn_bytes(MESH)
    scalars = 64  # the loss psum crosses in both
    assert flat["bytes_per_step"] >= plan.grad_bytes
    assert hier["bytes_per_step"] <= flat["bytes_per_step"] / plan.dp + scalars, (flat, hier)
    assert hier["by_kind"].keys() == {"all-reduce"}  # the dcn psum; scatter/gather stay in


@pytest.mark.slow
def test_delayed_reduction_is_hierarchical_too():
    hier, plan = _dcn_bytes(MESH + ["overlap.dcn_delay=1"])
    assert hier["bytes_per_step"] <= plan.grad_bytes / plan.dp * 1.01 + 64, hier


# --------------------------------------------------------------------- the delayed update


def test_in_flight_gradient_of_another_version_is_not_applied():
    mesh = meshlib.make_mesh(2, 1, 1, jax.devices()[:4], dcn=2)
    specs = {"w": jax.sharding.PartitionSpec()}
    fresh = delay.init({"w": jnp.zeros((3,))}, 2)
    assert int(fresh.version) == -1
    copies = jnp.stack([jnp.ones(3), 2 * jnp.ones(3)])  # two dcn groups' gradients
    put = jax.device_put(copies, jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec("dcn")))
    inflight = delay.launch({"w": put}, jnp.int32(5))
    summed, valid = jax.jit(lambda f, v: delay.arrived(f, v, mesh, specs))(inflight,
                                                                          jnp.int32(5))
    np.testing.assert_allclose(summed["w"], 3 * np.ones(3))
    assert bool(valid)
    _, valid = jax.jit(lambda f, v: delay.arrived(f, v, mesh, specs))(inflight, jnp.int32(6))
    assert not bool(valid)
    assert not bool(delay.select(valid, jnp.ones(()), jnp.zeros(())))


def test_delayed_training_is_one_device_training_with_the_gradient_one_step_late(tmp_path):
    """dcn=2 x dp=2 x tp=2 with overlap.dcn_delay=1 reproduces, step by step, a single-device
    loop whose optimizer applies each step's gradient at the next step (fp32)."""
    import optax
    from helpers import np_batch

    from jax_overlap.training import grads as gradslib
    from models.gpt import GPT

    cfg = config.load(TINY, MESH + ["overlap.dcn_delay=1", "overlap.dcn_delay_mode=gradient",
                                    "train.steps=5", "guard.enabled=false"])
    run = train.run(cfg, str(tmp_path / "run"), progress=False, devices=jax.devices()[:8])
    model = GPT.from_config(cfg.model)
    params = model.init(jax.random.key(cfg.train.seed))
    opt = steplib.make_optimizer(cfg.train)
    opt_state = opt.init(params)
    value_and_grad = jax.jit(jax.value_and_grad(
        lambda p, b: gradslib.reference_loss(model, p, b)))
    pending, losses = None, []
    for t in range(5):
        loss, g = value_and_grad(params, np_batch(cfg, t))
        losses.append(float(loss))
        if pending is not None:
            updates, opt_state = opt.update(pending, opt_state, params)
            params = optax.apply_updates(params, updates)
        pending = g
    assert max(rel(a, b) for a, b in zip(run.losses, losses)) <= 1e-5, (run.losses, losses)
    assert losses[1] != losses[2]  # updates were applied


def _records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("mode", ["local", pytest.param("gradient", marks=pytest.mark.slow)])
def test_nan_with_delay_rolls_back_and_drops_the_undone_in_flight_gradient(tmp_path, mode):
    """A NaN at step 3 is rejected (never in flight); the rollback restores the checkpoint of
    step 2, whose in-flight gradient (mode local: the groups' updates) belongs to the undone
    timeline: the first step after the rollback applies nothing, the next one applies its
    successor's."""
    cfg = config.load(TINY, MESH + [
        "overlap.dcn_delay=1", f"overlap.dcn_delay_mode={mode}", "train.steps=6", "fault.nan_at_step=3", "guard.max_skips=0",
        "checkpoint.every_steps=2", "checkpoint.async_save=false"])
    run_dir = str(tmp_path / "run")
    result = train.run(cfg, run_dir, progress=False, devices=jax.devices()[:8])
    assert result.extra["rollbacks"] == 1 and result.extra["final_step"] == 6
    assert np.isfinite(result.losses).all()
    records = _records(run_dir)
    events = [r.get("event") for r in records]
    steps = [r for r in records if "loss" in r]
    assert all(r["dcn_delay"] == 1 for r in steps) and all("dcn_exposed_s" in r for r in steps)
    rb = events.index("rollback")
    before = [r for r in records[:rb] if "loss" in r]
    after = [r for r in records[rb + 1:] if "loss" in r]
    assert [r["dcn_applied"] for r in before] == [False, True, True, True]  # the NaN: skipped
    assert before[-1].get("skipped")
    assert after[0]["step"] == 3 and after[0]["dcn_applied"] is False
    assert all(r["dcn_applied"] for r in after[1:])


@pytest.mark.slow
def test_checkpoint_restores_across_a_dcn_change(tmp_path):
    """dcn=2 x dp=2 saves; dcn=1 x dp=4 (the same data parallelism, one host) resumes and
    ends where an uninterrupted dp=4 run ends (the checkpoint's layout is logical)."""
    ck = ["checkpoint.every_steps=2", "checkpoint.async_save=false"]
    first = config.load(TINY, MESH + ["train.steps=2", *ck])
    run_dir = str(tmp_path / "a")
    train.run(first, run_dir, progress=False, devices=jax.devices()[:8])
    second = config.load(TINY, ["mesh.dp=4", "mesh.tp=2", "train.steps=4", *ck])
    resumed = train.run(second, run_dir, progress=False, devices=jax.devices()[:8])
    assert resumed.extra["resumed_from"] == 2
    straight = train.run(config.load(TINY, ["mesh.dp=4", "mesh.tp=2", "train.steps=4"]),
                         str(tmp_path / "b"), progress=False, devices=jax.devices()[:8])
    assert max(rel(a, b) for a, b in zip(resumed.losses, straight.losses[2:])) <= 1e-4


# --------------------------------------------------------------------------- config errors


@pytest.mark.parametrize("overrides,field", [
    (["overlap.dcn_delay=1"], "overlap.dcn_delay"),
    (["overlap.dcn_delay=2", "mesh.dcn=2"], "overlap.dcn_delay"),
    (["mesh.dcn=0"], "mesh.dcn"),
    (["mesh.dcn=3", "train.global_batch=8"], "train.global_batch"),
    (["diloco.inner_steps=8"], "diloco.inner_steps"),
    (["diloco.inner_steps=8", "mesh.dcn=2", "diloco.fragments=3"], "diloco.fragments"),
    (["diloco.inner_steps=8", "mesh.dcn=2", "diloco.fragments=2", "diloco.delay=4"],
     "diloco.delay"),
    (["diloco.inner_steps=8", "mesh.dcn=2", "overlap.dcn_delay=1"], "overlap.dcn_delay"),
    (["mesh.dcn=2", "overlap.dcn_delay=1", "overlap.dcn_delay_mode=late"],
     "overlap.dcn_delay_mode"),
    (["mesh.dcn=2", "overlap.dcn_delay=1", "overlap.dcn_delay_mode=local",
      "overlap.dcn_delay_compensation=0.1"], "overlap.dcn_delay_compensation"),
])
def test_slow_axis_config_errors_name_the_field(overrides, field):
    with pytest.raises(config.ConfigError) as e:
        config.load(TINY, overrides)
    assert any(p.startswith(field + ":") for p in e.value.problems), e.value.problems


# ----------------------------------------------------------------- simulator and tuner


def test_gpt_1p3b_on_two_hosts_at_100_gbps_simulated():
    """configs/hardware/h100_2x8_100g: the flat reduction puts the whole gradient on the slow
    link; hierarchical 1/dp of it; one step late it hides under the next step; DiLoCo sends
    1/H of it (bf16: half again) per inner step."""
    from jax_overlap.analysis import tune
    from jax_overlap.hardware.link_profiles import load_profile

    hw = load_profile("h100_2x8_100g")
    cfg = config.load(os.path.join(os.path.dirname(TINY), "gpt_1p3b.yaml"),
                      ["mesh.dcn=2", "mesh.dp=8", "overlap.grad_bucket_mb=0"])
    rows = {r["mode"]: r for r in tune.slow_axis_modes(cfg, hw)}
    flat, hier, late, dl = (rows[m] for m in ("flat", "hierarchical", "delay1", "diloco"))
    assert hier["dcn_bytes_per_step"] <= flat["dcn_bytes_per_step"] / 8
    assert flat["exposed_dcn_s"] > 10 * hier["exposed_dcn_s"] > 0
    assert late["exposed_dcn_s"] == 0 and late["step_time_s"] < hier["step_time_s"]
    assert dl["dcn_bytes_per_step"] <= hier["dcn_bytes_per_step"] / 8
    assert tune.best_slow_mode(list(rows.values()))["mode"] == "hierarchical"


def test_tuner_search_on_two_hosts_at_100_gbps_picks_a_hierarchical_dcn_plan():
    """On h100_2x8_100g the tuner's main search lays dp across the two hosts both ways: flat
    (the dp all-reduce on the 100 Gb/s link) and mesh.dcn = 2 (hierarchical, one step late,
    DiLoCo). The best plan (exact: one device's training) is hierarchical over dcn; the same
    layout flat is ranked and much slower; the stale modes are ranked but not picked."""
    from jax_overlap.analysis import tune

    cfg = config.load(os.path.join(os.path.dirname(TINY), "gpt_1p3b.yaml"), [])
    result = tune.tune(cfg, 16, "h100_2x8_100g", bucket_sizes_mb=(64.0,), max_microbatches=1)
    best = result.best
    assert best.candidate.dcn == 2 and best.candidate.slow == "hierarchical"
    assert best.config.mesh.dcn == 2 and best.config.mesh.dp * best.config.mesh.tp * \
        best.config.mesh.pp == 8 and best.config.overlap.dcn_delay == 0
    flat = next(p for p in result.plans if p.candidate == dataclasses.replace(
        best.candidate, dcn=1, dp=2 * best.candidate.dp, slow="flat"))
    assert flat.step_time_s > 1.5 * best.step_time_s
    modes = {p.candidate.slow.split(":")[0] for p in result.plans}
    assert {"flat", "hierarchical", "delay1", "diloco"} <= modes
    assert all(p.config.mesh.dcn == (1 if p.candidate.slow == "flat" else 2)
               for p in result.plans)
    stale = tune.TuneResult(**{**result.__dict__, "allow_stale": True}).best
    assert stale.step_time_s <= best.step_time_s
    table = tune.format_table(result)
    assert best.candidate.label() in table and "dcn2 dp" in table


def test_local_delay_mode_is_each_group_stepping_on_its_own_gradient_then_the_mean(tmp_path):
    """overlap.dcn_delay_mode=local on dcn=2 x dp=2 x tp=2 reproduces, step by step, a
    single-device loop over two groups (each on its half of the batch, its own AdamW state):
    group k steps from theta + u^k_{t-1}; theta moves by the groups' mean update one step
    late. fp32, <= 1e-5; the groups' parameters differ by their last own update only."""
    from helpers import np_batch

    from jax_overlap.training import grads as gradslib
    from models.gpt import GPT

    steps = 5
    cfg = config.load(TINY, MESH + ["overlap.dcn_delay=1", "overlap.dcn_delay_mode=local",
                                    f"train.steps={steps}", "guard.enabled=false"])
    run = train.run(cfg, str(tmp_path / "run"), progress=False, devices=jax.devices()[:8])
    model = GPT.from_config(cfg.model)
    theta = model.init(jax.random.key(cfg.train.seed))
    opt = steplib.make_optimizer(cfg.train)
    states = [opt.init(theta), opt.init(theta)]
    value_and_grad = jax.jit(jax.value_and_grad(
        lambda p, b: gradslib.reference_loss(model, p, b)))
    last = [jax.tree.map(jnp.zeros_like, theta)] * 2
    losses = []
    for t in range(steps):
        batch = np_batch(cfg, t)
        half = len(batch["inputs"]) // 2
        ups, loss = [], 0.0
        for k in range(2):
            part = {key: v[k * half:(k + 1) * half] for key, v in batch.items()}
            local = jax.tree.map(jnp.add, theta, last[k])
            lk, g = value_and_grad(local, part)
            loss += float(lk) / 2
            u, states[k] = opt.update(g, states[k], local)
            ups.append(u)
        theta = jax.tree.map(lambda p, a, b: p + (a + b) / 2, theta, *last)
        last = ups
        losses.append(loss)
    assert max(rel(a, b) for a, b in zip(run.losses, losses)) <= 1e-5, (run.losses, losses)
    assert losses[1] != losses[2]
    # One own update apart at most: AdamW moves an element by about lr (x the bias
    # correction's first-step factor) per step.
    apart = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(*map(jax.tree.leaves, last)))
    assert 0 < apart <= 4 * cfg.train.lr


@pytest.mark.slow
def test_deviceless_two_host_gpu_compile_reports_the_dcn_bytes_and_their_overlap():
    """`analyze --target h100` with mesh.dcn=2 compiles for 2 hosts x 8 GPUs (topology 1x2x8)
    and reads the collectives that cross the hosts from that program: the hierarchical
    reduction's dcn all-reduces move 1/dp of what a flat dp16 reduction moves."""
    from jax_overlap.analysis import deviceless

    if not deviceless.plugin_available():
        pytest.skip(deviceless.unavailable_reason() or "no CUDA plugin")
    base = ["mesh.tp=1", "train.global_batch=32", "overlap.grad_bucket_mb=0.01"]
    cfg = config.load(TINY, base + ["mesh.dcn=2", "mesh.dp=8"])
    doc = json.loads(an.analyze_command(cfg, "h100", as_json=True))
    dcn = doc["dcn"]
    assert dcn["hosts"] == 2 and dcn["count_per_step"] > 0 and dcn["unknown"] == 0
    assert 0.0 <= dcn["under_gemm_fraction"] <= 1.0 and dcn["async_fraction"] > 0
    from models.gpt import GPT

    shapes = jax.eval_shape(GPT.from_config(cfg.model).init, jax.random.key(0))
    grad_bytes = 4 * sum(x.size for x in jax.tree.leaves(shapes))
    assert 0 < dcn["bytes_per_step"] <= grad_bytes / 8 + 64  # 1/dp of an fp32 gradient
