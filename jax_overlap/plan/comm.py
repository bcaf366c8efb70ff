"""The communication's `auto` knobs: tensor-parallel mode and how sequence parallelism
splits its rows, ZeRO-1 and FSDP, gradient buckets and the XLA preset, MoE all-to-all chunks
and paired microbatches, and the slow axis's dtype and delay."""

from __future__ import annotations

import dataclasses

from jax_overlap.config import Config, ConfigError
from jax_overlap.plan.memory import (
    ESTIMATED_KINDS,
    MEMORY_BUDGET,
    estimated_step_bytes,
    fits_memory,
)
from jax_overlap.plan.values import MIB, Choice, OverlapPlan, Target


def resolve_tp(cfg: Config, target: Target, choices: dict[str, Choice]) -> tuple[str, str]:
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


def resolve_moe_chunks(cfg, target, choices) -> int:
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


def paired_moe_chunks(cfg: Config, plan, choices: dict[str, Choice]) -> OverlapPlan:
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


def resolve_pair_microbatches(cfg: Config, target: Target, overlap: OverlapPlan,
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


def resolve_zero1(cfg: Config, target: Target, choices: dict[str, Choice], tp_comm: str,
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
        buckets = int(resolve_overlap(cfg, target, {}, False)[0] * MIB)
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


def resolve_sharding(cfg: Config, target: Target, choices: dict[str, Choice], tp_comm: str,
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


def resolve_overlap(cfg: Config, target: Target, choices: dict[str, Choice], fsdp: bool
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


# Why `overlap.lone_tp_comm: auto` is collective matmul (measured; docs/results.md).
LONE_TP_COMM_WHY = (
    "GPU, fused pairs at tp = 2: a tick that runs one action has no other lane to hide its "
    "sequence-parallel all-gathers and reduce-scatters, so its blocks run as collective "
    "matmul, the gather under the own chunk's GEMM (GPT-1.3B pp2 x dp2 x tp2, deviceless 8 x "
    "H100: 0.78 -> 0.93 of the collective bytes under GEMMs, exposed 43 -> 22 ms, for 8 ms "
    "more of the estimated 1039 ms step)")


def resolve_lone_tp_comm(cfg: Config, plan, choices: dict[str, Choice]) -> str:
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


def resolve_sp_split(cfg: Config, plan, choices: dict[str, Choice]) -> str:
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


def resolve_slow(cfg: Config, plan, choices: dict[str, Choice]):
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
