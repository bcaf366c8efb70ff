"""configs/default.yaml, what `make train` runs, is safe by default (issue 27): it checkpoints,
so a run resumes (on another mesh too) and never shares its run dir with another run, and
`--set mesh.pp=4` or `--set pipeline.schedule=zb-v` alone give a valid plan."""

from __future__ import annotations

import json
import os

import pytest
from helpers import REPO, last_json_line, run_cli
from test_user_errors import assert_user_error, tree_hash

from jax_overlap import config
from jax_overlap.resilience import checkpoint as ckptlib
from jax_overlap.training.assemble import plan_for

DEFAULT = os.path.join(REPO, "configs", "default.yaml")
# default.yaml as `make train` runs it, for a few short steps on less of the corpus.
SHORT = ["--set", "train.eval_every=0", "--set", "data.max_bytes=400000",
         "--set", "train.global_batch=8", "--set", "model.seq_len=32"]


def train(run_dir, *overrides, steps):
    return run_cli("train", "--config", DEFAULT, "--run-dir", run_dir, "--no-progress", *SHORT,
                   "--set", f"train.steps={steps}", *overrides, timeout=600)


def records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """default.yaml for 3 steps (dp2 x tp4), then 4 steps on dp4 x tp2 in the same run dir."""
    run = str(tmp_path_factory.mktemp("default") / "run")
    first = train(run, steps=3)
    committed = sorted(int(s) for s in os.listdir(os.path.join(run, "checkpoints"))
                       if os.path.exists(os.path.join(run, "checkpoints", s,
                                                      ckptlib.MARKER_NAME)))
    second = train(run, "--set", "mesh.dp=4", "--set", "mesh.tp=2", steps=4)
    return {"run": run, "first": first, "committed": committed, "second": second}


def test_default_yaml_writes_a_committed_checkpoint(resumed):
    assert resumed["first"].returncode == 0, resumed["first"].stderr[-3000:]
    assert config.load(DEFAULT).checkpoint.every_steps > 0
    assert last_json_line(resumed["first"].stdout)["last_checkpoint"] == 3
    assert resumed["committed"] == [3]


def test_another_mesh_in_the_same_run_dir_resumes_without_mixing_metrics(resumed):
    assert resumed["second"].returncode == 0, resumed["second"].stderr[-3000:]
    summary = last_json_line(resumed["second"].stdout)
    assert summary["resumed_from"] == 3 and summary["final_step"] == 4
    assert summary["mesh"] == {"dp": 4, "pp": 1, "tp": 2}
    recs = records(resumed["run"])
    assert [r["step"] for r in recs if "event" not in r] == [1, 2, 3, 4]  # one run, no repeat
    assert [r["event"] for r in recs if "event" in r] == ["resume"]
    saved = json.load(open(os.path.join(resumed["run"], "config.json")))
    assert (saved["mesh"]["dp"], saved["mesh"]["tp"]) == (4, 2)


@pytest.mark.parametrize("override,named", [
    ("train.seed=1", "train.seed 0 -> 1"),
    ("model.layers=2", "model.layers 4 -> 2"),
    ("data.source=synthetic", "data.source 'stdlib' -> 'synthetic'"),
])
def test_another_run_in_the_run_dir_is_refused_unchanged(resumed, override, named):
    before = tree_hash(resumed["run"])
    proc = train(resumed["run"], "--set", override, steps=4)
    line = assert_user_error(proc, "--run-dir", resumed["run"], named, "fresh --run-dir")
    assert "RUN=" in line  # names the make variable too
    assert tree_hash(resumed["run"]) == before


def test_pp4_alone_plans_from_default_yaml():
    cfg = config.load(DEFAULT, ["mesh.pp=4"])
    plan = plan_for(cfg)
    assert plan.pp == 4 and plan.microbatches >= 4  # auto: enough to fill the pipeline
    assert cfg.pipeline.virtual_stages == 1


@pytest.mark.parametrize("pp,virtual", [(1, 1), (2, 2)])
def test_zbv_alone_takes_two_chunks_per_stage(pp, virtual):
    cfg = config.load(DEFAULT, ["pipeline.schedule=zb-v", f"mesh.pp={pp}"])
    assert cfg.pipeline.virtual_stages == virtual
    plan = plan_for(cfg)
    assert plan.num_virtual_stages == pp * virtual
    if pp > 1:
        assert plan.schedule.name == "zb-v"


def test_virtual_stages_auto_follows_the_schedule_and_explicit_wins():
    assert config.load(DEFAULT, ["mesh.pp=2", "pipeline.schedule=interleaved"]
                       ).pipeline.virtual_stages == 2
    assert config.load(DEFAULT, ["mesh.pp=2", "pipeline.schedule=interleaved",
                                 "pipeline.virtual_stages=4", "model.layers=8"]
                       ).pipeline.virtual_stages == 4
    with pytest.raises(config.ConfigError, match="pipeline.virtual_stages"):
        config.load(DEFAULT, ["mesh.pp=2", "pipeline.schedule=zb-v",
                              "pipeline.virtual_stages=1"])


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [["--set", "mesh.pp=4"],
                                       ["--set", "pipeline.schedule=zb-v"],
                                       ["--set", "mesh.pp=2", "--set", "pipeline.schedule=zb-v"]])
def test_pipeline_overrides_alone_train_from_default_yaml(tmp_path, overrides):
    proc = train(str(tmp_path / "run"), *overrides, steps=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = last_json_line(proc.stdout)
    assert summary["final_step"] == 2 and summary["last_loss"] < summary["first_loss"] + 0.5


def test_tune_on_default_yaml_exits_0_shows_progress_and_writes_nothing_unasked():
    """FLOP costs for 8 H100s (no calibration: seconds); the calibrated sweep of every shipped
    config is the slow test below."""
    unasked = os.path.join(REPO, "runs", "tuned.yaml")  # where tune used to write
    there = os.path.exists(unasked) and os.path.getmtime(unasked)
    proc = run_cli("tune", "--config", DEFAULT, "--devices", "8", "--hardware", "h100_8x_nvlink")
    assert proc.returncode == 0, proc.stderr[-3000:]
    best = [line for line in proc.stdout.splitlines() if line.startswith("best: ")]
    assert len(best) == 1 and "--out FILE writes its config" in best[0]
    assert "plans: " in proc.stderr and "plan/s]" in proc.stderr  # a bar over the candidates
    assert (os.path.exists(unasked) and os.path.getmtime(unasked)) == there


SHIPPED = sorted(name for name in os.listdir(os.path.join(REPO, "configs"))
                 if name.endswith(".yaml"))


@pytest.mark.slow
@pytest.mark.parametrize("name", SHIPPED)
def test_tune_runs_on_every_shipped_config_that_fits_8_devices(name):
    """`tune` (calibrated on this machine's forced devices) exits 0, shows progress on stderr
    and writes nothing unasked; minutes per config."""
    path = os.path.join(REPO, "configs", name)
    if config.load(path).num_devices > 8:
        pytest.skip(f"{name} needs more than 8 devices")
    unasked = os.path.join(REPO, "runs", "tuned.yaml")  # where tune used to write
    there = os.path.exists(unasked) and os.path.getmtime(unasked)
    proc = run_cli("tune", "--config", path, "--devices", "8", timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "best: " in proc.stdout and "plans: " in proc.stderr  # the progress bar
    # Calibrated here, or priced by FLOPs with the reason (a large model, a ResNet).
    skipped = "tune: FLOP costs, no calibration: " in proc.stderr
    assert skipped != ("calibrate: " in proc.stderr)
    assert ("(flops costs)" if skipped else "(calibrated costs)") in proc.stdout
    assert (os.path.exists(unasked) and os.path.getmtime(unasked)) == there
