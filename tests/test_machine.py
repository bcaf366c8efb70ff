"""The machine model (chips, links) and the one collective-cost formula."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from jax_overlap.hardware.collective_cost import collective_seconds, ring_factor, ring_steps
from jax_overlap.hardware.machine import (
    CHIPS,
    Link,
    LinkModel,
    chip_for_device_kind,
    chip_spec,
)
from jax_overlap.analysis.simulate import all_gather_time, all_reduce_time, p2p_time
from jax_overlap.analysis.xla_targets import TARGETS
from jax_overlap.training.loop import peak_flops


def test_device_kinds_find_their_chip():
    expected = {
        "NVIDIA H100 80GB HBM3": 989e12,
        "NVIDIA H200": 989e12,
        "NVIDIA A100-SXM4-80GB": 312e12,
        "NVIDIA H800": 989e12,
        "NVIDIA B200": 2250e12,
    }
    for kind, flops in expected.items():
        assert chip_for_device_kind(kind).peak_bf16_flops == flops
        assert peak_flops(SimpleNamespace(platform="gpu", device_kind=kind)) == flops
    assert chip_for_device_kind("Tesla V100-SXM2-16GB") is None
    assert peak_flops(SimpleNamespace(platform="cpu", device_kind="cpu")) is None


def test_targets_take_their_chip_from_the_table():
    for key, target in TARGETS.items():
        assert target.chip is CHIPS[key] is chip_spec(key)
    assert chip_spec("H100_SXM") is CHIPS["h100"]
    with pytest.raises(ValueError, match="known chips: a100, b200, h100, h200, h800"):
        chip_spec("v100")


def test_ring_steps_per_kind():
    assert ring_steps("all-reduce", 4) == (6, 4)
    assert ring_steps("all-gather", 4) == ring_steps("reduce-scatter", 4) == (3, 4)
    assert ring_steps("all-to-all", 8) == (7, 8)
    assert ring_steps("collective-permute", 8) == ring_steps("all-reduce", None) == (1, 1)
    assert ring_steps("all-gather", 1) == (0, 1)
    assert ring_factor("all-reduce", 8) == 2 * 7 / 8


def test_one_formula_for_simulator_and_hlo_report():
    link = Link("l", 100e9, 2e-6, efficiency=0.5)
    ar = collective_seconds("all-reduce", 8e6, 4, link)
    assert ar == pytest.approx(6 * 2e-6 + 1.5 * 8e6 / 50e9)
    assert all_reduce_time(8e6, 4, link) == ar
    assert all_gather_time(8e6, 4, link) == collective_seconds("all-gather", 8e6, 4, link)
    assert p2p_time(8e6, link) == collective_seconds("collective-permute", 8e6, None, link)
    assert p2p_time(8e6, link) == pytest.approx(2e-6 + 8e6 / 50e9)
    assert collective_seconds("all-reduce", 0, 4, link) == 0.0
    assert collective_seconds("all-reduce", 8e6, 1, link) == 0.0

    model = LinkModel(bytes_per_s=100e9, axis_bytes_per_s={"dp": 25e9, "tp": 50e9})
    assert model.link(("tp",)).effective_bandwidth == 50e9
    assert model.link(("dp", "tp")).bandwidth_bytes_per_s == 25e9  # the slowest axis
    assert model.link(()).bandwidth_bytes_per_s == 100e9
    assert LinkModel.from_chip(CHIPS["h100"]).bytes_per_s == 450e9
