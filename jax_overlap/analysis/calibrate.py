"""Measuring a model's pieces on this machine and fitting them over shapes; the cost of a
plan is made from the fits by `plan_costs` (`costs_for_config`), the one cost model.

What is measured
----------------
On the devices given -- all at once, each running its own copy, as the devices of a
real step do -- the configured model's pieces are timed at the micro-batch shape of one
TP rank (medians of a few calls, less the launch overhead of one call, since in a train
step every piece runs inside one program):

* the blocks: forward (``block_f``), forward + backward w.r.t. weights and input
  (``block_fb``) and, for split-backward schedules, forward + backward w.r.t. the input
  only (``block_fbx``) and w.r.t. the weights only (``block_fbw``), per layer of a
  ``lax.scan`` over every layer, as the train step and the executor run them (the scan
  stacks residuals for the backward: ~40% more work than a lone block at large
  micro-batches here). ``block1_*`` are the same for a one-layer pipeline chunk, whose
  length-1 scan XLA unrolls;
* the embedding (``embed_f``, ``embed_fb``) and the head with its loss (``head_f``,
  ``head_fb``);
* the optimizer update of one device's parameters (``optimizer``);
* psums over groups of each size the plans use (all groups at once), as ring links.

A TP rank's work is computed without its collectives: the model runs with
``Parallel(tp_axis=None, tp=k)``, i.e. at the per-rank shapes (heads, ``d_ff`` and
vocabulary split ``k`` ways, rank 0's slice) with every collective the identity. The
collectives are costed from their bytes and the measured links.

How a measurement becomes the cost of any plan
-----------------------------------------------
Each quantity is fitted (least squares on relative error) to

    t(b, k) = c0 + c1 * b + c2 * b / k

for micro-batch ``b`` sequences and TP degree ``k``. This is how TP is scaled: ``c2 *
b / k`` is the work TP divides -- every matmul, attention over the rank's ``heads / k``
heads, GELU on ``d_ff / k``, the ``vocab / k`` slice of the logits and loss -- while
``c1 * b`` is the work every rank repeats in full (layer norms, residual adds and
biases on ``d_model``, the position embedding) and ``c0`` per-call overhead. The tuner
measures the corners ``(smallest b, smallest k)``, ``(largest b, smallest k)``,
``(largest b, largest k)`` of its candidates, so predictions interpolate. A virtual
stage of ``n`` layers costs ``n`` blocks, plus the embedding on the first and the head
on the last; F, B and W are made of these as the step runs them:

* ``pp = 1`` (microbatches accumulated by a ``scan`` of ``value_and_grad``): F =
  ``f``, B = ``fb - f``;
* ``pp > 1`` (an F stashes its ``jax.vjp`` residuals, so a backward re-runs no forward
  but what ``model.remat: full`` recomputes, ``block_f`` a layer): B = ``fb - f``
  (non-split), or ``fb - f`` split in the ratio ``fbx : fbw`` between B (the input
  gradients) and W (the weight-gradient GEMMs), the head's backward half in each (split;
  virtual stage 0's B also pulls back into the embedding). Under a vocabulary-parallel head
  (`pipeline.vocab_parallel`) the head is no virtual stage's: each stage's head phase costs
  ``head_fb / pp`` (:func:`head_phase_time`).

Shared cores
------------
On the XLA CPU backend the forced devices share the machine's cores: a device's
compute is slower the more other devices compute at the same time. Measuring on all
``N`` devices at once builds that into every number. ``parallel_capacity`` -- ``N``
times the one-device-alone time over the all-devices time of the same block -- is how
many devices' worth of compute the machine runs at once. In a pipelined step the
lockstep executor leaves a schedule's bubble fraction of the devices idle, and idle
devices free their share of the cores, so pipelined compute times are scaled by
``max(N (1 - bubble), capacity) / max(N, capacity)``.

Communication
-------------
The simulator lumps one virtual stage's TP traffic per F / B into one all-reduce of
``tp_bytes``. Megatron's GPT issues several per action (per layer two in the forward
and two in the backward; the embedding one; the vocabulary-parallel loss a max and two
sums, and one more in its backward), each paying the ring latency. ``tp_bytes`` is
therefore the summed bytes plus ``k * (count - 1) * latency * bandwidth``, which makes
the simulator's single ring all-reduce cost exactly as much as the ``count`` separate
ones. The optimizer update and the step's one launch are outside the simulated
loss-and-gradients step; the tuner adds them to the predicted step time.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jax_overlap.hardware.collective_cost import ring_factor, ring_steps
from jax_overlap.hardware.machine import HardwareProfile, Link
from jax_overlap.config import Config
from jax_overlap.model_api import local_param_shapes

# ``block_*``: per layer of a lax.scan over every layer; ``block1_*``: a one-layer chunk,
# whose length-1 scan XLA unrolls, so it skips the residual stacking a longer scan pays.
QUANTITIES: tuple[str, ...] = (
    "block_f",
    "block_fb",
    "block_fbx",
    "block_fbw",
    "block1_f",
    "block1_fb",
    "block1_fbx",
    "block1_fbw",
    "embed_f",
    "embed_fb",
    "head_f",
    "head_fb",
)
SPLIT_QUANTITIES: tuple[str, ...] = ("block_fbx", "block_fbw", "block1_fbx", "block1_fbw")
BASE_QUANTITIES: tuple[str, ...] = ("block_f", "block_fb", "embed_f", "embed_fb", "head_f",
                                    "head_fb")
LINK_LOOP = 8  # psums per timed call when measuring a link
TICK_LOOP = 16  # ticks per timed call when measuring a pipeline tick
TICK_MAX_FLOATS = 1 << 22  # largest tick buffer timed (16 MB); larger ones are extrapolated

# ------------------------------------------------------------------------------ fits


@dataclass(frozen=True)
class Fit:
    """``t(b, k) = c0 + c1 b + c2 b / k``, fitted to measured points.

    Attributes:
      c0: per-call seconds.
      c1: seconds per sequence of work TP does not divide.
      c2: seconds per sequence of work TP divides.
      max_rel_residual: largest |fit - measured| / measured over the fitted points.
    """

    c0: float
    c1: float
    c2: float
    max_rel_residual: float = 0.0

    def at(self, micro_batch: float, tp: int) -> float:
        """Predicted seconds at micro-batch ``micro_batch`` and TP degree ``tp`` (>= 0)."""
        return max(0.0, self.c0 + self.c1 * micro_batch + self.c2 * micro_batch / tp)


@dataclass(frozen=True)
class Tick:
    """One pipeline tick of the executor's loop outside its actions, on one ring size:
    ``fixed_s + per_byte_s x`` the bytes each of its permutes carries (one microbatch's
    activation; the executor sends and files it every tick, zeros where nothing moves).

    Attributes:
      fixed_s: seconds of a tick whose permutes carry almost nothing (the switches, the
        rendezvous).
      per_byte_s: seconds per byte of the tick's activation-sized buffers.
    """

    fixed_s: float
    per_byte_s: float

    def at(self, nbytes: float) -> float:
        """Seconds of one tick whose permutes carry ``nbytes`` each."""
        return max(0.0, self.fixed_s + self.per_byte_s * nbytes)


def fit_points(points: Sequence[tuple[int, int, float]]) -> Fit:
    """Relative least-squares :class:`Fit` through ``(micro_batch, tp, seconds)`` points.

    Repeated shapes are first reduced to their median. Each point is weighted by
    ``1 / seconds``, so the relative error is what is minimised: small shapes (fast
    pieces) are fitted as well as large ones. With fewer distinct shapes than
    coefficients (one micro-batch size, or only ``tp = 1``) the minimum-norm solution is
    used; it reproduces the measured points, so predictions stay right where the plans
    need them.

    Args:
      points: measured ``(b, k, t)``.

    Returns:
      The :class:`Fit`.
    """
    by_shape: dict[tuple[int, int], list[float]] = {}
    for b, k, t in points:
        by_shape.setdefault((b, k), []).append(t)
    shapes = sorted(by_shape)
    ts = np.array([statistics.median(by_shape[sh]) for sh in shapes])
    w = 1.0 / np.maximum(ts, 1e-12)
    a = np.array([[1.0, b, b / k] for b, k in shapes]) * w[:, None]
    coef, *_ = np.linalg.lstsq(a, ts * w, rcond=None)
    fit = Fit(*(float(c) for c in coef))
    resid = max((abs(fit.at(b, k) - t) / t for (b, k), t in zip(shapes, ts) if t > 0),
                default=0.0)
    return dataclasses.replace(fit, max_rel_residual=float(resid))


# ----------------------------------------------------------------------- calibration


@dataclass(frozen=True)
class Sample:
    """One measured point: ``quantity`` at micro-batch ``micro_batch`` and TP ``tp``."""

    quantity: str
    micro_batch: int
    tp: int
    seconds: float


@dataclass(frozen=True)
class Calibration:
    """Measured compute costs of one model on this machine.

    Attributes:
      model: the model config it was measured for (``ModelConfig`` fields).
      precision: ``fp32`` or ``bf16`` compute.
      optimizer: ``adamw`` or ``lamb``.
      devices: devices that ran the measurements at once.
      parallel_capacity: devices' worth of compute the machine runs at once.
      fits: quantity -> :class:`Fit` of the whole pieces (see :data:`QUANTITIES`).
      optimizer_fit: seconds of one optimizer update, with the parameter elements in
        place of the micro-batch and ``tp = 1`` (so affine in the elements).
      split_ratios: split piece (``*_fbx``, ``*_fbw``) -> its time as a fraction of the
        matching ``*_fb``, measured at one shape and applied at every shape.
      dispatch_s: launch overhead of one call on all devices (subtracted from every
        piece; a train step pays it once).
      links: group size -> :class:`Link` measured for collectives over groups of that
        many devices (all groups at once).
      ticks: pipeline degree -> :class:`Tick`, one tick of the executor's loop outside its
        actions (the arrivals' filing, the switches to the tick's action, the two ring
        permutes), measured on rings of that many devices (all rings at once). On a CPU host
        a small model's pipeline step is mostly this.
      samples: every measured point.
    """

    model: dict[str, Any]
    precision: str
    optimizer: str
    devices: int
    parallel_capacity: float
    fits: dict[str, Fit]
    optimizer_fit: Fit
    split_ratios: dict[str, float] = field(default_factory=dict)
    dispatch_s: float = 0.0
    links: dict[int, Link] = field(default_factory=dict)
    ticks: dict[int, Tick] = field(default_factory=dict)
    samples: tuple[Sample, ...] = field(default=(), repr=False)

    def seconds(self, quantity: str, micro_batch: int, tp: int) -> float:
        """Seconds of ``quantity`` at ``(micro_batch, tp)``: measured there, else fitted.

        A shape that was measured uses its (median) measurement: on a CPU the cost is
        not quite affine in the micro-batch (cache effects make large ones superlinear),
        so the fit is only for shapes nobody measured.
        """
        exact = self.measured(quantity, micro_batch, tp)
        if exact is not None:
            return exact
        if quantity in self.split_ratios:
            whole = quantity.rsplit("_", 1)[0] + "_fb"
            return self.split_ratios[quantity] * self.seconds(whole, micro_batch, tp)
        if quantity not in self.fits:
            raise KeyError(
                f"calibration: {quantity!r} was not measured (measured: {', '.join(self.fits)})"
            )
        return self.fits[quantity].at(micro_batch, tp)

    def measured(self, quantity: str, micro_batch: int, tp: int) -> float | None:
        """Median measured seconds of ``quantity`` at exactly this shape, if any."""
        times = [s.seconds for s in self.samples
                 if (s.quantity, s.micro_batch, s.tp) == (quantity, micro_batch, tp)]
        return statistics.median(times) if times else None

    def tick_s(self, pp: int, act_bytes: float) -> float:
        """Seconds of one pipeline tick outside its actions on ``pp`` stages whose permutes
        carry ``act_bytes`` (0 if not measured)."""
        tick = self.ticks.get(pp)
        return tick.at(act_bytes) if tick is not None else 0.0

    def optimizer_s(self, elements: float) -> float:
        """Seconds of one optimizer update over ``elements`` parameters on one device."""
        return self.optimizer_fit.at(elements, 1)

    def profile(self, hw: HardwareProfile, plan) -> HardwareProfile:
        """``hw`` with each mesh axis on the link measured for its group size, if any."""
        sizes = plan.axis_sizes
        for axis, n in sizes.items():
            if n in self.links:
                hw = hw.with_link(axis, self.links[n])
        return hw

    def matches(self, cfg: Config) -> bool:
        """Whether this calibration measured ``cfg``'s model, precision and optimizer."""
        return (
            self.model == dataclasses.asdict(cfg.model)
            and self.precision == cfg.train.precision
            and self.optimizer == cfg.train.optimizer
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary."""
        return {
            "model": dict(self.model),
            "precision": self.precision,
            "optimizer": self.optimizer,
            "devices": self.devices,
            "parallel_capacity": self.parallel_capacity,
            "fits": {k: dataclasses.asdict(v) for k, v in self.fits.items()},
            "optimizer_fit": dataclasses.asdict(self.optimizer_fit),
            "split_ratios": dict(self.split_ratios),
            "dispatch_s": self.dispatch_s,
            "links": {str(n): dataclasses.asdict(link) for n, link in self.links.items()},
            "ticks": {str(n): dataclasses.asdict(t) for n, t in self.ticks.items()},
            "samples": [dataclasses.asdict(s) for s in self.samples],
        }


def _median_time(fn: Callable[..., Any], args: Sequence[Any], repeats: int,
                 warmup: bool = True) -> float:
    """Median of ``repeats`` calls, after one untimed call (compilation, first touch).

    The median, not the fastest: on cores shared with other processes a short call is
    more likely than a whole train step to slip into a quiet moment, so the fastest of
    many short calls would be biased low against step times; medians of both, taken
    under the same load, compare fairly.
    """
    import jax

    if warmup:
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _random_like(shapes: Any, seed: int) -> Any:
    """Small random arrays of the given shapes (numpy: no compilation per leaf shape)."""
    import jax

    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda s: (0.02 * rng.standard_normal(s.shape)).astype(s.dtype), shapes
    )


def _on_all(fn: Callable, devices: Sequence[Any], args: tuple, batch_args: tuple[bool, ...]):
    """``fn`` run by every device at once on its own copy, plus the stacked arguments.

    Arguments flagged in ``batch_args`` are split over the devices along their leading
    (micro-batch) axis; the others are replicated and marked device-varying so autodiff
    adds no reduction over the devices: no collective runs, only the per-device work.
    """
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_overlap.parallel.compat import shard_map, to_varying

    mesh = Mesh(np.array(devices, dtype=object), ("calib",))
    n = len(devices)

    def body(*local):
        local = tuple(a if is_batch else to_varying(a, ("calib",))
                      for a, is_batch in zip(local, batch_args))
        out = fn(*local)
        # A leading axis of 1 per device, so every output leaf (scalars too) can be
        # concatenated over the devices.
        return jax.tree.map(lambda x: x[None], out)

    in_specs = tuple(P("calib") if b else P() for b in batch_args)
    mapped = jax.jit(shard_map(body, mesh, in_specs=in_specs, out_specs=P("calib")))
    placed = []
    for a, is_batch in zip(args, batch_args):
        if is_batch:
            big = jax.tree.map(lambda x: np.concatenate([np.asarray(x)] * n), a)
            placed.append(jax.device_put(big, NamedSharding(mesh, P("calib"))))
        else:
            placed.append(jax.device_put(a, NamedSharding(mesh, P())))
    return mapped, tuple(placed)


def _piece_functions(model: Any, par: Any) -> dict[str, tuple[Callable, tuple[bool, ...]]]:
    """Per quantity, ``(fn, which args are per-micro-batch)`` of one TP rank."""
    import jax
    import jax.numpy as jnp

    def vjp_all(f, w, x):
        y, pull = jax.vjp(f, w, x)
        return pull(jnp.ones_like(y))

    def vjp_x(f):
        """`(w, x) -> d/dx` of `f`: the input-gradient half of its backward."""
        return lambda w, x: vjp_all(lambda _, x_: f(w, x_), None, x)[1:]

    def vjp_w(f):
        """`(w, x) -> d/dw` of `f`: the weight-gradient half of its backward."""
        return lambda w, x: vjp_all(lambda w_, _: f(w_, x), w, None)[:1]

    def block(w_stack, x):
        # Every layer under one lax.scan, as the train step and the pipeline executor
        # run them: the scan stacks each layer's residuals for the backward, which costs
        # copies a lone block does not pay (~40% more work at large micro-batches here).
        def layer(x, w):
            return model.block(w, x, par), None

        return jax.lax.scan(layer, x, w_stack)[0]

    def embed(w, ids):
        return model.embed(w, ids, par)

    def head(w, x, targets):
        return model.head_loss(w["embed"], w["head"], x, targets, par)

    def head_fb(w, x, targets):
        return vjp_all(lambda w_, x_: head(w_, x_, targets), w, x)

    def lone(w, x):
        return model.block(w, x, par)

    return {
        "block_f": (block, (False, True)),
        "block_fb": (lambda w, x: vjp_all(block, w, x), (False, True)),
        "block_fbx": (vjp_x(block), (False, True)),
        "block_fbw": (vjp_w(block), (False, True)),
        "block1_f": (lone, (False, True)),
        "block1_fb": (lambda w, x: vjp_all(lone, w, x), (False, True)),
        "block1_fbx": (vjp_x(lone), (False, True)),
        "block1_fbw": (vjp_w(lone), (False, True)),
        "embed_f": (embed, (False, True)),
        "embed_fb": (vjp_w(embed), (False, True)),
        "head_f": (head, (False, True, True)),
        "head_fb": (head_fb, (False, True, True)),
    }


def _piece_args(quantity: str, params: Any, micro_batch: int, cfg: Config, dtype: Any) -> tuple:
    import jax
    import jax.numpy as jnp

    m = cfg.model
    ids = (jnp.arange(micro_batch * m.seq_len, dtype=jnp.int32) % m.vocab).reshape(
        micro_batch, m.seq_len
    )
    x = 0.1 * jax.random.normal(jax.random.key(1), (micro_batch, m.seq_len, m.d_model), dtype)
    if quantity.startswith("block1"):
        return (jax.tree.map(lambda w: w[0], params["blocks"]), x)
    if quantity.startswith("block"):
        return (params["blocks"], x)
    if quantity.startswith("embed"):
        return (params["embed"], ids)
    return ({"embed": params["embed"], "head": params["head"]}, x, ids)


def ring_link(name: str, n: int, tiny_s: float, big_s: float, big_bytes: float) -> Link:
    """The :class:`Link` whose ring all-reduce formula reproduces two measured psums.

    Args:
      name: link name.
      n: devices in the group.
      tiny_s: seconds of a psum of a few bytes (all latency).
      big_s: seconds of a psum of ``big_bytes`` per device.
      big_bytes: bytes per device of the large psum.

    Returns:
      ``latency = tiny / 2(n-1)``, ``bandwidth = 2(n-1)/n big_bytes / (big - tiny)``.
    """
    hops = ring_steps("all-reduce", n)[0]
    return Link(
        name=name,
        bandwidth_bytes_per_s=ring_factor("all-reduce", n) * big_bytes / max(big_s - tiny_s, 1e-9),
        latency_s=tiny_s / hops,
        efficiency=1.0,
    )


@dataclass
class Calibrator:
    """Times the pieces of one config's model on a set of devices, all at once.

    Compiled functions are kept, so the same shapes can be re-timed (e.g. interleaved
    with step measurements so both see the same load from other processes).

    Attributes:
      cfg: the config whose model, precision and optimizer are measured.
      devices: the devices that run every measurement together.
      repeats: timed calls per measurement (the median counts).
      progress: a progress bar (`tqdm`-like: ``update(n)``, ``total``, ``refresh()``)
        advanced once per timed measurement; :func:`calibrate` and :func:`extend` add what
        they will measure to its total. None: silent.
    """

    cfg: Config
    devices: list
    repeats: int = 5
    progress: Any = field(default=None, repr=False)
    _compiled: dict = field(default_factory=dict, repr=False)
    _warm: set = field(default_factory=set, repr=False)
    _measured: dict = field(default_factory=dict, repr=False)
    _params: dict = field(default_factory=dict, repr=False)
    _models: dict = field(default_factory=dict, repr=False)

    def _model(self, tp: int):
        """The model built for a ``tp``-way layout: a Llama-family block stores its kv heads
        replicated when there are fewer than tp, and says so in its parameter axes."""
        from jax_overlap.model_api import build_model

        if tp not in self._models:
            self._models[tp] = build_model(self.cfg, tp=tp)
        return self._models[tp]

    def _dtype(self):
        from jax_overlap.training.step import compute_dtype

        return compute_dtype(self.cfg.train.precision)

    def _time(self, key: Any) -> float:
        """Median time of a compiled entry; its first use also runs one untimed call."""
        fn, args = self._compiled[key]
        seconds = _median_time(fn, args, self.repeats, warmup=key not in self._warm)
        self._warm.add(key)
        if self.progress is not None:
            self.progress.update(1)
        return seconds

    def expect(self, measurements: int) -> None:
        """Add `measurements` timed calls to come to the progress bar's total."""
        if self.progress is not None:
            self.progress.total = (self.progress.total or 0) + measurements
            self.progress.refresh()

    def _params_at(self, tp: int) -> Any:
        if tp not in self._params:
            self._params[tp] = _random_like(local_param_shapes(self._model(tp), tp), seed=0)
        return self._params[tp]

    def time_piece(self, quantity: str, micro_batch: int, tp: int) -> Sample:
        """Time ``quantity`` at ``(micro_batch, tp)`` (compiled on first use)."""
        from jax_overlap.parallel.collectives import Parallel

        key = (quantity, micro_batch, tp)
        if key not in self._compiled:
            par = Parallel(tp_axis=None, tp=tp, compute_dtype=self._dtype())
            fn, batch_args = _piece_functions(self._model(tp), par)[quantity]
            args = _piece_args(quantity, self._params_at(tp), micro_batch, self.cfg,
                               self._dtype())
            self._compiled[key] = _on_all(fn, self.devices, args, batch_args)
        # In a train step every piece runs inside one program: its own call's launch
        # overhead is not part of its cost. Block pieces run every layer: per layer.
        # A piece that times at or under a trivial launch (the embedding at tiny shapes, on a
        # loaded host) still does work: it keeps a twentieth of its call, never zero.
        per = self.cfg.model.layers if quantity.startswith("block_") else 1
        call = self._time(key)
        seconds = max(call - self.dispatch_s(), call / 20) / per
        return Sample(quantity, micro_batch, tp, seconds)

    def dispatch_s(self) -> float:
        """Launch overhead of one call on all devices: a trivial program's median time."""
        import jax.numpy as jnp

        if "dispatch" not in self._compiled:
            self._compiled["dispatch"] = _on_all(lambda x: x + 1, self.devices,
                                                 (jnp.zeros((1,), jnp.float32),), (True,))
        if "dispatch" not in self._measured:
            self._measured["dispatch"] = _median_time(*self._compiled["dispatch"],
                                                      repeats=max(5, self.repeats))
        return self._measured["dispatch"]

    def time_shapes(self, shapes: Sequence[tuple[int, int]],
                    quantities: Sequence[str] = BASE_QUANTITIES) -> list[Sample]:
        """Time every quantity at every ``(micro_batch, tp)`` shape."""
        return [self.time_piece(q, b, k) for b, k in shapes for q in quantities]

    def time_optimizer(self, tp: int) -> Sample:
        """One optimizer update of a TP rank's parameters (``micro_batch`` = elements)."""
        import jax

        from jax_overlap.training.step import make_optimizer

        key = ("optimizer", tp)
        params = self._params_at(tp)
        if key not in self._compiled:
            optimizer = make_optimizer(self.cfg.train)

            def update(p, s, g):
                updates, s = optimizer.update(g, s, p)
                return jax.tree.map(lambda a, u: a + u, p, updates), s

            args = (params, optimizer.init(params), params)
            self._compiled[key] = _on_all(update, self.devices, args, (False, False, False))
        elements = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
        return Sample("optimizer", elements, 1, max(self._time(key) - self.dispatch_s(), 0.0))

    def time_link(self, group: int, big_bytes: int = 1 << 20) -> Link:
        """Psum cost over groups of ``group`` devices (all groups at once) as a ring link.

        Each timed call runs :data:`LINK_LOOP` psums back to back in one program, less one
        call's launch overhead, so the per-psum time is what a psum inside a step costs.

        Args:
          group: devices per group (divides the device count).
          big_bytes: float32 bytes per device of the large psum.

        Returns:
          A :class:`Link` named ``measured_<group>`` (see :func:`ring_link`).
        """
        import jax
        import jax.numpy as jnp
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        from jax_overlap.parallel.compat import shard_map, to_varying

        n = len(self.devices)
        mesh = Mesh(np.array(self.devices, dtype=object).reshape(n // group, group),
                    ("rest", "g"))

        def psums(x):
            # Rescaled so repeated sums stay finite; the carry is varying again after each
            # psum (the loop's type must not change).
            body = lambda _, y: to_varying(jax.lax.psum(y, "g") * (1.0 / group), ("g",))
            return jax.lax.fori_loop(0, LINK_LOOP, body, x)

        times = []
        for nbytes in (4 * group, big_bytes):
            key = ("psum", group, nbytes)
            if key not in self._compiled:
                fn = jax.jit(shard_map(psums, mesh, in_specs=P(("rest", "g")),
                                       out_specs=P(("rest", "g"))))
                x = jax.device_put(jnp.ones((n * (nbytes // 4),), jnp.float32),
                                   NamedSharding(mesh, P(("rest", "g"))))
                self._compiled[key] = (fn, (x,))
            times.append(max(self._time(key) - self.dispatch_s(), 1e-9) / LINK_LOOP)
        return ring_link(f"measured_{group}", group, times[0], times[1], big_bytes)

    def time_tick(self, stages: int, act_bytes: float) -> Tick:
        """One pipeline tick outside its actions, on rings of ``stages`` devices.

        What the executor's loop does every tick whatever the action: file the last tick's
        two arrivals into the slot pool, switch on the tick's table entry to the action's
        reads and again to its slot write (or to nothing, when idle), then permute the
        output around the ring each way. :data:`TICK_LOOP` ticks run in one program, less
        one call's launch overhead. On a CPU host the permutes are rendezvous of device threads on shared
        cores, so this is what a small model's pipeline step mostly costs. Timed with
        buffers of 64 floats and of ``act_bytes``, the two points of the :class:`Tick`.

        Args:
          stages: devices per ring (divides the device count).
          act_bytes: bytes of the buffers the tick files and sends (one microbatch's
            activation).

        Returns:
          The :class:`Tick`.
        """
        small = 64
        big = min(max(small, int(act_bytes) // 4), TICK_MAX_FLOATS)
        seconds = [self._tick_at(stages, width) for width in sorted({small, big})]
        if len(seconds) == 1:
            return Tick(seconds[0], 0.0)
        per_byte = max(seconds[1] - seconds[0], 0.0) / (4 * (big - small))
        return Tick(seconds[0], per_byte)

    def _tick_at(self, stages: int, width: int) -> float:
        """Seconds per tick of the tick loop on buffers of ``width`` floats."""
        import jax
        import jax.numpy as jnp
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        from jax_overlap.parallel.compat import shard_map

        n = len(self.devices)
        key = ("tick", stages, width)
        if key not in self._compiled:
            mesh = Mesh(np.array(self.devices, dtype=object).reshape(n // stages, stages),
                        ("rest", "pp"))
            up_pairs = [(i, (i + 1) % stages) for i in range(stages)]
            down_pairs = [(i, (i - 1) % stages) for i in range(stages)]
            slots = 4

            def loop(x, pool, table):
                me = jax.lax.axis_index("pp")

                def idle(x, slot, pool):
                    return x

                def read(x, slot, pool):
                    return x + jax.lax.dynamic_index_in_dim(pool, slot, 0, False)

                def keep(x, slot, pool):
                    return pool

                def file(x, slot, pool):
                    return jax.lax.dynamic_update_index_in_dim(pool, x, slot, 0)

                def tick(t, carry):
                    x, down, up, pool = carry
                    kind, slot = table[t, me] % 3, table[t, me] % slots
                    # File the last tick's arrivals, run the action (reads), file its
                    # output (writes), send it both ways.
                    pool = jax.lax.dynamic_update_index_in_dim(pool, down, (slot + 1) % slots, 0)
                    pool = jax.lax.dynamic_update_index_in_dim(pool, up, (slot + 2) % slots, 0)
                    x = jax.lax.switch(kind, (idle, read, read), x, slot, pool)
                    pool = jax.lax.switch(kind, (keep, file, keep), x, slot, pool)
                    down = jax.lax.ppermute(x, "pp", up_pairs) * 0.5
                    up = jax.lax.ppermute(x, "pp", down_pairs) * 0.5
                    return down + up, down, up, pool

                x, _, _, pool = jax.lax.fori_loop(0, TICK_LOOP, tick, (x, x, x, pool))
                return x, pool

            spec = P(("rest", "pp"))
            fn = jax.jit(shard_map(loop, mesh, in_specs=(spec, spec, P()),
                                   out_specs=(spec, spec)))
            table = np.random.default_rng(0).integers(0, 12, (TICK_LOOP, stages))
            args = (jax.device_put(jnp.ones((n * width,), jnp.float32),
                                   NamedSharding(mesh, spec)),
                    jax.device_put(jnp.ones((n * slots, width), jnp.float32),
                                   NamedSharding(mesh, spec)),
                    jnp.asarray(table, jnp.int32))
            self._compiled[key] = (fn, args)
        return max(self._time(key) - self.dispatch_s(), 1e-9) / TICK_LOOP

    def parallel_capacity(self, micro_batch: int, tp: int) -> float:
        """Devices' worth of compute the machine runs at once.

        One block's forward timed on the first device alone and on all devices at once
        (each its own copy): capacity = ``N x alone / together``, clipped to ``[1, N]``.
        About the core count on a CPU host whose devices run single-threaded ops; 1
        when one device's ops already use every core; ``N`` on real accelerators.
        """
        import jax

        from jax_overlap.parallel.collectives import Parallel

        n = len(self.devices)
        if n <= 1:
            return 1.0
        key = ("alone", micro_batch, tp)
        if key not in self._compiled:
            par = Parallel(tp_axis=None, tp=tp, compute_dtype=self._dtype())
            fn, _ = _piece_functions(self._model(tp), par)["block_f"]
            args = _piece_args("block_f", self._params_at(tp), micro_batch, self.cfg,
                               self._dtype())
            self._compiled[key] = (jax.jit(fn), jax.device_put(args, self.devices[0]))
        alone = max(self._time(key) - self.dispatch_s(), 0.0) / self.cfg.model.layers
        together = self.time_piece("block_f", micro_batch, tp).seconds
        if together <= 0:
            return float(n)
        return float(min(n, max(1.0, n * alone / together)))

    def calibration(self, samples: Sequence[Sample], capacity: float,
                    links: dict[int, Link],
                    ticks: dict[int, Tick] | None = None) -> Calibration:
        """Fit measured samples into a :class:`Calibration`.

        Args:
          samples: piece samples (any shapes; split pieces optional) and optimizer
            samples.
          capacity: from :meth:`parallel_capacity`.
          links: group size -> measured :class:`Link`.
          ticks: pipeline degree -> :class:`Tick` from :meth:`time_tick`.

        Returns:
          The :class:`Calibration`.
        """
        measured = {s.quantity for s in samples}
        fits = {
            q: fit_points([(s.micro_batch, s.tp, s.seconds) for s in samples if s.quantity == q])
            for q in QUANTITIES
            if q in measured and q not in SPLIT_QUANTITIES
        }
        # Split pieces: measured at one shape, as fractions of that variant's fb there.
        ratios = {}
        for q in SPLIT_QUANTITIES:
            split = [s for s in samples if s.quantity == q]
            whole = q.rsplit("_", 1)[0] + "_fb"
            ref = [s for s in samples if s.quantity == whole and split
                   and (s.micro_batch, s.tp) == (split[-1].micro_batch, split[-1].tp)]
            if ref:
                ratios[q] = statistics.median(s.seconds for s in split) / max(
                    statistics.median(s.seconds for s in ref), 1e-12)
        opt = [(s.micro_batch, 1, s.seconds) for s in samples if s.quantity == "optimizer"]
        if len({e for e, _, _ in opt}) > 1:
            opt_fit = fit_points(opt)
        else:  # one size: proportional to the elements
            opt_fit = Fit(0.0, opt[0][2] / max(opt[0][0], 1), 0.0) if opt else Fit(0, 0, 0)
        return Calibration(
            model=dataclasses.asdict(self.cfg.model),
            precision=self.cfg.train.precision,
            optimizer=self.cfg.train.optimizer,
            devices=len(self.devices),
            parallel_capacity=capacity,
            fits=fits,
            optimizer_fit=opt_fit,
            split_ratios=ratios,
            dispatch_s=self.dispatch_s(),
            links=dict(links),
            ticks=dict(ticks or {}),
            samples=tuple(samples),
        )


def corner_shapes(micro_batches: Sequence[int], tps: Sequence[int]) -> list[tuple[int, int]]:
    """The shapes to measure so the plans' ``(b, k)`` range is interpolated.

    Three points fix the three coefficients of a :class:`Fit` -- the smallest and largest
    micro-batch without TP, and the largest micro-batch at the largest TP degree -- and
    the middle micro-batch without TP shows how far from affine in ``b`` the cost is.

    Args:
      micro_batches: micro-batch sizes the plans use.
      tps: TP degrees the plans use.

    Returns:
      Distinct ``(micro_batch, tp)`` shapes.
    """
    sizes = sorted(set(micro_batches))
    b_lo, b_mid, b_hi = sizes[0], sizes[len(sizes) // 2], sizes[-1]
    k_lo, k_hi = min(tps), max(tps)
    return sorted({(b_lo, k_lo), (b_mid, k_lo), (b_hi, k_lo), (b_hi, k_hi)})


def extend(calibrator: Calibrator, calibration: Calibration,
           points: Sequence[tuple[str, int, int]]) -> Calibration:
    """``calibration`` plus measurements of ``(quantity, micro_batch, tp)`` points.

    Measured shapes are used as measured (:meth:`Calibration.seconds`), so this is how
    a caller makes the plans it cares most about exact.

    Args:
      calibrator: the :class:`Calibrator` that made ``calibration`` (its compiled
        functions and devices are reused).
      calibration: the calibration to extend.
      points: what to measure; points already measured are skipped.

    Returns:
      A new :class:`Calibration` fitted over all samples.
    """
    have = {(s.quantity, s.micro_batch, s.tp) for s in calibration.samples}
    todo = [(q, b, k) for q, b, k in sorted(set(points)) if (q, b, k) not in have]
    calibrator.expect(len(todo))
    new = [calibrator.time_piece(q, b, k) for q, b, k in todo]
    return calibrator.calibration(list(calibration.samples) + new, calibration.parallel_capacity,
                                  calibration.links, calibration.ticks)


def calibrate(
    cfg: Config,
    shapes: Sequence[tuple[int, int]],
    *,
    devices: Sequence[Any] | None = None,
    quantities: Sequence[str] = BASE_QUANTITIES,
    groups: Sequence[int] = (),
    pipelines: Mapping[int, float] | None = None,
    repeats: int = 5,
    calibrator: Calibrator | None = None,
) -> Calibration:
    """Measure the model of ``cfg`` on ``devices`` and fit its per-piece costs.

    Compiling each timed function dominates the cost of calibrating (a second or more
    per function on a CPU), so few shapes are measured: :func:`corner_shapes` of the
    plans. Split-backward pieces are measured at one shape (the largest micro-batch at
    the smallest TP degree) as fractions of the matching ``*_fb``.

    Args:
      cfg: the config whose model, precision and optimizer are measured (its mesh is
        not used).
      shapes: ``(micro_batch, tp)`` points: sequences per microbatch and TP degree (each
        must divide the model's heads, ``d_ff`` and vocabulary).
      devices: devices that run the measurement at once (default: all); use the
        devices the plans will run on.
      quantities: pieces to measure (:data:`QUANTITIES`; :func:`quantities_for` says
        what a plan needs).
      groups: group sizes whose psum cost to measure as links (sizes that divide the
        device count; e.g. the plans' dp, tp and pp degrees).
      pipelines: pipeline degree -> activation bytes of its largest microbatch: the ticks to
        measure (:meth:`Calibrator.time_tick`; degrees that divide the device count).
      repeats: timed calls per point (the median counts).
      calibrator: a :class:`Calibrator` to measure with (its compiled functions are
        kept for :func:`extend`); None makes one from ``devices`` and ``repeats``.

    Returns:
      The :class:`Calibration`.
    """
    import jax

    if not shapes:
        raise ValueError("calibrate: need at least one (micro_batch, tp) shape")
    unknown = sorted(set(quantities) - set(QUANTITIES))
    if unknown:
        raise ValueError(f"calibrate: unknown quantities {unknown}; known: {QUANTITIES}")
    if calibrator is not None:
        devices = calibrator.devices
    devices = list(jax.devices() if devices is None else devices)
    shapes = sorted({(int(b), int(k)) for b, k in shapes})
    cal = calibrator if calibrator is not None else Calibrator(cfg, devices, repeats)
    base = [q for q in QUANTITIES if q in quantities and q not in SPLIT_QUANTITIES]
    split = [q for q in QUANTITIES if q in quantities and q in SPLIT_QUANTITIES]
    for q in split:  # a split piece is a fraction of its variant's whole backward
        whole = q.rsplit("_", 1)[0] + "_fb"
        if whole not in base:
            base.append(whole)
    tps = sorted({k for _, k in shapes})
    link_groups = [g for g in sorted(set(groups))
                   if 1 < g <= len(devices) and len(devices) % g == 0]
    tick_groups = {g: b for g, b in sorted((pipelines or {}).items())
                   if 1 < g <= len(devices) and len(devices) % g == 0}
    # Pieces, split pieces, optimizer updates, two psums per link, ticks, two capacity timings.
    cal.expect(len(shapes) * len(base) + len(split) + len(tps) + 2 * len(link_groups)
               + 2 * len(tick_groups) + 2)
    samples = cal.time_shapes(shapes, base)
    b_ref = max(b for b, _ in shapes)
    k_ref = min(k for b, k in shapes if b == b_ref)
    samples += cal.time_shapes([(b_ref, k_ref)], split)
    samples += [cal.time_optimizer(k) for k in tps]
    links = {g: cal.time_link(g) for g in link_groups}
    ticks = {g: cal.time_tick(g, b) for g, b in tick_groups.items()}
    return cal.calibration(samples, cal.parallel_capacity(b_ref, k_ref), links, ticks)
