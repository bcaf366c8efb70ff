"""Shared test utilities."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "tiny.yaml")


def corrupt_checkpoint_step(ckpt_dir, step: int, how: str = "truncate") -> list[str]:
    """Damages every OCDBT file under `ckpt_dir/step/state` (cut in half, or one byte
    flipped in the middle); returns them.

    Every file, not one: a step's `d/` files include superseded b-tree nodes the restore
    never reads, and which file holds what depends on how the writer threads split the
    save, so damaging a single file can miss everything a restore reads.
    """
    files = [f for f in glob.glob(os.path.join(ckpt_dir, str(step), "state", "**", "d", "*"),
                                  recursive=True) if os.path.isfile(f)]
    assert files, f"{ckpt_dir}: step {step} has no OCDBT data files to damage"
    for f in files:
        if how == "truncate":
            os.truncate(f, os.path.getsize(f) // 2)
        else:
            raw = bytearray(open(f, "rb").read())
            raw[len(raw) // 2] ^= 0xFF
            open(f, "wb").write(bytes(raw))
    return files


# A script prefix that restores a checkpoint directory's newest step with plain Orbax (no
# jax_overlap import) onto one device: `root`, `steps`, `step` and `out` (the "state" and
# "config" items) are defined for the lines that follow. argv[1] is the directory.
PLAIN_ORBAX_RESTORE = """
import json, sys
import jax, numpy as np
import orbax.checkpoint as ocp
from etils import epath

root = epath.Path(sys.argv[1])
mngr = ocp.CheckpointManager(root)
steps = list(mngr.all_steps())
step = max(steps)
md = ocp.StandardCheckpointer().metadata(root / str(step) / "state")
tree = getattr(md, "item_metadata", md)
tree = getattr(tree, "tree", tree)
dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=dev), tree)
out = mngr.restore(step, args=ocp.args.Composite(
    state=ocp.args.StandardRestore(target), config=ocp.args.JsonRestore()))
"""


def max_rel_err(tree, ref_tree) -> float:
    """Largest leaf-wise error, relative to each reference leaf's largest magnitude."""
    errs = jax.tree.map(
        lambda a, b: float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - b))
                           / (float(jnp.max(jnp.abs(b))) + 1e-30)), tree, ref_tree)
    return max(jax.tree.leaves(errs))


def run_cli(*args, env_extra=None, timeout=600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)  # the CLI sizes the host device count itself
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "jax_overlap.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def last_json_line(stdout: str) -> dict:
    import json

    return json.loads(stdout.strip().splitlines()[-1])


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def np_batch(cfg, index=0):
    from jax_overlap.data import streams as data

    return data.stream_from_config(cfg).batch(index)


__all__ = ["np", "REPO", "TINY", "max_rel_err", "run_cli", "last_json_line", "rel", "np_batch"]


def gpt_reference(overrides=()):
    """(model, params, batch, loss, grads) of the tiny GPT on one device: the ground truth."""
    from jax_overlap import config
    from jax_overlap.training import grads as gradslib
    from models.gpt import GPT

    cfg = config.load(TINY, list(overrides))
    model = GPT.from_config(cfg.model)
    params = model.init(jax.random.key(cfg.train.seed))
    batch = np_batch(cfg)
    loss, grads = jax.value_and_grad(lambda p: gradslib.reference_loss(model, p, batch))(params)
    return model, params, batch, float(loss), grads


def cached_references(cfg_for_key, model_cls=None):
    """`get(key) -> (model, params, batch, loss, grads)`: the single-device loss and gradients
    of `model_cls` (default the GPT) for the config `cfg_for_key(key)` returns, computed once
    per key (e.g. `tied`, or Llama's `kv_heads`)."""
    from jax_overlap.training import grads as gradslib
    from models.gpt import GPT

    model_cls = model_cls or GPT
    cache = {}

    def get(key):
        if key not in cache:
            cfg = cfg_for_key(key)
            model = model_cls.from_config(cfg.model)
            params = model.init(jax.random.key(cfg.train.seed))
            batch = np_batch(cfg)
            loss, grads = jax.jit(jax.value_and_grad(
                lambda p: gradslib.reference_loss(model, p, batch)))(params)
            cache[key] = (model, params, batch, float(loss), grads)
        return cache[key]

    return get


def schedule_sweep(meshes, policies=("none", "full", "save_dots")) -> list[tuple]:
    """Every schedule x (pp, dp, tp) mesh x remat policy, as the equivalence sweeps
    parametrize them: `(schedule, pp, dp, tp, microbatches = 2 pp, tied, remat)`, tied on
    every other case."""
    from jax_overlap.pipeline import schedules

    cases = [(name, mesh, policy) for name in schedules.SCHEDULES for mesh in meshes
             for policy in policies]
    return [(name, pp, dp, tp, 2 * pp, i % 2 == 0, policy)
            for i, (name, (pp, dp, tp), policy) in enumerate(cases)]
