"""Is the data loader ever the bottleneck? The Grain token loader's tokens/s against the train
step's, on 8 (forced CPU) devices, in one run.

The shards are a byte-level BPE of the stdlib made by `prepare-data` (or `--data DIR`). The
loader is timed as the loop uses it: `TokenLoader.place(i, mesh)` for consecutive batches
(reading this process's rows from the memory-mapped shards through Grain's prefetching
threads, then the host-to-device put); the train step's tokens/s is the steady-state number
of `jax_overlap.training.loop.run` on the same data. Target: ratio >= 10.

    python bench/loader.py [--config configs/default.yaml] [--data DIR] [--steps 10]
    python bench/loader.py --quick   # tiny model (seq_len 64), 300 kB of stdlib, BPE 512, no results
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = 10.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", help="default configs/default.yaml (tiny with --quick)")
    ap.add_argument("--data", help="a prepare-data directory (default: made here)")
    ap.add_argument("--steps", type=int, help="train steps (the first compiles)")
    ap.add_argument("--batches", type=int, help="loader batches timed")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", help="results JSON (default bench/results/loader.json; none "
                                  "with --quick)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    quick = args.quick
    args.config = args.config or os.path.join(REPO, "configs",
                                              "tiny.yaml" if quick else "default.yaml")
    args.steps = args.steps or (3 if quick else 12)
    args.batches = args.batches or (50 if quick else 200)
    if not quick:
        args.out = args.out or os.path.join(REPO, "bench", "results", "loader.json")

    sys.path.insert(0, REPO)
    from jax_overlap import config
    from jax_overlap.cli import prepare_backend
    from jax_overlap.data import prepare

    tmp = tempfile.TemporaryDirectory()
    data = args.data
    if not data:
        data = os.path.join(tmp.name, "shards")
        t0 = time.perf_counter()
        res = prepare.prepare(["stdlib"], data, train_vocab=512 if quick else 4096,
                              max_bytes=300_000 if quick else 0, progress=False)
        print(f"{res.line()} ({time.perf_counter() - t0:.1f} s)")
    # Quick: the tiny model at a realistic seq_len (at 16 tokens a window, per-window costs
    # that no real config sees would dominate the loader's number).
    sizes = ["model.seq_len=64"] if quick else []
    cfg = config.load(args.config, ["data.source=tokens", f"data.path={data}",
                                    "model.vocab=auto", f"train.steps={args.steps}",
                                    "train.eval_every=0", *sizes, *args.overrides])
    prepare_backend(cfg)
    if quick:
        from _quick import fast_cpu_compiles

        fast_cpu_compiles()
    import jax

    from jax_overlap import plan as plan_lib
    from jax_overlap.data.loader import TokenLoader
    from jax_overlap.training import loop

    mesh = plan_lib.mesh_from_config(cfg)
    m, t = cfg.model, cfg.train
    tokens_per_batch = t.global_batch * m.seq_len
    loader = TokenLoader(data, m.seq_len, t.global_batch, t.seed)
    jax.block_until_ready(loader.place(0, mesh))  # starts the reader threads
    t0 = time.perf_counter()
    for i in range(1, args.batches + 1):
        jax.block_until_ready(loader.place(i, mesh))
    loader_tps = tokens_per_batch * args.batches / (time.perf_counter() - t0)
    loader.close()

    result = loop.run(cfg, os.path.join(tmp.name, "run"), progress=False)
    step_tps = result.tokens_per_s
    ratio = loader_tps / step_tps
    print(f"loader vs train step: {m.layers}-layer GPT d={m.d_model} vocab={m.vocab}, "
          f"batch {t.global_batch} x {m.seq_len}, mesh dp{cfg.mesh.dp} pp{cfg.mesh.pp} "
          f"tp{cfg.mesh.tp} on {jax.device_count()} {jax.devices()[0].platform} devices")
    print(f"{'what':<28}{'tokens/s':>14}")
    print("-" * 42)
    print(f"{'loader (Grain, place)':<28}{loader_tps:>14.0f}")
    print(f"{'train step':<28}{step_tps:>14.0f}")
    print(f"ratio loader / step: {ratio:.1f} (target >= {TARGET:g}: "
          f"{'met' if ratio >= TARGET else 'NOT met'})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": os.path.relpath(args.config, REPO), "loader_tokens_per_s":
                       loader_tps, "step_tokens_per_s": step_tps, "ratio": ratio,
                       "batches": args.batches, "steps": args.steps}, f, indent=2)
            f.write("\n")
    tmp.cleanup()


if __name__ == "__main__":
    main()
