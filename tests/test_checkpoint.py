"""Checkpoint layer: commit protocol, verification, fallback, retention, cross-mesh."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import PLAIN_ORBAX_RESTORE, corrupt_checkpoint_step
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_overlap.resilience import checkpoint as ckpt
from jax_overlap.training.state import TrainState, new_state

# Orbax leaves un-awaited read coroutines behind when a corrupt file fails a restore.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

CONFIG = {"model": {"d": 64}, "optim": {"lr": 1e-3}}


def make_mesh(dp, pp, tp):
    return Mesh(np.array(jax.devices()).reshape(dp, pp, tp), ("dp", "pp", "tp"))


def param_specs():
    return {"w": P(None, "tp"), "b": P("tp"), "emb": P("dp", None)}


def state_shardings(mesh, state):
    """Shardings for a TrainState on `mesh`: params/moments by spec, the rest replicated."""
    specs = param_specs()
    rep = NamedSharding(mesh, P())

    def for_params(tree):
        return {k: NamedSharding(mesh, specs[k]) for k in tree}

    adam, *rest = state.opt_state
    opt = (adam._replace(count=rep, mu=for_params(adam.mu), nu=for_params(adam.nu)), *rest)
    return TrainState(
        step=rep, params=for_params(state.params), opt_state=opt, rng=rep, data_offset=rep, version=rep
    )


def make_state(mesh, seed=0, step=0):
    """A real adamw TrainState with sharded params, a few updates in so moments are non-zero."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    params = {
        "w": jax.random.normal(k1, (64, 64), jnp.float32),
        "b": jax.random.normal(k2, (64,), jnp.float32),
        "emb": jax.random.normal(k3, (8, 32), jnp.bfloat16),
    }
    params = {k: jax.device_put(v, NamedSharding(mesh, param_specs()[k])) for k, v in params.items()}
    opt = optax.adamw(1e-2)
    opt_state = opt.init(params)
    for _ in range(2):
        grads = jax.tree.map(lambda p: jnp.sin(p), params)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    state = new_state(params, opt_state, seed)
    return state._replace(step=jnp.int32(step), version=jnp.int32(step + 100))


def abstract_on(mesh, state):
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, state_shardings(mesh, state)
    )


def checksum_of(x):
    (entry,) = ckpt.array_checksums(x).values()
    return entry["checksum"]


def bits(x):
    return np.asarray(x).reshape(-1).view(np.uint8)


def assert_bit_equal(a, b):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(bits(x), bits(y))



@pytest.fixture
def mesh():
    return make_mesh(2, 1, 4)


def checkpointer(tmp_path, mesh, **kw):
    opts = dict(dir=str(tmp_path / "ckpt"), every_steps=1, keep=3, async_save=False)
    opts.update(kw)
    return ckpt.Checkpointer(ckpt.CheckpointOptions(**opts), mesh)


# --------------------------------------------------------------------------------------
# checksums


def test_checksum_is_mesh_independent_and_counts_replicas_once():
    x = jax.random.normal(jax.random.key(1), (16, 24))
    layouts = [
        NamedSharding(make_mesh(2, 1, 4), P("dp", "tp")),
        NamedSharding(make_mesh(8, 1, 1), P("dp", None)),
        NamedSharding(make_mesh(1, 1, 8), P(None, "tp")),
        NamedSharding(make_mesh(2, 1, 4), P()),  # fully replicated on 8 devices
    ]
    sums = {checksum_of(jax.device_put(x, s)) for s in layouts}
    host = checksum_of(np.asarray(x))
    assert sums == {host}


def test_checksum_detects_one_bit_flip_and_moved_data():
    x = np.arange(1000, dtype=np.float32)
    base = checksum_of(x)
    flipped = x.copy()
    flipped.view(np.uint32)[517] ^= 1 << 3
    swapped = x.copy()
    swapped[[3, 4]] = swapped[[4, 3]]
    negzero = np.zeros(4, np.float32), -np.zeros(4, np.float32)
    assert checksum_of(flipped) != base
    assert checksum_of(swapped) != base
    assert checksum_of(negzero[0]) != checksum_of(negzero[1])


def test_checksum_handles_wide_and_narrow_dtypes():
    for dtype in (np.bool_, np.int8, jnp.bfloat16, np.int64, np.complex128):
        x = np.ones((3, 5), dtype)
        (a,) = ckpt.array_checksums(x).values()
        assert a["shape"] == [3, 5] and len(a["checksum"]) == 16
        y = x.copy()
        y.reshape(-1).view(np.uint8)[-1] ^= 0x80
        assert checksum_of(y) != a["checksum"]


def test_checksum_is_independent_of_chunking_and_blocking(monkeypatch):
    x = np.random.default_rng(0).standard_normal((37, 11)).astype(np.float32)
    whole = ckpt.block_checksum(x, (slice(None), slice(None)), x.shape)
    blocks = [((slice(0, 20), slice(0, 5))), ((slice(0, 20), slice(5, 11))), ((slice(20, 37), slice(None)))]
    parts = sum(ckpt.block_checksum(x[b], b, x.shape) for b in blocks) % 2**64
    monkeypatch.setattr(ckpt, "_CHUNK_ITEMS", 16)  # several passes per block
    assert ckpt.block_checksum(x, (slice(None), slice(None)), x.shape) == whole == parts


def test_jax_collectives_single_process_round_trip():
    coll = ckpt.jax_collectives()
    big = [2**64 - 1, 2**63 + 12345, 7]
    assert coll.sum_u64(big) == big
    assert coll.broadcast_ints([5, 3, 1]) == [5, 3, 1]
    assert coll.broadcast_ints([]) == []
    assert coll.all_true(True) and not coll.all_true(False)


# --------------------------------------------------------------------------------------
# save / restore


def test_round_trip_is_bit_exact(tmp_path, mesh):
    state = make_state(mesh, step=4)
    with checkpointer(tmp_path, mesh) as c:
        assert c.maybe_save(state, CONFIG)
        assert c.committed_steps() == [4]
        result = c.latest_good(abstract_on(mesh, state))
    assert result.step == 4 and result.skipped == [] and result.config == CONFIG
    assert isinstance(result.state, TrainState)
    assert result.state.rng.dtype == jnp.uint32
    assert_bit_equal(result.state, state)
    for got, want in zip(jax.tree.leaves(result.state), jax.tree.leaves(state_shardings(mesh, state))):
        assert got.sharding == want
    assert c.last_known_good == 4


def test_async_save_commits_after_wait(tmp_path, mesh):
    state = make_state(mesh, step=6)
    ticks = iter(range(0, 1000, 5))
    opts = ckpt.CheckpointOptions(dir=str(tmp_path / "ckpt"), every_steps=3, async_save=True)
    c = ckpt.Checkpointer(opts, mesh, clock=lambda: float(next(ticks)))
    assert not c.maybe_save(state._replace(step=jnp.int32(5)), CONFIG)  # not due
    assert c.maybe_save(state, CONFIG)
    assert c.last_save_blocking_s == 5.0  # two reads of the injected clock
    assert not c.maybe_save(state, CONFIG, force=True)  # same step: nothing new to write
    c.wait()
    marker = json.loads((tmp_path / "ckpt" / "6" / "COMMITTED").read_text())
    assert marker["step"] == 6 and marker["version"] == 106
    assert set(marker["checksums"]) == set(ckpt.array_checksums(state))
    meta = json.loads((tmp_path / "ckpt" / "6" / "meta" / "metadata").read_text())
    assert meta == marker
    result = c.latest_good(abstract_on(mesh, state))
    c.close()
    assert result.step == 6
    assert_bit_equal(result.state, state)


def test_async_commit_happens_at_next_call_without_a_save(tmp_path, mesh):
    state = make_state(mesh, step=2)
    c = checkpointer(tmp_path, mesh, async_save=True, every_steps=2)
    assert c.maybe_save(state, CONFIG)
    c._manager.wait_until_finished()  # the background write ends while training goes on
    assert c.committed_steps() == []
    assert not c.maybe_save(state._replace(step=jnp.int32(3)), CONFIG, step=3)
    assert c.committed_steps() == [2]
    c.close()


def test_cross_mesh_restore(tmp_path):
    src = make_mesh(2, 1, 4)
    state = make_state(src, step=8)
    with checkpointer(tmp_path, src) as c:
        c.maybe_save(state, CONFIG)
    for shape in [(8, 1, 1), (1, 1, 8)]:
        dst = make_mesh(*shape)
        with checkpointer(tmp_path, dst) as c:
            result = c.latest_good(abstract_on(dst, state))
        assert result.step == 8
        assert_bit_equal(result.state, state)
        assert result.state.params["w"].sharding.mesh.shape == dict(zip(("dp", "pp", "tp"), shape))


def test_restore_target_without_shardings_is_replicated(tmp_path, mesh):
    state = make_state(mesh, step=1)
    with checkpointer(tmp_path, mesh) as c:
        c.maybe_save(state, CONFIG)
        bare = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        result = c.latest_good(bare)
    assert result.state.params["w"].sharding.is_fully_replicated
    assert_bit_equal(result.state, state)


# --------------------------------------------------------------------------------------
# damaged checkpoints


def save_steps(tmp_path, mesh, steps, **kw):
    states = {}
    with checkpointer(tmp_path, mesh, **kw) as c:
        for s in steps:
            states[s] = make_state(mesh, seed=s, step=s)
            assert c.maybe_save(states[s], CONFIG)
    return states


def restore_warned(tmp_path, mesh, template):
    with checkpointer(tmp_path, mesh) as c, pytest.warns(RuntimeWarning) as record:
        result = c.latest_good(abstract_on(mesh, template))
    return result, [str(w.message) for w in record]


def test_truncated_newest_falls_back_to_previous(tmp_path, mesh):
    states = save_steps(tmp_path, mesh, [1, 2])
    corrupt_checkpoint_step(tmp_path / "ckpt", 2)
    result, messages = restore_warned(tmp_path, mesh, states[1])
    assert result.step == 1
    assert_bit_equal(result.state, states[1])
    assert [s for s, _ in result.skipped] == [2]
    assert any("step 2" in m for m in messages)
    # The bad step is moved aside, not deleted, and a new save of step 2 works.
    assert os.path.isdir(tmp_path / "ckpt" / "quarantine" / "2.0")
    with checkpointer(tmp_path, mesh) as c:
        assert c.maybe_save(states[2], CONFIG)
        assert c.latest_good(abstract_on(mesh, states[2])).step == 2


def test_byte_flip_in_newest_falls_back_to_previous(tmp_path, mesh):
    states = save_steps(tmp_path, mesh, [1, 2, 3])
    corrupt_checkpoint_step(tmp_path / "ckpt", 3, how="flip")
    result, messages = restore_warned(tmp_path, mesh, states[2])
    assert result.step == 2
    assert_bit_equal(result.state, states[2])
    (step, reason), = result.skipped
    assert step == 3 and ("checksum" in reason or "restore failed" in reason)
    assert any("step 3" in m for m in messages)


def test_swapped_array_data_is_caught_by_checksums(tmp_path, mesh):
    """Data that restores cleanly but is not what was committed (deterministic check)."""
    states = save_steps(tmp_path, mesh, [1, 2])
    other = tmp_path / "other"
    with ckpt.Checkpointer(ckpt.CheckpointOptions(dir=str(other), every_steps=1, async_save=False), mesh) as c:
        c.maybe_save(make_state(mesh, seed=99, step=2), CONFIG)
    shutil.rmtree(tmp_path / "ckpt" / "2" / "state")
    shutil.copytree(other / "2" / "state", tmp_path / "ckpt" / "2" / "state")
    result, _ = restore_warned(tmp_path, mesh, states[1])
    assert result.step == 1
    assert result.skipped[0][0] == 2 and "checksum mismatch" in result.skipped[0][1]


def test_tampered_marker_is_skipped(tmp_path, mesh):
    states = save_steps(tmp_path, mesh, [1, 2])
    marker = tmp_path / "ckpt" / "2" / "COMMITTED"
    data = json.loads(marker.read_text())
    data["version"] += 1
    marker.write_text(json.dumps(data))
    result, _ = restore_warned(tmp_path, mesh, states[1])
    assert result.step == 1 and result.skipped[0][0] == 2


def test_uncommitted_only_directory_is_ignored(tmp_path, mesh):
    """A kill between Orbax finalising and our marker: files all there, no COMMITTED."""
    states = save_steps(tmp_path, mesh, [5])
    os.remove(tmp_path / "ckpt" / "5" / "COMMITTED")
    with checkpointer(tmp_path, mesh) as c, pytest.warns(RuntimeWarning, match="step 5"):
        assert c.committed_steps() == []
        assert c.latest_good(abstract_on(mesh, states[5])) is None


class FailingMarkerFS(ckpt.LocalFS):
    """Simulates a crash while committing given steps: the marker never lands."""

    def __init__(self, fail_steps):
        self.fail_steps = set(fail_steps)

    def write_atomic(self, path, text):
        if json.loads(text)["step"] in self.fail_steps:
            raise OSError("simulated crash during commit")
        super().write_atomic(path, text)


def test_failed_commit_keeps_previous_checkpoint(tmp_path, mesh):
    opts = ckpt.CheckpointOptions(dir=str(tmp_path / "ckpt"), every_steps=1, keep=1, async_save=True)
    c = ckpt.Checkpointer(opts, mesh, fs=FailingMarkerFS({3}))
    states = {s: make_state(mesh, seed=s, step=s) for s in (1, 2, 3)}
    c.maybe_save(states[1], CONFIG)
    c.maybe_save(states[2], CONFIG)
    c.maybe_save(states[3], CONFIG)
    assert c.committed_steps() == [2]  # keep=1: step 1 went once 2 was committed
    with pytest.raises(OSError, match="simulated crash"):
        c.wait()
    assert c.committed_steps() == [2] and os.path.isdir(tmp_path / "ckpt" / "2")
    with pytest.warns(RuntimeWarning, match="step 3"):
        result = c.latest_good(abstract_on(mesh, states[2]))
    c.close()
    assert result.step == 2 and result.skipped[0][0] == 3
    assert_bit_equal(result.state, states[2])


def test_retention_keeps_last_known_good(tmp_path, mesh):
    states = {s: make_state(mesh, seed=s, step=s) for s in range(1, 6)}
    with checkpointer(tmp_path, mesh, keep=2) as c:
        c.maybe_save(states[1], CONFIG)
        assert c.latest_good(abstract_on(mesh, states[1])).step == 1  # verified: known good
        for s in range(2, 6):
            c.maybe_save(states[s], CONFIG)
        assert c.committed_steps() == [1, 4, 5]
    # Both newest steps go bad; the known-good one is still there to fall back to.
    for s in (4, 5):
        corrupt_checkpoint_step(tmp_path / "ckpt", s)
    result, _ = restore_warned(tmp_path, mesh, states[1])
    assert result.step == 1 and [s for s, _ in result.skipped] == [5, 4]
    assert_bit_equal(result.state, states[1])


def test_resave_of_existing_step(tmp_path, mesh):
    state = make_state(mesh, step=2)
    with checkpointer(tmp_path, mesh) as c:
        assert c.maybe_save(state, CONFIG)
    with checkpointer(tmp_path, mesh) as c:
        # An identical committed copy (a resume right at a saved step): nothing to do.
        assert not c.maybe_save(state, CONFIG)
        # Same step, another timeline's state: the old copy is moved aside, not deleted.
        other = make_state(mesh, seed=7, step=2)._replace(version=jnp.int32(500))
        assert c.maybe_save(other, CONFIG)
        assert not c.maybe_save(other, CONFIG, force=True)
        result = c.latest_good(abstract_on(mesh, other))
    assert result.step == 2 and result.skipped == []
    assert_bit_equal(result.state, other)
    assert os.path.isdir(tmp_path / "ckpt" / "quarantine" / "2.0")
    assert ckpt.FORMAT_VERSION == json.loads((tmp_path / "ckpt" / "quarantine" / "2.0" / "COMMITTED").read_text())["format"]


# --------------------------------------------------------------------------------------
# plain Orbax can read it


PLAIN_READER = PLAIN_ORBAX_RESTORE + textwrap.dedent(
    """
    w = np.asarray(out["state"]["params"]["w"])
    print(json.dumps({"steps": steps, "config": out["config"],
                      "w": w.tolist(), "step": int(out["state"]["step"]),
                      "modules": sorted(m for m in sys.modules if m.startswith("jax_overlap"))}))
    """
)


def test_plain_orbax_can_read_the_directory(tmp_path, mesh):
    state = make_state(mesh, step=3)
    save_steps(tmp_path, mesh, [])
    with checkpointer(tmp_path, mesh) as c:
        c.maybe_save(make_state(mesh, seed=1, step=1), CONFIG)
        c.maybe_save(state, CONFIG)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    env["JAX_PLATFORMS"] = "cpu"  # a single device: a different topology from the save
    proc = subprocess.run(
        [sys.executable, "-c", PLAIN_READER, str(tmp_path / "ckpt")],
        capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["steps"] == [1, 3] and out["config"] == CONFIG and out["step"] == 3
    assert out["modules"] == []
    np.testing.assert_array_equal(np.asarray(out["w"], np.float32), np.asarray(state.params["w"]))
