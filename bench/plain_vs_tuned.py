"""The plan's own choices against the best of the tuner's candidates, by the GPU-step estimate.

Issue #27's check: a plain config (model + batch + precision + mesh, every other knob `auto`)
gets an estimated MFU within `TOLERANCE` of the best plan found for its mesh. For each mesh the
plain config is compiled deviceless for 8 GPUs as the plan resolves it, and so is each
candidate: the same config with the knobs that move a step on that mesh set by hand
(`pipeline.schedule`, `paired`, `microbatches`, `model.remat`; the rest left to the plan).
Every compile is `jax-overlap analyze --target h100 --json` in its own process (the plan's
XLA preset goes into that process's XLA_FLAGS); the candidates are ranked by the compiled
step's estimate (`analysis/step_estimate.py`), as `jax-overlap tune --estimate` ranks them.
Candidates whose compiled step takes more than the plan's `MEMORY_BUDGET` share of the GPU's
memory are not ranked (the rest is the headroom the plan keeps for XLA's own temporaries).

Estimates are cached in `--cache` (default bench/results/plain_vs_tuned.json), keyed by the
config file, the overrides and the values the plan resolves for them (so a changed default
compiles again), so a rerun compiles only what is new; `--fresh` compiles the meshes it runs
again and keeps the cached estimates of the others.
Deviceless GPT-1.3B compiles take 1-6 minutes each on a small CPU.

    python bench/plain_vs_tuned.py                 # GPT-1.3B, h100: every mesh below
    python bench/plain_vs_tuned.py --only dp8
    python bench/plain_vs_tuned.py --quick         # a small GPT, two candidates a mesh

Exits 1 when a plain config is more than `TOLERANCE` below its mesh's best (not with --quick,
whose tiny model's estimates mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # plans are resolved here, compiled in children

from jax_overlap.plan import MEMORY_BUDGET  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 0.05

# The plain configs: GPT-1.3B, batch 256 x 2048, bf16 and a mesh, every other knob `auto`
# (configs/gpu/, the GPU recipes).
GPU = os.path.join(REPO, "configs", "gpu")
# mesh name -> (recipe, candidates: the knobs set by hand, the rest `auto`).
MESHES = {
    "dp8": ("gpt_1p3b_dp8.yaml", [
        ["model.remat=none", "pipeline.microbatches=8"],
        ["model.remat=full", "pipeline.microbatches=8"],
        ["model.remat=full", "pipeline.microbatches=4"],
        ["model.remat=full", "pipeline.microbatches=2"],
        ["model.remat=save_dots", "pipeline.microbatches=8"],
        ["model.remat=minimal", "pipeline.microbatches=2"],
    ]),
    "pp4_dp2": ("gpt_1p3b_pp4_dp2.yaml", [
        ["pipeline.schedule=1f1b", "pipeline.paired=true", "pipeline.microbatches=32"],
        ["pipeline.schedule=1f1b", "pipeline.paired=true", "pipeline.microbatches=16"],
        ["pipeline.schedule=1f1b", "pipeline.paired=true", "pipeline.microbatches=8"],
        ["pipeline.schedule=1f1b", "pipeline.paired=false", "pipeline.microbatches=32"],
        ["pipeline.schedule=zb-h1", "pipeline.paired=false", "pipeline.microbatches=32"],
        ["pipeline.schedule=zb-v", "pipeline.paired=true", "pipeline.microbatches=32"],
        ["pipeline.schedule=1f1b", "pipeline.paired=true", "pipeline.microbatches=32",
         "model.remat=save_dots"],
        ["pipeline.microbatches=32"],
        ["pipeline.virtual_stages=2", "pipeline.schedule=interleaved",
         "pipeline.microbatches=16"],
        ["model.remat=save_dots"],
        ["model.remat=full"],
        ["pipeline.schedule=zb-v", "pipeline.paired=true", "pipeline.microbatches=32",
         "model.remat=full"],
    ]),
    "dp2_tp4": ("gpt_1p3b_dp2_tp4.yaml", [
        ["overlap.tp_comm=sequence_parallel"],
        ["overlap.tp_comm=collective_matmul", "pipeline.microbatches=2"],
        ["model.remat=full", "pipeline.microbatches=2"],
        ["overlap.tp_comm=collective_matmul", "pipeline.microbatches=4"],
        ["overlap.tp_comm=collective_matmul", "pipeline.microbatches=8"],
        ["overlap.tp_comm=collective_matmul", "pipeline.microbatches=16"],
    ]),
    "pp2_dp2_tp2": ("gpt_1p3b_pp2_dp2_tp2.yaml", [
        ["pipeline.schedule=1f1b", "pipeline.virtual_stages=1"],
        ["pipeline.virtual_stages=2", "pipeline.schedule=interleaved"],
        ["overlap.tp_comm=collective_matmul"],
        ["pipeline.microbatches=8"],
        ["pipeline.microbatches=16"],
        ["pipeline.microbatches=32"],
        ["pipeline.paired=false"],
        ["overlap.sp_split=sequence"],
        ["overlap.lone_tp_comm=same"],
    ]),
}
# Estimates of this version include the communication no compute hides (`exposed_ms`),
# count async reduce-scatters and all-to-alls as communication, not kernels, and count a
# collective around a pipeline tick's switches by the rows of its table (under GEMMs,
# exposed), with q, k and v as three GEMMs, and the remat checkpoints without a CSE barrier
# where they need none; cached ones without it are not reused. (A key also holds the plan's
# resolved choices, so an estimate is not reused once the plan picks otherwise.)
CACHE_VERSION = "+exposed+async-rs+per-row+qkv+nocse"
# --quick: a small GPT on the same meshes, two candidates each (seconds a compile).
QUICK_MODEL = ["model.layers=4", "model.d_model=128", "model.heads=4", "model.d_ff=512",
               "model.vocab=512", "model.seq_len=128", "train.global_batch=16"]
QUICK_MESHES = {
    "dp8": (MESHES["dp8"][0], [["model.remat=full", "pipeline.microbatches=1"]]),
    "pp4_dp2": (MESHES["pp4_dp2"][0], [["pipeline.schedule=1f1b", "pipeline.paired=false",
                                        "pipeline.microbatches=8"]]),
}


def estimate(recipe: str, overrides: list[str], target: str) -> dict:
    """`analyze --json` of a recipe with `overrides`: step ms, MFU, fit, choices."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("XLA_FLAGS", None)
    args = [sys.executable, "-m", "jax_overlap.cli", "analyze", "--config",
            os.path.join(GPU, recipe), "--target", target, "--json"]
    for o in overrides:
        args += ["--set", o]
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"analyze {' '.join(overrides)} failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    plan = out["plan"]
    choices = {k: v["value"] for k, v in plan.get("choices", {}).items()}
    choices.update(o.split("=", 1) for o in overrides)  # explicit values are not choices
    return {"step_ms": out["estimate"]["step_ms"], "mfu": out["estimate"]["mfu"],
            "exposed_ms": out["estimate"]["exposed_ms"],
            "under_gemms": out["collective_bytes_under_gemm_fraction"],
            "peak_gib": out["memory"]["peak_bytes"] / 2**30, "fits": out["memory"]["peak_bytes"]
            <= MEMORY_BUDGET * out["memory"]["device_bytes"],
            "schedule": plan["schedule"], "paired": plan["paired"],
            "microbatches": plan["microbatches"], "remat": choices.get("model.remat", "")}


def resolved(recipe: str, overrides: list[str], target: str) -> str:
    """The values the plan picks for the recipe's `auto` knobs (no compile)."""
    from jax_overlap import config
    from jax_overlap.analysis.analyze import build_plan

    plan = build_plan(config.load(os.path.join(GPU, recipe), overrides), target).plan
    return json.dumps({k: c.value for k, c in plan.choices.items()}, sort_keys=True,
                      default=str)


def compare(name: str, recipe: str, candidates: list[list[str]], base: list[str],
            target: str, cache: dict) -> dict:
    """The plain config's estimate, each candidate's, and the gap to the best that fits."""
    def cached(extra: list[str]) -> dict:
        key = (" ".join([recipe] + base + extra) + f" @{target}{CACHE_VERSION} "
               + resolved(recipe, base + extra, target))
        if key not in cache:
            print(f"  compiling {name} {' '.join(extra) or '(plain)'} ...", flush=True)
            cache[key] = estimate(recipe, base + extra, target)
        return cache[key]

    plain = cached([])
    rows = [{"knobs": "plain (the plan's choices)", **plain}]
    rows += [{"knobs": " ".join(c), **cached(c)} for c in candidates]
    fitting = [r for r in rows if r["fits"]]
    best = max(fitting, key=lambda r: r["mfu"]) if fitting else rows[0]
    return {"mesh": name, "rows": rows, "best": best["knobs"],
            "gap": 1 - plain["mfu"] / best["mfu"], "plain_fits": plain["fits"]}


def table(result: dict) -> str:
    lines = [f"mesh {result['mesh']}",
             "| knobs | schedule | paired | m | remat | step ms | of it exposed | MFU "
             "| under GEMMs | XLA peak GiB |",
             "|---|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['knobs']} | {r['schedule']} | {r['paired']} | {r['microbatches']} "
                     f"| {r['remat']} | {r['step_ms']:.4g} | {r['exposed_ms']:.3g} "
                     f"| {r['mfu']:.3g} | {r['under_gemms']:.3f} | "
                     f"{r['peak_gib']:.1f}{'' if r['fits'] else ' (over the budget)'} |")
    lines.append(f"best: {result['best']}; plain is {result['gap'] * 100:.1f}% below it "
                 f"(tolerance {TOLERANCE * 100:.0f}%)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", choices=list(MESHES))
    ap.add_argument("--target", default="h100")
    ap.add_argument("--cache", help="estimates JSON (default bench/results/"
                                    "plain_vs_tuned.json; none with --quick)")
    ap.add_argument("--fresh", action="store_true",
                    help="compile the meshes run again (the cache keeps the others)")
    ap.add_argument("--quick", action="store_true",
                    help="a small GPT, one candidate a mesh: checks the bench runs")
    args = ap.parse_args(argv)
    meshes, base = (QUICK_MESHES, QUICK_MODEL) if args.quick else (MESHES, [])
    if not args.quick:
        args.cache = args.cache or os.path.join(REPO, "bench", "results", "plain_vs_tuned.json")
    cache: dict = {}
    if args.cache and os.path.exists(args.cache):
        with open(args.cache) as f:
            cache = {k: v for k, v in json.load(f).items() if f"{CACHE_VERSION} " in k}
        if args.fresh:  # the meshes run now compile again; the others' estimates stay
            recipes = {meshes[name][0] for name in args.only or meshes}
            cache = {k: v for k, v in cache.items() if k.split()[0] not in recipes}
    failed = []
    for name in args.only or list(meshes):
        recipe, candidates = meshes[name]
        try:
            result = compare(name, recipe, candidates, base, args.target, cache)
        finally:
            if args.cache:
                with open(args.cache, "w") as f:
                    json.dump(cache, f, indent=1, sort_keys=True)
        print(table(result), flush=True)
        if result["gap"] > TOLERANCE or not result["plain_fits"]:
            failed.append(name)
    if failed and not args.quick:  # a tiny model's estimates mean nothing
        print(f"the plain config is more than {TOLERANCE * 100:.0f}% below the best candidate "
              f"(or does not fit) on: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
