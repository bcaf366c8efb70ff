"""Token shards on disk: flat `.bin` files of uint16/uint32 tokens plus `index.json`.

The shards are one token stream cut into files of at most `shard_tokens` tokens; the index
holds the per-shard counts, the dtype, the tokenizer's size and hash and the validation split
(the last `val_fraction` of the stream). Reading memory-maps the files, so a corpus larger
than memory is fine: only the windows a batch touches are paged in.

    {"format": "jax_overlap-tokens-1", "dtype": "uint16", "vocab_size": 4096,
     "tokenizer": {"kind": "tokenizers", "sha256": "...", "file": "tokenizer.json"},
     "shards": [{"file": "shard_00000.bin", "tokens": 1234567}, ...], "tokens": 1234567,
     "split": {"val_fraction": 0.05, "train_tokens": ..., "val_start": ..., "val_tokens": ...},
     "documents": 553, "input_bytes": ..., "inputs": [...]}
"""

from __future__ import annotations

import json
import os

import numpy as np

from jax_overlap.data.tokenizer import INDEX_FILE

FORMAT = "jax_overlap-tokens-1"
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def dtype_for(vocab_size: int, requested: str = "auto") -> str:
    """The smallest dtype that holds every token id (`requested` unless it is `auto`)."""
    if requested == "auto":
        return "uint16" if vocab_size <= 1 << 16 else "uint32"
    if requested not in DTYPES:
        raise ValueError(f"--dtype: {requested!r} is not one of auto, uint16, uint32")
    limit = np.iinfo(DTYPES[requested]).max + 1
    if vocab_size > limit:
        raise ValueError(f"--dtype {requested}: the tokenizer has {vocab_size} tokens, more "
                         f"than {requested} holds ({limit}); use --dtype uint32 or auto")
    return requested


class ShardWriter:
    """Appends token arrays to `shard_NNNNN.bin` files of at most `shard_tokens` tokens."""

    def __init__(self, out_dir: str, dtype: str, shard_tokens: int = 1 << 27):
        self.out_dir, self.dtype, self.shard_tokens = out_dir, dtype, shard_tokens
        self.shards: list[dict] = []
        self._f = None

    def _open(self) -> None:
        name = f"shard_{len(self.shards):05d}.bin"
        self._f = open(os.path.join(self.out_dir, name), "wb")
        self.shards.append({"file": name, "tokens": 0})

    def write(self, tokens: np.ndarray) -> None:
        tokens = tokens.astype(DTYPES[self.dtype], copy=False)
        while len(tokens):
            if self._f is None or self.shards[-1]["tokens"] >= self.shard_tokens:
                self.close()
                self._open()
            room = self.shard_tokens - self.shards[-1]["tokens"]
            part, tokens = tokens[:room], tokens[room:]
            self._f.write(part.tobytes())
            self.shards[-1]["tokens"] += len(part)

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def split_of(total: int, val_fraction: float) -> dict:
    val = int(round(total * val_fraction))
    return {"val_fraction": val_fraction, "train_tokens": total - val, "val_start": total - val,
            "val_tokens": val}


def write_index(out_dir: str, index: dict) -> None:
    """Written last and atomically: a directory with an index holds complete shards."""
    tmp = os.path.join(out_dir, INDEX_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    os.replace(tmp, os.path.join(out_dir, INDEX_FILE))


class TokenArray:
    """The shards of an index as one read-only token array, memory-mapped shard by shard."""

    def __init__(self, directory: str, index: dict):
        dtype = DTYPES[index["dtype"]]
        self._maps = []
        self._starts = [0]
        for shard in index["shards"]:
            path = os.path.join(directory, shard["file"])
            n = int(shard["tokens"])
            if os.path.getsize(path) != n * np.dtype(dtype).itemsize:
                raise ValueError(f"data.path: {path} holds {os.path.getsize(path)} bytes, not "
                                 f"the {n} tokens its index lists; run prepare-data again")
            self._maps.append(np.memmap(path, dtype=dtype, mode="r", shape=(n,)) if n else
                              np.zeros(0, dtype))
            self._starts.append(self._starts[-1] + n)
        self._starts_np = np.asarray(self._starts, np.int64)

    def __len__(self) -> int:
        return self._starts[-1]

    def read_many(self, starts: np.ndarray, length: int) -> np.ndarray:
        """(len(starts), length) int32: the tokens at each start; one gather per shard."""
        starts = np.asarray(starts, np.int64)
        out = np.empty((len(starts), length), np.int32)
        shard = np.searchsorted(self._starts_np, starts, side="right") - 1
        inside = starts + length <= self._starts_np[shard + 1]
        offsets = np.arange(length)
        for k in np.unique(shard[inside]):
            sel = inside & (shard == k)
            out[sel] = self._maps[k][(starts[sel] - self._starts[k])[:, None] + offsets]
        for i in np.flatnonzero(~inside):  # windows across a shard boundary
            out[i] = self.read(int(starts[i]), length)
        return out

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) as int32, across shard boundaries."""
        out = np.empty(length, np.int32)
        pos, filled = start, 0
        shard = int(np.searchsorted(self._starts_np, start, side="right")) - 1
        while filled < length:
            local = pos - self._starts[shard]
            take = min(length - filled, self._starts[shard + 1] - pos)
            out[filled:filled + take] = self._maps[shard][local:local + take]
            filled, pos, shard = filled + take, pos + take, shard + 1
        return out
