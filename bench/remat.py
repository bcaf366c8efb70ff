"""Remat trade-off: per `model.remat` policy, peak memory per device and step time.

Rows, for every policy in `parallel/remat.py` (none, full, save_dots, minimal):
  * the default model (`configs/default.yaml`) on 8 CPU devices at pp = 1 (its dp2 x tp4
    mesh) and at pp = 4 (pp4 x dp2, 1F1B and ZB-V, 8 microbatches, 8 layers): the jitted
    loss-and-gradients step, timed (best of `--reps`), and its peak bytes per device from
    XLA's memory analysis (arguments + outputs + temporaries - aliased);
  * GPT-1.3B (`configs/gpt_1p3b.yaml`) compiled for 8 H100s without a GPU (the
    `analyze --target h100` machinery): dp2 x tp4 at pp = 1 and pp4 x dp2 1F1B, peak bytes
    per device of the whole train step (no time: nothing runs).

`none` keeps every residual of the forward for the backward (no recompute), `full` keeps each
block's input and recomputes the block in the backward, `save_dots` / `minimal` keep matmul
outputs. The memory the policies trade is the activations': the fixed part (parameters,
optimizer state, gradients) is the same in every row of a group.

    python bench/remat.py [--reps 5] [--no-gpu] [--out bench/results/remat.json]
    python bench/remat.py --quick    # tiny model, pp1 and pp2 x two policies, no GPU compile
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICIES = ("none", "full", "save_dots", "minimal")
CPU_GROUPS = (
    ("pp1 dp2xtp4", []),
    ("pp4xdp2 1f1b", ["mesh.dp=2", "mesh.tp=1", "mesh.pp=4", "model.layers=8",
                      "pipeline.microbatches=8"]),
    ("pp4xdp2 zb-v", ["mesh.dp=2", "mesh.tp=1", "mesh.pp=4", "model.layers=8",
                      "pipeline.microbatches=8", "pipeline.schedule=zb-v",
                      "pipeline.virtual_stages=2"]),
)
GPU_GROUPS = (
    ("pp1 dp2xtp4", ["mesh.dp=2", "mesh.tp=4", "mesh.pp=1"]),
    ("pp4xdp2 1f1b", ["mesh.dp=2", "mesh.tp=1", "mesh.pp=4", "pipeline.microbatches=16"]),
)
QUICK_POLICIES = ("none", "full")
QUICK_MODEL = ["model.layers=4", "model.d_model=32", "model.heads=4", "model.d_ff=64",
               "model.seq_len=16", "train.global_batch=16", "data.source=synthetic"]
QUICK_GROUPS = (
    ("pp1 dp2xtp4", []),
    ("pp2xdp4 1f1b", ["mesh.dp=4", "mesh.tp=1", "mesh.pp=2", "pipeline.microbatches=4"]),
)


def peak_bytes(compiled) -> int | None:
    ma = compiled.memory_analysis()
    if ma is None:
        return None
    return int(ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
               - ma.alias_size_in_bytes)


def cpu_rows(groups, policies, base, reps: int) -> list[dict]:
    import jax

    from jax_overlap import config
    from jax_overlap.pipeline import layout
    from jax_overlap.data import streams as data
    from jax_overlap.training.assemble import assemble

    rows = []
    for group, overrides in groups:
        for policy in policies:
            cfg = config.load(os.path.join(REPO, "configs", "default.yaml"),
                              base + overrides + [f"model.remat={policy}"])
            run = assemble(cfg, jax.devices()[:cfg.num_devices])
            params = layout.to_staged(run.model.init(jax.random.key(0)), run.plan.layer_perm)
            params = jax.device_put(params, run.param_shardings())
            batch = run.put_batch(data.stream_from_config(cfg).batch(0))
            fn = jax.jit(run.loss_and_grads())
            compiled = fn.lower(params, batch).compile()
            jax.block_until_ready(compiled(params, batch))
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                jax.block_until_ready(compiled(params, batch))
                times.append(time.perf_counter() - t0)
            rows.append({"where": "cpu8", "group": group, "remat": policy,
                         "peak_bytes": peak_bytes(compiled), "step_ms": min(times) * 1e3})
            print(f"cpu {group} {policy}: {rows[-1]['step_ms']:.1f} ms", file=sys.stderr,
                  flush=True)
    return rows


def gpu_rows(groups, policies) -> list[dict]:
    from jax_overlap import config
    from jax_overlap.analysis import analyze, deviceless

    rows = []
    for group, overrides in groups:
        for policy in policies:
            cfg = config.load(os.path.join(REPO, "configs", "gpt_1p3b.yaml"),
                              overrides + [f"model.remat={policy}"])
            built = analyze.build_plan(cfg, "h100")
            devices = deviceless.gpu_topology_devices("h100", built.plan.num_devices)
            compiled = analyze.lower_train_step(cfg, devices, "h100", built).compile()
            rows.append({"where": "8xh100 deviceless", "group": group, "remat": policy,
                         "peak_bytes": peak_bytes(compiled), "step_ms": None})
            print(f"gpu {group} {policy}: {rows[-1]['peak_bytes'] / 2**30:.2f} GiB",
                  file=sys.stderr, flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-gpu", action="store_true", help="skip the deviceless GPT-1.3B rows")
    ap.add_argument("--gpu-only", action="store_true",
                    help="only the deviceless GPT-1.3B rows; the results file keeps its CPU rows")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", help="results JSON (default bench/results/remat.json; none with "
                                  "--quick)")
    args = ap.parse_args()
    sys.path.insert(0, REPO)
    if args.quick:
        from _quick import fast_cpu_compiles

        fast_cpu_compiles()
        args.reps, args.no_gpu = 1, True
    elif args.out is None:
        args.out = os.path.join(REPO, "bench", "results", "remat.json")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jax_overlap.parallel.mesh import force_host_devices

    force_host_devices(8)
    if args.gpu_only:  # the CPU rows of the last full run
        kept = json.load(open(args.out))["rows"] if os.path.exists(args.out) else []
        rows = [r for r in kept if r["where"] == "cpu8"]
    else:
        rows = cpu_rows(QUICK_GROUPS if args.quick else CPU_GROUPS,
                        QUICK_POLICIES if args.quick else POLICIES,
                        QUICK_MODEL if args.quick else [], args.reps)
    if not args.no_gpu:
        from jax_overlap.analysis import deviceless

        reason = deviceless.unavailable_reason()
        if reason:
            print(f"skipping the GPU rows: {reason}", file=sys.stderr)
        else:
            rows += gpu_rows(GPU_GROUPS, POLICIES[:3])
    print(f"{'where':<18} {'group':<14} {'remat':<10} {'peak MiB':>9} {'step ms':>8}")
    for r in rows:
        peak = f"{r['peak_bytes'] / 2**20:9.1f}" if r["peak_bytes"] is not None else "        -"
        step = f"{r['step_ms']:8.1f}" if r["step_ms"] is not None else "       -"
        print(f"{r['where']:<18} {r['group']:<14} {r['remat']:<10} {peak} {step}")
    if args.out:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
