"""`jax-overlap convert`: Hugging Face directories to runs and back, and `init_from_hf`.

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
from jax_overlap.data import run_tokenizer
from jax_overlap.hf import layouts, safetensors_io, tokenizer_files

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
    host = _to_numpy(params)
    tensors = layouts.params_to_hf(model_cfg, host, np_dtype)
    files = safetensors_io.write_tensors(out_dir, tensors, shard_bytes)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(layouts.hf_config(model_cfg, name), f, indent=2, sort_keys=True)
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


def from_hf(hf_dir: str, run_dir: str, overrides: list[str] = ()) -> dict:
    """`convert --from-hf`: the run directory with config.json and a step-0 checkpoint, and
    the HF directory's tokenizer (`data.tokenizer`, so training on text continues with it)."""
    check_out_dir(run_dir)
    cfg = hf_run_config(hf_dir, overrides)
    tokenizer_files.check_hf_tokenizer(hf_dir, cfg.model.vocab)
    if cfg.checkpoint.every_steps == 0:  # so that `train --run-dir` resumes from step 0
        cfg = config_lib.from_dict(config_lib.apply_overrides(cfg.to_dict(),
                                                              ["checkpoint.every_steps=100"]))
    ckpt_dir = cfg.checkpoint.dir or os.path.join(run_dir, "checkpoints")
    if os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
        raise ConfigError([f"--out {run_dir}: {ckpt_dir} already holds checkpoints; pick a "
                           f"new run directory"])
    params = load_hf_params(hf_dir, cfg.model)
    import jax

    from jax_overlap import model_api
    from jax_overlap import plan as plan_lib
    from jax_overlap.pipeline import layout
    from jax_overlap.resilience import checkpoint as ckptlib
    from jax_overlap.resilience.ckpt_layout import to_checkpoint
    from jax_overlap.resilience.loop_state import loop_shardings, make_initializer
    from jax_overlap.training import step as steplib

    mesh = plan_lib.mesh_from_config(cfg)
    model = model_api.build_model(cfg)
    plan = plan_lib.ParallelPlan.build(cfg, model,
                                       plan_lib.Target.of_devices(list(mesh.devices.flat)))
    check_params_match(params, jax.eval_shape(model.init, jax.random.key(0)), hf_dir)
    optimizer = steplib.make_optimizer(cfg.train)
    shardings = loop_shardings(model, cfg, plan, mesh, optimizer)
    loop = make_initializer(model, cfg, plan, mesh, optimizer)()
    staged = jax.device_put(layout.to_staged(params, plan.layer_perm), shardings.train.params)
    loop = loop._replace(train=loop.train._replace(params=staged))
    config_dict = plan.resolved_config(cfg).to_dict()
    os.makedirs(run_dir, exist_ok=True)
    tok = tokenizer_files.import_into_run(hf_dir, run_dir, cfg.model.vocab)
    if tok is not None:
        config_dict["data"].update(tokenizer=os.path.join(run_dir, tokenizer_files.TOKENIZER),
                                   **run_tokenizer.record(tok))
    ckpt = ckptlib.Checkpointer(ckptlib.CheckpointOptions(dir=ckpt_dir, async_save=False), mesh)
    ckpt.maybe_save(to_checkpoint(loop, plan.layer_perm, shardings), config_dict, force=True,
                    step=0)
    ckpt.close()
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        f.write(json.dumps(config_dict, indent=2, sort_keys=True))
    return {"run_dir": run_dir, "checkpoint_dir": ckpt_dir, "step": 0,
            "model": cfg.model.kind, "params": int(sum(np.size(a) for a in
                                                       jax.tree.leaves(params))),
            "tokenizer": run_tokenizer.kind_of(tok) if tok is not None else "none"}


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


def to_hf(run_dir: str, out_dir: str, dtype: str = "fp32", shard_mb: float = 0.0,
          overrides: list[str] = ()) -> dict:
    """`convert --to-hf`: the run's newest verified checkpoint as an HF directory."""
    from jax_overlap.training import run_state

    one_device = ["mesh.dp=1", "mesh.pp=1", "mesh.tp=1", "overlap.param_sharding=replicated",
                  "overlap.zero1=false", "pipeline.virtual_stages=1", "pipeline.schedule=1f1b"]
    cfg = run_state.run_config(run_dir, [*one_device, *overrides], flag="--to-hf")
    if cfg.model.kind not in ("llama", "gpt"):
        raise ConfigError([f"--to-hf {run_dir}: model.kind {cfg.model.kind} has no Hugging "
                           f"Face layout (llama, gpt)"])
    check_out_dir(out_dir)
    if os.path.exists(os.path.join(out_dir, "config.json")):
        raise ConfigError([f"--out {out_dir}: already holds a config.json; pick a new "
                           f"directory"])
    tok = run_tokenizer.for_run(run_dir, cfg)
    if tok is not None and tok.vocab_size > cfg.model.vocab:
        raise ConfigError([f"--to-hf {run_dir}: its tokenizer has {tok.vocab_size} tokens, more "
                           f"than model.vocab {cfg.model.vocab}"])
    from jax_overlap import model_api
    from jax_overlap import plan as plan_lib

    mesh = plan_lib.mesh_from_config(cfg)
    model = model_api.build_model(cfg)
    plan = plan_lib.ParallelPlan.build(cfg, model)
    params, step = run_state.newest_params(cfg, run_dir, model, plan, mesh, flag="--to-hf")
    files = export_params(cfg.model, params, out_dir, dtype, int(shard_mb * 2**20))
    files += tokenizer_files.write_export(out_dir, tok, cfg.model.seq_len, run_dir)
    for name in os.listdir(out_dir):  # readable by everyone, like any model download
        os.chmod(os.path.join(out_dir, name), 0o644)
    return {"out": out_dir, "step": step, "files": files, "dtype": dtype,
            "tokenizer": run_tokenizer.kind_of(tok),
            "architecture": layouts.ARCHITECTURES["llama" if cfg.model.kind == "llama"
                                                  else "gpt2"]}


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
