"""What XLA compiles for a pp=4 pipeline step: one transfer per ring and tick, in the loop.

One compile of the 1F1B step on pp4 x dp2 for the CPU devices. The tick loop is the `while`
whose trip count is the schedule's tick count; its body must hold the tick's transfers -- on
the CPU one all-gather over pp of one microbatch's activations, which carries both rings (each
collective there is a rendezvous of every device thread) -- and the actions behind two
`conditional`s (the actions that fill no residual pool, then those that fill one, in place).
Compiled for GPUs (deviceless, below) the forward send (+1 ring) and the backward send (-1
ring) are two asynchronous collective-permutes and nothing all-gathers activations.
"""

import re

import jax
import pytest
from helpers import TINY, np_batch

from jax_overlap import config
from jax_overlap.pipeline.program import LANE_SCOPE, TickSpan
from jax_overlap.training.assemble import assemble
from models.gpt import GPT

PP, DP, MICROBATCHES = 4, 2, 4


def _compiled_cpu_step(schedule: str):
    """(compiled HLO text, tick program, config) of a pp4 x dp2 step on the CPU devices, with
    the plan's compile options."""
    cfg = config.load(TINY, [f"mesh.pp={PP}", f"mesh.dp={DP}", "mesh.tp=1", "model.layers=4",
                             f"pipeline.schedule={schedule}",
                             f"pipeline.microbatches={MICROBATCHES}"])
    model = GPT.from_config(cfg.model)
    run = assemble(cfg, model=model)
    loss_and_grads = run.loss_and_grads()
    params = run.place_params(model.init(jax.random.key(0)))
    lowered = jax.jit(loss_and_grads, compiler_options=run.plan.compiler_options() or None
                      ).lower(params, run.put_batch(np_batch(cfg)))
    return lowered.compile().as_text(), loss_and_grads.program, cfg


@pytest.fixture(scope="module")
def compiled():
    # 1F1B places one chunk per stage: the staged layer order is the logical one.
    text, program, cfg = _compiled_cpu_step("1f1b")
    b = cfg.train.global_batch // DP // MICROBATCHES
    return text, program, (b, cfg.model.seq_len, cfg.model.d_model)


def _computations(text: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines (HLO text: a header line ending in '{')."""
    comps, name = {}, None
    for line in text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if header:
            name = header.group(1)
            comps[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            comps[name].append(line)
    return comps


def _tick_loop_body(text: str, ticks: int) -> str:
    """Name of the body of the `while` that runs `ticks` iterations."""
    bodies = [m.group(1) for m in re.finditer(
        r"while\(.*body=%?([\w.\-]+).*\"known_trip_count\":\{\"n\":\"(\d+)\"\}", text)
        if int(m.group(2)) == ticks]
    assert len(bodies) == 1, bodies
    return bodies[0]


def test_one_all_gather_per_tick_inside_the_loop_on_a_cpu(compiled):
    text, program, act_shape = compiled
    comps = _computations(text)
    body = _tick_loop_body(text, program.ticks)
    transfers = [line for name, lines in comps.items() for line in lines
                 if re.search(r" (collective-permute|all-gather)(-start)?\(", line)]
    in_body = [line for line in comps[body] if line in transfers]
    assert len(transfers) == 1 and len(in_body) == 1, transfers  # nothing outside the loop
    # One microbatch's activations from each of the PP stages, over the pp groups only:
    # partition ids are positions in the (dp, pp, tp) device grid, id = dp * PP + stage.
    (line,) = in_body
    assert " all-gather" in line
    shape = "f32[" + ",".join(map(str, (PP, *act_shape))) + "]"
    assert shape in line, line
    groups = re.search(r"replica_groups=(mesh\[[^\]]*\] \{[^}]*\}|\S+)", line).group(1)
    assert groups in ("{{0,1,2,3},{4,5,6,7}}", "[2,4]<=[8]",
                      "mesh['dp'=2,'pp'=4,'tp'=1] {'pp'}"), groups
    assert program.down_pairs == tuple((s, s + 1) for s in range(PP - 1))
    assert program.up_pairs == tuple((s + 1, s) for s in range(PP - 1))
    # The actions sit behind two conditionals with one branch per action kind (+ idle): the
    # actions that fill no residual pool, then those that fill one (updating it in place).
    # 1F1B at pp > 1 without a split backward: F fills the embedding's, the chunks' and the
    # head's pools, B fills none. No other conditional runs in the tick.
    conditionals = [line for line in comps[body] if " conditional(" in line]
    branches = [re.search(r"branch_computations=\{([^}]*)\}", line).group(1).split(",")
                for line in conditionals]
    assert [len(b) for b in branches] == [1 + len(program.branches)] * 2, branches
    assert all(f"/{LANE_SCOPE}0/" in line for line in conditionals)


def test_residual_pools_stay_in_place_through_the_tick_on_a_cpu():
    """ZB-H1 on pp4 x dp2 (F and the split B fill residual pools W reads), compiled for the
    CPU devices: the filing switch updates the pools in place. Without XLA:CPU's region-based
    copy insertion (which the forced host platform turns on: jax_overlap/parallel/mesh.py,
    and the plan's compile options) every pool was copied every tick."""
    text, program, _ = _compiled_cpu_step("zb-h1")
    body = _computations(text)[_tick_loop_body(text, program.ticks)]
    leading = {program.residual_slots(name) + 1 for name, _ in program.res_slots}
    pools = [line for line in body
             if re.search(r"= \w+\[(\d+),.* get-tuple-element\(%[\w.]*param", line)
             and int(re.search(r"= \w+\[(\d+),", line).group(1)) in leading]
    assert pools  # the pools are carried through the loop body
    copies = [line for line in body if " copy(" in line
              and int((re.search(r"= \w+\[(\d+)", line) or [0, 0])[1]) in leading]
    assert not copies, copies


def test_per_step_collective_counts_from_the_hlo_reader(compiled):
    text, program, _ = compiled
    from jax_overlap.analysis.hlo_report import analyze_hlo

    report = analyze_hlo(text)
    gathers = [op for op in report.ops if op.kind == "all-gather"]
    assert len(gathers) == 1 and "collective-permute" not in report.collectives
    assert gathers[0].executions_per_step == program.ticks
    assert report.collectives["all-gather"].count == program.ticks


# ------------------------------------------------------- the GPU schedule, without a GPU


def test_skewed_loop_and_in_loop_buckets_on_the_gpu_schedule():
    """pp4 x dp2, 1F1B, transfer_latency 2, 1 MB buckets, compiled for 8 H100s.

    Each tick sends the previous tick's output, so XLA starts both rings' permutes before
    the tick's `conditional` (its GEMMs) and finishes them after. Each chunk's last backward
    reduces its layers' gradients over dp inside its branch, bucket by bucket, under the
    backward of the chunk's earlier layers. Under remat full, whose recompute gives the
    backward its forward's GEMMs too (`auto` takes `minimal` here since 2026-12-07: at this
    size 0.25 of the in-loop bucket bytes are then under GEMMs; GPT-1.3B's are the same
    under either policy, docs/results.md).
    """
    from helpers import last_json_line, run_cli

    from jax_overlap.analysis import deviceless

    if not deviceless.plugin_available():
        pytest.skip(deviceless.unavailable_reason() or "CUDA plugin missing")
    overrides = ["mesh.pp=4", "mesh.dp=2", "mesh.tp=1", "model.layers=16", "model.d_model=256",
                 "model.heads=4", "model.d_ff=1024", "model.seq_len=128",
                 "pipeline.schedule=1f1b", "pipeline.microbatches=8", "train.global_batch=32",
                 "pipeline.transfer_latency=2", "overlap.grad_bucket_mb=1",
                 "overlap.xla_preset=gpu_overlap", "pipeline.vocab_parallel=false",
                 "model.remat=full"]
    proc = run_cli("analyze", "--config", TINY, "--target", "h100", "--json", "--top", "3",
                   *[a for o in overrides for a in ("--set", o)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = last_json_line(proc.stdout)
    ops = out["ops"]
    # The step estimate (analysis.step_estimate), with the exact keys: the pipeline
    # replayed on its tick table waits on the bubble; the three costliest non-GEMM kernels.
    est = out["estimate"]
    assert set(est) == {"step_ms", "mfu", "gemm_ms", "other_ms", "launch_ms", "wait_ms",
                        "exposed_ms", "model_flops", "gemm_flops", "expected_step_ms",
                        "expected_mfu"}
    assert est["wait_ms"] > 0 and 0 < est["mfu"] < 1
    # At the kernel rates measured on Hopper, every kernel takes longer than at the peaks.
    assert est["expected_step_ms"] > est["step_ms"] and est["expected_mfu"] < est["mfu"]
    # The communication nothing hides is part of the step.
    assert est["exposed_ms"] == pytest.approx(out["exposed_comm_s_estimate"] * 1e3)
    assert est["step_ms"] == pytest.approx(
        est["gemm_ms"] + est["other_ms"] + est["launch_ms"] + est["wait_ms"]
        + est["exposed_ms"])
    per_device = GPT.from_config(config.load(TINY, overrides).model).flops_per_example() * 32 / 8
    assert est["model_flops"] == pytest.approx(per_device)
    top = out["top_kernels"]
    assert len(top) == 3 and top[0]["ms"] >= top[1]["ms"] >= top[2]["ms"] > 0
    # What XLA allocates per device (memory_analysis), against the H100's memory.
    mem = out["memory"]
    # XLA's own peak where it reports one: at most every buffer live at once.
    assert mem["temp_bytes"] < mem["peak_bytes"] <= (
        mem["argument_bytes"] + mem["output_bytes"] - mem["alias_bytes"] + mem["temp_bytes"])
    assert mem["fits"] is True and mem["peak_bytes"] < mem["device_bytes"]
    permutes = [op for op in ops if op["kind"] == "collective-permute"]
    assert len(permutes) == 2
    assert all(op["async"] and op["gemms_between"] for op in permutes), permutes
    # On a GPU the stages' activations move point to point: nothing is all-gathered.
    assert not [op for op in ops if op["kind"] == "all-gather"]
    # Bucket reductions inside the loop's branches: weighted by how often the tick table takes
    # each branch, they add up to one stage's block gradients (fp32) per device and step.
    in_loop = [op for op in ops if op["kind"] == "all-reduce" and op["executions_per_step"] < 1]
    cfg = config.load(TINY, overrides)
    blocks = jax.eval_shape(GPT.from_config(cfg.model).init, jax.random.key(0))["blocks"]
    stage_bytes = sum(x.size * 4 for x in jax.tree.leaves(blocks)) // 4
    moved = sum(op["bytes"] * op["executions_per_step"] for op in in_loop)
    assert moved == pytest.approx(stage_bytes, rel=1e-3)
    hidden = sum(op["bytes"] * op["executions_per_step"] for op in in_loop
                 if op["async"] and op["gemms_between"])
    assert hidden / moved >= 0.5  # the chunk's first layer's buckets have nothing left


def _by_loop(ops: list[dict]) -> dict[str, list[dict]]:
    """`analyze --json` ops grouped by the computation they run in."""
    out: dict[str, list[dict]] = {}
    for op in ops:
        out.setdefault(op["computation"], []).append(op)
    return out


@pytest.mark.slow
def test_paired_zb_v_sends_every_transfer_under_a_lane_on_the_gpu_schedule():
    """pp4 x dp2, ZB-V with paired ticks, compiled for 8 H100s: in the steady state both lanes
    send on both rings, four permutes a tick, and each runs beside the other lane's
    `conditional` (its GEMMs), not beside the slot writes after it (the executor ties each
    lane's arrivals to its results). The fill's loop sends only the forward lane's two rings,
    the drain's only the backward lane's (`TickProgram.spans`). With the vocabulary-parallel
    head: the next test."""
    from helpers import last_json_line, run_cli

    from jax_overlap.analysis import deviceless

    if not deviceless.plugin_available():
        pytest.skip(deviceless.unavailable_reason() or "CUDA plugin missing")
    overrides = ["mesh.pp=4", "mesh.dp=2", "mesh.tp=1", "model.layers=8", "model.d_model=32",
                 "model.heads=4", "model.d_ff=64", "model.seq_len=16", "data.source=synthetic",
                 "pipeline.schedule=zb-v", "pipeline.virtual_stages=2", "pipeline.paired=true",
                 "pipeline.microbatches=8", "train.global_batch=16",
                 "overlap.xla_preset=gpu_overlap", "pipeline.vocab_parallel=false"]
    proc = run_cli("analyze", "--config", TINY, "--target", "h100", "--json",
                   *[a for o in overrides for a in ("--set", o)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    permutes = [op for op in last_json_line(proc.stdout)["ops"]
                if op["kind"] == "collective-permute"]
    loops = sorted(_by_loop(permutes).values(), key=len)
    assert [len(ops) for ops in loops] == [2, 2, 4], permutes
    assert all(op["async"] and op["gemms_between"] for op in loops[-1]), loops[-1]


@pytest.mark.slow
def test_paired_vocab_parallel_head_runs_its_all_reduces_under_the_lanes():
    """pp4 x dp2, ZB-V paired with the vocabulary-parallel head (the GPU default), compiled
    for 8 H100s: the head's two all-reduces over pp of one microbatch's activations -- the
    output's broadcast before the head and its gradient's sum after -- run under the backward
    lane and the next tick's forward lane, and the four permutes stay under the lanes too."""
    from helpers import last_json_line, run_cli

    from jax_overlap.analysis import deviceless

    if not deviceless.plugin_available():
        pytest.skip(deviceless.unavailable_reason() or "CUDA plugin missing")
    b, t, d = 1, 16, 32  # microbatch rows per replica, seq_len, d_model
    overrides = ["mesh.pp=4", "mesh.dp=2", "mesh.tp=1", "model.layers=8", f"model.d_model={d}",
                 "model.heads=4", "model.d_ff=64", f"model.seq_len={t}", "data.source=synthetic",
                 "pipeline.schedule=zb-v", "pipeline.virtual_stages=2", "pipeline.paired=true",
                 "pipeline.microbatches=8", f"train.global_batch={b * 8 * 2}",
                 "overlap.xla_preset=gpu_overlap", "pipeline.vocab_parallel=true"]
    proc = run_cli("analyze", "--config", TINY, "--target", "h100", "--json",
                   *[a for o in overrides for a in ("--set", o)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = last_json_line(proc.stdout)
    in_loop = [op for op in out["ops"] if op["executions_per_step"] > 1]
    heads = [op for op in in_loop if op["kind"] == "all-reduce" and op["mesh_axes"] == ["pp"]
             and op["bytes"] in (b * t * d * 2, b * t * d * 4)]  # bf16 or fp32 compute
    permutes = [op for op in in_loop if op["kind"] == "collective-permute"]
    # All the head's in the steady state's loop, once a tick there (whether or not the tick
    # has a head), with its four permutes; the fill's and the drain's loops have no head.
    (steady,) = {op["computation"] for op in heads}
    steady_permutes = [op for op in permutes if op["computation"] == steady]
    assert len(heads) == 2 and len(steady_permutes) == 4, in_loop
    assert len({op["executions_per_step"] for op in heads + steady_permutes}) == 1
    assert all(op["async"] and op["gemms_between"] for op in heads + steady_permutes), (
        heads + steady_permutes)
    assert sorted(len(ops) for ops in _by_loop(permutes).values()) == [2, 2, 4], permutes


def _tick_scan_bodies(jaxpr, lengths: list[int]) -> list:
    """The bodies of the traced step's scans over ticks, one per span of the table
    (`TickProgram.spans`), in order: the scans of `lengths` ticks, not those inside them."""

    def subs(params):  # the jaxprs an equation's params hold (cond branches, scan body...)
        for v in params.values():
            for x in v if isinstance(v, (tuple, list)) else (v,):
                x = getattr(x, "jaxpr", x)
                if hasattr(x, "eqns"):
                    yield x

    def find(j):
        for e in j.eqns:
            if e.primitive.name == "scan" and e.params["length"] in lengths:
                yield e.params["jaxpr"].jaxpr
                continue
            for sub in subs(e.params):
                yield from find(sub)

    bodies = list(find(jaxpr))
    assert [len(b.eqns) > 0 for b in bodies] == [True] * len(lengths), bodies
    return bodies


def _tick_scan_body(jaxpr, ticks: int):
    """The body of the traced step's one `scan` over its `ticks` ticks."""
    (body,) = _tick_scan_bodies(jaxpr, [ticks])
    return body


def test_an_accelerator_tick_permutes_only_where_data_moves():
    """The step a GPU plan builds (traced on the CPU devices), unpaired at latency 1: the
    tick's output goes on a switch over the table's ring patterns, each branch permuting
    exactly the pairs that trade data read at the next tick (+1 for forwards, -1 for
    backwards), one microbatch of activations each; what is read later goes on the slack
    ring, at the top of the body. (The CPU plan's tick all-gathers instead: above.)"""
    from jax_overlap.plan import Target

    cfg = config.load(TINY, [f"mesh.pp={PP}", f"mesh.dp={DP}", "mesh.tp=1", "model.layers=4",
                             "pipeline.schedule=1f1b", f"pipeline.microbatches={MICROBATCHES}",
                             "pipeline.paired=false", "pipeline.vocab_parallel=false",
                             "model.attention=plain"])
    model = GPT.from_config(cfg.model)
    run = assemble(cfg, jax.devices()[:PP * DP], target=Target("h100", True, 80e9),
                   model=model)
    program = run.plan.program
    params = run.place_params(model.init(jax.random.key(0)))
    jaxpr = jax.make_jaxpr(run.loss_and_grads())(params, run.put_batch(np_batch(cfg))).jaxpr
    body = _tick_scan_body(jaxpr, program.ticks)
    assert "all_gather" not in [e.primitive.name for e in body.eqns]
    b = cfg.train.global_batch // DP // MICROBATCHES
    shape = (b, cfg.model.seq_len, cfg.model.d_model)
    slack = [e for e in body.eqns if e.primitive.name == "ppermute"]
    assert [tuple(e.params["perm"]) for e in slack] == [r for r in program.slack_pairs if r]
    assert all(tuple(e.invars[0].aval.shape) == shape for e in slack)
    (switch,) = [e for e in body.eqns if e.primitive.name == "cond" and any(
        q.primitive.name == "ppermute" for br in e.params["branches"] for q in br.jaxpr.eqns)]
    sent = [tuple(tuple(q.params["perm"]) for q in br.jaxpr.eqns
                  if q.primitive.name == "ppermute") for br in switch.params["branches"]]
    assert sent == [tuple(r for r in pattern if r) for pattern in program.patterns]
    down = {(s_, s_ + 1) for s_ in range(PP - 1)}
    for down_pairs, up_pairs in program.patterns:
        assert set(down_pairs) <= down and {(d, s_) for s_, d in up_pairs} <= down
    # Every transfer a tick makes is on one of them; most ticks move only some pairs.
    assert sum(len(a) + len(b_) for a, b_ in program.patterns) < len(program.patterns) * 2 * (
        PP - 1)


def _tick_body_head_psums(paired: bool, accelerator: bool
                          ) -> tuple[list[TickSpan], list[tuple[int, int]]]:
    """The spans of the step's tick loops (one but for a paired tick on a GPU:
    `TickProgram.spans`) and, per loop, (psums over pp of one microbatch's activations at the
    top of its body, those inside a cond in it), from the traced step (no compile): pp2 x
    dp2, ZB-V, vocabulary-parallel head."""
    from jax_overlap.plan import Target

    cfg = config.load(TINY, ["mesh.pp=2", "mesh.dp=2", "mesh.tp=1", "model.layers=4",
                             "pipeline.schedule=zb-v", "pipeline.virtual_stages=2",
                             "pipeline.microbatches=4", "pipeline.vocab_parallel=true",
                             f"pipeline.paired={str(paired).lower()}", "model.attention=plain"])
    model = GPT.from_config(cfg.model)
    target = Target("h100", True, 80e9) if accelerator else None
    run = assemble(cfg, jax.devices()[:4], target=target, model=model)
    assert run.plan.vocab_parallel and run.plan.schedule.paired == paired
    params = run.place_params(model.init(jax.random.key(0)))
    jaxpr = jax.make_jaxpr(run.loss_and_grads())(params, run.put_batch(np_batch(cfg))).jaxpr
    act_rank = 3  # (b, T, D) per device

    def head_psums(eqns):
        return [e for e in eqns if e.primitive.name.startswith("psum")
                and e.params.get("axes") == ("pp",) and e.invars[0].aval.ndim == act_rank]

    program = run.plan.program
    spans = program.spans() if paired and accelerator else [
        TickSpan.every(0, program.ticks, program.lanes)]
    counts = []
    for span, body in zip(spans, _tick_scan_bodies(jaxpr, [s.stop - s.start for s in spans])):
        in_conds = sum(len(head_psums(b.jaxpr.eqns)) for e in body.eqns
                       if e.primitive.name == "cond" for b in e.params["branches"])
        counts.append((len(head_psums(body.eqns)), in_conds))
    return spans, counts


@pytest.mark.parametrize("paired,accelerator", [(True, True), (True, False), (False, True)])
def test_vocab_parallel_head_all_reduces_run_every_tick_only_when_hidden(paired, accelerator):
    """A paired tick on a GPU runs the head's two all-reduces over pp in the tick body, every
    tick of the steady state, under its lanes: the output's broadcast where a span has a
    head, its gradient's sum where it has one the tick before (the fill and the drain have
    fewer). Unpaired, or on CPU devices (synchronous collectives), one loop runs them inside
    the head's cond: a tick without a head runs none."""
    spans, counts = _tick_body_head_psums(paired, accelerator)
    if not (paired and accelerator):
        assert counts == [(0, 2)]
        return
    assert len(spans) == 3 and counts[1] == (2, 0)
    assert counts == [(s.head + s.head_before, 0) for s in spans]
    assert counts[0][0] < 2 and counts[2][0] < 2


def test_paired_gpu_pipeline_copies_no_gradient_accumulators_per_tick():
    """pp4 x dp2 as the plan sets it up on a GPU (1F1B paired, in-loop buckets), compiled for
    8 H100s: the tick switch updates the stage's fp32 gradient accumulators in place. Without
    copy insertion's region analysis (the plan's per-compile option for a pipeline) every
    branch that passes them through -- idle, the sync B's -- copied them, and the loop copied
    them back after the switch, every tick."""
    from helpers import last_json_line, run_cli

    from jax_overlap.analysis import deviceless

    if not deviceless.plugin_available():
        pytest.skip(deviceless.unavailable_reason() or "CUDA plugin missing")
    d, ff = 256, 1024
    overrides = ["mesh.pp=4", "mesh.dp=2", "mesh.tp=1", "model.layers=8", f"model.d_model={d}",
                 "model.heads=4", f"model.d_ff={ff}", "model.seq_len=128",
                 "train.global_batch=32", "pipeline.microbatches=8", "train.precision=bf16",
                 "data.source=synthetic"]
    proc = run_cli("analyze", "--config", TINY, "--target", "h100", "--json", "--top", "400",
                   *[a for o in overrides for a in ("--set", o)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = last_json_line(proc.stdout)
    assert out["plan"]["schedule"] == "1f1b" and out["plan"]["paired"] is True, out["plan"]
    copies = [k for k in out["top_kernels"] if k["name"].startswith("copy")]
    # One layer's fp32 MLP weight gradient is d x ff x 4 bytes: no copy moves that much.
    layer_grad_mib = d * ff * 4 / 2**20
    assert all(k["mib"] < layer_grad_mib for k in copies), [
        (k["name"], k["mib"], k["where"]) for k in copies if k["mib"] >= layer_grad_mib]
