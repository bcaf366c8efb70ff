"""Byte-level language-modelling data that exists on every machine, addressed by batch index.

A batch is a pure function of (seed, batch index): resuming at step k regenerates exactly the
batches an uninterrupted run would have seen, and every process of a multi-process run builds
the same global batch and keeps its own shard. The corpus's last `data.val_fraction` is held
out for evaluation. Token shards (`data.source: tokens`) go through the Grain loader of
`jax_overlap.data.loader` instead, which reads only each process's rows.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from functools import lru_cache

import numpy as np


def stdlib_files() -> list[str]:
    """The standard library's .py files behind `stdlib_corpus`, in its fixed order."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Tests and vendored packages are noisy; the fixed sort keeps the order reproducible.
        dirnames[:] = sorted(d for d in dirnames if d not in (
            "test", "tests", "site-packages", "idlelib", "__pycache__", "lib2to3"))
        found += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return found


@lru_cache(maxsize=4)
def stdlib_corpus(max_bytes: int) -> np.ndarray:
    """The Python standard library's own source text, concatenated in a fixed order."""
    chunks, total = [], 0
    for path in stdlib_files():
        with open(path, "rb") as f:
            data = f.read()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8).copy()


def file_corpus(path: str, max_bytes: int) -> np.ndarray:
    with open(path, "rb") as f:
        return np.frombuffer(f.read(max_bytes), dtype=np.uint8).copy()


def synthetic_corpus(vocab: int, size: int, seed: int = 1234) -> np.ndarray:
    """A sparse random Markov chain over `vocab` symbols: learnable, low entropy."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab, size=(vocab, 4))
    out = np.empty(size, np.int64)
    out[0] = 0
    choice = rng.integers(0, 4, size=size)
    for i in range(1, size):
        out[i] = successors[out[i - 1], choice[i]]
    return out


@dataclass(frozen=True)
class TokenStream:
    """Random windows of a corpus; batch `i` depends on (seed, i) only."""

    corpus: np.ndarray
    seq_len: int
    global_batch: int
    seed: int

    def batch(self, index: int) -> dict[str, np.ndarray]:
        rng = np.random.Generator(np.random.Philox(key=[self.seed, index]))
        starts = rng.integers(0, len(self.corpus) - self.seq_len - 1, size=self.global_batch)
        windows = np.stack([self.corpus[s:s + self.seq_len + 1] for s in starts]).astype(np.int32)
        return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


def split_corpus(corpus: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out): the held-out part is the corpus's last `val_fraction`."""
    n_val = int(len(corpus) * val_fraction)
    return corpus[:len(corpus) - n_val], corpus[len(corpus) - n_val:]


def tokenize_corpus(corpus: np.ndarray, spec: str) -> np.ndarray:
    """A byte corpus through the tokenizer `spec` (`bytes`: unchanged)."""
    from jax_overlap.data import tokenizer as toklib

    tok = toklib.load(spec)
    if tok.hf is None:
        return corpus
    data = corpus.tobytes()
    # Cut at line ends so the tokenizer encodes the pieces in parallel.
    pieces, start, step = [], 0, 1 << 20
    while start < len(data):
        cut = data.find(b"\n", start + step)
        cut = len(data) if cut < 0 else cut + 1
        pieces.append(data[start:cut])
        start = cut
    return np.concatenate(tok.encode_batch(pieces)).astype(np.int32)


def _corpus(cfg) -> np.ndarray:
    d, m, t = cfg.data, cfg.model, cfg.train
    if d.source in ("stdlib", "file"):
        return _text_corpus(d.source, d.path, d.max_bytes, d.tokenizer)
    return synthetic_corpus(m.vocab, max(100_000, 4 * m.seq_len * t.global_batch))


@lru_cache(maxsize=2)  # the train and the held-out stream share one encoding
def _text_corpus(source: str, path: str, max_bytes: int, tokenizer: str) -> np.ndarray:
    raw = stdlib_corpus(max_bytes) if source == "stdlib" else file_corpus(path, max_bytes)
    return tokenize_corpus(raw, tokenizer)


def stream_from_config(cfg):
    """The training batches `cfg.data` names: a `TokenStream` over the corpus minus its
    held-out tail, or the Grain loader over token shards (`data.source: tokens`)."""
    d, m, t = cfg.data, cfg.model, cfg.train
    if d.source == "tokens":
        from jax_overlap.data.loader import TokenLoader

        return TokenLoader(d.path, m.seq_len, t.global_batch, t.seed, split="train")
    train, _ = split_corpus(_corpus(cfg), d.val_fraction)
    return TokenStream(train, m.seq_len, t.global_batch, t.seed)


def eval_stream_from_config(cfg):
    """Held-out batches (the same ones at every evaluation): the token shards' val split
    read in order, or random windows of the byte corpus's last `data.val_fraction`."""
    d, m, t = cfg.data, cfg.model, cfg.train
    if d.source == "tokens":
        from jax_overlap.data.loader import TokenLoader

        return TokenLoader(d.path, m.seq_len, t.global_batch, t.seed, split="val",
                           shuffle=False)
    _, held_out = split_corpus(_corpus(cfg), d.val_fraction)
    if len(held_out) < m.seq_len + 2:
        raise ValueError(f"data.val_fraction: {d.val_fraction} holds out {len(held_out)} "
                         f"tokens, fewer than model.seq_len + 2 = {m.seq_len + 2}; raise it "
                         f"or data.max_bytes, or set train.eval_every=0")
    return TokenStream(held_out, m.seq_len, t.global_batch, t.seed + 1)


def place_batch(stream, index: int, mesh) -> dict:
    """Batch `index` of `stream` as global arrays split over dp. A stream with `place` (the
    token loader) reads only this process's rows; any other builds the global batch."""
    if hasattr(stream, "place"):
        return stream.place(index, mesh)
    from jax_overlap.data.loader import put_rows

    batch = stream.batch(index)
    rows = np.arange(len(next(iter(batch.values()))))
    return put_rows(batch, rows, len(rows), mesh)
