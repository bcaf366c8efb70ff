"""BERT: MLM masking, bidirectional attention, mesh equivalence and learning."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import REPO, max_rel_err, rel

from jax_overlap import config
from jax_overlap.parallel.collectives import Parallel
from jax_overlap.pipeline import layout
from jax_overlap.training.assemble import assemble
from jax_overlap.training import grads as gradslib
from models.bert import BERT, IGNORE, MASK_ID

TINY_YAML = os.path.join(REPO, "configs", "bert_tiny.yaml")
# 4 layers so that pp=2 with 2 virtual stages has a layer per chunk.
EQUIV = ["model.layers=4", "train.global_batch=16", "model.seq_len=16"]


@pytest.fixture(scope="module")
def reference():
    cfg = config.load(TINY_YAML, EQUIV)
    model = BERT.from_config(cfg.model)
    params = model.init(jax.random.key(cfg.train.seed))
    batch = model.data_stream(cfg).batch(0)
    loss, grads = jax.jit(jax.value_and_grad(
        lambda p: gradslib.reference_loss(model, p, batch)))(params)
    return model, params, batch, float(loss), grads


# ------------------------------------------------------------------------------ masking


def test_masking_is_deterministic_and_bert_shaped():
    cfg = config.load(TINY_YAML, ["train.global_batch=256"])
    model = BERT.from_config(cfg.model)
    stream = model.data_stream(cfg)
    batch = stream.batch(3)
    again = stream.batch(3)
    assert all(np.array_equal(batch[k], again[k]) for k in batch)
    assert not np.array_equal(batch["targets"], stream.batch(4)["targets"])
    tokens = stream.base.batch(3)["inputs"]
    chosen = batch["targets"] != IGNORE
    # round(0.15 * 32) = 5 positions in every sequence; targets are the original tokens there.
    assert model.masked_per_sequence() == 5
    assert (chosen.sum(1) == 5).all()
    assert np.array_equal(batch["targets"][chosen], tokens[chosen])
    assert np.array_equal(batch["inputs"][~chosen], tokens[~chosen])  # the rest is untouched
    masked = (batch["inputs"] == MASK_ID)
    assert not (masked & ~chosen).any()
    kept = batch["inputs"][chosen] == tokens[chosen]
    # BERT's 80% [MASK] / 10% random / 10% kept (random may hit the original by chance).
    assert 0.75 < masked[chosen].mean() < 0.85
    assert 0.07 < kept.mean() < 0.15
    assert float(model.loss_count(jnp.asarray(batch["targets"]))) == 256 * 5


def test_loss_is_cross_entropy_on_masked_positions_only(reference):
    model, params, batch, ref_loss, _ = reference
    par = Parallel()
    x = model.embed(params["embed"], batch["inputs"], par)
    x, _ = jax.lax.scan(lambda h, p: (model.block(p, h, par), None), x, params["blocks"])
    logits = model._head(1).apply({"params": params["head"]}, x, params["embed"]["wte"], par)
    logp = jax.nn.log_softmax(logits, -1)
    targets = batch["targets"]
    chosen = targets != IGNORE
    picked = np.take_along_axis(np.asarray(logp), np.where(chosen, targets, 0)[..., None], -1)
    expected = -picked[..., 0][chosen].mean()
    assert rel(ref_loss, float(expected)) <= 1e-5


def test_attention_is_bidirectional(reference):
    model, params, batch, _, _ = reference
    # Only position 0 is scored; changing a token after it must change that loss.
    targets = np.full_like(batch["targets"], IGNORE)
    targets[:, 0] = 65
    loss = jax.jit(lambda ids: gradslib.reference_loss(model, params,
                                                      {"inputs": ids, "targets": targets}))
    later = batch["inputs"].copy()
    later[:, 7] = (later[:, 7] + 1) % 256
    assert abs(float(loss(batch["inputs"])) - float(loss(later))) > 1e-4


# -------------------------------------------------------------------------- equivalence


def _mesh_run(model, params, batch, overrides):
    cfg = config.load(TINY_YAML, EQUIV + overrides)
    run = assemble(cfg, jax.devices()[: cfg.num_devices], model=model)
    fn = jax.jit(run.loss_and_grads())
    loss, grads = fn(run.place_params(params), run.put_batch(batch))
    return float(loss), layout.to_logical(grads, run.plan.layer_perm)


MESHES = {
    "dp2_tp4": ["mesh.dp=2", "mesh.pp=1", "mesh.tp=4"],
    "dp2_pp2_tp2_1f1b": ["mesh.dp=2", "mesh.pp=2", "mesh.tp=2", "pipeline.microbatches=2"],
    "pp2_tp2_interleaved": ["mesh.dp=1", "mesh.pp=2", "mesh.tp=2", "pipeline.microbatches=4",
                            "pipeline.schedule=interleaved", "pipeline.virtual_stages=2"],
    "dp2_tp4_sequence_parallel": pytest.param(
        ["mesh.dp=2", "mesh.pp=1", "mesh.tp=4", "overlap.tp_comm=sequence_parallel"],
        marks=pytest.mark.slow),
}


@pytest.mark.parametrize("overrides", MESHES.values(), ids=MESHES.keys())
def test_mesh_matches_single_device(reference, overrides):
    model, params, batch, ref_loss, ref_grads = reference
    loss, grads = _mesh_run(model, params, batch, overrides)
    assert rel(loss, ref_loss) <= 1e-5
    assert max_rel_err(grads, ref_grads) <= 1e-5


# ------------------------------------------------------------------------------ configs


def test_bert_large_has_bert_large_shapes():
    cfg = config.load(os.path.join(REPO, "configs", "bert_large.yaml"))
    model = BERT.from_config(cfg.model)
    assert (model.num_layers, model.d_model, model.heads, model.d_ff, model.seq_len) == (
        24, 1024, 16, 4096, 512)
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    assert count == model.num_params()
    # BERT-large's 24 x 12.6M encoder; the byte vocabulary keeps the embedding small.
    assert 300e6 < count < 306e6
    assert shapes["blocks"]["w_in"].shape == (24, 1024, 4096)


def test_bert_tiny_learns():
    """configs/bert_tiny.yaml (dp=2 x tp=4): within 40 steps the mean MLM loss of the last 5
    steps is at least 1.5 nats below the first step's (~ln 256 = 5.5)."""
    cfg = config.load(TINY_YAML)
    model = BERT.from_config(cfg.model)
    run = assemble(cfg, jax.devices()[: cfg.num_devices], model=model)
    state, train_step = run.init_state(), run.train_step()
    stream = model.data_stream(cfg)
    losses = []
    for i in range(cfg.train.steps):
        state, metrics = train_step(state, run.put_batch(stream.batch(i)))
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all()
    assert np.mean(losses[-5:]) < losses[0] - 1.5, losses
