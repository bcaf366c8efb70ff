"""The `StagedModel` methods every decoder here shares (GPT, Llama).

A decoder supplies its Flax modules at a TP size (`_embed(tp)`, `_block(tp)`, `_head(tp)`,
the head taking the token embedding for tied weights) and its shapes (`num_layers`,
`d_model`, `seq_len`); this mixin turns them into the per-device functions of
`jax_overlap.model_api.StagedModel`: init (logical, at tp = 1, blocks stacked with `vmap`),
embed, block, head_loss / logits, loss_count; and the key/value-cache decoding
`jax_overlap.training.generate` samples with (`init_cache`, `decode`): each block's
`__call__` takes an optional `cache=(k, v)` and `pos` and then returns `(x, cache)`.
"""

from __future__ import annotations

from typing import Any

import math

import jax
import jax.numpy as jnp

from jax_overlap.parallel.collectives import Parallel, vocab_cross_entropy


def cached_attention(q_bthe: jax.Array, k_bske: jax.Array, v_bske: jax.Array, pos,
                     dtype) -> jax.Array:
    """Causal attention of `t` new queries at positions `pos .. pos+t-1` over a key/value
    cache of `S` positions (those past `pos + t - 1` are masked out, whatever they hold).

    `(B, T, H, E)` queries, `(B, S, K, E)` cached keys and values with `H` a multiple of `K`
    (query head `h` reads kv head `h // (H / K)`); fp32 scores and softmax as the full
    forward's plain path, probabilities in `dtype`. Returns `(B, T, H, E)`.
    """
    b, t, h, e = q_bthe.shape
    s, kv = k_bske.shape[1], k_bske.shape[2]
    q_btkge = q_bthe.reshape(b, t, kv, h // kv, e)
    scores = jnp.einsum("btkge,bske->bkgts", q_btkge, k_bske).astype(jnp.float32)
    scores = scores / math.sqrt(e)
    visible_ts = jnp.arange(s)[None, :] <= pos + jnp.arange(t)[:, None]
    scores = jnp.where(visible_ts, scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    ctx_btkge = jnp.einsum("bkgts,bske->btkge", probs, v_bske)
    return ctx_btkge.reshape(b, t, h, e)


def write_cache(cache_bske: jax.Array, new_btke: jax.Array, pos) -> jax.Array:
    """The cache with the new positions' keys (or values) written at `pos .. pos+t-1`."""
    return jax.lax.dynamic_update_slice_in_dim(cache_bske, new_btke.astype(cache_bske.dtype),
                                               pos, axis=1)


class DecoderStagedModel:
    """Mixin: the shared StagedModel methods of a decoder-only LM."""

    # The head slices its output layer with `vocab_columns` and its loss is
    # `vocab_cross_entropy`: it can run vocabulary-parallel over the pipeline stages.
    vocab_parallel_head = True
    # The embedding maps each example on its own (no statistics over the batch, no collective
    # over the data axes): the pipeline may pull it back for any replica's inputs at once
    # (`jax_overlap.pipeline.tick_loop.DeferredEmbedding`).
    per_example_embedding = True

    def init(self, rng: jax.Array) -> Any:
        k_embed, k_blocks, k_head = jax.random.split(rng, 3)
        par = Parallel()
        ids = jnp.zeros((1, self.seq_len), jnp.int32)
        x = jnp.zeros((1, self.seq_len, self.d_model), jnp.float32)
        embed = self._embed(1).init(k_embed, ids, par)["params"]
        layer_keys = jax.random.split(k_blocks, self.num_layers)
        blocks = jax.vmap(lambda k: self._block(1).init(k, x, par)["params"])(layer_keys)
        head = self._head(1).init(k_head, x, embed["wte"], par).get("params", {})
        return {"embed": embed, "blocks": blocks, "head": head}

    def embed(self, params_embed, inputs_bt, par: Parallel):
        return self._embed(par.tp).apply({"params": params_embed}, inputs_bt, par)

    def block(self, params_block, x_btd, par: Parallel):
        return self._block(par.tp).apply({"params": params_block}, x_btd, par)

    def head_loss(self, params_embed, params_head, x_btd, targets_bt, par: Parallel):
        logits_btv = self.logits(params_embed, params_head, x_btd, par)
        return vocab_cross_entropy(logits_btv, targets_bt, par).sum()

    def logits(self, params_embed, params_head, x_btd, par: Parallel):
        """(B, T, V/tp) logits (the Hugging Face comparison reads them at tp = 1)."""
        return self._head(par.tp).apply({"params": params_head}, x_btd, params_embed["wte"],
                                        par)

    def loss_count(self, targets_bt):
        return jnp.asarray(targets_bt.size, jnp.float32)

    # Decoding with a key/value cache (jax_overlap.training.generate) --------------------
    def cache_heads(self) -> int:
        """Key/value heads a block caches (all heads, or Llama's `kv_heads`)."""
        return getattr(self, "kv_heads", 0) or self.heads

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32) -> dict:
        """Zero key/value cache `{"k", "v"}`, each `(layers, B, max_len, kv_heads, head_dim)`
        (global shapes: GSPMD splits the heads over tp like the weights that fill them)."""
        shape = (self.num_layers, batch, max_len, self.cache_heads(),
                 self.d_model // self.heads)
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}

    def decode(self, params, ids_bt, cache: dict, pos, par: Parallel):
        """`(logits (B, T, V/tp), cache)` of `T` new tokens at positions `pos .. pos+T-1`,
        given the cache of positions `0 .. pos-1`; the logits equal the full forward's over
        all `pos + T` tokens at those positions. `params` in the logical layout."""
        x_btd = self._embed(par.tp).apply({"params": params["embed"]}, ids_bt, par, pos=pos)
        block = self._block(par.tp)

        def layer(x_btd, p_k_v):
            p, k, v = p_k_v
            x_btd, (k, v) = block.apply({"params": p}, x_btd, par, cache=(k, v), pos=pos)
            return x_btd, (k, v)

        x_btd, (k, v) = jax.lax.scan(layer, x_btd, (params["blocks"], cache["k"], cache["v"]))
        return self.logits(params["embed"], params["head"], x_btd, par), {"k": k, "v": v}
