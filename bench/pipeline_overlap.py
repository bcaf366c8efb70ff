"""Pipeline transfers on the real GPU schedule: for each schedule and transfer latency, the
share of the collective-permute (stage-to-stage) bytes that XLA schedules with a GEMM between
start and done, compiled for 8 H100s without a GPU (`jax-overlap analyze --target h100`
machinery), beside what the latency costs in bubble and stash slots.

`pipeline.transfer_latency: 1` sends each tick's output at the end of the tick and lets the
neighbour use it at the next one: no GEMM is independent of the transfer. `2` runs the skewed
loop (the executor sends tick t-1's output beside tick t's action). With `grad_bucket_mb > 0`
each chunk's last backward also reduces its layers' gradients over dp inside the loop.

    python bench/pipeline_overlap.py [--preset gpu_overlap] [--out bench/results/pipeline_overlap.json]
    python bench/pipeline_overlap.py --quick

Paired ticks (`pipeline.paired: true`, latency 1) run each tick's forward and backward in two
lanes: the forward's output travels while the backward computes, the backward's while the
next tick's forward does.

`--model gpt_1p3b` compiles GPT-1.3B (configs/gpt_1p3b.yaml: 24 layers, d 2048, seq 2048) on
the same meshes instead, pp4 x dp2 and pp2 x dp2 x tp2 (`--mesh`), 8 microbatches of one
sequence per replica: a stage-to-stage message is 16 MiB (fp32), and a compile takes minutes.

`--quick` checks that the bench runs: two rows (1f1b skewed, 1f1b paired) of a 4-layer model
of tiny widths, still dp2 x pp4 compiled for 8 GPUs without one; it writes no results file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = 16  # 4 per stage: a chunk has layers left to hide its buckets' reductions under
MODEL = ["model.d_model=256", "model.heads=4", "model.d_ff=1024", "model.seq_len=128",
         "train.global_batch=32", "pipeline.microbatches=8"]
ROWS = [(name, v, latency, bucket_mb, paired)
        for name, v in [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2)]
        for latency, bucket_mb, paired in ((1, 0, False), (2, 0, False), (2, 1, False),
                                           (1, 0, True))]
# --quick: one row (a GPU compile of a pipelined step costs ~15 s of CPU even this small) on
# the smallest model that has a layer per stage.
QUICK_LAYERS = 4
QUICK_MODEL = ["model.d_model=32", "model.heads=4", "model.d_ff=64", "model.seq_len=16",
               "train.global_batch=16", "pipeline.microbatches=4", "data.source=synthetic"]
QUICK_ROWS = [("1f1b", 1, 2, 0, False), ("1f1b", 1, 1, 0, True)]


def bytes_of(ops: list[dict], kind: str) -> tuple[int, float, float]:
    """(ops, bytes per step, bytes per step with a GEMM between start and done) of a kind;
    around a tick's switch, on the share of the ticks whose action runs one
    (`under_share`)."""
    of_kind = [op for op in ops if op["kind"] == kind]
    moved = [op["bytes"] * op["executions_per_step"] for op in of_kind]
    hidden = [b * op["under_share"] for op, b in zip(of_kind, moved)]
    return len(of_kind), sum(moved), sum(hidden)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="gpu_overlap")
    ap.add_argument("--target", default="h100")
    ap.add_argument("--out", help="results JSON (default bench/results/pipeline_overlap.json; "
                                  "none with --quick)")
    ap.add_argument("--quick", action="store_true",
                    help="two rows of a 4-layer tiny model: checks the bench runs")
    ap.add_argument("--schedules", default="", help="comma-separated subset, e.g. 1f1b,zb-v")
    ap.add_argument("--paired-only", action="store_true", help="only the paired rows")
    ap.add_argument("--model", default="small", choices=("small", "gpt_1p3b"),
                    help="small: 16 layers d256 (default); gpt_1p3b: configs/gpt_1p3b.yaml")
    ap.add_argument("--mesh", default="pp4xdp2", choices=("pp4xdp2", "pp2xdp2xtp2"))
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    help="extra config override, e.g. model.remat=full (repeatable)")
    args = ap.parse_args()
    if not args.quick:
        args.out = args.out or "bench/results/pipeline_overlap.json"
    layers, model = (QUICK_LAYERS, QUICK_MODEL) if args.quick else (LAYERS, MODEL)
    base = os.path.join(REPO, "configs", "tiny.yaml")
    if args.model == "gpt_1p3b":
        base, layers = os.path.join(REPO, "configs", "gpt_1p3b.yaml"), 24
        # remat full: without it one microbatch's stash (attention probabilities included)
        # is ~1 GB a layer and the step needs 62-120 GiB per GPU, past which XLA's
        # scheduler stops overlapping to save memory.
        model = ["train.global_batch=16", "pipeline.microbatches=8", "model.remat=full"]
    mesh = {"pp4xdp2": ["mesh.dp=2", "mesh.pp=4", "mesh.tp=1"],
            "pp2xdp2xtp2": ["mesh.dp=2", "mesh.pp=2", "mesh.tp=2"]}[args.mesh]
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.preset != "none":
        from jax_overlap.overlap import xla_flags

        xla_flags.apply_preset(args.preset)
    from jax_overlap import config
    from jax_overlap.analysis import analyze

    rows = []
    todo = QUICK_ROWS if args.quick else ROWS
    if args.schedules:
        todo = [r for r in todo if r[0] in args.schedules.split(",")]
    if args.model == "gpt_1p3b":  # minutes per compile: the rows without in-loop buckets
        todo = [r for r in todo if r[3] == 0]
    if args.paired_only:
        todo = [r for r in todo if r[4]]
    for name, v, latency, bucket_mb, paired in todo:
        cfg = config.load(base, [
            *mesh, f"model.layers={layers}", *model,
            f"pipeline.schedule={name}", f"pipeline.virtual_stages={v}",
            f"pipeline.transfer_latency={latency}", f"overlap.grad_bucket_mb={bucket_mb}",
            f"pipeline.paired={str(paired).lower()}", *args.overrides])
        built = analyze.build_plan(cfg, args.target)
        program = built.plan.program
        data = analyze.analyze(cfg, args.target, built).to_json()
        permute_ops, total, under = bytes_of(data["ops"], "collective-permute")
        _, dp_total, dp_under = bytes_of(data["ops"], "all-reduce")
        rows.append({"schedule": name, "virtual_stages": v, "transfer_latency": latency,
                     "paired": paired,
                     "grad_bucket_mb": bucket_mb,
                     "dp_bytes_per_step": dp_total,
                     "dp_bytes_under_gemm_fraction": dp_under / dp_total if dp_total else 0.0,
                     "ticks": program.ticks, "bubble": program.idle_fraction(),
                     "stash_slots": program.slots, "permute_ops": permute_ops,
                     "permute_bytes_per_step": total,
                     "permute_bytes_under_gemm_fraction": under / total if total else 0.0,
                     "all_bytes_under_gemm_fraction":
                         data["collective_bytes_under_gemm_fraction"]})
        print(f"compiled {name} latency {latency} buckets {bucket_mb} paired {paired}",
              file=sys.stderr,
              flush=True)
    print(f"{args.mesh}, {layers} layers d{cfg.model.d_model}, {program.schedule.microbatches} "
          f"microbatches, compiled for 8x{args.target} (preset {args.preset}); fractions = "
          f"bytes with a GEMM between start and done")
    print(f"{'schedule':19s} {'latency':>7s} {'buckets':>7s} {'ticks':>5s} {'bubble':>6s} "
          f"{'slots':>5s} {'permute MiB':>11s} {'under':>5s} {'dp MiB':>6s} {'under':>5s} "
          f"{'all':>5s}")
    for r in rows:
        label = r["schedule"] + ("+paired" if r["paired"] else "")
        print(f"{label:19s} {r['transfer_latency']:7d} {r['grad_bucket_mb']:7g} "
              f"{r['ticks']:5d} {r['bubble']:6.3f} {r['stash_slots']:5d} "
              f"{r['permute_bytes_per_step'] / 2**20:11.4g} "
              f"{r['permute_bytes_under_gemm_fraction']:5.2f} "
              f"{r['dp_bytes_per_step'] / 2**20:6.3g} {r['dp_bytes_under_gemm_fraction']:5.2f} "
              f"{r['all_bytes_under_gemm_fraction']:5.2f}")
    if args.out is None:
        return 0
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"preset": args.preset, "target": args.target, "model": args.model,
                   "mesh": args.mesh, "overrides": args.overrides, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
