"""Held-out evaluation during training (`train.eval_every`, `train.eval_batches`).

Every `eval_every` accepted steps the loop asks `Evaluator.run(params)` for the mean loss and
perplexity over the same `eval_batches` held-out global batches (the token shards' val split,
or the byte corpus's held-out tail: `jax_overlap.data.streams.eval_stream_from_config`),
through the forward-only `jax_overlap.training.evaluate` loss, which is the same number on
every mesh and schedule. The batches are placed once and kept.
"""

from __future__ import annotations

from typing import Any

from jax_overlap.data import streams as datalib
from jax_overlap.training import evaluate


class Evaluator:
    """`due(step)` and `run(params) -> {"eval_loss", "eval_perplexity", "eval_tokens"}`."""

    def __init__(self, model, plan, mesh, stream, every: int, batches: int):
        self.every, self.num_batches = every, batches
        self._model, self._plan, self._mesh, self._stream = model, plan, mesh, stream
        self._fn: Any = None
        self._batches: list | None = None

    def due(self, step: int) -> bool:
        return self.every > 0 and step > 0 and step % self.every == 0

    def run(self, params) -> dict[str, float]:
        if self._fn is None:
            self._fn = evaluate.make_eval_loss(self._model, self._plan, self._mesh)
            self._batches = [datalib.place_batch(self._stream, j, self._mesh)
                             for j in range(self.num_batches)]
        out = evaluate.mean_loss(self._fn, params, self._batches)
        return {"eval_loss": out["loss"], "eval_perplexity": out["perplexity"],
                "eval_tokens": out["tokens"]}


def from_config(cfg, model, plan, mesh) -> Evaluator | None:
    """The run's evaluator, or None when `train.eval_every` is 0.

    Raises:
      ValueError: naming `train.eval_every` when the model brings its own batches
        (`data_stream`) but no held-out ones (`eval_stream`).
    """
    t = cfg.train
    if t.eval_every <= 0:
        return None
    if hasattr(model, "eval_stream"):
        stream = model.eval_stream(cfg)
    elif hasattr(model, "data_stream"):
        raise ValueError(f"train.eval_every: {type(model).__name__} supplies its own batches "
                         f"(data_stream) but no held-out ones (eval_stream); add "
                         f"eval_stream(cfg) to the model or set train.eval_every=0")
    else:
        stream = datalib.eval_stream_from_config(cfg)
    return Evaluator(model, plan, mesh, stream, t.eval_every, t.eval_batches)
