"""The training loop: config in, metrics.jsonl and a one-line JSON summary out.

`run(cfg, run_dir)` is what the CLI and the notebooks call. It builds the `ParallelPlan` once;
the step lives in `jax_overlap.training.step`, its guards, fault injection, rollback arithmetic
and watchdog in `jax_overlap.resilience`; this module owns the loop around them: data,
checkpoints, rollbacks, pre-emption, progress, metrics and summary.

Checkpoints (`checkpoint.every_steps` > 0; in `checkpoint.dir`, default <run_dir>/checkpoints):

* On start the newest committed step that verifies is restored onto the *current* mesh, whatever
  mesh saved it, and one line says which step and which newer steps were skipped as corrupt
  (those are quarantined by the checkpointer). Batches and RNG are functions of the state, so
  the resumed run continues the exact stream: rerunning the same command resumes.
* After every accepted step that is a multiple of `every_steps`, an async save; it is committed
  at the next step once written.
* At the end, and on pre-emption, a forced save that is waited for.

Pre-emption: SIGTERM or SIGINT lets the step in progress finish, saves, waits for the commit,
prints one line and returns normally, so the CLI exits 0 with `"preempted": true` in the summary.
A second SIGINT interrupts at once. With checkpointing off, nothing is saved (the line says so).

metrics.jsonl (process 0): one record per step attempt, `{"step", "loss", "grad_norm", "lr",
"step_time_s", "tokens_per_s", "batch", ...}` where `step` is the step attempted (1-based) and
`batch` the batch consumed; rejected attempts add `"skipped": true`, `"reason"` and
`"consecutive_bad"`. Events are records with an `"event"` key: `resume`, `rollback` (with
`from_step`, `to_step`, `reason`, `steps_lost`, ...) and `preempted`.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import jax
import numpy as np

from jax_overlap import model_api
from jax_overlap import plan as plan_lib
from jax_overlap.analysis.machine import chip_for_device_kind
from jax_overlap.config import Config, ConfigError
from jax_overlap.overlap import slow_axis
from jax_overlap.resilience import checkpoint as ckptlib
from jax_overlap.resilience.ckpt_layout import (
    checkpoint_mismatch,
    from_checkpoint,
    read_markers,
    to_checkpoint,
)
from jax_overlap.resilience.guard import RollbackPolicy
from jax_overlap.resilience.guarded_step import make_guarded_step, rejection_reason
from jax_overlap.resilience.loop_state import (
    LoopState,
    abstract_loop_state,
    lr_scale,
    make_initializer,
    shardings_of,
)
from jax_overlap.resilience.preemption import PreemptionWatcher, agree_to_stop
from jax_overlap.resilience.rollback import (
    MAX_ROLLBACKS_WITHOUT_PROGRESS,
    RollbackStreak,
    apply_rollback,
    note_rollback,
    plan_rollback,
)
from jax_overlap.resilience.watchdog import Watchdog, jax_board
from jax_overlap.training import data as datalib
from jax_overlap.training import step as steplib


def peak_flops(device) -> float | None:
    """Peak dense bf16 FLOP/s of `device`, for MFU: its chip in the machine model's table
    (`jax_overlap.analysis.machine.CHIPS`); None on CPU or for a chip the table lacks."""
    if device.platform == "cpu":
        return None
    chip = chip_for_device_kind(getattr(device, "device_kind", ""))
    return chip.peak_bf16_flops if chip is not None else None


class MetricsWriter:
    """metrics.jsonl, one line per record, flushed as written (a crash loses nothing logged)."""

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
    """What one invocation of `run` did (a resumed run reports only its own steps).

    `steps` and `losses` count accepted steps; `first_loss`/`last_loss` are None when the run
    had nothing left to do. `extra` carries the fault-tolerance counters (see `summary`).
    """

    run_dir: str
    steps: int
    first_loss: Optional[float]
    last_loss: Optional[float]
    tokens_per_s: float
    losses: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        out = {"run_dir": self.run_dir, "steps": self.steps, "first_loss": self.first_loss,
               "last_loss": self.last_loss, "tokens_per_s": self.tokens_per_s}
        out.update(self.extra)
        return out


class _Host:
    """Host copies of the loop state's scalars (refreshed from every step's metrics)."""

    __slots__ = ("step", "next_batch", "version", "rollbacks")

    def __init__(self, loop: LoopState):
        got = jax.device_get({"step": loop.train.step, "offset": loop.train.data_offset,
                              "version": loop.train.version, "rollbacks": loop.rollbacks})
        self.step = int(got["step"])
        self.next_batch = self.step + int(got["offset"])
        self.version = int(got["version"])
        self.rollbacks = int(got["rollbacks"])


def run(cfg: Config, run_dir: str, progress: bool = True, devices: list | None = None,
        model: Any = None) -> RunResult:
    """Trains until `cfg.train.steps` updates are applied (resuming, rolling back as needed).

    Args:
      cfg: the resolved config.
      run_dir: where metrics.jsonl, config.json and (by default) checkpoints are written.
      progress: show a progress bar on process 0.
      devices: run on these devices (default: all of the job's; their number must match the mesh).
      model: a `jax_overlap.model_api.StagedModel` to train instead of the one `model.kind`
        names (bring your own model; see docs/custom_models.md). A model with a
        `data_stream(cfg)` method supplies its own batches.

    Returns:
      RunResult; `summary()` adds `rollbacks`, `steps_lost`, `skipped_steps`, `resumed_from`,
      `final_step`, `preempted`, `lr_scale` and `last_checkpoint` to the throughput numbers.

    Raises:
      ConfigError: the checkpoint directory holds a run with another state layout.
    """
    os.makedirs(run_dir, exist_ok=True)
    trainer = _Trainer(cfg, run_dir, progress, devices, model)
    return trainer.run()


class _Trainer:
    """One invocation of `run`: what its steps share (mesh, checkpointer, step function) and
    the counters its summary reports."""

    def __init__(self, cfg: Config, run_dir: str, progress: bool, devices: list | None,
                 model: Any = None):
        self.cfg = cfg
        self.run_dir = run_dir
        self.is_main = jax.process_index() == 0
        self.mesh = plan_lib.mesh_from_config(cfg, devices)
        self.model = model_api.build_model(cfg) if model is None else model
        self.plan = plan_lib.ParallelPlan.build(cfg, self.model,
                                                plan_lib.Target.of_devices(list(self.mesh.devices.flat)))
        self.stream = (self.model.data_stream(cfg) if hasattr(self.model, "data_stream")
                       else datalib.stream_from_config(cfg))
        # The LR scale changes the schedule, never the optimizer state's structure.
        self.abstract = abstract_loop_state(
            self.model, cfg, self.plan, self.mesh, steplib.make_optimizer(cfg.train))
        self.shardings = shardings_of(self.abstract)
        self.perm = self.plan.layer_perm
        self.policy = RollbackPolicy(cfg.guard.max_skips, cfg.guard.skip_batches,
                                     cfg.guard.lr_scale_on_rollback)
        # What the run trains with: the config with every `auto` knob resolved by the plan.
        self.config_dict = self.plan.resolved_config(cfg).to_dict()
        ck = cfg.checkpoint
        self.ckpt_dir = ck.dir or os.path.join(run_dir, "checkpoints")
        self.ckpt = None
        if ck.every_steps > 0:
            self.ckpt = ckptlib.Checkpointer(
                ckptlib.CheckpointOptions(dir=self.ckpt_dir, every_steps=ck.every_steps,
                                          keep=ck.keep, async_save=ck.async_save), self.mesh)
        self.progress = progress
        self.tokens_per_step = cfg.train.global_batch * cfg.model.seq_len
        self.flops_per_step = self.model.flops_per_example() * cfg.train.global_batch
        self.peak = peak_flops(jax.devices()[0])
        # Counters of this invocation.
        self.losses: list[float] = []
        self.times: list[float] = []
        self.rollbacks = 0
        self.steps_lost = 0
        self.skipped_steps = 0
        self.resumed_from: Optional[int] = None
        self.skipped_checkpoints: list[int] = []
        self._streak = RollbackStreak()
        self._step_fns: dict[float, Any] = {}
        # The LR scale does not enter the initial state; compiled on first use.
        self._initial = make_initializer(self.model, cfg, self.plan, self.mesh,
                                         steplib.make_optimizer(cfg.train))

    # ---- entry point --------------------------------------------------------------------

    def run(self) -> RunResult:
        if self.is_main:
            with open(os.path.join(self.run_dir, "config.json"), "w") as f:
                f.write(json.dumps(self.config_dict, indent=2, sort_keys=True))
        try:
            self._check_checkpoint_layout()
        except ConfigError:
            if self.ckpt is not None:
                _close_quietly(self.ckpt)
            raise
        self.writer = MetricsWriter(os.path.join(self.run_dir, "metrics.jsonl"),
                                    enabled=self.is_main)
        multi = jax.process_count() > 1
        self.watchdog = Watchdog(
            jax_board() if multi else None, jax.process_index(), jax.process_count(),
            self.cfg.distributed.timeout_s)
        try:
            with _preemption_watcher() as self.watcher, self.watchdog:
                try:
                    loop = self._start()
                    self.bar = _progress_bar(self.cfg.train.steps, int(self.resumed_from or 0),
                                             enabled=self.progress and self.is_main)
                    loop, host, preempted = self._train(loop)
                    self._finish(loop, host, preempted)
                except BaseException:
                    if self.ckpt is not None and not multi:
                        _close_quietly(self.ckpt)  # commit a save that was already in flight
                    raise
        finally:
            self.writer.close()
            if getattr(self, "bar", None) is not None:
                self.bar.close()
        return self._result(host, preempted)

    # ---- start: resume or initialise ----------------------------------------------------

    def _check_checkpoint_layout(self) -> None:
        """Refuse a checkpoint dir written by a run this state cannot restore from.

        Without this, a changed model would make `latest_good` quarantine every step.
        """
        if self.ckpt is None:
            return
        markers = read_markers(self.ckpt_dir, self.ckpt.committed_steps())
        mismatch = checkpoint_mismatch(markers, self.abstract)
        if not ckptlib.default_collectives().all_true(mismatch is None):
            raise ConfigError([
                f"checkpoint.dir: {self.ckpt_dir}: "
                f"{mismatch or 'another process found an incompatible checkpoint'}; resume with "
                f"the config that saved it, or set checkpoint.dir to a fresh directory"])

    def _start(self) -> LoopState:
        if self.ckpt is not None:
            self.watchdog.beat("restore", 0)
            had_checkpoints = bool(self.ckpt.committed_steps())
            result = self.ckpt.latest_good(self.abstract)
            if result is not None:
                self.resumed_from = result.step
                self.skipped_checkpoints = [s for s, _ in result.skipped]
                self._say(_resume_line(result.step, result.skipped, self.ckpt_dir))
                self.writer.write({"event": "resume", "step": result.step,
                                   "skipped": [[s, r] for s, r in result.skipped]})
                return from_checkpoint(result.state, self.perm, self.shardings)
            if had_checkpoints:
                self._say(f"no checkpoint in {self.ckpt_dir} verifies (see the warnings above); "
                          f"starting from step 0")
        return self._initial()

    # ---- the loop -----------------------------------------------------------------------

    def _optimizer(self, rollbacks: int):
        scale = lr_scale(self.cfg.guard, rollbacks)
        return steplib.make_optimizer(self.cfg.train, scale)

    def _step_fn(self, rollbacks: int) -> tuple[Any, bool]:
        """The guarded step for this rollback count's LR scale; True when freshly built."""
        scale = lr_scale(self.cfg.guard, rollbacks)
        fresh = scale not in self._step_fns
        if fresh:
            self._step_fns = {scale: make_guarded_step(
                self.model, self.cfg, self.plan, self.mesh, self._optimizer(rollbacks))}
        return self._step_fns[scale], fresh

    def _train(self, loop):
        """Steps until done or pre-empted; returns (loop, host scalars, preempted)."""
        host = _Host(loop)
        step_fn, compiling = self._step_fn(host.rollbacks)
        scale = lr_scale(self.cfg.guard, host.rollbacks)
        while host.step < self.cfg.train.steps:
            self.watchdog.beat("compile" if compiling else "step", host.step)
            # Collective with several processes: all of them stop after the same step.
            if agree_to_stop(self.watcher.stop_requested(), host.step):
                return loop, host, True
            attempted, consumed = host.step + 1, host.next_batch
            batch = steplib.put_batch(self.stream.batch(consumed), self.mesh)
            t0 = time.perf_counter()
            loop, metrics = step_fn(loop, batch)
            m = jax.device_get(metrics)  # blocks until the step is done
            dt = time.perf_counter() - t0
            host.step, host.next_batch = int(m["step"]), int(m["next_batch"])
            host.version = int(m["version"])
            accepted = bool(m["accepted"])
            loss, grad_norm = float(m["loss"]), float(m["grad_norm"])
            record = {"step": attempted, "loss": loss, "grad_norm": grad_norm,
                      "lr": float(m["lr"]) * scale, "step_time_s": dt,  # effective LR
                      "tokens_per_s": self.tokens_per_step / dt, "batch": consumed}
            if self.peak:
                record["mfu"] = self.flops_per_step / (dt * self.peak * jax.device_count())
            record.update(slow_axis.step_record(self.plan, dt, m))
            if accepted:
                self.losses.append(loss)
                if not compiling:
                    self.times.append(dt)
            else:
                self.skipped_steps += 1
                record.update(skipped=True, reason=rejection_reason(loss, grad_norm),
                              consecutive_bad=int(m["consecutive_bad"]))
            self.writer.write(record)
            if accepted:
                self.bar.update(1)
                self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
                self._save_if_due(loop, host.step)
            compiling = False
            if not accepted and self.policy.should_roll_back(m["consecutive_bad"]):
                reason = (f"{int(m['consecutive_bad'])} consecutive rejected steps "
                          f"(last: {record['reason']}, loss {loss:.4g})")
                loop = metrics = batch = None  # let the old state go before restoring
                loop, host = self._roll_back(host, reason)
                step_fn, compiling = self._step_fn(host.rollbacks)
                scale = lr_scale(self.cfg.guard, host.rollbacks)
        return loop, host, False

    def _save_if_due(self, loop, step: int) -> None:
        if self.ckpt is None:
            return
        due = step % self.ckpt.options.every_steps == 0
        if due:
            self.watchdog.beat("save", step)
            loop = to_checkpoint(loop, self.perm, self.shardings)
        # Called after every accepted step, due or not: it also commits a save whose background
        # write has finished, at the first step after, not at the next due save. When not
        # due, maybe_save does not look at the state.
        self.ckpt.maybe_save(loop, self.config_dict, step=step)

    # ---- rollback -----------------------------------------------------------------------

    def _roll_back(self, host: _Host, reason: str):
        from_step = host.step
        self._streak = note_rollback(self._streak, from_step)
        if self._streak.stalled > MAX_ROLLBACKS_WITHOUT_PROGRESS:
            raise RuntimeError(
                f"giving up: {self._streak.stalled} rollbacks in a row without getting past "
                f"step {self._streak.furthest} ({reason}); lower train.lr or inspect the data "
                f"around batch {host.next_batch}")
        self.watchdog.beat("rollback", from_step)
        restored = None
        if self.ckpt is not None:
            result = self.ckpt.latest_good(self.abstract)
            if result is not None:
                restored = from_checkpoint(result.state, self.perm, self.shardings)
                to_step = result.step
        if restored is None:
            # No checkpoint (off, or none verifies yet): the initial state is reproducible
            # from the seed and is the checkpoint at step 0.
            restored = self._initial()
            to_step = 0
        plan = plan_rollback(from_step, host.next_batch, to_step,
                             self.cfg.guard.skip_batches, reason)
        rollbacks = host.rollbacks + 1
        loop = apply_rollback(restored, plan, host.version + 1, rollbacks,
                              self.shardings)
        self.rollbacks += 1
        self.steps_lost += plan.steps_lost
        scale = lr_scale(self.cfg.guard, rollbacks)
        self.writer.write({"event": "rollback", "from_step": from_step, "to_step": to_step,
                           "reason": reason, "steps_lost": plan.steps_lost,
                           "resume_batch": plan.resume_batch, "data_offset": plan.data_offset,
                           "rollbacks": rollbacks, "lr_scale": scale,
                           "from_checkpoint": self.ckpt is not None and to_step > 0})
        self._say(f"rollback: step {from_step} -> {to_step} ({reason}); continuing at batch "
                  f"{plan.resume_batch} with lr scale {scale:g}")
        self.bar.update(-plan.steps_lost)
        return loop, _Host(loop)

    # ---- the end ------------------------------------------------------------------------

    def _finish(self, loop, host: _Host, preempted: bool) -> None:
        if preempted:
            sig = self.watcher.received
            why = signal.Signals(sig).name if sig is not None else "a signal on another process"
            self.writer.write({"event": "preempted", "step": host.step, "signal": why})
        if self.ckpt is not None:
            self.watchdog.beat("save", host.step)
            self.ckpt.maybe_save(to_checkpoint(loop, self.perm, self.shardings),
                                 self.config_dict, force=True, step=host.step)
            self.ckpt.close()  # waits for the save and commits it
        if preempted:
            if self.ckpt is not None:
                saved = (f"checkpoint step {host.step} committed in {self.ckpt_dir}; rerun the "
                         f"same command to resume")
            else:
                saved = "checkpointing is off (checkpoint.every_steps=0): nothing was saved"
            self._say(f"pre-empted by {why} after step {host.step}: {saved}")

    def _result(self, host: _Host, preempted: bool) -> RunResult:
        steady = self.times or [float("nan")]
        median = float(np.median(steady))
        tokens_per_s = (self.tokens_per_step * len(self.times) / sum(self.times)
                        if self.times else 0.0)
        committed = self.ckpt.committed_steps() if self.ckpt is not None else []
        extra = {"mesh": self.plan.axis_sizes,
                 "median_step_time_s": median if self.times else None,
                 "final_step": host.step, "resumed_from": self.resumed_from,
                 "skipped_checkpoints": self.skipped_checkpoints,
                 "rollbacks": self.rollbacks, "steps_lost": self.steps_lost,
                 "skipped_steps": self.skipped_steps,
                 "lr_scale": lr_scale(self.cfg.guard, host.rollbacks),
                 "preempted": preempted, "last_checkpoint": committed[-1] if committed else None}
        if self.peak and self.times:
            extra["mfu"] = self.flops_per_step / (median * self.peak * jax.device_count())
        losses = self.losses
        return RunResult(self.run_dir, len(losses), losses[0] if losses else None,
                         losses[-1] if losses else None, tokens_per_s, losses, extra)

    def _say(self, line: str) -> None:
        if self.is_main:
            print(line, flush=True)


def _resume_line(step: int, skipped: list, ckpt_dir: str) -> str:
    line = f"resuming from checkpoint step {step} in {ckpt_dir}"
    if skipped:
        parts = ", ".join(f"step {s} ({reason})" for s, reason in skipped)
        line += f"; skipped as corrupt or uncommitted: {parts}"
    return line


def _close_quietly(ckpt) -> None:
    try:
        ckpt.close()
    except Exception:  # noqa: BLE001 - the original error is the one to report
        pass


class _NoSignals:
    """Stands in for the signal module off the main thread, where handlers cannot be set."""

    @staticmethod
    def signal(signum, handler):
        return None


def _preemption_watcher() -> PreemptionWatcher:
    if threading.current_thread() is threading.main_thread():
        return PreemptionWatcher()
    return PreemptionWatcher(signal_module=_NoSignals())


def _progress_bar(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc="train", unit="step",
                dynamic_ncols=True)
