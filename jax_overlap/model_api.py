"""What a model must provide to be trained by jax_overlap: embedding + N blocks + head.

A model is three pure per-device functions plus its parameter layout. The library owns the
mesh, the pipeline schedule, the overlap options, checkpoints and metrics; the model only says
how one device computes its part, calling `jax_overlap.collectives` for TP communication.

Parameters live in the logical (global, un-staged) layout:
    {'embed': ..., 'blocks': <every leaf stacked with a leading layer axis>, 'head': ...}
and `param_axes()` names the logical axis of every dimension ('layers' first for blocks), which
`jax_overlap.mesh.LOGICAL_RULES` binds to mesh axes.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax

from jax_overlap.collectives import Parallel

Batch = dict[str, jax.Array]  # {'inputs': (B, ...), 'targets': (B, ...)}; leading dim = batch


class StagedModel(Protocol):
    num_layers: int

    def init(self, rng: jax.Array) -> Any:
        """Global-shape parameters {'embed', 'blocks', 'head'}; same values for every mesh."""

    def param_axes(self) -> Any:
        """Same tree as `init`'s result, each leaf a tuple of logical axis names."""

    def embed(self, params_embed: Any, inputs: jax.Array, par: Parallel) -> jax.Array:
        """Inputs of one microbatch -> activations entering block 0."""

    def block(self, params_block: Any, x: jax.Array, par: Parallel) -> jax.Array:
        """One block (parameters of a single layer, no layer axis)."""

    def head_loss(self, params_embed: Any, params_head: Any, x: jax.Array,
                  targets: jax.Array, par: Parallel) -> jax.Array:
        """Sum of the per-example losses of the microbatch (a scalar, identical on TP ranks)."""

    def loss_count(self, targets: jax.Array) -> jax.Array:
        """How many loss terms `head_loss` sums over for these targets (the mean's divisor)."""

    def flops_per_example(self) -> float:
        """Training FLOPs (forward + backward) for one example, for MFU."""
