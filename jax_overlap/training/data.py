"""Byte-level language-modelling data that exists on every machine, addressed by batch index.

A batch is a pure function of (seed, batch index): resuming at step k regenerates exactly the
batches an uninterrupted run would have seen, and every process of a multi-process run builds
the same global batch and keeps its own shard.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from functools import lru_cache

import numpy as np


def _stdlib_files() -> list[str]:
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
    for path in _stdlib_files():
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


def stream_from_config(cfg) -> TokenStream:
    d, m, t = cfg.data, cfg.model, cfg.train
    if d.source == "stdlib":
        corpus = stdlib_corpus(d.max_bytes)
    elif d.source == "file":
        corpus = file_corpus(d.path, d.max_bytes)
    else:
        corpus = synthetic_corpus(m.vocab, max(100_000, 4 * m.seq_len * t.global_batch))
    return TokenStream(corpus, m.seq_len, t.global_batch, t.seed)
