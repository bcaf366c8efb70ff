"""Pipeline executor: runs any schedule table, tick by tick, inside one `shard_map`.

A schedule (`jax_overlap.pipeline.schedules`) says which action each stage runs at each tick.
`compile_program` turns it into small int tables -- per tick, per stage: which branch
(idle, or F/B/W of the first / a middle / the last virtual stage), microbatch, chunk, which
stash slots the action reads, and which slots this tick's arrivals are filed into. The
executor is a `lax.scan` over ticks; each stage reads its row with `axis_index('pp')` and
`lax.switch`es to that one action, so a tick costs only the work it executes.

Communication: a stage sends at most one tensor per tick -- an activation to the next virtual
stage (F) or an input gradient to the previous one (B). Neighbours are at +1 or -1 on the
'pp' ring (interleaved wraps from the last stage to the first for the next chunk; ZB-V's
chunk 1 runs up the stages, so its activations go to -1 and its gradients to +1), or on the
same stage (ZB-V's turn at the bottom). So every tick ends with two `ppermute`s, one per ring
direction (one when p = 2: both neighbours are the same stage), carrying this tick's output;
the receiver's table knows statically which arrival is meaningful and for which
(microbatch, chunk).

Double buffering: the `ppermute` results land in inboxes carried by the scan, separate from
the stash slots actions read, and are filed into slots at the start of the next tick. So a
transfer in flight never aliases a slot that an action is reading, the two rings' transfers
are independent of each other, and what is sent at tick t is readable from tick t+1 on --
exactly the schedules' time model. That model lets a neighbour consume at t+1 what was sent
at t, so such a transfer lies between two ticks on the critical path (as the p2p between
Megatron's stages does); only values consumed later than t+1 are hidden.

Skewed loop (`pipeline.transfer_latency: 2`): tick t sends tick t-1's output, at the top of
the loop body, and files what arrives at the end, after the tick's action. Neither the
transfers nor the action read the other's result, so the collective-permutes can be in
flight for the whole tick's `conditional`: its GEMMs run while the activations travel. The
tables are generated for that latency (a consumer on another stage runs two ticks after its
producer), which lengthens the ramp. Both rings' permutes are then in flight at once, which
needs the `gpu_overlap` preset's parallel-collective limit of 2. What XLA's GPU scheduler
did with this loop, per jaxlib version: `docs/xla_notes.md`.

Stash: per stage a pool of activation-sized slots. A received activation is a virtual stage's
*input*; it stays in its slot until the last backward action of that (microbatch, chunk)
(B, or W when the backward is split), which recomputes the chunk's forward under `jax.vjp`.
Likewise a received output gradient stays until B (split: W). Slots are assigned statically
from the table's lifetimes, so a stage holds `peak live (microbatch, chunk) tensors` slots,
not `microbatches x chunks`. Memory trade-off: storing inputs costs one (b, T, D) tensor per
live (microbatch, chunk) instead of every layer's residuals (a GPT block keeps on the order
of ten (b, T, D)-sized ones -- LayerNorm inputs, q/k/v, the MLP's hidden activations -- plus
(b, H, T, T) attention probabilities), paid for by one extra chunk forward per B (and per W
when split).

Split backward: B = vjp of the chunk w.r.t. its input only (sent up the pipe), W = vjp w.r.t.
the chunk's weights from the stashed input and output gradient; without the split, B does
both in one vjp. XLA drops the weight-gradient matmuls from B, but W has only the chunk's
output gradient, so it recomputes the forward and backpropagates through every layer of the
chunk: a W costs about a whole non-split B (measured in bench/pipeline.py). The split buys
scheduling freedom, not less work; making W cheap needs B to keep each matmul's output
gradient (and input) so that W is only the weight-gradient matmuls.

Embedding and head: F of virtual stage 0 embeds the microbatch's tokens, F of the last
virtual stage ends in the head and adds loss / (global loss count); their backward (B, or W
when split) produces the embedding / head gradients on the stage that owns them. Those are
summed over 'pp' at the end (with tied embeddings the head's use of `wte` and the embedding's
add up there), then the gradients go through the explicit DP reduction of `buckets`.

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
import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_overlap.overlap import buckets, fsdp
from jax_overlap.parallel.collectives import Parallel
from jax_overlap.parallel.compat import shard_map, to_varying
from jax_overlap.parallel.compat import varying_axes as _varying_axes
from jax_overlap.parallel.mesh import DP, PP, TP
from jax_overlap.pipeline.program import COL, TickProgram
from jax_overlap.training.grads import microbatched

# ----------------------------------------------------------------------- varying types


def _vary(x, axes) -> jax.Array:
    """Marks `x` varying over `axes`, skipping the ones it already varies over."""
    missing = tuple(a for a in axes if a not in _varying_axes(x))
    return to_varying(x, missing)


def _like(tree, ref) -> Any:
    """Casts every leaf to its reference leaf's varying axes (switch branches must agree)."""
    return jax.tree.map(lambda x, r: _vary(x, sorted(_varying_axes(r))), tree, ref)


# ---------------------------------------------------------------------------- executor


def _stage_functions(model, par: Parallel, count) -> dict[str, Callable]:
    """Per role, `(weights, x, targets) -> output` of one virtual stage.

    `weights` holds the chunk's stacked layers under 'chunk' and, where used, 'embed' and
    'head'. `first` takes token ids, `last` returns its share of the global mean loss.
    """

    def run_chunk(chunk_params, x_btd):
        def layer(x, p_layer):
            return model.block(p_layer, x, par), None

        return jax.lax.scan(layer, x_btd, chunk_params)[0]

    def first(w, ids_bt, targets_bt):
        del targets_bt
        return run_chunk(w["chunk"], model.embed(w["embed"], ids_bt, par))

    def mid(w, x_btd, targets_bt):
        del targets_bt
        return run_chunk(w["chunk"], x_btd)

    def last(w, x_btd, targets_bt):
        y_btd = run_chunk(w["chunk"], x_btd)
        return model.head_loss(w["embed"], w["head"], y_btd, targets_bt, par) / count

    return {"first": first, "mid": mid, "last": last}


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


@dataclass(frozen=True)
class StepContext:
    """What every action of one device's step reads: traced once at the top of the step.

    Attributes:
      model, par: the model and its TP context.
      params: this device's parameters (blocks gathered under fsdp), marked (dp, pp)-varying.
      blocks_vn: the stage's blocks as (chunks, layers per chunk, ...).
      ids_mbt, targets_mbt: the replica's microbatches.
      count: the global loss count (every partial loss is divided by it).
      zeros_btd: an activation-shaped zero with the varying type transfers carry.
      grads0, loss0: the accumulators' initial values (the type every branch returns).
      split: whether the schedule splits B and W.
      stage_fns: per role, `(weights, x, targets) -> output` of one virtual stage.
      overlap: the plan's overlap choices; axis_sizes: the mesh's.
      chunk_buckets: the bucket plan of one chunk (in-loop buckets), else None.
      tp_share: per bucketed leaf, the tp ranks its bucket sums over (1 for tp-split leaves).
    """

    model: Any
    par: Parallel
    params: Any
    blocks_vn: Any
    ids_mbt: jax.Array
    targets_mbt: jax.Array
    count: jax.Array
    zeros_btd: jax.Array
    grads0: Any
    loss0: jax.Array
    split: bool
    stage_fns: dict
    overlap: Any
    axis_sizes: dict
    chunk_buckets: Any = None
    tp_share: Any = None

    @property
    def layers_per_chunk(self) -> int:
        return jax.tree.leaves(self.blocks_vn)[0].shape[1]

    def weights(self, role: str, chunk) -> dict:
        """The weights a `role` action of `chunk` reads: the chunk's layers, plus the
        embedding (first, last: tied head) and the head (last)."""
        w = {"chunk": jax.tree.map(lambda b: jax.lax.dynamic_index_in_dim(b, chunk, 0, False),
                                   self.blocks_vn)}
        if role in ("first", "last"):
            w["embed"] = self.params["embed"]
        if role == "last":
            w["head"] = self.params["head"]
        return w

    def action_input(self, role: str, pool, row):
        """Token ids (virtual stage 0) or the stashed activation the action reads."""
        mb = row[COL["microbatch"]]
        return self.ids_mbt[mb] if role == "first" else pool[row[COL["x_slot"]]]

    def typed(self, grads, loss, out):
        """The branch result cast to the accumulators' varying types (branches must agree)."""
        return _like((grads, loss, out), (self.grads0, self.loss0, self.zeros_btd))


def _accumulate(grads: dict, dw: dict, chunk) -> dict:
    """Adds one action's weight gradients: the chunk's layers at `chunk`, embed/head whole."""
    grads = dict(grads)
    grads["blocks"] = jax.tree.map(lambda acc, g: acc.at[chunk].add(g), grads["blocks"],
                                   dw["chunk"])
    for part in ("embed", "head"):
        if part in dw:
            grads[part] = jax.tree.map(jnp.add, grads[part], dw[part])
    return grads


def action_branch(ctx: StepContext, kind: str, role: str) -> Callable:
    """The `lax.switch` branch of one (kind, role): F runs the virtual stage; B and W
    recompute it under `jax.vjp` from the stashed input and pull back the stashed output
    gradient (B: input gradient, and the weights' when not split; W: the weights')."""
    fn = ctx.stage_fns[role]

    def branch(pool, grads, loss, row):
        mb, chunk = row[COL["microbatch"]], row[COL["chunk"]]
        w = ctx.weights(role, chunk)
        x = ctx.action_input(role, pool, row)
        targets_bt = ctx.targets_mbt[mb]
        out, dw = ctx.zeros_btd, None
        if kind == "F":
            y = fn(w, x, targets_bt)
            if role == "last":
                loss = loss + y
            else:
                out = y
        else:
            want_w = kind == "W" or not ctx.split
            want_x = kind == "B" and role != "first"  # token ids have no gradient
            if want_w and want_x:
                y, vjp = jax.vjp(lambda w_, x_: fn(w_, x_, targets_bt), w, x)
            elif want_w:
                y, vjp = jax.vjp(lambda w_: fn(w_, x, targets_bt), w)
            elif want_x:
                y, vjp = jax.vjp(lambda x_: fn(w, x_, targets_bt), x)
            else:  # split B of virtual stage 0: nothing to compute, W does the work
                y, vjp = None, None
            if vjp is not None:
                ct = jnp.ones_like(y) if role == "last" else pool[row[COL["g_slot"]]]
                cts = vjp(ct)
                if want_w:
                    dw = cts[0]
                if want_x:
                    out = cts[-1]
        if dw is not None:
            grads = _accumulate(grads, dw, chunk)
        return ctx.typed(grads, loss, out)

    return branch


def sync_branch(ctx: StepContext, kind: str, role: str) -> Callable:
    """The chunk's last weight-gradient action, with its dp reduction inside.

    The chunk's layers run unrolled with a bucket hook per bucket (`buckets.BucketHooks`, as
    in the pp=1 path's last microbatch): in the backward each bucket's psum is issued as soon
    as its layers' gradients (this microbatch's plus the accumulated ones) exist, and runs
    while the chunk's earlier layers backpropagate. The same branch runs at the same tick on
    every dp replica of the stage, so each collective's replica group (the stage's dp peers)
    meets.
    """
    want_x = kind == "B" and role != "first"
    marked = (DP, PP, TP)
    plan, model, par, axis_sizes = ctx.chunk_buckets, ctx.model, ctx.par, ctx.axis_sizes

    def branch(pool, grads, loss, row):
        mb, chunk = row[COL["microbatch"]], row[COL["chunk"]]
        w = ctx.weights(role, chunk)
        x = ctx.action_input(role, pool, row)
        targets_bt = ctx.targets_mbt[mb]
        chunk_leaves, chunk_def = jax.tree.flatten(w["chunk"])
        # Marked tp-varying too: TP-replicated leaves get partial gradients, which their
        # buckets sum over ('dp', 'tp') (autodiff would psum them over tp one by one).
        chunk_leaves = [_vary(leaf, marked) for leaf in chunk_leaves]
        # The other actions' gradients of TP-replicated leaves are whole on every tp rank
        # (autodiff summed them); their bucket sums over tp again, so each rank adds 1/tp.
        acc_leaves = [jax.lax.dynamic_index_in_dim(a, chunk, 0, False) / ctx.tp_share[i]
                      for i, a in enumerate(jax.tree.leaves(grads["blocks"]))]
        others = {k: w[k] for k in ("embed", "head") if k in w}

        def forward(sinks, others_, x_):
            hooks = buckets.BucketHooks(plan, chunk_leaves, acc_leaves, sinks, axis_sizes,
                                        marked, ctx.overlap.grad_comm_dtype)
            h = model.embed(others_["embed"], x_, par) if role == "first" else x_
            for layer in range(ctx.layers_per_chunk):
                hooks.enter(1 + layer)
                h = model.block(jax.tree.unflatten(
                    chunk_def, [hooks.value(i, layer) for i in range(len(chunk_leaves))]),
                    h, par)
            if role == "last":
                return model.head_loss(others_["embed"], others_["head"], h, targets_bt,
                                       par) / ctx.count
            return h

        sinks = buckets.make_sinks(plan, axis_sizes, marked)
        if want_x:
            y, vjp = jax.vjp(forward, sinks, others, x)
        else:
            y, vjp = jax.vjp(lambda s_, o_: forward(s_, o_, x), sinks, others)
        ct = (_vary(jnp.ones(y.shape, y.dtype), (DP, PP)) if role == "last"
              else pool[row[COL["g_slot"]]])
        # The tp-marked weights make the output's *type* tp-varying while its values are
        # equal on every tp rank. vjp then reads the cotangent per rank and sums the ranks'
        # contributions, so each rank takes 1/tp of the (replicated) cotangent.
        extra = sorted(_varying_axes(y) - _varying_axes(ct))
        if extra:
            ct = _vary(ct, extra) / math.prod(axis_sizes[a] for a in extra)
        cts = vjp(ct)
        reduced = buckets.assemble(plan, cts[0], axis_sizes)  # leaf -> (layers, ...)
        synced, synced_def = jax.tree.flatten(grads["synced"])
        grads = {**grads, "synced": jax.tree.unflatten(synced_def, [
            acc.at[chunk].set(_vary(reduced[i], sorted(_varying_axes(acc))))
            for i, acc in enumerate(synced)])}
        for part, g in cts[1].items():
            grads[part] = jax.tree.map(jnp.add, grads[part], g)
        out = cts[2] if want_x else ctx.zeros_btd
        return ctx.typed(grads, loss, out)

    return branch


def idle_branch(ctx: StepContext) -> Callable:
    """Branch 0: nothing to compute, nothing to send."""

    def branch(pool, grads, loss, row):
        del pool, row
        return grads, loss, ctx.zeros_btd

    return branch


def _ring(out_btd, pairs, zeros_btd):
    """One ppermute on the pp ring (`pairs`: the (src, dst) stages that carry data)."""
    if not pairs:
        return zeros_btd
    return jax.lax.ppermute(out_btd, PP, perm=list(pairs))  # (b, T, D) per device, over pp


def _file(pool, row, route: str, arrival):
    """Files an arrival into the slot the table names (`trash` when nothing came)."""
    return pool.at[row[COL["file_" + route]]].set(arrival)


def run_ticks(ctx: StepContext, program: TickProgram, branches: list, pool_sbtd):
    """The tick loop: a `lax.scan` over the table, each stage switching to its action.

    Latency 1: a tick files last tick's arrivals, runs its action and sends its output.
    Latency 2 (skewed): a tick sends the previous tick's output before its action and files
    the arrivals after it, so the transfers run under the action.

    Returns:
      (grads, loss) accumulated over the step on this device.
    """
    stage = jax.lax.axis_index(PP)
    zeros = ctx.zeros_btd

    def tick(carry, rows):
        pool, inbox_down, inbox_up, inbox_self, grads, loss = carry
        row = jax.lax.dynamic_index_in_dim(rows, stage, 0, keepdims=False)
        # File last tick's arrivals.
        if program.down_pairs:
            pool = _file(pool, row, "down", inbox_down)
        if program.up_pairs:  # with 2 stages both neighbours are +1: one ring suffices
            pool = _file(pool, row, "up", inbox_up)
        if program.local_handoff:
            pool = _file(pool, row, "self", inbox_self)
        grads, loss, out = jax.lax.switch(row[COL["branch"]], branches, pool, grads, loss, row)
        inbox_down = _ring(out, program.down_pairs, zeros)
        inbox_up = _ring(out, program.up_pairs, zeros)
        inbox_self = out if program.local_handoff else inbox_self
        return (pool, inbox_down, inbox_up, inbox_self, grads, loss), None

    def skewed_tick(carry, rows_now_next):
        # Tick t sends tick t-1's output, so the transfers and this tick's action have no
        # data dependency: the ppermutes start before the action and finish after it. What
        # they bring is readable from tick t+1 on, as `transfer_latency = 2` tables expect.
        pool, pending, inbox_self, grads, loss = carry
        rows, rows_next = rows_now_next
        row = jax.lax.dynamic_index_in_dim(rows, stage, 0, keepdims=False)
        row_next = jax.lax.dynamic_index_in_dim(rows_next, stage, 0, keepdims=False)
        arrival_down = _ring(pending, program.down_pairs, zeros)
        arrival_up = _ring(pending, program.up_pairs, zeros)
        if program.local_handoff:  # same stage: readable one tick after it was made
            pool = _file(pool, row, "self", inbox_self)
        grads, loss, out = jax.lax.switch(row[COL["branch"]], branches, pool, grads, loss, row)
        if program.down_pairs:
            pool = _file(pool, row_next, "down", arrival_down)
        if program.up_pairs:
            pool = _file(pool, row_next, "up", arrival_up)
        return (pool, out, out, grads, loss), None

    table = jnp.asarray(program.table)
    if program.skewed:
        # Row t+1 says where the arrivals filed at the end of tick t go; nothing after the end.
        nothing = np.full((1, *program.table.shape[1:]), program.trash, np.int32)
        table_next = jnp.asarray(np.concatenate([program.table[1:], nothing]))
        carry0 = (pool_sbtd, zeros, zeros, ctx.grads0, ctx.loss0)
        (_, _, _, grads, loss), _ = jax.lax.scan(skewed_tick, carry0, (table, table_next))
    else:
        carry0 = (pool_sbtd, zeros, zeros, zeros, ctx.grads0, ctx.loss0)
        (_, _, _, _, grads, loss), _ = jax.lax.scan(tick, carry0, table)
    return grads, loss


def reduce_step_grads(grads: dict, overlap, fsdp_layout, dp: int, synced: bool) -> dict:
    """The step's gradients after the tick loop, reduced over pp and dp.

    Blocks stay on their stage; embedding and head gradients are summed over pp (which also
    adds the tied embedding's two uses). Over dp: in-loop buckets already reduced the blocks
    (`synced`), fsdp reduce-scatters them, otherwise every leaf goes through
    `buckets.reduce_gradients`.
    """
    grads = {
        # Each stage holds its own layers' gradients: nothing to combine over pp.
        "blocks": jax.tree.map(lambda g: g.reshape(-1, *g.shape[2:]),
                               grads["synced"] if synced else grads["blocks"]),
        # Embedding / head gradients live on the stages that ran virtual stage 0 / the last;
        # zeros elsewhere. Summing over pp gathers them (and adds tied wte's two uses).
        "embed": jax.lax.psum(grads["embed"], PP),  # (param shape) per device, over pp
        "head": jax.lax.psum(grads["head"], PP),  # (param shape) per device, over pp
    }
    bucket_bytes, comm_dtype = overlap.grad_bucket_bytes, overlap.grad_comm_dtype
    if synced:  # block gradients were reduced in the loop; the embedding and head follow
        rest = buckets.reduce_gradients({k: grads[k] for k in ("embed", "head")},
                                        bucket_bytes, comm_dtype, DP)
        return {**rest, "blocks": grads["blocks"]}
    if fsdp_layout is None:
        return buckets.reduce_gradients(grads, bucket_bytes, comm_dtype, DP)
    scattered = _scatter_stage_grads(grads["blocks"], fsdp_layout, dp, comm_dtype)
    # Leaves stored whole (no dim divisible by dp) are psum'd with the embedding and head.
    grads["blocks"] = jax.tree.map(lambda g, sc: g if sc is None else None, grads["blocks"],
                                   scattered, is_leaf=lambda x: x is None)
    reduced = buckets.reduce_gradients(grads, bucket_bytes, comm_dtype, DP)
    reduced["blocks"] = jax.tree.map(lambda r, sc: r if sc is None else sc, reduced["blocks"],
                                     scattered, is_leaf=lambda x: x is None)
    return reduced


def _per_device(params, batch, *, model, program: TickProgram, par: Parallel, overlap,
                axis_sizes: dict[str, int], fsdp_layout=None, chunk_buckets=None):
    """One device's loss and gradients for a whole step; see the module docstring."""
    s = program.schedule
    v = s.virtual_stages
    # Global divisor first, so every microbatch's loss is already scaled to the global mean.
    count = jax.lax.psum(model.loss_count(batch["targets"]), DP)  # () per device, over dp
    # Per-replica, per-stage values: autodiff must not reduce over dp or pp behind our back.
    params = jax.tree.map(lambda x: _vary(x, (DP, PP)), params)
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

    # What travels between stages: one microbatch's activations (shape, dtype and varying
    # axes as the embedding produces them; the probe is dead code after tracing).
    probe_btd = model.embed(params["embed"], mbs["inputs"][0], par)
    act_axes = sorted(_varying_axes(probe_btd) | {DP, PP})
    zeros_btd = _vary(jnp.zeros(probe_btd.shape, probe_btd.dtype), act_axes)
    pool_sbtd = _vary(jnp.zeros((program.slots + 1, *probe_btd.shape), probe_btd.dtype),
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
            lambda b: _vary(jnp.zeros(b.shape, jnp.float32), sorted(_varying_axes(b) - {DP})),
            blocks_vn)
        tp_share = {u.leaf: math.prod(axis_sizes[a] for a in u.axes if a != DP)
                    for u in chunk_buckets.units}
    ctx = StepContext(model=model, par=par, params=params, blocks_vn=blocks_vn,
                      ids_mbt=mbs["inputs"], targets_mbt=mbs["targets"], count=count,
                      zeros_btd=zeros_btd, grads0=grads0,
                      loss0=_vary(jnp.zeros((), jnp.float32), (DP, PP)),
                      split=s.split_backward, stage_fns=_stage_functions(model, par, count),
                      overlap=overlap, axis_sizes=axis_sizes, chunk_buckets=chunk_buckets,
                      tp_share=tp_share)
    branches = [idle_branch(ctx)] + [sync_branch(ctx, b.kind, b.role) if b.sync
                                     else action_branch(ctx, b.kind, b.role)
                                     for b in program.branches]
    grads, loss = run_ticks(ctx, program, branches, pool_sbtd)
    loss = jax.lax.psum(loss, (DP, PP))  # () per device, over dp and pp
    return loss, reduce_step_grads(grads, overlap, fsdp_layout, axis_sizes[DP], synced)


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
                   fsdp_layout=plan.layout.fsdp, chunk_buckets=plan.chunk_buckets)
    mapped = shard_map(body, mesh, in_specs=(param_specs, {"inputs": P(DP), "targets": P(DP)}),
                       out_specs=(P(), param_specs))

    def loss_and_grads(params, batch):
        return mapped(params, batch)

    loss_and_grads.program = program
    return loss_and_grads
