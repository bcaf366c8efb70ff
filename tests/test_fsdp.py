"""FSDP communication window: same numbers as the reference, memory of ~(k+1) gathered blocks,
and a train step with fsdp + ZeRO-1 that follows the baseline's curve."""

import jax
import numpy as np
import pytest
from helpers import TINY, gpt_reference, max_rel_err, np_batch, rel
from jax.sharding import PartitionSpec as P

from jax_overlap import config
from jax_overlap.overlap import dp_layout
from jax_overlap.training.assemble import assemble, plan_for
from jax_overlap.training import loop as train
from models.gpt import GPT


def test_block_layout_splits_every_block_leaf_over_dp():
    cfg = config.load(TINY, ["overlap.param_sharding=fsdp"])
    model = GPT.from_config(cfg.model)
    layout = dp_layout.dp_layout(model, plan_for(cfg).overlap, {"dp": 2, "pp": 1, "tp": 4})
    specs = layout.param_specs
    assert specs["blocks"]["w_in"] == P(None, "dp", "tp")  # (layers, embed/dp, mlp/tp)
    assert specs["blocks"]["b_in"] == P(None, ("tp", "dp"))  # no free dim: under tp
    assert specs["blocks"]["ln_attn"]["scale"] == P(None, "dp")
    assert specs["embed"]["wte"] == P("tp", None)  # embedding and head stay replicated
    # Two gradient groups per block (TP-split and TP-replicated leaves), both split.
    assert [split for _, split in layout.fsdp.groups] == [True, True]
    # One layer on one device (tp=4): qkv 32x24 + 24, out 8x32 + 32, mlp 32x16 + 16 and
    # 16x32 + 32, two LayerNorms 4x32.
    assert layout.fsdp.gathered_bytes == 4 * (768 + 24 + 256 + 32 + 512 + 16 + 512 + 32 + 128)


def test_a_leaf_no_dp_divides_is_stored_whole_and_its_gradient_leaves_unreduced():
    """A block leaf with no dim divisible by dp stays whole (replicated over dp);
    `reduce_scatter_layer` hands its gradient back as this device's, dp-varying, for the
    step to sum like any replicated parameter's (a psum there would be typed dp-varying and
    no replicated out spec would take it)."""
    from jax_overlap.overlap import fsdp

    blocks = {"w": jax.ShapeDtypeStruct((2, 8, 4), np.float32),
              "odd": jax.ShapeDtypeStruct((2, 6), np.float32)}
    layout, specs = fsdp.block_layout(blocks, {"w": P(None, None, None), "odd": P(None, None)},
                                      {"dp": 4}, "dp")
    assert specs == {"w": P(None, "dp", None), "odd": P(None, None)}
    assert layout.replicated == {0}  # leaves in tree order: odd, w
    mesh = jax.make_mesh((4,), ("dp",), devices=jax.devices()[:4])

    def per_device(w, odd):  # one layer's full gradients on each device: (8, 4), (6,)
        g_odd, g_w = fsdp.reduce_scatter_layer([odd[0], w], layout, "dp", 4, "fp32")
        return g_w, g_odd[None]

    odd = np.arange(24, dtype=np.float32).reshape(4, 6)  # a different gradient per device
    w = np.ones((4 * 8, 4), np.float32)
    put = [jax.device_put(a, jax.NamedSharding(mesh, P("dp"))) for a in (w, odd)]
    g_w, g_odd = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("dp"), P("dp")),
                                       out_specs=(P("dp"), P("dp"))))(*put)
    np.testing.assert_array_equal(g_odd, odd)  # untouched: the step sums it
    np.testing.assert_array_equal(g_w, np.full((4 * 2, 4), 4.0))  # summed, each rank's 2 rows


@pytest.fixture(scope="module")
def reference():
    return gpt_reference()


def _check(reference, overrides, dp=2, tp=4):
    model, params, batch, ref_loss, ref_grads = reference
    cfg = config.load(TINY, [f"mesh.dp={dp}", f"mesh.tp={tp}", "overlap.param_sharding=fsdp",
                             *overrides])
    run = assemble(cfg, jax.devices()[: dp * tp], model=model)
    sharded = run.place_params(params)
    assert sharded["blocks"]["w_in"].addressable_shards[0].data.shape == (2, 32 // dp, 64 // tp)
    loss, grads = jax.jit(run.loss_and_grads())(sharded, run.put_batch(batch))
    assert rel(float(loss), ref_loss) <= 1e-5
    assert max_rel_err(grads, ref_grads) <= 1e-5
    # Block gradients come back split like the stored blocks.
    # (as shardings: with tp=1 one spec may name the size-1 'tp' axis and the other not)
    assert grads["blocks"]["w_in"].sharding.is_equivalent_to(sharded["blocks"]["w_in"].sharding,
                                                             3)


@pytest.mark.parametrize("overrides", [
    ["overlap.window=1"],
    ["overlap.window=3", "overlap.grad_bucket_mb=0.004", "overlap.zero1=true",
     "overlap.tp_comm=collective_matmul", "overlap.collective_matmul_direction=bi"],
])
def test_fsdp_matches_reference(reference, overrides):
    _check(reference, overrides)


@pytest.mark.slow
@pytest.mark.parametrize("window", [1, 2, 3])
@pytest.mark.parametrize("dp,tp,tp_comm", [(8, 1, "plain"), (4, 2, "sequence_parallel"),
                                           (2, 4, "collective_matmul")])
def test_fsdp_sweep(reference, window, dp, tp, tp_comm):
    # tiny's global batch is 16: at most 16 / dp microbatches of one sequence per replica
    _check(reference, [f"overlap.window={window}", f"overlap.tp_comm={tp_comm}",
                       f"pipeline.microbatches={min(4, 16 // dp)}",
                       "overlap.grad_comm_dtype=fp32"], dp, tp)


def test_bf16_gathers_matrices_in_bf16_and_computes_the_same():
    """Under train.precision=bf16 the weight matrices are all-gathered in bf16 (the model
    casts them to bf16 where it uses them) and the vectors as their fp32 bits, in one
    all-gather per group, and the loss and gradients are those of the replicated bf16 run."""
    from jax_overlap.analysis.hlo_report import analyze_hlo

    model, params, batch, _, _ = gpt_reference()

    def run(precision, sharding):
        cfg = config.load(TINY, ["mesh.dp=4", "mesh.tp=2", f"train.precision={precision}",
                                 f"overlap.param_sharding={sharding}"])
        assembled = assemble(cfg, jax.devices()[:8], model=model)
        f = jax.jit(assembled.loss_and_grads())
        args = (assembled.place_params(params), assembled.put_batch(batch))
        # The lowered module: XLA:CPU widens bf16 collectives to f32 when it compiles (a GPU
        # keeps them; the deviceless Llama-3-8B analysis in docs/guides/data_and_hf.md).
        report = analyze_hlo(f.lower(*args).as_text(dialect="hlo"))
        return f(*args), report.collectives.get("all-gather")

    (loss_r, grads_r), _ = run("bf16", "replicated")
    (loss_f, grads_f), gathers_bf16 = run("bf16", "fsdp")
    _, gathers_fp32 = run("fp32", "fsdp")
    assert rel(float(loss_f), float(loss_r)) <= 1e-5
    assert max_rel_err(grads_f, grads_r) <= 2e-2  # bf16 compute; summation order differs
    # tiny's blocks, per layer and device: 1792 matrix parameters (now 2 bytes) and 456
    # vector ones (still 4: fp32 bits): (1792 * 2 + 456 * 4) / (2248 * 4) = 0.60.
    assert 0.5 < gathers_bf16.bytes / gathers_fp32.bytes < 0.65


def test_peak_memory_grows_by_one_block_per_window_step():
    """16 blocks whose weights dominate memory (activations are ~1% of a block): the temp
    memory of one loss-and-grads is a few blocks plus one more gathered block per extra
    step of window, far below the 16 a gather-everything FSDP would hold."""
    overrides = ["mesh.dp=8", "mesh.tp=1", "model.layers=16", "model.d_model=256",
                 "model.d_ff=1024", "pipeline.microbatches=1", "overlap.param_sharding=fsdp"]
    temps, block = [], None
    for window in (1, 2, 3):
        cfg = config.load(TINY, overrides + [f"overlap.window={window}"])
        model = GPT.from_config(cfg.model)
        run = assemble(cfg, jax.devices()[:8], model=model)
        abstract = jax.eval_shape(model.init, jax.random.key(0))
        batch = run.put_batch(np_batch(cfg))
        compiled = jax.jit(run.loss_and_grads()).lower(abstract, batch).compile()
        temps.append(compiled.memory_analysis().temp_size_in_bytes)
        block = dp_layout.dp_layout(model, run.plan.overlap,
                                    dict(run.mesh.shape)).fsdp.gathered_bytes
    steps = np.diff(temps) / block
    assert np.all((steps > 0.7) & (steps < 1.4)), (temps, block, steps)
    # (k + 1) blocks in flight plus about three blocks of per-layer work (the one block's
    # unsharded gradient and its flat copy for the reduce-scatter, activations).
    for window, temp in zip((1, 2, 3), temps):
        assert temp < (window + 4) * block, (window, temp / block)
    assert temps[-1] < 16 * block / 2


@pytest.mark.slow
def test_train_step_fsdp_zero1_follows_baseline(tmp_path):
    """FSDP blocks + ZeRO-1 (optimizer state split over dp, update under GSPMD) + buckets:
    the same loss curve as the plain step, with the state stored split."""
    base = ["train.steps=2"]
    want = train.run(config.load(TINY, base), str(tmp_path / "base"), progress=False).losses
    options = base + ["overlap.param_sharding=fsdp", "overlap.zero1=true",
                      "overlap.grad_bucket_mb=0.004"]
    cfg = config.load(TINY, options)
    got = train.run(cfg, str(tmp_path / "fsdp"), progress=False).losses
    assert max(rel(a, b) for a, b in zip(got, want)) <= 1e-4, (got, want)

    state = assemble(cfg, model=GPT.from_config(cfg.model)).init_state()
    adam = state.opt_state[1][0]
    assert state.params["blocks"]["w_in"].sharding.spec == P(None, "dp", "tp")
    assert adam.mu["blocks"]["w_in"].sharding.spec == P(None, "dp", "tp")
    assert state.params["embed"]["wte"].sharding.spec == P("tp", None)  # replicated over dp
    assert adam.mu["embed"]["wte"].sharding.spec == P("tp", "dp")  # ZeRO-1
    assert adam.nu["head"]["ln_f"]["scale"].sharding.spec == P(("dp", "tp"))
