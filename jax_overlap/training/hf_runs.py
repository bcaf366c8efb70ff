"""`jax-overlap convert`: a Hugging Face directory to a run directory with a step-0 checkpoint
(`from_hf`), and a run's newest verified checkpoint back to a Hugging Face directory (`to_hf`).
The HF side (config, layouts, safetensors, tokenizer files) is `jax_overlap.hf`; this module
builds or reads the run around it. Every bad input is one line (`ConfigError`).
"""

from __future__ import annotations

import json
import os

import numpy as np

from jax_overlap import config as config_lib
from jax_overlap.config import ConfigError
from jax_overlap.data import run_tokenizer
from jax_overlap.hf import layouts, tokenizer_files
from jax_overlap.hf.convert import (check_out_dir, check_params_match, export_params,
                                    hf_run_config, load_hf_params)


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

    from jax_overlap.pipeline import layout
    from jax_overlap.resilience import checkpoint as ckptlib
    from jax_overlap.resilience.ckpt_layout import to_checkpoint
    from jax_overlap.training.assemble import assemble

    run = assemble(cfg)
    model, plan, mesh = run.model, run.plan, run.mesh
    check_params_match(params, jax.eval_shape(model.init, jax.random.key(0)), hf_dir)
    shardings = run.loop_shardings()
    loop = run.initializer()()
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
    try:
        architecture = layouts.hf_config(cfg.model)["architectures"][0]
    except ConfigError as e:
        raise ConfigError([f"--to-hf {run_dir}: {e.problems[0]}"]) from None
    check_out_dir(out_dir)
    if os.path.exists(os.path.join(out_dir, "config.json")):
        raise ConfigError([f"--out {out_dir}: already holds a config.json; pick a new "
                           f"directory"])
    tok = run_tokenizer.for_run(run_dir, cfg)
    if tok is not None and tok.vocab_size > cfg.model.vocab:
        raise ConfigError([f"--to-hf {run_dir}: its tokenizer has {tok.vocab_size} tokens, more "
                           f"than model.vocab {cfg.model.vocab}"])
    from jax_overlap.training.assemble import assemble

    params, step = run_state.newest_params(assemble(cfg), run_dir, flag="--to-hf")
    files = export_params(cfg.model, params, out_dir, dtype, int(shard_mb * 2**20))
    files += tokenizer_files.write_export(out_dir, tok, cfg.model.seq_len, run_dir)
    for name in os.listdir(out_dir):  # readable by everyone, like any model download
        os.chmod(os.path.join(out_dir, name), 0o644)
    return {"out": out_dir, "step": step, "files": files, "dtype": dtype,
            "tokenizer": run_tokenizer.kind_of(tok),
            "architecture": architecture}
