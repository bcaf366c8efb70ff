"""The tokenizer travels with the run and its export (issue 28): prepare-data with a BPE ->
train a tiny Llama on the shards -> evaluate (the held-out split and a text file, with the
run's tokenizer) -> convert --to-hf -> our own loader of the export scores the same text the
same way. Without transformers (tests/test_hf_transformers.py checks the export with it)."""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import pytest
from helpers import TINY, rel

from jax_overlap import config
from jax_overlap.config import ConfigError
from jax_overlap.data import prepare
from jax_overlap.data import tokenizer as toklib

VOCAB = 320
LLAMA = ["model.kind=llama", "model.kv_heads=2", "model.tied_embeddings=false",
         "model.vocab=auto", "mesh.dp=1", "mesh.tp=2", "pipeline.microbatches=1"]


def text_file(tmp_path) -> str:
    """Held-out text: a stdlib file past the corpus the tokenizer and the model saw."""
    from jax_overlap.data.streams import stdlib_files

    path = tmp_path / "held_out.txt"
    big = next(p for p in stdlib_files()[40:] if os.path.getsize(p) > 4000)
    path.write_bytes(open(big, "rb").read()[:4000])
    return str(path)


@pytest.fixture(scope="module", autouse=True)
def first_devices():
    """In this process (8 forced devices) a mesh takes the first devices it needs, as the
    CLI's process would have exactly them."""
    import jax

    from jax_overlap.training import assemble

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(assemble, "job_devices", lambda cfg: jax.devices()[:cfg.num_devices])
        yield


@pytest.fixture(scope="module")
def trained(tmp_path_factory, first_devices):
    """A BPE shard directory and a tiny Llama trained 3 steps on it (held-out eval at step
    3 over exactly the split's windows: global_batch = their number)."""
    from jax_overlap.training import loop

    root = tmp_path_factory.mktemp("tokrun")
    shards = str(root / "shards")
    result = prepare.prepare(["stdlib"], shards, train_vocab=VOCAB, val_fraction=0.03,
                             max_bytes=40_000, progress=False)
    windows = (result.index["split"]["val_tokens"] - 1) // 16
    assert windows >= 8
    run = str(root / "run")
    over = ["data.source=tokens", f"data.path={shards}", *LLAMA, "train.steps=3",
            "train.eval_every=3", "train.eval_batches=1", f"train.global_batch={windows}",
            "checkpoint.every_steps=3", "checkpoint.async_save=false", "train.lr=0.01"]
    summary = loop.run(config.load(TINY, over), run, progress=False).summary()
    return {"root": root, "shards": shards, "run": run, "summary": summary, "over": over,
            "index": result.index, "windows": windows}


def test_the_run_records_and_keeps_its_tokenizer(trained):
    saved = json.load(open(os.path.join(trained["run"], "config.json")))["data"]
    sha = trained["index"]["tokenizer"]["sha256"]
    assert saved["tokenizer_kind"] == "tokenizers" and saved["tokenizer_sha256"] == sha
    assert saved["tokenizer"] == os.path.join(trained["shards"], "tokenizer.json")
    assert toklib.file_sha256(os.path.join(trained["run"], "tokenizer.json")) == sha


def test_evaluate_scores_the_held_out_split_as_training_did(trained):
    from jax_overlap.training import scoring

    out = scoring.evaluate_command(trained["run"], None, trained["shards"])
    assert out["split"] == "val" and out["step"] == 3
    assert out["tokenizer"]["sha256"] == trained["index"]["tokenizer"]["sha256"]
    assert out["windows"] == trained["windows"] and out["tokens"] == trained["windows"] * 16
    assert rel(out["loss"], trained["summary"]["eval_loss"]) <= 1e-5


def test_text_is_scored_with_the_run_tokenizer_and_the_export_agrees(trained, tmp_path):
    from jax_overlap.training import hf_runs, scoring

    data = text_file(tmp_path)
    tok = toklib.load(os.path.join(trained["shards"], "tokenizer.json"))
    ids = tok.encode(open(data, "rb").read())
    assert len(ids) < 0.8 * os.path.getsize(data)  # BPE, not one token per byte
    ours = scoring.evaluate_command(trained["run"], None, data)
    assert ours["windows"] == len(ids) // 17 and ours["tokens"] == ours["windows"] * 16
    assert ours["tokenizer"]["kind"] == "tokenizers" and ours["tokenizer"]["vocab_size"] == VOCAB
    assert ours["loss"] < np.log(VOCAB)

    export = str(tmp_path / "export")
    out = hf_runs.to_hf(trained["run"], export)
    names = set(os.listdir(export))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    for name in names:
        assert stat.S_IMODE(os.stat(os.path.join(export, name)).st_mode) == 0o644, name
    assert out["tokenizer"] == "tokenizers"
    tc = json.load(open(os.path.join(export, "tokenizer_config.json")))
    assert tc["model_max_length"] == 16 and tc["tokenizer_class"] == "PreTrainedTokenizerFast"
    theirs = scoring.evaluate_command(None, export, data)
    assert theirs["tokenizer"]["sha256"] == ours["tokenizer"]["sha256"]
    assert theirs["windows"] == ours["windows"]
    assert rel(theirs["loss"], ours["loss"]) <= 1e-4


def test_a_resume_on_other_tokens_is_refused(trained, tmp_path):
    import shutil

    from jax_overlap.training import loop

    run = str(tmp_path / "run")
    shutil.copytree(trained["run"], run)
    before = open(os.path.join(run, "config.json")).read()
    other = str(tmp_path / "bytes")
    prepare.prepare(["stdlib"], other, val_fraction=0.03, max_bytes=40_000, progress=False)
    over = [o for o in trained["over"] if not o.startswith("data.path")] + [
        f"data.path={other}", "train.steps=6"]
    with pytest.raises(ConfigError) as e:
        loop.run(config.load(TINY, over), run, progress=False)
    (line,) = e.value.problems
    # Other shards (and with them another tokenizer and vocabulary) make another run.
    assert line.startswith(f"--run-dir {run}: holds another run") and "data.path" in line
    assert open(os.path.join(run, "config.json")).read() == before


def test_from_hf_brings_the_tokenizer_into_the_run(trained, tmp_path):
    from jax_overlap.training import hf_runs

    export = str(tmp_path / "export")
    hf_runs.to_hf(trained["run"], export)
    run = str(tmp_path / "from_hf")
    out = hf_runs.from_hf(export, run)
    assert out["tokenizer"] == "tokenizers"
    cfg = config.load(os.path.join(run, "config.json"))
    assert cfg.data.tokenizer == os.path.join(run, "tokenizer.json")
    assert cfg.data.tokenizer_sha256 == trained["index"]["tokenizer"]["sha256"]
    assert os.path.isfile(os.path.join(run, "tokenizer_config.json"))


def test_a_byte_level_export_has_a_byte_tokenizer(tmp_path):
    path = str(tmp_path / "tokenizer.json")
    toklib.write_byte_tokenizer(path)
    tok = toklib.load(path)
    text = "héllo wörld\n\ttabs € 日本".encode()
    assert tok.vocab_size == 256
    assert np.array_equal(tok.encode(text), np.frombuffer(text, np.uint8))
    assert tok.hf.decode(tok.encode(text).tolist()) == text.decode()
