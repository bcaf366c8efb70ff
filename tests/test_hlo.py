"""HLO reader on real compiled programs: 8 CPU devices, and deviceless 8-GPU compiles."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_overlap.analysis import deviceless
from jax_overlap.hardware.collective_cost import ring_factor
from jax_overlap.analysis.hlo_collectives import parse_replica_groups
from jax_overlap.analysis.hlo_parse import parse_module, while_trip_count
from jax_overlap.analysis.hlo_report import analyze_hlo, comm_seconds
from jax_overlap.hardware.machine import LinkModel, chip_spec

needs_plugin = pytest.mark.skipif(
    not deviceless.plugin_available(), reason=deviceless.unavailable_reason() or "")

F32 = 4
BLOCK = (32, 64)  # per-device block of the mixed program
BLOCK_BYTES = BLOCK[0] * BLOCK[1] * F32
OUTER, INNER = 5, 3  # scan length, nested fori_loop length


def _mixed_lowered(devices):
    """Every collective kind inside a scan(5), plus a psum in a nested fori_loop(3).

    Mesh ``d`` x ``t`` = 2 x 4; per-device block f32[32, 64].
    """
    mesh = Mesh(np.array(devices[:8]).reshape(2, 4), ("d", "t"))

    def f(a, w):
        a = jax.lax.pcast(a, ("t",), to="varying")

        def body(c, _):
            s = jax.lax.psum(c, "t")
            g = jax.lax.all_gather(c, "t", tiled=True)
            r = jax.lax.psum_scatter(g, "t", tiled=True)
            p = jax.lax.ppermute(c, "d", [(0, 1), (1, 0)])
            x = jax.lax.all_to_all(c, "t", 0, 0, tiled=True)

            def inner(_, y):
                return jax.lax.pcast(jax.lax.psum(y, "d") * 0.5, ("d",), to="varying")

            y = jax.lax.fori_loop(0, INNER, inner, c)
            return s + r + p + x + y + c @ w, None

        out, _ = jax.lax.scan(body, a, None, length=OUTER)
        return jax.lax.psum(out, "t")

    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d")))
    a = jax.ShapeDtypeStruct((2 * BLOCK[0], BLOCK[1]), jnp.float32,
                             sharding=NamedSharding(mesh, P("d")))
    w = jax.ShapeDtypeStruct((BLOCK[1], BLOCK[1]), jnp.float32, sharding=NamedSharding(mesh, P()))
    return fn.lower(a, w)


RING_STEPS, RING_ROWS, RING_K = 4, 128, 256


def _ring_lowered(devices):
    """A ppermute ring next to an independent matmul inside fori_loop(4), 8 devices."""
    mesh = Mesh(np.array(devices[:8]), ("x",))
    ring = [(i, (i + 1) % 8) for i in range(8)]

    def f(a, b):
        def body(_, carry):
            a, acc = carry
            return jax.lax.ppermute(a, "x", ring), acc + jnp.dot(b, b)

        return jax.lax.fori_loop(0, RING_STEPS, body, (a, jnp.zeros_like(b)))

    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"), P("x")),
                               out_specs=(P("x"), P("x"))))
    a = jax.ShapeDtypeStruct((8 * RING_ROWS, RING_K), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P("x")))
    b = jax.ShapeDtypeStruct((8 * RING_K, RING_K), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P("x")))
    return fn.lower(a, b)


def _pipeline_lowered(devices):
    """An 8-stage pipeline loop: the stage output is ppermuted to the next stage, and
    an independent matmul (another microbatch) shares the loop body."""
    mesh = Mesh(np.array(devices[:8]), ("pp",))
    stages, micro, rows, dim = 8, 4, 64, 256
    ring = [(i, (i + 1) % stages) for i in range(stages)]

    def f(w, xs):
        w, xs = w[0], xs[0]
        w2 = jnp.flip(w, 0) * 1.5
        first = jax.lax.axis_index("pp") == 0

        def body(i, carry):
            state, outs, acc = carry
            y = jnp.tanh(jnp.where(first, xs[i % micro], state) @ w)
            outs = jax.lax.dynamic_update_index_in_dim(
                outs, y, jnp.clip(i - (stages - 1), 0, micro - 1), 0)
            acc = acc + jnp.tanh(xs[(i + 3) % micro] @ w2).astype(acc.dtype)
            return jax.lax.ppermute(y, "pp", ring), outs, acc

        def zeros(shape, dtype):
            return jax.lax.pcast(jnp.zeros(shape, dtype), ("pp",), to="varying")

        carry = (zeros((rows, dim), xs.dtype), zeros((micro, rows, dim), xs.dtype),
                 zeros((rows, dim), jnp.float32))
        _, outs, acc = jax.lax.fori_loop(0, micro + stages - 1, body, carry)
        return (outs + acc.astype(outs.dtype)[None])[None]

    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("pp"), P("pp")), out_specs=P("pp")))
    w = jax.ShapeDtypeStruct((stages, dim, dim), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P("pp")))
    xs = jax.ShapeDtypeStruct((stages, micro, rows, dim), jnp.bfloat16,
                              sharding=NamedSharding(mesh, P("pp")))
    return fn.lower(w, xs)


EXPECTED_MIXED = {
    # kind: (executions per step, bytes per step)
    "all-reduce": (1 + OUTER + OUTER * INNER, (1 + OUTER + OUTER * INNER) * BLOCK_BYTES),
    "all-gather": (OUTER, OUTER * 4 * BLOCK_BYTES),  # output: 4 blocks
    "reduce-scatter": (OUTER, OUTER * 4 * BLOCK_BYTES),  # input: 4 blocks
    "collective-permute": (OUTER, OUTER * BLOCK_BYTES),
    "all-to-all": (OUTER, OUTER * BLOCK_BYTES),
}


@pytest.fixture(scope="module")
def cpu_mixed_text():
    return _mixed_lowered(jax.devices()).compile().as_text()


def _summary(report):
    return {kind: (s.count, s.bytes) for kind, s in report.collectives.items()}


def test_cpu_counts_and_bytes_are_exact(cpu_mixed_text):
    report = analyze_hlo(cpu_mixed_text)
    assert report.target == "cpu"
    assert _summary(report) == EXPECTED_MIXED
    assert report.synchronous_only
    assert report.async_fraction == 0.0
    assert report.collective_bytes_under_gemm_fraction == 0.0
    assert "synchronously" in report.note
    assert all(op.form == "sync" and not op.is_async for op in report.ops)


def test_cpu_replica_groups_follow_mesh_axes(cpu_mixed_text):
    report = analyze_hlo(cpu_mixed_text)
    groups = {tuple(op.replica_groups.mesh_axes) or None: op.replica_groups.groups
              for op in report.ops if op.kind == "all-reduce"}
    assert groups[("t",)] == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert groups[("d",)] == ((0, 4), (1, 5), (2, 6), (3, 7))
    permute = next(op for op in report.ops if op.kind == "collective-permute")
    assert set(permute.source_target_pairs) == {(i, i + 4) for i in range(4)} | {
        (i + 4, i) for i in range(4)}


def test_trip_counts_derived_without_backend_config(cpu_mixed_text):
    # Older XLAs do not write known_trip_count; the loop condition must give the
    # same counts.
    stripped = re.sub(r'"known_(trip_count|init_step)":\{[^}]*\},?', "", cpu_mixed_text)
    assert "known_trip_count" not in stripped
    module = parse_module(stripped)
    trips = sorted(
        while_trip_count(module, comp, inst)
        for comp in module.computations.values() for inst in comp.instructions
        if inst.opcode == "while")
    assert trips == [INNER, OUTER]
    assert _summary(analyze_hlo(stripped)) == EXPECTED_MIXED


def test_report_json_has_the_documented_keys(cpu_mixed_text):
    data = json.loads(json.dumps(analyze_hlo(cpu_mixed_text, chip=chip_spec("h100")).to_json()))
    for key in ("collectives", "async_fraction", "collective_bytes_under_gemm_fraction",
                "exposed_comm_s_estimate", "target", "synchronous_only", "note"):
        assert key in data
    assert data["collectives"]["all-gather"] == {
        "count": OUTER, "bytes": OUTER * 4 * BLOCK_BYTES, "async_bytes": 0,
        "under_gemm_bytes": 0}
    # Synchronous collectives are fully exposed.
    assert data["exposed_comm_s_estimate"] == pytest.approx(data["total_comm_s_estimate"])
    assert data["exposed_comm_s_estimate"] > 0


@needs_plugin
def test_gpu_same_program_has_async_collectives(cpu_mixed_text):
    text = deviceless.compile_for("h100", 8, _mixed_lowered)
    assert "is_scheduled=true" in text
    report = analyze_hlo(text, target="h100")
    assert _summary(report) == _summary(analyze_hlo(cpu_mixed_text))
    assert not report.synchronous_only
    assert 0 < report.async_fraction <= 1
    scatter = next(op for op in report.ops if op.kind == "reduce-scatter")
    assert scatter.is_async and scatter.form == "start-done"


@needs_plugin
def test_gpu_ring_permute_overlaps_independent_matmul():
    report = deviceless.analyze_for("h100", 8, _ring_lowered)
    (permute,) = [op for op in report.ops if op.kind == "collective-permute"]
    assert permute.is_async
    assert permute.executions_per_step == RING_STEPS
    assert permute.bytes == RING_ROWS * RING_K * 2
    assert permute.gemms_between, permute.scheduled_between
    assert permute.gemm_flops_between == 2 * RING_K**3
    assert report.collective_bytes_under_gemm_fraction == 1.0
    assert report.exposed_comm_s_estimate < report.total_comm_s_estimate


@needs_plugin
def test_collective_permute_motion_blocks_overlap_and_the_flag_restores_it():
    default = deviceless.analyze_for("h200", 8, _pipeline_lowered)
    fixed = deviceless.analyze_for(
        "h200", 8, _pipeline_lowered,
        compiler_options={"xla_disable_hlo_passes": "collective-permute-motion"})
    (moved,) = [op for op in default.ops if op.kind == "collective-permute"]
    (kept,) = [op for op in fixed.ops if op.kind == "collective-permute"]
    assert moved.is_async and not moved.gemms_between
    assert kept.is_async and kept.gemms_between
    assert fixed.exposed_comm_s_estimate < default.exposed_comm_s_estimate


# A module in the older print style (operand shapes inline, quoted backend_config),
# with an async-start-wrapped all-gather, an all-reduce start/done pair and a cuBLAS
# GEMM scheduled under both.
OLD_STYLE = """HloModule m, is_scheduled=true, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%wrapped_all_gather (p: bf16[16,64]) -> bf16[64,64] {
  %p = bf16[16,64]{1,0} parameter(0)
  ROOT %ag = bf16[64,64]{1,0} all-gather(bf16[16,64]{1,0} %p), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true
}

ENTRY %main (x: bf16[16,64], w: bf16[64,128], g: f32[1024], h: bf16[64,64]) -> (bf16[64,64], bf16[64,128], f32[1024]) {
  %x = bf16[16,64]{1,0} parameter(0)
  %w = bf16[64,128]{1,0} parameter(1)
  %g = f32[1024]{0} parameter(2)
  %h = bf16[64,64]{1,0} parameter(3)
  %ags = ((bf16[16,64]{1,0}), bf16[64,64]{1,0}, s32[]) async-start(bf16[16,64]{1,0} %x), calls=%wrapped_all_gather
  %ars = f32[1024]{0} all-reduce-start(f32[1024]{0} %g), channel_id=2, replica_groups={{0,1},{2,3}}, to_apply=%add, backend_config="{\\"collective_backend_config\\":{\\"is_sync\\":false}}"
  %gemm = (bf16[64,128]{1,0}, s8[1024]{0}) custom-call(bf16[64,64]{1,0} %h, bf16[64,128]{1,0} %w), custom_call_target="__cublas$lt$matmul", backend_config="{\\"gemm_backend_config\\":{\\"dot_dimension_numbers\\":{\\"lhs_contracting_dimensions\\":[\\"1\\"],\\"rhs_contracting_dimensions\\":[\\"0\\"]}}}"
  %ard = f32[1024]{0} all-reduce-done(f32[1024]{0} %ars)
  %agd = bf16[64,64]{1,0} async-done(((bf16[16,64]{1,0}), bf16[64,64]{1,0}, s32[]) %ags), calls=%wrapped_all_gather
  %r = bf16[64,128]{1,0} get-tuple-element((bf16[64,128]{1,0}, s8[1024]{0}) %gemm), index=0
  ROOT %t = (bf16[64,64]{1,0}, bf16[64,128]{1,0}, f32[1024]{0}) tuple(bf16[64,64]{1,0} %agd, bf16[64,128]{1,0} %r, f32[1024]{0} %ard)
}
"""


def test_old_style_async_wrapper_and_cublas_gemm():
    chip = chip_spec("h100")
    link = LinkModel(bytes_per_s=1e9)
    report = analyze_hlo(OLD_STYLE, target="h100", link=link)
    gather = next(op for op in report.ops if op.kind == "all-gather")
    reduce = next(op for op in report.ops if op.kind == "all-reduce")
    assert (gather.form, gather.bytes, gather.replica_groups.groups) == (
        "async-wrapper", 64 * 64 * 2, ((0, 1, 2, 3),))
    assert (reduce.form, reduce.bytes, reduce.replica_groups.groups) == (
        "start-done", 1024 * 4, ((0, 1), (2, 3)))
    gemm_flops = 2 * 64 * 128 * 64
    assert [g.name for g in gather.gemms_between] == ["gemm"]
    assert reduce.gemm_flops_between == gemm_flops
    assert report.async_fraction == 1.0
    assert report.collective_bytes_under_gemm_fraction == 1.0
    assert report.collectives["all-gather"].under_gemm_bytes == 64 * 64 * 2
    assert report.collectives["all-reduce"].under_gemm_bytes == 1024 * 4
    hidden = gemm_flops / chip.peak_bf16_flops
    expected = (0.75 * 8192 / 1e9 - hidden) + (1.0 * 4096 / 1e9 - hidden)
    assert report.exposed_comm_s_estimate == pytest.approx(expected)


def test_replica_group_forms():
    assert parse_replica_groups("replica_groups={}", 8).group_size == 8
    assert parse_replica_groups("replica_groups=[4,2]<=[2,4]T(1,0)", 8).groups == (
        (0, 4), (1, 5), (2, 6), (3, 7))
    mesh = parse_replica_groups("replica_groups=mesh['a'=2,'b'=2,'c'=2] {'a','c'}", 8)
    assert mesh.mesh_axes == ("a", "c")
    assert mesh.groups == ((0, 1, 4, 5), (2, 3, 6, 7))
    sub = parse_replica_groups("replica_groups=mesh['x'=8] {'x':(1)2}", 8)
    assert (sub.group_size, sub.groups) == (2, None)


def test_link_model_uses_ring_factors_and_axis_overrides(cpu_mixed_text):
    assert ring_factor("all-reduce", 4) == pytest.approx(1.5)
    assert ring_factor("all-gather", 4) == pytest.approx(0.75)
    assert ring_factor("collective-permute", None) == 1.0
    assert ring_factor("all-reduce", 1) == 0.0
    report = analyze_hlo(cpu_mixed_text)
    op = next(o for o in report.ops if o.replica_groups.mesh_axes == ("d",))
    slow_d = LinkModel(bytes_per_s=100e9, axis_bytes_per_s={"d": 25e9})
    assert comm_seconds(op, slow_d) == pytest.approx(1.0 * BLOCK_BYTES / 25e9)
    assert comm_seconds(op, LinkModel(100e9)) == pytest.approx(1.0 * BLOCK_BYTES / 100e9)


def _branch(name: str, gemm: bool) -> str:
    """An HLO branch computation on a pair of (64, 64) operands: their product, or the first
    one (a branch that skips)."""
    if gemm:
        body = (f"  %a_{name} = bf16[64,64]{{1,0}} get-tuple-element(%p_{name}), index=0\n"
                f"  %b_{name} = bf16[64,64]{{1,0}} get-tuple-element(%p_{name}), index=1\n"
                f"  ROOT %d_{name} = bf16[64,64]{{1,0}} dot(bf16[64,64]{{1,0}} %a_{name}, "
                f"bf16[64,64]{{1,0}} %b_{name}), lhs_contracting_dims={{1}}, "
                f"rhs_contracting_dims={{0}}\n")
    else:
        body = f"  ROOT %z_{name} = bf16[64,64]{{1,0}} get-tuple-element(%p_{name}), index=0\n"
    return (f"%{name} (p_{name}: (bf16[64,64], bf16[64,64])) -> bf16[64,64] {{\n"
            f"  %p_{name} = (bf16[64,64]{{1,0}}, bf16[64,64]{{1,0}}) parameter(0)\n"
            f"{body}}}\n\n")


# A permute in flight around a two-branch `lax.cond` that XLA wrote as a predicate
# conditional: its true branch holds a GEMM, its false branch nothing (the pipeline's head
# phase on a tick without a head).
AROUND_COND = "HloModule m, is_scheduled=true, num_partitions=2\n\n" + _branch(
    "head", True) + _branch("no_head", False) + """\
ENTRY %main (x: bf16[64,64], y: bf16[64,64], c: pred[]) -> (bf16[64,64], bf16[64,64]) {
  %x = bf16[64,64]{1,0} parameter(0)
  %y = bf16[64,64]{1,0} parameter(1)
  %c = pred[] parameter(2)
  %cps = (bf16[64,64]{1,0}, bf16[64,64]{1,0}) collective-permute-start(bf16[64,64]{1,0} %x), channel_id=1, source_target_pairs={{0,1},{1,0}}
  %ops = (bf16[64,64]{1,0}, bf16[64,64]{1,0}) tuple(%x, %y)
  %cond = bf16[64,64]{1,0} conditional(pred[] %c, %ops, %ops), true_computation=%head, false_computation=%no_head
  %cpd = bf16[64,64]{1,0} collective-permute-done((bf16[64,64]{1,0}, bf16[64,64]{1,0}) %cps)
  ROOT %t = (bf16[64,64]{1,0}, bf16[64,64]{1,0}) tuple(%cpd, %cond)
}
"""


def test_a_collective_around_a_conditional_is_under_the_ticks_whose_branch_has_a_gemm():
    """The head phase's cond runs its GEMMs on a share of the ticks only (the tick table's,
    through `branch_frequencies`, index order: false, then true). A transfer in flight
    around it is under GEMMs on that share of its executions, with that share of the
    branch's FLOPs to hide under; before, the predicate conditional's branches were not
    looked into (never under) and were counted as taken every time."""
    link = LinkModel(bytes_per_s=1e9)
    chip = chip_spec("h100")
    report = analyze_hlo(AROUND_COND, target="h100", link=link, branch_frequencies=[0.75, 0.25])
    (permute,) = report.ops
    assert permute.under_share == pytest.approx(0.25)
    assert permute.gemm_flops_between == pytest.approx(0.25 * 2 * 64 * 64 * 64)
    assert report.collective_bytes_under_gemm_fraction == pytest.approx(0.25)
    hidden = 0.25 * 2 * 64 * 64 * 64 / chip.peak_bf16_flops
    assert report.exposed_comm_s_estimate == pytest.approx(64 * 64 * 2 / 1e9 - hidden)
    # A transfer shorter than the branch's GEMMs is hidden on the ticks that run them and
    # exposed whole on the others (not hidden by the FLOPs' average).
    fast = LinkModel(bytes_per_s=1e15)
    assert 64 * 64 * 2 / 1e15 < 2 * 64 * 64 * 64 / chip.peak_bf16_flops
    report = analyze_hlo(AROUND_COND, target="h100", link=fast, branch_frequencies=[0.75, 0.25])
    assert report.exposed_comm_s_estimate == pytest.approx(0.75 * 64 * 64 * 2 / 1e15)
    # Without the table's shares, each branch counts as taken: an upper bound, under.
    assert analyze_hlo(AROUND_COND, target="h100").ops[0].under_share == 1.0


# A lane's two switches on the same row of the tick table: an action runs in one (here: the
# first switch's branch 0, the second's branch 1), the other skips.
TWO_SWITCHES = "HloModule m, is_scheduled=true, num_partitions=2\n\n" + "".join(
    _branch(name, gemm) for name, gemm in (("gemm", True), ("gemm2", True), ("skip", False),
                                           ("skip2", False))) + """\
ENTRY %main (x: bf16[64,64], y: bf16[64,64], i: s32[]) -> (bf16[64,64], bf16[64,64], bf16[64,64]) {
  %x = bf16[64,64]{1,0} parameter(0)
  %y = bf16[64,64]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %cps = (bf16[64,64]{1,0}, bf16[64,64]{1,0}) collective-permute-start(bf16[64,64]{1,0} %x), channel_id=1, source_target_pairs={{0,1},{1,0}}
  %ops = (bf16[64,64]{1,0}, bf16[64,64]{1,0}) tuple(%x, %y)
  %plain = bf16[64,64]{1,0} conditional(s32[] %i, %ops, %ops), branch_computations={%gemm, %skip}
  %filing = bf16[64,64]{1,0} conditional(s32[] %i, %ops, %ops), branch_computations={%skip2, %gemm2}
  %cpd = bf16[64,64]{1,0} collective-permute-done((bf16[64,64]{1,0}, bf16[64,64]{1,0}) %cps)
  ROOT %t = (bf16[64,64]{1,0}, bf16[64,64]{1,0}, bf16[64,64]{1,0}) tuple(%cpd, %plain, %filing)
}
"""


def test_a_collective_around_both_switches_of_a_lane_is_under_whichever_runs():
    """Switches taken by the same shares run on the same row: each tick takes the same
    index in both, so the cover is the union over indices (0.75 + 0.25 here), not the
    larger share alone; switches taken by other shares are independent."""
    report = analyze_hlo(TWO_SWITCHES, target="h100", branch_frequencies=[0.75, 0.25])
    assert report.ops[0].under_share == pytest.approx(1.0)
    shares = {"plain": [0.75, 0.25], "filing": [0.5, 0.5]}
    report = analyze_hlo(TWO_SWITCHES, target="h100",
                         branch_frequencies=lambda inst: shares.get(inst.name))
    assert report.ops[0].under_share == pytest.approx(1 - (1 - 0.75) * (1 - 0.5))
