"""The pipeline executor computes the single-device loss and gradients, for every schedule.

Default run (compile time is the budget): every schedule at least once, every mesh of
pp4 x dp2, pp2 x tp2 x dp2, pp4 x tp2 and pp2 x dp4, microbatches pp and 2 pp, tied and
untied embeddings, and one 4-step training curve against pp=1. `make test-slow` sweeps every
schedule x mesh x microbatch count, sequence-parallel TP, and curves for every schedule.
"""

import dataclasses

import jax
import numpy as np
import pytest
from helpers import TINY, cached_references, max_rel_err, np_batch, rel, schedule_sweep

from jax_overlap import config
from jax_overlap.analysis.step_estimate import Ticks
from jax_overlap.parallel import mesh as meshlib
from jax_overlap.pipeline import layout, schedules
from jax_overlap.pipeline import program as tick_program
from jax_overlap.training.assemble import assemble, plan_for
from jax_overlap.training import loop as train
from models.gpt import GPT

CHUNKS = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zb-h1": 1, "zb-v": 2}
LAYERS = 8  # divisible by pp x chunks for every case below

# (schedule, pp, dp, tp, microbatches, tied)
DEFAULT_CASES = [
    ("interleaved", 4, 2, 1, 4, True),
    ("zb-v", 4, 2, 1, 4, True),
    ("1f1b", 2, 2, 2, 2, False),
    ("zb-h1", 2, 2, 2, 4, True),
    ("gpipe", 2, 4, 1, 2, False),
    ("zb-v", 4, 1, 2, 8, False),
]
MESHES = [(4, 2, 1), (2, 2, 2), (4, 1, 2), (2, 4, 1)]  # (pp, dp, tp)
SLOW_CASES = [(name, pp, dp, tp, m, i % 2 == 0) for i, (name, (pp, dp, tp), m) in enumerate(
    (name, mesh, m) for name in schedules.SCHEDULES for mesh in MESHES
    for m in (mesh[0], 2 * mesh[0]))]


def pipeline_cfg(name, pp, dp, tp, m, tied=True, extra=()):
    return config.load(TINY, [
        f"mesh.pp={pp}", f"mesh.dp={dp}", f"mesh.tp={tp}", f"model.layers={LAYERS}",
        f"model.tied_embeddings={str(tied).lower()}", f"pipeline.schedule={name}",
        f"pipeline.microbatches={m}", f"pipeline.virtual_stages={CHUNKS[name]}", *extra])


@pytest.fixture(scope="module")
def references():
    """Single-device loss and gradients, per tied/untied model (computed once each)."""
    return cached_references(lambda tied: pipeline_cfg("1f1b", 2, 4, 1, 2, tied))


def check_equivalence(references, name, pp, dp, tp, m, tied, extra=()):
    cfg = pipeline_cfg(name, pp, dp, tp, m, tied, extra)
    model, params, batch, ref_loss, ref_grads = references(tied)
    run = assemble(cfg, jax.devices()[: dp * pp * tp], model=model)
    perm, shardings = run.plan.layer_perm, run.param_shardings()
    loss_and_grads = run.loss_and_grads()
    loss, grads = jax.jit(loss_and_grads)(run.place_params(params), run.put_batch(batch))
    assert rel(float(loss), ref_loss) <= 1e-5, (float(loss), ref_loss)
    assert max_rel_err(layout.to_logical(grads, perm), ref_grads) <= 1e-5
    # Gradients come back laid out as the parameters: blocks split over pp (and over dp under
    # fsdp), not gathered.
    expected = shardings["blocks"]["w_in"]
    assert grads["blocks"]["w_in"].sharding.is_equivalent_to(expected, 3)
    # The executor ran exactly the schedule's table: its idle stage-ticks are the bubble.
    program = loss_and_grads.program
    assert program.schedule.name == name and program.ticks == program.schedule.ticks
    assert program.idle_fraction() == pytest.approx(
        schedules.bubble_fraction(program.schedule), abs=1e-12)


@pytest.mark.parametrize("name,pp,dp,tp,m,tied", DEFAULT_CASES)
def test_pipeline_matches_single_device(references, name, pp, dp, tp, m, tied):
    check_equivalence(references, name, pp, dp, tp, m, tied)


@pytest.mark.slow
@pytest.mark.parametrize("name,pp,dp,tp,m,tied", SLOW_CASES)
def test_pipeline_matches_single_device_sweep(references, name, pp, dp, tp, m, tied):
    check_equivalence(references, name, pp, dp, tp, m, tied)


# Remat policies: what each F keeps for its backward (none: every residual, no recompute; the
# default cases above run it). Default run: each other policy on a split and a plain
# schedule; the sweep: every schedule x policy x mesh.
REMAT_CASES = [
    ("zb-h1", 2, 2, 2, 4, True, "full"),
    ("1f1b", 4, 2, 1, 4, False, "save_dots"),
    ("zb-v", 2, 4, 1, 2, True, "minimal"),
]
REMAT_SWEEP = schedule_sweep([(4, 2, 1), (2, 2, 2), (2, 4, 1)])


@pytest.mark.parametrize("name,pp,dp,tp,m,tied,remat", REMAT_CASES)
def test_remat_policies_match_single_device(references, name, pp, dp, tp, m, tied, remat):
    check_equivalence(references, name, pp, dp, tp, m, tied, [f"model.remat={remat}"])


@pytest.mark.slow
@pytest.mark.parametrize("name,pp,dp,tp,m,tied,remat", REMAT_SWEEP)
def test_remat_policies_match_single_device_sweep(references, name, pp, dp, tp, m, tied,
                                                  remat):
    check_equivalence(references, name, pp, dp, tp, m, tied, [f"model.remat={remat}"])


# Paired F+B ticks (two lanes per tick): default run, a split and a plain schedule on two
# meshes and one remat policy; the sweep: every schedule x remat {none, full, save_dots} x
# mesh {pp4 x dp2, pp2 x dp2 x tp2, pp2 x dp4}.
PAIRED_CASES = [
    ("zb-v", 4, 2, 1, 8, True, "none"),
    ("1f1b", 2, 2, 2, 4, False, "full"),
    ("interleaved", 2, 4, 1, 4, True, "save_dots"),
]
PAIRED_SWEEP = REMAT_SWEEP  # the same grid, each case with paired ticks
# The ZB-V case runs a table from the pairing search (`pipeline.pair_search`) at CPU-measured
# tick costs: pairs where the fixed quorum has none, and the other way round.
SEARCHED = {"zb-v": ["pipeline.pair_search=40", "pipeline.tick_costs=[15.2,18.8,18.6]"]}


@pytest.mark.parametrize("name,pp,dp,tp,m,tied,remat", PAIRED_CASES)
def test_paired_ticks_match_single_device(references, name, pp, dp, tp, m, tied, remat):
    extra = ["pipeline.paired=true", *SEARCHED.get(name, [])]
    program = plan_for(pipeline_cfg(name, pp, dp, tp, m, tied, extra)).program
    assert program.lanes == 2  # the case runs two lanes per tick
    if name in SEARCHED:
        fixed = plan_for(pipeline_cfg(name, pp, dp, tp, m, tied,
                                                ["pipeline.paired=true"])).program
        assert program.schedule.grid != fixed.schedule.grid
    check_equivalence(references, name, pp, dp, tp, m, tied, [*extra, f"model.remat={remat}"])


@pytest.mark.parametrize("name,pp,m", [("zb-v", 4, 8), ("zb-h1", 2, 4)])
def test_cost_aware_table_matches_single_device(references, name, pp, m):
    """The paired table chosen at the zero-bubble paper's costs with a transfer (`schedule
    --paired --costs 14.4,14.4,9.7,1.6`) runs exactly: lanes as positions, so it runs W's in
    lane 0 beside B's and two W's in one tick."""
    dp, tp, tied = 2, 1, True
    table = schedules.make_schedule(name, pp, m, CHUNKS[name], 1, True,
                                    {"F": 14.4, "B": 14.4, "W": 9.7}, 0, 1.6)
    kinds = {(c.forward.kind, c.backward.kind) for row in table.grid for c in row
             if isinstance(c, schedules.Pair)}
    assert {("W", "B"), ("W", "W"), ("F", "B")} <= kinds, kinds
    cfg = pipeline_cfg(name, pp, dp, tp, m, tied, ["pipeline.paired=true"])
    model, params, batch, ref_loss, ref_grads = references(tied)
    run = assemble(cfg, jax.devices()[: dp * pp * tp], model=model)
    program = _check_table(run, table, params, batch, ref_loss, ref_grads)
    w_in_lane0 = [i + 1 for i, b in enumerate(program.branches) if b.kind == "W"]
    assert np.isin(program.column("branch")[:, :, 0], w_in_lane0).any()


def _check_table(run, table, params, batch, ref_loss, ref_grads):
    """`run` with its plan running `table`: the loss and gradients of one device (fp32,
    <= 1e-5); returns the tick program."""
    plan = run.plan.with_program(tick_program.compile_program(
        table, run.plan.overlap.buckets_in_loop, run.plan.vocab_parallel))
    run = dataclasses.replace(run, plan=plan)
    loss_and_grads = run.loss_and_grads()
    loss, grads = jax.jit(loss_and_grads)(run.place_params(params), run.put_batch(batch))
    assert loss_and_grads.program.schedule.grid == table.grid
    assert rel(float(loss), ref_loss) <= 1e-5, (float(loss), ref_loss)
    assert max_rel_err(layout.to_logical(grads, plan.layer_perm), ref_grads) <= 1e-5
    return plan.program


@pytest.mark.slow
@pytest.mark.parametrize("name,pp,dp,tp,m,tied,remat", PAIRED_SWEEP)
def test_paired_ticks_match_single_device_sweep(references, name, pp, dp, tp, m, tied, remat):
    check_equivalence(references, name, pp, dp, tp, m, tied,
                      ["pipeline.paired=true", f"model.remat={remat}"])


def test_remat_policy_sets_what_an_f_keeps():
    """`full` keeps less per microbatch than `none` (the stash the executor files)."""
    from jax_overlap.pipeline import executor

    sizes = {}
    for remat in ("none", "save_dots", "full"):
        cfg = pipeline_cfg("1f1b", 2, 4, 1, 2, True, [f"model.remat={remat}"])
        run = assemble(cfg, jax.devices()[:8], model=GPT.from_config(cfg.model))
        sizes[remat] = executor.residual_bytes(run.model, run.plan, run.mesh)
    assert sizes["none"]["chunk"] > sizes["save_dots"]["chunk"] > sizes["full"]["chunk"] > 0


# transfer_latency=2: the skewed loop that sends tick t-1's output beside tick t's action
# (zb-v with L=2 also runs in the default suite under OPTION_CASES; the rest in the sweep).
SKEWED_CASES = [("1f1b", 4, 2, 1, 4, True)]


@pytest.mark.parametrize("name,pp,dp,tp,m,tied", SKEWED_CASES)
def test_skewed_pipeline_matches_single_device(references, name, pp, dp, tp, m, tied):
    check_equivalence(references, name, pp, dp, tp, m, tied, ["pipeline.transfer_latency=2"])


# Overlap options under the pipeline (each with TP in the mesh where it fits).
OPTION_CASES = [
    ("1f1b", 2, 2, 2, 2, True, ["overlap.param_sharding=fsdp"]),
    ("zb-v", 4, 2, 1, 4, False, ["overlap.param_sharding=fsdp", "pipeline.transfer_latency=2"]),
    ("interleaved", 2, 4, 1, 2, True, ["overlap.zero1=true", "overlap.grad_bucket_mb=0.05"]),
    # In-loop buckets with TP: each chunk's last backward reduces over dp (and tp for the
    # TP-replicated leaves) inside the tick loop.
    ("1f1b", 2, 2, 2, 4, True, ["overlap.grad_bucket_mb=0.01"]),
    ("zb-v", 2, 2, 2, 2, False, ["overlap.grad_bucket_mb=0.01", "pipeline.transfer_latency=2"]),
    # W as the chunk's whole backward (what the plan picks on a GPU under full remat).
    ("zb-h1", 2, 2, 2, 2, False, ["pipeline.split_backward=false", "model.remat=full"]),
    # Collective matmul inside the per-stage branches: grouped steps (the plan's cm_grouped).
    ("zb-v", 2, 2, 2, 2, False, ["overlap.tp_comm=collective_matmul"]),
]
# The rest of collective matmul under a pipeline: both schedules the issue names, each ring
# direction (the grouped steps ignore it), the skewed loop, paired ticks, full remat.
CM = ["overlap.tp_comm=collective_matmul"]
CM_SWEEP = [(name, 2, 2, 2, m, tied, CM + more)
            for name, m, tied in [("1f1b", 2, True), ("zb-v", 4, False)]
            for more in (["overlap.collective_matmul_direction=uni"],
                         ["overlap.collective_matmul_direction=bi"],
                         ["pipeline.transfer_latency=2"], ["pipeline.paired=true"],
                         ["model.remat=full"])]


@pytest.mark.parametrize("name,pp,dp,tp,m,tied,extra", OPTION_CASES)
def test_pipeline_with_overlap_options_matches_single_device(references, name, pp, dp, tp, m,
                                                            tied, extra):
    check_equivalence(references, name, pp, dp, tp, m, tied, extra)
    if "overlap.param_sharding=fsdp" in extra:  # the storage really is split over dp
        cfg = pipeline_cfg(name, pp, dp, tp, m, tied, extra)
        run = assemble(cfg, jax.devices()[: dp * pp * tp], model=GPT.from_config(cfg.model))
        spec = run.param_shardings()["blocks"]["w_in"].spec
        assert meshlib.DP in jax.tree.leaves(tuple(spec)), spec


@pytest.mark.slow
@pytest.mark.parametrize("name,pp,dp,tp,m,tied,extra", CM_SWEEP)
def test_pipeline_with_collective_matmul_matches_single_device_sweep(references, name, pp, dp,
                                                                     tp, m, tied, extra):
    assert plan_for(pipeline_cfg(name, pp, dp, tp, m, tied, extra)).overlap.cm_grouped
    check_equivalence(references, name, pp, dp, tp, m, tied, extra)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpipe", "zb-h1", "interleaved", "zb-v"])
def test_skewed_pipeline_matches_single_device_sweep(references, name):
    m = 8 if name == "interleaved" else 4
    check_equivalence(references, name, 4, 2, 1, m, True, ["pipeline.transfer_latency=2"])
    if name == "zb-v":  # the local hand-off at the V's turn, with TP
        check_equivalence(references, name, 2, 2, 2, 2, False, ["pipeline.transfer_latency=2"])
    if name == "interleaved":  # the wrap from the last stage to the first, with TP
        check_equivalence(references, name, 2, 2, 2, 4, True, ["pipeline.transfer_latency=2"])


@pytest.mark.slow
@pytest.mark.parametrize("name,split", [("1f1b", "auto"), ("zb-v", "auto"),
                                        ("zb-v", "sequence")])
def test_pipeline_with_sequence_parallel_tp(references, name, split):
    """Sequence parallelism inside the stages, its rows whole sequences (`auto`: the
    microbatch's 2 divide by tp) or positions."""
    check_equivalence(references, name, 2, 2, 2, 4, True, ["overlap.tp_comm=sequence_parallel",
                                                           f"overlap.sp_split={split}"])


# ------------------------------------------------------------------------- layout


def test_staged_permutation_puts_each_stage_layers_contiguously():
    interleaved = schedules.make_schedule("interleaved", 2, 2, 2)
    # Stage 0 holds virtual stages 0 and 2, stage 1 holds 1 and 3 (2 layers each).
    assert layout.staged_permutation(8, interleaved).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    zbv = schedules.make_schedule("zb-v", 2, 2)
    # V placement: stage 0 holds virtual stages 0 and 3, stage 1 holds 1 and 2.
    assert layout.staged_permutation(4, zbv).tolist() == [0, 3, 1, 2]
    assert layout.staged_permutation(8, schedules.make_schedule("1f1b", 4, 4)).tolist() == \
        list(range(8))
    with pytest.raises(ValueError, match="model.layers"):
        layout.staged_permutation(6, interleaved)
    assert plan_for(pipeline_cfg("1f1b", 4, 2, 1, 4)).layer_perm is None
    assert plan_for(pipeline_cfg("zb-v", 2, 4, 1, 2)).layer_perm.tolist() == \
        [0, 1, 6, 7, 2, 3, 4, 5]


def test_to_staged_and_to_logical_are_inverse_on_a_whole_state():
    cfg = pipeline_cfg("interleaved", 4, 2, 1, 4)
    perm = plan_for(cfg).layer_perm
    blocks = {"w": np.arange(8 * 3).reshape(8, 3)}
    state = {"params": {"blocks": blocks, "embed": {"wte": np.ones((2, 2))}},
             "opt": ({"mu": {"blocks": blocks}}, np.int32(3))}
    staged = layout.to_staged(state, perm)
    np.testing.assert_array_equal(staged["params"]["blocks"]["w"], blocks["w"][perm])
    np.testing.assert_array_equal(staged["opt"][0]["mu"]["blocks"]["w"], blocks["w"][perm])
    np.testing.assert_array_equal(staged["params"]["embed"]["wte"], np.ones((2, 2)))
    back = layout.to_logical(staged, perm)
    jax.tree.map(np.testing.assert_array_equal, back, state)


def test_init_state_has_the_same_values_on_every_mesh():
    flat_cfg = config.load(TINY, ["mesh.dp=8", "mesh.tp=1", f"model.layers={LAYERS}"])
    model = GPT.from_config(flat_cfg.model)
    flat = assemble(flat_cfg, model=model).init_state()
    cfg = pipeline_cfg("zb-v", 4, 1, 2, 4)
    staged_run = assemble(cfg, model=model)
    staged = staged_run.init_state()
    perm = staged_run.plan.layer_perm
    assert perm is not None
    jax.tree.map(np.testing.assert_array_equal,
                 layout.to_logical(staged.params, perm), flat.params)
    assert staged.params["blocks"]["w_in"].sharding.spec[0] == "pp"


# ------------------------------------------------------------------------ program


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
def test_executed_bubble_equals_theory(name):
    for p in (2, 4):
        for m in (p, 2 * p):
            program = tick_program.compile_program(
                schedules.make_schedule(name, p, m, CHUNKS[name]))
            idle = int(np.sum(program.column("branch") == tick_program.IDLE))
            assert idle / (p * program.ticks) == pytest.approx(
                schedules.bubble_formula(name, p, m, CHUNKS[name]), abs=1e-12)


def test_stash_slots_follow_lifetimes_not_microbatch_count():
    for m in (4, 16):
        program = tick_program.compile_program(schedules.make_schedule("1f1b", 4, m))
        # 1F1B stage 1 holds at most 3 inputs plus one output gradient waiting for its B.
        assert program.slots == 5
    gpipe = tick_program.compile_program(schedules.make_schedule("gpipe", 4, 16))
    assert gpipe.slots == 17  # every input is held through the turn-around


def test_program_routes_follow_the_placement():
    interleaved = tick_program.compile_program(schedules.make_schedule("interleaved", 4, 4, 2))
    assert (3, 0) in interleaved.down_pairs  # last stage's chunk 0 feeds stage 0's chunk 1
    assert (0, 3) in interleaved.up_pairs
    assert not interleaved.local_handoff
    zbv = tick_program.compile_program(schedules.make_schedule("zb-v", 4, 4))
    assert zbv.local_handoff  # the V's turn at the bottom stays on stage 3
    assert (3, 0) not in zbv.down_pairs and (0, 3) not in zbv.up_pairs
    one_f = tick_program.compile_program(schedules.make_schedule("1f1b", 4, 4))
    assert one_f.down_pairs == ((0, 1), (1, 2), (2, 3))
    assert one_f.up_pairs == ((1, 0), (2, 1), (3, 2))


def _primitives(jaxpr):
    """Names of every primitive in `jaxpr`, recursing into sub-jaxprs."""
    names = []
    for eqn in jaxpr.eqns:
        names.append(eqn.primitive.name)
        for sub in _sub_jaxprs(eqn):
            names += _primitives(sub)
    return names


def _sub_jaxprs(eqn):
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            inner = getattr(item, "jaxpr", item)
            if hasattr(inner, "eqns"):
                yield inner


def _outside_switches(jaxpr):
    """The equations of `jaxpr`, with those inside its `jit` calls (e.g. `lax` slicing
    helpers) in their place; conditionals and loops are not entered."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("jit", "pjit"):
            yield from _outside_switches(eqn.params["jaxpr"].jaxpr)
        else:
            yield eqn


def _find(jaxpr, primitive, **params):
    """First equation of `primitive` (with these param values), depth first."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == primitive and all(eqn.params.get(k) == v
                                                   for k, v in params.items()):
            return eqn
        for sub in _sub_jaxprs(eqn):
            found = _find(sub, primitive, **params)
            if found is not None:
                return found
    return None


def _traced_tick(cfg):
    """(step jaxpr, program, tick-loop body jaxpr) of a config's loss-and-grads, traced."""
    model = GPT.from_config(cfg.model)
    loss_and_grads = assemble(cfg, model=model).loss_and_grads()
    params = jax.eval_shape(model.init, jax.random.key(0))
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in np_batch(cfg).items()}
    closed = jax.make_jaxpr(loss_and_grads)(params, batch)
    program = loss_and_grads.program
    tick = _find(closed.jaxpr, "scan", length=program.ticks).params["jaxpr"].jaxpr
    return closed.jaxpr, program, tick


def test_a_tick_runs_its_action_through_two_switches():
    """Idle ticks are cheap: all model work of a tick sits in the branches of two switches on
    the table's branch. The first runs the actions that fill no residual pool and only reads
    the pools; the second runs the actions that fill one and updates their slots in place
    (its other branches pass the pools through). No residual pool is written anywhere
    else."""
    _, program, tick = _traced_tick(pipeline_cfg("zb-h1", 4, 2, 1, 4))
    outside = [e.primitive.name for e in tick.eqns]
    # On the CPU devices one all-gather over pp carries both rings' transfers.
    assert outside.count("all_gather") == 1 and "ppermute" not in outside
    assert "dot_general" not in outside and "scan" not in outside
    # Outside a conditional only the arrivals are filed (into the activation pool); no
    # residual pool is updated there (that would move its slot bytes every tick, whatever
    # the action).
    arrival = {tuple(e.invars[0].aval.shape) for e in tick.eqns
               if e.primitive.name == "all_gather"}
    written = {tuple(e.invars[0].aval.shape)[1:] for e in _outside_switches(tick)
               if e.primitive.name in ("scatter", "dynamic_update_slice")}
    assert written and written <= arrival, (written, arrival)
    plain, filing = [e.params["branches"] for e in tick.eqns if e.primitive.name == "cond"]
    assert len(plain) == len(filing) == 1 + len(program.branches)
    fills = [any(flags[b] for flags in (program.fills(name)
                                         for name in tick_program.RESIDUAL_POOLS))
             for b in range(len(plain))]
    assert any(fills) and not all(fills[1:])
    for b, (run, file) in enumerate(zip(plain, filing)):
        run, file = _primitives(run.jaxpr), _primitives(file.jaxpr)
        # Each action computes in exactly one switch (the idle branch in neither); only the
        # filling side writes a slot.
        assert ("dot_general" in run) == (b != tick_program.IDLE and not fills[b]), b
        assert ("dot_general" in file) == fills[b], b
        assert ("dynamic_update_slice" in file) == fills[b], b
        assert "dynamic_update_slice" not in run, b


def _switch_branches(tick):
    """The branches of the tick's action switch (the first conditional; the others file
    residuals into their pools)."""
    return [e for e in tick.eqns if e.primitive.name == "cond"][0].params["branches"]


def test_in_loop_buckets_reduce_in_each_chunks_last_backward():
    """With buckets, the dp psums sit in the sync branches only (one per stage and chunk),
    and no block gradient is reduced after the loop."""
    cfg = pipeline_cfg("interleaved", 2, 2, 2, 4, extra=["overlap.grad_bucket_mb=0.01"])
    jaxpr, program, tick = _traced_tick(cfg)
    branches = _switch_branches(tick)
    syncs = [b for b in program.branches if b.sync]
    assert {(b.kind, b.role) for b in syncs} == {("B", "first"), ("B", "mid"), ("B", "last")}
    # Each (stage, chunk) runs its sync action exactly once per step.
    column = program.column("branch")
    sync_ids = [i + 1 for i, b in enumerate(program.branches) if b.sync]
    assert int(np.isin(column, sync_ids).sum()) == 2 * 2  # stages x chunks
    freqs = Ticks.of_program(program).frequencies(0)  # one lane
    assert sum(freqs) == pytest.approx(1.0)
    assert freqs[tick_program.IDLE] == pytest.approx(program.idle_fraction())
    for b, branch in zip(program.branches, branches[1:]):
        n_dp = len(_dp_sums(branch.jaxpr))
        assert (n_dp >= 2) if b.sync else (n_dp == 0), (b, n_dp)  # sync: one per bucket
    # After the loop only the embedding and head are reduced over dp: every dp sum outside
    # the tick loop is far smaller than the blocks.
    blocks_elems = sum(np.prod(x.shape) for x in jax.tree.leaves(
        jax.eval_shape(GPT.from_config(cfg.model).init, jax.random.key(0))["blocks"]))
    scan = _find(jaxpr, "scan", length=program.ticks)
    outside = _dp_sums(jaxpr, skip=scan)
    assert outside and all(n < blocks_elems // 4 for n in outside), outside


def _dp_sums(jaxpr, skip=None) -> list[int]:
    """Element counts of every sum over 'dp' in `jaxpr` (not descending into `skip`)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn is skip:
            continue
        if eqn.primitive.name.startswith("psum") and "dp" in tuple(eqn.params.get("axes", ())):
            found.append(int(sum(np.prod(v.aval.shape) for v in eqn.invars)))
        for sub in _sub_jaxprs(eqn):
            found += _dp_sums(sub, skip)
    return found


# ----------------------------------------------------------------------- training


def _curve(cfg, tmp_path, name):
    devices = jax.devices()[: cfg.num_devices]
    return train.run(cfg, str(tmp_path / name), progress=False, devices=devices).losses


@pytest.fixture(scope="module")
def flat_curve(tmp_path_factory):
    cfg = config.load(TINY, ["mesh.dp=2", "mesh.tp=1", f"model.layers={LAYERS}"])
    return _curve(cfg, tmp_path_factory.mktemp("flat"), "pp1")


def test_training_curve_matches_pp1(flat_curve, tmp_path):
    losses = _curve(pipeline_cfg("interleaved", 4, 2, 1, 4), tmp_path, "interleaved")
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert max(rel(a, b) for a, b in zip(losses, flat_curve)) <= 1e-4, (losses, flat_curve)


def test_paired_training_curve_matches_pp1(flat_curve, tmp_path):
    cfg = pipeline_cfg("zb-v", 4, 2, 1, 8, extra=["pipeline.paired=true", "model.remat=full"])
    losses = _curve(cfg, tmp_path, "zb-v-paired")
    assert max(rel(a, b) for a, b in zip(losses, flat_curve)) <= 1e-4, (losses, flat_curve)


# Every schedule x remat policy, paired ticks on every other one.
CURVE_SWEEP = [(name, remat, i % 2 == 1) for i, (name, remat) in enumerate(
    (name, remat) for name in ["gpipe", "1f1b", "zb-h1", "zb-v"]
    for remat in ("none", "full", "save_dots"))]


@pytest.mark.slow
@pytest.mark.parametrize("name,remat,paired", CURVE_SWEEP)
def test_training_curve_matches_pp1_sweep(flat_curve, tmp_path, name, remat, paired):
    cfg = pipeline_cfg(name, 4, 1, 2, 8, tied=True, extra=[
        f"model.remat={remat}", f"pipeline.paired={str(paired).lower()}"])
    losses = _curve(cfg, tmp_path, name)
    assert max(rel(a, b) for a, b in zip(losses, flat_curve)) <= 1e-4, (losses, flat_curve)


# Vocabulary-parallel head (`pipeline.vocab_parallel`): every stage computes 1/pp of the
# logits at the last virtual stage's F tick. Default run: the V placement (head on stage 0),
# a linear one with TP and a paired, split table with a remat policy; the sweep: every
# schedule x mesh, plain, paired and latency 2, and the overlap options.
VOCAB_CASES = [
    ("zb-v", 4, 2, 1, 4, True, ()),
    ("1f1b", 2, 2, 2, 4, False, ()),
    ("zb-h1", 4, 2, 1, 8, True, ("pipeline.paired=true", "model.remat=save_dots")),
]
VOCAB_SWEEP = [(name, pp, dp, tp, m, tied, extra)
               for (name, pp, dp, tp, m, tied, _) in schedule_sweep(
                   [(4, 2, 1), (2, 2, 2), (2, 4, 1)], policies=("none",))
               for extra in ((), ("pipeline.paired=true",), ("pipeline.transfer_latency=2",))]
VOCAB_OPTIONS = [(*case[:6], ("pipeline.vocab_parallel=true", *case[6])) for case in OPTION_CASES]
VOCAB_OPTIONS += [
    ("zb-v", 2, 2, 2, 4, True, ("overlap.tp_comm=sequence_parallel",)),
    ("zb-h1", 4, 2, 1, 4, True, ("pipeline.stage_layers=[3,2,2,1]",)),
]


def check_vocab_parallel(references, name, pp, dp, tp, m, tied, extra):
    extra = ["pipeline.vocab_parallel=true", *extra]
    program = plan_for(pipeline_cfg(name, pp, dp, tp, m, tied, extra)).program
    assert program.vocab_parallel
    assert all(b.role != "last" for b in program.branches)  # no stage runs the whole head
    # One head phase per microbatch, each at the tick of the last virtual stage's F.
    flags = program.column("head_mb")[:, 0, 0]
    assert sorted(flags[flags > 0].tolist()) == list(range(1, m + 1))
    check_equivalence(references, name, pp, dp, tp, m, tied, extra)


@pytest.mark.parametrize("name,pp,dp,tp,m,tied,extra", VOCAB_CASES)
def test_vocab_parallel_head_matches_single_device(references, name, pp, dp, tp, m, tied,
                                                   extra):
    check_vocab_parallel(references, name, pp, dp, tp, m, tied, extra)


@pytest.mark.slow
@pytest.mark.parametrize("name,pp,dp,tp,m,tied,extra", VOCAB_SWEEP + VOCAB_OPTIONS)
def test_vocab_parallel_head_matches_single_device_sweep(references, name, pp, dp, tp, m, tied,
                                                         extra):
    check_vocab_parallel(references, name, pp, dp, tp, m, tied, extra)


def test_vocab_parallel_training_curve_matches_pp1(flat_curve, tmp_path):
    """Training with the head split over the stages, through the skewed loop, follows pp=1."""
    cfg = pipeline_cfg("zb-v", 4, 2, 1, 4, extra=["pipeline.vocab_parallel=true",
                                                  "pipeline.transfer_latency=2"])
    losses = _curve(cfg, tmp_path, "zb-v-vocab")
    assert max(rel(a, b) for a, b in zip(losses, flat_curve)) <= 1e-4, (losses, flat_curve)


# The step a GPU plan builds, run on the CPU devices: the plan's GPU choices apply (paired
# ticks, the vocabulary-parallel head split around the backward lane, split W, in-loop
# buckets). Attention stays the einsum path: cuDNN's fused kernel runs on GPUs only.
GPU_PLANNED = [("zb-v", 2, 2, 1, 4, True), ("1f1b", 4, 2, 1, 4, True),
               # unpaired: per-tick rings (`TickProgram.patterns`) and the slack ring
               ("zb-v", 4, 2, 1, 4, True, ["pipeline.paired=false"]),
               ("zb-h1", 4, 2, 1, 8, False, ["pipeline.paired=false"]),
               pytest.param(("1f1b", 4, 2, 1, 8, False, ["pipeline.paired=false"]),
                            marks=pytest.mark.slow),
               pytest.param(("interleaved", 4, 2, 1, 8, True, ["pipeline.paired=false"]),
                            marks=pytest.mark.slow),
               # both lanes in one switch (`pipeline.fused_pairs`): the deferred last tick,
               # and a zero-bubble table's B / W pairs filing the dz pool beside F's chunk pool
               ("1f1b", 4, 2, 1, 4, True, ["pipeline.fused_pairs=true"]),
               ("zb-v", 2, 2, 1, 4, True, ["pipeline.fused_pairs=true"]),
               # sequence parallel inside the stages (fused pairs: tp > 1), the last tick's
               # embedding deferred
               pytest.param(("1f1b", 2, 2, 2, 4, True), marks=pytest.mark.slow),
               pytest.param(("1f1b", 2, 2, 2, 4, True, ["overlap.sp_split=sequence"]),
                            marks=pytest.mark.slow),
               # the split W's last weight matmuls replayed on tp-varying weights (in-loop
               # buckets), grouped collective matmul with its barriered backward sum
               pytest.param(("zb-h1", 2, 2, 2, 4, True, ["overlap.tp_comm=collective_matmul"]),
                            marks=pytest.mark.slow)]


@pytest.mark.parametrize("case", GPU_PLANNED)
def test_a_gpu_planned_pipeline_matches_single_device(references, case, monkeypatch):
    """Also the unpaired tick's per-tick rings and slack ring (the CPU plan's tick all-gathers
    instead), and paired 1F1B's last tick run after the loop, its embedding's gradient reduced
    sparsely after it (`tick_loop.DeferredEmbedding`)."""
    from jax_overlap.pipeline import executor, tick_loop
    from jax_overlap.plan import Target

    name, pp, dp, tp, m, tied, *extra = case
    extra = extra[0] if extra else []
    cfg = pipeline_cfg(name, pp, dp, tp, m, tied, ["model.attention=plain", *extra])
    model, params, batch, ref_loss, ref_grads = references(tied)
    run = assemble(cfg, jax.devices()[: dp * pp * tp], target=Target("h100", True, 80e9),
                   model=model)
    assert run.plan.vocab_parallel and run.plan.schedule.paired == ("pipeline.paired=false"
                                                                   not in extra)
    program = run.plan.program
    assert program.fused == (tp > 1 or "pipeline.fused_pairs=true" in extra)
    assert program.tick_rings == ("pipeline.paired=false" in extra)
    # ZB-H1 and interleaved send what they read two or more ticks later on the slack ring.
    assert (program.slack_pairs != ((), ())) == (program.tick_rings
                                                 and name in ("zb-h1", "interleaved"))
    # Sequence parallel at tp = 2: a tick with one action runs it as collective matmul.
    lone = tp == 2 and run.plan.overlap.tp_comm == "sequence_parallel"
    assert (run.plan.overlap.lone_tp_comm == "collective_matmul") == lone
    # At tp = 2 (sequence parallel, or grouped collective matmul) the rows are whole
    # sequences unless told otherwise.
    assert run.plan.overlap.sp_split == ("batch" if tp == 2 and "overlap.sp_split=sequence"
                                         not in extra else "sequence")
    contexts = []
    monkeypatch.setattr(executor, "_lone_context", lambda *a, _f=executor._lone_context: (
        contexts.append(_f(*a)) or contexts[-1]))
    deferred = tick_loop.deferred_embedding(model, program, True,
                                            any(b.sync for b in program.branches),
                                            run.plan.overlap, dict(run.mesh.shape))
    assert (deferred is not None) == (name == "1f1b" and not program.tick_rings)
    loss, grads = jax.jit(run.loss_and_grads())(run.place_params(params),
                                                run.put_batch(batch))
    assert [c is not None for c in contexts] == [lone]
    assert rel(float(loss), ref_loss) <= 1e-5, (float(loss), ref_loss)
    assert max_rel_err(layout.to_logical(grads, run.plan.layer_perm), ref_grads) <= 1e-5


@pytest.mark.parametrize("name,pp,m", [
    ("zb-v", 2, 4), pytest.param("zb-h1", 4, 8, marks=pytest.mark.slow)])
def test_a_gpu_planned_filled_table_matches_single_device(references, name, pp, m):
    """The GPU step (pools filed in place, vocabulary-parallel head, split W) running a filled
    paired table: W's in lane 0 beside B's and W+W ticks, as chosen at the paper's costs."""
    from jax_overlap.plan import Target

    dp, tp, tied = 2, 1, True
    table = schedules.filled_schedule(name, pp, m, None, {"F": 14.4, "B": 14.4, "W": 9.7},
                                      1.6)[0]
    assert any(isinstance(c, schedules.Pair) and c.forward.kind == "W"
               for row in table.grid for c in row)
    cfg = pipeline_cfg(name, pp, dp, tp, m, tied, ["model.attention=plain"])
    model, params, batch, ref_loss, ref_grads = references(tied)
    run = assemble(cfg, jax.devices()[: dp * pp * tp], target=Target("h100", True, 80e9),
                   model=model)
    assert run.plan.vocab_parallel and run.plan.schedule.paired
    _check_table(run, table, params, batch, ref_loss, ref_grads)


def _casts(jaxpr, shapes):
    """The fp32 -> bf16 casts in `jaxpr` (recursing) whose operand has one of `shapes`."""
    found = []
    for eqn in jaxpr.eqns:
        if (eqn.primitive.name == "convert_element_type"
                and eqn.invars[0].aval.dtype == np.float32
                and eqn.params["new_dtype"] == jax.numpy.bfloat16
                and tuple(eqn.invars[0].aval.shape) in shapes):
            found.append(eqn)
        for sub in _sub_jaxprs(eqn):
            found += _casts(sub, shapes)
    return found


def test_bf16_weights_are_cast_once_per_step_not_in_the_tick_loop():
    """Under bf16 the block's weight matrices, which it only reads cast to bf16, are cast
    once before the tick loop (`executor._compute_blocks`); no action casts one again."""
    cfg = pipeline_cfg("1f1b", 2, 4, 1, 4, extra=["train.precision=bf16"])
    step, _, tick = _traced_tick(cfg)
    blocks = jax.eval_shape(GPT.from_config(cfg.model).init, jax.random.key(0))["blocks"]
    weights = {tuple(w.shape[1:]) for w in jax.tree.leaves(blocks) if w.ndim >= 3}
    assert weights and not _casts(tick, weights)
    # ... cast before it: the stage's stacked (chunks, layers, ...) matrices.
    stacked = {(1, LAYERS // 2, *s) for s in weights}
    assert {tuple(e.invars[0].aval.shape) for e in _casts(step, stacked)} == stacked


@pytest.mark.parametrize("name,extra", [
    ("zb-h1", []),                                    # split W: weight matmuls on stashed operands
    ("1f1b", ["overlap.grad_bucket_mb=0.001"]),       # in-loop buckets: sync actions
])
def test_bf16_cast_once_gives_the_gradients_of_casting_at_every_use(monkeypatch, name, extra):
    """Casting the weights once per step changes no number: the actions see the same bf16
    values, and the bf16 weight gradients widen into the same fp32 accumulators."""
    from jax_overlap.pipeline import executor

    cfg = pipeline_cfg(name, 2, 2, 2, 4, extra=["train.precision=bf16", *extra])
    model = GPT.from_config(cfg.model)
    params = model.init(jax.random.key(0))
    batch = np_batch(cfg)

    def run():
        r = assemble(cfg, jax.devices()[:8], model=model)
        loss, grads = jax.jit(r.loss_and_grads())(r.place_params(params), r.put_batch(batch))
        return float(loss), layout.to_logical(grads, r.plan.layer_perm)

    loss, grads = run()
    monkeypatch.setattr(executor, "_compute_blocks", lambda model, par, blocks, x: blocks)
    loss_every, grads_every = run()
    assert rel(loss, loss_every) <= 1e-6
    assert max_rel_err(grads, grads_every) <= 1e-6
