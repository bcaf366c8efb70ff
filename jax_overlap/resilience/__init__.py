"""Storage and process hygiene: checkpoints, their tiers, the run-dir lock, pre-emption, a
watchdog, user errors. Imports nothing above the pipeline; the step's guard, faults, rollback
and loop state live in `jax_overlap.training` (they wrap the step).

The training loop (`jax_overlap.training.loop`) composes these; each piece is usable and
testable alone.

* `checkpoint`: Orbax saves, commit markers, verification and restore.
* `ckpt_layout`: the checkpoint's logical layer order and whether a checkpoint fits this run.
* `preemption`: SIGTERM/SIGINT handling agreed across processes.
* `watchdog`: makes every process of a multi-process job stop promptly, naming the culprit.
* `local_tier`: the fast local checkpoint tier (each process's shards, under /dev/shm).
* `lock`: one training per run dir.
* `preflight`: path and memory checks before JAX allocates anything.
* `user_errors`: which exceptions are the user's to fix, and the one line that says how.
* `run_log`: library warnings and tracebacks to `<run_dir>/logs/`, not the terminal.
* `run_dir_guard`: how the loop composes the above (a refused run changes nothing).
"""
