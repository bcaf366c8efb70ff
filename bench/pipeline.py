"""Pipeline schedules on 8 devices: step time, bubble fraction, and cost vs no pipeline.

For p = 4 stages and m in {8, 16} microbatches, each schedule's fwd+bwd step (the jitted
`make_loss_and_grads`, gradients reduced) on pp4 x dp2 of a small GPT, against the same model
with pp = 1 on the same devices (dp8, and dp2 x tp4). The global batch is fixed, so every row
does the same model work. Also the cost of one tick of each action kind, from programs that
run the same action on every stage for K ticks: a W-only tick costs a W, an idle tick only
its transfers (on the CPU devices one all-gather over pp that carries both rings).

Work ratio (`work` column, `work_ratio` in the JSON): each row's step time over a pp = 1 step
that does the same work in the same GEMM shapes, timed in the same run. A pipelined
microbatch is B / (dp m) = B / (2m) sequences (global batch B, dp = 2), and each device runs
its L / p layers on m of them. The baseline keeps all 8 devices and the same model with
pp = 1 and tp = 1, so dp = 8, and accumulates gradients over k = 2m / 8 = m / 4 microbatches
(`pipeline.microbatches` = k) of B / (8k) = B / (2m) sequences: same global batch, so the same
model FLOPs; per device L layers x k microbatches = (L / p) x m layer calls, each GEMM with
the same row count (sequences x seq_len) as the pipelined one's; one dp gradient reduction
after the accumulation and no TP collectives in both (the pipelined step reduces each
stage's quarter of the parameters over dp = 2, the baseline all of them over dp = 8). What
is left in the ratio is the pipeline's own cost -- idle ticks, the executor's recompute,
switch and transfers, the embedding and head on the end stages only -- and not the
smaller-GEMM cost of smaller microbatches, which the `/ pp1 dp8` column (dp8 without
accumulation, microbatches of B / 8) mixes in. (dp2 x tp4 with m microbatches has the same
row count but GEMMs a quarter as wide, plus TP collectives, so it is not used.) Where m / 4
is not a whole count that divides B / 8 (m < 4, or m not a multiple of 4), k is the valid
count whose microbatch is nearest B / (2m) sequences (ties: the larger microbatch); the
table flags those rows with `~` and lists both sizes below it.

    python bench/pipeline.py [--reps 5] [--set model.d_model=64 ...]
    python bench/pipeline.py --quick   # tiny model, 1f1b and zb-v at m=4, one repetition

Prints one aligned table and writes bench/results/pipeline.json. Columns: `bubble` is the
fraction of idle stage-ticks of the table the executor ran (unit-cost theory); `w-bubble` is
the idle device-time fraction of the same lockstep table when each action takes the measured
time of its kind (a tick lasts as long as its slowest action); `slots` is the stash size per
stage in microbatch activations; `work` is the work ratio above. Times are the best of
`--reps` calls (the pp=1 baselines are re-timed after each group of rows and keep their
best); a row's work ratio is its best over its baseline's best with the two timed turn about
(`alternating_best`), so the host's load drifting between minutes does not enter it.

On the CPU host platform the 8 devices are threads sharing the machine's cores, so wall time
tracks the total work of all devices more than the critical path: idle stage-ticks cost
little here, and the step-time ratios (the work ratio most directly) mostly show the
executor's recompute (B and W re-run the chunk's forward). The bubble column is the fraction
of idle stage-ticks in the table the executor ran, which is what costs time on real
accelerators.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

DEVICES = 8
STAGES = 4
MICROBATCHES = (8, 16)
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2))
MODEL = ["model.layers=8", "model.d_model=128", "model.heads=4", "model.d_ff=512",
         "model.seq_len=64", "train.global_batch=32", "data.source=synthetic"]
# --quick (run by the tests, so the bench keeps working; writes no results file): every tick
# program, and one schedule without and one with split backward and two chunks, at m = 4, on
# a model small enough to compile in seconds, LLVM at -O0.
QUICK_MICROBATCHES = (4,)
QUICK_SCHEDULES = (("1f1b", 1), ("zb-v", 2))
PAIRINGS = (False, True)  # every schedule also with paired F+B ticks (`pipeline.paired`)
QUICK_MODEL = ["model.layers=8", "model.d_model=32", "model.heads=4", "model.d_ff=64",
               "model.seq_len=16", "train.global_batch=16", "data.source=synthetic"]
# Paired rows: `pipeline.pair_search` steps, balancing the lockstep ticks at the F/B/W tick
# costs this run measured (`pipeline.tick_costs`); --quick: a few steps.
PAIR_SEARCH = 600
QUICK_PAIR_SEARCH = 5
TICKS = 8  # ticks of the single-action programs
TICK_M = 8  # microbatches (so microbatch size) of the single-action programs
TICK_REPS = 3  # calls each single-action program is timed (the best), --quick too
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def best_time(compiled, args, reps: int) -> float:
    """Best seconds per call of `reps` (not the median: this host's cores are shared, and
    other load only adds time)."""
    import jax

    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return min(times)


def alternating_best(compiled, args, other, other_args, reps: int) -> tuple[float, float]:
    """Best seconds per call of `compiled` and of `other`, timed turn about, `reps` calls
    each: a ratio of the two is then taken over the same minutes of this shared host's load
    (a baseline's best over the whole run can come from a quieter minute than the row's)."""
    import jax

    mine, theirs = [], []
    for _ in range(reps):
        for fn, fn_args, times in ((compiled, args, mine), (other, other_args, theirs)):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*fn_args))
            times.append(time.perf_counter() - t0)
    return min(mine), min(theirs)


def timed(fn, args, reps: int):
    """(compile seconds, best seconds per call, compiled) of `jax.jit(fn)` on `args`."""
    import jax

    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(compiled(*args))  # warm-up
    return compile_s, best_time(compiled, args, reps), compiled


def single_action_program(kind: str, microbatches: int, split: bool):
    """Every stage runs `kind` ('idle', 'F', 'B' or 'W') of a middle virtual stage each tick,
    or ('FB') an F and then a B of the same microbatch, tick after tick.

    Not a valid schedule -- the values are meaningless -- but each tick executes exactly one
    action per stage through the executor's switch, with the usual transfers. An F alone
    is dead code (nothing reads what it stashes or sends), so its cost is measured as 'FB'
    less 'B' (`tick_costs_ms`).
    """
    import numpy as np

    from jax_overlap.pipeline import program as tick_program
    from jax_overlap.pipeline import schedules

    kinds = () if kind == "idle" else ("F", "B", "W") if split else ("F", "B")
    per_tick = ["F", "B"] * (TICKS // 2) if kind == "FB" else [kind] * TICKS
    micro = [t // 2 if kind == "FB" else t for t in range(TICKS)]
    branches = tuple(tick_program.Branch(k, "mid") for k in kinds)
    grid = tuple(tuple(None if k == "idle" else schedules.Action(k, mb % microbatches)
                       for k, mb in zip(per_tick, micro)) for _ in range(STAGES))
    schedule = schedules.Schedule(f"only-{kind}", STAGES, microbatches, 1, split,
                                  schedules.linear_placement(STAGES), grid)
    table = np.zeros((TICKS, STAGES, 1, len(tick_program.FIELDS)), np.int32)
    col = tick_program.COL
    table[..., col["branch"]] = np.asarray([tick_program.IDLE if k == "idle"
                                            else 1 + kinds.index(k) for k in per_tick])[
        :, None, None]
    table[..., col["microbatch"]] = (np.asarray(micro) % microbatches)[:, None, None]
    table[..., [col["file_down"], col["file_up"], col["file_self"]]] = 1  # the trash slot
    down = tuple((s, s + 1) for s in range(STAGES - 1))
    return tick_program.TickProgram(schedule, branches, table, 1, down,
                                    tuple((b, a) for a, b in down), False)


def peak_bytes(compiled) -> int | None:
    """Per-device bytes the compiled step holds at once (XLA's memory analysis: arguments,
    outputs and temporaries, less what is aliased), or None where the backend has none."""
    ma = compiled.memory_analysis()
    if ma is None:
        return None
    return int(ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
               - ma.alias_size_in_bytes)


def weighted_bubble(program, cost: dict[str, float]) -> float:
    """Idle device-time fraction of the lockstep run when actions take their measured time.

    A tick lasts as long as its slowest entry; a non-split B costs the measured "B+W", and a
    paired entry the sum of its two actions.
    """
    import numpy as np

    s = program.schedule
    per_tick = np.zeros((program.ticks, s.stages))
    for d, t, action in s.actions():
        kind = "B+W" if action.kind == "B" and not s.split_backward else action.kind
        per_tick[t, d] += cost[kind]
    span = per_tick.max(axis=1).sum() * s.stages
    return float(1.0 - per_tick.sum() / span)


def accumulation_microbatches(global_batch: int, m: int, pipe_dp: int = 2
                               ) -> tuple[int, bool]:
    """(k, exact): the microbatch count of the pp = 1, dp = DEVICES baseline whose microbatch
    (global_batch / (DEVICES k) sequences) matches a pipelined row's, global_batch /
    (pipe_dp m); `exact` False when no valid k gives it and k is the nearest (ties: the
    larger microbatch, fewer k)."""
    per_replica = global_batch // DEVICES
    target = global_batch / (pipe_dp * m)
    valid = [k for k in range(1, per_replica + 1) if per_replica % k == 0]
    k = min(valid, key=lambda k: (abs(per_replica / k - target), k))
    return k, per_replica / k == target


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", help="results JSON (default bench/results/pipeline.json; "
                                  "none with --quick)")
    ap.add_argument("--json", action="store_true",
                    help="print one JSON object (action_ms, rows) instead of the table")
    ap.add_argument("--quick", action="store_true",
                    help="tiny model, two schedules at m=4, one repetition: checks the bench "
                         "runs")
    ap.add_argument("--schedules", default="",
                    help="comma-separated subset of the schedules, e.g. 1f1b,zb-v")
    ap.add_argument("--microbatches", default="", help="comma-separated, e.g. 8")
    ap.add_argument("--pair-search", type=int, default=PAIR_SEARCH,
                    help="paired rows: steps of the pairing search at the measured tick costs "
                         "(pipeline.pair_search; 0: one pairing quorum per table)")
    args = ap.parse_args()
    if args.quick:
        args.reps = 1
        args.pair_search = min(args.pair_search, QUICK_PAIR_SEARCH)
    elif args.out is None:
        args.out = os.path.join(REPO, "bench", "results", "pipeline.json")
    microbatches = QUICK_MICROBATCHES if args.quick else MICROBATCHES
    schedules = QUICK_SCHEDULES if args.quick else SCHEDULES
    if args.schedules:
        schedules = tuple(sc for sc in SCHEDULES if sc[0] in args.schedules.split(","))
    if args.microbatches:
        microbatches = tuple(int(m) for m in args.microbatches.split(","))

    sys.path.insert(0, REPO)
    from jax_overlap.parallel.mesh import force_host_devices

    if args.quick:
        from _quick import fast_cpu_compiles

        fast_cpu_compiles()

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    force_host_devices(DEVICES)
    import jax

    from jax_overlap import config
    from jax_overlap.pipeline import executor, layout
    from jax_overlap.data import streams as data
    from jax_overlap.training.assemble import assemble

    base = (QUICK_MODEL if args.quick else MODEL) + list(args.overrides)

    inits = {}  # every row has the same model: initialised once (eagerly: ~100 small ops)

    def setup(overrides):
        cfg = config.load(os.path.join(REPO, "configs", "tiny.yaml"), base + overrides)
        run = assemble(cfg, jax.devices()[:DEVICES])
        key = repr(cfg.model)
        if key not in inits:
            inits[key] = run.model.init(jax.random.key(0))
        params = layout.to_staged(inits[key], run.plan.layer_perm)
        params = jax.device_put(params, run.param_shardings())
        batch = run.put_batch(data.stream_from_config(cfg).batch(0))
        return run, params, batch

    baselines, again = {}, {}
    for name, mesh_set in (("dp8", ["mesh.dp=8", "mesh.tp=1"]),
                           ("dp2xtp4", ["mesh.dp=2", "mesh.tp=4"])):
        run, params, batch = setup(mesh_set + ["mesh.pp=1",
                                               "pipeline.microbatches=1"])
        cfg, model, mesh = run.cfg, run.model, run.mesh
        compile_s, step_s, compiled = timed(run.loss_and_grads(),
                                            (params, batch), args.reps)
        baselines[name] = {"step_s": step_s, "compile_s": compile_s, "microbatches": 1}
        again[name] = (compiled, (params, batch))
        print(f"pp=1 {name}: {step_s * 1e3:.1f} ms/step (compile {compile_s:.1f} s)",
              flush=True, file=sys.stderr if args.json else sys.stdout)

    # The work-ratio baselines: dp8, pp=1, gradient accumulation over k microbatches of the
    # pipelined rows' microbatch size (k = 1 is the dp8 baseline above, not compiled again).
    global_batch = batch["inputs"].shape[0]
    work_base = {}  # m -> (baseline name, k, exact)
    for m in microbatches:
        k, exact = accumulation_microbatches(global_batch, m)
        name = "dp8" if k == 1 else f"dp8 acc{k}"
        work_base[m] = (name, k, exact)
        if name in baselines:
            continue
        run, params, batch = setup(["mesh.dp=8", "mesh.tp=1", "mesh.pp=1",
                                    f"pipeline.microbatches={k}"])
        cfg, model, mesh = run.cfg, run.model, run.mesh
        compile_s, step_s, compiled = timed(
            run.loss_and_grads(),
            (params, batch), args.reps)
        baselines[name] = {"step_s": step_s, "compile_s": compile_s, "microbatches": k}
        again[name] = (compiled, (params, batch))
        print(f"pp=1 {name} ({k} microbatches of {global_batch // DEVICES // k}): "
              f"{step_s * 1e3:.1f} ms/step (compile {compile_s:.1f} s)",
              flush=True, file=sys.stderr if args.json else sys.stdout)

    def retime_baselines():
        # Re-timed between groups: the best over the whole run is robust to load bursts.
        for name, (compiled, fn_args) in again.items():
            best = best_time(compiled, fn_args, args.reps)
            baselines[name]["step_s"] = min(baselines[name]["step_s"], best)

    pipe = ["mesh.dp=2", f"mesh.pp={STAGES}", "mesh.tp=1"]
    # One tick of each action kind, every stage busy with it (TICK_M-sized microbatches).
    run, params, batch = setup(pipe + ["pipeline.schedule=zb-h1",
                                       f"pipeline.microbatches={TICK_M}"])
    cfg, model, mesh = run.cfg, run.model, run.mesh
    plan = run.plan
    ticks = {}
    # Each action's cost is a difference from the idle program's: a few calls each even in
    # --quick, or one slow call on a loaded host can put an action at or below zero.
    tick_reps = max(args.reps, TICK_REPS)
    for kind, split in (("idle", True), ("FB", True), ("B", True), ("W", True),
                        ("B", False)):
        program = single_action_program(kind, TICK_M, split)
        fn = executor.make_pipeline_loss_and_grads(model, plan.with_program(program), mesh)
        _, step_s, _ = timed(fn, (params, batch), tick_reps)
        ticks[kind if split or kind != "B" else "B+W (non-split B)"] = step_s
    idle_s = ticks["idle"]
    tick_ms = {"idle (whole program / ticks)": idle_s / TICKS * 1e3}
    tick_ms.update({k: (v - idle_s) / TICKS * 1e3 for k, v in ticks.items()
                    if k not in ("idle", "FB")})
    # FB runs TICKS / 2 of each: F = 2 (FB - idle) / TICKS - B.
    tick_ms["F"] = 2 * (ticks["FB"] - idle_s) / TICKS * 1e3 - tick_ms["B"]
    tick_ms = {k: tick_ms[k] for k in ("idle (whole program / ticks)", "F", "B", "W",
                                       "B+W (non-split B)")}

    cost = {"F": tick_ms["F"], "B": tick_ms["B"], "W": tick_ms["W"],
            "B+W": tick_ms["B+W (non-split B)"]}
    rows = []
    for m in microbatches:
        for (name, chunks), paired in ((sc, pr) for sc in schedules for pr in PAIRINGS):
            search = ([f"pipeline.pair_search={args.pair_search}",
                       # (a noisy tick that measured below the idle one still counts)
                       "pipeline.tick_costs=[{}]".format(",".join(
                           f"{max(cost[k], 1e-3):.4f}" for k in "FBW"))] if paired else [])
            run, params, batch = setup(pipe + [
                f"pipeline.schedule={name}", f"pipeline.microbatches={m}",
                f"pipeline.virtual_stages={chunks}", f"pipeline.paired={str(paired).lower()}",
                *search])
            cfg, model, mesh = run.cfg, run.model, run.mesh
            fn = run.loss_and_grads()
            compile_s, step_s, compiled = timed(fn, (params, batch), args.reps)
            # The work ratio: against its baseline timed turn about with it.
            base_compiled, base_args = again[work_base[m][0]]
            step_s, base_s = alternating_best(compiled, (params, batch), base_compiled,
                                              base_args, args.reps)
            program = fn.program
            plan = run.plan
            micro = batch["inputs"].shape[0] // 2 // m  # sequences per microbatch (dp = 2)
            act = micro * cfg.model.seq_len * cfg.model.d_model * 4  # one fp32 activation
            stash = (program.slots + 1) * act + sum(
                v for k, v in executor.residual_bytes(model, plan, mesh).items() if k != "slot")
            rows.append({"schedule": name, "paired": paired,
                         "pair_search": args.pair_search if paired else 0,
                         "stages": STAGES, "microbatches": m,
                         "bubble": program.idle_fraction(),
                         "weighted_bubble": weighted_bubble(program, cost),
                         "step_ms": step_s * 1e3, "stash_bytes": int(stash),
                         "peak_bytes": peak_bytes(compiled), "remat": plan.remat,
                         "virtual_stages": program.schedule.virtual_stages,
                         "ticks": program.ticks, "bubble_fraction": program.idle_fraction(),
                         "bubble_at_measured_costs": weighted_bubble(program, cost),
                         "stash_slots": program.slots, "step_s": step_s,
                         "work_baseline_s": base_s, "compile_s": compile_s})
            print(f"{name}{' paired' if paired else ''} m={m}: {step_s * 1e3:.1f} ms (compile {compile_s:.1f} s)", flush=True,
                  file=sys.stderr if args.json else sys.stdout)
        retime_baselines()
    ref_s = baselines["dp8"]["step_s"]
    for r in rows:
        r["vs_pp1_dp8"] = r["step_s"] / ref_s
        r["vs_pp1_dp2xtp4"] = r["step_s"] / baselines["dp2xtp4"]["step_s"]
        name, k, exact = work_base[r["microbatches"]]
        r["work_ratio"] = r["step_s"] / r["work_baseline_s"]
        r["work_baseline"] = {"name": name, "mesh": "dp8", "microbatches": k,
                              "micro_batch": global_batch // DEVICES // k,
                              "pipelined_micro_batch": global_batch // 2 // r["microbatches"],
                              "exact": exact, "step_ms": r.pop("work_baseline_s") * 1e3}

    header = (f"{'schedule':<19} {'p':>2} {'m':>3} {'v':>2} {'ticks':>5} {'bubble':>7} "
              f"{'w-bubble':>8} {'slots':>5} {'step ms':>8} {'peak MiB':>8} {'/ pp1 dp8':>9} "
              f"{'/ dp2xtp4':>9} {'work':>6}")
    title = (f"pp4 x dp2 on {jax.device_count()} {jax.devices()[0].platform} devices, "
             f"{cfg.model.layers}L d{cfg.model.d_model} ff{cfg.model.d_ff} "
             f"seq{cfg.model.seq_len} global batch {cfg.train.global_batch}; "
             f"pp=1 dp8 {ref_s * 1e3:.1f} ms, dp2xtp4 "
             f"{baselines['dp2xtp4']['step_s'] * 1e3:.1f} ms")
    lines = [title, header, "-" * len(header)]
    for r in rows:
        label = r["schedule"] + ("+paired" if r["paired"] else "")
        lines.append(f"{label:<19} {r['stages']:>2} {r['microbatches']:>3} "
                     f"{r['virtual_stages']:>2} {r['ticks']:>5} {r['bubble_fraction']:>7.3f} "
                     f"{r['bubble_at_measured_costs']:>8.3f} {r['stash_slots']:>5} "
                     f"{r['step_s'] * 1e3:>8.1f} {r['peak_bytes'] / 2**20 if r['peak_bytes'] else 0:>8.1f} "
                     f"{r['vs_pp1_dp8']:>9.2f} {r['vs_pp1_dp2xtp4']:>9.2f} "
                     f"{r['work_ratio']:>5.2f}{' ' if r['work_baseline']['exact'] else '~'}")
    lines.append("")
    lines.append("work = step / pp=1 dp8 step with gradient accumulation, same microbatch size:")
    for m, (name, k, exact) in work_base.items():
        micro = global_batch // DEVICES // k
        lines.append(f"  m={m:<3} {name:<10} {k:>3} microbatch{'es' if k > 1 else ''} of "
                     f"{micro} sequence{'s' if micro > 1 else ''} per replica, "
                     f"{baselines[name]['step_s'] * 1e3:.1f} ms"
                     + ("" if exact else f"  ~ nearest valid: pipelined microbatch is "
                                         f"{global_batch / 2 / m:g} sequences"))
    lines.append("")
    lines.append(f"one tick, every stage running the same action (pp4 x dp2, microbatch of "
                 f"{cfg.train.global_batch // 2 // TICK_M}, {TICKS}-tick programs, ms per "
                 f"tick):")
    for k, v in tick_ms.items():
        lines.append(f"  {k:<30} {v:>8.2f}")
    if args.json:
        print(json.dumps({"action_ms": cost, "rows": rows,
                          "baselines_ms": {k: v["step_s"] * 1e3 for k, v in baselines.items()}}))
    else:
        print("\n".join(lines))

    if args.out is None:
        return
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"devices": jax.device_count(), "platform": jax.devices()[0].platform,
                   "model": base, "baselines_pp1": baselines, "rows": rows,
                   "tick_ms": tick_ms, "table": lines}, f, indent=2)


if __name__ == "__main__":
    main()
