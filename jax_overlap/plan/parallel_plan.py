"""`ParallelPlan`: the plan built once from the config (`ParallelPlan.build` runs the
resolvers of `schedule`, `comm` and `memory` in order), what the step reads from it, and the
per-compile XLA options it sets; and the mesh a config names."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jax_overlap.config import Config, ConfigError
from jax_overlap.model_api import param_elements
from jax_overlap.pipeline.program import TickProgram, compile_program
from jax_overlap.pipeline.table import Schedule
from jax_overlap.plan.comm import (
    paired_moe_chunks,
    resolve_lone_tp_comm,
    resolve_moe_chunks,
    resolve_overlap,
    resolve_pair_microbatches,
    resolve_sharding,
    resolve_slow,
    resolve_sp_split,
    resolve_tp,
    resolve_zero1,
)
from jax_overlap.plan.derived import cached_schedule
from jax_overlap.plan.memory import (
    estimated_step_bytes,
    fits_memory,
    resolve_attention,
    resolve_microbatches,
)
from jax_overlap.plan.schedule import (
    layer_permutation,
    resolve_fused,
    resolve_latency,
    resolve_paired,
    resolve_schedule,
    resolve_split,
    resolve_stage_layers,
    resolve_vocab_parallel,
)
from jax_overlap.plan.values import MIB, Choice, DilocoPlan, OverlapPlan, Target

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
        cfg = resolve_schedule(cfg, target, choices)
        cfg = resolve_latency(cfg, target, choices)
        # Resolved first: the memory estimates below count the paired table's slots.
        cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(
            cfg.pipeline, paired=resolve_paired(cfg, target, choices)))
        m, pl, ov = cfg.mesh, cfg.pipeline, cfg.overlap
        tp_comm, direction = resolve_tp(cfg, target, choices)
        attention = resolve_attention(cfg, target, choices)
        cfg = resolve_zero1(cfg, target, choices, tp_comm, attention)
        ov = cfg.overlap
        fsdp = resolve_sharding(cfg, target, choices, tp_comm, attention)
        bucket_mb, embed_first, preset = resolve_overlap(cfg, target, choices, fsdp)
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
            moe_chunks=resolve_moe_chunks(cfg, target, choices),
        )
        microbatches, remat = resolve_microbatches(cfg, target, overlap, choices, attention)
        overlap = dataclasses.replace(overlap, pair_microbatches=resolve_pair_microbatches(
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
        vocab_parallel = resolve_vocab_parallel(cfg, target, model, choices)
        if vocab_parallel and model is not None and not getattr(model, "vocab_parallel_head",
                                                                False):
            raise ConfigError([
                f"pipeline.vocab_parallel: model {type(model).__name__} does not declare "
                f"vocab_parallel_head (its head must slice its output layer with "
                f"collectives.vocab_columns and use vocab_cross_entropy, "
                f"docs/guides/custom_models.md); "
                f"set it to false"])
        split = resolve_stage_layers(cfg, num_layers, schedule, choices, vocab_parallel,
                                     target)
        if m.pp > 1:
            perm = layer_permutation(num_layers, schedule, split)
        plan = cls(dp=m.dp, pp=m.pp, tp=m.tp, microbatches=microbatches,
                   micro_batch=cfg.train.global_batch // (m.dcn * m.dp * microbatches),
                   schedule=schedule, layer_perm=perm, overlap=overlap,
                   compute_dtype=cfg.train.precision, remat=remat, target=target,
                   choices=choices, stage_layers=split, dcn=m.dcn, ep=m.ep,
                   diloco=_diloco_plan(cfg),
                   dcn_bytes_per_s=m.dcn_gbps * 1e9 / 8, vocab_parallel=vocab_parallel,
                   attention=attention, param_elements=param_elements(cfg, model))
        plan = dataclasses.replace(plan, split_backward=resolve_split(cfg, target, schedule,
                                                                      remat, choices),
                                   fused_pairs=resolve_fused(cfg, target, choices,
                                                             schedule.paired))
        if plan.overlap.moe_chunks > 1 and (plan.fused_pairs or plan.overlap.pair_microbatches):
            plan = dataclasses.replace(plan, overlap=paired_moe_chunks(cfg, plan, choices))
        plan = dataclasses.replace(plan, overlap=dataclasses.replace(
            plan.overlap, lone_tp_comm=resolve_lone_tp_comm(cfg, plan, choices)))
        plan = dataclasses.replace(plan, overlap=dataclasses.replace(
            plan.overlap, sp_split=resolve_sp_split(cfg, plan, choices)))
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
            plan = resolve_slow(cfg, plan, choices)
        return plan


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
