"""`jax-overlap analyze`: the collectives of the compiled train step, and how many hide.

On `--target cpu` the step is compiled for this machine's (forced) CPU devices: every
collective there is synchronous, and the report says so. On a GPU target (`a100`, `h100`,
`h200`) the same step is compiled for that many GPUs without any GPU present (see
`jax_overlap.analysis.deviceless`), so the HLO is the one XLA's GPU latency-hiding scheduler
produces, with async start/done pairs whose placement we can read.
"""

from __future__ import annotations

import json
from typing import Any

import jax


def target_of(name: str):
    """The plan's `Target` for an `analyze --target` name: the forced CPU devices, or a GPU
    part with its memory."""
    from jax_overlap.plan import Target

    if name == "cpu":
        return Target()
    from jax_overlap.analysis.xla_targets import get_target

    chip = get_target(name)
    return Target(chip.key, True, float(chip.chip.hbm_bytes))


def abstract_inputs(run) -> tuple[Any, Any]:
    """ShapeDtypeStructs (with shardings) of the train state and a batch of an assembled `run`
    with a mesh: nothing allocated."""
    return run.abstract_state(), run.abstract_batch()


def build_plan(cfg, target: str = "cpu"):
    """The `Run` of `cfg` planned for an `analyze --target` name, with no mesh yet."""
    from jax_overlap.training.assemble import assemble

    return assemble(cfg, target=target_of(target))


def lower_train_step(cfg, devices: list, target: str = "cpu", built=None) -> Any:
    """`jax.jit(step).lower(...)` of the configured train step on `devices`, with the plan
    made for `target` (`built`: the `Run` from `build_plan`, to reuse)."""
    run = (built or build_plan(cfg, target)).on(devices)
    return run.train_step().lower(*abstract_inputs(run))


def analyze(cfg, target: str = "cpu", built=None, texts: list | None = None,
            memory: dict | None = None):
    """HloReport of the configured train step compiled for `target` (`texts`, when given,
    receives the compiled HLO text; `memory`, what XLA allocates per device)."""
    from jax_overlap.analysis.hlo_report import analyze_hlo

    built = built or build_plan(cfg, target)
    plan = built.plan
    from jax_overlap.analysis import deviceless

    if target == "cpu":
        from jax_overlap.config import check_device_count

        check_device_count(cfg, jax.device_count())
        text = deviceless.compile_lowered(lower_train_step(cfg, jax.devices(), target, built),
                                          memory=memory)
        if texts is not None:
            texts.append(text)
        return analyze_hlo(text, target="cpu",
                           branch_frequencies=switch_weights(plan.program, text))
    reason = deviceless.unavailable_reason()
    if reason:
        from jax_overlap.config import ConfigError

        raise ConfigError([f"--target {target}: {reason}"])
    # With a slow axis, one host per dcn group (topology 1 x dcn x devices per group), so the
    # compiled program is the multi-host one and its dcn collectives can be told apart.
    text = deviceless.compile_for(target, plan.num_devices,
                                  lambda devices: lower_train_step(cfg, devices, target, built),
                                  num_hosts=plan.dcn, memory=memory)
    if texts is not None:
        texts.append(text)
    from jax_overlap.analysis.xla_targets import get_target

    return analyze_hlo(text, target=get_target(target).key,
                       branch_frequencies=switch_weights(plan.program, text))


def switch_weights(program, text: str):
    """The branch weights of a compiled pipeline step's tick switches, for
    `hlo_parse.execution_counts` (None without a pipeline): each lane's switch by its own
    column of the tick table, the head phase's cond by the ticks that have a head
    (`step_estimate.tick_switch_shares`), not as if every branch ran every tick. Where the
    step runs its last tick after the loop (`LAST_TICK_SCOPE` in its HLO), that tick's
    switches take the last row, the loop's the others."""
    from jax_overlap.analysis.step_estimate import Ticks, tick_switch_shares
    from jax_overlap.pipeline.program import LAST_TICK_SCOPE

    if program is None:
        return None
    return tick_switch_shares(Ticks.of_program(program), f"/{LAST_TICK_SCOPE}/" in text)


def step_estimate(cfg, plan, model, target: str, text: str, report=None):
    """`StepEstimate` of a step compiled for a GPU `target` (`analysis.step_estimate`): the
    roofline over its kernels, the pipeline replayed on the plan's tick table, plus the
    communication the `report` (its `HloReport`) finds under no compute."""
    from jax_overlap.hardware.machine import chip_spec
    from jax_overlap.analysis.step_estimate import Ticks, estimate_step

    model_flops = model.flops_per_example() * cfg.train.global_batch / plan.num_devices
    ticks = Ticks.of_program(plan.program) if plan.program is not None else None
    exposed = (report.exposed_comm_s_estimate or 0.0) if report is not None else 0.0
    return estimate_step(text, chip_spec(target), model_flops, ticks, exposed)


# Below this share of collective bytes under GEMMs, `analyze` names the knobs that would help.
LOW_OVERLAP = 0.5


def overlap_hints(cfg, plan, fraction: float) -> list[str]:
    """What to change when little communication hides under GEMMs: one line per knob, naming
    the config key and the value to try. Empty on a CPU target (nothing overlaps there) or
    when the fraction is already high."""
    if not plan.target.accelerator or fraction >= LOW_OVERLAP:
        return []
    hints: list[str] = []
    ov = plan.overlap
    if plan.tp > 1 and ov.tp_comm != "collective_matmul":
        how = ("grouped steps under the GEMMs of the rank's own sequence chunk (hidden, but "
               "more kernels and copies: compare the estimated step)" if plan.pp > 1
               else "ring steps under the block's matmuls")
        hints.append(f"overlap.tp_comm=collective_matmul: TP all-gathers / reduce-scatters as "
                     f"{how}")
    if plan.dp > 1 and ov.grad_bucket_bytes == 0 and not ov.fsdp:
        hints.append("overlap.grad_bucket_mb=64: DP gradients reduced in buckets during the "
                     "last microbatch's backward instead of after it")
    if ov.xla_preset == "none":
        hints.append("overlap.xla_preset=gpu_overlap: XLA's latency-hiding scheduler flags")
    if plan.ep > 1:  # the expert all-to-alls: (a) chunks, (b) another microbatch's GEMMs
        paired = ov.pair_microbatches or plan.fused_pairs
        if ov.moe_chunks == 1:
            hints.append("overlap.moe_chunks=6: each MoE layer's all-to-alls in chunks, each "
                         "one under another chunk's expert GEMMs"
                         + (" (with the paired microbatches: the most hidden, at a longer "
                            "estimated step)" if paired else ""))
        if plan.pp == 1 and not paired:
            hints.append("overlap.pair_microbatches=true with pipeline.microbatches >= 2 and "
                         "no FSDP: a microbatch's forward beside the previous one's backward, "
                         "each one's all-to-alls under the other's GEMMs")
    from jax_overlap.plan import microbatch_fits

    seq = cfg.model.seq_len
    fits, need = microbatch_fits(cfg, plan.micro_batch, ov, plan.target)
    if not fits:
        per_replica = plan.micro_batch * plan.microbatches
        more = [n for n in range(plan.microbatches + 1, per_replica + 1)
                if per_replica % n == 0 and microbatch_fits(cfg, per_replica // n, ov,
                                                            plan.target)[0]]
        if more:
            hints.append(
                f"pipeline.microbatches={more[0]} (what auto picks): {plan.micro_batch} x {seq} "
                f"tokens per microbatch, ~{need / 1e9:.0f} GB per device "
                f"estimated; a step short of memory makes XLA serialise its collectives")
    return hints


def format_report(cfg, plan, target: str, report, dcn: dict | None = None,
                  estimate=None, top: int = 0, memory: dict | None = None) -> str:
    data = {**report.to_json(), "dcn": dcn}
    lines = [f"train step of {cfg.model.kind} ({cfg.model.layers} layers, d_model "
             f"{cfg.model.d_model}) on {f'dcn={plan.dcn} ' if plan.dcn > 1 else ''}"
             f"dp={plan.dp} pp={plan.pp} tp={plan.tp}, "
             f"{plan.microbatches} microbatches, compiled for {target}"]
    lines.extend(plan.choice_lines())
    lines.append(f"{'collective':20s} {'count/step':>10s} {'MiB/step':>10s} "
                 f"{'under GEMMs':>11s}")
    for kind, s in sorted(data["collectives"].items()):
        under = s["under_gemm_bytes"] / s["bytes"] if s["bytes"] else 0.0
        lines.append(f"{kind:20s} {s['count']:>10.10g} {s['bytes'] / 2**20:10.2f} "
                     f"{under:11.3f}")
    lines.append(f"async fraction of collective bytes:       {data['async_fraction']:.3f}")
    lines.append(f"collective bytes scheduled under GEMMs:   "
                 f"{data['collective_bytes_under_gemm_fraction']:.3f}")
    dcn = data.get("dcn")
    if dcn is not None:
        lines.append(f"bytes crossing dcn per step (per device): "
                     f"{dcn['bytes_per_step'] / 2**20:.3f} MiB in "
                     f"{dcn['count_per_step']:.0f} collectives ({dcn['mode']})")
        if "under_gemm_fraction" in dcn:
            lines.append(f"  of those, under GEMMs ({dcn['hosts']}-host GPU compile): "
                         f"{dcn['under_gemm_fraction'] * 100:.1f}% (async "
                         f"{dcn['async_fraction'] * 100:.1f}%)")
        for d in dcn.get("decisions", []):
            lines.append(f"slow axis: {d}")
    est = data.get("exposed_comm_s_estimate")
    if est is not None:
        lines.append(f"exposed communication estimate:           {est * 1e3:.3f} ms/step")
    if estimate is not None:
        from jax_overlap.analysis.step_estimate import format_estimate

        lines.extend(format_estimate(estimate, top))
    if memory and memory.get("peak_bytes"):
        device = memory.get("device_bytes")
        est = memory.get("estimated_bytes")
        lines.append(f"memory per device (XLA):                  "
                     f"{_gib(memory['peak_bytes'])}"
                     + (f" of {_gib(device)}" if device else "")
                     + (f" (plan estimated {_gib(est)})" if est else "")
                     + ("" if memory.get("fits") is not False else ": DOES NOT FIT"))
    if data.get("note"):
        lines.append(f"note: {data['note']}")
    for hint in overlap_hints(cfg, plan, data["collective_bytes_under_gemm_fraction"]):
        lines.append(f"to hide more: --set {hint}")
    return "\n".join(lines)


def dcn_summary(plan, texts: list, frequencies=None, report=None) -> dict | None:
    """Bytes per step crossing dcn and the plan's slow-axis decisions; None without a slow
    axis. From the compiled CPU HLO (`texts`), or from the collectives of a deviceless GPU
    compile for dcn hosts (`report`): there also the share of those bytes whose async
    collective has a GEMM scheduled between its start and done (`under_gemm_fraction`)."""
    if plan.dcn == 1:
        return None
    from jax_overlap.analysis.dcn_traffic import crosses, dcn_bytes, dcn_bytes_of_hlo

    out = {"mode": plan.slow_mode, "decisions": list(plan.slow_decisions)}
    group = plan.num_devices // plan.dcn
    if texts:
        out.update(dcn_bytes_of_hlo(texts[0], group, frequencies))
    elif report is not None and report.ops:  # deviceless GPU, one host per dcn group
        out.update(dcn_bytes(report.ops, group))
        slow = [op for op in report.ops if crosses(op, group)]
        total = sum(op.bytes_per_step for op in slow)
        under = sum(op.under_gemm_bytes for op in slow)
        out.update({"hosts": plan.dcn, "under_gemm_fraction": under / total if total else 0.0,
                    "async_fraction": (sum(op.bytes_per_step for op in slow if op.is_async)
                                       / total if total else 0.0)})
    else:  # no compiled program: the plan's estimate
        out.update({"bytes_per_step": float(plan.slow_bytes_per_step), "count_per_step": 0,
                    "by_kind": {}, "unknown": 0, "estimated": True})
    return out


def analyze_command(cfg, target: str = "cpu", as_json: bool = False, top: int = 0) -> str:
    """`jax-overlap analyze`: the report as text or JSON. On a GPU target it carries the
    step estimate (`estimate`; with `top`, the costliest non-GEMM kernels under
    `top_kernels`)."""
    built = build_plan(cfg, target)
    texts: list = []
    memory: dict = {}
    report = analyze(cfg, target, built, texts, memory)
    model, plan = built.model, built.plan
    frequencies = switch_weights(plan.program, texts[0])
    estimate = (step_estimate(cfg, plan, model, target, texts[0], report) if target != "cpu"
                else None)
    dcn = dcn_summary(plan, texts if target == "cpu" else [], frequencies, report)
    if as_json:
        out = report.to_json()
        if estimate is not None:
            out["estimate"] = estimate.to_json()
            if top:
                out["top_kernels"] = estimate.top(top)
        if dcn is not None:
            out["dcn"] = dcn
        out["mesh"] = plan.axis_sizes
        out["memory"] = memory_summary(plan, memory)
        out["plan"] = plan.describe()
        out["hints"] = overlap_hints(cfg, plan, out["collective_bytes_under_gemm_fraction"])
        return json.dumps(out, default=float)
    return format_report(cfg, plan, target, report, dcn, estimate, top,
                         memory_summary(plan, memory))


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def memory_summary(plan, memory: dict) -> dict:
    """What XLA allocates per device for the compiled step, beside the plan's estimate and
    the device's memory (`fits`: the peak within it; None where either is unknown)."""
    out = dict(memory)
    device = plan.target.memory_bytes
    out["device_bytes"] = device
    out["estimated_bytes"] = plan.memory_estimate or None
    peak = memory.get("peak_bytes")
    out["fits"] = None if not (device and peak) else bool(peak <= device)
    return out
