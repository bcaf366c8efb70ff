"""The same guarantees on a real GPU: equivalence, a preset train step, async collectives.

Run with `make test-gpu` (which sets JAX_PLATFORMS=cuda,cpu). Every test here is marked `gpu`
and skips with the reason where no GPU is present, so the default CPU run never selects them.

Tolerances: fp32 runs with matmul precision 'highest' (otherwise XLA uses TF32 on Ampere and
newer, ~1e-3 relative) and must match the single-device reference to 1e-5 relative; bf16 runs
must match the fp32 reference to 2e-2 relative (bf16 keeps ~3 significant digits).
"""

import json
import os
import subprocess
import sys

import jax
import pytest
from helpers import REPO, TINY, max_rel_err, np_batch, rel

pytestmark = pytest.mark.gpu

GPUS = [d for d in jax.devices() if d.platform == "gpu"] if os.environ.get(
    "JAX_PLATFORMS", "") != "cpu" else []
needs_gpu = pytest.mark.skipif(not GPUS, reason="no GPU visible to JAX (JAX_PLATFORMS=cuda)")


def _mesh_overrides(n: int) -> list[str]:
    """The largest (dp, tp) the tiny model allows on n GPUs."""
    tp = 4 if n % 4 == 0 else 2 if n % 2 == 0 else 1
    return [f"mesh.dp={n // tp}", "mesh.pp=1", f"mesh.tp={tp}",
            f"train.global_batch={8 * (n // tp) * 2}"]


@needs_gpu
@pytest.mark.parametrize("precision,tol", [("fp32", 1e-5), ("bf16", 2e-2)])
def test_loss_and_grads_match_reference_on_gpu(precision, tol):
    from jax_overlap import config
    from jax_overlap.plan import Target
    from jax_overlap.training import grads as gradslib
    from jax_overlap.training.assemble import assemble
    from models.gpt import GPT

    cfg = config.load(TINY, _mesh_overrides(len(GPUS)) + [f"train.precision={precision}"])
    model = GPT.from_config(cfg.model)
    batch = np_batch(cfg)
    with jax.default_matmul_precision("highest"):
        params = model.init(jax.random.key(0))
        ref_loss, ref_grads = jax.value_and_grad(
            lambda p: gradslib.reference_loss(model, p, batch))(params)
        # the CPU target's plan on the GPUs: the same code paths as the reference
        run = assemble(cfg, GPUS, model=model, target=Target())
        loss, grads = jax.jit(run.loss_and_grads())(run.place_params(params),
                                                    run.put_batch(batch))
    assert rel(float(loss), float(ref_loss)) <= tol
    assert max_rel_err(grads, ref_grads) <= (tol if precision == "fp32" else 5e-2)


@needs_gpu
def test_train_step_with_gpu_preset(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cuda,cpu", "PYTHONUNBUFFERED": "1"}
    overrides = sum((["--set", o] for o in _mesh_overrides(len(GPUS))), [])
    proc = subprocess.run(
        [sys.executable, "-m", "jax_overlap.cli", "train", "--config", TINY, "--no-progress",
         "--run-dir", str(tmp_path), "--set", "overlap.xla_preset=gpu_overlap",
         "--set", "train.steps=6", *overrides],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["last_loss"] < summary["first_loss"]
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert 0 < record["mfu"] < 1  # MFU is reported on an accelerator


@needs_gpu
def test_compiled_hybrid_step_has_async_collectives_under_compute():
    """dp2 x pp2 x tp2 compiled for 8 GPUs of this machine's kind (deviceless topology)."""
    from jax_overlap import config
    from jax_overlap.analysis import deviceless
    from jax_overlap.analysis.analyze import lower_train_step

    kind = GPUS[0].device_kind.lower()
    target = "h200" if "h200" in kind else "a100" if "a100" in kind else "h100"
    cfg = config.load(TINY, ["mesh.dp=2", "mesh.pp=2", "mesh.tp=2", "model.layers=4",
                             "pipeline.microbatches=2", "overlap.grad_bucket_mb=0.01"])
    report = deviceless.analyze_for(target, 8, lambda devices: lower_train_step(cfg, devices))
    data = report.to_json()
    assert data["async_fraction"] > 0.5
    assert data["collective_bytes_under_gemm_fraction"] > 0
