"""GPU benchmark: step time, tokens/s, MFU and peak memory of the GPT at three sizes on one GPU,
the overlap analysis of the 8-GPU-compiled 1.3B step, and a profiled step's overlap.

    JAX_PLATFORMS=cuda,cpu python bench/gpu.py [--out bench/results/gpu.json] [--steps 8]

MFU = model FLOPs per step / (step time x the chip's peak dense bf16 rate: 989 TFLOP/s for
H100/H200, 312 for A100). Sized to finish in under 8 minutes on one H200.

`--quick` checks that the bench runs, on a GPU or, without one, on the CPU backend (MFU is
then nan: no peak rate; LLVM at -O0): a 2-layer GPT timed for 2 steps, the dp8 analysis of
a 2-layer GPT compiled for 8 H100s without a GPU (skipped, with a note, when no CUDA plugin
is installed; `--skip-analyze` as usual), and a profiled step of the 2-layer GPT; no
results file, a temporary trace dir.

    python bench/gpu.py --quick
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "tiny.yaml")

SIZES = {  # name: (layers, d_model, heads, d_ff, seq_len, global_batch, microbatches)
    "gpt-125m": (12, 768, 12, 3072, 1024, 32, 1),
    "gpt-350m": (24, 1024, 16, 4096, 1024, 32, 1),
    "gpt-1.3b": (24, 2048, 16, 8192, 2048, 16, 2),
}


# --quick: one size, small enough to compile and run in seconds on the CPU backend.
QUICK_SIZES = {"gpt-tiny": (2, 64, 4, 256, 64, 8, 1)}
QUICK_VOCAB = 512


def overrides_for(name: str) -> list[str]:
    quick = name in QUICK_SIZES
    layers, d, h, f, t, b, m = (QUICK_SIZES if quick else SIZES)[name]
    vocab = QUICK_VOCAB if quick else 50304
    return [f"model.layers={layers}", f"model.d_model={d}", f"model.heads={h}",
            f"model.d_ff={f}", f"model.vocab={vocab}", f"model.seq_len={t}",
            f"train.global_batch={b}", f"pipeline.microbatches={m}", "train.precision=bf16",
            "mesh.dp=1", "mesh.pp=1", "mesh.tp=1", "data.source=synthetic"]


def time_size(name: str, steps: int) -> dict:
    import jax

    from jax_overlap import config
    from jax_overlap.data import streams as data
    from jax_overlap.training.assemble import assemble
    from jax_overlap.training.loop import peak_flops

    cfg = config.load(TINY, overrides_for(name))
    device = jax.devices()[0]
    run = assemble(cfg, [device])
    model = run.model
    state = run.init_state()
    step = run.train_step()
    stream = data.stream_from_config(cfg)
    batches = [run.put_batch(stream.batch(i)) for i in range(2)]
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


ANALYZE = {"dp8": [], "dp2xtp4 cm-bi": ["mesh.dp=2", "mesh.tp=4",
                                       "overlap.tp_comm=collective_matmul",
                                       "overlap.collective_matmul_direction=bi"]}


def analyze_8gpu(target: str, labels: dict[str, list[str]] = ANALYZE) -> dict:
    from jax_overlap import config
    from jax_overlap.analysis import analyze

    out = {}
    for label, extra in labels.items():
        cfg = config.load(os.path.join(REPO, "configs", "gpt_1p3b.yaml"), extra)
        data = analyze.analyze(cfg, target).to_json()
        out[label] = {k: data[k] for k in ("async_fraction", "collective_bytes_under_gemm_fraction",
                                           "exposed_comm_s_estimate")}
    return out


def profile_small(name: str = "gpt-125m", logdir: str = "runs/profile_gpu") -> dict:
    from jax_overlap import config
    from jax_overlap.analysis.profile import profile_config

    cfg = config.load(TINY, overrides_for(name))
    import jax

    res = profile_config(cfg, steps=2, logdir=logdir, devices=jax.devices()[:1])
    m = res.metrics
    return {"compute_s": m.compute_s, "comm_s": m.comm_s, "overlap_s": m.overlap_s,
            "idle_s": m.idle_s, "ccor": m.ccor, "step_time_s": m.step_time_s}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="results JSON (default bench/results/gpu.json; none with "
                                  "--quick)")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--skip-analyze", action="store_true")
    ap.add_argument("--quick", action="store_true",
                    help="a 2-layer GPT, 2 steps, GPU or CPU: checks the bench runs")
    args = ap.parse_args()
    if args.quick:
        args.steps = args.steps or 2
        if not glob.glob("/dev/nvidia[0-9]*"):
            os.environ.setdefault("JAX_PLATFORMS", "cpu")  # don't probe CUDA without a GPU
        if os.environ.get("JAX_PLATFORMS") == "cpu":
            from _quick import fast_cpu_compiles

            fast_cpu_compiles()
    else:
        args.steps = args.steps or 8
        args.out = args.out or "bench/results/gpu.json"
    os.environ.setdefault("JAX_PLATFORMS", "cuda,cpu")
    import jax

    if jax.devices()[0].platform != "gpu" and not args.quick:
        print("error: bench/gpu.py needs a GPU (JAX_PLATFORMS=cuda); --quick also runs on "
              "the CPU", file=sys.stderr)
        return 2
    sizes = QUICK_SIZES if args.quick else SIZES
    rows = [time_size(name, args.steps) for name in sizes]
    print(f"{'model':10s} {'params':>8s} {'step s':>8s} {'tokens/s':>10s} {'MFU':>6s} "
          f"{'peak GiB':>9s}   ({rows[0]['device']}, jax {jax.__version__})")
    for r in rows:
        print(f"{r['model']:10s} {r['params'] / 1e6:7.0f}M {r['step_s']:8.3f} "
              f"{r['tokens_per_s']:10.0f} {r['mfu']:6.1%} {r['peak_memory_gib']:9.1f}")
    result = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "rows": rows}
    kind = rows[0]["device"].lower()
    target = "h200" if "h200" in kind else "a100" if "a100" in kind else "h100"
    from jax_overlap.analysis import deviceless

    if args.skip_analyze:
        pass
    elif args.quick and not deviceless.plugin_available():
        print(f"8x{target} analysis skipped: {deviceless.unavailable_reason()}")
    else:
        if args.quick:  # the dp8 step of a 2-layer GPT
            from _quick import SMALL_GPT

            labels = {"dp8": SMALL_GPT}
        else:
            labels = ANALYZE
        result["analyze_8gpu_1p3b"] = analyze_8gpu(target, labels)
        model = "2-layer GPT" if args.quick else "1.3B"
        for label, a in result["analyze_8gpu_1p3b"].items():
            print(f"8x{target} {model} {label}: async {a['async_fraction']:.2f}, under GEMMs "
                  f"{a['collective_bytes_under_gemm_fraction']:.2f}")
    profiled = next(iter(sizes))
    if args.quick:
        logdir = tempfile.mkdtemp(prefix="profile_gpu_")
        try:
            result["profile_125m"] = p = profile_small(profiled, logdir)
        finally:
            shutil.rmtree(logdir, ignore_errors=True)
    else:
        result["profile_125m"] = p = profile_small()
    print(f"profiled {profiled} step: compute {p['compute_s'] * 1e3:.1f} ms, comm "
          f"{p['comm_s'] * 1e3:.1f} ms, overlap {p['overlap_s'] * 1e3:.1f} ms, idle "
          f"{p['idle_s'] * 1e3:.1f} ms")
    if args.out is None:
        return 0
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
