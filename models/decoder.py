"""The `StagedModel` methods every decoder here shares (GPT, Llama).

A decoder supplies its Flax modules at a TP size (`_embed(tp)`, `_block(tp)`, `_head(tp)`,
the head taking the token embedding for tied weights) and its shapes (`num_layers`,
`d_model`, `seq_len`); this mixin turns them into the per-device functions of
`jax_overlap.model_api.StagedModel`: init (logical, at tp = 1, blocks stacked with `vmap`),
embed, block, head_loss / logits, loss_count.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jax_overlap.parallel.collectives import Parallel, vocab_cross_entropy


class DecoderStagedModel:
    """Mixin: the shared StagedModel methods of a decoder-only LM."""

    # The head slices its output layer with `vocab_columns` and its loss is
    # `vocab_cross_entropy`: it can run vocabulary-parallel over the pipeline stages.
    vocab_parallel_head = True

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
