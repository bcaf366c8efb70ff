"""GPU target descriptions written by this project: what XLA needs to compile for a GPU.

Per GPU model the project compiles for without the GPU (A100-SXM4-80GB, H100-SXM5-80GB,
H200-SXM-141GB), a :class:`GpuTarget` pairs

* its chip from the machine model (:data:`jax_overlap.hardware.machine.CHIPS`: the
  peak rates the analysis uses), with
* a :class:`GpuDeviceInfo` -- the facts XLA's GPU compiler reads from a
  ``stream_executor.GpuTargetConfigProto`` when it compiles without a GPU
  (:mod:`jax_overlap.analysis.deviceless`). :func:`target_config_text` renders it
  as the text proto that ``jax.experimental.topologies.get_topology_desc(
  platform="cuda", target_config=...)`` takes.

Every value comes from a published source named in a comment next to it: the CUDA C++
Programming Guide's table "Technical Specifications per Compute Capability", NVIDIA's
datasheets for the A100 (80GB SXM4), H100 (SXM5) and H200 (SXM), and the NVIDIA
Ampere (GA100) / Hopper (GH100) architecture whitepapers. Values the compiler needs
but no datasheet prints are derived from those, with the arithmetic in the comment.

:func:`render_target_config` writes every field of :class:`GpuDeviceInfo`: some are
required (without them the compiler crashes or targets the wrong architecture), others
change the compiled program or feed XLA's cost models. Which was which, for one
jaxlib: ``docs/design/xla_notes.md``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from jax_overlap.hardware.machine import CHIPS, ChipSpec, chip_key

_GIB = 1 << 30
_MIB = 1 << 20
_KIB = 1 << 10

# xla.PrimitiveType enum values (xla/xla_data.proto); the unit-rate tables of a
# GpuDeviceInfoProto are keyed by them.
PRIMITIVE_TYPE_IDS: Mapping[str, int] = {
    "s8": 2,
    "s32": 4,
    "u8": 6,
    "u32": 8,
    "f16": 10,
    "f32": 11,
    "f64": 12,
    "bf16": 16,
    "f8e5m2": 19,
    "f8e4m3fn": 20,
    "f8e4m3b11fnuz": 23,
    "f8e5m2fnuz": 24,
    "f8e4m3fnuz": 25,
    "f8e4m3": 28,
    "f8e3m4": 29,
}


@dataclass(frozen=True)
class UnitRate:
    """Throughput of one kind of execution unit for one element type.

    Attributes:
      clock_rate_ghz: clock the rate is quoted at.
      units_per_core: units of this kind per SM.
      ops_per_clock: fused multiply-adds per unit per clock.
    """

    clock_rate_ghz: float
    units_per_core: int
    ops_per_clock: int


@dataclass(frozen=True)
class GpuDeviceInfo:
    """The subset of ``stream_executor.GpuDeviceInfoProto`` XLA's GPU compiler reads.

    Attributes mirror the proto fields of the same name; byte sizes are bytes,
    bandwidths bytes/s. ``scalar_units`` / ``matrix_units`` map an HLO type name (key
    of :data:`PRIMITIVE_TYPE_IDS`) to its :class:`UnitRate`; they feed XLA's
    analytical cost models and may be empty (the models then fall back to
    ``core_count x fpus_per_core x clock_rate_ghz``).
    """

    name: str
    core_count: int
    fpus_per_core: int
    clock_rate_ghz: float
    memory_bandwidth: int
    l2_cache_size: int
    device_memory_size: int
    shared_memory_per_core: int
    shared_memory_per_block_optin: int
    compute_capability: tuple[int, int]
    accelerated_features: bool
    nvlink_links: int
    shared_memory_per_block: int = 48 * _KIB
    threads_per_block_limit: int = 1024
    threads_per_warp: int = 32
    threads_per_core_limit: int = 2048
    block_dim_limit: tuple[int, int, int] = (2**31 - 1, 65535, 65535)
    thread_dim_limit: tuple[int, int, int] = (1024, 1024, 64)
    registers_per_core_limit: int = 65536
    registers_per_block_limit: int = 65536
    # cuDNN the compiler may assume: jax-cuda12-plugin's `with-cuda` extra requires
    # nvidia-cudnn-cu12>=9.10.2.21, so every supported GPU install has at least this.
    dnn_version: tuple[int, int, int] = (9, 10, 2)
    scalar_units: Mapping[str, UnitRate] = field(default_factory=dict)
    matrix_units: Mapping[str, UnitRate] = field(default_factory=dict)


@dataclass(frozen=True)
class GpuTarget:
    """One GPU model the project can compile for without the GPU.

    Attributes:
      key: short name (``a100``, ``h100``, ``h200``).
      chip: peak rates.
      device: compiler-facing description.
    """

    key: str
    chip: ChipSpec
    device: GpuDeviceInfo


# --------------------------------------------------------------------------- A100
# Sources: NVIDIA A100 Tensor Core GPU datasheet (80GB SXM column); NVIDIA A100
# Tensor Core GPU Architecture whitepaper (GA100: 108 SMs enabled, 64 FP32 cores and
# 4 third-generation tensor cores per SM, 40 MB L2, 164 KB shared memory per SM);
# CUDA C++ Programming Guide, compute capability 8.0 column.
A100_DEVICE = GpuDeviceInfo(
    name="NVIDIA A100-SXM4-80GB",  # the name the driver reports for this part
    core_count=108,  # whitepaper: 108 SMs on A100
    fpus_per_core=64,  # whitepaper: 64 FP32 CUDA cores per SM
    clock_rate_ghz=1.41,  # datasheet/whitepaper: 1410 MHz boost clock
    memory_bandwidth=2_039_040_000_000,  # 1593 MHz x 5120-bit x 2 (DDR) / 8 = 2,039 GB/s
    l2_cache_size=40 * _MIB,  # whitepaper: 40 MB L2
    device_memory_size=80 * _GIB,  # datasheet: 80GB
    shared_memory_per_core=164 * _KIB,  # programming guide cc 8.0: 164 KB per SM
    shared_memory_per_block_optin=163 * _KIB,  # programming guide cc 8.0: 163 KB per block
    compute_capability=(8, 0),  # programming guide: A100 is compute capability 8.0
    accelerated_features=False,  # sm_80 has no architecture-specific "a" features
    nvlink_links=12,
    # No unit-rate tables: XLA's own A100 description has none either, and its cost
    # models then use core_count x fpus_per_core x clock.
)

# --------------------------------------------------------------------------- H100
# Sources: NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column); NVIDIA H100 Tensor
# Core GPU Architecture whitepaper (GH100 SXM5: 132 SMs, 128 FP32 cores, 64 INT32 and
# 64 FP64 cores and 4 fourth-generation tensor cores per SM, 50 MB L2, 228 KB shared
# memory per SM, 18 NVLink-4 links); CUDA C++ Programming Guide, compute capability 9.0.
_H100_SCALAR_CLOCK = 1.98  # datasheet: H100 SXM max boost clock 1980 MHz
# Tensor-core clock implied by the datasheet's dense BF16 rate:
# 989e12 FLOP/s / (132 SMs x 4 tensor cores x 512 FMA/clock x 2 FLOP/FMA) = 1.829 GHz.
_H100_MATRIX_CLOCK = round(989e12 / (132 * 4 * 512 * 2) / 1e9, 4)


def _hopper_units(clock: float, matrix_clock: float) -> tuple[dict, dict]:
    """Per-SM unit rates of a GH100 SM (H100 and H200 share the SM).

    Args:
      clock: CUDA-core clock in GHz.
      matrix_clock: tensor-core clock in GHz.

    Returns:
      (scalar_units, matrix_units) keyed by HLO type name.
    """
    scalar = {
        "s32": UnitRate(clock, 64, 1),  # whitepaper: 64 INT32 units per SM
        "u32": UnitRate(clock, 64, 1),
        "f16": UnitRate(clock, 128, 2),  # 128 FP32 cores, each a packed half2 FMA
        "bf16": UnitRate(clock, 128, 2),
        "f32": UnitRate(clock, 128, 1),  # 132 x 128 x 2 x 1.98 GHz = 67 TFLOPS (datasheet)
        "f64": UnitRate(clock, 64, 1),  # 64 FP64 units per SM: 33.5 TFLOPS (datasheet 34)
    }
    # FMA per tensor core per clock, from the dense datasheet rates at the tensor clock:
    # BF16/FP16 512, TF32 256, FP8/INT8 1024; FP64 tensor 67 TFLOPS -> 32 at 1.98 GHz.
    matrix = {
        "bf16": UnitRate(matrix_clock, 4, 512),
        "f16": UnitRate(matrix_clock, 4, 512),
        "f32": UnitRate(matrix_clock, 4, 256),
        "f64": UnitRate(clock, 4, 32),
        "s8": UnitRate(matrix_clock, 4, 1024),
        "u8": UnitRate(matrix_clock, 4, 1024),
    }
    for fp8 in ("f8e5m2", "f8e4m3fn", "f8e4m3b11fnuz", "f8e5m2fnuz", "f8e4m3fnuz",
                "f8e4m3", "f8e3m4"):
        matrix[fp8] = UnitRate(matrix_clock, 4, 1024)
    return scalar, matrix


_HOPPER_SCALAR, _HOPPER_MATRIX = _hopper_units(_H100_SCALAR_CLOCK, _H100_MATRIX_CLOCK)

H100_DEVICE = GpuDeviceInfo(
    name="NVIDIA H100 80GB HBM3",  # the name the driver reports for H100 SXM5
    core_count=132,  # whitepaper: 132 SMs on H100 SXM5
    fpus_per_core=128,  # whitepaper: 128 FP32 CUDA cores per SM
    clock_rate_ghz=_H100_SCALAR_CLOCK,
    memory_bandwidth=3_352_320_000_000,  # 2619 MHz x 5120-bit x 2 / 8 = 3.35 TB/s (datasheet)
    l2_cache_size=50 * _MIB,  # whitepaper: 50 MB L2
    device_memory_size=80 * _GIB,  # datasheet: 80GB
    shared_memory_per_core=228 * _KIB,  # programming guide cc 9.0: 228 KB per SM
    shared_memory_per_block_optin=227 * _KIB,  # programming guide cc 9.0: 227 KB per block
    compute_capability=(9, 0),  # programming guide: H100 is compute capability 9.0
    accelerated_features=True,  # sm_90a: wgmma/TMA instructions XLA's Hopper kernels use
    nvlink_links=18,
    scalar_units=_HOPPER_SCALAR,
    matrix_units=_HOPPER_MATRIX,
)

# --------------------------------------------------------------------------- H200
# Sources: NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column). The H200 is the
# GH100 die of the H100 SXM5 with 141 GB of HBM3e: same SMs, clocks, tensor rates
# and NVLink; only memory size and bandwidth differ.
H200_DEVICE = dataclasses.replace(
    H100_DEVICE,
    name="NVIDIA H200",  # the name the driver reports for H200 SXM
    memory_bandwidth=4_800_000_000_000,  # datasheet: 4.8 TB/s
    device_memory_size=141 * _GIB,  # datasheet: 141GB
)

TARGETS: Mapping[str, GpuTarget] = {
    "a100": GpuTarget("a100", CHIPS["a100"], A100_DEVICE),
    "h100": GpuTarget("h100", CHIPS["h100"], H100_DEVICE),
    "h200": GpuTarget("h200", CHIPS["h200"], H200_DEVICE),
}


def get_target(name: str) -> GpuTarget:
    """Look up a target by short name or alias (case-insensitive).

    Args:
      name: ``a100``, ``h100``, ``h200`` or an alias such as ``h100_sxm``.

    Returns:
      The :class:`GpuTarget`.

    Raises:
      ValueError: unknown name; the message lists the valid ones.
    """
    key = chip_key(name)
    if key not in TARGETS:
        raise ValueError(
            f"unknown GPU target {name!r}; valid targets: {', '.join(sorted(TARGETS))}"
        )
    return TARGETS[key]


def _fmt_float(value: float) -> str:
    """Shortest decimal text for a float, as text protos write them."""
    return repr(float(value))


def _unit_block(title: str, units: Mapping[str, UnitRate]) -> list[str]:
    """Text-proto lines of one ``*_unit_description`` block, ordered by type id."""
    lines = [f"  {title} {{"]
    for dtype in sorted(units, key=lambda d: PRIMITIVE_TYPE_IDS[d]):
        rate = units[dtype]
        lines += [
            "    rate_infos {",
            f"      key: {PRIMITIVE_TYPE_IDS[dtype]}",
            "      value {",
            f"        clock_rate_ghz: {_fmt_float(rate.clock_rate_ghz)}",
            f"        units_per_core: {rate.units_per_core}",
            f"        ops_per_clock: {rate.ops_per_clock}",
            "      }",
            "    }",
        ]
    lines.append("  }")
    return lines


def render_target_config(device: GpuDeviceInfo) -> str:
    """Render a :class:`GpuDeviceInfo` as ``stream_executor.GpuTargetConfigProto`` text.

    Args:
      device: the description.

    Returns:
      Text-proto string accepted by ``get_topology_desc(target_config=...)``.
    """
    major, minor = device.compute_capability
    cc = [f"    major: {major}"]
    if minor:
        cc.append(f"    minor: {minor}")
    cc.append(
        "    feature_extension: "
        + ("ACCELERATED_FEATURES" if device.accelerated_features else "NONE")
    )
    lines = [
        "# stream_executor.GpuTargetConfigProto written by jax_overlap.analysis.xla_targets",
        "gpu_device_info {",
        f"  threads_per_block_limit: {device.threads_per_block_limit}",
        f"  threads_per_warp: {device.threads_per_warp}",
        f"  shared_memory_per_block: {device.shared_memory_per_block}",
        f"  shared_memory_per_core: {device.shared_memory_per_core}",
        f"  threads_per_core_limit: {device.threads_per_core_limit}",
        f"  core_count: {device.core_count}",
        f"  fpus_per_core: {device.fpus_per_core}",
        f"  block_dim_limit_x: {device.block_dim_limit[0]}",
        f"  block_dim_limit_y: {device.block_dim_limit[1]}",
        f"  block_dim_limit_z: {device.block_dim_limit[2]}",
        f"  memory_bandwidth: {device.memory_bandwidth}",
        f"  l2_cache_size: {device.l2_cache_size}",
        f"  clock_rate_ghz: {_fmt_float(device.clock_rate_ghz)}",
        f"  device_memory_size: {device.device_memory_size}",
        f"  shared_memory_per_block_optin: {device.shared_memory_per_block_optin}",
        "  cuda_compute_capability {",
        *cc,
        "  }",
        f"  registers_per_core_limit: {device.registers_per_core_limit}",
        f"  registers_per_block_limit: {device.registers_per_block_limit}",
    ]
    if device.scalar_units:
        lines += _unit_block("scalar_unit_description", device.scalar_units)
    if device.matrix_units:
        lines += _unit_block("matrix_unit_description", device.matrix_units)
    lines += [
        f"  thread_dim_limit_x: {device.thread_dim_limit[0]}",
        f"  thread_dim_limit_y: {device.thread_dim_limit[1]}",
        f"  thread_dim_limit_z: {device.thread_dim_limit[2]}",
        '  device_vendor: "NVIDIA Corporation"',
        f'  name: "{device.name}"',
        "  device_interconnect_info {",
        f"    active_links: {device.nvlink_links}",
        "  }",
        "}",
        'platform_name: "CUDA"',
        "dnn_version_info {",
        f"  major: {device.dnn_version[0]}",
        f"  minor: {device.dnn_version[1]}",
        f"  patch: {device.dnn_version[2]}",
        "}",
        f'device_description_str: "{device.name}"',
    ]
    return "\n".join(lines) + "\n"


def target_config_text(name: str) -> str:
    """GpuTargetConfigProto text of a target (see :func:`get_target` for names)."""
    return render_target_config(get_target(name).device)


_FIELD_RE = re.compile(r"^([A-Za-z_][\w]*)\s*:\s*(.+?)\s*$")
_OPEN_RE = re.compile(r"^([A-Za-z_][\w]*)\s*\{\s*$")


def _strip_comment(line: str) -> str:
    """Drop a ``#`` comment that is not inside a quoted string."""
    quoted = False
    for i, ch in enumerate(line):
        if ch == '"' and (i == 0 or line[i - 1] != "\\"):
            quoted = not quoted
        elif ch == "#" and not quoted:
            return line[:i]
    return line


def read_textproto(text: str) -> dict[str, list[str]]:
    """Flatten a text proto into ``dotted.field.path -> [values]``.

    Only what these descriptions use is supported: one field per line, nested
    messages opened with ``name {`` and closed with ``}``, ``#`` comments. Repeated
    fields and fields inside repeated messages collect every value in order; string
    values keep their quotes stripped.

    Args:
      text: the text proto.

    Returns:
      Mapping from dotted path (e.g. ``gpu_device_info.cuda_compute_capability.major``)
      to the list of raw values found at that path.
    """
    out: dict[str, list[str]] = {}
    stack: list[str] = []
    for raw in text.splitlines():
        line = _strip_comment(raw).strip()
        if not line:
            continue
        if line == "}":
            stack.pop()
            continue
        opened = _OPEN_RE.match(line)
        if opened:
            stack.append(opened.group(1))
            continue
        match = _FIELD_RE.match(line)
        if match:
            value = match.group(2)
            if value.startswith('"') and value.endswith('"'):
                value = value[1:-1]
            out.setdefault(".".join(stack + [match.group(1)]), []).append(value)
    return out
