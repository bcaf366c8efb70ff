"""The collectives of a parsed HLO module: who takes part, their bytes, what runs under them.

:func:`find_collectives` finds every collective (``all-reduce``, ``all-gather``,
``reduce-scatter``, ``collective-permute``, ``all-to-all``) in all the forms XLA prints:

* synchronous ops (every collective on CPU; on GPU the ones XLA turned back to
  synchronous because nothing could be scheduled beside them -- their
  ``backend_config`` says ``"is_sync":true``);
* ``<kind>-start`` / ``<kind>-done`` pairs;
* async wrappers: ``async-start`` / ``async-update`` / ``async-done`` and
  ``fusion-start`` / ``fusion-done`` whose called computation holds the collective
  (e.g. a ``__triton_collective`` fusion around a small GPU all-reduce);
* ``recv`` / ``recv-done`` from a collective-permute XLA decomposed into send/recv
  (counted as ``collective-permute``).

Byte convention (per device, per execution; :data:`BYTES_CONVENTION`): ``all-gather``
counts its output, ``reduce-scatter`` its input, every other kind its result (tuples
summed) -- i.e. always the larger, unsharded side, which is what a ring moves
``(n-1)/n`` of (:mod:`jax_overlap.hardware.collective_cost`). Counts are per step
(:func:`jax_overlap.analysis.hlo_parse.execution_counts`).

Participants: :func:`parse_replica_groups` reads every printed form of
``replica_groups`` (explicit, iota, mesh axes); a collective-permute has
``source_target_pairs`` instead.

For each asynchronous collective the record lists the instructions scheduled between
its start and done -- the instruction order of a scheduled module is the execution
order on one stream -- and which of them are GEMMs (:mod:`jax_overlap.analysis.hlo_gemms`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from jax_overlap.analysis.hlo_gemms import GemmWork, gemm_work
from jax_overlap.analysis.hlo_parse import (
    Computation,
    HloModule,
    Instruction,
    branch_computations,
    called_computations,
    execution_counts,
    operand_shape,
    scan_balanced,
    shape_bytes,
    tuple_elements,
)

COLLECTIVE_KINDS: tuple[str, ...] = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-permute",
    "all-to-all",
)
_OPCODE_KIND = {kind: kind for kind in COLLECTIVE_KINDS} | {
    "ragged-all-to-all": "all-to-all",
}

BYTES_CONVENTION = (
    "per device per execution: all-gather = output bytes, reduce-scatter = input "
    "bytes, others = result bytes (tuples summed); collective-permute result bytes "
    "x share of devices that receive"
)


# ----------------------------------------------------------------------------- groups


@dataclass(frozen=True)
class ReplicaGroups:
    """Who takes part in a collective.

    Attributes:
      groups: explicit device groups, or None when XLA printed a form this reader
        does not expand (sub-axes, a permuted mesh).
      group_size: devices per group (None only when nothing could be read).
      mesh_axes: mesh axis names, when XLA printed the ``mesh[...] {axes}`` form.
    """

    groups: tuple[tuple[int, ...], ...] | None
    group_size: int | None
    mesh_axes: tuple[str, ...] = ()


def _iota_groups(text: str) -> tuple[tuple[int, ...], ...] | None:
    """Expand ``[G,S]<=[dims]T(perm)`` (iota replica groups)."""
    match = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text.strip())
    if not match:
        return None
    out_shape = [int(x) for x in match.group(1).split(",")]
    dims = [int(x) for x in match.group(2).split(",")]
    perm = [int(x) for x in match.group(3).split(",")] if match.group(3) else list(range(len(dims)))
    ids = _transpose_iota(dims, perm)
    size = out_shape[-1]
    return tuple(tuple(ids[i : i + size]) for i in range(0, len(ids), size))


def _transpose_iota(dims: list[int], perm: list[int]) -> list[int]:
    """Flattened ``arange(prod(dims)).reshape(dims).transpose(perm)``."""
    strides = [math.prod(dims[i + 1 :]) for i in range(len(dims))]
    new_dims = [dims[p] for p in perm]
    out = []
    for flat in range(math.prod(dims)):
        index = []
        rem = flat
        for size in reversed(new_dims):
            index.append(rem % size)
            rem //= size
        index.reverse()
        out.append(sum(index[k] * strides[perm[k]] for k in range(len(perm))))
    return out


def _participants(attributes: str, num_devices: int) -> ReplicaGroups:
    """Replica groups of a collective; none for collective-permute (it has pairs)."""
    if "source_target_pairs=" in attributes or "_xla_send_recv_source_target_pairs" in attributes:
        return ReplicaGroups(None, None)
    return parse_replica_groups(attributes, num_devices)


def parse_replica_groups(attributes: str, num_devices: int) -> ReplicaGroups:
    """Read ``replica_groups`` in any of XLA's printed forms.

    Forms: explicit ``{{0,1},{2,3}}``; empty ``{}`` (all devices); iota
    ``[2,4]<=[8]`` / ``[2,4]<=[4,2]T(1,0)``; mesh axes ``mesh['d'=2,'t'=4] {'t'}``
    (jaxlib 0.11+), optionally with sub-axes ``'t':(1)2`` or ``device_ids=(...)``.

    Args:
      attributes: the instruction's attribute text.
      num_devices: devices in the program (for the empty form).

    Returns:
      :class:`ReplicaGroups`.
    """
    match = re.search(r"replica_groups=", attributes)
    if not match:
        return ReplicaGroups(None, num_devices)
    rest = attributes[match.end():]
    if rest.startswith("mesh"):
        mesh = re.match(r"mesh\[([^\]]*)\](,\s*device_ids=\([^)]*\))?\s*\{([^}]*)\}", rest)
        if not mesh:
            return ReplicaGroups(None, None)
        axes = [(n.strip("'\""), int(s)) for n, s in re.findall(r"([^,=\s]+)=(\d+)", mesh.group(1))]
        names = [n for n, _ in axes]
        sizes = dict(axes)
        chosen = [a.strip() for a in mesh.group(3).split(",") if a.strip()]
        group_size, plain, picked = 1, True, []
        for ref in chosen:
            sub = re.match(r"['\"]?([^'\":]+)['\"]?:\((\d+)\)(\d+)", ref)
            if sub:
                plain = False
                picked.append(sub.group(1))
                group_size *= int(sub.group(3))
            else:
                axis = ref.strip("'\"")
                picked.append(axis)
                group_size *= sizes.get(axis, 1)
        groups = None
        if plain and not mesh.group(2) and all(a in sizes for a in picked):
            keep = [i for i, n in enumerate(names) if n not in picked]
            perm = keep + [names.index(a) for a in picked]
            ids = _transpose_iota([sizes[n] for n in names], perm)
            groups = tuple(tuple(ids[i : i + group_size]) for i in range(0, len(ids), group_size))
        return ReplicaGroups(groups, group_size, tuple(dict.fromkeys(picked)))
    if rest.startswith("["):
        groups = _iota_groups(rest)
        return ReplicaGroups(groups, len(groups[0]) if groups else None)
    if rest.startswith("{"):
        end = scan_balanced(rest, 0)
        inner = rest[1 : end - 1].strip()
        if not inner:
            return ReplicaGroups(None, num_devices)
        groups = tuple(
            tuple(int(x) for x in g.split(",") if x.strip())
            for g in re.findall(r"\{([\d,\s]*)\}", inner))
        return ReplicaGroups(groups, len(groups[0]) if groups else None)
    return ReplicaGroups(None, None)


def _pairs_after(attributes: str, key: str) -> tuple[tuple[int, int], ...] | None:
    """Pairs ``{{a,b},...}`` following ``key=`` (optionally quoted), or None."""
    match = re.search(rf"(?<![\w]){key}=\"?", attributes)
    if not match or match.end() >= len(attributes) or attributes[match.end()] != "{":
        return None
    end = scan_balanced(attributes, match.end())
    return tuple((int(a), int(b)) for a, b in
                 re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", attributes[match.end():end]))


def _source_target_pairs(attributes: str) -> tuple[tuple[int, int], ...] | None:
    """A collective-permute's pairs, from its attribute or (send/recv) frontend attribute."""
    pairs = _pairs_after(attributes, "source_target_pairs")
    if pairs is None:
        pairs = _pairs_after(attributes, "_xla_send_recv_source_target_pairs")
    return pairs


def _permute_share(pairs: tuple[tuple[int, int], ...] | None, num_devices: int) -> float:
    """Fraction of devices that receive in a collective-permute (1 when unknown).

    XLA splits a ring ``ppermute`` into a forward and a backward send/recv (pairs
    ``{0->1..6->7}`` and ``{7->0}``); weighting each by its receivers keeps the
    per-device average equal to the undivided permute's.
    """
    if not pairs or num_devices <= 0:
        return 1.0
    return min(1.0, len({target for _, target in pairs}) / num_devices)


# ----------------------------------------------------------------------------- collectives


@dataclass(frozen=True)
class CollectiveOp:
    """One collective in the compiled program.

    Attributes:
      kind: one of :data:`COLLECTIVE_KINDS`.
      name: the instruction that starts it (the op itself when synchronous).
      computation: computation it is scheduled in.
      form: ``sync``, ``start-done``, ``async-wrapper`` (``async-start`` /
        ``fusion-start`` around it) or ``send-recv``.
      is_async: whether it runs asynchronously (False for ``is_sync`` pairs).
      bytes: bytes per execution (see :data:`BYTES_CONVENTION`).
      executions_per_step: times it runs per execution of the entry computation.
      replica_groups: participants.
      source_target_pairs: for collective-permute.
      scheduled_between: instructions between start and done, in schedule order.
      gemms_between: GEMM-like ones among them.
      done_found: False when the done is in another computation (pipelined across
        loop iterations), so ``scheduled_between`` is unknown.
    """

    kind: str
    name: str
    computation: str
    form: str
    is_async: bool
    bytes: int
    executions_per_step: float
    replica_groups: ReplicaGroups
    source_target_pairs: tuple[tuple[int, int], ...] | None = None
    scheduled_between: tuple[str, ...] = ()
    gemms_between: tuple[GemmWork, ...] = ()
    done_found: bool = True

    @property
    def bytes_per_step(self) -> int:
        """Bytes moved per step: bytes x executions."""
        return self.bytes * self.executions_per_step

    @property
    def gemm_flops_between(self) -> float:
        """FLOPs of the GEMMs scheduled between start and done."""
        return sum(g.flops for g in self.gemms_between)

    @property
    def under_gemm(self) -> bool:
        """Async with at least one GEMM between start and done."""
        return self.is_async and bool(self.gemms_between)

    @property
    def under_share(self) -> float:
        """The share of its executions that run under a GEMM: 1 with a GEMM between start
        and done; with only conditionals there, the share of executions in which one of
        them takes a branch holding one (`cover_cases`); 0 when synchronous."""
        if not self.under_gemm:
            return 0.0
        return sum(p for p, s in cover_cases(self.gemms_between, lambda g, f: f) if s > 0)

    @property
    def under_gemm_bytes(self) -> float:
        """Bytes per step moved under GEMMs: `bytes_per_step` times `under_share`."""
        return self.bytes_per_step * self.under_share


def _is_sync_config(inst: Instruction) -> bool:
    return bool(re.search(r'is_sync\\?"\s*:\s*true', inst.attributes))


def _collective_inside(module: HloModule, comp_names: Iterable[str], depth: int = 0
                       ) -> tuple[Computation, Instruction] | None:
    """First collective op inside the given computations (searching nested calls)."""
    if depth > 8:
        return None
    for name in comp_names:
        comp = module.computations.get(name)
        if comp is None:
            continue
        for inst in comp.instructions:
            if inst.opcode in _OPCODE_KIND:
                return comp, inst
            calls = called_computations(inst)
            nested = calls.get("calls", [])
            if nested:
                found = _collective_inside(module, nested, depth + 1)
                if found:
                    return found
    return None


def _collective_bytes(comp: Computation, inst: Instruction, kind: str, result_shape: str,
                      num_devices: int) -> int:
    """Bytes by :data:`BYTES_CONVENTION`: reduce-scatter its inputs, others their result.

    A collective-permute's result bytes are weighted by the share of devices that
    receive (see :func:`_permute_share`).
    """
    if kind == "reduce-scatter":
        shapes = [operand_shape(comp, inst, i) for i in range(len(inst.operands))]
        if all(shapes):
            return sum(shape_bytes(s) for s in shapes)
    if kind == "collective-permute":
        share = _permute_share(_source_target_pairs(inst.attributes), num_devices)
        return math.ceil(shape_bytes(result_shape) * share)
    return shape_bytes(result_shape)


def _users(comp: Computation) -> dict[str, list[Instruction]]:
    users: dict[str, list[Instruction]] = {}
    for inst in comp.instructions:
        for operand in inst.operands:
            users.setdefault(operand, []).append(inst)
    return users


def _find_done(comp: Computation, users: Mapping[str, list[Instruction]],
               start: Instruction, done_opcodes: tuple[str, ...]) -> Instruction | None:
    """Follow ``*-update`` links from a start to its done in the same computation."""
    current = start
    for _ in range(32):
        nxt = None
        for user in users.get(current.name, []):
            if user.opcode in done_opcodes:
                return user
            if user.opcode.endswith("-update"):
                nxt = user
        if nxt is None:
            return None
        current = nxt
    return None


def _control_flow_computations(module: HloModule) -> list[str]:
    """Computations that are executed as schedules (entry, loop bodies, calls, branches)."""
    seen: list[str] = []
    stack = [module.entry]
    while stack:
        name = stack.pop()
        if name in seen or name not in module.computations:
            continue
        seen.append(name)
        for inst in module.computations[name].instructions:
            calls = called_computations(inst)
            if inst.opcode == "while":
                stack += calls.get("body", []) + calls.get("condition", [])
            elif inst.opcode == "call":
                stack += calls.get("to_apply", []) + calls.get("calls", [])
            elif inst.opcode == "conditional":
                stack += (calls.get("branch_computations", []) + calls.get("true_computation", [])
                          + calls.get("false_computation", []))
    return seen


def find_collectives(module: HloModule, branch_frequencies: Sequence[float] | None = None
                     ) -> tuple[list[CollectiveOp], list[str]]:
    """Every collective of a module with its schedule neighbourhood.

    Args:
      module: a parsed module.
      branch_frequencies: see :func:`execution_counts`.

    Returns:
      (collectives in computation/schedule order, warnings).
    """
    counts, warnings = execution_counts(module, branch_frequencies)
    num_devices = module.num_partitions * module.replica_count
    found: list[CollectiveOp] = []
    for comp_name in _control_flow_computations(module):
        comp = module.computations[comp_name]
        users = _users(comp)
        for inst in comp.instructions:
            record = _classify(module, comp, users, inst, num_devices, counts)
            if record is None:
                continue
            if not record.done_found:
                warnings.append(
                    f"{record.name}: done not in {comp_name} (pipelined across iterations); "
                    "nothing is known about what overlaps it")
            found.append(record)
    return found, warnings


def _classify(module: HloModule, comp: Computation, users: Mapping[str, list[Instruction]],
              inst: Instruction, num_devices: int, counts: Mapping[str, float]
              ) -> CollectiveOp | None:
    """A :class:`CollectiveOp` if ``inst`` starts (or is) a collective, else None
    (`counts`: each computation's executions per step, `execution_counts`)."""
    executions = counts[comp.name]
    opcode = inst.opcode
    kind = _OPCODE_KIND.get(opcode)
    if kind is not None:
        return CollectiveOp(
            kind=kind, name=inst.name, computation=comp.name, form="sync", is_async=False,
            bytes=_collective_bytes(comp, inst, kind, inst.shape, num_devices),
            executions_per_step=executions,
            replica_groups=_participants(inst.attributes, num_devices),
            source_target_pairs=_source_target_pairs(inst.attributes))
    base = opcode[: -len("-start")] if opcode.endswith("-start") else None
    if base in _OPCODE_KIND:
        kind = _OPCODE_KIND[base]
        done = _find_done(comp, users, inst, (f"{base}-done",))
        result = done.shape if done is not None else (tuple_elements(inst.shape)[-1])
        return _async_record(module, comp, inst, done, kind, "start-done",
                             _collective_bytes(comp, inst, kind, result, num_devices),
                             inst, num_devices, counts)
    if opcode in ("async-start", "fusion-start", "fusion", "custom-call") or (
            base is not None and "calls=" in inst.attributes):
        inner = _collective_inside(module, called_computations(inst).get("calls", []))
        if inner is None:
            return None
        inner_comp, inner_inst = inner
        kind = _OPCODE_KIND[inner_inst.opcode]
        size = _collective_bytes(inner_comp, inner_inst, kind, inner_inst.shape, num_devices)
        if opcode in ("fusion", "custom-call"):
            return CollectiveOp(
                kind=kind, name=inst.name, computation=comp.name, form="sync",
                is_async=False, bytes=size, executions_per_step=executions,
                replica_groups=_participants(inner_inst.attributes, num_devices),
                source_target_pairs=_source_target_pairs(inner_inst.attributes))
        done_ops = ("async-done", "fusion-done") if base is None else (f"{base}-done",)
        done = _find_done(comp, users, inst, done_ops + ("async-done",))
        return _async_record(module, comp, inst, done, kind, "async-wrapper", size,
                             inner_inst, num_devices, counts)
    if opcode == "recv" and "is_host_transfer=true" not in inst.attributes:
        done = _find_done(comp, users, inst, ("recv-done",))
        data = tuple_elements(inst.shape)[0]
        share = _permute_share(_source_target_pairs(inst.attributes), num_devices)
        return _async_record(module, comp, inst, done, "collective-permute", "send-recv",
                             math.ceil(shape_bytes(data) * share), inst, num_devices,
                             counts)
    return None


def _branch_work(module: HloModule, comp: Computation, inst: Instruction,
                 counts: Mapping[str, float]) -> GemmWork | None:
    """The GEMM work a `conditional` does per execution, or None if no branch has any: its
    branches' FLOPs weighted by the share of its executions that take each (`counts`, from
    the pipeline's tick table where it knows them), and (share, FLOPs) of every branch in
    index order. A collective around the head phase's cond is under GEMMs only on the
    ticks that have a head."""
    runs = counts.get(comp.name, 0)
    flops, dtype, branches = 0.0, "", []
    for branch in branch_computations(called_computations(inst)):
        inner = module.computations.get(branch)
        works = [] if inner is None else [
            w for w in (gemm_work(module, inner, i) for i in inner.instructions)
            if w is not None]
        taken = min(1.0, counts.get(branch, 0) / runs) if runs else 1.0
        work = sum(w.flops for w in works)
        branches.append((taken, work))
        if works:
            flops += taken * work
            dtype = dtype or works[0].dtype
    if not dtype:
        return None
    return GemmWork(inst.name, flops, dtype, branches=tuple(branches))


def cover_cases(gemms: Sequence[GemmWork], seconds) -> list[tuple[float, float]]:
    """(probability, seconds of GEMMs) of what runs under one execution of a collective with
    `gemms` between its start and done (`seconds(work, flops)`: a GEMM's time). Plain GEMMs
    run every time. Conditionals taken by the same shares are switches on the same row of
    the tick table (a lane's two switches: an action runs in one, the other skips), so a
    tick takes the same branch index in each; conditionals taken otherwise are independent."""
    fixed = sum(seconds(g, g.flops) for g in gemms if not g.branches)
    groups: dict[tuple, list[GemmWork]] = {}
    for g in gemms:
        if g.branches:
            groups.setdefault(tuple(round(p, 9) for p, _ in g.branches), []).append(g)
    cases = [(1.0, fixed)]
    for shares, members in groups.items():
        options = [(p, sum(seconds(g, g.branches[i][1]) for g in members))
                   for i, p in enumerate(shares)]
        rest = 1.0 - sum(shares)
        if rest > 1e-9:
            options.append((rest, 0.0))
        cases = [(p * q, s + u) for p, s in cases for q, u in options if p * q > 0]
        if len(cases) > 4096:  # many independent conditionals: their average instead
            cases = [(1.0, sum(p * s for p, s in cases))]
    return cases


def _async_record(module: HloModule, comp: Computation, start: Instruction,
                  done: Instruction | None, kind: str, form: str, size: int,
                  described: Instruction, num_devices: int, counts: Mapping[str, float]
                  ) -> CollectiveOp:
    """Build the record of an async collective, with what is scheduled inside it."""
    between: tuple[Instruction, ...] = ()
    if done is not None:
        between = comp.instructions[start.position + 1 : done.position]
    gemms = tuple(w for w in (_branch_work(module, comp, i, counts) if i.opcode == "conditional"
                              else gemm_work(module, comp, i) for i in between)
                  if w is not None)
    executions = counts[comp.name]
    pairs = _source_target_pairs(described.attributes)
    return CollectiveOp(
        kind=kind, name=start.name, computation=comp.name, form=form,
        is_async=not (_is_sync_config(start) or (done is not None and _is_sync_config(done))),
        bytes=size, executions_per_step=executions,
        replica_groups=_participants(described.attributes, num_devices),
        source_target_pairs=pairs,
        scheduled_between=tuple(i.name for i in between),
        gemms_between=gemms,
        done_found=done is not None)
