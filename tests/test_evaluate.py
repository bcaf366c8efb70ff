"""Forward-only evaluation gives the single-device loss on every mesh, staged layouts included."""

import jax
import pytest
from helpers import TINY, np_batch, rel

from jax_overlap import config
from jax_overlap.parallel import mesh as meshlib
from jax_overlap.pipeline import layout
from jax_overlap.plan import ParallelPlan
from jax_overlap.training import evaluate
from jax_overlap.training import grads as gradslib
from jax_overlap.training import step as steplib
from models.gpt import GPT


@pytest.mark.parametrize("overrides", [
    ["mesh.dp=2", "mesh.tp=4"],
    ["mesh.dp=4", "mesh.tp=1", "overlap.param_sharding=fsdp"],
    ["mesh.pp=2", "mesh.dp=2", "mesh.tp=2", "model.layers=4", "pipeline.schedule=zb-v",
     "pipeline.virtual_stages=2", "pipeline.microbatches=2"],
])
def test_eval_loss_matches_single_device(overrides):
    cfg = config.load(TINY, overrides)
    model = GPT.from_config(cfg.model)
    params = model.init(jax.random.key(cfg.train.seed))
    batch = np_batch(cfg)
    ref = float(gradslib.reference_loss(model, params, batch))

    plan = ParallelPlan.build(cfg, model)
    mesh = meshlib.make_mesh(plan.dp, plan.pp, plan.tp, jax.devices()[: cfg.num_devices])
    staged = jax.device_put(layout.to_staged(params, plan.layer_perm),
                            steplib.param_shardings(model, mesh, plan.layout))
    fn = evaluate.make_eval_loss(model, plan, mesh)
    placed = steplib.put_batch(batch, mesh)
    got = evaluate.mean_loss(fn, staged, [placed, placed])
    assert rel(got["loss"], ref) <= 1e-5
    assert got["tokens"] == 2 * batch["targets"].size
    assert got["perplexity"] == pytest.approx(2.718281828 ** ref, rel=1e-5)


def test_mean_loss_refuses_no_batches():
    with pytest.raises(ValueError, match="no batch"):
        evaluate.mean_loss(lambda p, b: (0.0, 0.0), None, [])
