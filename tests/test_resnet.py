"""ResNet: standard shapes, batch norm synchronised over dp, units, data, and it learns."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import REPO, max_rel_err, rel
from jax.sharding import PartitionSpec as P

from jax_overlap import config
from jax_overlap.model_api import build_model
from jax_overlap.parallel import compat
from jax_overlap.parallel import mesh as meshlib
from jax_overlap.parallel.collectives import Parallel
from jax_overlap.parallel.mesh import DP, TP
from jax_overlap.training.assemble import assemble
from jax_overlap.training import grads as gradslib
from models.data_images import ArrayImages, SyntheticImages, load_images
from models.resnet import BatchNorm, ResNetConfig, ResNetModel, units_padding

TINY_YAML = os.path.join(REPO, "configs", "resnet_tiny.yaml")
# ResNet-18's block structure at width 8 on 16x16 images; zero-init off so every weight of
# every residual branch gets a gradient to compare.
SMALL18 = ResNetConfig(depth=18, width=8, image_size=16, classes=10, zero_init_residual=False)
BATCH = 16


def _cfg(dp=1, pp=1, microbatches=1):
    return config.load(TINY_YAML, [f"mesh.dp={dp}", f"mesh.pp={pp}", "model.layers=18",
                                   f"train.global_batch={BATCH}",
                                   f"pipeline.microbatches={microbatches}"])


def _mesh_loss_and_grads(model, params, batch, dp, pp=1, microbatches=1):
    cfg = _cfg(dp, pp, microbatches)
    run = assemble(cfg, jax.devices()[: dp * pp], model=model)
    return jax.jit(run.loss_and_grads())(run.place_params(params), run.put_batch(batch))


@pytest.fixture(scope="module")
def reference():
    model = ResNetModel(SMALL18)
    params = model.init(jax.random.key(0))
    batch = SyntheticImages(16, 10, BATCH, seed=0).batch(0)
    loss, grads = jax.jit(jax.value_and_grad(
        lambda p: gradslib.reference_loss(model, p, batch)))(params)
    return model, params, batch, float(loss), grads


# ------------------------------------------------------------------------------ shapes


@pytest.mark.parametrize("depth,params,gmacs", [(18, 11_689_512, 1.814), (50, 25_557_032, 4.089),
                                                 (152, 60_192_808, 11.514)])
def test_standard_models_match_published_sizes(depth, params, gmacs):
    # torchvision's parameter counts and the usual forward GMACs at 224x224, 1000 classes.
    model = ResNetModel(ResNetConfig(depth=depth, image_size=224, classes=1000), units=4)
    assert model.num_params() == params
    assert model.forward_flops() / 2e9 == pytest.approx(gmacs, rel=1e-3)
    assert model.flops_per_example() == 3 * model.forward_flops()


def test_units_are_flop_balanced_groups_of_whole_blocks():
    model = ResNetModel(ResNetConfig(depth=50, image_size=224, classes=1000), units=4)
    params = jax.eval_shape(model.init, jax.random.key(0))
    assert params["blocks"]["packed"].shape == (4, model.packed_size)
    assert model.plan().bounds[0] == 0 and model.plan().bounds[-1] == 16
    assert model.plan().imbalance < 1.15
    # Padding to the largest unit costs memory (the last stage holds the wide blocks).
    assert 1.0 < units_padding(model) < 3.0
    assert units_padding(ResNetModel(model.cfg, units=1)) == 1.0


def test_units_regroup_the_same_network():
    small10 = ResNetConfig(**{**SMALL18.__dict__, "depth": 10})
    one, two = ResNetModel(small10, units=1), ResNetModel(small10, units=2)
    key = jax.random.key(3)
    p1, p2 = one.init(key), two.init(key)
    # Initial values do not depend on the grouping, and conversion is lossless both ways.
    assert jax.tree.all(jax.tree.map(np.array_equal, two.convert_params(p1, one), p2))
    assert jax.tree.all(jax.tree.map(np.array_equal, one.convert_params(p2, two), p1))
    batch = SyntheticImages(16, 10, 8, seed=1).batch(0)
    l1 = jax.jit(lambda p: gradslib.reference_loss(one, p, batch))(p1)
    l2 = jax.jit(lambda p: gradslib.reference_loss(two, p, batch))(p2)  # tag-driven switch
    assert rel(float(l2), float(l1)) <= 1e-6


def test_from_config_reads_the_shared_fields_and_the_config_refuses_tp():
    cfg = config.load(os.path.join(REPO, "configs", "resnet152.yaml"))
    model = build_model(cfg)  # the library passes pp x v pipeline units
    assert (model.cfg.depth, model.cfg.width, model.cfg.image_size, model.cfg.classes) == (
        152, 64, 224, 1000)
    assert model.units == cfg.mesh.pp == 4 and model.cfg.imagenet_stem
    assert ResNetModel.from_config(config.load(TINY_YAML)).units == 1
    assert ResNetModel.from_config(cfg, 8).units == 8
    with pytest.raises(config.ConfigError, match="mesh.tp: ResNet has no tensor-parallel"):
        config.load(TINY_YAML, ["mesh.tp=2"])


# --------------------------------------------------------------------------- batch norm


def test_synced_statistics_are_the_full_batch_statistics():
    # Each dp shard gets a different distribution, so local statistics are far from global.
    shift_b = np.repeat(np.arange(4.0), 4)[:, None, None, None]
    x_bhwc = jnp.asarray(np.random.default_rng(0).normal(size=(16, 3, 3, 5)) * (1 + shift_b)
                         + 3 * shift_b, jnp.float32)
    bn = BatchNorm()
    params = bn.init(jax.random.key(0), x_bhwc, Parallel())
    params = jax.tree.map(lambda p: p + 0.1 * jnp.arange(p.size).reshape(p.shape), params)
    full = BatchNorm().apply(params, x_bhwc, Parallel())
    mesh = meshlib.make_mesh(4, 1, 1, jax.devices()[:4])
    par = Parallel(tp_axis=TP, tp=1)

    def under_dp(sync):
        fn = compat.shard_map(lambda p, x: BatchNorm(sync=sync).apply(p, x, par), mesh,
                               in_specs=(P(), P(DP)), out_specs=P(DP))
        return jax.jit(fn)(params, x_bhwc)

    np.testing.assert_allclose(under_dp(True), full, rtol=1e-5, atol=1e-5)
    per_shard = jnp.concatenate([BatchNorm().apply(params, x_bhwc[i:i + 4], Parallel())
                                 for i in range(0, 16, 4)])
    np.testing.assert_allclose(under_dp(False), per_shard, rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(per_shard - full).max()) > 0.5


def test_synced_bn_under_dp_matches_single_device(reference):
    model, params, batch, ref_loss, ref_grads = reference
    loss, grads = _mesh_loss_and_grads(model, params, batch, dp=4)
    assert rel(float(loss), ref_loss) <= 1e-5
    assert max_rel_err(grads, ref_grads) <= 1e-5


@pytest.mark.slow
def test_local_bn_under_dp_differs(reference):
    model, params, batch, ref_loss, ref_grads = reference
    local = ResNetModel(ResNetConfig(**{**SMALL18.__dict__, "bn_sync": False}))
    loss, grads = _mesh_loss_and_grads(local, params, batch, dp=4)
    # Statistics of 4 examples instead of 16: a visibly different loss and gradients.
    assert rel(float(loss), ref_loss) > 1e-3
    assert max_rel_err(grads, ref_grads) > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("schedule,virtual_stages", [("1f1b", 1), ("interleaved", 2)])
def test_pipeline_with_synced_bn_matches_single_device(schedule, virtual_stages):
    """dp=2 x pp=2, one unit per virtual stage, 2 microbatches. BN statistics are per global
    microbatch, so the reference runs each global microbatch (its rows on every replica)."""
    from jax_overlap.pipeline import layout

    dp, pp, m, local = 2, 2, 2, BATCH // 2
    # The model is built directly; the config only describes the mesh and schedule, and its
    # layer count must be the stacked units' for the validator (see models/resnet.py).
    cfg = config.load(TINY_YAML, [f"mesh.dp={dp}", f"mesh.pp={pp}", f"train.global_batch={BATCH}",
                                  f"model.layers={pp * virtual_stages}",
                                  f"pipeline.microbatches={m}", f"pipeline.schedule={schedule}",
                                  f"pipeline.virtual_stages={virtual_stages}"])
    model = ResNetModel(SMALL18, units=pp * virtual_stages)
    params = model.init(jax.random.key(0))
    batch = SyntheticImages(16, 10, BATCH, seed=0).batch(0)
    grad_fn = jax.jit(jax.value_and_grad(
        lambda p, mb: gradslib.reference_loss(model, p, mb) * len(mb["targets"])))
    ref_loss, ref_grads = 0.0, None
    for i in range(m):
        rows = np.concatenate([np.arange(d * local + i * local // m,
                                         d * local + (i + 1) * local // m) for d in range(dp)])
        loss_i, grads_i = grad_fn(params, {k: v[rows] for k, v in batch.items()})
        ref_loss += float(loss_i) / BATCH
        grads_i = jax.tree.map(lambda g: g / BATCH, grads_i)
        ref_grads = grads_i if ref_grads is None else jax.tree.map(jnp.add, ref_grads, grads_i)
    # The units' storage order follows the schedule's placement; the activations' tags make
    # each stage run the unit it holds whatever that order is.
    run = assemble(cfg, jax.devices()[: dp * pp], model=model)
    perm = layout.staged_permutation(model.num_layers, run.plan.program.schedule)
    loss, grads = jax.jit(run.loss_and_grads())(
        jax.device_put(layout.to_staged(params, perm), run.param_shardings()),
        run.put_batch(batch))
    assert rel(float(loss), ref_loss) <= 1e-5
    assert max_rel_err(layout.to_logical(grads, perm), ref_grads) <= 1e-5


# ---------------------------------------------------------------------------------- data


def test_synthetic_images_are_a_function_of_the_batch_index():
    stream = SyntheticImages(16, 10, 8, seed=5)
    a, b = stream.batch(7), stream.batch(7)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["inputs"], stream.batch(8)["inputs"])
    assert a["inputs"].shape == (8, 16, 16, 3) and a["inputs"].dtype == np.float32
    assert a["targets"].dtype == np.int32 and a["targets"].max() < 10


def _write_folder(root, per_class):
    from PIL import Image

    rng = np.random.default_rng(0)
    for name in ("cat", "dog"):
        os.makedirs(root / name)
        for i in range(per_class):
            pixels = rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")


def test_user_images_load_from_npz_npy_and_folders(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, (10, 16, 16, 3), dtype=np.uint8)
    labels = np.arange(10) % 3
    np.savez(tmp_path / "set.npz", images=images, labels=labels)
    x, y, _ = load_images(str(tmp_path / "set.npz"), 16)
    assert x.shape == (10, 16, 16, 3) and np.array_equal(y, labels)
    np.testing.assert_allclose(x.mean((0, 1, 2)), 0, atol=1e-5)  # standardised per channel
    np.save(tmp_path / "grey.npy", images[..., 0])
    with pytest.raises(ValueError, match="grey_labels.npy"):
        load_images(str(tmp_path / "grey.npy"), 16)
    np.save(tmp_path / "grey_labels.npy", labels)
    x, _, _ = load_images(str(tmp_path / "grey.npy"), 16)
    assert x.shape == (10, 16, 16, 3)  # grey repeated over the model's channels
    with pytest.raises(ValueError, match="expects 32x32"):
        load_images(str(tmp_path / "set.npz"), 32)
    _write_folder(tmp_path / "folder", per_class=3)
    x, y, names = load_images(str(tmp_path / "folder"), 16)  # resized from 20x24
    assert x.shape == (6, 16, 16, 3) and names == ["cat", "dog"]
    assert sorted(y.tolist()) == [0, 0, 0, 1, 1, 1]


def test_array_images_visit_every_example_once_per_epoch():
    images = np.arange(12, dtype=np.float32).reshape(12, 1, 1, 1)
    stream = ArrayImages(images, np.arange(12), global_batch=4, seed=0)
    epoch0 = np.concatenate([stream.batch(i)["targets"] for i in range(3)])
    epoch1 = np.concatenate([stream.batch(i)["targets"] for i in range(3, 6)])
    assert sorted(epoch0) == sorted(epoch1) == list(range(12))
    assert not np.array_equal(epoch0, epoch1)  # reshuffled each epoch
    assert np.array_equal(stream.batch(4)["targets"], stream.batch(4)["targets"])


def test_image_models_refuse_text_data():
    model = ResNetModel.from_config(config.load(TINY_YAML))
    with pytest.raises(ValueError, match="data.source=synthetic"):
        model.data_stream(config.load(TINY_YAML, ["data.source=stdlib"]))


# ------------------------------------------------------------------------------ learning


def test_resnet_tiny_learns_the_synthetic_task():
    """configs/resnet_tiny.yaml (ResNet-10, width 8, dp=2, synced BN, 4 classes): in 30 steps
    the mean loss of the last 5 steps is at least 0.7 nats below the first step's (~ln 4)."""
    cfg = config.load(TINY_YAML)
    model = ResNetModel.from_config(cfg)
    run = assemble(cfg, jax.devices()[: cfg.num_devices], model=model)
    state, train_step = run.init_state(), run.train_step()
    stream = model.data_stream(cfg)
    losses = []
    for i in range(cfg.train.steps):
        state, metrics = train_step(state, run.put_batch(stream.batch(i)))
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all()
    assert np.mean(losses[-5:]) < losses[0] - 0.7, losses
