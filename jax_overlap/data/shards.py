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


def index_problem(directory: str, index: dict) -> str:
    """What is wrong with a prepare-data index against its files ("" when nothing): every
    shard present with exactly the bytes its count says, the counts adding up to `tokens`,
    the split inside the stream, the dtype holding the vocabulary."""
    try:
        dtype = index["dtype"]
        if dtype not in DTYPES:
            return f"{INDEX_FILE} names dtype {dtype!r}, not one of {', '.join(DTYPES)}"
        vocab = int(index["vocab_size"])
        if not 0 < vocab <= np.iinfo(DTYPES[dtype]).max + 1:
            return f"{INDEX_FILE}: vocab_size {vocab} does not fit {dtype}"
        total = 0
        for shard in index["shards"]:
            name, n = str(shard["file"]), int(shard["tokens"])
            path = os.path.join(directory, name)
            if os.path.basename(name) != name or n < 0:
                return f"{INDEX_FILE} lists a bad shard entry {shard!r}"
            if not os.path.isfile(path):
                return f"{name}, listed in {INDEX_FILE}, is missing"
            size = os.path.getsize(path)
            if size != n * np.dtype(DTYPES[dtype]).itemsize:
                return (f"{name} holds {size} bytes, not the {n} {dtype} tokens "
                        f"{INDEX_FILE} lists")
            total += n
        sp = index["split"]
        train, start, val = int(sp["train_tokens"]), int(sp["val_start"]), int(sp["val_tokens"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        return f"{INDEX_FILE} is not a prepare-data index ({type(e).__name__}: {e})"
    if total != int(index.get("tokens", total)):
        return f"{INDEX_FILE} says {index['tokens']} tokens, its shards hold {total}"
    if min(train, start, val) < 0 or train > total or start + val > total:
        return (f"{INDEX_FILE}'s split (train {train}, val {start}..{start + val}) is outside "
                f"its {total} tokens")
    return ""


def write_index(out_dir: str, index: dict) -> None:
    """Written last and atomically: a directory with an index holds complete shards."""
    tmp = os.path.join(out_dir, INDEX_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    os.replace(tmp, os.path.join(out_dir, INDEX_FILE))


class TokenArray:
    """The shards of an index as one read-only token array, memory-mapped shard by shard.

    Raises:
      ValueError: naming `field` when the index does not describe the files (a missing or
        truncated shard, counts or a split that do not add up, an unknown dtype).
    """

    def __init__(self, directory: str, index: dict, field: str = "data.path"):
        problem = index_problem(directory, index)
        if problem:
            raise ValueError(f"{field}: {directory}: {problem}; run prepare-data again")
        dtype = DTYPES[index["dtype"]]
        self._maps = []
        self._starts = [0]
        for shard in index["shards"]:
            path = os.path.join(directory, shard["file"])
            n = int(shard["tokens"])
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
