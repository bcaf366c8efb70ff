"""Uneven pipeline stages (`pipeline.stage_layers`): same loss and gradients as one device,
checkpoints in logical order across splits, `auto` balancing the head, bad lists refused.

Default run: a split-backward, a plain, an interleaved and a V schedule with uneven chunks on
pp4 x dp2 and pp2 x dp2 x tp2; `make test-slow` sweeps every schedule x mesh x remat.
"""

import os

import jax
import numpy as np
import pytest
from helpers import TINY, max_rel_err, np_batch, rel

from jax_overlap import config
from jax_overlap.parallel import mesh as meshlib
from jax_overlap.pipeline import layout, schedules
from jax_overlap.plan import ParallelPlan
from jax_overlap.training import grads as gradslib
from jax_overlap.training import step as steplib
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
SLOW_CASES = [(name, pp, dp, tp, 2 * pp, i % 2 == 0, remat)
              for i, (name, (pp, dp, tp), remat) in enumerate(
                  (name, mesh, remat) for name in schedules.SCHEDULES
                  for mesh in [(4, 2, 1), (2, 2, 2)]
                  for remat in ("none", "full", "save_dots"))]
# Uneven stages with the rest of the overlap machinery: in-loop buckets (the chunk's last
# backward unrolled with bucket hooks), fsdp, ZeRO-1, latency-2 transfers.
COMPOSE_CASES = [
    ("1f1b", 2, 2, 2, 4, True, ["overlap.grad_bucket_mb=0.01"]),
    ("zb-v", 4, 2, 1, 4, False, ["overlap.param_sharding=fsdp", "pipeline.transfer_latency=2"]),
    ("interleaved", 2, 4, 1, 4, True, ["overlap.zero1=true", "overlap.grad_bucket_mb=0.05"]),
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
    cache = {}

    def get(tied):
        if tied not in cache:
            cfg = stage_cfg("1f1b", 2, 4, 1, 2, tied)
            model = GPT.from_config(cfg.model)
            params = model.init(jax.random.key(cfg.train.seed))
            batch = np_batch(cfg)
            loss, grads = jax.jit(jax.value_and_grad(
                lambda p: gradslib.reference_loss(model, p, batch)))(params)
            cache[tied] = (model, params, batch, float(loss), grads)
        return cache[tied]

    return get


def check_equivalence(references, name, pp, dp, tp, m, tied, remat, extra=()):
    cfg = stage_cfg(name, pp, dp, tp, m, tied, extra=[f"model.remat={remat}", *extra])
    model, params, batch, ref_loss, ref_grads = references(tied)
    mesh = meshlib.make_mesh(dp, pp, tp, jax.devices()[: dp * pp * tp])
    plan = ParallelPlan.build(cfg, model)
    assert list(plan.stage_layers) == SPLITS[pp * CHUNKS[name]]
    perm = plan.layer_perm
    assert len(perm) == pp * CHUNKS[name] * max(plan.stage_layers)  # padded to the largest
    loss_and_grads = steplib.make_loss_and_grads(model, plan, mesh)
    shardings = steplib.param_shardings(model, mesh, plan.layout)
    staged = jax.device_put(layout.to_staged(params, perm), shardings)
    loss, grads = jax.jit(loss_and_grads)(staged, steplib.put_batch(batch, mesh))
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


# ---------------------------------------------------------------------------------------------
# Checkpoints in logical order: save with one split, resume with another / on pp = 1.

RESUME = ["model.layers=6", "train.steps=4", "checkpoint.every_steps=2", "checkpoint.keep=5",
          "checkpoint.async_save=false", "pipeline.microbatches=4"]
SPLIT_A = ["mesh.dp=2", "mesh.pp=2", "mesh.tp=2", "pipeline.schedule=zb-h1",
           "pipeline.stage_layers=[5,1]"]
RESUME_ON = {
    "split_b": ["mesh.dp=2", "mesh.pp=2", "mesh.tp=2", "pipeline.schedule=interleaved",
                "pipeline.virtual_stages=2", "pipeline.stage_layers=[1,2,2,1]"],
    "pp1": ["mesh.dp=8", "mesh.pp=1", "mesh.tp=1"],
}


@pytest.fixture(scope="module")
def saved_with_split_a(tmp_path_factory):
    from jax_overlap.training import loop as train

    run_dir = str(tmp_path_factory.mktemp("split_a"))
    result = train.run(config.load(TINY, RESUME + SPLIT_A), run_dir, progress=False)
    return result, os.path.join(run_dir, "checkpoints")


@pytest.mark.parametrize("name", ["split_b", pytest.param("pp1", marks=pytest.mark.slow)])
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
