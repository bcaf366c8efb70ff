"""Every user error: exit 2, one line on stderr naming the field or path, no traceback, and the
run dir byte-for-byte as it was (issue 16). Most cases are refused before JAX starts; the
ones that need a trained checkpoint dir share one short run."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from jax_overlap import config
from jax_overlap.resilience import checkpoint as ckptlib
from jax_overlap.resilience.lock import RunDirLock
from tests.helpers import REPO, TINY, corrupt_checkpoint_step, last_json_line, run_cli

TRAIN = ["train", "--config", TINY, "--no-progress"]
SYN = ["--set", "data.source=synthetic"]


def tree_hash(path: str) -> str:
    """Names, sizes and contents of everything under `path` ("absent" if missing)."""
    if not os.path.exists(path):
        return "absent"
    h = hashlib.sha256()
    if os.path.isfile(path):
        h.update(open(path, "rb").read())
        return h.hexdigest()
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(dirs + files):
            full = os.path.join(root, name)
            h.update(os.path.relpath(full, path).encode())
            if os.path.isfile(full):
                h.update(open(full, "rb").read())
    return h.hexdigest()


def assert_user_error(proc, *named: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert len(lines) == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and lines[0].startswith("error: ")
    for word in named:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def _files(tmp):
    paths = {"empty": tmp / "empty.txt", "short": tmp / "short.txt", "dir": tmp / "a_dir",
             "file": tmp / "a_file", "garbage": tmp / "garbage.yaml",
             "empty_cfg": tmp / "empty.yaml"}
    paths["empty"].write_bytes(b"")
    paths["short"].write_bytes(b"0123456789")
    paths["dir"].mkdir()
    paths["file"].write_text("not a directory\n")
    paths["garbage"].write_bytes(bytes(range(256)) * 4)
    paths["empty_cfg"].write_text("# nothing here\n")
    paths["cfg_run"] = tmp / "cfg_run"  # a run dir with config.json and no checkpoint
    paths["cfg_run"].mkdir()
    (paths["cfg_run"] / "config.json").write_text(json.dumps(config.load(TINY).to_dict()))
    return {k: str(v) for k, v in paths.items()}


# (id, argv builder, words the line must name). `f` holds the prepared files, `run` the run dir.
CASES = [
    ("set_invalid_yaml", lambda f, run: TRAIN + ["--run-dir", run, "--set", "train.lr=[1"],
     ["--set train.lr", "YAML"]),
    ("checkpoint_keep_0", lambda f, run: TRAIN + ["--run-dir", run, "--set", "checkpoint.keep=0"],
     ["checkpoint.keep"]),
    ("guard_window_too_small", lambda f, run: TRAIN + ["--run-dir", run, "--set", "guard.window=1"],
     ["guard.window"]),
    ("infinite_lr", lambda f, run: TRAIN + ["--run-dir", run, "--set", "train.lr=.inf"],
     ["train.lr", "finite"]),
    ("nan_float", lambda f, run: TRAIN + ["--run-dir", run, "--set", "train.weight_decay=.nan"],
     ["train.weight_decay", "finite"]),
    ("data_file_empty", lambda f, run: TRAIN + ["--run-dir", run, "--set", "data.source=file",
                                                "--set", f"data.path={f['empty']}"],
     ["data.path", "fewer than one sequence"]),
    ("data_file_short", lambda f, run: TRAIN + ["--run-dir", run, "--set", "data.source=file",
                                                "--set", f"data.path={f['short']}"],
     ["data.path", "model.seq_len"]),
    ("data_path_directory", lambda f, run: TRAIN + ["--run-dir", run, "--set", "data.source=file",
                                                    "--set", f"data.path={f['dir']}"],
     ["data.path", "directory"]),
    ("run_dir_is_a_file", lambda f, run: TRAIN + ["--run-dir", f["file"]],
     ["--run-dir", "is a file"]),
    ("run_dir_under_a_file", lambda f, run: TRAIN + ["--run-dir", f["file"] + "/run"],
     ["--run-dir", "is a file"]),
    ("checkpoint_dir_is_a_file", lambda f, run: TRAIN + [
        "--run-dir", run, "--set", "checkpoint.every_steps=2", "--set", f"checkpoint.dir={f['file']}"],
     ["checkpoint.dir", "is a file"]),
    ("config_is_a_directory", lambda f, run: ["train", "--config", f["dir"], "--run-dir", run],
     ["--config", "directory"]),
    ("config_binary_garbage", lambda f, run: ["train", "--config", f["garbage"], "--run-dir", run],
     ["--config", "not a text file"]),
    ("config_empty", lambda f, run: ["train", "--config", f["empty_cfg"], "--run-dir", run],
     ["--config", "empty", "{}"]),
    ("config_missing", lambda f, run: ["train", "--config", f["dir"] + "/none.yaml", "--run-dir", run],
     ["--config", "not found"]),
    ("negative_checkpoint_interval", lambda f, run: TRAIN + [
        "--run-dir", run, "--set", "checkpoint.every_steps=-1"], ["checkpoint.every_steps"]),
    ("negative_spike_threshold", lambda f, run: TRAIN + [
        "--run-dir", run, "--set", "guard.spike_sigma=-1"], ["guard.spike_sigma"]),
    ("local_tier_without_persistent", lambda f, run: TRAIN + [
        "--run-dir", run, "--set", "checkpoint.local_every=1"], ["checkpoint.local_every"]),
    ("global_batch_impossible", lambda f, run: TRAIN + [
        "--run-dir", run, "--set", "train.global_batch=1000000000000"],
     ["train.global_batch", "GiB"]),
    ("layers_impossible", lambda f, run: TRAIN + ["--run-dir", run, "--set", "model.layers=100000"],
     ["model.layers", "GiB"]),
    ("schedule_unbounded", lambda f, run: ["schedule", "--schedule", "1f1b", "--stages", "2",
                                           "--microbatches", "100000000"],
     ["microbatches", str(1 << 20)]),
    ("tune_unbounded", lambda f, run: ["tune", "--config", TINY, "--devices", "100000000"],
     ["--devices"]),
    ("sample_every_negative", lambda f, run: TRAIN + [
        "--run-dir", run, "--set", "train.sample_every=-1"], ["train.sample_every"]),
    # generate
    ("generate_neither_source", lambda f, run: ["generate", "--prompt", "x"],
     ["--run-dir / --from-hf", "exactly one"]),
    ("generate_both_sources", lambda f, run: ["generate", "--run-dir", f["cfg_run"],
                                              "--from-hf", f["dir"], "--prompt", "x"],
     ["--run-dir / --from-hf", "exactly one"]),
    ("generate_no_run_dir", lambda f, run: ["generate", "--run-dir", f["dir"] + "/none",
                                            "--prompt", "x"], ["--run-dir", "config.json"]),
    ("generate_hf_dir_is_a_file", lambda f, run: ["generate", "--from-hf", f["file"],
                                                  "--prompt", "x"],
     ["--from-hf", "not a directory"]),
    ("generate_no_checkpoint", lambda f, run: ["generate", "--run-dir", f["cfg_run"],
                                               "--prompt", "x"],
     ["--run-dir", "no checkpoints"]),
    ("generate_zero_new_tokens", lambda f, run: ["generate", "--run-dir", f["cfg_run"],
                                                 "--prompt", "x", "--max-new-tokens", "0"],
     ["--max-new-tokens", ">= 1"]),
    ("generate_negative_top_k", lambda f, run: ["generate", "--run-dir", f["cfg_run"],
                                                "--prompt", "x", "--top-k", "-1"],
     ["--top-k", ">= 0"]),
    ("generate_negative_temperature", lambda f, run: [
        "generate", "--run-dir", f["cfg_run"], "--prompt", "x", "--temperature", "-1"],
     ["--temperature"]),
    ("generate_empty_prompt", lambda f, run: ["generate", "--run-dir", f["cfg_run"],
                                              "--prompt", ""], ["--prompt", "empty"]),
    ("generate_prompt_fills_context", lambda f, run: [
        "generate", "--run-dir", f["cfg_run"], "--prompt", "x" * 16],
     ["--prompt", "16 tokens", "model.seq_len = 16"]),
    ("generate_no_room_to_generate", lambda f, run: [
        "generate", "--run-dir", f["cfg_run"], "--prompt", "abc", "--max-new-tokens", "20"],
     ["--max-new-tokens", "at most 13"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_user_error_is_one_line_and_changes_nothing(case, tmp_path):
    _, argv, named = case
    files = _files(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("the user's own file\n")
    before = tree_hash(str(tmp_path))
    proc = run_cli(*argv(files, str(run)), timeout=120)
    assert_user_error(proc, *named)
    assert tree_hash(str(tmp_path)) == before


def test_a_missing_run_dir_stays_missing(tmp_path):
    run = tmp_path / "new" / "run"
    proc = run_cli(*TRAIN, "--run-dir", str(run), "--set", "checkpoint.keep=0", timeout=120)
    assert_user_error(proc, "checkpoint.keep")
    assert not (tmp_path / "new").exists()


def test_read_only_run_dir(tmp_path, monkeypatch, capsys):
    """A read-only filesystem cannot be mounted here (and root may write anywhere), so the
    filesystem's answer is faked; the CLI path is the real one."""
    from jax_overlap import cli
    from jax_overlap.resilience import preflight

    run = tmp_path / "ro" / "run"
    real_access = os.access
    monkeypatch.setattr(preflight.os, "access", lambda p, mode: False if str(p).startswith(
        str(tmp_path)) else real_access(p, mode))

    class RO:
        f_flag = os.ST_RDONLY

    monkeypatch.setattr(preflight.os, "statvfs", lambda p: RO())
    rc = cli.main(["train", "--config", TINY, "--run-dir", str(run)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--run-dir" in err[0] and "read-only" in err[0]
    assert not run.exists()


def test_held_run_dir_is_refused_naming_the_holder(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    holder = RunDirLock(str(run), run_id=1234)
    holder.acquire()
    try:
        before = tree_hash(str(run))
        proc = run_cli(*TRAIN, "--run-dir", str(run), timeout=120)
        line = assert_user_error(proc, "--run-dir", f"pid {os.getpid()}", "run id 1234")
        assert holder.host in line
        assert tree_hash(str(run)) == before
    finally:
        holder.release()
    assert not (run / "LOCK").exists()


# --------------------------------------------------------------------------------------------
# Cases that need JAX and a checkpoint dir: one short trained run, copied per case.

STEPS = 4
CKPT = ["--set", f"train.steps={STEPS}", "--set", "checkpoint.every_steps=2", *SYN]


@pytest.fixture(scope="module")
def concurrent(tmp_path_factory):
    """Run A trains; run B, started on the same run dir once A holds it, is refused."""
    run = str(tmp_path_factory.mktemp("trained") / "run")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)
    a = subprocess.Popen([sys.executable, "-m", "jax_overlap.cli", *TRAIN, "--run-dir", run,
                          *CKPT], cwd=REPO, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not os.path.exists(os.path.join(run, "LOCK")) and a.poll() is None:
        assert time.time() < deadline
        time.sleep(0.05)
    b = run_cli(*TRAIN, "--run-dir", run, *CKPT, timeout=300)
    out, err = a.communicate(timeout=600)
    assert a.returncode == 0, err[-3000:]
    return {"run": run, "a_pid": a.pid, "b": b, "a_out": out}


@pytest.fixture(scope="module")
def trained(concurrent):
    return concurrent["run"]


def test_second_training_on_a_held_run_dir_is_refused(concurrent):
    line = assert_user_error(concurrent["b"], "--run-dir", f"pid {concurrent['a_pid']}",
                             "started")
    assert "another training holds it" in line
    records = [json.loads(x) for x in open(os.path.join(concurrent["run"], "metrics.jsonl"))]
    assert [r["step"] for r in records if "event" not in r] == list(range(1, STEPS + 1))
    assert last_json_line(concurrent["a_out"])["final_step"] == STEPS
    assert not os.path.exists(os.path.join(concurrent["run"], "LOCK"))  # released at the end


def _corrupt_all(run: str) -> list[int]:
    ckpt = os.path.join(run, "checkpoints")
    steps = sorted(int(s) for s in os.listdir(ckpt) if s.isdigit())
    for step in steps:
        corrupt_checkpoint_step(ckpt, step)
    return steps


def test_no_checkpoint_verifies_is_refused_unchanged(trained, tmp_path):
    run = str(tmp_path / "run")
    shutil.copytree(trained, run)
    steps = _corrupt_all(run)
    before = tree_hash(run)
    proc = run_cli(*TRAIN, "--run-dir", run, *CKPT, timeout=600)
    assert_user_error(proc, "checkpoint.on_unreadable=restart", "--run-dir",
                      f"none of the {len(steps)} committed checkpoints")
    assert tree_hash(run) == before  # nothing quarantined, config.json and metrics untouched
    # (the one line above also shows that TensorStore's "Exception ignored" flood of the
    # truncated files went to the log, not the terminal)


@pytest.mark.slow
def test_every_checkpoint_corrupt_restarts_on_purpose_and_lists_them(trained, tmp_path):
    run = str(tmp_path / "run")
    shutil.copytree(trained, run)
    steps = _corrupt_all(run)
    proc = run_cli(*TRAIN, "--run-dir", run, *CKPT, "--set", "checkpoint.on_unreadable=restart",
                   timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The TensorStore "Exception ignored" flood of the truncated files went to the log.
    assert len(proc.stderr.strip().splitlines()) <= 2, proc.stderr[-3000:]
    summary = last_json_line(proc.stdout)
    assert summary["resumed_from"] is None and summary["final_step"] == STEPS
    assert sorted(summary["skipped_checkpoints"]) == steps
    assert all(r["reason"] for r in summary["skipped_checkpoint_reasons"])
    records = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    (restart,) = [r for r in records if r.get("event") == "restart"]
    assert sorted(s for s, _ in restart["skipped"]) == steps
    assert os.path.isdir(os.path.join(run, "checkpoints", ckptlib.QUARANTINE_DIR))


def test_refused_resume_leaves_config_json(trained, tmp_path):
    run = str(tmp_path / "run")
    shutil.copytree(trained, run)
    before = tree_hash(run)
    proc = run_cli(*TRAIN, "--run-dir", run, *CKPT, "--set", "model.d_ff=128", timeout=600)
    assert_user_error(proc, "--run-dir", "holds another run", "model.d_ff 64 -> 128")
    assert tree_hash(run) == before


def test_checkpoint_dir_of_another_model_is_refused(trained, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(trained, "checkpoints"), ckpt)
    before = tree_hash(ckpt)
    proc = run_cli(*TRAIN, "--run-dir", str(tmp_path / "run"), *CKPT, "--set",
                   f"checkpoint.dir={ckpt}", "--set", "model.d_ff=128", timeout=600)
    assert_user_error(proc, "checkpoint.dir")
    assert tree_hash(ckpt) == before and not os.path.exists(tmp_path / "run")


def test_fresh_start_over_an_earlier_runs_metrics_is_refused(trained, tmp_path):
    """A run dir whose run left metrics but no checkpoint: a new start would append a second
    step 1 to them."""
    run = str(tmp_path / "run")
    shutil.copytree(trained, run)
    shutil.rmtree(os.path.join(run, "checkpoints"))
    before = tree_hash(run)
    proc = run_cli(*TRAIN, "--run-dir", run, *CKPT, timeout=600)
    assert_user_error(proc, "--run-dir", "no checkpoint to resume from", "fresh --run-dir")
    assert tree_hash(run) == before


@pytest.mark.slow
def test_disk_full_during_async_save_then_resume(tmp_path):
    run = str(tmp_path / "run")
    args = [*TRAIN, "--run-dir", run, "--set", "train.steps=6", "--set",
            "checkpoint.every_steps=2", *SYN]
    proc = run_cli(*args, "--set", "fault.disk_full_at_step=4", timeout=600)
    line = assert_user_error(proc, "no space left on device", "checkpoint.dir")
    assert os.path.join("checkpoints", "4") in line
    ckpt = os.path.join(run, "checkpoints")
    assert os.path.exists(os.path.join(ckpt, "2", ckptlib.MARKER_NAME))  # last good intact
    assert not os.path.exists(os.path.join(ckpt, "4", ckptlib.MARKER_NAME))
    proc = run_cli(*args, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = last_json_line(proc.stdout)
    assert summary["resumed_from"] == 2 and summary["final_step"] == 6


def test_a_bug_is_one_line_naming_the_traceback_file(monkeypatch, capsys):
    """Not a user error: exit 1, one line, the traceback in a file (the run's log for train)."""
    from jax_overlap import cli

    def broken(args):
        raise RuntimeError("something inside broke\nsecond line")

    monkeypatch.setitem(cli.COMMANDS, "schedule", broken)
    rc = cli.main(["schedule", "--schedule", "1f1b", "--stages", "2", "--microbatches", "4"])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and "internal error, RuntimeError: something inside broke" in line
    path = line.rsplit("(traceback in ", 1)[1].rstrip(")")
    text = open(path).read()
    os.remove(path)
    assert "Traceback" in text and "second line" in text


# --------------------------------------------------------------------------------------------
# Data, tokenizers and Hugging Face files (issue 28): in-process through `cli.main` (no JAX
# computation happens before any of these refusals), so many cases stay cheap.


def _data_files(tmp) -> dict[str, str]:
    import numpy as np
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models

    from jax_overlap import config
    from jax_overlap.data import prepare
    from jax_overlap.hf import layouts

    f = {k: str(tmp / k) for k in ("text", "a_file", "empty_dir", "small_tok.json")}
    (tmp / "text").write_text("def f(x):\n    return x + 1\n" * 40)
    (tmp / "a_file").write_text("not a directory\n")
    (tmp / "empty_dir").mkdir()
    Tokenizer(models.WordLevel({str(i): i for i in range(10)}, unk_token="0")).save(
        f["small_tok.json"])
    hf_cfg = layouts.hf_config(config.load(TINY, ["model.kind=llama"]).model)
    for name in ("hf_trunc", "hf_garbage", "hf_badindex"):
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text(json.dumps(hf_cfg))
        f[name] = str(tmp / name)
    save_file({"model.embed_tokens.weight": np.ones((256, 32), np.float32)},
              f["hf_trunc"] + "/model.safetensors")
    os.truncate(f["hf_trunc"] + "/model.safetensors", 5000)
    (tmp / "hf_garbage" / "model.safetensors").write_bytes(bytes(range(256)) * 8)
    (tmp / "hf_badindex" / "model.safetensors.index.json").write_text("{not json")
    for name, vocab in (("shards", 0), ("bpe_shards", 300)):
        f[name] = str(tmp / name)
        prepare.prepare(["stdlib"], f[name], train_vocab=vocab, max_bytes=20_000,
                        val_fraction=0.1, progress=False)
    for name in ("shards_trunc", "shards_lie", "shards_missing"):
        shutil.copytree(f["shards"], tmp / name)
        f[name] = str(tmp / name)
    os.truncate(f["shards_trunc"] + "/shard_00000.bin", 1000)
    index = json.load(open(f["shards_lie"] + "/index.json"))
    index["split"]["val_tokens"] += 10_000
    json.dump(index, open(f["shards_lie"] + "/index.json", "w"))
    os.remove(f["shards_missing"] + "/shard_00000.bin")
    (tmp / "fake_run").mkdir()
    (tmp / "fake_run" / "config.json").write_text(json.dumps(config.load(TINY).to_dict()))
    f["fake_run"] = str(tmp / "fake_run")
    return f


def _tokens(path):
    return ["--set", "data.source=tokens", "--set", f"data.path={path}"]


DATA_CASES = [
    # corrupt or truncated safetensors
    ("from_hf_truncated_safetensors", lambda f, new: [
        "convert", "--from-hf", f["hf_trunc"], "--out", new], ["--from-hf", "safetensors"]),
    ("from_hf_garbage_safetensors", lambda f, new: [
        "convert", "--from-hf", f["hf_garbage"], "--out", new], ["--from-hf", "safetensors"]),
    ("from_hf_index_not_json", lambda f, new: [
        "convert", "--from-hf", f["hf_badindex"], "--out", new], ["--from-hf", "index"]),
    ("evaluate_truncated_safetensors", lambda f, new: [
        "evaluate", "--from-hf", f["hf_trunc"], "--data", f["text"]],
     ["--from-hf", "truncated"]),
    # corrupt or truncated shards, an index that lies
    ("train_truncated_shard", lambda f, new: TRAIN + ["--run-dir", new, *_tokens(
        f["shards_trunc"])], ["data.path", "shard_00000.bin", "prepare-data"]),
    ("train_missing_shard", lambda f, new: TRAIN + ["--run-dir", new, *_tokens(
        f["shards_missing"])], ["data.path", "missing"]),
    ("train_index_lies_about_split", lambda f, new: TRAIN + ["--run-dir", new, *_tokens(
        f["shards_lie"])], ["data.path", "split"]),
    ("evaluate_truncated_shard", lambda f, new: [
        "evaluate", "--from-hf", f["hf_trunc"], "--data", f["shards_trunc"]],
     ["--data", "shard_00000.bin"]),
    ("evaluate_dir_without_index", lambda f, new: [
        "evaluate", "--from-hf", f["hf_trunc"], "--data", f["empty_dir"]],
     ["--data", "index.json"]),
    ("evaluate_shards_of_another_tokenizer", lambda f, new: [
        "evaluate", "--from-hf", f["hf_trunc"], "--data", f["bpe_shards"]],
     ["--data", "another tokenizer"]),
    ("evaluate_missing_run", lambda f, new: [
        "evaluate", "--run-dir", new, "--data", f["text"]], ["--run-dir", "config.json"]),
    # a file where a directory goes
    ("to_hf_out_is_a_file", lambda f, new: [
        "convert", "--to-hf", f["fake_run"], "--out", f["a_file"]], ["--out", "not a directory"]),
    ("from_hf_out_is_a_file", lambda f, new: [
        "convert", "--from-hf", f["hf_trunc"], "--out", f["a_file"]], ["--out", "not a directory"]),
    ("prepare_out_is_a_file", lambda f, new: [
        "prepare-data", "--input", f["text"], "--out", f["a_file"]], ["--out", "not a directory"]),
    ("tune_out_under_a_file", lambda f, new: [
        "tune", "--config", TINY, "--devices", "8", "--out", f["a_file"] + "/tuned.yaml"],
     ["a_file", "directory"]),
    ("tune_out_is_a_directory", lambda f, new: [
        "tune", "--config", TINY, "--devices", "8", "--out", f["empty_dir"]],
     ["empty_dir", "is a directory"]),
    # negative or zero sizes
    ("shard_mb_negative", lambda f, new: [
        "convert", "--to-hf", f["fake_run"], "--out", new, "--shard-mb", "-1"], ["--shard-mb"]),
    ("shard_mb_zero", lambda f, new: [
        "convert", "--to-hf", f["fake_run"], "--out", new, "--shard-mb", "0"], ["--shard-mb"]),
    ("max_bytes_negative", lambda f, new: [
        "prepare-data", "--input", f["text"], "--out", new, "--max-bytes", "-1"], ["--max-bytes"]),
    ("max_bytes_zero", lambda f, new: [
        "prepare-data", "--input", f["text"], "--out", new, "--max-bytes", "0"], ["--max-bytes"]),
    ("train_tokenizer_zero", lambda f, new: [
        "prepare-data", "--input", f["text"], "--out", new, "--train-tokenizer", "0"],
     ["--train-tokenizer"]),
    ("train_tokenizer_below_bytes", lambda f, new: [
        "prepare-data", "--input", f["text"], "--out", new, "--train-tokenizer", "100"],
     ["--train-tokenizer", "257"]),
    # tokenizer vocabularies that do not fit
    ("tokenizer_smaller_than_bytes", lambda f, new: [
        "prepare-data", "--input", f["text"], "--out", new, "--tokenizer", f["small_tok.json"]],
     ["--tokenizer", "256"]),
    ("tokenizer_not_json", lambda f, new: [
        "prepare-data", "--input", f["text"], "--out", new, "--tokenizer", f["text"]],
     ["--tokenizer", "tokenizer.json"]),
    # careless inputs
    ("prepare_no_such_input", lambda f, new: [
        "prepare-data", "--input", new + "/nothing.txt", "--out", new], ["--input"]),
    ("prepare_val_fraction_one", lambda f, new: [
        "prepare-data", "--input", f["text"], "--out", new, "--val-fraction", "1"],
     ["--val-fraction"]),
    ("convert_both_directions", lambda f, new: [
        "convert", "--from-hf", f["hf_trunc"], "--to-hf", f["fake_run"], "--out", new],
     ["--to-hf", "--from-hf"]),
    ("convert_from_a_file", lambda f, new: [
        "convert", "--from-hf", f["text"], "--out", new], ["--from-hf", "not a directory"]),
    ("evaluate_without_data", lambda f, new: [
        "evaluate", "--from-hf", f["hf_trunc"]], ["--data"]),
    ("schedule_stages_not_a_number", lambda f, new: [
        "schedule", "--schedule", "1f1b", "--stages", "two", "--microbatches", "4"],
     ["--stages"]),
    ("schedule_no_stages", lambda f, new: [
        "schedule", "--schedule", "1f1b", "--stages", "0", "--microbatches", "4"],
     ["stages"]),
    ("tune_measure_negative", lambda f, new: [
        "tune", "--config", TINY, "--devices", "8", "--measure", "-1"], ["--measure"]),
]


@pytest.mark.parametrize("case", DATA_CASES, ids=[c[0] for c in DATA_CASES])
def test_data_and_hf_user_error_is_one_line_and_changes_nothing(case, tmp_path_factory,
                                                                 capsys):
    from jax_overlap import cli

    _, argv, named = case
    root = tmp_path_factory.mktemp("data_errors")
    files = _data_files(root)
    new = str(root / "new")
    before = tree_hash(str(root))
    capsys.readouterr()
    try:
        rc = cli.main(argv(files, new))
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), (rc, err)
    for word in named:
        assert word in err[0], (word, err[0])
    assert tree_hash(str(root)) == before
