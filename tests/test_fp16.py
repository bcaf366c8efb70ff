"""fp16 compute with dynamic loss scaling: overflow steps are skipped (not guard faults),
the scale halves on overflow and doubles after clean steps, and a resume restores it."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from helpers import TINY, max_rel_err, np_batch, rel

from jax_overlap import config
from jax_overlap.training.assemble import assemble
from jax_overlap.training import loop as train
from jax_overlap.training import loss_scale
from jax_overlap.training import step as steplib
from models.gpt import GPT


def test_scale_halves_on_overflow_and_doubles_after_clean_steps():
    s = loss_scale.LossScale(jnp.float32(8.0), jnp.int32(0), jnp.int32(0))
    s = loss_scale.update(s, jnp.bool_(True), growth_interval=2)
    assert float(s.scale) == 8.0 and int(s.good_steps) == 1
    s = loss_scale.update(s, jnp.bool_(True), growth_interval=2)
    assert float(s.scale) == 16.0 and int(s.good_steps) == 0
    s = loss_scale.update(s, jnp.bool_(False), growth_interval=2)
    assert float(s.scale) == 8.0 and int(s.good_steps) == 0 and int(s.overflows) == 1
    tiny = loss_scale.LossScale(jnp.float32(1.0), jnp.int32(0), jnp.int32(0))
    assert float(loss_scale.update(tiny, jnp.bool_(False), 2).scale) == 1.0  # floor


def test_scaled_loss_gives_scaled_gradients_on_a_mesh():
    """The ScaledLoss wrapper multiplies loss and gradients by S through the real step."""
    cfg = config.load(TINY, ["mesh.dp=2", "mesh.tp=4"])
    model = GPT.from_config(cfg.model)
    run = assemble(cfg, jax.devices()[:8], model=model)
    plan, mesh = run.plan, run.mesh
    params = run.place_params(model.init(jax.random.key(0)))
    batch = run.put_batch(np_batch(cfg))
    loss, grads = jax.jit(run.loss_and_grads())(params, batch)

    @jax.jit
    def scaled(p, b, s):
        wrapped = loss_scale.ScaledLoss(model, s)
        return loss_scale.unscale(*steplib.make_loss_and_grads(wrapped, plan, mesh)(p, b), s)

    loss_s, grads_s = scaled(params, batch, jnp.float32(1024.0))
    assert rel(float(loss_s), float(loss)) <= 1e-6
    assert max_rel_err(grads_s, grads) <= 1e-6


def records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if '"step"' in line and "event" not in line]


def test_forced_overflow_is_skipped_halves_the_scale_and_resumes(tmp_path):
    # A scale of 2^30 overflows fp16's cotangents (max 65504) for certain; each overflow
    # halves it until the steps go through.
    over = ["train.precision=fp16", "train.loss_scale_init=1073741824",
            "train.loss_scale_growth_interval=3", "checkpoint.every_steps=1",
            "checkpoint.async_save=false", "mesh.dp=2", "mesh.tp=1", "pipeline.microbatches=1"]
    run_dir = str(tmp_path / "run")
    devices = jax.devices()[:2]
    result = train.run(config.load(TINY, over + ["train.steps=3"]), run_dir, progress=False,
                       devices=devices)
    recs = records(run_dir)
    skipped = [r for r in recs if r.get("skipped_overflow")]
    assert skipped and recs[0].get("skipped_overflow"), recs[0]
    assert result.extra["skipped_overflow"] == len(skipped)
    assert result.extra["rollbacks"] == 0 and result.extra["final_step"] == 3
    ok = [r for r in recs if not r.get("skipped")]
    assert len(ok) == 3 and all(np.isfinite(r["loss"]) for r in ok)
    # Every record's scale follows the rule: /2 after an overflow, x2 after 3 clean steps.
    scale, good = 2.0 ** 30, 0
    for r in recs:
        assert r["loss_scale"] == scale, (r, scale)
        if r.get("skipped_overflow"):
            scale, good = scale / 2, 0
        else:
            good += 1
            if good == 3:
                scale, good = scale * 2, 0
    final_scale = scale
    resumed = train.run(config.load(TINY, over + ["train.steps=4"]), run_dir, progress=False,
                        devices=devices)
    assert resumed.extra["resumed_from"] == 3
    assert records(run_dir)[len(recs)]["loss_scale"] == final_scale  # restored, not reset
    assert np.isfinite(resumed.losses).all()
