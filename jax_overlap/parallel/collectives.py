"""Tensor-parallel building blocks with their collectives written out.

Every function here is written per device (inside `jax.shard_map`) and takes a `Parallel`
context. With `tp_axis=None` the same code is the single-device reference: every collective
becomes the identity, so one model definition serves the reference, the TP run and GSPMD.

Megatron's pattern: a column-parallel matmul (weight split on its output dim) needs no
communication; the following row-parallel matmul (weight split on its input dim) produces
partial sums that one `psum` over TP completes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_overlap.parallel import collective_matmul as cm
from jax_overlap.parallel.compat import (  # noqa: F401 - re-exported for models
    sum_to_type, to_varying, vary_like, varying_axes)
from jax_overlap.parallel.remat import kept_matmul


@dataclass(frozen=True)
class Parallel:
    """How the code running on one device relates to its TP group."""

    tp_axis: str | None = None  # mesh axis name; None = single device / GSPMD
    tp: int = 1
    compute_dtype: Any = jnp.float32
    tp_comm: str = "plain"  # plain | sequence_parallel | collective_matmul
    cm_direction: str = "uni"  # collective matmul ring: uni | bi
    # Collective matmul steps as tp-grouped all-gathers / reduce-scatters instead of ring
    # ppermutes: correct inside the pipeline's per-stage branches (`collective_matmul`).
    cm_grouped: bool = False
    # The dim of a (B, T, D) activation that sequence parallelism splits over TP between
    # blocks (`overlap.sp_split`): 1, the sequence (Megatron's); 0, the microbatch's
    # sequences. Either way each rank holds 1/tp of the token rows. An all-gather on GPUs
    # concatenates along the major-most dim, so a sequence split's gathered rows land
    # sequence-major, and every weight-gradient GEMM that pairs them with batch-major rows
    # transposes them first; gathered along the batch they are already in (b, t) order.
    sp_dim: int = 1
    # Weight matmuls with their backward written out (`local_matmul`). The pipeline turns it
    # off: its B/W split (`pipeline.weight_grads`) must see the weight matmuls in the jaxpr,
    # which a custom derivative would hide.
    explicit_wgrad: bool = True
    # A vocabulary-parallel head over the pipeline (`pipeline.vocab_parallel`): every stage
    # computes the logits of its 1/vocab_shards of this TP rank's vocabulary columns
    # (`vocab_columns`), and the loss's reductions run over this axis too.
    vocab_axis: str | None = None
    vocab_shards: int = 1
    # The attention kernel blocks run (`model.attention` resolved by the plan for its
    # target): "plain" einsums, "fused" (cuDNN flash attention), or "xla" (the fused code
    # path through XLA's implementation, for tests); `parallel.attention`.
    attention: str = "plain"
    # Expert parallelism: an MoE layer sends its tokens to their experts and back in this
    # many chunks (`overlap.moe_chunks` resolved by the plan; `models/moe.expert_parallel`).
    moe_chunks: int = 1

    def __post_init__(self):
        if self.sp_dim not in (0, 1):
            raise ValueError(f"Parallel.sp_dim must be 0 (batch) or 1 (sequence), got "
                             f"{self.sp_dim}")
        if self.tp_comm == "collective_matmul":
            cm.check_dim(self.sp_dim, self.tp, self.cm_grouped)

    @property
    def active(self) -> bool:
        # A size-1 axis still types values as varying, so its collectives stay for values
        # that vary over it (see `needs_tp`).
        return self.tp_axis is not None

    @property
    def sequence_sharded(self) -> bool:
        """Between blocks, activations' token rows are split over TP (Megatron SP, over the
        sequence or the batch: `sp_dim`)."""
        return self.active and self.tp_comm in ("sequence_parallel", "collective_matmul")


def needs_tp(x: jax.Array, par: Parallel) -> bool:
    """Whether a reduction of `x` over TP does anything. On a size-1 axis it only changes
    the type of a value varying over it; one that does not (the pp=1 step leaves tp=1 out
    of every spec, `step.dp_layout`) skips it rather than emit a one-rank all-reduce, which
    XLA keeps (a launch and a copy)."""
    return par.active and (par.tp > 1 or par.tp_axis in varying_axes(x))


def tp_index(par: Parallel) -> jax.Array:
    # On a size-1 axis the index is 0, and as a constant it leaves values tp-invariant.
    return (jax.lax.axis_index(par.tp_axis) if par.active and par.tp > 1
            else jnp.zeros((), jnp.int32))


def sequence_shard(a: jax.Array, axis: int, t_local: int, par: Parallel) -> jax.Array:
    """This rank's positions [r*T/tp, (r+1)*T/tp) of per-position data (position
    embeddings) under sequence parallelism split over the sequence; `a` unchanged otherwise
    (split over the batch, every rank holds every position)."""
    if not par.sequence_sharded or par.sp_dim != 1:
        return a
    return jax.lax.dynamic_slice_in_dim(a, tp_index(par) * t_local, t_local, axis=axis)


def token_shard(a_bt: jax.Array, par: Parallel) -> jax.Array:
    """This rank's token rows of per-token data `(B, T, ...)` (token ids) under sequence
    parallelism, as `sp_scatter` splits the activations; `a_bt` unchanged otherwise."""
    if not par.sequence_sharded:
        return a_bt
    n = a_bt.shape[par.sp_dim] // par.tp
    return jax.lax.dynamic_slice_in_dim(a_bt, tp_index(par) * n, n, axis=par.sp_dim)


def sp_gather(x_btd: jax.Array, par: Parallel) -> jax.Array:
    """(B, T, D) from this rank's token rows under sequence parallelism: an all-gather over
    TP along the split dim (`Parallel.sp_dim`)."""
    return jax.lax.all_gather(x_btd, par.tp_axis, axis=par.sp_dim, tiled=True)


def sp_scatter(x_btd: jax.Array, par: Parallel) -> jax.Array:
    """This rank's token rows of the sum over TP of the partial sums `x_btd` (B, T, D)."""
    return jax.lax.psum_scatter(x_btd, par.tp_axis, scatter_dimension=par.sp_dim, tiled=True)


def psum_tp(x: jax.Array, par: Parallel) -> jax.Array:
    return jax.lax.psum(x, par.tp_axis) if needs_tp(x, par) else x


def local_matmul(x_bk: jax.Array, w_kn: jax.Array, par: Parallel) -> jax.Array:
    """x (..., K) @ w (K, N) on this device. Inside the step (`par.active`) the backward is
    written out: dx = dy w^T, and the weight gradient as ONE GEMM x^T dy contracting the
    leading dims, whose (K, N) output is already w's layout. Each cotangent is summed over
    the mesh axes it varies over and its input does not (exactly what autodiff does for the
    implicit pvary: the backward TP psum of a column-parallel input).

    Autodiff instead computes dy^T x (N, K) and transposes it. With nothing between the two
    (under GSPMD the per-layer dp all-reduce is; the step reduces over dp after the
    backward) XLA folds the transpose into the GEMM, and its CPU backend (jaxlib 0.12) runs it with
    both operands transposed (4 per layer, no YNNPACK kernel) after copying dy^T: ~10% of
    the default dp2 x tp4 step on CPU. Written as x^T dy it gets a YNNPACK GEMM, as GSPMD's
    do. A GPU GEMM takes either operand order, so there both spellings are one cuBLAS call.
    Outside the step (reference, GSPMD) this is the plain einsum.
    """
    if not par.active:
        return jnp.einsum("...k,kn->...n", x_bk, w_kn)
    if not par.explicit_wgrad:
        return jnp.einsum("...k,kn->...n", x_bk, w_kn)
    return kept_matmul(_matmul(x_bk, w_kn))  # a custom VJP: named for `save_dots`, `minimal`


@jax.custom_vjp
def _matmul(x_bk, w_kn):
    return jnp.einsum("...k,kn->...n", x_bk, w_kn)


def _matmul_fwd(x_bk, w_kn):
    return _matmul(x_bk, w_kn), (x_bk, w_kn)


def _matmul_bwd(residuals, dy_bn):
    x_bk, w_kn = residuals
    dx_bk = jnp.einsum("...n,kn->...k", dy_bn, w_kn)
    lead = tuple(range(x_bk.ndim - 1))
    dw_kn = jax.lax.dot_general(x_bk, dy_bn, ((lead, lead), ((), ())))  # x^T dy: (K, N)
    return sum_to_type(dx_bk, x_bk), sum_to_type(dw_kn, w_kn)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def column_parallel(x_btd: jax.Array, w_dn: jax.Array, par: Parallel) -> jax.Array:
    """x @ W with W split over its output dim: local output columns, no collective.

    Under sequence parallelism the input arrives split over TP (its positions, or its
    sequences: `Parallel.sp_dim`) and is all-gathered first (or, with collective matmul,
    gathered chunk by chunk under the partial matmuls).
    """
    if par.sequence_sharded:
        if par.tp_comm == "collective_matmul":
            return cm.all_gather_matmul(x_btd, w_dn, par.tp_axis, par.tp, par.cm_direction,
                                        par.cm_grouped, par.sp_dim)
        x_btd = sp_gather(x_btd, par)  # this rank's rows -> (B, T, D), over tp
    return local_matmul(x_btd, w_dn, par)


def column_parallel_parts(x_btd: jax.Array, ws_dn: Sequence[jax.Array], par: Parallel
                          ) -> list[jax.Array]:
    """`column_parallel` of x against several weights (q, k and v): one all-gather of x,
    then one GEMM per weight, so each output is its own array. One GEMM against their
    concatenation would need its output split, a copy of every part, and its backward a
    concatenation (GPT-1.3B pp4 x dp2, deviceless H100: 30 ms of a 1081 ms step). With
    collective matmul, whose partial products are placed chunk by chunk, the weights are
    concatenated and the output split.
    """
    if par.sequence_sharded and par.tp_comm == "collective_matmul":
        out = column_parallel(x_btd, jnp.concatenate(ws_dn, axis=-1), par)
        ends = np.cumsum([w.shape[-1] for w in ws_dn])[:-1]
        return jnp.split(out, ends, axis=-1)
    if par.sequence_sharded:
        x_btd = sp_gather(x_btd, par)
    # Marked varying like the weights once, not by each GEMM: one input for their backward
    # to keep (and for a split backward's W to stash), not one per part.
    x_btd = vary_like(x_btd, *ws_dn)
    return [local_matmul(x_btd, w_dn, par) for w_dn in ws_dn]


def row_parallel(h_btn: jax.Array, w_nd: jax.Array, par: Parallel) -> jax.Array:
    """h @ W with W split over its input dim: partial sums completed over TP.

    Plain TP: psum, (B, T, D) on every TP rank. Sequence parallel: psum_scatter, each rank
    keeps its token rows of the finished sum ((B, T/tp, D), or (B/tp, T, D) split over the
    batch).
    """
    if par.sequence_sharded:
        if par.tp_comm == "collective_matmul":
            return cm.matmul_reduce_scatter(h_btn, w_nd, par.tp_axis, par.tp, par.cm_direction,
                                            par.cm_grouped, par.sp_dim)
        return sp_scatter(local_matmul(h_btn, w_nd, par), par)
    partial_btd = local_matmul(h_btn, w_nd, par)
    return psum_tp(partial_btd, par)  # (B, T, D) over tp


def position_wise(x_btd: jax.Array, w_in_dn: jax.Array, fn, w_out_nd: jax.Array,
                  par: Parallel) -> jax.Array:
    """`row_parallel(fn(column_parallel(x, w_in)), w_out)` for a position-wise `fn`: an MLP.

    With collective matmul the hidden activations are never put in sequence order: the ring
    steps hand their pieces from one ring to the other (`collective_matmul.
    position_wise_ring`), and inside a pipeline at tp = 2 each sequence chunk goes through
    both matmuls on its own (`collective_matmul.gather_map_scatter`), the gather and the
    scatter each under a GEMM of the rank's own chunk.
    """
    if par.sequence_sharded and par.tp_comm == "collective_matmul":
        if not par.cm_grouped:
            return cm.position_wise_ring(x_btd, w_in_dn, fn, w_out_nd, par.tp_axis, par.tp,
                                         par.cm_direction)
        if cm.own_chunk_first(par.tp):
            return cm.gather_map_scatter(x_btd, w_in_dn, fn, w_out_nd, par.tp_axis, par.tp,
                                         par.sp_dim)
    return row_parallel(fn(column_parallel(x_btd, w_in_dn, par)), w_out_nd, par)


def vocab_embed(ids_bt: jax.Array, wte_vd: jax.Array, par: Parallel) -> jax.Array:
    """Embedding lookup with the vocabulary split over TP.

    Each rank holds rows [r*V/tp, (r+1)*V/tp); ids outside them contribute zeros and one psum
    over TP assembles the embedding.
    """
    v_local = wte_vd.shape[0]
    local_ids = ids_bt - tp_index(par) * v_local
    inside = (local_ids >= 0) & (local_ids < v_local)
    x_btd = jnp.take(wte_vd, jnp.clip(local_ids, 0, v_local - 1), axis=0)
    x_btd = jnp.where(inside[..., None], x_btd, 0)
    if par.sequence_sharded:  # (B, T, D) partial -> this rank's rows summed, over tp
        return sp_scatter(x_btd, par)
    return psum_tp(x_btd, par)  # (B, T, D) over tp


def vocab_columns(w_xv: jax.Array, par: Parallel) -> jax.Array:
    """This device's vocabulary columns of an output layer's `(..., V/tp)` weight or bias.

    Under a vocabulary-parallel head (`par.vocab_axis`) the rank `k` of that axis keeps
    columns `[k n, (k+1) n)`, `n = V / (tp vocab_shards)`; otherwise `w_xv` as it is. A model
    whose head slices its output layer through this (and computes its loss with
    `vocab_cross_entropy`) can run its head vocabulary-parallel over the pipeline.
    """
    if par.vocab_axis is None:
        return w_xv
    n = w_xv.shape[-1] // par.vocab_shards
    k = jax.lax.axis_index(par.vocab_axis)
    return jax.lax.dynamic_slice_in_dim(w_xv, k * n, n, axis=w_xv.ndim - 1)


def _vocab_index(par: Parallel) -> jax.Array:
    """Which block of `V / (tp vocab_shards)` columns this device's logits are."""
    if par.vocab_axis is None:
        return tp_index(par)
    return tp_index(par) * par.vocab_shards + jax.lax.axis_index(par.vocab_axis)


def vocab_cross_entropy(logits_btv: jax.Array, targets_bt: jax.Array, par: Parallel
                        ) -> jax.Array:
    """Per-token cross-entropy with logits split over the vocabulary on TP (and, under a
    vocabulary-parallel head, over `par.vocab_axis` as well).

    Three small reductions over those axes: the max (for stability), the sum of exponentials
    and the target logit; the full (B, T, V) logits never exist on one device.
    """
    logits_btv = logits_btv.astype(jnp.float32)
    v_local = logits_btv.shape[-1]
    # The max only stabilises the exponentials; it needs no gradient.
    local_max_bt = jax.lax.stop_gradient(logits_btv.max(-1))
    axes = ((par.tp_axis,) if needs_tp(local_max_bt, par) else ()) + (
        (par.vocab_axis,) if par.vocab_axis is not None else ())

    def total(x):
        return jax.lax.psum(x, axes) if axes else x

    max_bt = jax.lax.pmax(local_max_bt, axes) if axes else local_max_bt
    sum_exp_bt = total(jnp.exp(logits_btv - max_bt[..., None]).sum(-1))
    local_t = targets_bt - _vocab_index(par) * v_local
    inside = (local_t >= 0) & (local_t < v_local)
    picked_bt = jnp.take_along_axis(logits_btv, jnp.clip(local_t, 0, v_local - 1)[..., None],
                                    axis=-1)[..., 0]
    target_logit_bt = total(jnp.where(inside, picked_bt, 0.0))
    return jnp.log(sum_exp_bt) + max_bt - target_logit_bt
