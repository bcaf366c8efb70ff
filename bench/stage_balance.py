"""Balanced pipeline stages: simulated step time and bubble, even vs `pipeline.stage_layers=auto`.

GPT-1.3B (configs/gpt_1p3b.yaml) on one node of 8 H100s (configs/hardware/h100_8x_nvlink.yaml),
no device needed: every plan is simulated (`jax_overlap.analysis.simulate`) with FLOP-based
costs (`jax-overlap tune`'s `flop_costs`, at its assumed 50% of peak), per virtual stage from
the plan's layer split, two ways: `timing="ticks"` plays the executor's program (tick by tick,
each stage waiting for its ring neighbours at every permute), `timing="events"` runs each
stage's row as soon as its inputs are there (what an MPMD runtime would do with the same
order). With the head on the last virtual stage, the even split leaves the stage that also
runs the LM head and loss (about 1.75 blocks of work for GPT-1.3B) the slowest and `auto`
moves layers off it; a vocabulary-parallel head (`pipeline.vocab_parallel`) gives every stage
1/pp of it instead.

    python bench/stage_balance.py            # the table; writes bench/results/stage_balance.json
    python bench/stage_balance.py --json     # one JSON object on the last line as well
    python bench/stage_balance.py --quick    # one mesh, one microbatch count; writes nothing

Columns: `head` (last: on the last virtual stage; vocab: vocabulary-parallel), `L`
(`pipeline.transfer_latency`; 2 is the skewed loop, whose permutes run under the next tick's
action), `stage_layers` (per virtual stage, model order), `tick_ms` / `t-bubble` (the tick
simulation's step and idle fraction of it, device mean; JSON `tick_step_ms`, `tick_bubble`),
`e-bubble` (the event-driven one; JSON `step_ms`, `bubble`); split `search` is auto's split
improved by the tick simulation (`tune.search_split`: one-layer moves while the step gets
shorter, what `jax-overlap tune` does for its leading pipelined plans), `table` (the schedule
table's idle fraction, what equal action costs would give), `floor` (the least bubble any
whole-layer split can have from stage imbalance alone: the embedding and a head on the last
virtual stage are extra work on their stages; see docs/guides/pipelines.md), `speedup` (even
tick step / this one).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "gpt_1p3b.yaml")
HARDWARE = "h100_8x_nvlink"
MESHES = [(4, 2, 1), (2, 2, 2)]  # (pp, dp, tp)
SCHEDULES = [("zb-v", 2), ("1f1b", 1)]
MICROBATCHES = (8, 16, 32)  # 32: 4 sequences per microbatch, auto microbatching's GPU choice
BUCKET_MB = 64.0  # configs/gpt_1p3b.yaml's gradient buckets
# Where the LM head runs (`pipeline.vocab_parallel`: "last", the last virtual stage's stage;
# "vocab", 1/pp of it on every stage) and the transfer latency (2: the skewed loop).
VARIANTS = [("last", 1), ("vocab", 1), ("vocab", 2)]
QUICK = {"meshes": MESHES[:1], "microbatches": (8,)}


def imbalance_floor(cfg, hw) -> float:
    """The least bubble any whole-layer split can have from stage imbalance alone.

    Per virtual stage, `tune.flop_costs` of `cfg` (F + B + W) gives one layer's cost and the
    embedding's / head's extra; a stage's load is its chunks' layers plus those extras.
    Every split of the layers into per-stage counts (each stage at least one layer per
    chunk) is tried: the floor is 1 - mean load / the smallest busiest-stage load.
    """
    import itertools

    from jax_overlap.analysis import tune

    plan = tune.plan_of(cfg)
    costs = tune.flop_costs(cfg, hw)
    total = [f + b + w for f, b, w in zip(costs.forward_s, costs.backward_s, costs.weight_s)]
    layers = list(plan.stage_layers)
    layer = min(t / n for t, n in zip(total, layers))  # a chunk without embedding or head
    extra = [0.0] * plan.pp
    chunks = [0] * plan.pp
    for vs, (stage, _) in enumerate(plan.schedule.placement):
        extra[stage] += total[vs] - layers[vs] * layer
        chunks[stage] += 1
    n_layers = sum(layers)
    best = None
    for counts in itertools.product(*(range(c, n_layers + 1) for c in chunks)):
        if sum(counts) != n_layers:
            continue
        busiest = max(n * layer + e for n, e in zip(counts, extra))
        best = busiest if best is None else min(best, busiest)
    mean = (n_layers * layer + sum(extra)) / plan.pp
    return 1.0 - mean / best


def rows(meshes, microbatches, variants=VARIANTS) -> list[dict]:
    from jax_overlap import config
    from jax_overlap.analysis import tune
    from jax_overlap.hardware.link_profiles import load_profile
    from jax_overlap.pipeline.schedules import bubble_fraction

    hw = load_profile(HARDWARE)
    base = config.load(CONFIG)
    out = []
    for pp, dp, tp in meshes:
        for schedule, v in SCHEDULES:
            for m in microbatches:
                for head, lat in variants:
                    even_ms, p = None, None
                    for split in ("even", "auto", "search"):
                        if split == "search":  # auto's split improved by the tick simulation
                            p = tune.search_split(p, hw, timing="ticks")
                            cfg = p.config
                        else:
                            # On a GPU `auto` is the balanced split.
                            cand = tune.Candidate(dp, tp, pp, v, m, schedule, BUCKET_MB, False,
                                                  1, lat, "balanced" if split == "auto" else split,
                                                  vocab_parallel=head == "vocab")
                            cfg = tune.apply_candidate(base, cand)
                            p = tune.predict(cand, cfg, hw, timing="ticks")
                        events = tune.predict(p.candidate, cfg, hw, timing="events")
                        plan = tune.plan_of(cfg)
                        step_ms = p.step_time_s * 1e3
                        even_ms = step_ms if split == "even" else even_ms
                        if split == "even":
                            floor = imbalance_floor(cfg, hw)
                        out.append({"mesh": f"pp{pp}xdp{dp}" + (f"xtp{tp}" if tp > 1 else ""),
                                    "schedule": schedule, "microbatches": m, "head": head,
                                    "transfer_latency": lat, "split": split,
                                    "stage_layers": list(plan.stage_layers),
                                    "tick_step_ms": round(step_ms, 1),
                                    "tick_bubble": round(p.bubble_rate, 4),
                                    "step_ms": round(events.step_time_s * 1e3, 1),
                                    "bubble": round(events.bubble_rate, 4),
                                    "table": round(bubble_fraction(plan.schedule), 4),
                                    "floor": round(floor, 4),
                                    "speedup": round(even_ms / step_ms, 3)})
    return out


def table(result: list[dict]) -> str:
    head = (f"{'mesh':<12} {'schedule':<8} {'m':>3} {'head':<5} {'L':>1} {'split':<6} "
            f"{'stage_layers':<24} {'tick_ms':>8} {'t-bubble':>8} {'e-bubble':>8} "
            f"{'table':>6} {'floor':>6} {'speedup':>7}")
    lines = [head, "-" * len(head)]
    for r in result:
        layers = ",".join(str(n) for n in r["stage_layers"])
        lines.append(f"{r['mesh']:<12} {r['schedule']:<8} {r['microbatches']:>3} "
                     f"{r['head']:<5} {r['transfer_latency']:>1} {r['split']:<6} {layers:<24} "
                     f"{r['tick_step_ms']:>8.1f} {r['tick_bubble']:>8.3f} {r['bubble']:>8.3f} "
                     f"{r['table']:>6.3f} {r['floor']:>6.3f} {r['speedup']:>7.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one mesh, m=8; writes nothing")
    ap.add_argument("--json", action="store_true", help="also print one JSON object")
    args = ap.parse_args(argv)
    sys.path.insert(0, ROOT)
    if args.quick:
        result = rows(QUICK["meshes"], QUICK["microbatches"])
    else:
        result = rows(MESHES, MICROBATCHES)
    print(f"GPT-1.3B on {HARDWARE}, simulated (FLOP costs), even vs auto stage_layers; "
          f"t-: the executor's ticks, e-: event-driven")
    print(table(result))
    doc = {"hardware": HARDWARE, "config": "configs/gpt_1p3b.yaml", "rows": result,
           "date": datetime.date.today().isoformat()}
    if not args.quick:
        path = os.path.join(ROOT, "bench", "results", "stage_balance.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"wrote {os.path.relpath(path, ROOT)}")
    if args.json:
        print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
