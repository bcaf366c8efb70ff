"""Uneven pipeline stages (`pipeline.stage_layers`): same loss and gradients as one device,
checkpoints in logical order across splits, `auto` balancing the head, bad lists refused.

Default run: a split-backward, a plain, an interleaved and a V schedule with uneven chunks on
pp4 x dp2 and pp2 x dp2 x tp2; `make test-slow` sweeps every schedule x mesh x remat.
"""

import os

import jax
import numpy as np
import pytest
from helpers import TINY, cached_references, max_rel_err, rel, run_cli, schedule_sweep

from jax_overlap import config
from jax_overlap.config import ConfigError
from jax_overlap.parallel import mesh as meshlib
from jax_overlap.pipeline import layout, schedules, stage_split
from jax_overlap.plan import Target
from jax_overlap.training.assemble import assemble, plan_for
from models.gpt import GPT

CHUNKS = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zb-h1": 1, "zb-v": 2}
LAYERS = 10  # not a multiple of 4 or 8: every pp4 split below is uneven

# Uneven splits per number of virtual stages (model order).
SPLITS = {2: [7, 3], 4: [3, 2, 4, 1], 8: [2, 1, 1, 2, 1, 1, 1, 1]}

# (schedule, pp, dp, tp, microbatches, tied, remat)
DEFAULT_CASES = [
    ("zb-h1", 4, 2, 1, 4, True, "none"),
    ("interleaved", 2, 2, 2, 4, True, "full"),
    ("zb-v", 4, 2, 1, 4, False, "none"),
]
SLOW_CASES = schedule_sweep([(4, 2, 1), (2, 2, 2)])
# Uneven stages with the rest of the overlap machinery: in-loop buckets (the chunk's last
# backward unrolled with bucket hooks), fsdp, ZeRO-1, latency-2 transfers.
COMPOSE_CASES = [
    ("1f1b", 2, 2, 2, 4, True, ["overlap.grad_bucket_mb=0.01"]),
    ("zb-v", 4, 2, 1, 4, False, ["overlap.param_sharding=fsdp", "pipeline.transfer_latency=2"]),
    ("interleaved", 2, 4, 1, 4, True, ["overlap.zero1=true", "overlap.grad_bucket_mb=0.05"]),
    ("zb-h1", 2, 2, 2, 4, False, ["pipeline.paired=true", "model.remat=save_dots"]),
]


def stage_cfg(name, pp, dp, tp, m, tied=True, split=None, extra=()):
    split = SPLITS[pp * CHUNKS[name]] if split is None else split
    return config.load(TINY, [
        f"mesh.pp={pp}", f"mesh.dp={dp}", f"mesh.tp={tp}", f"model.layers={LAYERS}",
        f"model.tied_embeddings={str(tied).lower()}", f"pipeline.schedule={name}",
        f"pipeline.microbatches={m}", f"pipeline.virtual_stages={CHUNKS[name]}",
        f"pipeline.stage_layers={split}".replace(" ", ""), *extra])


@pytest.fixture(scope="module")
def references():
    """Single-device loss and gradients, per tied/untied model (computed once each)."""
    return cached_references(lambda tied: stage_cfg("1f1b", 2, 4, 1, 2, tied))


def check_equivalence(references, name, pp, dp, tp, m, tied, remat, extra=()):
    cfg = stage_cfg(name, pp, dp, tp, m, tied, extra=[f"model.remat={remat}", *extra])
    model, params, batch, ref_loss, ref_grads = references(tied)
    run = assemble(cfg, jax.devices()[: dp * pp * tp], model=model)
    plan = run.plan
    assert list(plan.stage_layers) == SPLITS[pp * CHUNKS[name]]
    perm = plan.layer_perm
    assert len(perm) == pp * CHUNKS[name] * max(plan.stage_layers)  # padded to the largest
    loss, grads = jax.jit(run.loss_and_grads())(run.place_params(params), run.put_batch(batch))
    assert rel(float(loss), ref_loss) <= 1e-5, (float(loss), ref_loss)
    assert max_rel_err(layout.to_logical(grads, perm), ref_grads) <= 1e-5
    # Padded layers get exactly zero gradients (so their zero weights and moments stay zero).
    pad = np.asarray(perm) < 0
    for g in jax.tree.leaves(grads["blocks"]):
        assert not np.asarray(g)[pad].any()


@pytest.mark.parametrize("name,pp,dp,tp,m,tied,remat", DEFAULT_CASES)
def test_uneven_stages_match_single_device(references, name, pp, dp, tp, m, tied, remat):
    check_equivalence(references, name, pp, dp, tp, m, tied, remat)


@pytest.mark.slow
@pytest.mark.parametrize("name,pp,dp,tp,m,tied,remat", SLOW_CASES)
def test_uneven_stages_match_single_device_sweep(references, name, pp, dp, tp, m, tied, remat):
    check_equivalence(references, name, pp, dp, tp, m, tied, remat)


@pytest.mark.slow
@pytest.mark.parametrize("name,pp,dp,tp,m,tied,extra", COMPOSE_CASES)
def test_uneven_stages_compose_with_overlap(references, name, pp, dp, tp, m, tied, extra):
    check_equivalence(references, name, pp, dp, tp, m, tied, "none", extra)


def test_uneven_stages_with_paired_ticks(references):
    """Padded chunks and two lanes per tick together (zb-v: split backward, V placement)."""
    check_equivalence(references, "zb-v", 4, 2, 1, 8, True, "none", ["pipeline.paired=true"])


# ---------------------------------------------------------------------------------------------
# Checkpoints in logical order: save with one split, resume with another / on pp = 1.

RESUME = ["model.layers=6", "train.steps=4", "checkpoint.every_steps=2", "checkpoint.keep=5",
          "checkpoint.async_save=false", "pipeline.microbatches=4"]
SPLIT_A = ["mesh.dp=2", "mesh.pp=2", "mesh.tp=2", "pipeline.schedule=zb-h1",
           "pipeline.stage_layers=[5,1]"]
RESUME_ON = {
    "split_b": ["mesh.dp=2", "mesh.pp=2", "mesh.tp=2", "pipeline.schedule=interleaved",
                "pipeline.virtual_stages=2", "pipeline.stage_layers=[1,2,2,1]"],
    "pp1": ["mesh.dp=8", "mesh.pp=1", "mesh.tp=1", "pipeline.microbatches=2"],
}


@pytest.fixture(scope="module")
def saved_with_split_a(tmp_path_factory):
    from jax_overlap.training import loop as train

    run_dir = str(tmp_path_factory.mktemp("split_a"))
    result = train.run(config.load(TINY, RESUME + SPLIT_A), run_dir, progress=False)
    return result, os.path.join(run_dir, "checkpoints")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["split_b", "pp1"])
def test_resume_across_stage_splits(saved_with_split_a, tmp_path, name):
    import json
    import os
    import shutil

    from jax_overlap.training import loop as train

    straight, ckpt_src = saved_with_split_a
    ckpt_dir = str(tmp_path / "ckpt")
    shutil.copytree(ckpt_src, ckpt_dir)
    shutil.rmtree(os.path.join(ckpt_dir, "4"))  # as if split A had stopped at step 2
    with open(os.path.join(ckpt_dir, "2", "COMMITTED")) as f:  # stored unpadded, logical
        table = json.load(f)["checksums"]
    assert table[".train.params['blocks']['w_in']"]["shape"][0] == 6
    resumed = train.run(config.load(TINY, RESUME + RESUME_ON[name] + [
        f"checkpoint.dir={ckpt_dir}"]), str(tmp_path / "resumed"), progress=False)
    assert resumed.summary()["resumed_from"] == 2 and resumed.steps == 2
    # Steps 3..4 from split A's parameters and optimizer state: the same losses as split A
    # running on (up to the reduction order).
    assert max(rel(a, b) for a, b in zip(resumed.losses, straight.losses[2:])) <= 1e-5


def test_checkpoint_of_one_split_restores_bit_exact_with_another_and_on_pp1(tmp_path):
    """The save / restore path of the training loop (`to_checkpoint` with the logical
    `checkpoint_target`, `latest_good`, `from_checkpoint`) without training steps."""
    from jax_overlap.resilience import checkpoint as ckptlib
    from jax_overlap.resilience.ckpt_layout import (
        checkpoint_target,
        from_checkpoint,
        to_checkpoint,
    )
    from jax_overlap.training.loop_state import shardings_of

    def setup(overrides):
        cfg = config.load(TINY, RESUME + overrides)
        run = assemble(cfg, jax.devices()[:8], model=GPT.from_config(cfg.model))
        return run, run.plan, run.mesh, run.abstract_loop_state()

    run, plan, mesh, abstract = setup(SPLIT_A)
    assert abstract.train.params["blocks"]["w_in"].shape[0] == 2 * 5  # padded: 2 x max(5, 1)
    state = run.initializer()()
    target = checkpoint_target(abstract, plan.layer_perm)
    assert target.train.params["blocks"]["w_in"].shape[0] == 6  # logical, unpadded
    opts = ckptlib.CheckpointOptions(dir=str(tmp_path), every_steps=1, async_save=False)
    with ckptlib.Checkpointer(opts, mesh) as c:
        c.maybe_save(to_checkpoint(state, plan.layer_perm, shardings_of(target)), {}, force=True,
                     step=0)
    logical = jax.device_get(layout.to_logical(state, plan.layer_perm))
    for name, overrides in RESUME_ON.items():
        run, plan, mesh, abstract = setup(overrides)
        target = checkpoint_target(abstract, plan.layer_perm)
        with ckptlib.Checkpointer(opts, mesh) as c:
            result = c.latest_good(target)
        restored = from_checkpoint(result.state, plan.layer_perm, shardings_of(abstract))
        assert jax.tree.map(lambda a: a.shape, restored) == jax.tree.map(lambda a: a.shape,
                                                                          abstract), name
        back = jax.device_get(layout.to_logical(restored, plan.layer_perm))
        assert jax.tree.all(jax.tree.map(np.array_equal, back, logical)), name


# ---------------------------------------------------------------------------------------------
# The split: layout, plan, auto, refusals.

GPT_1P3B = os.path.join(os.path.dirname(TINY), "gpt_1p3b.yaml")


def test_staged_layout_pads_uneven_chunks_and_round_trips_a_whole_state():
    zbv = schedules.make_schedule("zb-v", 2, 4, 2)  # stage 0: vs 0 and 3; stage 1: vs 1, 2
    perm = layout.staged_permutation(6, zbv, (1, 2, 2, 1))
    # Stage 0: chunk 0 = vs 0 (layer 0), chunk 1 = vs 3 (layer 5); stage 1: vs 1, vs 2.
    assert perm.tolist() == [0, -1, 5, -1, 1, 2, 3, 4]
    assert layout.chunk_mask((1, 2, 2, 1), zbv.placement, 2, 2).tolist() == [
        [[True, False], [True, False]], [[True, True], [True, True]]]
    import optax

    from jax_overlap.training.state import new_state

    params = {"embed": {"wte": np.ones((3, 2))},
              "blocks": {"w": np.arange(12.0).reshape(6, 2) + 1}, "head": {}}
    opt = optax.adam(1e-3)
    state = new_state(params, opt.init(params), 0)
    staged = layout.to_staged(state, perm)
    assert staged.params["blocks"]["w"].shape == (8, 2)
    assert not np.asarray(staged.params["blocks"]["w"])[perm < 0].any()  # padding is zeros
    back = layout.to_logical(staged, perm)
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)),
                                     back, state))
    with pytest.raises(ValueError, match="stage_layers"):
        layout.staged_permutation(6, zbv, (1, 2, 2, 2))


def test_checkpoint_target_is_the_logical_unpadded_state():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_overlap.resilience.ckpt_layout import checkpoint_target

    mesh = meshlib.make_mesh(2, 4, 1, jax.devices()[:8])
    perm = layout.staged_permutation(10, schedules.make_schedule("1f1b", 4, 4), (3, 2, 4, 1))
    staged = {"blocks": {"w": jax.ShapeDtypeStruct((16, 3), np.float32, sharding=NamedSharding(
        mesh, P("pp", None)))}, "wte": jax.ShapeDtypeStruct((5,), np.float32)}
    target = checkpoint_target(staged, perm)
    assert target["blocks"]["w"].shape == (10, 3)  # 10 layers do not split over pp=4
    assert target["blocks"]["w"].sharding.spec == P(None, None)
    assert target["wte"] is staged["wte"]
    assert checkpoint_target(staged, None) is staged


def test_auto_gives_the_stage_with_the_head_fewer_layers():
    # GPT-1.3B: the LM head + loss is ~1.75 blocks of FLOPs, on the last virtual stage (with
    # the head on one stage: a vocabulary-parallel head spreads it over every stage). On a
    # GPU target `auto` balances by FLOPs.
    gpu = Target("h100", True, 80e9)
    head_last = ["mesh.dp=2", "mesh.pp=4", "pipeline.microbatches=8",
                 "pipeline.vocab_parallel=false"]
    cfg = config.load(GPT_1P3B, head_last)
    plan = plan_for(cfg, target=gpu)
    assert plan.stage_layers == (7, 6, 6, 5) and sum(plan.stage_layers) == 24
    assert plan.describe()["stage_layers"] == [7, 6, 6, 5]
    # The run's resolved config holds the list, which validates and gives the same plan.
    resolved = plan.resolved_config(cfg)
    assert resolved.pipeline.stage_layers == [7, 6, 6, 5]
    config.validate(resolved)
    assert plan_for(resolved, target=gpu).stage_layers == plan.stage_layers
    assert "balanced by FLOPs" in plan.choices["pipeline.stage_layers"].why
    # V placement: stage 0 runs virtual stages 0 and 7 (the head): it gets the fewest layers.
    zbv = plan_for(config.load(GPT_1P3B, [*head_last, "pipeline.schedule=zb-v",
                                          "pipeline.virtual_stages=2"]), target=gpu)
    split = zbv.stage_layers
    assert split[-1] < 3 and sum(split) == 24
    per_stage = stage_split.device_loads(split, zbv.schedule.placement, 4)
    assert per_stage[0] == min(per_stage)
    # A negligible head, or the vocabulary-parallel head a GPU plan picks: even.
    small = config.load(GPT_1P3B, [*head_last, "model.vocab=64"])
    assert plan_for(small, target=gpu).stage_layers == (6, 6, 6, 6)
    spread = plan_for(config.load(GPT_1P3B, head_last[:3]), target=gpu)
    assert spread.vocab_parallel and spread.stage_layers == (6, 6, 6, 6)
    # On a CPU `auto` (the default) splits evenly where the layers divide, and says why.
    cpu = plan_for(config.load(GPT_1P3B, head_last[:3]))
    assert cpu.stage_layers == (6, 6, 6, 6) and cpu.layer_perm is None
    assert cpu.choices["pipeline.stage_layers"].why.startswith("CPU:")
    # ... and by FLOPs where they do not (10 layers over 4 stages).
    uneven = plan_for(config.load(GPT_1P3B, [*head_last, "model.layers=10"]))
    assert sum(uneven.stage_layers) == 10 and uneven.stage_layers[-1] == min(uneven.stage_layers)
    assert "balanced by FLOPs" in uneven.choices["pipeline.stage_layers"].why


@pytest.mark.parametrize("value,words", [
    ("[3,3]", "2 counts for mesh.pp x pipeline.virtual_stages = 4"),
    ("[4,3,3,0]", "every virtual stage needs >= 1 layer"),
    ("[3,3,3,3]", "sums to 12, not model.layers = 10"),
    ("uneven", "expected 'even' | 'balanced' | 'auto' or list of int"),
])
def test_bad_stage_layers_are_refused_with_one_line(value, words):
    with pytest.raises(ConfigError) as e:
        stage_cfg("1f1b", 4, 2, 1, 4, split=value)
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith(
        "pipeline.stage_layers")
    assert words in e.value.problems[0]


def test_bad_stage_layers_exit_2_from_the_cli(tmp_path):
    proc = run_cli("train", "--config", TINY, "--run-dir", str(tmp_path / "run"),
                   "--set", "mesh.pp=2", "--set", "mesh.tp=2",
                   "--set", "pipeline.stage_layers=[2,1]")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
    assert len(lines) == 1 and "pipeline.stage_layers" in lines[0], lines
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_simulator_and_tuner_take_the_split():
    from jax_overlap.analysis import tune
    from jax_overlap.hardware.link_profiles import load_profile
    from jax_overlap.analysis.plan_costs import costs_from_model

    even = costs_from_model(8, 64, 4, 256, 50000, 32, 2, 1, 2, 1e12, 0.5, num_virtual_stages=4)
    uneven = costs_from_model(8, 64, 4, 256, 50000, 32, 2, 1, 2, 1e12, 0.5,
                              num_virtual_stages=4, stage_layers=(3, 2, 2, 1))
    layer = even.forward_s[1] / 2
    assert uneven.forward_s[0] == pytest.approx(3 * layer)
    assert uneven.forward_s[1] == pytest.approx(2 * layer)
    assert uneven.forward_s[3] == pytest.approx(even.forward_s[3] - layer)  # 1 layer + head
    # The tuner tries the balanced split beside the even one, and for GPT-1.3B's 1F1B on
    # pp4 x dp2 predicts it faster.
    cfg = config.load(GPT_1P3B)
    hw = load_profile("h100_8x_nvlink")
    found = {}
    for split in ("even", "balanced"):
        cand = tune.Candidate(2, 1, 4, 1, 8, "1f1b", 64.0, False, 1, 1, split)
        found[split] = tune.predict(cand, tune.apply_candidate(cfg, cand), hw)
    assert found["balanced"].step_time_s < found["even"].step_time_s
    assert found["balanced"].bubble_rate < found["even"].bubble_rate
    splits = {c.stage_layers for c, _ in tune.enumerate_candidates(
        cfg, 8, bucket_sizes_mb=(64.0,), windows=(1,), max_microbatches=8) if c.pp == 4}
    assert splits == {"even", "balanced"}


def test_tuner_search_improves_the_split_by_simulation():
    from jax_overlap.analysis import tune
    from jax_overlap.hardware.link_profiles import load_profile

    cfg = config.load(GPT_1P3B)
    hw = load_profile("h100_8x_nvlink")
    cand = tune.Candidate(2, 2, 2, 2, 8, "zb-v", 64.0, False, 1, 1, "balanced")
    auto = tune.predict(cand, tune.apply_candidate(cfg, cand), hw)
    found = tune.search_split(auto, hw)
    assert found.step_time_s < auto.step_time_s
    split = [int(n) for n in found.candidate.stage_layers.split(",")]
    assert found.config.pipeline.stage_layers == split and sum(split) == 24
    config.validate(found.config)  # what `tune` writes is a valid config
