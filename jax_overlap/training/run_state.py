"""A finished (or running) run's config and newest verified parameters, on any mesh.

Shared by `jax-overlap evaluate --run-dir` and `jax-overlap convert --to-hf`: the run's
resolved `config.json` plus `--set` overrides (usually another mesh), and the newest
checkpoint that restores and verifies (`Checkpointer.latest_good`), laid out on that mesh.
"""

from __future__ import annotations

import os
from typing import Any

from jax_overlap import config as config_lib
from jax_overlap.config import Config, ConfigError


def run_config(run_dir: str, overrides: list[str] = (), flag: str = "--run-dir") -> Config:
    """The run's `config.json` (what `train` wrote) with `overrides` applied."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.isdir(run_dir) or not os.path.exists(path):
        raise ConfigError([f"{flag} {run_dir}: no config.json; point it at a directory "
                           f"written by jax-overlap train or convert --from-hf"])
    return config_lib.load(path, list(overrides))


def checkpoint_dir(cfg: Config, run_dir: str) -> str:
    return cfg.checkpoint.dir or os.path.join(run_dir, "checkpoints")


def newest_params(run, run_dir: str, flag: str = "--run-dir") -> tuple[Any, int]:
    """(params in the plan's staged layout on the mesh, step) of the newest verified checkpoint
    of `run_dir`, for an assembled `run` (`training.assemble`).

    Raises:
      ConfigError: no checkpoint of the run verifies.
    """
    from jax_overlap.resilience import checkpoint as ckptlib
    from jax_overlap.resilience.ckpt_layout import from_checkpoint
    from jax_overlap.training.loop_state import shardings_of

    cfg, plan, mesh = run.cfg, run.plan, run.mesh
    directory = checkpoint_dir(cfg, run_dir)
    if not os.path.isdir(directory):
        raise ConfigError([f"{flag} {run_dir}: no checkpoints in {directory}; train with "
                           f"checkpoint.every_steps > 0"])
    abstract = run.abstract_loop_state()
    ckpt = ckptlib.Checkpointer(ckptlib.CheckpointOptions(dir=directory, async_save=False), mesh)
    try:
        result = ckpt.latest_good(abstract)
    finally:
        ckpt.close()
    if result is None:
        raise ConfigError([f"{flag} {run_dir}: no checkpoint in {directory} restores and "
                           f"verifies; see the warnings above"])
    state = from_checkpoint(result.state, plan.layer_perm, shardings_of(abstract))
    return state.train.params, result.step


def placed_params(run, run_dir: str | None, hf_dir: str | None, logical: Any = None
                  ) -> tuple[Any, dict]:
    """The parameters `evaluate` and `generate` score or sample with, laid out for an
    assembled `run`'s plan on its mesh: a run dir's newest verified checkpoint, or a Hugging
    Face directory's weights (`logical`, as `hf.convert.load_hf_params` read them); with where
    they came from."""
    if run_dir:
        params, step = newest_params(run, run_dir)
        return params, {"run_dir": run_dir, "step": step}
    params = run.place_params(logical)
    return params, {"from_hf": hf_dir}
