"""Parser for compiled HLO text: modules, shapes, and how often each computation runs.

Input is ``jax.jit(f).lower(...).compile().as_text()`` -- from the CPU backend or from a
deviceless GPU compile (:mod:`jax_overlap.analysis.deviceless`). :func:`parse_module`
turns it into an :class:`HloModule` of :class:`Computation` s of :class:`Instruction` s,
in printed order; in a scheduled module (``is_scheduled=true``) that is the execution
order on one stream.

Shapes: :func:`array_shapes`, :func:`shape_bytes` (sub-byte types fractional, tuples
summed), :func:`tuple_elements`, :func:`operand_shape`.

Calls: :func:`called_computations` (``calls``, ``body``, ``branch_computations``...)
and :func:`execution_counts`, which makes counts per step: a ``while`` body runs once
per iteration (:func:`while_trip_count`: ``known_trip_count`` from the loop's
``backend_config``, else derived from the condition's compare against a constant and
the induction variable's initial value); nested loops multiply.

The GEMMs of a module are :mod:`jax_overlap.analysis.hlo_gemms`, its collectives
:mod:`jax_overlap.analysis.hlo_collectives`, the report on them
:mod:`jax_overlap.analysis.hlo_report`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

# Bytes per element of HLO element types; sub-byte types are fractional.
_DTYPE_BYTES: Mapping[str, float] = {
    "pred": 1, "s1": 0.125, "u1": 0.125, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5,
    "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f4e2m1fn": 0.5, "f8e8m0fnu": 1, "token": 0, "opaque": 0,
}


# ----------------------------------------------------------------------------- parse


@dataclass(frozen=True)
class Instruction:
    """One HLO instruction as printed.

    Attributes:
      name: instruction name without ``%``.
      opcode: e.g. ``all-reduce-start``.
      shape: result shape text, e.g. ``(f32[8]{0}, s32[])``.
      operands: operand names (for ``constant`` and other literal ops: the literal).
      operand_shapes: shape printed in front of each operand (older printers), or None.
      attributes: raw text after the operand list (``channel_id=1, ...``).
      is_root: whether the line starts with ``ROOT``.
      position: index in its computation (the schedule order if scheduled).
    """

    name: str
    opcode: str
    shape: str
    operands: tuple[str, ...]
    operand_shapes: tuple[str | None, ...]
    attributes: str
    is_root: bool
    position: int


@dataclass(frozen=True)
class Computation:
    """One HLO computation.

    Attributes:
      name: computation name without ``%``.
      instructions: instructions in printed (schedule) order.
      is_entry: whether it is the ENTRY computation.
    """

    name: str
    instructions: tuple[Instruction, ...]
    is_entry: bool
    _by_name: Mapping[str, Instruction] = field(default_factory=dict, repr=False)

    def get(self, name: str) -> Instruction | None:
        """Instruction by name, or None."""
        return self._by_name.get(name)

    @property
    def root(self) -> Instruction | None:
        """The ROOT instruction (the last one if none is marked)."""
        for inst in self.instructions:
            if inst.is_root:
                return inst
        return self.instructions[-1] if self.instructions else None


@dataclass(frozen=True)
class HloModule:
    """A parsed HLO module.

    Attributes:
      name: module name.
      is_scheduled: ``is_scheduled=true`` in the header.
      num_partitions: from the header (1 when absent).
      replica_count: from the header (1 when absent).
      computations: name -> :class:`Computation`, in printed order.
      entry: name of the ENTRY computation.
    """

    name: str
    is_scheduled: bool
    num_partitions: int
    replica_count: int
    computations: Mapping[str, Computation]
    entry: str


def _structure(text: str, start: int = 0):
    """Yields ``(index, char, depth)`` for characters outside double-quoted strings.

    Tracks ``()``, ``{}``, ``[]`` and strings (with escapes), so JSON in ``backend_config``
    and quoted metadata do not confuse the walkers below. ``depth`` is the nesting after
    an opening bracket and before a closing one.
    """
    depth = 0
    i = start
    in_str = False
    while i < len(text):
        ch = text[i]
        if in_str:
            if ch == "\\":
                i += 2
                continue
            if ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        else:
            if ch in "({[":
                depth += 1
            yield i, ch, depth
            if ch in ")}]":
                depth -= 1
        i += 1


def scan_balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at ``text[start]``."""
    for i, ch, depth in _structure(text, start):
        if ch in ")}]" and depth == 1:
            return i + 1
    return len(text)


def _split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split on ``sep`` outside brackets and strings."""
    parts: list[str] = []
    cur_start = 0
    for i, ch, depth in _structure(text):
        if ch == sep and depth == 0:
            parts.append(text[cur_start:i])
            cur_start = i + 1
    parts.append(text[cur_start:])
    return [p.strip() for p in parts if p.strip()]


_COMMENT_RE = re.compile(r"/\*.*?\*/")
_HEADER_RE = re.compile(r"^\s*HloModule\s+([^\s,]+)(.*)$")
_COMP_RE = re.compile(r"^\s*(ENTRY\s+)?%?([^\s(]+)\s*(\(.*\)\s*->\s*.*)?\{\s*$")
_INSTR_RE = re.compile(r"^\s*(ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_OPCODE_RE = re.compile(r"\s*([a-z][a-z0-9\-_]*)\(")


def _parse_operand(text: str) -> tuple[str, str | None]:
    """Split ``[shape] %name`` into (name, shape or None)."""
    text = _COMMENT_RE.sub("", text).strip()
    match = re.search(r"%([^\s,()]+)\s*$", text)
    if match:
        shape = text[: match.start()].strip() or None
        return match.group(1), shape
    return text, None


def _parse_instruction(line: str, position: int) -> Instruction | None:
    """Parse one instruction line, or None if the line is not one."""
    match = _INSTR_RE.match(line)
    if not match:
        return None
    is_root, name, rest = bool(match.group(1)), match.group(2), match.group(3)
    rest = rest.lstrip()
    if rest.startswith("("):
        end = scan_balanced(rest, 0)
    else:
        end = rest.find(" ")
        if end < 0:
            return None
    shape, rest = rest[:end], rest[end:]
    op = _OPCODE_RE.match(rest)
    if not op:
        return None
    open_at = op.end() - 1
    close_at = scan_balanced(rest, open_at)
    operand_text = rest[open_at + 1 : close_at - 1]
    parsed = [_parse_operand(p) for p in _split_top_level(operand_text)]
    attributes = rest[close_at:].lstrip(", ").strip()
    return Instruction(
        name=name,
        opcode=op.group(1),
        shape=_COMMENT_RE.sub("", shape),
        operands=tuple(p[0] for p in parsed),
        operand_shapes=tuple(p[1] for p in parsed),
        attributes=attributes,
        is_root=is_root,
        position=position,
    )


def parse_module(text: str) -> HloModule:
    """Parse HLO module text (``compiled.as_text()``).

    Args:
      text: the module text.

    Returns:
      :class:`HloModule`.

    Raises:
      ValueError: no computation found.
    """
    name, is_scheduled, partitions, replicas = "", False, 1, 1
    computations: dict[str, Computation] = {}
    entry = ""
    current: tuple[str, bool] | None = None
    instructions: list[Instruction] = []
    for line in text.splitlines():
        if current is None:
            header = _HEADER_RE.match(line)
            if header:
                name = header.group(1)
                is_scheduled = "is_scheduled=true" in header.group(2)
                part = re.search(r"num_partitions=(\d+)", header.group(2))
                repl = re.search(r"replica_count=(\d+)", header.group(2))
                partitions = int(part.group(1)) if part else 1
                replicas = int(repl.group(1)) if repl else 1
                continue
            comp = _COMP_RE.match(line)
            if comp and "=" not in line.split("(", 1)[0]:
                current = (comp.group(2), bool(comp.group(1)))
                instructions = []
            continue
        if line.strip().startswith("}"):
            comp_name, is_entry = current
            computations[comp_name] = Computation(
                name=comp_name,
                instructions=tuple(instructions),
                is_entry=is_entry,
                _by_name={i.name: i for i in instructions},
            )
            if is_entry:
                entry = comp_name
            current = None
            continue
        inst = _parse_instruction(line, len(instructions))
        if inst is not None:
            instructions.append(inst)
    if not computations:
        raise ValueError("no HLO computation found in the text")
    if not entry:
        entry = next(reversed(computations))
    return HloModule(name, is_scheduled, partitions, replicas, computations, entry)


def parse_attributes(attributes: str) -> dict[str, str]:
    """Split an instruction's attribute text into ``key -> raw value``."""
    out: dict[str, str] = {}
    for part in _split_top_level(attributes):
        key, sep, value = part.partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out


def operand_shape(comp: Computation, inst: Instruction, i: int) -> str | None:
    """Shape text of operand ``i``: printed inline, or its defining instruction's."""
    if i < len(inst.operand_shapes) and inst.operand_shapes[i]:
        return inst.operand_shapes[i]
    if i < len(inst.operands):
        src = comp.get(inst.operands[i])
        if src is not None:
            return src.shape
    return None


# ----------------------------------------------------------------------------- shapes


def array_shapes(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """Every array leaf of a (possibly tuple) shape, as (dtype, dims)."""
    leaves = []
    for dtype, dims in re.findall(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]", _COMMENT_RE.sub("", shape)):
        sizes = tuple(int(d.replace("<=", "")) for d in dims.split(",") if d.strip())
        leaves.append((dtype, sizes))
    return leaves


def element_bytes(dtype: str) -> float:
    """Bytes per element of an HLO element type (every 8-bit float is 1 byte)."""
    if dtype in _DTYPE_BYTES:
        return _DTYPE_BYTES[dtype]
    if dtype.startswith("f8"):
        return 1
    raise ValueError(f"unknown HLO element type {dtype!r}")


def shape_bytes(shape: str) -> int:
    """Total bytes of a shape's array leaves (tuples summed)."""
    total = 0.0
    for dtype, dims in array_shapes(shape):
        total += element_bytes(dtype) * math.prod(dims)
    return int(math.ceil(total))


def tuple_elements(shape: str) -> list[str]:
    """Top-level elements of a tuple shape; a non-tuple shape is one element."""
    shape = _COMMENT_RE.sub("", shape).strip()
    if shape.startswith("(") and shape.endswith(")"):
        return _split_top_level(shape[1:-1])
    return [shape]


# ----------------------------------------------------------------------------- calls

_CALL_KEYS = (
    "calls", "to_apply", "condition", "body", "branch_computations",
    "true_computation", "false_computation", "called_computations",
)


def called_computations(inst: Instruction) -> dict[str, list[str]]:
    """Computations an instruction calls, grouped by attribute (``calls``, ``body``...)."""
    attrs = parse_attributes(inst.attributes)
    out: dict[str, list[str]] = {}
    for key in _CALL_KEYS:
        if key in attrs:
            out[key] = re.findall(r"%?([\w.\-]+)", attrs[key].strip("{}"))
    return out


def branch_computations(calls: Mapping[str, list[str]]) -> list[str]:
    """A `conditional`'s branches in index order, from its `called_computations`: an index
    conditional names them (`branch_computations`); a predicate one (XLA rewrites a
    two-branch `lax.cond` so) has a false (index 0) and a true (index 1) computation."""
    return (calls.get("branch_computations")
            or calls.get("false_computation", []) + calls.get("true_computation", []))


def _int_literal(inst: Instruction) -> int | None:
    """Value of a scalar integer ``constant``, else None."""
    if inst.opcode != "constant" or not inst.operands:
        return None
    try:
        return int(inst.operands[0])
    except ValueError:
        return None


def _trace(module: HloModule, comp: Computation, name: str,
           bindings: Mapping[int, tuple[Computation, str]] | None = None
           ) -> tuple[str, int] | None:
    """Follow a scalar value back to a constant or a tuple element of the parameter.

    Args:
      module: the module.
      comp: computation ``name`` lives in.
      name: instruction name.
      bindings: for a fused computation, parameter number -> (outer computation,
        operand name) of the fusion instruction.

    Returns:
      ``("const", value)``, ``("gte", tuple index)`` or None.
    """
    inst = comp.get(name)
    for _ in range(64):
        if inst is None:
            return None
        value = _int_literal(inst)
        if value is not None:
            return ("const", value)
        if inst.opcode == "get-tuple-element":
            index = re.search(r"index=(\d+)", inst.attributes)
            return ("gte", int(index.group(1))) if index else None
        if inst.opcode == "parameter" and bindings is not None:
            number = int(inst.operands[0])
            if number not in bindings:
                return None
            outer, outer_name = bindings[number]
            return _trace(module, outer, outer_name)
        if inst.opcode in ("copy", "convert", "bitcast", "reshape") and inst.operands:
            inst = comp.get(inst.operands[0])
            continue
        return None
    return None


def _find_compare(module: HloModule, comp: Computation
                  ) -> tuple[Computation, Instruction, dict] | None:
    """The compare deciding a loop condition, through one level of fusion."""
    root = comp.root
    if root is None:
        return None
    if root.opcode == "compare":
        return comp, root, {}
    if root.opcode == "fusion":
        called = called_computations(root).get("calls", [])
        if called and called[0] in module.computations:
            fused = module.computations[called[0]]
            inner = fused.root
            if inner is not None and inner.opcode == "compare":
                bindings = {i: (comp, op) for i, op in enumerate(root.operands)}
                return fused, inner, bindings
    return None


def while_trip_count(module: HloModule, comp: Computation, inst: Instruction) -> int | None:
    """Iterations of a ``while`` instruction, or None when it cannot be told.

    Uses ``known_trip_count`` from ``backend_config`` when XLA wrote it; otherwise
    reads the condition ``compare(induction variable, constant)`` (``LT``, ``LE``,
    ``GT``, ``GE``, ``NE``) and the induction variable's constant initial value from
    the loop's input tuple, assuming a step of 1 (``known_init_step`` overrides both).

    Args:
      module: the module.
      comp: computation holding the loop.
      inst: the ``while`` instruction.

    Returns:
      Trip count, or None.
    """
    known = re.search(r'known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"(-?\d+)',
                      inst.attributes)
    if known:
        return int(known.group(1))
    calls = called_computations(inst)
    cond_name = (calls.get("condition") or [None])[0]
    if cond_name not in module.computations:
        return None
    found = _find_compare(module, module.computations[cond_name])
    if found is None:
        return None
    cmp_comp, cmp, bindings = found
    direction = re.search(r"direction=(\w+)", cmp.attributes)
    if not direction or len(cmp.operands) != 2:
        return None
    lhs = _trace(module, cmp_comp, cmp.operands[0], bindings or None)
    rhs = _trace(module, cmp_comp, cmp.operands[1], bindings or None)
    flip = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE", "NE": "NE", "EQ": "EQ"}
    op = direction.group(1)
    if lhs and rhs and lhs[0] == "const" and rhs[0] == "gte":
        lhs, rhs, op = rhs, lhs, flip.get(op, op)
    if not (lhs and rhs and lhs[0] == "gte" and rhs[0] == "const"):
        return None
    index, limit = lhs[1], rhs[1]
    init, step = 0, 1
    init_step = re.search(
        r'known_init_step\\?"\s*:\s*\{\s*\\?"init\\?"\s*:\s*\\?"(-?\d+)\\?"\s*,\s*'
        r'\\?"step\\?"\s*:\s*\\?"(-?\d+)', inst.attributes)
    if init_step:
        init, step = int(init_step.group(1)), int(init_step.group(2))
    else:
        loop_input = comp.get(inst.operands[0]) if inst.operands else None
        if (loop_input is not None and loop_input.opcode == "tuple"
                and index < len(loop_input.operands)):
            traced = _trace(module, comp, loop_input.operands[index])
            if traced and traced[0] == "const":
                init = traced[1]
    if op in ("GT", "GE"):
        step = -abs(step)
    if step == 0:
        return None
    span = {"LT": limit - init, "LE": limit - init + 1, "NE": limit - init,
            "GT": init - limit, "GE": init - limit + 1}.get(op)
    if span is None:
        return None
    return max(0, math.ceil(span / abs(step)))


def execution_counts(module: HloModule, branch_frequencies: Sequence[float] | None = None
                     ) -> tuple[dict[str, float], list[str]]:
    """How often each computation runs per execution of the entry computation.

    ``while`` bodies run ``trip count`` times per execution of their caller
    (conditions one more); ``call``, ``conditional`` branches (an upper bound: each
    branch counted as if taken), async and fusion computations once. Reducers
    (``to_apply``) are not counted.

    Args:
      module: the module.
      branch_frequencies: for a ``conditional`` with exactly this many branches, the
        share of its executions that take each branch (a pipeline's tick table knows
        it: the share of (tick, stage) entries running each action, averaged over
        stages); branch ``b`` then counts its caller's executions times ``[b]``. Or a
        function of the conditional giving those shares (or None), where they differ
        from one conditional to another (`analysis.analyze.switch_weights`).

    Returns:
      (computation -> executions, warnings about loops whose trip count is unknown).
    """
    counts: dict[str, float] = {name: 0 for name in module.computations}
    warnings: list[str] = []
    order: list[tuple[str, int]] = [(module.entry, 1)]
    while order:
        name, times = order.pop()
        if name not in module.computations:
            continue
        counts[name] += times
        comp = module.computations[name]
        for inst in comp.instructions:
            calls = called_computations(inst)
            if inst.opcode == "while":
                trips = while_trip_count(module, comp, inst)
                if trips is None:
                    warnings.append(
                        f"trip count of {inst.name} in {name} unknown; its body is "
                        "counted once per execution")
                    trips = 1
                for body in calls.get("body", []):
                    order.append((body, times * trips))
                for cond in calls.get("condition", []):
                    order.append((cond, times * (trips + 1)))
                continue
            branches = branch_computations(calls) if inst.opcode == "conditional" else []
            shares = (branch_frequencies(inst) if callable(branch_frequencies)
                      else branch_frequencies)
            if (inst.opcode == "conditional" and shares is not None
                    and len(branches) == len(shares)):
                for callee, share in zip(branches, shares):
                    order.append((callee, times * share))
                continue
            for key, names in calls.items():
                if key == "to_apply" and inst.opcode != "call":
                    continue
                for callee in names:
                    order.append((callee, times))
    return counts, warnings
