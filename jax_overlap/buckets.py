"""Gradient reduction over the data-parallel axis."""

from __future__ import annotations

from typing import Any

import jax


def reduce_gradients(grads: Any, overlap_cfg, axis: str) -> Any:
    """One psum over `axis` per gradient leaf: (shape of leaf) per device, summed over dp."""
    return jax.tree.map(lambda g: jax.lax.psum(g, axis), grads)
