"""Fault drill: SIGKILL a CLI training run at random moments, restart it, check nothing changed.

    python bench/fault_drill.py [--kills 3] [--config configs/tiny.yaml] [--steps 60]
                                [--every 5] [--seed 0] [--set k=v ...]
                                [--out bench/results/fault_drill.json] [--keep-work]

1. The command runs once uninterrupted: the reference.
2. The same command runs in a fresh run directory and is killed with SIGKILL `--kills` times,
   each time at a random step past the one it resumed from, after a random delay inside that
   step (so kills also land in the middle of async saves and commits), then restarted; the
   last restart runs to the end.
3. Per kill: the last step completed before the kill, the step the restart resumed from and
   the steps lost (recomputed) in between. Finally the per-array checksums of the two runs'
   last checkpoints (parameters, optimizer state, RNG, data position, guard) are compared.

All launches share a JAX persistent compilation cache, fresh for each drill, so a restart
costs start-up and restore rather than a recompile, as for a production job with a cache dir.
Runs, logs and the cache live in a temporary directory, removed on success unless
`--keep-work` (a failure always keeps it and names it).

`--quick` checks that the drill works: one kill of an 8-step run of configs/tiny.yaml on
synthetic data, checkpointed every 2 steps, LLVM at -O0; it prints the table and writes no
results file.

    python bench/fault_drill.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Defaults of --kills / --steps / --every / --jitter-s / --out, and those of --quick.
# Quick: with seed 0 the kill lands at most 10 ms after step 4, with 4 steps and 2 saves still
# to go, so the run does not finish first.
FULL = {"kills": 3, "steps": 60, "every": 5, "jitter_s": 0.05,
        "out": "bench/results/fault_drill.json"}
QUICK = {"kills": 1, "steps": 8, "every": 2, "jitter_s": 0.01}


class Launch(NamedTuple):
    resumed_from: int  # step restored at start (0: started fresh)
    last_step: int  # last step record written before the process ended
    killed: bool  # SIGKILLed by the drill (False: it ran to the end)
    rc: int
    seconds: float


def read_records(run_dir: str) -> list[dict]:
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def launch_view(records: list[dict], start: int) -> tuple[int, int]:
    """(resumed_from, last completed step) of the launch whose records begin at `start`."""
    mine = records[start:]
    resumed = next((r["step"] for r in mine if r.get("event") == "resume"), 0)
    steps = [r["step"] for r in mine if "event" not in r and not r.get("skipped")]
    return resumed, (steps[-1] if steps else resumed)


def run_once(cmd: list[str], env: dict, run_dir: str, logs: str, kill_at: Optional[int],
             jitter_s: float, poll_s: float = 0.01, timeout_s: float = 900) -> Launch:
    """Runs the command; SIGKILLs it `jitter_s` after it completes step `kill_at` (if given)."""
    start = len(read_records(run_dir))
    t0 = time.time()
    with open(logs + ".out", "w") as out, open(logs + ".err", "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err)
        killed = False
        while proc.poll() is None and time.time() - t0 < timeout_s:
            if kill_at is not None and launch_view(read_records(run_dir), start)[1] >= kill_at:
                time.sleep(jitter_s)
                proc.send_signal(signal.SIGKILL)
                killed = True
                break
            time.sleep(poll_s)
        if proc.poll() is None and not killed:
            proc.kill()
        proc.wait()
    resumed, last = launch_view(read_records(run_dir), start)
    return Launch(resumed, last, killed, proc.returncode, time.time() - t0)


def final_checksums(run_dir: str) -> tuple[int, dict]:
    """(step, checksums) of the newest committed checkpoint of a run."""
    ckpt = os.path.join(run_dir, "checkpoints")
    steps = sorted(int(s) for s in os.listdir(ckpt)
                   if s.isdigit() and os.path.exists(os.path.join(ckpt, s, "COMMITTED")))
    with open(os.path.join(ckpt, str(steps[-1]), "COMMITTED")) as f:
        return steps[-1], {k: v["checksum"] for k, v in json.load(f)["checksums"].items()}


def drill(args) -> dict:
    overrides = [f"train.steps={args.steps}", f"checkpoint.every_steps={args.every}",
                 "checkpoint.async_save=true", *args.overrides]
    work = tempfile.mkdtemp(prefix="fault_drill_")
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "JAX_COMPILATION_CACHE_DIR": os.path.join(work, "jax_cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    env.pop("XLA_FLAGS", None)  # the CLI sizes the host device count itself
    if args.quick:
        from _quick import fast_cpu_compiles

        fast_cpu_compiles(env)

    def command(run_dir):
        sets = sum((["--set", o] for o in overrides), [])
        return [sys.executable, "-m", "jax_overlap.cli", "train", "--config", args.config,
                "--no-progress", "--run-dir", run_dir, *sets]

    ref_dir, drill_dir = os.path.join(work, "reference"), os.path.join(work, "drill")
    t0 = time.time()
    reference = run_once(command(ref_dir), env, ref_dir, os.path.join(work, "reference"), None, 0)
    if reference.rc != 0:
        raise SystemExit(f"reference run failed (rc {reference.rc}); see {work}/reference.err")

    rng = random.Random(args.seed)
    launches: list[Launch] = []
    resumed = 0
    for i in range(args.kills):
        # A step that leaves a few to go, so the kill lands before the run can finish.
        target = rng.randint(resumed + 1, max(resumed + 1, args.steps - 3))
        jitter = rng.uniform(0.0, args.jitter_s)
        launch = run_once(command(drill_dir), env, drill_dir, os.path.join(work, f"kill{i}"),
                          target, jitter)
        launches.append(launch)
        if not launch.killed:
            break  # finished before the kill landed
        resumed = launch.last_step
    final = run_once(command(drill_dir), env, drill_dir, os.path.join(work, "final"), None, 0)
    launches.append(final)
    if final.rc != 0:
        raise SystemExit(f"final restart failed (rc {final.rc}); see {work}/final.err")

    rows = []
    for i, launch in enumerate(launches[:-1]):
        if not launch.killed:
            continue
        restored = launches[i + 1].resumed_from
        rows.append({"kill": len(rows) + 1, "killed_after_step": launch.last_step,
                     "resumed_from": restored, "steps_lost": launch.last_step - restored,
                     "launch_s": round(launch.seconds, 1)})
    lost = [r["steps_lost"] for r in rows]
    ref_step, ref_sums = final_checksums(ref_dir)
    got_step, got_sums = final_checksums(drill_dir)
    params = {k: v for k, v in ref_sums.items() if k.startswith(".train.params")}
    from importlib.metadata import version

    result = {
        "kills": len(rows), "restarts": len(rows),
        "steps_lost": {"per_kill": lost, "median": statistics.median(lost) if lost else None,
                       "max": max(lost) if lost else None},
        "final_step": {"reference": ref_step, "drill": got_step},
        "final_params_equal": ref_step == got_step and all(
            got_sums.get(k) == v for k, v in params.items()),
        "final_state_equal": ref_step == got_step and got_sums == ref_sums,
        "rows": rows, "checkpoint_every_steps": args.every, "steps": args.steps,
        "config": args.config, "overrides": args.overrides, "seed": args.seed,
        "wall_s": round(time.time() - t0, 1), "jax": version("jax"),
        "work_dir": work if args.keep_work else None,
    }
    if not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return result


def table(result: dict) -> str:
    lines = [f"{'kill':>4}  {'killed after step':>17}  {'resumed from':>12}  {'steps lost':>10}",
             "-" * 51]
    for r in result["rows"]:
        lines.append(f"{r['kill']:>4}  {r['killed_after_step']:>17}  {r['resumed_from']:>12}  "
                     f"{r['steps_lost']:>10}")
    lost = result["steps_lost"]
    lines += ["-" * 51,
              f"kills {result['kills']}, restarts {result['restarts']}, steps lost per kill: "
              f"median {lost['median']}, max {lost['max']} "
              f"(checkpoint every {result['checkpoint_every_steps']} steps)",
              f"final params equal to the uninterrupted run: "
              f"{'yes' if result['final_params_equal'] else 'NO'} "
              f"(whole state: {'yes' if result['final_state_equal'] else 'NO'})"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int)
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--every", type=int, help="checkpoint.every_steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jitter-s", dest="jitter_s", type=float,
                    help="largest random delay between the target step and the kill (default "
                         "0.05)")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", help="results JSON (default bench/results/fault_drill.json; none "
                                  "with --quick)")
    ap.add_argument("--keep-work", dest="keep_work", action="store_true",
                    help="keep the runs, logs and compilation cache")
    ap.add_argument("--quick", action="store_true",
                    help="one kill of an 8-step tiny run: checks the drill works")
    args = ap.parse_args()
    defaults = QUICK if args.quick else FULL
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.quick:
        args.overrides = ["data.source=synthetic", *args.overrides]
    result = drill(args)
    print(table(result))
    if args.out is None:
        return
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
