"""The local checkpoint tier (jax_overlap/resilience/local_tier.py): per-process shards, a
commit marker, checksums, retention, binding to the run; in one process on 8 CPU devices."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jax_overlap.parallel.mesh import make_mesh
from jax_overlap.resilience import checkpoint as ckptlib
from jax_overlap.resilience.local_tier import LocalTier, run_key, sweep_orphans


def _tree(mesh, seed=0):
    k = jax.random.PRNGKey(seed)
    tp = NamedSharding(mesh, PartitionSpec(None, "tp"))
    rep = NamedSharding(mesh, PartitionSpec())
    return {"w": jax.device_put(jax.random.normal(k, (8, 16)), tp),
            "b": jax.device_put(jnp.arange(5, dtype=jnp.float32) * (seed + 1), rep),
            "step": jax.device_put(jnp.int32(seed), rep)}


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        tree)


@pytest.fixture
def mesh():
    return make_mesh(2, 1, 4, jax.devices()[:8])


def _tier(tmp_path, **kw):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)
    tier = LocalTier(str(ckpt), every=1, root=str(tmp_path / "local"),
                     collectives=ckptlib.local_collectives(), **kw)
    tier.bind(1234)
    return tier


def test_round_trip_is_bit_exact_and_retention_keeps_the_newest(tmp_path, mesh):
    tier = _tier(tmp_path, keep=2)
    trees = {s: _tree(mesh, s) for s in (1, 2, 3)}
    for s, t in trees.items():
        tier.save(t, s, version=0)
    tier.wait()
    assert tier.committed_steps() == [2, 3]
    got, skipped = tier.restore(_abstract(trees[3]))
    assert got.step == 3 and skipped == []
    for name in trees[3]:
        assert got.state[name].sharding == trees[3][name].sharding
        np.testing.assert_array_equal(np.asarray(got.state[name]), np.asarray(trees[3][name]))
    got, _ = tier.restore(_abstract(trees[3]), min_step=4)  # nothing new enough
    assert got is None


def test_corrupt_or_uncommitted_newest_falls_back_to_the_older(tmp_path, mesh):
    tier = _tier(tmp_path, keep=2)
    for s in (1, 2):
        tier.save(_tree(mesh, s), s, version=0)
    tier.wait()
    marker = os.path.join(tier.dir, "2", ckptlib.MARKER_NAME)
    meta = json.load(open(marker))
    meta["leaves"][0]["shards"][0]["checksum"] = "0" * 16  # as if the data had changed
    open(marker, "w").write(json.dumps(meta))
    got, skipped = tier.restore(_abstract(_tree(mesh, 1)))
    assert got.step == 1 and skipped[0][0] == 2 and "checksum mismatch" in skipped[0][1]
    os.remove(os.path.join(tier.dir, "1", ckptlib.MARKER_NAME))  # killed before the commit
    got, skipped = tier.restore(_abstract(_tree(mesh, 1)))
    assert got is None and "never committed" in skipped[-1][1]


def test_another_mesh_is_not_restored_locally(tmp_path, mesh):
    tier = _tier(tmp_path)
    tier.save(_tree(mesh, 1), 1, version=0)
    other = make_mesh(8, 1, 1, jax.devices()[:8])  # tp shards of another shape
    target = _abstract(_tree(mesh, 1))
    target["w"] = jax.ShapeDtypeStruct((8, 16), jnp.float32,
                                       sharding=NamedSharding(other, PartitionSpec("dp", None)))
    got, skipped = tier.restore(target)
    assert got is None and "another mesh" in skipped[0][1]


def test_a_tier_of_another_run_is_never_restored(tmp_path, mesh):
    tier = _tier(tmp_path)
    tier.save(_tree(mesh, 1), 1, version=0)
    tier.wait()
    fresh = LocalTier(str(tmp_path / "ckpt"), every=1, root=str(tmp_path / "local"),
                      collectives=ckptlib.local_collectives(), token=999)  # a new run's token
    got, _ = fresh.restore(_abstract(_tree(mesh, 1)))
    assert got is None
    fresh.bind(999)
    assert fresh.steps() == []  # the old run's steps are gone


def test_discard_after_drops_another_timeline_and_close_removes(tmp_path, mesh):
    tier = _tier(tmp_path, keep=2)
    for s in (4, 5):
        tier.save(_tree(mesh, s), s, version=0)
    tier.discard_after(4)
    assert tier.committed_steps() == [4]
    tier.close(remove=True)
    assert not os.path.exists(tier.run_root)


def test_orphaned_tiers_are_swept(tmp_path, mesh):
    tier = _tier(tmp_path)
    tier.save(_tree(mesh, 1), 1, version=0)
    tier.wait()
    os.rename(tmp_path / "ckpt", tmp_path / "gone")  # the run's checkpoint dir went away
    assert sweep_orphans(str(tmp_path / "local")) == [tier.run_root]
    assert run_key(str(tmp_path / "ckpt")) == os.path.basename(tier.run_root)


def test_a_failed_write_is_reported_by_the_next_wait(tmp_path, mesh):
    tier = _tier(tmp_path)
    os.chmod(tier.dir, 0o500)
    if os.access(tier.dir, os.W_OK):  # root writes anyway: fake the full disk instead
        os.chmod(tier.dir, 0o700)
        tier.dir = os.path.join(str(tmp_path), "a_file")
        open(tier.dir, "w").close()
    tier.save(_tree(mesh, 1), 1, version=0)
    with pytest.raises(OSError):
        tier.wait()
