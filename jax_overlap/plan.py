"""The parallel plan: every decision about the mesh, the pipeline and the overlap, made once.

`ParallelPlan.build(cfg, model, target)` reads the config's `mesh`, `pipeline` and `overlap`
sections -- the only module below the CLI, the training loop and the tuner that does -- and
resolves them into plain values: the axis sizes, the microbatch count, the schedule with its
transfer latency and its compiled tick program, the staged layer order, the overlap choices
(bucket size in bytes, ZeRO-1, FSDP window, TP communication) and, given a model, the DP
layout with its bucket plans. The step, the executor, the checkpoint code and the analysis take
the plan (or plain values from it) and never look at the config's parallel sections again.

Knobs left at `auto` are chosen here for the target the step runs on (`Target`): with tp > 1
on a GPU, collective matmul (bidirectional when the local sequence chunk splits in two), and
together the fewest microbatches whose GEMMs stay within their row budget (`gemm_tokens`),
whose pipeline bubble stays within `PIPELINE_BUBBLE`, and whose estimated step
(`hardware.memory`, remat `full`: `GPU_REMAT_WHY`) fits `MEMORY_BUDGET` of the device's
memory; on a CPU, where every collective is synchronous and wall time follows total work, plain
TP, no extra microbatches and no recompute. `ParallelPlan.choices` says what was picked and
why; `resolved_config` writes the choices back into the config (the run's config.json holds
them).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jax_overlap.config import Config, ConfigError, PlanDecides
from jax_overlap.model_api import param_elements
from jax_overlap.pipeline.program import TickProgram, compile_program
from jax_overlap.pipeline.schedules import make_schedule
from jax_overlap.pipeline.table import KINDS, Schedule

MIB = 2**20

# GEMM rows per microbatch (sequences x positions) auto microbatching allows on a GPU where
# tensor parallelism's collectives run whole beside the GEMMs (sequence parallel or plain TP at
# pp = 1): small enough that one microbatch's activations leave XLA's latency-hiding scheduler
# room to keep those collectives in flight (it serialises them when the step would not fit
# otherwise). `gemm_tokens`.
MICROBATCH_TOKENS = 8192
# Everywhere else four times that: data parallelism's GEMMs, each collective-matmul ring
# step's (1/tp of the rows), each pipeline action's. Each microbatch adds a pass over the f32
# gradient accumulators and its share of kernel launches (deviceless 8 x H100, remat full:
# GPT-1.3B dp8, 2026-12-03, m 4 / 2 / 1: 1017 / 960 / 941 ms estimated step, 29.0 / 32.4 /
# 44.9 GiB compiled, at m 1 the f32 logits of the whole batch start to dominate; with the
# exposed communication in the step, 2026-12-06: dp2 x tp4 collective matmul, m 2 / 4 / 8 /
# 16: 1312 / 1429 / 1593 / 1981 ms; pp2 x dp2 x tp2, m 8 / 16 / 32: 1278 / 1271 / 1336 ms).
GEMM_TOKENS = 4 * MICROBATCH_TOKENS
# A pipeline's microbatches fill it: auto takes no fewer than make its bubble,
# (pp - 1) / (m + pp - 1), at most this share (GPT-1.3B pp4 x dp2, m 8 / 16 / 32: 1282 /
# 1151 / 1134 ms; 0.889 / 0.933 / 0.962 of the collective bytes under GEMMs).
PIPELINE_BUBBLE = 0.1
# Share of device memory the estimated step may take under auto microbatching / remat; the rest
# is headroom for the buffers that overlapping keeps alive longer and for XLA's own
# temporaries. (XLA's GPU scheduler itself plans for 80% of the device, and its
# rematerialization pass starts cloning instructions -- GEMMs included -- near 95%.)
MEMORY_BUDGET = 0.8
# Why `model.remat: auto` recomputes a pipeline's forward on a CPU, where no memory needs
# saving: its F files every residual into a stash slot that a later tick reads back, and that
# traffic costs more than the recompute (bench/pipeline.py, p = 4, m = 8: 1F1B's CPU work is
# about 0.8 of a pp = 1 step's under `full`, 1.5 under `none`).
CPU_PIPELINE_REMAT_WHY = ("CPU pipeline: stashing each block's input and recomputing costs "
                          "less work than moving every residual through the stash slots")
# `model.remat` policies by how much of the forward the backward recomputes, least first: on a
# GPU `auto` takes the first whose estimated step fits where no layer scan stacks residuals.
REMAT_ORDER = ("none", "save_dots", "minimal", "full")
# Why `model.remat: auto` recomputes on a GPU even where keeping every residual would fit.
GPU_REMAT_WHY = ("GPU: stashing only each block's input and recomputing is faster than moving "
                 "every residual through memory (traced on one H200: GPT-1.3B 1.28 s a step "
                 "under full, 1.48 s under none; deviceless 8 x H100, estimated: pp4 x dp2 "
                 "paired 1F1B 3.24 -> 1.43 s)")
# `model.remat` policies `auto` tries on a GPU, first the one that fits, where keeping the
# projections' outputs beats recomputing them (`_keeps_projections`), and why.
KEPT_REMATS = ("minimal", "full")
RING_REMAT_WHY = ("collective-matmul rings: recomputing a block's forward would run its ring "
                  "steps again; keeping the projections' outputs recomputes only the "
                  "elementwise work and attention (GPT-1.3B dp2 x tp4, deviceless 8 x H100, "
                  "estimated: 1.21 s under full, 1.09 s under minimal, 1.73 s under none)")
PIPELINE_REMAT_WHY = ("pipeline at tp = 1: B reads the projections' outputs from the F's "
                      "stash slot instead of recomputing the block's GEMMs (GPT-1.3B pp4 x dp2, "
                      "deviceless 8 x H100, estimated: interleaved 1.02 -> 0.98 s, ZB-V "
                      "1.27 -> 1.17 s; at tp = 2 under sequence parallelism no faster: B "
                      "gathers the inputs again for the weight gradients)")
# XLA's rematerialization pass, disabled for a step estimated to fit (`compiler_options`).
XLA_REMAT_PASS = "rematerialization"
# Copy insertion's region-based interference analysis, for a pipeline's step
# (`ParallelPlan.compiler_options`; the forced host platform sets the CPU one in XLA_FLAGS).
PIPELINE_COPY_ANALYSIS = {"xla_gpu_copy_insertion_use_region_analysis": True,
                          "xla_cpu_copy_insertion_use_region_analysis": True}
# The memory XLA's latency-hiding scheduler allows itself, in percent of (80% of the device's
# memory less the step's inputs and outputs): XLA's default 95 (`GetSchedulerMemoryLimit`),
# raised for a pipelined step the plan estimates to fit (`ParallelPlan.compiler_options`).
SCHEDULER_SLOP_FLAG = "xla_gpu_memory_limit_slop_factor"
PIPELINE_SCHEDULER_SLOP = 150
# Model kinds `hardware.memory` estimates (transformers; GPT-calibrated).
ESTIMATED_KINDS = ("gpt", "bert", "llama")


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


@dataclass(frozen=True)
class ParallelPlan:
    """Everything below the config needs to know about the parallel layout of a step.

    Attributes:
      dp, pp, tp: mesh axis sizes.
      microbatches: per data-parallel replica per step.
      micro_batch: sequences per microbatch on one replica.
      schedule: the schedule, with its transfer latency (at pp = 1 the one-stage table of the
        microbatch loop, which the simulator runs).
      program: the schedule compiled into the executor's tick tables (pp > 1, compiled on
        first use); else None.
      layer_perm: staged position -> logical layer (pp > 1 with a non-contiguous placement or
        uneven chunks; -1 marks a padded position, `pipeline.layout`).
      overlap: the resolved overlap choices.
      compute_dtype: "fp32", "bf16" or "fp16" (train.precision).
      remat: the rematerialisation policy every block runs under (model.remat).
      target: the target the automatic choices were made for.
      choices: the `auto` knobs, by config key, with what was picked and why.
      layout: the DP layout of the model's parameters (`overlap.dp_layout.DpLayout`), when the
        plan was built with a model.
      chunk_buckets: pp > 1 with in-loop buckets: the bucket plan of one chunk's layers.
      stage_layers: layers per virtual stage in model order (`pipeline.stage_layers`
        resolved: even, explicit or auto); empty only in hand-built plans (= even).
      dcn: the slow data axis's size (mesh.dcn; the mesh has a 'dcn' axis when > 1).
      ep: expert parallelism (mesh.ep): above 1 the routed experts are stored split over dp.
      diloco: Streaming DiLoCo over dcn, or None.
      slow_decisions: what the plan decided about the slow axis, one line each.
      grad_bytes: fp32 gradient bytes per device (tp / pp split, before any dp split), when
        built with a model.
      dcn_bytes_per_s: the slow link's per-device bandwidth (mesh.dcn_gbps).
      attention: the blocks' attention kernel, "fused" or "plain" (model.attention resolved
        for the target; `parallel.attention`).
      memory_estimate: the step's estimated peak bytes per device (`estimated_step_bytes`),
        on an accelerator target; 0 elsewhere.
      split_backward: the executor runs W as only the weight-gradient GEMMs (a zb schedule,
        `pipeline.split_backward` resolved); False: W is the chunk's whole backward.
      param_elements: (embedding + head elements, elements of one block) of the model, unsplit
        (`model_api.param_elements`: the package's one parameter count).
    """

    dp: int
    pp: int
    tp: int
    microbatches: int
    micro_batch: int
    schedule: Schedule
    layer_perm: np.ndarray | None
    overlap: OverlapPlan
    compute_dtype: str = "fp32"
    remat: str = "none"
    target: Target = Target()
    choices: dict[str, Choice] = field(default_factory=dict)
    layout: Any = None
    chunk_buckets: Any = None
    stage_layers: tuple[int, ...] = ()
    dcn: int = 1
    ep: int = 1
    diloco: DilocoPlan | None = None
    slow_decisions: tuple[str, ...] = ()
    grad_bytes: int = 0
    dcn_bytes_per_s: float = 12.5e9
    vocab_parallel: bool = False
    attention: str = "plain"
    split_backward: bool = False
    fused_pairs: bool = False
    memory_estimate: float = 0.0
    param_elements: tuple[float, float] = (0.0, 0.0)

    # ------------------------------------------------------------------ derived values

    @functools.cached_property
    def program(self) -> TickProgram | None:
        if self.pp == 1:
            return None
        return compile_program(self.schedule, self.overlap.buckets_in_loop,
                               self.vocab_parallel, self.fused_pairs)

    @property
    def axis_sizes(self) -> dict[str, int]:
        sizes = {"dp": self.dp, "pp": self.pp, "tp": self.tp}
        return {"dcn": self.dcn, **sizes} if self.dcn > 1 else sizes

    @property
    def num_devices(self) -> int:
        return self.dcn * self.dp * self.pp * self.tp

    @property
    def slow_bytes_per_step(self) -> float:
        """Bytes one device sends across dcn per step for its gradient (ring all-reduce over
        dcn of its 1/dp slice; DiLoCo: the outer gradient's share per inner step)."""
        from jax_overlap.overlap.slow_axis import slow_bytes

        full = slow_bytes(self.grad_bytes, self.dp, self.dcn)
        if self.diloco is not None:
            size = {"fp32": 4, "bf16": 2, "int8": 1}[self.diloco.outer_dtype]
            return full * size / 4 / self.diloco.inner_steps
        return full / 2 if self.overlap.grad_comm_dtype == "bf16" else full

    @property
    def slow_mode(self) -> str:
        """How gradients cross dcn: "none" (no dcn axis), "sync" (hierarchical, every step),
        "delay" (one step late) or "local" (each dcn group steps its own parameters:
        DiLoCo, or dcn_delay_mode local; updates / parameters cross dcn, never gradients)."""
        if self.dcn == 1:
            return "none"
        if self.diloco is not None:
            return "local"
        if self.overlap.dcn_delay:
            return "local" if self.overlap.dcn_delay_mode == "local" else "delay"
        return "sync"

    @property
    def pipelined(self) -> bool:
        return self.pp > 1

    @property
    def virtual_stages(self) -> int:
        return self.schedule.virtual_stages

    @property
    def transfer_latency(self) -> int:
        return self.schedule.transfer_latency

    @property
    def num_virtual_stages(self) -> int:
        return self.pp * self.virtual_stages

    def parallel(self):
        """The TP context the model's per-device functions receive inside the step."""
        import jax.numpy as jnp

        from jax_overlap.parallel.collectives import Parallel
        from jax_overlap.parallel.mesh import TP

        dtype = {"bf16": jnp.bfloat16, "fp16": jnp.float16}.get(self.compute_dtype, jnp.float32)
        return Parallel(tp_axis=TP, tp=self.tp, compute_dtype=dtype,
                        tp_comm=self.overlap.tp_comm, cm_direction=self.overlap.cm_direction,
                        cm_grouped=self.overlap.cm_grouped,
                        sp_dim=0 if self.overlap.sp_split == "batch" else 1,
                        explicit_wgrad=not self.pipelined, attention=self.attention,
                        moe_chunks=self.overlap.moe_chunks)

    def compiler_options(self, environ=None) -> dict[str, Any]:
        """Per-compile XLA options of the train step (`jax.jit(..., compiler_options=)`).

        On a GPU whose memory the estimated step fits (`fits_memory`), XLA's own
        rematerialization pass is disabled: the remat policy already fits, and the pass
        overestimates a pipeline's buffers and clones GEMMs that save nothing (GPT-1.3B
        pp4 x dp2, fused attention, deviceless for 8 x H100: 1.26x the model's GEMM FLOPs with
        the pass, 0.97x without, 56.3 GiB allocated either way). The passes `XLA_FLAGS`
        already disables (the `gpu_overlap` preset's) stay disabled: a per-compile value
        replaces the flag's list.

        A pipeline also gets copy insertion's region analysis (`PIPELINE_COPY_ANALYSIS`):
        without it the tick switch's branches that pass the stage's fp32 gradient
        accumulators through copied them, and the loop copied them back after the switch,
        every tick (GPT-1.3B pp4 x dp2 on a GPU, in-loop buckets: 2.4 GB a tick, 1289 ->
        1255 ms a step estimated); on a CPU it copied the residual pools the filing switch
        updates (ZB-V 1.8x the step). Per compile, not in `XLA_FLAGS`: at pp = 1 on a GPU
        the same analysis left dp8's bucket all-reduces synchronous (0.96 -> 0.12 of
        collective bytes under GEMMs).

        A pipelined step that fits also lets XLA's latency-hiding scheduler plan with more
        memory (`PIPELINE_SCHEDULER_SLOP`, unless `XLA_FLAGS` sets it): its default limit
        leaves out the parameters and optimizer state, and below it a large stage stops
        overlapping anything. Llama-3-8B pp4 x dp2 (deviceless 8 x H100, 62 GiB): the tick
        transfers ran with nothing between their start and done, 0.04 of the collective
        bytes under GEMMs; 0.53 with the higher limit, 5611 -> 5553 ms, the same peak. The
        GPT-1.3B pipelines compile to the same step either way; Llama-3-8B FSDP dp8 (pp = 1)
        was 5 ms slower with it, so steps at pp = 1 keep XLA's default.
        """
        import os

        options: dict[str, Any] = dict(PIPELINE_COPY_ANALYSIS) if self.pipelined else {}
        if not (self.target.accelerator and self.memory_estimate
                and fits_memory(self.memory_estimate, self.target)):
            return options
        environ = os.environ if environ is None else environ
        passes, flags = [], set()
        for token in environ.get("XLA_FLAGS", "").split():
            name, _, value = token.lstrip("-").partition("=")
            flags.add(name)
            if name == "xla_disable_hlo_passes":
                passes += [p for p in value.split(",") if p]
        passes = list(dict.fromkeys(passes + [XLA_REMAT_PASS]))
        if self.pipelined and SCHEDULER_SLOP_FLAG not in flags:
            options[SCHEDULER_SLOP_FLAG] = PIPELINE_SCHEDULER_SLOP
        return {**options, "xla_disable_hlo_passes": ",".join(passes)}

    def with_program(self, program: TickProgram) -> "ParallelPlan":
        """The same plan running another tick program (benchmarks time hand-made tables)."""
        out = dataclasses.replace(self, schedule=program.schedule)
        out.__dict__["program"] = program  # the cached_property's slot
        return out

    def resolved_config(self, cfg: Config) -> Config:
        """`cfg` with every `auto` knob replaced by the plan's choice."""
        out = cfg
        for key, choice in self.choices.items():
            section, name = key.split(".")
            out = dataclasses.replace(out, **{section: dataclasses.replace(
                getattr(out, section), **{name: choice.value})})
        return out

    def choice_lines(self) -> list[str]:
        """One line per `auto` knob the plan decided, with why (what `train` and `analyze`
        print)."""
        return [f"auto {key} = {c.value}: {c.why}" for key, c in self.choices.items()]

    def describe(self) -> dict[str, Any]:
        """Plain-data summary for reports: sizes, schedule and the automatic choices."""
        return {
            "mesh": self.axis_sizes,
            "microbatches": self.microbatches,
            "schedule": self.schedule.name,
            "transfer_latency": self.transfer_latency,
            "paired": self.schedule.paired,
            "fused_pairs": self.fused_pairs,
            "stage_layers": list(self.stage_layers),
            "vocab_parallel": self.vocab_parallel,
            "attention": self.attention,
            "overlap": dataclasses.asdict(self.overlap),
            "target": self.target.name,
            "choices": {k: {"value": c.value, "why": c.why} for k, c in self.choices.items()},
        }

    # ------------------------------------------------------------------------ building

    @classmethod
    def build(cls, cfg: Config, model: Any = None, target: Target | None = None
              ) -> "ParallelPlan":
        """Resolves the config's parallel sections for `target` (default: a CPU).

        Args:
          cfg: a validated config.
          model: the `StagedModel` to lay out; without one the plan has no `layout` (the
            analytic tools -- simulator, tuner -- need none).
          target: what the step runs on; decides the `auto` knobs.

        Raises:
          ConfigError: one line per problem, e.g. no microbatch count fits the batch.
        """
        target = target or Target()
        choices: dict[str, Choice] = {}
        cfg = _resolve_schedule(cfg, target, choices)
        cfg = _resolve_latency(cfg, target, choices)
        # Resolved first: the memory estimates below count the paired table's slots.
        cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(
            cfg.pipeline, paired=_resolve_paired(cfg, target, choices)))
        m, pl, ov = cfg.mesh, cfg.pipeline, cfg.overlap
        tp_comm, direction = _resolve_tp(cfg, target, choices)
        attention = _resolve_attention(cfg, target, choices)
        cfg = _resolve_zero1(cfg, target, choices, tp_comm, attention)
        ov = cfg.overlap
        fsdp = _resolve_sharding(cfg, target, choices, tp_comm, attention)
        bucket_mb, embed_first, preset = _resolve_overlap(cfg, target, choices, fsdp)
        overlap = OverlapPlan(
            grad_bucket_bytes=int(bucket_mb * MIB),
            bucket_order=ov.bucket_order,
            embed_before_first_layer=embed_first,
            zero1=ov.zero1,
            grad_comm_dtype=ov.grad_comm_dtype,
            fsdp=fsdp,
            window=ov.window,
            tp_comm=tp_comm,
            cm_direction=direction,
            cm_grouped=tp_comm == "collective_matmul" and m.pp > 1,
            xla_preset=preset,
            dcn_delay=0 if ov.dcn_delay == "auto" else ov.dcn_delay,
            dcn_delay_compensation=ov.dcn_delay_compensation,
            dcn_comm_dtype="fp32" if ov.dcn_comm_dtype == "auto" else ov.dcn_comm_dtype,
            dcn_delay_mode=ov.dcn_delay_mode,
            moe_chunks=_resolve_moe_chunks(cfg, target, choices),
        )
        microbatches, remat = _resolve_microbatches(cfg, target, overlap, choices, attention)
        overlap = dataclasses.replace(overlap, pair_microbatches=_resolve_pair_microbatches(
            cfg, target, overlap, microbatches, remat, attention, choices))
        try:
            # One stage runs the plain microbatch loop whatever schedule is named.
            costs = tuple(pl.tick_costs) if pl.tick_costs is not None else None
            schedule = (cached_schedule(pl.schedule, m.pp, microbatches, pl.virtual_stages,
                                        pl.transfer_latency, pl.paired, costs,
                                        pl.pair_search if pl.paired else 0) if m.pp > 1
                        else cached_schedule("1f1b", 1, microbatches))
        except ValueError as e:
            raise ConfigError([str(e)]) from None
        perm = None
        num_layers = model.num_layers if model is not None else cfg.model.layers
        vocab_parallel = _resolve_vocab_parallel(cfg, target, model, choices)
        if vocab_parallel and model is not None and not getattr(model, "vocab_parallel_head",
                                                                False):
            raise ConfigError([
                f"pipeline.vocab_parallel: model {type(model).__name__} does not declare "
                f"vocab_parallel_head (its head must slice its output layer with "
                f"collectives.vocab_columns and use vocab_cross_entropy, "
                f"docs/guides/custom_models.md); "
                f"set it to false"])
        split = _resolve_stage_layers(cfg, num_layers, schedule, choices, vocab_parallel,
                                      target)
        if m.pp > 1:
            perm = _layer_permutation(num_layers, schedule, split)
        plan = cls(dp=m.dp, pp=m.pp, tp=m.tp, microbatches=microbatches,
                   micro_batch=cfg.train.global_batch // (m.dcn * m.dp * microbatches),
                   schedule=schedule, layer_perm=perm, overlap=overlap,
                   compute_dtype=cfg.train.precision, remat=remat, target=target,
                   choices=choices, stage_layers=split, dcn=m.dcn, ep=m.ep,
                   diloco=_diloco_plan(cfg),
                   dcn_bytes_per_s=m.dcn_gbps * 1e9 / 8, vocab_parallel=vocab_parallel,
                   attention=attention, param_elements=param_elements(cfg, model))
        plan = dataclasses.replace(plan, split_backward=_resolve_split(cfg, target, schedule,
                                                                       remat, choices),
                                   fused_pairs=_resolve_fused(cfg, target, choices,
                                                              schedule.paired))
        if plan.overlap.moe_chunks > 1 and (plan.fused_pairs or plan.overlap.pair_microbatches):
            plan = dataclasses.replace(plan, overlap=_paired_moe_chunks(cfg, plan, choices))
        plan = dataclasses.replace(plan, overlap=dataclasses.replace(
            plan.overlap, lone_tp_comm=_resolve_lone_tp_comm(cfg, plan, choices)))
        plan = dataclasses.replace(plan, overlap=dataclasses.replace(
            plan.overlap, sp_split=_resolve_sp_split(cfg, plan, choices)))
        if target.accelerator:
            plan = dataclasses.replace(plan, memory_estimate=estimated_step_bytes(
                cfg, plan.micro_batch, overlap, remat, attention))
        if model is not None:
            from jax_overlap.overlap import dp_layout

            layout = dp_layout.dp_layout(model, overlap, plan.axis_sizes)
            chunk = None
            if m.pp > 1 and overlap.buckets_in_loop:
                chunk = dp_layout.chunk_bucket_plan(
                    model, overlap, plan.axis_sizes, max(split))
            plan = dataclasses.replace(plan, layout=layout, chunk_buckets=chunk,
                                       grad_bytes=_grad_bytes(model, plan.axis_sizes))
        if m.dcn > 1 and "auto" in (ov.dcn_delay, ov.dcn_comm_dtype):
            plan = _resolve_slow(cfg, plan, choices)
        return plan


@functools.lru_cache(maxsize=1024)
def cached_schedule(name: str, stages: int, microbatches: int, virtual_stages: int = 1,
                    transfer_latency: int = 1, paired: bool = False,
                    tick_costs: tuple[float, float, float] | None = None,
                    pair_search: int = 0) -> Schedule:
    """`make_schedule`, memoised: the tuner plans hundreds of configs and a large table takes a
    while to build. Schedules are immutable, so sharing one is safe."""
    cost = dict(zip(KINDS, tick_costs)) if tick_costs is not None else None
    return make_schedule(name, stages, microbatches, virtual_stages, transfer_latency, paired,
                         cost, pair_search)


def _layer_permutation(num_layers: int, schedule: Schedule, stage_layers=None
                       ) -> np.ndarray | None:
    from jax_overlap.pipeline.layout import staged_permutation

    perm = staged_permutation(num_layers, schedule, stage_layers)
    return None if np.array_equal(perm, np.arange(num_layers)) else perm


def _resolve_stage_layers(cfg: Config, num_layers: int, schedule: Schedule,
                          choices: dict[str, Choice], vocab_parallel: bool = False,
                          target: Target | None = None) -> tuple[int, ...]:
    """`pipeline.stage_layers` as layers per virtual stage (`balanced` from the model's FLOPs,
    `pipeline.stage_split`; `auto` balanced on a GPU, even on a CPU where the layers divide)."""
    from jax_overlap.pipeline import stage_split

    value, parts = cfg.pipeline.stage_layers, len(schedule.placement)
    if isinstance(value, (list, tuple)):
        problems = stage_split.list_problems(value, num_layers, parts)
        if problems:
            raise ConfigError(problems)
        return tuple(int(n) for n in value)
    # ResNet groups its residual blocks into balanced units itself (models/resnet.py).
    cpu_even = (value == "auto" and not (target and target.accelerator)
                and num_layers % parts == 0)
    if value == "even" or parts == 1 or cfg.model.kind == "resnet" or cpu_even:
        try:
            split = stage_split.even_split(num_layers, parts)
        except ValueError as e:
            raise ConfigError([str(e)]) from None
        if cpu_even and cfg.model.kind != "resnet" and parts > 1:
            choices["pipeline.stage_layers"] = Choice(list(split), CPU_STAGE_LAYERS_WHY)
        return split
    mo = cfg.model
    block, embed, head = stage_split.transformer_costs(mo.d_model, mo.d_ff, mo.vocab, mo.seq_len)
    if vocab_parallel:  # every stage runs 1/pp of the head: no stage is heavier
        head = 0.0
    try:
        split = stage_split.auto_split(num_layers, schedule.placement, schedule.stages,
                                       embed / block, head / block)
    except ValueError as e:
        raise ConfigError([str(e)]) from None
    choices["pipeline.stage_layers"] = Choice(list(split), stage_split.why_auto(
        split, schedule.placement, schedule.stages, embed / block, head / block))
    return split


# Why `pipeline.stage_layers: auto` splits evenly on a CPU.
CPU_STAGE_LAYERS_WHY = ("CPU: the devices share the host's cores, so wall time follows the "
                        "total work, which a balanced split does not change; an even split "
                        "pads no stage's chunks")


def _resolve_tp(cfg: Config, target: Target, choices: dict[str, Choice]) -> tuple[str, str]:
    """`overlap.tp_comm` and `overlap.collective_matmul_direction`, `auto` resolved."""
    m, ov, mo = cfg.mesh, cfg.overlap, cfg.model
    tp_comm = ov.tp_comm
    if tp_comm == "auto":
        if m.tp == 1:
            tp_comm, why = "plain", "tp = 1: no tensor-parallel collectives"
        elif not target.accelerator:
            tp_comm, why = "plain", ("CPU: collectives run synchronously, so the ring steps of "
                                     "collective matmul would only add work")
        elif m.pp > 1:
            tp_comm, why = "sequence_parallel", (
                "pp > 1: inside the pipeline's per-stage branches collective matmul runs as "
                "grouped all-gather / reduce-scatter steps, whose chunk copies cost more than "
                "the communication they hide beside another lane's GEMMs (GPT-1.3B pp2 x dp2 "
                "x tp2, interleaved, 8 microbatches, deviceless 8 x H100: 1.17 s estimated "
                "step, 0.96 of the collective bytes under GEMMs, 0.02 s exposed; sequence "
                "parallel, its lone actions as collective matmul: 1.12 s, 0.89 under GEMMs, "
                "0.03 s exposed)")
        elif mo.kind not in ("gpt", "bert", "llama") or mo.seq_len % m.tp:
            tp_comm, why = "plain", (f"collective matmul needs a transformer whose seq_len is a "
                                     f"multiple of tp={m.tp}")
        else:
            tp_comm, why = "collective_matmul", (
                f"tp={m.tp} on {target.name}: each block's all-gather and reduce-scatter run as "
                f"ring steps under the partial matmuls (GPT-1.3B dp2 x tp4, deviceless 8 x "
                f"H100: 1.31 s estimated step, 0.06 s of it exposed communication; sequence "
                f"parallel 1.90 s, 0.48 s exposed)")
        choices["overlap.tp_comm"] = Choice(tp_comm, why)
    direction = ov.collective_matmul_direction
    if direction == "auto":
        t_local = mo.seq_len // m.tp if m.tp else mo.seq_len
        if tp_comm == "collective_matmul" and t_local % 2 == 0:
            direction, why = "bi", "two ring directions: half the steps, each under a matmul"
        elif tp_comm == "collective_matmul":
            direction, why = "uni", f"seq_len / tp = {t_local} is odd: bi needs it even"
        else:
            direction, why = "uni", "no collective matmul"
        choices["overlap.collective_matmul_direction"] = Choice(direction, why)
    return tp_comm, direction


def _resolve_moe_chunks(cfg, target, choices) -> int:
    """`overlap.moe_chunks`: `auto` is 6 on a GPU with expert parallelism, else 1 (a dense
    model's plan records no choice)."""
    chunks = cfg.overlap.moe_chunks
    if chunks != "auto":
        return chunks
    if not cfg.model.experts:
        return 1
    if cfg.mesh.ep == 1:
        chunks, why = 1, "no expert parallelism (mesh.ep = 1): no all-to-all to hide"
    elif not target.accelerator:
        chunks, why = 1, "CPU: collectives run synchronously, chunks would only add work"
    else:
        chunks, why = 6, (
            "chunk i's expert GEMMs run beside chunk i+1's dispatch and chunk i-1's combine "
            "(Mixtral-8x7B shape, 2 layers, deviceless 8 x H100: all-to-all bytes under "
            "GEMMs against 1 chunk 0.33 -> 0.95 at ep8, 0.50 -> 0.95 at ep4 x tp2, "
            "0.33 -> 0.92 at ep4 x pp2 paired, the fewest chunks at >= 0.9 on all three; "
            "estimated step 3-6% longer from the extra copies)")
    choices["overlap.moe_chunks"] = Choice(chunks, why)
    return chunks


def _paired_moe_chunks(cfg: Config, plan, choices: dict[str, Choice]) -> OverlapPlan:
    """`overlap.moe_chunks: auto` where microbatches pair (fused pipeline ticks, paired
    microbatches at pp = 1): one chunk, the other microbatch's GEMMs hiding the all-to-alls.
    An explicit count stays."""
    if cfg.overlap.moe_chunks != "auto":
        return plan.overlap
    where = ("fused pairs (pipeline.fused_pairs)" if plan.fused_pairs
             else "paired microbatches (overlap.pair_microbatches)")
    choices["overlap.moe_chunks"] = Choice(1, PAIRED_MOE_CHUNKS_WHY.format(where=where))
    return dataclasses.replace(plan.overlap, moe_chunks=1)


# Why `overlap.moe_chunks: auto` is 1 where microbatches pair (measured; docs/results.md).
PAIRED_MOE_CHUNKS_WHY = (
    "{where}: the other microbatch's GEMMs hide the all-to-alls without splitting the "
    "tokens; chunks would add more time than they hide (Mixtral-8x7B shape, 2 layers, "
    "deviceless 8 x H100, estimated step: ep8, 4 microbatches paired 374 ms with 1 chunk, "
    "394 ms with 6; ep4 x pp2 fused 426 ms, 456 ms)")

# Why `overlap.pair_microbatches: auto` is what it is (measured; docs/results.md).
PAIR_MICROBATCHES_WHY = (
    "GPU, ep = {ep}, {m} microbatches: microbatch i+1's forward runs beside microbatch i's "
    "backward, so each one's all-to-alls run under the other's GEMMs (Mixtral-8x7B shape, 2 "
    "layers, ep8, 4 microbatches, deviceless 8 x H100, one chunk: all-to-all bytes under "
    "GEMMs 0.38 -> 0.71, estimated step 382 -> 374 ms)")


def _resolve_pair_microbatches(cfg: Config, target: Target, overlap: OverlapPlan,
                               microbatches: int, remat: str, attention: str,
                               choices: dict[str, Choice]) -> bool:
    """`overlap.pair_microbatches`, `auto` resolved: on at pp = 1 on a GPU with expert
    parallelism, two microbatches or more, no FSDP, and the second microbatch's residuals
    within the memory budget; off elsewhere (a dense model's plan records no choice)."""
    m, want = cfg.mesh, cfg.overlap.pair_microbatches
    if want != "auto":
        return bool(want) and m.pp == 1 and microbatches > 1
    if m.pp > 1 or not cfg.model.experts:
        return False
    why = None
    if m.ep == 1:
        why = "no expert parallelism (mesh.ep = 1): no all-to-all to hide"
    elif not target.accelerator:
        why = "CPU: collectives run synchronously; nothing runs under them"
    elif microbatches < 2:
        why = "one microbatch: no second one to pair with"
    elif overlap.fsdp:
        why = ("FSDP runs the layers as a gather-window loop: a forward's and a backward's "
               "layers cannot run side by side")
    else:
        micro_batch = cfg.train.global_batch // (m.dcn * m.dp * microbatches)
        paired = dataclasses.replace(overlap, pair_microbatches=True)
        need = estimated_step_bytes(cfg, micro_batch, paired, remat, attention)
        if not fits_memory(need, target):
            why = (f"a second microbatch's residuals: ~{need / 1e9:.0f} GB per device "
                   f"estimated, over the budget of "
                   f"{MEMORY_BUDGET * target.memory_bytes / 1e9:.0f} GB")
    on = why is None
    choices["overlap.pair_microbatches"] = Choice(on, PAIR_MICROBATCHES_WHY.format(
        ep=m.ep, m=microbatches) if on else why)
    return on


# What `overlap.grad_bucket_mb: auto` picks on a GPU: the `gpu_overlap` preset's combine
# threshold, so XLA keeps each bucket one collective. GPT-1.3B dp8 (deviceless, 8 x H100):
# 0.97 of the collective bytes under GEMMs with buckets, the preset and the embedding first;
# 0.00 with one reduction per leaf after the backward.
AUTO_BUCKET_MB = 64.0


def auto_xla_preset(accelerator: bool, cfg: Config) -> str:
    """What `overlap.xla_preset: auto` becomes: the overlap flags where the step runs on (or
    is compiled for) a GPU, without the collective pipeliner's all-gather / reduce-scatter
    under tensor parallelism at pp = 1 (`xla_flags.py`). The CLI applies it before JAX
    starts; the plan records it."""
    if not accelerator:
        return "none"
    if cfg.mesh.tp > 1 and cfg.mesh.pp == 1:
        return "gpu_overlap_tp"
    return "gpu_overlap"


def _resolve_zero1(cfg: Config, target: Target, choices: dict[str, Choice], tp_comm: str,
                   attention: str) -> Config:
    """`cfg` with `overlap.zero1: auto` resolved: on a GPU with dp > 1, ZeRO-1 where a
    replica's step does not fit without it even at its smallest (one sequence per microbatch,
    remat full), off otherwise (its all-gather of the updated parameters after the optimizer
    has no GEMM left to hide under)."""
    m, ov = cfg.mesh, cfg.overlap
    if ov.zero1 != "auto":
        return cfg
    on, why = False, ""
    if m.dp == 1:
        why = "dp = 1: nothing to shard over"
    elif not target.accelerator:
        why = "CPU: every device's state is in host memory; sharding only adds collectives"
    elif ov.param_sharding == "fsdp":
        why = "overlap.param_sharding=fsdp already shards the optimizer state"
    elif cfg.model.kind not in ESTIMATED_KINDS:
        why = f"no memory estimate for model.kind={cfg.model.kind}"
    else:
        # With the gradient buckets `auto` gives a replicated step (in a pipeline's tick loop
        # they hold a second copy of the stage's gradients).
        buckets = int(_resolve_overlap(cfg, target, {}, False)[0] * MIB)
        need = estimated_step_bytes(cfg, 1, OverlapPlan(grad_bucket_bytes=buckets,
                                                        tp_comm=tp_comm), "full", attention)
        budget = f"budget {MEMORY_BUDGET * (target.memory_bytes or 0) / 1e9:.0f} GB"
        if not fits_memory(need, target):
            with_zero1 = estimated_step_bytes(
                cfg, 1, OverlapPlan(zero1=True, grad_bucket_bytes=buckets, tp_comm=tp_comm),
                "full", attention)
            on = fits_memory(with_zero1, target)
            why = (f"a replica's optimizer state does not fit: ~{need / 1e9:.0f} GB per device "
                   f"at its smallest (1 sequence per microbatch, remat full; {budget}); "
                   + (f"Adam's moments split over dp: ~{with_zero1 / 1e9:.0f} GB" if on else
                      f"split over dp still ~{with_zero1 / 1e9:.0f} GB: left to "
                      f"overlap.param_sharding"))
        else:
            why = (f"a replica fits: ~{need / 1e9:.0f} GB per device at its smallest ({budget}); "
                   f"the all-gather after the optimizer would have no GEMM to hide under"
                   if target.memory_bytes else "device memory unknown")
    choices["overlap.zero1"] = Choice(on, why)
    return dataclasses.replace(cfg, overlap=dataclasses.replace(ov, zero1=on))


def _resolve_sharding(cfg: Config, target: Target, choices: dict[str, Choice], tp_comm: str,
                      attention: str) -> bool:
    """`overlap.param_sharding`, `auto` resolved (True: fsdp): on a GPU with dp > 1, FSDP
    where a replica's step does not fit even at its smallest (one sequence per microbatch,
    remat full); replicated otherwise (its gradient reduction hides under the backward, and
    nothing is gathered)."""
    m, ov = cfg.mesh, cfg.overlap
    if ov.param_sharding != "auto":
        return ov.param_sharding == "fsdp"
    if m.dp == 1 or not target.accelerator or cfg.model.kind not in ESTIMATED_KINDS:
        choices["overlap.param_sharding"] = Choice("replicated", (
            "dp = 1: nothing to shard over" if m.dp == 1 else
            "CPU: sharding only adds all-gathers" if not target.accelerator else
            f"no memory estimate for model.kind={cfg.model.kind}"))
        return False
    replica = OverlapPlan(zero1=ov.zero1, tp_comm=tp_comm)
    need = estimated_step_bytes(cfg, 1, replica, "full", attention)
    if fits_memory(need, target):
        choices["overlap.param_sharding"] = Choice("replicated", (
            f"a replica fits: ~{need / 1e9:.0f} GB per device at its smallest (1 sequence "
            f"per microbatch, remat full; budget "
            f"{MEMORY_BUDGET * target.memory_bytes / 1e9:.0f} GB)"
            if target.memory_bytes else "device memory unknown"))
        return False
    sharded = dataclasses.replace(replica, fsdp=True)
    choices["overlap.param_sharding"] = Choice("fsdp", (
        f"a replica needs ~{need / 1e9:.0f} GB per device even at 1 sequence per microbatch "
        f"under remat full (budget {MEMORY_BUDGET * target.memory_bytes / 1e9:.0f} GB); FSDP "
        f"~{estimated_step_bytes(cfg, 1, sharded, 'full', attention) / 1e9:.0f} GB"))
    return True


def _resolve_overlap(cfg: Config, target: Target, choices: dict[str, Choice], fsdp: bool
                     ) -> tuple[float, bool, str]:
    """`overlap.grad_bucket_mb`, `embed_before_first_layer` and `xla_preset`, `auto`
    resolved: on a GPU with a data-parallel reduction, buckets issued during the backward,
    the embedding's first, and XLA's overlap flags; on a CPU (synchronous collectives, wall
    time follows total work) one reduction after the backward and no flags."""
    m, ov = cfg.mesh, cfg.overlap
    reduces = m.dp * m.dcn > 1 and not fsdp
    bucket_mb = ov.grad_bucket_mb
    if bucket_mb == "auto":
        if target.accelerator and reduces and m.pp > 1 and m.ep > 1:
            bucket_mb, why = 0.0, (
                "mesh.ep > 1 in a pipeline: the in-loop buckets do not take the experts each "
                "rank stores; one reduction after the loop")
        elif target.accelerator and reduces:
            bucket_mb = AUTO_BUCKET_MB
            why = ("GPU: each bucket's reduction is issued as soon as its layers' backward is "
                   "done and runs under the rest of the backward (64 MiB: XLA's combine "
                   "threshold under gpu_overlap)")
        elif target.accelerator:
            bucket_mb, why = 0.0, ("fsdp: gradients are reduce-scattered layer by layer "
                                   "already" if fsdp else
                                   "no data-parallel gradient reduction to bucket")
        else:
            bucket_mb, why = 0.0, ("CPU: collectives are synchronous; one reduction per "
                                   "gradient after the backward")
        choices["overlap.grad_bucket_mb"] = Choice(bucket_mb, why)
    embed_first = ov.embed_before_first_layer
    if embed_first == "auto":
        embed_first = bool(target.accelerator and bucket_mb > 0 and ov.bucket_order == "backward")
        choices["overlap.embed_before_first_layer"] = Choice(embed_first, (
            "the embedding's gradient is complete only at the end of the backward: issued "
            "before the first layer's buckets it runs under that layer's weight-gradient "
            "GEMMs (GPT-1.3B dp8: 0.98 of the bytes under GEMMs, 0.87 reduced last)")
            if embed_first else "no buckets issued during the backward")
    preset = ov.xla_preset
    if preset == "auto":
        preset = auto_xla_preset(target.accelerator, cfg)
        choices["overlap.xla_preset"] = Choice(preset, (
            "GPU, tp > 1: the latency-hiding scheduler and 64 MiB combining, without pipelined "
            "all-gathers / reduce-scatters (they made XLA clone the layer loops: 1.84x the "
            "GEMM FLOPs on GPT-1.3B dp2 x tp4)") if preset == "gpu_overlap_tp" else (
            "GPU: the latency-hiding scheduler, collective pipelining and 64 MiB combining "
            "(overlap/xla_flags.py)") if target.accelerator else
            "CPU: XLA's collectives are synchronous there; no flags")
    return float(bucket_mb), bool(embed_first), preset


# Why `pipeline.schedule: auto` runs what it runs, on each target (measured; docs/results.md).
INTERLEAVED_WHY = ("GPU: interleaved 1F1B, paired: less bubble than 1F1B at the same "
                   "microbatches for more transfers, all under GEMMs -- the fastest compiled "
                   "step estimated (GPT-1.3B pp4 x dp2, deviceless 8 x H100: interleaved m 16 "
                   "980 ms, MFU 0.61; 1F1B m 32 1056 ms; ZB-V 1170 ms)")
# How many chunks `auto` cuts each stage into, in order of preference: three or four, where
# each keeps at least `INTERLEAVED_MIN_LAYERS` layers, else two (deviceless 8 x H100, plain
# configs: GPT-1.3B pp4 x dp2 v 2 / 3 / 6: 998 / 980 / 979 ms, v 6 at m 8 holding 46 GiB
# against 31 with 0.63 of its collective bytes under GEMMs against 0.79; pp2 x dp2 x tp2
# v 2 / 3 / 4 / 6: 1083 / 1065 / 1068 / 1066 ms; Llama-3-8B pp4 x dp2 v 2 / 4: 5532 / 5427 ms).
# Past three or four, each tick's fixed costs (filing arrivals, launches) and its transfers,
# now under fewer GEMMs, outweigh the bubble it saves.
INTERLEAVED_CHUNKS = (3, 4)
INTERLEAVED_MIN_LAYERS = 2
INTERLEAVED_CHUNKS_WHY = ("{v} chunks of {n} layers per stage: bubble (p - 1) / (v m + p - 1) "
                          "a third to a half below two chunks', each tick's transfers still "
                          "under its GEMMs (GPT-1.3B pp4 x dp2, deviceless 8 x H100: v 2 / 3 "
                          "998 / 980 ms, v 6 no faster at 46 GiB against 31; Llama-3-8B pp4 x "
                          "dp2: v 2 / 4 5532 / 5427 ms)")
INTERLEAVED_TWO_WHY = ("two chunks of {n} layers per stage: model.layers {layers} does not split "
                       "into " + " or ".join(map(str, INTERLEAVED_CHUNKS))
                       + " x pp chunks of at least {least} layers")
AUTO_SCHEDULE_WHY = {
    True: ("GPU: 1F1B paired ({why}; GPT-1.3B pp4 x dp2, deviceless 8 x H100: interleaved "
           "980 ms, 1F1B 1056 ms, ZB-V 1170 ms, whose extra ticks and W actions cost more than "
           "its smaller bubble saves)"),
    False: ("CPU: the least work (bench/pipeline.py, p = 4, m = 8: 1F1B 1.09-1.29x a pp = 1 "
            "step's, ZB-V 1.35-1.47x)"),
}
# Decoders whose blocks are all alike, which the plan may cut into two chunks per stage.
INTERLEAVED_KINDS = ("gpt", "llama")


def _no_interleaving(cfg: Config) -> str | None:
    """Why `schedule: auto` cannot run interleaved 1F1B on a GPU, or None if it can: the
    virtual stages are left to the plan, the model is a plain decoder, its layers split
    evenly into 2 x pp chunks and an explicit microbatch count suits the table."""
    m, pl, mo = cfg.mesh, cfg.pipeline, cfg.model
    if not isinstance(pl.virtual_stages, PlanDecides):
        return f"pipeline.virtual_stages = {pl.virtual_stages} is given"
    if mo.kind not in INTERLEAVED_KINDS or getattr(mo, "experts", 0):
        return f"model.kind {mo.kind}: one chunk per stage"
    if pl.stage_layers not in (None, "auto"):
        return "pipeline.stage_layers is given"
    if mo.layers % (2 * m.pp):
        return f"model.layers {mo.layers} does not split into 2 x pp = {2 * m.pp} equal chunks"
    if pl.microbatches != "auto" and pl.microbatches % m.pp:
        return f"pipeline.microbatches {pl.microbatches} is not a multiple of mesh.pp"
    return None


def schedule_name(cfg: Config) -> str:
    """`pipeline.schedule` with `auto` resolved: interleaved where more than one virtual stage
    is asked for, else 1f1b (the same on every target today: `AUTO_SCHEDULE_WHY`)."""
    pl = cfg.pipeline
    if pl.schedule != "auto":
        return pl.schedule
    return "interleaved" if pl.virtual_stages > 1 else "1f1b"


def _interleaved_chunks(cfg: Config) -> Choice:
    """How many chunks per stage `auto` runs interleaved 1F1B with on a GPU (the layers split
    evenly into 2 x pp chunks: `_no_interleaving`): the first of `INTERLEAVED_CHUNKS` whose
    chunks split the layers evenly and keep at least `INTERLEAVED_MIN_LAYERS` each, else 2."""
    layers, pp = cfg.model.layers, cfg.mesh.pp
    for v in INTERLEAVED_CHUNKS:
        if layers % (v * pp) == 0 and layers // (v * pp) >= INTERLEAVED_MIN_LAYERS:
            return Choice(v, INTERLEAVED_CHUNKS_WHY.format(v=v, n=layers // (v * pp)))
    return Choice(2, INTERLEAVED_TWO_WHY.format(n=layers // (2 * pp), layers=layers,
                                                least=INTERLEAVED_MIN_LAYERS))


def _resolve_schedule(cfg: Config, target: Target, choices: dict[str, Choice]) -> Config:
    """`cfg` with `pipeline.schedule: auto` resolved, and on a GPU the chunks per stage of an
    interleaved schedule whose `virtual_stages` is left to the plan (choices only where there
    is a pipeline)."""
    name, pl = schedule_name(cfg), cfg.pipeline
    gpu_pipeline = target.accelerator and cfg.mesh.pp > 1
    blocked = _no_interleaving(cfg) if gpu_pipeline else None
    if pl.schedule == "auto" and cfg.mesh.pp > 1:
        why = (f"virtual_stages = {pl.virtual_stages}: the schedule that runs several chunks "
               f"per stage") if name == "interleaved" else AUTO_SCHEDULE_WHY[False]
        if target.accelerator and name == "1f1b":
            if blocked is None:
                name, why = "interleaved", INTERLEAVED_WHY
            else:
                why = AUTO_SCHEDULE_WHY[True].format(why=blocked)
        choices["pipeline.schedule"] = Choice(name, why)
    if gpu_pipeline and name == "interleaved" and blocked is None:  # chunks left to the plan
        chunks = _interleaved_chunks(cfg)
        pl = dataclasses.replace(pl, virtual_stages=chunks.value)
        choices["pipeline.virtual_stages"] = chunks
    return dataclasses.replace(cfg, pipeline=dataclasses.replace(pl, schedule=name))


# Why `pipeline.transfer_latency: auto` is 1 on a GPU unless a transfer is exposed: at latency
# 1 paired ticks hide each transfer under the other lane's GEMMs, and latency 2 lengthens the
# ramp (GPT-1.3B dp2 x pp4 1F1B m 8, simulated on FLOP costs: NVLink 2494 ms at latency 1,
# 3093 ms at 2; a 2 GB/s stage link 3313 ms at 1, 3154 ms at 2; docs/results.md).
AUTO_LATENCY_WHY = ("the transfer of a microbatch's activations between stages (~{t:.3g} ms "
                    "over {link}) hides under the GEMMs of a tick (~{c:.3g} ms)")


# A tick's kernels per layer, each launched in `hardware.machine.KERNEL_LAUNCH_S`: a small
# model's tick is launches, not GEMMs, and a transfer is one kernel too.
TICK_KERNELS_PER_LAYER = 20


def _transfer_and_tick_s(cfg: Config, target: Target) -> tuple[float, float, str] | None:
    """(seconds one microbatch's activations take between stages, seconds of one chunk's
    forward: its GEMMs at the chip's peak plus its kernels' launches, the link's name) on a
    GPU the chip table knows; None otherwise. One sequence per microbatch (the GEMMs and the
    transfer grow with its tokens alike)."""
    from jax_overlap.hardware.machine import (CHIPS, KERNEL_LAUNCH_S, chip_for_device_kind,
                                              chip_key)
    from jax_overlap.hardware.memory import dtype_bytes

    chip = CHIPS.get(chip_key(target.name)) or chip_for_device_kind(target.name)
    if chip is None:
        return None
    m, mo = cfg.mesh, cfg.model
    tokens = mo.seq_len
    act = tokens * mo.d_model * dtype_bytes(cfg.train.precision) / max(m.tp, 1)
    chunk_layers = mo.layers / (m.pp * max(cfg.pipeline.virtual_stages, 1))
    _, block = param_elements(cfg)
    flops = 2 * tokens * block / max(m.tp, 1) * chunk_layers
    dtype = "bf16" if cfg.train.precision in ("bf16", "fp16") else "f32"
    launches = TICK_KERNELS_PER_LAYER * chunk_layers * KERNEL_LAUNCH_S
    return (KERNEL_LAUNCH_S + act / chip.nvlink_unidirectional_bytes_per_s,
            flops / chip.matmul_flops_per_s(dtype) + launches, f"{chip.name} NVLink")


def _resolve_latency(cfg: Config, target: Target, choices: dict[str, Choice]) -> Config:
    """`cfg` with `pipeline.transfer_latency: auto` resolved: 1, or 2 on a GPU where one
    microbatch's transfer between stages outlasts the GEMMs of a tick it would hide under and
    the step at its smallest still fits (`AUTO_LATENCY_WHY`)."""
    pl, m = cfg.pipeline, cfg.mesh
    if pl.transfer_latency != "auto":
        return cfg
    latency, why = 1, None
    if m.pp > 1:
        times = _transfer_and_tick_s(cfg, target) if target.accelerator else None
        if not target.accelerator:
            why = ("CPU: collectives are synchronous, nothing hides a transfer; latency 2 only "
                   "lengthens the ramp")
        elif pl.paired is True:
            why = "pipeline.paired is on: paired ticks run at latency 1"
        elif times is None:
            why = f"no link model for {target.name}: the shorter ramp"
        else:
            transfer, tick, link = times
            detail = AUTO_LATENCY_WHY.format(t=transfer * 1e3, link=link, c=tick * 1e3)
            why = detail
            if transfer > tick:
                two = dataclasses.replace(cfg, pipeline=dataclasses.replace(
                    pl, transfer_latency=2, paired=False))
                need = estimated_step_bytes(two, 1, OverlapPlan(), "full")
                group = 2 * m.pp
                if (pl.schedule == "interleaved" and pl.microbatches != "auto"
                        and pl.microbatches % group):
                    why = (f"a transfer (~{transfer * 1e3:.3g} ms) outlasts a tick's GEMMs "
                           f"(~{tick * 1e3:.3g} ms), but interleaved at latency 2 takes "
                           f"microbatches in groups of 2 x pp = {group}, and "
                           f"pipeline.microbatches is {pl.microbatches}: kept at 1")
                elif fits_memory(need, target):
                    latency = 2
                    why = (f"the transfer of a microbatch's activations (~{transfer * 1e3:.3g} "
                           f"ms over {link}) outlasts a tick's GEMMs (~{tick * 1e3:.3g} ms): "
                           f"latency 2 sends it under the next tick")
                else:
                    why = (f"a transfer (~{transfer * 1e3:.3g} ms) outlasts a tick's GEMMs "
                           f"(~{tick * 1e3:.3g} ms), but at latency 2 the step needs "
                           f"~{need / 1e9:.0f} GB at its smallest: kept at 1")
    if why is not None:
        choices["pipeline.transfer_latency"] = Choice(latency, why)
    return dataclasses.replace(cfg, pipeline=dataclasses.replace(pl, transfer_latency=latency))


# Why `overlap.lone_tp_comm: auto` is collective matmul (measured; docs/results.md).
LONE_TP_COMM_WHY = (
    "GPU, fused pairs at tp = 2: a tick that runs one action has no other lane to hide its "
    "sequence-parallel all-gathers and reduce-scatters, so its blocks run as collective "
    "matmul, the gather under the own chunk's GEMM (GPT-1.3B pp2 x dp2 x tp2, deviceless 8 x "
    "H100: 0.78 -> 0.93 of the collective bytes under GEMMs, exposed 43 -> 22 ms, for 8 ms "
    "more of the estimated 1039 ms step)")


def _resolve_lone_tp_comm(cfg: Config, plan, choices: dict[str, Choice]) -> str:
    """`overlap.lone_tp_comm`, `auto` resolved: collective matmul for the lone actions of a
    fused program on a GPU at tp = 2 under sequence parallelism and full remat."""
    want, m = cfg.overlap.lone_tp_comm, cfg.mesh
    if want == "same":
        return "same"
    fits = plan.fused_pairs and m.tp > 1 and plan.overlap.tp_comm == "sequence_parallel"
    if want == "collective_matmul":
        if not fits or plan.remat != "full":
            raise ConfigError([
                "overlap.lone_tp_comm=collective_matmul: needs fused pipeline ticks "
                "(pipeline.fused_pairs), tp > 1, overlap.tp_comm=sequence_parallel and "
                "model.remat=full; set it to same"])
        return want
    if not fits:
        return "same"
    if not plan.target.accelerator or m.tp != 2 or plan.remat != "full":
        if not plan.target.accelerator:
            why = "CPU: collectives are synchronous; the ring's extra work hides nothing"
        elif plan.remat != "full":
            why = "remat is not full: a lone action's residuals would differ from its pair's"
        else:
            why = "measured at tp = 2 only"
        choices["overlap.lone_tp_comm"] = Choice("same", why)
        return "same"
    choices["overlap.lone_tp_comm"] = Choice("collective_matmul", LONE_TP_COMM_WHY)
    return "collective_matmul"


# Why `overlap.sp_split: auto` is batch where it can be (measured; docs/results.md).
SP_SPLIT_WHY = (
    "the microbatch's {b} sequences divide by tp = {tp}: each TP rank holds whole sequences "
    "between blocks, so a gather over TP lands in the (b, t) order the other activations "
    "are in and no weight-gradient GEMM transposes it first (GPT-1.3B pp2 x dp2 x tp2, "
    "deviceless 8 x H100: its 26 ms of transposes gone, estimated step 1065 -> 1039 ms)")


def _resolve_sp_split(cfg: Config, plan, choices: dict[str, Choice]) -> str:
    """`overlap.sp_split`, `auto` resolved: batch where sequence parallelism's rows can be
    whole sequences (the microbatch divides by tp, and any collective matmul runs grouped
    own-chunk-first steps, which take a chunk of any dim), sequence elsewhere."""
    want, ov, tp = cfg.overlap.sp_split, plan.overlap, plan.tp
    sharded = tp > 1 and ov.tp_comm in ("sequence_parallel", "collective_matmul")
    if want == "sequence" or (want == "auto" and not sharded):
        return "sequence"
    from jax_overlap.parallel.collective_matmul import own_chunk_first

    own_first = own_chunk_first(tp)  # those steps take a chunk of any dim
    cm_steps = ov.tp_comm == "collective_matmul" or ov.lone_tp_comm == "collective_matmul"
    if not sharded:
        why = "needs tp > 1 and overlap.tp_comm sequence_parallel or collective_matmul"
    elif ov.tp_comm == "collective_matmul" and not ov.cm_grouped:
        why = "collective matmul's ring steps cut the sequence"
    elif cm_steps and not own_first:
        why = f"collective matmul's grouped steps at tp = {tp} cut sequence pieces"
    elif plan.micro_batch % tp:
        why = f"the microbatch's {plan.micro_batch} sequences do not divide by tp = {tp}"
    else:
        why = None
    if want == "batch":
        if why:
            raise ConfigError([f"overlap.sp_split=batch: {why}; set it to sequence or auto"])
        return "batch"
    if why:
        choices["overlap.sp_split"] = Choice("sequence", why)
        return "sequence"
    choices["overlap.sp_split"] = Choice("batch", SP_SPLIT_WHY.format(b=plan.micro_batch,
                                                                      tp=tp))
    return "batch"


# Why `pipeline.fused_pairs: auto` is what it is (measured; docs/results.md).
FUSED_PAIRS_WHY = {
    True: ("GPU, {what}: a tick's forward and backward run as one computation, so each lane's "
           "collectives run under the other lane's GEMMs; the transfers between stages run "
           "between ticks (GPT-1.3B pp2 x dp2 x tp2 interleaved, deviceless 8 x H100: 0.29 -> "
           "0.72 of the collective bytes under GEMMs, exposed 127 -> 55 ms, estimated step "
           "1188 -> 1124 ms)"),
    False: ("no collectives inside an action (tp = ep = 1) for the other lane to hide; each "
            "lane its own switch keeps every transfer under the other lane"),
}


def _resolve_fused(cfg: Config, target: Target, choices: dict[str, Choice],
                   paired: bool) -> bool:
    """`pipeline.fused_pairs`, `auto` resolved: on for a paired pipeline on a GPU whose
    actions hold collectives (tp > 1, ep > 1), off elsewhere."""
    pl, m = cfg.pipeline, cfg.mesh
    if pl.fused_pairs != "auto":
        return bool(pl.fused_pairs) and paired
    if m.pp == 1 or not paired:
        return False
    if not target.accelerator:
        choices["pipeline.fused_pairs"] = Choice(False, "CPU: collectives are synchronous; "
                                                        "nothing runs under them")
        return False
    inside = [f"{k} = {v}" for k, v in (("tp", m.tp), ("ep", m.ep)) if v > 1]
    fused = bool(inside)
    choices["pipeline.fused_pairs"] = Choice(fused, FUSED_PAIRS_WHY[fused].format(
        what=" and ".join(inside)))
    return fused


def _resolve_paired(cfg: Config, target: Target, choices: dict[str, Choice]) -> bool:
    """`pipeline.paired`, `auto` resolved: paired F+B ticks for a pipeline on a GPU at
    transfer latency 1, unpaired elsewhere."""
    pl, m = cfg.pipeline, cfg.mesh
    if pl.paired != "auto":
        return bool(pl.paired)
    if m.pp == 1:
        return False
    if not target.accelerator:
        choices["pipeline.paired"] = Choice(False, "CPU: collectives are synchronous and wall "
                                                   "time follows total work; pairing only adds "
                                                   "permutes")
        return False
    if pl.transfer_latency != 1:
        choices["pipeline.paired"] = Choice(False, "transfer_latency 2 already hides each "
                                                   "transfer under a tick; paired ticks run at "
                                                   "latency 1")
        return False
    choices["pipeline.paired"] = Choice(True, "a stage runs one forward and one backward per "
                                              "tick: lockstep ticks cost alike on every stage "
                                              "and each transfer runs under the other lane's "
                                              "GEMMs (GPT-1.3B pp4 x dp2 1F1B, m 8, estimated "
                                              "step 1.95 s unpaired, 1.33 s paired)")
    return True


# Why `pipeline.vocab_parallel: auto` splits the LM head over the stages on a GPU (measured;
# docs/results.md).
AUTO_VOCAB_PARALLEL_WHY = (
    "GPU: the last stage no longer runs the whole head and loss while the others wait (GPT-1.3B "
    "pp4 x dp2, deviceless 8 x H100, estimated step: 1F1B paired 1.28 -> 1.18 s, ZB-V "
    "1.84 -> 1.42 s with the chunk's layers scanned)")


def auto_vocab_parallel(cfg: Config, accelerator: bool) -> tuple[bool, str]:
    """`pipeline.vocab_parallel` (`auto` resolved by the config alone) and why."""
    m, mo, value = cfg.mesh, cfg.model, cfg.pipeline.vocab_parallel
    if value != "auto":
        return bool(value) and m.pp > 1, "set in the config"
    if m.pp == 1:
        return False, "pp = 1: no stages to split the head over"
    if mo.kind == "resnet":
        return False, "resnet's head is a small classifier with no vocabulary to split"
    if not isinstance(mo.vocab, int) or mo.vocab % (m.tp * m.pp):
        return False, (f"model.vocab {mo.vocab} is not divisible by mesh.tp x mesh.pp = "
                       f"{m.tp * m.pp} (pad it to split the head)")
    if not accelerator:
        return False, ("CPU: the head stays on the last stage (every collective is "
                       "synchronous there: the head phase's psums over pp add work, they hide "
                       "nothing)")
    return True, AUTO_VOCAB_PARALLEL_WHY


def _resolve_vocab_parallel(cfg: Config, target: Target, model, choices: dict[str, Choice]
                            ) -> bool:
    """`pipeline.vocab_parallel`, `auto` resolved (a choice only where there is a pipeline)."""
    value, why = auto_vocab_parallel(cfg, bool(target.accelerator))
    if cfg.pipeline.vocab_parallel != "auto":
        return value
    if value and model is not None and not getattr(model, "vocab_parallel_head", False):
        value, why = False, f"model {type(model).__name__} does not declare vocab_parallel_head"
    if cfg.mesh.pp > 1:
        choices["pipeline.vocab_parallel"] = Choice(value, why)
    return value


def _resolve_split(cfg: Config, target: Target, schedule: Schedule, remat: str,
                   choices: dict[str, Choice]) -> bool:
    """`pipeline.split_backward`, `auto` resolved for a split-backward schedule: W only the
    weight-gradient GEMMs."""
    value = cfg.pipeline.split_backward
    if not schedule.split_backward or value != "auto":
        return schedule.split_backward and value is not False
    choices["pipeline.split_backward"] = Choice(True, AUTO_SPLIT_WHY[bool(target.accelerator)])
    return True


# Why `pipeline.split_backward: auto` splits (measured; docs/results.md).
AUTO_SPLIT_WHY = {
    True: ("W only the weight-gradient GEMMs, from operands and output gradients B keeps in "
           "stash slots (GPT-1.3B pp4 x dp2 ZB-V paired, vocab-parallel, deviceless 8 x H100: "
           "estimated step 1.24 s split, 1.66 s not)"),
    False: "W only the weight-gradient GEMMs, from operands and output gradients B keeps in "
           "stash slots",
}


def _resolve_attention(cfg: Config, target: Target, choices: dict[str, Choice]) -> str:
    """`model.attention`, `auto` resolved (`parallel.attention.resolve`): "fused" or "plain"."""
    from jax_overlap.parallel.attention import resolve

    mo = cfg.model
    value, why, problem = resolve(mo.attention, accelerator=target.accelerator,
                                  target_name=target.name, kind=mo.kind,
                                  precision=cfg.train.precision,
                                  head_dim=mo.d_model // max(mo.heads, 1))
    if problem:
        raise ConfigError([problem])
    if why is not None:
        choices["model.attention"] = Choice(value, why)
    return value


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def estimated_step_bytes(cfg: Config, micro_batch: int, overlap: OverlapPlan, remat: str,
                         attention: str = "plain") -> float:
    """The step's estimated peak bytes per device (`hardware.memory.step_bytes`) with
    `micro_batch` sequences per microbatch under a remat policy; at pp > 1 with the slot
    counts of the tick program that microbatch count gives (pairing search off: it keeps the
    same activation caps)."""
    from jax_overlap.hardware.memory import PipelineSlots, step_bytes

    m, pl = cfg.mesh, cfg.pipeline
    count = max(1, cfg.train.global_batch // (m.dcn * m.dp * max(micro_batch, 1)))
    # As the plan resolves it on a GPU (the only target with a memory estimate).
    vocab_parallel = auto_vocab_parallel(cfg, accelerator=True)[0]
    slots, split = None, False
    if m.pp > 1:
        try:
            costs = tuple(pl.tick_costs) if pl.tick_costs is not None else None
            slots, split = _pipeline_slots(schedule_name(cfg), m.pp, count, pl.virtual_stages,
                                           pl.transfer_latency, pl.paired, costs,
                                           overlap.buckets_in_loop, vocab_parallel)
        except ValueError:  # no table for this count: the rough slot counts
            slots = PipelineSlots.rough(m.pp, count, pl.virtual_stages)
        split = split and pl.split_backward is not False
    return step_bytes(cfg.model, micro_batch, m.tp, m.pp, m.dp, cfg.train.precision,
                      params=param_elements(cfg), zero1=overlap.zero1, fsdp=overlap.fsdp,
                      remat=remat, attention=attention,
                      microbatches=count, sequence_parallel=overlap.tp_comm != "plain",
                      slots=slots, split_backward=split, vocab_parallel=vocab_parallel,
                      paired=m.pp > 1 and pl.paired is True,
                      buckets_in_loop=m.pp > 1 and overlap.buckets_in_loop,
                      unrolled_buckets=(m.pp == 1 and overlap.grad_bucket_bytes > 0
                                        and not overlap.fsdp
                                        and overlap.bucket_order == "largest_first"),
                      ep=m.ep, ring_steps=_ring_steps(cfg, overlap.tp_comm),
                      paired_microbatches=m.pp == 1 and overlap.pair_microbatches)


@functools.lru_cache(maxsize=256)
def _pipeline_slots(name: str, stages: int, microbatches: int, virtual_stages: int,
                    transfer_latency: int, paired: bool, tick_costs, buckets_in_loop: bool,
                    vocab_parallel: bool):
    """(`memory.PipelineSlots`, split backward) of a schedule's compiled tick program."""
    from jax_overlap.hardware.memory import PipelineSlots

    schedule = cached_schedule(name, stages, microbatches, virtual_stages, transfer_latency,
                               paired, tick_costs)
    program = compile_program(schedule, buckets_in_loop, vocab_parallel)
    return PipelineSlots.of_program(program), schedule.split_backward


def fits_memory(need: float, target: Target) -> bool:
    """Whether an estimated step of `need` bytes per device fits the target: within
    `MEMORY_BUDGET` of its memory (always, where the memory is unknown)."""
    return not target.memory_bytes or need <= MEMORY_BUDGET * target.memory_bytes


def _keeps_projections(cfg: Config, tp_comm: str) -> str | None:
    """Why `auto` remat on a GPU tries `minimal` before `full`, or None where recomputing the
    projections costs less than keeping them: at pp = 1 with collective-matmul rings (the
    recompute would run the rings again: `RING_REMAT_WHY`), and in a pipeline at tp = 1
    without experts (B reads them from the stash slot: `PIPELINE_REMAT_WHY`)."""
    if _ring_steps(cfg, tp_comm):
        return RING_REMAT_WHY
    if cfg.mesh.pp > 1 and cfg.mesh.tp == 1 and not cfg.model.experts:
        return PIPELINE_REMAT_WHY
    return None


def _remat_candidates(cfg: Config, target: Target, unrolled: bool = False,
                      kept: str | None = None) -> tuple[str, ...]:
    """The policies `model.remat` may take: the explicit one; `auto` on a CPU `none` (there
    recomputing only adds work) but `full` for a pipeline; on a GPU `full` (`GPU_REMAT_WHY`),
    but every policy, least recompute first, for a step whose one microbatch runs `unrolled`
    (`_unrolled`: no layer scan stacks its residuals), and `minimal` before `full` where
    keeping the projections pays (`kept`: `_keeps_projections`'s reason); `none` for a model
    the memory estimate does not describe (`ESTIMATED_KINDS`)."""
    if cfg.model.remat != "auto":
        return (cfg.model.remat,)
    if not target.accelerator and cfg.mesh.pp > 1:
        return ("full",)  # see CPU_PIPELINE_REMAT_WHY
    if target.accelerator and cfg.model.kind in ESTIMATED_KINDS:
        # Kept residuals travel through memory: a pipeline's F files them into stash slots
        # that every tick reads and writes, and the pp = 1 layer scan stacks them with
        # dynamic-update-slices and copies. Stashing only each block's input and recomputing
        # costs less on both (GPU_REMAT_WHY).
        if unrolled:
            return REMAT_ORDER
        return KEPT_REMATS if kept else ("full",)
    return ("none",)


def _unrolled(cfg: Config, overlap: OverlapPlan, microbatches: int) -> bool:
    """Whether the whole step is the last microbatch, run with its layers unrolled for the
    gradient buckets (`training/grads.py`): one microbatch at pp = 1 with in-backward buckets
    that mix layers (`bucket_order: largest_first`) and no FSDP. (Buckets packed per layer
    are reduced in the layer scan's backward.)"""
    return (cfg.mesh.pp == 1 and microbatches == 1 and overlap.grad_bucket_bytes > 0
            and not overlap.fsdp and overlap.bucket_order == "largest_first")


def _cheapest_remat(cfg: Config, micro_batch: int, overlap: OverlapPlan, target: Target,
                    attention: str, remats: tuple[str, ...]
                    ) -> tuple[str | None, float, dict[str, float]]:
    """The first of `remats` whose estimated step fits the target (None if none does), its
    estimated bytes (the last one's when none fits), and the estimate of each policy tried.

    A policy estimated to keep no less than one that recomputes less is passed over; one
    estimated to keep exactly what the next does is named as the next (with the fused
    attention kernel, which is no dot, `save_dots` keeps what `minimal` does).
    """
    @functools.cache
    def bytes_of(remat: str) -> float:
        return estimated_step_bytes(cfg, micro_batch, overlap, remat, attention)

    tried: dict[str, float] = {}
    need = 0.0
    for i, remat in enumerate(remats):
        need = bytes_of(remat)
        if tried and need >= min(tried.values()) and i < len(remats) - 1:
            continue
        while i + 1 < len(remats) and bytes_of(remats[i + 1]) == need:
            i, remat = i + 1, remats[i + 1]
        tried[remat] = need
        if fits_memory(need, target):
            return remat, need, tried
    return None, need, tried


def _ring_steps(cfg: Config, tp_comm: str) -> bool:
    """Whether each GEMM runs as tp collective-matmul ring steps of 1/tp of its rows (at
    pp = 1; a pipeline's grouped steps are whole GEMMs)."""
    return tp_comm == "collective_matmul" and cfg.mesh.pp == 1 and cfg.mesh.tp > 1


def gemm_tokens(cfg: Config, tp_comm: str) -> int:
    """Most tokens a microbatch takes under auto microbatching on a GPU: `GEMM_TOKENS` GEMM
    rows (per ring step under collective matmul), `MICROBATCH_TOKENS` where TP collectives
    run whole beside the GEMMs (sequence parallel or plain TP at pp = 1)."""
    if _ring_steps(cfg, tp_comm):
        return GEMM_TOKENS * cfg.mesh.tp
    if cfg.mesh.pp == 1 and cfg.mesh.tp > 1:
        return MICROBATCH_TOKENS
    return GEMM_TOKENS


def pipeline_bubble(stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The idle share of a 1F1B-like pipeline: (p - 1) / (v m + p - 1) with v chunks per
    stage (interleaved)."""
    return ((stages - 1) / (virtual_stages * microbatches + stages - 1) if stages > 1
            else 0.0)


def microbatch_fits(cfg: Config, micro_batch: int, overlap: OverlapPlan, target: Target,
                    remat: str | None = None, attention: str | None = None
                    ) -> tuple[bool, float]:
    """Whether `micro_batch` sequences per microbatch suit a GPU: at most `MICROBATCH_TOKENS`
    GEMM rows, and the estimated step (`estimated_step_bytes`, bytes returned too) within
    `MEMORY_BUDGET` of the target's memory where it is known (`fits_memory`). `remat`
    (default `model.remat`) at `auto`: under the policy auto would take for it."""
    remat = remat or cfg.model.remat
    if attention is None:
        attention = _resolve_attention(cfg, target, {})
    per_replica = cfg.train.global_batch // (cfg.mesh.dcn * cfg.mesh.dp)
    unrolled = _unrolled(cfg, overlap, max(1, per_replica // max(micro_batch, 1)))
    remats = (_remat_candidates(cfg, target, unrolled,
                                _keeps_projections(cfg, overlap.tp_comm))
              if remat == "auto" else (remat,))
    chosen, need, _ = _cheapest_remat(cfg, micro_batch, overlap, target, attention, remats)
    return (micro_batch * cfg.model.seq_len <= gemm_tokens(cfg, overlap.tp_comm)
            and chosen is not None), need


def _remat_why(remat: str, need: float, tried: dict[str, float], target: Target,
               kept: str | None = None) -> str:
    """Why auto took `remat`: its estimate against the budget, and what the policies that
    recompute less were estimated to need (`kept`: why `minimal` was tried first)."""
    budget = (f" (budget {MEMORY_BUDGET * target.memory_bytes / 1e9:.0f} GB)"
              if target.memory_bytes else "")
    lead = ("nothing recomputed" if remat == "none" else "the least recompute that fits")
    if remat == "minimal" and kept and "none" not in tried:
        lead = kept
    elif remat == "full" and target.accelerator and "none" not in tried:
        lead = GPU_REMAT_WHY
    why = f"{lead}: ~{need / 1e9:.0f} GB per device estimated{budget}"
    over = [f"{r} ~{b / 1e9:.0f} GB" for r, b in tried.items() if r != remat]
    return why + (f"; over it: {', '.join(over)}" if over else "")


def _resolve_microbatches(cfg: Config, target: Target, overlap: OverlapPlan,
                          choices: dict[str, Choice], attention: str = "plain"
                          ) -> tuple[int, str]:
    """`pipeline.microbatches` and `model.remat`, `auto` resolved together (explicit values are
    kept): on a GPU the fewest microbatches whose GEMMs stay within `gemm_tokens` rows, whose
    pipeline bubble is at most `PIPELINE_BUBBLE` and whose estimated step fits (`fits_memory`)
    under the candidate policies (`_remat_candidates`); on a CPU the fewest microbatches and
    no recompute but in a pipeline (`CPU_PIPELINE_REMAT_WHY`)."""
    m, pl, mo = cfg.mesh, cfg.pipeline, cfg.model
    auto_remat = mo.remat == "auto"
    per_replica = cfg.train.global_batch // (m.dcn * m.dp)

    kept = _keeps_projections(cfg, overlap.tp_comm)

    def remats(n: int) -> tuple[str, ...]:
        return _remat_candidates(cfg, target, _unrolled(cfg, overlap, n), kept)

    def pick_remat(n: int) -> str:
        """The remat policy for an explicit (or CPU) microbatch count."""
        if not auto_remat:
            return mo.remat
        if not target.accelerator and m.pp > 1:
            choices["model.remat"] = Choice("full", CPU_PIPELINE_REMAT_WHY)
            return "full"
        if not target.accelerator:
            choices["model.remat"] = Choice("none", "CPU: no device memory to save, and "
                                                    "recomputing only adds work")
            return "none"
        if mo.kind not in ESTIMATED_KINDS:
            choices["model.remat"] = Choice("none", f"no memory estimate for model.kind="
                                                    f"{mo.kind}: nothing recomputed")
            return "none"
        b = max(1, per_replica // n)
        remat, need, tried = _cheapest_remat(cfg, b, overlap, target, attention, remats(n))
        if remat is None:
            choices["model.remat"] = Choice("full", f"the least memory: ~{need / 1e9:.0f} GB "
                                                    f"per device estimated; the step may "
                                                    f"still not fit the device's memory")
            return "full"
        choices["model.remat"] = Choice(remat,
                                        _remat_why(remat, need, tried, target, kept))
        return remat

    if pl.microbatches != "auto":
        return pl.microbatches, pick_remat(pl.microbatches)
    group = m.pp * pl.transfer_latency if pl.schedule == "interleaved" and m.pp > 1 else 1
    least = m.pp if m.pp > 1 and pl.schedule != "gpipe" else 1
    valid = [n for n in _divisors(per_replica) if n >= least and n % group == 0]
    if not valid:
        raise ConfigError([
            f"pipeline.microbatches: auto finds no count that divides the {per_replica} "
            f"sequences per replica (train.global_batch / mesh.dp) and suits "
            f"{pl.schedule} on {m.pp} stages; set pipeline.microbatches or train.global_batch"])
    if m.pp > 1:  # fill the pipeline twice over where the batch allows: less bubble
        valid = [n for n in valid if n >= 2 * m.pp] or valid[-1:]
    if not target.accelerator:
        n = valid[0]
        why = ("CPU: wall time follows total work, so the fewest microbatches"
               + (" that fill the pipeline twice" if m.pp > 1 else ""))
        choices["pipeline.microbatches"] = Choice(n, why)
        return n, pick_remat(n)
    budget = MEMORY_BUDGET * target.memory_bytes if target.memory_bytes else None
    tokens = gemm_tokens(cfg, overlap.tp_comm)
    v = pl.virtual_stages if pl.schedule == "interleaved" else 1
    filled = [n for n in valid if pipeline_bubble(m.pp, n, v) <= PIPELINE_BUBBLE] or valid[-1:]
    for n in filled:
        b = per_replica // n
        if b * mo.seq_len > tokens:
            continue
        remat, need, tried = _cheapest_remat(cfg, b, overlap, target, attention, remats(n))
        if remat is not None:
            rows = (f"collective-matmul ring steps of {b * mo.seq_len // m.tp} rows"
                    if _ring_steps(cfg, overlap.tp_comm)
                    else f"GEMMs of {b * mo.seq_len} rows")
            bubble = (f", bubble {pipeline_bubble(m.pp, n, v):.3f}" if m.pp > 1 else "")
            why = (f"{b} sequences x {mo.seq_len} positions per microbatch: {rows}{bubble}, "
                   f"~{need / 1e9:.0f} GB per device estimated")
            if budget is not None:
                why += f" (budget {budget / 1e9:.0f} GB)"
            choices["pipeline.microbatches"] = Choice(n, why)
            if auto_remat and mo.kind not in ESTIMATED_KINDS:
                return n, pick_remat(n)
            if auto_remat:
                choices["model.remat"] = Choice(
                    remat, _remat_why(remat, need, tried, target, kept))
            return n, remat
    n = valid[-1]
    choices["pipeline.microbatches"] = Choice(n, "the most microbatches the batch allows; the "
                                                 "step may still not fit the device's memory")
    return n, pick_remat(n)


def _resolve_slow(cfg: Config, plan: "ParallelPlan", choices: dict[str, Choice]
                  ) -> "ParallelPlan":
    """`overlap.dcn_comm_dtype` / `overlap.dcn_delay` auto: per gradient bucket, the dcn
    transfer against the backward compute it hides under (`slow_axis.decide`), on a GPU
    target from FLOP estimates at half the chip's peak; on a CPU fp32 and no delay."""
    from jax_overlap.overlap import slow_axis

    ov = cfg.overlap
    delay_knob = 0 if plan.diloco is not None else ov.dcn_delay  # DiLoCo: no gradient crosses
    if not plan.target.accelerator:
        why = "CPU: collectives run synchronously, nothing hides under compute"
        dtype = "fp32" if ov.dcn_comm_dtype == "auto" else ov.dcn_comm_dtype
        delay, lines = 0 if delay_knob == "auto" else delay_knob, []
        if ov.dcn_comm_dtype == "auto":
            choices["overlap.dcn_comm_dtype"] = Choice("fp32", why)
        if delay_knob == "auto":
            choices["overlap.dcn_delay"] = Choice(0, why)
    else:
        from jax_overlap.hardware.machine import chip_spec

        mo = cfg.model
        flops = 0.5 * chip_spec(plan.target.name).peak_bf16_flops
        tokens = plan.micro_batch * mo.seq_len
        layer_fwd = 2 * (4 * mo.d_model ** 2 + 2 * mo.d_model * mo.d_ff) * tokens / plan.tp
        layer_bwd = 2 * layer_fwd / flops
        layers = mo.layers // plan.pp
        backward_end = layers * layer_bwd
        step = 3 * layer_fwd / flops * layers * plan.microbatches
        bp = plan.layout.plan if plan.layout is not None else None
        if bp is not None:  # in-backward buckets: ready as the backward passes their layer
            ready = [(layers + 1 - min(b.ready_segment, layers + 1)) * layer_bwd
                     for b in bp.buckets]
            nbytes = [b.nbytes / (plan.dp if not b.scatter else 1) for b in bp.buckets]
        else:
            ready, nbytes = [backward_end], [plan.grad_bytes / plan.dp]
        dtype, delay, lines = slow_axis.decide(ready, nbytes, plan.dcn, plan.dcn_bytes_per_s,
                                               backward_end, step, ov.dcn_comm_dtype,
                                               delay_knob)
        for line in lines:
            key, why = line.split(": ", 1)
            choices[f"overlap.{key.split('=')[0]}"] = Choice(
                dtype if key.startswith("dcn_comm") else delay, why)
        if delay and delay_knob == "auto" and cfg.model.experts and ov.dcn_delay_mode == "local":
            delay = 0
            choices["overlap.dcn_delay"] = Choice(0, (
                "model.experts > 0: dcn_delay_mode local would keep each host's MoE router "
                "statistics apart; set overlap.dcn_delay_mode: gradient to delay the gradient"))
    overlap = dataclasses.replace(plan.overlap, dcn_comm_dtype=dtype, dcn_delay=delay)
    return dataclasses.replace(plan, overlap=overlap, choices=choices,
                               slow_decisions=tuple(lines))


def _grad_bytes(model, axis_sizes: dict[str, int]) -> int:
    """fp32 bytes of one device's gradient (its tp / pp share of every parameter)."""
    import math

    import jax

    from jax_overlap.overlap.buckets import local_shape
    from jax_overlap.parallel.mesh import rules_for, tree_specs

    specs = tree_specs(model.param_axes(), rules_for(axis_sizes.get("pp", 1)))
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    shapes = jax.tree.map(lambda a, s: local_shape(a.shape, tuple(s), axis_sizes), abstract,
                          specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    return 4 * sum(math.prod(s) for s in jax.tree.leaves(
        shapes, is_leaf=lambda x: isinstance(x, tuple)))


def _diloco_plan(cfg: Config) -> DilocoPlan | None:
    d = cfg.diloco
    if d.inner_steps <= 0 or cfg.mesh.dcn == 1:
        return None
    return DilocoPlan(d.inner_steps, d.fragments, d.delay, d.outer_lr, d.outer_momentum,
                      d.outer_dtype, d.mix)


def mesh_from_config(cfg: Config, devices: list | None = None) -> Any:
    """The config's (dp, pp, tp) mesh -- (dcn, dp, pp, tp) with mesh.dcn > 1 -- over
    `devices` (default: all devices of the job, which must match)."""
    import jax

    from jax_overlap.config import check_device_count
    from jax_overlap.parallel.mesh import make_mesh

    devices = jax.devices() if devices is None else devices
    check_device_count(cfg, len(devices))
    return make_mesh(cfg.mesh.dp, cfg.mesh.pp, cfg.mesh.tp, devices, dcn=cfg.mesh.dcn)
