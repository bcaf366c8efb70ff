"""Fault tolerance around the train step: guarded steps, injected faults, rollbacks, a watchdog.

The training loop (`jax_overlap.training.loop`) composes these; each piece is usable and testable alone.

**What the loop carries.** `LoopState` = the `TrainState`, the step guard's `GuardState` and the
number of rollbacks in the run's history. It is also what a checkpoint holds, so a resumed run
makes the same accept/reject decisions, uses the same learning-rate scale and replays the same
injected faults as a run that was never interrupted (the guard's loss window is a few floats;
rebuilding it empty instead would switch spike detection off for `window // 2` steps after every
restart and make resumed runs diverge from uninterrupted ones whenever a spike is near).

**Step semantics** (`make_guarded_step`). One call consumes exactly one batch, accepted or not:

* accepted: `step` and `version` +1, params and optimizer state updated, the loss enters the
  guard's window;
* rejected (non-finite loss or gradients, or a loss spike): params, optimizer state (moments and
  Adam's count, hence the LR schedule), `step` and `version` are untouched; `data_offset` +1, so
  the next attempt at the same step reads the next batch; `guard.consecutive_bad` +1.

So `step` always counts applied updates (`train.steps` is the number of updates a run applies)
and `batch_index = step + data_offset` counts batches consumed.

**Rollback** (`plan_rollback`, `apply_rollback`). After more than `guard.max_skips` rejected
steps in a row the loop restores the newest good checkpoint (or, with none, the initial state,
which the seed reproduces exactly: it is the implicit checkpoint at step 0) and moves the data
position `guard.skip_batches` past the last batch consumed, so the replayed steps never see the
batches around the blow-up again. `version` moves past every version the run has used, the guard
keeps its restored window with the bad streak cleared, `rollbacks` +1, and the learning rate is
scaled by `guard.lr_scale_on_rollback ** rollbacks`.

**Injected faults** (`make_fault_hook`). `fault.nan_at_step=k` / `fault.spike_at_step=j` make
every attempt at that step produce a NaN loss and gradients / a loss and gradients
`SPIKE_FACTOR` times too large, until the run has rolled back once per fault up to and including
this one. Each fault therefore forces exactly one rollback (with guards on), and the plan is a
pure function of the state, so a killed and resumed drill replays it exactly.

**Multi-process.** Accept/reject and the rollback decision are computed in-graph from replicated
values, so every process takes them identically without exchanging anything; the step to
restore is agreed by `Checkpointer.latest_good`. What JAX 0.12 offers for lost processes, and
what the `Watchdog` adds:

* a process killed outright: the coordination service notices missing heartbeats after
  `heartbeat_timeout_seconds` (`mesh.init_distributed` passes `max(10, timeout_s // 10)`) and
  aborts every other process with "The following tasks are unhealthy (stopped sending
  heartbeats): <ids>". On CPU, gloo fails the next collective sooner ("Connection closed by
  peer <address>", no process id); the watchdog then names the process whose beat stopped;
* a process that raised: its peers would wait in the next collective until JAX's shutdown
  barrier times out (300 s, measured) and then abort; the watchdog publishes the error and
  every other process stops within a poll, naming it;
* a process alive but stuck: the watchdog stops the others after `distributed.timeout_s`
  without progress, naming the processes that are elsewhere.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable, Iterable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_overlap.resilience.guard import (
    GuardState,
    guard_init,
    guard_update,
    select_tree,
)
from jax_overlap.training import step as steplib
from jax_overlap.training.state import TrainState, batch_index

# --------------------------------------------------------------------------------------------
# What the loop carries and checkpoints


class LoopState(NamedTuple):
    """The train state plus everything else a bit-exact resume needs.

    `step` and `version` forward to the train state, which is what `Checkpointer` keys on.
    """

    train: TrainState
    guard: GuardState
    rollbacks: jax.Array  # int32 scalar: rollbacks in this run's history

    @property
    def step(self) -> jax.Array:
        return self.train.step

    @property
    def version(self) -> jax.Array:
        return self.train.version


def _replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def loop_shardings(model, cfg, plan, mesh, optimizer) -> LoopState:
    """NamedSharding of every leaf of the `LoopState` on `mesh` (extras are replicated).

    Args:
      model, plan, mesh, optimizer: as for `step.init_state`; cfg: the run's config.

    Returns:
      A LoopState of shardings.
    """
    abstract_params = jax.eval_shape(model.init, jax.random.key(cfg.train.seed))
    train = steplib.state_shardings(model, mesh, optimizer, abstract_params, plan.layout)
    rep = _replicated(mesh)
    guard = GuardState(losses=rep, count=rep, consecutive_bad=rep)
    return LoopState(train=train, guard=guard, rollbacks=rep)


def abstract_loop_state(model, cfg, plan, mesh, optimizer) -> LoopState:
    """ShapeDtypeStructs with the current mesh's shardings: the target a checkpoint restores to.

    Shapes come from tracing `init_state` (so they follow whatever layout it builds) and
    shardings from `loop_shardings`; nothing is allocated.
    """
    train = jax.eval_shape(lambda: steplib.init_state(model, plan, mesh, optimizer,
                                                      cfg.train.seed))
    shapes = LoopState(train=train, guard=jax.eval_shape(lambda: guard_init(cfg.guard.window)),
                       rollbacks=jax.ShapeDtypeStruct((), jnp.int32))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, loop_shardings(model, cfg, plan, mesh, optimizer))


def shardings_of(abstract: Any) -> Any:
    return jax.tree.map(lambda a: a.sharding, abstract)


def make_initializer(model, cfg, plan, mesh, optimizer) -> Callable[[], LoopState]:
    """`() -> LoopState`: the run's initial state, compiled once however often it is called.

    `init_state` plus an empty guard and no rollbacks, built directly in its sharded layout.
    A rollback with no checkpoint to go back to calls it again, hence the single compile.
    """
    def build():
        train = steplib.init_state(model, plan, mesh, optimizer, cfg.train.seed)
        return LoopState(train, guard_init(cfg.guard.window), jnp.zeros((), jnp.int32))

    return jax.jit(build, out_shardings=loop_shardings(model, cfg, plan, mesh, optimizer))


def init_loop_state(model, cfg, plan, mesh, optimizer) -> LoopState:
    """The run's initial state (see `make_initializer`)."""
    return make_initializer(model, cfg, plan, mesh, optimizer)()


def lr_scale(guard_cfg, rollbacks: int) -> float:
    """The learning-rate factor after `rollbacks` rollbacks (compounding)."""
    return float(guard_cfg.lr_scale_on_rollback) ** int(rollbacks)


# --------------------------------------------------------------------------------------------
# Checkpoint layout: params are stored in the logical layer order, whatever the pipeline does


def to_checkpoint(loop: LoopState, perm: Optional[np.ndarray], shardings: LoopState) -> LoopState:
    """The tree to save: blocks in logical order, so any mesh and schedule can restore it.

    This and `from_checkpoint` are the only places where the runtime layout and the
    checkpoint layout differ.
    """
    if perm is None:
        return loop
    from jax_overlap.pipeline import layout

    return jax.jit(lambda t: layout.to_logical(t, perm), out_shardings=shardings)(loop)


def from_checkpoint(tree: LoopState, perm: Optional[np.ndarray], shardings: LoopState) -> LoopState:
    """Inverse of `to_checkpoint`: a restored tree in this run's (staged) layout."""
    if perm is None:
        return tree
    from jax_overlap.pipeline import layout

    return jax.jit(lambda t: layout.to_staged(t, perm), out_shardings=shardings)(tree)


def checkpoint_mismatch(markers: Iterable[tuple[int, dict]], abstract: Any) -> Optional[str]:
    """Why no committed checkpoint can restore into `abstract`, or None if one may.

    Compares leaf names, shapes and dtypes with the `checksums` table of each commit marker
    (global shapes, so a different mesh still matches). Used before `latest_good`, which would
    otherwise treat a run started with another model or optimizer as "every checkpoint is
    corrupt" and quarantine them all.

    Args:
      markers: (step, parsed COMMITTED marker) pairs, newest first; unparsable ones left out.
      abstract: the restore target.

    Returns:
      None when some marker matches or there is none; else a one-line description of how the
      newest marker differs.
    """
    expected = {jax.tree_util.keystr(path): (list(leaf.shape), str(leaf.dtype))
                for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    first = None
    for step, marker in markers:
        table = marker.get("checksums") if isinstance(marker, dict) else None
        if not isinstance(table, dict):
            continue
        saved = {name: (list(e.get("shape", [])), str(e.get("dtype"))) for name, e in table.items()}
        if saved == expected:
            return None
        if first is None:
            first = (step, saved)
    if first is None:
        return None
    step, saved = first
    extra, missing = sorted(set(saved) - set(expected)), sorted(set(expected) - set(saved))
    if extra or missing:
        what = (f"it has {extra[0]} which this run lacks" if extra
                else f"it lacks {missing[0]} which this run has")
    else:
        name = next(n for n in sorted(expected) if saved[n] != expected[n])
        what = (f"{name} is {saved[name][1]}{saved[name][0]} there, "
                f"{expected[name][1]}{expected[name][0]} here")
    return f"checkpoint step {step} was saved with a different model/optimizer/guard layout: {what}"


def read_markers(ckpt_dir: str, steps: Iterable[int]) -> list[tuple[int, dict]]:
    """(step, marker) for every given step whose COMMITTED marker parses, newest first."""
    from jax_overlap.resilience.checkpoint import MARKER_NAME

    out = []
    for step in sorted(steps, reverse=True):
        try:
            with open(os.path.join(ckpt_dir, str(step), MARKER_NAME), encoding="utf-8") as f:
                out.append((step, json.load(f)))
        except (OSError, ValueError):
            continue  # latest_good reports unreadable markers itself
    return out


# --------------------------------------------------------------------------------------------
# Fault injection

NAN, SPIKE = "nan", "spike"
SPIKE_FACTOR = 100.0  # far above any plausible spike_sigma threshold of a healthy window


class Fault(NamedTuple):
    step: int
    kind: str  # NAN or SPIKE


def planned_faults(fault_cfg) -> tuple[Fault, ...]:
    """The faults a `FaultConfig` asks for, in step order (ties: NaN first)."""
    faults = [Fault(fault_cfg.nan_at_step, NAN), Fault(fault_cfg.spike_at_step, SPIKE)]
    return tuple(sorted((f for f in faults if f.step >= 0), key=lambda f: (f.step, f.kind)))


def make_fault_hook(faults: tuple[Fault, ...], rollbacks: jax.Array) -> Optional[Callable]:
    """A `fault_hook` for `make_train_step` that plays `faults`, or None when there are none.

    Fault i (in step order) is live at its step while `rollbacks <= i`, i.e. until the run has
    rolled back past it. Without faults the step is compiled without a hook at all; with them,
    a step with no live fault multiplies by exactly 1, so values are unchanged bit for bit.

    Args:
      faults: from `planned_faults`.
      rollbacks: the (traced) rollback count of the state being stepped.

    Returns:
      `(state, loss, grads) -> (loss, grads)`, or None.
    """
    if not faults:
        return None

    def hook(state: TrainState, loss, grads):
        nan = jnp.zeros((), bool)
        spike = jnp.zeros((), bool)
        for i, fault in enumerate(faults):
            live = (state.step == fault.step) & (rollbacks <= i)
            if fault.kind == NAN:
                nan = nan | live
            else:
                spike = spike | live
        factor = jnp.where(spike, SPIKE_FACTOR, 1.0).astype(jnp.float32)
        loss = jnp.where(nan, jnp.nan, loss * factor.astype(loss.dtype))
        grads = jax.tree.map(
            lambda g: jnp.where(nan, jnp.asarray(jnp.nan, g.dtype), g * factor.astype(g.dtype)),
            grads)
        return loss, grads

    return hook


# --------------------------------------------------------------------------------------------
# The guarded step


def make_guarded_step(model, cfg, plan, mesh, optimizer) -> Callable:
    """`step(loop, batch) -> (loop, metrics)`: the train step with guards and fault injection.

    See the module docstring for what accepted and rejected steps do. Metrics are the train
    step's plus `accepted` (bool), `consecutive_bad`, and the new state's `step`, `next_batch`
    (= `batch_index`) and `version`, so the host needs no other transfer.

    Args:
      model, plan, mesh: as for `make_train_step`; cfg: the run's config (guard, faults,
        learning-rate schedule).
      optimizer: the optimizer to step with (rebuilt with another LR scale after rollbacks).

    Returns:
      The jitted step; the loop state is donated.
    """
    faults = planned_faults(cfg.fault)
    g = cfg.guard

    def guarded(loop: LoopState, batch):
        # The hook closes over this trace's rollback count, so it is built per trace.
        hook = make_fault_hook(faults, loop.rollbacks)
        inner = steplib.make_train_step(model, plan, mesh, optimizer,
                                        lr=steplib.lr_schedule(cfg.train), fault_hook=hook,
                                        jit=False)
        updated, metrics = inner(loop.train, batch)
        if g.enabled:
            ok, guard = guard_update(loop.guard, metrics["loss"], metrics["grad_norm"],
                                     g.spike_sigma)
        else:
            ok, guard = jnp.ones((), bool), loop.guard
        rejected = loop.train._replace(data_offset=loop.train.data_offset + 1)
        train = select_tree(ok, updated, rejected)
        out = {**metrics, "accepted": ok, "consecutive_bad": guard.consecutive_bad,
               "step": train.step, "next_batch": batch_index(train), "version": train.version}
        return loop._replace(train=train, guard=guard), out

    return jax.jit(guarded, donate_argnums=(0,))


def rejection_reason(loss: float, grad_norm: float) -> str:
    """Why the guard rejected a step, from its host-side metrics."""
    return "non_finite" if not (np.isfinite(loss) and np.isfinite(grad_norm)) else "spike"


# --------------------------------------------------------------------------------------------
# Rollback


class Rollback(NamedTuple):
    from_step: int  # the step the run was stuck at
    to_step: int  # the step restored
    resume_batch: int  # the first batch the restored run consumes
    data_offset: int  # the restored state's new data_offset
    steps_lost: int  # accepted updates discarded
    reason: str


def plan_rollback(from_step: int, next_batch: int, to_step: int, skip_batches: int,
                  reason: str) -> Rollback:
    """Where a rollback resumes the data stream.

    The run goes back to `to_step` but not back in the data: it continues `skip_batches` past
    `next_batch`, the first batch it has not consumed (the rejected attempts already consumed
    the bad ones). With `batch_index = step + data_offset` that fixes the new offset.

    Args:
      from_step: the state's step when the rollback was decided.
      next_batch: `batch_index` of that state.
      to_step: the step of the state being restored.
      skip_batches: `guard.skip_batches`.
      reason: for the log.

    Returns:
      The Rollback record.
    """
    if to_step > from_step:
        raise ValueError(f"rollback to step {to_step} is ahead of step {from_step}")
    resume = next_batch + skip_batches
    return Rollback(from_step, to_step, resume, resume - to_step, from_step - to_step, reason)


# A run that keeps rolling back without getting past the step it last rolled back from is
# not recovering; after this many such rollbacks in a row the loop stops with an error.
MAX_ROLLBACKS_WITHOUT_PROGRESS = 3


class RollbackStreak(NamedTuple):
    furthest: int = -1  # the furthest step any rollback of this run started from
    stalled: int = 0  # rollbacks in a row that did not start past the previous furthest


def note_rollback(streak: RollbackStreak, from_step: int) -> RollbackStreak:
    """The streak after a rollback from `from_step`; see MAX_ROLLBACKS_WITHOUT_PROGRESS.

    Two faults at different steps each roll back once and count as progress; the same spot
    failing again and again does not.
    """
    if from_step > streak.furthest:
        return RollbackStreak(from_step, 1)
    return RollbackStreak(streak.furthest, streak.stalled + 1)


def apply_rollback(restored: LoopState, rollback: Rollback, version: int, rollbacks: int,
                   shardings: LoopState) -> LoopState:
    """The state to continue from: `restored` with the new data position, version and count.

    Args:
      restored: the checkpointed (or initial) loop state, in the runtime layout.
      rollback: from `plan_rollback`.
      version: the new version; callers pass one above every version used so far, so no
        later save can be mistaken for an earlier timeline's.
      rollbacks: the new rollback count.
      shardings: the loop state's shardings.

    Returns:
      The new LoopState; the guard keeps its window, its bad streak is cleared.
    """

    def update(loop, data_offset, version, rollbacks):
        train = loop.train._replace(data_offset=data_offset, version=version)
        guard = loop.guard._replace(consecutive_bad=jnp.zeros_like(loop.guard.consecutive_bad))
        return LoopState(train, guard, rollbacks)

    return jax.jit(update, out_shardings=shardings, donate_argnums=(0,))(
        restored, np.int32(rollback.data_offset), np.int32(version), np.int32(rollbacks))


# --------------------------------------------------------------------------------------------
# Watchdog

EXIT_PEER_FAILED = 3  # exit status of a process stopped because another one failed or was lost
EXIT_FAILED = 1  # exit status of the process whose own code raised (multi-process runs)

# Phases in which a stall counts. Compiling (the first step after (re)building the step
# function), restoring and saving can legitimately take long and are left to JAX's heartbeats.
TIMED_PHASES = frozenset({"step"})

_FAILED_KEY = "jax_overlap/failed"
_PROGRESS_KEY = "jax_overlap/progress/{}"


class MemoryBoard:
    """A status board in a dict: one process's view, for tests and single-process runs."""

    def __init__(self):
        self.values: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value

    def get(self, key: str) -> Optional[str]:
        return self.values.get(key)


class KeyValueBoard:
    """A status board over `jax.distributed`'s key-value store (one RPC per call)."""

    def __init__(self, client):
        self._client = client

    def set(self, key: str, value: str) -> None:
        self._client.key_value_set(key, value, allow_overwrite=True)

    def get(self, key: str) -> Optional[str]:
        try:
            return self._client.key_value_try_get(key)
        except Exception:  # noqa: BLE001 - NOT_FOUND is an exception, and so is a lost service
            return None


def jax_board() -> Optional[KeyValueBoard]:
    """The board of the running `jax.distributed` job, or None when there is none."""
    from jax._src import distributed  # the client has no public accessor in 0.11/0.12

    client = getattr(distributed.global_state, "client", None)
    return KeyValueBoard(client) if client is not None else None


def hard_exit(message: str, code: int) -> None:
    """Print "error: <message>" and leave now, without JAX's shutdown barrier.

    A normal exit would wait in that barrier for peers that wait for us in a collective
    (measured: 300 s, then an abort), and a thread cannot make the main thread leave one.
    """
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


class Watchdog:
    """Makes every process of a job stop promptly, with a message naming the culprit.

    Each process publishes its progress (phase, step and a beat counter) on a shared board
    every `poll_s`, from a thread, so the beat goes on while the main thread sits in a
    collective. The main thread reports progress with `beat`. The thread stops the process:

    * at once when another process published a failure;
    * when a timed phase (a steady-state step) has lasted more than `timeout_s`, naming the
      processes whose published progress differs from ours (we wait for them in a collective).

    When the main thread raises (leaving the `with` block with an exception), `__exit__`
    works out whose fault it is, because a lost peer makes collectives fail here too (gloo:
    "Connection closed by peer"): a failure another process published wins; otherwise peers
    whose beat stays frozen for `grace_s` are lost (killed, OOM, machine gone); otherwise the
    error is ours, and is published so the others stop. Then it exits: EXIT_PEER_FAILED with
    a message naming the other process, or EXIT_FAILED after the traceback. `grace_s` must stay
    below JAX's heartbeat timeout, after which the runtime aborts the process itself.

    With a single process nobody waits for anybody: no thread, no board, exceptions propagate.

    Args:
      board: shared status board (`jax_board()`, or a `MemoryBoard` in tests); None disables.
      process_index, process_count: this process and how many there are.
      timeout_s: `distributed.timeout_s`.
      clock: monotonic clock.
      sleep: how to wait (tests fake it).
      poll_s: polling period.
      grace_s: how long a peer's beat must stay frozen to count as lost.
      exit_fn: `(message, exit_code)`, called once to stop the process (default `hard_exit`).
    """

    def __init__(self, board, process_index: int, process_count: int, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, poll_s: float = 1.0,
                 grace_s: float = 5.0, exit_fn: Callable[[str, int], None] = hard_exit):
        self._board = board
        self._me = process_index
        self._n = process_count
        self._timeout = float(timeout_s)
        self._clock = clock
        self._sleep = sleep
        self._poll = poll_s
        self._grace = grace_s
        self._exit = exit_fn
        self._phase, self._step, self._since = "start", 0, clock()
        self._beats = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def active(self) -> bool:
        return self._board is not None and self._n > 1

    def beat(self, phase: str, step: int) -> None:
        """The main thread entered `phase` at `step` (cheap: no communication)."""
        with self._lock:
            self._phase, self._step, self._since = phase, int(step), self._clock()

    def publish(self) -> None:
        """Put our progress and a fresh beat on the board."""
        with self._lock:
            self._beats += 1
            record = [self._phase, self._step, self._beats]
        self._board.set(_PROGRESS_KEY.format(self._me), json.dumps(record))

    def _peer(self, p: int) -> Optional[list]:
        raw = self._board.get(_PROGRESS_KEY.format(p))
        return None if raw is None else json.loads(raw)

    def fail(self, process: int, reason: str) -> None:
        """Publish that `process` failed, unless a failure is already known (the first wins)."""
        if self._board.get(_FAILED_KEY) is None:
            self._board.set(_FAILED_KEY, json.dumps({"process": process, "reason": reason}))

    def peer_failure(self) -> Optional[str]:
        """The message for a failure another process published, or None."""
        raw = self._board.get(_FAILED_KEY)
        if raw is None:
            return None
        info = json.loads(raw)
        if info["process"] == self._me:
            return None
        return (f"process {info['process']} failed ({info['reason']}); stopping process "
                f"{self._me} too. Restart all processes to resume from the last committed "
                f"checkpoint")

    def check(self) -> Optional[str]:
        """One poll: publish our progress, then return a fatal message or None."""
        self.publish()
        failed = self.peer_failure()
        if failed is not None:
            return failed
        with self._lock:
            phase, step, since = self._phase, self._step, self._since
        stalled = self._clock() - since
        if phase not in TIMED_PHASES or stalled <= self._timeout:
            return None
        behind = []
        for p in range(self._n):
            if p == self._me:
                continue
            record = self._peer(p)
            if record is None:
                behind.append(f"process {p} never reported")
            elif record[:2] != [phase, step]:
                behind.append(f"process {p} is stuck in {record[0]} at step {record[1]}")
        who = "; ".join(behind) if behind else (
            f"every process reports {phase} at step {step}: a collective is stuck")
        return (f"process {self._me}: no progress for {stalled:.0f} s (distributed.timeout_s="
                f"{self._timeout:.0f}) in {phase} at step {step}; {who}. Restart all processes "
                f"to resume from the last committed checkpoint")

    def lost_peers(self) -> list[int]:
        """Peers whose beat stays frozen for `grace_s` (ours keeps going meanwhile).

        Returns early, with no one lost, as soon as some process publishes a failure.
        """
        before = {p: self._peer(p) for p in range(self._n) if p != self._me}
        waited = 0.0
        while waited < self._grace:
            self.publish()
            if self._board.get(_FAILED_KEY) is not None:
                return []
            self._sleep(self._poll)
            waited += self._poll
        return [p for p, record in before.items() if self._peer(p) == record]

    def diagnose(self, exc: BaseException) -> tuple[str, int]:
        """Whose fault an exception of the main thread is: (message, exit code).

        May wait up to `grace_s`. Publishes our own failure when it is ours, or the lost
        peers when there are some, so every other process gives the same cause.
        """
        summary = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        message = self.peer_failure()
        if message is not None:
            return message, EXIT_PEER_FAILED
        lost = self.lost_peers()
        message = self.peer_failure()  # published while we were waiting
        if message is not None:
            return message, EXIT_PEER_FAILED
        if lost:
            self.fail(lost[0], f"lost: no sign of life for {self._grace:.0f} s")
            names = ", ".join(str(p) for p in lost)
            return (f"lost process {names} (no sign of life for {self._grace:.0f} s; here: "
                    f"{summary}); stopping process {self._me}. Restart all processes to resume "
                    f"from the last committed checkpoint", EXIT_PEER_FAILED)
        self.fail(self._me, summary)
        return f"process {self._me} failed: {summary}", EXIT_FAILED

    def _run(self) -> None:
        while not self._stop.wait(self._poll):
            try:
                message = self.check()
            except Exception:  # noqa: BLE001 - a lost coordinator: JAX's heartbeats handle it
                continue
            if message is not None:
                self._exit(message, EXIT_PEER_FAILED)
                return

    def __enter__(self) -> "Watchdog":
        if self.active:
            self.publish()
            self._thread = threading.Thread(target=self._run, name="jax_overlap-watchdog",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self._poll)
        if exc is None or not self.active or isinstance(exc, KeyboardInterrupt):
            return
        message, code = self.diagnose(exc)
        if code == EXIT_FAILED:
            traceback.print_exception(exc_type, exc, tb, file=sys.stderr)
        self._exit(message, code)
