"""Collective matmul equals the plain all-gather / reduce-scatter version, alone and in the GPT."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY, gpt_reference, max_rel_err, rel
from jax.sharding import PartitionSpec as P

from jax_overlap import config
from jax_overlap.parallel import collective_matmul as cm
from jax_overlap.parallel import compat
from jax_overlap.parallel import mesh as meshlib
from jax_overlap.training.assemble import assemble


def _tp_mesh(tp):
    return meshlib.make_mesh(1, 1, tp, jax.devices()[:tp])


def _plain_and_ring(tp, direction, dim=1):
    """Per-device (plain, ring) versions of both ops, each with its gradient, on a tp mesh.
    `direction` "grouped": the grouped steps (all-gathers / reduce-scatters of pieces);
    `dim`: the dim of (B, T, D) split over tp (0: the batch, `overlap.sp_split: batch`)."""
    grouped = direction == "grouped"
    mesh = _tp_mesh(tp)
    spec_seq = P(None, "tp", None) if dim == 1 else P("tp", None, None)
    spec_col, spec_row = P(None, "tp"), P("tp", None)

    def ag_plain(x, w):
        x_full = jax.lax.all_gather(x, "tp", axis=dim, tiled=True)  # (B, T, D), over tp
        return jnp.einsum("btd,dn->btn", x_full, w)

    def ag_ring(x, w):
        return cm.all_gather_matmul(x, w, "tp", tp, direction, grouped, dim)

    def rs_plain(h, w):
        partial_btd = jnp.einsum("btn,nd->btd", h, w)
        return jax.lax.psum_scatter(partial_btd, "tp", scatter_dimension=dim,
                                    tiled=True)  # this rank's rows, over tp

    def rs_ring(h, w):
        return cm.matmul_reduce_scatter(h, w, "tp", tp, direction, grouped, dim)

    def with_grads(f, in_specs, out_spec):
        g = compat.shard_map(f, mesh, in_specs=in_specs, out_specs=out_spec)

        def value_and_grads(a, b, ct):
            out, vjp = jax.vjp(g, a, b)
            return out, vjp(ct)

        return jax.jit(value_and_grads)

    ag = [with_grads(f, (spec_seq, spec_col), P(None, None, "tp")) for f in (ag_plain, ag_ring)]
    rs = [with_grads(f, (P(None, None, "tp"), spec_row), spec_seq) for f in (rs_plain, rs_ring)]
    return ag, rs


@pytest.mark.parametrize("tp,direction,t_local,dim", [
    (4, "uni", 8, 1), (4, "bi", 8, 1), (2, "bi", 8, 1), (4, "grouped", 8, 1),
    (2, "grouped", 8, 1), (4, "grouped", 6, 1),  # 6 positions per rank: 3 pieces of 2
    (2, "grouped", 8, 0)])  # split over the batch: a rank's chunk is its sequences
def test_functions_match_plain_collectives(tp, direction, t_local, dim):
    rng = np.random.default_rng(tp)
    b, t, d, n = 2, t_local * tp, 16, 12 * tp
    x = jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32)
    w_in = jnp.asarray(rng.standard_normal((d, n)), jnp.float32)
    w_out = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    h = jnp.asarray(rng.standard_normal((b, t, n)), jnp.float32)
    ct_ag = jnp.asarray(rng.standard_normal((b, t, n)), jnp.float32)
    ct_rs = jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32)
    (ag_plain, ag_ring), (rs_plain, rs_ring) = _plain_and_ring(tp, direction, dim)

    want, got = ag_plain(x, w_in, ct_ag), ag_ring(x, w_in, ct_ag)
    np.testing.assert_allclose(np.asarray(want[0]), np.asarray(x @ w_in), rtol=1e-5, atol=1e-5)
    assert max_rel_err(got, want) <= 1e-5

    want, got = rs_plain(h, w_out, ct_rs), rs_ring(h, w_out, ct_rs)
    np.testing.assert_allclose(np.asarray(want[0]), np.asarray(h @ w_out), rtol=1e-5, atol=1e-4)
    assert max_rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("tp,how", [(2, "chunked"), (4, "chunked"), (4, "uni"), (4, "bi"),
                                    (2, "bi"), (2, "batch")])
def test_mlp_rings_match_plain_collectives(tp, how):
    """An MLP carried chunk by chunk (`gather_map_scatter`, the pipeline's tp = 2 path; "batch":
    its rows split over the batch) or as the two rings handing their pieces over
    (`position_wise_ring`) gives the plain all-gather / reduce-scatter MLP's output and
    gradients, its bias's included."""
    rng = np.random.default_rng(tp)
    b, t, d, n = 2 * tp, 4 * tp, 8, 6 * tp
    x, w_in, bias, w_out, ct = (jnp.asarray(rng.standard_normal(s), jnp.float32)
                                for s in ((b, t, d), (d, n), (n,), (n, d), (b, t, d)))
    mesh = _tp_mesh(tp)
    dim = 0 if how == "batch" else 1
    split = P(None, "tp", None) if dim == 1 else P("tp", None, None)
    specs = (split, P(None, "tp"), P("tp"), P("tp", None))

    def plain(x, wi, bi, wo):
        h = jnp.tanh(jax.lax.all_gather(x, "tp", axis=dim, tiled=True) @ wi + bi)
        return jax.lax.psum_scatter(h @ wo, "tp", scatter_dimension=dim, tiled=True)

    def chunked(x, wi, bi, wo):
        fn = lambda h: jnp.tanh(h + bi)  # noqa: E731 - closes over the bias, as models do
        if how in ("chunked", "batch"):
            return cm.gather_map_scatter(x, wi, fn, wo, "tp", tp, dim)
        return cm.position_wise_ring(x, wi, fn, wo, "tp", tp, how)

    def value_and_grads(f):
        g = compat.shard_map(f, mesh, in_specs=specs, out_specs=split)
        out, vjp = jax.vjp(g, x, w_in, bias, w_out)
        return out, vjp(ct)

    want, got = value_and_grads(plain), jax.jit(lambda: value_and_grads(chunked))()
    np.testing.assert_allclose(np.asarray(want[0]), np.tanh(np.asarray(x) @ np.asarray(w_in)
                                                            + np.asarray(bias))
                               @ np.asarray(w_out), rtol=1e-5, atol=1e-5)
    assert max_rel_err(got, want) <= 1e-5
    if how not in ("chunked", "batch"):
        # The hidden pieces go from ring to ring as they are: no rank-dependent slice or
        # update of a whole-sequence buffer, forward or backward.
        jaxpr = str(jax.make_jaxpr(lambda: value_and_grads(chunked))())
        assert "dynamic_slice" not in jaxpr and "dynamic_update_slice" not in jaxpr


def test_ring_is_ppermutes_not_gathers():
    """The compiled ring is collective-permutes only: no all-gather or reduce-scatter."""
    tp = 4
    (_, ag_ring), (_, rs_ring) = _plain_and_ring(tp, "uni")
    x = jnp.zeros((2, 8 * tp, 16))
    w = jnp.zeros((16, 12 * tp))
    text = ag_ring.lower(x, w, jnp.zeros((2, 8 * tp, 12 * tp))).compile().as_text()
    from jax_overlap.analysis.hlo_report import analyze_hlo

    kinds = analyze_hlo(text).collectives
    # Forward: tp-1 permutes; backward (the custom VJP): a reduce-scatter ring for the
    # input's gradient (tp-1) and the input's chunks again for the weight's (tp-1), whose
    # first transfer is the forward's first, shared (CSE) when one program has both.
    assert 3 * (tp - 1) - 1 <= kinds["collective-permute"].count <= 3 * (tp - 1)
    assert "all-gather" not in kinds and "reduce-scatter" not in kinds


def test_grouped_steps_are_gathers_and_scatters_not_permutes():
    """Grouped steps: one all-gather per piece forward and one reduce-scatter per piece
    backward (autodiff of the gather), every one in a loop body but the first; no permute."""
    from jax_overlap.analysis.hlo_report import analyze_hlo

    tp = 4
    (_, ag), _ = _plain_and_ring(tp, "grouped")
    text = ag.lower(jnp.zeros((2, 8 * tp, 16)), jnp.zeros((16, 12 * tp)),
                    jnp.zeros((2, 8 * tp, 12 * tp))).compile().as_text()
    kinds = analyze_hlo(text).collectives
    assert "collective-permute" not in kinds
    assert kinds["all-gather"].count >= 2 and kinds["reduce-scatter"].count >= 2


def test_grouped_steps_are_right_under_stage_divergent_branches():
    """The executor's situation in miniature: a two-stage pipeline over 'pp' whose stages
    take different `lax.switch` branches at each tick, the busy branch running a collective
    matmul over 'tp', and a 'pp' ppermute after every tick. The grouped steps give the
    one-device result. (Ring ppermutes there are matched with the other stage's 'pp'
    permute by XLA:CPU and give wrong numbers: `docs/design/xla_notes.md`.)"""
    tp, b, t, d = 2, 1, 8, 4
    mesh = meshlib.make_mesh(2, 2, tp, jax.devices()[:8])
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2 * b, t, d)), jnp.float32)
    w_in = jnp.asarray(rng.standard_normal((d, d)), jnp.float32)
    w_out = jnp.asarray(rng.standard_normal((d, d)), jnp.float32)

    def layer(h, wi, wo):  # SP block: gathered column matmul, then row matmul scattered
        y = cm.all_gather_matmul(h, wi, "tp", tp, grouped=True)
        return h + cm.matmul_reduce_scatter(jnp.tanh(y), wo, "tp", tp, grouped=True)

    def per_device(h, wi, wo):
        stage = jax.lax.axis_index("pp")
        h = compat.to_varying(h, ("pp",))

        def tick(h, t_):  # stage s works at tick s, then hands its activation to s + 1
            busy = jax.lax.switch((t_ == stage).astype(jnp.int32),
                                  [lambda a: compat.vary_like(a * 0.0, a, wi, wo),
                                   lambda a: layer(a, wi, wo)], h)
            got = jax.lax.ppermute(busy, "pp", [(0, 1)])
            return jnp.where(stage == 0, jnp.where(t_ == 0, busy, h),
                             jnp.where(t_ == 0, got, busy)), None

        return jax.lax.scan(tick, h, jnp.arange(2))[0]

    f = jax.jit(compat.shard_map(per_device, mesh, in_specs=(
        P("dp", "tp", None), P(None, "tp"), P("tp", None)), out_specs=P(("pp", "dp"), "tp")))
    got = np.asarray(f(x, w_in, w_out)).reshape(2, 2 * b, t, d)[1]  # stage 1's output

    def ref_layer(h):
        return h + jnp.tanh(h @ w_in) @ w_out

    np.testing.assert_allclose(got, np.asarray(ref_layer(ref_layer(x))), rtol=1e-5, atol=1e-5)


def test_odd_local_chunk_is_rejected_for_bi():
    mesh = _tp_mesh(2)
    f = compat.shard_map(lambda x, w: cm.all_gather_matmul(x, w, "tp", 2, "bi"), mesh,
                          in_specs=(P(None, "tp", None), P(None, "tp")),
                          out_specs=P(None, None, "tp"))
    with pytest.raises(ValueError, match="seq_len / tp is odd"):
        jax.jit(f).lower(jnp.zeros((1, 6, 4)), jnp.zeros((4, 4)))


def test_rows_split_over_the_batch_need_own_chunk_first_steps():
    """The ring and the grouped pieces cut the sequence: a batch split is refused there, not
    computed on the wrong rows."""
    from jax_overlap.parallel.collectives import Parallel

    with pytest.raises(ValueError, match="grouped steps at tp = 2"):
        cm.all_gather_matmul(jnp.zeros((2, 4, 4)), jnp.zeros((4, 4)), "tp", 4, "uni", True, 0)
    with pytest.raises(ValueError, match="ring cuts the sequence"):
        Parallel(tp_axis="tp", tp=4, tp_comm="collective_matmul", sp_dim=0)
    Parallel(tp_axis="tp", tp=2, tp_comm="collective_matmul", cm_grouped=True, sp_dim=0)


@pytest.fixture(scope="module")
def reference():
    return gpt_reference()


def _model_matches(reference, overrides, dp=2, tp=4):
    model, params, batch, ref_loss, ref_grads = reference
    cfg = config.load(TINY, [f"mesh.dp={dp}", f"mesh.tp={tp}", *overrides])
    run = assemble(cfg, jax.devices()[: dp * tp], model=model)
    loss, grads = jax.jit(run.loss_and_grads())(run.place_params(params), run.put_batch(batch))
    assert rel(float(loss), ref_loss) <= 1e-5
    assert max_rel_err(grads, ref_grads) <= 1e-5


@pytest.mark.parametrize("tp_comm,direction", [
    ("sequence_parallel", "uni"), ("collective_matmul", "uni"), ("collective_matmul", "bi")])
def test_gpt_matches_reference(reference, tp_comm, direction):
    _model_matches(reference, [f"overlap.tp_comm={tp_comm}",
                               f"overlap.collective_matmul_direction={direction}"])


@pytest.mark.slow
@pytest.mark.parametrize("dp,tp", [(1, 2), (4, 2), (2, 2)])  # tiny has 4 heads: tp <= 4
@pytest.mark.parametrize("direction", ["uni", "bi"])
def test_gpt_matches_reference_other_meshes(reference, dp, tp, direction):
    _model_matches(reference, ["overlap.tp_comm=collective_matmul",
                               f"overlap.collective_matmul_direction={direction}"], dp, tp)


@pytest.mark.slow
@pytest.mark.parametrize("direction", ["uni", "bi"])
def test_gpu_schedule_hides_ring_steps_under_gemms(direction):
    """Deviceless H100: each ring step's transfer has a GEMM under it (sequence parallelism's
    one-shot all-gather / reduce-scatter has almost none). The bidirectional ring needs two
    collectives in flight at once, which XLA allows only when told to."""
    from test_buckets import gpu_report, under_gemm_fraction

    def tp_ops(report):
        return [op for op in report.ops if op.kind == "collective-permute"
                or set(op.replica_groups.mesh_axes) == {"tp"}]

    sp = tp_ops(gpu_report(["overlap.tp_comm=sequence_parallel"]))
    assert under_gemm_fraction(sp) < 0.3  # measured 0.22 (2026-11-29, jax 0.12.0.1)
    overrides = ["overlap.tp_comm=collective_matmul",
                 f"overlap.collective_matmul_direction={direction}"]
    options = ({"xla_gpu_experimental_parallel_collective_overlap_limit": 2}
               if direction == "bi" else None)
    report = gpu_report(overrides, compiler_options=options)
    assert under_gemm_fraction(tp_ops(report)) >= 0.6


@pytest.mark.parametrize("direction", ["uni", "bi"])
def test_ring_steps_are_unrolled(direction):
    """Neither ring (forward or backward) is a loop: as a scan, XLA:GPU copied the carried
    chunk and output buffers at every step (collective_matmul's docstring). Every transfer is
    still its own step: tp - 1 permutes per ring direction and pass."""
    from jax_overlap.analysis.hlo_parse import parse_module
    from jax_overlap.analysis.hlo_report import analyze_hlo

    tp = 4
    (_, ag_ring), (_, rs_ring) = _plain_and_ring(tp, direction)
    b, t, d, n = 2, 8 * tp, 16, 12 * tp
    for f, args in ((ag_ring, (jnp.zeros((b, t, d)), jnp.zeros((d, n)), jnp.zeros((b, t, n)))),
                    (rs_ring, (jnp.zeros((b, t, n)), jnp.zeros((n, d)), jnp.zeros((b, t, d))))):
        text = f.lower(*args).compile().as_text()
        module = parse_module(text)
        assert not any(i.opcode == "while" for c in module.computations.values()
                       for i in c.instructions)
        permutes = [op for op in analyze_hlo(text).ops if op.kind == "collective-permute"]
        # the forward's ring and the backward's (the all-gather's backward re-sends x too,
        # its first transfer shared with the forward's), on each ring direction
        rings = 2 if direction == "bi" else 1
        assert 2 * rings * (tp - 1) <= len(permutes) <= 3 * rings * (tp - 1)


@pytest.mark.slow
def test_gpu_schedule_hides_grouped_steps_at_tp2_in_a_pipeline():
    """Deviceless H100, pp2 x dp2 x tp2: inside the pipeline's stage branches sequence
    parallelism's all-gathers and reduce-scatters have no GEMM beside them; the grouped
    steps (own chunk first at tp = 2) put nearly all of their bytes under one, in the
    backward too, and so does the head's gather."""
    from jax_overlap.analysis import analyze, deviceless

    if not deviceless.plugin_available():
        pytest.skip(deviceless.unavailable_reason() or "no CUDA plugin")

    def tp_share(tp_comm, lone="same"):
        cfg = config.load("configs/default.yaml", ["mesh.pp=2", "mesh.dp=2", "mesh.tp=2",
                                                   f"overlap.tp_comm={tp_comm}",
                                                   f"overlap.lone_tp_comm={lone}"])
        ops = [op for op in analyze.analyze(cfg, "h100").ops
               if set(op.replica_groups.mesh_axes) == {"tp"}
               and op.kind in ("all-gather", "reduce-scatter")]
        return sum(op.bytes_per_step for op in ops if op.under_gemm) / sum(
            op.bytes_per_step for op in ops)

    # measured 0.13 (2026-12-06, jax 0.12.0.1; 0.07 before the head ran in two halves)
    sequence_parallel = tp_share("sequence_parallel")
    assert sequence_parallel < 0.2
    # The ticks that run one action as collective matmul (`overlap.lone_tp_comm`, the plan's
    # pick here): measured 0.29 (2026-12-06)
    assert tp_share("sequence_parallel", "auto") > sequence_parallel + 0.1
    # measured 0.96 (0.73 before the own GEMM's input gradient was summed after a barrier,
    # `collective_matmul._fork`, and the head's gather went under its GEMM)
    assert tp_share("collective_matmul") >= 0.9


@pytest.mark.parametrize("tp_comm", ["sequence_parallel", "collective_matmul"])
def test_column_parallel_parts_is_one_gather_and_a_gemm_per_part(tp_comm):
    """q, k and v (`collectives.column_parallel_parts`): the parts of one column-parallel
    matmul against their concatenated weights, values and gradients. Sequence parallel, the
    input is gathered once and each part is its own GEMM (no output to split); collective
    matmul keeps one ring over the concatenation."""
    from jax_overlap.parallel.collectives import Parallel, column_parallel, column_parallel_parts

    tp, widths = 2, (8, 4, 4)
    par = Parallel(tp_axis="tp", tp=tp, tp_comm=tp_comm, cm_direction="bi")
    mesh = _tp_mesh(tp)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 8, 16)), jnp.float32)
    ws = [jnp.asarray(rng.standard_normal((16, tp * n)), jnp.float32) for n in widths]
    specs = (P(None, "tp", None), [P(None, "tp")] * 3)

    def loss(f):
        g = compat.shard_map(f, mesh, in_specs=specs, out_specs=P())
        return jax.jit(jax.value_and_grad(g, argnums=(0, 1)))

    def score(outs):  # a loss that tells the parts apart
        return jax.lax.psum(sum(jnp.sum(jnp.sin(o) * (i + 1)) for i, o in enumerate(outs)), "tp")

    def parts(x_, ws_):
        return score(column_parallel_parts(x_, ws_, par))

    def concatenated(x_, ws_):
        out = column_parallel(x_, jnp.concatenate(ws_, axis=-1), par)
        return score(jnp.split(out, np.cumsum(widths)[:-1], axis=-1))

    (v1, (dx1, dw1)), (v2, (dx2, dw2)) = loss(parts)(x, ws), loss(concatenated)(x, ws)
    assert rel(float(v1), float(v2)) < 1e-6 and max_rel_err(dx1, dx2) < 1e-5
    assert max(max_rel_err(a, b) for a, b in zip(dw1, dw2)) < 1e-5
    if tp_comm == "sequence_parallel":
        text = str(jax.make_jaxpr(compat.shard_map(
            lambda x_, ws_: column_parallel_parts(x_, ws_, par), mesh, in_specs=specs,
            out_specs=[P(None, None, "tp")] * 3))(x, ws))
        assert text.count("all_gather[") == 1 and text.count("dot_general[") == 3
