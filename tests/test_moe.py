"""The mixture-of-experts Llama (models/moe.py): routing, capacity and drops, the router
losses' gradients, the statistics the step reports, and the single-device loss and gradients
on every mesh (fp32, <= 1e-5), drops included: the same tokens drop on every mesh.

Default run: tiny meshes with drops, shared experts and dense layers between the MoE
ones (ep2 x tp2 with chunked all-to-alls and paired microbatches; sequence parallel with FSDP
over dp4, which stores the statistics leaf whole; ep2 x tp2 with ZeRO-1, in-backward buckets
and paired microbatches; ep2 on two hosts). `make test-slow`: pipelines (1F1B, paired 1F1B,
ZB-V, ZB-H1, with and without ep, on two hosts), collective matmul, FSDP, remat, dropless,
the pp = 1 cases unpaired, configs/moe_tiny.yaml learning with balanced experts, and a
checkpoint saved with ep2 + FSDP resuming with ep1.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY, max_rel_err, np_batch, rel

from jax_overlap import config
from jax_overlap.pipeline import layout
from jax_overlap.training.assemble import assemble
from jax_overlap.training import grads as gradslib
from jax_overlap.training import moe_stats
from models import moe
from models.moe import MoeLlama, MoeSpec

BASE = ["model.kind=llama", "model.heads=4", "model.kv_heads=2", "model.layers=4",
        "model.tied_embeddings=false", "model.experts=4", "model.experts_per_token=2",
        "model.router_aux_loss=0.1", "model.router_z_loss=0.01"]
# key -> model overrides: drops (capacity 1.0 of 4 experts, top-2) with a shared expert and
# dense layers between the MoE ones; dropless.
VARIANTS = {
    "drops": ["model.expert_capacity=1.0", "model.shared_experts=1", "model.moe_every=2"],
    "dropless": ["model.expert_capacity=dropless"],
}


def moe_cfg(key, dp=1, tp=1, pp=1, extra=()):
    return config.load(TINY, [*BASE, *VARIANTS[key], f"mesh.dp={dp}", f"mesh.tp={tp}",
                              f"mesh.pp={pp}", *extra])


_REFS = {}


def reference(key):
    if key not in _REFS:
        cfg = moe_cfg(key)
        model = MoeLlama.from_config(cfg)
        params = model.init(jax.random.key(cfg.train.seed))
        batch = np_batch(cfg)
        loss, grads = jax.jit(jax.value_and_grad(
            lambda p: gradslib.reference_loss(model, p, batch)))(params)
        _REFS[key] = (params, batch, float(loss), grads)
    return _REFS[key]


def check(key, dp, tp, pp=1, extra=()):
    cfg = moe_cfg(key, dp, tp, pp, extra)
    params, batch, ref_loss, ref_grads = reference(key)
    run = assemble(cfg, jax.devices()[: cfg.mesh.dcn * dp * pp * tp])
    plan = run.plan
    staged = run.place_params(params)
    loss, grads = jax.jit(run.loss_and_grads())(staged, run.put_batch(batch))
    grads = layout.to_logical(grads, plan.layer_perm)
    if cfg.mesh.ep > 1:  # each rank stores E/dp experts; their tokens travel by all-to-all
        for name in ("w_experts_gate_up", "w_experts_down"):
            stored = staged["blocks"]["moe"][name]
            shard = stored.addressable_shards[0].data.shape
            expert_dim = 1 - params["blocks"]["moe"][name].ndim  # after the layer dim
            assert shard[expert_dim] == cfg.model.experts // dp, (name, shard)
        hlo = jax.jit(run.loss_and_grads()).lower(staged, run.put_batch(batch)).as_text()
        assert "all_to_all" in hlo or "all-to-all" in hlo
        if (pp == 1 and plan.layout.fsdp is None and plan.layout.plan is None
                and not plan.overlap.pair_microbatches):
            # one scanned unit (no unrolled bucketed microbatch): per chunk a dispatch and a
            # combine, forward and backward
            assert hlo.count("all_to_all") == 4 * plan.parallel().moe_chunks
    assert rel(float(loss), ref_loss) <= 1e-5, (float(loss), ref_loss)
    # The statistics "gradient": tokens per expert and dropped assignments are counts, equal
    # on every mesh (the same tokens drop), and the router losses' value.
    stats, ref_stats = (np.asarray(g["blocks"]["moe"][moe.STATS]) for g in (grads, ref_grads))
    np.testing.assert_allclose(stats[:, :5], ref_stats[:, :5], atol=1e-3)
    assert max_rel_err(grads, ref_grads) <= 1e-5


def pipeline_extra(name, chunks=1, paired=False):
    return [f"pipeline.schedule={name}", "pipeline.microbatches=2",
            f"pipeline.virtual_stages={chunks}"] + (["pipeline.paired=true"] if paired else [])


PAIRED = ["overlap.pair_microbatches=true"]
DEFAULT = [
    # ep2 over dp4: each rank stores 1 of the 4 experts, the two replicas of an ep slot
    # all-gather the slot's 2 and reduce-scatter their gradients. 3 chunks: the middle
    # stage runs beside the next chunk's dispatch and the previous one's combine. Paired
    # microbatches: the first forward, two trips of (forward 2 | backward 1, forward 3 |
    # backward 2), the last backward.
    ("drops", 4, 2, 1, ["mesh.ep=2", "overlap.moe_chunks=3", "pipeline.microbatches=4",
                        *PAIRED]),
    # ep = dp with ZeRO-1 and in-backward buckets: the experts' optimizer state is split by
    # ep already (no dp sum, no ZeRO-1 split), the rest by ZeRO-1. At tp2 the buckets mark
    # the router weight tp-varying and reduce the statistics over (dp, tp): each tp rank
    # gives half (the counts came out doubled). Paired over 2 microbatches: the first one's
    # backward beside the last one's bucketed forward and backward.
    ("drops", 2, 2, 1, ["mesh.ep=2", "overlap.zero1=true", "overlap.grad_bucket_mb=0.01",
                        "pipeline.microbatches=2", *PAIRED]),
    # FSDP over dp=4 stores the moe_stats leaf (E + 2 = 6) whole: its gradient is summed with
    # the in-backward buckets' after the FSDP stack (`fsdp.BlockLayout.replicated`).
    ("drops", 4, 2, 1, ["overlap.tp_comm=sequence_parallel", "overlap.param_sharding=fsdp",
                        "overlap.grad_bucket_mb=0.01"]),
    # Two hosts (the slow axis), nothing but the mesh set: the experts each rank stores are
    # the same on both, their gradients summed over dcn as well as in their ep slot.
    ("drops", 2, 1, 1, ["mesh.dcn=2", "mesh.ep=2"]),
]


def case_id(case):
    key, dp, tp, pp, extra = case
    opts = "-".join(e.split(".")[-1] for e in extra if not e.startswith("pipeline.m"))
    return f"{key}-dp{dp}-tp{tp}-pp{pp}" + (f"-{opts}" if opts else "")


@pytest.mark.parametrize("key,dp,tp,pp,extra", DEFAULT, ids=[case_id(c) for c in DEFAULT])
def test_moe_matches_single_device(key, dp, tp, pp, extra):
    check(key, dp, tp, pp, extra)


def test_route_keeps_first_choices_first_and_drops_past_capacity():
    # One sequence of 4 tokens, 2 experts, top-2, capacity 2 (factor 0.5 x 4 x 2 / 2).
    spec = MoeSpec(experts=2, k=2, capacity=0.5)
    assert spec.capacity_for(4) == 2 and MoeSpec(2, 2, "dropless").capacity_for(4) == 4
    logits = jnp.asarray([[[2.0, 0.0], [1.0, 0.0], [0.0, 3.0], [0.0, 1.0]]])
    expert, slot, gate, keep, _ = moe.route(logits, spec, 2)
    # First choices (n = t): experts 0, 0, 1, 1 take slots 0, 1, 0, 1; every second choice
    # (n = 4 + t) finds its expert full.
    np.testing.assert_array_equal(expert[0], [0, 0, 1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(keep[0], [True] * 4 + [False] * 4)
    np.testing.assert_array_equal(slot[0], [0, 1, 0, 1, 2, 2, 2, 2])
    np.testing.assert_allclose(gate[0, :4] + gate[0, 4:], 1.0, rtol=1e-6)  # renormalised
    out = moe.combine(moe.dispatch(jnp.arange(8.0).reshape(1, 4, 2), expert, slot, spec, 2),
                      expert, slot, gate, spec, 1, 4, 2)
    # With identity experts a kept token comes back times its first gate only.
    np.testing.assert_allclose(out[0], np.arange(8.0).reshape(4, 2) * np.asarray(gate[0, :4])[:, None],
                               rtol=1e-6)


def test_chunk_bounds_cover_the_slots_with_half_size_ends():
    # 3+ chunks: the first and the last (whose all-to-alls have no GEMM of the layer to go
    # under) are half the others.
    assert moe.chunk_bounds(12, 4) == [0, 2, 6, 10, 12]
    assert moe.chunk_bounds(20480, 6) == [0, 2048, 6144, 10240, 14336, 18432, 20480]
    assert moe.chunk_bounds(10, 2) == [0, 5, 10] and moe.chunk_bounds(10, 1) == [0, 10]
    # more chunks than slots: no empty chunk
    bounds = moe.chunk_bounds(3, 8)
    assert bounds[0] == 0 and bounds[-1] == 3 and all(b > a for a, b in zip(bounds, bounds[1:]))


def _explicit_router_loss(model, params, batch):
    """The router losses' sum over layers (unscaled), as a differentiable value."""
    from jax_overlap.parallel.collectives import Parallel

    x = model.embed(params["embed"], batch["inputs"], Parallel())
    total = 0.0
    for i in range(model.num_layers):
        p = jax.tree.map(lambda a: a[i], params["blocks"])
        x, state = model._block(1).apply({"params": p}, x, Parallel(),
                                         mutable=["intermediates"])
        total = total + sum(jax.tree.leaves(state))
    return total


def test_router_loss_gradient_is_the_explicit_losses_gradient():
    import dataclasses

    cfg = moe_cfg("drops")
    model = MoeLlama.from_config(cfg)
    params = model.init(jax.random.key(0))
    batch = np_batch(cfg)
    off = dataclasses.replace(model, moe=dataclasses.replace(model.moe, aux_coef=0.0,
                                                             z_coef=0.0))
    silent = dataclasses.replace(model, moe=dataclasses.replace(model.moe, loss_scale=0.0))

    def grad(m, f):
        return jax.jit(jax.grad(lambda p: f(m, p, batch)))(params)

    with_losses = grad(model, gradslib.reference_loss)
    without = grad(off, gradslib.reference_loss)
    explicit = grad(silent, _explicit_router_loss)
    expected = jax.tree.map(lambda a, b: a + model.moe.loss_scale * b, without, explicit)
    router = with_losses["blocks"]["moe"]["w_router"]
    assert float(jnp.abs(router - without["blocks"]["moe"]["w_router"]).max()) > 1e-6
    for name in ("w_router", "w_q", "w_experts_gate_up"):
        assert max_rel_err(with_losses["blocks"]["moe"][name],
                           expected["blocks"]["moe"][name]) <= 1e-5, name


def test_step_reports_tokens_per_expert_and_drops():
    _, _, _, grads = reference("drops")
    cleaned, metrics = moe_stats.take(grads, 4)
    assert float(jnp.abs(cleaned["blocks"]["moe"][moe.STATS]).max()) == 0.0
    cfg = moe_cfg("drops")
    per_layer = cfg.train.global_batch * cfg.model.seq_len * cfg.model.experts_per_token
    np.testing.assert_allclose(float(metrics["moe_tokens_per_expert"].sum()), per_layer)
    assert 0 < float(metrics["moe_dropped_tokens"]) < per_layer  # capacity 1.0 drops some
    assert 0 < float(metrics["moe_expert_load_min"]) <= 1
    record = moe_stats.step_record(jax.device_get(metrics))
    assert len(record["tokens_per_expert"]) == 4 and record["dropped_tokens"] > 0
    assert moe_stats.take({"blocks": {"w": jnp.ones(2)}}, 0)[1] == {}


@pytest.mark.parametrize("override,message", [
    (["model.kind=gpt"], "model.experts: mixture of experts is built on the Llama decoder"),
    (["model.moe_every=3"], "model.moe_every: 3 must be >= 1 and divide model.layers=4"),
    (["model.experts_per_token=5"], "model.experts_per_token: 5 must be between 1 and"),
    (["model.expert_capacity=0"], "model.expert_capacity: must be dropless or a factor > 0"),
    (["model.expert_capacity=lots"], "model.expert_capacity: expected"),
    (["model.moe_every=2", "mesh.pp=4", "mesh.dp=1", "mesh.tp=1"],
     "model.moe_every: the pipeline splits groups of 2 layers"),
    (["mesh.dp=8", "mesh.tp=1", "mesh.ep=2"], "model.experts: 4 experts cannot be stored split"),
    (["mesh.dp=2", "mesh.tp=1", "mesh.pp=2", "mesh.ep=2", "overlap.grad_bucket_mb=1"],
     "overlap.grad_bucket_mb: in-loop buckets under a pipeline"),
    (["mesh.dcn=2", "mesh.dp=2", "mesh.tp=1", "overlap.dcn_delay=1"],
     "overlap.dcn_delay_mode: local keeps its own gradients"),
])
def test_bad_moe_settings_are_one_line_each(override, message):
    with pytest.raises(config.ConfigError) as e:
        config.load(TINY, [*BASE, *override])
    assert any(p.startswith(message) for p in e.value.problems), e.value.problems


SWEEP = [
    ("drops", 2, 2, 1, []),
    ("drops", 4, 2, 1, ["mesh.ep=2", "overlap.moe_chunks=3"]),
    ("drops", 2, 2, 1, ["mesh.ep=2", "overlap.zero1=true", "overlap.grad_bucket_mb=0.01"]),
    ("dropless", 4, 1, 1, ["mesh.ep=4", "model.remat=full", "pipeline.microbatches=2",
                           "overlap.grad_bucket_mb=0.01", *PAIRED]),
    ("drops", 2, 2, 1, ["mesh.ep=2", "overlap.param_sharding=fsdp", "pipeline.microbatches=2",
                        *PAIRED]),
    ("drops", 2, 1, 2, pipeline_extra("1f1b", paired=True) + ["mesh.dcn=2", "mesh.ep=2"]),
    ("drops", 2, 1, 1, ["mesh.dcn=2", "mesh.ep=2", "overlap.param_sharding=fsdp",
                        "overlap.dcn_delay_mode=gradient"]),
    ("dropless", 2, 2, 2, pipeline_extra("1f1b")),
    ("dropless", 8, 1, 1, []),
    ("dropless", 4, 1, 1, ["mesh.ep=4", "overlap.moe_chunks=3"]),
    ("dropless", 4, 1, 2, pipeline_extra("1f1b", paired=True) + ["mesh.ep=2",
                                                                 "overlap.moe_chunks=3"]),
    ("drops", 4, 2, 1, ["mesh.ep=4", "overlap.param_sharding=fsdp",
                        "overlap.tp_comm=sequence_parallel"]),
    ("dropless", 2, 2, 2, pipeline_extra("1f1b", paired=True) + ["mesh.ep=2"]),
    ("dropless", 2, 2, 2, pipeline_extra("zb-v", chunks=2) + ["mesh.ep=2",
                                                             "overlap.moe_chunks=2"]),
    ("dropless", 2, 4, 1, ["overlap.tp_comm=collective_matmul"]),
    ("drops", 2, 4, 1, ["overlap.param_sharding=fsdp", "model.remat=full"]),
    ("drops", 2, 2, 2, pipeline_extra("1f1b", paired=True)),
    ("dropless", 2, 2, 2, pipeline_extra("1f1b", paired=True)
     + ["overlap.tp_comm=sequence_parallel"]),
    ("dropless", 2, 2, 2, pipeline_extra("zb-v", chunks=2)),
    ("dropless", 2, 2, 2, pipeline_extra("zb-v", chunks=2) + ["overlap.param_sharding=fsdp"]),
    ("drops", 1, 2, 2, pipeline_extra("zb-h1") + ["model.remat=save_dots"]),
    ("dropless", 2, 1, 2, pipeline_extra("interleaved", chunks=2) + ["mesh.ep=2"]),
    ("dropless", 2, 2, 2, pipeline_extra("interleaved", chunks=2, paired=True)
     + ["mesh.ep=2", "pipeline.fused_pairs=true"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("key,dp,tp,pp,extra", SWEEP, ids=[case_id(c) for c in SWEEP])
def test_moe_matches_single_device_sweep(key, dp, tp, pp, extra):
    check(key, dp, tp, pp, extra)


@pytest.mark.slow
def test_moe_tiny_learns_with_every_expert_in_use(tmp_path):
    """configs/moe_tiny.yaml, 200 steps on CPU: the loss falls and over the last 20 steps no
    expert of any layer gets below 25% of its layer's mean load."""
    import json

    from helpers import last_json_line, run_cli

    out = run_cli("train", "--config", "configs/moe_tiny.yaml", "--run-dir", str(tmp_path / "r"))
    assert out.returncode == 0, out.stderr[-2000:]
    summary = last_json_line(out.stdout)
    assert summary["last_loss"] < 0.5 * summary["first_loss"], summary
    records = [json.loads(line) for line in open(tmp_path / "r" / "metrics.jsonl")]
    steps = [r for r in records if "tokens_per_expert" in r]
    assert len(steps) == 200 and len(steps[-1]["tokens_per_expert"]) == 8
    assert min(r["expert_load_min"] for r in steps[-20:]) >= 0.25


@pytest.mark.slow  # two compiled training runs: ~75 s on 2 busy cores
@pytest.mark.parametrize("saved_with,resumed_with", [
    (["mesh.ep=2", "overlap.moe_chunks=2", "overlap.param_sharding=fsdp"], ["mesh.ep=1"]),
    (["mesh.ep=1"], ["mesh.ep=2"]),
], ids=["ep2-to-ep1", "ep1-to-ep2"])
def test_checkpoint_resumes_across_ep_sizes(tmp_path, saved_with, resumed_with):
    """Checkpoints hold the logical experts: a run saved with ep2 (each rank storing its
    own experts and their optimizer state; FSDP for the rest) resumes with ep1, replicated,
    and one saved with ep1 resumes with ep2; the resumed steps 3..4 are the straight run's
    (up to the reduction order)."""
    import os
    import shutil

    from jax_overlap.training import loop as train

    opts = ["train.steps=4", "checkpoint.every_steps=2", "checkpoint.keep=5",
            "checkpoint.async_save=false"]
    saved = train.run(moe_cfg("drops", dp=2, extra=[*opts, *saved_with]),
                      str(tmp_path / "saved"), progress=False, devices=jax.devices()[:2])
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(tmp_path, "saved", "checkpoints"), ckpt)
    shutil.rmtree(os.path.join(ckpt, "4"))  # as if the saved run had stopped at step 2
    resumed = train.run(moe_cfg("drops", dp=2, extra=[*opts, *resumed_with,
                                                      f"checkpoint.dir={ckpt}"]),
                        str(tmp_path / "resumed"), progress=False, devices=jax.devices()[:2])
    assert resumed.summary()["resumed_from"] == 2 and resumed.steps == 2
    assert max(rel(a, b) for a, b in zip(resumed.losses, saved.losses[2:])) <= 1e-4
    assert saved.losses[3] != saved.losses[1]  # steps 3..4 are not steps 1..2 again


def test_memory_estimate_stores_experts_split_over_dp():
    """hardware.memory: with mesh.ep > 1 each rank stores E/dp of the routed experts, with
    their fp32 gradient and Adam moments (4 + 4 + 8 bytes an element), and the rest as before;
    the plan's estimate passes mesh.ep."""
    from jax_overlap.hardware import memory
    from jax_overlap.model_api import param_elements

    cfg = config.load("configs/mixtral_8x7b.yaml", ["model.layers=2"])
    m, dp = cfg.model, 4
    routed = memory.routed_expert_elements(m)
    assert routed == m.experts * 3 * m.d_model * m.d_ff
    args = (m, 1, 1, 1, dp, "bf16")
    full = memory.step_memory(*args, params=param_elements(cfg), ep=1)
    split = memory.step_memory(*args, params=param_elements(cfg), ep=dp)
    assert full.state - split.state == pytest.approx(16 * m.layers * routed * (1 - 1 / dp))
    zero1 = memory.step_memory(*args, params=param_elements(cfg), ep=dp, zero1=True)  # experts' moments not split twice
    other = full.state / 16 - m.layers * routed  # elements of everything else
    assert split.state - zero1.state == pytest.approx(8 * other * (1 - 1 / dp))
    # The plan carries mesh.ep, so its estimate and preflight's see the split experts.
    import dataclasses

    from jax_overlap.resilience import preflight
    from jax_overlap.training.assemble import plan_for

    cfg = config.load("configs/mixtral_8x7b.yaml", ["model.layers=2",
                                                    "overlap.param_sharding=replicated"])
    plan = plan_for(cfg)
    assert plan.ep == cfg.mesh.ep == cfg.mesh.dp == 8
    parts = memory.plan_step_memory(m, cfg.train.precision, plan)
    whole = memory.plan_step_memory(m, cfg.train.precision, dataclasses.replace(plan, ep=1))
    assert whole.state - parts.state == pytest.approx(16 * m.layers * routed * (1 - 1 / 8))
    assert preflight.device_step_parts(m, cfg.train, plan)["state"] == parts.state
    # Under FSDP the routed experts stay out of the gathered window preflight counts.
    fsdp = plan_for(config.load("configs/mixtral_8x7b.yaml", ["model.layers=2"]))
    gathered = (fsdp.overlap.window + 1) * 4 / fsdp.tp
    comm_ep = preflight.device_step_parts(m, cfg.train, fsdp)["comm"]
    comm_no = preflight.device_step_parts(m, cfg.train, dataclasses.replace(fsdp, ep=1))["comm"]
    assert fsdp.overlap.fsdp and comm_no - comm_ep == pytest.approx(gathered * routed)
