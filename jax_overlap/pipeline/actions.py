"""A stage's actions: the forward (F), backward (B) and weight-gradient (W) of a virtual
stage, as the `lax.switch` branches the tick loop (`tick_loop`) selects from the table,
each reading its inputs and residuals from the stage's stash slots and adding its
gradients into the stage's accumulators.

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
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from jax_overlap.overlap import buckets
from jax_overlap.parallel.collectives import Parallel
from jax_overlap.parallel.compat import varying_axes as _varying_axes
from jax_overlap.parallel.mesh import PP, TP, data_axes
from jax_overlap.parallel.remat import remat_block
from jax_overlap.pipeline import residuals
from jax_overlap.pipeline.program import COL, TickProgram
from jax_overlap.pipeline.residuals import Layout, vjp_with_layout
from jax_overlap.pipeline.slots import add_at, at, like, set_at, vary


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


def _vocab_shards(program: TickProgram) -> int:
    """How many ways the head's vocabulary is split over pp (1: the last stage runs it)."""
    return program.schedule.stages if program.vocab_parallel else 1


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
            skipped = (h, [vary(jnp.zeros(shape, dtype), axes)
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
        return [[vary(jnp.zeros(shape, dtype), axes) for shape, dtype, axes in
                 self.split.z_avals] for _ in range(layers)]

    def weight_matmuls(self, w_dot, w_other, acts) -> list:
        """Every layer's weight matmuls on the saved activation operands (one batch of
        independent GEMMs: no layer waits for another)."""
        def one(wd_l, wo_l, acts_l):
            return self.split.weight_matmuls(self.layer(wd_l, wo_l), list(acts_l))
        return jax.vmap(one)(w_dot, w_other, tuple(acts))


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
        w = {"chunk": jax.tree.map(lambda b: at(b, chunk), blocks)}
        if self.valid_vn is not None:
            w["valid"] = at(self.valid_vn, chunk)
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
        return like((res, grads, loss, out), (res0, self.grads0, self.loss0, self.zeros_btd))


def accumulate(grads: dict, dw: dict, chunk, blocks: bool = True) -> dict:
    """Adds one action's weight gradients: the chunk's layers at `chunk` (unless `blocks` is
    False), embed/head whole."""
    grads = dict(grads)
    if blocks:
        grads["blocks"] = jax.tree.map(lambda acc, g: add_at(acc, chunk, g), grads["blocks"],
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
            grads = accumulate(grads, dw, chunk)
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
        leaves[i] = add_at(leaves[i], chunk, g)
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
            grads = accumulate(grads, {"chunk": None, "embed": d_embed, "head": d_head},
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
    acc_leaves = [at(a, chunk) / ctx.tp_share[i]
                  for i, a in enumerate(jax.tree.leaves(grads["blocks"]))]
    return marked, [vary(leaf, marked) for leaf in leaves], treedef, acc_leaves


def _store_synced(ctx: StepContext, grads: dict, chunk, reduced_flat) -> dict:
    """`grads` with the chunk's reduced buckets (the sinks' cotangents) filed into
    `grads["synced"]` at `chunk`."""
    reduced = buckets.assemble(ctx.chunk_buckets, reduced_flat,
                               ctx.axis_sizes)  # leaf -> (layers, ...)
    synced, synced_def = jax.tree.flatten(grads["synced"])
    return {**grads, "synced": jax.tree.unflatten(synced_def, [
        set_at(acc, chunk, vary(reduced[i], sorted(_varying_axes(acc))))
        for i, acc in enumerate(synced)])}


def _ct_like(y, ct, axis_sizes: dict[str, int]):
    """A cotangent for `y` from `ct`. The bucket hooks' tp-marked weights make `y`'s *type*
    vary over axes `ct` does not while its values agree across them; vjp then reads the
    cotangent per rank and sums the ranks' contributions, so each rank takes its share."""
    extra = sorted(_varying_axes(y) - _varying_axes(ct))
    ct = ct.astype(y.dtype)
    if extra:
        ct = vary(ct, extra) / math.prod(axis_sizes[a] for a in extra)
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

    `defer_embed` (virtual stage 0's last one, run as the step's last tick:
    `tick_loop.DeferredEmbedding`): the embedding runs outside the pullback, and the branch's
    output is the gradient of its activations instead of the embedding's gradients.
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
                    h = vary(h, marked)
                    h = _masked(w["valid"][layer],
                                lambda p_=p_l, h_=h: vary(model.block(p_, h_, par), marked), h)
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
        ct = (vary(jnp.ones(y.shape, y.dtype), (*data_axes(axis_sizes), PP)) if role == "last"
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
