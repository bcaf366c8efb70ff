"""Trace metrics: hand-computed synthetic traces and a real 8-device CPU trace."""

import gzip
import json
from functools import partial

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_overlap.analysis.trace import (
    intersect,
    is_collective,
    load_trace,
    parse_trace,
    profile_steps,
    union,
)

US = 1e-6  # the synthetic trace is written in microseconds


def _synthetic_trace() -> dict:
    """Two GPUs over two marked steps, window [0, 30) us.

    gpu0: compute [0,10) [12,20); comm all-reduce [8,14), nccl kernel [25,28).
      C = 18, M = 9, overlap [8,10)+[12,14) = 4, busy 23, idle 7.
    gpu1: a while loop [2,22) wrapping fusion [4,6) and all-reduce [6,16) on one stream
      (the loop must not count), plus a B/E fusion [20,24).
      C = 2 + 4 = 6, M = 10, overlap 0, busy 16, idle 14.
    Host events (Python, a launch thunk tagged hlo_op) and the derived "XLA Modules"
    line must be ignored.
    """
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 1, "tid": 1, "name": "thread_name", "args": {"name": "python"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 2, "tid": 1, "name": "thread_name", "args": {"name": "Stream #1"}},
        {"ph": "M", "pid": 2, "tid": 2, "name": "thread_name", "args": {"name": "Stream #2(nccl)"}},
        {"ph": "M", "pid": 2, "tid": 3, "name": "thread_name", "args": {"name": "XLA Modules"}},
        {"ph": "M", "pid": 3, "name": "process_name", "args": {"name": "/device:GPU:1"}},
        {"ph": "M", "pid": 3, "tid": 1, "name": "thread_name", "args": {"name": "Stream #1"}},
    ]

    def x(pid, tid, name, ts, dur, **args):
        return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur, "args": args}

    events = [
        x(1, 1, "train", 0, 15, step_num=0),
        x(1, 1, "train", 15, 15, step_num=1),
        x(1, 1, "$python.py:1 step", 0, 30),
        x(1, 1, "ThunkExecutor launch", 1, 20, hlo_op="fusion.1"),
        x(2, 1, "fusion.1", 0, 10, hlo_op="fusion.1"),
        x(2, 1, "convolution.2", 12, 8),
        x(2, 2, "all-reduce.3", 8, 6, hlo_op="all-reduce.3"),
        x(2, 2, "ncclDevKernel_AllGather_RING_LL", 25, 3, hlo_op="all-gather-start.4"),
        x(2, 3, "jit_step", 0, 28),
        x(3, 1, "while.1", 2, 20, hlo_op="while.1"),
        x(3, 1, "fusion.2", 4, 2, hlo_op="fusion.2"),
        x(3, 1, "all-reduce.5", 6, 10, hlo_op="all-reduce.5"),
        {"ph": "B", "pid": 3, "tid": 1, "name": "fusion.9", "ts": 20},
        {"ph": "E", "pid": 3, "tid": 1, "ts": 24},
    ]
    return {"traceEvents": meta + events}


def test_interval_arithmetic():
    a = union([(5, 7), (0, 2), (1, 3), (7, 8)])
    assert a == [(0, 3), (5, 8)]
    assert intersect(a, union([(2, 6), (7.5, 10)])) == [(2, 3), (5, 6), (7.5, 8)]


def test_collective_classification():
    for name in [
        "all-reduce.3",
        "all-gather-start",
        "reduce_scatter.1",
        "collective-permute-done",
        "ncclDevKernel_AllReduce_Sum_f32",
        "psum_invariant.7",
        "ppermute",
        "all-to-all.2",
        "send.4",
        "recv-done.1",
    ]:
        assert is_collective(name), name
    for name in [
        "fusion.1",
        "dot.3",
        "transcendental_fusion",
        "ynn_fusion",
        "wrapped_tanh",
        "convolution",
        "reduce.2",
    ]:
        assert not is_collective(name), name
    assert is_collective("fusion.7", "all-reduce.7")  # judged by its hlo_op stat too


def test_synthetic_trace_exact(tmp_path):
    doc = _synthetic_trace()
    path = tmp_path / "host.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)
    for m in (parse_trace(doc), parse_trace(path)):
        assert m.steps == 2
        assert m.step_time_s == pytest.approx(15 * US)
        g0, g1 = m.devices["/device:GPU:0"], m.devices["/device:GPU:1"]
        assert (g0.compute_s, g0.comm_s, g0.overlap_s, g0.idle_s) == pytest.approx(
            (9 * US, 4.5 * US, 2 * US, 3.5 * US)
        )
        assert g0.exposed_comm_s == pytest.approx(2.5 * US)
        assert g0.ccor == pytest.approx(4 / 27)
        assert g0.bubble_rate == pytest.approx(7 / 30)
        assert (g1.compute_s, g1.comm_s, g1.overlap_s, g1.idle_s) == pytest.approx(
            (3 * US, 5 * US, 0.0, 7 * US)
        )
        assert (m.compute_s, m.comm_s, m.overlap_s, m.idle_s) == pytest.approx(
            (6 * US, 4.75 * US, 1 * US, 5.25 * US)
        )
        assert m.exposed_comm_s == pytest.approx(3.75 * US)
        assert m.ccor == pytest.approx(1 / 10.75)
        assert m.bubble_rate == pytest.approx(0.35)
        assert not m.synchronous_collectives
        assert set(m.collective_ops) == {"all-reduce", "ncclDevKernel_AllGather_RING_LL"}
    out = json.loads(parse_trace(doc).to_json())
    assert out["devices"]["/device:GPU:0"]["ccor"] == pytest.approx(4 / 27)


def test_steps_skip_and_unmarked_trace():
    doc = _synthetic_trace()
    second = parse_trace(
        doc, skip_steps=1
    )  # window [15, 30): only gpu0's nccl kernel and gpu1's tail
    g0 = second.devices["/device:GPU:0"]
    assert (g0.compute_s, g0.comm_s) == pytest.approx((5 * US, 3 * US))
    unmarked = {"traceEvents": [e for e in doc["traceEvents"] if e.get("name") != "train"]}
    m = parse_trace(unmarked)
    assert m.steps == 1
    assert m.step_time_s == pytest.approx(28 * US)  # first op start to last op end
    assert any("no step markers" in n for n in m.notes)


def _psum_step():
    mesh = jax.make_mesh((8,), ("x",))

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"))
    def step(a, w):
        h = jnp.tanh(a @ w)
        s = jax.lax.psum(h, "x")
        return jnp.tanh(s @ w)

    a = jax.device_put(jnp.ones((8 * 64, 256), jnp.float32), NamedSharding(mesh, P("x")))
    w = jax.device_put(jnp.full((256, 256), 0.01, jnp.float32), NamedSharding(mesh, P()))
    return step, (a, w)


def test_real_cpu_trace_adds_up(tmp_path):
    step, args = _psum_step()
    m = profile_steps(step, args, steps=3, logdir=tmp_path)
    assert list(tmp_path.glob("plugins/profile/*/*.xplane.pb"))
    assert m.steps == 3
    assert m.synchronous_collectives
    assert any("psum" in name for name in m.collective_ops)
    assert len(m.devices) == 8
    assert m.comm_s > 0 and m.compute_s > 0
    for d in [m, *m.devices.values()]:
        assert d.compute_s + d.comm_s + d.idle_s == pytest.approx(d.step_time_s, rel=0.05)
    # The Chrome JSON written next to the XSpace (when this jax writes one) agrees.
    json_files = list(tmp_path.glob("plugins/profile/*/*.trace.json.gz"))
    if json_files:
        from_json = parse_trace(json_files[0], step_name="train")
        assert from_json.comm_s == pytest.approx(m.comm_s, rel=1e-3)
        assert from_json.compute_s == pytest.approx(m.compute_s, rel=1e-3)


def test_load_trace_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "missing")
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path)
