"""Gradient buckets: the plan, equality with the reference, and the buckets in compiled HLO."""

import re

import jax
import numpy as np
import pytest
from helpers import TINY, gpt_reference, last_json_line, max_rel_err, rel, run_cli

from jax_overlap import config
from jax_overlap.analysis.hlo_parse import called_computations, parse_module
from jax_overlap.analysis.hlo_report import analyze_hlo
from jax_overlap.overlap import buckets, dp_layout
from jax_overlap.plan import Target
from jax_overlap.training.assemble import assemble, plan_for
from jax_overlap.training import step as steplib
from models.gpt import GPT

# ---------------------------------------------------------------------------------------------
# The plan (pure data)


def _unit(i, nbytes, segment, axes=("dp",), split=None):
    return buckets.Unit(i, f"u{i}", None, (nbytes // 4,), nbytes, axes, segment, split)


def test_pack_follows_backward_order_and_cap():
    # Segments 0 (embedding) .. 3 (head): the backward finishes 3, 2, 1, 0.
    units = [_unit(0, 400, 0), _unit(1, 400, 1), _unit(2, 400, 2), _unit(3, 400, 3)]
    plan = buckets.pack_units(units, cap_bytes=800)
    assert [b.units for b in plan.buckets] == [(3, 2), (1, 0)]
    assert [b.ready_segment for b in plan.buckets] == [2, 0]
    assert [b.nbytes for b in plan.buckets] == [800, 800]
    # cap 0: one collective per unit, head first.
    assert [b.units for b in buckets.pack_units(units, 0).buckets] == [(3,), (2,), (1,), (0,)]


def test_per_segment_packing_and_sub_plans():
    """Per segment (pp = 1, a layer's buckets reduced in the layer scan's body): no bucket
    spans two segments, so every layer is packed alike; `only` keeps some segments' buckets,
    renumbered over their own units."""
    units = [_unit(0, 400, 0), _unit(1, 300, 1), _unit(2, 100, 1), _unit(3, 300, 2),
             _unit(4, 100, 2), _unit(5, 400, 3)]
    mixed = buckets.pack_units(units, cap_bytes=800)
    assert not mixed.per_segment  # (5, 4, 3) spans the head and the last layer
    plan = buckets.pack_units(units, cap_bytes=800, per_segment=True)
    assert plan.per_segment
    assert [b.units for b in plan.buckets] == [(5,), (4, 3), (2, 1), (0,)]
    layers = plan.only([1, 2])
    assert [b.ready_segment for b in layers.buckets] == [2, 1]
    assert [[layers.units[i].leaf for i in b.units] for b in layers.buckets] == [[4, 3], [2, 1]]
    assert [b.index for b in layers.buckets] == [0, 1] and layers.total_bytes == 800
    # largest_first mixes layers on purpose: never per segment.
    assert not buckets.pack_units(units, 800, "largest_first", per_segment=True).per_segment


def test_embedding_units_are_packed_before_the_first_layer():
    # Segments 0 (embedding), 1 (first layer), 2 (last layer), 3 (head). Both 0 and 1 finish
    # at the end of the backward; the embedding's go first so the first layer's weight
    # gradient GEMMs can run under their reduction.
    units = [_unit(0, 400, 0), _unit(1, 400, 1), _unit(2, 400, 2), _unit(3, 400, 3)]
    plan = buckets.pack_units(units, 0, embed_before_first_layer=True)
    assert [b.units for b in plan.buckets] == [(3,), (2,), (0,), (1,)]
    assert [b.ready_segment for b in plan.buckets] == [3, 2, 0, 1]
    # The embedding's units never share a bucket: with the first layer's they would wait for
    # its weight gradients, with a later layer's they would hold its reduction to the end.
    packed = buckets.pack_units(units[:3] + [_unit(3, 200, 3)], 800,
                                embed_before_first_layer=True)
    assert [b.units for b in packed.buckets] == [(3, 2), (0,), (1,)]
    assert [b.ready_segment for b in packed.buckets] == [2, 0, 1]
    assert [b.units for b in buckets.pack_units(units, 800).buckets] == [(3, 2), (1, 0)]


def test_hooks_wrap_buckets_in_reverse_plan_order():
    """A bucket's hook is applied before its segment's forward, and no later than any bucket
    before it in the plan: the backward then reduces the buckets in plan order."""
    import jax.numpy as jnp

    units = [_unit(0, 8, 0), _unit(1, 8, 1), _unit(2, 8, 2), _unit(3, 8, 3)]
    plan = buckets.pack_units(units, 0, embed_before_first_layer=True)
    leaves = [jnp.zeros((2,)) for _ in units]
    sinks = [jnp.zeros((2,)) for _ in plan.buckets]
    hooks = buckets.BucketHooks(plan, leaves, leaves, sinks, {"dp": 1}, (), "fp32")
    # Segment 0 wraps the embedding's bucket (2) and the first layer's (3), which follows it
    # in the plan, last-reduced first; then the last layer's (1) and the head's (0).
    assert [hooks.enter(segment) for segment in range(4)] == [[3, 2], [], [1], [0]]


def test_largest_first_and_reduction_kinds():
    units = [_unit(0, 100, 0), _unit(1, 900, 1), _unit(2, 500, 2), _unit(3, 300, 3, ("dp", "tp"))]
    plan = buckets.pack_units(units, cap_bytes=1000, order="largest_first")
    assert plan.buckets[0].units == (1, 2)  # 900 then 500: closed at 1400
    assert plan.buckets[0].ready_segment == 1  # complete only when layer 1's backward is done
    # Units reduced over other axes never share a bucket.
    assert {b.axes for b in plan.buckets} == {("dp",), ("dp", "tp")}
    assert sorted(i for b in plan.buckets for i in b.units) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="bucket_order"):
        buckets.pack_units(units, 10, order="random")


def test_split_dim_prefers_free_large_dims():
    assert buckets.split_dim((8, 24), (None, None), 8) == 1
    assert buckets.split_dim((32, 3), ("tp", None), 2) == 0  # only divisible dim, tp-split
    assert buckets.split_dim((32, 16), ("tp", None), 2) == 1  # a free dim wins
    assert buckets.split_dim((3, 5), (None, None), 2) is None
    spec = buckets.with_axes(("tp", None), 0, ("dp",), 2)
    assert tuple(spec) == (("tp", "dp"), None)


def test_plan_covers_every_layer_of_the_gpt_once():
    cfg = config.load(TINY, ["overlap.grad_bucket_mb=0.01", "overlap.zero1=true"])
    model = GPT.from_config(cfg.model)
    layout = dp_layout.dp_layout(model, plan_for(cfg).overlap, {"dp": 2, "pp": 1, "tp": 4})
    plan = layout.plan
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    leaves = jax.tree.leaves(abstract)
    blocks = dp_layout.leaf_indices(abstract, "blocks")
    seen = sorted((u.leaf, -1 if u.layer is None else u.layer) for u in plan.units)
    want = sorted((i, layer) for i in range(len(leaves))
                  for layer in (range(cfg.model.layers) if i in blocks else [-1]))
    assert seen == want
    # Bytes per device: TP-split leaves count 1/tp.
    specs = steplib.tree_specs(model.param_axes(), steplib.rules_for(1))
    per_device = sum(4 * int(np.prod(buckets.local_shape(a.shape, tuple(s),
                                                         {"dp": 2, "pp": 1, "tp": 4})))
                     for a, s in zip(leaves, jax.tree.leaves(
                         specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))))
    assert plan.total_bytes == per_device
    assert sum(b.nbytes for b in plan.buckets) == per_device
    # The first bucket completes before the embedding's backward: it can hide under it.
    assert plan.buckets[0].ready_segment > 0


# ---------------------------------------------------------------------------------------------
# Compiled programs


@pytest.fixture(scope="module")
def reference():
    return gpt_reference()


# Three layers: the first runs outside the layer scan (its buckets hooked like the
# embedding's), so the scan's backward body, with a layer's buckets, runs twice.
DEEPER = ["model.layers=3"]


@pytest.fixture(scope="module")
def reference3():
    return gpt_reference(DEEPER)


_COMPILED: dict = {}


def _compile(reference, overrides, dp=2, tp=4, pp=1):
    """Compiled loss-and-grads for these overrides (cached: compiles are the slow part)."""
    key = (tuple(overrides), dp, tp, pp)
    if key not in _COMPILED:
        _COMPILED[key] = _compile_uncached(reference, overrides, dp, tp, pp)
    return _COMPILED[key]


def _compile_uncached(reference, overrides, dp, tp, pp):
    model, params, batch, _, _ = reference
    cfg = config.load(TINY, [f"mesh.dp={dp}", f"mesh.tp={tp}", f"mesh.pp={pp}", *overrides])
    run = assemble(cfg, jax.devices()[: dp * pp * tp], model=model)
    mesh = run.mesh
    args = (run.place_params(params), run.put_batch(batch))
    lowered = jax.jit(run.loss_and_grads()).lower(*args)
    compiled = lowered.compile()
    compiled.lowered_text = lowered.as_text()
    layout = dp_layout.dp_layout(model, run.plan.overlap, dict(mesh.shape))
    return compiled, args, layout, mesh


def dp_collectives(text: str) -> list:
    """All-reduce / reduce-scatter ops over groups that include dp (per the HLO reader)."""
    report = analyze_hlo(text)
    return [op for op in report.ops if op.kind in ("all-reduce", "reduce-scatter")
            and "dp" in op.replica_groups.mesh_axes]


def _gemm_names(module, comp) -> set[str]:
    def has_dot(name, depth=0):
        c = module.computations.get(name)
        return c is not None and depth < 4 and any(
            i.opcode in ("dot", "convolution")
            or any(has_dot(n, depth + 1) for n in called_computations(i).get("calls", []))
            for i in c.instructions)

    return {i.name for i in comp.instructions
            if i.opcode in ("dot", "convolution")
            or (i.opcode == "fusion" and any(has_dot(n) for n in
                                              called_computations(i).get("calls", [])))}


def independent_gemms(text: str, op_name: str, computation: str | None = None) -> int:
    """GEMMs of the computation holding the collective `op_name` (default the entry) that
    neither feed nor wait for it: the work a scheduler may overlap with it."""
    module = parse_module(text)
    entry = module.computations[computation or module.entry]
    by_name = {i.name: i for i in entry.instructions}
    users: dict[str, list[str]] = {}
    for i in entry.instructions:
        for o in i.operands:
            users.setdefault(o, []).append(i.name)

    def closure(start, edges):
        seen, stack = set(), [start]
        while stack:
            for n in edges(stack.pop()):
                if n not in seen:
                    seen.add(n)
                    stack.append(n)
        return seen

    before = closure(op_name, lambda n: [o for o in by_name[n].operands if o in by_name]
                     if n in by_name else [])
    after = closure(op_name, lambda n: users.get(n, []))
    return len(_gemm_names(module, entry) - before - after)


@pytest.mark.parametrize("bucket_mb,embed_first", [(0.004, False), (0.01, False), (1.0, False),
                                                    (0.004, True), (0.01, True)])
def test_buckets_match_reference_and_show_in_hlo(reference3, bucket_mb, embed_first):
    _, _, _, ref_loss, ref_grads = reference3
    options = [f"overlap.grad_bucket_mb={bucket_mb}"] + (
        ["overlap.embed_before_first_layer=true"] if embed_first else [])
    compiled, args, layout, _ = _compile(reference3, DEEPER + options)
    loss, grads = compiled(*args)
    assert rel(float(loss), ref_loss) <= 1e-5
    assert max_rel_err(grads, ref_grads) <= 1e-5

    plan = layout.plan
    ops = dp_collectives(compiled.as_text())
    # One scalar psum over dp besides the buckets: the loss (XLA may fold it into a bucket's
    # all-reduce, so it is counted by bytes; the GPT's loss count is a constant, not a
    # collective). A detached (embedding) bucket has no data path to the first layer's, so
    # the CPU backend's combiner may merge it into one of them (on GPU the preset's 64 MiB
    # threshold keeps the 1.3B model's apart); every other bucket is one collective.
    # A later layer's buckets are reduced in the layer scan's backward body, once per layer
    # (the CPU backend's combiner may merge one layer's: nothing orders them); the
    # embedding's, the first layer's and the head's, chained, outside it.
    big = [op for op in ops if op.bytes > 8]
    layers = max(u.layer for u in plan.units if u.layer is not None) + 1
    in_loop = [op for op in big if op.executions_per_step == layers - 1]
    per_layer = [b for b in plan.buckets if b.ready_segment == 2]
    assert 1 <= len(in_loop) <= len(per_layer)
    assert sum(op.bytes for op in in_loop) == sum(b.nbytes for b in per_layer)
    ends = [b for b in plan.buckets if b.ready_segment in (0, 1, layers + 1)]
    chained = [b for b in ends if not b.detached]
    assert len(chained) <= len(big) - len(in_loop) <= len(ends)
    assert sum(op.bytes * op.executions_per_step for op in ops) == plan.total_bytes + 4
    assert len(plan.buckets) >= (2 if bucket_mb == 1.0 else 3)


@pytest.mark.parametrize("remat,mesh", [("full", (2, 4)), ("save_dots", (8, 1))])
def test_scanned_buckets_under_remat_match_reference(reference3, remat, mesh):
    """The layer scan's body under a checkpoint that never saves the layer's parameters (taken
    from the whole stacks), composed with each recomputing policy: still the reference."""
    _, _, _, ref_loss, ref_grads = reference3
    compiled, args, layout, _ = _compile(reference3, DEEPER + [
        f"model.remat={remat}", "overlap.grad_bucket_mb=0.01", "pipeline.microbatches=2"],
        dp=mesh[0], tp=mesh[1])
    assert layout.plan.per_segment
    loss, grads = compiled(*args)
    assert rel(float(loss), ref_loss) <= 1e-5
    assert max_rel_err(grads, ref_grads) <= 1e-5


def test_first_bucket_is_issued_inside_the_backward(reference3):
    """The first bucket's all-reduce has backward GEMMs that neither feed nor wait for it;
    the baseline's reductions wait for the whole backward."""
    compiled, _, layout, _ = _compile(reference3, DEEPER + ["overlap.grad_bucket_mb=0.004"])
    text = compiled.as_text()
    ops = [op for op in dp_collectives(text) if op.bytes > 8]
    layers = max(u.layer for u in layout.plan.units if u.layer is not None) + 1
    # A layer's buckets: in the layer scan's backward body, once per layer, beside the
    # input-gradient GEMMs of that layer (which neither feed nor wait for them), but for the
    # last one, whose gradients (the layer's first-used norm) need the whole layer's backward:
    # XLA:GPU pipelines that one under the next layer's (`test_gpu_schedule_hides_...`).
    in_loop = [op for op in ops if op.executions_per_step == layers - 1]
    per_layer = [b for b in layout.plan.buckets if b.ready_segment == 2]
    assert sum(op.bytes for op in in_loop) == sum(b.nbytes for b in per_layer)
    free = [independent_gemms(text, op.name, op.computation) > 0 for op in in_loop]
    assert sum(free) >= len(in_loop) - 1 >= 0 and any(free)

    compiled, _, _, _ = _compile(reference3, DEEPER)
    text = compiled.as_text()
    for op in dp_collectives(text):
        if op.bytes > 8:
            assert independent_gemms(text, op.name) == 0


def test_zero1_largest_first_sequence_parallel(reference):
    """ZeRO-1 scatters each bucket: every rank keeps 1/dp (1/(dp*tp) for TP-replicated
    leaves) of the gradient, laid out as the optimizer state's sharding says."""
    _, _, _, ref_loss, ref_grads = reference
    compiled, args, layout, mesh = _compile(reference, [
        "overlap.grad_bucket_mb=0.01", "overlap.zero1=true", "overlap.bucket_order=largest_first",
        "overlap.tp_comm=sequence_parallel"])
    loss, grads = compiled(*args)
    assert rel(float(loss), ref_loss) <= 1e-5
    assert max_rel_err(grads, ref_grads) <= 1e-5
    wte = grads["embed"]["wte"]
    assert wte.sharding.spec == jax.sharding.PartitionSpec("tp", "dp")
    assert wte.addressable_shards[0].data.shape == (256 // 4, 32 // 2)
    assert grads["blocks"]["ln_attn"]["scale"].sharding.spec == jax.sharding.PartitionSpec(
        None, ("dp", "tp"))
    ops = dp_collectives(compiled.as_text())
    assert len([op for op in ops if op.kind == "reduce-scatter"]) == len(layout.plan.buckets)


def test_zero1_without_buckets(reference):
    _, _, _, ref_loss, ref_grads = reference
    compiled, args, _, _ = _compile(reference, ["overlap.zero1=true"], dp=8, tp=1)
    loss, grads = compiled(*args)
    assert rel(float(loss), ref_loss) <= 1e-5
    assert max_rel_err(grads, ref_grads) <= 1e-5
    assert grads["blocks"]["w_in"].addressable_shards[0].data.shape[1:] == (32 // 8, 64)


@pytest.mark.parametrize("overrides", [[], ["overlap.grad_bucket_mb=0.004"]])
def test_tp1_step_has_dp_reductions_only(reference, overrides):
    """dp=8, tp=1: no one-rank TP all-reduces (the size-1 tp axis is left out of the
    specs), and no all-reduce of the (constant) loss count: only the gradient reductions,
    with the loss folded into one of them."""
    _, _, _, ref_loss, ref_grads = reference
    compiled, args, layout, _ = _compile(reference, overrides, dp=8, tp=1)
    loss, grads = compiled(*args)
    assert rel(float(loss), ref_loss) <= 1e-5
    assert max_rel_err(grads, ref_grads) <= 1e-5
    report = analyze_hlo(compiled.as_text())
    ops = [op for op in report.ops if op.kind in ("all-reduce", "reduce-scatter")]
    assert ops and all("dp" in op.replica_groups.mesh_axes for op in ops)
    grad_bytes = layout.plan.total_bytes if layout.plan else 4 * sum(
        g.size for g in jax.tree.leaves(ref_grads))
    assert sum(op.bytes * op.executions_per_step for op in ops) == grad_bytes + 4  # + the loss


def test_buckets_and_bf16_with_the_pipeline(reference):
    """pp=2 (1F1B): with buckets the executor reduces each chunk's block gradients over dp in
    its last backward, inside the tick loop, optionally in bf16 (embedding and head after
    the loop, with `reduce_gradients`)."""
    from jax_overlap.pipeline import layout as staging

    _, _, _, ref_loss, ref_grads = reference
    for options, bound in ((["overlap.grad_bucket_mb=0.004"], 1e-5),
                           (["overlap.grad_bucket_mb=0.004", "overlap.grad_comm_dtype=bf16"],
                            2 * 2.0 ** -8)):
        compiled, args, _, _ = _compile(reference, options, dp=2, tp=2, pp=2)
        loss, grads = compiled(*args)
        perm = plan_for(config.load(TINY, ["mesh.pp=2"])).layer_perm
        assert rel(float(loss), ref_loss) <= 1e-5
        assert max_rel_err(staging.to_logical(grads, perm), ref_grads) <= bound


def test_bf16_reduction_error_is_bounded(reference):
    """bf16 on the wire, fp32 accumulation: each of the dp addends is rounded once to bf16
    (relative error <= 2^-9) and every partial sum once more, so an element's error is at
    most about (2 dp - 1) * 2^-9 * sum|g_i|; relative to a leaf's largest gradient that is
    below dp * 2^-8 (the gradients of one leaf have one scale). Measured: ~4e-3 at dp=2."""
    _, _, _, ref_loss, ref_grads = reference
    compiled, args, layout, _ = _compile(reference, ["overlap.grad_bucket_mb=0.01",
                                                     "overlap.grad_comm_dtype=bf16"])
    loss, grads = compiled(*args)
    err = max_rel_err(grads, ref_grads)
    assert rel(float(loss), ref_loss) <= 1e-5  # the loss is not communicated in bf16
    assert 1e-5 < err <= 2 * 2.0 ** -8, err
    # Each bucket's all-reduce is emitted on bf16 (half the bytes on a GPU's wire; the CPU
    # backend upcasts it to f32 after the rounding, so the numbers above are the bf16 ones).
    emitted = re.findall(r'"?stablehlo\.all_reduce"?.*?:\s*\(tensor<(\d+)x(bf16|f32)>\)',
                         compiled.lowered_text, flags=re.S)
    bf16_sizes = sorted(int(n) for n, dtype in emitted if dtype == "bf16")
    # (one op per bucket of a layer, in the layer scan's backward body: layer 1's stand for
    # the scan's; layer 0 runs outside it)
    layers = max(u.layer for u in layout.plan.units if u.layer is not None) + 1
    assert bf16_sizes == sorted(b.nbytes // 4 for b in layout.plan.buckets
                                if b.ready_segment in (0, 1, 2, layers + 1))


@pytest.mark.slow
@pytest.mark.parametrize("dp,tp", [(8, 1), (4, 2), (2, 4)])
@pytest.mark.parametrize("options", [
    ["overlap.grad_bucket_mb=0.002"],
    ["overlap.grad_bucket_mb=0.002", "overlap.bucket_order=largest_first"],
    ["overlap.grad_bucket_mb=0.002", "overlap.zero1=true", "pipeline.microbatches=2"],
    ["overlap.grad_bucket_mb=0.05", "overlap.zero1=true", "overlap.tp_comm=collective_matmul",
     "overlap.collective_matmul_direction=bi"],
])
def test_bucket_sweep(reference, dp, tp, options):
    _, _, _, ref_loss, ref_grads = reference
    compiled, args, _, _ = _compile(reference, options, dp=dp, tp=tp)
    loss, grads = compiled(*args)
    assert rel(float(loss), ref_loss) <= 1e-5
    assert max_rel_err(grads, ref_grads) <= 1e-5


def gpu_report(overrides: list[str], config_path: str = "configs/default.yaml",
               compiler_options: dict | None = None):
    """HLO report of loss-and-grads compiled deviceless for 8 H100s (skips without the
    CUDA plugin): the GPU latency-hiding schedule the CPU backend cannot show."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_overlap.analysis import deviceless

    if not deviceless.plugin_available():
        pytest.skip(deviceless.unavailable_reason() or "no CUDA plugin")
    cfg = config.load(config_path, overrides)
    model = GPT.from_config(cfg.model)
    planned = assemble(cfg, target=Target(), model=model)  # the CPU plan, compiled for H100s

    def build(devices):
        run = planned.on(devices)
        mesh = run.mesh
        params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              jax.eval_shape(model.init, jax.random.key(0)),
                              run.param_shardings())
        tokens = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.model.seq_len), jnp.int32,
                                      sharding=NamedSharding(mesh, P("dp")))
        return jax.jit(run.loss_and_grads()).lower(params, {"inputs": tokens, "targets": tokens})

    text = deviceless.compile_for("h100", cfg.num_devices, build,
                                  compiler_options=compiler_options)
    return analyze_hlo(text, target="h100")


def under_gemm_fraction(ops) -> float:
    total = sum(op.bytes_per_step for op in ops)
    return sum(op.bytes_per_step for op in ops if op.under_gemm) / total


@pytest.mark.slow
def test_gpu_schedule_hides_buckets_under_backward_gemms():
    """Deviceless H100, as `jax-overlap analyze --target h100` compiles the default config at
    dp8 (the GPU plan and its XLA preset, whose pipelined all-reduce moves a layer's buckets,
    in the layer scan's backward body, under the next layer's backward): without buckets the
    one (combined) gradient all-reduce waits for the whole backward; 0.05 MB buckets are
    async and mostly have backward GEMMs under them.

    At the config's own dp2 x tp4 the same buckets share the layer body with collective
    matmul's ring steps: 0.84 of their bytes under GEMMs with the steps a scan, 0.33 since
    they are unrolled (2026-12-06; the step is shorter, 10.7 -> 7.4 ms estimated, and 0.1 ms
    is exposed either way; GPT-1.3B dp2 x tp4 at full size: 0.91 -> 0.87, docs/results.md)."""
    def dp_ops(overrides):
        proc = run_cli("analyze", "--config", "configs/default.yaml", "--target", "h100",
                       "--json", "--set", "mesh.dp=8", "--set", "mesh.tp=1",
                       *[a for o in overrides for a in ("--set", o)], timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return [op for op in last_json_line(proc.stdout)["ops"]
                if "dp" in op["mesh_axes"] and op["bytes"] > 8]

    def under_gemm(ops):
        return (sum(o["bytes"] * o["executions_per_step"] for o in ops if o["gemms_between"])
                / sum(o["bytes"] * o["executions_per_step"] for o in ops))

    assert under_gemm(dp_ops(["overlap.grad_bucket_mb=0"])) == 0.0
    ops = dp_ops(["overlap.grad_bucket_mb=0.05"])
    assert sum(o["executions_per_step"] for o in ops) >= 8 and all(o["async"] for o in ops)
    assert any(o["executions_per_step"] > 1 for o in ops)  # a layer's, in the scan's body
    # measured 0.71 at dp8 (2026-12-06, jax 0.12.0.1; 0.84 at dp2 x tp4 with the ring steps a
    # scan, 2026-12-04). The CPU plan compiled for H100s: 0.08 without the preset (a layer's
    # buckets end the scan body with nothing under them), 0.23 with only its pipelined
    # all-reduce.
    assert under_gemm(ops) >= 0.6


def test_zero1_state_shardings_with_pipeline():
    """With pp > 1 the executor reduces whole gradients; ZeRO-1 still stores the optimizer
    state split over dp (GSPMD slices the gradient for the update)."""
    cfg = config.load(TINY, ["mesh.pp=2", "mesh.dp=2", "mesh.tp=2", "overlap.zero1=true"])
    sh = assemble(cfg, jax.devices()[:8], model=GPT.from_config(cfg.model)).state_shardings()
    adam = sh.opt_state[1][0]
    assert sh.params["blocks"]["w_in"].spec == jax.sharding.PartitionSpec("pp", None, "tp")
    assert adam.mu["blocks"]["w_in"].spec == jax.sharding.PartitionSpec("pp", "dp", "tp")
    assert adam.nu["embed"]["wte"].spec == jax.sharding.PartitionSpec("tp", "dp")
