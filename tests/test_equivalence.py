"""Every (dp, tp) mesh computes the single-device loss and gradients (fp32)."""

import jax
import numpy as np
import pytest
from helpers import TINY, gpt_reference, max_rel_err, np_batch, rel

from jax_overlap import config
from jax_overlap.training.assemble import assemble
from jax_overlap.training import grads as gradslib
from jax_overlap.training import loop as train
from jax_overlap.training import step as steplib
from models.gpt import GPT

MESHES = [(1, 1), (2, 1), (1, 2), (2, 2), (2, 4), (8, 1)]


@pytest.fixture(scope="module")
def reference():
    return (config.load(TINY),) + gpt_reference()


@pytest.mark.parametrize("dp,tp", MESHES)
def test_loss_and_grads_match_single_device(reference, dp, tp):
    cfg, model, params, batch, ref_loss, ref_grads = reference
    cfg = config.load(TINY, [f"mesh.dp={dp}", f"mesh.tp={tp}"])
    run = assemble(cfg, jax.devices()[: dp * tp], model=model)
    mesh = run.mesh
    loss, grads = jax.jit(run.loss_and_grads())(run.place_params(params), run.put_batch(batch))
    assert rel(float(loss), ref_loss) <= 1e-5
    assert max_rel_err(grads, ref_grads) <= 1e-5
    # The gradients come back sharded as the parameters are, not gathered.
    expected = steplib.param_shardings(model, mesh)["embed"]["wte"]
    assert grads["embed"]["wte"].sharding.is_equivalent_to(expected, 2)


@pytest.mark.parametrize("remat,extra", [
    # The bucketed last microbatch recomputes each layer once its output gradient exists.
    ("full", ["mesh.dp=2", "mesh.tp=4", "overlap.grad_bucket_mb=0.01",
              "pipeline.microbatches=2"]),
    ("save_dots", ["mesh.dp=8", "mesh.tp=1", "overlap.grad_bucket_mb=0.01",
                   "pipeline.microbatches=2"]),
    # The rings' outputs are what `minimal` keeps (named: they are custom VJPs).
    ("minimal", ["mesh.dp=2", "mesh.tp=4", "overlap.param_sharding=fsdp",
                 "overlap.tp_comm=collective_matmul", "overlap.collective_matmul_direction=bi"]),
])
def test_remat_policies_match_single_device(reference, remat, extra):
    """pp = 1 under each remat policy: the plain scan, the bucketed last microbatch (with
    tp under `full`), FSDP with collective matmul."""
    _, model, params, batch, ref_loss, ref_grads = reference
    cfg = config.load(TINY, [f"model.remat={remat}", *extra])
    run = assemble(cfg, jax.devices()[: cfg.num_devices], model=model)
    loss, grads = jax.jit(run.loss_and_grads())(run.place_params(params), run.put_batch(batch))
    assert rel(float(loss), ref_loss) <= 1e-5
    assert max_rel_err(grads, ref_grads) <= 1e-5


def _curve(overrides, tmp_path, name):
    cfg = config.load(TINY, overrides)
    devices = jax.devices()[: cfg.num_devices]
    return train.run(cfg, str(tmp_path / name), progress=False, devices=devices).losses


def test_training_curves_agree_across_meshes(tmp_path):
    ref = _curve(["mesh.dp=1", "mesh.tp=1"], tmp_path, "ref")
    assert len(ref) == 4 and ref[-1] < ref[0]
    for dp, tp in [(2, 4), (8, 1)]:
        losses = _curve([f"mesh.dp={dp}", f"mesh.tp={tp}"], tmp_path, f"{dp}x{tp}")
        assert max(rel(a, b) for a, b in zip(losses, ref)) <= 1e-4, (dp, tp, losses, ref)


@pytest.mark.slow
def test_microbatches_do_not_change_the_step(tmp_path):
    one = _curve(["pipeline.microbatches=1"], tmp_path, "m1")
    four = _curve(["pipeline.microbatches=4"], tmp_path, "m4")
    assert max(rel(a, b) for a, b in zip(one, four)) <= 1e-4


def test_untied_embeddings_match(reference):
    cfg = config.load(TINY, ["model.tied_embeddings=false"])
    model = GPT.from_config(cfg.model)
    params = model.init(jax.random.key(0))
    assert "w_out" in params["head"]
    batch = np_batch(cfg)
    ref_loss, ref_grads = jax.value_and_grad(
        lambda p: gradslib.reference_loss(model, p, batch))(params)
    run = assemble(cfg, jax.devices()[:8], model=model)
    loss, grads = jax.jit(run.loss_and_grads())(run.place_params(params), run.put_batch(batch))
    assert rel(float(loss), float(ref_loss)) <= 1e-5
    assert max_rel_err(grads, ref_grads) <= 1e-5


def test_bf16_compute_keeps_fp32_master_weights(tmp_path):
    cfg = config.load(TINY, ["train.precision=bf16"])
    result = train.run(cfg, str(tmp_path / "bf16"), progress=False)
    fp32 = _curve([], tmp_path, "fp32")
    assert np.isfinite(result.losses).all()
    # bf16 has ~3 significant digits; the curves agree to that.
    assert max(rel(a, b) for a, b in zip(result.losses, fp32)) < 2e-2
    state = assemble(cfg, model=GPT.from_config(cfg.model)).init_state()
    assert state.params["blocks"]["w_in"].dtype == np.float32


def test_lamb_optimizer_trains(tmp_path):
    losses = _curve(["train.optimizer=lamb", "train.steps=6", "train.lr=0.01"], tmp_path, "lamb")
    assert losses[-1] < losses[0]
