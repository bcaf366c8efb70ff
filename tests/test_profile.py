"""`jax-overlap profile`: a real traced train step, through the CLI and in process."""

import json

import pytest
from helpers import TINY, run_cli

from jax_overlap import config
from jax_overlap.analysis.profile import format_summary, profile_config

KEYS = ("step_time_s", "compute_s", "comm_s", "overlap_s", "idle_s", "exposed_comm_s", "ccor",
        "bubble_rate", "devices", "steps", "synchronous_collectives", "logdir", "mesh")


def test_profile_cli_json(tmp_path):
    out = run_cli("profile", "--config", TINY, "--steps", "2", "--json", "--logdir",
                  str(tmp_path))
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    for key in KEYS:
        assert key in doc, key
    assert doc["steps"] == 2
    assert doc["mesh"] == {"dp": 2, "pp": 1, "tp": 4}
    assert len(doc["devices"]) == 8
    assert doc["synchronous_collectives"] is True  # CPU backend
    assert doc["compute_s"] > 0 and doc["comm_s"] > 0
    # Every instant of the step is compute, communication or idle; on CPU the two hardly
    # overlap, so their sum is the step time.
    for d in [doc, *doc["devices"].values()]:
        parts = d["compute_s"] + d["comm_s"] + d["idle_s"]
        assert parts == pytest.approx(d["step_time_s"], rel=0.05)
        assert d["ccor"] == pytest.approx(d["overlap_s"] / (d["compute_s"] + d["comm_s"]))
    assert list(tmp_path.glob("plugins/profile/*/*.xplane.pb"))  # trace left for XProf
    (perfetto,) = tmp_path.glob("plugins/profile/*/*perfetto_trace.json.gz")  # and Perfetto
    assert doc["trace_files"]["perfetto"] == str(perfetto)
    assert doc["trace_files"]["xplane"].endswith(".xplane.pb")


def test_profile_summary_text(tmp_path):
    cfg = config.load(TINY, ["mesh.dp=1", "mesh.tp=2", "train.global_batch=4"])
    import jax

    result = profile_config(cfg, steps=2, logdir=str(tmp_path), devices=jax.devices()[:2])
    text = format_summary(result)
    assert "CPU:0" in text and "CPU:1" in text and "overall (mean)" in text
    assert "synchronous" in text and "overlap 0" in text  # why CPU CCOR is 0
    m = result.metrics
    assert m.steps == 2 and len(m.devices) == 2
    assert f"{m.step_time_s * 1e3:.3f}" in text
    assert f"open: tensorboard --logdir {result.logdir}" in text
    assert "open: https://ui.perfetto.dev" in text and "perfetto_trace.json.gz" in text


def test_profile_rejects_zero_steps():
    with pytest.raises(ValueError, match="--steps"):
        from jax_overlap.analysis.profile import profile_command

        profile_command(config.load(TINY), steps=0)
