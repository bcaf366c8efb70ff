#!/usr/bin/env bash
# One call on a lent GPU: the GPU suite, then GPT-1.3B traced on one GPU under the plan's
# choices and under the alternatives the plan rejected, each beside the compiled-step estimate.
#
#   scripts/gpu_check.sh OUT_DIR [SECONDS]
#
# Needs .whl/ with the jax_overlap wheel (for its entry points) and any package the GPU image
# lacks (tensorboardX). Each part is skipped once the time budget (default 480 s)
# would run out, most important first. Writes logs and JSON under OUT_DIR; prints a table last.
set -u
OUT=${1:?OUT_DIR}; BUDGET=${2:-480}; START=$SECONDS
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda,cpu}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH="$PWD:/tmp/site"  # the tree's code; the wheel's dist-info for entry points
left() { echo $(( BUDGET - (SECONDS - START) )); }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv \
  | tee "$OUT/gpu.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee -a "$OUT/gpu.txt"

CFG=${GPU_CHECK_CONFIG:-configs/gpu/gpt_1p3b_dp8.yaml}
read -r -a BASE <<<"${GPU_CHECK_SET:---set mesh.dp=1 --set train.global_batch=32}"
# name | extra overrides (GPU_CHECK_VARIANTS: the same, ';'-separated)
VARIANTS=("plan|" "remat_none|--set model.remat=none" "attention_plain|--set model.attention=plain")
[[ -n ${GPU_CHECK_VARIANTS:-} ]] && IFS=';' read -r -a VARIANTS <<<"$GPU_CHECK_VARIANTS"
run_variant() {  # name, overrides...
  local name=$1; shift
  local t; t=$(left); if (( t < 90 )); then echo "skip $name: ${t}s left"; return; fi
  echo "== $name ($(left)s left)"
  timeout $(( t - 30 )) python3 -m jax_overlap.cli analyze --config $CFG "${BASE[@]}" "$@" \
    --target h200 --json > "$OUT/$name.analyze.json" 2> "$OUT/$name.analyze.log"
  t=$(left); (( t < 60 )) && { echo "skip $name profile: ${t}s left"; return; }
  timeout $(( t - 20 )) python3 -m jax_overlap.cli profile --config $CFG "${BASE[@]}" "$@" \
    --steps 3 --json --logdir /tmp/prof_$name > "$OUT/$name.profile.json" 2> "$OUT/$name.profile.log"
  echo "profile rc $?"; tail -3 "$OUT/$name.profile.log"
  python3 scripts/gpu_kernels.py /tmp/prof_$name --estimate "$OUT/$name.analyze.json" \
    --json-out "$OUT/$name.kernels.json" --top 12 2>&1 | tee "$OUT/$name.kernels.txt"
}

for v in "${VARIANTS[@]}"; do
  IFS='|' read -r name extra <<<"$v"
  # shellcheck disable=SC2086
  run_variant "$name" $extra
  if [[ $name == plan && ${GPU_CHECK_SUITE:-1} == 1 ]]; then  # second: the plan's numbers first
    t=$(left); echo "== GPU suite ($t s left)"
    timeout $(( t > 200 ? 180 : t / 2 )) python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider \
      -x 2>&1 | tail -15 | tee "$OUT/gpu_suite.txt"
  fi
done

f=$(find /tmp/prof_plan -name 'perfetto_trace.json.gz' 2>/dev/null | head -1)
[[ -n $f && $(stat -c%s "$f") -lt 12000000 ]] && cp "$f" "$OUT/plan.perfetto_trace.json.gz"
echo "== summary ($(left)s left)"
python3 - "$OUT" "${VARIANTS[@]%%|*}" <<'EOF'
import json, os, sys
out = sys.argv[1]
for name in sys.argv[2:]:
    try:
        k = json.load(open(f"{out}/{name}.kernels.json"))
        e = json.load(open(f"{out}/{name}.analyze.json")).get("estimate", {})
        p = json.load(open(f"{out}/{name}.profile.json"))
    except Exception as err:  # a part skipped or failed: its log says why
        print(f"{name}: incomplete ({type(err).__name__})"); continue
    s = k["steps"][-1]
    print(f"{name}: traced step {p.get('step_time_s', 0) * 1e3:.0f} ms (span {s['span_ms']:.0f}, "
          f"busy {s['busy_ms']:.0f}; gemm {s.get('gemm_ms', 0):.0f}, attention "
          f"{s.get('attention_ms', 0):.0f}, other {s.get('other_ms', 0):.0f}, {s['kernels']} kernels)"
          f" | estimate {e.get('step_ms', 0):.0f} ms (gemm {e.get('gemm_ms', 0):.0f}, other "
          f"{e.get('other_ms', 0):.0f}, launch {e.get('launch_ms', 0):.0f}), at measured rates "
          f"{e.get('expected_step_ms') or 0:.0f} ms")
EOF
