"""The plan's plain values: the target a step runs on, the resolved overlap choices,
Streaming DiLoCo's, and a choice made for an `auto` knob with its reason."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MIB = 2**20


@dataclass(frozen=True)
class Target:
    """What the step runs on, as far as the plan's automatic choices care.

    Attributes:
      name: "cpu", or a GPU's short name ("h100") or device kind.
      accelerator: whether collectives run asynchronously beside compute (GPU).
      memory_bytes: device memory, None where unknown (no memory check then).
    """

    name: str = "cpu"
    accelerator: bool = False
    memory_bytes: float | None = None

    @classmethod
    def of_devices(cls, devices) -> "Target":
        """The target of the devices a run uses (the first one's platform and memory)."""
        d = devices[0]
        if d.platform == "cpu":
            return cls()
        memory = None
        try:
            memory = (d.memory_stats() or {}).get("bytes_limit")
        except Exception:  # noqa: BLE001 - memory stats are optional on some backends
            memory = None
        return cls(getattr(d, "device_kind", d.platform), True, memory)


@dataclass(frozen=True)
class OverlapPlan:
    """The resolved overlap choices, as plain values.

    Attributes:
      grad_bucket_bytes: DP gradient bucket size; 0 = one reduction per leaf after the backward.
      bucket_order: "backward" or "largest_first".
      embed_before_first_layer: issue the embedding's buckets ahead of the first layer's.
      zero1: optimizer state split over dp (reduce-scatter, then all-gather the parameters).
      grad_comm_dtype: "fp32" or "bf16", the dtype gradients travel in.
      fsdp: block parameters stored split over dp, gathered `window` blocks ahead.
      window: FSDP prefetch depth.
      tp_comm: "plain", "sequence_parallel" or "collective_matmul".
      cm_direction: collective matmul ring, "uni" or "bi".
      cm_grouped: collective matmul steps are tp-grouped all-gathers / reduce-scatters, not
        ring ppermutes (pp > 1: a permute inside the executor's per-stage branches is
        matched with another stage's permute; `parallel.collective_matmul`).
      xla_preset: XLA flag preset name, or "none".
      dcn_delay: 1 applies the cross-dcn reduction of each step's gradient one step late.
      dcn_delay_compensation: DC-ASGD lambda for the late gradient (0: none).
      dcn_comm_dtype: "fp32" or "bf16", what the gradient bytes crossing dcn travel in.
      dcn_delay_mode: "gradient" (the reduced gradient one step late) or "local" (each
        group's own update at once, the mean of the groups' updates one step late).
      moe_chunks: expert parallelism's all-to-alls per MoE layer and direction (the tokens
        in that many chunks, each one's all-to-all under another's expert GEMMs).
      pair_microbatches: pp = 1, the microbatch loop runs one microbatch's forward beside the
        previous one's backward (`training.grads`).
      lone_tp_comm: "same", or "collective_matmul": a fused pipeline tick that runs one
        action runs it with collective matmul (`pipeline.executor`).
      sp_split: "sequence" or "batch": the dim sequence parallelism splits the activations
        along between blocks (`Parallel.sp_dim`).
    """

    grad_bucket_bytes: int = 0
    bucket_order: str = "backward"
    embed_before_first_layer: bool = False
    zero1: bool = False
    grad_comm_dtype: str = "fp32"
    fsdp: bool = False
    window: int = 2
    tp_comm: str = "plain"
    cm_direction: str = "uni"
    cm_grouped: bool = False
    xla_preset: str = "none"
    dcn_delay: int = 0
    dcn_delay_compensation: float = 0.0
    dcn_comm_dtype: str = "fp32"
    dcn_delay_mode: str = "local"
    moe_chunks: int = 1
    pair_microbatches: bool = False
    lone_tp_comm: str = "same"
    sp_split: str = "sequence"

    @property
    def buckets_in_loop(self) -> bool:
        """Whether the pipeline reduces block gradients inside the tick loop: with buckets,
        except under fsdp (reduce-scattered once after the loop)."""
        return self.grad_bucket_bytes > 0 and not self.fsdp


@dataclass(frozen=True)
class DilocoPlan:
    """Streaming DiLoCo over dcn (`overlap.diloco`), resolved.

    Attributes:
      inner_steps: H, inner steps between two syncs of one fragment.
      fragments: parameter fragments; fragment f is issued at inner steps t with
        t % H == f * H / fragments.
      delay: tau, inner steps between issuing a fragment's sync and applying it.
      outer_lr, outer_momentum: outer Nesterov SGD.
      outer_dtype: "fp32", "bf16" or "int8", what the outer gradient crosses dcn in.
      mix: share of the local fragment kept when a delayed sync lands.
    """

    inner_steps: int
    fragments: int = 1
    delay: int = 0
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_dtype: str = "bf16"
    mix: float = 0.5

    @property
    def period(self) -> int:
        """Inner steps between two consecutive fragment syncs (of different fragments)."""
        return self.inner_steps // self.fragments


@dataclass(frozen=True)
class Choice:
    """A knob the plan chose because the config said `auto`."""

    value: Any
    why: str
