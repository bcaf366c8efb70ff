"""Guarded steps, injected faults, rollbacks and the watchdog (in-process, 8 CPU devices)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY

from jax_overlap import config
from jax_overlap.config import ConfigError
from jax_overlap.training.assemble import assemble
from jax_overlap.resilience.ckpt_layout import checkpoint_mismatch
from jax_overlap.training.faults import Fault, make_fault_hook, planned_faults
from jax_overlap.training.rollback import (
    MAX_ROLLBACKS_WITHOUT_PROGRESS,
    RollbackStreak,
    note_rollback,
    plan_rollback,
)
from jax_overlap.resilience.watchdog import (
    EXIT_FAILED,
    EXIT_PEER_FAILED,
    MemoryBoard,
    Watchdog,
)
from jax_overlap.training import loop as train
from jax_overlap.training.state import TrainState

# Orbax leaves un-awaited read coroutines behind when a restore fails.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def bits_equal(a, b):
    """Same tree of leaves, equal bit for bit (NaN payloads and -0.0 included)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).dtype == np.asarray(y).dtype
        and np.array_equal(np.atleast_1d(np.asarray(x)).view(np.uint8),
                           np.atleast_1d(np.asarray(y)).view(np.uint8))
        for x, y in zip(la, lb))


# ---------------------------------------------------------------------------------------------
# Pure pieces


def test_rollback_resumes_data_past_the_bad_batches():
    # Stuck at step 7 having consumed batches up to 10 (4 rejected attempts: 7, 8, 9, 10);
    # the checkpoint is at step 4 and one more batch is skipped.
    plan = plan_rollback(from_step=7, next_batch=11, to_step=4, skip_batches=1,
                         reason="r")
    assert plan.resume_batch == 12 and plan.steps_lost == 3
    assert plan.to_step + plan.data_offset == 12  # batch_index of the restored state
    assert plan_rollback(0, 3, 0, 0, "r").data_offset == 3
    with pytest.raises(ValueError, match="ahead"):
        plan_rollback(3, 5, 4, 1, "r")


def test_rollback_streak_counts_only_rollbacks_without_progress():
    streak = RollbackStreak()
    for step in (5, 9):  # two faults at different steps: progress in between
        streak = note_rollback(streak, step)
        assert streak.stalled == 1
    for n in range(2, 5):  # the same spot failing again and again, or earlier
        streak = note_rollback(streak, 9 if n % 2 else 7)
        assert streak == (9, n)
    assert streak.stalled > MAX_ROLLBACKS_WITHOUT_PROGRESS
    assert note_rollback(streak, 10) == (10, 1)


def test_fault_plan_fires_until_rolled_back_past():
    cfg = config.load(TINY, ["fault.nan_at_step=5", "fault.spike_at_step=2"])
    faults = planned_faults(cfg.fault)
    assert faults == (Fault(2, "spike"), Fault(5, "nan"))
    assert make_fault_hook((), jnp.int32(0)) is None
    grads = {"w": jnp.array([1.5, -2.0], jnp.float32)}
    loss = jnp.float32(3.25)

    def play(step, rollbacks):
        hook = make_fault_hook(faults, jnp.int32(rollbacks))
        state = TrainState(jnp.int32(step), None, None, None, jnp.int32(0), jnp.int32(0))
        return hook(state, loss, grads)

    l, g = play(2, 0)  # the spike, the first fault: live until one rollback
    assert float(l) == 325.0 and np.array_equal(g["w"], [150.0, -200.0])
    l, g = play(2, 1)
    assert bits_equal((l, g), (loss, grads))  # passes values through bit for bit
    l, g = play(5, 1)  # the NaN is the second fault: live until two rollbacks
    assert np.isnan(float(l)) and np.isnan(np.asarray(g["w"])).all()
    assert bits_equal(play(5, 2), (loss, grads))
    assert bits_equal(play(4, 0), (loss, grads))


def test_checkpoint_mismatch_names_the_leaf():
    abstract = {"w": jax.ShapeDtypeStruct((4, 8), jnp.float32),
                "b": jax.ShapeDtypeStruct((8,), jnp.float32)}
    same = {"checksums": {"['w']": {"shape": [4, 8], "dtype": "float32"},
                          "['b']": {"shape": [8], "dtype": "float32"}}}
    wider = {"checksums": {"['w']": {"shape": [4, 16], "dtype": "float32"},
                           "['b']": {"shape": [8], "dtype": "float32"}}}
    fewer = {"checksums": {"['w']": {"shape": [4, 8], "dtype": "float32"}}}
    assert checkpoint_mismatch([], abstract) is None
    assert checkpoint_mismatch([(9, wider), (4, same)], abstract) is None
    msg = checkpoint_mismatch([(9, wider)], abstract)
    assert "step 9" in msg and "['w'] is float32[4, 16] there, float32[4, 8] here" in msg
    assert "lacks ['b']" in checkpoint_mismatch([(3, fewer)], abstract)
    assert checkpoint_mismatch([(3, {"garbage": 1})], abstract) is None


# ---------------------------------------------------------------------------------------------
# Watchdog (fake clock, in-memory board shared by two "processes")


class Clock:
    """A fake monotonic clock; `sleep` advances it."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def sleep(self, dt):
        self.t += dt


def pair(timeout=30.0, board=None, clock=None):
    board, clock = board or MemoryBoard(), clock or Clock()
    exits = []
    dogs = [Watchdog(board, i, 2, timeout, clock=clock, sleep=clock.sleep, grace_s=3.0,
                     exit_fn=lambda m, c: exits.append((m, c))) for i in (0, 1)]
    return board, clock, dogs, exits


def test_watchdog_stops_at_once_when_a_peer_failed():
    board, clock, (d0, d1), _ = pair()
    d0.beat("step", 3)
    assert d0.check() is None
    d1.fail(1, "RuntimeError: boom")
    d1.fail(1, "later errors do not overwrite the first")
    msg = d0.check()
    assert msg.startswith("process 1 failed (RuntimeError: boom)") and "Restart" in msg
    assert d1.check() is None  # the failed process does not stop itself through the board


def test_watchdog_names_the_process_that_is_elsewhere_after_the_timeout():
    board, clock, (d0, d1), _ = pair(timeout=30)
    d0.beat("step", 12)
    d1.beat("save", 12)
    d1.check()
    clock.t = 29.0
    assert d0.check() is None
    clock.t = 31.0
    msg = d0.check()
    assert "no progress for 31 s" in msg and "process 1 is stuck in save at step 12" in msg


def test_watchdog_timeout_only_in_timed_phases():
    board, clock, (d0, d1), _ = pair(timeout=5)
    d0.beat("compile", 0)  # the first step compiles: may take long on every process
    clock.t = 100.0
    assert d0.check() is None
    d0.beat("step", 1)
    d1.beat("step", 1)
    d1.check()
    clock.t = 106.0
    assert "every process reports step at step 1: a collective is stuck" in d0.check()


class PeerBeats(MemoryBoard):
    """A board on which process 1's thread keeps beating while process 0 waits (or not)."""

    def __init__(self, peer, alive):
        super().__init__()
        self.peer, self.alive = peer, alive

    def get(self, key):
        if self.alive and key == "jax_overlap/progress/1":
            self.peer.publish()
        return super().get(key)


@pytest.mark.parametrize("peer_alive", [False, True])
def test_watchdog_diagnoses_an_error_of_the_main_thread(peer_alive):
    clock = Clock()
    board, _, (d0, d1), exits = pair(clock=clock)
    board = PeerBeats(d1, peer_alive)
    d0._board = d1._board = board
    d1.publish()
    error = RuntimeError("Gloo AllGather failed: Connection closed by peer [127.0.0.1]:6050")
    d0.__exit__(RuntimeError, error, None)  # as when the main thread's step raised
    (message, code), = exits
    if peer_alive:  # then the error is ours: published, so process 1 stops naming us
        assert code == EXIT_FAILED and message.startswith("process 0 failed")
        assert d1.peer_failure().startswith("process 0 failed (RuntimeError: Gloo")
    else:  # process 1's beat froze: it is the lost one, and the board says so
        assert code == EXIT_PEER_FAILED
        assert message.startswith("lost process 1 (no sign of life for 3 s; here: RuntimeError")
        assert json.loads(board.get("jax_overlap/failed"))["process"] == 1
    assert clock.t >= 3.0  # waited for the grace period


def test_watchdog_prefers_a_failure_the_peer_published():
    board, clock, (d0, d1), exits = pair()
    d1.fail(1, "ValueError: bad batch")
    d0.__exit__(RuntimeError, RuntimeError("Connection closed by peer"), None)
    assert exits == [(d0.peer_failure(), EXIT_PEER_FAILED)]
    assert clock.t == 0.0  # no waiting needed


def test_watchdog_thread_exits_on_a_peer_failure_and_single_process_starts_none():
    import threading

    board = MemoryBoard()
    fired = threading.Event()
    exits = []
    dog = Watchdog(board, 0, 2, 60, poll_s=0.01,
                   exit_fn=lambda m, c: (exits.append((m, c)), fired.set()))
    with dog:
        board.set("jax_overlap/failed", json.dumps({"process": 1, "reason": "OOM"}))
        assert fired.wait(5)
    assert exits[0][0].startswith("process 1 failed (OOM)")
    assert exits[0][1] == EXIT_PEER_FAILED
    lone = Watchdog(None, 0, 1, 60)
    with lone:
        assert not lone.active and lone._thread is None
    with pytest.raises(KeyError):  # a single process lets errors propagate untouched
        with Watchdog(None, 0, 1, 60):
            raise KeyError("x")


# ---------------------------------------------------------------------------------------------
# The guarded step on a dp2 x tp4 mesh


@pytest.fixture(scope="module")
def tiny_mesh_setup():
    return assemble(config.load(TINY, ["fault.nan_at_step=1", "guard.window=4"]))


def test_guarded_step_accepts_like_the_plain_step_and_skips_a_nan(tiny_mesh_setup):
    run = tiny_mesh_setup
    from helpers import np_batch

    guarded = run.guarded_step()
    plain = run.train_step()
    loop = run.initializer()()
    assert jax.tree.structure(loop) == jax.tree.structure(run.abstract_loop_state())
    b0, b1 = (run.put_batch(np_batch(run.cfg, i)) for i in (0, 1))

    ref, _ = plain(jax.tree.map(jnp.copy, loop.train), b0)  # a copy: the step donates it
    loop, m = guarded(loop, b0)  # step 0: healthy, accepted
    assert bool(m["accepted"]) and int(m["step"]) == 1 and int(m["next_batch"]) == 1
    assert bits_equal(loop.train, ref)  # guards and the idle fault hook change nothing
    before = jax.device_get(loop)

    loop, m = guarded(loop, b1)  # step 1: the injected NaN
    after = jax.device_get(loop)
    assert not bool(m["accepted"]) and np.isnan(float(m["loss"]))
    assert int(m["consecutive_bad"]) == 1
    assert bits_equal((after.train.params, after.train.opt_state),
                      (before.train.params, before.train.opt_state))
    assert int(after.train.step) == 1 and int(after.train.version) == 1
    assert int(after.train.data_offset) == 1 and int(m["next_batch"]) == 2  # batch consumed
    assert bits_equal(after.guard.losses, before.guard.losses)
    assert int(after.guard.count) == 1


# ---------------------------------------------------------------------------------------------
# Whole runs


FAULTY = ["train.steps=10", "fault.nan_at_step=5", "fault.spike_at_step=7", "guard.window=4",
          "guard.max_skips=1", "guard.skip_batches=1", "checkpoint.every_steps=2",
          "checkpoint.async_save=true"]


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("faulty"))
    cfg = config.load(TINY, FAULTY)
    result = train.run(cfg, run_dir, progress=False)
    return cfg, run_dir, result


def test_nan_and_spike_roll_back_and_finish_finite(faulty_run):
    cfg, run_dir, result = faulty_run
    s = result.summary()
    assert s["final_step"] == 10 and np.isfinite(result.losses).all()
    assert s["rollbacks"] == 2 and s["skipped_steps"] == 4  # (max_skips + 1) per fault
    assert s["steps_lost"] <= 2 * cfg.checkpoint.every_steps
    assert s["lr_scale"] == 1.0 and s["last_checkpoint"] == 10
    records = read_metrics(run_dir)
    events = [r for r in records if r.get("event") == "rollback"]
    assert [(e["from_step"], e["to_step"]) for e in events] == [(5, 4), (7, 6)]
    assert all(e["steps_lost"] <= cfg.checkpoint.every_steps for e in events)
    assert "consecutive rejected steps" in events[0]["reason"]
    skipped = [r for r in records if r.get("skipped")]
    assert [r["reason"] for r in skipped] == ["non_finite"] * 2 + ["spike"] * 2
    # Data: the attempts at step 6 consumed batches 5 and 6; after restoring step 4 the run
    # continues one batch past them, so the replayed step 5 reads batch 8.
    after = records[records.index(events[0]) + 1]
    assert after["step"] == 5 and after["batch"] == events[0]["resume_batch"] == 8
    # The replayed step restarts from the checkpoint's optimizer state: same schedule point.
    first = {r["step"]: r["lr"] for r in records[:records.index(events[0])] if "lr" in r}
    assert after["lr"] == first[5]


@pytest.mark.slow
def test_rollback_without_checkpoints_restarts_from_the_initial_state(tmp_path):
    cfg = config.load(TINY, ["train.steps=4", "fault.nan_at_step=2", "guard.max_skips=0",
                             "guard.skip_batches=2", "guard.lr_scale_on_rollback=0.5",
                             "checkpoint.every_steps=0"])
    result = train.run(cfg, str(tmp_path), progress=False)
    s = result.summary()
    assert s["rollbacks"] == 1 and s["steps_lost"] == 2 and s["final_step"] == 4
    assert s["last_checkpoint"] is None and not os.path.exists(tmp_path / "checkpoints")
    records = read_metrics(tmp_path)
    (event,) = [r for r in records if r.get("event") == "rollback"]
    assert (event["from_step"], event["to_step"], event["from_checkpoint"]) == (2, 0, False)
    # The restart reads new data: batches 0, 1 were used, 2 was the NaN, 3 and 4 are skipped.
    steps = [r for r in records if "loss" in r and not r.get("skipped")]
    assert steps[0]["loss"] != steps[2]["loss"] and steps[2]["batch"] == 5
    assert np.isfinite(result.losses).all() and len(result.losses) == 6
    # The optimizer is rebuilt with the learning rate halved: same schedule step, half the LR.
    assert s["lr_scale"] == 0.5
    assert steps[2]["step"] == steps[0]["step"] == 1
    assert steps[3]["lr"] == pytest.approx(0.5 * steps[1]["lr"], rel=1e-6) and steps[1]["lr"] > 0


def test_resume_refuses_a_checkpoint_of_another_model(faulty_run, tmp_path):
    cfg, run_dir, _ = faulty_run
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    before = sorted(os.listdir(ckpt_dir))
    other = config.load(TINY, FAULTY + ["model.d_ff=128", f"checkpoint.dir={ckpt_dir}"])
    with pytest.raises(ConfigError, match=r"checkpoint\.dir: .*saved with a different model"):
        train.run(other, str(tmp_path), progress=False)
    assert sorted(os.listdir(ckpt_dir)) == before  # nothing was quarantined
