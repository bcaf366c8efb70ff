"""Two JAX processes x 4 CPU devices (gloo), each one "host" of a dcn=2 mesh: the one-step-late
reduction and Streaming DiLoCo train, and a run killed mid-way resumes bit-exact (its final
checkpoint -- parameters, optimizer and slow-axis state -- equals an uninterrupted run's)."""

import pytest
from helpers import TINY, last_json_line
from test_fault_multiprocess import launch
from test_resume import marker, read_metrics, step_records

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]

MESH = ["mesh.dcn=2", "mesh.dp=2", "mesh.tp=2", "train.steps=8", "checkpoint.every_steps=2",
        "checkpoint.async_save=false", "distributed.timeout_s=60"]
VARIANTS = {
    "delay": ["overlap.dcn_delay=1"],
    "diloco": ["diloco.inner_steps=4", "diloco.fragments=2", "diloco.delay=1",
               "diloco.outer_dtype=int8"],
}


def _args(run_dir, overrides):
    out = ["train", "--config", TINY, "--no-progress", "--run-dir", str(run_dir)]
    for o in overrides:
        out += ["--set", o]
    return out


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("jax_cache_dcn_mp")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_two_hosts_train_and_resume_bit_exact_after_a_kill(tmp_path, jax_cache, variant):
    overrides = MESH + VARIANTS[variant]
    straight_dir, killed_dir = tmp_path / "straight", tmp_path / "killed"
    for d in ("a", "b", "c"):
        (tmp_path / d).mkdir()
    p0, p1 = launch(_args(straight_dir, overrides), tmp_path / "a", jax_cache)
    assert p0.rc == 0 and p1.rc == 0, p0.err[-3000:] + p1.err[-3000:]
    straight = step_records(read_metrics(straight_dir))
    assert len(straight) == 8 and straight[-1]["loss"] < straight[0]["loss"]
    # Both "hosts" are killed after step 5 (the checkpoint of step 4 is committed).
    launch(_args(killed_dir, overrides), tmp_path / "b", jax_cache,
           drills={0: {"kill_at": 5}, 1: {"kill_at": 5}})
    p0, p1 = launch(_args(killed_dir, overrides), tmp_path / "c", jax_cache)
    assert p0.rc == 0 and p1.rc == 0, p0.err[-3000:] + p1.err[-3000:]
    assert last_json_line(p0.out)["resumed_from"] == 4
    resumed = step_records(read_metrics(killed_dir))
    assert [r["loss"] for r in resumed[-4:]] == [r["loss"] for r in straight[-4:]]
    a = marker(str(straight_dir / "checkpoints"), 8)["checksums"]
    b = marker(str(killed_dir / "checkpoints"), 8)["checksums"]
    slow = [k for k in a if k.startswith(".train.slow")]
    assert slow, sorted(a)[:5]  # the in-flight gradient / outer state is checkpointed
    assert {k: v["checksum"] for k, v in a.items()} == {k: v["checksum"] for k, v in b.items()}
