"""`jax-overlap evaluate`: mean next-token loss and perplexity of a checkpoint over a text file.

The file is tokenized (`file_tokens`), cut into non-overlapping windows of `model.seq_len + 1`
tokens (a last partial window is dropped); each window gives `seq_len` predictions (inputs
tokens 0..T-1, targets 1..T). Batches of windows run through `evaluate.make_eval_loss` on the
config's mesh (any dp x pp x tp: evaluation is forward-only under GSPMD), so the number is the
same on every mesh.

The parameters come from a run's newest verified checkpoint (`--run-dir`) or straight from a
Hugging Face directory (`--from-hf`), which is how an exported model is compared with its
source.
"""

from __future__ import annotations

import os

import numpy as np

from jax_overlap.config import Config, ConfigError


def file_tokens(path: str, cfg: Config) -> np.ndarray:
    """The file's token ids (int32): bytes (ids 0..255), or the run's `data.tokenizer` when
    the config has one that is not `bytes` (the one place tokens are made for evaluation)."""
    if not os.path.isfile(path):
        raise ConfigError([f"--data {path}: file not found; pass a text file"])
    with open(path, "rb") as f:
        raw = f.read()
    tokenizer = getattr(cfg.data, "tokenizer", "bytes") or "bytes"
    if tokenizer == "bytes":
        return np.frombuffer(raw, np.uint8).astype(np.int32)
    # The data package's tokenizers (bytes or a tokenizer.json).
    from jax_overlap.data.tokenizer import load

    return np.asarray(load(tokenizer).encode(raw), np.int32)


def windows(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """(N, seq_len + 1) non-overlapping windows; the last partial one is dropped."""
    n = len(tokens) // (seq_len + 1)
    return tokens[: n * (seq_len + 1)].reshape(n, seq_len + 1)


def evaluate(cfg: Config, params, model, plan, mesh, tokens: np.ndarray,
             batch_size: int) -> dict:
    """`{"loss", "perplexity", "tokens", "windows"}` of staged `params` over `tokens`."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_overlap.parallel.mesh import DP
    from jax_overlap.training.evaluate import make_eval_loss, mean_loss

    w = windows(tokens, cfg.model.seq_len)
    if len(w) == 0:
        raise ConfigError([f"--data: {len(tokens)} tokens are fewer than one window of "
                           f"model.seq_len + 1 = {cfg.model.seq_len + 1}; use a longer file"])
    if cfg.model.vocab <= int(w.max()):
        raise ConfigError([f"model.vocab: {cfg.model.vocab} is too small for token id "
                           f"{int(w.max())} of the data"])
    dp = mesh.shape[DP]
    batch_size = max(dp, batch_size - batch_size % dp)
    split, whole = NamedSharding(mesh, P(DP)), NamedSharding(mesh, P())

    def batches():
        for start in range(0, len(w), batch_size):
            chunk = w[start:start + batch_size]
            # A last batch that dp does not divide is placed whole (GSPMD splits the rest).
            sharding = split if len(chunk) % dp == 0 else whole
            yield {"inputs": jax.device_put(chunk[:, :-1], sharding),
                   "targets": jax.device_put(chunk[:, 1:], sharding)}

    out = mean_loss(make_eval_loss(model, plan, mesh), params, batches())
    return {**out, "windows": int(len(w)), "seq_len": cfg.model.seq_len}


def evaluate_command(run_dir: str | None, hf_dir: str | None, data: str,
                     overrides: list[str] = ()) -> dict:
    """What `jax-overlap evaluate` prints (see the module docstring)."""
    import jax

    from jax_overlap import model_api
    from jax_overlap import plan as plan_lib

    if run_dir:
        from jax_overlap.training import run_state

        cfg = run_state.run_config(run_dir, overrides)
    else:
        from jax_overlap.hf import convert

        cfg = convert.hf_run_config(hf_dir, overrides)
    tokens = file_tokens(data, cfg)
    mesh = plan_lib.mesh_from_config(cfg)
    model = model_api.build_model(cfg)
    plan = plan_lib.ParallelPlan.build(cfg, model)
    if run_dir:
        params, step = run_state.newest_params(cfg, run_dir, model, plan, mesh)
        source = {"run_dir": run_dir, "step": step}
    else:
        from jax_overlap.pipeline import layout
        from jax_overlap.training import step as steplib

        logical = convert.load_hf_params(hf_dir, cfg.model)
        params = jax.device_put(layout.to_staged(logical, plan.layer_perm),
                                steplib.param_shardings(model, mesh, plan.layout))
        source = {"from_hf": hf_dir}
    result = evaluate(cfg, params, model, plan, mesh, tokens, cfg.train.global_batch)
    return {**result, **source, "mesh": plan.axis_sizes}
