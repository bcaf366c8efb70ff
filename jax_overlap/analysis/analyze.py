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
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_overlap.parallel.mesh import DP, make_mesh
from jax_overlap.training import step as steplib
from jax_overlap.training.state import new_state


def abstract_inputs(cfg, model, mesh, optimizer) -> tuple[Any, Any]:
    """ShapeDtypeStructs (with shardings) of the train state and a batch: nothing allocated."""
    key = jax.random.key(cfg.train.seed)
    abstract_params = jax.eval_shape(model.init, key)
    shardings = steplib.state_shardings(model, mesh, optimizer, abstract_params, cfg.overlap)
    shapes = jax.eval_shape(
        lambda: new_state(model.init(key), optimizer.init(model.init(key)), cfg.train.seed))
    state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                         shapes, shardings)
    batch_sharding = NamedSharding(mesh, P(DP))
    b, t = cfg.train.global_batch, cfg.model.seq_len
    example = model.example_batch_shapes(b) if hasattr(model, "example_batch_shapes") else {
        "inputs": ((b, t), "int32"), "targets": ((b, t), "int32")}
    batch = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding)
             for k, (shape, dtype) in example.items()}
    return state, batch


def lower_train_step(cfg, devices: list) -> Any:
    """`jax.jit(step).lower(...)` of the configured train step on `devices`."""
    from jax_overlap.model_api import build_model

    mesh = make_mesh(cfg.mesh.dp, cfg.mesh.pp, cfg.mesh.tp, devices)
    model = build_model(cfg)
    optimizer = steplib.make_optimizer(cfg.train)
    state, batch = abstract_inputs(cfg, model, mesh, optimizer)
    return steplib.make_train_step(model, cfg, mesh, optimizer).lower(state, batch)


def analyze(cfg, target: str = "cpu"):
    """HloReport of the configured train step compiled for `target`."""
    from jax_overlap.analysis.hlo_report import analyze_hlo

    # A pipeline step runs its actions through one `conditional` per tick: weigh each branch
    # by how often the tick table takes it, not as if every branch ran every tick.
    frequencies = None
    if cfg.mesh.pp > 1:
        from jax_overlap.pipeline import program as tick_program
        frequencies = tick_program.program_for(cfg).branch_frequencies()
    if target == "cpu":
        from jax_overlap.config import check_device_count

        check_device_count(cfg, jax.device_count())
        text = lower_train_step(cfg, jax.devices()).compile().as_text()
        return analyze_hlo(text, target="cpu", branch_frequencies=frequencies)
    from jax_overlap.analysis import deviceless

    reason = deviceless.unavailable_reason()
    if reason:
        from jax_overlap.config import ConfigError

        raise ConfigError([f"--target {target}: {reason}"])
    return deviceless.analyze_for(target, cfg.num_devices,
                                  lambda devices: lower_train_step(cfg, devices),
                                  branch_frequencies=frequencies)


def format_report(cfg, target: str, report) -> str:
    data = report.to_json()
    m = cfg.mesh
    lines = [f"train step of {cfg.model.kind} ({cfg.model.layers} layers, d_model "
             f"{cfg.model.d_model}) on dp={m.dp} pp={m.pp} tp={m.tp}, compiled for {target}",
             f"{'collective':20s} {'count/step':>10s} {'MiB/step':>10s}"]
    for kind, s in sorted(data["collectives"].items()):
        lines.append(f"{kind:20s} {s['count']:>10.10g} {s['bytes'] / 2**20:10.2f}")
    lines.append(f"async fraction of collective bytes:       {data['async_fraction']:.3f}")
    lines.append(f"collective bytes scheduled under GEMMs:   "
                 f"{data['collective_bytes_under_gemm_fraction']:.3f}")
    est = data.get("exposed_comm_s_estimate")
    if est is not None:
        lines.append(f"exposed communication estimate:           {est * 1e3:.3f} ms/step")
    if data.get("note"):
        lines.append(f"note: {data['note']}")
    return "\n".join(lines)


def analyze_command(cfg, target: str = "cpu", as_json: bool = False) -> str:
    report = analyze(cfg, target)
    if as_json:
        out = report.to_json()
        out["mesh"] = {"dp": cfg.mesh.dp, "pp": cfg.mesh.pp, "tp": cfg.mesh.tp}
        return json.dumps(out, default=float)
    return format_report(cfg, target, report)
