"""The project's GPU target descriptions against XLA's own, and compiled deviceless."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_overlap.analysis import deviceless
from jax_overlap.hardware.machine import chip_spec
from jax_overlap.analysis.xla_targets import (
    PRIMITIVE_TYPE_IDS,
    TARGETS,
    get_target,
    read_textproto,
    target_config_text,
)

REFERENCE_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "gpu_targets"
REFERENCE_FILES = {"a100": "a100_sxm_80.txtpb", "h100": "h100_sxm.txtpb", "h200": "h200.txtpb"}

EXACT_FIELDS = [
    "core_count", "fpus_per_core", "threads_per_warp", "threads_per_block_limit",
    "threads_per_core_limit", "shared_memory_per_block", "shared_memory_per_core",
    "shared_memory_per_block_optin", "l2_cache_size", "registers_per_core_limit",
    "registers_per_block_limit", "block_dim_limit_x", "block_dim_limit_y",
    "block_dim_limit_z", "thread_dim_limit_x", "thread_dim_limit_y", "thread_dim_limit_z",
    "cuda_compute_capability.major", "cuda_compute_capability.minor",
    "cuda_compute_capability.feature_extension", "device_interconnect_info.active_links",
]
# Published figures are rounded (3.35 TB/s, "80GB"); XLA's files hold what a driver
# reported, so these agree to a tolerance.
CLOSE_FIELDS = {"clock_rate_ghz": 1e-6, "memory_bandwidth": 0.01, "device_memory_size": 0.02}


def _reference(key: str) -> dict[str, list[str]]:
    path = REFERENCE_DIR / REFERENCE_FILES[key]
    if not path.exists():
        pytest.skip(f"XLA reference descriptions not found at {REFERENCE_DIR}")
    return read_textproto(path.read_text())


def _units(fields: dict[str, list[str]], block: str) -> dict[int, tuple[float, int, int]]:
    prefix = f"gpu_device_info.{block}.rate_infos."
    keys = fields.get(prefix + "key", [])
    clocks = fields.get(prefix + "value.clock_rate_ghz", [])
    units = fields.get(prefix + "value.units_per_core", [])
    ops = fields.get(prefix + "value.ops_per_clock", [])
    rows = zip(keys, clocks, units, ops, strict=True)
    return {int(k): (float(c), int(u), int(o)) for k, c, u, o in rows}


@pytest.mark.parametrize("key", sorted(REFERENCE_FILES))
def test_description_agrees_with_xla_reference(key):
    ref = _reference(key)
    ours = read_textproto(target_config_text(key))
    for name in EXACT_FIELDS:
        path = f"gpu_device_info.{name}"
        default = ["0"] if not name.endswith("feature_extension") else ["NONE"]
        if path in ref or name == "cuda_compute_capability.minor":
            assert ours.get(path, default) == ref.get(path, default), name
    for name, tolerance in CLOSE_FIELDS.items():
        path = f"gpu_device_info.{name}"
        assert float(ours[path][0]) == pytest.approx(float(ref[path][0]), rel=tolerance), name
    assert ours["platform_name"] == ref["platform_name"] == ["CUDA"]
    for block in ("scalar_unit_description", "matrix_unit_description"):
        ref_units, our_units = _units(ref, block), _units(ours, block)
        for type_id, (clock, units, ops) in our_units.items():
            assert type_id in ref_units, (block, type_id)
            assert ref_units[type_id][1:] == (units, ops), (block, type_id)
            assert ref_units[type_id][0] == pytest.approx(clock, rel=0.01), (block, type_id)
        if ref_units:
            # Every tensor-core type we claim, XLA's description has too, and we cover
            # the ones training uses.
            assert {PRIMITIVE_TYPE_IDS[t] for t in ("bf16", "f16", "f32")} <= set(our_units)


@pytest.mark.parametrize("key", sorted(TARGETS))
def test_chip_spec_matches_device_description(key):
    target = get_target(key)
    chip, dev = target.chip, target.device
    # FP32 CUDA-core rate = SMs x FP32 units x 2 FLOP/FMA x clock.
    assert chip.peak_fp32_flops == pytest.approx(
        dev.core_count * dev.fpus_per_core * 2 * dev.clock_rate_ghz * 1e9, rel=0.01)
    assert chip.hbm_bytes == dev.device_memory_size
    assert chip.hbm_bytes_per_s == pytest.approx(dev.memory_bandwidth, rel=0.01)
    assert chip.nvlink_links == dev.nvlink_links
    if dev.matrix_units:
        bf16 = dev.matrix_units["bf16"]
        tensor = dev.core_count * bf16.units_per_core * bf16.ops_per_clock * 2
        assert chip.peak_bf16_flops == pytest.approx(tensor * bf16.clock_rate_ghz * 1e9, rel=0.01)


def test_chip_specs_published_rates():
    assert chip_spec("a100").peak_bf16_flops == 312e12
    assert chip_spec("h100").peak_bf16_flops == chip_spec("h200").peak_bf16_flops == 989e12
    assert chip_spec("a100").nvlink_bytes_per_s == 600e9
    assert chip_spec("h200").nvlink_bytes_per_s == 900e9
    assert chip_spec("h200").nvlink_unidirectional_bytes_per_s == 450e9
    h100 = chip_spec("h100")
    assert h100.matmul_flops_per_s("bf16") == 989e12
    assert h100.matmul_flops_per_s("f32") == h100.peak_tf32_flops
    assert h100.matmul_flops_per_s("f8e4m3fn") == h100.peak_fp8_flops
    assert chip_spec("a100").matmul_flops_per_s("f8e4m3fn") == 312e12  # no FP8 on Ampere
    assert chip_spec("h200").hbm_bytes_per_s > h100.hbm_bytes_per_s


def test_target_names():
    assert get_target("H100_SXM").key == "h100"
    assert get_target("a100-sxm4-80gb").key == "a100"
    with pytest.raises(ValueError, match="a100, h100, h200"):
        get_target("v100")


@pytest.mark.skipif(not deviceless.plugin_available(),
                    reason=deviceless.unavailable_reason() or "")
@pytest.mark.parametrize("key", sorted(TARGETS))
def test_description_compiles_deviceless(key):
    devices = deviceless.gpu_topology_devices(key, 2)
    assert devices[0].device_kind == get_target(key).device.name
    mesh = Mesh(np.array(devices), ("x",))

    def f(a, b):
        return jax.lax.psum(a @ b, "x")

    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(None, "x"), P("x", None)),
                               out_specs=P()))
    a = jax.ShapeDtypeStruct((128, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "x")))
    b = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P("x", None)))
    text = deviceless.compile_lowered(fn.lower(a, b))
    assert "is_scheduled=true" in text
    assert "all-reduce" in text
