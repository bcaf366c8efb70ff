"""The design's headline, estimated: GPT models on 8 x A100 with and without overlap.

The design claims that 500M / 1.2B / 3B-parameter GPT models train 41% / 38% / 42% faster
with compute-communication overlap than without on 8 x A100 80 GB (18.2 -> 25.7, 9.5 -> 13.1,
4.1 -> 5.8 iter/s), and that at 3B the communication per iteration falls from 195 to 112 ms.

For each size, `jax-overlap analyze --target a100 --json` compiles the train step for 8 A100s
on this machine (no GPU) twice, each in its own process (XLA flags are read once, at start):

  no overlap  one reduction per gradient leaf after the backward (`overlap.grad_bucket_mb=0`,
              `overlap.embed_before_first_layer=false`) and no latency-hiding XLA flags
              (`overlap.xla_preset=none`): the reduction runs after the backward, exposed
  defaults    the plan's `auto` choices for the GPU (buckets issued inside the backward, the
              `gpu_overlap` XLA preset, ...)

and prints, per variant: the estimated step (the GPU-step estimate over the compiled program,
`estimate.step_ms`, plus the communication the compiled schedule leaves exposed at the link's
bandwidth, `exposed_comm_s_estimate`) as iterations per second, and the communication per
iteration (all collectives' link time, and the exposed part). These are estimates, not
measurements on GPUs.

    python bench/overlap_headline.py [--out bench/results/overlap_headline.json]   # ~1 h here
    python bench/overlap_headline.py --quick     # a 2-layer GPT: checks the bench runs

`--quick` writes no results file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "gpu", "gpt_1p3b_dp8.yaml")
# GPT shapes near the design's sizes (parameters with the embedding, vocab 50304).
SIZES = {
    "500M": ["model.layers=24", "model.d_model=1280", "model.heads=20", "model.d_ff=5120"],
    "1.2B": ["model.layers=24", "model.d_model=2048", "model.heads=16", "model.d_ff=8192"],
    "3B": ["model.layers=36", "model.d_model=2560", "model.heads=32", "model.d_ff=10240"],
}
QUICK_SIZES = {"tiny": ["model.layers=2", "model.d_model=256", "model.heads=4",
                        "model.d_ff=1024", "model.vocab=1024", "model.seq_len=256"]}
# One sequence of 2048 tokens per GPU per iteration.
COMMON = ["mesh.dp=8", "train.global_batch=8"]
VARIANTS = {
    "no overlap": ["overlap.grad_bucket_mb=0", "overlap.embed_before_first_layer=false",
                   "overlap.xla_preset=none"],
    "defaults": [],
}
# The design's table: iter/s without and with overlap, and 3B's communication per iteration.
DESIGN = {"500M": (18.2, 25.7), "1.2B": (9.5, 13.1), "3B": (4.1, 5.8)}
DESIGN_COMM_MS = {"3B": (195.0, 112.0)}


def parameters(overrides: list[str]) -> float:
    """GPT parameters (embedding included) of a SIZES entry."""
    kv = dict(o.split("=") for o in overrides)
    layers, d = int(kv["model.layers"]), int(kv["model.d_model"])
    ff, vocab = int(kv["model.d_ff"]), int(kv.get("model.vocab", 50304))
    return layers * (4 * d * d + 2 * d * ff) + vocab * d


def analyze(overrides: list[str]) -> dict:
    """`jax-overlap analyze --target a100 --json` of the config with `overrides`."""
    cmd = [sys.executable, "-m", "jax_overlap.cli", "analyze", "--config", CONFIG,
           "--target", "a100", "--json"]
    for o in overrides:
        cmd += ["--set", o]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"analyze failed ({proc.returncode}): {' '.join(cmd)}\n"
                         f"{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def row(report: dict) -> dict:
    """Iterations per second and communication per iteration of one analyze report."""
    compute_s = report["estimate"]["step_ms"] / 1e3
    exposed_s = report["exposed_comm_s_estimate"] or 0.0
    step_s = compute_s + exposed_s
    return {"compute_ms": compute_s * 1e3, "exposed_comm_ms": exposed_s * 1e3,
            "comm_ms": (report["total_comm_s_estimate"] or 0.0) * 1e3,
            "step_ms": step_s * 1e3, "iter_per_s": 1.0 / step_s,
            "under_gemm": report["collective_bytes_under_gemm_fraction"],
            "mfu": report["estimate"]["mfu"]}


def table(results: dict) -> str:
    head = (f"{'model':<6} {'params':>7} {'variant':<11} {'step_ms':>8} {'iter/s':>7} "
            f"{'comm_ms':>8} {'exposed_ms':>10} {'under_gemm':>10} {'design_iter/s':>13} "
            f"{'design_comm_ms':>14}")
    lines = [head, "-" * len(head)]
    for size, r in results.items():
        for i, (variant, v) in enumerate(r["variants"].items()):
            design = DESIGN.get(size)
            comm = DESIGN_COMM_MS.get(size)
            lines.append(
                f"{size:<6} {r['params'] / 1e9:>6.2f}B {variant:<11} {v['step_ms']:>8.1f} "
                f"{v['iter_per_s']:>7.2f} {v['comm_ms']:>8.2f} {v['exposed_comm_ms']:>10.2f} "
                f"{v['under_gemm']:>10.3f} {design[i] if design else '-':>13} "
                f"{comm[i] if comm else '-':>14}")
        base, best = (r["variants"][k]["iter_per_s"] for k in VARIANTS)
        lines.append(f"{'':<6} {'':>7} {'speed-up':<11} {'':>8} {best / base - 1:>+7.0%}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="results JSON (default bench/results/overlap_headline.json; "
                                  "none with --quick)")
    ap.add_argument("--quick", action="store_true", help="a 2-layer GPT: checks the bench runs")
    args = ap.parse_args()
    sizes = QUICK_SIZES if args.quick else SIZES
    results = {}
    t0 = time.time()
    for size, shape in sizes.items():
        variants = {}
        for variant, overrides in VARIANTS.items():
            variants[variant] = row(analyze(COMMON + shape + overrides))
            print(f"{size} {variant}: {variants[variant]['iter_per_s']:.2f} iter/s "
                  f"({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
        results[size] = {"params": parameters(shape), "variants": variants}
    print("Estimated on 8 x A100 80GB (deviceless compile; GPU-step estimate + exposed "
          "communication), not measured")
    print(table(results))
    if not args.quick:
        out = args.out or os.path.join(ROOT, "bench", "results", "overlap_headline.json")
        import jax

        with open(out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__,
                       "command": "python bench/overlap_headline.py", "config": CONFIG,
                       "common": COMMON, "variants": VARIANTS, "sizes": SIZES,
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
