"""Pipeline executor: runs any schedule table, tick by tick, inside one `shard_map`.

A schedule (`jax_overlap.pipeline.schedules`) says which action each stage runs at each tick.
`compile_program` turns it into small int tables -- per tick, per stage: which branch
(idle, or F/B/W of the first / a middle / the last virtual stage), microbatch, chunk, which
stash slots the action reads, and which slots this tick's arrivals are filed into. The
executor is a `lax.scan` over ticks; each stage reads its row with `axis_index('pp')` and
`lax.switch`es to that one action, so a tick costs only the work it executes. A paired
table on an accelerator runs as three scans, over the fill, the steady state and the drain
(`TickProgram.spans`): the fill's loop has no backward lane, ring or head all-reduce and the
drain's no forward ring, so a collective that would carry only zeros there is not compiled.

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
did with this loop, per jaxlib version: `docs/design/xla_notes.md`.

Stash: per stage a pool of activation-sized slots. A received activation is a virtual stage's
*input*; it stays in its slot until the last backward action of that (microbatch, chunk) (B,
or W when the backward is split). Likewise a received output gradient stays until B (split:
W). Slots are assigned statically from the table's lifetimes, so a stage holds `peak live
(microbatch, chunk) tensors` slots, not `microbatches x chunks`.

Residuals (`jax_overlap.pipeline.residuals`): an F runs its virtual stage under `jax.vjp` and
files the pullback's residuals -- the embedding's, the chunk's, the head's -- into slots of
three pools, assigned like the stash from the F's tick to the last backward's. B and W rebuild
the pullbacks from those slots, so no action re-runs a forward. What the residuals are is the
remat policy's choice (`model.remat`, applied to every block with `jax.checkpoint`): `none`
keeps every residual (on the order of ten (b, T, D)-sized tensors per GPT block plus the
(b, H, T, T) attention probabilities); `full` keeps each block's input and recomputes the
block inside the pullback (the memory of stashing only inputs, the cost of one more forward
per backward); `save_dots` / `minimal` keep the (weight) matmul outputs.

Split backward: B pulls back to the chunk's input only (XLA drops the weight-gradient
matmuls), W to the weights only, both from the same residuals. W still backpropagates through
the chunk's layers to reach the earlier layers' weights; making it only the weight-gradient
matmuls needs B to keep each matmul's output gradient.

Embedding and head: F of virtual stage 0 embeds the microbatch's tokens, F of the last
virtual stage ends in the head and adds loss / (global loss count); their backward (B, or W
when split) produces the embedding / head gradients on the stage that owns them.

Vocabulary-parallel head (`pipeline.vocab_parallel`, `TickProgram.vocab_parallel`): the last
virtual stage's F ends at its chunk's output instead. At that tick, after the forward lane
(a paired tick: after the backward lane, see `paired_tick`), every stage runs the head phase
(`lax.cond` on a flag every stage reads alike): the output is
broadcast over 'pp' (a psum of it masked to its stage), each stage computes the logits of
its 1/pp of the vocabulary and the loss from statistics reduced over 'pp'
(`collectives.vocab_cross_entropy`), pulls back at once, and the output's gradient (the
stages' partial sums, psum'd over 'pp') is filed into a stash slot of the F's stage, where
the chunk's B reads it as if a next stage had sent it. Each stage's head gradient covers its
vocabulary columns only; the sum over 'pp' below completes it.

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
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_overlap.model_api import batch_shapes
from jax_overlap.overlap import buckets, fsdp, slow_axis
from jax_overlap.parallel.collectives import Parallel
from jax_overlap.parallel.compat import all_gather_invariant, shard_map, to_varying
from jax_overlap.parallel.compat import varying_axes as _varying_axes
from jax_overlap.parallel.compute_cast import cast_leaves, cast_on_use
from jax_overlap.parallel.mesh import DCN, DP, PP, TP, data_axes, data_spec
from jax_overlap.parallel.remat import remat_block
from jax_overlap.pipeline import residuals, weight_grads
from jax_overlap.pipeline.program import (COL, HEAD_SCOPE, LANE_SCOPE, LAST_TICK_SCOPE,
                                          SPAN_SCOPE, TickProgram, TickSpan)
from jax_overlap.pipeline.residuals import Layout, vjp_with_layout
from jax_overlap.parallel.mesh import microbatched

_log = logging.getLogger("jax_overlap")

# ----------------------------------------------------------------------- varying types


def _vary(x, axes) -> jax.Array:
    """Marks `x` varying over `axes`, skipping the ones it already varies over."""
    missing = tuple(a for a in axes if a not in _varying_axes(x))
    return to_varying(x, missing)


def _summed_slow(x) -> set[str]:
    """{'dcn'} when the in-loop buckets also sum over it (see `overlap.slow_axis`)."""
    return {DCN} if slow_axis.crosses_dcn(x) else set()


# ------------------------------------------------------------------ slots and accumulators
# Every index the executor uses comes from the tick table, a chunk count or the stage's
# axis index and is in range, so plain dynamic slices do: `x.at[i].set(v)` and `x[i]` would
# add a negative-index wrap and a bounds check (three more kernels each, every tick).


def _at(x, i):
    """`x[i]` along the leading axis."""
    return jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)


def _set_at(x, i, v):
    """`x` with `x[i] = v` (in place where XLA can)."""
    return jax.lax.dynamic_update_index_in_dim(x, v.astype(x.dtype), i, 0)


def _add_at(x, i, v):
    """`x` with `v` added to `x[i]`: a scatter-add in place, without the bounds check (a
    dynamic slice, add and update costs XLA:GPU a copy of the slice first)."""
    return x.at[i].add(v.astype(x.dtype), mode="promise_in_bounds", indices_are_sorted=True,
                       unique_indices=True)


def _like(tree, ref) -> Any:
    """Casts every leaf to its reference leaf's varying axes (switch branches must agree)."""
    return jax.tree.map(lambda x, r: _vary(x, sorted(_varying_axes(r))), tree, ref)


# ---------------------------------------------------------------------------- executor


class StagePieces(NamedTuple):
    """One virtual stage as three pure functions, so that each keeps its own residuals.

    Attributes:
      embed: `(w_embed, ids) -> x` (virtual stage 0 only).
      chunk: `(w_chunk, x, valid=None) -> y`, the chunk's layers, each block under the
        remat policy; `w_chunk` as `chunk_weights` gives it; `valid` (one bool per layer,
        uneven `pipeline.stage_layers`) skips the padded layers (`_masked`).
      head: `(w_embed, w_head, y, targets) -> loss / global count` (the last virtual stage).
      block: `(p_layer, x) -> x`, one block without remat (what `weight_grads` splits).
      remat: the remat policy name.
      unrolled: the chunk's layers unrolled (paired ticks), not a scan. A scan's stacked
        residuals and weight gradients are written once into the loop's outputs and again
        into their stash slot or accumulator; unrolled, once (GPT-1.3B pp4 x dp2 paired
        1F1B, deviceless 8 x H100: docs/results.md). Unpaired, XLA runs more of the
        unrolled recomputes ahead of the backward, at a memory cost the estimate does not
        model, so those ticks keep the scan.
    """

    embed: Callable
    chunk: Callable
    head: Callable
    block: Callable
    remat: str
    unrolled: bool = False

    def chunk_weights(self, w_chunk):
        """What `chunk` takes: the stacked layers (a scan), or `layers_of` them (unrolled)."""
        return layers_of(w_chunk) if self.unrolled else w_chunk

    def chunk_grads(self, dw):
        """The chunk's weight gradients stacked over its layers, from `chunk`'s pullback."""
        return stack_layers(dw) if self.unrolled else dw


def stage_pieces(model, par: Parallel, count, remat: str, program: TickProgram
                 ) -> StagePieces:
    """The `StagePieces` of a model with its TP context, loss divisor and remat policy, for
    `program`: a vocabulary-parallel head is this pp rank's share of it; paired ticks run the
    chunk's layers unrolled (see `StagePieces`)."""
    vocab_shards, unrolled = _vocab_shards(program), program.lanes == 2
    raw = partial(_apply_block, model, par)
    block = remat_block(raw, remat, prevent_cse=_cse_barrier(remat))

    def chunk(w_chunk, x_btd, valid=None):
        if unrolled:
            for i, p in enumerate(w_chunk):
                if valid is None:
                    x_btd = block(p, x_btd)
                else:
                    x_btd = _masked(valid[i], lambda p=p, h=x_btd: block(p, h), x_btd)
            return x_btd
        if valid is None:
            return jax.lax.scan(lambda h, p: (block(p, h), None), x_btd, w_chunk)[0]
        return jax.lax.scan(lambda h, xs: (_masked(xs[1], lambda: block(xs[0], h), h), None),
                            x_btd, (w_chunk, valid))[0]

    def embed(w_embed, ids_bt):
        return model.embed(w_embed, ids_bt, par)

    head_par = (par if vocab_shards == 1 else
                dataclasses.replace(par, vocab_axis=PP, vocab_shards=vocab_shards))

    def head(w_embed, w_head, y_btd, targets_bt):
        return model.head_loss(w_embed, w_head, y_btd, targets_bt, head_par) / count

    if vocab_shards == 1:
        # The last virtual stage's F stashes the head's residuals until its B. Kept as they
        # are, they are the full-vocabulary logits in f32 ([b, T, V]: 6.6 GB a microbatch for
        # GPT-1.3B at b = 16), written into a pool slot every tick by every stage; kept under
        # `jax.checkpoint` they are the head's input (b, T, D) and B recomputes the logits
        # (one head GEMM more per microbatch, on the last stage only). The vocabulary-parallel
        # head pulls back at once and keeps nothing, so it runs without the checkpoint.
        head = jax.checkpoint(head)
    return StagePieces(embed, chunk, head, raw, remat, unrolled)


def _cse_barrier(remat: str) -> bool:
    """Whether a chunk's blocks keep `jax.checkpoint`'s CSE barrier. F and B run in different
    branches of the tick switch, so no CSE can merge the recompute into the forward. Under a
    policy that keeps residuals the barrier only makes B copy them out of the stash slot
    first (GPT-1.3B pp4 x dp2 interleaved under `minimal`, deviceless 8 x H100: 1045 -> 1006
    ms without it). Under `full` it stays: it keeps the recompute where XLA's scheduler
    hides the other lane's collectives under it (pp2 x dp2 x tp2: 0.927 of the collective
    bytes under GEMMs with it, 0.861 without; pp4 x dp2 the same either way)."""
    return remat == "full"


def layers_of(w_chunk, layers: int | None = None) -> list:
    """A chunk's stacked layer parameters (any tree of arrays stacked over `layers`, by
    default their leading dim) as one tree per layer. An F's vjp and its B's pullback take
    these same slices, so a residual that is one of them (a checkpointed block's weights) is
    handed to B again (`residuals.vjp_with_layout`'s `reuse`), not stashed."""
    layers = jax.tree.leaves(w_chunk)[0].shape[0] if layers is None else layers
    return [jax.tree.map(lambda a, i=i: a[i], w_chunk) for i in range(layers)]


def stack_layers(per_layer: list) -> Any:
    """The inverse of `layers_of`: one tree per layer as one tree stacked over the layers."""
    return jax.tree.map(lambda *a: jnp.stack(a), *per_layer)


def _apply_block(model, par, p, x):
    return model.block(p, x, par)


def _masked(ok, run: Callable, skipped):
    """`run()` where the layer is real, `skipped` (the input passed through) where it pads an
    uneven chunk to the stage's largest one: a `cond`, so padded layers cost nothing and get
    zero gradients."""
    return jax.lax.cond(ok, run, lambda: skipped)


def chunk_validity(stage_layers, placement, stages: int, virtual_stages: int):
    """(stages, chunks, padded layers per chunk) bools, or None when the split is even."""
    from jax_overlap.pipeline.layout import chunk_mask

    mask = chunk_mask(stage_layers, placement, stages, virtual_stages)
    return None if mask.all() else mask


class ChunkSplit(NamedTuple):
    """A chunk's backward split into B and W (`weight_grads.SplitBlock` over its layers).

    Attributes:
      split: the block's `SplitBlock`.
      treedef: one layer's parameter structure; n_leaves: its leaf count.
      act_avals: (shape, dtype, varying axes) of one layer's weight-matmul activation
        operands (what a padded layer of an uneven chunk returns as zeros).
    """

    split: Any
    treedef: Any
    n_leaves: int
    act_avals: tuple = ()

    def parts(self, w_chunk) -> tuple[list, list]:
        """(W's leaves, B's leaves) of the chunk's stacked parameters."""
        leaves = jax.tree.leaves(w_chunk)
        other = self.split.other_leaves(self.n_leaves)
        return [leaves[i] for i in self.split.dot_leaves], [leaves[i] for i in other]

    def layer_parts(self, w_chunk) -> tuple[list, list]:
        """`parts` per layer: ([W's leaves of layer i], [B's leaves of layer i]). The F's vjp
        and B's pullback take these same slices, so a residual that is one of them is
        handed to B again (`reuse`), not stashed."""
        layers = jax.tree.leaves(w_chunk)[0].shape[0]
        return tuple(layers_of(part, layers) for part in self.parts(w_chunk))

    def layer(self, w_dot, w_other):
        """One layer's parameter tree from W's and B's leaves (what `parts` splits)."""
        leaves = [None] * self.n_leaves
        for i, v in zip(self.split.dot_leaves, w_dot):
            leaves[i] = v
        for i, v in zip(self.split.other_leaves(self.n_leaves), w_other):
            leaves[i] = v
        return jax.tree.unflatten(self.treedef, leaves)

    def forward(self, remat: str) -> Callable:
        """`(x, z, w_other, w_dot, valid=None) -> (y, acts)`: the chunk with the matmul
        addends, every layer under the remat policy; `z`, `w_other`, `w_dot` lists per layer
        (`zero_addends`, `layer_parts`), `acts` stacked over the chunk's layers; `valid`
        skips padded layers (zero activation operands, so W adds nothing).

        The layers are unrolled, not scanned: a scan's stacked outputs (the activation
        operands here, their output gradients in B's transpose) are written once into the
        loop's output and then again into the stash slot; unrolled, each layer's go to the
        slot. (GPT-1.3B pp4 x dp2 ZB-V, deviceless 8 x H100: docs/results.md.)"""
        layer = remat_block(self.split.forward, remat, prevent_cse=_cse_barrier(remat))

        def step(h, z_l, wo_l, wd_l, ok):
            p_l = self.layer(wd_l, wo_l)
            if ok is None:
                return layer(p_l, h, list(z_l))
            skipped = (h, [_vary(jnp.zeros(shape, dtype), axes)
                           for shape, dtype, axes in self.act_avals])
            return _masked(ok, lambda: layer(p_l, h, list(z_l)), skipped)

        def run(x, z, w_other, w_dot, valid=None):
            acts = []
            for i, (z_l, wo_l, wd_l) in enumerate(zip(z, w_other, w_dot)):
                x, acts_l = step(x, z_l, wo_l, wd_l, None if valid is None else valid[i])
                acts.append(acts_l)
            return x, stack_layers(acts)

        return run

    def zero_addends(self, layers: int) -> list:
        """The zero addends of `layers` layers' weight matmuls, a list per layer. B is handed
        these same arrays again (`residuals.vjp_with_layout`'s `reuse`): kept as residuals,
        every F would stash a slot of zeros."""
        return [[_vary(jnp.zeros(shape, dtype), axes) for shape, dtype, axes in
                 self.split.z_avals] for _ in range(layers)]

    def weight_matmuls(self, w_dot, w_other, acts) -> list:
        """Every layer's weight matmuls on the saved activation operands (one batch of
        independent GEMMs: no layer waits for another)."""
        def one(wd_l, wo_l, acts_l):
            return self.split.weight_matmuls(self.layer(wd_l, wo_l), list(acts_l))
        return jax.vmap(one)(w_dot, w_other, tuple(acts))


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
      blocks_vn: the stage's blocks as (chunks, layers per chunk, ...), in the dtype the
        block reads each leaf in (`_compute_blocks`).
      stored_vn: the same blocks as stored (fp32 under mixed precision): what the sync
        actions' bucket hooks take, whose backward adds the fp32 accumulators.
      ids_mbt, targets_mbt: the replica's microbatches.
      count: the global loss count (every partial loss is divided by it).
      zeros_btd: an activation-shaped zero with the varying type transfers carry.
      grads0, loss0: the accumulators' initial values (the type every branch returns).
      split: whether the schedule splits B and W.
      pieces: the virtual stage's `StagePieces`.
      layouts: the residual `Layout` of the "embed", "chunk" and "head" vjps.
      chunk_split: with a split backward, the chunk's `ChunkSplit` (W = the weight matmuls
        only); None otherwise, or for a block `weight_grads` cannot split.
      z0: the zero addends of the chunk's weight matmuls (`ChunkSplit.zero_addends`).
      overlap: the plan's overlap choices; axis_sizes: the mesh's.
      chunk_buckets: the bucket plan of one chunk (in-loop buckets), else None.
      tp_share: per bucketed leaf, the tp ranks its bucket sums over (1 for tp-split leaves).
      valid_vn: uneven `pipeline.stage_layers`: this stage's (chunks, padded layers) bools,
        True for a real layer; None when every chunk has the same layers.
    """

    model: Any
    par: Parallel
    params: Any
    blocks_vn: Any
    stored_vn: Any
    ids_mbt: jax.Array
    targets_mbt: jax.Array
    count: jax.Array
    zeros_btd: jax.Array
    grads0: Any
    loss0: jax.Array
    split: bool
    pieces: StagePieces
    layouts: dict
    overlap: Any
    axis_sizes: dict
    chunk_buckets: Any = None
    tp_share: Any = None
    chunk_split: Any = None
    z0: Any = None
    valid_vn: Any = None

    @property
    def layers_per_chunk(self) -> int:
        return jax.tree.leaves(self.blocks_vn)[0].shape[1]

    def weights(self, role: str, chunk, stored: bool = False) -> dict:
        """The weights a `role` action of `chunk` reads: the chunk's layers (as stored if
        `stored`, else as the block reads them), plus the embedding (first, last: tied head)
        and the head (last); with an uneven split also "valid", which of the chunk's
        (padded) layers are real."""
        blocks = self.stored_vn if stored else self.blocks_vn
        w = {"chunk": jax.tree.map(lambda b: _at(b, chunk), blocks)}
        if self.valid_vn is not None:
            w["valid"] = _at(self.valid_vn, chunk)
        if role in ("first", "last"):
            w["embed"] = self.params["embed"]
        if role == "last":
            w["head"] = self.params["head"]
        return w

    def action_input(self, role: str, inbox, row):
        """Token ids (virtual stage 0) or the stashed activation the action reads."""
        mb = row[COL["microbatch"]]
        return self.ids_mbt[mb] if role == "first" else inbox["x"]

    def typed(self, res, grads, loss, out, res0):
        """The branch result cast to the carry's varying types (branches must agree)."""
        return _like((res, grads, loss, out), (res0, self.grads0, self.loss0, self.zeros_btd))


def _accumulate(grads: dict, dw: dict, chunk, blocks: bool = True) -> dict:
    """Adds one action's weight gradients: the chunk's layers at `chunk` (unless `blocks` is
    False), embed/head whole."""
    grads = dict(grads)
    if blocks:
        grads["blocks"] = jax.tree.map(lambda acc, g: _add_at(acc, chunk, g), grads["blocks"],
                                       dw["chunk"])
    for part in ("embed", "head"):
        if part in dw:
            grads[part] = jax.tree.map(jnp.add, grads[part], dw[part])
    return grads


def _checked(layout: Layout, want: Layout, what: str) -> None:
    if (layout.kinds, layout.avals) != (want.kinds, want.avals):
        raise RuntimeError(f"pipeline executor: the {what} residuals traced differently in an F "
                           f"branch than in the probe; the model's functions must be pure")


def _forward_action(ctx: StepContext, role: str, chunk_residuals: Callable, inbox, res, loss,
                    row):
    """An F: embedding (virtual stage 0), chunk and head (the last) under `jax.vjp`, each
    one's residuals returned for this (microbatch, chunk)'s slots. `chunk_residuals(w_chunk,
    x, valid) -> (y, leaves)` runs the chunk (plainly, or B/W-split)."""
    pieces, lay = ctx.pieces, ctx.layouts
    mb, chunk = row[COL["microbatch"]], row[COL["chunk"]]
    w = ctx.weights(role, chunk)
    res, out = dict(res), ctx.zeros_btd
    if role == "first":
        x, _, got, leaves = vjp_with_layout(
            lambda we: pieces.embed(we, ctx.ids_mbt[mb]), (w["embed"],), (w["embed"],))
        _checked(got, lay["embed"], "embedding")
        res["first"] = list(leaves + [x])
    else:
        x = inbox["x"]
    y, res["chunk"] = chunk_residuals(w["chunk"], x, w.get("valid"))
    if role == "last":
        part, _, got, leaves = vjp_with_layout(
            lambda we, wh, y_: pieces.head(we, wh, y_, ctx.targets_mbt[mb]),
            (w["embed"], w["head"], y), (w["embed"], w["head"]))
        _checked(got, lay["head"], "head")
        res["last"] = list(leaves)
        loss = loss + part
    else:
        out = y
    return res, loss, out


def action_branch(ctx: StepContext, kind: str, role: str) -> Callable:
    """The `lax.switch` branch of one (kind, role).

    F runs the virtual stage under `jax.vjp` and files its residuals (the embedding's, the
    chunk's, the head's: whatever the remat policy keeps) into this (microbatch, chunk)'s
    slots. B and W rebuild the pullbacks from those slots and pull back the output gradient
    (the stashed one, or d loss = 1 on the last virtual stage): B the input gradient, and the
    weights' when the backward is not split; W the weights'. Nothing re-runs the forward but
    what the remat policy recomputes inside a pullback.
    """
    pieces, lay = ctx.pieces, ctx.layouts

    def chunk_residuals(w_chunk, x, valid=None):
        w_layers = pieces.chunk_weights(w_chunk)
        y, _, got, leaves = vjp_with_layout(lambda w_, x_: pieces.chunk(w_, x_, valid),
                                            (w_layers, x), (w_layers, x))
        _checked(got, lay["chunk"], "chunk")
        return y, list(leaves)

    def forward(inbox, res, grads, loss, row):
        res, loss, out = _forward_action(ctx, role, chunk_residuals, inbox, res, loss, row)
        return res, grads, loss, out

    def backward(inbox, res, grads, loss, row):
        chunk = row[COL["chunk"]]
        w = ctx.weights(role, chunk)
        want_w = kind == "W" or not ctx.split
        want_x = kind == "B" and role != "first"  # token ids have no gradient
        out, dw = ctx.zeros_btd, {}
        if role == "last":
            pull = residuals.pullback(lay["head"], res["last"], (w["embed"], w["head"]))
            d_embed, d_head, dy = pull(residuals.ones_cotangent(lay["head"]))
            dw.update(embed=d_embed, head=d_head)
        else:
            dy = inbox["g"]
        x = res["first"][-1] if role == "first" else inbox["x"]
        pull = residuals.pullback(lay["chunk"], res["chunk"],
                                  (pieces.chunk_weights(w["chunk"]), x))
        dw_layers, dx = pull(dy)
        dw["chunk"] = pieces.chunk_grads(dw_layers)
        if role == "first":
            pull = residuals.pullback(lay["embed"], res["first"][:-1], (w["embed"],))
            (dw["embed"],) = pull(dx)
        if want_x:
            out = dx
        if want_w:
            grads = _accumulate(grads, dw, chunk)
        return res, grads, loss, out

    def branch(inbox, res, grads, loss, row):
        if kind == "F":
            out = forward(inbox, res, grads, loss, row)
        elif kind == "B" and ctx.split and role == "first":
            out = (res, grads, loss, ctx.zeros_btd)  # split B of vs 0: W does the work
        else:
            out = backward(inbox, res, grads, loss, row)
        return ctx.typed(*out, res)

    return branch


def _add_leaves(grads: dict, chunk, idx, values) -> dict:
    """Adds per-leaf block gradients (`values` for the leaves `idx`) at `chunk`."""
    leaves, treedef = jax.tree.flatten(grads["blocks"])
    for i, g in zip(idx, values):
        leaves[i] = _add_at(leaves[i], chunk, g)
    return {**grads, "blocks": jax.tree.unflatten(treedef, leaves)}


def split_action_branch(ctx: StepContext, kind: str, role: str, sync: bool = False
                        ) -> Callable:
    """A split-backward schedule's branch with W only the weight-gradient matmuls.

    F runs the chunk with a zero addend on every weight matmul's output and keeps, besides the
    residuals, each weight matmul's activation operand. B pulls back to the chunk's input,
    the addends (= every weight matmul's output gradient, kept in a "dz" slot until W) and
    the small parameters (biases, norms); W multiplies the kept output gradients with the kept
    activation operands. Virtual stage 0 has no input gradient to send; its B still pulls
    back to the embedding (and the embedding's gradient), so its B and W cost what every
    other chunk's do and lockstep ticks stay alike.

    With in-loop buckets the chunk's last W (`sync`) is still only the weight matmuls, run
    layer by layer with a bucket hook per bucket (`_synced_weight_grads`): each bucket's
    reduction over dp starts as soon as its layers' weight gradients exist, under the
    weight-gradient GEMMs of the chunk's other layers.
    """
    pieces, lay, cs = ctx.pieces, ctx.layouts, ctx.chunk_split
    run = cs.forward(pieces.remat)
    dot, other = cs.split.dot_leaves, cs.split.other_leaves(cs.n_leaves)
    n_stash = len(lay["chunk"].avals)

    def chunk_pull(res, w_chunk, x):
        w_dot, w_other = cs.layer_parts(w_chunk)
        return residuals.pullback(lay["chunk"], res["chunk"][:n_stash],
                                  (w_dot, w_other, x, ctx.z0))

    def weight_part(w_chunk, acts, dz):
        w_dot, w_other = cs.parts(w_chunk)
        _, pull = jax.vjp(lambda wd: cs.weight_matmuls(wd, w_other, acts), w_dot)
        (d_dot,) = pull(dz)
        return d_dot

    def chunk_residuals(w_chunk, x, valid=None):
        w_dot, w_other = cs.layer_parts(w_chunk)
        (y, acts), _, got, leaves = vjp_with_layout(
            lambda x_, z_, wo_: run(x_, z_, wo_, w_dot, valid), (x, ctx.z0, w_other),
            (w_dot, w_other, x, ctx.z0), has_aux=True)
        _checked(got, lay["chunk"], "chunk")
        return y, list(leaves + jax.tree.leaves(acts))

    def forward(inbox, res, grads, loss, row):
        res, loss, out = _forward_action(ctx, role, chunk_residuals, inbox, res, loss, row)
        return res, grads, loss, out

    def head_pull(res, w):
        pull = residuals.pullback(lay["head"], res["last"], (w["embed"], w["head"]))
        return pull(residuals.ones_cotangent(lay["head"]))

    def input_grads(inbox, res, grads, row):
        """B: the input gradient, each weight matmul's output gradient, the small params'."""
        chunk = row[COL["chunk"]]
        w = ctx.weights(role, chunk)
        if role == "last":
            # The head's weight gradients come with its input gradient: one pullback of the
            # head (deferred to W, it would run a second time there).
            d_embed, d_head, dy = head_pull(res, w)
            grads = _accumulate(grads, {"chunk": None, "embed": d_embed, "head": d_head},
                                chunk, blocks=False)
        else:
            dy = inbox["g"]
        x = res["first"][-1] if role == "first" else inbox["x"]
        dx, dz, d_other = chunk_pull(res, w["chunk"], x)(dy)
        return dx, stack_layers(dz), _add_leaves(grads, chunk, other, stack_layers(d_other))

    def backward(inbox, res, grads, loss, row):
        chunk = row[COL["chunk"]]
        w = ctx.weights(role, chunk)
        res, out = dict(res), ctx.zeros_btd
        if kind == "B":
            dx, dz, grads = input_grads(inbox, res, grads, row)
            res["dz"] = list(dz)
            if role == "first":  # the chunk's input gradient goes into the embedding
                pull = residuals.pullback(lay["embed"], res["first"][:-1], (w["embed"],))
                (d_embed,) = pull(dx)
                grads = {**grads, "embed": jax.tree.map(jnp.add, grads["embed"], d_embed)}
            else:
                out = dx
        else:  # W
            dz = list(res["dz"])
            acts = list(res["chunk"][n_stash:])
            if sync:
                grads = _synced_weight_grads(ctx, grads, chunk,
                                             ctx.weights(role, chunk, stored=True)["chunk"],
                                             acts, dz)
            else:
                grads = _add_leaves(grads, chunk, dot, weight_part(w["chunk"], acts, dz))
        return res, grads, loss, out

    def branch(inbox, res, grads, loss, row):
        if kind == "F":
            out = forward(inbox, res, grads, loss, row)
        else:
            out = backward(inbox, res, grads, loss, row)
        return ctx.typed(*out, res)

    return branch


def _synced_weight_grads(ctx: StepContext, grads: dict, chunk, w_chunk, acts: list,
                         dz: list) -> dict:
    """The chunk's last W with its dp reduction: every layer's weight matmuls on the kept
    activation operands, pulled back from the kept output gradients `dz`, with a bucket hook
    per bucket on the chunk's parameters (`buckets.BucketHooks`). A hook's backward adds the
    accumulated gradients -- earlier microbatches', and this microbatch's small parameters'
    from B -- to this W's weight gradients and reduces the bucket into `grads["synced"]`."""
    cs, plan, axis_sizes = ctx.chunk_split, ctx.chunk_buckets, ctx.axis_sizes
    marked, leaves, _, acc_leaves = _bucketed_chunk(ctx, grads, chunk, w_chunk)
    layers = ctx.layers_per_chunk

    def matmuls(sinks):
        hooks = buckets.BucketHooks(plan, leaves, acc_leaves, sinks, axis_sizes, marked,
                                    ctx.overlap.grad_comm_dtype)
        outs = []
        for layer in range(layers):
            hooks.enter(1 + layer)
            values = [hooks.value(i, layer) for i in range(cs.n_leaves)]
            p_l = cs.layer([values[i] for i in cs.split.dot_leaves],
                           [values[i] for i in cs.split.other_leaves(cs.n_leaves)])
            outs.append(cs.split.weight_matmuls(p_l, [a[layer] for a in acts]))
        hooks.enter(layers + 1)  # buckets completing after the chunk's layers (none here)
        return outs

    sinks = buckets.make_sinks(plan, axis_sizes, marked)
    outs, pull = jax.vjp(matmuls, sinks)
    cts = [[_ct_like(o, z[layer], axis_sizes) for o, z in zip(layer_outs, dz)]
           for layer, layer_outs in enumerate(outs)]
    (reduced_flat,) = pull(cts)
    return _store_synced(ctx, grads, chunk, reduced_flat)


def _bucketed_chunk(ctx: StepContext, grads: dict, chunk, w_chunk):
    """What a sync action's bucket hooks take: (the axes every parameter is marked varying
    over, the chunk's marked parameter leaves, their treedef, the accumulated gradients).

    Marked tp-varying too: TP-replicated leaves get partial gradients, which their buckets
    sum over ('dp', 'tp') (autodiff would psum them over tp one by one). The other actions'
    gradients of TP-replicated leaves are whole on every tp rank (autodiff summed them);
    their bucket sums over tp again, so each rank adds 1/tp.
    """
    marked = (*data_axes(ctx.axis_sizes), PP, TP)
    leaves, treedef = jax.tree.flatten(w_chunk)
    acc_leaves = [_at(a, chunk) / ctx.tp_share[i]
                  for i, a in enumerate(jax.tree.leaves(grads["blocks"]))]
    return marked, [_vary(leaf, marked) for leaf in leaves], treedef, acc_leaves


def _store_synced(ctx: StepContext, grads: dict, chunk, reduced_flat) -> dict:
    """`grads` with the chunk's reduced buckets (the sinks' cotangents) filed into
    `grads["synced"]` at `chunk`."""
    reduced = buckets.assemble(ctx.chunk_buckets, reduced_flat,
                               ctx.axis_sizes)  # leaf -> (layers, ...)
    synced, synced_def = jax.tree.flatten(grads["synced"])
    return {**grads, "synced": jax.tree.unflatten(synced_def, [
        _set_at(acc, chunk, _vary(reduced[i], sorted(_varying_axes(acc))))
        for i, acc in enumerate(synced)])}


def _ct_like(y, ct, axis_sizes: dict[str, int]):
    """A cotangent for `y` from `ct`. The bucket hooks' tp-marked weights make `y`'s *type*
    vary over axes `ct` does not while its values agree across them; vjp then reads the
    cotangent per rank and sums the ranks' contributions, so each rank takes its share."""
    extra = sorted(_varying_axes(y) - _varying_axes(ct))
    ct = ct.astype(y.dtype)
    if extra:
        ct = _vary(ct, extra) / math.prod(axis_sizes[a] for a in extra)
    return ct


def sync_branch(ctx: StepContext, kind: str, role: str, defer_embed: bool = False
                ) -> Callable:
    """The chunk's last weight-gradient action, with its dp reduction inside.

    The chunk's layers run unrolled with a bucket hook per bucket (`buckets.BucketHooks`, as
    in the pp=1 path's last microbatch): in the backward each bucket's psum is issued as soon
    as its layers' gradients (this microbatch's plus the accumulated ones) exist, and runs
    while the chunk's earlier layers backpropagate. The same branch runs at the same tick on
    every dp replica of the stage, so each collective's replica group (the stage's dp peers)
    meets.

    `defer_embed` (virtual stage 0's last one, run as the step's last tick: `_TickLoop`'s
    deferred embedding): the embedding runs outside the pullback, and the branch's output is
    the gradient of its activations instead of the embedding's gradients.
    """
    want_x = kind == "B" and role != "first"
    if defer_embed and role != "first":
        raise ValueError("sync_branch: only virtual stage 0 has an embedding to defer")
    plan, model, par, axis_sizes = ctx.chunk_buckets, ctx.model, ctx.par, ctx.axis_sizes

    def branch(inbox, res, grads, loss, row):
        mb, chunk = row[COL["microbatch"]], row[COL["chunk"]]
        w = ctx.weights(role, chunk, stored=True)
        x = ctx.action_input(role, inbox, row)
        targets_bt = ctx.targets_mbt[mb]
        marked, chunk_leaves, chunk_def, acc_leaves = _bucketed_chunk(ctx, grads, chunk,
                                                                      w["chunk"])
        others = {k: w[k] for k in ("embed", "head") if k in w}

        def forward(sinks, others_, x_, embedded=False):
            hooks = buckets.BucketHooks(plan, chunk_leaves, acc_leaves, sinks, axis_sizes,
                                        marked, ctx.overlap.grad_comm_dtype)
            h = model.embed(others_["embed"], x_, par) if role == "first" and not embedded else x_
            for layer in range(ctx.layers_per_chunk):
                hooks.enter(1 + layer)
                p_l = jax.tree.unflatten(
                    chunk_def, [hooks.value(i, layer) for i in range(len(chunk_leaves))])
                if "valid" in w:  # both branches typed like the tp-marked weights' output
                    h = _vary(h, marked)
                    h = _masked(w["valid"][layer],
                                lambda p_=p_l, h_=h: _vary(model.block(p_, h_, par), marked), h)
                else:
                    h = model.block(p_l, h, par)
            if role == "last":
                return model.head_loss(others_["embed"], others_["head"], h, targets_bt,
                                       par) / ctx.count
            return h

        sinks = buckets.make_sinks(plan, axis_sizes, marked)
        if defer_embed:  # the embedded microbatch's gradient, as if it were the chunk input's
            others = {}
            x = model.embed(w["embed"], x, par)
            y, vjp = jax.vjp(lambda s_, o_, h_: forward(s_, o_, h_, embedded=True), sinks,
                             others, x)
        elif want_x:
            y, vjp = jax.vjp(forward, sinks, others, x)
        else:
            y, vjp = jax.vjp(lambda s_, o_: forward(s_, o_, x), sinks, others)
        ct = (_vary(jnp.ones(y.shape, y.dtype), (*data_axes(axis_sizes), PP)) if role == "last"
              else inbox["g"])
        cts = vjp(_ct_like(y, ct, axis_sizes))
        grads = _store_synced(ctx, grads, chunk, cts[0])
        for part, g in cts[1].items():
            grads[part] = jax.tree.map(jnp.add, grads[part], g)
        out = cts[2] if want_x or defer_embed else ctx.zeros_btd
        return ctx.typed(res, grads, loss, out, res)

    return branch


def idle_branch(ctx: StepContext) -> Callable:
    """Branch 0: nothing to compute, nothing to send."""

    def branch(inbox, res, grads, loss, row):
        del inbox, row
        return res, grads, loss, ctx.zeros_btd

    return branch


def _ring(out_btd, pairs, zeros_btd):
    """One ppermute on the pp ring (`pairs`: the (src, dst) stages that carry data)."""
    if not pairs:
        return zeros_btd
    return jax.lax.ppermute(out_btd, PP, perm=list(pairs))  # (b, T, D) per device, over pp


def _file(pool, row, route: str, arrival):
    """Files an arrival into the slot the table names (`trash` when nothing came)."""
    return _set_at(pool, row[COL["file_" + route]], arrival)


class DeferredEmbedding(NamedTuple):
    """How a paired step ends whose last tick runs only virtual stage 0's last backward
    (`deferred_embedding`; `_TickLoop.last_tick`).

    Attributes:
      branches: the last tick's branches: that backward's (`sync_branch(defer_embed=True)`)
        hands on its embedding's activation gradient instead of adding its gradients.
      microbatch: the microbatch it runs.
      embed: the embedding's parameters as the step got them (invariant over pp and dp).
    """

    branches: list
    microbatch: int
    embed: Any


def deferred_embedding(model, program: TickProgram, accelerator: bool, synced: bool, overlap,
                       axis_sizes: dict[str, int]) -> tuple[int, int] | None:
    """(branch, microbatch) of the last tick's one action if the step can defer its
    embedding's reduction under that tick (`_TickLoop.last_tick`), else None.

    It can on an accelerator (where the all-reduce runs under the tick's GEMMs), for a paired
    table whose blocks are reduced in the loop (then the embedding and head are what is left
    for after it: one fp32 psum over (pp, dp), no slow axis) and whose last tick runs one
    action, virtual stage 0's last (sync) B, and no head: 1F1B, paired. The model's
    embedding must declare `per_example_embedding` (a decoder's token lookup does; a batch
    norm's statistics would differ for the gathered replicas' inputs).
    """
    if not (accelerator and synced and program.lanes == 2 and overlap.grad_comm_dtype == "fp32"
            and axis_sizes.get(DCN, 1) == 1 and getattr(model, "per_example_embedding", False)):
        return None
    last = program.table[-1]
    busy = np.argwhere(last[..., COL["branch"]] > 0)
    if len(busy) != 1 or last[..., COL["head_mb"]].any():
        return None
    stage, lane = busy[0]
    b = int(last[stage, lane, COL["branch"]])
    branch = program.branches[b - 1]
    if (branch.kind, branch.role, branch.sync) != ("B", "first", True):
        return None
    return b, int(last[stage, lane, COL["microbatch"]])


def run_ticks(ctx: StepContext, program: TickProgram, branches: list, pool_sbtd, res0: dict,
              accelerator: bool = True, deferred: DeferredEmbedding | None = None,
              lone_branches: list | None = None):
    """The tick loop: a `lax.scan` over the table, each stage switching to its action.

    Latency 1: a tick files last tick's arrivals, runs its action and sends its output.
    Latency 2 (skewed): a tick sends the previous tick's output before its action and files
    the arrivals after it, so the transfers run under the action.
    Paired (two lanes): each lane runs as a skewed half-tick -- the other lane's last output
    is sent before the action and filed after it -- so every transfer runs under the other
    lane's compute at latency 1. Fused pairs (`TickProgram.fused`): both lanes' actions in
    one switch, so each one's collectives run under the other's GEMMs, and the transfers
    between ticks (`_TickLoop.fused_tick`).

    The residual pools and gradient accumulators are updated in place through the tick's
    switches; XLA keeps them in place only with copy insertion's region analysis
    (`plan.PIPELINE_COPY_ANALYSIS`, which the plan's compile options and the forced host
    platform set), and otherwise copies them every tick.

    `accelerator`: the collectives run asynchronously; a paired tick then splits a
    vocabulary-parallel head around its backward lane (`_TickLoop.paired_tick`).
    `deferred`: the last tick runs apart, its embedding's reduction deferred
    (`_TickLoop.last_tick`).
    `lone_branches`: a fused program's branches for the ticks that run one action, in the
    lone context (`_lone_context`, `overlap.lone_tp_comm`); None runs them as the pairs.

    Returns:
      (grads, loss, ends): grads and loss accumulated over the step on this device; `ends`
      None, or with `deferred` the embedding's and head's gradients summed over (pp, dp).
    """
    return _TickLoop(ctx, program, branches, res0, accelerator, deferred,
                     lone_branches).run(pool_sbtd)


# A fused tick's vocabulary-parallel head at tp > 1 runs in this many parts of its
# microbatch, so one part's all-gather / reduce-scatter over tp runs under another part's
# GEMMs (GPT-1.3B pp2 x dp2 x tp2 interleaved fused, deviceless 8 x H100: collective bytes
# under GEMMs 0.696 -> 0.721, estimated step 1208.0 -> 1205.8 ms; 4 parts: 0.721, 1210.1 ms;
# steps from before the estimate counted async reduce-scatters as communication).
HEAD_HALVES = 2


class _TickLoop:
    """`run_ticks`'s loop: the per-lane switches, built once, and one tick of each kind."""

    def __init__(self, ctx: StepContext, program: TickProgram, branches: list, res0: dict,
                 accelerator: bool = True, deferred: DeferredEmbedding | None = None,
                 lone_branches: list | None = None):
        self.ctx, self.program = ctx, program
        self.stage = jax.lax.axis_index(PP)
        self.zeros = ctx.zeros_btd
        # A pool is filed at a slot the stage's table row names, so what an action files varies
        # over pp even where the pool's initial zeros do not: typed so from the start, the
        # filing switch's branches (and the scan's carry) agree. Over no other axis: a
        # residual the vjp kept invariant over dp (a batch norm's statistics, summed over dp)
        # must come back invariant, or its pullback's types no longer match.
        res0 = jax.tree.map(lambda p: _vary(p, [PP]), res0)
        # Per lane, the branches its table column takes, and whether any of them adds to the
        # gradients (a paired lane of only F's does not: its switches then neither take nor
        # return the accumulators, which XLA would otherwise copy in every branch). A W runs
        # in whichever lane its pair puts it: lane 0 of a zero-bubble table then adds too.
        self.fills = {name: program.fills(name) for name in res0}
        self.adds = [False] + [b.kind != "F" for b in program.branches]
        self.branches, self.lone_branches = branches, lone_branches
        self.lanes = self.switches(branches, slice(None), lone_branches)
        # The last tick's switches, when it runs apart (`last_tick`): only its own branches,
        # in the step's context (the lone context cost GPT-1.3B pp2 x dp2 x tp2 4 ms there:
        # the embedding's reduction already runs under that tick).
        self.deferred = deferred
        self.last_lanes = (None if deferred is None
                           else self.switches(deferred.branches, slice(-1, None)))
        self.res0 = res0
        # A paired tick splits the vocabulary-parallel head around its backward lane where
        # collectives run asynchronously (an accelerator's program).
        self.split_head = (program.vocab_parallel and program.lanes == 2 and accelerator
                           and not program.fused)
        # A split head's pending gradient where the last tick had no head: zeros, for the
        # trash slot (typed like a row's slot: varying over pp).
        self.no_head = ()
        if self.split_head:
            row0 = _at(jnp.asarray(program.table[0]), self.stage)[0]
            self.no_head = (self.zeros, jnp.full_like(row0[COL["head_slot"]], program.trash))
        self.accelerator = accelerator
        # A fused tick's head runs after its switch, with nothing else to hide its TP
        # collectives under: in two halves of the microbatch, each half's under the other's
        # GEMMs (`HEAD_HALVES`).
        self.head_halves = program.fused and accelerator and ctx.par.tp > 1

    def switches(self, branches, rows, lone_branches=None) -> list:
        """Per lane, its switches over the branches `rows` of the table take (the others
        no-ops); fused, one switch over the (lane 0, lane 1) pairs they take."""
        ctx, program = self.ctx, self.program
        if program.fused:
            pairs, index = program.lane_pairs
            return [_pair_switch(ctx, branches, self.fills, pairs,
                                 set(index[rows].ravel().tolist()), self.adds, lone_branches)]
        out = []
        for lane in range(program.lanes):
            taken = set(np.unique(program.column("branch")[rows][..., lane]).tolist())
            out.append(_lane_switches(ctx, branches, self.fills, taken,
                                      any(self.adds[b] for b in taken)))
        return out

    def head_phase(self, pool, grads, loss, out, rows, row):
        # Vocabulary-parallel head (see the module docstring), all of it at once and only on
        # a tick that has a head: the output's psum, the head's pull-back and the gradient's
        # psum, inside one cond, filed into the F's stage's slot. (A paired tick on an
        # accelerator splits it around its backward lane: `paired_tick`.)
        if not self.program.vocab_parallel:
            return pool, grads, loss
        dy, grads, loss = self.head_pullback(lambda: self.head_input(out, row), grads, loss,
                                             rows, row, summed=True)
        return _set_at(pool, row[COL["head_slot"]], dy), grads, loss

    def head_input(self, out, row):
        # The last virtual stage's output, broadcast over pp (a psum of it masked to the
        # stage whose F made it: `head_slot` is `trash` on every other stage).
        mine = row[COL["head_slot"]] != self.program.trash
        return _like(jax.lax.psum(jnp.where(mine, out, jnp.zeros_like(out)), PP), self.zeros)

    def head_gradient(self, dy):
        # The output's gradient: the stages' partial sums (`head_pullback`), over pp.
        return _like(jax.lax.psum(dy, PP), self.zeros)

    def head_pullback(self, y_of: Callable, grads, loss, rows, row, summed: bool = False):
        # This stage's vocabulary shard of the head on the broadcast output `y_of()`: its
        # loss, its head gradients, and its partial sum of the output's gradient (the sum
        # over pp if `summed`; zeros where the tick has no head). `y_of` and the sum run
        # inside the cond, so a tick without a head runs neither collective. The flag is
        # read from stage 0's row (every stage's says the same), so it is pp-invariant and
        # every stage takes the same side of the cond: the collectives inside meet. Only the
        # head's accumulators go through the cond (the pool and the blocks' stay outside it,
        # so nothing large is handed to a conditional that might copy it).
        mb1 = rows[0, 0, COL["head_mb"]]
        mine = row[COL["head_slot"]] != self.program.trash
        acc = {k: grads[k] for k in ("embed", "head")}

        def run(acc, loss):
            w = self.ctx.params
            y, targets = y_of(), self.ctx.targets_mbt[mb1 - 1]
            halves = HEAD_HALVES if self.head_halves and y.shape[0] % HEAD_HALVES == 0 else 1
            part, d_embed, d_head, dys = 0.0, None, None, []
            for y_h, t_h in zip(jnp.split(y, halves), jnp.split(targets, halves)):
                part_h, pull = jax.vjp(
                    lambda we, wh, y_, t_=t_h: self.ctx.pieces.head(we, wh, y_, t_),
                    w["embed"], w["head"], y_h)
                d_e, d_h, dy_h = pull(jnp.ones_like(part_h))
                part, dys = part + part_h, dys + [dy_h]
                d_embed = d_e if d_embed is None else jax.tree.map(jnp.add, d_embed, d_e)
                d_head = d_h if d_head is None else jax.tree.map(jnp.add, d_head, d_h)
            dy = jnp.concatenate(dys) if halves > 1 else dys[0]
            acc = _accumulate(acc, {"embed": d_embed, "head": d_head}, None, blocks=False)
            loss = loss + jnp.where(mine, part, jnp.zeros_like(part))
            dy = self.head_gradient(dy) if summed else _like(dy, self.zeros)
            return dy, _like(acc, {k: self.ctx.grads0[k] for k in acc}), _like(loss, self.ctx.loss0)

        with jax.named_scope(HEAD_SCOPE):
            dy, acc, loss = jax.lax.cond(mb1 > 0, run, lambda acc, loss: (self.zeros, acc, loss),
                                         acc, loss)
        return dy, {**grads, **acc}, loss

    def slots(self, pool, row):
        # The two slots an action can read: its input and its output gradient.
        return {"x": _at(pool, row[COL["x_slot"]]), "g": _at(pool, row[COL["g_slot"]])}

    def read_inbox(self, pool, row):
        # The action's slots, tied to the pool that holds them: arrivals filed into the pool
        # after this point then update it in place. Without the tie nothing orders these
        # reads before those writes, and XLA copies the whole pool every tick.
        return jax.lax.optimization_barrier((pool, self.slots(pool, row)))

    def act(self, pool, res, grads, loss, row, inbox=None, tie=None, lane=0, lanes=None):
        # Two switches on the row's branch. The first runs the actions that file
        # nothing into a residual pool (idle, B without a split, W...) and gets the pools
        # read-only: a branch reads its (microbatch, chunk)'s slots itself, so only the
        # actions that use a slot read it. The second runs the actions that fill pools (F; a
        # split B) and gets the pools this lane fills, to update in place at the slots the
        # table names; its other branches pass them through untouched. So no action moves
        # pool data it does not own, and nothing is made for an idle branch to copy. (One
        # switch that returned what an action made, or zeros, cost a slot-sized write per
        # idle branch; one that updated every pool in place made XLA copy each pool in every
        # branch.)
        # Likewise the activation pool: the switches get only the two slots an action can
        # read (its input and its output gradient). Handed the pool, they would hold it as
        # an operand while the other lane's arrivals are filed into it, and XLA would copy it.
        switches = (lanes or self.lanes)[lane]
        branch = row[COL["branch"]]
        if inbox is None:
            inbox = self.slots(pool, row)
        carry = (grads, loss) if switches.grads else (loss,)
        # The named scope marks the switches in the compiled HLO for `analysis.step_estimate`.
        with jax.named_scope(f"{LANE_SCOPE}{lane}"):
            carry, out = jax.lax.switch(branch, switches.plain, inbox, res, carry, row)
            kept = {name: res[name] for name in switches.pools}
            if kept:
                # The pools go to the filing switch through the plain switch's results: its
                # reads (W reads the stash F and B filled) are then ordered before the
                # in-place writes. XLA drops a switch's pass-through operands, and without
                # this tie the two switches were unordered and each pool the plain one reads
                # was copied every tick.
                kept, carry, out = jax.lax.optimization_barrier((kept, carry, out))
                read_only = {name: p for name, p in res.items() if name not in kept}
                kept, carry, out = jax.lax.switch(branch, switches.filing, inbox, read_only,
                                                  kept, carry, out, row)
        res = {**res, **kept}
        grads, loss = carry if switches.grads else (grads, carry[0])
        if tie is None:
            return res, grads, loss, out
        # Transfers that must be under this action: nothing that reads them may run before
        # the action's results exist, so their only cover is the action itself (not the slot
        # writes after it, which XLA's cost model would count as enough). One of the
        # switches' results suffices (it has them all at once); tied, the gradient
        # accumulators would be copied in every branch that hands them on.
        out, tie = jax.lax.optimization_barrier((out, tie))
        return res, grads, loss, out, tie

    def tick(self, carry, rows):
        pool, res, inbox_down, inbox_up, inbox_self, grads, loss = carry
        row = _at(rows, self.stage)[0]
        # File last tick's arrivals.
        if self.program.down_pairs:
            pool = _file(pool, row, "down", inbox_down)
        if self.program.up_pairs:  # with 2 stages both neighbours are +1: one ring suffices
            pool = _file(pool, row, "up", inbox_up)
        if self.program.local_handoff:
            pool = _file(pool, row, "self", inbox_self)
        res, grads, loss, out = self.act(pool, res, grads, loss, row)
        pool, grads, loss = self.head_phase(pool, grads, loss, out, rows, row)
        inbox_down, inbox_up = self.rings(out, self.program.down_pairs, self.program.up_pairs)
        inbox_self = out if self.program.local_handoff else inbox_self
        return (pool, res, inbox_down, inbox_up, inbox_self, grads, loss), None

    def rings(self, out, down_pairs, up_pairs):
        """(what arrives from the -1 neighbour, from the +1 neighbour): `out` sent on both
        rings. On an accelerator, one asynchronous ppermute per ring. On a CPU every
        collective is a rendezvous of all the host's device threads, and a tick's two were
        most of what a short action costs beyond its work (ZB-V on pp4 x dp2, 51 ticks: 332
        -> 261 ms, docs/results.md): there one all-gather over pp carries both."""
        if self.accelerator or not (down_pairs and up_pairs):
            return _ring(out, down_pairs, self.zeros), _ring(out, up_pairs, self.zeros)
        every = jax.lax.all_gather(out, PP)  # (stages, b, T, D), the same on every stage
        got = []
        for pairs in (down_pairs, up_pairs):
            source = np.full(self.program.schedule.stages, -1, np.int32)
            for src, dst in pairs:
                source[dst] = src
            mine = jnp.asarray(source)[self.stage]
            got.append(_like(jnp.where(mine >= 0, _at(every, jnp.maximum(mine, 0)),
                                       jnp.zeros_like(out)), self.zeros))
        return tuple(got)

    def skewed_tick(self, carry, rows_now_next):
        # Tick t sends tick t-1's output, so the transfers and this tick's action have no
        # data dependency: the ppermutes start before the action and finish after it. What
        # they bring is readable from tick t+1 on, as `transfer_latency = 2` tables expect.
        pool, res, pending, inbox_self, grads, loss = carry
        rows, rows_next = rows_now_next
        row = _at(rows, self.stage)[0]
        row_next = _at(rows_next, self.stage)[0]
        arrival_down, arrival_up = self.rings(pending, self.program.down_pairs,
                                              self.program.up_pairs)
        if self.program.local_handoff:  # same stage: readable one tick after it was made
            pool = _file(pool, row, "self", inbox_self)
        pool, inbox = self.read_inbox(pool, row)
        res, grads, loss, out, (arrival_down, arrival_up) = self.act(
            pool, res, grads, loss, row, inbox, tie=(arrival_down, arrival_up))
        pool, grads, loss = self.head_phase(pool, grads, loss, out, rows, row)
        if self.program.down_pairs:
            pool = _file(pool, row_next, "down", arrival_down)
        if self.program.up_pairs:
            pool = _file(pool, row_next, "up", arrival_up)
        return (pool, res, out, out, grads, loss), None

    def file_all(self, pool, row, inboxes, lane):
        down_pairs, up_pairs, handoff = self.program.lane_rings[lane]
        down, up, own = inboxes
        if down_pairs:
            pool = _file(pool, row, "down", down)
        if up_pairs:
            pool = _file(pool, row, "up", up)
        if handoff:
            pool = _file(pool, row, "self", own)
        return pool

    def send(self, out, lane):
        # Only the rings this lane's actions send on (one each for a paired 1F1B); a
        # same-stage hand-off is the value itself.
        down_pairs, up_pairs, _ = self.program.lane_rings[lane]
        return (*self.rings(out, down_pairs, up_pairs), out)

    def paired_tick(self, carry, rows_now_next, lanes=None, span: TickSpan | None = None):
        # Lane 0 runs the forward (or a W), lane 1 the backward (B or W), each as a skewed
        # half-tick (a W sends nothing: its lane's output is zeros, filed in `trash`): what
        # the other lane produced last is sent before this lane's action and filed after
        # it, just before the other lane runs again. So the backward's output (tick t-1)
        # travels under tick t's forward and the forward's under tick t's backward; neither
        # transfer feeds the compute beside it, and both are read at the next tick, as the
        # latency-1 table expects.
        # On an accelerator a vocabulary-parallel head is split the same way: the output's
        # broadcast over pp runs under the backward lane, the head's pull-back after it, and
        # the gradient's psum under the next tick's forward lane, filed before the backward
        # lane that reads it (the F's own stage runs that B a tick later at the earliest).
        # Both all-reduces then run every tick, zero-filled where it has no head. On a CPU,
        # where collectives are synchronous and nothing runs under them, the head runs whole
        # after the forward lane (`head_phase`), only on the ticks that have one.
        # `pending_head`: (the last tick's partial head gradient, the slot it goes to), or ()
        # unless the head is split.
        # `span`: the ticks this loop runs (`TickProgram.spans`); a part of the tick none of
        # them uses -- a lane's action, its ring, the head's all-reduces -- is left out.
        pool, res, pending_b, pending_head, grads, loss = carry
        on = span or TickSpan.every(0, 0, 2)
        rows, rows_next = rows_now_next
        now = _at(rows, self.stage)
        next_ = _at(rows_next, self.stage)
        split_head = self.split_head
        head_before, head_now = split_head and on.head_before, split_head and on.head
        arrival_b = self.send(pending_b, 1) if on.receives[1] else ()
        if head_before:  # last tick's head gradient, summed over pp under this forward
            head_dy, head_slot = pending_head
            arrival_b = (arrival_b, self.head_gradient(head_dy))
        out_f = self.zeros
        if on.acts[0]:
            pool, inbox = self.read_inbox(pool, now[0])
            res, grads, loss, out_f, arrival_b = self.act(pool, res, grads, loss, now[0], inbox,
                                                          tie=arrival_b, lanes=lanes)
        arrival_f = self.send(out_f, 0) if on.sends[0] else ()
        if head_before:
            arrival_b, dy = arrival_b
            pool = _set_at(pool, head_slot, dy)
        if head_now:
            arrival_f = (arrival_f, self.head_input(out_f, now[0]))
        elif not split_head and on.head:
            pool, grads, loss = self.head_phase(pool, grads, loss, out_f, rows, now[0])
        if on.receives[1]:
            pool = self.file_all(pool, now[1], arrival_b, 1)
        out_b = self.zeros
        if on.acts[1]:
            pool, inbox = self.read_inbox(pool, now[1])
            res, grads, loss, out_b, arrival_f = self.act(pool, res, grads, loss, now[1], inbox,
                                                          tie=arrival_f, lane=1, lanes=lanes)
        if head_now:
            arrival_f, y = arrival_f
            head_dy, grads, loss = self.head_pullback(lambda: y, grads, loss, rows, now[0])
            pending_head = (head_dy, now[0][COL["head_slot"]])
        elif split_head:
            pending_head = self.no_head
        if on.sends[0]:
            pool = self.file_all(pool, next_[0], arrival_f, 0)
        return (pool, res, out_b, pending_head, grads, loss), None

    def fused_tick(self, carry, rows_pairs, lanes=None, send=True):
        # Both lanes in one switch (`TickProgram.fused`): last tick's arrivals are filed
        # first, then the tick's pair runs, its two actions in one computation, so the
        # collectives of each (tensor-parallel all-gathers and reduce-scatters, expert
        # all-to-alls) can run under the other's GEMMs. Its outputs are sent right after
        # the switch, so the transfers run under the head phase (`head_phase`, run whole
        # after the switch, its gradient filed before any B reads it) and are read by the
        # next tick's switch. `send=False` (the last tick run after the loop): the carry
        # holds the tick's outputs instead of their arrivals.
        pool, res, arrived_b, arrived_f, grads, loss = carry
        rows, pair_rows = rows_pairs
        now = _at(rows, self.stage)
        pool = self.file_all(pool, now[0], arrived_f, 0)
        pool = self.file_all(pool, now[1], arrived_b, 1)
        pool, inboxes = jax.lax.optimization_barrier(
            (pool, (self.slots(pool, now[0]), self.slots(pool, now[1]))))
        switch = (lanes or self.lanes)[0]
        kept = {name: res[name] for name in switch.pools}
        read_only = {name: p for name, p in res.items() if name not in kept}
        step = (grads, loss) if switch.grads else (loss,)
        with jax.named_scope(f"{LANE_SCOPE}0"):
            kept, step, (out_f, out_b) = jax.lax.switch(
                _at(pair_rows, self.stage), switch.branches, inboxes, read_only, kept, step,
                (now[0], now[1]))
        res = {**res, **kept}
        grads, loss = step if switch.grads else (grads, step[0])
        sent_f, sent_b = out_f, out_b
        if send:  # issued before the head phase, so the transfers run under it
            sent_f, sent_b = self.send(out_f, 0), self.send(out_b, 1)
        pool, grads, loss = self.head_phase(pool, grads, loss, out_f, rows, now[0])
        return (pool, res, sent_b, sent_f, grads, loss), None

    def scan_spans(self, tick: Callable, carry, xs):
        """`tick` scanned over the table's rows (`xs`, the per-row inputs, all but a last tick
        that runs apart), in a loop scoped with its rows (`SPAN_SCOPE`, which
        `analysis.step_estimate` replays).

        A paired tick on an accelerator runs one loop per span of `TickProgram.spans` -- the
        fill, the steady state, the drain --, each with its own switches (over the branches
        its rows take) and only the parts of a tick its rows use: the fill sends nothing
        back and runs no head, the drain sends nothing forward. (GPT-1.3B pp4 x dp2,
        deviceless 8 x H100: 992 -> 980 ms, 0.748 -> 0.793 of the collective bytes under
        GEMMs.) Elsewhere one loop: a CPU host's collectives cost their rendezvous whether
        they carry data or not, each loop is one more body to compile, and a fused program's
        lone ticks (collective matmul at tp > 1) laid its pools out sequence-major, which
        the steady loop's carry took on and transposed back every tick (GPT-1.3B pp2 x dp2 x
        tp2: 1065 -> 1115 ms)."""
        stop = xs[0].shape[0]
        spanned = self.accelerator and self.program.lanes == 2 and not self.program.fused
        spans = self.program.spans(stop) if spanned else (
            TickSpan.every(0, stop, self.program.lanes),)
        for span in spans:
            rows = slice(span.start, span.stop)
            if len(spans) == 1:
                body, lanes = tick, None
            else:
                lanes = self.switches(self.branches, rows, self.lone_branches)
                body = partial(tick, lanes=lanes, span=span)
            with jax.named_scope(f"{SPAN_SCOPE}{span.start}_{span.stop}"):
                carry, _ = jax.lax.scan(body, carry, tuple(x[rows] for x in xs))
        return carry

    def run(self, pool_sbtd):
        """(grads, loss) after scanning the table."""
        start = (self.ctx.grads0, self.ctx.loss0)
        table = jnp.asarray(self.program.table)
        apart = self.deferred is not None
        if self.program.fused:
            pair_rows = jnp.asarray(self.program.lane_pairs[1])
            nothing = (self.zeros,) * 3  # no arrivals before the first tick (`send`)
            carry0 = (pool_sbtd, self.res0, nothing, nothing, *start)
            xs = (table, pair_rows)
            carry = self.scan_spans(self.fused_tick, carry0,
                                    tuple(x[:-1] if apart else x for x in xs))
            if apart:
                return self.last_tick(carry, table[-1], pair_rows[-1])
            (*_, grads, loss) = carry
        elif self.program.lanes == 2:
            nothing = np.full((1, *self.program.table.shape[1:]), self.program.trash, np.int32)
            table_next = jnp.asarray(np.concatenate([self.program.table[1:], nothing]))
            carry0 = (pool_sbtd, self.res0, self.zeros, self.no_head, *start)
            xs = (table, table_next)
            carry = self.scan_spans(self.paired_tick, carry0,
                                    tuple(x[:-1] if apart else x for x in xs))
            if apart:
                return self.last_tick(carry, table[-1], table_next[-1])
            (*_, grads, loss) = carry
        elif self.program.skewed:
            # Row t+1 says where the arrivals filed at the end of tick t go; nothing after the end.
            nothing = np.full((1, *self.program.table.shape[1:]), self.program.trash, np.int32)
            table_next = jnp.asarray(np.concatenate([self.program.table[1:], nothing]))
            carry0 = (pool_sbtd, self.res0, self.zeros, self.zeros, *start)
            (*_, grads, loss), _ = jax.lax.scan(self.skewed_tick, carry0, (table, table_next))
        else:
            carry0 = (pool_sbtd, self.res0, self.zeros, self.zeros, self.zeros, *start)
            (*_, grads, loss), _ = jax.lax.scan(self.tick, carry0, table)
        return grads, loss, None

    def last_tick(self, carry, rows, rows_next):
        """The step's last paired tick, run after the loop (`rows_next`: a fused program's
        pair indices of that row). It runs one action, virtual
        stage 0's last backward (`deferred_embedding`); until it ends, the tied embedding's
        gradient was complete nowhere, and its fp32 all-reduce over (pp, dp) -- the step's
        largest -- had nothing left to run under. Here the embedding and head gradients of
        every earlier tick are summed over (pp, dp) while this tick runs, and its own
        embedding is pulled back after it, sparsely: the microbatch's activation gradient
        (on stage 0) is broadcast over pp and gathered over dp with the token ids (one
        microbatch's activations per replica, not the table's rows), and every device pulls
        back every replica's embedding itself.

        Returns:
          (grads, loss, ends): `ends` the embedding's and head's gradients over (pp, dp).
        """
        ctx, deferred = self.ctx, self.deferred
        grads = carry[-2]
        ends = jax.lax.psum({k: grads[k] for k in ("embed", "head")}, (PP, DP))
        # The scope tells `analysis.step_estimate` that these switches run the last row.
        tick = (partial(self.fused_tick, send=False) if self.program.fused
                else self.paired_tick)
        with jax.named_scope(LAST_TICK_SCOPE):
            (_, _, dx, _, grads, loss), _ = tick(carry, (rows, rows_next), lanes=self.last_lanes)
        dx = jax.lax.psum(dx, PP)  # virtual stage 0's, made on stage 0 only
        dx = all_gather_invariant(dx, DP)  # (dp b, T, D), the same on every replica
        ids = all_gather_invariant(ctx.ids_mbt[deferred.microbatch], DP)  # (dp b, T)
        axes = sorted(_varying_axes(dx))
        _, pull = jax.vjp(lambda we: _vary(ctx.model.embed(we, ids, ctx.par), axes),
                          deferred.embed)
        (d_embed,) = pull(dx)
        ends["embed"] = jax.tree.map(jnp.add, ends["embed"], d_embed)
        return grads, loss, ends


# Which table column names an action's slot in each residual pool.
_POOL_SLOT = {"first": "e_slot", "last": "e_slot", "chunk": "r_slot", "dz": "z_slot"}


class _LaneSwitches(NamedTuple):
    """One lane's two switches over the table's branches (see `act` in `run_ticks`).

    Attributes:
      plain: per branch, `(inbox, pools, carry, row) -> (carry, out)`: the action, if it
        fills no pool; a no-op otherwise.
      filing: per branch, `(inbox, read_only, kept, carry, out, row) -> (kept, carry, out)`:
        the action, if it fills a pool, its slots of `kept` updated in place; else the
        operands passed through.
      pools: the residual pools this lane's actions fill (`kept`).
      grads: whether its actions add to the gradients; `carry` is `(grads, loss)` if so,
        `(loss,)` if not.
    """

    plain: list
    filing: list
    pools: tuple[str, ...]
    grads: bool


def _lane_switches(ctx: StepContext, branches: list, fills: dict[str, tuple[bool, ...]],
                   taken: set[int], grads: bool) -> _LaneSwitches:
    """The switches of a lane whose table column takes the branches `taken`.

    `branches[b](inbox, slots, grads, loss, row) -> (made, grads, loss, out)` gets and returns
    its slot of each residual pool; `fills[pool][b]` says whether it files what it made.
    """
    filler = [any(flags[b] for flags in fills.values()) for b in range(len(branches))]
    pools = tuple(name for name, flags in fills.items() if any(flags[b] for b in taken))

    def unpack(carry):
        return carry if grads else (ctx.grads0, carry[0])

    def pack(g, loss):
        return (g, loss) if grads else (loss,)

    def plain(b, fn):
        def run(inbox, res, carry, row):
            if filler[b] or b not in taken:
                return carry, ctx.zeros_btd
            _, g, loss, out = fn(inbox, _slots_of(res, row), *unpack(carry), row)
            return pack(g, loss), out
        return run

    def filing(b, fn):
        def run(inbox, read_only, kept, carry, out, row):
            if not filler[b] or b not in taken:
                return kept, carry, out
            made, g, loss, out = fn(inbox, _slots_of({**read_only, **kept}, row),
                                    *unpack(carry), row)
            kept = {name: _filed(leaves, made[name], row[COL[_POOL_SLOT[name]]])
                    if fills[name][b] else list(leaves) for name, leaves in kept.items()}
            return kept, pack(g, loss), out
        return run

    return _LaneSwitches([plain(b, fn) for b, fn in enumerate(branches)],
                         [filing(b, fn) for b, fn in enumerate(branches)], pools, grads)


class _PairSwitch(NamedTuple):
    """A fused paired program's one switch (`_TickLoop.fused_tick`).

    Attributes:
      branches: per (lane 0, lane 1) pair of `TickProgram.lane_pairs`,
        `(inboxes, read_only, kept, carry, rows) -> (kept, carry, (out 0, out 1))`: the two
        actions, what they fill filed into `kept` in place.
      pools: the residual pools its actions fill (`kept`).
      grads: whether its actions add to the gradients (as `_LaneSwitches.grads`).
    """

    branches: list
    pools: tuple[str, ...]
    grads: bool


def _pair_switch(ctx: StepContext, branches: list, fills: dict[str, tuple[bool, ...]],
                 pairs: tuple[tuple[int, int], ...], taken: set[int], adds: list[bool],
                 lone_branches: list | None = None) -> _PairSwitch:
    """The one switch of a fused paired program over `pairs`, of which the table takes
    the indices `taken` (the others are no-ops). A pair with one action runs it from
    `lone_branches` where given.

    Both actions read their slots of the pools as the tick got them: a slot one fills is
    never one the other reads (slots are allocated per tick), so XLA orders the reads before
    the in-place writes and copies nothing.
    """
    used = {b for i in taken for b in pairs[i] if b}
    grads = any(adds[b] for b in used)
    pools = tuple(name for name, flags in fills.items() if any(flags[b] for b in used))

    def one(i, pair):
        def run(inboxes, read_only, kept, carry, rows):
            outs = [ctx.zeros_btd, ctx.zeros_btd]
            if i not in taken:
                return kept, carry, tuple(outs)
            every = {**read_only, **kept}
            g, loss = carry if grads else (ctx.grads0, carry[0])
            filed = dict(kept)
            # A lone action has no other lane to hide its collectives under: it runs in
            # the lone context (`_lone_context`), if there is one.
            run_ = branches if lone_branches is None or all(pair) else lone_branches
            for lane, b in enumerate(pair):
                if not b:
                    continue
                made, g_out, loss, outs[lane] = run_[b](
                    inboxes[lane], _slots_of(every, rows[lane]), g, loss, rows[lane])
                # An action that adds nothing (F) hands back the accumulators recast: the
                # other's additions must not take them from it, or they wait for the whole
                # F and XLA runs the two actions one after the other.
                if adds[b]:
                    g = g_out
                filed = {name: _filed(leaves, made[name], rows[lane][COL[_POOL_SLOT[name]]])
                         if fills[name][b] else leaves for name, leaves in filed.items()}
            return filed, ((g, loss) if grads else (loss,)), tuple(outs)
        return run

    return _PairSwitch([one(i, pair) for i, pair in enumerate(pairs)], pools, grads)


def _slots_of(pools: dict, row) -> dict:
    """Each residual pool's slot named by the table row (reads no action uses are dead)."""
    return {name: [_at(p, row[COL[_POOL_SLOT[name]]]) for p in leaves]
            for name, leaves in pools.items()}


def _filed(leaves: list, values: list, slot) -> list:
    """`leaves` (one residual pool) with `values` written at `slot`, in place."""
    return [_like(_set_at(p, slot, v), p) for p, v in zip(leaves, values)]


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
    embedding's and head's gradients already reduced over (pp, dp) (`_TickLoop.last_tick`).
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
    params = jax.tree.map(lambda x: _vary(x, (*data, PP)), params)
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


def _vocab_shards(program: TickProgram) -> int:
    """How many ways the head's vocabulary is split over pp (1: the last stage runs it)."""
    return program.schedule.stages if program.vocab_parallel else 1


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
    z_layer = [_vary(jnp.zeros(shape, dtype), axes) for shape, dtype, axes in split.z_avals]
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
    n_chunk = program.residual_slots("chunk") + 1  # + a trash slot (see `run_ticks`)
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
            _vary(jnp.zeros((n_chunk, *a.shape), a.dtype), sorted(_varying_axes(a)))
            for a in jax.tree.leaves(acts)]
        extra = [_vary(jnp.zeros((program.residual_slots("dz") + 1, *z.shape), z.dtype),
                       sorted(_varying_axes(z))) for z in stack_layers(z0)]
    layouts = {"embed": embed_layout, "chunk": chunk_layout}
    n_first = program.residual_slots("first") + 1
    first = residuals.empty_pool(embed_layout, n_first)
    first.append(_vary(jnp.zeros((n_first, *x.shape), x.dtype), sorted(_varying_axes(x))))
    pools = {"first": first, "chunk": chunk_pool}
    if not program.vocab_parallel:  # else the head phase pulls back at once: nothing kept
        # An F branch indexes the targets by a stage-dependent microbatch: varying over pp.
        targets = _vary(targets, [PP])
        _, _, layouts["head"], _ = vjp_with_layout(
            lambda we, wh, y_: pieces.head(we, wh, y_, targets),
            (params["embed"], params["head"], y), (params["embed"], params["head"]))
        pools["last"] = [_vary(p, [PP]) for p in residuals.empty_pool(
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
            lambda b: _vary(jnp.zeros(b.shape, jnp.float32),
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
                      loss0=_vary(jnp.zeros((), jnp.float32), (*data, PP)),
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
