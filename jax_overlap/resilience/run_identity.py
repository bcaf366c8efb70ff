"""Whether a `train` start continues the run already in its run dir, or would mix two runs.

A run dir holds one run: its `config.json`, one `metrics.jsonl` and TensorBoard stream, its
checkpoints. A start in a dir that already holds a run's metrics is allowed only as a resume
of that run:

* the same model, data and seed (`IDENTITY`); the mesh, the parallel knobs, `train.steps`,
  the learning rate and the rest may change, because checkpoints hold the logical layout and
  restore onto any mesh;
* and a checkpoint to resume from (a fresh start would append a second step 1 to the old
  metrics).

A dir with a `config.json` but no metrics (`convert --from-hf` writes one) holds no run yet:
training from it on other data is fine-tuning, not a second run.

Pure functions over plain dicts (the resolved configs' `to_dict()`); the loop decides when
to call them.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

# What makes two configs the same run. model.remat and model.attention are how a step is
# computed, not what is trained, so they may change on resume.
IDENTITY = {
    "model": None,  # every key but the ones below
    "data": None,
    "train": ("seed",),
}
MODEL_EXECUTION_KEYS = ("remat", "attention")
# Recorded by training itself (`data.run_tokenizer`), which also refuses a resume on another
# tokenizer; a start's config has them empty.
DATA_RECORDED_KEYS = ("tokenizer_kind", "tokenizer_sha256")

FIX = ("pass a fresh --run-dir (`make train RUN=runs/NAME`), or rerun with the run's own "
       "config to resume it")


def identity(config: dict) -> dict[str, Any]:
    """{"section.key": value} of what defines the run (`IDENTITY`)."""
    out: dict[str, Any] = {}
    for section, keys in IDENTITY.items():
        values = config.get(section) or {}
        for key in (keys if keys is not None else sorted(values)):
            if (section, key) in {("model", k) for k in MODEL_EXECUTION_KEYS} | {
                    ("data", k) for k in DATA_RECORDED_KEYS}:
                continue
            out[f"{section}.{key}"] = values.get(key)
    return out


def differences(saved: dict, new: dict) -> list[str]:
    """`"model.layers 4 -> 2"` for each identity key whose value differs."""
    a, b = identity(saved), identity(new)
    return [f"{key} {a.get(key)!r} -> {b.get(key)!r}" for key in sorted(set(a) | set(b))
            if a.get(key) != b.get(key)]


def holds_metrics(run_dir: str) -> bool:
    """True when an earlier run wrote training records in `run_dir`."""
    path = os.path.join(run_dir, "metrics.jsonl")
    return os.path.isfile(path) and os.path.getsize(path) > 0


def saved_config(run_dir: str) -> Optional[dict]:
    """The run dir's `config.json`, or None when it has none that reads."""
    try:
        with open(os.path.join(run_dir, "config.json"), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def another_run(run_dir: str, new_config: dict) -> Optional[str]:
    """The refusal line when `run_dir` holds a run with another model, data or seed.

    Args:
      run_dir: the run dir the start would write to.
      new_config: the starting run's resolved config, as `Config.to_dict()`.

    Returns:
      None when the start may go on (no earlier run's metrics, or the same run).
    """
    if not holds_metrics(run_dir):
        return None
    saved = saved_config(run_dir)
    if saved is None:
        return None
    diff = differences(saved, new_config)
    if not diff:
        return None
    shown = ", ".join(diff[:3]) + (f" and {len(diff) - 3} more" if len(diff) > 3 else "")
    return f"--run-dir {run_dir}: holds another run ({shown}); {FIX}"


def fresh_start_refused(run_dir: str) -> Optional[str]:
    """The refusal line for a start from step 0 in a dir that holds an earlier run's metrics
    (nothing to resume from: a second run would be appended to the first one's records)."""
    if not holds_metrics(run_dir):
        return None
    return (f"--run-dir {run_dir}: holds an earlier run's metrics.jsonl but no checkpoint to "
            f"resume from (checkpoint.every_steps was 0, or it stopped before its first "
            f"save); pass a fresh --run-dir (`make train RUN=runs/NAME`), or delete {run_dir} "
            f"to start over")
