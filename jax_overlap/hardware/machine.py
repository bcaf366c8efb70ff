"""The machine model: chips, the links between them, and which link each mesh axis uses.

One description of the hardware serves every estimate in the project -- MFU in the
training loop, the exposed-communication estimate of the HLO report, the timeline
simulator and the tuner:

* :class:`ChipSpec` -- one GPU model's peak rates: dense FLOP/s per dtype
  (:meth:`ChipSpec.matmul_flops_per_s`), HBM size and bandwidth, NVLink.
  :data:`CHIPS` is the table; :func:`chip_spec` looks a chip up by name,
  :func:`chip_for_device_kind` by the ``device_kind`` a JAX device reports.
* :class:`Link` -- one kind of interconnect as one device sees it: bandwidth per
  direction, latency per transfer (one ring hop), and the share of the peak that
  collectives reach.
* :class:`HardwareProfile` -- a whole machine for the simulator and the tuner: its
  chip's rate and memory, its links and which link each mesh axis (``dp``, ``pp``,
  ``tp``) uses. Profiles are YAML files under ``configs/hardware/``, read (and, for
  this machine, measured) by :mod:`jax_overlap.hardware.link_profiles`.
* :class:`LinkModel` -- the links of a compiled program's collectives for the HLO
  report, by mesh axis name (a compiled program may name its axes anything).

What a collective costs on a :class:`Link` is :mod:`jax_overlap.hardware.collective_cost`. What
XLA's GPU compiler needs to compile for a chip without one is
:mod:`jax_overlap.analysis.xla_targets`.

Every chip number comes from a published source named in a comment next to it
(NVIDIA's datasheets and architecture whitepapers); numbers derived from those show
the arithmetic.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

_GIB = 1 << 30
# Seconds to launch one GPU kernel: what the GPU-step estimate charges every kernel, and what
# a tick of many small kernels costs beyond its GEMMs.
KERNEL_LAUNCH_S = 4e-6

# ----------------------------------------------------------------------------- chips


@dataclass(frozen=True)
class KernelEfficiency:
    """Shares of a chip's peaks that its kernels were measured to reach in a training step.

    The GPU-step estimate is a roofline at the peaks; its ``expected`` figure runs every
    kernel at these shares instead (:meth:`ChipSpec.at_measured_rates`).

    Attributes:
      gemm: cuBLAS / Triton GEMMs: achieved FLOP/s over the matmul peak.
      attention: cuDNN fused attention: its matmul FLOPs per second over the matmul peak.
      memory: every other kernel: its roofline bytes per second over the HBM bandwidth.
      source: where and how they were measured.
    """

    gemm: float
    attention: float
    memory: float
    source: str


# Measured on one H200 (jax 0.11.2, CUDA 13), 2026-12-04, `scripts/gpu_check.sh`: GPT-1.3B,
# 32 x 2048 tokens a step on one GPU, traced. Fitted to the plan's program (remat full, fused
# attention); out of sample within 5% of four more traced steps (GPT-1.3B under remat none
# and plain attention, a Llama-3-8B shape under full and none; docs/results.md, "The
# estimate against a real GPU"). The H100 is the same die.
HOPPER_MEASURED = KernelEfficiency(
    gemm=0.75, attention=0.39, memory=0.62,
    source="one H200, GPT-1.3B and a Llama-3-8B shape traced, 2026-12-04 (docs/results.md)")


@dataclass(frozen=True)
class ChipSpec:
    """Peak rates of one GPU model, for MFU and link-time estimates.

    Attributes:
      name: marketing name of the part.
      peak_bf16_flops: dense BF16/FP16 tensor-core FLOP/s (no sparsity).
      peak_tf32_flops: dense TF32 tensor-core FLOP/s: what an f32 matmul runs at under
        JAX's default matmul precision on these chips.
      peak_fp32_flops: FP32 FLOP/s on the CUDA cores (non-tensor).
      peak_fp8_flops: dense FP8 tensor-core FLOP/s, or None where the chip has none.
      hbm_bytes: device memory, as the datasheet states it (GiB-sized parts).
      hbm_bytes_per_s: peak HBM bandwidth.
      nvlink_bytes_per_s: NVLink bandwidth per GPU as NVIDIA publishes it: the sum over
        all links of both directions.
      nvlink_links: number of NVLink links per GPU.
      sources: where the numbers come from.
      efficiency: the shares of these peaks measured kernels reach (None: not measured).
      attention_share: fused attention's matmul rate over the GEMM rate: 1 at the peaks;
        below 1 on a chip at measured rates.
    """

    name: str
    peak_bf16_flops: float
    peak_tf32_flops: float
    peak_fp32_flops: float
    peak_fp8_flops: float | None
    hbm_bytes: int
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    nvlink_links: int
    sources: tuple[str, ...] = ()
    efficiency: KernelEfficiency | None = None
    attention_share: float = 1.0

    @property
    def nvlink_unidirectional_bytes_per_s(self) -> float:
        """Bytes/s one GPU can send (or receive) over NVLink at once.

        Ring collectives send and receive at the same time, so their per-step
        bandwidth is one direction's: half of the published bidirectional figure.
        """
        return self.nvlink_bytes_per_s / 2.0

    def at_measured_rates(self) -> ChipSpec | None:
        """This chip with its peaks scaled to the measured :attr:`efficiency` (None when
        none was measured): the rates the estimate's ``expected`` figure runs kernels at."""
        e = self.efficiency
        if e is None:
            return None
        return dataclasses.replace(
            self, peak_bf16_flops=self.peak_bf16_flops * e.gemm,
            peak_tf32_flops=self.peak_tf32_flops * e.gemm,
            peak_fp32_flops=self.peak_fp32_flops * e.gemm,
            peak_fp8_flops=self.peak_fp8_flops and self.peak_fp8_flops * e.gemm,
            hbm_bytes_per_s=self.hbm_bytes_per_s * e.memory,
            attention_share=e.attention / e.gemm, efficiency=None)

    def attention_flops_per_s(self, dtype: str) -> float:
        """The rate of a fused attention kernel's matmuls (:attr:`attention_share` of the
        GEMM rate)."""
        return self.matmul_flops_per_s(dtype) * self.attention_share

    def matmul_flops_per_s(self, dtype: str) -> float:
        """Peak dense matmul rate for operands of ``dtype`` (an HLO type name).

        Args:
          dtype: HLO element type, e.g. ``bf16``, ``f16``, ``f32``, ``f8e4m3fn``.

        Returns:
          FLOP/s: BF16 rate for 16-bit types, TF32 rate for f32 (JAX's default matmul
          precision on Ampere/Hopper uses TF32 tensor cores), FP8 rate for 8-bit floats
          where the chip has FP8 (else BF16), FP32 CUDA-core rate for anything else.
        """
        dtype = dtype.lower()
        if dtype in ("bf16", "f16"):
            return self.peak_bf16_flops
        if dtype == "f32":
            return self.peak_tf32_flops
        if dtype.startswith("f8"):
            return self.peak_fp8_flops or self.peak_bf16_flops
        if dtype in ("s8", "u8"):
            # Integer MMA runs at the FP8 rate on Hopper and twice BF16 on Ampere.
            return self.peak_fp8_flops or 2.0 * self.peak_bf16_flops
        return self.peak_fp32_flops


# --------------------------------------------------------------------------- A100
# Sources: NVIDIA A100 Tensor Core GPU datasheet (80GB SXM column); NVIDIA A100
# Tensor Core GPU Architecture whitepaper (GA100: 108 SMs enabled, 64 FP32 cores and
# 4 third-generation tensor cores per SM, 40 MB L2, 164 KB shared memory per SM);
# CUDA C++ Programming Guide, compute capability 8.0 column.
A100_CHIP = ChipSpec(
    name="NVIDIA A100-SXM4-80GB",
    peak_bf16_flops=312e12,  # datasheet: BF16 Tensor Core 312 TFLOPS (dense)
    peak_tf32_flops=156e12,  # datasheet: TF32 Tensor Core 156 TFLOPS (dense)
    peak_fp32_flops=19.5e12,  # datasheet: FP32 19.5 TFLOPS
    peak_fp8_flops=None,  # Ampere tensor cores have no FP8
    hbm_bytes=80 * _GIB,  # datasheet: 80GB HBM2e
    hbm_bytes_per_s=2039e9,  # datasheet: 2,039 GB/s (80GB SXM)
    nvlink_bytes_per_s=600e9,  # datasheet: NVLink 600 GB/s (12 links x 50 GB/s)
    nvlink_links=12,  # whitepaper: 12 third-generation NVLink links
    sources=(
        "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM)",
        "NVIDIA A100 Tensor Core GPU Architecture whitepaper",
    ),
)

# --------------------------------------------------------------------------- H100
# Sources: NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column); NVIDIA H100 Tensor
# Core GPU Architecture whitepaper (GH100 SXM5: 132 SMs, 128 FP32 cores, 64 INT32 and
# 64 FP64 cores and 4 fourth-generation tensor cores per SM, 50 MB L2, 228 KB shared
# memory per SM, 18 NVLink-4 links); CUDA C++ Programming Guide, compute capability 9.0.
H100_CHIP = ChipSpec(
    name="NVIDIA H100 SXM5 80GB",
    peak_bf16_flops=989e12,  # datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity -> 989 dense
    peak_tf32_flops=494.5e12,  # datasheet: TF32 Tensor Core 989 TFLOPS with sparsity -> 494.5 dense
    peak_fp32_flops=67e12,  # datasheet: FP32 67 TFLOPS
    peak_fp8_flops=1979e12,  # datasheet: FP8 Tensor Core 3,958 TFLOPS with sparsity -> 1,979 dense
    hbm_bytes=80 * _GIB,  # datasheet: 80GB HBM3
    hbm_bytes_per_s=3.35e12,  # datasheet: 3.35 TB/s
    nvlink_bytes_per_s=900e9,  # datasheet: NVLink 900 GB/s
    nvlink_links=18,  # whitepaper: 18 fourth-generation NVLink links
    sources=(
        "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM)",
        "NVIDIA H100 Tensor Core GPU Architecture whitepaper",
    ),
    efficiency=HOPPER_MEASURED,
)

# --------------------------------------------------------------------------- H200
# Sources: NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column). The H200 is the
# GH100 die of the H100 SXM5 with 141 GB of HBM3e: same SMs, clocks, tensor rates
# and NVLink; only memory size and bandwidth differ.
H200_CHIP = dataclasses.replace(
    H100_CHIP,
    name="NVIDIA H200 SXM 141GB",
    peak_bf16_flops=989e12,  # datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity
    hbm_bytes=141 * _GIB,  # datasheet: 141GB HBM3e
    hbm_bytes_per_s=4.8e12,  # datasheet: 4.8 TB/s
    nvlink_bytes_per_s=900e9,  # datasheet: NVLink 900 GB/s
    sources=("NVIDIA H200 Tensor Core GPU datasheet (H200 SXM)",) + H100_CHIP.sources,
)

# --------------------------------------------------------------------------- H800
# Sources: NVIDIA H800 Tensor Core GPU datasheet (H800 SXM5 column). The H800 is the
# GH100 die of the H100 SXM5 with the NVLink bandwidth cut to 400 GB/s (and FP64 to
# 1 TFLOPS); the tensor-core rates, memory and HBM bandwidth are the H100's.
H800_CHIP = dataclasses.replace(
    H100_CHIP,
    name="NVIDIA H800 SXM5 80GB",
    nvlink_bytes_per_s=400e9,  # datasheet: NVLink 400 GB/s
    nvlink_links=8,  # 400 GB/s / 50 GB/s per fourth-generation NVLink link
    sources=("NVIDIA H800 Tensor Core GPU datasheet (H800 SXM5)",) + H100_CHIP.sources,
)

# --------------------------------------------------------------------------- B200
# Sources: NVIDIA Blackwell Architecture Technical Brief and the NVIDIA DGX B200 / HGX
# B200 datasheets (HGX B200 at 1000 W; their system figures are for 8 GPUs, divided
# by 8 here).
B200_CHIP = ChipSpec(
    name="NVIDIA B200 (HGX, 1000 W)",
    peak_bf16_flops=2250e12,  # BF16 Tensor Core 4.5 PFLOPS with sparsity -> 2.25 dense
    peak_tf32_flops=1100e12,  # TF32 Tensor Core 2.2 PFLOPS with sparsity -> 1.1 dense
    peak_fp32_flops=80e12,  # FP32 80 TFLOPS
    peak_fp8_flops=4500e12,  # FP8 Tensor Core 9 PFLOPS with sparsity -> 4.5 dense
    hbm_bytes=180 * _GIB,  # DGX B200: 1,440 GB HBM3e over 8 GPUs
    hbm_bytes_per_s=8e12,  # DGX B200: 64 TB/s HBM3e over 8 GPUs
    nvlink_bytes_per_s=1800e9,  # fifth-generation NVLink 1.8 TB/s per GPU
    nvlink_links=18,  # 18 fifth-generation NVLink links (100 GB/s each)
    sources=(
        "NVIDIA Blackwell Architecture Technical Brief (HGX B200)",
        "NVIDIA DGX B200 datasheet",
    ),
)

# The chip table: every chip the project knows, by short name.
CHIPS: Mapping[str, ChipSpec] = {
    "a100": A100_CHIP,
    "h100": H100_CHIP,
    "h200": H200_CHIP,
    "h800": H800_CHIP,
    "b200": B200_CHIP,
}

# Other spellings people use for the same parts.
CHIP_ALIASES: Mapping[str, str] = {
    "a100_sxm_80": "a100",
    "a100-sxm-80gb": "a100",
    "a100-sxm4-80gb": "a100",
    "h100_sxm": "h100",
    "h100-sxm": "h100",
    "h100-sxm5": "h100",
    "h200_sxm": "h200",
    "h200-sxm": "h200",
    "h800_sxm": "h800",
    "h800-sxm": "h800",
}

# What a JAX device's ``device_kind`` contains for each chip, in match order (e.g.
# ``NVIDIA H100 80GB HBM3``, ``NVIDIA A100-SXM4-80GB``, ``NVIDIA H200``).
DEVICE_KIND_MARKERS: Sequence[tuple[str, str]] = (
    ("H100", "h100"),
    ("H200", "h200"),
    ("A100", "a100"),
    ("H800", "h800"),
    ("B200", "b200"),
)


def chip_key(name: str) -> str:
    """The short name of a chip name or alias (lower-cased; may be unknown)."""
    key = name.strip().lower()
    return CHIP_ALIASES.get(key, key)


def chip_spec(name: str) -> ChipSpec:
    """A chip of :data:`CHIPS` by short name or alias (case-insensitive).

    Args:
      name: ``a100``, ``h100``, ``h200``, ``h800``, ``b200`` or an alias such as
        ``h100_sxm``.

    Returns:
      The :class:`ChipSpec`.

    Raises:
      ValueError: unknown name; the message lists the known ones.
    """
    key = chip_key(name)
    if key not in CHIPS:
        raise ValueError(f"unknown chip {name!r}; known chips: {', '.join(sorted(CHIPS))}")
    return CHIPS[key]


def chip_for_device_kind(device_kind: str) -> ChipSpec | None:
    """The chip a JAX device's ``device_kind`` names, or None when none matches.

    Substring match against :data:`DEVICE_KIND_MARKERS` (``NVIDIA H100 80GB HBM3``
    -> H100), so variants of a part (PCIe, NVL) get the SXM part's rates.
    """
    for marker, key in DEVICE_KIND_MARKERS:
        if marker in device_kind:
            return CHIPS[key]
    return None


# ----------------------------------------------------------------------------- links


@dataclass(frozen=True)
class Link:
    """One kind of interconnect, as seen by one device.

    Attributes:
      name: link name in the profile, e.g. ``nvlink``.
      bandwidth_bytes_per_s: peak bytes/s per device per direction.
      latency_s: fixed cost of one transfer (one ring hop of a collective).
      efficiency: fraction of the peak bandwidth collectives reach.
    """

    name: str
    bandwidth_bytes_per_s: float
    latency_s: float
    efficiency: float = 1.0

    @property
    def effective_bandwidth(self) -> float:
        """Bytes/s a large transfer achieves: peak x efficiency."""
        return self.bandwidth_bytes_per_s * self.efficiency


@dataclass(frozen=True)
class AxisLink:
    """Where one mesh axis's traffic goes.

    Attributes:
      link: name of the :class:`Link` it uses.
      crosses_hosts: whether the axis spans hosts (so rides the inter-host network).
    """

    link: str
    crosses_hosts: bool


@dataclass(frozen=True)
class HardwareProfile:
    """A machine description for the timeline simulator.

    Attributes:
      name: profile name.
      description: one line on what machine this is.
      chip: chip model.
      chip_flops: peak dense FLOP/s per device in the training dtype.
      memory_bytes: device memory.
      devices_per_host: devices in one host.
      hosts: hosts.
      links: link name -> :class:`Link`.
      axes: mesh axis (``dp``, ``pp``, ``tp``) -> :class:`AxisLink`.
      sources: dotted field path -> where its value came from.
      synchronous_collectives: communication blocks the device's compute (the XLA CPU
        backend runs collectives inline on the op thread), so nothing overlaps.
    """

    name: str
    description: str
    chip: str
    chip_flops: float
    memory_bytes: float
    devices_per_host: int
    hosts: int
    links: Mapping[str, Link]
    axes: Mapping[str, AxisLink]
    sources: Mapping[str, str] = field(default_factory=dict)
    synchronous_collectives: bool = False

    def link(self, axis: str) -> Link:
        """The link that traffic on mesh ``axis`` uses.

        Args:
          axis: ``dp``, ``pp`` or ``tp``.

        Returns:
          The :class:`Link`.
        """
        return self.links[self.axes[axis].link]

    def with_link(self, axis: str, link: Link) -> HardwareProfile:
        """A copy where ``axis`` uses ``link`` (for what-if sweeps)."""
        links = {**self.links, link.name: link}
        axes = {**self.axes, axis: AxisLink(link.name, self.axes[axis].crosses_hosts)}
        return HardwareProfile(
            self.name,
            self.description,
            self.chip,
            self.chip_flops,
            self.memory_bytes,
            self.devices_per_host,
            self.hosts,
            links,
            axes,
            self.sources,
            self.synchronous_collectives,
        )


@dataclass(frozen=True)
class LinkModel:
    """The links of a compiled program's collectives, by mesh axis name.

    Attributes:
      bytes_per_s: default per-device, per-direction bandwidth.
      axis_bytes_per_s: overrides per mesh axis name (e.g. a ``dp`` axis over
        InfiniBand); a collective over several axes takes the slowest.
      latency_s: latency of one transfer (one ring hop), as :attr:`Link.latency_s`.
    """

    bytes_per_s: float
    axis_bytes_per_s: Mapping[str, float] = field(default_factory=dict)
    latency_s: float = 0.0

    @classmethod
    def from_chip(cls, chip: ChipSpec, **overrides: Any) -> LinkModel:
        """All traffic on NVLink, one direction's bandwidth (see ChipSpec)."""
        return cls(bytes_per_s=chip.nvlink_unidirectional_bytes_per_s, **overrides)

    def axis_bandwidth(self, mesh_axes: Sequence[str]) -> float:
        """Bytes/s over ``mesh_axes``: the slowest of their overrides, else the default."""
        rates = [self.axis_bytes_per_s[a] for a in mesh_axes if a in self.axis_bytes_per_s]
        return min(rates) if rates else self.bytes_per_s

    def bandwidth(self, op: Any) -> float:
        """Bytes/s for a collective (anything with ``replica_groups.mesh_axes``)."""
        return self.axis_bandwidth(op.replica_groups.mesh_axes)

    def link(self, mesh_axes: Sequence[str]) -> Link:
        """The :class:`Link` a collective over ``mesh_axes`` runs on."""
        name = "+".join(mesh_axes) or "default"
        return Link(name, self.axis_bandwidth(mesh_axes), self.latency_s)
