"""GPU benchmark: step time, tokens/s, MFU and peak memory of the GPT at three sizes on one GPU,
the overlap analysis of the 8-GPU-compiled 1.3B step, and a profiled step's overlap.

    JAX_PLATFORMS=cuda,cpu python bench/gpu.py [--out bench/results/gpu.json] [--steps 8]

MFU = model FLOPs per step / (step time x the chip's peak dense bf16 rate: 989 TFLOP/s for
H100/H200, 312 for A100). Sized to finish in under 8 minutes on one H200.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

SIZES = {  # name: (layers, d_model, heads, d_ff, seq_len, global_batch, microbatches)
    "gpt-125m": (12, 768, 12, 3072, 1024, 32, 1),
    "gpt-350m": (24, 1024, 16, 4096, 1024, 32, 1),
    "gpt-1.3b": (24, 2048, 16, 8192, 2048, 16, 2),
}


def overrides_for(name: str) -> list[str]:
    layers, d, h, f, t, b, m = SIZES[name]
    return [f"model.layers={layers}", f"model.d_model={d}", f"model.heads={h}",
            f"model.d_ff={f}", "model.vocab=50304", f"model.seq_len={t}",
            f"train.global_batch={b}", f"pipeline.microbatches={m}", "train.precision=bf16",
            "mesh.dp=1", "mesh.pp=1", "mesh.tp=1", "data.source=synthetic"]


def time_size(name: str, steps: int) -> dict:
    import jax

    from jax_overlap import config
    from jax_overlap import plan as plan_lib
    from jax_overlap.model_api import build_model
    from jax_overlap.plan import ParallelPlan
    from jax_overlap.training import data
    from jax_overlap.training import step as steplib
    from jax_overlap.training.loop import peak_flops

    cfg = config.load("configs/tiny.yaml", overrides_for(name))
    device = jax.devices()[0]
    mesh = plan_lib.mesh_from_config(cfg, [device])
    model = build_model(cfg)
    optimizer = steplib.make_optimizer(cfg.train)
    state = steplib.init_state(model, ParallelPlan.build(cfg, model), mesh, optimizer, cfg.train.seed)
    step = steplib.make_train_step(model, ParallelPlan.build(cfg, model), mesh, optimizer, steplib.lr_schedule(cfg.train))
    stream = data.stream_from_config(cfg)
    batches = [steplib.put_batch(stream.batch(i), mesh) for i in range(2)]
    state, m = step(state, batches[0])
    float(m["loss"])
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        state, m = step(state, batches[i % 2])
        float(m["loss"])
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    flops = model.flops_per_example() * cfg.train.global_batch
    peak = peak_flops(device) or float("nan")
    stats = device.memory_stats() or {}
    return {"model": name, "params": model.num_params(), "step_s": t,
            "tokens_per_s": cfg.train.global_batch * cfg.model.seq_len / t,
            "mfu": flops / (t * peak), "peak_memory_gib": stats.get("peak_bytes_in_use", 0) / 2**30,
            "device": device.device_kind, "loss": float(m["loss"])}


def analyze_8gpu(target: str) -> dict:
    from jax_overlap import config
    from jax_overlap.analysis import analyze

    out = {}
    for label, extra in [("dp8", []), ("dp2xtp4 cm-bi", ["mesh.dp=2", "mesh.tp=4",
                          "overlap.tp_comm=collective_matmul",
                          "overlap.collective_matmul_direction=bi"])]:
        cfg = config.load("configs/gpt_1p3b.yaml", extra)
        data = analyze.analyze(cfg, target).to_json()
        out[label] = {k: data[k] for k in ("async_fraction", "collective_bytes_under_gemm_fraction",
                                           "exposed_comm_s_estimate")}
    return out


def profile_small() -> dict:
    from jax_overlap import config
    from jax_overlap.analysis.profile import profile_config

    cfg = config.load("configs/tiny.yaml", overrides_for("gpt-125m"))
    import jax

    res = profile_config(cfg, steps=2, logdir="runs/profile_gpu", devices=jax.devices()[:1])
    m = res.metrics
    return {"compute_s": m.compute_s, "comm_s": m.comm_s, "overlap_s": m.overlap_s,
            "idle_s": m.idle_s, "ccor": m.ccor, "step_time_s": m.step_time_s}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/gpu.json")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--skip-analyze", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cuda,cpu")
    import jax

    if jax.devices()[0].platform != "gpu":
        print("error: bench/gpu.py needs a GPU (JAX_PLATFORMS=cuda)", file=sys.stderr)
        return 2
    rows = [time_size(name, args.steps) for name in SIZES]
    print(f"{'model':10s} {'params':>8s} {'step s':>8s} {'tokens/s':>10s} {'MFU':>6s} "
          f"{'peak GiB':>9s}   ({rows[0]['device']}, jax {jax.__version__})")
    for r in rows:
        print(f"{r['model']:10s} {r['params'] / 1e6:7.0f}M {r['step_s']:8.3f} "
              f"{r['tokens_per_s']:10.0f} {r['mfu']:6.1%} {r['peak_memory_gib']:9.1f}")
    result = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "rows": rows}
    kind = rows[0]["device"].lower()
    target = "h200" if "h200" in kind else "a100" if "a100" in kind else "h100"
    if not args.skip_analyze:
        result["analyze_8gpu_1p3b"] = analyze_8gpu(target)
        for label, a in result["analyze_8gpu_1p3b"].items():
            print(f"8x{target} 1.3B {label}: async {a['async_fraction']:.2f}, under GEMMs "
                  f"{a['collective_bytes_under_gemm_fraction']:.2f}")
    result["profile_125m"] = profile_small()
    p = result["profile_125m"]
    print(f"profiled gpt-125m step: compute {p['compute_s'] * 1e3:.1f} ms, comm "
          f"{p['comm_s'] * 1e3:.1f} ms, overlap {p['overlap_s'] * 1e3:.1f} ms, idle "
          f"{p['idle_s'] * 1e3:.1f} ms")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
