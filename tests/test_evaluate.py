"""Forward-only evaluation gives the single-device loss on every mesh, staged layouts included."""

import jax
import pytest
from helpers import TINY, np_batch, rel

from jax_overlap import config
from jax_overlap.training.assemble import assemble
from jax_overlap.training import evaluate
from jax_overlap.training import grads as gradslib
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

    run = assemble(cfg, jax.devices()[: cfg.num_devices], model=model)
    staged = run.place_params(params)
    fn = evaluate.make_eval_loss(model, run.plan, run.mesh)
    placed = run.put_batch(batch)
    got = evaluate.mean_loss(fn, staged, [placed, placed])
    assert rel(got["loss"], ref) <= 1e-5
    assert got["tokens"] == 2 * batch["targets"].size
    assert got["perplexity"] == pytest.approx(2.718281828 ** ref, rel=1e-5)


def test_mean_loss_refuses_no_batches():
    with pytest.raises(ValueError, match="no batch"):
        evaluate.mean_loss(lambda p, b: (0.0, 0.0), None, [])
