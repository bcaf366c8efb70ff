"""Collective matmul: the TP all-gather / reduce-scatter split into ring steps under the GEMMs.

Under sequence parallelism a column-parallel matmul needs the whole sequence
(`all_gather(x) @ W`) and a row-parallel one leaves partial sums that are reduce-scattered
over the sequence (`psum_scatter(h @ W)`). Done as one collective, the GEMM waits for the
transfer (or the transfer for the GEMM). Here the sequence moves in `tp` chunks around the
TP ring with `ppermute`, and each ring step's partial matmul does not depend on the transfer
in flight, so the transfer runs under the GEMM.

The tp - 1 ring steps are unrolled, and each step's results (the chunk that arrived, the
buffers its matmul wrote) pass through one `optimization_barrier`, so XLA's GPU pipeline
cannot undo the overlap:
  * a step's partial GEMM of a chunk that arrived cannot be merged (DotMerger) with another
    step's into one GEMM of the concatenated chunks, which would wait for every transfer
    (the reduce-scatter ring's partial GEMMs read local rows only; XLA may merge those into
    one GEMM ahead of the ring, which the estimate finds cheaper than copying each step's
    rows out for its own GEMM: 1312 against 1383 ms on GPT-1.3B dp2 x tp4);
  * a transfer cannot be moved away from the GEMM it runs under: the step's permute and its
    GEMM both end at the step's barrier, and the next step's permute reads the barrier's
    output.
As a `lax.scan` (one permute + one partial GEMM per iteration) the same steps kept these
properties only by the loop's shape, and XLA:GPU copied the loop's carried buffers (the
chunk in flight, the output or accumulator) at every iteration: GPT-1.3B dp2 x tp4,
deviceless 8 x H100, 1.53 s estimated step as a scan, 1.31 s unrolled (docs/results.md).
What XLA did with the earlier shapes (DotMerger, CollectivePermuteMotion, the exposed
transfers it cost on GPT-1.3B): `docs/design/xla_notes.md`.

Directions:
  uni: one ring (rank r sends to r+1): tp-1 transfers of a (B, T/tp, .) chunk.
  bi:  each chunk is split in two halves along the sequence; one half travels +1, the
       other -1. Still tp-1 steps, but every step moves half a chunk on each direction of
       the link, so a full-duplex link finishes each step in half the time.

Numbers equal the plain collectives up to floating-point summation order (the ring adds the
partial sums in a fixed order; XLA's reduce-scatter may use another). The backward of each
ring is the other ring, written out as a custom VJP with the weight-gradient GEMMs in the
same steps (see "the two rings" below).

Grouped steps (`grouped=True`, what the plan uses at pp > 1): the same software-pipelined
steps, but each step moves its piece with an `all_gather` / `psum_scatter` over `axis` instead
of a `ppermute`. The pipeline executor runs every block inside a `lax.switch` whose branch
differs from stage to stage; a collective-permute there is matched with whatever
collective-permute the other stages run at that moment (XLA:CPU keys a permute's rendezvous by
channel id and the whole device set of its pairs, and JAX gives every permute channel 1), so
the ring read another stage's buffers (`docs/design/xla_notes.md`). An all-gather or reduce-scatter
has replica groups -- the tp peers, who all run the same branch -- so it is correct under
divergent branches. Each rank's local chunk is cut into `pieces` (tp, or the largest divisor
of T/tp below it) along the sequence; step j gathers (scatters) piece j of every chunk while
the matmul of piece j - 1 (j + 1) runs. The bytes are one all-gather's (reduce-scatter's),
the same as the ring's; the first gather (the last scatter) has no matmul to hide under.
At tp = 2 that would be half the bytes (and XLA merged the two gathers back into one), so
there the steps are own-chunk-first instead: one all-gather under the GEMM of the rank's own
chunk, one reduce-scatter under the own rows' GEMM -- the ring's single step, as a grouped
collective. An MLP between the two (`gather_map_scatter`) carries each chunk through both
GEMMs, so its hidden activations are never put in sequence order. These own-chunk-first
steps also take the rows split over the batch (`dim=0`, `overlap.sp_split: batch`): the
"chunk" is then the rank's sequences instead of its positions.

Both functions are written per device (inside `shard_map`); `tp` must equal the size of
`axis`. With tp == 1 they are a plain matmul.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_overlap.parallel.compat import sum_to_type, vary_like
from jax_overlap.parallel.remat import kept_matmul


def _ring(tp: int, shift: int) -> list[tuple[int, int]]:
    """ppermute pairs sending rank j's value to rank (j + shift) mod tp."""
    return [(j, (j + shift) % tp) for j in range(tp)]


def _halves(t_local: int) -> int:
    """Rows per half-chunk for the bidirectional ring (checked: it must split evenly)."""
    if t_local % 2:
        raise ValueError(f"collective_matmul_direction=bi splits each sequence chunk in two, "
                         f"but the local chunk has {t_local} positions (seq_len / tp is odd); "
                         f"use an even seq_len / tp or direction=uni")
    return t_local // 2


def _steps(body, carry, first: int, last: int):
    """`carry` after body(carry, i) for i in [first, last): the steps unrolled, each one's
    results tied by an optimization barrier (see the module docstring)."""
    for i in range(first, last):
        carry = jax.lax.optimization_barrier(body(carry, i))
    return carry


def _pieces(t_local: int, tp: int) -> int:
    """How many sequence pieces the grouped steps cut a local chunk into."""
    return max(k for k in range(1, tp + 1) if t_local % k == 0)


def _mm(a_btk: jax.Array, w_kn: jax.Array) -> jax.Array:
    return jnp.einsum("btk,kn->btn", a_btk, w_kn)


def _wgrad(a_btk: jax.Array, g_btn: jax.Array) -> jax.Array:
    """a^T g contracting batch and positions: (K, N), accumulated in fp32."""
    return jax.lax.dot_general(a_btk, g_btn, (((0, 1), (0, 1)), ((), ())),
                               preferred_element_type=jnp.float32)


# ------------------------------------------------------------------------- pieces by step
# Step i of the all-gather ring brings rank r the rows of sequence chunk (r - i) (lane 0: the
# whole chunk under `uni`, its first half under `bi`) and, under `bi`, the second half of
# chunk (r + i) (lane 1). The reduce-scatter ring and both backwards read their operands'
# chunks by the same step numbers, so an operand is read through `of(i, lane)`, from either
# of two holdings:
#   * the whole sequence `(B, T, N)`, in order (`_by_step`): each read is a rank-dependent
#     slice, a copy;
#   * its pieces in step order, `pieces[lane][i]` (`_in_pieces`): each read is the piece
#     itself. Between the two rings of an MLP (`position_wise_ring`) the hidden activations
#     stay so: never written into a whole-sequence buffer and never sliced back out. Such a
#     ring runs on positions-major operands, `(t, B, N)` (`_seq`): a half chunk is then a
#     contiguous block, which XLA no longer transposes around every step's barrier
#     (GPT-1.3B dp2 x tp4, deviceless H100: 1250 -> 1208 ms a step).


def _step_row(rank, i: int, lane: int, t_local: int, tp: int, half: int):
    """The first sequence position of what step i brings on `lane` (see above; `half` is
    `t_local` under `uni`, whose steps have lane 0 only)."""
    return ((rank - i) % tp) * t_local if lane == 0 else ((rank + i) % tp) * t_local + half


def _by_step(a_btn: jax.Array, axis: str, tp: int, direction: str):
    """`of(i, lane)`: the rows step i reads of a whole-sequence operand (see above)."""
    t_local = a_btn.shape[1] // tp
    rank = jax.lax.axis_index(axis)
    size = t_local if direction == "uni" else _halves(t_local)
    return lambda i, lane: jax.lax.dynamic_slice_in_dim(
        a_btn, _step_row(rank, i, lane, t_local, tp, size), size, axis=1)


def _seq(pieces: bool) -> int:
    """The sequence axis of a ring's operands: 0 for pieces (`(t, B, N)`), else 1."""
    return 0 if pieces else 1


def _split(a, half: int, seq: int):
    """`a`'s first `half` positions and the rest, along its sequence axis `seq`."""
    return (jax.lax.slice_in_dim(a, 0, half, axis=seq),
            jax.lax.slice_in_dim(a, half, a.shape[seq], axis=seq))


def _in_pieces(pieces):
    """`of(i, lane)` of an operand held as `pieces[lane][i]` (step i mod tp)."""
    return lambda i, lane: pieces[lane][i % len(pieces[lane])]


def _reader(a, pieces: bool, axis: str, tp: int, direction: str):
    """`of(i, lane)` of `a`, held as pieces or as the whole sequence."""
    return _in_pieces(a) if pieces else _by_step(a, axis, tp, direction)


# --------------------------------------------------------------------------- the two rings
# Each op is a custom VJP whose backward is the other ring, with the weight gradient's GEMMs
# in the same steps: the all-gather ring's input gradient is a reduce-scatter ring of
# dy @ w^T, beside which the saved input chunk travels the ring again for its weight GEMMs;
# the reduce-scatter ring's input gradient is an all-gather ring of dz, each arriving chunk
# also giving its weight GEMM. Only the local chunk (and h) is kept from the forward.
# Autodiff of the forward loops instead carried a whole-sequence gradient buffer through
# the loop, updated at a dynamic slice each step, and XLA:GPU copied that buffer at every
# step; keeping the gathered input instead cost a whole sequence per layer (Llama-3-8B
# dp2 x tp4 no longer fit 80 GB).
# Operands are named for the usual `(B, t, .)`; an MLP's pieces run positions-major,
# `(t, B, .)`, with `seq = 0` (`_seq`).


def _all_gather_ring(x_btd, w_dn, axis: str, tp: int, direction: str, rows_of=None,
                     pieces: bool = False):
    """`all_gather(x) @ w` by ring steps; with `rows_of(i, lane)` (the rows step i reads of
    another `(B, T, K)` operand, `_by_step` / `_in_pieces`) also `sum over chunks of
    rows_of^T @ x_chunk`, `(K, D)` fp32.

    Each step's matmul is written into a whole-sequence buffer carried through the steps at
    the chunk's rows (XLA:GPU updates it in place; stacked as a scan's per-step outputs
    instead, the writes became async fusions that XLA scheduled under the transfers, leaving
    the matmuls outside them); with `pieces`, it is kept as it is, in step order: the result
    is then `pieces[lane][i]` (`_in_pieces`).
    """
    seq = _seq(pieces)
    t_local, d = x_btd.shape[seq], x_btd.shape[2]
    rank = jax.lax.axis_index(axis)
    lanes = 1 if direction == "uni" else 2
    half = t_local if direction == "uni" else _halves(t_local)
    out_dtype = jnp.result_type(x_btd.dtype, w_dn.dtype)
    out = (((),) * lanes if pieces else
           vary_like(jnp.zeros((x_btd.shape[0], t_local * tp, w_dn.shape[1]), out_dtype),
                     x_btd, w_dn))
    dw = None
    if rows_of is not None:
        dw = vary_like(jnp.zeros((rows_of(0, 0).shape[2], d), jnp.float32), x_btd,
                       rows_of(0, 0))

    def place(bufs, piece_btd, i, lane=0):
        out, dw = bufs
        y_btn = _mm(piece_btd, w_dn)
        if pieces:
            out = tuple(o + (y_btn,) if k == lane else o for k, o in enumerate(out))
        else:
            out = jax.lax.dynamic_update_slice_in_dim(
                out, y_btn, _step_row(rank, i, lane, t_local, tp, half), axis=1)
        if dw is not None:
            dw = dw + _wgrad(rows_of(i, lane), piece_btd)
        return out, dw

    if direction == "uni":
        def step(carry, i):
            # Rank r holds chunk (r - i) mod tp. The next chunk's transfer does not depend
            # on this chunk's matmul: it runs under it.
            bufs, chunk_btd = carry
            nxt_btd = jax.lax.ppermute(chunk_btd, axis, _ring(tp, 1))  # (B, T/tp, D), over tp
            return place(bufs, chunk_btd, i), nxt_btd

        bufs, chunk_btd = _steps(step, ((out, dw), x_btd), 0, tp - 1)
        # The last chunk arrives with no transfer left to hide: its matmul ends the op.
        return place(bufs, chunk_btd, tp - 1)

    def both(bufs, fwd_btd, bwd_btd, i):
        # Step i: first half of chunk (r - i), second half of chunk (r + i).
        return place(place(bufs, fwd_btd, i, 0), bwd_btd, i, 1)

    def step_bi(carry, i):
        bufs, fwd_btd, bwd_btd = carry
        nxt_fwd = jax.lax.ppermute(fwd_btd, axis, _ring(tp, 1))  # (B, T/2tp, D), over tp
        nxt_bwd = jax.lax.ppermute(bwd_btd, axis, _ring(tp, -1))  # (B, T/2tp, D), over tp
        return both(bufs, fwd_btd, bwd_btd, i), nxt_fwd, nxt_bwd

    carry = ((out, dw), *_split(x_btd, half, seq))  # halves go +1 and -1
    bufs, fwd_btd, bwd_btd = _steps(step_bi, carry, 0, tp - 1)
    return both(bufs, fwd_btd, bwd_btd, tp - 1)


def _ring_add(arrived, own):
    """`arrived + own` of a reduce-scatter ring step, after a barrier: fused into the own
    GEMM's epilogue, the add would make that GEMM wait for the transfer it should hide
    (GPT-1.3B dp2 x tp4, positions-major MLP pieces: four of every layer's forward transfers
    ran synchronously, 0.968 of the bytes under GEMMs; with the barrier 0.995, for 13 ms a
    step more. The backward's rings keep their transfers under the weight-gradient GEMMs
    with the add fused; a barrier there cost 25 ms.)"""
    arrived, own = jax.lax.optimization_barrier((arrived, own))
    return arrived + own


def _reduce_scatter_ring(h_of, w_nd, axis: str, tp: int, direction: str, seq: int = 1):
    """`psum_scatter(h @ w)` by ring steps, `h` read through `h_of(i, lane)`."""
    def part(i, lane=0):
        return _mm(h_of(i, lane), w_nd)

    if direction == "uni":
        # The accumulator on rank r at step i is for chunk (r - 1 - i) mod tp; after tp - 1
        # moves to r + 1 it lands on its owner with every rank's term added.
        def step(acc_btd, i):
            own_btd = part(1 + i)
            acc_btd = jax.lax.ppermute(acc_btd, axis, _ring(tp, 1))  # (B, T/tp, D), over tp
            return _ring_add(acc_btd, own_btd)

        # Every move is a step with a GEMM beside it, the last (own chunk) too.
        return _steps(step, part(1), 1, tp)

    # First halves accumulate along +1 (chunk (r - 1 - i)), second halves along -1
    # (chunk (r + 1 + i)); both end on their owner after tp - 1 moves.
    def step_bi(carry, i):
        acc_fwd, acc_bwd = carry
        own_fwd, own_bwd = part(1 + i, 0), part(1 + i, 1)
        acc_fwd = jax.lax.ppermute(acc_fwd, axis, _ring(tp, 1))  # (B, T/2tp, D), over tp
        acc_bwd = jax.lax.ppermute(acc_bwd, axis, _ring(tp, -1))  # (B, T/2tp, D), over tp
        return _ring_add(acc_fwd, own_fwd), _ring_add(acc_bwd, own_bwd)

    acc_fwd, acc_bwd = _steps(step_bi, (part(1, 0), part(1, 1)), 1, tp)
    return jnp.concatenate([acc_fwd, acc_bwd], axis=seq)


def _all_gather_matmul_grads(x_btd, w_dn, dy_of, axis: str, tp: int, direction: str,
                             seq: int = 1):
    """`(dx, dw)` of `all_gather(x) @ w` (dy read through `dy_of(i, lane)`): a reduce-scatter
    ring of dy @ w^T for dx, and in the same steps x's chunks travelling the ring again, each
    giving its GEMM of dw (fp32)."""
    w_nd = w_dn.T
    dw = vary_like(jnp.zeros(w_dn.shape, jnp.float32), x_btd, dy_of(0, 0))

    if direction == "uni":
        def step(carry, k):
            # Reduce-scatter step k + 1: the accumulator for chunk (r - 2 - k) arrives while
            # this rank's term for it is computed; gather step k: chunk (r - k) of x.
            acc_btd, chunk_btd, dw = carry
            own_btd = _mm(dy_of(2 + k, 0), w_nd)
            acc_btd = jax.lax.ppermute(acc_btd, axis, _ring(tp, 1))  # (B, T/tp, D), over tp
            nxt_btd = jax.lax.ppermute(chunk_btd, axis, _ring(tp, 1))  # (B, T/tp, D), over tp
            dw = dw + _wgrad(chunk_btd, dy_of(k, 0))
            return acc_btd + own_btd, nxt_btd, dw

        first = _mm(dy_of(1, 0), w_nd)
        dx_btd, chunk_btd, dw = _steps(step, (first, x_btd, dw), 0, tp - 1)
        return dx_btd, dw + _wgrad(chunk_btd, dy_of(tp - 1, 0))  # chunk (r - (tp - 1))
    half = _halves(x_btd.shape[seq])

    def step_bi(carry, k):
        acc_fwd, acc_bwd, fwd_btd, bwd_btd, dw = carry
        own_fwd = _mm(dy_of(2 + k, 0), w_nd)
        own_bwd = _mm(dy_of(2 + k, 1), w_nd)
        acc_fwd = jax.lax.ppermute(acc_fwd, axis, _ring(tp, 1))  # (B, T/2tp, D), over tp
        acc_bwd = jax.lax.ppermute(acc_bwd, axis, _ring(tp, -1))  # (B, T/2tp, D), over tp
        nxt_fwd = jax.lax.ppermute(fwd_btd, axis, _ring(tp, 1))  # (B, T/2tp, D), over tp
        nxt_bwd = jax.lax.ppermute(bwd_btd, axis, _ring(tp, -1))  # (B, T/2tp, D), over tp
        dw = dw + _wgrad(fwd_btd, dy_of(k, 0)) + _wgrad(bwd_btd, dy_of(k, 1))
        return acc_fwd + own_fwd, acc_bwd + own_bwd, nxt_fwd, nxt_bwd, dw

    carry = (_mm(dy_of(1, 0), w_nd), _mm(dy_of(1, 1), w_nd), *_split(x_btd, half, seq), dw)
    acc_fwd, acc_bwd, fwd_btd, bwd_btd, dw = _steps(step_bi, carry, 0, tp - 1)
    # The last chunks: (r - (tp - 1)) = (r + 1)'s first half, (r + (tp - 1))'s second.
    dw = dw + _wgrad(fwd_btd, dy_of(tp - 1, 0)) + _wgrad(bwd_btd, dy_of(tp - 1, 1))
    return jnp.concatenate([acc_fwd, acc_bwd], axis=seq), dw


def _typed(grads, primals):
    """Each gradient in its primal's dtype, summed over the axes the primal does not vary
    over (`sum_to_type`)."""
    return jax.tree.map(lambda g, p: sum_to_type(g.astype(p.dtype), p), grads, primals)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _ring_all_gather_matmul(x_btd, w_dn, axis: str, tp: int, direction: str, pieces: bool):
    return _all_gather_ring(x_btd, w_dn, axis, tp, direction, pieces=pieces)[0]


def _ring_all_gather_matmul_fwd(x_btd, w_dn, axis, tp, direction, pieces):
    return _ring_all_gather_matmul(x_btd, w_dn, axis, tp, direction, pieces), (x_btd, w_dn)


def _ring_all_gather_matmul_bwd(axis, tp, direction, pieces, residuals, dy):
    x_btd, w_dn = residuals
    dy_of = _reader(dy, pieces, axis, tp, direction)
    return _typed(_all_gather_matmul_grads(x_btd, w_dn, dy_of, axis, tp, direction,
                                           _seq(pieces)),
                  (x_btd, w_dn))


_ring_all_gather_matmul.defvjp(_ring_all_gather_matmul_fwd, _ring_all_gather_matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _ring_matmul_reduce_scatter(h, w_nd, axis: str, tp: int, direction: str, pieces: bool):
    return _reduce_scatter_ring(_reader(h, pieces, axis, tp, direction), w_nd, axis, tp,
                                direction, _seq(pieces))


def _ring_matmul_reduce_scatter_fwd(h, w_nd, axis, tp, direction, pieces):
    return _ring_matmul_reduce_scatter(h, w_nd, axis, tp, direction, pieces), (h, w_nd)


def _ring_matmul_reduce_scatter_bwd(axis, tp, direction, pieces, residuals, dz_btd):
    # dh = all_gather(dz) @ w^T, and each arriving chunk of dz gives its GEMM of dw = h^T dz.
    h, w_nd = residuals
    dh, dw_nd = _all_gather_ring(dz_btd, w_nd.T, axis, tp, direction,
                                 rows_of=_reader(h, pieces, axis, tp, direction),
                                 pieces=pieces)
    return _typed((dh, dw_nd), (h, w_nd))


_ring_matmul_reduce_scatter.defvjp(_ring_matmul_reduce_scatter_fwd,
                                   _ring_matmul_reduce_scatter_bwd)


# ------------------------------------------------------------------------------ public ops


def all_gather_matmul(x_btd: jax.Array, w_dn: jax.Array, axis: str, tp: int,
                      direction: str = "uni", grouped: bool = False, dim: int = 1) -> jax.Array:
    """`all_gather(x, axis, seq) @ w`, with the gather done as ring steps under the matmuls.

    Args:
      x_btd: (B, T/tp, D) this rank's sequence chunk (chunk r on rank r).
      w_dn: (D, N) this rank's weight columns.
      axis: the TP mesh axis name.
      tp: size of `axis`.
      direction: 'uni' (one ring) or 'bi' (half-chunks on both rings).
      grouped: steps are all-gathers of sequence pieces (see the module docstring);
        `direction` is then unused.
      dim: the dim `x_btd` is split along: 1, the sequence; 0, the batch (own chunk first
        only: grouped at tp = 2).

    Returns:
      (B, T, N): every position of the sequence times this rank's columns.
    """
    if tp == 1:
        return jnp.einsum("btd,dn->btn", x_btd, w_dn)
    check_dim(dim, tp, grouped)
    if grouped:
        return _grouped_all_gather_matmul(x_btd, w_dn, axis, tp, dim)
    if direction == "bi":
        _halves(x_btd.shape[1])
    return kept_matmul(_ring_all_gather_matmul(x_btd, w_dn, axis, tp, direction, False))


def matmul_reduce_scatter(h_btn: jax.Array, w_nd: jax.Array, axis: str, tp: int,
                          direction: str = "uni", grouped: bool = False, dim: int = 1
                          ) -> jax.Array:
    """`psum_scatter(h @ w, axis, seq)`, with the reduce-scatter done as ring steps.

    A partial-sum accumulator for one output chunk travels the ring; every rank adds its own
    partial product for that chunk. The product for the next step does not depend on the
    accumulator in flight, so it runs while the accumulator moves.

    Args:
      h_btn: (B, T, N) the whole sequence, this rank's slice of the contracted dim.
      w_nd: (N, D) this rank's weight rows.
      axis: the TP mesh axis name.
      tp: size of `axis`.
      direction: 'uni' or 'bi'.
      grouped: steps are reduce-scatters of sequence pieces (see the module docstring);
        `direction` is then unused.
      dim: the dim the result is split along (as `all_gather_matmul`'s).

    Returns:
      (B, T/tp, D): rows [r*T/tp, (r+1)*T/tp) of the sum over ranks of h @ w (split over
      the batch: (B/tp, T, D), sequences [r*B/tp, (r+1)*B/tp)).
    """
    if tp == 1:
        return jnp.einsum("btn,nd->btd", h_btn, w_nd)
    check_dim(dim, tp, grouped)
    if grouped:
        return _grouped_matmul_reduce_scatter(h_btn, w_nd, axis, tp, dim)
    if direction == "bi":
        _halves(h_btn.shape[1] // tp)
    return kept_matmul(_ring_matmul_reduce_scatter(h_btn, w_nd, axis, tp, direction, False))


def position_wise_ring(x_btd: jax.Array, w_in_dn: jax.Array, fn, w_out_nd: jax.Array,
                       axis: str, tp: int, direction: str = "uni") -> jax.Array:
    """`psum_scatter(fn(all_gather(x) @ w_in) @ w_out)` for a position-wise `fn` (an MLP) by
    the two rings, the hidden activations kept as the all-gather ring's pieces.

    The same steps, transfers and GEMMs as `all_gather_matmul` then `matmul_reduce_scatter`,
    but the reduce-scatter ring reads step i's piece where the all-gather ring left it, so the
    `(B, T, N)` hidden is never written into sequence order nor sliced back out by rank; `fn`
    runs on each piece. The backward likewise hands the pieces' gradients from one ring to
    the other.

    Args:
      x_btd: (B, T/tp, D) this rank's sequence chunk.
      w_in_dn: (D, N) this rank's columns of the first matmul.
      fn: position-wise `(B, t, N) -> (B, t, N')` (bias, activation, gating), run on each
        piece.
      w_out_nd: (N', D) this rank's rows of the second matmul.
      axis, tp: the TP mesh axis and its size.
      direction: 'uni' or 'bi' (see the module docstring).

    Returns:
      (B, T/tp, D): this rank's chunk of the sum over ranks.
    """
    if tp == 1:
        return _mm(fn(_mm(x_btd, w_in_dn)), w_out_nd)
    if direction == "bi":
        _halves(x_btd.shape[1])
    x_tbd = jnp.swapaxes(x_btd, 0, 1)
    hidden = kept_matmul(_ring_all_gather_matmul(x_tbd, w_in_dn, axis, tp, direction, True))

    def fn_tbn(h_tbn):  # `fn` sees (B, t, N), as documented; XLA fuses the transposes
        return jnp.swapaxes(fn(jnp.swapaxes(h_tbn, 0, 1)), 0, 1)

    out_tbd = kept_matmul(_ring_matmul_reduce_scatter(jax.tree.map(fn_tbn, hidden), w_out_nd,
                                                      axis, tp, direction, True))
    return jnp.swapaxes(out_tbd, 0, 1)


def own_chunk_first(tp: int) -> bool:
    """Whether grouped steps run own chunk first (see the module docstring): at tp = 2."""
    return tp == 2


def check_dim(dim: int, tp: int, grouped: bool) -> None:
    """Raises unless steps of this kind take rows split along `dim`: the ring's steps and the
    grouped pieces cut the sequence (dim 1); only own-chunk-first steps take a chunk of any
    dim."""
    if dim != 1 and not (grouped and own_chunk_first(tp)):
        raise ValueError(f"collective matmul: rows split along dim {dim} need grouped steps "
                         f"at tp = 2: the ring cuts the sequence (got grouped={grouped}, "
                         f"tp={tp})")


def _merged(a: jax.Array, dim: int) -> jax.Array:
    """`a` with dims `dim` and `dim + 1` merged into one."""
    return a.reshape(a.shape[:dim] + (a.shape[dim] * a.shape[dim + 1],) + a.shape[dim + 2:])


def _chunks(a: jax.Array, dim: int, tp: int) -> jax.Array:
    """`a` with dim `dim` split into (tp, its size / tp): the ranks' chunks."""
    return a.reshape(a.shape[:dim] + (tp, a.shape[dim] // tp) + a.shape[dim + 1:])


@jax.custom_vjp
def _fork(x):
    """`(x, x)`, whose backward adds the two cotangents only after an optimization barrier.

    `_gather_under` uses `x` twice: in the own chunk's GEMM and in the all-gather. In the
    backward their cotangents are the own GEMM's input gradient and the reduce-scatter of
    the other chunks' (the all-gather's transpose). Summed by autodiff, XLA fuses the add
    into the own GEMM's epilogue, and that GEMM then waits for the reduce-scatter; summed
    after a barrier, the reduce-scatter runs under it."""
    return x, x


def _fork_fwd(x):
    return (x, x), None


def _fork_bwd(_, cts):
    own, gathered = jax.lax.optimization_barrier(cts)
    return (own + gathered,)


_fork.defvjp(_fork_fwd, _fork_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _swap(x, axis: str):
    """The other rank's `x` over a size-2 `axis`: an exchange, written as an all-gather (a
    permute inside the pipeline's branches is not safe, see the module docstring) and a
    read of the other half. Its own transpose: the backward swaps the cotangents back, one
    all-gather again, where autodiff would reduce-scatter a zero-padded buffer."""
    gathered = jax.lax.all_gather(x, axis)  # (2, ...), over axis
    return jax.lax.dynamic_index_in_dim(gathered, 1 - jax.lax.axis_index(axis), axis=0,
                                        keepdims=False)


def _swap_fwd(x, axis):
    return _swap(x, axis), None


def _swap_bwd(axis, _, ct):
    return (_swap(ct, axis),)


_swap.defvjp(_swap_fwd, _swap_bwd)


def _gather_under(x_btd, own_fn, axis: str, tp: int, dim: int = 1):
    """Gathers the other ranks' chunks of `x` (split along `dim`) over `axis` while
    `own_fn(x)` runs on the rank's own chunk (at tp = 2 an exchange, `_swap`).

    Returns:
      (own_fn(x), [(chunk, rows)] for every other rank's chunk, rows shaped as `x_btd`).
    """
    rank = jax.lax.axis_index(axis)
    x_btd, x_sent = _fork(x_btd)
    if tp == 2:
        others = [(1 - rank, _swap(x_sent, axis))]
    else:
        gathered = jax.lax.all_gather(x_sent, axis, axis=dim)  # tp chunks at `dim`, over tp
        others = [(c, jax.lax.dynamic_index_in_dim(gathered, c, axis=dim, keepdims=False))
                  for c in ((rank + i) % tp for i in range(1, tp))]
    # The barrier keeps the own work ahead of the gather's end: XLA would otherwise fuse the
    # own GEMM with the other chunks' (one GEMM of the concatenated rows, after the gather).
    own, others = jax.lax.optimization_barrier((own_fn(x_btd), others))
    return own, others


def _scatter_under(others, own_in, own_fn, axis: str, tp: int, like, dim: int = 1):
    """This rank's rows of the sum over `axis`: the other ranks' partial products `others`
    ([(chunk, rows)], each a chunk along `dim`) reduce-scattered while `own_fn(own_in)`, the
    own rows' partial product, runs; `like`: the arrays the zero blocks take their varying
    axes from. At tp = 2 the reduce-scatter is an exchange (`_swap`): the same bytes,
    without its zero-padded input."""
    if tp == 2:
        sent = others[0][1]
    else:
        sent = _placed(others, None, tp, like, dim)
    # The barrier puts the own GEMM after the others' (else XLA fuses them into one GEMM
    # that the reduce-scatter waits for).
    sent, own_in = jax.lax.optimization_barrier((sent, own_in))
    if tp == 2:
        arrived = _swap(sent, axis)
    else:
        arrived = jax.lax.psum_scatter(sent, axis, scatter_dimension=dim)  # the own chunk
    # And the sum after a second one: fused into the GEMM's epilogue, the add would make the
    # own GEMM wait for the reduce-scatter.
    arrived, own = jax.lax.optimization_barrier((arrived, own_fn(own_in)))
    return arrived + own


def _own_first_all_gather_matmul(x_btd, w_dn, axis: str, tp: int, dim: int = 1) -> jax.Array:
    """`all_gather_matmul` as one all-gather under the GEMM of the rank's own chunk.

    The own chunk needs no transfer, so its GEMM runs while the other chunks are gathered;
    the other chunks' GEMMs follow. At tp = 2 this is the ring's single step. Autodiff gives
    the backward the same shape: the other chunks' input gradients are reduce-scattered
    under the own chunk's."""
    own, others = _gather_under(x_btd, lambda a: _mm(a, w_dn), axis, tp, dim)
    out = _placed([(c, _mm(rows, w_dn)) for c, rows in others],
                  (jax.lax.axis_index(axis), own), tp, (x_btd, w_dn), dim)
    return _merged(out, dim)


def _placed(blocks, own, tp: int, like, dim: int = 1) -> jax.Array:
    """`(B, tp, t, N)` (`dim` 1; 0: `(tp, b, T, N)`): each `(chunk, rows)` of `blocks` (and
    `own`, if given) at its chunk's index along `dim`, zeros elsewhere; `like`: the arrays
    the zeros take their varying axes from.

    Written as one select per index, not as updates of a zero buffer: XLA shares one zero
    constant between the layers' buffers and copies it before every in-place update (GPT-1.3B
    pp2 x dp2 x tp2: a 128 MiB copy per layer), and the selects are one fusion that writes
    each block once."""
    every = list(blocks) + ([own] if own is not None else [])
    zero = vary_like(jnp.zeros_like(every[0][1]), *like)
    out = []
    for j in range(tp):
        block = zero
        for chunk, value in every:
            block = jnp.where(chunk == j, value, block)
        out.append(block)
    return jnp.stack(out, axis=dim)


def _own_last_matmul_reduce_scatter(h_btn, w_nd, axis: str, tp: int, dim: int = 1
                                    ) -> jax.Array:
    """`matmul_reduce_scatter` as one reduce-scatter under the GEMM of the rank's own rows.

    The other ranks' rows are multiplied first and reduce-scattered (the own rows' block
    left zero) while the own rows' partial product runs; it is added to what arrives."""
    rank = jax.lax.axis_index(axis)
    h4 = _chunks(h_btn, dim, tp)

    def rows(chunk):
        return jax.lax.dynamic_index_in_dim(h4, chunk, axis=dim, keepdims=False)

    others = [(c, _mm(rows(c), w_nd)) for c in ((rank + i) % tp for i in range(1, tp))]
    return _scatter_under(others, rows(rank), lambda r: _mm(r, w_nd), axis, tp,
                          (h_btn, w_nd), dim)


def gather_map_scatter(x_btd: jax.Array, w_in_dn: jax.Array, fn, w_out_nd: jax.Array,
                       axis: str, tp: int, dim: int = 1) -> jax.Array:
    """`psum_scatter(fn(all_gather(x) @ w_in) @ w_out)` for a position-wise `fn` (an MLP),
    each chunk of rows carried through both matmuls on its own.

    The rows never need the sequence's order, so the hidden activations are never assembled
    or sliced (`all_gather_matmul` then `matmul_reduce_scatter` would write the whole
    `(B, T, N)` hidden in order and read it back by rank). The all-gather runs under the
    own chunk's first GEMM; the other chunks go through both GEMMs; their partial sums are
    reduce-scattered under the own chunk's second GEMM.

    Args:
      x_btd: (B, T/tp, D) this rank's sequence chunk.
      w_in_dn: (D, N) this rank's columns of the first matmul.
      fn: position-wise `(B, t, N) -> (B, t, N')` (bias, activation, gating).
      w_out_nd: (N', D) this rank's rows of the second matmul.
      axis, tp: the TP mesh axis and its size.
      dim: the dim `x_btd` is split along (1, the sequence; 0, the batch).

    Returns:
      (B, T/tp, D): this rank's chunk of the sum over ranks (shaped as `x_btd`).
    """
    def hidden(rows):
        return fn(_mm(rows, w_in_dn))

    if tp == 1:
        return _mm(hidden(x_btd), w_out_nd)
    own_h, others = _gather_under(x_btd, hidden, axis, tp, dim)
    parts = [(chunk, _mm(hidden(rows), w_out_nd)) for chunk, rows in others]
    return _scatter_under(parts, own_h, lambda h: _mm(h, w_out_nd), axis, tp,
                          (x_btd, w_in_dn, w_out_nd), dim)


def _grouped_all_gather_matmul(x_btd, w_dn, axis: str, tp: int, dim: int = 1) -> jax.Array:
    """`all_gather_matmul` with each step an all-gather of one sequence piece of every chunk."""
    if own_chunk_first(tp):
        return _own_first_all_gather_matmul(x_btd, w_dn, axis, tp, dim)
    b, t_local, _ = x_btd.shape
    k = _pieces(t_local, tp)
    size = t_local // k
    out_dtype = jnp.result_type(x_btd.dtype, w_dn.dtype)
    out = vary_like(jnp.zeros((b, tp, t_local, w_dn.shape[1]), out_dtype), x_btd, w_dn)

    def gather(j):  # piece j of every rank's chunk: (B, tp * size, D), rank-major
        piece = jax.lax.dynamic_slice_in_dim(x_btd, j * size, size, axis=1)
        return jax.lax.all_gather(piece, axis, axis=1, tiled=True)  # over tp

    def place(out, got_btd, j):
        part = jnp.einsum("btd,dn->btn", got_btd, w_dn).reshape(b, tp, size, -1)
        return jax.lax.dynamic_update_slice_in_dim(out, part, j * size, axis=2)

    def step(carry, j):
        # The next piece's gather does not depend on this piece's matmul: it runs under it.
        out, got_btd = carry
        return place(out, got_btd, j), gather(j + 1)

    out, got_btd = _steps(step, (out, gather(0)), 0, k - 1)
    out = place(out, got_btd, k - 1)
    return out.reshape(b, tp * t_local, -1)


def _grouped_matmul_reduce_scatter(h_btn, w_nd, axis: str, tp: int, dim: int = 1
                                   ) -> jax.Array:
    """`matmul_reduce_scatter` with each step a reduce-scatter of one sequence piece."""
    if own_chunk_first(tp):
        return _own_last_matmul_reduce_scatter(h_btn, w_nd, axis, tp, dim)
    b, t, n = h_btn.shape
    t_local = t // tp
    k = _pieces(t_local, tp)
    size = t_local // k
    h4 = h_btn.reshape(b, tp, t_local, n)

    def partial(j):  # piece j of every rank's chunk times this rank's rows: (B, tp*size, D)
        rows = jax.lax.dynamic_slice_in_dim(h4, j * size, size, axis=2).reshape(b, tp * size, n)
        return jnp.einsum("btn,nd->btd", rows, w_nd)

    def scatter(part_btd):  # (B, tp * size, D) -> this rank's piece, summed over tp
        return jax.lax.psum_scatter(part_btd, axis, scatter_dimension=1, tiled=True)

    out_dtype = jnp.result_type(h_btn.dtype, w_nd.dtype)
    out = vary_like(jnp.zeros((b, t_local, w_nd.shape[1]), out_dtype), h_btn, w_nd)

    def step(carry, j):
        # The reduce-scatter of piece j - 1 depends only on the carry; the matmul of piece j
        # runs while it is in flight.
        out, part_btd = carry
        out = jax.lax.dynamic_update_slice_in_dim(out, scatter(part_btd), (j - 1) * size,
                                                  axis=1)
        return out, partial(j)

    out, part_btd = _steps(step, (out, partial(0)), 1, k)
    return jax.lax.dynamic_update_slice_in_dim(out, scatter(part_btd), (k - 1) * size, axis=1)
