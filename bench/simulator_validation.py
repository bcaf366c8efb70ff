"""Simulator validation: predicted vs measured step times of several plans on 8 CPU devices.

For each configuration (a mix of dp / tp / pp degrees and microbatches of the default
model; the pipelined ones when the executor exists) the train step is run for real and
predicted by the simulator on the `cpu_here` profile from a calibration
(`jax_overlap.analysis.calibrate`). Other processes share this machine's cores and the
load drifts while the benchmark runs, so measurements are taken in pairs: one train step,
then at once the calibration pieces its prediction uses (its own micro-batch shape, the
optimizer update, the psum links of its group sizes, a pipeline's tick loop; the cores'
parallel capacity once per round). A plan's error is the median over its pairs of
predicted / measured - 1; the plans are visited round-robin, `--rounds` times, `--steps`
pairs each time.

Two predictions are reported: `predicted` from the pieces timed in the same pair;
`predicted (fit)` from the least-squares fit over every measured shape -- what
`jax-overlap tune` uses -- to show what interpolating between shapes costs.

    python bench/simulator_validation.py [--rounds 3] [--steps 3]
    python bench/simulator_validation.py --quick

Writes bench/results/simulator_validation.json and bench/results/simulator_validation.md (its
table goes into docs/results.md). `--quick`
checks that the bench runs: `QUICK_PLANS` (one pipelined plan, so dp and pp links) of a
tiny model, one round of three pairs, LLVM at -O0; it prints the table and writes neither file,
and exits 1 when predicted / measured is outside [1 / QUICK_BOUND, QUICK_BOUND].
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = 0.25
# The --quick run's bound, predicted / measured within [1 / QUICK_BOUND, QUICK_BOUND]
# (docs/results.md): its tiny model's pipeline step is mostly fixed costs -- the tick loop's
# (the branch switch and each transfer's rendezvous of 8 device threads, timed by
# `Calibrator.time_tick`) and every kernel's launch -- which vary most between machines.
QUICK_BOUND = 3.0

# (dp, tp, pp, microbatches, schedule, virtual stages): plans of the default model on 8
# devices. The pipelined ones run only when the executor exists.
PLANS = [
    (2, 4, 1, 2, "1f1b", 1),
    (8, 1, 1, 1, "1f1b", 1),
    (8, 1, 1, 4, "1f1b", 1),
    (4, 2, 1, 2, "1f1b", 1),
    (4, 2, 1, 8, "1f1b", 1),
    (2, 4, 1, 8, "1f1b", 1),
    (2, 2, 2, 4, "1f1b", 1),
    (4, 1, 2, 4, "gpipe", 1),
    (2, 1, 4, 4, "1f1b", 1),
]

# --quick: configs/tiny.yaml's model with 4 layers (4 stages), synthetic data.
QUICK_PLANS = [(2, 1, 4, 4, "1f1b", 1)]
QUICK_MODEL = ["model.layers=4", "data.source=synthetic"]


def summarise(label: str, pairs: list[tuple[float, float]], fit) -> dict:
    """One plan's row from its (measured, predicted) pairs and the fit-based prediction.

    The error is the median over pairs of predicted / measured - 1: each pair's numbers
    were taken seconds apart, under the same load.
    """
    measured = statistics.median(m for m, _ in pairs)
    predicted = statistics.median(p for _, p in pairs)
    return {
        "plan": label,
        "measured_s": measured,
        "predicted_s": predicted,
        "error": statistics.median(p / m - 1 for m, p in pairs),
        "predicted_fit_s": fit.step_time_s,
        "error_fit": (fit.step_time_s - measured) / measured,
        "predicted_ccor": fit.ccor,
        "predicted_bubble": fit.bubble_rate,
        "pairs": [{"measured_s": m, "predicted_s": p} for m, p in pairs],
    }


def _time_steps(step, args, steps: int) -> tuple[list[float], tuple]:
    import jax

    state, batch = args
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    return times, (state, batch)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="default configs/default.yaml (configs/tiny.yaml with "
                                     "4 layers with --quick)")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--steps", type=int,
                    help="(step, calibration) pairs per plan per round (default 3)")
    ap.add_argument("--out", help="results JSON (default bench/results/"
                                  "simulator_validation.json; none with --quick)")
    ap.add_argument("--doc", help="markdown page (default bench/results/"
                                  "simulator_validation.md; none with --quick)")
    ap.add_argument("--quick", action="store_true",
                    help="one plan of a tiny model, three pairs: checks the bench runs")
    args = ap.parse_args()
    overrides = []
    if args.quick:
        args.config = args.config or os.path.join(ROOT, "configs", "tiny.yaml")
        args.rounds, args.steps = args.rounds or 1, args.steps or 3
        overrides = QUICK_MODEL
    else:
        args.config = args.config or os.path.join(ROOT, "configs", "default.yaml")
        args.rounds, args.steps = args.rounds or 3, args.steps or 3
        args.out = args.out or os.path.join(ROOT, "bench", "results",
                                            "simulator_validation.json")
        args.doc = args.doc or os.path.join(ROOT, "bench", "results", "simulator_validation.md")

    from jax_overlap import config
    from jax_overlap.parallel.mesh import force_host_devices

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    force_host_devices(8)
    if args.quick:
        from _quick import fast_cpu_compiles

        fast_cpu_compiles()
    import jax

    from jax_overlap.analysis import calibrate as cal_lib
    from jax_overlap.analysis import plan_costs, plan_shape
    from jax_overlap.analysis import tune
    from jax_overlap.hardware.link_profiles import load_profile
    from jax_overlap.analysis.profile import build_step

    load_start = os.getloadavg()[0]
    base = config.load(args.config, overrides)
    hw = load_profile("cpu_here")
    devices = jax.devices()[:8]
    have_executor = os.path.exists(os.path.join(ROOT, "jax_overlap", "pipeline", "executor.py"))
    plans = []
    for dp, tp, pp, m, schedule, v in QUICK_PLANS if args.quick else PLANS:
        if pp > 1 and not have_executor:
            continue
        cand = tune.Candidate(dp, tp, pp, v, m, schedule, 0.0, False, 1)
        plans.append((cand, tune.apply_candidate(base, cand)))

    print(f"compiling {len(plans)} train steps ...", flush=True)
    steps = {}
    for cand, cfg in plans:
        step, step_args = build_step(cfg, devices)
        _, step_args = _time_steps(step, step_args, 1)  # compile
        steps[cand] = (step, step_args)

    # Pieces are timed once per pair (repeats=1): the pairing, not repetition, is what
    # makes a prediction comparable with the step measured next to it.
    calibrator = cal_lib.Calibrator(base, devices, repeats=1)
    shape_of = {c: (tune.plan_of(cfg).micro_batch, cfg.mesh.tp) for c, cfg in plans}
    quantities_of = {}
    for cand, cfg in plans:
        plan = tune.plan_of(cfg)
        quantities_of[cand] = plan_shape.quantities_for(cfg, plan, plan.split_backward)
    act_of = {c: plan_costs.activation_bytes(cfg, tune.plan_of(cfg)) for c, cfg in plans}
    groups_of = {c: sorted({n for n in (c.dp, c.tp, c.pp) if n > 1}) for c, _ in plans}
    print("compiling calibration pieces ...", flush=True)
    for cand, cfg in plans:
        calibrator.time_shapes([shape_of[cand]], quantities_of[cand])
        calibrator.time_optimizer(cfg.mesh.tp)
        for g in groups_of[cand]:
            calibrator.time_link(g)
        if cand.pp > 1:
            calibrator.time_tick(cand.pp, act_of[cand])
    big_shape = max(shape_of.values())
    calibrator.parallel_capacity(*big_shape)

    all_samples: list = []
    pairs: dict = {c: [] for c, _ in plans}  # (measured, predicted) per pair
    capacities, link_samples, tick_samples = [], {}, {}
    for r in range(args.rounds):
        t_round = time.perf_counter()
        capacity = calibrator.parallel_capacity(*big_shape)
        capacities.append(capacity)
        for cand, cfg in plans:
            step, step_args = steps[cand]
            for _ in range(args.steps):
                times, step_args = _time_steps(step, step_args, 1)
                samples = calibrator.time_shapes([shape_of[cand]], quantities_of[cand])
                samples.append(calibrator.time_optimizer(cfg.mesh.tp))
                links = {g: calibrator.time_link(g) for g in groups_of[cand]}
                for g, link in links.items():
                    link_samples.setdefault(g, []).append(link)
                ticks = ({cand.pp: calibrator.time_tick(cand.pp, act_of[cand])}
                         if cand.pp > 1 else {})
                for g, tick in ticks.items():
                    tick_samples.setdefault(g, []).append(tick)
                all_samples += samples
                cal = calibrator.calibration(samples, capacity, links, ticks)
                pairs[cand].append((times[0], tune.predict(cand, cfg, hw, cal).step_time_s))
            steps[cand] = (step, step_args)
            meas = statistics.median(m for m, _ in pairs[cand])
            pred = statistics.median(p for _, p in pairs[cand])
            print(f"  round {r + 1}: {cand.label():<38} measured {meas * 1e3:8.1f} ms"
                  f"  predicted {pred * 1e3:8.1f} ms", flush=True)
        print(f"round {r + 1} took {time.perf_counter() - t_round:.0f} s", flush=True)

    capacity = statistics.median(capacities)
    links = {g: dataclasses.replace(
        ls[0],
        latency_s=statistics.median(x.latency_s for x in ls),
        bandwidth_bytes_per_s=statistics.median(x.bandwidth_bytes_per_s for x in ls))
        for g, ls in link_samples.items()}
    # Without its samples a calibration answers every shape from the fit alone (with them
    # it would answer measured shapes as measured): the fit is what this column shows.
    ticks = {g: cal_lib.Tick(statistics.median(t.fixed_s for t in ts),
                             statistics.median(t.per_byte_s for t in ts))
             for g, ts in tick_samples.items()}
    fitted = dataclasses.replace(calibrator.calibration(all_samples, capacity, links, ticks),
                                 samples=())
    rows = []
    for cand, cfg in plans:
        p = tune.predict(cand, cfg, hw, fitted)
        rows.append(summarise(cand.label(), pairs[cand], p))

    doc = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{os.cpu_count()} cores, 8 forced XLA CPU devices; jax {jax.__version__}",
        "config": os.path.relpath(args.config, ROOT),
        "load_average": [load_start, os.getloadavg()[0]],
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "target": TARGET,
        "parallel_capacity": capacity,
        "links": {str(g): dataclasses.asdict(link) for g, link in links.items()},
        "ticks": {str(g): dataclasses.asdict(t) for g, t in ticks.items()},
        "fits": {k: dataclasses.asdict(v) for k, v in fitted.fits.items()},
        "rows": rows,
        "within_target": sum(abs(r["error"]) <= TARGET for r in rows),
    }
    if args.out:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)
    table = markdown_table(rows)
    print(table)
    if args.doc:
        os.makedirs(os.path.dirname(args.doc), exist_ok=True)
        with open(args.doc, "w") as f:
            f.write(markdown_page(doc, table))
    if args.quick:
        off = [r["plan"] for r in rows if not within_quick_bound(r["error"])]
        if off:
            print(f"predicted / measured outside [1/{QUICK_BOUND:g}, {QUICK_BOUND:g}]: "
                  f"{', '.join(off)}")
            return 1
    return 0


def within_quick_bound(error: float) -> bool:
    """Whether a quick run's error (predicted / measured - 1) is within its bound."""
    return 1 / QUICK_BOUND <= 1 + error <= QUICK_BOUND


def markdown_table(rows: list[dict]) -> str:
    """Predicted vs measured as a markdown table."""
    lines = [
        "| plan | measured ms | predicted ms | error | predicted (fit) ms | error (fit) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['plan']} | {r['measured_s'] * 1e3:.1f} | {r['predicted_s'] * 1e3:.1f} | "
            f"{r['error'] * 100:+.1f}% | {r['predicted_fit_s'] * 1e3:.1f} | "
            f"{r['error_fit'] * 100:+.1f}% |"
        )
    return "\n".join(lines)


def markdown_page(doc: dict, table: str) -> str:
    """The page of the table (bench/results/simulator_validation.md).."""
    n = len(doc["rows"])
    off = [r for r in doc["rows"] if abs(r["error"]) > doc["target"]]
    outliers = ("Outside the target: " + "; ".join(
        f"{r['plan']} ({r['error'] * 100:+.0f}%)" for r in off) + ".") if off else ""
    return f"""# Simulator validation on this machine

Generated by `python bench/simulator_validation.py` on {doc['date']} ({doc['machine']});
raw numbers in `bench/results/simulator_validation.json`.

Each plan of `{doc['config']}` was run for real on 8 forced CPU devices and predicted by
`jax_overlap.analysis.simulate` on the `cpu_here` profile from a calibration
(`jax_overlap.analysis.calibrate`). Times are per train step (loss, gradients and
optimizer update). Other processes share the cores and the load drifts, so every
measurement is a pair: one step, then at once the calibration pieces its prediction uses;
{doc['rounds']} rounds of {doc['steps_per_round']} pairs per plan. Columns are medians over
the pairs; the error is the median of the pairs' predicted / measured - 1.

* **predicted**: pieces timed at the plan's own micro-batch shape in the same pair.
* **predicted (fit)**: the fit `t = c0 + c1 b + c2 b / tp` over every measured shape --
  what `jax-overlap tune` uses.

{table}

{doc['within_target']} of {n} plans are within the {doc['target'] * 100:.0f}% target
(prediction from the pieces timed in the same pair). The 1-minute load average of this
machine was {doc['load_average'][0]:.1f} at the start and {doc['load_average'][1]:.1f} at the
end: other processes were competing for the same cores, so single measurements scatter by
tens of percent and only the paired medians are meaningful.

{outliers}

## How the CPU is modelled

* The 8 devices share {os.cpu_count()} cores. Every calibration piece runs on all 8 devices
  at once, so a device's compute time already includes waiting for its share of the
  cores. The measured parallel capacity -- devices' worth of compute that run at once --
  is {doc['parallel_capacity']:.2f}: 8 devices computing together each take
  {8 / doc['parallel_capacity']:.1f}x as long as one alone (one device's ops already spread
  over both cores part of the time). In a pipelined step the idle stages free their share,
  which `plan_costs.busy_scale` accounts for.
* XLA CPU runs collectives inline (`synchronous_collectives` in `cpu_here`), so no
  communication overlaps compute. Collectives are costed by the ring formula with
  links measured in the same run, per group size, with all groups reducing at once.
* A pipelined step adds its tick loop: the schedule's ticks (two lanes each where paired)
  times one tick's cost outside its actions -- the arrivals' filing, the switches, the two
  ring permutes of an activation-sized buffer -- measured per ring size
  (`Calibrator.time_tick`).
* Each TP collective pays its own latency: one F / B issues `2 x layers` all-reduces
  plus the embedding's and the loss's, folded into the simulator's single per-action
  all-reduce as latency-equivalent bytes.

## What validating changed in the cost model

The first comparisons were off by 50-80%; each fix below is a property of this machine or
of how the step runs, not a correction factor:

* **Blocks are timed inside a `lax.scan` over every layer**, as the step runs them. The scan
  stacks each layer's residuals for the backward; a lone block skips those copies and
  measured ~40% less work per step (process CPU time) at 4-8 sequences per microbatch.
  One-layer pipeline chunks are timed alone, because XLA unrolls a length-1 scan.
* **One call's launch overhead is subtracted from every piece** (a trivial program on all
  devices, ~0.5 ms): a step runs its pieces in one program, so with 8 microbatches the
  per-piece launches had added ~60% to the prediction.
* **Links are timed as 8 psums in one program**, not one psum per call: per-call timing
  charged every TP all-reduce a launch (~0.7 ms instead of ~0.1 ms).
* **Timings are medians, paired with the step they predict**: short pieces timed minutes
  away from the step, or as the fastest of several calls, caught quieter moments of the
  shared cores than whole steps did.

Still open: at 8 sequences x TP 4 (dp2 tp4 m2) the blocks' scan timed alone runs ~25%
slower per sequence than at 2 sequences (superlinear in the micro-batch, unlike every
other shape measured), while the train step at that shape does not. Over the three full
runs made so far the exact-shape prediction for that plan was 20-33% high and the fit-based
one 4-16% high -- the plan closest to the target's edge.
"""


if __name__ == "__main__":
    sys.exit(main())
