"""Which one-step-late method converges: a one-device simulation of dcn = 2 groups.

    python bench/slow_axis_methods.py METHOD [--steps 300] [--warm W] [--set k=v ...]
    python bench/slow_axis_methods.py --stability
    python bench/slow_axis_methods.py --quick

Cheaper than the 8-device runs of bench/slow_axis.py (one jitted, vmapped step over the two
groups' halves of each batch), for comparing methods on the default model before building
one. METHOD:

  sync     AdamW on the global gradient every step (the reference)
  delay    AdamW on the global gradient one step late (overlap.dcn_delay=1, mode gradient);
           --warm W: the first W steps synchronous
  predict  delay, with the forward at theta + (the last update): weight prediction
  corr     per group: AdamW on g^k_t + (G_{t-1} - g^k_{t-1}), fresh local gradient plus
           the late correction in gradient space
  local    per group: AdamW on its own fresh gradient; the mean of the groups' updates
           replaces the own one a step later (overlap.dcn_delay_mode=local)
  diloco   Streaming DiLoCo H=8, 2 fragments, tau=1 (--outer-lr, --outer-momentum, --mix);
           fp32 outer gradients, fragments cut as in overlap/diloco.py

Prints the final loss and the mean of the last 20 steps; --out writes the curve (JSON).
`--stability`: the largest stable a*h of m' = b1 m + (1 - b1) h x, theta' = theta - a m for a
fresh, stale and partly fresh x (the linear model of docs/guides/slow_links.md, section 2b).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
D = 2


def stability(beta: float, fresh: float, predict: bool = False, steps: int = 3000) -> float:
    """Largest stable a (h = 1) for x = fresh * theta_t + (1 - fresh) * theta_{t-1}; with
    `predict`, x = theta_{t-1} + (theta_{t-1} - theta_{t-2})."""
    def stable(a):
        th, m = [1.0, 1.0, 1.0], 0.0
        for _ in range(steps):
            x = (2 * th[-2] - th[-3]) if predict else fresh * th[-1] + (1 - fresh) * th[-2]
            m = beta * m + (1 - beta) * x
            th.append(th[-1] - a * m)
            if abs(th[-1]) > 1e6:
                return False
        return abs(th[-1]) < 1.0
    lo, hi = 0.0, 100.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if stable(mid) else (lo, mid)
    return lo


def simulate(method: str, cfg, warm: int = 0, outer_lr: float = 0.7,
             outer_momentum: float = 0.9, mix: float = 0.5, log=print) -> list[float]:
    import jax
    import jax.numpy as jnp
    import optax

    from jax_overlap.data import streams as data
    from jax_overlap.training import grads as gradslib
    from jax_overlap.training import step as steplib
    from models.gpt import GPT

    model = GPT.from_config(cfg.model)
    stream = data.stream_from_config(cfg)
    opt = steplib.make_optimizer(cfg.train)
    p0 = model.init(jax.random.key(cfg.train.seed))
    tmap = jax.tree.map
    vg = jax.jit(jax.vmap(jax.value_and_grad(
        lambda p, b: gradslib.reference_loss(model, p, b))))
    upd, vupd = jax.jit(opt.update), jax.jit(jax.vmap(opt.update))
    mean0 = lambda t: tmap(lambda x: x.mean(0), t)  # noqa: E731
    stack = lambda t: tmap(lambda x: jnp.broadcast_to(x, (D, *x.shape)), t)  # noqa: E731
    add = lambda a, b: tmap(jnp.add, a, b)  # noqa: E731
    sub = lambda a, b: tmap(jnp.subtract, a, b)  # noqa: E731

    def fragment_mask(tree, f, fragments=2):
        def m(path, x):
            key = path[0].key
            if key == "blocks":
                n = x.shape[0] // fragments
                i = jnp.arange(x.shape[0])
                on = ((i >= f * n) & (i < (f + 1) * n)).astype(x.dtype)
                return on.reshape((-1,) + (1,) * (x.ndim - 1)) * jnp.ones_like(x)
            own = (key == "embed" and f == 0) or (key == "head" and f == fragments - 1)
            return jnp.full_like(x, 1.0 if own else 0.0)
        return jax.tree_util.tree_map_with_path(m, tree)

    params, state = p0, opt.init(p0)
    local, states = stack(p0), jax.vmap(opt.init)(stack(p0))
    pending, last_u, prev = None, tmap(jnp.zeros_like, p0), None
    outer, momentum = p0, tmap(jnp.zeros_like, p0)
    period, losses, t0 = 4, [], time.time()
    issued = lambda t: (t // period - 1) % 2 if t > 0 and t % period == 0 else -1  # noqa: E731
    for t in range(cfg.train.steps):
        b = tmap(lambda x: jnp.asarray(x).reshape(D, -1, *x.shape[1:]), stream.batch(t))
        if method in ("sync", "delay", "predict"):
            at = add(params, last_u) if method == "predict" else params
            loss, g = vg(stack(at), b)
            G = mean0(g)
            use = G if method == "sync" or t < warm else pending
            if use is not None:
                last_u, state = upd(use, state, params)
                params = optax.apply_updates(params, last_u)
            pending = None if t < warm else G
        elif method in ("corr", "local"):
            loss, g = vg(local, b)
            if method == "corr":
                use = g if prev is None else add(g, sub(stack(mean0(prev)), prev))
                u, states = vupd(use, states, local)
                local, prev = optax.apply_updates(local, u), g
            else:
                u, states = vupd(g, states, local)
                local = optax.apply_updates(local, u)
                if prev is not None:
                    local = add(local, sub(stack(mean0(prev)), prev))
                prev = u
        elif method == "diloco":
            f = issued(t)
            if f >= 0:
                mask = fragment_mask(outer, f)
                delta = tmap(lambda g_, l_: g_ - l_.mean(0), outer, local)
                momentum = tmap(lambda m, d, k: k * (outer_momentum * m + d) + (1 - k) * m,
                                momentum, delta, mask)
                outer = tmap(lambda g_, d, m, k: g_ - k * outer_lr * (d + outer_momentum * m),
                             outer, delta, momentum, mask)
            loss, g = vg(local, b)
            u, states = vupd(g, states, local)
            local = optax.apply_updates(local, u)
            f = issued(t - 1)
            if f >= 0:
                mask = fragment_mask(outer, f)
                local = tmap(lambda l_, g_, k: k * (mix * l_ + (1 - mix) * g_) + (1 - k) * l_,
                             local, outer, mask)
        else:
            raise SystemExit(f"METHOD: unknown {method!r}; see --help")
        losses.append(float(loss.mean()))
        if t % 50 == 0:
            log(f"step {t}: loss {losses[-1]:.4f} ({time.time() - t0:.0f} s)")
    return losses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("method", nargs="?", default="local")
    ap.add_argument("--config", default=os.path.join(REPO, "configs", "default.yaml"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warm", type=int, default=0)
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--outer-momentum", type=float, default=0.9)
    ap.add_argument("--mix", type=float, default=0.5)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default="")
    ap.add_argument("--stability", action="store_true")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.stability:
        print(f"{'b1':>5s} {'fresh':>7s} {'stale':>7s} {'half':>7s} {'90%':>7s} {'predict':>8s}")
        for beta in (0.0, 0.5, 0.9):
            print(f"{beta:5.2f} {stability(beta, 1.0):7.3f} {stability(beta, 0.0):7.3f} "
                  f"{stability(beta, 0.5):7.3f} {stability(beta, 0.9):7.3f} "
                  f"{stability(beta, 0.0, predict=True):8.3f}")
        return 0
    from jax_overlap import config

    config_path, steps, extra = args.config, args.steps, list(args.set)
    methods = [args.method]
    if args.quick:
        # Checks the bench runs (the default suite): the reference, the late gradient and the
        # method the project ships, on the tiny model.
        config_path, steps = os.path.join(REPO, "configs", "tiny.yaml"), 3
        extra += ["data.source=synthetic"]
        methods = ["sync", "delay", "local"]
    cfg = config.load(config_path, [f"train.steps={steps}", *extra])
    for method in methods:
        losses = simulate(method, cfg, args.warm, args.outer_lr, args.outer_momentum, args.mix)
        tail = losses[-20:]
        print(json.dumps({"method": method, "warm": args.warm, "final": losses[-1],
                          "tail_mean": sum(tail) / len(tail)}))
        if args.out and not args.quick:
            with open(args.out, "w") as f:
                json.dump({"method": method, "config": cfg.model.kind, "losses": losses}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
