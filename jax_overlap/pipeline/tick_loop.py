"""The tick loop: runs a compiled schedule table (`TickProgram`) as `lax.scan`s over ticks,
each stage switching to its action and the stages trading activations and gradients
over the 'pp' ring.

A paired table on an accelerator runs as three scans, over the fill, the steady state
and the drain (`TickProgram.spans`): the fill's loop has no backward lane, ring or head
all-reduce and the drain's no forward ring, so a collective that would carry only zeros
there is not compiled.

Communication: a stage sends at most one tensor per tick -- an activation to the next virtual
stage (F) or an input gradient to the previous one (B). Neighbours are at +1 or -1 on the
'pp' ring (interleaved wraps from the last stage to the first for the next chunk; ZB-V's
chunk 1 runs up the stages, so its activations go to -1 and its gradients to +1), or on the
same stage (ZB-V's turn at the bottom). So every tick ends with two `ppermute`s, one per ring
direction (one when p = 2: both neighbours are the same stage), carrying this tick's output;
the receiver's table knows statically which arrival is meaningful and for which
(microbatch, chunk).

Double buffering: the `ppermute` results land in inboxes carried by the scan, separate from
the stash slots actions read, and are filed into slots at the start of the next tick. So a
transfer in flight never aliases a slot that an action is reading, the two rings' transfers
are independent of each other, and what is sent at tick t is readable from tick t+1 on --
exactly the schedules' time model. That model lets a neighbour consume at t+1 what was sent
at t, so in an unpaired table at latency 1 such a transfer lies between two ticks on the
critical path (as the p2p between Megatron's stages does). On a CPU every tick's arrivals are
filed into the pool before the next action reads it, whichever tick consumes them. Paired
lanes and latency 2 (below) put the transfers under compute.

Per-tick rings (an unpaired latency-1 table on an accelerator: `TickProgram.tick_rings`,
`rendezvous_tick`): a tick's output goes on a switch over the table's ring patterns whose
branch permutes only the pairs trading at that tick, so a permute meets only the stages
that move data: a stage with nothing to send or receive runs on without waiting for its
neighbours' actions. Where the table reads many transfers two or more ticks after they were
sent (ZB-H1, interleaved: `ticks.tick_transfers`), those go on a slack ring instead, issued at
the top of the next tick with fixed pairs: in flight under that tick's action, filed after it.

Skewed loop (`pipeline.transfer_latency: 2`): tick t sends tick t-1's output, at the top of
the loop body, and files what arrives at the end, after the tick's action. Neither the
transfers nor the action read the other's result, so the collective-permutes can be in
flight for the whole tick's `conditional`: its GEMMs run while the activations travel. The
tables are generated for that latency (a consumer on another stage runs two ticks after its
producer), which lengthens the ramp. Both rings' permutes are then in flight at once, which
needs the `gpu_overlap` preset's parallel-collective limit of 2. What XLA's GPU scheduler
did with this loop, per jaxlib version: `docs/design/xla_notes.md`.

Vocabulary-parallel head (`pipeline.vocab_parallel`, `TickProgram.vocab_parallel`): the last
virtual stage's F ends at its chunk's output instead. At that tick, after the forward lane
(a paired tick: after the backward lane, see `paired_tick`), every stage runs the head phase
(`lax.cond` on a flag every stage reads alike): the output is
broadcast over 'pp' (a psum of it masked to its stage), each stage computes the logits of
its 1/pp of the vocabulary and the loss from statistics reduced over 'pp'
(`collectives.vocab_cross_entropy`), pulls back at once, and the output's gradient (the
stages' partial sums, psum'd over 'pp') is filed into a stash slot of the F's stage, where
the chunk's B reads it as if a next stage had sent it. Each stage's head gradient covers its
vocabulary columns only; the sum over 'pp' after the loop
(`executor.reduce_step_grads`) completes it.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_overlap.parallel.compat import all_gather_invariant
from jax_overlap.parallel.compat import varying_axes as _varying_axes
from jax_overlap.parallel.mesh import DCN, DP, PP
from jax_overlap.pipeline.actions import StepContext, accumulate
from jax_overlap.pipeline.program import (COL, HEAD_SCOPE, LANE_SCOPE, LAST_TICK_SCOPE,
                                          RING_SCOPE, SPAN_SCOPE, TickProgram, TickSpan)
from jax_overlap.pipeline.slots import at, like, set_at, vary


def _ring(out_btd, pairs, zeros_btd):
    """One ppermute on the pp ring (`pairs`: the (src, dst) stages that carry data)."""
    if not pairs:
        return zeros_btd
    return jax.lax.ppermute(out_btd, PP, perm=list(pairs))  # (b, T, D) per device, over pp


def _file(pool, row, route: str, arrival):
    """Files an arrival into the slot the table names (`trash` when nothing came)."""
    return set_at(pool, row[COL["file_" + route]], arrival)


class DeferredEmbedding(NamedTuple):
    """How a paired step ends whose last tick runs only virtual stage 0's last backward
    (`deferred_embedding`; `_TickLoop.last_tick`).

    Attributes:
      branches: the last tick's branches: that backward's (`sync_branch(defer_embed=True)`)
        hands on its embedding's activation gradient instead of adding its gradients.
      microbatch: the microbatch it runs.
      embed: the embedding's parameters as the step got them (invariant over pp and dp).
    """

    branches: list
    microbatch: int
    embed: Any


def deferred_embedding(model, program: TickProgram, accelerator: bool, synced: bool, overlap,
                       axis_sizes: dict[str, int]) -> tuple[int, int] | None:
    """(branch, microbatch) of the last tick's one action if the step can defer its
    embedding's reduction under that tick (`_TickLoop.last_tick`), else None.

    It can on an accelerator (where the all-reduce runs under the tick's GEMMs), for a paired
    table whose blocks are reduced in the loop (then the embedding and head are what is left
    for after it: one fp32 psum over (pp, dp), no slow axis) and whose last tick runs one
    action, virtual stage 0's last (sync) B, and no head: 1F1B, paired. The model's
    embedding must declare `per_example_embedding` (a decoder's token lookup does; a batch
    norm's statistics would differ for the gathered replicas' inputs).
    """
    if not (accelerator and synced and program.lanes == 2 and overlap.grad_comm_dtype == "fp32"
            and axis_sizes.get(DCN, 1) == 1 and getattr(model, "per_example_embedding", False)):
        return None
    last = program.table[-1]
    busy = np.argwhere(last[..., COL["branch"]] > 0)
    if len(busy) != 1 or last[..., COL["head_mb"]].any():
        return None
    stage, lane = busy[0]
    b = int(last[stage, lane, COL["branch"]])
    branch = program.branches[b - 1]
    if (branch.kind, branch.role, branch.sync) != ("B", "first", True):
        return None
    return b, int(last[stage, lane, COL["microbatch"]])


def run_ticks(ctx: StepContext, program: TickProgram, branches: list, pool_sbtd, res0: dict,
              accelerator: bool = True, deferred: DeferredEmbedding | None = None,
              lone_branches: list | None = None):
    """The tick loop: a `lax.scan` over the table, each stage switching to its action.

    Latency 1: a tick files last tick's arrivals, runs its action and sends its output (on an
    accelerator: on that tick's ring pattern, and what is read later on the slack ring at
    the top of the next tick, under its action: `_TickLoop.rendezvous_tick`).
    Latency 2 (skewed): a tick sends the previous tick's output before its action and files
    the arrivals after it, so the transfers run under the action.
    Paired (two lanes): each lane runs as a skewed half-tick -- the other lane's last output
    is sent before the action and filed after it -- so every transfer runs under the other
    lane's compute at latency 1. Fused pairs (`TickProgram.fused`): both lanes' actions in
    one switch, so each one's collectives run under the other's GEMMs, and the transfers
    between ticks (`_TickLoop.fused_tick`).

    The residual pools and gradient accumulators are updated in place through the tick's
    switches; XLA keeps them in place only with copy insertion's region analysis
    (`plan.PIPELINE_COPY_ANALYSIS`, which the plan's compile options and the forced host
    platform set), and otherwise copies them every tick.

    `accelerator`: the collectives run asynchronously; a paired tick then splits a
    vocabulary-parallel head around its backward lane (`_TickLoop.paired_tick`).
    `deferred`: the last tick runs apart, its embedding's reduction deferred
    (`_TickLoop.last_tick`).
    `lone_branches`: a fused program's branches for the ticks that run one action, in the
    lone context (`executor._lone_context`, `overlap.lone_tp_comm`); None runs them as the pairs.

    Returns:
      (grads, loss, ends): grads and loss accumulated over the step on this device; `ends`
      None, or with `deferred` the embedding's and head's gradients summed over (pp, dp).
    """
    return _TickLoop(ctx, program, branches, res0, accelerator, deferred,
                     lone_branches).run(pool_sbtd)


# A fused tick's vocabulary-parallel head at tp > 1 runs in this many parts of its
# microbatch, so one part's all-gather / reduce-scatter over tp runs under another part's
# GEMMs (GPT-1.3B pp2 x dp2 x tp2 interleaved fused, deviceless 8 x H100: collective bytes
# under GEMMs 0.696 -> 0.721, estimated step 1208.0 -> 1205.8 ms; 4 parts: 0.721, 1210.1 ms;
# steps from before the estimate counted async reduce-scatters as communication).
HEAD_HALVES = 2


class _TickLoop:
    """`run_ticks`'s loop: the per-lane switches, built once, and one tick of each kind."""

    def __init__(self, ctx: StepContext, program: TickProgram, branches: list, res0: dict,
                 accelerator: bool = True, deferred: DeferredEmbedding | None = None,
                 lone_branches: list | None = None):
        self.ctx, self.program = ctx, program
        self.stage = jax.lax.axis_index(PP)
        self.zeros = ctx.zeros_btd
        # A pool is filed at a slot the stage's table row names, so what an action files varies
        # over pp even where the pool's initial zeros do not: typed so from the start, the
        # filing switch's branches (and the scan's carry) agree. Over no other axis: a
        # residual the vjp kept invariant over dp (a batch norm's statistics, summed over dp)
        # must come back invariant, or its pullback's types no longer match.
        res0 = jax.tree.map(lambda p: vary(p, [PP]), res0)
        # Per lane, the branches its table column takes, and whether any of them adds to the
        # gradients (a paired lane of only F's does not: its switches then neither take nor
        # return the accumulators, which XLA would otherwise copy in every branch). A W runs
        # in whichever lane its pair puts it: lane 0 of a zero-bubble table then adds too.
        self.fills = {name: program.fills(name) for name in res0}
        self.adds = [False] + [b.kind != "F" for b in program.branches]
        self.branches, self.lone_branches = branches, lone_branches
        self.lanes = self.switches(branches, slice(None), lone_branches)
        # The last tick's switches, when it runs apart (`last_tick`): only its own branches,
        # in the step's context (the lone context cost GPT-1.3B pp2 x dp2 x tp2 4 ms there:
        # the embedding's reduction already runs under that tick).
        self.deferred = deferred
        self.last_lanes = (None if deferred is None
                           else self.switches(deferred.branches, slice(-1, None)))
        self.res0 = res0
        # A paired tick splits the vocabulary-parallel head around its backward lane where
        # collectives run asynchronously (an accelerator's program).
        self.split_head = (program.vocab_parallel and program.lanes == 2 and accelerator
                           and not program.fused)
        # A split head's pending gradient where the last tick had no head: zeros, for the
        # trash slot (typed like a row's slot: varying over pp).
        self.no_head = ()
        if self.split_head:
            row0 = at(jnp.asarray(program.table[0]), self.stage)[0]
            self.no_head = (self.zeros, jnp.full_like(row0[COL["head_slot"]], program.trash))
        self.accelerator = accelerator
        # A fused tick's head runs after its switch, with nothing else to hide its TP
        # collectives under: in two halves of the microbatch, each half's under the other's
        # GEMMs (`HEAD_HALVES`).
        self.head_halves = program.fused and accelerator and ctx.par.tp > 1

    def switches(self, branches, rows, lone_branches=None) -> list:
        """Per lane, its switches over the branches `rows` of the table take (the others
        no-ops); fused, one switch over the (lane 0, lane 1) pairs they take."""
        ctx, program = self.ctx, self.program
        if program.fused:
            pairs, index = program.lane_pairs
            return [_pair_switch(ctx, branches, self.fills, pairs,
                                 set(index[rows].ravel().tolist()), self.adds, lone_branches)]
        out = []
        for lane in range(program.lanes):
            taken = set(np.unique(program.column("branch")[rows][..., lane]).tolist())
            out.append(_lane_switches(ctx, branches, self.fills, taken,
                                      any(self.adds[b] for b in taken)))
        return out

    def head_phase(self, pool, grads, loss, out, rows, row):
        # Vocabulary-parallel head (see the module docstring), all of it at once and only on
        # a tick that has a head: the output's psum, the head's pull-back and the gradient's
        # psum, inside one cond, filed into the F's stage's slot. (A paired tick on an
        # accelerator splits it around its backward lane: `paired_tick`.)
        if not self.program.vocab_parallel:
            return pool, grads, loss
        dy, grads, loss = self.head_pullback(lambda: self.head_input(out, row), grads, loss,
                                             rows, row, summed=True)
        return set_at(pool, row[COL["head_slot"]], dy), grads, loss

    def head_input(self, out, row):
        # The last virtual stage's output, broadcast over pp (a psum of it masked to the
        # stage whose F made it: `head_slot` is `trash` on every other stage).
        mine = row[COL["head_slot"]] != self.program.trash
        return like(jax.lax.psum(jnp.where(mine, out, jnp.zeros_like(out)), PP), self.zeros)

    def head_gradient(self, dy):
        # The output's gradient: the stages' partial sums (`head_pullback`), over pp.
        return like(jax.lax.psum(dy, PP), self.zeros)

    def head_pullback(self, y_of: Callable, grads, loss, rows, row, summed: bool = False):
        # This stage's vocabulary shard of the head on the broadcast output `y_of()`: its
        # loss, its head gradients, and its partial sum of the output's gradient (the sum
        # over pp if `summed`; zeros where the tick has no head). `y_of` and the sum run
        # inside the cond, so a tick without a head runs neither collective. The flag is
        # read from stage 0's row (every stage's says the same), so it is pp-invariant and
        # every stage takes the same side of the cond: the collectives inside meet. Only the
        # head's accumulators go through the cond (the pool and the blocks' stay outside it,
        # so nothing large is handed to a conditional that might copy it).
        mb1 = rows[0, 0, COL["head_mb"]]
        mine = row[COL["head_slot"]] != self.program.trash
        acc = {k: grads[k] for k in ("embed", "head")}

        def run(acc, loss):
            w = self.ctx.params
            y, targets = y_of(), self.ctx.targets_mbt[mb1 - 1]
            halves = HEAD_HALVES if self.head_halves and y.shape[0] % HEAD_HALVES == 0 else 1
            part, d_embed, d_head, dys = 0.0, None, None, []
            for y_h, t_h in zip(jnp.split(y, halves), jnp.split(targets, halves)):
                part_h, pull = jax.vjp(
                    lambda we, wh, y_, t_=t_h: self.ctx.pieces.head(we, wh, y_, t_),
                    w["embed"], w["head"], y_h)
                d_e, d_h, dy_h = pull(jnp.ones_like(part_h))
                part, dys = part + part_h, dys + [dy_h]
                d_embed = d_e if d_embed is None else jax.tree.map(jnp.add, d_embed, d_e)
                d_head = d_h if d_head is None else jax.tree.map(jnp.add, d_head, d_h)
            dy = jnp.concatenate(dys) if halves > 1 else dys[0]
            acc = accumulate(acc, {"embed": d_embed, "head": d_head}, None, blocks=False)
            loss = loss + jnp.where(mine, part, jnp.zeros_like(part))
            dy = self.head_gradient(dy) if summed else like(dy, self.zeros)
            return dy, like(acc, {k: self.ctx.grads0[k] for k in acc}), like(loss, self.ctx.loss0)

        with jax.named_scope(HEAD_SCOPE):
            dy, acc, loss = jax.lax.cond(mb1 > 0, run, lambda acc, loss: (self.zeros, acc, loss),
                                         acc, loss)
        return dy, {**grads, **acc}, loss

    def slots(self, pool, row):
        # The two slots an action can read: its input and its output gradient.
        return {"x": at(pool, row[COL["x_slot"]]), "g": at(pool, row[COL["g_slot"]])}

    def read_inbox(self, pool, row):
        # The action's slots, tied to the pool that holds them: arrivals filed into the pool
        # after this point then update it in place. Without the tie nothing orders these
        # reads before those writes, and XLA copies the whole pool every tick.
        return jax.lax.optimization_barrier((pool, self.slots(pool, row)))

    def act(self, pool, res, grads, loss, row, inbox=None, tie=None, lane=0, lanes=None):
        # Two switches on the row's branch. The first runs the actions that file
        # nothing into a residual pool (idle, B without a split, W...) and gets the pools
        # read-only: a branch reads its (microbatch, chunk)'s slots itself, so only the
        # actions that use a slot read it. The second runs the actions that fill pools (F; a
        # split B) and gets the pools this lane fills, to update in place at the slots the
        # table names; its other branches pass them through untouched. So no action moves
        # pool data it does not own, and nothing is made for an idle branch to copy. (One
        # switch that returned what an action made, or zeros, cost a slot-sized write per
        # idle branch; one that updated every pool in place made XLA copy each pool in every
        # branch.)
        # Likewise the activation pool: the switches get only the two slots an action can
        # read (its input and its output gradient). Handed the pool, they would hold it as
        # an operand while the other lane's arrivals are filed into it, and XLA would copy it.
        switches = (lanes or self.lanes)[lane]
        branch = row[COL["branch"]]
        if inbox is None:
            inbox = self.slots(pool, row)
        carry = (grads, loss) if switches.grads else (loss,)
        # The named scope marks the switches in the compiled HLO for `analysis.step_estimate`.
        with jax.named_scope(f"{LANE_SCOPE}{lane}"):
            carry, out = jax.lax.switch(branch, switches.plain, inbox, res, carry, row)
            kept = {name: res[name] for name in switches.pools}
            if kept:
                # The pools go to the filing switch through the plain switch's results: its
                # reads (W reads the stash F and B filled) are then ordered before the
                # in-place writes. XLA drops a switch's pass-through operands, and without
                # this tie the two switches were unordered and each pool the plain one reads
                # was copied every tick.
                kept, carry, out = jax.lax.optimization_barrier((kept, carry, out))
                read_only = {name: p for name, p in res.items() if name not in kept}
                kept, carry, out = jax.lax.switch(branch, switches.filing, inbox, read_only,
                                                  kept, carry, out, row)
        res = {**res, **kept}
        grads, loss = carry if switches.grads else (grads, carry[0])
        if tie is None:
            return res, grads, loss, out
        # Transfers that must be under this action: nothing that reads them may run before
        # the action's results exist, so their only cover is the action itself (not the slot
        # writes after it, which XLA's cost model would count as enough). One of the
        # switches' results suffices (it has them all at once); tied, the gradient
        # accumulators would be copied in every branch that hands them on.
        out, tie = jax.lax.optimization_barrier((out, tie))
        return res, grads, loss, out, tie

    def tick(self, carry, rows):
        pool, res, inbox_down, inbox_up, inbox_self, grads, loss = carry
        row = at(rows, self.stage)[0]
        # File last tick's arrivals.
        if self.program.down_pairs:
            pool = _file(pool, row, "down", inbox_down)
        if self.program.up_pairs:  # with 2 stages both neighbours are +1: one ring suffices
            pool = _file(pool, row, "up", inbox_up)
        if self.program.local_handoff:
            pool = _file(pool, row, "self", inbox_self)
        res, grads, loss, out = self.act(pool, res, grads, loss, row)
        pool, grads, loss = self.head_phase(pool, grads, loss, out, rows, row)
        inbox_down, inbox_up = self.rings(out, self.program.down_pairs, self.program.up_pairs)
        inbox_self = out if self.program.local_handoff else inbox_self
        return (pool, res, inbox_down, inbox_up, inbox_self, grads, loss), None

    def rings(self, out, down_pairs, up_pairs):
        """(what arrives from the -1 neighbour, from the +1 neighbour): `out` sent on both
        rings. On an accelerator, one asynchronous ppermute per ring. On a CPU every
        collective is a rendezvous of all the host's device threads, and a tick's two were
        most of what a short action costs beyond its work (ZB-V on pp4 x dp2, 51 ticks: 332
        -> 261 ms, docs/results.md): there one all-gather over pp carries both."""
        if self.accelerator or not (down_pairs and up_pairs):
            return _ring(out, down_pairs, self.zeros), _ring(out, up_pairs, self.zeros)
        every = jax.lax.all_gather(out, PP)  # (stages, b, T, D), the same on every stage
        got = []
        for pairs in (down_pairs, up_pairs):
            source = np.full(self.program.schedule.stages, -1, np.int32)
            for src, dst in pairs:
                source[dst] = src
            mine = jnp.asarray(source)[self.stage]
            got.append(like(jnp.where(mine >= 0, at(every, jnp.maximum(mine, 0)),
                                       jnp.zeros_like(out)), self.zeros))
        return tuple(got)

    def rendezvous_tick(self, carry, rows):
        # An unpaired latency-1 tick on an accelerator (`TickProgram.tick_rings`). Last
        # tick's output goes on the slack ring first, for the stages that read it two or
        # more ticks on: in flight under this tick's action, filed after it. Then the urgent
        # arrivals (sent last tick, read now) are filed, the action runs, and its output
        # goes on this tick's own permutes, whose pairs are only the stages that trade
        # urgent data at this tick: a stage that neither sends nor receives one does not
        # wait for its neighbours to finish their actions.
        pool, res, urgent_down, urgent_up, inbox_self, pending, grads, loss = carry
        program = self.program
        row = at(rows, self.stage)[0]
        slack = self.rings(pending, *program.slack_pairs)
        for ring, route, arrival in ((0, "urgent_down", urgent_down), (1, "urgent_up", urgent_up)):
            if any(pattern[ring] for pattern in program.patterns):
                pool = _file(pool, row, route, arrival)
        if program.local_handoff:
            pool = _file(pool, row, "self", inbox_self)
        pool, inbox = self.read_inbox(pool, row)
        res, grads, loss, out, slack = self.act(pool, res, grads, loss, row, inbox, tie=slack)
        pool, grads, loss = self.head_phase(pool, grads, loss, out, rows, row)
        for route, arrival, pairs in zip(("slack_down", "slack_up"), slack,
                                         program.slack_pairs):
            if pairs:
                pool = _file(pool, row, route, arrival)
        urgent_down, urgent_up = self.tick_permutes(out, rows[0, 0, COL["ring_pattern"]])
        return (pool, res, urgent_down, urgent_up, out, out, grads, loss), None

    def tick_permutes(self, out, pattern):
        """(from the -1 neighbour, from the +1 neighbour): `out` sent on the pairs of
        `TickProgram.patterns[pattern]` (the same index on every stage, so every stage takes
        the same branch and the permutes inside meet)."""
        def send(pairs):
            return lambda x: tuple(like(_ring(x, ring, self.zeros), self.zeros)
                                   for ring in pairs)

        branches = [send(pairs) for pairs in self.program.patterns]
        if len(branches) == 1:
            return branches[0](out)
        with jax.named_scope(RING_SCOPE):
            return jax.lax.switch(pattern, branches, out)

    def skewed_tick(self, carry, rows_now_next):
        # Tick t sends tick t-1's output, so the transfers and this tick's action have no
        # data dependency: the ppermutes start before the action and finish after it. What
        # they bring is readable from tick t+1 on, as `transfer_latency = 2` tables expect.
        pool, res, pending, inbox_self, grads, loss = carry
        rows, rows_next = rows_now_next
        row = at(rows, self.stage)[0]
        row_next = at(rows_next, self.stage)[0]
        arrival_down, arrival_up = self.rings(pending, self.program.down_pairs,
                                              self.program.up_pairs)
        if self.program.local_handoff:  # same stage: readable one tick after it was made
            pool = _file(pool, row, "self", inbox_self)
        pool, inbox = self.read_inbox(pool, row)
        res, grads, loss, out, (arrival_down, arrival_up) = self.act(
            pool, res, grads, loss, row, inbox, tie=(arrival_down, arrival_up))
        pool, grads, loss = self.head_phase(pool, grads, loss, out, rows, row)
        if self.program.down_pairs:
            pool = _file(pool, row_next, "down", arrival_down)
        if self.program.up_pairs:
            pool = _file(pool, row_next, "up", arrival_up)
        return (pool, res, out, out, grads, loss), None

    def file_all(self, pool, row, inboxes, lane):
        down_pairs, up_pairs, handoff = self.program.lane_rings[lane]
        down, up, own = inboxes
        if down_pairs:
            pool = _file(pool, row, "down", down)
        if up_pairs:
            pool = _file(pool, row, "up", up)
        if handoff:
            pool = _file(pool, row, "self", own)
        return pool

    def send(self, out, lane):
        # Only the rings this lane's actions send on (one each for a paired 1F1B); a
        # same-stage hand-off is the value itself.
        down_pairs, up_pairs, _ = self.program.lane_rings[lane]
        return (*self.rings(out, down_pairs, up_pairs), out)

    def paired_tick(self, carry, rows_now_next, lanes=None, span: TickSpan | None = None):
        # Lane 0 runs the forward (or a W), lane 1 the backward (B or W), each as a skewed
        # half-tick (a W sends nothing: its lane's output is zeros, filed in `trash`): what
        # the other lane produced last is sent before this lane's action and filed after
        # it, just before the other lane runs again. So the backward's output (tick t-1)
        # travels under tick t's forward and the forward's under tick t's backward; neither
        # transfer feeds the compute beside it, and both are read at the next tick, as the
        # latency-1 table expects.
        # On an accelerator a vocabulary-parallel head is split the same way: the output's
        # broadcast over pp runs under the backward lane, the head's pull-back after it, and
        # the gradient's psum under the next tick's forward lane, filed before the backward
        # lane that reads it (the F's own stage runs that B a tick later at the earliest).
        # Both all-reduces then run every tick, zero-filled where it has no head. On a CPU,
        # where collectives are synchronous and nothing runs under them, the head runs whole
        # after the forward lane (`head_phase`), only on the ticks that have one.
        # `pending_head`: (the last tick's partial head gradient, the slot it goes to), or ()
        # unless the head is split.
        # `span`: the ticks this loop runs (`TickProgram.spans`); a part of the tick none of
        # them uses -- a lane's action, its ring, the head's all-reduces -- is left out.
        pool, res, pending_b, pending_head, grads, loss = carry
        on = span or TickSpan.every(0, 0, 2)
        rows, rows_next = rows_now_next
        now = at(rows, self.stage)
        next_ = at(rows_next, self.stage)
        split_head = self.split_head
        head_before, head_now = split_head and on.head_before, split_head and on.head
        arrival_b = self.send(pending_b, 1) if on.receives[1] else ()
        if head_before:  # last tick's head gradient, summed over pp under this forward
            head_dy, head_slot = pending_head
            arrival_b = (arrival_b, self.head_gradient(head_dy))
        out_f = self.zeros
        if on.acts[0]:
            pool, inbox = self.read_inbox(pool, now[0])
            res, grads, loss, out_f, arrival_b = self.act(pool, res, grads, loss, now[0], inbox,
                                                          tie=arrival_b, lanes=lanes)
        arrival_f = self.send(out_f, 0) if on.sends[0] else ()
        if head_before:
            arrival_b, dy = arrival_b
            pool = set_at(pool, head_slot, dy)
        if head_now:
            arrival_f = (arrival_f, self.head_input(out_f, now[0]))
        elif not split_head and on.head:
            pool, grads, loss = self.head_phase(pool, grads, loss, out_f, rows, now[0])
        if on.receives[1]:
            pool = self.file_all(pool, now[1], arrival_b, 1)
        out_b = self.zeros
        if on.acts[1]:
            pool, inbox = self.read_inbox(pool, now[1])
            res, grads, loss, out_b, arrival_f = self.act(pool, res, grads, loss, now[1], inbox,
                                                          tie=arrival_f, lane=1, lanes=lanes)
        if head_now:
            arrival_f, y = arrival_f
            head_dy, grads, loss = self.head_pullback(lambda: y, grads, loss, rows, now[0])
            pending_head = (head_dy, now[0][COL["head_slot"]])
        elif split_head:
            pending_head = self.no_head
        if on.sends[0]:
            pool = self.file_all(pool, next_[0], arrival_f, 0)
        return (pool, res, out_b, pending_head, grads, loss), None

    def fused_tick(self, carry, rows_pairs, lanes=None, send=True):
        # Both lanes in one switch (`TickProgram.fused`): last tick's arrivals are filed
        # first, then the tick's pair runs, its two actions in one computation, so the
        # collectives of each (tensor-parallel all-gathers and reduce-scatters, expert
        # all-to-alls) can run under the other's GEMMs. Its outputs are sent right after
        # the switch, so the transfers run under the head phase (`head_phase`, run whole
        # after the switch, its gradient filed before any B reads it) and are read by the
        # next tick's switch. `send=False` (the last tick run after the loop): the carry
        # holds the tick's outputs instead of their arrivals.
        pool, res, arrived_b, arrived_f, grads, loss = carry
        rows, pair_rows = rows_pairs
        now = at(rows, self.stage)
        pool = self.file_all(pool, now[0], arrived_f, 0)
        pool = self.file_all(pool, now[1], arrived_b, 1)
        pool, inboxes = jax.lax.optimization_barrier(
            (pool, (self.slots(pool, now[0]), self.slots(pool, now[1]))))
        switch = (lanes or self.lanes)[0]
        kept = {name: res[name] for name in switch.pools}
        read_only = {name: p for name, p in res.items() if name not in kept}
        step = (grads, loss) if switch.grads else (loss,)
        with jax.named_scope(f"{LANE_SCOPE}0"):
            kept, step, (out_f, out_b) = jax.lax.switch(
                at(pair_rows, self.stage), switch.branches, inboxes, read_only, kept, step,
                (now[0], now[1]))
        res = {**res, **kept}
        grads, loss = step if switch.grads else (grads, step[0])
        sent_f, sent_b = out_f, out_b
        if send:  # issued before the head phase, so the transfers run under it
            sent_f, sent_b = self.send(out_f, 0), self.send(out_b, 1)
        pool, grads, loss = self.head_phase(pool, grads, loss, out_f, rows, now[0])
        return (pool, res, sent_b, sent_f, grads, loss), None

    def scan_spans(self, tick: Callable, carry, xs):
        """`tick` scanned over the table's rows (`xs`, the per-row inputs, all but a last tick
        that runs apart), in a loop scoped with its rows (`SPAN_SCOPE`, which
        `analysis.step_estimate` replays).

        A paired tick on an accelerator runs one loop per span of `TickProgram.spans` -- the
        fill, the steady state, the drain --, each with its own switches (over the branches
        its rows take) and only the parts of a tick its rows use: the fill sends nothing
        back and runs no head, the drain sends nothing forward. (GPT-1.3B pp4 x dp2,
        deviceless 8 x H100: 992 -> 980 ms, 0.748 -> 0.793 of the collective bytes under
        GEMMs.) Elsewhere one loop: a CPU host's collectives cost their rendezvous whether
        they carry data or not, each loop is one more body to compile, and a fused program's
        lone ticks (collective matmul at tp > 1) laid its pools out sequence-major, which
        the steady loop's carry took on and transposed back every tick (GPT-1.3B pp2 x dp2 x
        tp2: 1065 -> 1115 ms)."""
        stop = xs[0].shape[0]
        spanned = self.accelerator and self.program.lanes == 2 and not self.program.fused
        spans = self.program.spans(stop) if spanned else (
            TickSpan.every(0, stop, self.program.lanes),)
        for span in spans:
            rows = slice(span.start, span.stop)
            body = tick if len(spans) == 1 else partial(
                tick, lanes=self.switches(self.branches, rows, self.lone_branches), span=span)
            with jax.named_scope(f"{SPAN_SCOPE}{span.start}_{span.stop}"):
                carry, _ = jax.lax.scan(body, carry, tuple(x[rows] for x in xs))
        return carry

    def run(self, pool_sbtd):
        """(grads, loss, ends) after scanning the table (`ends`: see `run_ticks`)."""
        start = (self.ctx.grads0, self.ctx.loss0)
        table = jnp.asarray(self.program.table)
        if self.program.fused:
            nothing = (self.zeros,) * 3  # no arrivals before the first tick (`send`)
            return self.scan_pairs(self.fused_tick, (pool_sbtd, self.res0, nothing, nothing,
                                                     *start),
                                   (table, jnp.asarray(self.program.lane_pairs[1])))
        if self.program.lanes == 2:
            return self.scan_pairs(self.paired_tick, (pool_sbtd, self.res0, self.zeros,
                                                      self.no_head, *start),
                                   (table, self.next_rows()))
        if self.program.tick_rings and self.accelerator:
            carry0 = (pool_sbtd, self.res0, self.zeros, self.zeros, self.zeros, self.zeros,
                      *start)
            (*_, grads, loss), _ = jax.lax.scan(self.rendezvous_tick, carry0, table)
        elif self.program.skewed:
            carry0 = (pool_sbtd, self.res0, self.zeros, self.zeros, *start)
            (*_, grads, loss), _ = jax.lax.scan(self.skewed_tick, carry0,
                                                (table, self.next_rows()))
        else:
            carry0 = (pool_sbtd, self.res0, self.zeros, self.zeros, self.zeros, *start)
            (*_, grads, loss), _ = jax.lax.scan(self.tick, carry0, table)
        return grads, loss, None

    def next_rows(self):
        """Per tick, the next tick's row, which says where the arrivals filed at the end of
        this one go (the trash slot after the last tick)."""
        nothing = np.full((1, *self.program.table.shape[1:]), self.program.trash, np.int32)
        return jnp.asarray(np.concatenate([self.program.table[1:], nothing]))

    def scan_pairs(self, tick: Callable, carry0, xs):
        """A two-lane table's loops (`scan_spans`), then its last tick where that runs apart
        (`last_tick`, with the last of each of `xs`)."""
        apart = self.deferred is not None
        carry = self.scan_spans(tick, carry0, tuple(x[:-1] if apart else x for x in xs))
        if apart:
            return self.last_tick(carry, *(x[-1] for x in xs))
        (*_, grads, loss) = carry
        return grads, loss, None

    def last_tick(self, carry, rows, rows_next):
        """The step's last paired tick, run after the loop (`rows_next`: a fused program's
        pair indices of that row). It runs one action, virtual
        stage 0's last backward (`deferred_embedding`); until it ends, the tied embedding's
        gradient was complete nowhere, and its fp32 all-reduce over (pp, dp) -- the step's
        largest -- had nothing left to run under. Here the embedding and head gradients of
        every earlier tick are summed over (pp, dp) while this tick runs, and its own
        embedding is pulled back after it, sparsely: the microbatch's activation gradient
        (on stage 0) is broadcast over pp and gathered over dp with the token ids (one
        microbatch's activations per replica, not the table's rows), and every device pulls
        back every replica's embedding itself.

        Returns:
          (grads, loss, ends): `ends` the embedding's and head's gradients over (pp, dp).
        """
        ctx, deferred = self.ctx, self.deferred
        grads = carry[-2]
        ends = jax.lax.psum({k: grads[k] for k in ("embed", "head")}, (PP, DP))
        # The scope tells `analysis.step_estimate` that these switches run the last row.
        tick = (partial(self.fused_tick, send=False) if self.program.fused
                else self.paired_tick)
        with jax.named_scope(LAST_TICK_SCOPE):
            (_, _, dx, _, grads, loss), _ = tick(carry, (rows, rows_next), lanes=self.last_lanes)
        dx = jax.lax.psum(dx, PP)  # virtual stage 0's, made on stage 0 only
        dx = all_gather_invariant(dx, DP)  # (dp b, T, D), the same on every replica
        ids = all_gather_invariant(ctx.ids_mbt[deferred.microbatch], DP)  # (dp b, T)
        par = ctx.par
        if par.sequence_sharded and par.sp_dim == 0 and par.tp > 1:
            # Split over the batch, a TP rank's rows of dx are its share of each replica's
            # sequences, replica by replica: the ids put in that order, so the embedding's
            # scatter over TP hands every rank the rows its dx holds.
            n, t = ids.shape
            b = ctx.ids_mbt.shape[1]
            ids = ids.reshape(n // b, par.tp, b // par.tp, t).swapaxes(0, 1).reshape(n, t)
        axes = sorted(_varying_axes(dx))
        _, pull = jax.vjp(lambda we: vary(ctx.model.embed(we, ids, ctx.par), axes),
                          deferred.embed)
        (d_embed,) = pull(dx)
        ends["embed"] = jax.tree.map(jnp.add, ends["embed"], d_embed)
        return grads, loss, ends


# Which table column names an action's slot in each residual pool.
_POOL_SLOT = {"first": "e_slot", "last": "e_slot", "chunk": "r_slot", "dz": "z_slot"}


class _LaneSwitches(NamedTuple):
    """One lane's two switches over the table's branches (see `act` in `run_ticks`).

    Attributes:
      plain: per branch, `(inbox, pools, carry, row) -> (carry, out)`: the action, if it
        fills no pool; a no-op otherwise.
      filing: per branch, `(inbox, read_only, kept, carry, out, row) -> (kept, carry, out)`:
        the action, if it fills a pool, its slots of `kept` updated in place; else the
        operands passed through.
      pools: the residual pools this lane's actions fill (`kept`).
      grads: whether its actions add to the gradients; `carry` is `(grads, loss)` if so,
        `(loss,)` if not.
    """

    plain: list
    filing: list
    pools: tuple[str, ...]
    grads: bool


def _lane_switches(ctx: StepContext, branches: list, fills: dict[str, tuple[bool, ...]],
                   taken: set[int], grads: bool) -> _LaneSwitches:
    """The switches of a lane whose table column takes the branches `taken`.

    `branches[b](inbox, slots, grads, loss, row) -> (made, grads, loss, out)` gets and returns
    its slot of each residual pool; `fills[pool][b]` says whether it files what it made.
    """
    filler = [any(flags[b] for flags in fills.values()) for b in range(len(branches))]
    pools = tuple(name for name, flags in fills.items() if any(flags[b] for b in taken))

    def unpack(carry):
        return carry if grads else (ctx.grads0, carry[0])

    def pack(g, loss):
        return (g, loss) if grads else (loss,)

    def plain(b, fn):
        def run(inbox, res, carry, row):
            if filler[b] or b not in taken:
                return carry, ctx.zeros_btd
            _, g, loss, out = fn(inbox, _slots_of(res, row), *unpack(carry), row)
            return pack(g, loss), out
        return run

    def filing(b, fn):
        def run(inbox, read_only, kept, carry, out, row):
            if not filler[b] or b not in taken:
                return kept, carry, out
            made, g, loss, out = fn(inbox, _slots_of({**read_only, **kept}, row),
                                    *unpack(carry), row)
            kept = {name: _filed(leaves, made[name], row[COL[_POOL_SLOT[name]]])
                    if fills[name][b] else list(leaves) for name, leaves in kept.items()}
            return kept, pack(g, loss), out
        return run

    return _LaneSwitches([plain(b, fn) for b, fn in enumerate(branches)],
                         [filing(b, fn) for b, fn in enumerate(branches)], pools, grads)


class _PairSwitch(NamedTuple):
    """A fused paired program's one switch (`_TickLoop.fused_tick`).

    Attributes:
      branches: per (lane 0, lane 1) pair of `TickProgram.lane_pairs`,
        `(inboxes, read_only, kept, carry, rows) -> (kept, carry, (out 0, out 1))`: the two
        actions, what they fill filed into `kept` in place.
      pools: the residual pools its actions fill (`kept`).
      grads: whether its actions add to the gradients (as `_LaneSwitches.grads`).
    """

    branches: list
    pools: tuple[str, ...]
    grads: bool


def _pair_switch(ctx: StepContext, branches: list, fills: dict[str, tuple[bool, ...]],
                 pairs: tuple[tuple[int, int], ...], taken: set[int], adds: list[bool],
                 lone_branches: list | None = None) -> _PairSwitch:
    """The one switch of a fused paired program over `pairs`, of which the table takes
    the indices `taken` (the others are no-ops). A pair with one action runs it from
    `lone_branches` where given.

    Both actions read their slots of the pools as the tick got them: a slot one fills is
    never one the other reads (slots are allocated per tick), so XLA orders the reads before
    the in-place writes and copies nothing.
    """
    used = {b for i in taken for b in pairs[i] if b}
    grads = any(adds[b] for b in used)
    pools = tuple(name for name, flags in fills.items() if any(flags[b] for b in used))

    def one(i, pair):
        def run(inboxes, read_only, kept, carry, rows):
            outs = [ctx.zeros_btd, ctx.zeros_btd]
            if i not in taken:
                return kept, carry, tuple(outs)
            every = {**read_only, **kept}
            g, loss = carry if grads else (ctx.grads0, carry[0])
            filed = dict(kept)
            # A lone action has no other lane to hide its collectives under: it runs in
            # the lone context (`executor._lone_context`), if there is one.
            run_ = branches if lone_branches is None or all(pair) else lone_branches
            for lane, b in enumerate(pair):
                if not b:
                    continue
                made, g_out, loss, outs[lane] = run_[b](
                    inboxes[lane], _slots_of(every, rows[lane]), g, loss, rows[lane])
                # An action that adds nothing (F) hands back the accumulators recast: the
                # other's additions must not take them from it, or they wait for the whole
                # F and XLA runs the two actions one after the other.
                if adds[b]:
                    g = g_out
                filed = {name: _filed(leaves, made[name], rows[lane][COL[_POOL_SLOT[name]]])
                         if fills[name][b] else leaves for name, leaves in filed.items()}
            return filed, ((g, loss) if grads else (loss,)), tuple(outs)
        return run

    return _PairSwitch([one(i, pair) for i, pair in enumerate(pairs)], pools, grads)


def _slots_of(pools: dict, row) -> dict:
    """Each residual pool's slot named by the table row (reads no action uses are dead)."""
    return {name: [at(p, row[COL[_POOL_SLOT[name]]]) for p in leaves]
            for name, leaves in pools.items()}


def _filed(leaves: list, values: list, slot) -> list:
    """`leaves` (one residual pool) with `values` written at `slot`, in place."""
    return [like(set_at(p, slot, v), p) for p, v in zip(leaves, values)]
