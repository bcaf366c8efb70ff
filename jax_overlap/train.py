"""The training loop: config in, metrics.jsonl and a one-line JSON summary out.

`run(cfg, run_dir)` is what the CLI and the notebooks call. The step itself lives in
`jax_overlap.step`; this module owns the loop around it: data, progress, metrics, summary.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from jax_overlap import data as datalib
from jax_overlap import step as steplib
from jax_overlap.config import Config
from jax_overlap.mesh import mesh_from_config
from jax_overlap.train_state import batch_index


def build_model(cfg: Config):
    """The StagedModel a config names."""
    kind = cfg.model.kind
    if kind == "gpt":
        from models.gpt import GPT

        return GPT.from_config(cfg.model)
    if kind == "bert":
        from models.bert import BERT

        return BERT.from_config(cfg.model)
    if kind == "resnet":
        from models.resnet import ResNetModel

        return ResNetModel.from_config(cfg)
    raise ValueError(f"model.kind: unknown model {kind!r}")


# Peak dense bf16 FLOP/s by device kind, for MFU on accelerators (published spec sheets).
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "H800": 989e12, "B200": 2250e12}


def peak_flops(device) -> float | None:
    if device.platform == "cpu":
        return None
    kind = getattr(device, "device_kind", "")
    for name, flops in PEAK_FLOPS.items():
        if name in kind:
            return flops
    return None


class MetricsWriter:
    """metrics.jsonl, one line per step, flushed as written (a crash loses nothing logged)."""

    def __init__(self, path: str, enabled: bool = True):
        self.enabled = enabled
        self._f = open(path, "a", buffering=1) if enabled else None

    def write(self, record: dict) -> None:
        if self._f:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f:
            self._f.close()


@dataclass
class RunResult:
    run_dir: str
    steps: int
    first_loss: float
    last_loss: float
    tokens_per_s: float
    losses: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        out = {"run_dir": self.run_dir, "steps": self.steps, "first_loss": self.first_loss,
               "last_loss": self.last_loss, "tokens_per_s": self.tokens_per_s}
        out.update(self.extra)
        return out


def run(cfg: Config, run_dir: str, progress: bool = True, devices: list | None = None
        ) -> RunResult:
    """Trains `cfg.train.steps` steps; returns the losses and throughput.

    Args:
      cfg: the resolved config.
      run_dir: where metrics.jsonl, config.json (and checkpoints) are written.
      progress: show a progress bar on process 0.
      devices: run on these devices (default: all of the job's; their number must match the mesh).
    """
    os.makedirs(run_dir, exist_ok=True)
    is_main = jax.process_index() == 0
    mesh = mesh_from_config(cfg, devices)
    model = build_model(cfg)
    stream = datalib.stream_from_config(cfg)
    optimizer = steplib.make_optimizer(cfg.train)
    state = steplib.init_state(model, cfg, mesh, optimizer)
    train_step = steplib.make_train_step(model, cfg, mesh, optimizer)
    if is_main:
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            f.write(json.dumps(cfg.to_dict(), indent=2, sort_keys=True))

    tokens_per_step = cfg.train.global_batch * cfg.model.seq_len
    flops_per_step = model.flops_per_example() * cfg.train.global_batch
    peak = peak_flops(jax.devices()[0])
    writer = MetricsWriter(os.path.join(run_dir, "metrics.jsonl"), enabled=is_main)
    bar = _progress_bar(cfg.train.steps, enabled=progress and is_main)
    losses, times = [], []
    try:
        while int(state.step) < cfg.train.steps:
            step = int(state.step)
            batch = steplib.put_batch(stream.batch(int(batch_index(state))), mesh)
            t0 = time.perf_counter()
            state, metrics = train_step(state, batch)
            loss = float(metrics["loss"])  # blocks until the step is done
            dt = time.perf_counter() - t0
            losses.append(loss)
            times.append(dt)
            record = {"step": step + 1, "loss": loss, "grad_norm": float(metrics["grad_norm"]),
                      "lr": float(metrics["lr"]), "step_time_s": dt,
                      "tokens_per_s": tokens_per_step / dt}
            if peak:
                record["mfu"] = flops_per_step / (dt * peak * jax.device_count())
            writer.write(record)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
    finally:
        bar.close()
        writer.close()
    # The first step includes compilation; throughput is reported over the rest.
    steady = times[1:] or times
    tokens_per_s = tokens_per_step * len(steady) / sum(steady)
    extra = {"mesh": {"dp": cfg.mesh.dp, "pp": cfg.mesh.pp, "tp": cfg.mesh.tp},
             "median_step_time_s": float(np.median(steady))}
    if peak:
        extra["mfu"] = flops_per_step / (float(np.median(steady)) * peak * jax.device_count())
    return RunResult(run_dir, len(losses), losses[0], losses[-1], tokens_per_s, losses, extra)


def _progress_bar(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, desc="train", unit="step", dynamic_ncols=True)
