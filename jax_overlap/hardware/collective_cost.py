"""What one collective costs on a link: the formula the HLO report, simulator and tuner share.

Every collective is modelled as a ring (NCCL's algorithm for large messages): ``hops``
steps over the link, each paying its latency and moving one ``1/pieces`` share of the
counted bytes, so

    seconds = hops x latency + hops x (bytes / pieces) / (bandwidth x efficiency)

with, for a group of ``n`` devices,

====================  ========  ======  =====================================
kind                  hops      pieces  ring factor = hops / pieces
====================  ========  ======  =====================================
all-reduce            2(n-1)    n       2(n-1)/n (reduce-scatter + all-gather)
all-gather            n-1       n       (n-1)/n
reduce-scatter        n-1       n       (n-1)/n
all-to-all            n-1       n       (n-1)/n
collective-permute    1         1       1 (one point-to-point transfer)
====================  ========  ======  =====================================

A group of one device moves nothing (0 s); a group of unknown size counts the bytes
once, in one hop. ``bytes`` is per device and is always the larger, unsharded side:
all-gather its output, reduce-scatter its input, every other kind its result -- what
:mod:`jax_overlap.analysis.hlo_collectives` counts and the simulator's ``Costs``
hold. The link is a :class:`jax_overlap.hardware.machine.Link`.
"""

from __future__ import annotations

from jax_overlap.hardware.machine import Link

POINT_TO_POINT = "collective-permute"


def ring_steps(kind: str, group_size: int | None) -> tuple[int, int]:
    """``(hops, pieces)`` of a ring implementation of ``kind`` over ``group_size`` devices.

    Args:
      kind: an HLO collective kind (``all-reduce``, ``all-gather``, ``reduce-scatter``,
        ``all-to-all``, ``collective-permute``).
      group_size: devices per group, or None when unknown.

    Returns:
      Hops (0 for a group of one device) and the pieces the bytes are cut into.
    """
    if kind == POINT_TO_POINT or group_size is None:
        return 1, 1
    if group_size <= 1:
        return 0, 1
    n = group_size
    return (2 * (n - 1) if kind == "all-reduce" else n - 1), n


def ring_factor(kind: str, group_size: int | None) -> float:
    """Fraction of the counted bytes each device sends in a ring implementation.

    all-reduce ``2(n-1)/n`` (reduce-scatter then all-gather); all-gather,
    reduce-scatter, all-to-all ``(n-1)/n``; collective-permute 1. A group of one
    device moves nothing; an unknown group size counts the bytes once.
    """
    hops, pieces = ring_steps(kind, group_size)
    return hops / pieces


def collective_seconds(kind: str, nbytes: float, group_size: int | None, link: Link) -> float:
    """Time of one ``kind`` collective of ``nbytes`` per device over ``group_size`` devices.

    ``hops x link.latency_s + hops x (nbytes / pieces) / link.effective_bandwidth``
    (see the module docstring for hops and pieces).

    Args:
      kind: collective kind; ``collective-permute`` is one point-to-point transfer.
      nbytes: bytes per device (the unsharded side).
      group_size: devices per group (None: unknown, the bytes move once).
      link: the group's link.

    Returns:
      Seconds; 0 when nothing moves (no bytes, or a group of one device).
    """
    hops, pieces = ring_steps(kind, group_size)
    if hops == 0 or nbytes <= 0:
        return 0.0
    return hops * link.latency_s + hops * (nbytes / pieces) / link.effective_bandwidth
