"""Per-device memory of a transformer train step, estimated from shapes alone (no tracing).

Used where a decision has to be made before anything is compiled: the plan's automatic
microbatching, `analyze`'s hints and the calibrated cost model's stash sizes. The estimate
counts what a step keeps alive at its peak:

* state: fp32 parameters, gradients and Adam's two moments per parameter stored on the
  device (TP splits blocks, the vocabulary and the MLP; PP splits the layers; ZeRO-1 splits
  the moments over dp; FSDP splits the blocks' parameters, gradients and moments over dp),
  plus a bf16 copy of the parameters under bf16 precision;
* activations: what each layer keeps for its backward under the remat policy
  (`layer_stash_bytes`: every residual for `none`, the block input for `full`, the matmul
  outputs for `save_dots` / `minimal`), for one microbatch at pp = 1 and, at pp > 1, for
  each microbatch in flight on the stage (at most `pp`), plus one layer's recomputed
  residuals while `full` backpropagates;
* the fp32 logits and their gradient on the last stage.

It is an estimate, not XLA's number: XLA's buffer assignment adds temporaries and, when it
overlaps collectives, keeps some buffers alive longer; callers keep headroom for that.
"""

from __future__ import annotations


def dtype_bytes(precision: str) -> int:
    """Bytes per activation element: 2 under bf16 compute, else 4."""
    return 2 if precision in ("bf16", "fp16") else 4


def layer_residual_bytes(model, micro_batch: int, tp: int, precision: str) -> float:
    """Residual bytes one transformer layer keeps for its backward, for one microbatch on one
    TP rank: per token the norm and matmul inputs (4 d, not TP-split), q, k, v, the attention
    output and both MLP hidden tensors (4 d + 2 d_ff, split) and the attention probabilities
    (heads x T, split)."""
    tokens = micro_batch * model.seq_len
    width = 4 * model.d_model + (4 * model.d_model + 2 * model.d_ff
                                 + model.heads * model.seq_len) / tp
    return tokens * dtype_bytes(precision) * width


def layer_stash_bytes(model, micro_batch: int, tp: int, precision: str,
                      remat: str = "none") -> float:
    """What one layer keeps between its forward and its backward under a remat policy
    (`parallel/remat.py`), for one microbatch on one TP rank: `none` every residual
    (`layer_residual_bytes`); `full` only the block's input; `save_dots` the matmul outputs
    (the residuals less the softmax output, recomputed from the saved scores: about the same);
    `minimal` the matmul outputs without the attention scores and probabilities."""
    tokens = micro_batch * model.seq_len
    every = layer_residual_bytes(model, micro_batch, tp, precision)
    if remat == "full":
        return tokens * model.d_model * dtype_bytes(precision)
    if remat == "minimal":
        return every - tokens * dtype_bytes(precision) * model.heads * model.seq_len / tp
    return every


def param_elements(model) -> tuple[float, float]:
    """(embedding + head elements, elements of one block) of a GPT/BERT-shaped model."""
    d, f = model.d_model, model.d_ff
    embed = model.vocab * d + model.seq_len * d + 2 * d
    if not getattr(model, "tied_embeddings", True):
        embed += model.vocab * d
    block = 4 * d * d + 2 * d * f + 9 * d + f  # qkv + out, MLP, biases and norms
    return float(embed), float(block)


def step_bytes(model, micro_batch: int, tp: int, pp: int, dp: int, precision: str, *,
               zero1: bool = False, fsdp: bool = False, remat: str = "none") -> float:
    """Estimated peak bytes per device of one train step (see the module docstring).

    Args:
      model: the model config (`cfg.model`: layers, d_model, heads, d_ff, vocab, seq_len).
      micro_batch: sequences per microbatch on one replica.
      tp, pp, dp: mesh axis sizes.
      precision: "fp32" or "bf16".
      zero1: Adam's moments split over dp.
      fsdp: block parameters, gradients and moments split over dp.
      remat: the `model.remat` policy (what each layer stashes, `layer_stash_bytes`).
    """
    embed, block = param_elements(model)
    layers = model.layers / pp
    block_elems = layers * block / tp / (dp if fsdp else 1)
    embed_elems = embed / tp
    elems = block_elems + embed_elems
    moments = 8 * (elems / dp if zero1 and not fsdp else elems)
    state = elems * (4 + 4) + moments + (2 * elems if precision in ("bf16", "fp16") else 0)
    tokens = micro_batch * model.seq_len
    kept = layer_stash_bytes(model, micro_batch, tp, precision, remat)
    # `full` rebuilds one layer's residuals at a time inside the backward.
    redo = layer_residual_bytes(model, micro_batch, tp, precision) if remat == "full" else 0.0
    in_flight = 1 if pp == 1 else pp
    acts = in_flight * layers * kept + redo
    logits = 2 * tokens * model.vocab / tp * 4
    return float(state + acts + logits)
