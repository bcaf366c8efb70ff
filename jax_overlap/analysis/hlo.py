"""Static reader for compiled HLO text: collectives, their schedule, and what hides them.

Input is ``jax.jit(f).lower(...).compile().as_text()`` -- from the CPU backend or
from a deviceless GPU compile (:mod:`jax_overlap.analysis.deviceless`). The reader
finds every collective (``all-reduce``, ``all-gather``, ``reduce-scatter``,
``collective-permute``, ``all-to-all``) in all the forms XLA prints:

* synchronous ops (every collective on CPU; on GPU the ones XLA turned back to
  synchronous because nothing could be scheduled beside them -- their
  ``backend_config`` says ``"is_sync":true``);
* ``<kind>-start`` / ``<kind>-done`` pairs;
* async wrappers: ``async-start`` / ``async-update`` / ``async-done`` and
  ``fusion-start`` / ``fusion-done`` whose called computation holds the collective
  (e.g. a ``__triton_collective`` fusion around a small GPU all-reduce);
* ``recv`` / ``recv-done`` from a collective-permute XLA decomposed into send/recv
  (counted as ``collective-permute``).

Byte convention (per device, per execution): ``all-gather`` counts its output,
``reduce-scatter`` its input, every other kind its result (tuples summed) -- i.e.
always the larger, unsharded side, which is what a ring moves ``(n-1)/n`` of.

Counts are per step: a collective in a ``while`` body counts once per iteration
(``known_trip_count`` from the loop's ``backend_config``, else derived from the
condition's compare against a constant and the induction variable's initial
value); nested loops multiply.

For each asynchronous collective the reader lists the instructions scheduled
between its start and done -- the instruction order of a scheduled module
(``is_scheduled=true``) is the execution order on one stream -- and which of them
are GEMMs: ``dot``/``convolution``, cuBLAS/cuDNN custom-calls (``__cublas$gemm``,
``__cublas$lt$matmul``, ``__cudnn$...``), and fusions/calls whose computation holds a
``dot`` or ``convolution`` (Triton gemm fusions, ``kind=kCustom``), with FLOPs
``2 x prod(output dims) x prod(contracting dims)``.

What XLA's GPU pipeline did with the programs this reader was built on (which passes
move collectives, which flags counter them, per jaxlib version): ``docs/xla_notes.md``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jax_overlap.analysis.costs import collective_seconds
from jax_overlap.analysis.machine import ChipSpec, LinkModel, chip_spec

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

# Bytes per element of HLO element types; sub-byte types are fractional.
_DTYPE_BYTES: Mapping[str, float] = {
    "pred": 1, "s1": 0.125, "u1": 0.125, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5,
    "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f4e2m1fn": 0.5, "f8e8m0fnu": 1, "token": 0, "opaque": 0,
}

_GEMM_CUSTOM_CALL = re.compile(r"^__(cublas|cudnn)")


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


def _scan_balanced(text: str, start: int) -> int:
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
        end = _scan_balanced(rest, 0)
    else:
        end = rest.find(" ")
        if end < 0:
            return None
    shape, rest = rest[:end], rest[end:]
    op = _OPCODE_RE.match(rest)
    if not op:
        return None
    open_at = op.end() - 1
    close_at = _scan_balanced(rest, open_at)
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
        stages); branch ``b`` then counts its caller's executions times ``[b]``.

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
            branches = calls.get("branch_computations", [])
            if (inst.opcode == "conditional" and branch_frequencies is not None
                    and len(branches) == len(branch_frequencies)):
                for callee, share in zip(branches, branch_frequencies):
                    order.append((callee, times * share))
                continue
            for key, names in calls.items():
                if key == "to_apply" and inst.opcode != "call":
                    continue
                for callee in names:
                    order.append((callee, times))
    return counts, warnings


# ----------------------------------------------------------------------------- gemms


@dataclass(frozen=True)
class GemmWork:
    """A GEMM-like instruction and its work.

    Attributes:
      name: instruction name (the fusion/call/custom-call as scheduled).
      flops: total FLOPs of the dots/convolutions in it (0 when not derivable, e.g.
        cuDNN attention custom-calls).
      dtype: element type of the first matmul operand (picks the chip's rate).
    """

    name: str
    flops: float
    dtype: str


def _operand_shape(comp: Computation, inst: Instruction, i: int) -> str | None:
    """Shape text of operand ``i``: printed inline, or its defining instruction's."""
    if i < len(inst.operand_shapes) and inst.operand_shapes[i]:
        return inst.operand_shapes[i]
    if i < len(inst.operands):
        src = comp.get(inst.operands[i])
        if src is not None:
            return src.shape
    return None


def _dims_attr(attributes: str, key: str) -> tuple[int, ...]:
    match = re.search(rf"\b{key}=\{{([\d,\s]*)\}}", attributes)
    if not match:
        return ()
    return tuple(int(x) for x in match.group(1).split(",") if x.strip())


def _dot_flops(comp: Computation, inst: Instruction) -> tuple[float, str]:
    """FLOPs of a ``dot``: 2 x output elements x contracted elements."""
    out = array_shapes(inst.shape)
    lhs_shape = _operand_shape(comp, inst, 0)
    lhs = array_shapes(lhs_shape) if lhs_shape else []
    if not out or not lhs:
        return 0.0, (lhs[0][0] if lhs else "bf16")
    contracting = _dims_attr(inst.attributes, "lhs_contracting_dims")
    k = math.prod(lhs[0][1][d] for d in contracting if d < len(lhs[0][1]))
    return 2.0 * math.prod(out[0][1]) * k, lhs[0][0]


def _conv_flops(comp: Computation, inst: Instruction, kernel_index: int = 1
                ) -> tuple[float, str]:
    """FLOPs of a convolution: 2 x output elements x kernel elements per output."""
    out = array_shapes(inst.shape)
    kernel_shape = _operand_shape(comp, inst, kernel_index)
    lhs_shape = _operand_shape(comp, inst, 0)
    kernel = array_shapes(kernel_shape) if kernel_shape else []
    dtype = array_shapes(lhs_shape)[0][0] if lhs_shape and array_shapes(lhs_shape) else "bf16"
    labels = re.search(r"dim_labels=\w+_(\w+)->\w+", inst.attributes)
    if not out or not kernel or not labels or len(labels.group(1)) != len(kernel[0][1]):
        return 0.0, dtype
    per_output = math.prod(
        size for label, size in zip(labels.group(1), kernel[0][1], strict=True) if label != "o")
    return 2.0 * math.prod(out[0][1]) * per_output, dtype


def _custom_call_target(inst: Instruction) -> str:
    match = re.search(r'custom_call_target="([^"]+)"', inst.attributes)
    return match.group(1) if match else ""


def _custom_gemm_flops(comp: Computation, inst: Instruction) -> tuple[float, str]:
    """FLOPs of a cuBLAS custom-call from its ``dot_dimension_numbers``."""
    lhs_shape = _operand_shape(comp, inst, 0)
    lhs = array_shapes(lhs_shape) if lhs_shape else []
    out_elems = tuple_elements(inst.shape)
    out = array_shapes(out_elems[0]) if out_elems else []
    dtype = lhs[0][0] if lhs else "bf16"
    contracting = re.search(r'lhs_contracting_dimensions\\?"\s*:\s*\[([^\]]*)\]', inst.attributes)
    if not lhs or not out or not contracting:
        return 0.0, dtype
    dims = [int(x) for x in re.findall(r"-?\d+", contracting.group(1))]
    k = math.prod(lhs[0][1][d] for d in dims if d < len(lhs[0][1]))
    return 2.0 * math.prod(out[0][1]) * k, dtype


def gemm_work(module: HloModule, comp: Computation, inst: Instruction,
              _depth: int = 0) -> GemmWork | None:
    """The GEMM work an instruction performs, or None if it is not GEMM-like.

    Args:
      module: the module.
      comp: computation holding ``inst``.
      inst: the instruction.

    Returns:
      :class:`GemmWork` for dots, convolutions, cuBLAS/cuDNN custom-calls and for
      fusions/calls/loops containing them (loop bodies times their trip count).
    """
    if _depth > 16:
        return None
    if inst.opcode == "dot":
        flops, dtype = _dot_flops(comp, inst)
        return GemmWork(inst.name, flops, dtype)
    if inst.opcode == "convolution":
        flops, dtype = _conv_flops(comp, inst)
        return GemmWork(inst.name, flops, dtype)
    if inst.opcode == "custom-call":
        target = _custom_call_target(inst)
        if _GEMM_CUSTOM_CALL.match(target):
            if "conv" in target:
                flops, dtype = _conv_flops(comp, inst)
            elif "cublas" in target:
                flops, dtype = _custom_gemm_flops(comp, inst)
            else:
                lhs_shape = _operand_shape(comp, inst, 0)
                leaves = array_shapes(lhs_shape) if lhs_shape else []
                flops, dtype = 0.0, (leaves[0][0] if leaves else "bf16")
            return GemmWork(inst.name, flops, dtype)
    if inst.opcode in ("fusion", "call", "while", "conditional", "async-start", "fusion-start"):
        calls = called_computations(inst)
        names = calls.get("calls", []) + calls.get("to_apply", []) + calls.get("body", []) \
            + calls.get("branch_computations", [])
        trips = 1
        if inst.opcode == "while":
            trips = while_trip_count(module, comp, inst) or 1
        total, dtype, found = 0.0, "", False
        for callee in names:
            inner = module.computations.get(callee)
            if inner is None:
                continue
            for sub in inner.instructions:
                work = gemm_work(module, inner, sub, _depth + 1)
                if work is not None:
                    found = True
                    total += work.flops
                    dtype = dtype or work.dtype
        if found:
            return GemmWork(inst.name, total * trips, dtype or "bf16")
    return None


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
        end = _scan_balanced(rest, 0)
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
    end = _scan_balanced(attributes, match.end())
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
        shapes = [_operand_shape(comp, inst, i) for i in range(len(inst.operands))]
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
            record = _classify(module, comp, users, inst, num_devices, counts[comp_name])
            if record is None:
                continue
            if not record.done_found:
                warnings.append(
                    f"{record.name}: done not in {comp_name} (pipelined across iterations); "
                    "nothing is known about what overlaps it")
            found.append(record)
    return found, warnings


def _classify(module: HloModule, comp: Computation, users: Mapping[str, list[Instruction]],
              inst: Instruction, num_devices: int, executions: int) -> CollectiveOp | None:
    """A :class:`CollectiveOp` if ``inst`` starts (or is) a collective, else None."""
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
                             inst, num_devices, executions)
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
                             inner_inst, num_devices, executions)
    if opcode == "recv" and "is_host_transfer=true" not in inst.attributes:
        done = _find_done(comp, users, inst, ("recv-done",))
        data = tuple_elements(inst.shape)[0]
        share = _permute_share(_source_target_pairs(inst.attributes), num_devices)
        return _async_record(module, comp, inst, done, "collective-permute", "send-recv",
                             math.ceil(shape_bytes(data) * share), inst, num_devices,
                             executions)
    return None


def _async_record(module: HloModule, comp: Computation, start: Instruction,
                  done: Instruction | None, kind: str, form: str, size: int,
                  described: Instruction, num_devices: int, executions: int) -> CollectiveOp:
    """Build the record of an async collective, with what is scheduled inside it."""
    between: tuple[Instruction, ...] = ()
    if done is not None:
        between = comp.instructions[start.position + 1 : done.position]
    gemms = tuple(w for w in (gemm_work(module, comp, i) for i in between) if w is not None)
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


# ----------------------------------------------------------------------------- link model


def comm_seconds(op: CollectiveOp, link: LinkModel) -> float:
    """Link time of one execution of ``op`` (:func:`costs.collective_seconds`)."""
    return collective_seconds(op.kind, op.bytes, op.replica_groups.group_size,
                              link.link(op.replica_groups.mesh_axes))


def exposed_seconds(op: CollectiveOp, link: LinkModel, chip: ChipSpec) -> float:
    """Link time of one execution of ``op`` not hidden by the GEMMs under it.

    A synchronous collective is fully exposed. An async one is hidden by the time the
    GEMMs between its start and done take at the chip's peak rate; a GEMM under two
    collectives is credited to both (optimistic), contention is ignored.
    """
    t = comm_seconds(op, link)
    if op.is_async:
        t -= sum(g.flops / chip.matmul_flops_per_s(g.dtype) for g in op.gemms_between)
    return max(0.0, t)


# ----------------------------------------------------------------------------- report


@dataclass(frozen=True)
class KindSummary:
    """Per-step totals of one collective kind.

    Attributes:
      count: executions per step.
      bytes: bytes per step.
      async_bytes: bytes per step moved by async collectives.
    """

    count: int | float
    bytes: int | float
    async_bytes: int | float = 0


@dataclass(frozen=True)
class HloReport:
    """What :func:`analyze_hlo` found.

    Attributes:
      target: ``cpu``, ``gpu`` or a GPU target name.
      chip: chip name used for the estimates, or None.
      is_scheduled: whether the module text is in schedule order.
      collectives: per kind, per-step totals.
      ops: every collective.
      async_fraction: async collective bytes / all collective bytes (per step).
      collective_bytes_under_gemm_fraction: bytes of async collectives with at least
        one GEMM scheduled between start and done / all collective bytes.
      exposed_comm_s_estimate: link time per step not hidden by GEMMs (None without a
        chip).
      total_comm_s_estimate: link time per step if nothing were hidden (None without a
        chip).
      synchronous_only: no collective runs asynchronously.
      note: one paragraph on how to read the numbers.
      warnings: what could not be determined.
    """

    target: str
    chip: str | None
    is_scheduled: bool
    collectives: Mapping[str, KindSummary]
    ops: tuple[CollectiveOp, ...]
    async_fraction: float
    collective_bytes_under_gemm_fraction: float
    exposed_comm_s_estimate: float | None
    total_comm_s_estimate: float | None
    synchronous_only: bool
    note: str
    warnings: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (``json.dumps(report.to_json())`` works)."""
        return {
            "target": self.target,
            "chip": self.chip,
            "is_scheduled": self.is_scheduled,
            "bytes_convention": BYTES_CONVENTION,
            "collectives": {
                kind: {"count": s.count, "bytes": s.bytes, "async_bytes": s.async_bytes}
                for kind, s in self.collectives.items()
            },
            "async_fraction": self.async_fraction,
            "collective_bytes_under_gemm_fraction": self.collective_bytes_under_gemm_fraction,
            "exposed_comm_s_estimate": self.exposed_comm_s_estimate,
            "total_comm_s_estimate": self.total_comm_s_estimate,
            "synchronous_only": self.synchronous_only,
            "note": self.note,
            "warnings": list(self.warnings),
            "ops": [
                {
                    "kind": op.kind,
                    "name": op.name,
                    "computation": op.computation,
                    "form": op.form,
                    "async": op.is_async,
                    "bytes": op.bytes,
                    "executions_per_step": op.executions_per_step,
                    "group_size": op.replica_groups.group_size,
                    "mesh_axes": list(op.replica_groups.mesh_axes),
                    "scheduled_between": len(op.scheduled_between),
                    "gemms_between": [g.name for g in op.gemms_between],
                    "gemm_flops_between": op.gemm_flops_between,
                }
                for op in self.ops
            ],
        }

    def to_json_str(self) -> str:
        """``to_json()`` as indented text."""
        return json.dumps(self.to_json(), indent=2)


# CPU prints kind=kCustom fusions too (its dot fusions), so that is no GPU marker.
_GPU_MARKERS = ("operation_queue_id", "__cublas", "__triton", "__cudnn")


def detect_target(text: str) -> str:
    """``gpu`` if the text carries GPU backend markers, else ``cpu``."""
    return "gpu" if any(m in text for m in _GPU_MARKERS) else "cpu"


def _note(is_gpu: bool, synchronous_only: bool, has_ops: bool, is_scheduled: bool) -> str:
    """The report's reading guide for this kind of program."""
    parts = []
    if not has_ops:
        parts.append("No collectives in this program.")
    elif not is_gpu and synchronous_only:
        parts.append(
            "CPU backend: XLA runs every collective synchronously, so nothing overlaps "
            "communication here; the fractions are 0 by construction and say nothing "
            "about a GPU run. Compile deviceless for a GPU target "
            "(jax_overlap.analysis.deviceless) to see the latency-hiding schedule.")
    elif synchronous_only:
        parts.append(
            "No asynchronous collective in this schedule: XLA made every collective "
            "synchronous (nothing could be scheduled beside it, or async collectives "
            "are disabled).")
    else:
        parts.append(
            "Async collectives overlap only what the schedule places between their "
            "start and done. The exposed-time estimate credits each async collective "
            "with the GEMMs under it at the chip's peak rate (a GEMM under two "
            "collectives counts for both) and ignores link contention and latency "
            "unless the link model sets it.")
    if not is_scheduled:
        parts.append(
            "The module is not scheduled (is_scheduled=false): text order is not "
            "execution order, so 'between start and done' is only text order.")
    return " ".join(parts)


def _tidy(x: float) -> int | float:
    """An int when `x` is one (every count is, unless `branch_frequencies` averages)."""
    return int(round(x)) if abs(x - round(x)) < 1e-9 else x


def analyze_module(module: HloModule, *, target: str = "cpu", chip: ChipSpec | None = None,
                   link: LinkModel | None = None, is_gpu: bool | None = None,
                   branch_frequencies: Sequence[float] | None = None) -> HloReport:
    """Build an :class:`HloReport` from a parsed module.

    Args:
      module: parsed module.
      target: label for the report (``cpu``, ``gpu``, ``h100``...).
      chip: chip for the time estimates; None leaves them None.
      link: link model; defaults to the chip's NVLink.
      is_gpu: whether the module came from the GPU backend (default: target != cpu).
      branch_frequencies: see :func:`execution_counts`.

    Returns:
      The report.
    """
    ops, warnings = find_collectives(module, branch_frequencies)
    is_gpu = (target != "cpu") if is_gpu is None else is_gpu
    summary: dict[str, KindSummary] = {}
    for kind in COLLECTIVE_KINDS:
        of_kind = [op for op in ops if op.kind == kind]
        if of_kind:
            summary[kind] = KindSummary(
                count=_tidy(sum(op.executions_per_step for op in of_kind)),
                bytes=_tidy(sum(op.bytes_per_step for op in of_kind)),
                async_bytes=_tidy(sum(op.bytes_per_step for op in of_kind if op.is_async)))
    total = sum(op.bytes_per_step for op in ops)
    async_bytes = sum(op.bytes_per_step for op in ops if op.is_async)
    under = sum(op.bytes_per_step for op in ops if op.under_gemm)
    exposed = total_time = None
    if chip is not None:
        link = link or LinkModel.from_chip(chip)
        exposed = sum(exposed_seconds(op, link, chip) * op.executions_per_step for op in ops)
        total_time = sum(comm_seconds(op, link) * op.executions_per_step for op in ops)
    synchronous_only = not any(op.is_async for op in ops)
    return HloReport(
        target=target,
        chip=chip.name if chip is not None else None,
        is_scheduled=module.is_scheduled,
        collectives=summary,
        ops=tuple(ops),
        async_fraction=async_bytes / total if total else 0.0,
        collective_bytes_under_gemm_fraction=under / total if total else 0.0,
        exposed_comm_s_estimate=exposed,
        total_comm_s_estimate=total_time,
        synchronous_only=synchronous_only,
        note=_note(is_gpu, synchronous_only, bool(ops), module.is_scheduled),
        warnings=tuple(warnings),
    )


def analyze_hlo(text: str, *, target: str | None = None, chip: ChipSpec | None = None,
                link: LinkModel | None = None,
                branch_frequencies: Sequence[float] | None = None) -> HloReport:
    """Parse compiled HLO text and report its collectives.

    Args:
      text: ``compiled.as_text()``.
      target: ``cpu``, ``gpu`` or a GPU target name (``a100``, ``h100``, ``h200``);
        default: detected from the text (``cpu``/``gpu``).
      chip: chip for the time estimates; default: the target's chip when the target
        is a GPU name, else None (no estimates).
      link: link model; default: the chip's NVLink, one direction.
      branch_frequencies: see :func:`execution_counts` (the pipeline executor's
        `TickProgram.branch_frequencies`).

    Returns:
      :class:`HloReport`.
    """
    detected = detect_target(text)
    target = target or detected
    if chip is None and target not in ("cpu", "gpu"):
        chip = chip_spec(target)
    return analyze_module(parse_module(text), target=target, chip=chip, link=link,
                          is_gpu=detected == "gpu" or target != "cpu",
                          branch_frequencies=branch_frequencies)
