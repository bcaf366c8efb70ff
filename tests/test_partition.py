"""The stage partitioner is exact, balanced on ResNet-152 and prints readable cuts."""

import itertools

import numpy as np
import pytest

from jax_overlap.parallel.partition import (
    Partition,
    describe_model_partition,
    describe_partition,
    partition,
)
from models.resnet import ResNetConfig, ResNetModel


def _brute_force_bottleneck(costs, parts: int) -> float:
    n, best = len(costs), np.inf
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(prefix[b] - prefix[a] for a, b in zip(bounds, bounds[1:])))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_exact_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 10))
    parts = int(rng.integers(1, n + 1))
    # Integer costs make ties common, which exercises the tie-breaking.
    costs = rng.integers(0, 6, n).astype(float) if seed % 2 else rng.exponential(1.0, n)
    part = partition(costs, parts)
    assert part.parts == parts
    assert part.bounds[0] == 0 and part.bounds[-1] == n
    assert all(b > a for a, b in zip(part.bounds, part.bounds[1:]))  # non-empty, contiguous
    assert part.bottleneck == pytest.approx(_brute_force_bottleneck(costs, parts), rel=1e-12)
    assert sum(part.part_costs) == pytest.approx(float(np.sum(costs)))


def test_virtual_stages_place_chunks_round_robin():
    part = partition([1.0] * 8, stages=2, virtual_stages=2)
    assert part.bounds == (0, 2, 4, 6, 8)
    assert part.stage_costs == (4.0, 4.0)  # parts 0, 2 on stage 0; parts 1, 3 on stage 1
    assert [part.part_of(i) for i in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="non-empty parts"):
        partition([1.0, 2.0], stages=3)
    with pytest.raises(ValueError, match=">= 0"):
        partition([1.0, -2.0], stages=1)


def test_resnet152_pp4_is_balanced_by_flops():
    model = ResNetModel(ResNetConfig(depth=152, image_size=224, classes=1000))
    part = model.plan(stages=4)
    assert isinstance(part, Partition)
    assert part.bottleneck <= 1.10 * part.total / 4
    # Equal block counts would be worse: the blocks' costs differ (projections, stem, head).
    counts = np.diff(part.bounds)
    assert counts.sum() == 50 and len(set(counts)) > 1
    text = describe_partition(part)
    assert text.startswith("50 blocks -> 4 parts (pp=4 x v=1)")
    assert "cuts after: s2b7 | s3b12 | s3b25" in text, text
    assert text.count("\n  part ") == 4


def test_describe_shows_stages_for_virtual_chunks():
    text = describe_partition(partition([3.0, 1.0, 1.0, 1.0, 2.0, 2.0], 2, 2,
                                        names=list("abcdef")), unit="ms")
    assert "pp=2 x v=2" in text and "(stage 1)" in text and "per stage:" in text
    assert "cuts after:" in text and "ms" in text


def test_models_describe_their_cut_for_the_cli():
    from models.gpt import GPT

    resnet = ResNetModel(ResNetConfig(depth=50, image_size=224, classes=1000))
    assert describe_model_partition(resnet, 4) == resnet.describe_partition(4)
    gpt = GPT(num_layers=8, d_model=32, heads=4, d_ff=64, vocab=256, seq_len=16)
    text = describe_model_partition(gpt, 2, 2)
    # Identical blocks: an even split, two layers per virtual stage.
    assert "cuts after: layer1 | layer3 | layer5" in text and "1.000 x ideal" in text
