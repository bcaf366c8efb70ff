"""The plan's memory estimate against what XLA allocates, on the plain GPU recipes.

For each case: `jax-overlap analyze --config FILE --target h100 --json` in its own process (the
plan's XLA preset goes into that process's XLA_FLAGS), and from its `memory` object the peak
bytes per device XLA allocates (`compiled.memory_analysis()`) beside the plan's estimate; the
estimate's parts (`hardware.memory.plan_step_memory`: state, kept, work) and the plan's auto
choices (remat, microbatches, FSDP, schedule) are printed with it. Deviceless: no GPU needed,
1-4 minutes a case on a CPU.

    python bench/memory_estimate.py                      # the six cases of docs/results.md
    python bench/memory_estimate.py --only gpt-pp4-dp2   # one
    python bench/memory_estimate.py --dump /tmp/dumps    # also XLA's buffer assignment per case
    python bench/memory_estimate.py --quick              # one small pipeline: checks it runs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = os.path.join(REPO, "configs", "gpu")
CASES = {
    "gpt-dp8": ("gpt_1p3b_dp8.yaml", []),
    "gpt-dp2-tp4": ("gpt_1p3b_dp2_tp4.yaml", []),
    "gpt-pp4-dp2": ("gpt_1p3b_pp4_dp2.yaml", []),
    "gpt-pp4-dp2-zbv": ("gpt_1p3b_pp4_dp2.yaml", ["pipeline.schedule=zb-v"]),
    "gpt-pp2-dp2-tp2": ("gpt_1p3b_pp2_dp2_tp2.yaml", []),
    "llama-dp2-tp4": ("llama3_8b_dp2_tp4.yaml", []),
}
# Not in the table: other policies and models for checking the terms.
EXTRA = {
    "gpt-dp2-tp4-full": ("gpt_1p3b_dp2_tp4.yaml", ["model.remat=full"]),
    "gpt-dp8-full": ("gpt_1p3b_dp8.yaml", ["model.remat=full"]),
    "llama-small-dp2-tp4": ("llama3_8b_dp2_tp4.yaml", ["model.layers=4", "model.seq_len=2048",
                                                        "train.global_batch=16"]),
}
# --quick: a small GPT at pp2 x dp2 x tp2 (paired 1F1B, sequence parallel), seconds to compile.
QUICK = {"quick-pp2-dp2-tp2": ("gpt_1p3b_pp2_dp2_tp2.yaml", [
    "model.layers=4", "model.d_model=256", "model.heads=4", "model.d_ff=1024",
    "model.seq_len=256", "model.vocab=1024", "train.global_batch=16"])}
CASES.update(EXTRA)
CASES.update(QUICK)
TABLE = [name for name in CASES if name not in EXTRA and name not in QUICK]
GIB = 2**30


def plan_parts(path: str, overrides: list[str], target: str) -> dict:
    """The estimate's parts and the plan's memory-relevant choices (no compile)."""
    from jax_overlap import config
    from jax_overlap.analysis import analyze as an
    from jax_overlap.hardware import memory

    cfg = config.load(path, overrides)
    plan = an.build_plan(cfg, target).plan
    parts = memory.plan_step_memory(cfg.model, cfg.train.precision, plan)
    return {"remat": plan.remat, "microbatches": plan.microbatches,
            "micro_batch": plan.micro_batch, "fsdp": plan.overlap.fsdp,
            "zero1": plan.overlap.zero1, "tp_comm": plan.overlap.tp_comm,
            "attention": getattr(plan, "attention", "plain"),
            "schedule": plan.program.schedule.name if plan.program is not None else None,
            "vocab_parallel": plan.vocab_parallel, "state": parts.state, "kept": parts.kept,
            "work": parts.work, "plan_estimate": plan.memory_estimate}


def run_case(name: str, target: str, dump: str | None) -> dict:
    path, overrides = CASES[name]
    path = os.path.join(GPU, path)
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("XLA_FLAGS", None)
    if dump:
        env["XLA_FLAGS"] = f"--xla_dump_to={os.path.join(dump, name)}"
    args = [sys.executable, "-m", "jax_overlap.cli", "analyze", "--config", path,
            "--target", target, "--json"]
    for o in overrides:
        args += ["--set", o]
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: analyze failed:\n{proc.stderr[-3000:]}")
    mem = json.loads(proc.stdout.strip().splitlines()[-1])["memory"]
    row = {"case": name, "xla": mem["peak_bytes"], "estimate": mem["estimated_bytes"],
           **plan_parts(path, overrides, target)}
    row["ratio"] = row["estimate"] / row["xla"]
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=list(CASES))
    parser.add_argument("--target", default="h100")
    parser.add_argument("--dump", help="folder for XLA's dumps (buffer assignment), per case")
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--quick", action="store_true", help="one small case (%s)" % (
        ", ".join(QUICK)))
    args = parser.parse_args(argv)
    rows = []
    for name in args.only or (list(QUICK) if args.quick else TABLE):
        row = run_case(name, args.target, args.dump)
        rows.append(row)
        print(f"{name:18s} estimate {row['estimate'] / GIB:6.1f} GiB  XLA {row['xla'] / GIB:6.1f}"
              f" GiB  ratio {row['ratio']:.2f}  (state {row['state'] / GIB:.1f}, kept "
              f"{row['kept'] / GIB:.1f}, work {row['work'] / GIB:.1f}; remat {row['remat']}, "
              f"{row['microbatches']} x {row['micro_batch']}, fsdp {row['fsdp']}, "
              f"{row['schedule'] or 'pp1'}, {row['tp_comm']}, {row['attention']})", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
