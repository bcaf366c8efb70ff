"""Benches are code too: every script under bench/ runs in its `--quick` mode (tiny model, one
repetition) as a user runs it, in a fresh process, and its table must hold real numbers.

A quick run writes no results file: bench/results/, docs/ and runs/profile_gpu/ must be
untouched afterwards.
The deviceless GPU compiles of `overlap.py --goal` and of `gpu.py`'s 8-GPU analysis cost
~15 s of CPU each even for a 2-layer GPT; they run in `make test-slow`
(`pipeline_overlap.py --quick`, one such compile, stays in the default run).
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import resource
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO

ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
       "PYTHONUNBUFFERED": "1"}
# Every bench/*.py and the test that runs it (a new bench without a test fails below).
TESTED = {
    "fault_drill.py": "test_fault_drill_quick",
    "gpu.py": "test_gpu_quick_on_cpu",
    "loader.py": "test_loader_quick",
    "memory_estimate.py": "test_memory_estimate_quick",
    "overlap.py": "test_overlap_quick",
    "overlap_headline.py": "test_overlap_headline_quick",
    "pipeline.py": "test_pipeline_quick",
    "pipeline_overlap.py": "test_pipeline_overlap_quick",
    "plain_vs_tuned.py": "test_plain_vs_tuned_quick",
    "remat.py": "test_remat_quick",
    "simulator_validation.py": "test_simulator_validation_quick",
    "slow_axis.py": "test_slow_axis_quick",
    "slow_axis_methods.py": "test_slow_axis_methods_quick",
    "stage_balance.py": "test_stage_balance_quick",
    "step_time.py": "test_step_time_quick",
    "zero_bubble.py": "test_zero_bubble_quick",
}
WRITABLE = ("bench/results", "docs", "runs/profile_gpu")  # what the full runs write


def _snapshot() -> dict[str, tuple[int, int]]:
    out = {}
    for top in WRITABLE:
        for path in glob.glob(os.path.join(REPO, top, "**"), recursive=True):
            if os.path.isfile(path):
                st = os.stat(path)
                out[os.path.relpath(path, REPO)] = (st.st_mtime_ns, st.st_size)
    return out


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_bench(script: str, *args: str, timeout: float = 600) -> str:
    """`<python> bench/<script> --quick <args>` from the repo root; its stdout."""
    env = {**os.environ, **ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    before = _snapshot()
    t0, cpu0 = time.perf_counter(), _children_cpu_s()
    proc = subprocess.run([sys.executable, os.path.join("bench", script), "--quick", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)
    wall, cpu = time.perf_counter() - t0, _children_cpu_s() - cpu0
    print(f"bench/{script} --quick {' '.join(args)}: {wall:.1f} s wall, {cpu:.1f} s CPU")
    assert proc.returncode == 0, (f"bench/{script} --quick exited {proc.returncode}\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    after = _snapshot()
    changed = sorted(p for p in after if before.get(p) != after[p])
    assert not changed, f"--quick wrote into the repo: {changed}"
    return proc.stdout


def table_rows(out: str, header_start: str, n: int) -> tuple[list[str], list[list[str]]]:
    """(header words, the `n` rows split on whitespace) of the first table whose header line
    starts with `header_start`; dashed rules are skipped."""
    lines = out.splitlines()
    i = next((i for i, line in enumerate(lines) if line.startswith(header_start)), None)
    assert i is not None, f"no table header {header_start!r} in:\n{out}"
    body = [line.split() for line in lines[i + 1:] if set(line.strip()) != {"-"}][:n]
    assert len(body) == n and all(body), f"expected {n} rows under {lines[i]!r} in:\n{out}"
    return lines[i].split(), body


def positive(text: str) -> float:
    value = float(text)
    assert value > 0, text
    return value


def fraction(text: str) -> float:
    value = float(text)
    assert 0.0 <= value <= 1.0, text
    return value


def test_every_bench_has_a_quick_test():
    scripts = {os.path.basename(p) for p in glob.glob(os.path.join(REPO, "bench", "*.py"))
               if not os.path.basename(p).startswith("_")}
    assert scripts == set(TESTED)
    assert all(name in globals() for name in TESTED.values())


def test_pipeline_quick():
    # The single-action tick programs (the per-kind cost rows) are hand-built TickPrograms
    # run through the executor: they broke when the executor started reading Branch.sync.
    out = json.loads(run_bench("pipeline.py", "--json").strip().splitlines()[-1])
    assert set(out["action_ms"]) == {"F", "B", "W", "B+W"}
    # B, W and B+W are timed programs; F is the difference of two (an F-and-B program less
    # B), which one repetition on a loaded machine can leave at or below zero.
    assert all(out["action_ms"][k] > 0 for k in ("B", "W", "B+W"))
    assert math.isfinite(out["action_ms"]["F"])
    rows = out["rows"]
    assert [(r["schedule"], r["paired"]) for r in rows] == [
        ("1f1b", False), ("1f1b", True), ("zb-v", False), ("zb-v", True)]
    for r in rows:
        assert r["stages"] == 4 and r["microbatches"] == 4 and r["ticks"] > 0
        assert 0 <= r["bubble"] < 1 and 0 <= r["weighted_bubble"] < 1
        assert r["step_ms"] > 0 and r["stash_bytes"] > 0 and r["peak_bytes"] > 0
        # Work ratio: over a pp = 1 dp8 step accumulating microbatches of the same size (at
        # m = 4 on pp4 x dp2 that is one microbatch of B / 8, the plain dp8 baseline).
        assert math.isfinite(r["work_ratio"]) and r["work_ratio"] > 0
        base = r["work_baseline"]
        assert base["exact"] and base["micro_batch"] == base["pipelined_micro_batch"] == 2
        assert base["microbatches"] == 1 and base["name"] in out["baselines_ms"]
    plain_1f1b, paired_1f1b, zb_v = rows[0], rows[1], rows[2]
    assert zb_v["virtual_stages"] == 2  # zb-v: two chunks per stage
    assert zb_v["bubble"] < plain_1f1b["bubble"]  # zero bubble beats 1f1b's idle ticks
    # Pairing: fewer, longer ticks; every stage's steady tick costs F + B alike.
    assert paired_1f1b["ticks"] < plain_1f1b["ticks"]
    assert paired_1f1b["weighted_bubble"] <= plain_1f1b["weighted_bubble"] + 1e-9


def test_pipeline_overlap_quick():
    out = run_bench("pipeline_overlap.py")
    header, rows = table_rows(out, "schedule ", 2)
    assert header[:6] == ["schedule", "latency", "buckets", "ticks", "bubble", "slots"]
    skewed, paired = rows
    assert skewed[:3] == ["1f1b", "2", "0"] and paired[:3] == ["1f1b+paired", "1", "0"]
    for r in rows:
        assert int(r[3]) > 0 and int(r[5]) > 0
        fraction(r[4])
        positive(r[6])  # permute MiB
        assert fraction(r[7]) > 0  # sends beside GEMMs: the skewed loop's, the other lane's
        fraction(r[9]), fraction(r[10])
    assert fraction(paired[4]) < fraction(skewed[4])  # latency 1: a shorter ramp


def test_remat_quick():
    out = run_bench("remat.py")
    header, rows = table_rows(out, "where ", 4)
    assert header == ["where", "group", "remat", "peak", "MiB", "step", "ms"]
    by = {(r[1] + " " + r[2], r[3]): r for r in rows}
    for group in ("pp1 dp2xtp4", "pp2xdp4 1f1b"):
        none, full = float(by[(group, "none")][4]), float(by[(group, "full")][4])
        assert 0 < full <= none  # keeping only block inputs never holds more
        assert float(by[(group, "none")][5]) > 0


def test_overlap_quick():
    out = run_bench("overlap.py")
    header, rows = table_rows(out, "option ", 5)
    assert header[:3] == ["option", "step_ms", "x_step"]
    # Names have spaces: the 11 numeric columns are the last ones.
    by_name = {" ".join(r[:-11]): r[-11:] for r in rows}
    assert list(by_name) == ["baseline dp2xtp4", "bf16 comm, buckets 0.02MB",
                             "tp collective_matmul bi", "baseline dp8", "fsdp window 2 dp8"]
    for vals in by_name.values():
        positive(vals[0]), positive(vals[1]), positive(vals[10])  # step_ms, x_step, x_peak
    col = {name: i for i, name in enumerate(["step_ms", "x_step", "dp_ops", "dp_MiB", "wire",
                                              "tp_ops", "tp_MiB", "bkts", "temp", "peak",
                                              "x_peak"])}
    base, bf16 = by_name["baseline dp2xtp4"], by_name["bf16 comm, buckets 0.02MB"]
    assert float(base[col["x_step"]]) == 1.0
    assert int(bf16[col["bkts"]]) > 1
    assert float(bf16[col["wire"]]) < float(bf16[col["dp_MiB"]])  # bf16 on the wire
    cm = by_name["tp collective_matmul bi"]
    assert int(cm[col["tp_ops"]]) > int(base[col["tp_ops"]])  # the ring's permutes
    fsdp, dp8 = by_name["fsdp window 2 dp8"], by_name["baseline dp8"]
    assert int(fsdp[col["dp_ops"]]) > int(dp8[col["dp_ops"]])  # gathers + reduce-scatters
    assert float(fsdp[col["x_peak"]]) < 1.0  # sharded params and optimizer state


@pytest.mark.slow  # four deviceless GPU compiles (~75 s of CPU)
def test_overlap_goal_quick():
    from jax_overlap.analysis import deviceless

    if not deviceless.plugin_available():
        pytest.skip(deviceless.unavailable_reason())
    out = run_bench("overlap.py", "--goal")
    _, rows = table_rows(out, "mesh ", 4)
    assert [r[:2] for r in rows] == [["dp8", "ours"], ["dp8", "gspmd"], ["dp2xtp4", "ours"],
                                     ["dp2xtp4", "gspmd"]]
    for r in rows:  # mesh step async under-GEMMs exposed-ms GiB/step (0.00 at this size)
        fraction(r[2]), fraction(r[3]), float(r[4])
        assert float(r[5]) >= 0


def test_step_time_quick():
    out = run_bench("step_time.py")
    assert "mesh dp2 pp1 tp4 on 8 cpu devices" in out
    header, rows = table_rows(out, "step ", 2)
    assert header == ["step", "median", "s", "tokens/s", "time", "/", "ours"]
    # name words, median s, tokens/s, time / ours
    by_name = {" ".join(r[:-3]): [positive(x) for x in r[-3:]] for r in rows}
    assert list(by_name) == ["jax_overlap shard_map", "jit + NamedSharding (GSPMD)"]
    assert by_name["jax_overlap shard_map"][2] == 1.0
    diff = float(re.search(r"max relative loss difference over the run: (\S+)", out)[1])
    assert diff < 1e-4  # the same model and batches: the same losses


def test_simulator_validation_quick():
    out = run_bench("simulator_validation.py")
    rows = [line.strip("|").split("|") for line in out.splitlines()
            if line.startswith("| dp")]
    assert [r[0].strip() for r in rows] == ["dp2 tp1 pp4 m4 1f1b b0 repl"]
    _, measured, predicted, error, fit, error_fit = (c.strip() for c in rows[0])
    positive(measured), positive(predicted), positive(fit)
    assert error.endswith("%") and error_fit.endswith("%")
    # The bound docs/results.md states for the quick run: predicted / measured within
    # [1/3, 3] (its tiny model's step is mostly fixed costs -- kernel launches and the tick
    # loop's; the full run's bound is 25%). A 500% error fails here.
    bound = _bench_module("simulator_validation").QUICK_BOUND
    assert bound == 3.0
    for e in (error, error_fit):
        assert 1 / bound <= 1 + float(e[:-1]) / 100 <= bound, (e, out)
    # (the error column is the median of the pairs' ratios; the fit's, of the medians)
    assert 1 + float(error_fit[:-1]) / 100 == pytest.approx(float(fit) / float(measured),
                                                           abs=0.01)


def _bench_module(name: str):
    """bench/<name>.py imported (for its constants)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "bench", name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow  # four deviceless GPU compiles (~80 s of CPU)
def test_plain_vs_tuned_quick():
    from jax_overlap.analysis import deviceless

    if not deviceless.plugin_available():
        pytest.skip(deviceless.unavailable_reason())
    out = run_bench("plain_vs_tuned.py")
    for mesh, schedule in (("dp8", "1f1b"), ("pp4_dp2", "1f1b")):
        block = out.split(f"mesh {mesh}\n")[1].split("best: ")
        rows = [[c.strip() for c in line.strip("|").split("|")]  # past the header
                for line in block[0].splitlines() if line.startswith("| ")][1:]
        assert rows[0][0] == "plain (the plan's choices)" and len(rows) == 2
        mfu = {r[0]: fraction(r[7]) for r in rows}
        assert all(r[1] == schedule for r in rows)
        best = max(mfu, key=mfu.get)
        gap = float(re.match(r"(.*); plain is (\S+)% below it", block[1])[2])
        assert block[1].startswith(best)
        assert gap == pytest.approx(100 * (1 - mfu[rows[0][0]] / mfu[best]), abs=0.5)


@pytest.mark.slow
def test_slow_axis_quick():
    # Five short training runs (five compiles): in make test-slow.
    out = run_bench("slow_axis.py")
    _, rows = table_rows(out, "variant ", 5)
    assert [r[0] for r in rows] == ["sync", "delay1", "delay1_local", "diloco", "diloco_tuned"]
    for r in rows:
        assert positive(r[1]) and positive(r[2])
    assert float(rows[0][3].rstrip("%")) == 0.0


def test_slow_axis_methods_quick():
    out = run_bench("slow_axis_methods.py")
    runs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["method"] for r in runs] == ["sync", "delay", "local"]
    for r in runs:
        assert 0 < r["final"] < 20 and 0 < r["tail_mean"] < 20
    # The late gradient's first step applies nothing, so it ends elsewhere than sync.
    assert runs[1]["final"] != runs[0]["final"]


def test_fault_drill_quick():
    out = run_bench("fault_drill.py")
    _, rows = table_rows(out, "kill ", 1)
    (r,) = rows
    kill, killed_after, resumed, lost, committed = map(int, r[:5])
    assert kill == 1 and 1 <= killed_after < 8 and 0 <= resumed <= killed_after
    assert lost == killed_after - resumed and committed <= resumed  # no committed step lost
    assert lost <= 1 and r[5] == "local"  # the local tier, every step: at most the step in flight
    assert "final params equal to the uninterrupted run: yes (whole state: yes)" in out


def _check_gpu_table(out: str) -> None:
    header, rows = table_rows(out, "model ", 1)
    assert header[:7] == ["model", "params", "step", "s", "tokens/s", "MFU", "peak"]
    (r,) = rows
    assert r[0] == "gpt-tiny"
    positive(r[2]), positive(r[3])  # step s, tokens/s
    compute = re.search(r"profiled gpt-tiny step: compute (\S+) ms", out)
    assert compute, out
    positive(compute[1])


def test_gpu_quick_on_cpu():
    # On the CPU backend (MFU nan); the deviceless 8-GPU analysis is the slow test below.
    out = run_bench("gpu.py", "--skip-analyze")
    _check_gpu_table(out)
    assert "(cpu, jax" in out


@pytest.mark.slow  # one deviceless GPU compile (~15 s of CPU)
def test_gpu_quick_with_analysis():
    out = run_bench("gpu.py")
    _check_gpu_table(out)
    from jax_overlap.analysis import deviceless

    if deviceless.plugin_available():
        m = re.search(r"2-layer GPT dp8: async (\S+), under GEMMs (\S+)", out)
        assert m, out
        fraction(m[1]), fraction(m[2])
    else:
        assert "analysis skipped" in out


def test_stage_balance_quick():
    out = run_bench("stage_balance.py", "--json")
    header, rows = table_rows(out, "mesh ", 18)
    assert header == ["mesh", "schedule", "m", "head", "L", "split", "stage_layers", "tick_ms",
                      "t-bubble", "e-bubble", "table", "floor", "speedup"]
    assert [(r[1], r[3], r[4], r[5]) for r in rows] == [
        (name, head, lat, split) for name in ("zb-v", "1f1b")
        for head, lat in (("last", "1"), ("vocab", "1"), ("vocab", "2"))
        for split in ("even", "auto", "search")]
    for r in rows:
        assert sum(int(n) for n in r[6].split(",")) == 24  # GPT-1.3B's layers
        positive(r[7]), fraction(r[8]), fraction(r[9]), fraction(r[10]), positive(r[12])
    doc = json.loads(out.strip().splitlines()[-1])
    by = {(r["schedule"], r["head"], r["transfer_latency"], r["split"]): r for r in doc["rows"]}
    for r in doc["rows"]:
        if r["head"] == "last":
            # No split beats the whole-layer imbalance floor: the head is 1.75 blocks on one
            # stage.
            assert 0.0 < r["floor"] <= min(r["bubble"], r["tick_bubble"])
        else:  # spread over the stages, the head leaves no stage heavier
            assert r["floor"] == 0.0
    for name in ("zb-v", "1f1b"):
        last = {split: by[(name, "last", 1, split)] for split in ("even", "auto", "search")}
        # Balancing the head's stage shortens the simulated step of both schedules.
        assert last["auto"]["tick_step_ms"] < last["even"]["tick_step_ms"]
        assert last["auto"]["step_ms"] < last["even"]["step_ms"]
        assert last["search"]["tick_step_ms"] <= last["auto"]["tick_step_ms"]
        vocab = by[(name, "vocab", 1, "even")]
        if name == "zb-v":
            # A vocabulary-parallel head beats an even split of a head on one stage (for
            # 1F1B, whose unpaired ticks meet only where data moves, its head phase's barrier
            # costs more than the one stage's extra head: docs/results.md) ...
            assert vocab["tick_step_ms"] < last["even"]["tick_step_ms"]
        # ... and the skewed loop's slack (each permute under the next tick's action) absorbs
        # ticks whose stages run actions of unequal cost.
        assert by[(name, "vocab", 2, "even")]["tick_bubble"] < vocab["tick_bubble"]


def test_loader_quick():
    out = run_bench("loader.py")
    _, rows = table_rows(out, "what ", 2)
    by_name = {" ".join(r[:-1]): positive(r[-1]) for r in rows}
    assert list(by_name) == ["loader (Grain, place)", "train step"]
    ratio = float(re.search(r"ratio loader / step: (\S+)", out)[1])
    assert ratio == pytest.approx(by_name["loader (Grain, place)"] / by_name["train step"],
                                  rel=0.01)
    assert ratio >= 10  # the loader is never the bottleneck


def test_zero_bubble_quick():
    """The paper's rows beside ours (small sizes): our executed bubbles are fractions, pairing
    for the costs never does worse than the plain table here, and the build timings print."""
    doc = json.loads(run_bench("zero_bubble.py", "--json").strip().splitlines()[-1])
    assert [(r["schedule"], r["stages"]) for r in doc["rows"]] == [
        ("1f1b", 4), ("zb-h1", 4), ("zb-v", 4)]
    for r in doc["rows"]:
        fraction(r["table"]), fraction(r["paired"]), fraction(r["search"])
        assert r["paired"] < r["table"] and r["search"] <= r["paired"] + 1e-12
        assert r["best"] == min(r["table"], r["paired"], r["search"])
        assert 1 <= r["mem"] <= 2  # at most twice the plain table's activations
    filled = {r["schedule"]: r["filled"] for r in doc["rows"] if "filled" in r}
    assert sorted(filled) == ["zb-h1", "zb-v"]
    for r in doc["rows"][1:]:  # the filled table is what --paired --costs picks here
        assert r["paired"] == pytest.approx(r["filled"])
        assert r["paired"] <= r["paper"] + 0.02
    assert len(doc["timings"]) == 7 and all(t["seconds"] >= 0 and t["ticks"] > 0
                                            for t in doc["timings"])
    assert [t["what"].split(" p=")[0] for t in doc["timings"][4:6]] == [
        "build 1f1b paired", "build zb-v paired"]


def _headline_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "overlap_headline", os.path.join(REPO, "bench", "overlap_headline.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_overlap_headline_arithmetic():
    """The estimated step is the compiled step's GPU estimate plus the exposed communication;
    iter/s is its inverse (no compile: canned analyze reports)."""
    h = _headline_module()
    report = {"estimate": {"step_ms": 80.0, "mfu": 0.4}, "exposed_comm_s_estimate": 0.02,
              "total_comm_s_estimate": 0.05, "collective_bytes_under_gemm_fraction": 0.6}
    r = h.row(report)
    assert r["step_ms"] == pytest.approx(100.0) and r["iter_per_s"] == pytest.approx(10.0)
    assert r["comm_ms"] == pytest.approx(50.0) and r["exposed_comm_ms"] == pytest.approx(20.0)
    # GPT-1.3B's shape: 1.31e9 parameters with its embedding.
    assert h.parameters(h.SIZES["1.2B"]) == pytest.approx(1.31e9, rel=0.01)
    assert h.parameters(h.SIZES["3B"]) == pytest.approx(2.96e9, rel=0.02)
    slow = {**report, "exposed_comm_s_estimate": 0.07}
    text = h.table({"1.2B": {"params": 1.31e9, "variants": {"no overlap": h.row(slow),
                                                             "defaults": r}}})
    assert "+50%" in text and "9.5" in text and "13.1" in text  # the design's figures beside


@pytest.mark.slow  # two deviceless GPU compiles (~25 s of CPU)
def test_overlap_headline_quick():
    out = run_bench("overlap_headline.py")
    header, rows = table_rows(out, "model ", 2)
    assert header[:4] == ["model", "params", "variant", "step_ms"]
    base, best = rows
    assert base[2:4] == ["no", "overlap"] and best[2] == "defaults"
    # no overlap: nothing under GEMMs; the defaults hide part of the gradient reduction
    assert float(base[8]) == 0.0 and float(best[7]) > 0.0
    assert float(best[4]) > float(base[5])  # iter/s


def test_memory_estimate_quick():
    """A small pipelined GPT compiled deviceless for H100s: the plan's estimate sits within a
    factor of 1.5 of what XLA allocates (the full six-config table is held to 15%, slow)."""
    from jax_overlap.analysis import deviceless

    if not deviceless.plugin_available():
        pytest.skip(deviceless.unavailable_reason() or "CUDA plugin missing")
    out = run_bench("memory_estimate.py", "--quick")
    ratio = float(re.search(r"ratio (\d+\.\d+)", out).group(1))
    assert 1 / 1.5 <= ratio <= 1.5, out
