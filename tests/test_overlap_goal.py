"""The overlap goal on the real GPU schedule, compiled for 8 H100s without a GPU.

`analyze --target h100` compiles the GPT-1.3B train step (configs/gpt_1p3b.yaml) for 8 H100s
with the CUDA plugin (no CUDA libraries needed) and reads where XLA's latency-hiding scheduler
put each async collective. These tests fail if the share of collective bytes scheduled under
GEMMs drops below what the overlap engine reached (bench/overlap.py and the README report the
numbers; plain jit + GSPMD reaches 60% for dp=8).
"""

import pytest

from helpers import REPO
from jax_overlap import config
from jax_overlap.analysis import deviceless

pytestmark = pytest.mark.skipif(not deviceless.plugin_available(),
                                reason=deviceless.unavailable_reason() or "")

GPT_1P3B = f"{REPO}/configs/gpt_1p3b.yaml"


def _under_gemm(overrides):
    from jax_overlap.analysis import report

    cfg = config.load(GPT_1P3B, overrides)
    data = report.analyze(cfg, "h100").to_json()
    return data


def test_dp8_buckets_hide_under_backward_gemms_shallow():
    # Same widths as the 1.3B model, 4 layers: compiles in a fraction of the time.
    data = _under_gemm(["model.layers=4", "train.global_batch=64"])
    assert data["async_fraction"] == pytest.approx(1.0)
    # Measured 0.652 (2026-11-29, jax 0.12.0.1): the embedding's gradient is a larger share of
    # a 4-layer model, and it is complete only at the very end of the backward.
    assert data["collective_bytes_under_gemm_fraction"] >= 0.64


@pytest.mark.slow
def test_dp8_gpt_1p3b_reaches_its_overlap():
    data = _under_gemm([])  # measured 0.867 (GSPMD: 0.60)
    assert data["async_fraction"] == pytest.approx(1.0)
    assert data["collective_bytes_under_gemm_fraction"] >= 0.86


@pytest.mark.slow
def test_dp2_tp4_collective_matmul_reaches_its_overlap():
    data = _under_gemm(["mesh.dp=2", "mesh.tp=4", "overlap.tp_comm=collective_matmul",
                        "overlap.collective_matmul_direction=bi", "pipeline.microbatches=32"])
    assert data["async_fraction"] >= 0.99  # measured 0.996
    assert data["collective_bytes_under_gemm_fraction"] >= 0.82  # measured 0.824 (GSPMD: 0.21)
