"""What a model must provide to be trained by jax_overlap: embedding + N blocks + head.

A model is three pure per-device functions plus its parameter layout. The library owns the
mesh, the pipeline schedule, the overlap options, checkpoints and metrics; the model only says
how one device computes its part, calling `jax_overlap.parallel.collectives` for TP communication.

Parameters live in the logical (global, un-staged) layout:
    {'embed': ..., 'blocks': <every leaf stacked with a leading layer axis>, 'head': ...}
and `param_axes()` names the logical axis of every dimension ('layers' first for blocks), which
`jax_overlap.parallel.mesh.LOGICAL_RULES` binds to mesh axes.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Protocol

import jax
import numpy as np

from jax_overlap.parallel.collectives import Parallel
from jax_overlap.parallel.mesh import LOGICAL_RULES, TP

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


class Decoder(Protocol):
    """Optional, for `jax-overlap generate` and `train.sample_every` (jax_overlap.training.
    generate): decoding with a key/value cache. The built-in GPT and Llama have it
    (`models/decoder.py`); a model without it trains but cannot sample."""

    vocab: int

    def cache_heads(self) -> int:
        """Key/value heads per layer the cache holds (GSPMD splits them over tp if it can)."""

    def init_cache(self, batch: int, max_len: int) -> Any:
        """The empty cache for `batch` sequences of up to `max_len` tokens (global shapes,
        heads on axis 3 of every leaf)."""

    def decode(self, params: Any, ids_bt: jax.Array, cache: Any, pos: Any,
               par: Parallel) -> tuple[jax.Array, Any]:
        """`(logits (B, T, V), cache)` of `T` new tokens at positions `pos .. pos+T-1` given
        the cache of the positions before them: the same logits as the full forward's over
        all `pos + T` tokens. `params` in the logical layout."""


# Models register themselves under this entry-point group (pyproject.toml), so the library finds
# `model.kind` without importing any model package: `kind = "module:builder"`, where
# `builder(cfg) -> StagedModel` takes the whole config, and, as keywords, those of
# `build_facts(cfg)` it declares: the plain parallel facts a model may need (models never read
# the mesh, pipeline or overlap sections themselves).
ENTRY_POINT_GROUP = "jax_overlap.models"


def registered_models() -> dict[str, metadata.EntryPoint]:
    """`model.kind` -> its entry point, for every installed model."""
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def build_model(cfg, tp: int | None = None) -> StagedModel:
    """The StagedModel that `cfg.model.kind` names, from the registered builders; with `tp`,
    laid out for that tensor-parallel degree instead of the mesh's (a Llama-family block
    stores its kv heads replicated when there are fewer than tp).

    Raises:
      ValueError: a kind no installed package registers (the message names the fix).
    """
    kind = cfg.model.kind
    known = registered_models()
    if kind not in known:
        names = ", ".join(sorted(known)) or "none (reinstall the package: pip install -e .)"
        raise ValueError(f"model.kind: no installed model is registered as {kind!r}; "
                         f"registered: {names}")
    builder = known[kind].load()
    declared = inspect.signature(builder).parameters
    facts = build_facts(cfg) | ({} if tp is None else {"tp": tp})
    return builder(cfg, **{k: v for k, v in facts.items() if k in declared})


def build_facts(cfg) -> dict[str, int]:
    """What a builder may ask for by name: `tp`, the tensor-parallel degree its layout is
    built for (Llama's kv-head split), `pipeline_units`, and for a mixture of experts `ep`
    (experts split over groups of ep dp ranks; the plan's `overlap.moe_chunks` reaches the
    blocks as `Parallel.moe_chunks`)."""
    return {"tp": cfg.mesh.tp, "pipeline_units": pipeline_units(cfg), "ep": cfg.mesh.ep}


# A mixture-of-experts block's statistics leaf (`models/moe.py`, `training/moe_stats.py`): a
# zero parameter of this length per MoE layer whose "gradient" carries tokens per expert,
# dropped assignments and the router loss. The Hugging Face layouts store no tensor for it.
MOE_STATS = "moe_stats"


def moe_stats_len(experts: int) -> int:
    """Length of a `moe_stats` leaf: tokens per expert (E), dropped assignments, router loss.
    (FSDP stores a leaf no dp divides whole and sums its gradient like a replicated one's.)"""
    return experts + 2


def pipeline_units(cfg) -> int:
    """How many pieces the pipeline cuts the model into: mesh.pp x the virtual stages per
    device (two under zb-v), one without a pipeline. ResNet groups its residual blocks into
    that many FLOP-balanced units."""
    if cfg.mesh.pp == 1:
        return 1
    v = 2 if cfg.pipeline.schedule == "zb-v" else cfg.pipeline.virtual_stages
    return cfg.mesh.pp * v


def batch_shapes(model, batch: int, seq_len: int) -> dict[str, tuple]:
    """`(shape, dtype)` per batch key for `batch` examples: the model's own
    `example_batch_shapes`, else token ids and targets of `(batch, seq_len)`."""
    if hasattr(model, "example_batch_shapes"):
        return model.example_batch_shapes(batch)
    return {"inputs": ((batch, seq_len), "int32"), "targets": ((batch, seq_len), "int32")}


# ------------------------------------------------------------------------ parameter count


@dataclass(frozen=True)
class ParamCounts:
    """Parameter elements on one TP rank: the package's one parameter count, traced from the
    model's own `init` and `param_axes` (abstract shapes: nothing is allocated).

    Attributes:
      per_layer: one block's elements.
      embed: embedding elements (token + position).
      head: head elements (final norm; output matrix when untied).
      leaves_per_layer: one block's parameter arrays, each ``(elements,)``.
      embed_leaves: embedding arrays' elements.
      head_leaves: head arrays' elements.
    """

    per_layer: int
    embed: int
    head: int
    leaves_per_layer: tuple[int, ...]
    embed_leaves: tuple[int, ...]
    head_leaves: tuple[int, ...]


def _local_shape(shape: tuple[int, ...], axes: tuple, tp: int) -> tuple[int, ...]:
    """One TP rank's shape: every dimension bound to the TP mesh axis divided by ``tp``."""
    return tuple(
        n // tp if a is not None and LOGICAL_RULES.get(a) == TP else n
        for n, a in zip(shape, axes)
    )


def local_param_shapes(model: StagedModel, tp: int) -> Any:
    """``ShapeDtypeStruct`` tree of one TP rank's parameters (blocks keep the layer axis).
    Traced abstractly, the key too: no backend starts (a plan is built before
    `jax.distributed.initialize` may run)."""
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0)))
    return jax.tree.map(
        lambda s, axes: jax.ShapeDtypeStruct(_local_shape(s.shape, axes, tp), s.dtype),
        abstract,
        model.param_axes(),
        is_leaf=lambda x: isinstance(x, tuple),
    )


def _counts(shapes: Any) -> ParamCounts:
    """`ParamCounts` of a `local_param_shapes` tree."""
    def sizes(tree, drop_layer_axis=False):
        return tuple(int(np.prod(s.shape[1:] if drop_layer_axis else s.shape))
                     for s in jax.tree.leaves(tree))

    blocks = sizes(shapes["blocks"], drop_layer_axis=True)
    embed, head = sizes(shapes["embed"]), sizes(shapes.get("head", {}))
    return ParamCounts(sum(blocks), sum(embed), sum(head), blocks, embed, head)


def param_counts(cfg, tp: int = 1) -> ParamCounts:
    """Parameter elements of ``cfg``'s model on one rank of a ``tp``-way TP group.

    The model is built as the library default config with only ``cfg.model`` set (so the
    count depends on the model alone) and its init traced abstractly, once per model: ~0.1 s,
    and a plan or a sweep asks for the same few counts many times.
    """
    return _param_counts(type(cfg), type(cfg.model), dataclasses.astuple(cfg.model), tp)


@functools.lru_cache(maxsize=64)
def _param_counts(config_type: type, model_type: type, model_fields: tuple,
                  tp: int) -> ParamCounts:
    cfg = config_type(model=model_type(*model_fields))
    return _counts(local_param_shapes(build_model(cfg), tp))


def param_elements(cfg, model: StagedModel | None = None) -> tuple[float, float]:
    """``(embedding + head elements, elements of one block)`` of ``cfg``'s model, unsplit
    (`param_counts` at tp = 1): what the memory model and the plan's estimates take. Given
    the built ``model`` (a model the config alone does not describe, e.g. a test's small
    ResNet), its own arrays are counted."""
    c = param_counts(cfg, 1) if model is None else _counts(local_param_shapes(model, 1))
    return float(c.embed + c.head), float(c.per_layer)
