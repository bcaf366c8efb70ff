"""`jax-overlap generate` and `train.sample_every`: sampling text with a key/value cache.

The model decodes through its optional `init_cache` / `decode` methods (the decoders in
`models/decoder.py`; `jax_overlap.model_api.Decoder`): one prefill of the prompt, then one
token per step inside a `lax.fori_loop`, each step attending over the cache instead of
re-running the prefix. Like evaluation it runs under GSPMD on the run's mesh: parameters on
their dp / tp shardings, the cache's heads split over tp like the weights that fill them, the
batch over dp when dp divides it. A pp > 1 run decodes on a pp = 1 mesh of its dp x tp
devices (checkpoints are logical: `generation_config`).

Temperature 0 is greedy (argmax); otherwise softmax(logits / T) over the `top_k` largest
logits (0: all of them), with a key folded from the seed and the token's index. Ids past the
tokenizer's vocabulary (the padding that rounds model.vocab up to a multiple of tp) are never
drawn.

The tokenizer is the run's (`run_tokenizer`): its directory's tokenizer.json, else
`data.tokenizer`, else the token shards' own (`data.source: tokens`), else bytes.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from jax_overlap.config import Config, ConfigError
from jax_overlap.data import tokenizer as toklib

DEFAULT_NEW_TOKENS = 64  # without --max-new-tokens: this many, or as many as the context holds

# A pp > 1 run's checkpoint decodes on pp = 1 (the blocks are stored in logical order).
PP1 = ["mesh.pp=1", "pipeline.virtual_stages=1", "pipeline.schedule=1f1b",
       "pipeline.stage_layers=even", "pipeline.vocab_parallel=false"]


def generation_config(run_dir: str | None, hf_dir: str | None,
                      overrides: list[str] = ()) -> Config:
    """The config to decode with: the run's (or the HF directory's) with `overrides`, on
    pp = 1 (`PP1`: a no-op for an unpipelined run; no JAX)."""
    if run_dir:
        from jax_overlap.training.run_state import run_config

        return run_config(run_dir, [*overrides, *PP1])
    from jax_overlap.hf.convert import hf_run_config

    return hf_run_config(hf_dir, [*overrides, *PP1])


def run_tokenizer(cfg: Config, run_dir: str | None = None, hf_dir: str | None = None
                  ) -> toklib.Tokenizer:
    """The tokenizer a run (`data.run_tokenizer.for_run`: its own copy, else what its config
    names) or a Hugging Face directory (`for_hf`) was trained with; bytes otherwise (no
    JAX)."""
    from jax_overlap.data import run_tokenizer as run_tok

    if hf_dir:
        return run_tok.for_hf(hf_dir)
    tok = run_tok.for_run(run_dir, cfg) if run_dir else run_tok.of_data(cfg.data)
    return toklib.byte_tokenizer() if tok is None else tok


def check_options(max_new_tokens: int | None, temperature: float, top_k: int,
                  prefix: str = "--") -> None:
    """ConfigError naming the flag for a sampling option out of range (no JAX)."""
    names = {"max_new": f"{prefix}max-new-tokens", "temperature": f"{prefix}temperature",
             "top_k": f"{prefix}top-k"}
    problems = []
    if max_new_tokens is not None and max_new_tokens <= 0:
        problems.append(f"{names['max_new']}: must be >= 1, got {max_new_tokens}")
    if not math.isfinite(temperature) or temperature < 0:
        problems.append(f"{names['temperature']}: must be a finite number >= 0 (0: greedy), "
                        f"got {temperature}")
    if top_k < 0:
        problems.append(f"{names['top_k']}: must be >= 0 (0: the whole vocabulary), "
                        f"got {top_k}")
    if problems:
        raise ConfigError(problems[:1])


def prompt_ids(tok: toklib.Tokenizer, prompt: str, model_cfg, max_new_tokens: int | None,
               field: str = "--prompt", new_field: str = "--max-new-tokens"
               ) -> tuple[np.ndarray, int]:
    """The prompt's token ids (int32) and the number of tokens to generate, checked against
    the model: at least one prompt token, and room for `max_new_tokens` more within
    model.seq_len (None: `DEFAULT_NEW_TOKENS` or what the context holds). No JAX."""
    if tok.vocab_size > model_cfg.vocab:
        raise ConfigError([f"model.vocab: {model_cfg.vocab} is smaller than the tokenizer's "
                           f"{tok.vocab_size} tokens ({tok.name}); generate with the run's "
                           f"own tokenizer"])
    ids = np.asarray(tok.encode(prompt.encode("utf-8")), np.int32)
    seq_len = model_cfg.seq_len
    if len(ids) == 0:
        raise ConfigError([f"{field}: empty; give at least one character to continue"])
    if len(ids) >= seq_len:
        raise ConfigError([f"{field}: {len(ids)} tokens leave no room in the model's context "
                           f"of model.seq_len = {seq_len} tokens; shorten it below {seq_len} "
                           f"tokens"])
    if max_new_tokens is None:
        return ids, min(DEFAULT_NEW_TOKENS, seq_len - len(ids))
    if len(ids) + max_new_tokens > seq_len:
        raise ConfigError([f"{new_field}: {max_new_tokens} after a prompt of {len(ids)} tokens "
                           f"exceeds model.seq_len = {seq_len}; use at most "
                           f"{seq_len - len(ids)}"])
    return ids, max_new_tokens


def sample_next(logits_bv, key, temperature: float, top_k: int, valid_vocab: int):
    """(B,) next token ids from the last position's (B, V) logits: argmax at temperature 0,
    else a draw from softmax(logits / temperature) over the `top_k` largest (0: all); ids
    >= `valid_vocab` are never chosen."""
    import jax
    import jax.numpy as jnp

    logits_bv = logits_bv.astype(jnp.float32)
    v = logits_bv.shape[-1]
    if valid_vocab < v:
        logits_bv = jnp.where(jnp.arange(v) < valid_vocab, logits_bv, -jnp.inf)
    if temperature == 0:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    logits_bv = logits_bv / temperature
    if 0 < top_k < valid_vocab:
        kth_b1 = jax.lax.top_k(logits_bv, top_k)[0][:, -1:]
        logits_bv = jnp.where(logits_bv >= kth_b1, logits_bv, -jnp.inf)
    return jax.random.categorical(key, logits_bv, axis=-1).astype(jnp.int32)


def can_decode(model) -> bool:
    """Whether `model` has the `jax_overlap.model_api.Decoder` methods."""
    return callable(getattr(model, "init_cache", None)) and callable(getattr(model, "decode",
                                                                             None))


def make_generate(model, plan, mesh, batch: int, prompt_len: int, max_new_tokens: int,
                  temperature: float = 0.0, top_k: int = 0,
                  valid_vocab: int | None = None) -> Callable:
    """Jitted `(staged params, prompt ids (B, P) int32, key) -> (B, max_new_tokens)` new token
    ids, for params in the plan's layout on `mesh` (any dp x tp; pp = 1)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_overlap.parallel.collectives import Parallel
    from jax_overlap.parallel.mesh import DP, TP
    from jax_overlap.pipeline import layout as staged_layout

    par = Parallel()  # GSPMD: global shapes, XLA places the collectives
    valid = valid_vocab or model.vocab
    dp, tp = mesh.shape[DP], mesh.shape[TP]
    cache_spec = P(None, DP if batch % dp == 0 else None, None,
                   TP if model.cache_heads() % tp == 0 else None, None)
    cache_sharding = NamedSharding(mesh, cache_spec)
    max_len = prompt_len + max_new_tokens

    def generate(params, prompt_bt, key):
        logical = staged_layout.to_logical(params, plan.layer_perm)
        cache = jax.tree.map(lambda c: jax.lax.with_sharding_constraint(c, cache_sharding),
                             model.init_cache(batch, max_len))
        logits_btv, cache = model.decode(logical, prompt_bt, cache, 0, par)  # prefill
        first_b = sample_next(logits_btv[:, -1], jax.random.fold_in(key, 0), temperature,
                              top_k, valid)
        out_bn = jnp.zeros((batch, max_new_tokens), jnp.int32).at[:, 0].set(first_b)

        def step(i, carry):
            out_bn, cache = carry
            last_b1 = jax.lax.dynamic_slice_in_dim(out_bn, i - 1, 1, axis=1)
            logits_btv, cache = model.decode(logical, last_b1, cache, prompt_len + i - 1, par)
            next_b = sample_next(logits_btv[:, -1], jax.random.fold_in(key, i), temperature,
                                 top_k, valid)
            return out_bn.at[:, i].set(next_b), cache

        out_bn, _ = jax.lax.fori_loop(1, max_new_tokens, step, (out_bn, cache))
        return out_bn

    return jax.jit(generate)


def place_prompt(ids_bt: np.ndarray, mesh):
    """The prompt batch on `mesh`: split over dp when dp divides it, else replicated."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_overlap.parallel.mesh import DP

    spec = P(DP) if ids_bt.shape[0] % mesh.shape[DP] == 0 else P()
    return jax.device_put(np.asarray(ids_bt, np.int32), NamedSharding(mesh, spec))


def sample(model, plan, mesh, params, tok: toklib.Tokenizer, ids: np.ndarray,
           max_new_tokens: int, temperature: float, top_k: int, seed: int,
           batch: int = 1) -> list[list[int]]:
    """`batch` continuations (token id lists) of the prompt `ids` by staged `params`."""
    import jax

    fn = make_generate(model, plan, mesh, batch, len(ids), max_new_tokens, temperature,
                       top_k, valid_vocab=tok.vocab_size)
    prompt_bt = place_prompt(np.tile(ids[None, :], (batch, 1)), mesh)
    out = jax.device_get(fn(params, prompt_bt, jax.random.key(seed)))
    return [list(map(int, row)) for row in out]


def generate_command(run_dir: str | None, hf_dir: str | None, prompt: str,
                     max_new_tokens: int | None, temperature: float, top_k: int, seed: int,
                     overrides: list[str] = ()) -> dict:
    """What `jax-overlap generate` prints (see the module docstring); `max_new_tokens`
    None: `DEFAULT_NEW_TOKENS`, or fewer where the context ends."""
    import jax

    from jax_overlap import model_api

    check_options(max_new_tokens, temperature, top_k)
    cfg = generation_config(run_dir, hf_dir, overrides)
    tok = run_tokenizer(cfg, run_dir, hf_dir)
    ids, max_new_tokens = prompt_ids(tok, prompt, cfg.model, max_new_tokens)
    model = model_api.build_model(cfg)
    if not can_decode(model):
        raise ConfigError([f"model.kind: {cfg.model.kind} cannot generate text (no key/value "
                           f"cache decoding); generate with a gpt or llama run"])
    from jax_overlap.training import run_state
    from jax_overlap.training.assemble import assemble

    run = assemble(cfg, model=model)
    plan, mesh = run.plan, run.mesh

    logical = None
    if hf_dir:  # a file of the wrong shapes is refused before any device work
        from jax_overlap.hf import convert

        logical = convert.load_hf_params(hf_dir, cfg.model)
        convert.check_params_match(logical, jax.eval_shape(model.init, jax.random.key(0)),
                                   hf_dir)
    params, source = run_state.placed_params(run, run_dir, hf_dir, logical)
    (new,) = sample(model, plan, mesh, params, tok, ids, max_new_tokens, temperature, top_k,
                    seed)
    prompt_list = [int(i) for i in ids]
    return {"text": tok.decode(prompt_list + new), "completion": tok.decode(new),
            "prompt_tokens": prompt_list, "new_tokens": new,
            "tokenizer": tok.describe()["kind"], "temperature": temperature, "top_k": top_k,
            "seed": seed, **source, "mesh": plan.axis_sizes}
