"""Resuming real training runs: kills, pre-emption, corrupt checkpoints, other meshes.

Most scenarios share one chain of CLI runs in the same run directory (subprocesses pay for
start-up and compilation each, so they are grouped):

  A  killed with SIGKILL at step 10 while the save of step 8 is held in flight
  B  the same command: resumes from step 4 (8 never committed); SIGTERM part-way
  C  the same command: resumes where B stopped and finishes

and the finished run is compared bit for bit with an uninterrupted run of the same command.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from helpers import (PLAIN_ORBAX_RESTORE, REPO, TINY, corrupt_checkpoint_step, last_json_line,
                     rel)

from jax_overlap import config
from jax_overlap.resilience import checkpoint as ckptlib
from jax_overlap.training import loop as train

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

# Runs the CLI with test-only faults taken from the environment. Faults hook the metrics
# writer, which every process calls right after each step, so they fire at exact steps.
DRIVER = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    from jax_overlap.training import loop as train

    def env(name):
        return int(os.environ.get(name, "-1"))

    kill_at, raise_at, slow_from, hold_save = (
        env("DRILL_KILL_AT"), env("DRILL_RAISE_AT"), env("DRILL_SLOW_FROM"), env("DRILL_HOLD_SAVE"))
    write = train.MetricsWriter.write

    def drill_write(self, record):
        write(self, record)
        if "event" in record or record.get("skipped"):
            return
        step = record["step"]
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == raise_at:
            raise RuntimeError(f"injected failure at step {step}")
        if 0 <= slow_from <= step:
            time.sleep(0.2)

    train.MetricsWriter.write = drill_write
    if hold_save >= 0:
        import orbax.checkpoint as ocp

        finalize = ocp.CheckpointManager._finalize_checkpoint

        def held(self, step):
            if step == hold_save:  # the background save never finishes
                print(f"holding the save of step {step} in flight", flush=True)
                threading.Event().wait()
            return finalize(self, step)

        ocp.CheckpointManager._finalize_checkpoint = held
    from jax_overlap import cli

    sys.exit(cli.main(sys.argv[1:]))
    """
)


def cli_env(cache_dir=None, **drill):
    """Environment of a CLI run; `cache_dir` shares compiled steps between runs of a test.

    JAX's persistent compilation cache turns every launch after the first into a cache hit
    (~4x faster here); the directory is fresh per test session, so nothing stale is reused.
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # the CLI sizes the host device count itself
    if cache_dir is not None:
        env.update(JAX_COMPILATION_CACHE_DIR=str(cache_dir),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    env.update({f"DRILL_{k.upper()}": str(v) for k, v in drill.items()})
    return env


def start_cli(args, cache_dir=None, **drill) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", DRIVER, *args], cwd=REPO,
                            env=cli_env(cache_dir, **drill), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=600):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, out, err


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def step_records(records):
    return [r for r in records if "event" not in r and not r.get("skipped")]


def marker(ckpt_dir, step):
    with open(os.path.join(ckpt_dir, str(step), ckptlib.MARKER_NAME)) as f:
        return json.load(f)


def model_checksums(mark):
    """Checksums of params and optimizer state (the step counters are compared separately)."""
    return {k: v["checksum"] for k, v in mark["checksums"].items()
            if k.startswith((".train.params", ".train.opt_state"))}


def wait_for_step(run_dir, step, proc, after_event=None, timeout=600):
    """Polls metrics.jsonl until a step record >= `step` (after the last `after_event`)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"process ended early: {proc.communicate()[1][-3000:]}")
        try:
            records = read_metrics(run_dir)
        except (FileNotFoundError, json.JSONDecodeError):
            records = []
        if after_event is not None:
            marks = [i for i, r in enumerate(records) if r.get("event") == after_event]
            records = records[marks[-1] + 1:] if marks else []
        seen = [r["step"] for r in step_records(records)]
        if seen and seen[-1] >= step:
            return seen[-1]
        time.sleep(0.02)
    raise AssertionError(f"no step {step} within {timeout} s")


STEPS = 40
RUN = ["train", "--config", TINY, "--no-progress", "--set", f"train.steps={STEPS}",
       "--set", "checkpoint.every_steps=4", "--set", "checkpoint.keep=3",
       "--set", "checkpoint.async_save=true"]


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("jax_cache")


@pytest.fixture(scope="module")
def chain(tmp_path_factory, jax_cache):
    run_dir = str(tmp_path_factory.mktemp("chain"))
    args = RUN + ["--run-dir", run_dir]
    out = {"run_dir": run_dir, "ckpt": os.path.join(run_dir, "checkpoints"), "cache": jax_cache}

    # A: SIGKILL at step 10; the save of step 8 is still in flight (held), 4 is committed.
    out["A"] = finish(start_cli(args, jax_cache, kill_at=10, hold_save=8))
    out["after_A"] = {name: os.path.exists(os.path.join(out["ckpt"], name, ckptlib.MARKER_NAME))
                      for name in os.listdir(out["ckpt"])}

    # B: the same command resumes; SIGTERM once it is well past the resume point.
    proc = start_cli(args, jax_cache, slow_from=14)
    seen = wait_for_step(run_dir, 14, proc, after_event="resume")
    t_signal = time.time()
    proc.send_signal(signal.SIGTERM)
    out["B"] = finish(proc)
    out["B_exit_s"] = time.time() - t_signal
    out["B_seen"] = seen

    # C: the same command again runs to the end.
    out["C"] = finish(start_cli(args, jax_cache))
    return out


@pytest.fixture(scope="module")
def straight(tmp_path_factory, chain):
    """The uninterrupted run, same command (after the chain: its compiled step is cached)."""
    run_dir = str(tmp_path_factory.mktemp("straight"))
    rc, out, err = finish(start_cli(RUN + ["--run-dir", run_dir], chain["cache"]))
    assert rc == 0, err[-3000:]
    assert last_json_line(out)["final_step"] == STEPS
    return run_dir


def test_sigkill_during_in_flight_save_resumes_from_previous_commit(chain):
    rc, out, err = chain["A"]
    assert rc == -signal.SIGKILL, err[-3000:]
    # Step 4 committed; step 8 still being written (Orbax's temporary directory) or held
    # just before its commit: either way without a marker.
    after = chain["after_A"]
    assert after.pop("4") is True
    (held,) = after
    assert held.startswith("8") and after[held] is False
    rc, out, err = chain["B"]
    resume = [line for line in out.splitlines() if line.startswith("resuming")]
    assert len(resume) == 1 and resume[0].startswith("resuming from checkpoint step 4 in ")
    # The held step either never left Orbax's temporary directory or has no commit marker.
    assert "step 8" not in resume[0] or "no COMMITTED marker" in resume[0]


def test_sigterm_finishes_the_step_saves_and_exits_zero(chain):
    rc, out, err = chain["B"]
    assert rc == 0, err[-3000:]
    summary = last_json_line(out)
    stopped = summary["final_step"]
    assert summary["preempted"] and summary["resumed_from"] == 4
    assert chain["B_seen"] <= stopped <= chain["B_seen"] + 2  # the step in flight, then out
    assert f"pre-empted by SIGTERM after step {stopped}: checkpoint step {stopped} committed" in out
    assert summary["last_checkpoint"] == stopped
    assert marker(chain["ckpt"], stopped)["step"] == stopped
    # Steps here take >= 0.2 s; the exit adds one step, a save, its commit and shutdown.
    assert chain["B_exit_s"] < 20, chain["B_exit_s"]
    (event,) = [r for r in read_metrics(chain["run_dir"]) if r.get("event") == "preempted"]
    assert event == {"event": "preempted", "step": stopped, "signal": "SIGTERM"}
    rc, out, err = chain["C"]
    assert rc == 0, err[-3000:]
    assert f"resuming from checkpoint step {stopped} in " in out
    assert last_json_line(out)["resumed_from"] == stopped


def test_killed_and_preempted_run_ends_bit_identical_to_uninterrupted(chain, straight):
    rc, out, err = chain["C"]
    assert rc == 0, err[-3000:]
    assert last_json_line(out)["final_step"] == STEPS
    ours = marker(chain["ckpt"], STEPS)
    ref = marker(os.path.join(straight, "checkpoints"), STEPS)
    # 64-bit checksums of the raw bits of every parameter and optimizer-state array.
    assert len(model_checksums(ref)) > 10
    assert model_checksums(ours) == model_checksums(ref)
    assert ours["checksums"] == ref["checksums"]  # and RNG, data position, guard, counters
    # Every step after the last resume saw the same batch and produced the same loss.
    records = read_metrics(chain["run_dir"])
    last_resume = max(i for i, r in enumerate(records) if r.get("event") == "resume")
    tail = {r["step"]: (r["loss"], r["batch"]) for r in step_records(records[last_resume:])}
    ref_steps = {r["step"]: (r["loss"], r["batch"]) for r in step_records(read_metrics(straight))}
    assert tail and all(ref_steps[s] == v for s, v in tail.items())



def test_corrupt_newest_checkpoints_are_reported_and_skipped(chain, tmp_path):
    run_dir = str(tmp_path / "run")
    shutil.copytree(chain["run_dir"], run_dir)
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    committed = sorted(int(s) for s in os.listdir(ckpt_dir) if s.isdigit()
                       and os.path.exists(os.path.join(ckpt_dir, s, ckptlib.MARKER_NAME)))
    newest, second, good = committed[-1], committed[-2], committed[-3]
    corrupt_checkpoint_step(ckpt_dir, newest)
    corrupt_checkpoint_step(ckpt_dir, second, how="flip")

    proc = start_cli(RUN + ["--run-dir", run_dir, "--set", f"train.steps={STEPS + 2}"],
                     chain["cache"])
    rc, out, err = finish(proc)
    assert rc == 0, err[-3000:]
    (line,) = [x for x in out.splitlines() if x.startswith("resuming")]
    assert line.startswith(f"resuming from checkpoint step {good} in ")
    assert f"step {newest} (" in line and f"step {second} (" in line
    log = open(os.path.join(run_dir, "logs", "error.log")).read()
    for step in (newest, second):  # the warnings name the steps, in the run's log
        assert f"skipping checkpoint step {step}" in log and f"skipping checkpoint step {step}" not in err
    summary = last_json_line(out)
    assert summary["skipped_checkpoints"] == [newest, second]
    assert summary["final_step"] == STEPS + 2 and summary["resumed_from"] == good
    moved = set(os.listdir(os.path.join(ckpt_dir, "quarantine")))
    assert {f"{second}.0", f"{newest}.0"} <= moved  # moved aside, not deleted


PLAIN_READER = PLAIN_ORBAX_RESTORE + textwrap.dedent(
    """
    train = out["state"]["train"]
    np.save(sys.argv[2], np.asarray(train["params"]["embed"]["wte"]))
    print(json.dumps({"step": step, "state_step": int(train["step"]),
                      "keys": sorted(out["state"]), "config": out["config"],
                      "modules": sorted(m for m in sys.modules if m.startswith("jax_overlap"))}))
    """
)


def test_training_checkpoints_are_readable_by_plain_orbax(chain, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    env["JAX_PLATFORMS"] = "cpu"  # one device: not the topology that saved it
    wte = str(tmp_path / "wte.npy")
    proc = subprocess.run([sys.executable, "-c", PLAIN_READER, chain["ckpt"], wte],
                          capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["modules"] == []
    assert got["step"] == got["state_step"] == STEPS
    assert got["keys"] == ["guard", "rollbacks", "train"]
    assert got["config"]["train"]["steps"] == STEPS and got["config"]["mesh"]["tp"] == 4
    # The bits plain Orbax hands back are the ones our checksum was taken of.
    table = ckptlib.array_checksums({"wte": np.load(wte)})
    expected = marker(chain["ckpt"], STEPS)["checksums"][".train.params['embed']['wte']"]
    assert table["['wte']"]["checksum"] == expected["checksum"]


# ---------------------------------------------------------------------------------------------
# Cross-mesh resume (in-process): save on dp2 x tp4, resume on dp8 and on an interleaved
# pipeline (dp2 x pp2 x tp2, two virtual stages: the staged layer order differs from the
# logical one the checkpoint stores).

XMESH = ["model.layers=4", "train.steps=6", "checkpoint.every_steps=3", "checkpoint.keep=5",
         "checkpoint.async_save=false"]
MESHES = {
    "dp8": ["mesh.dp=8", "mesh.tp=1"],
    "pp2_interleaved": ["mesh.dp=2", "mesh.pp=2", "mesh.tp=2", "pipeline.schedule=interleaved",
                        "pipeline.virtual_stages=2"],
}


@pytest.fixture(scope="module")
def saved_on_dp2_tp4(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("xmesh_save"))
    train.run(config.load(TINY, XMESH), run_dir, progress=False)
    return os.path.join(run_dir, "checkpoints")


@pytest.mark.parametrize("name", [
    "dp8", pytest.param("pp2_interleaved", marks=pytest.mark.slow)])
def test_resume_on_another_mesh_matches_an_uninterrupted_run_there(saved_on_dp2_tp4, tmp_path,
                                                                   name):
    ckpt_dir = str(tmp_path / "ckpt")
    shutil.copytree(saved_on_dp2_tp4, ckpt_dir)
    shutil.rmtree(os.path.join(ckpt_dir, "6"))  # as if the run had stopped at step 3
    overrides = XMESH + MESHES[name]
    resumed = train.run(config.load(TINY, overrides + [f"checkpoint.dir={ckpt_dir}"]),
                        str(tmp_path / "resumed"), progress=False)
    straight = train.run(config.load(TINY, overrides), str(tmp_path / "straight"), progress=False)
    assert resumed.summary()["resumed_from"] == 3 and resumed.steps == 3
    assert straight.steps == 6
    # Steps 4..6 on the new mesh: the same losses, up to the reduction order of steps 1..3.
    assert max(rel(a, b) for a, b in zip(resumed.losses, straight.losses[3:])) <= 1e-4
    assert resumed.losses[-1] < straight.losses[0]
