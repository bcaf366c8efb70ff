"""Hugging Face directories in and out: their config, their weights in our layout, and
`init_from_hf`. The two halves of `jax-overlap convert` that build or read a run
(`training/hf_runs.py`) use these:

* `--from-hf DIR --out RUN_DIR`: reads `config.json` + safetensors, writes `RUN_DIR/config.json`
  (the jax_overlap config, `--set` applied) and a verified checkpoint at step 0 with the HF
  weights (fp32 master weights, whatever the file's dtype); `train --config RUN_DIR/config.json
  --run-dir RUN_DIR` continues from it, `evaluate --run-dir RUN_DIR` scores it.
* `--to-hf RUN_DIR --out DIR`: the run's newest verified checkpoint as `config.json` +
  `model.safetensors` (or shards + `model.safetensors.index.json` with `--shard-mb`), fp32 or
  bf16, loadable by `transformers.AutoModelForCausalLM.from_pretrained`, with the run's
  tokenizer files (`hf.tokenizer_files`), all mode 0644.

Layouts are in `hf.layouts`; every bad input is one line (`ConfigError`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from jax_overlap import config as config_lib
from jax_overlap.config import Config, ConfigError
from jax_overlap.hf import layouts, safetensors_io

DTYPES = {"fp32": ("float32", np.float32), "bf16": ("bfloat16", None)}


def read_hf_config(hf_dir: str, flag: str = "--from-hf") -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isdir(hf_dir):
        raise ConfigError([f"{flag} {hf_dir}: not a directory; pass a Hugging Face model "
                           f"directory (config.json + model.safetensors)"])
    if not os.path.exists(path):
        raise ConfigError([f"{flag} {hf_dir}: no config.json; pass a Hugging Face model "
                           f"directory"])
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError:
        raise ConfigError([f"{flag} {path}: not valid JSON"]) from None


def hf_run_config(hf_dir: str, overrides: list[str] = (), base: dict | None = None,
                  flag: str = "--from-hf") -> Config:
    """A jax_overlap config whose model is the HF directory's (then `overrides`)."""
    fields = layouts.model_fields_from_hf(read_hf_config(hf_dir, flag), flag, hf_dir)
    data = json.loads(json.dumps(base or {}))
    data.setdefault("model", {}).update(fields)
    return config_lib.from_dict(config_lib.apply_overrides(data, list(overrides)))


def load_hf_params(hf_dir: str, model_cfg, flag: str = "--from-hf") -> dict:
    """Our logical parameter tree (fp32 numpy) from the directory's safetensors."""
    if model_cfg.kind not in ("llama", "gpt"):
        raise ConfigError([f"{flag} {hf_dir}: model.kind {model_cfg.kind} has no Hugging Face "
                           f"layout (llama, gpt)"])
    tensors = safetensors_io.read_tensors(hf_dir, flag)
    return layouts.params_from_hf(model_cfg, tensors, flag, hf_dir)


def export_params(model_cfg, params: Any, out_dir: str, dtype: str = "fp32",
                  shard_bytes: int = 0) -> list[str]:
    """Writes `config.json` and the safetensors of logical `params` (numpy or jax arrays)."""
    name, np_dtype = DTYPES[dtype]
    if np_dtype is None:
        import ml_dtypes

        np_dtype = ml_dtypes.bfloat16
    hf_cfg = layouts.hf_config(model_cfg, name)  # refuses a model with no HF layout first
    host = _to_numpy(params)
    tensors = layouts.params_to_hf(model_cfg, host, np_dtype)
    files = safetensors_io.write_tensors(out_dir, tensors, shard_bytes)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2, sort_keys=True)
    return files


def check_out_dir(out_dir: str) -> None:
    """`--out` must be a directory path (new or existing), not a file."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError([f"--out {out_dir}: exists and is not a directory; pick a new "
                           f"directory path"])
    parent = os.path.dirname(os.path.abspath(out_dir))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError([f"--out {out_dir}: {parent} is a file, not a directory; pick "
                           f"another path"])


def _to_numpy(tree):
    import jax

    return jax.tree.map(lambda a: np.asarray(jax.device_get(a), np.float32), tree)


def check_params_match(params: Any, abstract: Any, where: str) -> None:
    """Our tree from the HF tensors against the model's own parameter tree (same names and
    shapes), so a layout bug cannot pass silently."""
    import jax

    got = {jax.tree_util.keystr(k): np.shape(v)
           for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    want = {jax.tree_util.keystr(k): tuple(v.shape)
            for k, v in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    if got != want:
        diff = sorted(set(got.items()) ^ set(want.items()))[:3]
        raise ConfigError([f"--from-hf {where}: the converted parameters do not match the "
                           f"model's ({diff}); fix config.json"])


def initializer_from_hf(initial, hf_dir: str, model_cfg, plan, shardings):
    """`checkpoint.init_from_hf`: wraps the loop's `() -> LoopState` initializer so that its
    parameters are the HF directory's (read once; the rest of the state is as initialised).

    Raises:
      ConfigError: the directory's weights do not fit `model_cfg` (one line).
    """
    import jax

    from jax_overlap.pipeline import layout

    flag = "checkpoint.init_from_hf:"
    params = load_hf_params(hf_dir, model_cfg, flag)

    def build():
        loop = initial()
        staged = jax.device_put(layout.to_staged(params, plan.layer_perm),
                                shardings.train.params)
        return loop._replace(train=loop.train._replace(params=staged))

    return build
