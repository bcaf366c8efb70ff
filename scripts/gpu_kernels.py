"""Where a traced GPU step's time went, by kernel kind: GEMMs, fused attention, the rest.

    python scripts/gpu_kernels.py TRACE_DIR [--estimate analyze.json] [--top 15]

TRACE_DIR is a `jax-overlap profile --logdir` directory (or a trace file). Prints, per traced
step, the device time of each kind of kernel, their count and the step's span, beside the
compiled-step estimate's `gemm_ms` / `other_ms` / `launch_ms` when `--estimate` names the JSON
of `analyze --target ... --json` for the same config. Used by scripts/gpu_check.sh on a lent GPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys

from jax_overlap.analysis import trace as tracelib

# cuBLAS / cuBLASLt / CUTLASS GEMM kernels (nvjet is cuBLASLt's Hopper family); Triton GEMM
# fusions that XLA emits are named after their HLO fusion ("triton_gemm", "gemm_fusion").
_GEMM = re.compile(r"gemm|nvjet|cutlass|xmma|cublas|wgmma|sm90_|matmul|dot", re.I)
_ATTENTION = re.compile(r"cudnn|fmha|flash|sdpa|fprop|dgrad|attention", re.I)


def kind(name: str) -> str:
    if tracelib.is_collective(name):
        return "collective"
    if _ATTENTION.search(name):
        return "attention"
    if _GEMM.search(name):
        return "gemm"
    return "other"


def summarize(trace: tracelib.Trace, top: int) -> dict:
    events = [e for e in trace.events if "gpu" in e.device.lower()] or list(trace.events)
    windows = list(trace.steps) or [(min(e.start_ns for e in events),
                                     max(e.end_ns for e in events))]
    steps = []
    by_name: collections.Counter = collections.Counter()
    for lo, hi in windows:
        inside = [e for e in events if lo <= e.start_ns < hi]
        ms = collections.Counter()
        for e in inside:
            ms[kind(e.name)] += (e.end_ns - e.start_ns) / 1e6
            by_name[(kind(e.name), e.name[:90])] += (e.end_ns - e.start_ns) / 1e6 / len(windows)
        busy = tracelib.total(tracelib.union((e.start_ns, e.end_ns) for e in inside)) / 1e6
        steps.append({"span_ms": (hi - lo) / 1e6, "busy_ms": busy, "kernels": len(inside),
                      **{f"{k}_ms": v for k, v in sorted(ms.items())}})
    return {"steps": steps,
            "top": [{"kind": k, "name": n, "ms_per_step": round(v, 3)}
                    for (k, n), v in by_name.most_common(top)]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--estimate", help="JSON of `analyze --target ... --json`")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json-out", help="also write the summary here")
    args = ap.parse_args(argv)
    out = summarize(tracelib.load_trace(args.trace), args.top)
    if args.estimate:
        est = json.load(open(args.estimate)).get("estimate", {})
        out["estimate"] = {k: est.get(k) for k in
                           ("step_ms", "gemm_ms", "other_ms", "launch_ms", "mfu")}
    for s in out["steps"]:
        print("  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                        for k, v in s.items()))
    if "estimate" in out:
        print("estimate:", out["estimate"])
    for row in out["top"]:
        print(f"{row['ms_per_step']:9.3f} ms  {row['kind']:<10} {row['name']}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
