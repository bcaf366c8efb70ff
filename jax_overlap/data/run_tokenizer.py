"""The tokenizer a run trained with: its record in the run's config.json, its copy in the run
dir, and the tokenizer that `evaluate` and `convert` use for a run or a Hugging Face directory.

A run records `data.tokenizer_kind` (`bytes`, `tokenizers` or `synthetic`) and
`data.tokenizer_sha256` (of the tokenizer.json; `bytes` for the byte tokenizer) in its
config.json and keeps the tokenizer.json itself as `RUN_DIR/tokenizer.json`, so everything
after training (evaluation, export, a resume) tokenizes the way training did, even when the
shard directory is gone.

No JAX here.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional

from jax_overlap.errors import ConfigError
from jax_overlap.data import tokenizer as toklib

RUN_FILE = toklib.TOKENIZER_FILE  # the run dir's copy (and an HF directory's)
SYNTHETIC = "synthetic"


def of_data(d) -> Optional[toklib.Tokenizer]:
    """The tokenizer the tokens of data config `d` were made with (None: synthetic data).

    Raises:
      ConfigError: the shards' tokenizer.json is missing or is not the one their index
        records (one line naming `data.path`).
    """
    if d.source == SYNTHETIC:
        return None
    if d.source != "tokens":
        try:
            return toklib.load(d.tokenizer)
        except ValueError as e:
            raise ConfigError([str(e)]) from None
    try:
        entry = toklib.read_index(d.path).get("tokenizer") or {}
    except ValueError as e:
        raise ConfigError([str(e)]) from None
    if entry.get("kind", toklib.BYTES) == toklib.BYTES:
        return toklib.byte_tokenizer()
    path = os.path.join(d.path, entry.get("file") or toklib.TOKENIZER_FILE)
    return load_checked(path, entry.get("sha256", ""), "data.path",
                        "the tokenizer the shards' index records", "run prepare-data again")


def load_checked(path: str, sha256: str, field: str, what: str, fix: str) -> toklib.Tokenizer:
    """The tokenizer.json at `path`, which must hash to `sha256` (when given); ConfigError
    naming `field` otherwise (`what` the file should be, `fix` what to do)."""
    if not os.path.isfile(path):
        raise ConfigError([f"{field}: {path} is missing; {fix}"])
    try:
        tok = toklib.load(path, field=field)
    except ValueError as e:
        raise ConfigError([str(e)]) from None
    if sha256 and tok.sha256 != sha256:
        raise ConfigError([f"{field}: {path} is not {what} (sha256 {tok.sha256[:12]}, "
                           f"expected {sha256[:12]}); {fix}"])
    return tok


def kind_of(tok: Optional[toklib.Tokenizer]) -> str:
    if tok is None:
        return SYNTHETIC
    return toklib.BYTES if tok.hf is None else "tokenizers"


def record(tok: Optional[toklib.Tokenizer]) -> dict:
    """The `data.*` fields a run's config.json records for `tok`."""
    return {"tokenizer_kind": kind_of(tok), "tokenizer_sha256": "" if tok is None else tok.sha256}


def describe(tok: Optional[toklib.Tokenizer]) -> dict:
    """What `evaluate --json` reports about the tokenizer it used."""
    if tok is None:
        return {"kind": SYNTHETIC}
    return {"kind": kind_of(tok), "sha256": tok.sha256, "vocab_size": tok.vocab_size,
            "file": None if tok.hf is None else tok.name}


def config_fields(d, tok: Optional[toklib.Tokenizer]) -> dict:
    """The `data` section's changes in a run's config.json: the record, and for token shards
    made with a tokenizer.json its path (so the file says which tokenizer, not `bytes`)."""
    out = record(tok)
    if d.source == "tokens" and tok is not None and tok.hf is not None:
        out["tokenizer"] = tok.name
    return out


def save_copy(run_dir: str, tok: Optional[toklib.Tokenizer]) -> None:
    """Keeps `tok`'s tokenizer.json as `run_dir/tokenizer.json` (0644, written atomically);
    a run without one leaves no stale copy behind."""
    dest = os.path.join(run_dir, RUN_FILE)
    if tok is None or tok.hf is None:
        if os.path.exists(dest):
            os.remove(dest)
        return
    if os.path.abspath(tok.name) == os.path.abspath(dest):
        return
    tmp = dest + ".tmp"
    shutil.copyfile(tok.name, tmp)
    os.chmod(tmp, 0o644)
    os.replace(tmp, dest)


def recorded_sha256(run_dir: str) -> str:
    """The tokenizer hash an earlier run wrote in `run_dir/config.json` ("" if none)."""
    path = os.path.join(run_dir, "config.json")
    try:
        with open(path) as f:
            return str((json.load(f).get("data") or {}).get("tokenizer_sha256", "") or "")
    except (OSError, ValueError, AttributeError):
        return ""


def check_resume(run_dir: str, tok: Optional[toklib.Tokenizer], data_path: str) -> None:
    """A resume must read tokens made with the tokenizer the run trained with.

    Raises:
      ConfigError: one line naming `data.path` (or `data.tokenizer`).
    """
    want = recorded_sha256(run_dir)
    got = record(tok)["tokenizer_sha256"]
    if not want or want == got:
        return
    field = f"data.path: {data_path}" if data_path else "data.tokenizer"
    raise ConfigError([f"{field}: its tokenizer ({kind_of(tok)}, sha256 {got[:12] or '-'}) is "
                       f"not the one {run_dir} was trained with (sha256 {want[:12]}); resume "
                       f"on data made with {os.path.join(run_dir, RUN_FILE)}, or train in a "
                       f"new --run-dir"])


def for_run(run_dir: str, cfg) -> Optional[toklib.Tokenizer]:
    """The tokenizer a run trained with: its own copy, else what its config names."""
    d = cfg.data
    copy = os.path.join(run_dir, RUN_FILE)
    if os.path.isfile(copy):
        return load_checked(copy, d.tokenizer_sha256 if d.tokenizer_kind == "tokenizers" else "",
                            "--run-dir", "the tokenizer its config.json records",
                            "restore the run's tokenizer.json")
    if d.tokenizer_kind == toklib.BYTES:
        return toklib.byte_tokenizer()
    if d.tokenizer_kind == "tokenizers":
        raise ConfigError([f"--run-dir {run_dir}: {RUN_FILE} is missing (config.json records a "
                           f"tokenizer.json); copy the whole run directory"])
    tok = of_data(d)
    return toklib.byte_tokenizer() if tok is None else tok


def for_hf(hf_dir: str) -> toklib.Tokenizer:
    """An HF directory's tokenizer.json, or bytes when it has none."""
    path = os.path.join(hf_dir, RUN_FILE)
    if not os.path.isfile(path):
        return toklib.byte_tokenizer()
    return load_checked(path, "", "--from-hf", "a tokenizer.json", "fix or remove it")
