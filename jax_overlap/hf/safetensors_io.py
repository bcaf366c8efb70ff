"""Reading and writing a Hugging Face weights directory with the `safetensors` library.

A directory holds either one `model.safetensors` or shards listed by
`model.safetensors.index.json` (`{"metadata": {"total_size": ...}, "weight_map": {name: file}}`).
Arrays are numpy (bf16 as `ml_dtypes.bfloat16`, which safetensors reads and writes).
"""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import load_file, save_file

from jax_overlap.config import ConfigError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def read_tensors(directory: str, flag: str = "--from-hf") -> dict[str, np.ndarray]:
    """Every tensor of the directory's single file or of all its indexed shards.

    Raises:
      ConfigError: one line for a missing, truncated or corrupt file, or an index that
        places tensors in a shard that does not hold them.
    """
    single, index = os.path.join(directory, SINGLE), os.path.join(directory, INDEX)
    if os.path.exists(index):
        try:
            with open(index) as f:
                data = json.load(f)
            weight_map = dict(data.get("weight_map", {}))
        except (OSError, ValueError, TypeError, AttributeError):
            raise ConfigError([f"{flag} {index}: not a safetensors index (JSON with a "
                               f"weight_map); copy it again"]) from None
        tensors: dict[str, np.ndarray] = {}
        for shard in sorted(set(weight_map.values())):
            path = os.path.join(directory, str(shard))
            if not os.path.isfile(path):
                raise ConfigError([f"{flag} {directory}: {INDEX} lists {shard}, which is "
                                   f"missing; copy the whole directory"])
            got = _load(path, flag)
            listed = {n for n, f in weight_map.items() if f == shard}
            if not listed <= set(got):
                missing = sorted(listed - set(got))[:3]
                raise ConfigError([f"{flag} {directory}: {INDEX} places {missing} in {shard}, "
                                   f"which does not hold them; copy the whole directory"])
            tensors.update(got)
        return tensors
    if os.path.exists(single):
        return _load(single, flag)
    raise ConfigError([f"{flag} {directory}: no {SINGLE} or {INDEX}; point it at a Hugging "
                       f"Face model directory"])


def _load(path: str, flag: str) -> dict[str, np.ndarray]:
    """One safetensors file; a truncated or corrupt one is a ConfigError."""
    try:
        return load_file(path)
    except Exception as e:  # noqa: BLE001 - SafetensorError, OSError, numpy's ValueError
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        raise ConfigError([f"{flag} {path}: not a readable safetensors file ({first}); "
                           f"it may be truncated or corrupt, copy it again"]) from None


def write_tensors(directory: str, tensors: dict[str, np.ndarray],
                  max_shard_bytes: int = 0) -> list[str]:
    """Writes `tensors` as one file, or as shards of at most `max_shard_bytes` (> 0) with an
    index; returns the file names written. Names keep their insertion order."""
    os.makedirs(directory, exist_ok=True)
    metadata = {"format": "pt"}  # what transformers expects of a PyTorch checkpoint
    total = sum(int(a.nbytes) for a in tensors.values())
    if max_shard_bytes <= 0 or total <= max_shard_bytes:
        save_file(dict(tensors), os.path.join(directory, SINGLE), metadata=metadata)
        return [SINGLE]
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, array in tensors.items():
        if shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += int(array.nbytes)
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(files, shards):
        save_file(shard, os.path.join(directory, file), metadata=metadata)
        weight_map.update({name: file for name in shard})
    with open(os.path.join(directory, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return files
