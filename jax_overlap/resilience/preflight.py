"""Checks a training run must pass before JAX allocates anything: paths and memory.

Pure Python, no JAX import: the CLI runs them before the backend starts, the training loop
again (with the device's real memory) before it builds the state. Each returns a list of
problems, one line each naming the path or field and the fix (empty: go ahead); the caller
raises them as one `ConfigError`, so a refused run ends in exit code 2 and touches nothing.

* `path_problems`: the run dir and the checkpoint dir must be (or be creatable as)
  writable directories.
* `memory_problems`: the estimated per-device bytes of the step (parameters, gradients,
  optimizer state, activations as the schedule and remat policy keep them, communication
  buffers; `jax_overlap.hardware.memory`) and the host bytes of the data pipeline, against
  the device's memory (a GPU's `bytes_limit`) or, on CPU where every device shares the host,
  the host's RAM. The estimate is deliberately rough; a run is refused only when it is over
  the memory outright (not over a budget), so a refusal is certain to be right.
"""

from __future__ import annotations

import os
from typing import Optional

GIB = 1 << 30


# ---------------------------------------------------------------------------------- paths


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def _dir_problem(path: str, what: str, fix: str) -> Optional[str]:
    """Why `path` cannot be used as a writable directory (None: it can)."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{what} {path}: is a file, not a directory; {fix}"
    base = _nearest_existing(path)
    if not os.path.isdir(base):
        return f"{what} {path}: {base} is a file, not a directory; {fix}"
    if not os.access(base, os.W_OK | os.X_OK):
        why = "is on a read-only filesystem" if _read_only_fs(base) else "is not writable"
        return f"{what} {path}: {base} {why}; {fix}"
    return None


def _read_only_fs(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def path_problems(run_dir: str, checkpoint_dir: str, checkpointing: bool) -> list[str]:
    """The run dir and (when checkpointing) the checkpoint dir must be writable directories.

    Args:
      run_dir: `--run-dir`.
      checkpoint_dir: `checkpoint.dir`, resolved (default <run_dir>/checkpoints).
      checkpointing: whether checkpoint.every_steps > 0.
    """
    out = []
    bad = _dir_problem(run_dir, "--run-dir", "pass a writable directory (it is created if "
                                             "missing)")
    if bad:
        return [bad]
    if checkpointing:
        bad = _dir_problem(checkpoint_dir, "checkpoint.dir:",
                           "set checkpoint.dir to a writable directory")
        if bad:
            out.append(bad)
    return out


def out_file_problem(path: str, flag: str) -> Optional[str]:
    """Why a command could not write its output file `path` (None: it can): the file's
    directory must be (or be creatable as) a writable directory. Checked before the command
    does its work, so a bad `--out` is refused at once."""
    fix = "pick a file path in a writable directory"
    if os.path.isdir(path):
        return f"{flag} {path}: is a directory, not a file; {fix}"
    return _dir_problem(os.path.dirname(os.path.abspath(path)), f"{flag} {path}:", fix)


# --------------------------------------------------------------------------------- memory


def host_memory_bytes() -> Optional[int]:
    """Physical RAM of this host (None where unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def device_step_parts(model, train, plan) -> dict[str, float]:
    """Estimated peak bytes per device of one train step, by part.

    Args:
      model: `cfg.model` (a GPT/BERT-shaped transformer).
      train: `cfg.train` (precision).
      plan: the `ParallelPlan` (mesh sizes, micro batch, remat, overlap choices).

    Returns:
      {"state": parameters + gradients + optimizer moments, "activations": what the schedule
      and remat policy keep for the backward plus the logits, "comm": communication buffers}.
    """
    from jax_overlap.hardware.memory import dtype_bytes, plan_step_memory, routed_expert_elements

    ov = plan.overlap
    # The plan's own estimate (the one its auto microbatches and remat policy were chosen by).
    mem = plan_step_memory(model, train.precision, plan)
    tokens = plan.micro_batch * model.seq_len
    act_bytes = dtype_bytes(train.precision)
    _, block = plan.param_elements
    comm = 2.0 * ov.grad_bucket_bytes  # a bucket being filled and one being reduced
    if ov.fsdp:
        # gathered blocks in flight (mesh.ep > 1: the routed experts stay out of the window)
        window = block - (routed_expert_elements(model) if plan.ep > 1 else 0.0)
        comm += (ov.window + 1) * window / plan.tp * 4
    if plan.pp > 1:
        comm += 2 * tokens * model.d_model * act_bytes * plan.transfer_latency
    return {"state": mem.state, "activations": mem.kept + mem.work, "comm": float(comm)}


def host_data_bytes(model, train, data) -> float:
    """Host bytes the data pipeline holds: one global batch (uint8 windows, int32 copy) and,
    for synthetic data, the generated corpus (int64)."""
    batch = train.global_batch * (model.seq_len + 1) * (1 + 4)
    corpus = 0.0
    if data.source == "synthetic":
        corpus = max(100_000, 4 * model.seq_len * train.global_batch) * 8 * 3
    elif data.source in ("stdlib", "file"):
        corpus = float(data.max_bytes)
    return float(batch + corpus)


def _gib(x: float) -> str:
    return f"{x / GIB:.3g} GiB"


def memory_problems(model, train, data, plan, *, device_bytes: Optional[float],
                    local_devices: int, host_bytes: Optional[float]) -> list[str]:
    """Whether the step and the data fit; one line naming the field to change when not.

    Args:
      model, train, data: `cfg.model`, `cfg.train`, `cfg.data`.
      plan: the `ParallelPlan` (model may be None in it).
      device_bytes: one device's memory (a GPU's bytes_limit); None on CPU, where the
        devices share the host's RAM.
      local_devices: devices of this process (on CPU they all draw on host RAM).
      host_bytes: the host's RAM (None: unknown, no host check).
    """
    out = []
    data_bytes = host_data_bytes(model, train, data)
    parts = None
    if model.kind in ("gpt", "bert"):
        parts = device_step_parts(model, train, plan)
        need = sum(parts.values())
        detail = (f"parameters, gradients and optimizer state {_gib(parts['state'])}, "
                  f"activations {_gib(parts['activations'])}, comm buffers "
                  f"{_gib(parts['comm'])}")
        budget = device_bytes or (host_bytes / max(1, local_devices) if host_bytes else None)
        if budget and parts["state"] > budget / 2:  # the model itself is too big
            embed, block = plan.param_elements
            field = "model.layers" if model.layers * block >= embed else "model.d_model"
            fix = ("shrink the model (model.layers, model.d_model, model.d_ff, model.vocab) "
                   "or split it further (mesh.pp, mesh.tp, overlap.param_sharding=fsdp)")
        else:
            fix = ("lower train.global_batch, raise pipeline.microbatches or set "
                   "model.remat=full")
            field = "train.global_batch"
        if device_bytes:
            if need > device_bytes:
                out.append(f"{field}: the step needs ~{_gib(need)} per device ({detail}) but a "
                           f"device has {_gib(device_bytes)}; {fix}")
                return out
        elif host_bytes and need * local_devices + data_bytes > host_bytes:
            out.append(f"{field}: the step needs ~{_gib(need)} per device x {local_devices} "
                       f"CPU devices ({detail}) but the host has {_gib(host_bytes)} of RAM; "
                       f"{fix}")
            return out
    if host_bytes and data_bytes > host_bytes:
        out.append(f"train.global_batch: {train.global_batch} sequences of "
                   f"{model.seq_len + 1} tokens need ~{_gib(data_bytes)} of host memory for "
                   f"one batch, more than the host's {_gib(host_bytes)}; lower "
                   f"train.global_batch")
    return out
