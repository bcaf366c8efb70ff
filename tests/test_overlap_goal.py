"""The overlap goal on the real GPU schedule, compiled for 8 H100s without a GPU.

`analyze --target h100` compiles the GPT-1.3B train step (configs/gpt_1p3b.yaml) for 8 H100s
with the CUDA plugin (no CUDA libraries needed) and reads where XLA's latency-hiding scheduler
put each async collective. These tests fail if the share of collective bytes scheduled under
GEMMs drops below what the overlap engine reached (bench/overlap.py and the README report the
numbers; plain jit + GSPMD reaches 60% for dp=8, 21% for dp=2 x tp=4; the goal is 90%).
Slow: the Mixtral-shaped MoE's expert all-to-alls (configs/mixtral_8x7b.yaml, 2 layers).
"""

import pytest
from helpers import REPO, last_json_line, run_cli

from jax_overlap.analysis import deviceless

pytestmark = pytest.mark.skipif(not deviceless.plugin_available(),
                                reason=deviceless.unavailable_reason() or "")

GPT_1P3B = f"{REPO}/configs/gpt_1p3b.yaml"
MIXTRAL = f"{REPO}/configs/mixtral_8x7b.yaml"
# The shallow variants keep the microbatching they were measured with (one sequence each).
SHALLOW = ["model.layers=4", "train.global_batch=64", "pipeline.microbatches=8"]
DP2_TP4_SHALLOW = ["mesh.dp=2", "mesh.tp=4", "overlap.tp_comm=collective_matmul",
                   "overlap.collective_matmul_direction=bi", "pipeline.microbatches=32"]
# The full model: only the mesh changes; the config's `auto` knobs pick collective matmul,
# bidirectional, and 2 microbatches of 64 sequences (ring steps of 32768 rows).
DP2_TP4 = ["mesh.dp=2", "mesh.tp=4"]


def _under_gemm(overrides, config=GPT_1P3B):
    """`jax-overlap analyze --target h100 --json` in a fresh process, as a user runs it: the
    config's XLA preset must be in XLA_FLAGS before the plugin's XLA first parses them, which
    in a shared test process another deviceless compile may already have done."""
    proc = run_cli("analyze", "--config", config, "--target", "h100", "--json",
                   *[a for o in overrides for a in ("--set", o)], timeout=1200)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return last_json_line(proc.stdout)


def test_dp8_buckets_hide_under_backward_gemms_shallow():
    # Same widths as the 1.3B model, 4 layers: compiles in a fraction of the time.
    data = _under_gemm(SHALLOW)
    assert data["async_fraction"] == pytest.approx(1.0)
    # Measured 0.878 (2026-12-04, jax 0.12.0.1; 0.489 with the first layer in the layer
    # scan, whose end left the embedding's buckets no GEMM): the first two layers' last
    # buckets and the position embedding's are what is left after the last GEMM, a larger
    # share of 4 layers than of 24 (0.959).
    assert data["collective_bytes_under_gemm_fraction"] >= 0.87


@pytest.mark.slow  # default suite: test_collective_matmul's unrolled-ring-steps check
def test_dp2_tp4_ring_steps_hide_under_gemms_shallow():
    data = _under_gemm(SHALLOW + DP2_TP4_SHALLOW)
    # Measured 0.753 (2026-12-06) with the ring steps unrolled: at one sequence a microbatch
    # XLA merges the reduce-scatter ring's partial GEMMs (their rows are local, read by no
    # transfer) into one GEMM before the ring, whose transfers then have only adds beside
    # them. Threading the rows through each step's barrier kept them apart (0.968) but cost
    # the full-size step 1312 -> 1383 ms (each step's rows copied out for its GEMM), so the
    # merge stays; at full size the transfers run under other GEMMs (0.995,
    # test_dp2_tp4_defaults_reach_their_overlap). As a scan: 0.889; with the reduce-scatter
    # ring's last transfer outside its loop: 0.759; sequence parallelism: 0.2.
    assert data["collective_bytes_under_gemm_fraction"] >= 0.72


@pytest.mark.slow
def test_dp8_gpt_1p3b_reaches_its_overlap():
    data = _under_gemm([])
    assert data["async_fraction"] == pytest.approx(1.0)
    # Measured 0.959 with the plan's 2 microbatches of 16 sequences under remat full
    # (2026-12-04; 0.907 with the last microbatch's layers unrolled; GSPMD: 0.60): a layer's
    # buckets go under the next layer's backward, the embedding's under the first layer's
    # (which runs outside the layer scan); 0.85 ms exposed of a 0.96 s step.
    assert data["collective_bytes_under_gemm_fraction"] >= 0.95
    assert data["exposed_comm_s_estimate"] <= 0.01 * data["estimate"]["step_ms"] / 1e3


@pytest.mark.slow
def test_dp2_tp4_defaults_reach_their_overlap():
    data = _under_gemm(DP2_TP4)
    choices = {k: c["value"] for k, c in data["plan"]["choices"].items()}
    assert {k: choices[k] for k in ("overlap.tp_comm", "overlap.collective_matmul_direction",
                                    "pipeline.microbatches", "overlap.xla_preset",
                                    "model.remat")} == {
        "overlap.tp_comm": "collective_matmul", "overlap.collective_matmul_direction": "bi",
        "pipeline.microbatches": 2, "overlap.xla_preset": "gpu_overlap_tp",
        "model.remat": "minimal"}
    # measured 0.995 (2026-12-06, m 2, ring steps unrolled; 0.987 as a scan; 0.977 at m 8 on
    # 2026-12-03; 0.824 before collective matmul; GSPMD: 0.21)
    assert data["collective_bytes_under_gemm_fraction"] >= 0.95
    # No GEMM cloned (the pipelined all-gathers of gpu_overlap made 1.84x) and none
    # recomputed: `minimal` keeps the projections' outputs (0.97x, the fused attention
    # kernel's FLOPs are the model's but no GEMM's; remat full's recompute made 1.14x), and
    # it fits (47.4 GB, estimated 45.4 GB).
    est = data["estimate"]
    assert est["gemm_flops"] <= 1.0 * est["model_flops"] and data["memory"]["fits"]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [
    [],
    ["pipeline.microbatches=4", "overlap.param_sharding=replicated", "overlap.moe_chunks=6"],
    ["mesh.dp=4", "mesh.pp=2", "mesh.ep=4", "pipeline.paired=true", "overlap.moe_chunks=6"],
], ids=["ep8", "ep8-paired-microbatches", "ep4-pp2-fused-pairs"])
def test_moe_all_to_alls_hide_under_expert_gemms(mesh):
    # Mixtral's layer at 2 layers. ep8, one microbatch: (a) alone, auto's 6 software-pipelined
    # chunks, measured 0.950 (2026-12-03). (a) + (b), each chunk's all-to-alls also under the
    # other microbatch's GEMMs: 0.967 at pp = 1 with 4 microbatches paired, 0.979 at ep4 x pp2
    # in fused pairs (2026-12-06); (b) alone, what auto picks there as the faster step:
    # 0.708 / 0.771; neither 0.375 / 0.333.
    data = _under_gemm(["model.layers=2", *mesh], config=MIXTRAL)
    if not mesh:
        assert data["plan"]["choices"]["overlap.moe_chunks"]["value"] == 6
    else:
        assert data["plan"]["overlap"]["pair_microbatches"] or data["plan"]["fused_pairs"]
    a2a = data["collectives"]["all-to-all"]
    assert a2a["under_gemm_bytes"] / a2a["bytes"] >= 0.9


# Issue #27's plain recipes (configs/gpu/: model, batch, precision and mesh; every other knob
# `auto`), compiled for 8 H100s: the share of collective bytes under GEMMs, and the fit.
PLAIN = {
    # Below issue #27's 0.95: measured 0.793 per tick (2026-12-07, the fill, the steady state
    # and the drain as three loops; 0.748 in one, 0.732 with two chunks per stage). The fill's
    # forward transfers and the drain's backward ones have nothing under them: the next stage
    # needs each at the next tick, and the sender runs nothing else then. Counted on every
    # tick, as before 2026-12-06, it was 0.963.
    "gpt_1p3b_pp4_dp2": 0.77,
    # Not one of issue #27's meshes for Llama; measured 0.883 (2026-12-07, three loops; 0.821
    # in one, 0.534 with two chunks per stage) with XLA's scheduler given more memory for a
    # fitting pipeline (`plan.PIPELINE_SCHEDULER_SLOP`), 0.041 with its default, under which
    # the tick transfers overlapped nothing.
    "llama3_8b_pp4_dp2": 0.86,
    # Measured 0.951 (2026-12-04): FSDP chosen by the plan, a replica needs ~146 GB.
    "llama3_8b_fsdp8": 0.95,
    # Measured 0.988 (2026-12-04): collective matmul, bidirectional.
    "llama3_8b_dp2_tp4": 0.95,
    # Below issue #27's 0.95: measured 0.928 per tick (2026-12-07, the rows split over the
    # batch, `overlap.sp_split`: XLA then starts both lanes' first all-gathers ahead of
    # every GEMM; 0.939 split over the sequence, at 26 ms more of transposes; three chunks
    # per stage; 0.927 with two: fused pairs, the head in two halves, the ticks that run one action as
    # collective matmul, q, k and v as three GEMMs; 0.902 with one QKV GEMM, 0.721 with the
    # lone ticks sequence parallel, 0.292 with the lanes apart). What stays exposed: each
    # pair's first all-gather, the transfers sent after the switch on the ticks without a
    # head, the last tick (docs/results.md). Guards what is hidden.
    "gpt_1p3b_pp2_dp2_tp2": 0.92,
}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(PLAIN))
def test_a_plain_recipe_reaches_its_overlap_and_fits(recipe):
    data = _under_gemm([], config=f"{REPO}/configs/gpu/{recipe}.yaml")
    assert data["collective_bytes_under_gemm_fraction"] >= PLAIN[recipe]
    assert data["memory"]["fits"]
