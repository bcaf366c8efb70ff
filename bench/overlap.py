"""Overlap options one at a time: step time, collectives and memory against a baseline.

For every option (bucket sizes and order, ZeRO-1, bf16 gradient communication, FSDP window
1/2/3, tp_comm plain / sequence_parallel / collective_matmul uni / bi) the full train step
of the default model is compiled for 8 forced CPU devices and measured:

  step_ms         median wall time of a few steps (after one warm-up step)
  dp_ops/dp_mb    collectives over groups that include dp: count and MiB per step
  wire            dp MiB as a GPU would send them (bf16 buckets at half their f32 bytes;
                  the CPU backend upcasts a bf16 all-reduce after rounding)
  tp_ops/tp_mb    collectives within TP groups (all-reduce, reduce-scatter, all-gather,
                  collective-permute): count and MiB per step
  temp_mb/peak_mb `compiled.memory_analysis()`: temporaries, and temporaries + arguments +
                  outputs - aliased (the donated state) as the peak estimate
  x_step/x_peak   ratios to the row's baseline (same mesh, no option)

Counts and bytes come from the compiled HLO (`jax_overlap.analysis.hlo_report`, per step: a
collective inside a loop counts once per iteration). CPU collectives are synchronous, so
step time here shows the cost of the extra work an option does (flat-buffer copies, the
FSDP recompute, ring steps), not the overlap a GPU gets; that is what the HLO columns and
`jax-overlap analyze --target h100` are for.

    python bench/overlap.py [--steps 5] [--out bench/results/overlap.json] [--only NAME ...]

`--goal` instead compiles GPT-1.3B (configs/gpt_1p3b.yaml) for 8 H100s without a GPU, on dp=8
and dp=2 x tp=4, once as jax_overlap's step and once as plain jit + GSPMD, and prints the share
of collective bytes under GEMMs side by side (about 15 minutes on 2 cores):

    python bench/overlap.py --goal [--goal-set model.layers=4 ...]

`--quick` (with or without `--goal`) checks that the bench runs: a tiny model, one row per
kind of collective the table sorts (dp buckets with bf16 wire bytes, TP ring permutes of
collective matmul, FSDP gathers on dp8) and one timed step, LLVM at -O0; or the goal's four
compiles of a 2-layer GPT. It writes no results file.

    python bench/overlap.py --quick
    python bench/overlap.py --goal --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# (name, baseline name, overrides). The two baselines: the default dp=2 x tp=4 mesh, and
# dp=8 x tp=1 where FSDP and ZeRO-1 split 8 ways.
DP8 = ["mesh.dp=8", "mesh.tp=1"]
ROWS: list[tuple[str, str, list[str]]] = [
    ("baseline dp2xtp4", "baseline dp2xtp4", []),
    ("buckets 0.05MB", "baseline dp2xtp4", ["overlap.grad_bucket_mb=0.05"]),
    ("buckets 0.25MB", "baseline dp2xtp4", ["overlap.grad_bucket_mb=0.25"]),
    ("buckets 1MB", "baseline dp2xtp4", ["overlap.grad_bucket_mb=1"]),
    ("buckets 0.25MB largest_first", "baseline dp2xtp4",
     ["overlap.grad_bucket_mb=0.25", "overlap.bucket_order=largest_first"]),
    ("bf16 comm, buckets 0.25MB", "baseline dp2xtp4",
     ["overlap.grad_bucket_mb=0.25", "overlap.grad_comm_dtype=bf16"]),
    ("zero1", "baseline dp2xtp4", ["overlap.zero1=true"]),
    ("zero1, buckets 0.25MB", "baseline dp2xtp4",
     ["overlap.zero1=true", "overlap.grad_bucket_mb=0.25"]),
    ("tp sequence_parallel", "baseline dp2xtp4", ["overlap.tp_comm=sequence_parallel"]),
    ("tp collective_matmul uni", "baseline dp2xtp4", ["overlap.tp_comm=collective_matmul"]),
    ("tp collective_matmul bi", "baseline dp2xtp4",
     ["overlap.tp_comm=collective_matmul", "overlap.collective_matmul_direction=bi"]),
    ("baseline dp8", "baseline dp8", DP8),
    ("zero1, buckets 0.25MB dp8", "baseline dp8",
     DP8 + ["overlap.zero1=true", "overlap.grad_bucket_mb=0.25"]),
    *((f"fsdp window {k} dp8", "baseline dp8",
       DP8 + ["overlap.param_sharding=fsdp", f"overlap.window={k}"]) for k in (1, 2, 3)),
]


# --quick: the tiny model (configs/tiny.yaml's, synthetic data; ~0.1 MiB of gradients, so
# 0.02 MiB buckets make several) and one row of each kind the table has.
QUICK_MODEL = ["model.layers=2", "model.d_model=32", "model.heads=4", "model.d_ff=64",
               "model.seq_len=16", "train.global_batch=16", "data.source=synthetic"]
QUICK_ROWS: list[tuple[str, str, list[str]]] = [
    ("baseline dp2xtp4", "baseline dp2xtp4", []),
    ("bf16 comm, buckets 0.02MB", "baseline dp2xtp4",
     ["overlap.grad_bucket_mb=0.02", "overlap.grad_comm_dtype=bf16"]),
    ("tp collective_matmul bi", "baseline dp2xtp4",
     ["overlap.tp_comm=collective_matmul", "overlap.collective_matmul_direction=bi"]),
    ("baseline dp8", "baseline dp8", DP8),
    ("fsdp window 2 dp8", "baseline dp8",
     DP8 + ["overlap.param_sharding=fsdp", "overlap.window=2"]),
]


def collective_summary(text: str, mesh) -> dict:
    """DP / TP collective counts and bytes per step from compiled HLO text."""
    import numpy as np

    from jax_overlap.analysis.hlo_report import analyze_hlo

    ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
    tp_axis = list(mesh.axis_names).index("tp")
    rows = np.moveaxis(ids, tp_axis, -1).reshape(-1, ids.shape[tp_axis])
    tp_groups = {tuple(row) for row in rows}
    tp_of = {d: g for g in tp_groups for d in g}
    out = {"dp_ops": 0, "dp_bytes": 0, "tp_ops": 0, "tp_bytes": 0}
    for op in analyze_hlo(text).ops:
        axes = set(op.replica_groups.mesh_axes)
        if op.kind == "collective-permute":
            pairs = op.source_target_pairs or ()
            side = "tp" if pairs and all(tp_of[a] == tp_of[b] for a, b in pairs) else "dp"
        elif axes:
            side = "dp" if "dp" in axes else ("tp" if axes == {"tp"} else None)
        else:
            groups = {tuple(g) for g in (op.replica_groups.groups or ())}
            side = "tp" if groups and groups <= tp_groups else "dp"
        if side:
            out[f"{side}_ops"] += op.executions_per_step
            out[f"{side}_bytes"] += op.bytes_per_step
    return out


def measure(overrides: list[str], steps: int) -> dict:
    """Compile and time the train step of the default config with these overrides (the
    model's own come first: `QUICK_MODEL` in quick mode)."""
    import jax

    from jax_overlap import config
    from jax_overlap.overlap import dp_layout
    from jax_overlap.data import streams as data
    from jax_overlap.training.assemble import assemble

    cfg = config.load("configs/default.yaml", overrides)
    run = assemble(cfg, jax.devices()[: cfg.num_devices])
    mesh, model = run.mesh, run.model
    state = run.init_state()
    batch = run.put_batch(data.stream_from_config(cfg).batch(0))
    t0 = time.perf_counter()
    compiled = run.train_step().lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics["loss"])
        if i:  # the first call pays for buffer allocation
            times.append(time.perf_counter() - t0)
    mem = compiled.memory_analysis()
    peak = (mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
            - mem.alias_size_in_bytes)
    row = {"step_ms": 1e3 * statistics.median(times), "compile_s": compile_s,
           "loss": float(metrics["loss"]), "temp_mb": mem.temp_size_in_bytes / 2**20,
           "peak_mb": peak / 2**20}
    row.update(collective_summary(compiled.as_text(), mesh))
    layout = dp_layout.dp_layout(model, run.plan.overlap, dict(mesh.shape))
    row["buckets"] = len(layout.plan.buckets) if layout.plan else 0
    # The CPU backend upcasts a bf16 all-reduce to f32 after the rounding; on a GPU the
    # bucket buffers travel as bf16, half their f32 bytes.
    row["dp_wire_bytes"] = row["dp_bytes"]
    if cfg.overlap.grad_comm_dtype == "bf16" and layout.plan:
        row["dp_wire_bytes"] -= layout.plan.total_bytes // 2
    return row


def table(rows: list[dict]) -> str:
    head = (f"{'option':32s} {'step_ms':>8s} {'x_step':>7s} {'dp_ops':>6s} {'dp_MiB':>7s} "
            f"{'wire':>6s} "
            f"{'tp_ops':>6s} {'tp_MiB':>7s} {'bkts':>4s} {'temp_MiB':>8s} {'peak_MiB':>8s} "
            f"{'x_peak':>6s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['option']:32s} {r['step_ms']:8.1f} {r['x_step']:7.2f} {r['dp_ops']:6d} "
            f"{r['dp_bytes'] / 2**20:7.3f} {r['dp_wire_bytes'] / 2**20:6.3f} "
            f"{r['tp_ops']:6d} {r['tp_bytes'] / 2**20:7.2f} "
            f"{r['buckets']:4d} {r['temp_mb']:8.2f} {r['peak_mb']:8.2f} {r['x_peak']:6.2f}")
    return "\n".join(lines)


# The overlap goal: GPT-1.3B compiled for 8 H100s without a GPU, ours against plain jit + GSPMD.
GOAL_CONFIG = "configs/gpt_1p3b.yaml"
GOAL_MESHES = {
    "dp8": [],
    "dp2xtp4": ["mesh.dp=2", "mesh.tp=4", "overlap.tp_comm=collective_matmul",
                "overlap.collective_matmul_direction=bi", "pipeline.microbatches=32"],
}


def lower_gspmd_step(cfg, devices):
    """What a user would otherwise write: the single-device loss on global arrays, params and
    batch annotated with NamedShardings, microbatches accumulated in a scan, AdamW; XLA picks
    every collective. Same mesh, shardings and microbatches as ours."""
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_overlap.analysis.analyze import abstract_inputs, target_of
    from jax_overlap.parallel.mesh import DP
    from jax_overlap.training import grads as gradslib
    from jax_overlap.training.assemble import assemble

    run = assemble(cfg, target=target_of("h100")).on(devices)
    mesh, model, plan, optimizer = run.mesh, run.model, run.plan, run.optimizer
    state, batch = abstract_inputs(run)
    m = plan.microbatches

    dp_rows = NamedSharding(mesh, P(None, DP))

    def step(state, batch):
        # Microbatch i takes every replica's i-th slice (as ours does per device), so each
        # microbatch stays split over dp; contiguous rows would put a microbatch on one replica
        # and GSPMD would gather the batch and compute it everywhere instead.
        mbs = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
            x.reshape(cfg.mesh.dp, m, -1, *x.shape[1:]).swapaxes(0, 1)
             .reshape(m, -1, *x.shape[1:]), dp_rows), batch)

        def one(acc, mb):
            loss, grads = jax.value_and_grad(
                lambda p: gradslib.reference_loss(model, p, mb) / m)(state.params)
            return (acc[0] + loss, gradslib.tree_add(acc[1], grads)), None

        zero = (0.0, gradslib.tree_zeros_like(state.params))
        (loss, grads), _ = jax.lax.scan(one, zero, mbs)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        return state._replace(params=optax.apply_updates(state.params, updates),
                              opt_state=opt_state, step=state.step + 1), loss

    shardings = jax.tree.map(lambda s: s.sharding, state)
    return jax.jit(step, in_shardings=(shardings, batch["inputs"].sharding),
                   out_shardings=(shardings, None), donate_argnums=(0,)).lower(state, batch)


def goal_one(kind: str, overrides: list[str]) -> dict:
    """One deviceless H100 compile (run in its own process: the preset must precede JAX)."""
    from jax_overlap import config
    from jax_overlap.cli import prepare_deviceless

    cfg = config.load(GOAL_CONFIG, overrides)
    prepare_deviceless(cfg)  # before anything imports jax
    from jax_overlap.analysis import analyze, deviceless

    t0 = time.perf_counter()
    if kind == "ours":
        data = analyze.analyze(cfg, "h100").to_json()
    else:
        data = deviceless.analyze_for("h100", cfg.num_devices,
                                      lambda devices: lower_gspmd_step(cfg, devices)).to_json()
    return {"async_fraction": data["async_fraction"],
            "under_gemm_fraction": data["collective_bytes_under_gemm_fraction"],
            "exposed_comm_s_estimate": data.get("exposed_comm_s_estimate"),
            "collective_bytes": sum(v["bytes"] for v in data["collectives"].values()),
            "compile_s": time.perf_counter() - t0}


def goal(extra: list[str], out: str | None) -> None:
    import subprocess

    rows = []
    for mesh, overrides in GOAL_MESHES.items():
        for kind in ("ours", "gspmd"):
            cmd = [sys.executable, __file__, "--goal-one", kind,
                   *[a for o in overrides + extra for a in ("--goal-set", o)]]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"{mesh} {kind}: {proc.stderr[-2000:]}")
            rows.append({"mesh": mesh, "step": kind,
                         **json.loads(proc.stdout.strip().splitlines()[-1])})
            print(f"{mesh} {kind}: compiled in {rows[-1]['compile_s']:.0f} s", file=sys.stderr,
                  flush=True)
    lines = [f"{GOAL_CONFIG} {' '.join(extra)} compiled for 8 x H100 (deviceless, preset "
             f"gpu_overlap); goal: >= 0.90 of collective bytes under GEMMs",
             f"{'mesh':8s} {'step':6s} {'async':>6s} {'under GEMMs':>11s} {'exposed ms':>10s} "
             f"{'GiB/step':>8s}"]
    for r in rows:
        exposed = r["exposed_comm_s_estimate"]
        lines.append(f"{r['mesh']:8s} {r['step']:6s} {r['async_fraction']:6.3f} "
                     f"{r['under_gemm_fraction']:11.3f} "
                     f"{exposed * 1e3 if exposed is not None else float('nan'):10.1f} "
                     f"{r['collective_bytes'] / 2**30:8.2f}")
    print("\n".join(lines))
    if out is None:
        return
    with open(out, "w") as f:
        json.dump({"config": GOAL_CONFIG, "extra": extra, "rows": rows, "table": lines}, f,
                  indent=2)
    print(f"wrote {out}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int)
    ap.add_argument("--out", help="results JSON (default bench/results/overlap.json, or "
                                  "overlap_goal*.json with --goal; none with --quick)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny model, a few rows (or a 2-layer goal), one timed step, no "
                         "results file: checks the bench runs")
    ap.add_argument("--only", nargs="*", help="row names to run (default: all)")
    ap.add_argument("--goal", action="store_true",
                    help="the GPT-1.3B overlap goal on 8 H100s, ours vs GSPMD (deviceless)")
    ap.add_argument("--goal-set", action="append", default=[], help="override for --goal")
    ap.add_argument("--goal-one", choices=("ours", "gspmd"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.goal_one:
        print(json.dumps(goal_one(args.goal_one, args.goal_set)))
        return
    if args.goal:
        if args.quick:  # the goal's meshes and both steps, on a 2-layer GPT
            from _quick import SMALL_GPT

            goal(SMALL_GPT + args.goal_set, args.out)
        else:
            goal(args.goal_set, args.out or ("bench/results/overlap_goal.json" if not
                                             args.goal_set else
                                             "bench/results/overlap_goal_custom.json"))
        return
    steps = args.steps or (1 if args.quick else 5)
    if not args.quick:
        args.out = args.out or "bench/results/overlap.json"

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jax_overlap.parallel.mesh import force_host_devices

    force_host_devices(8)
    if args.quick:
        from _quick import fast_cpu_compiles

        fast_cpu_compiles()
    rows, by_name = [], {}
    for name, base, overrides in QUICK_ROWS if args.quick else ROWS:
        if args.only and name not in args.only and name != base:
            continue
        r = {"option": name, "baseline": base, "overrides": overrides,
             **measure((QUICK_MODEL if args.quick else []) + overrides, steps)}
        ref = by_name.get(base, r)
        r["x_step"] = r["step_ms"] / ref["step_ms"]
        r["x_peak"] = r["peak_mb"] / ref["peak_mb"]
        by_name[name] = r
        rows.append(r)
        print(f"{name}: {r['step_ms']:.1f} ms, compile {r['compile_s']:.0f} s", file=sys.stderr,
              flush=True)
    text = table(rows)
    print(text)
    if args.out is None:
        return
    import jax

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": f"{jax.device_count()} forced CPU devices "
                             f"({os.cpu_count()} cores), jax {jax.__version__}",
                   "config": "configs/default.yaml", "steps_timed": steps,
                   "note": "CPU collectives are synchronous: step time shows extra work, not "
                           "overlap; bytes are per device per step (hlo_collectives.BYTES_CONVENTION).",
                   "rows": rows, "table": text.splitlines()}, f, indent=2)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
