"""Real data: tokenizers, `prepare-data` shards, the Grain loader, held-out evaluation and
TensorBoard events, on a small slice of the stdlib with a locally trained BPE."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import REPO, TINY

from jax_overlap import config
from jax_overlap.data import prepare, shards
from jax_overlap.data import tokenizer as toklib
from jax_overlap.data.loader import TokenLoader

VOCAB = 512


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("bpe") / "shards")
    result = prepare.prepare(["stdlib"], out, train_vocab=VOCAB, val_fraction=0.1,
                             max_bytes=300_000, shard_tokens=40_000, progress=False)
    return out, result


def prepare_cli(*args):
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", "jax_overlap.cli", "prepare-data", *args,
                           "--no-progress"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def test_prepare_data_writes_shards_and_index(bpe_dir):
    out, result = bpe_dir
    index = json.load(open(os.path.join(out, "index.json")))
    assert index["dtype"] == "uint16" and index["vocab_size"] == VOCAB
    assert index["tokenizer"]["sha256"] == toklib.file_sha256(os.path.join(out, "tokenizer.json"))
    assert len(index["shards"]) > 1  # 40k tokens per shard: windows cross shard boundaries
    assert sum(s["tokens"] for s in index["shards"]) == index["tokens"] == result.tokens
    sp = index["split"]
    assert sp["train_tokens"] + sp["val_tokens"] == index["tokens"]
    assert sp["val_start"] == sp["train_tokens"] and abs(sp["val_tokens"] / index["tokens"]
                                                         - 0.1) < 1e-3
    assert index["input_bytes"] == 300_000
    # BPE compresses Python source well below one token per byte ...
    assert index["tokens"] < 0.6 * index["input_bytes"]
    # ... and the shards decode back to the input text.
    tok = toklib.load(os.path.join(out, "tokenizer.json"))
    ids = shards.TokenArray(out, index).read(0, index["tokens"])
    from jax_overlap.data.streams import stdlib_corpus

    text = stdlib_corpus(300_000).tobytes().decode("utf-8", errors="replace")
    assert tok.hf.decode(ids.tolist()) == text
    assert "tokens/s" in result.line() and "MB/s" in result.line()


def test_prepare_data_refuses_with_one_line(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    # A tokenizer with more ids than uint16 holds.
    from tokenizers import Tokenizer, models

    big = Tokenizer(models.WordLevel({f"w{i}": i for i in range(70_000)}, unk_token="w0"))
    big.save(str(tmp_path / "big.json"))
    cases = [
        (["--input", str(tmp_path / "missing.txt")], "--input"),
        (["--input", str(tmp_path / "*.nothing")], "no file matches"),
        (["--input", str(empty)], "empty"),
        (["--input", str(empty), "--val-fraction", "1.5"], "--val-fraction"),
        (["--input", "stdlib", "--max-bytes", "1000", "--tokenizer", str(tmp_path / "big.json"),
          "--dtype", "uint16"], "--dtype uint16"),
    ]
    for args, needle in cases:
        proc = prepare_cli(*args, "--out", str(tmp_path / "out"))
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    # uint32 holds it, and prepare-data copies the tokenizer next to the shards.
    proc = prepare_cli("--input", "stdlib", "--max-bytes", "1000", "--tokenizer",
                       str(tmp_path / "big.json"), "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    index = json.load(open(tmp_path / "out" / "index.json"))
    assert index["dtype"] == "uint32" and index["vocab_size"] == 70_000
    assert (tmp_path / "out" / "tokenizer.json").exists()


def test_byte_shards_hold_the_corpus_bytes(tmp_path):
    src = tmp_path / "a.txt"
    src.write_bytes(b"hello world\n" * 1000)
    result = prepare.prepare([str(src)], str(tmp_path / "out"), val_fraction=0.0,
                             progress=False)
    index = result.index
    assert index["vocab_size"] == 256 and index["tokenizer"]["sha256"] == "bytes"
    ids = shards.TokenArray(str(tmp_path / "out"), index).read(0, index["tokens"])
    assert bytes(ids.astype(np.uint8)) == src.read_bytes()


def test_vocab_auto_and_refusals(bpe_dir, tmp_path):
    out, _ = bpe_dir
    tokens = ["data.source=tokens", f"data.path={out}"]
    assert config.load(TINY, tokens + ["model.vocab=auto"]).model.vocab == VOCAB
    # Padded to a multiple of tp: 512 tokens on tp=3 -> 513 (the mesh check is separate).
    assert toklib.padded_vocab(VOCAB, 3) == 513 and toklib.padded_vocab(VOCAB, 4) == 512
    assert config.load(TINY, ["model.vocab=auto"]).model.vocab == 256  # bytes
    with pytest.raises(config.ConfigError) as e:
        config.load(TINY, tokens + ["model.vocab=256"])
    (line,) = e.value.problems
    assert line.startswith("model.vocab: 256 < 512") and "model.vocab=auto" in line
    with pytest.raises(config.ConfigError) as e:
        config.load(TINY, ["data.source=tokens", f"data.path={tmp_path}", "model.vocab=auto"])
    assert e.value.problems[0].startswith("data.path:") and "index.json" in e.value.problems[0]
    with pytest.raises(config.ConfigError) as e:  # a tokenizer other than the shards' own
        config.load(TINY, tokens + ["model.vocab=auto", "data.tokenizer=configs/tiny.yaml"])
    assert e.value.problems[0].startswith("data.tokenizer:")
    tok = os.path.join(out, "tokenizer.json")
    assert config.load(TINY, tokens + ["model.vocab=auto", f"data.tokenizer={tok}"])
    # No val split, but evaluation asked for: refused before the run starts.
    no_val = str(tmp_path / "no_val")
    prepare.prepare(["stdlib"], no_val, val_fraction=0.0, max_bytes=5000, progress=False)
    with pytest.raises(config.ConfigError) as e:
        config.load(TINY, ["data.source=tokens", f"data.path={no_val}", "train.eval_every=2"])
    (line,) = e.value.problems
    assert line.startswith("train.eval_every:") and "--val-fraction" in line
    # stdlib through the same tokenizer: the size comes from the tokenizer file, and the
    # train and held-out streams are the encoded corpus.
    cfg = config.load(TINY, [f"data.tokenizer={tok}", "model.vocab=auto",
                             "data.max_bytes=50000"])
    assert cfg.model.vocab == 512
    from jax_overlap.data import streams as data
    from jax_overlap.data.streams import stdlib_corpus

    train, held_out = data.stream_from_config(cfg), data.eval_stream_from_config(cfg)
    ids = np.concatenate([train.corpus, held_out.corpus])
    assert 0.04 < len(held_out.corpus) / len(ids) < 0.06  # data.val_fraction 0.05
    text = stdlib_corpus(50_000).tobytes().decode("utf-8", errors="replace")
    assert toklib.load(tok).hf.decode(ids.tolist()) == text


def test_loader_batches_epochs_and_prefetch(bpe_dir):
    out, _ = bpe_dir
    seq, batch = 16, 8
    loader = TokenLoader(out, seq, batch, seed=3)
    n = loader.num_windows
    index = json.load(open(os.path.join(out, "index.json")))
    assert n == (index["split"]["train_tokens"] - 1) // seq
    b = loader.batch(5)
    assert b["inputs"].shape == (batch, seq) and b["inputs"].dtype == np.int32
    assert np.array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])  # shifted by one
    w = loader.window_ids(5, range(batch))
    assert np.array_equal(b["inputs"][0], loader.tokens.read(w[0] * seq, seq))
    # Seeded: another loader with the same seed reads the same batch; another seed does not.
    assert np.array_equal(TokenLoader(out, seq, batch, seed=3).batch(5)["inputs"], b["inputs"])
    assert not np.array_equal(TokenLoader(out, seq, batch, seed=4).batch(5)["inputs"],
                              b["inputs"])
    # Each epoch is a permutation of all windows, and epochs differ.
    rows = np.arange(batch)
    flat = np.concatenate([loader.window_ids(i, rows) for i in range(2 * n // batch + 2)])
    e0, e1 = flat[:n], flat[n:2 * n]
    assert sorted(e0) == list(range(n)) and sorted(e1) == list(range(n))
    assert not np.array_equal(e0, e1) and not np.array_equal(e0, np.arange(n))
    # The prefetching iterator yields the same batches, in order, and jumps (resume,
    # rollback) restart it at the asked index.
    for i in (0, 1, 2, 7, 8, 3):
        got = loader.local_batch(i, [1, 4])
        want = loader.read_rows(i, [1, 4])
        assert np.array_equal(got["targets"], want["targets"])
        assert np.array_equal(got["targets"], loader.batch(i)["targets"][[1, 4]])
    assert loader.iterator_state() == {"next_batch": 4}
    # The val split is read in order, from where the train split ends.
    val = TokenLoader(out, seq, batch, seed=3, split="val", shuffle=False)
    assert np.array_equal(val.batch(0)["inputs"][1],
                          loader.tokens.read(index["split"]["val_start"] + seq, seq))


def test_loader_places_only_its_rows():
    """`put_rows` builds the global array from the rows a process holds."""
    import jax

    from jax_overlap.data.loader import process_rows, put_rows
    from jax_overlap.parallel.mesh import make_mesh

    mesh = make_mesh(2, 1, 4, jax.devices()[:8])
    rows = process_rows(mesh, 16)
    assert list(rows) == list(range(16))  # one process holds every row
    local = {"inputs": np.arange(16 * 3, dtype=np.int32).reshape(16, 3)}
    placed = put_rows(local, rows, 16, mesh)
    assert np.array_equal(np.asarray(placed["inputs"]), local["inputs"])


def read_scalars(logdir):
    """{tag: [(step, value), ...]} of the event files in `logdir`, via tensorboard's reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


SCALARS = {"train/loss", "eval/loss", "eval/perplexity", "train/lr", "train/grad_norm",
           "perf/tokens_per_s", "perf/mfu", "faults/rollbacks", "faults/skipped_steps"}


def test_tokenized_training_evaluates_and_writes_events(bpe_dir, tmp_path, monkeypatch):
    from jax_overlap.training import loop

    out, _ = bpe_dir
    monkeypatch.setattr(loop, "peak_flops", lambda device: 1e12)  # CPU has none: MFU too
    cfg = config.load(TINY, ["data.source=tokens", f"data.path={out}", "model.vocab=auto",
                             "train.steps=6", "train.eval_every=3", "train.eval_batches=2",
                             "train.warmup_steps=1", "train.lr=0.01"])
    result = loop.run(cfg, str(tmp_path), progress=False)
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    evals = [r for r in records if r.get("event") == "eval"]
    assert [r["step"] for r in evals] == [3, 6]
    assert evals[1]["eval_loss"] < evals[0]["eval_loss"] < np.log(VOCAB) + 0.5
    assert evals[0]["eval_perplexity"] == pytest.approx(np.exp(evals[0]["eval_loss"]))
    assert evals[0]["eval_tokens"] == 2 * 16 * 16  # eval_batches x global_batch x seq_len
    summary = result.summary()
    assert summary["eval_loss"] == evals[1]["eval_loss"]
    assert result.last_loss < result.first_loss
    scalars = read_scalars(tmp_path)
    assert SCALARS <= set(scalars), sorted(scalars)
    steps = [r for r in records if "event" not in r]
    assert [s for s, _ in scalars["train/loss"]] == [r["step"] for r in steps]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([r["loss"] for r in steps])
    assert scalars["eval/loss"] == [(3, pytest.approx(evals[0]["eval_loss"])),
                                    (6, pytest.approx(evals[1]["eval_loss"]))]
    assert all(v == 0 for _, v in scalars["faults/rollbacks"])


def test_event_writer_counts_faults(tmp_path):
    from jax_overlap.training.events import EventWriter

    w = EventWriter(str(tmp_path))
    w.write({"step": 1, "loss": 5.0, "grad_norm": 1.0, "lr": 1e-3, "step_time_s": 0.1,
             "tokens_per_s": 100.0, "batch": 0, "mfu": 0.25})
    w.write({"step": 2, "loss": float("nan"), "grad_norm": 1.0, "lr": 1e-3, "skipped": True,
             "reason": "nan", "consecutive_bad": 1, "batch": 1})
    w.write({"event": "rollback", "from_step": 2, "to_step": 0, "steps_lost": 1})
    w.write({"step": 1, "loss": 4.0, "grad_norm": 1.0, "lr": 1e-3, "batch": 2,
             "dcn_delay_s": 0.5})  # another helper's new metric: its own chart
    w.write({"event": "eval", "step": 1, "eval_loss": 3.0, "eval_perplexity": 20.0})
    w.close()
    s = read_scalars(tmp_path)
    assert [v for _, v in s["faults/skipped_steps"]] == [0, 1, 1]
    assert s["faults/rollbacks"][-1][1] == 1 and s["faults/steps_lost"] == [(2, 1.0)]
    assert s["perf/mfu"] == [(1, 0.25)] and s["train/dcn_delay_s"] == [(1, 0.5)]
    assert s["eval/loss"] == [(1, 3.0)] and "train/batch" not in s


# Each of two processes (4 CPU devices each) places batches of a (dp, tp) mesh from the token
# loader, logging which rows and windows it read, and gathers the global batch.
ROWS_DRIVER = """
import json, sys
import numpy as np
from jax_overlap.parallel import mesh as meshlib
coord, pid, data, out, dp, tp = sys.argv[1:]
meshlib.force_host_devices(4)
meshlib.init_distributed(coord, 2, int(pid), 120)
import jax
from jax.experimental import multihost_utils
from jax_overlap.data.loader import TokenLoader
mesh = meshlib.make_mesh(int(dp), 1, int(tp), jax.devices())
loader = TokenLoader(data, 16, 16, seed=0)
read = []
inner = loader.read_rows
def logged(i, rows):
    read.append([i, [int(r) for r in rows], loader.window_ids(i, rows).tolist()])
    return inner(i, rows)
loader.read_rows = logged
full = []
for i in (0, 1, 2, 5):
    placed = loader.place(i, mesh)
    full.append(multihost_utils.process_allgather(placed["inputs"], tiled=True).tolist())
loader.close()
json.dump({"read": read, "full": full}, open(out, "w"))
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("dp,tp", [(2, 4), pytest.param(8, 1, marks=pytest.mark.slow)])
def test_two_processes_read_disjoint_rows(bpe_dir, tmp_path, dp, tp):
    from test_multiprocess import free_port

    out, _ = bpe_dir
    port = free_port()
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, "-c", ROWS_DRIVER, f"127.0.0.1:{port}", str(i),
                               out, str(tmp_path / f"p{i}.json"), str(dp), str(tp)],
                              cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    logs = [json.load(open(tmp_path / f"p{i}.json")) for i in range(2)]
    loader = TokenLoader(out, 16, 16, seed=0)
    for k, index in enumerate((0, 1, 2, 5)):
        # Whatever the prefetch read ahead, batch `index`'s reads per process:
        reads = [next(r for r in log["read"] if r[0] == index) for log in logs]
        rows0, rows1 = set(reads[0][1]), set(reads[1][1])
        assert rows0 and rows1 and not rows0 & rows1 and rows0 | rows1 == set(range(16))
        windows = dict(zip(reads[0][1] + reads[1][1], reads[0][2] + reads[1][2]))
        assert [windows[r] for r in range(16)] == loader.window_ids(index, range(16)).tolist()
        for log in logs:  # the placed global array is the global batch
            assert np.array_equal(np.asarray(log["full"][k]), loader.batch(index)["inputs"])
        assert all(len(r[1]) == 8 for log in logs for r in log["read"])  # half the rows each


@pytest.mark.slow  # three CLI runs
def test_token_loader_resume_after_sigkill_is_bit_identical(bpe_dir, tmp_path):
    from test_resume import finish, marker, model_checksums, read_metrics, start_cli

    out, _ = bpe_dir
    run = ["train", "--config", TINY, "--no-progress", "--set", "train.steps=8",
           "--set", "data.source=tokens", "--set", f"data.path={out}",
           "--set", "model.vocab=auto", "--set", "checkpoint.every_steps=2",
           "--set", "checkpoint.async_save=false", "--set", "train.eval_every=4"]
    cache = tmp_path / "cache"
    killed = str(tmp_path / "killed")
    rc, _, err = finish(start_cli(run + ["--run-dir", killed], cache, kill_at=5))
    assert rc == -9, err[-3000:]
    rc, stdout, err = finish(start_cli(run + ["--run-dir", killed], cache))
    assert rc == 0, err[-3000:]
    assert json.loads(stdout.strip().splitlines()[-1])["resumed_from"] == 4
    straight = str(tmp_path / "straight")
    rc, _, err = finish(start_cli(run + ["--run-dir", straight], cache))
    assert rc == 0, err[-3000:]
    a = model_checksums(marker(os.path.join(killed, "checkpoints"), 8))
    b = model_checksums(marker(os.path.join(straight, "checkpoints"), 8))
    assert a and a == b
    # The resumed run read the exact batches of the uninterrupted one, and evaluated alike.
    def after_resume(records):
        i = max([k for k, r in enumerate(records) if r.get("event") == "resume"], default=-1)
        return [(r.get("batch"), r.get("loss"), r.get("eval_loss")) for r in records[i + 1:]]
    tail = after_resume(read_metrics(killed))
    assert tail == after_resume(read_metrics(straight))[-len(tail):] and len(tail) == 5


@pytest.mark.slow  # two pipeline/plain compiles
def test_pipelined_run_evaluates_like_plain(bpe_dir, tmp_path):
    from helpers import rel

    from jax_overlap.training import loop

    out, _ = bpe_dir
    common = ["data.source=tokens", f"data.path={out}", "model.vocab=auto", "train.steps=2",
              "train.eval_every=1", "train.eval_batches=2", "pipeline.microbatches=2"]
    plain = loop.run(config.load(TINY, common), str(tmp_path / "plain"), progress=False)
    piped = loop.run(config.load(TINY, common + ["mesh.dp=1", "mesh.pp=2", "mesh.tp=4"]),
                     str(tmp_path / "pp"), progress=False)
    a, b = plain.summary(), piped.summary()
    assert rel(b["eval_loss"], a["eval_loss"]) <= 1e-5


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_train_and_evaluate_from_shards(bpe_dir, tmp_path):
    from helpers import last_json_line, rel, run_cli
    from test_multiprocess import launch

    out, _ = bpe_dir
    common = ["train", "--config", TINY, "--no-progress", "--set", "train.steps=2",
              "--set", "data.source=tokens", "--set", f"data.path={out}",
              "--set", "model.vocab=auto", "--set", "train.eval_every=2",
              "--set", "train.eval_batches=2"]
    outs = launch(common + ["--run-dir", str(tmp_path / "mp")], 2, tmp_path)
    for rc, _, err in outs:
        assert rc == 0, err[-3000:]
    multi = last_json_line(outs[0][1])
    single = run_cli(*common, "--run-dir", str(tmp_path / "sp"))
    assert single.returncode == 0, single.stderr[-3000:]
    single = last_json_line(single.stdout)
    assert rel(multi["first_loss"], single["first_loss"]) <= 1e-5
    assert rel(multi["eval_loss"], single["eval_loss"]) <= 1e-4


def test_inputs_are_read_in_bounded_chunks(tmp_path, monkeypatch):
    """No input is read whole: chunks end at line ends (or are cut once 4 chunks long)."""
    monkeypatch.setattr(prepare, "CHUNK_BYTES", 1000)
    lines = tmp_path / "lines.txt"
    lines.write_bytes(b"".join(b"line %d of some text\n" % i for i in range(2000)))
    blob = tmp_path / "blob.bin"
    blob.write_bytes(bytes(range(256)) * 40)  # no newline at all
    chunks = list(prepare.read_chunks([str(lines), str(blob)]))
    assert b"".join(chunks) == lines.read_bytes() + blob.read_bytes()
    assert max(len(c) for c in chunks) <= 4000
    n_lines = sum(1 for c in chunks if c.endswith(b"\n"))
    assert n_lines >= lines.stat().st_size // 1000 - 1  # the text file's chunks end at a line
    capped = b"".join(prepare.read_chunks([str(lines)], max_bytes=2500))
    assert capped == lines.read_bytes()[:2500]
