"""What the compiled step costs on a GPU: a roofline over the kernels of its optimized HLO.

Every kernel the program launches is costed once per execution, and executions come from
the program's own structure: a ``while`` body runs its trip count times, a ``conditional``
runs one branch -- the branch the pipeline's tick table says (a tick switch's branches are
weighted by how often the table takes them), and the most expensive branch of any other
conditional (a guard's apply, a real layer rather than a padded one). Per kernel:

* a GEMM (a dot, a cuBLAS/cuDNN call, a fusion holding one): ``max(flops / matmul peak,
  bytes / HBM bandwidth)`` at the dtype's peak (:meth:`ChipSpec.matmul_flops_per_s`);
* any other kernel: ``bytes / HBM bandwidth``. Bytes are what it reads and writes: a
  fusion reading a slice of a large buffer (a pool slot) counts the slice, one that
  updates a buffer in place (``dynamic-update-slice``, ``scatter``) counts the update;
* every kernel, collectives included: :data:`LAUNCH_S` for its launch;
* a collective's transfer: hidden where compute runs under it; what is not is passed in
  (``exposed_s``: ``HloReport.exposed_comm_s_estimate``, which credits each async collective
  with the GEMMs under it) and added to the step.

Pipelines are replayed tick by tick (:func:`replay_ticks`): a stage's tick costs the tick
loop's own kernels plus the branch its row of the table runs in each lane, and a stage
starts a tick only when it and the stages that send to it have finished the last one (at
transfer latency 2 and in paired ticks the arrival is needed to finish the tick, not to
start it). A vocabulary-parallel head phase synchronises every stage. The replayed step is
the loop's longest stage plus the work outside the loop.

Returned figures (:class:`StepEstimate`) are per device per step: ``gemm_ms``,
``other_ms`` and ``launch_ms`` are the average device's work (the stages' mean in a
pipeline), ``wait_ms`` the rest of the replayed step -- the bubble, lockstep waits and
stage imbalance (0 without a pipeline), ``exposed_ms`` the communication nothing hides;
``step_ms`` their sum; ``mfu`` the model's FLOPs over ``step_ms`` at the chip's bf16 peak.
So a plan that leaves its collectives exposed (sequence parallelism's, say) is not ranked
ahead of one that hides them at the cost of more kernels.

The roofline runs kernels at the chip's peaks. Where the chip's kernels were measured
(:attr:`ChipSpec.efficiency`: Hopper, on a traced H200 step), ``expected_ms`` is the same
replay with every kernel at its measured share of the peak -- GEMMs, fused attention and
the other kernels each their own -- and ``expected_mfu`` its MFU: what a real step takes.

What the roofline leaves out: kernel efficiency below the peaks, caches, the cost of a
conditional's predicate read beyond one launch, overlap of independent kernels on several
streams, and link contention.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jax_overlap.analysis.hlo_gemms import gemm_work
from jax_overlap.analysis.hlo_parse import (
    Computation,
    HloModule,
    Instruction,
    called_computations,
    parse_module,
    shape_bytes,
    tuple_elements,
    while_trip_count,
)
from jax_overlap.hardware.machine import KERNEL_LAUNCH_S as LAUNCH_S  # seconds a launch
from jax_overlap.hardware.machine import ChipSpec
from jax_overlap.pipeline.program import (HEAD_SCOPE, LANE_SCOPE, LAST_TICK_SCOPE, RING_SCOPE,
                                          SPAN_SCOPE)


_FREE = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "opt-barrier",
    "after-all", "partition-id", "replica-id", "add-dependency", "domain", "async-done",
    "fusion-done", "copy-done", "all-reduce-done", "all-gather-done",
    "collective-permute-done", "reduce-scatter-done", "all-to-all-done", "send-done",
    "recv-done", "async-update",
})
_COLLECTIVES = frozenset({
    "all-reduce", "all-reduce-start", "all-gather", "all-gather-start", "reduce-scatter",
    "reduce-scatter-start", "collective-permute", "collective-permute-start", "all-to-all",
    "all-to-all-start", "ragged-all-to-all",
    "send", "recv", "collective-broadcast",
})
_SLICING = frozenset({"dynamic-slice", "slice", "gather"})
# Ops that update their operand 0 in place: the operand holding the update.
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}
_OP_NAME = re.compile(r'op_name="([^"]*)"')


# ----------------------------------------------------------------------------- kernels


@dataclass(frozen=True)
class Kernel:
    """One launched kernel and its cost per execution.

    Attributes:
      name: the instruction (fusion, custom-call, collective...).
      computation: the computation it is launched from.
      kind: ``gemm``, ``other`` or ``collective``.
      flops: matmul FLOPs (0 unless a GEMM).
      bytes: bytes read and written.
      seconds: roofline time (0 for a collective: its transfer is assumed hidden).
      op: the JAX operation it came from (the tail of its ``op_name``).
    """

    name: str
    computation: str
    kind: str
    flops: float
    bytes: float
    seconds: float
    op: str


def _op_name(inst: Instruction) -> str:
    match = _OP_NAME.search(inst.attributes)
    if not match:
        return inst.opcode
    parts = [p for p in match.group(1).split("/") if p and not p.startswith("jit(")]
    return "/".join(parts[-3:]) or inst.opcode


class _Users:
    """Users of each instruction of a computation (memoised per computation)."""

    def __init__(self):
        self._of: dict[str, dict[str, list[Instruction]]] = {}

    def __call__(self, comp: Computation) -> dict[str, list[Instruction]]:
        if comp.name not in self._of:
            users: dict[str, list[Instruction]] = {}
            for inst in comp.instructions:
                for op in inst.operands:
                    users.setdefault(op, []).append(inst)
            self._of[comp.name] = users
        return self._of[comp.name]


def _read_bytes(comp: Computation, users, name: str, full: float, depth: int = 0) -> float:
    """Bytes a fused computation reads of its value ``name`` (``full`` bytes): only the
    slices where every use slices it, nothing where it is the buffer an in-place update
    writes into, else all of it."""
    uses = users(comp).get(name, [])
    if not uses or depth > 8:
        return full
    total = 0.0
    for use in uses:
        if use.opcode in _SLICING and use.operands and use.operands[0] == name:
            total += shape_bytes(use.shape)
        elif use.opcode in _IN_PLACE and use.operands[0] == name:
            continue
        elif use.opcode in ("bitcast", "reshape"):
            total += _read_bytes(comp, users, use.name, full, depth + 1)
        else:
            return full
    return min(total, full)


def _written_bytes(comp: Computation, inst: Instruction, depth: int = 0) -> float:
    """Bytes a fused computation's value ``inst`` writes: an in-place update writes only
    its update; a tuple, each element's."""
    if depth > 8:
        return shape_bytes(inst.shape)
    if inst.opcode in _IN_PLACE and len(inst.operands) > _IN_PLACE[inst.opcode]:
        update = comp.get(inst.operands[_IN_PLACE[inst.opcode]])
        return shape_bytes(update.shape) if update is not None else shape_bytes(inst.shape)
    if inst.opcode == "tuple":
        return sum(_written_bytes(comp, comp.get(op), depth + 1) if comp.get(op) is not None
                   else 0 for op in inst.operands)
    if inst.opcode in ("bitcast", "reshape") and inst.operands and comp.get(inst.operands[0]):
        return _written_bytes(comp, comp.get(inst.operands[0]), depth + 1)
    return shape_bytes(inst.shape)


def _operand_bytes(comp: Computation, inst: Instruction) -> list[float]:
    out = []
    for i, op in enumerate(inst.operands):
        shape = inst.operand_shapes[i] if i < len(inst.operand_shapes) else None
        if not shape:
            src = comp.get(op)
            shape = src.shape if src is not None else ""
        out.append(float(shape_bytes(shape)) if shape else 0.0)
    return out


def _fusion_bytes(module: HloModule, comp: Computation, inst: Instruction, users) -> float:
    """Bytes a fusion moves: its operands as the fused computation reads them, its result
    as the fused root writes it."""
    callee = (called_computations(inst).get("calls") or [None])[0]
    fused = module.computations.get(callee) if callee else None
    operands = _operand_bytes(comp, inst)
    if fused is None:
        return sum(operands) + shape_bytes(inst.shape)
    params = {}
    for sub in fused.instructions:
        if sub.opcode == "parameter" and sub.operands:
            try:
                params[int(sub.operands[0])] = sub.name
            except ValueError:
                pass
    read = sum(_read_bytes(fused, users, params[i], full) if i in params else full
               for i, full in enumerate(operands))
    root = fused.root
    return read + (_written_bytes(fused, root) if root is not None else shape_bytes(inst.shape))


def _plain_bytes(comp: Computation, inst: Instruction) -> float:
    """Bytes an unfused kernel moves."""
    if inst.opcode in _IN_PLACE and len(inst.operands) > _IN_PLACE[inst.opcode]:
        return 2.0 * _operand_bytes(comp, inst)[_IN_PLACE[inst.opcode]]
    if inst.opcode in _SLICING or inst.opcode == "copy":
        return 2.0 * shape_bytes(inst.shape)
    return sum(_operand_bytes(comp, inst)) + shape_bytes(inst.shape)


def kernel_of(module: HloModule, comp: Computation, inst: Instruction, chip: ChipSpec,
              users=None) -> Kernel | None:
    """The kernel ``inst`` launches, or None when it launches none (tuples, parameters,
    bitcasts, async done ops) or is control flow (``while``, ``conditional``, ``call``).

    Args:
      module: the module.
      comp: the computation ``inst`` is in (not a fused one).
      inst: the instruction.
      chip: the chip's peaks.
      users: a :class:`_Users` cache (one is made when omitted).

    Returns:
      The :class:`Kernel`, or None.
    """
    users = users or _Users()
    op = inst.opcode
    if op in _FREE or op in ("while", "conditional", "call"):
        return None
    if op in _COLLECTIVES:
        return Kernel(inst.name, comp.name, "collective", 0.0, 0.0, 0.0, _op_name(inst))
    if op in ("fusion", "fusion-start"):
        nbytes = _fusion_bytes(module, comp, inst, users)
    elif op == "custom-call":
        nbytes = sum(_operand_bytes(comp, inst)) + shape_bytes(tuple_elements(inst.shape)[0])
    else:
        nbytes = _plain_bytes(comp, inst)
    memory_s = nbytes / chip.hbm_bytes_per_s
    work = gemm_work(module, comp, inst)
    if work is not None and work.flops > 0:
        rate = (chip.attention_flops_per_s if work.attention else chip.matmul_flops_per_s)
        seconds = max(work.flops / rate(work.dtype), memory_s)
        return Kernel(inst.name, comp.name, "gemm", work.flops, nbytes, seconds,
                      _op_name(inst))
    return Kernel(inst.name, comp.name, "other", 0.0, nbytes, memory_s, _op_name(inst))


# ----------------------------------------------------------------------------- tallies


@dataclass
class Tally:
    """Work of some executions of a computation: totals and the kernels behind them.

    Attributes:
      gemm_s, other_s: roofline seconds of GEMM / other kernels.
      launches: kernel launches.
      gemm_flops: matmul FLOPs.
      kernels: (computation, name) -> [Kernel, executions, context].
    """

    gemm_s: float = 0.0
    other_s: float = 0.0
    launches: float = 0.0
    gemm_flops: float = 0.0
    kernels: dict = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.gemm_s + self.other_s + self.launches * LAUNCH_S

    def add_kernel(self, kernel: Kernel, context: str) -> None:
        self.launches += 1
        if kernel.kind == "gemm":
            self.gemm_s += kernel.seconds
            self.gemm_flops += kernel.flops
        else:
            self.other_s += kernel.seconds
        key = (kernel.computation, kernel.name)
        entry = self.kernels.setdefault(key, [kernel, 0.0, context])
        entry[1] += 1

    def add(self, other: Tally, times: float = 1.0) -> None:
        if times == 0:
            return
        self.gemm_s += times * other.gemm_s
        self.other_s += times * other.other_s
        self.launches += times * other.launches
        self.gemm_flops += times * other.gemm_flops
        for key, (kernel, n, context) in other.kernels.items():
            entry = self.kernels.setdefault(key, [kernel, 0.0, context])
            entry[1] += times * n


# A conditional's branch weights: given the conditional, its weights, or None to take the
# most expensive branch.
BranchWeights = Callable[[Instruction], Sequence[float] | None]


class _Walker:
    """Tallies computations, memoised: ``tally(name)`` is one execution of ``name``."""

    def __init__(self, module: HloModule, chip: ChipSpec, weights: BranchWeights,
                 label: Callable[[Instruction, int], str | None]):
        self.module, self.chip, self.weights, self.label = module, chip, weights, label
        self.users = _Users()
        self._memo: dict[tuple[str, str], Tally] = {}

    def tally(self, name: str, context: str = "", skip: frozenset = frozenset()) -> Tally:
        key = (name, context)
        if not skip and key in self._memo:
            return self._memo[key]
        out = Tally()
        comp = self.module.computations.get(name)
        for inst in (comp.instructions if comp is not None else ()):
            if inst.name not in skip:
                self._instruction(comp, inst, context, out)
        if not skip:
            self._memo[key] = out
        return out

    def branches(self, inst: Instruction, context: str) -> list[Tally]:
        calls = called_computations(inst)
        # A predicate conditional's branch 0 is its false computation.
        names = calls.get("branch_computations") or (
            calls.get("false_computation", []) + calls.get("true_computation", []))
        return [self.tally(n, self.label(inst, b) or context) for b, n in enumerate(names)]

    def _instruction(self, comp: Computation, inst: Instruction, context: str,
                     out: Tally) -> None:
        calls = called_computations(inst)
        if inst.opcode == "while":
            trips = while_trip_count(self.module, comp, inst) or 1
            for body in calls.get("body", []):
                out.add(self.tally(body, context), trips)
            for cond in calls.get("condition", []):
                out.add(self.tally(cond, context), trips + 1)
            return
        if inst.opcode == "conditional":
            out.launches += 1  # the predicate's read
            branches = self.branches(inst, context)
            if not branches:
                return
            weights = self.weights(inst)
            if weights is None or len(weights) != len(branches):
                weights = [0.0] * len(branches)
                weights[int(np.argmax([b.seconds for b in branches]))] = 1.0
            for b, w in zip(branches, weights):
                out.add(b, w)
            return
        if inst.opcode == "call":
            for callee in calls.get("to_apply", []) + calls.get("calls", []):
                out.add(self.tally(callee, context))
            return
        if inst.opcode == "async-start":
            for callee in calls.get("calls", []):
                out.add(self.tally(callee, context))
            return
        kernel = kernel_of(self.module, comp, inst, self.chip, self.users)
        if kernel is not None:
            out.add_kernel(kernel, context)


def _scope_of(inst: Instruction) -> str:
    match = _OP_NAME.search(inst.attributes)
    return match.group(1) if match else ""


def _lane(inst: Instruction) -> int | None:
    found = re.search(rf"/{LANE_SCOPE}(\d+)/", _scope_of(inst) + "/")
    return int(found.group(1)) if found else None


def _is_head(inst: Instruction) -> bool:
    return f"/{HEAD_SCOPE}/" in _scope_of(inst) + "/"


def _in_last_tick(inst: Instruction) -> bool:
    return f"/{LAST_TICK_SCOPE}/" in _scope_of(inst) + "/"


# ----------------------------------------------------------------------------- ticks


@dataclass(frozen=True)
class Ticks:
    """What the replay needs of a pipeline's tick program.

    Attributes:
      branch: int ``(ticks, stages, lanes)``: the switch branch each stage runs per lane
        (0 idle).
      names: a label per branch (``idle``, ``F first``, ``B mid``...).
      senders: per stage, the stages whose transfers it receives each tick.
      head: bool ``(ticks,)``: ticks with a vocabulary-parallel head phase.
      arrival_to_finish: at transfer latency 2 and with paired lanes a tick's arrival is
        needed to finish the tick, not to start it.
      tick_senders: an unpaired latency-1 program's per-tick rings
        (`TickProgram.tick_rings`): per tick, per stage, the stages whose urgent transfers
        it receives at that tick, needed to start it; `senders` are then its slack ring's,
        needed to finish it. None otherwise.
      patterns: int ``(ticks,)``: the ring pattern each tick sends on (its switch's branch,
        `RING_SCOPE`, of `pattern_count`); None without per-tick rings.
    """

    branch: np.ndarray
    names: tuple[str, ...]
    senders: tuple[tuple[int, ...], ...]
    head: np.ndarray
    arrival_to_finish: bool
    tick_senders: tuple | None = None
    patterns: np.ndarray | None = None
    pattern_count: int = 0

    @classmethod
    def of_program(cls, program: Any) -> Ticks:
        """From a `jax_overlap.pipeline.program.TickProgram`."""
        branch = program.column("branch")
        stages = branch.shape[1]

        def senders_of(rings) -> tuple[tuple[int, ...], ...]:  # per stage, whom it hears on
            pairs = [pair for ring in rings for pair in ring]
            return tuple(tuple(sorted({src for src, dst in pairs if dst == s and src != s}))
                         for s in range(stages))

        head = (program.column("head_mb")[:, 0, 0] > 0) if program.vocab_parallel \
            else np.zeros(branch.shape[0], bool)
        if program.tick_rings:
            patterns = program.column("ring_pattern")[:, 0, 0]
            received = [senders_of(pattern) for pattern in program.patterns]
            tick_senders = (((),) * stages,) + tuple(received[i] for i in patterns[:-1])
            return cls(program.switch_table(), program.switch_names(),
                       senders_of(program.slack_pairs), head, False, tick_senders, patterns,
                       len(program.patterns))
        # Fused lanes: one switch, whose arrivals are filed before it runs.
        return cls(program.switch_table(), program.switch_names(),
                   senders_of((program.down_pairs, program.up_pairs)), head,
                   (program.lanes == 2 and not program.fused) or program.skewed)

    def frequencies(self, lane: int, rows: slice = slice(None)) -> list[float]:
        """The share of lane `lane`'s (tick, stage) entries of the ticks `rows` taking each
        branch."""
        counts = np.bincount(self.branch[rows, :, lane].ravel(), minlength=len(self.names))
        return (counts / max(counts.sum(), 1)).tolist()


def _rows_of(inst: Instruction, last_apart: bool) -> slice:
    """The table rows a tick switch runs: those of its loop's span (`SPAN_SCOPE`); the last
    row for a last tick run after the loop (`last_apart`), the others for the loop's; else
    all."""
    if _in_last_tick(inst):
        return slice(-1, None)
    span = re.search(rf"/{SPAN_SCOPE}(\d+)_(\d+)/", _scope_of(inst) + "/")
    if span:
        return slice(int(span.group(1)), int(span.group(2)))
    return slice(0, -1) if last_apart else slice(None)


def tick_switch_shares(ticks: Ticks, last_apart: bool
                       ) -> Callable[[Instruction], Sequence[float] | None]:
    """Per `conditional` of a pipeline step, the share of its executions that take each
    branch, for `hlo_parse.execution_counts`: a lane's switch, its own column of the table
    (each lane's switch runs once a tick); the head phase's cond, the share of ticks that
    have a head; None for any other. `last_apart`: the step runs its last tick after the loop
    (`LAST_TICK_SCOPE`)."""

    def shares(inst: Instruction) -> Sequence[float] | None:
        rows = _rows_of(inst, last_apart)
        lane = _lane(inst)
        if lane is not None and lane < ticks.branch.shape[2]:
            return ticks.frequencies(lane, rows)
        if _is_head(inst):
            share = float(ticks.head[rows].mean())
            return [1.0 - share, share]
        if ticks.patterns is not None and f"/{RING_SCOPE}/" in _scope_of(inst) + "/":
            counts = np.bincount(ticks.patterns[rows], minlength=ticks.pattern_count)
            return (counts / max(counts.sum(), 1)).tolist()
        return None

    return shares


def replay_ticks(work: np.ndarray, ticks: Ticks) -> np.ndarray:
    """Finish time of each stage's last tick, replaying the table.

    Args:
      work: seconds ``(ticks, stages)`` each stage's tick takes once started.
      ticks: the program's senders and head ticks.

    Returns:
      ``(stages,)`` finish times of the last tick.
    """
    stages = work.shape[1]
    finish = np.zeros(stages)
    for t in range(work.shape[0]):
        before = finish.copy()
        for s in range(stages):
            arrived = max((before[src] for src in ticks.senders[s]), default=0.0)
            if ticks.tick_senders is not None:  # urgent arrivals to start, slack to finish
                start = max((before[src] for src in ticks.tick_senders[t][s]),
                            default=before[s])
                finish[s] = max(max(before[s], start) + work[t, s], arrived)
            elif ticks.arrival_to_finish:
                finish[s] = max(before[s] + work[t, s], arrived)
            else:
                finish[s] = max(before[s], arrived) + work[t, s]
        if ticks.head[t]:
            finish[:] = finish.max()
    return finish


# ----------------------------------------------------------------------------- estimate


@dataclass(frozen=True)
class StepEstimate:
    """The compiled step's estimated time on one device (see the module docstring).

    Attributes:
      step_ms: the replayed step.
      mfu: ``model_flops / (step_ms x bf16 peak)``.
      gemm_ms, other_ms, launch_ms: the average device's GEMM, other-kernel and launch time.
      wait_ms: the replayed step minus the average device's work (0 without a pipeline).
      exposed_ms: communication under no compute, added to the step.
      model_flops: the model's training FLOPs per device per step.
      gemm_flops: the program's matmul FLOPs per device per step (recompute included).
      kernels: every kernel with its executions per step and where it runs.
      chip: the chip's name.
      expected_ms, expected_mfu: the same replay at the chip's measured kernel rates (None
        where the chip has none: :meth:`ChipSpec.at_measured_rates`).
    """

    step_ms: float
    mfu: float
    gemm_ms: float
    other_ms: float
    launch_ms: float
    wait_ms: float
    model_flops: float
    gemm_flops: float
    kernels: tuple = ()
    chip: str = ""
    expected_ms: float | None = None
    expected_mfu: float | None = None
    exposed_ms: float = 0.0

    def to_json(self) -> dict[str, float]:
        """The JSON object ``analyze --json`` prints under ``estimate``."""
        out = {"step_ms": self.step_ms, "mfu": self.mfu, "gemm_ms": self.gemm_ms,
               "other_ms": self.other_ms, "launch_ms": self.launch_ms,
               "wait_ms": self.wait_ms, "exposed_ms": self.exposed_ms,
               "model_flops": self.model_flops,
               "gemm_flops": self.gemm_flops}
        if self.expected_ms is not None:
            out.update(expected_step_ms=self.expected_ms, expected_mfu=self.expected_mfu)
        return out

    def top(self, n: int, kind: str = "other") -> list[dict[str, Any]]:
        """The ``n`` kernels of ``kind`` costing most per step (time x executions)."""
        rows = [(k.seconds * runs, k, runs, where) for k, runs, where in self.kernels
                if k.kind == kind and runs > 0]
        rows.sort(key=lambda r: -r[0])
        return [{"ms": total * 1e3, "name": k.name, "executions": runs,
                 "ms_each": k.seconds * 1e3, "mib": k.bytes / 2**20, "op": k.op,
                 "where": where or k.computation}
                for total, k, runs, where in rows[:n]]


def _tick_loops(module: HloModule) -> list[tuple[Computation, Instruction, list[Instruction]]]:
    """Each ``while`` whose body holds tick switches (one per span of the table:
    `TickProgram.spans`), with those switches."""
    loops = []
    for comp in module.computations.values():
        for inst in comp.instructions:
            if inst.opcode != "while":
                continue
            body = module.computations.get((called_computations(inst).get("body") or [""])[0])
            if body is None:
                continue
            switches = [i for i in body.instructions if i.opcode == "conditional" and (
                _lane(i) is not None or _is_head(i))]
            if any(_lane(i) is not None for i in switches):
                loops.append((comp, inst, switches))
    return loops


def _last_tick_switches(module: HloModule) -> list[Instruction]:
    """The tick switches of a last tick run after the tick loop, in the entry computation."""
    entry = module.computations[module.entry]
    return [i for i in entry.instructions if i.opcode == "conditional" and _in_last_tick(i)
            and (_lane(i) is not None or _is_head(i))]


def estimate_step(hlo: str | HloModule, chip: ChipSpec, model_flops: float,
                  ticks: Ticks | None = None, exposed_s: float = 0.0) -> StepEstimate:
    """Estimate the compiled step's time on one device of ``chip``.

    Args:
      hlo: ``compiled.as_text()`` of the step, or its parsed module.
      chip: the GPU's peaks.
      model_flops: the model's training FLOPs per device per step (for ``mfu``).
      ticks: the pipeline's tick table (:meth:`Ticks.of_program`); None without one.
      exposed_s: seconds of communication no compute hides
        (``HloReport.exposed_comm_s_estimate``), added to the step.

    Returns:
      The :class:`StepEstimate`.
    """
    module = parse_module(hlo) if isinstance(hlo, str) else hlo
    est = _replay(module, chip, model_flops, ticks, exposed_s)
    measured = chip.at_measured_rates()
    if measured is None:
        return est
    expected_s = _replay(module, measured, model_flops, ticks, exposed_s).step_ms * 1e-3
    return dataclasses.replace(
        est, expected_ms=expected_s * 1e3,
        expected_mfu=model_flops / (expected_s * chip.peak_bf16_flops) if expected_s else 0.0)


def _replay(module: HloModule, chip: ChipSpec, model_flops: float,
            ticks: Ticks | None, exposed_s: float = 0.0) -> StepEstimate:
    """The roofline of ``module`` at ``chip``'s rates, its pipeline replayed, plus
    ``exposed_s``."""

    # A step that runs its last tick after the loop (`pipeline.tick_loop.DeferredEmbedding`)
    # has a second set of tick switches, outside the loop: those take the table's last
    # row, the loop's the rows before it.
    loops = _tick_loops(module) if ticks is not None else []
    peeled = _last_tick_switches(module) if loops else []

    def rows_of(inst: Instruction) -> slice:
        return _rows_of(inst, bool(peeled))

    weights = tick_switch_shares(ticks, bool(peeled)) if ticks is not None else (
        lambda inst: None)

    def label(inst: Instruction, b: int) -> str | None:
        lane = _lane(inst)
        if lane is not None and ticks is not None and b < len(ticks.names):
            return f"lane {lane}: {ticks.names[b]}"
        if _is_head(inst):
            return "head phase" if b == 1 else "head phase (skipped)"
        return None

    walker = _Walker(module, chip, weights, label)
    total = walker.tally(module.entry)
    wait_s = 0.0
    if loops:
        # Each loop's work outside its switches, on its rows; a last tick run apart pays
        # the last loop's.
        work = np.zeros(ticks.branch.shape[:2])
        covered = np.zeros(ticks.branch.shape[0], bool)
        every, last_stop, last_outside = [], -1, 0.0
        for comp, inst, switches in loops:
            rows = rows_of(switches[0])
            trips = while_trip_count(module, comp, inst) or len(covered[rows])
            body = (called_computations(inst).get("body") or [""])[0]
            cond = (called_computations(inst).get("condition") or [""])[0]
            outside = walker.tally(body, skip=frozenset(s.name for s in switches)).seconds \
                + walker.tally(cond).seconds * (trips + 1) / max(trips, 1)
            work[rows] += outside
            covered[rows] = True
            every += switches
            stop = rows.indices(len(covered))[1]
            if stop > last_stop:  # the loop over the latest rows
                last_stop, last_outside = stop, outside
        work[~covered] += last_outside
        for switch in every + peeled:
            rows = rows_of(switch)
            costs = [b.seconds for b in walker.branches(switch, "")]
            lane = _lane(switch)
            if lane is not None and lane < ticks.branch.shape[2]:
                work[rows] += np.asarray(costs)[np.clip(ticks.branch[rows, :, lane], 0,
                                                        len(costs) - 1)]
            elif len(costs) == 2:  # the head phase: on its ticks, every stage
                work[rows] += np.where(ticks.head[rows], costs[1], costs[0])[:, None]
        replayed = replay_ticks(work, ticks).max()
        wait_s = max(0.0, replayed - work.sum(axis=0).mean())
    step_s = total.seconds + wait_s + exposed_s
    kernels = tuple((k, runs, where) for k, runs, where in total.kernels.values())
    return StepEstimate(
        step_ms=step_s * 1e3,
        mfu=model_flops / (step_s * chip.peak_bf16_flops) if step_s > 0 else 0.0,
        gemm_ms=total.gemm_s * 1e3, other_ms=total.other_s * 1e3,
        launch_ms=total.launches * LAUNCH_S * 1e3, wait_ms=wait_s * 1e3,
        exposed_ms=exposed_s * 1e3, model_flops=float(model_flops),
        gemm_flops=total.gemm_flops, kernels=kernels, chip=chip.name)


def format_estimate(est: StepEstimate, top: int = 0) -> list[str]:
    """Text lines for ``analyze``: the estimate and, with ``top``, the costliest non-GEMM
    kernels."""
    lines = [f"estimated step on one {est.chip}: {est.step_ms:.1f} ms, MFU {est.mfu:.3f} "
             f"(GEMMs {est.gemm_ms:.1f} ms, other kernels {est.other_ms:.1f} ms, launches "
             f"{est.launch_ms:.1f} ms, waits {est.wait_ms:.1f} ms, exposed communication "
             f"{est.exposed_ms:.1f} ms; GEMM FLOPs "
             f"{est.gemm_flops / max(est.model_flops, 1):.2f}x the model's)"]
    if est.expected_ms is not None:
        lines.append(f"expected at measured kernel rates: {est.expected_ms:.1f} ms, MFU "
                     f"{est.expected_mfu:.3f} (GEMMs, fused attention and other kernels at the "
                     f"shares of peak measured on a traced H200 step: docs/results.md)")
    if top:
        lines.append(f"costliest non-GEMM kernels ({'ms/step':>8s}, runs, MiB each, what):")
        for row in est.top(top):
            lines.append(f"  {row['ms']:9.2f} {row['executions']:7.1f} {row['mib']:9.1f}  "
                         f"{row['op']} [{row['where']}]")
    return lines
