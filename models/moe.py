"""Mixture-of-experts Llama: the Llama decoder with MoE feed-forward blocks (Mixtral-style).

Config (`model.*`): `experts` (0 = dense), `experts_per_token` (top-k), `expert_capacity`
(`dropless` or a capacity factor), `shared_experts`, `moe_every` (layer i is MoE when
(i + 1) % moe_every == 0), `router_aux_loss` and `router_z_loss` (coefficients).

Router: softmax over the experts, top-k, the k gates renormalised to sum to 1 when k > 1
(Mixtral; with k = 1 the gate is the raw probability, Switch). Dispatch is capacity based,
with fixed shapes: each expert takes at most C tokens of each sequence,
`C = ceil(factor * T * k / E)` (`dropless`: C = T, nothing can drop); the slots go to the
first choices of all tokens first, then the second, each in position order (GShard). A
dropped assignment adds nothing (the residual carries the token). Everything is per
sequence, so the routing, the drops and the losses are the same on every mesh.

Losses (per sequence b, averaged over the MoE layers and the batch's tokens):
  balance  E * sum_e f_be * P_be   (f: the share of b's k*T assignments to e, P: the mean
           router probability of e over b's tokens), times `router_aux_loss`;
  z-loss   mean over tokens of logsumexp(router logits)^2, times `router_z_loss`.
They are not in the reported `loss`: like Megatron's aux-loss scaler, the block adds their
gradient in its backward (`_side_channel`), scaled to the step's global token mean, so no
extra value has to cross the pipeline.

Metrics: every MoE block holds a zero parameter `moe_stats` (E + 2) that its forward never
reads; its "gradient" is this microbatch's tokens per expert, dropped assignments and router
loss. The step sums it over microbatches and devices like any gradient, takes it out before
the optimizer (`jax_overlap.training.moe_stats`) and reports it.

Layers: with `moe_every = k` the stacked unit (one `block`) is k Llama layers, the last one
MoE, so every unit has the same parameters; `num_layers` counts units.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_overlap.model_api import MOE_STATS, moe_stats_len
from jax_overlap.parallel.collectives import Parallel, psum_tp, sp_gather, sp_scatter
from jax_overlap.parallel.compat import axis_size, to_varying, varying_axes
from jax_overlap.parallel.mesh import DP
from models.llama import Block, Llama, RMSNorm, Rope, _normal

STATS = MOE_STATS
stats_len = moe_stats_len


@dataclass(frozen=True)
class MoeSpec:
    """One MoE layer's shape and router settings (static, hashable)."""

    experts: int
    k: int = 2
    capacity: float | str = "dropless"
    shared: int = 0
    aux_coef: float = 0.01
    z_coef: float = 0.001
    # Gradient of the summed router losses: 1 / (global tokens x MoE layers), the step's
    # mean (its loss is the sum over the global batch's tokens / their count).
    loss_scale: float = 1.0
    # Expert parallelism: `ep` slots of dp ranks split the experts, stored split over dp
    # (`ep_groups`; the tokens travel in `Parallel.moe_chunks` pieces, the plan's
    # `overlap.moe_chunks`).
    ep: int = 1

    def capacity_for(self, t: int) -> int:
        """Slots per expert per sequence of `t` tokens."""
        if self.capacity == "dropless":
            return t
        return max(1, min(t, math.ceil(float(self.capacity) * t * self.k / self.experts)))


def route(logits_bte: jax.Array, spec: MoeSpec, capacity: int):
    """Top-k routing with per-sequence capacity.

    Args:
      logits_bte: router logits, fp32.
    Returns:
      (expert_bn, slot_bn, gate_bn, keep_bn, probs_bte): for each of the k*T assignments of a
      sequence (n = j*T + t: choice j of token t), its expert, its slot in that expert's
      buffer (C when dropped, out of bounds), its gate and whether it was kept.
    """
    b, t, e = logits_bte.shape
    probs_bte = jax.nn.softmax(logits_bte, axis=-1)
    gate_btk, expert_btk = jax.lax.top_k(probs_bte, spec.k)
    if spec.k > 1:
        gate_btk = gate_btk / gate_btk.sum(-1, keepdims=True)
    expert_bn = expert_btk.transpose(0, 2, 1).reshape(b, spec.k * t)
    gate_bn = gate_btk.transpose(0, 2, 1).reshape(b, spec.k * t)
    onehot_bne = jax.nn.one_hot(expert_bn, e, dtype=jnp.int32)
    slot_bn = (jnp.cumsum(onehot_bne, axis=1) * onehot_bne).sum(-1) - 1
    keep_bn = slot_bn < capacity
    slot_bn = jnp.where(keep_bn, slot_bn, capacity)
    return expert_bn, slot_bn, gate_bn, keep_bn, probs_bte


def router_losses(logits_bte, probs_bte, expert_bn, spec: MoeSpec):
    """(balance summed over sequences, z-loss summed over tokens, tokens per expert (E,))."""
    b, t, e = logits_bte.shape
    counts_be = jax.nn.one_hot(expert_bn, e, dtype=jnp.float32).sum(1)
    f_be = counts_be / (t * spec.k)
    balance = e * (f_be * probs_bte.mean(1)).sum()
    z = jnp.square(jax.nn.logsumexp(logits_bte, axis=-1)).sum()
    return balance, z, counts_be.sum(0)


def dispatch(y_btd, expert_bn, slot_bn, spec: MoeSpec, capacity: int):
    """(B, T, D) tokens -> (E, B*C, D) expert buffers (dropped assignments are left out)."""
    b, t, d = y_btd.shape
    tok_bnd = jnp.tile(y_btd, (1, spec.k, 1))
    rows = jnp.arange(b)[:, None]
    buf_becd = jnp.zeros((b, spec.experts, capacity, d), y_btd.dtype)
    buf_becd = buf_becd.at[rows, expert_bn, slot_bn].set(tok_bnd, mode="drop")
    return buf_becd.transpose(1, 0, 2, 3).reshape(spec.experts, b * capacity, d)


def combine(out_end, expert_bn, slot_bn, gate_bn, spec: MoeSpec, b: int, t: int,
            capacity: int):
    """(E, B*C, D) expert outputs -> (B, T, D): each token's kept assignments, gate-weighted."""
    d = out_end.shape[-1]
    out_becd = out_end.reshape(spec.experts, b, capacity, d).transpose(1, 0, 2, 3)
    rows = jnp.arange(b)[:, None]
    y_bnd = out_becd.at[rows, expert_bn, slot_bn].get(mode="fill", fill_value=0)
    y_bnd = y_bnd * gate_bn[..., None].astype(y_bnd.dtype)
    return y_bnd.reshape(b, spec.k, t, d).sum(1)


def swiglu_experts(x_ecd, w_gu_ed2f, w_down_efd, dt):
    """Each expert's SwiGLU on its own tokens: (E, C, D) -> (E, C, D) (a TP partial sum when
    the hidden size is split)."""
    e, d, _, f = w_gu_ed2f.shape
    gu_ecn = jnp.einsum("ecd,edn->ecn", x_ecd.astype(dt), w_gu_ed2f.reshape(e, d, 2 * f)
                        .astype(dt))
    h_ecf = jax.nn.silu(gu_ecn[..., :f]) * gu_ecn[..., f:]
    return jnp.einsum("ecf,efd->ecd", h_ecf, w_down_efd.astype(dt))


def ep_groups(dp: int, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """(all-to-all groups, expert-gather groups) of the dp ranks for `ep`-way experts.

    The experts' dim is stored split over dp (rank r holds experts [r E/dp, (r+1) E/dp)),
    so the R = dp/ep consecutive ranks j R .. j R + R - 1 together hold ep slot j's E/ep
    experts: they are slot j's replicas, gather the slot's experts from each other and
    reduce-scatter their gradients (the reduction over the data-parallel ranks that are not
    ep). An all-to-all group takes one rank of every slot: {i, i + R, ..., i + (ep-1) R}.
    """
    r = dp // ep
    return ([[i + r * j for j in range(ep)] for i in range(r)],
            [[j * r + i for i in range(r)] for j in range(ep)])


def chunk_bounds(n: int, chunks: int) -> list[int]:
    """Where `chunks` pieces of `n` token slots start and end (empty pieces left out).

    With 3 or more chunks the first and the last are half the size of the others: chunk 0's
    dispatch and the last chunk's combine have no GEMM of the layer to go under
    (`expert_parallel`), so they carry the fewest tokens; the middle ones each go under a
    stage's GEMMs either way.
    """
    weights = [1] + [2] * (chunks - 2) + [1] if chunks >= 3 else [1] * chunks
    total, acc, bounds = sum(weights), 0, [0]
    for w in weights:
        acc += w
        bounds.append(round(acc * n / total))
    return sorted(set(bounds))


def expert_parallel(x_end, w_gu_ed2f, w_down_efd, spec: MoeSpec, dt, chunks: int = 1):
    """The experts' SwiGLU on their tokens, the experts split over `spec.ep` slots of dp
    ranks (inside the step's shard_map).

    The weights arrive as this rank's stored experts, (E/dp, ...): with dp = ep they are its
    slot's; with dp > ep the slot's replicas all-gather them, (E/dp, ...) -> (E/ep, ...), and
    the gather's transpose reduce-scatters their gradients over the replicas (`ep_groups`).
    Per chunk of the token slots: an all-to-all over the group sends each expert's tokens to
    its slot, (E, N, D) -> (E/ep, ep N, D), the GEMMs run there, and a second one brings the
    outputs back, (E/ep, ep N, D) -> (E, N, D).

    The chunks are software-pipelined: stage i runs chunk i's GEMMs beside chunk i+1's
    dispatch and chunk i-1's combine, and an optimization barrier closes each stage (what
    follows waits for all three), so XLA's latency-hiding scheduler finds GEMMs of the same
    stage to put under each all-to-all; left alone it ran each chunk's dispatch -> GEMMs ->
    combine nearly in order in a forward. (A dispatch's input is ready from the start, so the
    scheduler may still start one a stage early.) Only chunk 0's dispatch and the last
    chunk's combine are outside a stage, and those two chunks are the smallest
    (`chunk_bounds`). The barriers' transposes give the backward the mirrored stages.
    Measured: docs/results.md, "All-to-alls under GEMMs".
    """
    ep, dp = spec.ep, axis_size(DP)
    a2a, gather = ep_groups(dp, ep)
    if dp > ep:  # (E/dp, ...) -> (E/ep, ...) over the slot's replicas
        w_gu_ed2f = jax.lax.all_gather(w_gu_ed2f, DP, axis=0, tiled=True,
                                       axis_index_groups=gather)
        w_down_efd = jax.lax.all_gather(w_down_efd, DP, axis=0, tiled=True,
                                        axis_index_groups=gather)

    def send(x_end):  # (E, n, D) -> (E/ep, ep n, D) over the ep group
        return jax.lax.all_to_all(x_end, DP, 0, 1, tiled=True, axis_index_groups=a2a)

    def back(y_lnd):  # (E/ep, ep n, D) -> (E, n, D) over the ep group
        return jax.lax.all_to_all(y_lnd, DP, 1, 0, tiled=True, axis_index_groups=a2a)

    bounds = chunk_bounds(x_end.shape[1], chunks)
    parts = jax.lax.split(x_end, [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])], axis=1)
    if len(parts) == 1:
        return back(swiglu_experts(send(parts[0]), w_gu_ed2f, w_down_efd, dt))
    outs = []
    recv, y_prev = send(parts[0]), None
    for i in range(len(parts)):
        stage = (swiglu_experts(recv, w_gu_ed2f, w_down_efd, dt),  # chunk i's GEMMs
                 send(parts[i + 1]) if i + 1 < len(parts) else None,
                 back(y_prev) if y_prev is not None else None)
        y_prev, recv, done = jax.lax.optimization_barrier(stage)
        if done is not None:
            outs.append(done)
    outs.append(back(y_prev))
    return jnp.concatenate(outs, axis=1)


# The side channel: identity on x, router-loss gradient and statistics in the backward ------
@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _side_channel(x, aux_sum, sink, stats, info):
    return x


def _side_fwd(x, aux_sum, sink, stats, info):
    return x, (aux_sum, sink, stats)


def _side_bwd(info, residuals, g):
    scale, tp_axis, tp = info
    aux_sum, sink, stats = residuals
    # A value the tp ranks compute alike but that is typed tp-varying has its gradient summed
    # over tp (by the implicit pvary's transpose or by the step's buckets): each rank adds
    # its 1/tp share.
    share = tp if tp_axis is not None and tp_axis in varying_axes(aux_sum) else 1
    ct_aux = aux_sum * 0 + scale / share
    return g, ct_aux, _as_gradient_of(stats, sink, tp_axis, tp), jnp.zeros_like(stats)


def _as_gradient_of(stats, sink, tp_axis, tp):
    """`stats` (identical on the tp ranks) typed as `sink`'s gradient, so that the step's
    reductions of it give the sum over the data-parallel devices once.

    The step sums a gradient over every axis its parameter varies over: where `sink` varies
    over tp (in-backward buckets mark the parameters tp-varying and reduce over (dp, tp)),
    each tp rank gives its 1/tp share, whether or not `stats` is typed tp-varying (it is
    when the router weight was marked so, though its value is the same on every tp rank).
    """
    have, want = varying_axes(stats), varying_axes(sink)
    extra = have - want
    if tp_axis in extra:  # identical on tp ranks: their mean
        stats = jax.lax.psum(stats, tp_axis) / tp
    rest = tuple(sorted(extra - {tp_axis}))
    if rest:
        stats = jax.lax.psum(stats, rest)
    if tp_axis is not None and tp_axis in want:  # the step sums the tp ranks' shares
        stats = stats / tp
    missing = tuple(sorted(want - varying_axes(stats)))
    return to_varying(stats, missing).astype(sink.dtype)


_side_channel.defvjp(_side_fwd, _side_bwd)


class MoeBlock(Block):
    """A Llama block whose feed-forward is a mixture of experts."""

    moe: MoeSpec | None = None

    def feed_forward(self, x_btd, par: Parallel):
        spec, d = self.moe, self.d_model
        e, f_local = spec.experts, self.d_ff // self.tp
        out_std = 0.02 / math.sqrt(2 * self.num_layers)
        dt = par.compute_dtype
        w_router_de = self.param("w_router", _normal(0.02), (d, e))
        split = par.active and spec.ep > 1
        # Inside the step's shard_map with mesh.ep > 1: this rank's E/dp stored experts.
        e_stored = e // axis_size(DP) if split else e
        w_gu_ed2f = self.param("w_experts_gate_up", _normal(0.02), (e_stored, d, 2, f_local))
        w_down_efd = self.param("w_experts_down", _normal(out_std), (e_stored, f_local, d))
        sink = self.param(STATS, nn.initializers.zeros, (stats_len(e),))
        y_btd = RMSNorm(self.eps, name="mlp_norm")(x_btd)
        if par.sequence_sharded:  # every TP rank routes every token: its rows -> (B, T, D)
            y_btd = sp_gather(y_btd, par)
        b, t, _ = y_btd.shape
        capacity = spec.capacity_for(t)

        logits_bte = jnp.einsum("btd,de->bte", y_btd.astype(jnp.float32),
                                w_router_de.astype(jnp.float32))
        expert_bn, slot_bn, gate_bn, keep_bn, probs_bte = route(logits_bte, spec, capacity)
        x_end = dispatch(y_btd.astype(dt), expert_bn, slot_bn, spec, capacity)
        if split:
            out_end = expert_parallel(x_end, w_gu_ed2f, w_down_efd, spec, dt, par.moe_chunks)
        else:
            out_end = swiglu_experts(x_end, w_gu_ed2f, w_down_efd, dt)
        out_btd = combine(out_end, expert_bn, slot_bn, gate_bn, spec, b, t, capacity)
        if spec.shared:
            fs = spec.shared * f_local
            w_sgu = self.param("w_shared_gate_up", _normal(0.02), (d, 2, fs))
            w_sdown = self.param("w_shared_down", _normal(out_std), (fs, d))
            out_btd = out_btd + swiglu_experts(y_btd[None].reshape(1, b * t, d), w_sgu[None],
                                               w_sdown[None], dt).reshape(b, t, d)
        # The experts' hidden size is split over tp: partial sums, completed here.
        if par.sequence_sharded:  # (B, T, D) partial -> this rank's rows summed, over tp
            out_btd = sp_scatter(out_btd, par)
        else:
            out_btd = psum_tp(out_btd, par)  # (B, T, D) over tp

        balance, z, tokens_e = router_losses(logits_bte, probs_bte, expert_bn, spec)
        aux_sum = spec.aux_coef * t * balance + spec.z_coef * z
        self.sow("intermediates", "router_loss_sum", aux_sum)  # tests differentiate it
        dropped = (~keep_bn).sum().astype(jnp.float32)
        stats = jax.lax.stop_gradient(jnp.concatenate(
            [tokens_e, dropped[None], (aux_sum * spec.loss_scale)[None]]))
        return _side_channel(out_btd, aux_sum, sink, stats,
                             (spec.loss_scale, par.tp_axis, par.tp))


class Unit(nn.Module):
    """`dense` Llama layers then one MoE layer: the stacked unit of an MoE decoder."""

    d_model: int
    heads: int
    kv_heads: int
    d_ff: int
    num_layers: int
    rope: Rope
    eps: float
    tp: int
    moe: MoeSpec
    dense: int = 0

    @nn.compact
    def __call__(self, x_btd, par: Parallel, cache=None, pos=None):
        args = (self.d_model, self.heads, self.kv_heads, self.d_ff, self.num_layers, self.rope,
                self.eps, self.tp)
        layers = [Block(*args, name=f"dense_{i}") for i in range(self.dense)]
        layers.append(MoeBlock(*args, moe=self.moe, name="moe"))
        if cache is None:
            for layer in layers:
                x_btd = layer(x_btd, par)
            return x_btd
        kv = cache[0].shape[2] // len(layers)  # the unit's layers' kv heads, side by side
        ks, vs = [], []
        for i, layer in enumerate(layers):
            part = (cache[0][:, :, i * kv:(i + 1) * kv], cache[1][:, :, i * kv:(i + 1) * kv])
            x_btd, (k, v) = layer(x_btd, par, cache=part, pos=pos)
            ks.append(k)
            vs.append(v)
        return x_btd, (jnp.concatenate(ks, axis=2), jnp.concatenate(vs, axis=2))


@dataclass(frozen=True)
class MoeLlama(Llama):
    """The MoE decoder as a `StagedModel`: `num_layers` units of `moe_every` layers."""

    moe: MoeSpec = MoeSpec(experts=8)
    moe_every: int = 1

    @classmethod
    def from_config(cls, cfg, tp: int = 1, ep: int = 1) -> "MoeLlama":
        """From the config's `model` and `train.global_batch` (the router losses' mean);
        `tp` and `ep` as `model_api.build_facts` gives them."""
        m = cfg.model
        base = Llama.from_config(m, tp=tp)
        units = m.layers // m.moe_every
        tokens = cfg.train.global_batch * m.seq_len
        spec = MoeSpec(m.experts, m.experts_per_token, m.expert_capacity, m.shared_experts,
                       m.router_aux_loss, m.router_z_loss, 1.0 / (tokens * units), ep)
        fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
        fields["num_layers"] = units
        return cls(**fields, moe=spec, moe_every=m.moe_every)

    @property
    def total_layers(self) -> int:
        return self.num_layers * self.moe_every

    def _block(self, tp):
        return Unit(self.d_model, self.heads, self.kv_heads, self.d_ff, self.total_layers,
                    self.rope, self.eps, tp, self.moe, self.moe_every - 1)

    def param_axes(self) -> Any:
        dense = jax.tree.map(lambda a: a[1:], Llama.param_axes(self)["blocks"],
                             is_leaf=lambda x: isinstance(x, tuple))
        moe = {k: v for k, v in dense.items() if k not in ("w_gate_up", "w_down")}
        # mesh.ep > 1: the experts' dim stored split over dp ('experts'), else replicated.
        ex = "experts" if self.moe.ep > 1 else None
        moe.update(w_router=("embed", None), w_experts_gate_up=(ex, "embed", None, "mlp"),
                   w_experts_down=(ex, "mlp", "embed"))
        moe[STATS] = (None,)
        if self.moe.shared:
            moe.update(w_shared_gate_up=("embed", None, "mlp"), w_shared_down=("mlp", "embed"))
        unit = {f"dense_{i}": dense for i in range(self.moe_every - 1)}
        unit["moe"] = moe
        axes = Llama.param_axes(self)
        axes["blocks"] = jax.tree.map(lambda a: ("layers",) + a, unit,
                                      is_leaf=lambda x: isinstance(x, tuple))
        return axes

    def cache_heads(self) -> int:
        """A unit caches the kv heads of its `moe_every` layers side by side."""
        return self.kv_heads * self.moe_every

    def _layer_params(self, active: bool) -> int:
        d, f, e, n = self.d_model, self.d_ff, self.moe.experts, self.total_layers
        attn = 2 * d * d + 2 * d * self.kv_heads * self.head_dim + 2 * d
        dense_ffn = 3 * d * f
        moe_ffn = 3 * d * f * ((self.moe.k if active else e) + self.moe.shared) + d * e
        units = self.num_layers
        return n * attn + units * (self.moe_every - 1) * dense_ffn + units * moe_ffn

    def num_params(self) -> int:
        v, d = self.vocab, self.d_model
        return self._layer_params(False) + v * d + d + (0 if self.tied_embeddings else d * v)

    def active_params(self) -> int:
        """Parameters one token passes through (k routed experts, the shared ones)."""
        v, d = self.vocab, self.d_model
        return self._layer_params(True) + v * d + d + (0 if self.tied_embeddings else d * v)

    def flops_per_example(self) -> float:
        """6·N_active·T for the matmuls plus attention's 12·L·T²·d."""
        t = self.seq_len
        return (6.0 * self.active_params() * t
                + 12.0 * self.total_layers * t * t * self.d_model)


def build(cfg, tp: int = 1, ep: int = 1):
    """The model `model.kind: llama` names (registered in pyproject.toml), laid out for the
    tensor-parallel degree `tp` the library's `build_model` passes: the dense decoder
    (`models.llama`), or with `model.experts > 0` this mixture-of-experts one, its experts
    split `ep` ways. It lives here, beside the one model that builds on the other, so that
    `models.llama` needs nothing of this module."""
    if cfg.model.experts:
        return MoeLlama.from_config(cfg, tp, ep)
    return Llama.from_config(cfg.model, tp=tp)
