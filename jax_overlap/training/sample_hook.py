"""Samples during training (`train.sample_every`, `train.sample_prompt`, `train.sample_tokens`).

Every `sample_every` accepted steps the loop asks `Sampler.run(params, step)` for `SAMPLES`
continuations of the prompt, drawn at temperature 1 with a key of `train.seed` and the step,
by `jax_overlap.training.generate`'s key/value-cache decoding (compiled once) and decoded with
the run's tokenizer. The loop writes them as a `sample` event to metrics.jsonl, and
`training.events` puts them in TensorBoard's text tab.
"""

from __future__ import annotations

from typing import Any

from jax_overlap.config import ConfigError
from jax_overlap.training import generate

SAMPLES = 3
DEFAULT_PROMPT = "def "  # the default corpus (data.source: stdlib) is Python source


class Sampler:
    """`due(step)` and `run(params, step) -> {"prompt", "samples"}`."""

    def __init__(self, model, plan, mesh, tok, prompt: str, ids, tokens: int, every: int,
                 seed: int):
        self.every, self.prompt, self.tokens = every, prompt, tokens
        self._model, self._plan, self._mesh = model, plan, mesh
        self._tok, self._ids, self._seed = tok, ids, seed
        self._fn: Any = None

    def due(self, step: int) -> bool:
        return self.every > 0 and step > 0 and step % self.every == 0

    def run(self, params, step: int) -> dict:
        import jax
        import numpy as np

        if self._fn is None:
            self._fn = generate.make_generate(self._model, self._plan, self._mesh, SAMPLES,
                                              len(self._ids), self.tokens, temperature=1.0,
                                              valid_vocab=self._tok.vocab_size)
            self._prompt_bt = generate.place_prompt(
                np.tile(self._ids[None, :], (SAMPLES, 1)), self._mesh)
        key = jax.random.fold_in(jax.random.key(self._seed), step)
        rows = jax.device_get(self._fn(params, self._prompt_bt, key))
        return {"prompt": self.prompt,
                "samples": [self._tok.decode(list(self._ids) + list(r)) for r in rows]}


def from_config(cfg, model, plan, mesh, run_dir: str | None = None) -> Sampler | None:
    """The run's sampler, or None when `train.sample_every` is 0.

    Raises:
      ConfigError: naming `train.sample_every` for a model that cannot decode, or
        `train.sample_prompt` for a prompt that fills model.seq_len.
    """
    t = cfg.train
    if t.sample_every <= 0:
        return None
    if not generate.can_decode(model):
        raise ConfigError([f"train.sample_every: {type(model).__name__} cannot generate text "
                           f"(no init_cache / decode, jax_overlap.model_api.Decoder); set "
                           f"train.sample_every=0"])
    tok = generate.run_tokenizer(cfg, run_dir)
    prompt = t.sample_prompt or DEFAULT_PROMPT
    room = cfg.model.seq_len - len(tok.encode(prompt.encode("utf-8")))
    tokens = max(1, min(t.sample_tokens, room))
    ids, tokens = generate.prompt_ids(tok, prompt, cfg.model, tokens, field="train.sample_prompt",
                              new_field="train.sample_tokens")
    return Sampler(model, plan, mesh, tok, prompt, ids, tokens, t.sample_every, t.seed)
