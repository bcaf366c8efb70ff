"""Tokenizers: `bytes` (one token per byte, vocab 256) or a Hugging Face `tokenizer.json`
through the `tokenizers` library, and a small byte-level BPE trained on the corpus itself.

No JAX here: the config reads a tokenizer's size (`model.vocab: auto`) before JAX starts.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from jax_overlap.errors import ConfigError

BYTES = "bytes"
TOKENIZER_FILE = "tokenizer.json"  # where prepare-data stores a trained or given tokenizer
INDEX_FILE = "index.json"  # the shard index prepare-data writes last


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class Tokenizer:
    """`encode(bytes) -> int array`; `hf` is the `tokenizers.Tokenizer` (None for bytes)."""

    name: str  # "bytes" or the tokenizer.json path
    vocab_size: int
    sha256: str  # of the tokenizer.json ("bytes" for the byte tokenizer)
    hf: Any = None

    def encode(self, data: bytes) -> np.ndarray:
        if self.hf is None:
            return np.frombuffer(data, np.uint8)
        ids = self.hf.encode(data.decode("utf-8", errors="replace")).ids
        return np.asarray(ids, np.uint32)

    def encode_batch(self, chunks: list[bytes]) -> list[np.ndarray]:
        """Several chunks at once (the `tokenizers` library encodes them in parallel)."""
        if self.hf is None:
            return [self.encode(c) for c in chunks]
        texts = [c.decode("utf-8", errors="replace") for c in chunks]
        return [np.asarray(e.ids, np.uint32) for e in self.hf.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of token ids (bytes: ids past 255 are dropped; invalid UTF-8 replaced)."""
        ids = [int(i) for i in ids]
        if self.hf is None:
            return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
        return self.hf.decode(ids)

    def describe(self) -> dict:
        return {"kind": BYTES if self.hf is None else "tokenizers", "vocab_size": self.vocab_size,
                "sha256": self.sha256, "file": None if self.hf is None else TOKENIZER_FILE}


def byte_tokenizer() -> Tokenizer:
    return Tokenizer(BYTES, 256, BYTES)


def load(spec: str, field: str = "data.tokenizer") -> Tokenizer:
    """`bytes` or the path of a `tokenizer.json`; ValueError naming `field` otherwise."""
    if spec in ("", BYTES):
        return byte_tokenizer()
    if not os.path.isfile(spec):
        raise ValueError(f"{field}: {spec} is not a file; pass `bytes` or the path of a Hugging "
                         f"Face tokenizer.json")
    from tokenizers import Tokenizer as HF

    try:
        hf = HF.from_file(spec)
    except Exception as e:  # noqa: BLE001 - the library's parse errors have no common type
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{field}: {spec} is not a tokenizer.json the `tokenizers` library "
                         f"reads ({first}); pass `bytes` or a valid tokenizer.json") from None
    size = hf.get_vocab_size()
    if size < 256:
        raise ValueError(f"{field}: {spec} has {size} tokens, fewer than the 256 byte values; "
                         f"pass `bytes` or a tokenizer with at least 256 tokens")
    return Tokenizer(spec, size, file_sha256(spec), hf)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable character for each byte (what the ByteLevel pre-tokenizer emits)."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def write_byte_tokenizer(path: str) -> None:
    """The byte tokenizer as a Hugging Face tokenizer.json: token id = byte value (a
    byte-level BPE with the 256 bytes as its vocabulary and no merges), so an exported
    byte-level model loads with `AutoTokenizer` and encodes UTF-8 text as we do."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    hf = HF(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.save(path)


def train_bpe(texts: Iterable[str], vocab_size: int, path: str) -> Tokenizer:
    """A byte-level BPE of `vocab_size` tokens trained on `texts`, saved at `path`.

    Byte-level: every byte string encodes (no unknown token), and decoding gives it back.
    """
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(texts, trainer=trainer)
    hf.save(path)
    return Tokenizer(path, hf.get_vocab_size(), file_sha256(path), hf)


def read_index(directory: str, field: str = "data.path") -> dict:
    """The JSON index of a prepare-data directory; ValueError naming `field` if absent."""
    path = os.path.join(directory, INDEX_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{field}: {directory} has no {INDEX_FILE}; point it at a "
                         f"`jax-overlap prepare-data --out DIR` directory")
    try:
        with open(path) as f:
            index = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{field}: {path} cannot be read as JSON ({type(e).__name__}); run "
                         f"prepare-data again") from None
    if not isinstance(index, dict) or "vocab_size" not in index:
        raise ValueError(f"{field}: {path} is not a prepare-data index; run prepare-data again")
    return index


def data_vocab_size(source: str, path: str, tokenizer: str) -> tuple[int, str]:
    """(vocabulary size, where it comes from) of the data a config names, without JAX.

    Raises ValueError naming the field when the shards or the tokenizer cannot be read.
    """
    if source == "tokens":
        size = read_index(path)["vocab_size"]
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"data.path: {path}/{INDEX_FILE} has vocab_size {size!r}, not a "
                             f"positive integer; run prepare-data again")
        return size, f"the tokenizer of {path}"
    if source in ("stdlib", "file") and tokenizer not in ("", BYTES):
        return load(tokenizer).vocab_size, f"data.tokenizer {tokenizer}"
    return 256, "the byte tokenizer"


def padded_vocab(size: int, multiple: int) -> int:
    """`size` rounded up to a multiple of `multiple` (the tp degree shards the vocab)."""
    return -(-size // multiple) * multiple


def data_vocab(data) -> tuple[int, str]:
    """(the tokenizer size of the config's `data` section, where it comes from); ConfigError
    naming the field."""
    if data.source == "tokens" and not os.path.isdir(data.path):
        raise ConfigError([f"data.path: {data.path or '(empty)'} is not a directory; "
                           f"data.source=tokens needs a `jax-overlap prepare-data --out` "
                           f"directory"])
    try:
        return data_vocab_size(data.source, data.path, data.tokenizer)
    except ValueError as e:
        raise ConfigError([str(e)]) from None
