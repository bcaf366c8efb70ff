"""MoE router statistics out of the gradients, into the step's metrics.

An MoE block (`models/moe.py`) holds a zero parameter `moe_stats` of shape (E + 2) that its
forward never reads; its backward writes the block's statistics as that parameter's
"gradient": tokens per expert (E), dropped assignments, the router losses' value. The
gradient machinery (microbatch accumulation, dp reductions, the pipeline) sums them over the
global batch like any gradient. `take` zeroes them before the optimizer (so the parameter
stays 0 and the gradient norm and clipping never see them) and turns them into metrics.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jax_overlap.model_api import MOE_STATS

STATS = MOE_STATS


def take(grads: Any, experts: int) -> tuple[Any, dict]:
    """(grads with every `moe_stats` leaf zeroed, metrics); no metrics without MoE blocks.
    Each leaf's entries: tokens per expert (`experts`), dropped, router loss.

    Metrics (global batch, one step): `moe_tokens_per_expert` (E,) the routed assignments per
    expert, mean over MoE layers; `moe_dropped_tokens` assignments over capacity, summed over
    layers; `moe_router_loss` the balance + z-loss term's value; `moe_expert_load_min` the
    least loaded expert's share of its layer's mean load (1 = perfectly even), worst layer.
    """
    found: list[jax.Array] = []

    def visit(tree):
        if isinstance(tree, dict):
            out = {}
            for k, v in tree.items():
                if k == STATS and not isinstance(v, dict):
                    found.append(v)
                    out[k] = jnp.zeros_like(v)
                else:
                    out[k] = visit(v)
            return out
        return tree

    grads = visit(grads)
    if not found:
        return grads, {}
    stats = jnp.concatenate([s.reshape(-1, s.shape[-1]) for s in found]).astype(jnp.float32)
    tokens_le = stats[:, :-2]
    mean_l = tokens_le.mean(-1)
    load_min = jnp.min(tokens_le.min(-1) / jnp.maximum(mean_l, 1e-9))
    return grads, {"moe_tokens_per_expert": tokens_le.mean(0),
                   "moe_dropped_tokens": stats[:, -2].sum(),
                   "moe_router_loss": stats[:, -1].sum(),
                   "moe_expert_load_min": load_min}


def step_record(metrics: dict) -> dict:
    """The MoE fields of a metrics.jsonl record, from a step's host metrics (empty without
    MoE): `tokens_per_expert` (list), `dropped_tokens`, `router_loss`, `expert_load_min`."""
    if "moe_tokens_per_expert" not in metrics:
        return {}
    return {"tokens_per_expert": [round(float(x), 2) for x in metrics["moe_tokens_per_expert"]],
            "dropped_tokens": int(round(float(metrics["moe_dropped_tokens"]))),
            "router_loss": float(metrics["moe_router_loss"]),
            "expert_load_min": float(metrics["moe_expert_load_min"])}
