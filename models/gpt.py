"""GPT-style decoder (pre-norm, causal attention, GELU MLP) with Megatron tensor parallelism.

Flax modules declare parameters at their per-device size: a module built with `tp=1` creates
the global (logical) parameters, the same module with `tp=k` applies to one TP shard of them.
So initialisation is done once, globally and mesh-independently, and the same code runs on the
single-device reference, inside `shard_map` and under GSPMD.

TP layout (Megatron): QKV and MLP-in are column-parallel (split over heads / d_ff), attention-out
and MLP-out are row-parallel with a psum over TP; embedding and cross-entropy split the vocab.
Attention over the local heads is the einsum path below, or one fused kernel when the plan
chose `model.attention: fused` (`par.attention`, `jax_overlap.parallel.attention`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_overlap.parallel.attention import fused_attention, use_fused
from jax_overlap.parallel.collectives import (
    Parallel,
    column_parallel,
    column_parallel_parts,
    position_wise,
    row_parallel,
    sequence_shard,
    vocab_columns,
    vocab_embed,
)
from models.decoder import DecoderStagedModel, cached_attention, write_cache


def _normal(std: float):
    return nn.initializers.normal(stddev=std)


class LayerNorm(nn.Module):
    """LayerNorm computed in fp32 whatever the compute dtype (bf16 statistics drift)."""

    eps: float = 1e-5

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (d,))
        bias = self.param("bias", nn.initializers.zeros, (d,))
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps) * scale + bias
        return y.astype(x.dtype)


class Block(nn.Module):
    """One pre-norm decoder block, written for one device of a TP group."""

    d_model: int
    heads: int
    d_ff: int
    num_layers: int
    tp: int = 1
    causal: bool = True

    @nn.compact
    def __call__(self, x_btd, par: Parallel, cache=None, pos=None):
        """The block's output; with a key/value `cache` (decoding, `models.decoder`) of the
        positions before `pos`, `(output, cache with these positions written)`."""
        h_local, hd = self.heads // self.tp, self.d_model // self.heads
        f_local = self.d_ff // self.tp
        out_std = 0.02 / math.sqrt(2 * self.num_layers)  # GPT-2's residual scaling
        dt = par.compute_dtype

        w_qkv_dh3 = self.param("w_qkv", _normal(0.02), (self.d_model, h_local, 3 * hd))
        b_qkv_h3 = self.param("b_qkv", nn.initializers.zeros, (h_local, 3 * hd))
        w_o_hed = self.param("w_o", _normal(out_std), (h_local, hd, self.d_model))
        b_o_d = self.param("b_o", nn.initializers.zeros, (self.d_model,))
        w_in_df = self.param("w_in", _normal(0.02), (self.d_model, f_local))
        b_in_f = self.param("b_in", nn.initializers.zeros, (f_local,))
        w_out_fd = self.param("w_out", _normal(out_std), (f_local, self.d_model))
        b_out_d = self.param("b_out", nn.initializers.zeros, (self.d_model,))

        # Attention: column-parallel QKV (local heads), row-parallel output projection.
        y_btd = LayerNorm(name="ln_attn")(x_btd)
        # q, k and v as three GEMMs of one gathered input: each comes out whole, where one
        # GEMM's per-head [q k v] output had to be split (copied) before attention.
        w_qkv_dh3, b_qkv_h3 = w_qkv_dh3.astype(dt), b_qkv_h3.astype(dt)
        parts = [slice(i * hd, (i + 1) * hd) for i in range(3)]
        qkv = column_parallel_parts(
            y_btd.astype(dt), [w_qkv_dh3[..., s].reshape(self.d_model, -1) for s in parts], par)
        b, t = qkv[0].shape[:2]
        # Three separate bias values: sharing one operand, XLA fuses the three additions
        # into one pass over q, k and v instead of into each GEMM's epilogue.
        biases = jax.lax.optimization_barrier([b_qkv_h3[:, s].reshape(-1) for s in parts])
        q_bthe, k_bthe, v_bthe = ((p_btn + b_n).reshape(b, t, h_local, hd)
                                  for p_btn, b_n in zip(qkv, biases))
        if cache is not None:  # decoding: attend over the cached positions and these
            cache = (write_cache(cache[0], k_bthe, pos), write_cache(cache[1], v_bthe, pos))
            ctx_bthe = cached_attention(q_bthe, cache[0], cache[1], pos, dt)
        elif use_fused(par):  # one flash-attention kernel: no (B, H, T, T) tensor in memory
            ctx_bthe = fused_attention(q_bthe, k_bthe, v_bthe, causal=self.causal, par=par)
        else:
            scores_bhts = jnp.einsum("bthe,bshe->bhts", q_bthe, k_bthe).astype(jnp.float32)
            scores_bhts = scores_bhts / math.sqrt(hd)
            if self.causal:
                mask_ts = jnp.tril(jnp.ones((t, t), bool))
                scores_bhts = jnp.where(mask_ts, scores_bhts, -1e30)
            probs_bhts = jax.nn.softmax(scores_bhts, axis=-1).astype(dt)
            ctx_bthe = jnp.einsum("bhts,bshe->bthe", probs_bhts, v_bthe)
        attn_btd = row_parallel(ctx_bthe.reshape(b, t, h_local * hd),
                                w_o_hed.reshape(h_local * hd, self.d_model).astype(dt), par)
        x_btd = x_btd + (attn_btd + b_o_d.astype(dt)).astype(x_btd.dtype)

        # MLP: column-parallel in, row-parallel out.
        y_btd = LayerNorm(name="ln_mlp")(x_btd)
        def hidden(h_btf):
            return jax.nn.gelu(h_btf + b_in_f.astype(dt), approximate=True)

        mlp_btd = position_wise(y_btd.astype(dt), w_in_df.astype(dt), hidden,
                                w_out_fd.astype(dt), par)
        out_btd = x_btd + (mlp_btd + b_out_d.astype(dt)).astype(x_btd.dtype)
        return out_btd if cache is None else (out_btd, cache)


class Embed(nn.Module):
    vocab: int
    d_model: int
    seq_len: int
    tp: int = 1

    @nn.compact
    def __call__(self, ids_bt, par: Parallel, pos=None):
        """Token plus position embeddings; `pos`: the first token's position (decoding)."""
        wte_vd = self.param("wte", _normal(0.02), (self.vocab // self.tp, self.d_model))
        wpe_td = self.param("wpe", _normal(0.01), (self.seq_len, self.d_model))
        x_btd = vocab_embed(ids_bt, wte_vd.astype(par.compute_dtype), par)
        t = ids_bt.shape[1]
        if pos is not None:
            wpe_td = jax.lax.dynamic_slice_in_dim(wpe_td, pos, t, axis=0)
        pos_td = sequence_shard(wpe_td[:t].astype(par.compute_dtype), 0, x_btd.shape[1], par)
        return x_btd + pos_td


class Head(nn.Module):
    """Final LayerNorm and vocab-parallel logits; `w_out` exists only when untied."""

    vocab: int
    d_model: int
    tied: bool
    tp: int = 1

    @nn.compact
    def __call__(self, x_btd, wte_vd, par: Parallel):
        y_btd = LayerNorm(name="ln_f")(x_btd)
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
class GPT(DecoderStagedModel):
    """The GPT as a `jax_overlap.model_api.StagedModel`."""

    num_layers: int
    d_model: int
    heads: int
    d_ff: int
    vocab: int
    seq_len: int
    tied_embeddings: bool = True

    @classmethod
    def from_config(cls, m) -> "GPT":
        return cls(m.layers, m.d_model, m.heads, m.d_ff, m.vocab, m.seq_len, m.tied_embeddings)

    # Modules at a given TP size -------------------------------------------------------------
    def _embed(self, tp):
        return Embed(self.vocab, self.d_model, self.seq_len, tp)

    def _block(self, tp):
        return Block(self.d_model, self.heads, self.d_ff, self.num_layers, tp)

    def _head(self, tp):
        return Head(self.vocab, self.d_model, self.tied_embeddings, tp)

    # StagedModel (init, embed, block, head_loss, logits, loss_count: DecoderStagedModel) ---
    def param_axes(self) -> Any:
        ln = {"scale": ("embed",), "bias": ("embed",)}
        blocks = {
            "w_qkv": ("embed", "heads", None), "b_qkv": ("heads", None),
            "w_o": ("heads", "head_dim", "embed"), "b_o": ("embed",),
            "w_in": ("embed", "mlp"), "b_in": ("mlp",),
            "w_out": ("mlp", "embed"), "b_out": ("embed",),
            "ln_attn": ln, "ln_mlp": ln,
        }
        blocks = jax.tree.map(lambda a: ("layers",) + a, blocks,
                              is_leaf=lambda x: isinstance(x, tuple))
        head: dict[str, Any] = {"ln_f": ln}
        if not self.tied_embeddings:
            head["w_out"] = ("embed", "vocab")
        return {"embed": {"wte": ("vocab", "embed"), "wpe": ("seq", "embed")},
                "blocks": blocks, "head": head}

    def num_params(self) -> int:
        d, f, v, t, n = self.d_model, self.d_ff, self.vocab, self.seq_len, self.num_layers
        per_block = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d
        return n * per_block + v * d + t * d + 2 * d + (0 if self.tied_embeddings else d * v)

    def flops_per_example(self) -> float:
        """6·N·T for the matmuls (N without position embeddings) plus attention's 12·L·T²·d."""
        t = self.seq_len
        n = self.num_params() - t * self.d_model
        return 6.0 * n * t + 12.0 * self.num_layers * t * t * self.d_model


def build(cfg):
    """The model `model.kind: gpt` names (registered in pyproject.toml)."""
    return GPT.from_config(cfg.model)
