"""`training.assemble`: one way from a config to a run (model, plan, mesh, optimizer, step)."""

import jax
import numpy as np
import pytest
from helpers import TINY, np_batch

from jax_overlap import config
from jax_overlap.config import ConfigError
from jax_overlap.plan import Target
from jax_overlap.training.assemble import assemble

# Uneven stages (7 + 3 layers over pp=2) and fp16: the padded staged layout and the loss scale
# are the two places an abstract state written by hand drifts from the real one.
UNEVEN_FP16 = ["mesh.pp=2", "mesh.dp=2", "mesh.tp=2", "model.layers=10",
               "pipeline.stage_layers=[7,3]", "pipeline.microbatches=2", "train.precision=fp16"]


def test_abstract_state_is_the_initial_state_without_allocating():
    run = assemble(config.load(TINY, UNEVEN_FP16), jax.devices()[:8])
    abstract, state = run.abstract_state(), run.init_state()
    assert jax.tree.structure(abstract) == jax.tree.structure(state)
    assert state.loss_scale is not None
    assert abstract.params["blocks"]["w_in"].shape[0] == 2 * 7  # padded: 2 x max(7, 3)
    for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(state)):
        assert (a.shape, a.dtype) == (s.shape, s.dtype)
        assert a.sharding.is_equivalent_to(s.sharding, len(s.shape))


def test_the_train_step_runs_on_its_batches():
    run = assemble(config.load(TINY), jax.devices()[:8])
    step = run.train_step()
    state, metrics = step(run.init_state(), run.put_batch(np_batch(run.cfg)))
    assert int(state.step) == 1 and np.isfinite(float(metrics["loss"]))
    batch = run.abstract_batch()
    assert batch["inputs"].shape == (run.cfg.train.global_batch, run.cfg.model.seq_len)


def test_a_run_for_a_target_takes_its_devices_later():
    cfg = config.load(TINY)
    planned = assemble(cfg, target=Target())
    assert planned.mesh is None
    run = planned.on(jax.devices()[:8])
    assert run.plan is planned.plan
    assert dict(run.mesh.shape) == {"dp": run.plan.dp, "pp": run.plan.pp, "tp": run.plan.tp}


def test_devices_that_do_not_fill_the_mesh_are_refused():
    with pytest.raises(ConfigError, match=r"mesh: dcn x dp x pp x tp = .* 4 devices"):
        assemble(config.load(TINY), jax.devices()[:4])
