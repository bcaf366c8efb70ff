"""Bytes that cross the slow axis (dcn) per step, read from a compiled program's collectives.

A collective crosses dcn when one of its replica groups (or, for a collective-permute, one
of its source/target pairs) holds devices of two dcn groups. The mesh puts dcn outermost,
so device (partition) i belongs to dcn group `i // devices_per_group`. Bytes follow
`hlo_collectives.BYTES_CONVENTION` (per device, the unsharded side, times executions per
step): the hierarchical reduction's dcn all-reduce moves 1/dp of the gradient, a flat
all-reduce over every data-parallel rank moves all of it.
"""

from __future__ import annotations

from collections.abc import Iterable

from jax_overlap.analysis.hlo_collectives import CollectiveOp, find_collectives
from jax_overlap.analysis.hlo_parse import parse_module


def crosses(op: CollectiveOp, devices_per_group: int) -> bool | None:
    """Whether `op` moves data between dcn groups; None when its participants are unknown."""
    if op.source_target_pairs is not None:
        return any(a // devices_per_group != b // devices_per_group
                   for a, b in op.source_target_pairs)
    groups = op.replica_groups.groups
    if groups is None:
        size = op.replica_groups.group_size
        if size is not None and size > devices_per_group:
            return True  # a group larger than one dcn group must span two
        return None if size != 1 else False
    return any(len({d // devices_per_group for d in g}) > 1 for g in groups)


def dcn_bytes(ops: Iterable[CollectiveOp], devices_per_group: int) -> dict:
    """Per-step bytes (per device) of the collectives that cross dcn.

    Returns:
      {"bytes_per_step", "count_per_step", "by_kind": {kind: bytes}, "unknown": ops whose
      participants could not be read}.
    """
    total, count, unknown, by_kind = 0.0, 0.0, 0, {}
    for op in ops:
        c = crosses(op, devices_per_group)
        if c is None:
            unknown += 1
        if not c:
            continue
        total += op.bytes_per_step
        count += op.executions_per_step
        by_kind[op.kind] = by_kind.get(op.kind, 0.0) + op.bytes_per_step
    return {"bytes_per_step": total, "count_per_step": count, "by_kind": by_kind,
            "unknown": unknown}


def dcn_bytes_of_hlo(text: str, devices_per_group: int, branch_frequencies=None) -> dict:
    """`dcn_bytes` of a compiled module's text (`compiled.as_text()`)."""
    ops, _ = find_collectives(parse_module(text), branch_frequencies)
    return dcn_bytes(ops, devices_per_group)
