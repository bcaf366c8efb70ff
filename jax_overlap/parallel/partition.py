"""Stage partitioner: cut a chain of blocks into contiguous stages, minimising the slowest.

A pipeline runs at the pace of its slowest stage, so the cut that matters is the one that
minimises the largest per-stage cost (the bottleneck), not the one that equalises block counts.
For a chain of n blocks and k parts the exact answer comes from a small dynamic programme over
prefix sums (O(k n^2); n is at most a few hundred residual blocks, so this is instant).

With `virtual_stages` v > 1 the chain is cut into p*v virtual stages; virtual stage s runs on
device s mod p (the interleaved placement), and a device's load is the sum of its chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class Partition:
    """A contiguous cut of a chain of blocks.

    Attributes:
      costs: per-block cost, in chain order.
      bounds: part i holds blocks `bounds[i]:bounds[i+1]`; `bounds[0] == 0`,
        `bounds[-1] == len(costs)`.
      stages: pipeline stages (devices) the parts are placed on, round-robin.
      names: optional display name of every block.
    """

    costs: tuple[float, ...]
    bounds: tuple[int, ...]
    stages: int = 1
    names: tuple[str, ...] | None = None

    @property
    def parts(self) -> int:
        return len(self.bounds) - 1

    @property
    def part_costs(self) -> tuple[float, ...]:
        prefix = np.concatenate([[0.0], np.cumsum(self.costs)])
        return tuple(float(prefix[b] - prefix[a]) for a, b in zip(self.bounds, self.bounds[1:]))

    @property
    def stage_costs(self) -> tuple[float, ...]:
        """Load of each device: the sum of the parts placed on it (part s -> s mod stages)."""
        loads = [0.0] * self.stages
        for s, c in enumerate(self.part_costs):
            loads[s % self.stages] += c
        return tuple(loads)

    @property
    def total(self) -> float:
        return float(sum(self.costs))

    @property
    def bottleneck(self) -> float:
        """The slowest part's cost: what the exact partitioner minimises."""
        return max(self.part_costs)

    @property
    def imbalance(self) -> float:
        """Slowest part / ideal part (total / parts); 1.0 is a perfect split."""
        return self.bottleneck / (self.total / self.parts)

    def part_of(self, block: int) -> int:
        """Which part holds `block`."""
        return int(np.searchsorted(np.asarray(self.bounds), block, side="right") - 1)


def partition(costs: Sequence[float], stages: int, virtual_stages: int = 1,
              names: Sequence[str] | None = None) -> Partition:
    """The contiguous cut into `stages * virtual_stages` non-empty parts with the smallest
    maximum part cost.

    Ties (several cuts with the same bottleneck) go to the cut whose earlier parts are as
    large as possible, so the result is deterministic.

    Args:
      costs: per-block cost (e.g. estimated training FLOPs), all >= 0, in chain order.
      stages: pipeline stages p.
      virtual_stages: chunks per stage v (interleaved); the chain is cut into p * v parts.
      names: optional display names of the blocks (same length as `costs`).

    Returns:
      The optimal `Partition`.

    Raises:
      ValueError: if there are fewer blocks than parts or a cost is negative.
    """
    c = np.asarray(costs, np.float64)
    k, n = stages * virtual_stages, len(c)
    if stages < 1 or virtual_stages < 1:
        raise ValueError(f"stages and virtual_stages must be >= 1, got {stages}, {virtual_stages}")
    if n < k:
        raise ValueError(f"cannot cut {n} blocks into {k} non-empty parts (pp x virtual stages); "
                         f"use fewer stages or a deeper model")
    if (c < 0).any():
        raise ValueError("block costs must be >= 0")
    if names is not None and len(names) != n:
        raise ValueError(f"names: {len(names)} names for {n} blocks")
    prefix = np.concatenate([[0.0], np.cumsum(c)])
    # best[j, i]: smallest bottleneck of the first i blocks cut into j parts;
    # cut[j, i]: where the j-th part starts in that optimum.
    best = np.full((k + 1, n + 1), np.inf)
    cut = np.zeros((k + 1, n + 1), np.int64)
    best[0, 0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            starts = np.arange(j - 1, i)  # the last part is blocks starts..i-1 (non-empty)
            candidates = np.maximum(best[j - 1, starts], prefix[i] - prefix[starts])
            # Exact ties resolved toward the latest start (earlier parts as large as possible);
            # a relative tolerance keeps float noise in the prefix sums from deciding.
            lowest = candidates.min()
            pick = np.nonzero(candidates <= lowest * (1 + 1e-12))[0][-1]
            best[j, i], cut[j, i] = candidates[pick], starts[pick]
    bounds = [n]
    for j in range(k, 0, -1):
        bounds.append(int(cut[j, bounds[-1]]))
    return Partition(tuple(float(x) for x in c), tuple(reversed(bounds)), stages,
                     None if names is None else tuple(names))


def describe_partition(part: Partition, unit: str = "FLOP") -> str:
    """A human-readable table of a partition: per part its blocks, cost and share.

    Args:
      part: the `Partition` to show.
      unit: what the costs count, for the header (e.g. 'FLOP').

    Returns:
      Multi-line text, ending with the cut points (the blocks each part ends on).
    """

    def fmt(x: float) -> str:
        for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
            if abs(x) >= scale:
                return f"{x / scale:.3g} {suffix}{unit}"
        return f"{x:.3g} {unit}"

    def name(i: int) -> str:
        return part.names[i] if part.names is not None else f"#{i}"

    ideal = part.total / part.parts
    v = part.parts // part.stages
    lines = [f"{len(part.costs)} blocks -> {part.parts} parts (pp={part.stages} x v={v}); "
             f"total {fmt(part.total)}, ideal part {fmt(ideal)}, "
             f"slowest {fmt(part.bottleneck)} = {part.imbalance:.3f} x ideal"]
    width = 30
    for s, (a, b) in enumerate(zip(part.bounds, part.bounds[1:])):
        cost = part.part_costs[s]
        bar = "#" * max(1, round(width * cost / part.bottleneck)) if cost > 0 else ""
        span = name(a) if b - a == 1 else f"{name(a)} .. {name(b - 1)}"
        where = f" (stage {s % part.stages})" if v > 1 else ""
        lines.append(f"  part {s:>2}{where}: {b - a:>3} blocks [{span}]  {fmt(cost)} "
                     f"({cost / ideal:.1%} of ideal)  {bar}")
    if v > 1:
        lines.append("  per stage: " + ", ".join(
            f"{d}: {fmt(c)}" for d, c in enumerate(part.stage_costs)))
    lines.append("  cuts after: " + " | ".join(name(b - 1) for b in part.bounds[1:-1]))
    return "\n".join(lines)


def model_partition(model, stages: int, virtual_stages: int = 1) -> Partition:
    """The FLOP-balanced cut of a model's blocks into `stages * virtual_stages` parts.

    Models with heterogeneous blocks expose `block_costs()` (and optionally `block_names()`);
    for a stack of identical blocks every block costs `flops_per_example() / num_layers`.

    Args:
      model: a `StagedModel`.
      stages, virtual_stages: the pipeline's pp and chunks per stage.

    Returns:
      The optimal `Partition`.
    """
    if hasattr(model, "block_costs"):
        costs = list(model.block_costs())
    else:
        costs = [model.flops_per_example() / model.num_layers] * model.num_layers
    names = model.block_names() if hasattr(model, "block_names") else [
        f"layer{i}" for i in range(len(costs))]
    return partition(costs, stages, virtual_stages, names)


def describe_model_partition(model, stages: int, virtual_stages: int = 1) -> str:
    """`describe_partition(model_partition(...))`: what the CLI prints for a config's model."""
    return describe_partition(model_partition(model, stages, virtual_stages))
