"""GEMM-like instructions of a parsed HLO module and their FLOPs.

What counts as a GEMM: ``dot`` / ``convolution``, cuBLAS/cuDNN custom-calls
(``__cublas$gemm``, ``__cublas$lt$matmul``, ``__cudnn$...``), and fusions, calls and
loops whose computations hold one (Triton gemm fusions, ``kind=kCustom``; a loop body
times its trip count). FLOPs are ``2 x prod(output dims) x prod(contracting dims)``
(convolutions: kernel elements per output); the dtype of the first matmul operand
picks the chip's rate (:meth:`jax_overlap.hardware.machine.ChipSpec.matmul_flops_per_s`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from jax_overlap.analysis.hlo_parse import (
    Computation,
    HloModule,
    Instruction,
    array_shapes,
    branch_computations,
    called_computations,
    operand_shape,
    tuple_elements,
    while_trip_count,
)

_GEMM_CUSTOM_CALL = re.compile(r"^__(cublas|cudnn)")


@dataclass(frozen=True)
class GemmWork:
    """A GEMM-like instruction and its work.

    Attributes:
      name: instruction name (the fusion/call/custom-call as scheduled).
      flops: total FLOPs of the dots/convolutions in it (cuDNN fused attention: its
        matmuls, `_fmha_flops`; 0 when not derivable).
      dtype: element type of the first matmul operand (picks the chip's rate).
      attention: a cuDNN fused attention call (its kernels reach a lower share of the peak
        than plain GEMMs: `ChipSpec.attention_flops_per_s`).
      branches: for a conditional under a collective, (share of its executions, FLOPs) of
        each branch in index order; `flops` is then their average (`hlo_collectives`).
    """

    name: str
    flops: float
    dtype: str
    attention: bool = False
    branches: tuple[tuple[float, float], ...] = ()


def _dims_attr(attributes: str, key: str) -> tuple[int, ...]:
    match = re.search(rf"\b{key}=\{{([\d,\s]*)\}}", attributes)
    if not match:
        return ()
    return tuple(int(x) for x in match.group(1).split(",") if x.strip())


def _dot_flops(comp: Computation, inst: Instruction) -> tuple[float, str]:
    """FLOPs of a ``dot``: 2 x output elements x contracted elements."""
    out = array_shapes(inst.shape)
    lhs_shape = operand_shape(comp, inst, 0)
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
    kernel_shape = operand_shape(comp, inst, kernel_index)
    lhs_shape = operand_shape(comp, inst, 0)
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
    lhs_shape = operand_shape(comp, inst, 0)
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


def _fmha_flops(comp: Computation, inst: Instruction, target: str) -> tuple[float, str]:
    """FLOPs of a cuDNN fused attention custom-call (``__cudnn$fmha*``): per batch and head
    ``2 T S E`` for each of its matmuls -- q k^T and p v forward; the recomputed q k^T and
    dv, dp, dq, dk backward -- from the scores' shape (``intermediate_tensor_shape``:
    B, N, T, S) and the query's head dim E, halved under a causal mask (the kernel skips the
    masked tiles)."""
    lhs_shape = operand_shape(comp, inst, 0)
    q = array_shapes(lhs_shape) if lhs_shape else []
    dtype = q[0][0] if q else "bf16"
    config = re.search(r'"intermediate_tensor_shape"\s*:\s*\{[^{}]*?"dimensions"\s*:\s*'
                       r'\[([^\]]*)\]', inst.attributes)
    if not q or not config:
        return 0.0, dtype
    scores = [int(x) for x in re.findall(r"\d+", config.group(1))]
    matmuls = 5 if "Backward" in target else 2
    flops = matmuls * 2.0 * math.prod(scores) * q[0][1][-1]
    if re.search(r'"mask_type"\s*:\s*"[A-Z_]*CAUSAL', inst.attributes):
        flops /= 2
    return flops, dtype


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
            elif target.startswith("__cudnn$fmha"):
                return GemmWork(inst.name, *_fmha_flops(comp, inst, target), attention=True)
            else:
                lhs_shape = operand_shape(comp, inst, 0)
                leaves = array_shapes(lhs_shape) if lhs_shape else []
                flops, dtype = 0.0, (leaves[0][0] if leaves else "bf16")
            return GemmWork(inst.name, flops, dtype)
    if inst.opcode in ("fusion", "call", "while", "conditional", "async-start", "fusion-start"):
        calls = called_computations(inst)
        names = calls.get("calls", []) + calls.get("to_apply", []) + calls.get("body", []) \
            + branch_computations(calls)
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
