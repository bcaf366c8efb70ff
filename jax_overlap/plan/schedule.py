"""The pipeline's `auto` knobs: the schedule and its chunks per stage, the transfer
latency, paired and fused ticks, the vocabulary-parallel head, the split backward and the
layers per virtual stage (with the staged layer order they give)."""

from __future__ import annotations

import dataclasses

import numpy as np

from jax_overlap.config import Config, ConfigError, PlanDecides
from jax_overlap.model_api import param_elements
from jax_overlap.pipeline.table import Schedule
from jax_overlap.plan.derived import auto_vocab_parallel, schedule_name
from jax_overlap.plan.memory import estimated_step_bytes, fits_memory
from jax_overlap.plan.values import Choice, OverlapPlan, Target


def layer_permutation(num_layers: int, schedule: Schedule, stage_layers=None
                      ) -> np.ndarray | None:
    from jax_overlap.pipeline.layout import staged_permutation

    perm = staged_permutation(num_layers, schedule, stage_layers)
    return None if np.array_equal(perm, np.arange(num_layers)) else perm


def resolve_stage_layers(cfg: Config, num_layers: int, schedule: Schedule,
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


def resolve_schedule(cfg: Config, target: Target, choices: dict[str, Choice]) -> Config:
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


def resolve_latency(cfg: Config, target: Target, choices: dict[str, Choice]) -> Config:
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


def resolve_fused(cfg: Config, target: Target, choices: dict[str, Choice],
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


def resolve_paired(cfg: Config, target: Target, choices: dict[str, Choice]) -> bool:
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


def resolve_vocab_parallel(cfg: Config, target: Target, model, choices: dict[str, Choice]
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


def resolve_split(cfg: Config, target: Target, schedule: Schedule, remat: str,
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
