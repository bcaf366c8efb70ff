"""A model written outside `models/` runs through the library unchanged (bring your own model).

`ShiftMLP` is defined here, against the public API only (`model_api`'s protocol and
`collectives`): a token-mixing MLP language model whose blocks blend each position with the
previous one and apply a Megatron MLP (column-parallel in, row-parallel out). Under tp=2 and
under dp=2 x pp=2 x tp=2 with 1F1B it must reproduce its single-device loss and gradients.
"""

from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY, max_rel_err, np_batch, rel

from jax_overlap import config
from jax_overlap.parallel.collectives import (
    Parallel,
    column_parallel,
    row_parallel,
    vocab_cross_entropy,
    vocab_embed,
)
from jax_overlap.pipeline import layout
from jax_overlap.training.assemble import assemble
from jax_overlap.training import grads as gradslib
from jax_overlap.training import step as steplib


class ShiftBlock(nn.Module):
    d_model: int
    d_ff: int
    tp: int = 1  # tp=1 creates the global parameters, tp=k applies to one shard of them

    @nn.compact
    def __call__(self, x_btd, par: Parallel):
        f_local = self.d_ff // self.tp
        mix_d = self.param("mix", nn.initializers.constant(0.5), (self.d_model,))
        w_in_df = self.param("w_in", nn.initializers.normal(0.05), (self.d_model, f_local))
        w_out_fd = self.param("w_out", nn.initializers.normal(0.05), (f_local, self.d_model))
        # Causal token mixing: each position blends in its predecessor (zeros before t=0).
        prev_btd = jnp.pad(x_btd, ((0, 0), (1, 0), (0, 0)))[:, :-1]
        y_btd = nn.LayerNorm(name="ln")(x_btd + mix_d * prev_btd)
        h_btf = jax.nn.gelu(column_parallel(y_btd, w_in_df, par))
        return x_btd + row_parallel(h_btf, w_out_fd, par)


@dataclass(frozen=True)
class ShiftMLP:
    """Embedding + `num_layers` ShiftBlocks + tied vocab-parallel head: a StagedModel."""

    num_layers: int = 4
    d_model: int = 32
    d_ff: int = 64
    vocab: int = 256

    def init(self, rng):
        k_wte, k_blocks = jax.random.split(rng)
        x = jnp.zeros((1, 4, self.d_model))
        blocks = jax.vmap(lambda k: ShiftBlock(self.d_model, self.d_ff).init(
            k, x, Parallel())["params"])(jax.random.split(k_blocks, self.num_layers))
        return {"embed": {"wte": 0.05 * jax.random.normal(k_wte, (self.vocab, self.d_model))},
                "blocks": blocks, "head": {"scale": jnp.ones((self.d_model,))}}

    def param_axes(self):
        return {"embed": {"wte": ("vocab", "embed")},
                "blocks": {"mix": ("layers", "embed"), "w_in": ("layers", "embed", "mlp"),
                           "w_out": ("layers", "mlp", "embed"),
                           "ln": {"scale": ("layers", "embed"), "bias": ("layers", "embed")}},
                "head": {"scale": ("embed",)}}

    def embed(self, params_embed, ids_bt, par):
        return vocab_embed(ids_bt, params_embed["wte"], par)

    def block(self, params_block, x_btd, par):
        return ShiftBlock(self.d_model, self.d_ff, par.tp).apply({"params": params_block},
                                                                 x_btd, par)

    def head_loss(self, params_embed, params_head, x_btd, targets_bt, par):
        logits_btv = jnp.einsum("btd,vd->btv", x_btd * params_head["scale"],
                                params_embed["wte"])
        return vocab_cross_entropy(logits_btv, targets_bt, par).sum()

    def loss_count(self, targets_bt):
        return jnp.asarray(targets_bt.size, jnp.float32)

    def flops_per_example(self):
        return 6.0 * self.num_layers * 2 * self.d_model * self.d_ff


@pytest.fixture(scope="module")
def reference():
    model = ShiftMLP()
    cfg = config.load(TINY, ["model.layers=4"])
    params = model.init(jax.random.key(0))
    batch = np_batch(cfg)
    loss, grads = jax.jit(jax.value_and_grad(
        lambda p: gradslib.reference_loss(model, p, batch)))(params)
    return model, params, batch, float(loss), grads


@pytest.mark.parametrize("overrides", [
    ["mesh.dp=1", "mesh.tp=2"],
    ["mesh.dp=2", "mesh.pp=2", "mesh.tp=2", "pipeline.schedule=1f1b", "pipeline.microbatches=2"],
], ids=["tp2", "dp2_pp2_tp2_1f1b"])
def test_custom_model_matches_single_device(reference, overrides):
    model, params, batch, ref_loss, ref_grads = reference
    cfg = config.load(TINY, ["model.layers=4", *overrides])
    run = assemble(cfg, jax.devices()[: cfg.num_devices], model=model)
    mesh, perm = run.mesh, run.plan.layer_perm
    fn = jax.jit(run.loss_and_grads())
    loss, grads = fn(run.place_params(params), run.put_batch(batch))
    assert rel(float(loss), ref_loss) <= 1e-5
    assert max_rel_err(layout.to_logical(grads, perm), ref_grads) <= 1e-5
    # The TP-split weights stay split: each device holds half of d_ff.
    w_in = steplib.param_shardings(model, mesh)["blocks"]["w_in"]
    assert w_in.shard_shape((4, 32, 64))[-1] == 32


def test_custom_model_trains_with_the_library_step():
    model = ShiftMLP()
    cfg = config.load(TINY, ["model.layers=4", "mesh.dp=2", "mesh.tp=2", "train.steps=12",
                             "train.lr=0.01"])
    run = assemble(cfg, jax.devices()[: cfg.num_devices], model=model)
    state, train_step = run.init_state(), run.train_step()
    losses = []
    for i in range(cfg.train.steps):
        state, metrics = train_step(state, run.put_batch(np_batch(cfg, i)))
        losses.append(float(metrics["loss"]))
    # Byte-level text from ~ln 256 = 5.5: byte statistics alone take off over a nat in 12 steps.
    assert np.mean(losses[-3:]) < losses[0] - 1.0, losses
