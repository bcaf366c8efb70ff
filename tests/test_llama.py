"""The Llama decoder computes the single-device loss and gradients on every mesh (fp32).

Default run: a few meshes covering both kv-head layouts (split over tp when kv_heads >= tp,
replicated below), a pipeline, FSDP and collective matmul (also under a pipeline). `make
test-slow` sweeps (dp, tp) in {(2, 4), (8, 1)} x kv_heads in {1, 2, heads} x tp_comm x FSDP,
and pp2 x dp2 x tp2 with 1F1B and ZB-V (plain, FSDP, sequence parallel, collective matmul)
for every kv_heads.
"""

import jax
import numpy as np
import pytest
from helpers import TINY, cached_references, max_rel_err, rel

from jax_overlap import config
from jax_overlap.pipeline import layout
from jax_overlap.training.assemble import assemble
from models.llama import Llama, Rope

HEADS = 4
CHUNKS = {"1f1b": 1, "zb-v": 2}


def llama_cfg(kv, dp=1, tp=1, pp=1, extra=()):
    return config.load(TINY, [
        "model.kind=llama", f"model.heads={HEADS}", f"model.kv_heads={kv}", "model.layers=4",
        "model.tied_embeddings=false", f"mesh.dp={dp}", f"mesh.tp={tp}", f"mesh.pp={pp}",
        *extra])


@pytest.fixture(scope="module")
def references():
    """Single-device loss and gradients per kv_heads (computed once each)."""
    return cached_references(llama_cfg, Llama)


def check(references, kv, dp, tp, pp=1, extra=()):
    cfg = llama_cfg(kv, dp, tp, pp, extra)
    _, params, batch, ref_loss, ref_grads = references(kv)
    model = Llama.from_config(cfg.model, tp=tp)
    run = assemble(cfg, jax.devices()[: dp * pp * tp], model=model)
    plan, shardings = run.plan, run.param_shardings()
    staged = run.place_params(params)
    loss, grads = jax.jit(run.loss_and_grads())(staged, run.put_batch(batch))
    assert rel(float(loss), ref_loss) <= 1e-5, (float(loss), ref_loss)
    assert max_rel_err(layout.to_logical(grads, plan.layer_perm), ref_grads) <= 1e-5
    # kv heads split over tp exactly when kv_heads >= tp; replicated otherwise.
    kv_spec = shardings["blocks"]["w_kv"].spec
    assert (kv_spec[2] == "tp") == (tp > 1 and kv >= tp), kv_spec


def pipeline_extra(name):
    return [f"pipeline.schedule={name}", "pipeline.microbatches=2",
            f"pipeline.virtual_stages={CHUNKS[name]}"]


def case_id(case):
    kv, dp, tp, pp, extra = case
    opts = "-".join(e.split("=")[1] for e in extra if not e.startswith("pipeline.m")
                    and not e.startswith("pipeline.v"))
    return f"kv{kv}-dp{dp}-tp{tp}-pp{pp}" + (f"-{opts}" if opts else "")


DEFAULT = [
    (2, 8, 1, 1, []),
    (4, 2, 4, 1, ["overlap.param_sharding=fsdp"]),  # kv split over tp
    (2, 2, 4, 1, ["overlap.tp_comm=collective_matmul"]),  # 2 < 4: replicated, under CM
    # One pipelined case (a minute of compiles on 2 cores): ZB-V with collective matmul's
    # grouped steps inside the stage branches. 1F1B and the kv_heads sweep under a pipeline
    # are in the slow SWEEP below.
    (4, 2, 2, 2, pipeline_extra("zb-v") + ["overlap.tp_comm=collective_matmul"]),
]


@pytest.mark.parametrize("kv,dp,tp,pp,extra", DEFAULT, ids=[case_id(c) for c in DEFAULT])
def test_llama_matches_single_device(references, kv, dp, tp, pp, extra):
    check(references, kv, dp, tp, pp, extra)


SWEEP = [(kv, dp, tp, 1, extra) for kv in (1, 2, HEADS) for dp, tp in [(2, 4), (8, 1)]
         for extra in ([], ["overlap.param_sharding=fsdp"],
                       ["overlap.tp_comm=sequence_parallel"],
                       ["overlap.tp_comm=collective_matmul"],
                       ["overlap.tp_comm=collective_matmul", "overlap.param_sharding=fsdp"])
         if not (tp == 1 and extra[:1] != [] and "tp_comm" in extra[0])]
SWEEP += [(kv, 2, 2, 2, pipeline_extra(name) + more) for kv in (1, 2, HEADS)
          for name in ("1f1b", "zb-v")
          for more in ([], ["overlap.param_sharding=fsdp"], ["overlap.tp_comm=sequence_parallel"],
                       ["overlap.tp_comm=collective_matmul"])]


@pytest.mark.slow
@pytest.mark.parametrize("kv,dp,tp,pp,extra", SWEEP, ids=[case_id(c) for c in SWEEP])
def test_llama_matches_single_device_sweep(references, kv, dp, tp, pp, extra):
    check(references, kv, dp, tp, pp, extra)


def test_tied_head_shares_the_embedding(references):
    cfg = config.load(TINY, ["model.kind=llama", "model.tied_embeddings=true"])
    params = Llama.from_config(cfg.model).init(jax.random.key(0))
    assert "w_out" not in params["head"]
    untied = Llama.from_config(llama_cfg(2).model).init(jax.random.key(0))
    assert untied["head"]["w_out"].shape == (32, 256)  # untied is the default in llama_cfg


def test_llama3_rope_scaling_keeps_high_and_divides_low_frequencies():
    plain, scaled = Rope(500000.0).inv_freq(128), Rope(500000.0, "llama3").inv_freq(128)
    wavelen = 2 * np.pi / plain
    high, low = wavelen < 8192 / 4.0, wavelen > 8192 / 1.0
    assert high.any() and low.any() and not (high & low).any()
    np.testing.assert_array_equal(scaled[high], plain[high])
    np.testing.assert_allclose(scaled[low], plain[low] / 8.0, rtol=1e-6)
    medium = ~high & ~low
    assert (scaled[medium] < plain[medium]).all() and (scaled[medium] > plain[medium] / 8).all()


@pytest.mark.parametrize("override,message", [
    (["model.kv_heads=3"], "model.kv_heads: 3 must divide model.heads=4"),
    (["model.heads=12", "model.d_model=96", "model.kv_heads=6"],
     "model.kv_heads: 6 >= mesh.tp=4 is split over tp and must be a multiple of it"),
    (["model.heads=4", "model.d_model=12"], "model.d_model: head size 12/4 is odd"),
])
def test_bad_kv_heads_and_head_size_are_one_line_each(override, message):
    with pytest.raises(config.ConfigError) as e:
        config.load(TINY, ["model.kind=llama", "mesh.dp=2", "mesh.tp=4", *override])
    assert e.value.problems[0].startswith(message), e.value.problems


def test_gpt_ignores_the_llama_fields():
    cfg = config.load(TINY, ["model.kv_heads=3", "model.rope_theta=5e5"])  # kind: gpt
    assert cfg.model.kind == "gpt"
