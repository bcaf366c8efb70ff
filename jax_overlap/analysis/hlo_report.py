"""Report on the collectives of compiled HLO text: how many, how big, and how many hide.

:func:`analyze_hlo` parses ``compiled.as_text()`` (:mod:`jax_overlap.analysis.hlo_parse`),
finds its collectives (:mod:`jax_overlap.analysis.hlo_collectives`) and sums them per
kind and per step into an :class:`HloReport`: the share of collective bytes that run
asynchronously, the share with a GEMM scheduled between start and done, and -- given a
chip -- link-time estimates: each collective costs
:func:`jax_overlap.hardware.collective_cost.collective_seconds` on the link the
:class:`~jax_overlap.hardware.machine.LinkModel` gives its mesh axes, and an async one
is credited with the GEMMs under it at the chip's peak rate.

What XLA's GPU pipeline did with the programs this reader was built on (which passes
move collectives, which flags counter them, per jaxlib version): ``docs/design/xla_notes.md``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jax_overlap.hardware.collective_cost import collective_seconds
from jax_overlap.analysis.hlo_collectives import (
    BYTES_CONVENTION,
    COLLECTIVE_KINDS,
    CollectiveOp,
    cover_cases,
    find_collectives,
)
from jax_overlap.analysis.hlo_parse import HloModule, parse_module
from jax_overlap.hardware.machine import ChipSpec, LinkModel, chip_spec

# ----------------------------------------------------------------------------- link time


def comm_seconds(op: CollectiveOp, link: LinkModel) -> float:
    """Link time of one execution of ``op`` on its mesh axes' link (:func:`collective_seconds`)."""
    return collective_seconds(op.kind, op.bytes, op.replica_groups.group_size,
                              link.link(op.replica_groups.mesh_axes))


def exposed_seconds(op: CollectiveOp, link: LinkModel, chip: ChipSpec) -> float:
    """Link time of one execution of ``op`` not hidden by the GEMMs under it, on average.

    A synchronous collective is fully exposed. An async one is hidden by the time the
    GEMMs between its start and done take at the chip's peak rate; a GEMM under two
    collectives is credited to both (optimistic), contention is ignored. Under a
    conditional (a pipeline tick's switch) the time left is averaged over its branches
    as often as each is taken: an idle tick hides nothing, however long the busy ones.
    """
    t = comm_seconds(op, link)
    if not op.is_async:
        return t
    cases = cover_cases(op.gemms_between,
                        lambda g, flops: flops / chip.matmul_flops_per_s(g.dtype))
    return sum(p * max(0.0, t - s) for p, s in cases)


# ----------------------------------------------------------------------------- report


@dataclass(frozen=True)
class KindSummary:
    """Per-step totals of one collective kind.

    Attributes:
      count: executions per step.
      bytes: bytes per step.
      async_bytes: bytes per step moved by async collectives.
      under_gemm_bytes: bytes per step of async collectives with at least one GEMM
        scheduled between start and done (an MoE step's all-to-alls: what hides); one
        around a conditional, on the share of executions whose branch holds a GEMM
        (`CollectiveOp.under_share`).
    """

    count: int | float
    bytes: int | float
    async_bytes: int | float = 0
    under_gemm_bytes: int | float = 0


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
        one GEMM scheduled between start and done / all collective bytes (around a
        conditional: the share of its executions that take a branch with a GEMM).
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
                kind: {"count": s.count, "bytes": s.bytes, "async_bytes": s.async_bytes,
                       "under_gemm_bytes": s.under_gemm_bytes}
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
                    "under_share": op.under_share,
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
                async_bytes=_tidy(sum(op.bytes_per_step for op in of_kind if op.is_async)),
                under_gemm_bytes=_tidy(sum(op.under_gemm_bytes for op in of_kind)))
    total = sum(op.bytes_per_step for op in ops)
    async_bytes = sum(op.bytes_per_step for op in ops if op.is_async)
    under = sum(op.under_gemm_bytes for op in ops)
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
      branch_frequencies: see :func:`execution_counts` (a pipeline step's:
        `analysis.analyze.switch_weights`).

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
