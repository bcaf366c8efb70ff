"""`jax-overlap evaluate`: mean next-token loss and perplexity of a checkpoint over a text
file or the held-out split of a `prepare-data` directory.

A text file is tokenized with the model's tokenizer (a run's own copy, an HF directory's
tokenizer.json, or bytes: `data.run_tokenizer`) and cut into non-overlapping windows of
`model.seq_len + 1` tokens (a last partial window is dropped). A prepare-data directory (made
with the same tokenizer) gives its held-out split's windows as training's evaluation reads
them: `seq_len + 1` tokens every `seq_len`, in order. Each window gives `seq_len` predictions
(inputs tokens 0..T-1, targets 1..T). Batches of windows run through `evaluate.make_eval_loss` on the
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


def text_windows(path: str, tok, seq_len: int) -> np.ndarray:
    """(N, seq_len + 1) non-overlapping windows of a text file's tokens under `tok` (a
    `data.tokenizer.Tokenizer`; the one place evaluation makes tokens from text)."""
    if not os.path.isfile(path):
        raise ConfigError([f"--data {path}: file not found; pass a text file or a "
                           f"`jax-overlap prepare-data` directory"])
    with open(path, "rb") as f:
        raw = f.read()
    return windows(np.asarray(tok.encode(raw), np.int32), seq_len)


def split_windows(directory: str, tok, seq_len: int) -> np.ndarray:
    """The held-out split of a prepare-data directory as training's evaluation cuts it:
    windows of `seq_len + 1` tokens starting every `seq_len` tokens, in order, each once.

    Raises:
      ConfigError: the directory's tokenizer is not `tok`, or its split is too short.
    """
    from jax_overlap.data import shards as shardlib
    from jax_overlap.data import tokenizer as toklib

    try:
        index = toklib.read_index(directory, field="--data")
        tokens = shardlib.TokenArray(directory, index, field="--data")
    except ValueError as e:
        raise ConfigError([str(e).splitlines()[0]]) from None
    got = (index.get("tokenizer") or {}).get("sha256", "")
    if got != tok.sha256:
        raise ConfigError([f"--data {directory}: its tokens were made with another tokenizer "
                           f"(sha256 {got[:12]}) than the model's ({tok.sha256[:12]}); prepare "
                           f"it with --tokenizer set to the model's tokenizer.json"])
    sp = index["split"]
    n = (sp["val_tokens"] - 1) // seq_len
    if n < 1:
        raise ConfigError([f"--data {directory}: the held-out split has {sp['val_tokens']} "
                           f"tokens, fewer than model.seq_len + 1 = {seq_len + 1}; prepare-data "
                           f"with a larger --val-fraction"])
    return tokens.read_many(sp["val_start"] + np.arange(n) * seq_len, seq_len + 1)


def data_windows(data: str, tok, seq_len: int) -> tuple[np.ndarray, dict]:
    """(windows, what was scored) of `--data`: a text file or a prepare-data directory."""
    if os.path.isdir(data):
        return split_windows(data, tok, seq_len), {"data": data, "split": "val"}
    return text_windows(data, tok, seq_len), {"data": data}


def windows(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """(N, seq_len + 1) non-overlapping windows; the last partial one is dropped."""
    n = len(tokens) // (seq_len + 1)
    return tokens[: n * (seq_len + 1)].reshape(n, seq_len + 1)


def evaluate(cfg: Config, params, model, plan, mesh, w: np.ndarray, batch_size: int) -> dict:
    """`{"loss", "perplexity", "tokens", "windows"}` of staged `params` over the windows `w`
    ((N, seq_len + 1) token ids)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_overlap.parallel.mesh import DP
    from jax_overlap.training.evaluate import make_eval_loss, mean_loss

    if len(w) == 0:
        raise ConfigError([f"--data: fewer tokens than one window of model.seq_len + 1 = "
                           f"{cfg.model.seq_len + 1}; use a longer file"])
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
    from jax_overlap.data import run_tokenizer
    from jax_overlap.hf import convert
    from jax_overlap.training import run_state
    from jax_overlap.training.assemble import assemble

    if run_dir:
        cfg = run_state.run_config(run_dir, overrides)
        tok = run_tokenizer.for_run(run_dir, cfg)
    else:
        cfg = convert.hf_run_config(hf_dir, overrides)
        tok = run_tokenizer.for_hf(hf_dir)
    w, scored = data_windows(data, tok, cfg.model.seq_len)
    logical = None
    if hf_dir:  # a corrupt file is refused before any device work
        logical = convert.load_hf_params(hf_dir, cfg.model)
    run = assemble(cfg)
    model, plan, mesh = run.model, run.plan, run.mesh
    params, source = run_state.placed_params(run, run_dir, hf_dir, logical)
    result = evaluate(cfg, params, model, plan, mesh, w, cfg.train.global_batch)
    return {**result, **source, **scored, "tokenizer": run_tokenizer.describe(tok),
            "mesh": plan.axis_sizes}
