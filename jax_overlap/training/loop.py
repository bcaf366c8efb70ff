"""The training loop: config in, metrics.jsonl and a one-line JSON summary out.

`run(cfg, run_dir)` is what the CLI and the notebooks call. It assembles the run once
(`jax_overlap.training.assemble`: model, plan, mesh, optimizer, the guarded step); the step
lives in `jax_overlap.training.step`, its guards, fault injection and rollback arithmetic beside
it in `training`; this module owns the loop around them: data,
checkpoints, rollbacks, pre-emption, progress, metrics and summary.

Checkpoints (`checkpoint.every_steps` > 0; in `checkpoint.dir`, default <run_dir>/checkpoints):

* On start the newest committed step that verifies is restored onto the *current* mesh, whatever
  mesh saved it, and one line says which step and which newer steps were skipped as corrupt
  (those are quarantined by the checkpointer). Batches and RNG are functions of the state, so
  the resumed run continues the exact stream: rerunning the same command resumes.
* After every accepted step that is a multiple of `every_steps`, an async save; it is committed
  at the next step once written.
* At the end, and on pre-emption, a forced save that is waited for.
* With `checkpoint.local_every` > 0, also a local tier (each process's shards under /dev/shm,
  every N steps, in the background); a restart takes the newest step that verifies in either
  tier. The run dir is locked for the run, and a refused run (lock held, another state layout,
  no checkpoint verifies) leaves it unchanged (`resilience/run_dir_guard.py`,
  docs/guides/fault_tolerance.md).

Pre-emption: SIGTERM or SIGINT lets the step in progress finish, saves, waits for the commit,
prints one line and returns normally, so the CLI exits 0 with `"preempted": true` in the summary.
A second SIGINT interrupts at once. With checkpointing off, nothing is saved (the line says so).

metrics.jsonl (process 0): one record per step attempt, `{"step", "loss", "grad_norm", "lr",
"step_time_s", "tokens_per_s", "batch", ...}` where `step` is the step attempted (1-based) and
`batch` the batch consumed; rejected attempts add `"skipped": true`, `"reason"` and
`"consecutive_bad"`. Events are records with an `"event"` key: `resume`, `rollback` (with
`from_step`, `to_step`, `reason`, `steps_lost`, ...), `preempted`, `eval` (`train.eval_every`:
`eval_loss`, `eval_perplexity`, `eval_tokens`) and `sample` (`train.sample_every`: `prompt`,
`samples`). The same records go to TensorBoard event files
in the run dir (`jax_overlap.training.events`).
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

from jax_overlap.hardware.machine import chip_for_device_kind
from jax_overlap.config import Config, ConfigError
from jax_overlap.data import run_tokenizer
from jax_overlap.overlap import slow_axis
from jax_overlap.resilience import checkpoint as ckptlib
from jax_overlap.resilience import run_dir_guard, run_identity
from jax_overlap.resilience.ckpt_layout import (
    checkpoint_mismatch,
    checkpoint_target,
    from_checkpoint,
    read_markers,
    to_checkpoint,
)
from jax_overlap.training.guard import RollbackPolicy
from jax_overlap.training.assemble import assemble
from jax_overlap.training.guarded_step import rejection_reason
from jax_overlap.training.loop_state import (
    LoopState,
    lr_scale,
    shardings_of,
)
from jax_overlap.resilience.preemption import PreemptionWatcher, agree_to_stop
from jax_overlap.training.rollback import (
    MAX_ROLLBACKS_WITHOUT_PROGRESS,
    RollbackStreak,
    apply_rollback,
    note_rollback,
    plan_rollback,
)
from jax_overlap.resilience.watchdog import Watchdog, jax_board
from jax_overlap.data import streams as datalib
from jax_overlap.training import eval_hook, events, moe_stats, sample_hook
from jax_overlap.training import step as steplib


def peak_flops(device) -> float | None:
    """Peak dense bf16 FLOP/s of `device`, for MFU: its chip in the machine model's table
    (`jax_overlap.hardware.machine.CHIPS`); None on CPU or for a chip the table lacks."""
    if device.platform == "cpu":
        return None
    chip = chip_for_device_kind(getattr(device, "device_kind", ""))
    return chip.peak_bf16_flops if chip is not None else None


class MetricsWriter:
    """metrics.jsonl, one line per record, flushed as written (a crash loses nothing logged);
    with `events_dir`, the same records as TensorBoard scalars (`training.events`)."""

    def __init__(self, path: str, enabled: bool = True, events_dir: str | None = None):
        self.enabled = enabled
        self.path = path
        self.events_dir = events_dir
        # Opened at the first record: a refused run creates no file.
        self._f = None
        self._events = None

    def write(self, record: dict) -> None:
        if self.enabled and self._f is None:
            self._f = open(self.path, "a", buffering=1)
            if self.events_dir:
                self._events = events.EventWriter(self.events_dir)
        if self._f:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()
        if self._events:
            self._events.write(record)

    def close(self) -> None:
        if self._f:
            self._f.close()
        if self._events:
            self._events.close()


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
        names (bring your own model; see docs/guides/custom_models.md). A model with a
        `data_stream(cfg)` method supplies its own batches.

    Returns:
      RunResult; `summary()` adds `rollbacks`, `steps_lost`, `skipped_steps`, `resumed_from`,
      `final_step`, `preempted`, `lr_scale` and `last_checkpoint` to the throughput numbers.

    Raises:
      ConfigError: the checkpoint directory holds a run with another state layout.
    """
    with run_dir_guard.refusals_leave_no_trace(cfg, run_dir):
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
        self.assembled = assemble(cfg, devices, model=model)
        self.mesh, self.model, self.plan = (self.assembled.mesh, self.assembled.model,
                                            self.assembled.plan)
        if model is None:  # before anything is allocated
            run_dir_guard.check_memory(cfg, self.plan)
        self.stream = (self.model.data_stream(cfg) if hasattr(self.model, "data_stream")
                       else datalib.stream_from_config(cfg))
        self.evaluator = eval_hook.from_config(cfg, self.model, self.plan, self.mesh)
        self.sampler = sample_hook.from_config(cfg, self.model, self.plan, self.mesh, run_dir)
        self.last_eval: dict = {}
        # The LR scale changes the schedule, never the optimizer state's structure.
        self.abstract = self.assembled.abstract_loop_state()
        self.shardings = shardings_of(self.abstract)
        self.perm = self.plan.layer_perm
        # What a checkpoint holds: blocks in logical order (no padding of uneven stages).
        self.ckpt_abstract = checkpoint_target(self.abstract, self.perm)
        self.ckpt_shardings = shardings_of(self.ckpt_abstract)
        self.policy = RollbackPolicy(cfg.guard.max_skips, cfg.guard.skip_batches,
                                     cfg.guard.lr_scale_on_rollback)
        # What the run trains with: the config with every `auto` knob resolved by the plan,
        # and the tokenizer its tokens come from (kept in the run dir).
        self.config_dict = self.plan.resolved_config(cfg).to_dict()
        self.tokenizer = None
        if not hasattr(self.model, "data_stream"):
            self.tokenizer = run_tokenizer.of_data(cfg.data)
            self.config_dict["data"].update(run_tokenizer.config_fields(cfg.data, self.tokenizer))
        ck = cfg.checkpoint
        self.ckpt_dir = ck.dir or os.path.join(run_dir, "checkpoints")
        self.ckpt = self.local = None  # opened once the run dir is locked
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
        self.overflow_steps = 0
        self.resumed_from: Optional[int] = None
        self.skipped_checkpoints: list[int] = []
        self._streak = RollbackStreak()
        self._step_fns: dict[float, Any] = {}
        # The LR scale does not enter the initial state; compiled on first use.
        self._initial = self.assembled.initializer()
        if cfg.checkpoint.init_from_hf:  # start (and restart) from Hugging Face weights
            from jax_overlap.hf.convert import initializer_from_hf

            self._initial = initializer_from_hf(self._initial, cfg.checkpoint.init_from_hf,
                                                cfg.model, self.plan, self.shardings)

    # ---- entry point --------------------------------------------------------------------

    def run(self) -> RunResult:
        with run_dir_guard.locked(self.run_dir):
            self.ckpt, self.local = run_dir_guard.open_tiers(self.cfg, self.ckpt_dir, self.mesh)
            return self._run()

    def _run(self) -> RunResult:
        self.writer = MetricsWriter(os.path.join(self.run_dir, "metrics.jsonl"),
                                    enabled=self.is_main, events_dir=self.run_dir)
        try:
            self._refuse_run_dir(run_identity.another_run(self.run_dir, self.config_dict))
            self._check_checkpoint_layout()
        except ConfigError:
            if self.ckpt is not None:
                _close_quietly(self.ckpt)
            raise
        multi = jax.process_count() > 1
        self.watchdog = Watchdog(
            jax_board() if multi else None, jax.process_index(), jax.process_count(),
            self.cfg.distributed.timeout_s)
        try:
            with _preemption_watcher() as self.watcher, self.watchdog:
                try:
                    for line in self.plan.choice_lines():  # every `auto`, and why
                        self._say(line)
                    loop = self._start()
                    self._accept()
                    self.bar = _progress_bar(self.cfg.train.steps, int(self.resumed_from or 0),
                                             enabled=self.progress and self.is_main)
                    loop, host, preempted = self._train(loop)
                    self._finish(loop, host, preempted)
                except BaseException:
                    if self.ckpt is not None and not multi:
                        _close_quietly(self.ckpt)  # commit a save that was already in flight
                    if self.local is not None:
                        _close_quietly(self.local)
                    raise
        finally:
            self.writer.close()
            if hasattr(self.stream, "close"):
                self.stream.close()  # the token loader's reader threads
            if getattr(self, "bar", None) is not None:
                self.bar.close()
        return self._result(host, preempted)

    # ---- start: resume or initialise ----------------------------------------------------

    def _refuse_run_dir(self, problem: str | None) -> None:
        """A run-dir refusal process 0 found (it alone writes metrics.jsonl), on every process.

        Raises:
          ConfigError: `problem` here, or one on another process.
        """
        problem = problem if self.is_main else None
        if not ckptlib.default_collectives().all_true(problem is None):
            raise ConfigError([problem or "--run-dir: process 0 refused the run dir (see its "
                                          "error line)"])

    def _check_checkpoint_layout(self) -> None:
        """Refuse a checkpoint dir written by a run this state cannot restore from.

        Without this, a changed model would make `latest_good` quarantine every step.
        """
        if self.ckpt is None:
            return
        if self.ckpt.committed_steps() and not hasattr(self.model, "data_stream"):
            run_tokenizer.check_resume(self.run_dir, self.tokenizer, self.cfg.data.path)
        markers = read_markers(self.ckpt_dir, self.ckpt.committed_steps())
        mismatch = checkpoint_mismatch(markers, self.ckpt_abstract)
        if not ckptlib.default_collectives().all_true(mismatch is None):
            raise ConfigError([
                f"checkpoint.dir: {self.ckpt_dir}: "
                f"{mismatch or 'another process found an incompatible checkpoint'}; resume with "
                f"the config that saved it, or set checkpoint.dir to a fresh directory"])

    def _start(self) -> LoopState:
        """Resume from the newest step that verifies in either tier, or start at step 0 (in a
        run dir with no earlier run's metrics, or on purpose: `checkpoint.on_unreadable`).

        Nothing in the run dir changes here (a refusal leaves it as it was); `_accept`
        applies the decision (quarantine, events, config.json).
        """
        self._events = []
        if self.ckpt is not None:
            self.watchdog.beat("restore", 0)
            found = run_dir_guard.restore_newest(self.ckpt, self.local, self.ckpt_abstract,
                                             self.cfg.checkpoint.on_unreadable, self.ckpt_dir)
            self.skipped_checkpoints = [s for s, _ in found.skipped]
            self.skipped_reasons = [{"step": s, "reason": r} for s, r in found.skipped]
            self.resumed_tier = found.tier
            if found.state is not None:
                self.resumed_from = found.step
                self._events.append(_resume_line(found.step, found.skipped, self.ckpt_dir)
                                    + (" (local tier)" if found.tier == "local" else ""))
                self._events.append({"event": "resume", "step": found.step, "tier": found.tier,
                                     "skipped": [[s, r] for s, r in found.skipped]})
                return from_checkpoint(found.state, self.perm, self.shardings)
            if found.skipped:
                self._events.append(f"no checkpoint in {self.ckpt_dir} verifies; restarting "
                                    f"from step 0 (checkpoint.on_unreadable=restart)")
                self._events.append({"event": "restart", "step": 0, "skipped": [
                    [s, r] for s, r in found.skipped]})
        if not self._events:  # not a restart on purpose: no earlier run's records to follow
            self._refuse_run_dir(run_identity.fresh_start_refused(self.run_dir))
        return self._initial()

    def _accept(self) -> None:
        """The run is on: from here on it may change the run dir."""
        run_dir_guard.accepted(self.ckpt_dir, self.local)
        if self.ckpt is not None:
            self.ckpt.quarantine_skipped(self.ckpt.last_skipped)
        if self.is_main:
            if not hasattr(self.model, "data_stream"):
                run_tokenizer.save_copy(self.run_dir, self.tokenizer)
            with open(os.path.join(self.run_dir, "config.json"), "w") as f:
                f.write(json.dumps(self.config_dict, indent=2, sort_keys=True))
        for event in self._events:
            if isinstance(event, dict):
                self.writer.write(event)
            else:
                self._say(event)

    # ---- the loop -----------------------------------------------------------------------

    def _optimizer(self, rollbacks: int):
        scale = lr_scale(self.cfg.guard, rollbacks)
        return steplib.make_optimizer(self.cfg.train, scale)

    def _step_fn(self, rollbacks: int) -> tuple[Any, bool]:
        """The guarded step for this rollback count's LR scale; True when freshly built."""
        scale = lr_scale(self.cfg.guard, rollbacks)
        fresh = scale not in self._step_fns
        if fresh:
            self._step_fns = {scale: self.assembled.guarded_step(self._optimizer(rollbacks))}
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
            batch = datalib.place_batch(self.stream, consumed, self.mesh)
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
            overflow = bool(m.get("overflow", False))  # fp16 (training/loss_scale.py)
            if "loss_scale" in m:
                record["loss_scale"] = float(m["loss_scale"])
            record.update(slow_axis.step_record(self.plan, dt, m))
            record.update(moe_stats.step_record(m))
            if accepted:
                self.losses.append(loss)
                if not compiling:
                    self.times.append(dt)
            elif overflow:
                self.overflow_steps += 1
                record.update(skipped=True, skipped_overflow=True, reason="overflow")
            else:
                self.skipped_steps += 1
                record.update(skipped=True, reason=rejection_reason(loss, grad_norm),
                              consecutive_bad=int(m["consecutive_bad"]))
            if self.local is not None:  # the last local save is committed before a step is
                self.local.wait()  # reported done: a kill loses at most the step in flight
            self.writer.write(record)
            if accepted:
                self.bar.update(1)
                self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}",
                                     **self._eval_postfix())
                self._save_if_due(loop, host.step)
                self._evaluate_if_due(loop, host.step)
                self._sample_if_due(loop, host.step)
            compiling = False
            if (not accepted and not overflow
                    and self.policy.should_roll_back(m["consecutive_bad"])):
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
        local_due = self.local is not None and self.local.due(step)
        if due or local_due:
            self.watchdog.beat("save", step)
            loop = to_checkpoint(loop, self.perm, self.ckpt_shardings)
        if local_due:  # first: its background write overlaps the persistent save's start
            self.local.save(loop, step, int(jax.device_get(loop.train.version)))
        # Called after every accepted step, due or not: it also commits a save whose background
        # write has finished, at the first step after, not at the next due save. When not
        # due, maybe_save does not look at the state.
        self.ckpt.maybe_save(loop, self.config_dict, step=step)

    def _evaluate_if_due(self, loop, step: int) -> None:
        if self.evaluator is None or not self.evaluator.due(step):
            return
        self.watchdog.beat("eval", step)
        self.last_eval = self.evaluator.run(loop.train.params)
        self.writer.write({"event": "eval", "step": step, **self.last_eval})
        self.bar.set_postfix(loss=f"{self.losses[-1]:.4f}", **self._eval_postfix())

    def _sample_if_due(self, loop, step: int) -> None:
        if self.sampler is None or not self.sampler.due(step):
            return
        self.watchdog.beat("sample", step)
        self.writer.write({"event": "sample", "step": step,
                           **self.sampler.run(loop.train.params, step)})

    def _eval_postfix(self) -> dict:
        return {"eval": f"{self.last_eval['eval_loss']:.4f}"} if self.last_eval else {}

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
            result = self.ckpt.latest_good(self.ckpt_abstract)
            if result is not None:
                restored = from_checkpoint(result.state, self.perm, self.shardings)
                to_step = result.step
        if self.local is not None:
            self.local.discard_after(to_step if restored is not None else 0)
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
            self.ckpt.maybe_save(to_checkpoint(loop, self.perm, self.ckpt_shardings),
                                 self.config_dict, force=True, step=host.step)
            self.ckpt.close()  # waits for the save and commits it
        if self.local is not None:  # the persistent tier now holds the final state
            self.local.close(remove=True)
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
                 "skipped_checkpoint_reasons": getattr(self, "skipped_reasons", []),
                 "resumed_tier": getattr(self, "resumed_tier", None),
                 "rollbacks": self.rollbacks, "steps_lost": self.steps_lost,
                 "skipped_steps": self.skipped_steps, "skipped_overflow": self.overflow_steps,
                 "lr_scale": lr_scale(self.cfg.guard, host.rollbacks),
                 "preempted": preempted, "last_checkpoint": committed[-1] if committed else None}
        extra.update(self.last_eval)  # eval_loss, eval_perplexity of the last evaluation
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
