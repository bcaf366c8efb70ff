"""Forward-only loss of a checkpoint's parameters on any mesh: held-out evaluation during
training (`train.eval_every`) and scoring a checkpoint (`jax-overlap evaluate`).

Evaluation has no gradients to reduce and nothing to overlap, so it does not go through the
explicit-collective step: the staged parameters are put back in logical layer order and the
single-device loss (`grads.reference_loss`'s sum) runs under GSPMD on their shardings. The
result is the same number on every mesh, including pp > 1 (the stage-split blocks are
gathered by XLA), and a mean over several batches weights every loss term alike.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import jax
import jax.numpy as jnp

from jax_overlap.parallel.collectives import Parallel
from jax_overlap.pipeline import layout as staged_layout
from jax_overlap.training import grads


def make_eval_loss(model, plan, mesh) -> Callable:
    """Jitted `(params, batch) -> (loss_sum, count)` for staged params in the plan's layout.

    `loss_sum` is the sum of the per-example losses over the batch and `count` the number of
    loss terms (`model.loss_count`), both fp32 scalars, so batches combine as
    `sum(loss_sum) / sum(count)`.
    """
    del mesh  # the arrays carry their shardings; GSPMD places the forward

    def loss_sum(params, batch):
        logical = staged_layout.to_logical(params, plan.layer_perm)
        total = grads.loss_sum(model, logical, batch, Parallel())
        count = model.loss_count(batch["targets"])
        return total.astype(jnp.float32), jnp.asarray(count, jnp.float32)

    return jax.jit(loss_sum)


def mean_loss(eval_fn: Callable, params, batches: Iterable) -> dict[str, float]:
    """`{"loss", "perplexity", "tokens"}` over `batches` (placed arrays) with `eval_fn` from
    `make_eval_loss`; the mean is over every loss term of every batch."""
    total, count = 0.0, 0.0
    for batch in batches:
        s, c = eval_fn(params, batch)
        total += float(s)
        count += float(c)
    if count == 0:
        raise ValueError("evaluation: no batch to evaluate (the data is shorter than one batch)")
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": int(count)}
