"""`jax-overlap prepare-data`: text files in, token shards and their index out.

    jax-overlap prepare-data --input stdlib --train-tokenizer 4096 --out data/stdlib_bpe4k

Inputs are files, globs or `stdlib` (the Python standard library's source, the embedded
corpus of `data.source: stdlib`). They are read in chunks cut at line ends, so no file has to
fit in memory; each chunk is encoded (`tokenizers` encodes a group of chunks in parallel) and
appended to the shards (`jax_overlap.data.shards`). With `--train-tokenizer VOCAB` a byte-level
BPE is first trained on the same inputs and stored as `DIR/tokenizer.json`; a given
`--tokenizer` file is copied there, so the shard directory is self-contained.
"""

from __future__ import annotations

import glob
import os
import shutil
import time
from dataclasses import dataclass
from typing import Iterator

from jax_overlap.data import shards as shardlib
from jax_overlap.data import tokenizer as toklib

CHUNK_BYTES = 1 << 20  # read unit; cut back to the last newline so lines stay whole
ENCODE_GROUP = 16  # chunks handed to the tokenizer at once (it encodes them in parallel)


def resolve_inputs(specs: list[str]) -> list[str]:
    """Files named by `specs` (paths, globs, directories walked for files, or `stdlib`),
    in a fixed order; ValueError naming `--input` for one that matches nothing readable."""
    from jax_overlap.data.streams import stdlib_files

    out: list[str] = []
    for spec in specs:
        if spec == "stdlib":
            out += stdlib_files()
            continue
        if os.path.isdir(spec):
            found = sorted(os.path.join(d, f) for d, _, fs in os.walk(spec) for f in fs)
        else:
            found = sorted(glob.glob(spec, recursive=True)) if glob.has_magic(spec) else [spec]
        if not found:
            raise ValueError(f"--input {spec}: no file matches; pass files, a glob in quotes "
                             f"or `stdlib`")
        for path in found:
            if not os.path.isfile(path) or not os.access(path, os.R_OK):
                raise ValueError(f"--input {path}: not a readable file; fix the path or its "
                                 f"permissions")
        out += [p for p in found if os.path.isfile(p)]
    return out


def read_chunks(paths: list[str], max_bytes: int = 0) -> Iterator[bytes]:
    """The inputs' bytes in chunks of about `CHUNK_BYTES` ending at a newline (a file's last
    chunk ends where the file does); at most `max_bytes` in all when > 0."""
    left = max_bytes if max_bytes > 0 else -1
    for path in paths:
        try:
            f = open(path, "rb")
        except OSError as e:
            raise ValueError(f"--input {path}: cannot be read ({e.strerror}); fix the path or "
                             f"its permissions") from None
        with f:
            carry = b""
            while left != 0:
                block = f.read(CHUNK_BYTES if left < 0 else min(CHUNK_BYTES, left))
                if not block:
                    break
                left = left - len(block) if left > 0 else left
                data = carry + block
                cut = data.rfind(b"\n") + 1
                if cut == 0 or left == 0:
                    cut = len(data) if left == 0 or len(data) >= 4 * CHUNK_BYTES else 0
                carry, data = data[cut:], data[:cut]
                if data:
                    yield data
            if carry:
                yield carry
        if left == 0:
            return


@dataclass(frozen=True)
class PrepareResult:
    out: str
    files: int
    input_bytes: int
    tokens: int
    vocab_size: int
    dtype: str
    seconds: float
    index: dict

    def line(self) -> str:
        s = max(self.seconds, 1e-9)
        sp = self.index["split"]
        return (f"prepare-data: {self.tokens:,} tokens ({sp['train_tokens']:,} train, "
                f"{sp['val_tokens']:,} val) from {self.files} files ({self.input_bytes / 1e6:.1f} "
                f"MB) in {self.seconds:.1f} s: {self.tokens / s:,.0f} tokens/s, "
                f"{self.input_bytes / 1e6 / s:.1f} MB/s; vocab {self.vocab_size}, {self.dtype}; "
                f"train with --set data.source=tokens --set data.path={self.out} "
                f"--set model.vocab=auto")


def prepare(inputs: list[str], out: str, tokenizer: str = "bytes", train_vocab: int = 0,
            val_fraction: float = 0.05, dtype: str = "auto", max_bytes: int = 0,
            shard_tokens: int = 1 << 27, progress: bool = True) -> PrepareResult:
    """Tokenizes `inputs` into shards in `out` (see the module docstring).

    Args:
      inputs: `--input` specs (files, globs, directories, `stdlib`).
      out: the shard directory (created; an earlier prepare-data output is replaced).
      tokenizer: `bytes` or a tokenizer.json path (ignored when `train_vocab` > 0).
      train_vocab: > 0: train a byte-level BPE of this many tokens on the inputs first.
      val_fraction: the last fraction of the token stream held out for evaluation.
      dtype: `auto` (uint16 when the vocab fits, else uint32), `uint16` or `uint32`.
      max_bytes: read at most this many input bytes (0: all).
      shard_tokens: tokens per .bin file.
      progress: show a progress bar with the throughput.

    Raises:
      ValueError: one line naming the flag (unreadable input, empty corpus, vocab not
        fitting the dtype, a bad fraction or output directory).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"--val-fraction: {val_fraction} is outside [0, 1); e.g. 0.05")
    if train_vocab and not 256 < train_vocab <= 1 << 20:
        raise ValueError(f"--train-tokenizer: {train_vocab} must be in 257..{1 << 20} (the "
                         f"byte alphabet takes 256); e.g. 4096")
    paths = _first_bytes(resolve_inputs(inputs), max_bytes)
    total_bytes = sum(os.path.getsize(p) for p in paths)
    if max_bytes > 0:
        total_bytes = min(total_bytes, max_bytes)
    if total_bytes == 0:
        raise ValueError(f"--input {' '.join(inputs)}: the corpus is empty (0 bytes); pass "
                         f"files with text in them")
    given = None if train_vocab else toklib.load(tokenizer, field="--tokenizer")
    if given is not None:
        dtype = shardlib.dtype_for(given.vocab_size, dtype)  # refused before --out changes
    _prepare_out_dir(out)
    t0 = time.perf_counter()
    if train_vocab:
        texts = (c.decode("utf-8", errors="replace") for c in read_chunks(paths, max_bytes))
        tok = toklib.train_bpe(texts, train_vocab, os.path.join(out, toklib.TOKENIZER_FILE))
    else:
        tok = given
        if tok.hf is not None:
            shutil.copyfile(tokenizer, os.path.join(out, toklib.TOKENIZER_FILE))
    dtype = shardlib.dtype_for(tok.vocab_size, dtype)
    writer = shardlib.ShardWriter(out, dtype, shard_tokens)
    bar = _bar(total_bytes, progress)
    t_encode = time.perf_counter()  # the bar's tokens/s counts encoding only
    try:
        group: list[bytes] = []
        for chunk in read_chunks(paths, max_bytes):
            group.append(chunk)
            if len(group) == ENCODE_GROUP:
                _encode_group(tok, group, writer, bar, t_encode)
                group = []
        if group:
            _encode_group(tok, group, writer, bar, t_encode)
    finally:
        writer.close()
        bar.close()
    if writer.tokens == 0:
        raise ValueError(f"--input {' '.join(inputs)}: the corpus encodes to 0 tokens; pass "
                         f"files with text in them")
    index = {"format": shardlib.FORMAT, "dtype": dtype, "vocab_size": tok.vocab_size,
             "tokenizer": tok.describe(), "shards": writer.shards, "tokens": writer.tokens,
             "split": shardlib.split_of(writer.tokens, val_fraction),
             "documents": len(paths), "input_bytes": total_bytes,
             "inputs": list(inputs)}
    shardlib.write_index(out, index)
    return PrepareResult(out, len(paths), total_bytes, writer.tokens, tok.vocab_size, dtype,
                         time.perf_counter() - t0, index)


def _first_bytes(paths: list[str], max_bytes: int) -> list[str]:
    """The files that hold the first `max_bytes` bytes (all when 0)."""
    if max_bytes <= 0:
        return paths
    out, total = [], 0
    for p in paths:
        if total >= max_bytes:
            break
        out.append(p)
        total += os.path.getsize(p)
    return out


def _encode_group(tok, group: list[bytes], writer, bar, t0: float) -> None:
    for ids in tok.encode_batch(group):
        writer.write(ids)
    bar.update(sum(len(c) for c in group))
    bar.set_postfix(tokens=f"{writer.tokens:,}",
                    tok_s=f"{writer.tokens / max(time.perf_counter() - t0, 1e-9):,.0f}")


def _prepare_out_dir(out: str) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out}: exists and is not a directory; pick a directory path")
    if os.path.isdir(out):
        leftover = [f for f in os.listdir(out) if not (
            f.startswith("shard_") or f in (toklib.INDEX_FILE, toklib.TOKENIZER_FILE))]
        if leftover:
            raise ValueError(f"--out {out}: holds files prepare-data did not write "
                             f"({leftover[0]}, ...); pick an empty or new directory")
        for f in os.listdir(out):
            os.remove(os.path.join(out, f))
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {out}: cannot be created ({e.strerror})") from None


def _bar(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, desc="prepare-data", unit="B",
                unit_scale=True, dynamic_ncols=True)
