"""Fault drill: SIGKILL a CLI training run at random moments, restart it, check nothing changed.

    python bench/fault_drill.py [--kills 20] [--config configs/tiny.yaml] [--steps 60]
                                [--every 5] [--local-every 1] [--seed 0] [--set k=v ...]
                                [--out bench/results/fault_drill.json] [--keep-work]
    python bench/fault_drill.py --processes 2 --kills 5 --out FILE   # 2 processes x 4 devices

1. The command runs once uninterrupted: the reference.
2. The same command runs in a fresh run directory and is killed with SIGKILL `--kills` times,
   each time at a random step past the one it resumed from, then restarted; the last restart
   runs to the end. Each kill has a random kind:
   * `mid_step`: a random delay (up to `--jitter-s`) after the step's metrics line;
   * `during_save`: while a persistent save's temporary directory is being written;
   * `before_commit`: after Orbax finalised a persistent step, before its commit marker
     (`fault.commit_delay_s` holds that window open for 0.2 s).
   A kind whose moment does not come within a few saves falls back to `mid_step` (the row
   says so).
3. Per kill: the last step completed before the kill, the newest step committed in either
   checkpoint tier at the kill, the step the restart resumed from and the steps lost
   (recomputed) in between; a restart that resumes before a step committed at the kill has
   lost a committed step. Finally the per-array checksums of the two runs' last checkpoints
   (parameters, optimizer state, RNG, data position, guard) are compared.

The local checkpoint tier is on (`checkpoint.local_every`, default 1 here: every step; off by
default for users, see docs/guides/fault_tolerance.md) in a directory of its own under /dev/shm.

`--processes 2`: the same with two JAX processes of 4 CPU devices each (gloo on loopback);
each kill SIGKILLs one process (the other stops through the watchdog or a failed
collective), then both restart.

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
import glob
import json
import os
import random
import shutil
import signal
import socket
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
FULL = {"kills": 20, "steps": 100, "every": 5, "jitter_s": 0.05, "local_every": 1,
        "out": "bench/results/fault_drill.json"}
QUICK = {"kills": 1, "steps": 8, "every": 2, "jitter_s": 0.01, "local_every": 1}
KINDS = ("mid_step", "during_save", "before_commit")
COMMIT_DELAY_S = 0.2  # fault.commit_delay_s: the save-to-commit window kills can land in


class Launch(NamedTuple):
    resumed_from: int  # step restored at start (0: started fresh)
    last_step: int  # last step record written before the process ended
    killed: bool  # SIGKILLed by the drill (False: it ran to the end)
    rc: int
    seconds: float
    kind: str = ""  # what the kill landed in (KINDS; "fallback" suffix when it did not come)
    committed: int = 0  # newest step committed in either tier right after the kill
    tier: Optional[str] = None  # the tier the launch resumed from


def _committed_in(d: str) -> set[int]:
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return set()
    return {int(n) for n in names if n.isdigit() and os.path.exists(os.path.join(d, n, "COMMITTED"))}


def committed_everywhere(ckpt_dir: str, local_root: str, processes: int) -> int:
    """The newest step a restart may use: committed persistently, or locally on every process."""
    local = None
    for p in range(processes):
        steps = set().union(*[_committed_in(d) for d in glob.glob(
            os.path.join(local_root, "*", f"p{p}"))])
        local = steps if local is None else local & steps
    return max(_committed_in(ckpt_dir) | (local or set()), default=0)


def save_in_flight(ckpt_dir: str) -> bool:
    """An Orbax temporary directory is in the persistent dir: a save is being written."""
    try:
        return any("tmp" in n for n in os.listdir(ckpt_dir))
    except FileNotFoundError:
        return False


def awaiting_commit(ckpt_dir: str) -> bool:
    """A finalised step directory has no commit marker yet."""
    try:
        return any(n.isdigit() and not os.path.exists(os.path.join(ckpt_dir, n, "COMMITTED"))
                   and os.path.exists(os.path.join(ckpt_dir, n, "_CHECKPOINT_METADATA"))
                   for n in os.listdir(ckpt_dir))
    except FileNotFoundError:
        return False


def read_records(run_dir: str) -> list[dict]:
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def launch_view(records: list[dict], start: int) -> tuple[int, int, Optional[str]]:
    """(resumed_from, last completed step, resumed tier) of the launch whose records begin at
    `start`."""
    mine = records[start:]
    resume = next((r for r in mine if r.get("event") == "resume"), None)
    resumed = resume["step"] if resume else 0
    steps = [r["step"] for r in mine if "event" not in r and not r.get("skipped")]
    return resumed, (steps[-1] if steps else resumed), resume.get("tier") if resume else None


def run_once(cmds: list[list[str]], envs: list[dict], run_dir: str, logs: str,
             kill_at: Optional[int], jitter_s: float, kind: str = "mid_step",
             victim: int = 0, every: int = 5, local_root: str = "", poll_s: float = 0.002,
             timeout_s: float = 900) -> Launch:
    """Runs the command(s) (one per process); once step `kill_at` is done, SIGKILLs process
    `victim` at the moment `kind` names (see the module docstring)."""
    start = len(read_records(run_dir))
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    t0 = time.time()
    files = [(open(f"{logs}.p{i}.out", "w"), open(f"{logs}.p{i}.err", "w"))
             for i in range(len(cmds))]
    procs = [subprocess.Popen(c, cwd=REPO, env=e, stdout=o, stderr=r)
             for c, e, (o, r) in zip(cmds, envs, files)]
    killed, landed, committed = False, kind, 0
    while procs[0].poll() is None and time.time() - t0 < timeout_s:
        if kill_at is not None:
            last = launch_view(read_records(run_dir), start)[1]
            moment = False
            if last >= kill_at:
                if kind == "mid_step":
                    time.sleep(jitter_s)
                    moment = True
                elif kind == "during_save":
                    moment = save_in_flight(ckpt_dir)
                else:
                    moment = awaiting_commit(ckpt_dir)
                if not moment and last >= kill_at + 2 * every:
                    moment, landed = True, f"{kind}-fallback"
            if moment:
                procs[victim].send_signal(signal.SIGKILL)
                procs[victim].wait()
                committed = committed_everywhere(ckpt_dir, local_root, len(cmds))
                killed = True
                break
        time.sleep(poll_s)
    deadline = time.time() + 120  # the other processes stop on their own (watchdog)
    for p in procs:
        while p.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        if p.poll() is None:
            p.kill()
        p.wait()
    for o, r in files:
        o.close(), r.close()
    resumed, last, tier = launch_view(read_records(run_dir), start)
    return Launch(resumed, last, killed, procs[0].returncode, time.time() - t0,
                  landed if killed else "", committed, tier)


def final_checksums(run_dir: str) -> tuple[int, dict]:
    """(step, checksums) of the newest committed checkpoint of a run."""
    ckpt = os.path.join(run_dir, "checkpoints")
    steps = sorted(int(s) for s in os.listdir(ckpt)
                   if s.isdigit() and os.path.exists(os.path.join(ckpt, s, "COMMITTED")))
    with open(os.path.join(ckpt, str(steps[-1]), "COMMITTED")) as f:
        return steps[-1], {k: v["checksum"] for k, v in json.load(f)["checksums"].items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def drill(args) -> dict:
    work = tempfile.mkdtemp(prefix="fault_drill_")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else work
    local_root = tempfile.mkdtemp(prefix="fault_drill_local_", dir=shm)
    overrides = [f"train.steps={args.steps}", f"checkpoint.every_steps={args.every}",
                 "checkpoint.async_save=true", f"checkpoint.local_every={args.local_every}",
                 f"checkpoint.local_dir={local_root}", f"fault.commit_delay_s={COMMIT_DELAY_S}",
                 *args.overrides]
    if args.local_every <= 0:
        overrides = [o for o in overrides if not o.startswith("checkpoint.local_")]
    n = args.processes
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "JAX_COMPILATION_CACHE_DIR": os.path.join(work, "jax_cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    env.pop("XLA_FLAGS", None)  # the CLI sizes the host device count itself
    if args.quick:
        from _quick import fast_cpu_compiles

        fast_cpu_compiles(env)

    def commands(run_dir):
        sets = sum((["--set", o] for o in overrides), [])
        base = [sys.executable, "-m", "jax_overlap.cli", "train", "--config", args.config,
                "--no-progress", "--run-dir", run_dir, *sets]
        if n == 1:
            return [base]
        port = free_port()
        return [base + ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n),
                        "--process-id", str(i), "--set", "distributed.timeout_s=20"]
                for i in range(n)]

    envs = [env] * n
    ref_dir, drill_dir = os.path.join(work, "reference"), os.path.join(work, "drill")
    t0 = time.time()
    reference = run_once(commands(ref_dir), envs, ref_dir, os.path.join(work, "reference"), None,
                         0, local_root=local_root)
    if reference.rc != 0:
        raise SystemExit(f"reference run failed (rc {reference.rc}); see {work}/reference.p0.err")

    rng = random.Random(args.seed)
    launches: list[Launch] = []
    resumed = 0
    # Kill targets spread over the run, leaving a few steps (and, for a save-bound kind, room
    # for its moment to come or its fallback) before the end, so the kill lands before the run
    # can finish; each kill lands at its target or just after the step resumed from.
    if args.quick:
        targets = [rng.randint(1, max(1, args.steps - 3))]
    else:
        last = max(1, args.steps - 3 - 2 * args.every)
        targets = sorted(rng.sample(range(1, last + 1), min(args.kills, last)))
    for i, planned in enumerate(targets):
        kind = KINDS[0] if args.quick else rng.choice(KINDS)
        target = max(planned, resumed + 1)
        jitter = rng.uniform(0.0, args.jitter_s)
        launch = run_once(commands(drill_dir), envs, drill_dir, os.path.join(work, f"kill{i}"),
                          target, jitter, kind, rng.randrange(n), args.every, local_root)
        launches.append(launch)
        if not launch.killed:
            break  # finished before the kill landed
        resumed = launch.last_step
    final = run_once(commands(drill_dir), envs, drill_dir, os.path.join(work, "final"), None, 0,
                     local_root=local_root)
    launches.append(final)
    if final.rc != 0:
        raise SystemExit(f"final restart failed (rc {final.rc}); see {work}/final.p0.err")

    rows = []
    for i, launch in enumerate(launches[:-1]):
        if not launch.killed:
            continue
        nxt = launches[i + 1]
        restored = nxt.resumed_from
        rows.append({"kill": len(rows) + 1, "killed_after_step": launch.last_step,
                     "committed_at_kill": launch.committed, "resumed_from": restored,
                     "steps_lost": launch.last_step - restored, "kind": launch.kind,
                     "tier": nxt.tier, "committed_lost": max(0, launch.committed - restored),
                     "launch_s": round(launch.seconds, 1)})
    lost = [r["steps_lost"] for r in rows]
    ref_step, ref_sums = final_checksums(ref_dir)
    got_step, got_sums = final_checksums(drill_dir)
    params = {k: v for k, v in ref_sums.items() if k.startswith(".train.params")}
    from importlib.metadata import version

    result = {
        "kills": len(rows), "restarts": len(rows),
        "steps_lost": {"per_kill": lost, "median": statistics.median(lost) if lost else None,
                       "mean": round(statistics.mean(lost), 3) if lost else None,
                       "max": max(lost) if lost else None},
        "committed_steps_lost": sum(r["committed_lost"] for r in rows),
        "kinds": {k: sum(r["kind"] == k for r in rows) for k in sorted({r["kind"] for r in rows})},
        "processes": n, "checkpoint_local_every": args.local_every,
        "final_step": {"reference": ref_step, "drill": got_step},
        "final_params_equal": ref_step == got_step and all(
            got_sums.get(k) == v for k, v in params.items()),
        "final_state_equal": ref_step == got_step and got_sums == ref_sums,
        "rows": rows, "checkpoint_every_steps": args.every, "steps": args.steps,
        "config": args.config, "overrides": args.overrides, "seed": args.seed,
        "wall_s": round(time.time() - t0, 1), "jax": version("jax"),
        "work_dir": work if args.keep_work else None,
    }
    shutil.rmtree(local_root, ignore_errors=True)
    if not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return result


def table(result: dict) -> str:
    lines = [f"{'kill':>4}  {'killed after step':>17}  {'resumed from':>12}  {'steps lost':>10}  "
             f"{'committed':>9}  {'tier':>10}  kind", "-" * 84]
    for r in result["rows"]:
        lines.append(f"{r['kill']:>4}  {r['killed_after_step']:>17}  {r['resumed_from']:>12}  "
                     f"{r['steps_lost']:>10}  {r['committed_at_kill']:>9}  "
                     f"{r['tier'] or 'none':>10}  {r['kind']}")
    lost = result["steps_lost"]
    lines += ["-" * 84,
              f"kills {result['kills']} ({result['processes']} process(es)), restarts "
              f"{result['restarts']}, steps lost per kill: mean {lost['mean']}, median "
              f"{lost['median']}, max {lost['max']}; committed steps lost "
              f"{result['committed_steps_lost']} (persistent checkpoint every "
              f"{result['checkpoint_every_steps']} steps, local every "
              f"{result['checkpoint_local_every']})",
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
    ap.add_argument("--local-every", dest="local_every", type=int,
                    help="checkpoint.local_every (default 1; 0: persistent tier only)")
    ap.add_argument("--processes", type=int, default=1,
                    help="JAX processes (2: 2 x 4 CPU devices with configs/tiny.yaml)")
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
