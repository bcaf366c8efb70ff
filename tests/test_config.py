"""Config loading and validation: one clear line per problem, exit code 2, no traceback."""

import pytest
from helpers import TINY, last_json_line, rel, run_cli

from jax_overlap import config
from jax_overlap.config import ConfigError


def _problems(overrides, path=TINY):
    with pytest.raises(ConfigError) as err:
        config.load(path, overrides)
    return err.value.problems


def test_tiny_loads_with_types():
    cfg = config.load(TINY, ["train.lr=1e-3", "mesh.dp=8", "mesh.tp=1"])
    assert cfg.train.lr == 1e-3 and isinstance(cfg.train.lr, float)
    assert cfg.num_devices == 8
    assert cfg.train.global_batch % (8 * cfg.pipeline.microbatches) == 0


@pytest.mark.parametrize("overrides,field,fix", [
    (["model.heads=3", "model.d_model=48"], "model.heads", "multiple of 4"),
    (["model.d_ff=66"], "model.d_ff", "multiple of 4"),
    (["model.vocab=258"], "model.vocab", "multiple of 4"),
    (["train.global_batch=10"], "train.global_batch", "multiple of 4"),
    (["model.lyers=3"], "model.lyers", "did you mean 'model.layers'"),
    (["train.steps=ten"], "train.steps", "expected int"),
    (["train.precision=fp8"], "train.precision", "is not one of"),
    (["train.optimizer=adam"], "train.optimizer", "did you mean 'adamw'"),
    (["model.layers=3", "mesh.pp=2", "mesh.dp=1", "pipeline.stage_layers=even"],
     "model.layers", "multiple of 2"),
    (["pipeline.transfer_latency=3"], "pipeline.transfer_latency", "must be 1 or 2"),
    (["mesh.pp=2", "mesh.dp=1", "model.layers=4", "pipeline.schedule=interleaved",
      "pipeline.virtual_stages=2", "pipeline.microbatches=2", "pipeline.transfer_latency=2"],
     "pipeline.microbatches", "use 4"),
    (["pipeline.vocab_parallel=true"], "pipeline.vocab_parallel", "needs mesh.pp > 1"),
    (["mesh.pp=4", "mesh.dp=1", "model.layers=4", "model.vocab=260",
      "pipeline.vocab_parallel=true"], "pipeline.vocab_parallel", "multiple of 16 (e.g. 272)"),
])
def test_each_rule_names_field_and_fix(overrides, field, fix):
    problems = _problems(overrides)
    assert any(p.startswith(field) and fix in p for p in problems), problems


def test_every_problem_is_reported_at_once():
    problems = _problems(["model.d_ff=66", "model.vocab=258"])
    assert len(problems) == 2


def test_missing_file():
    problems = _problems([], path="configs/nope.yaml")
    assert "file not found" in problems[0] and "configs/nope.yaml" in problems[0]


def test_mesh_must_match_device_count():
    cfg = config.load(TINY)
    with pytest.raises(ConfigError) as err:
        config.check_device_count(cfg, 4)
    assert err.value.problems[0].startswith("mesh:") and "4 devices" in err.value.problems[0]


@pytest.mark.parametrize("args,field", [
    (["--set", "model.heads=3", "--set", "model.d_model=48"], "model.heads"),
    (["--set", "mesh.dpp=2"], "mesh.dpp"),
    (["--set", "train.steps=ten"], "train.steps"),
    (["--config", "configs/missing.yaml"], "configs/missing.yaml"),
])
def test_cli_user_errors_exit_2_without_traceback(args, field):
    base = ["train"] + ([] if "--config" in args else ["--config", TINY])
    proc = run_cli(*base, *args, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert field in proc.stderr
    assert proc.stderr.startswith("error: ")


def test_cli_device_count_mismatch_exit_2():
    # The CLI forces as many host devices as the mesh needs, so a mismatch needs an explicit
    # smaller device budget.
    proc = run_cli("train", "--config", TINY, timeout=120,
                   env_extra={"XLA_FLAGS": "--xla_force_host_platform_device_count=4",
                              "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "mesh:" in proc.stderr


def test_cli_same_seed_same_losses_whatever_the_mesh(tmp_path):
    runs = []
    for mesh in (["mesh.dp=2", "mesh.tp=4"], ["mesh.dp=8", "mesh.tp=1"]):
        proc = run_cli("train", "--config", TINY, "--no-progress", "--run-dir",
                       str(tmp_path / "_".join(mesh)), *sum((["--set", m] for m in mesh), []),
                       "--set", "train.seed=3")
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(last_json_line(proc.stdout))
    a, b = runs
    assert a["steps"] == b["steps"] == 4
    assert rel(a["first_loss"], b["first_loss"]) <= 1e-5
    assert rel(a["last_loss"], b["last_loss"]) <= 1e-4
    lines = (tmp_path / "mesh.dp=2_mesh.tp=4" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4
    import json
    rec = json.loads(lines[-1])
    assert {"step", "loss", "grad_norm", "lr", "step_time_s", "tokens_per_s"} <= set(rec)
