"""Fault tolerance around the train step: guards, faults, rollbacks, checkpoints, a watchdog.

The training loop (`jax_overlap.training.loop`) composes these; each piece is usable and
testable alone.

* `loop_state`: `LoopState` (train state, guard state, rollback count), what the loop carries
  and checkpoints; its shardings and its initial value.
* `guard`: the in-graph step guard (non-finite and loss-spike rejection) and rollback policy.
* `guarded_step`: the train step wrapped with the guard and fault injection.
* `faults`: injected NaN and loss-spike faults, for drills and tests.
* `rollback`: where a rollback resumes the data stream and the state it continues from.
* `checkpoint`: Orbax saves, commit markers, verification and restore.
* `ckpt_layout`: the checkpoint's logical layer order and whether a checkpoint fits this run.
* `preemption`: SIGTERM/SIGINT handling agreed across processes.
* `watchdog`: makes every process of a multi-process job stop promptly, naming the culprit.
* `local_tier`: the fast local checkpoint tier (each process's shards, under /dev/shm).
* `lock`: one training per run dir.
* `preflight`: path and memory checks before JAX allocates anything.
* `user_errors`: which exceptions are the user's to fix, and the one line that says how.
* `run_log`: library warnings and tracebacks to `<run_dir>/logs/`, not the terminal.
* `run_guard`: how the loop composes the above (a refused run changes nothing).
"""
