"""The compiled step's estimate (`jax_overlap.analysis.step_estimate`): kernels counted per
execution, in-place updates and slices at their real size, the pipeline replayed on its tick
table, and agreement with a second, simpler roofline of the same HLO."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY, run_cli

from jax_overlap import config
from jax_overlap.analysis.hlo_gemms import gemm_work
from jax_overlap.analysis.hlo_parse import (
    called_computations,
    execution_counts,
    parse_module,
    shape_bytes,
)
from jax_overlap.hardware.machine import KernelEfficiency, chip_spec
from jax_overlap.analysis.analyze import switch_weights
from jax_overlap.analysis.step_estimate import (
    LAUNCH_S,
    Ticks,
    _in_last_tick,
    _lane,
    estimate_step,
    replay_ticks,
)

H100 = chip_spec("h100")


def _hlo(f, *args) -> str:
    return jax.jit(f).lower(*args).compile().as_text()


def test_a_loop_body_counts_once_per_trip():
    """Five trips of a (64 x 128) @ (128 x 32) matmul: five times its FLOPs."""
    def f(x, w):
        return jax.lax.fori_loop(0, 5, lambda i, h: jnp.tanh(h @ w), x)

    x, w = jnp.ones((64, 128)), jnp.ones((128, 128))
    text = _hlo(f, x, w)
    est = estimate_step(text, H100, model_flops=1.0)
    assert est.gemm_flops == pytest.approx(5 * 2 * 64 * 128 * 128)
    assert est.wait_ms == 0 and est.exposed_ms == 0
    assert est.step_ms == pytest.approx(est.gemm_ms + est.other_ms + est.launch_ms)
    # Communication no compute hides (`HloReport.exposed_comm_s_estimate`) adds to the step.
    exposed = estimate_step(text, H100, model_flops=1.0, exposed_s=2e-3)
    assert exposed.exposed_ms == pytest.approx(2.0)
    assert exposed.step_ms == pytest.approx(est.step_ms + 2.0)
    assert exposed.mfu == pytest.approx(est.mfu * est.step_ms / exposed.step_ms)


def test_expected_runs_each_kernel_at_its_measured_share_of_the_peak():
    """`expected_ms` is the roofline again with GEMMs at the chip's measured GEMM share and
    every other kernel at its measured share of the bandwidth; MFU over the real peak."""
    def f(x, w):
        return jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w), x)

    x, w = jnp.ones((512, 1024)), jnp.ones((1024, 1024))
    eff = KernelEfficiency(gemm=0.5, attention=0.2, memory=0.25, source="test")
    chip = dataclasses.replace(H100, efficiency=eff)
    est = estimate_step(_hlo(f, x, w), chip, model_flops=1e9)
    want = est.launch_ms * 1e-3
    for kernel, runs, _ in est.kernels:
        memory = kernel.bytes / (H100.hbm_bytes_per_s * eff.memory)
        want += runs * (max(kernel.flops / (H100.peak_tf32_flops * eff.gemm), memory)
                        if kernel.kind == "gemm" else memory)
    assert est.expected_ms == pytest.approx(want * 1e3)
    assert est.expected_mfu == pytest.approx(1e9 / (want * H100.peak_bf16_flops))
    assert est.to_json()["expected_step_ms"] == est.expected_ms
    # Without measured shares there is no expected figure.
    bare = estimate_step(_hlo(f, x, w), chip_spec("a100"), model_flops=1e9)
    assert bare.expected_ms is None and "expected_step_ms" not in bare.to_json()


def test_an_in_place_update_costs_its_update_not_its_buffer():
    """Writing one (8, 256) row block into a 64 MiB pool moves kilobytes, not the pool."""
    pool = jnp.zeros((1024, 64, 256))

    def f(pool, x, i):
        return jax.lax.dynamic_update_slice_in_dim(pool, x[None] * 2, i, axis=0)

    text = jax.jit(f, donate_argnums=0).lower(pool, jnp.ones((64, 256)), 3).compile().as_text()
    est = estimate_step(text, H100, model_flops=1.0)
    moved = est.other_ms * 1e-3 * H100.hbm_bytes_per_s
    assert moved < 4 * 64 * 256 * 4  # a few times the update, far below the 64 MiB pool


def test_replay_waits_for_the_senders():
    """Two stages sending to each other each tick: a stage starts a tick when it and its
    sender finished the last one (latency 1), or finishes it no earlier than the sender's
    last tick (arrival needed to finish)."""
    work = np.array([[1.0, 3.0], [3.0, 1.0]])
    ticks = Ticks(branch=np.zeros((2, 2, 1), int), names=("idle",), senders=((1,), (0,)),
                  head=np.zeros(2, bool), arrival_to_finish=False)
    assert replay_ticks(work, ticks).tolist() == [6.0, 4.0]
    skewed = Ticks(**{**ticks.__dict__, "arrival_to_finish": True})
    assert replay_ticks(work, skewed).tolist() == [4.0, 4.0]
    alone = Ticks(**{**ticks.__dict__, "senders": ((), ())})
    assert replay_ticks(work, alone).tolist() == [4.0, 4.0]


def _pipeline_hlo(overrides):
    from jax_overlap.analysis.analyze import build_plan, lower_train_step

    cfg = config.load(TINY, overrides)
    built = build_plan(cfg, "cpu")
    model, plan = built.model, built.plan
    text = lower_train_step(cfg, jax.devices()[:plan.num_devices], "cpu",
                            built).compile().as_text()
    return cfg, model, plan, text


PIPELINE = ["mesh.pp=4", "mesh.dp=2", "mesh.tp=1", "model.layers=4", "pipeline.microbatches=4",
            "train.global_batch=16", "data.source=synthetic"]


def test_pipeline_estimate_replays_the_tick_table():
    """pp4 x dp2 1F1B: the switch branches are weighted as the table takes them (every
    stage runs each microbatch's F and B once: the block GEMMs' FLOPs add up to the model's
    forward and backward), and the replayed step waits on the bubble."""
    cfg, model, plan, text = _pipeline_hlo(PIPELINE)
    est = estimate_step(text, H100, 1.0, Ticks.of_program(plan.program))
    where = {w for _, runs, w in est.kernels if runs > 0}
    assert {"lane 0: F first", "lane 0: B last"} <= where
    model_flops = model.flops_per_example() * cfg.train.global_batch / plan.num_devices
    assert 0.9 < est.gemm_flops / model_flops < 1.5
    assert est.wait_ms > 0
    assert est.step_ms == pytest.approx(est.gemm_ms + est.other_ms + est.launch_ms + est.wait_ms)
    # No tick table: every branch costed as the most expensive one, nothing replayed.
    flat = estimate_step(text, H100, 1.0)
    assert flat.wait_ms == 0 and flat.gemm_flops > est.gemm_flops


def _simple_roofline(text: str, chip, frequencies) -> float:
    """A second, simpler counter: `hlo_parse.execution_counts` per computation (every
    conditional's branches as often as the tick table takes them), each kernel at
    max(FLOPs / peak, 2 x written bytes / bandwidth) -- a kernel reads about what it
    writes, an in-place update writes its update -- plus a launch."""
    module = parse_module(text)
    counts, _ = execution_counts(module, frequencies)
    fused = {c for comp in module.computations.values() for inst in comp.instructions
             if inst.opcode not in ("call", "async-start")
             for key, names in called_computations(inst).items()
             if key in ("calls", "to_apply") for c in names}
    free = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
            "conditional", "call", "opt-barrier", "after-all", "partition-id", "async-start"}
    seconds = 0.0
    for name, comp in module.computations.items():
        runs = counts.get(name, 0)
        if not runs or name in fused:
            continue
        for inst in comp.instructions:
            if inst.opcode in free or inst.opcode.endswith("-done"):
                continue
            seconds += runs * LAUNCH_S
            if any(k in inst.opcode for k in ("all-", "collective", "reduce-scatter")):
                continue
            callee = (called_computations(inst).get("calls") or [None])[0]
            body = module.computations.get(callee, comp)
            root = body.root if callee in module.computations else inst
            written = shape_bytes(root.shape)
            if root.opcode in ("dynamic-update-slice", "scatter"):
                update = body.get(root.operands[1 if root.opcode != "scatter" else 2])
                written = shape_bytes(update.shape) if update is not None else written
            work = gemm_work(module, comp, inst)
            memory = 2 * written / chip.hbm_bytes_per_s
            seconds += runs * (max(work.flops / chip.matmul_flops_per_s(work.dtype), memory)
                               if work is not None and work.flops else memory)
    return seconds


def test_the_estimate_agrees_with_a_simpler_roofline():
    """The work part of the estimate (its step less the replay's waits) is within 20% of the
    simple counter above, on the pipelined program and on a pp = 1 one."""
    for overrides in (PIPELINE, ["model.layers=4", "train.global_batch=16"]):
        _, _, plan, text = _pipeline_hlo(overrides)
        ticks = Ticks.of_program(plan.program) if plan.program is not None else None
        est = estimate_step(text, H100, 1.0, ticks)
        simple = _simple_roofline(text, H100, switch_weights(plan.program, text)) * 1e3
        work = est.step_ms - est.wait_ms
        assert abs(work - simple) / simple < 0.20, (overrides, work, simple)


def test_analyze_top_must_be_a_count():
    proc = run_cli("analyze", "--config", TINY, "--top", "-1")
    assert proc.returncode == 2
    assert "--top" in proc.stderr and "Traceback" not in proc.stderr


def test_a_last_tick_after_the_loop_is_costed_by_the_last_row(monkeypatch):
    """The GPU plan's paired 1F1B runs its last tick after the loop, the embedding's
    reduction under it (`pipeline.tick_loop.DeferredEmbedding`). The loop's switches are
    weighted by the rows before the last and the peeled tick's by the last row, so the step
    costs the same GEMMs as when every tick runs in the loop (weighted by the whole table,
    the peeled tick counted as an average one: one tick's GEMMs short)."""
    from jax_overlap.pipeline import executor
    from jax_overlap.plan import Target
    from jax_overlap.training.assemble import assemble

    cfg = config.load(TINY, [*PIPELINE, "model.attention=plain"])
    run = assemble(cfg, jax.devices()[:8], target=Target("h100", True, 80e9))
    params = run.place_params(run.model.init(jax.random.key(0)))

    def compiled():
        return jax.jit(run.loss_and_grads()).lower(params, run.abstract_batch()).compile(
        ).as_text()

    peeled = compiled()
    monkeypatch.setattr(executor, "deferred_embedding", lambda *a, **k: None)
    looped = compiled()
    assert "/pp_last_tick/" in peeled and "/pp_last_tick/" not in looped
    ticks = Ticks.of_program(run.plan.program)
    one, other = (estimate_step(text, H100, 1.0, ticks) for text in (peeled, looped))
    assert one.gemm_flops == pytest.approx(other.gemm_flops, rel=1e-6)
    assert one.gemm_ms == pytest.approx(other.gemm_ms, rel=1e-6)
    assert 0 < one.wait_ms == pytest.approx(other.wait_ms, rel=0.05)
    # The collective report counts each lane's switch by its own column of the table (of
    # its span's rows: the fill's loop runs no backward lane, the drain's no forward one): a
    # stage runs each microbatch's F in lane 0 and its B in lane 1 once a step (weights
    # pooled over both lanes had each at half that, and the in-switch collectives too).
    program = run.plan.program
    m = program.schedule.microbatches
    for text in (peeled, looped):
        module = parse_module(text)
        counts, _ = execution_counts(module, switch_weights(program, text))
        runs, switches = {0: 0.0, 1: 0.0}, {0: 0, 1: 0}
        for comp in module.computations.values():
            for inst in comp.instructions:
                lane = _lane(inst) if inst.opcode == "conditional" else None
                if lane is None or _in_last_tick(inst):
                    continue
                called = called_computations(inst)["branch_computations"]
                assert len(called) == 1 + len(program.branches)
                kind = "F" if lane == 0 else "B"
                runs[lane] += sum(counts[called[b + 1]] for b, branch
                                  in enumerate(program.branches) if branch.kind == kind)
                switches[lane] += 1
        # Per device, on average over the stages: each microbatch's action once, but where
        # the last tick runs apart, stage 0's last B.
        want = {lane: m - (lane == 1 and text is peeled) / program.schedule.stages
                for lane in (0, 1)}
        assert runs == pytest.approx(want), (runs, want)
        assert switches == {0: 2, 1: 2}  # fill + steady, steady + drain
    # Both lanes in one switch (`pipeline.fused_pairs`): one switch over the table's
    # (forward, backward) pairs, weighted by how often each pair runs; every microbatch's F
    # and B still once a step, and the replay's work the same GEMMs.
    monkeypatch.undo()
    fused_cfg = config.load(TINY, [*PIPELINE, "model.attention=plain",
                                   "pipeline.fused_pairs=true"])
    fused = assemble(fused_cfg, jax.devices()[:8], target=Target("h100", True, 80e9))
    program = fused.plan.program
    pairs, index = program.lane_pairs
    assert program.fused and (program.column("branch") == np.asarray(pairs)[index]).all()
    text = jax.jit(fused.loss_and_grads()).lower(params, fused.abstract_batch()).compile(
    ).as_text()
    module = parse_module(text)
    counts, _ = execution_counts(module, switch_weights(program, text))
    runs = {"F": 0.0, "B": 0.0}
    for comp in module.computations.values():
        for inst in comp.instructions:
            if inst.opcode != "conditional" or _lane(inst) is None:
                continue
            assert _lane(inst) == 0
            called = called_computations(inst)["branch_computations"]
            assert len(called) == len(pairs)
            for i, pair in enumerate(pairs):
                for b in pair:
                    if b:
                        runs[program.branches[b - 1].kind] += counts[called[i]]
    assert runs == pytest.approx({"F": m, "B": m}), runs
    est = estimate_step(text, H100, 1.0, Ticks.of_program(program))
    assert est.gemm_flops == pytest.approx(one.gemm_flops, rel=1e-6)


_ASYNC_COLLECTIVES = """HloModule m, is_scheduled=true

%add (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %s = bf16[] add(%a, %b)
}

ENTRY %main (p: bf16[16,2048,2048], q: bf16[8,4096,2048]) -> (bf16[16,1024,2048], bf16[8,4096,2048]) {
  %p = bf16[16,2048,2048]{2,1,0} parameter(0)
  %q = bf16[8,4096,2048]{2,1,0} parameter(1)
  %rs = ((bf16[16,2048,2048]{2,1,0}), bf16[16,1024,2048]{2,1,0}) reduce-scatter-start(%p), channel_id=1, replica_groups={{0,1}}, dimensions={1}, to_apply=%add
  %d = bf16[16,1024,2048]{2,1,0} reduce-scatter-done(%rs)
  %aa = ((bf16[8,4096,2048]{2,1,0}), bf16[8,4096,2048]{2,1,0}) all-to-all-start(%q), channel_id=2, replica_groups={{0,1}}, dimensions={0}
  %e = bf16[8,4096,2048]{2,1,0} all-to-all-done(%aa)
  ROOT %t = (bf16[16,1024,2048]{2,1,0}, bf16[8,4096,2048]{2,1,0}) tuple(%d, %e)
}
"""


def test_async_reduce_scatters_and_all_to_alls_are_communication_not_kernels():
    """jax 0.12's GPU HLO prints `reduce-scatter-start` / `-done` and `all-to-all-start` /
    `-done` pairs. They are collectives (their time is the exposed communication), not
    memory-bound kernels: until 2026-12-06 each pair was charged its buffers' HBM traffic
    (GPT-1.3B pp2 x dp2 x tp2: 74 ms of phantom kernels a step)."""
    est = estimate_step(_ASYNC_COLLECTIVES, H100, model_flops=1.0)
    assert est.other_ms == 0 and est.gemm_ms == 0
    assert sorted((k.name, k.kind) for k, _, _ in est.kernels) == [
        ("aa", "collective"), ("rs", "collective")]
