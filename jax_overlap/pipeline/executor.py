"""Pipeline executor: runs any schedule table, tick by tick, inside one `shard_map`.

A schedule (`jax_overlap.pipeline.table`) says which action each stage runs at each tick.
`compile_program` turns it into small int tables -- per tick, per stage: which branch
(idle, or F/B/W of the first / a middle / the last virtual stage), microbatch, chunk, which
stash slots the action reads, and which slots this tick's arrivals are filed into. The
executor is a `lax.scan` over ticks; each stage reads its row with `axis_index('pp')` and
`lax.switch`es to that one action, so a tick costs only the work it executes.

Three modules: `actions` builds what a stage runs in a tick (F, B, W of a virtual stage,
as `lax.switch` branches over the stage's stash), `tick_loop` runs the table (the scans,
the ring transfers, the vocabulary-parallel head phase), and this one assembles the
per-device step around them: the stage's blocks, the residual pools, the loop, and the
gradients' reduction after it.

Stash: per stage a pool of activation-sized slots. A received activation is a virtual stage's
*input*; it stays in its slot until the last backward action of that (microbatch, chunk) (B,
or W when the backward is split). Likewise a received output gradient stays until B (split:
W). Slots are assigned statically from the table's lifetimes, so a stage holds `peak live
(microbatch, chunk) tensors` slots, not `microbatches x chunks`.

The embedding and head gradients are summed over 'pp' at the end (with tied embeddings the
head's use of `wte` and the embedding's add up there), then the gradients go through the
explicit DP reduction of `buckets`. Where the last tick runs only stage 0's last backward (a
paired 1F1B with in-loop buckets, on an accelerator: `DeferredEmbedding`), it runs after the
loop with that sum of the earlier ticks' gradients in flight under it, and its own
embedding's gradient is pulled back after it from the gathered activation gradients.

DP reduction of the blocks, by `overlap`:
  no buckets           after the loop, one collective per leaf.
  grad_bucket_mb > 0   inside the loop: the action that completes a chunk's weight gradients
                       on its stage (the chunk's last B, or W when split; `Branch.sync`) runs
                       the chunk's layers unrolled with a bucket hook per bucket, so each
                       bucket's psum (this microbatch's gradients plus the accumulated ones)
                       is issued as its layers finish and runs under the chunk's earlier
                       layers' backward -- in the cool-down, while other stages still work.
                       The reduced gradients are kept apart from the per-replica
                       accumulators (a psum result is typed dp-invariant): one more copy of
                       the stage's block gradients for the step.
  param_sharding fsdp  the stage's blocks are all-gathered over dp once per step and their
                       gradients reduce-scattered once after the loop (every tick uses them;
                       gathering per tick would move them `ticks` times). `overlap.window`
                       applies to pp = 1 only.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from functools import partial
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_overlap.model_api import batch_shapes
from jax_overlap.overlap import buckets, fsdp, slow_axis
from jax_overlap.parallel.collectives import Parallel
from jax_overlap.parallel.compat import shard_map
from jax_overlap.parallel.compat import varying_axes as _varying_axes
from jax_overlap.parallel.compute_cast import cast_leaves, cast_on_use
from jax_overlap.parallel.mesh import DCN, DP, PP, data_axes, data_spec, microbatched
from jax_overlap.pipeline import residuals, weight_grads
from jax_overlap.pipeline.actions import (ChunkSplit, StagePieces, StepContext, action_branch,
                                          chunk_validity, idle_branch, split_action_branch,
                                          stack_layers, stage_pieces, sync_branch)
from jax_overlap.pipeline.program import TickProgram
from jax_overlap.pipeline.residuals import vjp_with_layout
from jax_overlap.pipeline.slots import vary
from jax_overlap.pipeline.tick_loop import DeferredEmbedding, deferred_embedding, run_ticks

_log = logging.getLogger("jax_overlap")


def _summed_slow(x) -> set[str]:
    """{'dcn'} when the in-loop buckets also sum over it (see `overlap.slow_axis`)."""
    return {DCN} if slow_axis.crosses_dcn(x) else set()


def _gather_stage_blocks(blocks, fsdp_layout, dp: int):
    """FSDP storage -> this stage's whole (tp-local) block leaves: `fsdp.gather_layer` for
    every layer of the stage at once (one all-gather per gradient group)."""
    leaves, treedef = jax.tree.flatten(blocks)
    full = jax.vmap(lambda shards: fsdp.gather_layer(shards, fsdp_layout, DP, dp))(leaves)
    return jax.tree.unflatten(treedef, full)


def _scatter_stage_grads(grads, fsdp_layout, dp: int, comm_dtype: str):
    """Block gradients -> each rank's FSDP shard, summed over dp (`fsdp.reduce_scatter_layer`
    for every layer at once); None for leaves stored whole (their psum goes with the
    embedding's and head's buckets: a psum here would be typed dp-varying, as a parameter's
    cotangent, not as the replicated gradient the step returns)."""
    split_only = dataclasses.replace(
        fsdp_layout, groups=tuple(g for g in fsdp_layout.groups if g[1]))
    leaves, treedef = jax.tree.flatten(grads)
    out = jax.vmap(lambda g: fsdp.reduce_scatter_layer(g, split_only, DP, dp, comm_dtype))(
        leaves)
    return jax.tree.unflatten(treedef, out)


def reduce_step_grads(grads: dict, overlap, fsdp_layout, dp: int, synced: bool,
                      own_rows: frozenset[str] = frozenset(), ends: dict | None = None
                      ) -> dict:
    """The step's gradients after the tick loop, reduced over pp and dp.

    Blocks stay on their stage; embedding and head gradients are summed over pp (which also
    adds the tied embedding's two uses). Over dp: in-loop buckets already reduced the blocks
    (`synced`; without a slow axis the embedding and head then go in one fp32 all-reduce
    each over (pp, dp): nothing is left to hide them under, and one collective's latency is
    less than two in a row), fsdp reduce-scatters them, otherwise every leaf goes through
    `buckets.reduce_gradients`, but the `own_rows` leaves (`DpLayout.own_rows`: stored split
    over dp, their gradients already summed where their rows are shared). `ends`: the
    embedding's and head's gradients already reduced over (pp, dp)
    (`tick_loop._TickLoop.last_tick`).
    """
    # Each stage holds its own layers' gradients: nothing to combine over pp.
    blocks = jax.tree.map(lambda g: g.reshape(-1, *g.shape[2:]),
                          grads["synced"] if synced else grads["blocks"])
    if ends is not None:
        return {"blocks": blocks, **ends}
    # Embedding / head gradients live on the stages that ran virtual stage 0 / the last;
    # zeros elsewhere. Summing over pp gathers them (and adds tied wte's two uses).
    ends = {k: grads[k] for k in ("embed", "head")}
    bucket_bytes, comm_dtype = overlap.grad_bucket_bytes, overlap.grad_comm_dtype
    slow = any(DCN in _varying_axes(g) for g in jax.tree.leaves(ends))  # dcn: slow_axis
    if synced and comm_dtype == "fp32" and not slow:
        return {"blocks": blocks, **jax.tree.map(  # (param shape) per device, over (pp, dp)
            lambda g: jax.lax.psum(g, (PP, DP)), ends)}
    ends = jax.tree.map(lambda g: jax.lax.psum(g, PP), ends)  # (param shape), over pp
    if synced:
        return {"blocks": blocks, **buckets.reduce_gradients(ends, bucket_bytes, comm_dtype, DP)}
    grads = {"blocks": blocks, **ends}
    if fsdp_layout is None:
        return buckets.reduce_gradients(grads, bucket_bytes, comm_dtype, DP, own=own_rows)
    scattered = _scatter_stage_grads(grads["blocks"], fsdp_layout, dp, comm_dtype)
    # Leaves stored whole (no dim divisible by dp) are psum'd with the embedding and head.
    grads["blocks"] = jax.tree.map(lambda g, sc: g if sc is None else None, grads["blocks"],
                                   scattered, is_leaf=lambda x: x is None)
    reduced = buckets.reduce_gradients(grads, bucket_bytes, comm_dtype, DP, own=own_rows)
    reduced["blocks"] = jax.tree.map(lambda r, sc: r if sc is None else sc, reduced["blocks"],
                                     scattered, is_leaf=lambda x: x is None)
    return reduced


def _prologue(params, batch, model, program: TickProgram, axis_sizes, fsdp_layout):
    """The step's per-device starting values: (params marked (dp, pp)-varying with fsdp
    blocks gathered, the stage's blocks as (chunks, layers, ...), microbatches, loss count)."""
    s = program.schedule
    v = s.virtual_stages
    # Global divisor first, so every microbatch's loss is already scaled to the global mean.
    data = data_axes(axis_sizes)  # (dcn, dp) with a slow axis, else (dp,)
    count = jax.lax.psum(model.loss_count(batch["targets"]), data)  # () per device, over data
    # Per-replica, per-stage values: autodiff must not reduce over dp or pp behind our back.
    params = jax.tree.map(lambda x: vary(x, (*data, PP)), params)
    if fsdp_layout is not None:
        # FSDP under a pipeline: every tick of the step uses the stage's blocks, so they are
        # gathered once per step (not per tick: that would move them `ticks` times) and the
        # gradients are reduce-scattered once at the end. Storage and optimizer state stay
        # split over dp; the gathered copy lives for the step.
        params = {**params, "blocks": _gather_stage_blocks(params["blocks"], fsdp_layout,
                                                           axis_sizes[DP])}
    blocks_vn = jax.tree.map(lambda w: w.reshape(v, w.shape[0] // v, *w.shape[1:]),
                             params["blocks"])
    mbs = microbatched(batch, s.microbatches)
    return params, blocks_vn, mbs, count


def _compute_blocks(model, par: Parallel, blocks_vn, x_btd):
    """The stage's blocks as the actions read them: every leaf the block only reads in the
    compute dtype cast to it once per step, not once per layer per action
    (`parallel.compute_cast`; the same numbers). The stored blocks stay what gradients
    accumulate against and what the sync actions' bucket hooks take."""
    dtype = par.compute_dtype
    if dtype == jnp.float32:
        return blocks_vn
    layer = jax.tree.map(lambda w: w[0, 0], blocks_vn)
    mask = cast_on_use(lambda p, x: model.block(p, x, par), layer, x_btd, dtype=dtype)
    return cast_leaves(blocks_vn, mask, dtype)


def residual_bytes(model, plan, mesh) -> dict[str, int]:
    """Bytes per device of each residual pool the step's stash holds ("chunk", "first",
    "last": slots x one slot), and "slot" (one microbatch's chunk residuals), traced without
    running anything."""
    program = plan.program
    found = {}

    def probe(params, batch):
        params, blocks_vn, mbs, count = _prologue(params, batch, model, program,
                                                  dict(mesh.shape), plan.layout.fsdp)
        par = plan.parallel()
        blocks_vn = _compute_blocks(model, par, blocks_vn,
                                    model.embed(params["embed"], mbs["inputs"][0], par))
        pieces = stage_pieces(model, par, count, plan.remat, program)
        valid_vn = _stage_validity(plan.stage_layers, program)
        pools = _residual_pools(pieces, params, blocks_vn, mbs, program, valid_vn).pools
        found.update({k: sum(a.size * a.dtype.itemsize for a in v) for k, v in pools.items()})
        found["slot"] = found["chunk"] // program.residual_slots("chunk")
        return count

    abstract = jax.eval_shape(model.init, jax.random.key(0))
    b = plan.micro_batch * plan.microbatches * plan.dp * plan.dcn
    batch = {k: jax.ShapeDtypeStruct(shape, dtype)
             for k, (shape, dtype) in batch_shapes(model, b, model.seq_len).items()}
    mapped = shard_map(probe, mesh, in_specs=(plan.layout.param_specs,
                                              {k: data_spec(dict(mesh.shape)) for k in batch}),
                       out_specs=P())
    jax.eval_shape(mapped, abstract, batch)
    return found


class Residuals(NamedTuple):
    """The residual layouts and empty pools of a step (see `_residual_pools`)."""

    layouts: dict
    pools: dict
    chunk_split: Any = None
    z0: Any = None


def _stage_validity(stage_layers, program: TickProgram):
    """This stage's (chunks, padded layers) validity (`chunk_validity`), or None if even."""
    s = program.schedule
    if not stage_layers:
        return None
    mask = chunk_validity(stage_layers, s.placement, s.stages, s.virtual_stages)
    if mask is None:
        return None
    return jnp.asarray(mask)[jax.lax.axis_index(PP)]  # (chunks, layers) per device, over pp


def _chunk_split(pieces: StagePieces, w_chunk, x, program: TickProgram):
    """The chunk's `ChunkSplit` for a split-backward schedule, or None (with a one-line notice
    when the block cannot be split: W then runs the whole backward)."""
    if not program.schedule.split_backward:
        return None
    layer = jax.tree.map(lambda b: b[0], w_chunk)
    split, why = weight_grads.split_block(pieces.block, layer, x)
    if split is None:
        _log.warning("pipeline: W runs the whole chunk backward: %s", why)
        return None
    z_layer = [vary(jnp.zeros(shape, dtype), axes) for shape, dtype, axes in split.z_avals]
    _, acts = split.forward(layer, x, z_layer)  # a probe: dead code after tracing
    act_avals = tuple((tuple(a.shape), a.dtype, tuple(sorted(_varying_axes(a))))
                      for a in acts)
    return ChunkSplit(split, jax.tree.structure(layer), len(jax.tree.leaves(layer)), act_avals)


def _residual_pools(pieces: StagePieces, params, blocks_vn, mbs, program: TickProgram,
                    valid_vn=None, split_backward: bool = True):
    """The residual layouts of the embedding, chunk and head vjps (traced once on the first
    microbatch and chunk; the probe is dead code after tracing) and their empty slot pools."""
    w_chunk = jax.tree.map(lambda b: b[0], blocks_vn)
    valid = None if valid_vn is None else valid_vn[0]
    ids, targets = mbs["inputs"][0], mbs["targets"][0]
    x, _, embed_layout, _ = vjp_with_layout(lambda we: pieces.embed(we, ids),
                                            (params["embed"],), (params["embed"],))
    cs = _chunk_split(pieces, w_chunk, x, program) if split_backward else None
    n_chunk = program.residual_slots("chunk") + 1  # + a trash slot (see `tick_loop.run_ticks`)
    z0 = extra = None
    if cs is None:
        w_layers = pieces.chunk_weights(w_chunk)
        y, _, chunk_layout, _ = vjp_with_layout(lambda w_, x_: pieces.chunk(w_, x_, valid),
                                                (w_layers, x), (w_layers, x))
        chunk_pool = residuals.empty_pool(chunk_layout, n_chunk)
    else:
        z0 = cs.zero_addends(jax.tree.leaves(w_chunk)[0].shape[0])
        w_dot, w_other = cs.layer_parts(w_chunk)
        run = cs.forward(pieces.remat)
        (y, acts), _, chunk_layout, _ = vjp_with_layout(
            lambda x_, z_, wo_: run(x_, z_, wo_, w_dot, valid), (x, z0, w_other),
            (w_dot, w_other, x, z0), has_aux=True)
        chunk_pool = residuals.empty_pool(chunk_layout, n_chunk) + [
            vary(jnp.zeros((n_chunk, *a.shape), a.dtype), sorted(_varying_axes(a)))
            for a in jax.tree.leaves(acts)]
        extra = [vary(jnp.zeros((program.residual_slots("dz") + 1, *z.shape), z.dtype),
                       sorted(_varying_axes(z))) for z in stack_layers(z0)]
    layouts = {"embed": embed_layout, "chunk": chunk_layout}
    n_first = program.residual_slots("first") + 1
    first = residuals.empty_pool(embed_layout, n_first)
    first.append(vary(jnp.zeros((n_first, *x.shape), x.dtype), sorted(_varying_axes(x))))
    pools = {"first": first, "chunk": chunk_pool}
    if not program.vocab_parallel:  # else the head phase pulls back at once: nothing kept
        # An F branch indexes the targets by a stage-dependent microbatch: varying over pp.
        targets = vary(targets, [PP])
        _, _, layouts["head"], _ = vjp_with_layout(
            lambda we, wh, y_: pieces.head(we, wh, y_, targets),
            (params["embed"], params["head"], y), (params["embed"], params["head"]))
        pools["last"] = [vary(p, [PP]) for p in residuals.empty_pool(
            layouts["head"], program.residual_slots("last") + 1)]
    if extra is not None:
        pools["dz"] = extra
    return Residuals(layouts, pools, cs, z0)


def _per_device(params, batch, *, model, program: TickProgram, par: Parallel, overlap,
                axis_sizes: dict[str, int], fsdp_layout=None, chunk_buckets=None,
                remat: str = "none", stage_layers=(), split_backward: bool = True,
                accelerator: bool = True, own_rows: frozenset[str] = frozenset()):
    """One device's loss and gradients for a whole step; see the module docstring."""
    s = program.schedule
    embed_in = params["embed"]
    params, blocks_vn, mbs, count = _prologue(params, batch, model, program, axis_sizes,
                                              fsdp_layout)

    # What travels between stages: one microbatch's activations (shape, dtype and varying
    # axes as the embedding produces them; the probe is dead code after tracing).
    probe_btd = model.embed(params["embed"], mbs["inputs"][0], par)
    data = data_axes(axis_sizes)
    act_axes = sorted(_varying_axes(probe_btd) | {*data, PP})
    zeros_btd = vary(jnp.zeros(probe_btd.shape, probe_btd.dtype), act_axes)
    pool_sbtd = vary(jnp.zeros((program.slots + 1, *probe_btd.shape), probe_btd.dtype),
                      act_axes)
    grads0 = {"embed": jax.tree.map(jnp.zeros_like, params["embed"]),
              "blocks": jax.tree.map(jnp.zeros_like, blocks_vn),
              "head": jax.tree.map(jnp.zeros_like, params["head"])}
    synced = any(b.sync for b in program.branches)
    tp_share = None
    if synced:
        # Block gradients reduced over dp inside the loop land here: typed without dp (a
        # psum result), so they are kept apart from the per-replica accumulators.
        grads0["synced"] = jax.tree.map(
            lambda b: vary(jnp.zeros(b.shape, jnp.float32),
                            sorted(set(_varying_axes(b)) - {DP} - _summed_slow(b))),
            blocks_vn)
        tp_share = {u.leaf: math.prod(axis_sizes[a] for a in u.axes if a != DP)
                    for u in chunk_buckets.units}
    pieces = stage_pieces(model, par, count, remat, program)
    valid_vn = _stage_validity(stage_layers, program)
    stored_vn, blocks_vn = blocks_vn, _compute_blocks(model, par, blocks_vn, probe_btd)
    found = _residual_pools(pieces, params, blocks_vn, mbs, program, valid_vn, split_backward)
    ctx = StepContext(model=model, par=par, params=params, blocks_vn=blocks_vn,
                      stored_vn=stored_vn,
                      ids_mbt=mbs["inputs"], targets_mbt=mbs["targets"], count=count,
                      zeros_btd=zeros_btd, grads0=grads0,
                      loss0=vary(jnp.zeros((), jnp.float32), (*data, PP)),
                      split=s.split_backward, pieces=pieces, layouts=found.layouts,
                      overlap=overlap, axis_sizes=axis_sizes, chunk_buckets=chunk_buckets,
                      tp_share=tp_share, chunk_split=found.chunk_split, z0=found.z0,
                      valid_vn=valid_vn)
    branches = _branches(ctx, program)
    lone = _lone_context(ctx, program, mbs, split_backward)
    lone_branches = None if lone is None else _branches(lone, program)
    deferred = None
    last = deferred_embedding(model, program, accelerator, synced, overlap, axis_sizes)
    if last is not None:
        b, mb = last
        deferred = DeferredEmbedding(
            [*branches[:b], sync_branch(ctx, "B", "first", defer_embed=True), *branches[b + 1:]],
            mb, embed_in)
    grads, loss, ends = run_ticks(ctx, program, branches, pool_sbtd, found.pools, accelerator,
                                  deferred, lone_branches)
    loss = jax.lax.psum(loss, (*data, PP))  # () per device, over (dcn,) dp and pp
    return loss, reduce_step_grads(grads, overlap, fsdp_layout, axis_sizes[DP], synced,
                                   own_rows, ends)


def _branches(ctx: StepContext, program: TickProgram) -> list:
    """The switch branches of `program`'s actions under `ctx`, idle first."""
    if ctx.chunk_split is not None:
        branches = [split_action_branch(ctx, b.kind, b.role, b.sync) for b in program.branches]
    else:
        branches = [sync_branch(ctx, b.kind, b.role) if b.sync else
                    action_branch(ctx, b.kind, b.role) for b in program.branches]
    return [idle_branch(ctx)] + branches


def _lone_context(ctx: StepContext, program: TickProgram, mbs, split_backward: bool
                  ) -> StepContext | None:
    """The context a fused program's lone actions run in (`overlap.lone_tp_comm`): collective
    matmul where the pairs run sequence parallelism, so a tick with one action still has its
    TP collectives under GEMMs. None where the plan keeps one context, or (with a warning)
    where collective matmul's residuals are not laid out as sequence parallelism's: an F
    and its B may run in different kinds of tick, so they must stash the same residuals
    (under full remat, the layers' inputs)."""
    par = ctx.par
    if ctx.overlap.lone_tp_comm != "collective_matmul" or not program.fused:
        return None
    lone_par = dataclasses.replace(par, tp_comm="collective_matmul", cm_grouped=True)
    pieces = stage_pieces(ctx.model, lone_par, ctx.count, ctx.pieces.remat, program)
    found = _residual_pools(pieces, ctx.params, ctx.blocks_vn, mbs, program, ctx.valid_vn,
                            split_backward)
    if any((found.layouts[k].kinds, found.layouts[k].avals)
           != (ctx.layouts[k].kinds, ctx.layouts[k].avals) for k in ctx.layouts):
        _log.warning("pipeline: lone actions keep %s: collective matmul stashes other "
                     "residuals under remat %s", par.tp_comm, ctx.pieces.remat)
        return None
    return dataclasses.replace(ctx, par=lone_par, pieces=pieces, layouts=found.layouts,
                               chunk_split=found.chunk_split)


def make_pipeline_loss_and_grads(model, plan, mesh) -> Callable:
    """(params, batch) -> (mean loss, grads) for pp > 1, as one `shard_map` over the mesh.

    Args:
      model: a `StagedModel`.
      plan: the run's `ParallelPlan` (built with `model`): its tick program, DP layout, chunk
        bucket plan, overlap choices and TP context. Benchmarks run hand-made tables through
        `plan.with_program(...)`; only a program compiled from a valid schedule computes
        gradients.
      mesh: the (dp, pp, tp) mesh.

    Returns:
      A function with the same contract as `grads.make_loss_and_grads`: params in the staged
      layout (`jax_overlap.pipeline.layout`) sharded as `step.param_shardings(..., plan.layout)`,
      batch split over dp; returns the replicated mean loss and the gradients laid out as the
      params. Its `program` attribute is the `TickProgram` run.
    """
    program = plan.program
    if program.schedule.stages != mesh.shape[PP]:
        raise ValueError(f"mesh.pp: the mesh has {mesh.shape[PP]} stages, the schedule "
                         f"{program.schedule.stages}")
    param_specs = plan.layout.param_specs  # 'blocks' also split over dp under fsdp
    body = partial(_per_device, model=model, program=program, par=plan.parallel(),
                   overlap=plan.overlap, axis_sizes=dict(mesh.shape),
                   fsdp_layout=plan.layout.fsdp, chunk_buckets=plan.chunk_buckets,
                   remat=plan.remat, stage_layers=plan.stage_layers,
                   split_backward=plan.split_backward,
                   accelerator=bool(plan.target is not None and plan.target.accelerator),
                   own_rows=plan.layout.own_rows)
    batch_spec = data_spec(dict(mesh.shape))
    mapped = slow_axis.wrap_step(body, mesh, param_specs, param_specs,
                                 {"inputs": batch_spec, "targets": batch_spec}, plan.slow_mode,
                                 plan.overlap.dcn_comm_dtype)

    def loss_and_grads(params, batch):
        return mapped(params, batch)

    loss_and_grads.program = program
    return loss_and_grads
