"""`model.attention`: the fused attention kernel computes what the einsum path does, the plan
picks it for GPU targets only, and the GPU step compiled without a GPU runs cuDNN's kernel.

On a CPU the fused code path (`parallel.attention.fused_attention`, one
`jax.nn.dot_product_attention` call) runs with XLA's implementation (`Parallel.attention =
"xla"`): same call, same layout, grouped-query heads and masks as the cuDNN one, so comparing
it with the plain einsums in fp32 checks everything but cuDNN's kernel itself. The
deviceless compile checks that kernel is what a GPU would run.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest
from helpers import REPO, TINY, cached_references, max_rel_err, rel

from jax_overlap import config
from jax_overlap.analysis import deviceless
from jax_overlap.config import ConfigError
from jax_overlap.parallel import attention
from jax_overlap.parallel.collectives import Parallel
from jax_overlap.pipeline import layout
from jax_overlap.plan import Target
from jax_overlap.training.assemble import assemble, plan_for
from models.bert import BERT
from models.gpt import GPT
from models.llama import Llama

H100 = Target("h100", True, 80e9)
GPT_1P3B = f"{REPO}/configs/gpt_1p3b.yaml"
RESNET_TINY = f"{REPO}/configs/resnet_tiny.yaml"


# ------------------------------------------------------------------------ one block, fp32


def _block_value_and_grads(model, par):
    params = jax.tree.map(lambda a: a[0], model.init(jax.random.key(0))["blocks"])
    x = jax.random.normal(jax.random.key(1), (3, model.seq_len, model.d_model), jnp.float32)

    def loss(p, x):
        return (model.block(p, x, par) ** 2).sum()

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)


@pytest.mark.parametrize("model", [
    GPT(1, 32, 4, 64, 256, 16),
    BERT(1, 32, 4, 64, 256, 16),  # bidirectional: no mask
    Llama(1, 32, 4, 4, 64, 256, 16),
    Llama(1, 32, 4, 2, 64, 256, 16),  # grouped-query: two query heads per kv head
    Llama(1, 32, 4, 1, 64, 256, 16),
], ids=["gpt", "bert", "llama-kv4", "llama-kv2", "llama-kv1"])
def test_fused_code_path_matches_the_einsums(model):
    plain_loss, plain_grads = _block_value_and_grads(model, Parallel())
    fused_loss, fused_grads = _block_value_and_grads(model, Parallel(attention="xla"))
    assert rel(float(fused_loss), float(plain_loss)) <= 1e-6
    assert max_rel_err(fused_grads, plain_grads) <= 1e-5


def test_the_plain_path_is_the_default_and_unknown_kernels_are_refused():
    assert not attention.use_fused(Parallel())
    q = jnp.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError, match="unknown kernel"):
        attention.fused_attention(q, q, q, causal=True, par=Parallel(attention="pallas"))


# ------------------------------------------------------- the whole step: tp, pp, remat


def _cfg(extra):
    return config.load(TINY, ["model.layers=4", "model.tied_embeddings=false", *extra])


@pytest.fixture(scope="module")
def references():
    """Single-device (plain einsum) loss and gradients per model class, computed once each."""
    by_class = {cls: cached_references(
        lambda kind: _cfg([f"model.kind={kind}", "model.kv_heads=2"]), cls)
        for cls in (GPT, Llama)}
    return lambda cls, kind: by_class[cls](kind)


CASES = {
    # heads split over tp, with every block under `full`
    "gpt-dp2-tp4-full": (GPT, ["mesh.dp=2", "mesh.tp=4", "model.remat=full"]),
    # a pipeline with the B/W split, matmul outputs kept (the kernel is recomputed)
    "gpt-pp2-tp2-zbh1-save_dots": (GPT, [
        "mesh.dp=2", "mesh.pp=2", "mesh.tp=2", "pipeline.schedule=zb-h1",
        "pipeline.microbatches=2", "model.remat=save_dots"]),
    # grouped-query heads, kv replicated over tp (2 < 4), sequence parallel, minimal
    "llama-dp2-tp4-sp-minimal": (Llama, [
        "model.kind=llama", "model.kv_heads=2", "mesh.dp=2", "mesh.tp=4",
        "overlap.tp_comm=sequence_parallel", "model.remat=minimal"]),
}


@pytest.mark.parametrize("case", CASES, ids=CASES.keys())
def test_fused_step_matches_single_device(references, case):
    """The step with every block on the fused code path computes the single-device
    (plain einsum) loss and gradients, in fp32."""
    cls, extra = CASES[case]
    cfg = _cfg(extra)
    _, params, batch, ref_loss, ref_grads = references(cls, cfg.model.kind)
    model = (Llama.from_config(cfg.model, tp=cfg.mesh.tp) if cls is Llama
             else cls.from_config(cfg.model))
    run = assemble(cfg, jax.devices()[: cfg.num_devices], model=model)
    plan = dataclasses.replace(run.plan, attention="xla")
    run = dataclasses.replace(run, plan=plan)
    assert plan.parallel().attention == "xla"
    loss, grads = jax.jit(run.loss_and_grads())(run.place_params(params), run.put_batch(batch))
    assert rel(float(loss), ref_loss) <= 1e-5, (float(loss), ref_loss)
    assert max_rel_err(layout.to_logical(grads, plan.layer_perm), ref_grads) <= 1e-5


# ------------------------------------------------------------------------------ the plan


def test_auto_is_plain_on_a_cpu_and_fused_on_a_gpu_in_bf16():
    cpu = plan_for(config.load(TINY))
    assert cpu.attention == "plain" and cpu.parallel().attention == "plain"
    assert "needs a GPU" in cpu.choices["model.attention"].why
    gpu = plan_for(config.load(GPT_1P3B), target=H100)
    assert gpu.attention == "fused" and gpu.parallel().attention == "fused"
    assert gpu.choices["model.attention"].value == "fused"
    assert gpu.describe()["attention"] == "fused"
    resolved = gpu.resolved_config(config.load(GPT_1P3B))
    assert resolved.model.attention == "fused"
    config.validate(resolved)


@pytest.mark.parametrize("overrides,reason", [
    (["train.precision=fp32"], "bf16 or fp16"),
    (["model.heads=8"], "head dim 256"),  # 2048 / 8
    (["model.heads=32", "model.d_model=1920"], "head dim 60"),  # not a multiple of 8
])
def test_auto_falls_back_to_the_einsums_where_cudnn_cannot_run(overrides, reason):
    plan = plan_for(config.load(GPT_1P3B, overrides), target=H100)
    assert plan.attention == "plain"
    assert reason in plan.choices["model.attention"].why


def test_explicit_choices_win_and_impossible_ones_are_one_line():
    gpu = plan_for(config.load(GPT_1P3B, ["model.attention=plain"]), target=H100)
    assert gpu.attention == "plain" and "model.attention" not in gpu.choices
    with pytest.raises(ConfigError) as e:
        plan_for(config.load(TINY, ["model.attention=fused"]))
    assert len(e.value.problems) == 1 and "needs a GPU" in e.value.problems[0]
    with pytest.raises(ConfigError, match="bf16 or fp16"):
        plan_for(config.load(GPT_1P3B, ["model.attention=fused",
                                                  "train.precision=fp32"]), target=H100)
    resnet = plan_for(config.load(RESNET_TINY), target=H100)
    assert resnet.attention == "plain"
    assert "no attention" in resnet.choices["model.attention"].why


# ------------------------------------------------------------ the GPU step, deviceless


@pytest.mark.skipif(not deviceless.plugin_available(),
                    reason=deviceless.unavailable_reason() or "")
def test_the_gpu_step_runs_cudnn_flash_attention_and_no_score_tensor():
    """A small GPT train step (bf16, dp2 x tp2: two local heads) compiled for 4 H100s holds
    cuDNN's flash attention forward and backward, and no (b, h, T, T) tensor of any dtype."""
    from jax_overlap.analysis import analyze
    from jax_overlap.analysis.hlo_gemms import gemm_work
    from jax_overlap.analysis.hlo_parse import parse_module

    t = 256  # unlike any other dim of the step
    cfg = config.load(TINY, ["train.precision=bf16", "model.d_model=128", "model.heads=4",
                             "model.d_ff=256", f"model.seq_len={t}", "mesh.dp=2", "mesh.tp=2",
                             # one code path per microbatch (buckets give the last its own)
                             "overlap.grad_bucket_mb=0",
                             "model.remat=none"])  # one forward kernel (full re-runs it)
    built = analyze.build_plan(cfg, "h100")
    plan = built.plan
    assert plan.attention == "fused"
    devices = deviceless.gpu_topology_devices("h100", plan.num_devices)
    text = analyze.lower_train_step(cfg, devices, "h100", built).compile().as_text()
    targets = set(re.findall(r'custom_call_target="(__cudnn\$fmha[^"]*)"', text))
    assert targets == {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}
    assert re.findall(rf"\w+\[[\d,]*,{t},{t}\]", text) == []
    # The estimate sees the kernels' matmuls: q k^T and p v forward, five backward, causal.
    module = parse_module(text)
    b, h, e = plan.micro_batch, cfg.model.heads // plan.tp, cfg.model.d_model // cfg.model.heads
    calls = [(c, i, w) for c in module.computations.values() for i in c.instructions
             if i.opcode == "custom-call" and "fmha" in i.attributes
             and (w := gemm_work(module, c, i)) is not None]
    assert sorted(w.flops for _, _, w in calls) == [2 * 2 * b * h * t * t * e / 2,
                                                     5 * 2 * b * h * t * t * e / 2]
    # At measured rates, the kernels run at fused attention's share of the peak, not a GEMM's.
    from jax_overlap.analysis.step_estimate import kernel_of
    from jax_overlap.hardware.machine import chip_spec

    h100 = chip_spec("h100")
    measured = h100.at_measured_rates()
    for comp, inst, work in calls:
        assert work.attention
        kernel = kernel_of(module, comp, inst, measured)
        assert kernel.seconds == pytest.approx(max(
            work.flops / (h100.peak_bf16_flops * h100.efficiency.attention),
            kernel.bytes / (h100.hbm_bytes_per_s * h100.efficiency.memory)))
