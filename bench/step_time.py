"""Train-step time: jax_overlap's shard_map step vs the same model under plain jit + GSPMD.

Both run the default model on 8 (forced CPU) devices with the same mesh, parameters and batch;
the GSPMD version is what a user would otherwise write: the model applied to global arrays,
parameters and batch annotated with NamedShardings, XLA choosing every collective. The two are
timed step by step in alternation (ours, GSPMD, GSPMD, ours, ...), so that the load of a shared
machine falls on both alike; each keeps its own state.

    python bench/step_time.py [--config configs/default.yaml] [--steps 10] [--set k=v ...]
    python bench/step_time.py --quick   # configs/tiny.yaml, 2 timed steps, no results file
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", help="default configs/default.yaml (configs/tiny.yaml with "
                                     "--quick)")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", help="results JSON (default bench/results/step_time.json; none "
                                  "with --quick)")
    ap.add_argument("--quick", action="store_true",
                    help="the tiny model (same dp2 x tp4 mesh), 2 timed steps, LLVM at -O0: "
                         "checks the bench runs")
    args = ap.parse_args()
    if args.quick:
        args.config = args.config or os.path.join(REPO, "configs", "tiny.yaml")
        args.steps = args.steps or 2
    else:
        args.config = args.config or "configs/default.yaml"
        args.steps = args.steps or 10
        args.out = args.out or "bench/results/step_time.json"

    from jax_overlap import config
    from jax_overlap.cli import prepare_backend

    cfg = config.load(args.config, (["data.source=synthetic"] if args.quick else [])
                      + args.overrides)
    prepare_backend(cfg)
    if args.quick:
        from _quick import fast_cpu_compiles

        fast_cpu_compiles()
    import jax
    import optax

    from jax_overlap.data import streams as data
    from jax_overlap.training import grads as gradslib
    from jax_overlap.training import step as steplib
    from jax_overlap.training.assemble import assemble

    run = assemble(cfg)
    mesh, model, optimizer = run.mesh, run.model, run.optimizer
    stream = data.stream_from_config(cfg)
    batches = [run.put_batch(stream.batch(i)) for i in range(args.steps + 1)]

    ours = run.train_step()
    state = run.init_state()

    def gspmd_step(state, batch):
        loss, grads = jax.value_and_grad(
            lambda p: gradslib.reference_loss(model, p, batch))(state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        return state._replace(params=optax.apply_updates(state.params, updates),
                              opt_state=opt_state, step=state.step + 1), {"loss": loss}

    shardings = steplib.state_shardings(model, mesh, optimizer,
                                        jax.eval_shape(model.init, jax.random.key(0)))
    gspmd = jax.jit(gspmd_step, in_shardings=(shardings, None), out_shardings=(shardings, None),
                    donate_argnums=(0,))
    state_g = run.init_state()

    fns, states = {"ours": ours, "gspmd": gspmd}, {"ours": state, "gspmd": state_g}
    times: dict[str, list[float]] = {k: [] for k in fns}
    losses: dict[str, list[float]] = {k: [] for k in fns}
    for k, fn in fns.items():  # compile + warm-up
        states[k], m = fn(states[k], batches[0])
        float(m["loss"])
    for i, b in enumerate(batches[1:]):
        for k in (("ours", "gspmd") if i % 2 == 0 else ("gspmd", "ours")):
            t0 = time.perf_counter()
            states[k], m = fns[k](states[k], b)
            losses[k].append(float(m["loss"]))
            times[k].append(time.perf_counter() - t0)
    t_ours, l_ours = statistics.median(times["ours"]), losses["ours"]
    t_gspmd, l_gspmd = statistics.median(times["gspmd"]), losses["gspmd"]
    tokens = cfg.train.global_batch * cfg.model.seq_len
    rows = [("jax_overlap shard_map", t_ours, tokens / t_ours, 1.0),
            ("jit + NamedSharding (GSPMD)", t_gspmd, tokens / t_gspmd, t_gspmd / t_ours)]
    m = cfg.mesh
    print(f"model: {cfg.model.layers}L d{cfg.model.d_model} h{cfg.model.heads} "
          f"ff{cfg.model.d_ff} seq{cfg.model.seq_len} batch{cfg.train.global_batch}; mesh "
          f"dp{m.dp} pp{m.pp} tp{m.tp} on {jax.device_count()} {jax.devices()[0].platform} "
          f"devices; median of {args.steps} steps; jax {jax.__version__}")
    print(f"{'step':32s} {'median s':>10s} {'tokens/s':>10s} {'time / ours':>12s}")
    for name, t, tps, ratio in rows:
        print(f"{name:32s} {t:10.4f} {tps:10.0f} {ratio:12.2f}")
    max_diff = max(abs(a - b) / abs(b) for a, b in zip(l_ours, l_gspmd))
    print(f"max relative loss difference over the run: {max_diff:.2e}")
    if args.out is None:
        return
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"rows": [dict(name=n, median_step_s=t, tokens_per_s=tps, ratio_to_ours=r)
                            for n, t, tps, r in rows], "max_rel_loss_diff": max_diff,
                   "jax": jax.__version__, "config": cfg.to_dict()}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
