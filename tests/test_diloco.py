"""Streaming DiLoCo over dcn: the fragment schedule, the outer step (fp32 / int8 with its
stated error bound), bytes across dcn, training and exact resume with the outer state."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY

from jax_overlap import config
from jax_overlap.analysis.dcn_traffic import dcn_bytes_of_hlo
from jax_overlap.overlap import diloco
from jax_overlap.training.assemble import assemble
from jax_overlap.training import loop as train
from jax_overlap.training import step as steplib
from models.gpt import GPT

MESH = ["mesh.dcn=2", "mesh.dp=2", "mesh.tp=2"]


def _run(extra):
    cfg = config.load(TINY, MESH + ["diloco.inner_steps=4", "diloco.fragments=2", *extra])
    return assemble(cfg, jax.devices()[:8], model=GPT.from_config(cfg.model))


def test_fragments_are_issued_in_turn_and_land_tau_steps_later():
    plan = _run(["diloco.delay=1"]).plan
    d = plan.diloco
    assert plan.slow_mode == "local" and d.period == 2
    assert [diloco.issued(d, t) for t in range(10)] == [-1, -1, 0, -1, 1, -1, 0, -1, 1, -1]
    assert [diloco.landed(d, t) for t in range(10)] == [-1, -1, -1, 0, -1, 1, -1, 0, -1, 1]
    assert int(diloco.issued(d, jnp.int32(6))) == 0


def _outer_inputs(plan, model, mesh, seed=1):
    params = model.init(jax.random.key(0))
    keys = iter(jax.random.split(jax.random.key(seed), 1000))
    local = jax.tree.map(lambda p: p[None] + 0.01 * jax.random.normal(next(keys), (2, *p.shape)),
                         params)
    momentum = jax.tree.map(lambda p: 0.1 * jax.random.normal(next(keys), p.shape), params)
    psh = steplib.param_shardings(model, mesh, plan.layout)
    lsh = jax.tree.map(lambda s: jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec("dcn", *s.spec)), psh)
    return (jax.device_put(params, psh), jax.device_put(local, lsh),
            jax.device_put(momentum, psh))


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_outer_nesterov_step_on_one_fragment(dtype):
    """Fragment 0 (the first layer of each stacked leaf, and the embedding) moves by outer
    Nesterov SGD on the dcn-mean of (global - local); fragment 1 (the second layer, the
    head) is untouched. int8: within the stated bound absmax / 254 per element."""
    run = _run([f"diloco.outer_dtype={dtype}", "diloco.outer_lr=0.7",
                "diloco.outer_momentum=0.9"])
    model, plan, mesh = run.model, run.plan, run.mesh
    params, local, momentum = _outer_inputs(plan, model, mesh)
    issue, _ = diloco.make_outer(plan, mesh)
    new_p, new_m = jax.jit(issue)(jnp.int32(2), params, local, momentum)  # issues fragment 0
    p, lo, mo = (jax.tree.map(np.asarray, t) for t in (params, local, momentum))
    np_, nm = jax.tree.map(np.asarray, new_p), jax.tree.map(np.asarray, new_m)
    delta = jax.tree.map(lambda g, l: (g[None] - l).mean(0), p, lo)
    m_exp = jax.tree.map(lambda m, d: 0.9 * m + d, mo, delta)
    p_exp = jax.tree.map(lambda g, d, m: g - 0.7 * (d + 0.9 * m), p, delta, m_exp)
    absmax = max(float(np.abs(g[None] - l).max()) for g, l in
                 zip(jax.tree.leaves(p), jax.tree.leaves(lo)))
    # Error bound of the mean delta, carried through lr (1 + mu) to the parameters.
    tol = 1e-6 if dtype == "fp32" else absmax / 254 * 0.7 * 1.9 + 1e-6
    checked = 0
    for part, sl in (("embed", slice(None)), ("blocks", slice(0, 1))):
        for a, b in zip(jax.tree.leaves(np_[part]), jax.tree.leaves(p_exp[part])):
            assert np.abs(a[sl] - b[sl]).max() <= tol
            checked += 1
        for a, b in zip(jax.tree.leaves(nm[part]), jax.tree.leaves(m_exp[part])):
            assert np.abs(a[sl] - b[sl]).max() <= tol / 0.7
    assert checked > 4
    for a, b in zip(jax.tree.leaves(np_["blocks"]), jax.tree.leaves(p["blocks"])):
        np.testing.assert_array_equal(a[1:], b[1:])  # fragment 1: not this step
    for a, b in zip(jax.tree.leaves(np_["head"]), jax.tree.leaves(p["head"])):
        np.testing.assert_array_equal(a, b)


def test_outer_sync_bytes_per_inner_step_are_at_most_one_h_th_of_synchronous():
    """From the compiled outer sync: every fragment's branch counted once (one sync of each
    per H inner steps), bf16, 1/dp of each fragment per device: per inner step at most 1/H of
    the synchronous reduction's bytes across dcn (the whole fp32 gradient / dp per step)."""
    run = _run(["diloco.outer_dtype=bf16"])
    model, plan, mesh = run.model, run.plan, run.mesh
    params, local, momentum = _outer_inputs(plan, model, mesh)
    issue, _ = diloco.make_outer(plan, mesh)
    text = jax.jit(issue).lower(jnp.int32(2), params, local, momentum).compile().as_text()
    # Each branch's collectives once (frequency 1 each: one sync of each fragment).
    traffic = dcn_bytes_of_hlo(text, 4, branch_frequencies=None)
    synchronous = plan.grad_bytes / plan.dp  # per step, what the sync test measures
    per_inner_step = traffic["bytes_per_step"] / plan.diloco.inner_steps
    assert 0 < per_inner_step <= synchronous / plan.diloco.inner_steps, traffic


@pytest.mark.slow
def test_diloco_trains_and_resumes_bit_exact_with_its_outer_state(tmp_path):
    """A run's checkpoint of step 3 (mid-period, a fragment sync in flight) resumes to the
    same losses as the run itself (the newer checkpoints are removed first)."""
    import shutil

    over = MESH + ["diloco.inner_steps=4", "diloco.fragments=2", "diloco.delay=1",
                   "checkpoint.every_steps=3", "checkpoint.async_save=false", "train.steps=8"]
    cfg = config.load(TINY, over)
    first = str(tmp_path / "a")
    straight = train.run(cfg, first, progress=False, devices=jax.devices()[:8])
    assert straight.losses[-1] < straight.losses[0]
    again = str(tmp_path / "b")
    shutil.copytree(first, again)
    for step in ("6", "8"):
        shutil.rmtree(os.path.join(again, "checkpoints", step))
    resumed = train.run(cfg, again, progress=False, devices=jax.devices()[:8])
    assert resumed.extra["resumed_from"] == 3
    assert resumed.losses == straight.losses[3:]
