"""BERT-style bidirectional encoder with masked-language-modelling loss, on the GPT's TP block.

The encoder is `models.gpt.Block` with `causal=False` (pre-norm, Megatron TP: column-parallel
QKV / MLP-in, row-parallel out-projections), so everything the library does for the GPT
(TP collectives, sequence parallelism, pipelining, overlap) applies unchanged.

Masked language modelling on the same byte-level data: `MLMStream` wraps the config's
`TokenStream`; batch i masks exactly `round(mask_rate * T)` positions per sequence, chosen
from a generator seeded by (seed, i) -- so the global batch, hence every mesh, masks the same
positions, and a resumed run re-masks identically. Chosen positions become [MASK] (80%),
a random byte (10%) or stay unchanged (10%), as in BERT. Batches are
    inputs:  (B, T) token ids, with MASK_ID (-1) at masked positions,
    targets: (B, T) the original token at the chosen positions, IGNORE (-1) elsewhere.
[MASK] is a learned vector outside the vocabulary table (id -1 never matches a vocab row on
any TP rank), so the vocabulary stays the data's and the tied output layer predicts only real
tokens. The loss sums cross-entropy over chosen positions; `loss_count` is how many there are,
which the step psums over dp for the global mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jax_overlap.parallel.collectives import (
    Parallel,
    sequence_shard,
    sp_gather,
    token_shard,
    vocab_columns,
    vocab_cross_entropy,
    vocab_embed,
)
from models.gpt import GPT, Block, LayerNorm

MASK_ID = -1  # input id of the [MASK] token (not a vocabulary row)
IGNORE = -1  # target of positions without a loss term


def _normal(std: float):
    return nn.initializers.normal(stddev=std)


class BertEmbed(nn.Module):
    """Token (vocab-parallel) + position embeddings, with a learned [MASK] vector."""

    vocab: int
    d_model: int
    seq_len: int
    tp: int = 1

    @nn.compact
    def __call__(self, ids_bt, par: Parallel):
        wte_vd = self.param("wte", _normal(0.02), (self.vocab // self.tp, self.d_model))
        wpe_td = self.param("wpe", _normal(0.01), (self.seq_len, self.d_model))
        mask_d = self.param("mask", _normal(0.02), (self.d_model,))
        dt = par.compute_dtype
        # MASK_ID lies outside every rank's vocabulary rows, so it embeds to zeros here.
        x_btd = vocab_embed(ids_bt, wte_vd.astype(dt), par)
        t = ids_bt.shape[1]
        t_local = x_btd.shape[1]
        pos_td = sequence_shard(wpe_td[:t].astype(dt), 0, t_local, par)
        ids_bt = token_shard(ids_bt, par)
        masked_bt1 = (ids_bt == MASK_ID)[..., None]
        return jnp.where(masked_bt1, mask_d.astype(dt), x_btd) + pos_td


class MLMHead(nn.Module):
    """Final LayerNorm, BERT's transform (dense + GELU + LayerNorm), vocab-parallel logits."""

    vocab: int
    d_model: int
    tied: bool
    tp: int = 1

    @nn.compact
    def __call__(self, x_btd, wte_vd, par: Parallel):
        dt = par.compute_dtype
        w_t_dd = self.param("w_transform", _normal(0.02), (self.d_model, self.d_model))
        b_t_d = self.param("b_transform", nn.initializers.zeros, (self.d_model,))
        b_v = self.param("b_vocab", nn.initializers.zeros, (self.vocab // self.tp,))
        y_btd = LayerNorm(name="ln_f")(x_btd)
        if par.sequence_sharded:  # logits need every position: this rank's rows -> (B, T, D)
            y_btd = sp_gather(y_btd, par)
        # The transform is small and replicated on TP ranks: no collective needed.
        h_btd = jnp.einsum("btd,de->bte", y_btd.astype(dt), w_t_dd.astype(dt)) + b_t_d.astype(dt)
        h_btd = LayerNorm(name="ln_transform")(jax.nn.gelu(h_btd, approximate=True))
        if self.tied:
            w_dv = wte_vd.T
        else:
            w_dv = self.param("w_out", _normal(0.02), (self.d_model, self.vocab // self.tp))
        w_dv, b_v = vocab_columns(w_dv, par), vocab_columns(b_v, par)
        return jnp.einsum("btd,dv->btv", h_btd.astype(dt), w_dv.astype(dt)) + b_v.astype(dt)


@dataclass(frozen=True)
class BERT(GPT):
    """The encoder as a `jax_overlap.model_api.StagedModel`; batches come from `MLMStream`.

    Shares the GPT's initialisation, block, and per-device apply functions; only the module
    set (bidirectional block, [MASK] embedding, MLM head), the loss and the data differ.
    """

    mask_rate: float = 0.15
    # An encoder: no left-to-right decoding (jax_overlap.model_api.Decoder) to inherit.
    init_cache = decode = None

    def _embed(self, tp):
        return BertEmbed(self.vocab, self.d_model, self.seq_len, tp)

    def _block(self, tp):
        return Block(self.d_model, self.heads, self.d_ff, self.num_layers, tp, causal=False)

    def _head(self, tp):
        return MLMHead(self.vocab, self.d_model, self.tied_embeddings, tp)

    def param_axes(self) -> Any:
        ln = {"scale": ("embed",), "bias": ("embed",)}
        gpt_blocks = super().param_axes()["blocks"]  # same Block, same layout
        head: dict[str, Any] = {"ln_f": ln, "ln_transform": ln,
                                "w_transform": ("embed", "embed"), "b_transform": ("embed",),
                                "b_vocab": ("vocab",)}
        if not self.tied_embeddings:
            head["w_out"] = ("embed", "vocab")
        return {"embed": {"wte": ("vocab", "embed"), "wpe": ("seq", "embed"),
                          "mask": ("embed",)},
                "blocks": gpt_blocks, "head": head}

    def head_loss(self, params_embed, params_head, x_btd, targets_bt, par: Parallel):
        logits_btv = self._head(par.tp).apply({"params": params_head}, x_btd,
                                              params_embed["wte"], par)
        chosen_bt = targets_bt != IGNORE
        ce_bt = vocab_cross_entropy(logits_btv, jnp.where(chosen_bt, targets_bt, 0), par)
        return jnp.where(chosen_bt, ce_bt, 0.0).sum()

    def loss_count(self, targets_bt):
        return (targets_bt != IGNORE).sum().astype(jnp.float32)

    def num_params(self) -> int:
        d, f, v, t, n = self.d_model, self.d_ff, self.vocab, self.seq_len, self.num_layers
        per_block = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d
        head = 2 * d + d * d + d + 2 * d + v + (0 if self.tied_embeddings else d * v)
        return n * per_block + v * d + t * d + d + head

    # flops_per_example: GPT's formula; the head runs on every position (masked or not), as
    # the logits are computed densely.

    def masked_per_sequence(self) -> int:
        return max(1, int(round(self.mask_rate * self.seq_len)))

    # Data -------------------------------------------------------------------------------------
    def data_stream(self, cfg) -> "MLMStream":
        """The config's token stream, masked for MLM."""
        from jax_overlap.data import streams as datalib

        return MLMStream(datalib.stream_from_config(cfg), self.vocab, self.masked_per_sequence())

    def eval_stream(self, cfg) -> "MLMStream":
        """Held-out sequences (`train.eval_every`), masked alike."""
        from jax_overlap.data import streams as datalib

        return MLMStream(datalib.eval_stream_from_config(cfg), self.vocab,
                         self.masked_per_sequence())


@dataclass(frozen=True)
class MLMStream:
    """Masks a `TokenStream`'s sequences for masked language modelling, by batch index.

    Attributes:
      base: the token stream (its `inputs` are the sequences; its `targets` are unused).
      vocab: random replacements are drawn from [0, vocab).
      masked: positions chosen per sequence.
    """

    base: Any
    vocab: int
    masked: int

    SALT = 0x4D4C4D  # 'MLM': the masking generator is independent of the window sampler

    def batch(self, index: int) -> dict[str, np.ndarray]:
        tokens_bt = self.base.batch(index)["inputs"]
        b, t = tokens_bt.shape
        rng = np.random.Generator(np.random.Philox(key=[self.base.seed ^ self.SALT, index]))
        # `masked` distinct positions per row: the smallest of t random keys.
        chosen_bk = np.argsort(rng.random((b, t)), axis=1)[:, :self.masked]
        chosen_bt = np.zeros((b, t), bool)
        np.put_along_axis(chosen_bt, chosen_bk, True, axis=1)
        action_bt = rng.random((b, t))  # < 0.8: [MASK], < 0.9: random token, else keep
        random_bt = rng.integers(0, self.vocab, size=(b, t))
        inputs_bt = np.where(chosen_bt & (action_bt < 0.8), MASK_ID, tokens_bt)
        inputs_bt = np.where(chosen_bt & (action_bt >= 0.8) & (action_bt < 0.9), random_bt,
                             inputs_bt)
        targets_bt = np.where(chosen_bt, tokens_bt, IGNORE)
        return {"inputs": inputs_bt.astype(np.int32), "targets": targets_bt.astype(np.int32)}


__all__ = ["BERT", "MLMStream", "BertEmbed", "MLMHead", "MASK_ID", "IGNORE"]


def build(cfg):
    """The model `model.kind: bert` names (registered in pyproject.toml)."""
    return BERT.from_config(cfg.model)
