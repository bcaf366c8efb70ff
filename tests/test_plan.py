"""The parallel plan: built once from the config, automatic knobs resolved for the target,
the transfer latency carried into the simulator and searched by the tuner."""

import dataclasses
import json

import numpy as np
import pytest
from helpers import REPO, TINY, last_json_line, run_cli

from jax_overlap import config
from jax_overlap.analysis import tune
from jax_overlap.hardware.link_profiles import AxisLink, Link, load_profile
from jax_overlap.analysis.simulate import Costs, simulate
from jax_overlap.config import ConfigError
from jax_overlap.hardware import memory
from jax_overlap.pipeline.schedules import bubble_fraction
from jax_overlap import plan as plan_lib
from jax_overlap.plan import schedule as plan_schedule
from jax_overlap.plan import ParallelPlan, Target, fits_memory

GPT_1P3B = f"{REPO}/configs/gpt_1p3b.yaml"
H100 = Target("h100", True, 80e9)


def test_auto_knobs_on_cpu_keep_the_plain_step():
    plan = ParallelPlan.build(config.load(TINY, ["pipeline.microbatches=auto"]))
    assert (plan.overlap.tp_comm, plan.overlap.cm_direction) == ("plain", "uni")
    assert plan.microbatches == 1 and plan.micro_batch == 16 // 2
    assert set(plan.choices) == {"overlap.tp_comm", "overlap.collective_matmul_direction",
                                 "pipeline.microbatches", "model.attention", "model.remat",
                                 "overlap.grad_bucket_mb", "overlap.embed_before_first_layer",
                                 "overlap.xla_preset", "overlap.param_sharding",
                                 "overlap.zero1"}
    assert plan.remat == "none"  # CPU: recomputing only adds work
    # CPU collectives are synchronous: one reduction after the backward, no XLA flags.
    assert (plan.overlap.grad_bucket_bytes, plan.overlap.embed_before_first_layer,
            plan.overlap.xla_preset) == (0, False, "none")
    assert plan.choices["overlap.grad_bucket_mb"].why.startswith("CPU")
    piped = ParallelPlan.build(config.load(TINY, ["mesh.pp=2", "mesh.tp=2",
                                                  "pipeline.microbatches=auto"]))
    assert piped.microbatches == 4  # fills two stages twice


def test_auto_moe_chunks_split_the_all_to_alls_on_a_gpu_with_ep_only():
    mixtral = f"{REPO}/configs/mixtral_8x7b.yaml"
    small = ["model.layers=2"]
    gpu = ParallelPlan.build(config.load(mixtral, small), target=H100)
    assert gpu.overlap.moe_chunks == 6 and gpu.parallel().moe_chunks == 6
    assert "all-to-all bytes under GEMMs" in gpu.choices["overlap.moe_chunks"].why
    assert gpu.resolved_config(config.load(mixtral, small)).overlap.moe_chunks == 6
    no_ep = ParallelPlan.build(config.load(mixtral, small + ["mesh.ep=1"]), target=H100)
    assert no_ep.overlap.moe_chunks == 1
    assert no_ep.choices["overlap.moe_chunks"].why.startswith("no expert parallelism")
    cpu = ParallelPlan.build(config.load(mixtral, small))
    assert cpu.overlap.moe_chunks == 1 and cpu.choices["overlap.moe_chunks"].why.startswith("CPU")
    given = ParallelPlan.build(config.load(mixtral, small + ["overlap.moe_chunks=2"]),
                               target=H100)
    assert given.overlap.moe_chunks == 2 and "overlap.moe_chunks" not in given.choices
    # Where microbatches pair, the other one's GEMMs hide the all-to-alls: one chunk.
    for sets in (["pipeline.microbatches=4", "overlap.param_sharding=replicated"],
                 ["mesh.dp=4", "mesh.pp=2", "mesh.ep=4"]):
        paired = ParallelPlan.build(config.load(mixtral, small + sets), target=H100)
        assert paired.overlap.moe_chunks == 1, sets
        assert "hide the all-to-alls" in paired.choices["overlap.moe_chunks"].why


def test_auto_knobs_on_a_gpu_pick_collective_matmul_and_microbatches_that_fit():
    tp4 = ParallelPlan.build(config.load(GPT_1P3B, ["mesh.dp=2", "mesh.tp=4"]), target=H100)
    assert (tp4.overlap.tp_comm, tp4.overlap.cm_direction) == ("collective_matmul", "bi")
    # 64 sequences x 2048 positions per microbatch: ring steps of 32768 rows, as dp8's GEMMs
    # (estimated step 1312 ms; 8 of 16: 1593 ms, 32 of 4 spent the step on the ring steps'
    # small kernels).
    assert (tp4.microbatches, tp4.micro_batch) == (2, 64)
    assert "ring steps of 32768 rows" in tp4.choices["pipeline.microbatches"].why
    # A pipeline: the fewest microbatches whose bubble is at most 0.1 (pp2: 16 of 8
    # sequences, estimated step 1346 ms; 32 of 4: 1451 ms).
    pp2 = ParallelPlan.build(config.load(GPT_1P3B, ["mesh.dp=2", "mesh.pp=2", "mesh.tp=2"]),
                             target=H100)
    assert (pp2.microbatches, pp2.micro_batch) == (16, 8)
    assert "bubble 0.059" in pp2.choices["pipeline.microbatches"].why
    # Data parallelism alone: 16 sequences, GEMMs of 32768 rows (estimated step 960 ms; 4
    # microbatches of 8: 1017 ms).
    dp8 = ParallelPlan.build(config.load(GPT_1P3B), target=H100)
    assert (dp8.overlap.tp_comm, dp8.microbatches, dp8.micro_batch) == ("plain", 2, 16)
    assert "GEMMs of 32768 rows" in dp8.choices["pipeline.microbatches"].why


def test_a_plain_gpu_config_gets_the_overlap_knobs():
    """Model + batch + precision + mesh only: on a GPU the plan buckets the dp reduction into
    the backward, issues the embedding's first and applies XLA's overlap flags; an explicit
    value wins; FSDP (per-layer reduce-scatters) and dp = 1 get no buckets."""
    plain = ["model.layers=24", "model.d_model=2048", "model.heads=16", "model.d_ff=8192",
             "model.vocab=50304", "model.seq_len=2048", "train.global_batch=256",
             "train.precision=bf16", "data.source=synthetic", "mesh.dp=8"]
    plan = ParallelPlan.build(config.load(None, plain), target=H100)
    ov = plan.overlap
    assert (ov.grad_bucket_bytes, ov.embed_before_first_layer, ov.xla_preset) == (
        64 * 2**20, True, "gpu_overlap")
    assert all(plan.choices[k].why for k in ("overlap.grad_bucket_mb", "overlap.xla_preset",
                                             "overlap.embed_before_first_layer"))
    mine = ParallelPlan.build(config.load(None, plain + ["overlap.grad_bucket_mb=25",
                                                         "overlap.xla_preset=none"]), target=H100)
    assert (mine.overlap.grad_bucket_bytes, mine.overlap.xla_preset) == (25 * 2**20, "none")
    assert "overlap.grad_bucket_mb" not in mine.choices
    fsdp = ParallelPlan.build(config.load(None, plain + ["overlap.param_sharding=fsdp"]),
                              target=H100)
    assert fsdp.overlap.grad_bucket_bytes == 0 and not fsdp.overlap.embed_before_first_layer
    one = ParallelPlan.build(config.load(None, plain[:-1] + ["mesh.dp=1"]), target=H100)
    assert one.overlap.grad_bucket_bytes == 0
    piped = plain[:-1] + ["mesh.dp=2", "mesh.pp=4"]
    assert ParallelPlan.build(config.load(None, piped), target=H100).overlap.buckets_in_loop
    zbv = ParallelPlan.build(config.load(None, piped + ["pipeline.schedule=zb-v"]), target=H100)
    # A zero-bubble table too: its W's reduce their chunk's buckets in the loop.
    assert zbv.overlap.buckets_in_loop and zbv.overlap.grad_bucket_bytes == 64 * 2**20


def test_auto_schedule_is_printed_and_an_explicit_one_wins():
    piped_overrides = ["mesh.pp=2", "mesh.dp=2", "model.layers=4", "pipeline.virtual_stages=auto",
                       "pipeline.microbatches=auto",
                       "pipeline.schedule=auto"]
    piped = config.load(TINY, piped_overrides)
    assert piped.pipeline.schedule == "auto" and piped.pipeline.virtual_stages == 1
    # CPU: 1F1B; GPU: interleaved 1F1B, two chunks per stage, where the layers split evenly.
    for target, name, v in ((Target(), "1f1b", 1), (H100, "interleaved", 2)):
        plan = ParallelPlan.build(piped, target=target)
        assert (plan.schedule.name, plan.virtual_stages) == (name, v)
        assert plan.choices["pipeline.schedule"].why.startswith("GPU" if v == 2 else "CPU")
        resolved = plan.resolved_config(piped).pipeline
        assert (resolved.schedule, resolved.virtual_stages) == (name, v)
    assert plan.schedule.paired  # GPU: paired ticks
    assert plan.microbatches % piped.mesh.pp == 0
    # On a GPU, 1F1B where interleaving cannot run, with the reason; an explicit count wins.
    for extra, reason in ((["pipeline.virtual_stages=1"], "pipeline.virtual_stages = 1"),
                          (["model.layers=6"], "model.layers 6")):
        plan = ParallelPlan.build(config.load(TINY, [*piped_overrides, *extra]), target=H100)
        assert plan.schedule.name == "1f1b" and plan.virtual_stages == 1
        assert reason in plan.choices["pipeline.schedule"].why
        assert "pipeline.virtual_stages" not in plan.choices
    # The microbatch rule counts the interleaved bubble (p - 1) / (v m + p - 1): GPT-1.3B
    # pp4 x dp2 takes three chunks of two layers per stage and 16 microbatches (bubble 0.059)
    # where 1F1B needs 32.
    gpt = ParallelPlan.build(config.load(f"{REPO}/configs/gpu/gpt_1p3b_pp4_dp2.yaml"),
                             target=H100)
    assert (gpt.schedule.name, gpt.virtual_stages, gpt.microbatches) == ("interleaved", 3, 16)
    assert "bubble 0.059" in gpt.choices["pipeline.microbatches"].why
    assert gpt.choices["pipeline.virtual_stages"].why.startswith("3 chunks of 2 layers")
    # Three or four chunks of at least two layers where the layers split so, else two.
    for layers, pp, v in ((32, 4, 4), (24, 2, 3), (16, 4, 2), (40, 4, 2)):
        plan = ParallelPlan.build(config.load(f"{REPO}/configs/gpu/gpt_1p3b_pp4_dp2.yaml",
                                              [f"model.layers={layers}", f"mesh.pp={pp}"]),
                                  target=H100)
        assert plan.virtual_stages == v and len(plan.stage_layers) == pp * v
        assert sum(plan.stage_layers) == layers
        why = plan.choices["pipeline.virtual_stages"].why
        assert why.startswith("two chunks" if v == 2 else f"{v} chunks of {layers // (pp * v)}")
    # A named `interleaved` leaves its chunks to the plan too (2 on CPU); a count wins.
    for extra, target, v in ((["pipeline.schedule=interleaved"], H100, 3),
                             (["pipeline.schedule=interleaved"], Target(), 2),
                             (["pipeline.schedule=interleaved", "pipeline.virtual_stages=2"],
                              H100, 2)):
        plan = ParallelPlan.build(config.load(f"{REPO}/configs/gpu/gpt_1p3b_pp4_dp2.yaml",
                                              extra), target=target)
        assert (plan.schedule.name, plan.virtual_stages) == ("interleaved", v)
        assert ("pipeline.virtual_stages" in plan.choices) == (v == 3)
    one = ParallelPlan.build(config.load(f"{REPO}/configs/gpu/gpt_1p3b_pp4_dp2.yaml",
                                         ["pipeline.schedule=1f1b"]), target=H100)
    assert (one.schedule.name, one.virtual_stages, one.microbatches) == ("1f1b", 1, 32)
    chunks = config.load(TINY, ["mesh.pp=2", "mesh.dp=2", "pipeline.virtual_stages=2",
                                "pipeline.microbatches=4", "pipeline.schedule=auto",
                                "model.layers=4"])
    assert ParallelPlan.build(chunks).schedule.name == "interleaved"
    zbv = config.load(TINY, ["mesh.pp=2", "mesh.dp=2", "pipeline.schedule=zb-v",
                             "pipeline.microbatches=4", "model.layers=4",
                             "pipeline.virtual_stages=auto"])
    plan = ParallelPlan.build(zbv)
    assert plan.schedule.name == "zb-v" and "pipeline.schedule" not in plan.choices
    assert "pipeline.schedule" not in ParallelPlan.build(config.load(TINY)).choices  # pp = 1


def test_auto_param_sharding_shards_only_a_replica_that_does_not_fit():
    """Llama-3-8B's fp32 weights and Adam moments alone are 96 GB: at dp8 the plan shards
    them (FSDP); at dp2 x tp4 a replica's quarter fits; on a CPU nothing is sharded."""
    llama = f"{REPO}/configs/llama3_8b.yaml"
    auto = ["overlap.param_sharding=auto", "overlap.grad_bucket_mb=auto"]
    dp8 = ParallelPlan.build(config.load(llama, auto + ["mesh.dp=8", "mesh.tp=1"]), target=H100)
    assert dp8.overlap.fsdp and dp8.choices["overlap.param_sharding"].value == "fsdp"
    assert dp8.overlap.grad_bucket_bytes == 0  # FSDP reduce-scatters layer by layer
    assert dp8.memory_estimate <= 0.8 * 80e9
    tp4 = ParallelPlan.build(config.load(llama, auto), target=H100)
    assert not tp4.overlap.fsdp and tp4.overlap.grad_bucket_bytes > 0
    cpu = ParallelPlan.build(config.load(llama, auto + ["mesh.dp=8", "mesh.tp=1"]))
    assert not cpu.overlap.fsdp and cpu.choices["overlap.param_sharding"].why.startswith("CPU")


def test_auto_zero1_splits_only_an_optimizer_state_that_does_not_fit():
    gpt_dp8 = f"{REPO}/configs/gpu/gpt_1p3b_dp8.yaml"
    small = Target("h100", True, 30e9)  # a 24 GB budget: a replica ~27 GB at its smallest
    tight = ParallelPlan.build(config.load(gpt_dp8), target=small)
    assert tight.overlap.zero1 is True and not tight.overlap.fsdp
    assert tight.choices["overlap.zero1"].why.startswith("a replica's optimizer state does "
                                                         "not fit")
    assert fits_memory(tight.memory_estimate, small)
    assert tight.resolved_config(config.load(gpt_dp8)).overlap.zero1 is True
    gpt = ParallelPlan.build(config.load(gpt_dp8), target=H100)
    assert gpt.overlap.zero1 is False
    assert gpt.choices["overlap.zero1"].why.startswith("a replica fits")
    llama = f"{REPO}/configs/gpu/llama3_8b_pp4_dp2.yaml"
    cpu = ParallelPlan.build(config.load(llama, ["model.layers=4", "model.d_model=256"]))
    assert cpu.overlap.zero1 is False and cpu.choices["overlap.zero1"].why.startswith("CPU")
    # Where ZeRO-1 alone does not make a replica fit (its in-loop buckets counted), FSDP
    # decides (and shards the moments too). (1F1B's slots: interleaved's chunks of four
    # layers stash less, and there ZeRO-1 fits.)
    big = ParallelPlan.build(config.load(llama, ["pipeline.schedule=1f1b"]), target=H100)
    assert big.overlap.fsdp and big.overlap.zero1 is False
    assert "left to overlap.param_sharding" in big.choices["overlap.zero1"].why
    fsdp = ParallelPlan.build(config.load(f"{REPO}/configs/gpu/llama3_8b_fsdp8.yaml"),
                              target=H100)
    assert fsdp.overlap.fsdp and fsdp.overlap.zero1 is False
    given = ParallelPlan.build(config.load(llama, ["overlap.zero1=false"]), target=H100)
    assert given.overlap.zero1 is False and "overlap.zero1" not in given.choices
    given = ParallelPlan.build(config.load(TINY, ["overlap.zero1=true"]))
    assert given.overlap.zero1 is True and "overlap.zero1" not in given.choices


def test_auto_transfer_latency_is_two_only_where_a_transfer_outlasts_a_tick():
    gpt = ParallelPlan.build(config.load(f"{REPO}/configs/gpu/gpt_1p3b_pp4_dp2.yaml"),
                             target=H100)
    assert gpt.transfer_latency == 1 and gpt.schedule.paired
    assert "hides under the GEMMs of a tick" in gpt.choices["pipeline.transfer_latency"].why
    # A stage link slower than a tick's GEMMs (as between hosts): latency 2, unpaired, where
    # the step fits.
    narrow = ["mesh.pp=4", "mesh.tp=1", "pipeline.microbatches=8", "model.layers=4"]
    tiny = ParallelPlan.build(config.load(TINY, narrow), target=H100)  # launches: hidden
    assert tiny.transfer_latency == 1
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan_schedule, "_transfer_and_tick_s",
                   lambda cfg, target: (2e-3, 1e-3, "slow"))
        exposed = ParallelPlan.build(config.load(TINY, narrow), target=H100)
        assert exposed.transfer_latency == 2 and not exposed.schedule.paired
        assert "outlasts a tick's GEMMs" in exposed.choices["pipeline.transfer_latency"].why
        assert exposed.choices["pipeline.paired"].why.startswith("transfer_latency 2")
        full = ParallelPlan.build(config.load(TINY, narrow), target=Target("h100", True, 1e3))
        assert full.transfer_latency == 1  # latency 2's step would not fit
        assert "kept at 1" in full.choices["pipeline.transfer_latency"].why
        for explicit in (["pipeline.transfer_latency=1"], ["pipeline.paired=true"]):
            given = ParallelPlan.build(config.load(TINY, narrow + explicit), target=H100)
            assert given.transfer_latency == 1 and given.schedule.paired
        # Interleaved (auto, 8 layers in 2 x pp chunks) at latency 2 takes microbatches in
        # groups of 2 x pp: a count given outside them keeps latency 1 instead of failing.
        odd = ParallelPlan.build(config.load(TINY, ["mesh.pp=4", "mesh.tp=1", "model.layers=8",
                                                    "pipeline.schedule=auto",
                                                    "pipeline.virtual_stages=auto",
                                                    "pipeline.microbatches=4"]), target=H100)
        assert odd.schedule.name == "interleaved" and odd.transfer_latency == 1
        assert "groups of 2 x pp = 8" in odd.choices["pipeline.transfer_latency"].why
    cpu = ParallelPlan.build(config.load(TINY, narrow))
    assert cpu.transfer_latency == 1
    assert cpu.choices["pipeline.transfer_latency"].why.startswith("CPU")
    given = ParallelPlan.build(config.load(TINY, narrow + ["pipeline.transfer_latency=1"]),
                               target=H100)
    assert "pipeline.transfer_latency" not in given.choices
    flat = ParallelPlan.build(config.load(TINY), target=H100)  # pp = 1: nothing to decide
    assert flat.transfer_latency == 1 and "pipeline.transfer_latency" not in flat.choices


def test_explicit_choices_win_and_resolved_config_holds_the_choices():
    cfg = config.load(GPT_1P3B, ["mesh.dp=2", "mesh.tp=4", "overlap.tp_comm=collective_matmul",
                                 "pipeline.microbatches=8"])
    plan = ParallelPlan.build(cfg, target=H100)
    assert plan.overlap.tp_comm == "collective_matmul" and plan.microbatches == 8
    assert set(plan.choices) == {"overlap.collective_matmul_direction", "model.attention",
                                 "model.remat", "overlap.xla_preset", "overlap.sp_split"}
    assert plan.overlap.sp_split == "sequence"  # the ring's steps cut the sequence
    auto = config.load(GPT_1P3B, ["mesh.dp=2", "mesh.tp=4"])
    resolved = ParallelPlan.build(auto, target=H100).resolved_config(auto)
    assert resolved.overlap.tp_comm == "collective_matmul"
    assert resolved.pipeline.microbatches == 2
    config.validate(resolved)  # the resolved config is itself a valid explicit config


def test_auto_remat_recomputes_on_a_gpu():
    # GPT-1.3B dp8: full on either attention path (deviceless 8 x H100, 8 microbatches of 4
    # sequences: 1.27 s estimated step under none, 1.11 s under full).
    for attention in ("plain", "fused"):
        cfg = config.load(GPT_1P3B, [f"model.attention={attention}"])
        dp8 = ParallelPlan.build(cfg, target=H100)
        assert (dp8.microbatches, dp8.remat) == (2, "full")
        assert dp8.choices["model.remat"].why.startswith(plan_lib.GPU_REMAT_WHY)
        assert dp8.resolved_config(cfg).model.remat == "full"  # config.json holds the choice
    # One sequence a GPU is one microbatch. Its buckets are reduced in the layer scan's
    # backward, which stacks the residuals like any other: full. Only buckets that mix
    # layers run it unrolled, where no scan stacks them and keeping them wins where they fit
    # (GPT-1.2B dp8 on A100s, deviceless: 9.06 iterations/s under none, 7.13 under full).
    one = ["train.global_batch=8"]
    assert ParallelPlan.build(config.load(GPT_1P3B, one), target=H100).remat == "full"
    mixed = config.load(GPT_1P3B, one + ["overlap.bucket_order=largest_first"])
    assert ParallelPlan.build(mixed, target=H100).remat == "none"
    # An explicit policy always wins; auto microbatching then works around it.
    none = ParallelPlan.build(config.load(GPT_1P3B, ["model.attention=plain",
                                                     "model.remat=none"]), target=H100)
    assert none.remat == "none" and "model.remat" not in none.choices
    assert none.microbatches == 32  # 2 x 2048 tokens need ~64 GB under none (XLA: 64.2)
    # Collective-matmul rings at pp = 1: a recomputed forward would run the rings again, so
    # auto keeps the projections (minimal) where they fit (GPT-1.3B dp2 x tp4, deviceless:
    # 1.11 s a step against 1.21 s under full), else full, naming what minimal needed.
    tp4 = ParallelPlan.build(config.load(GPT_1P3B, ["mesh.dp=2", "mesh.tp=4"]), target=H100)
    assert (tp4.overlap.tp_comm, tp4.microbatches, tp4.remat) == ("collective_matmul", 2,
                                                                  "minimal")
    assert tp4.choices["model.remat"].why.startswith(plan_lib.RING_REMAT_WHY)
    small = ParallelPlan.build(config.load(GPT_1P3B, ["mesh.dp=2", "mesh.tp=4"]),
                               target=Target("h100-40", True, 40e9))
    assert small.remat == "full" and "over it: minimal" in small.choices["model.remat"].why


def test_auto_remat_with_explicit_microbatches_and_pipelines():
    cfg = config.load(GPT_1P3B, ["mesh.dp=2", "mesh.pp=4", "model.attention=plain",
                                 "pipeline.microbatches=32"])
    plan = ParallelPlan.build(cfg, target=H100)
    # Pipelined on a GPU at tp = 1: B reads the projections from the stash slot rather than
    # recomputing the block's GEMMs (minimal) where that fits, else only block inputs (full).
    assert plan.microbatches == 32 and plan.remat == "minimal"
    assert plan.choices["model.remat"].why.startswith(plan_lib.PIPELINE_REMAT_WHY)
    assert plan.schedule.paired and "pipeline.paired" in plan.choices
    small = ParallelPlan.build(cfg, target=Target("h100-30", True, 30e9))
    assert small.remat == "full" and small.memory_estimate <= 0.8 * 30e9
    assert small.choices["model.remat"].why.startswith(plan_lib.GPU_REMAT_WHY)
    assert "over it: minimal" in small.choices["model.remat"].why
    # At tp = 2 (sequence parallel) B would gather the inputs again: full.
    tp2 = ParallelPlan.build(config.load(GPT_1P3B, ["mesh.dp=2", "mesh.pp=2", "mesh.tp=2"]),
                             target=H100)
    assert tp2.remat == "full" and tp2.choices["model.remat"].why.startswith(
        plan_lib.GPU_REMAT_WHY)
    cpu = ParallelPlan.build(cfg)  # a CPU: unpaired; recomputing beats moving the stash
    assert cpu.remat == "full" and not cpu.schedule.paired
    assert cpu.choices["model.remat"].why.startswith("CPU pipeline")
    assert cpu.choices["pipeline.paired"].value is False
    latency2 = ParallelPlan.build(config.load(GPT_1P3B, [
        "mesh.dp=2", "mesh.pp=4", "pipeline.transfer_latency=2"]), target=H100)
    assert not latency2.schedule.paired
    # ZB-V: W as only the weight GEMMs on every target (B keeps W's operands); the head
    # split over the stages on a GPU only; explicit values win.
    zbv = ["mesh.dp=2", "mesh.pp=4", "pipeline.schedule=zb-v", "pipeline.virtual_stages=2"]
    gpu = ParallelPlan.build(config.load(GPT_1P3B, zbv), target=H100)
    assert gpu.remat == "minimal" and gpu.split_backward and gpu.vocab_parallel
    assert gpu.choices["pipeline.split_backward"].value is True
    assert gpu.choices["pipeline.vocab_parallel"].why.startswith("GPU")
    cpu = ParallelPlan.build(config.load(GPT_1P3B, zbv))
    assert cpu.split_backward and not cpu.vocab_parallel
    assert cpu.choices["pipeline.vocab_parallel"].why.startswith("CPU")
    forced = config.load(GPT_1P3B, zbv + ["pipeline.split_backward=false",
                                          "pipeline.vocab_parallel=false"])
    plan = ParallelPlan.build(forced, target=H100)
    assert not plan.split_backward and not plan.vocab_parallel
    assert "pipeline.vocab_parallel" not in plan.choices
    odd = config.load(GPT_1P3B, zbv + ["model.vocab=50257"])
    plan = ParallelPlan.build(odd, target=H100)
    assert not plan.vocab_parallel and "not divisible" in plan.choices[
        "pipeline.vocab_parallel"].why
    assert not ParallelPlan.build(cfg, target=H100).split_backward  # 1f1b: nothing to split
    huge = config.load(GPT_1P3B, ["model.attention=plain", "pipeline.microbatches=1"])
    plan = ParallelPlan.build(huge, target=H100)  # 32 sequences per microbatch, in a scan
    assert plan.remat == "full" and plan.memory_estimate <= 0.8 * 80e9
    plan = ParallelPlan.build(huge, target=Target("small", True, 40e9))  # nothing fits
    assert plan.remat == "full" and "may still not fit" in plan.choices["model.remat"].why


def test_a_step_that_fits_compiles_without_xla_rematerialization():
    # XLA's pass, given a step our policy already fits, clones GEMMs that save nothing.
    preset = {"XLA_FLAGS": "--xla_disable_hlo_passes=collective-permute-motion --x=1"}
    plan = ParallelPlan.build(config.load(GPT_1P3B, ["model.attention=plain"]), target=H100)
    assert 0 < plan.memory_estimate <= 0.8 * 80e9
    assert plan.compiler_options(preset) == {
        "xla_disable_hlo_passes": "collective-permute-motion,rematerialization"}
    over = config.load(GPT_1P3B, ["model.attention=plain", "model.remat=none",
                                  "pipeline.microbatches=8"])
    assert ParallelPlan.build(over, target=H100).compiler_options(preset) == {}  # ~100 GB
    assert ParallelPlan.build(config.load(TINY)).compiler_options(preset) == {}  # CPU


def test_a_pipeline_compiles_with_copy_insertion_region_analysis():
    # Without it the tick switch copied the stage's gradient accumulators (GPU) and residual
    # pools (CPU) every tick; at pp = 1 on a GPU it left dp8's bucket all-reduces
    # synchronous, so only pipelines get it.
    from jax_overlap.plan import (
        PIPELINE_COPY_ANALYSIS,
        PIPELINE_SCHEDULER_SLOP,
        SCHEDULER_SLOP_FLAG,
    )

    pipe = ParallelPlan.build(config.load(GPT_1P3B, ["mesh.dp=2", "mesh.pp=4"]), target=H100)
    assert pipe.compiler_options({}).items() >= PIPELINE_COPY_ANALYSIS.items()
    # A fitting pipeline also gives XLA's scheduler more memory to overlap in, unless the
    # user's XLA_FLAGS set it.
    assert pipe.compiler_options({})[SCHEDULER_SLOP_FLAG] == PIPELINE_SCHEDULER_SLOP
    own = {"XLA_FLAGS": f"--{SCHEDULER_SLOP_FLAG}=120"}
    assert SCHEDULER_SLOP_FLAG not in pipe.compiler_options(own)
    flat = ParallelPlan.build(config.load(GPT_1P3B), target=H100)
    assert flat.pp == 1 and not set(flat.compiler_options({})) & set(PIPELINE_COPY_ANALYSIS)
    assert SCHEDULER_SLOP_FLAG not in flat.compiler_options({})
    cpu = ParallelPlan.build(config.load(TINY, ["mesh.dp=2", "mesh.pp=2", "mesh.tp=2"]))
    assert cpu.compiler_options({}) == PIPELINE_COPY_ANALYSIS


def test_auto_microbatches_refuse_an_impossible_batch_in_one_line():
    cfg = config.load(TINY, ["mesh.dp=2", "mesh.pp=2", "mesh.tp=2", "train.global_batch=2",
                             "pipeline.microbatches=auto"])
    with pytest.raises(ConfigError) as e:
        ParallelPlan.build(cfg)
    assert e.value.problems[0].startswith("pipeline.microbatches: auto finds no count")


def test_plan_holds_schedule_program_and_layer_order():
    cfg = config.load(TINY, ["mesh.dp=2", "mesh.pp=2", "mesh.tp=2", "pipeline.schedule=zb-v",
                             "pipeline.virtual_stages=2", "model.layers=4",
                             "pipeline.transfer_latency=2", "pipeline.microbatches=4"])
    plan = ParallelPlan.build(cfg)
    assert plan.schedule.transfer_latency == 2 and plan.program.skewed
    assert plan.program.schedule is plan.schedule
    assert plan.layer_perm.tolist() == [0, 3, 1, 2]  # stage 0: vs 0 and 3; stage 1: 1, 2
    flat = ParallelPlan.build(config.load(TINY))
    assert flat.program is None and flat.layer_perm is None and not flat.pipelined


def test_simulated_bubble_follows_the_transfer_latency_table():
    for latency in (1, 2):
        cfg = config.load(TINY, ["mesh.dp=2", "mesh.pp=2", "mesh.tp=2",
                                 f"pipeline.transfer_latency={latency}",
                                 "pipeline.microbatches=4"])
        plan = tune.plan_for(cfg)
        assert plan.schedule.transfer_latency == latency
        costs = Costs.uniform(2, 1.0, 1.0, 0.0, act_bytes=0.0)
        result = simulate(plan, costs, load_profile("h100_8x_nvlink"))
        # (the profile's per-hop link latency, microseconds against 1 s actions, is all that differs)
        assert result.bubble_rate == pytest.approx(bubble_fraction(plan.schedule), abs=1e-4)
    assert bubble_fraction(tune.plan_for(cfg).schedule) > 0.3  # latency 2: the longer ramp


def _latency_pair(hw, timing=None):
    cfg = config.load(GPT_1P3B, ["mesh.dp=2", "mesh.pp=4", "pipeline.microbatches=8"])
    times = {}
    for latency in (1, 2):
        cand = tune.Candidate(2, 1, 4, 1, 8, "1f1b", 64.0, False, 1, latency)
        times[latency] = tune.predict(cand, tune.apply_candidate(cfg, cand), hw,
                                      timing=timing).step_time_s
    return times


def test_tuner_picks_latency_two_when_the_stage_link_is_slow():
    nvlink = load_profile("h100_8x_nvlink")
    slow = dataclasses.replace(nvlink, links={**nvlink.links, "slow": Link("slow", 2e9, 5e-5)},
                               axes={**nvlink.axes, "pp": AxisLink("slow", True)})
    # Played as the table's order with nothing else to wait for (event-driven), latency 2
    # pays its longer ramp on NVLink and wins only where transfers are slow.
    fast, slow_times = _latency_pair(nvlink, "events"), _latency_pair(slow, "events")
    assert fast[1] < fast[2]
    assert slow_times[2] < slow_times[1]
    # On the executor's ticks (the tuner's default on a GPU) a latency-1 permute makes each
    # stage wait for its neighbours' slower actions every tick, and the skewed loop's idle
    # ramp entries cost only that wait: latency 2 wins on both links, by far on the slow one.
    fast, slow_times = _latency_pair(nvlink), _latency_pair(slow)
    assert fast[2] < fast[1] and slow_times[2] < slow_times[1]
    assert slow_times[1] / slow_times[2] > fast[1] / fast[2]
    best = tune.tune(config.load(TINY, ["model.layers=4", "model.d_model=512", "model.d_ff=2048",
                                        "model.seq_len=512", "train.global_batch=64"]),
                     8, slow, bucket_sizes_mb=(0.0,), windows=(2,), max_microbatches=8)
    piped = [p for p in best.plans if p.candidate.pp > 1]
    assert {p.candidate.transfer_latency for p in piped} == {1, 2}


def test_tune_json_lists_plans_with_both_latencies(tmp_path):
    proc = run_cli("tune", "--config", TINY, "--devices", "8", "--hardware", "h100_8x_nvlink",
                   "--json", "--out", str(tmp_path / "best.yaml"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    plans = last_json_line(proc.stdout)["plans"]
    latencies = {p["transfer_latency"] for p in plans if p["pp"] > 1}
    assert latencies == {1, 2}
    assert all(p["transfer_latency"] == 1 for p in plans if p["pp"] == 1)
    assert any(" L2" in p["plan"] for p in plans)


def test_train_writes_the_resolved_config(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli("train", "--config", TINY, "--set", "train.steps=1", "--set",
                   "pipeline.microbatches=auto", "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stderr[-2000:]
    written = json.loads((run_dir / "config.json").read_text())
    assert written["overlap"]["tp_comm"] == "plain"
    assert written["overlap"]["collective_matmul_direction"] == "uni"
    assert written["pipeline"]["microbatches"] == 1
    assert np.isfinite(last_json_line(proc.stdout)["last_loss"])
    # Every automatic choice is printed at the start, with its reason.
    assert "auto pipeline.microbatches = 1: CPU" in proc.stdout
    assert "auto model.remat = none: CPU" in proc.stdout


def test_analyze_names_the_knobs_that_would_hide_more():
    from jax_overlap.analysis.analyze import overlap_hints

    cfg = config.load(GPT_1P3B, ["mesh.dp=2", "mesh.tp=4", "overlap.tp_comm=plain",
                                 "pipeline.microbatches=8", "overlap.xla_preset=none"])
    plan = ParallelPlan.build(cfg, target=H100)
    hints = overlap_hints(cfg, plan, 0.056)  # what XLA gave this step (README)
    keys = [h.split(":")[0].split(" ")[0] for h in hints]
    assert keys == ["overlap.tp_comm=collective_matmul", "overlap.xla_preset=gpu_overlap",
                    "pipeline.microbatches=32"]
    assert overlap_hints(cfg, plan, 0.97) == []  # enough already hides
    assert overlap_hints(cfg, ParallelPlan.build(cfg), 0.05) == []  # CPU: nothing overlaps
    # In a pipeline the hint names the grouped steps and their cost, not the ring.
    piped = config.load(GPT_1P3B, ["mesh.pp=2", "mesh.dp=2", "mesh.tp=2"])
    (tp_hint,) = [h for h in overlap_hints(piped, ParallelPlan.build(piped, target=H100), 0.28)
                  if h.startswith("overlap.tp_comm")]
    assert "grouped steps" in tp_hint and "estimated step" in tp_hint
    # Expert parallelism: the chunks, and at pp = 1 the paired microbatches.
    moe = config.load(f"{REPO}/configs/mixtral_8x7b.yaml", ["model.layers=2",
                                                           "overlap.moe_chunks=1"])
    keys = [h.split(":")[0].split(" ")[0]
            for h in overlap_hints(moe, ParallelPlan.build(moe, target=H100), 0.46)]
    assert keys[:2] == ["overlap.moe_chunks=6", "overlap.pair_microbatches=true"]


def test_collective_matmul_under_a_pipeline_runs_grouped_steps():
    """Ring permutes inside the executor's per-stage branches are matched with other stages'
    permutes (wrong loss, `docs/design/xla_notes.md`), so at pp > 1 an explicit collective matmul
    runs grouped all-gather / reduce-scatter steps; `auto` picks sequence parallelism there
    (the grouped steps hide the TP collectives but cost more than they hide). At pp = 1 the
    ring stays."""
    pp2 = ["mesh.pp=2", "mesh.dp=2", "mesh.tp=2", "pipeline.microbatches=2"]
    gpu = Target("h100", True, 80 * 2**30)
    plan = ParallelPlan.build(config.load(TINY, pp2), target=gpu)
    assert plan.overlap.tp_comm == "sequence_parallel" and not plan.overlap.cm_grouped
    assert "pp > 1" in plan.choices["overlap.tp_comm"].why
    cm = ParallelPlan.build(config.load(TINY, [*pp2, "overlap.tp_comm=collective_matmul"]))
    assert cm.overlap.tp_comm == "collective_matmul" and cm.parallel().cm_grouped
    flat = ParallelPlan.build(config.load(TINY, ["mesh.dp=4", "mesh.tp=2",
                                                 "overlap.tp_comm=collective_matmul"]))
    assert not flat.parallel().cm_grouped


def test_vocab_parallel_needs_a_model_that_declares_it():
    """`pipeline.vocab_parallel` with a model whose head does not slice its vocabulary over pp
    is refused in one line naming the field; the built-in decoders declare it."""
    from models.gpt import GPT

    cfg = config.load(TINY, ["mesh.pp=2", "mesh.dp=1", "pipeline.vocab_parallel=true",
                             "pipeline.microbatches=2"])
    model = GPT.from_config(cfg.model)
    assert ParallelPlan.build(cfg, model).program.vocab_parallel

    @dataclasses.dataclass(frozen=True)
    class Plain(GPT):
        vocab_parallel_head = False

    with pytest.raises(ConfigError, match="^pipeline.vocab_parallel: model Plain does not"):
        ParallelPlan.build(cfg, Plain(**dataclasses.asdict(model)))


def test_auto_fused_pairs_only_where_an_action_holds_collectives():
    """Paired ticks run both lanes as one switch on a GPU where the actions hold collectives
    for the other lane to hide (tp > 1); not at tp = 1, unpaired or on a CPU; an explicit
    value wins."""
    gpu = f"{REPO}/configs/gpu"
    tp2 = ParallelPlan.build(config.load(f"{gpu}/gpt_1p3b_pp2_dp2_tp2.yaml"), target=H100)
    assert tp2.fused_pairs and tp2.program.fused
    assert tp2.choices["pipeline.fused_pairs"].why.startswith("GPU, tp = 2")
    tp1 = ParallelPlan.build(config.load(f"{gpu}/gpt_1p3b_pp4_dp2.yaml"), target=H100)
    assert not tp1.fused_pairs and not tp1.program.fused
    assert "tp = ep = 1" in tp1.choices["pipeline.fused_pairs"].why
    cpu = ParallelPlan.build(config.load(f"{gpu}/gpt_1p3b_pp2_dp2_tp2.yaml",
                                         ["model.layers=4", "model.d_model=256",
                                          "pipeline.paired=true"]))
    assert not cpu.fused_pairs and cpu.choices["pipeline.fused_pairs"].why.startswith("CPU")
    given = ParallelPlan.build(config.load(f"{gpu}/gpt_1p3b_pp4_dp2.yaml",
                                           ["pipeline.fused_pairs=true"]), target=H100)
    assert given.program.fused and "pipeline.fused_pairs" not in given.choices
    unpaired = ParallelPlan.build(config.load(f"{gpu}/gpt_1p3b_pp2_dp2_tp2.yaml",
                                              ["pipeline.paired=false"]), target=H100)
    assert not unpaired.fused_pairs and unpaired.program.lanes == 1


def test_auto_lone_tp_comm_runs_lone_actions_as_collective_matmul():
    """A fused tick that runs one action runs it as collective matmul on a GPU at tp = 2
    under sequence parallelism and full remat; not without fused pairs, under another remat
    or on a CPU. An explicit value wins, and one that cannot hold is refused in one line."""
    gpu = f"{REPO}/configs/gpu/gpt_1p3b_pp2_dp2_tp2.yaml"
    plan = ParallelPlan.build(config.load(gpu), target=H100)
    assert plan.remat == "full" and plan.overlap.tp_comm == "sequence_parallel"
    assert plan.overlap.lone_tp_comm == "collective_matmul"
    assert plan.choices["overlap.lone_tp_comm"].why.startswith("GPU, fused pairs at tp = 2")
    for sets, why in ((["model.remat=save_dots"], "remat is not full"),
                      (["mesh.tp=4", "mesh.dp=1"], "tp = 2 only")):
        other = ParallelPlan.build(config.load(gpu, sets), target=H100)
        assert other.overlap.lone_tp_comm == "same"
        assert why in other.choices["overlap.lone_tp_comm"].why
    for sets in (["pipeline.fused_pairs=false"], ["overlap.lone_tp_comm=same"],
                 ["overlap.tp_comm=collective_matmul"]):
        other = ParallelPlan.build(config.load(gpu, sets), target=H100)
        assert other.overlap.lone_tp_comm == "same"
        assert "overlap.lone_tp_comm" not in other.choices
    cpu = ParallelPlan.build(config.load(gpu, ["model.layers=4", "model.d_model=256"]))
    assert cpu.overlap.lone_tp_comm == "same"
    fused_cpu = ParallelPlan.build(config.load(gpu, [
        "model.layers=4", "model.d_model=256", "pipeline.paired=true",
        "pipeline.fused_pairs=true", "overlap.tp_comm=sequence_parallel", "model.remat=full"]))
    assert fused_cpu.overlap.lone_tp_comm == "same"
    assert fused_cpu.choices["overlap.lone_tp_comm"].why.startswith("CPU")
    given = ParallelPlan.build(config.load(gpu, ["overlap.lone_tp_comm=collective_matmul",
                                                 "mesh.tp=4", "mesh.dp=1"]), target=H100)
    assert given.overlap.lone_tp_comm == "collective_matmul"
    with pytest.raises(ConfigError, match="^overlap.lone_tp_comm=collective_matmul: needs "):
        ParallelPlan.build(config.load(gpu, ["overlap.lone_tp_comm=collective_matmul",
                                             "pipeline.fused_pairs=false"]), target=H100)


def test_auto_sp_split_over_the_batch_where_the_microbatch_divides_by_tp():
    """Sequence parallelism splits whole sequences over TP where the microbatch's sequences
    divide by tp and any collective matmul takes a chunk of any dim (grouped, tp = 2); the
    sequence where they do not, with the reason. An explicit value wins; `batch` where it
    cannot hold is refused in one line naming the key."""
    gpu = f"{REPO}/configs/gpu/gpt_1p3b_pp2_dp2_tp2.yaml"
    plan = ParallelPlan.build(config.load(gpu), target=H100)
    assert plan.overlap.lone_tp_comm == "collective_matmul" and plan.micro_batch == 16
    assert plan.overlap.sp_split == "batch" and plan.parallel().sp_dim == 0
    assert plan.choices["overlap.sp_split"].why.startswith("the microbatch's 16 sequences")
    for sets, why in ((["train.global_batch=36", "pipeline.microbatches=2"],
                       "9 sequences do not divide by tp = 2"),
                      (["mesh.tp=4", "mesh.dp=1", "overlap.lone_tp_comm=collective_matmul"],
                       "grouped steps at tp = 4 cut sequence pieces"),
                      (["mesh.pp=1", "mesh.dp=4", "overlap.tp_comm=collective_matmul"],
                       "ring steps cut the sequence")):
        other = ParallelPlan.build(config.load(gpu, sets), target=H100)
        assert other.overlap.sp_split == "sequence" and other.parallel().sp_dim == 1
        assert why in other.choices["overlap.sp_split"].why, sets
    plain = ParallelPlan.build(config.load(gpu, ["overlap.tp_comm=plain"]), target=H100)
    assert plain.overlap.sp_split == "sequence" and "overlap.sp_split" not in plain.choices
    given = ParallelPlan.build(config.load(gpu, ["overlap.sp_split=sequence"]), target=H100)
    assert given.overlap.sp_split == "sequence" and "overlap.sp_split" not in given.choices
    with pytest.raises(ConfigError, match="^overlap.sp_split=batch: the microbatch's 9 "):
        ParallelPlan.build(config.load(gpu, ["overlap.sp_split=batch", "train.global_batch=36",
                                             "pipeline.microbatches=2"]), target=H100)


def test_auto_pair_microbatches_where_expert_all_to_alls_can_hide():
    """At pp = 1 the microbatch loop pairs one microbatch's forward with the previous one's
    backward on a GPU with expert parallelism and two microbatches or more, without FSDP
    and within the memory budget (the estimate counts the second microbatch's residuals);
    every other case says why not, a dense model records nothing, an explicit value wins."""
    mixtral = f"{REPO}/configs/mixtral_8x7b.yaml"
    small = ["model.layers=2", "overlap.param_sharding=replicated"]
    on = ParallelPlan.build(config.load(mixtral, [*small, "pipeline.microbatches=4"]),
                            target=H100)
    assert on.overlap.pair_microbatches
    assert on.choices["overlap.pair_microbatches"].why.startswith("GPU, ep = 8, 4 microbatches")
    unpaired = dataclasses.replace(on, overlap=dataclasses.replace(on.overlap,
                                                                   pair_microbatches=False))
    model = config.load(mixtral, small).model
    # two microbatches' residuals, and the unrolled layers' recomputes
    assert (memory.plan_step_memory(model, "bf16", on).kept
            > 2 * memory.plan_step_memory(model, "bf16", unpaired).kept)
    for sets, why in [(["pipeline.microbatches=1"], "one microbatch"),
                      (["pipeline.microbatches=4", "overlap.param_sharding=fsdp"], "FSDP"),
                      (["pipeline.microbatches=4", "mesh.ep=1"], "no expert parallelism"),
                      (["pipeline.microbatches=2", "model.layers=10"], "a second microbatch")]:
        plan = ParallelPlan.build(config.load(mixtral, [*small, *sets]), target=H100)
        assert not plan.overlap.pair_microbatches, sets
        assert plan.choices["overlap.pair_microbatches"].why.startswith(why) or \
            why in plan.choices["overlap.pair_microbatches"].why, (sets, plan.choices)
    cpu = ParallelPlan.build(config.load(mixtral, [*small, "pipeline.microbatches=4"]))
    assert cpu.choices["overlap.pair_microbatches"].why.startswith("CPU")
    dense = ParallelPlan.build(config.load(f"{REPO}/configs/gpu/gpt_1p3b_dp8.yaml"),
                               target=H100)
    assert "overlap.pair_microbatches" not in dense.choices
    given = ParallelPlan.build(config.load(f"{REPO}/configs/gpu/gpt_1p3b_dp8.yaml",
                                           ["overlap.pair_microbatches=true",
                                            "pipeline.microbatches=2"]), target=H100)
    assert given.overlap.pair_microbatches and "overlap.pair_microbatches" not in given.choices


def test_auto_dcn_delay_keeps_moe_router_statistics_whole():
    """On slow links the plan delays the dcn reduction of an MoE model only as a whole
    gradient: `dcn_delay_mode: local` would keep each host's router statistics apart."""
    from models.moe import MoeLlama

    sets = ["model.layers=2", "mesh.dcn=2", "mesh.dp=4", "mesh.ep=4", "overlap.dcn_delay=auto",
            "mesh.dcn_gbps=10"]
    for mode, delay in (("local", 0), ("gradient", 1)):
        cfg = config.load(f"{REPO}/configs/mixtral_8x7b.yaml",
                          [*sets, f"overlap.dcn_delay_mode={mode}"])
        plan = ParallelPlan.build(cfg, MoeLlama.from_config(cfg), target=H100)
        assert plan.overlap.dcn_delay == delay, mode
    assert plan.slow_mode == "delay"
    assert "router statistics" in ParallelPlan.build(
        cfg := config.load(f"{REPO}/configs/mixtral_8x7b.yaml", sets),
        MoeLlama.from_config(cfg), target=H100).choices["overlap.dcn_delay"].why
