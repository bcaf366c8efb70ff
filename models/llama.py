"""Llama-family decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention) with Megatron TP.

Written exactly as `models/gpt.py`: Flax modules declare parameters at their per-device size
(`tp=1` creates the global parameters, `tp=k` applies to one TP shard), and one definition
serves the single-device reference, the `shard_map` step and GSPMD.

TP layout:
* query heads, the SwiGLU's gate/up columns and the vocabulary are split over TP (column /
  vocab parallel); attention-out and MLP-down are row-parallel (a psum, or a reduce-scatter
  under sequence parallelism).
* key/value heads: split over TP when `kv_heads >= tp` (each rank keeps `kv_heads / tp` of
  them, needs `kv_heads % tp == 0`); otherwise stored replicated and each rank slices the one
  kv head its query heads read (`tp % kv_heads == 0`). The replicated weights' gradients are
  summed over TP by autodiff (the implicit `pvary`'s transpose).
* one column-parallel matmul computes q, k and v (the local q and kv weights concatenated),
  so sequence parallelism and collective matmul gather each block's input once.

RoPE uses the half-split ("rotate_half") convention of Hugging Face's `LlamaForCausalLM`,
so HF q/k projection weights load without the Meta-format permutation (see
`jax_overlap/hf/llama.py` and docs/guides/data_and_hf.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jax_overlap.parallel.attention import fused_attention, use_fused
from jax_overlap.parallel.collectives import (
    Parallel,
    column_parallel,
    column_parallel_parts,
    position_wise,
    row_parallel,
    tp_index,
    vocab_columns,
    vocab_embed,
)
from models.decoder import DecoderStagedModel, cached_attention, write_cache


def _normal(std: float):
    return nn.initializers.normal(stddev=std)


@dataclass(frozen=True)
class Rope:
    """Rotary embedding frequencies: `theta`, and Llama-3.1 scaling when `scaling == 'llama3'`."""

    theta: float = 10000.0
    scaling: str = "none"  # none | llama3
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """(head_dim/2,) float32, computed as transformers does (float32 powers)."""
        exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
        inv = (1.0 / (np.float32(self.theta) ** exponents)).astype(np.float32)
        if self.scaling != "llama3":
            return inv
        low_wavelen = self.original_max_len / self.low_freq_factor
        high_wavelen = self.original_max_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
        smooth = ((self.original_max_len / wavelen - self.low_freq_factor)
                  / (self.high_freq_factor - self.low_freq_factor))
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(t: int, head_dim: int, rope: Rope, start=0) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape (T, head_dim) for positions `start .. start+T-1`, fp32: the angles
    duplicated over the two halves."""
    inv = jnp.asarray(rope.inv_freq(head_dim))
    positions_t = (jnp.arange(t) + start).astype(jnp.float32)
    angles_te = positions_t[:, None] * inv[None, :]
    angles_te = jnp.concatenate([angles_te, angles_te], axis=-1)
    return jnp.cos(angles_te), jnp.sin(angles_te)


def apply_rope(x_bthe: jax.Array, cos_te: jax.Array, sin_te: jax.Array) -> jax.Array:
    """x*cos + rotate_half(x)*sin, in fp32, back in x's dtype."""
    x32 = x_bthe.astype(jnp.float32)
    half = x32.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos_te[:, None, :] + rotated * sin_te[:, None, :]
    return out.astype(x_bthe.dtype)


class RMSNorm(nn.Module):
    """x / rms(x) * scale, in fp32 whatever the compute dtype."""

    eps: float = 1e-5

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + self.eps)
        return (y * scale).astype(x.dtype)


def kv_split(kv_heads: int, tp: int) -> bool:
    """Whether TP splits the kv heads (kv_heads >= tp) or replicates them."""
    return kv_heads >= tp


class Block(nn.Module):
    """One pre-norm Llama block, written for one device of a TP group."""

    d_model: int
    heads: int
    kv_heads: int
    d_ff: int
    num_layers: int
    rope: Rope
    eps: float = 1e-5
    tp: int = 1

    @nn.compact
    def __call__(self, x_btd, par: Parallel, cache=None, pos=None):
        """The block's output; with a key/value `cache` (decoding, `models.decoder`) of the
        positions before `pos`, `(output, cache with these positions written)`."""
        d, hd = self.d_model, self.d_model // self.heads
        h_local = self.heads // self.tp
        split = kv_split(self.kv_heads, self.tp)
        kv_stored = self.kv_heads // self.tp if split else self.kv_heads
        out_std = 0.02 / math.sqrt(2 * self.num_layers)
        dt = par.compute_dtype

        w_q_dhe = self.param("w_q", _normal(0.02), (d, h_local, hd))
        w_kv_dk2e = self.param("w_kv", _normal(0.02), (d, kv_stored, 2, hd))
        w_o_hed = self.param("w_o", _normal(out_std), (h_local, hd, d))

        # Attention: q, k, v from one column-parallel matmul (local query heads, local or
        # this rank's kv heads), RoPE, causal GQA, row-parallel output.
        if split:
            kv_local, w_kv_local = kv_stored, w_kv_dk2e
        else:  # replicated kv heads: the one this rank's h_local query heads share
            kv_local = 1
            first = tp_index(par) * self.kv_heads // self.tp
            w_kv_local = jax.lax.dynamic_slice_in_dim(w_kv_dk2e, first, 1, axis=1)
        # One GEMM each (one gather of the input): q, k and v come out whole, not as slices
        # of one output that attention would read through copies.
        w_kv_local = w_kv_local.astype(dt)
        y_btd = RMSNorm(self.eps, name="attn_norm")(x_btd)
        q_btn, k_btn, v_btn = column_parallel_parts(
            y_btd.astype(dt), [w_q_dhe.astype(dt).reshape(d, h_local * hd),
                               w_kv_local[:, :, 0].reshape(d, kv_local * hd),
                               w_kv_local[:, :, 1].reshape(d, kv_local * hd)], par)
        b, t = q_btn.shape[:2]
        q_bthe = q_btn.reshape(b, t, h_local, hd)
        k_btke, v_btke = k_btn.reshape(b, t, kv_local, hd), v_btn.reshape(b, t, kv_local, hd)
        cos_te, sin_te = rope_cos_sin(t, hd, self.rope, 0 if pos is None else pos)
        q_bthe = apply_rope(q_bthe, cos_te, sin_te)
        k_btke = apply_rope(k_btke, cos_te, sin_te)
        group = h_local // kv_local
        if cache is not None:  # decoding: attend over the cached positions and these
            cache = (write_cache(cache[0], k_btke, pos), write_cache(cache[1], v_btke, pos))
            ctx_bthe = cached_attention(q_bthe, cache[0], cache[1], pos, dt)
        elif use_fused(par):  # one flash-attention kernel (GQA: query head h reads h // group)
            ctx_bthe = fused_attention(q_bthe, k_btke, v_btke, causal=True, par=par)
        else:
            q_btkge = q_bthe.reshape(b, t, kv_local, group, hd)
            scores = jnp.einsum("btkge,bske->bkgts", q_btkge, k_btke).astype(jnp.float32)
            scores = scores / math.sqrt(hd)
            scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e30)
            probs = jax.nn.softmax(scores, axis=-1).astype(dt)
            ctx_btkge = jnp.einsum("bkgts,bske->btkge", probs, v_btke)
            ctx_bthe = ctx_btkge.reshape(b, t, h_local, hd)
        attn_btd = row_parallel(ctx_bthe.reshape(b, t, h_local * hd),
                                w_o_hed.reshape(h_local * hd, d).astype(dt), par)
        x_btd = x_btd + attn_btd.astype(x_btd.dtype)

        out_btd = x_btd + self.feed_forward(x_btd, par).astype(x_btd.dtype)
        return out_btd if cache is None else (out_btd, cache)

    def feed_forward(self, x_btd, par: Parallel):
        """SwiGLU MLP of the normed input: gate and up column-parallel in one matmul,
        row-parallel down (an MoE block replaces it, `models.moe`)."""
        d, f_local = self.d_model, self.d_ff // self.tp
        out_std = 0.02 / math.sqrt(2 * self.num_layers)
        dt = par.compute_dtype
        w_gu_d2f = self.param("w_gate_up", _normal(0.02), (d, 2, f_local))
        w_down_fd = self.param("w_down", _normal(out_std), (f_local, d))
        y_btd = RMSNorm(self.eps, name="mlp_norm")(x_btd)
        def hidden(gu_btn):
            return jax.nn.silu(gu_btn[..., :f_local]) * gu_btn[..., f_local:]

        return position_wise(y_btd.astype(dt), w_gu_d2f.reshape(d, 2 * f_local).astype(dt),
                             hidden, w_down_fd.astype(dt), par)


class Embed(nn.Module):
    vocab: int
    d_model: int
    tp: int = 1

    @nn.compact
    def __call__(self, ids_bt, par: Parallel, pos=None):
        """Token embeddings (`pos`, the first token's position when decoding, is unused:
        RoPE places the tokens in the blocks)."""
        wte_vd = self.param("wte", _normal(0.02), (self.vocab // self.tp, self.d_model))
        return vocab_embed(ids_bt, wte_vd.astype(par.compute_dtype), par)


class Head(nn.Module):
    """Final RMSNorm and vocab-parallel logits; `w_out` exists only when untied."""

    vocab: int
    d_model: int
    tied: bool
    eps: float = 1e-5
    tp: int = 1

    @nn.compact
    def __call__(self, x_btd, wte_vd, par: Parallel):
        y_btd = RMSNorm(self.eps, name="norm")(x_btd)
        if self.tied:
            w_dv = wte_vd.T
        else:
            w_dv = self.param("w_out", _normal(0.02), (self.d_model, self.vocab // self.tp))
        w_dv = vocab_columns(w_dv, par)
        # Logits need every position: under sequence parallelism the sequence is gathered
        # (B, T/tp, D) -> (B, T, D) for this matmul, under collective matmul beneath it.
        return column_parallel(y_btd.astype(par.compute_dtype), w_dv.astype(par.compute_dtype),
                               par)


@dataclass(frozen=True)
class Llama(DecoderStagedModel):
    """The Llama decoder as a `jax_overlap.model_api.StagedModel`."""

    num_layers: int
    d_model: int
    heads: int
    kv_heads: int
    d_ff: int
    vocab: int
    seq_len: int
    tied_embeddings: bool = False
    rope: Rope = Rope()
    eps: float = 1e-5
    # The TP size `param_axes` lays the kv heads out for (split when kv_heads >= tp). The
    # parameters themselves (global shapes, values) do not depend on it.
    tp: int = 1

    @classmethod
    def from_config(cls, m, tp: int = 1) -> "Llama":
        rope = Rope(m.rope_theta, m.rope_scaling, m.rope_factor, m.rope_low_freq_factor,
                    m.rope_high_freq_factor, m.rope_original_max_len)
        return cls(m.layers, m.d_model, m.heads, m.kv_heads or m.heads, m.d_ff, m.vocab,
                   m.seq_len, m.tied_embeddings, rope, m.norm_eps, tp)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    # Modules at a given TP size -------------------------------------------------------------
    def _embed(self, tp):
        return Embed(self.vocab, self.d_model, tp)

    def _block(self, tp):
        return Block(self.d_model, self.heads, self.kv_heads, self.d_ff, self.num_layers,
                     self.rope, self.eps, tp)

    def _head(self, tp):
        return Head(self.vocab, self.d_model, self.tied_embeddings, self.eps, tp)

    # StagedModel (init, embed, block, head_loss, logits, loss_count: DecoderStagedModel) ---
    def param_axes(self) -> Any:
        """Logical axes. The kv-head dim of `w_kv` is 'heads' (split over tp) when
        kv_heads >= tp (the `tp` this model was built for), else replicated (None)."""
        norm = {"scale": ("embed",)}
        kv_axis = "heads" if kv_split(self.kv_heads, self.tp) else None
        blocks = {
            "w_q": ("embed", "heads", "head_dim"),
            "w_kv": ("embed", kv_axis, None, "head_dim"),
            "w_o": ("heads", "head_dim", "embed"),
            "w_gate_up": ("embed", None, "mlp"),
            "w_down": ("mlp", "embed"),
            "attn_norm": norm, "mlp_norm": norm,
        }
        blocks = jax.tree.map(lambda a: ("layers",) + a, blocks,
                              is_leaf=lambda x: isinstance(x, tuple))
        head: dict[str, Any] = {"norm": norm}
        if not self.tied_embeddings:
            head["w_out"] = ("embed", "vocab")
        return {"embed": {"wte": ("vocab", "embed")}, "blocks": blocks, "head": head}

    def num_params(self) -> int:
        d, f, v, n = self.d_model, self.d_ff, self.vocab, self.num_layers
        kv_dim = self.kv_heads * self.head_dim
        per_block = 2 * d * d + 2 * d * kv_dim + 3 * d * f + 2 * d
        return n * per_block + v * d + d + (0 if self.tied_embeddings else d * v)

    def flops_per_example(self) -> float:
        """6·N·T for the matmuls plus attention's 12·L·T²·d."""
        t = self.seq_len
        return 6.0 * self.num_params() * t + 12.0 * self.num_layers * t * t * self.d_model
