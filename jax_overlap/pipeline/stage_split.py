"""How many layers each virtual stage holds (`pipeline.stage_layers`): even, explicit or auto.

Pure Python and NumPy (no JAX), so config validation can check a list before the backend
starts. A split is a tuple of layer counts per virtual stage in model order: virtual stage
`vs` holds logical layers `sum(split[:vs]) .. sum(split[:vs+1]) - 1`, wherever the schedule's
placement puts it (round-robin for interleaved, V for zb-v); a device's load is the sum of
its chunks.

`auto` balances the stages' costs, counting the embedding on virtual stage 0 and the LM head
and loss on the last one. The costs are relative to one block, from the model's FLOPs
(`transformer_costs`): for a GPT block `24 d^2 + 4 T d` FLOPs per token in the forward, for the
head `2 d V`, so GPT-1.3B's head is worth about 1.75 blocks. The cut comes from the exact
min-bottleneck partitioner (`jax_overlap.parallel.partition`); among the cuts with that
bottleneck, a local search picks the one with the lightest device (for interleaved / V
placement: the sum of its chunks) and then the most even virtual stages.
"""

from __future__ import annotations

from typing import Sequence

EVEN, AUTO = "even", "auto"


def even_split(layers: int, parts: int) -> tuple[int, ...]:
    """Equal chunks (the default); `layers` must be a multiple of `parts`."""
    if parts < 1 or layers % parts:
        raise ValueError(f"model.layers: {layers} is not divisible by mesh.pp x "
                         f"pipeline.virtual_stages = {parts}; use a multiple of {parts} or set "
                         f"pipeline.stage_layers")
    return (layers // parts,) * parts


def list_problems(value: Sequence[int], layers: int, parts: int) -> list[str]:
    """One line per problem of an explicit `pipeline.stage_layers` list (empty: valid)."""
    example = ", ".join(str(n) for n in near_even(layers, parts)) if layers >= parts else ""
    fix = (f"give {parts} counts >= 1 that sum to {layers}, e.g. [{example}], or 'auto'"
           if example else f"use at least {parts} layers (model.layers) or fewer stages")
    if len(value) != parts:
        return [f"pipeline.stage_layers: {len(value)} counts for mesh.pp x "
                f"pipeline.virtual_stages = {parts} virtual stages; {fix}"]
    if any(n < 1 for n in value):
        return [f"pipeline.stage_layers: every virtual stage needs >= 1 layer, got "
                f"{list(value)}; {fix}"]
    if sum(value) != layers:
        return [f"pipeline.stage_layers: {list(value)} sums to {sum(value)}, not model.layers = "
                f"{layers}; {fix}"]
    return []


def near_even(layers: int, parts: int) -> tuple[int, ...]:
    """As even as the layers allow, earlier virtual stages taking the extra ones."""
    base, extra = divmod(layers, parts)
    return tuple(base + (i < extra) for i in range(parts))


def transformer_costs(d_model: int, d_ff: int, vocab: int, seq_len: int
                      ) -> tuple[float, float, float]:
    """(block, embed, head) forward FLOPs per token of a decoder block, its embedding and
    its LM head + loss: `2 (4 d^2 + 2 d d_ff) + 4 T d`, ~0 (a gather) and `2 d V` (the
    softmax cross-entropy's elementwise work is small beside it)."""
    block = 2 * (4 * d_model ** 2 + 2 * d_model * d_ff) + 4 * seq_len * d_model
    return float(block), 0.0, float(2 * d_model * vocab)


def device_loads(split: Sequence[int], placement: Sequence[tuple[int, int]], stages: int,
                 embed: float = 0.0, head: float = 0.0) -> tuple[float, ...]:
    """Per device: its chunks' layers (block = 1) plus the embedding / head it runs."""
    loads = [0.0] * stages
    for vs, n in enumerate(split):
        loads[placement[vs][0]] += n
    loads[placement[0][0]] += embed
    loads[placement[-1][0]] += head
    return tuple(loads)


def auto_split(layers: int, placement: Sequence[tuple[int, int]], stages: int,
               embed: float = 0.0, head: float = 0.0) -> tuple[int, ...]:
    """The balanced split: min-bottleneck over virtual stages, then the lightest device,
    then the most even virtual stages.

    Args:
      layers: the model's blocks (all of one cost, 1).
      placement: virtual stage -> (stage, chunk), e.g. `Schedule.placement`.
      stages: pipeline stages p.
      embed, head: the embedding's / head's cost in blocks (on the first / last virtual
        stage).

    Returns:
      Layers per virtual stage, each >= 1, summing to `layers`.
    """
    from jax_overlap.parallel.partition import partition

    parts = len(placement)
    if layers < parts:
        raise ValueError(f"pipeline.stage_layers: auto needs at least {parts} layers "
                         f"(model.layers = {layers}) for {parts} virtual stages")
    costs = [1.0] * layers
    costs[0] += embed
    costs[-1] += head
    cut = partition(costs, parts)  # exact: the smallest slowest virtual stage
    split = [b - a for a, b in zip(cut.bounds, cut.bounds[1:])]

    def key(s):
        vs_costs = [n + embed * (i == 0) + head * (i == parts - 1) for i, n in enumerate(s)]
        return (round(max(vs_costs), 9),
                round(max(device_loads(s, placement, stages, embed, head)), 9),
                round(sum(c * c for c in vs_costs), 9), tuple(-n for n in s))

    best = key(split)
    improved = True
    while improved:  # move one layer across one boundary while that improves the key
        improved = False
        for i in range(parts):
            for j in range(parts):
                if i == j or split[i] <= 1:
                    continue
                trial = list(split)
                trial[i] -= 1
                trial[j] += 1
                k = key(trial)
                if k < best:
                    split, best, improved = trial, k, True
    return tuple(split)


def why_auto(split: Sequence[int], placement: Sequence[tuple[int, int]], stages: int,
             embed: float, head: float) -> str:
    """One line for the plan's choices: what `auto` balanced and what it gained."""
    parts = len(placement)

    def slowest(s):
        return max(device_loads(s, placement, stages, embed, head))

    even = near_even(sum(split), parts)
    return (f"balanced by FLOPs (embedding {embed:.2f}, LM head + loss {head:.2f} blocks): "
            f"slowest device {slowest(split):.2f} blocks, even split {slowest(even):.2f}")
