"""One way to assemble a run: (config, devices | target) -> `Run`.

`assemble` builds, in this order and nowhere else: the model (unless one is brought), the
`ParallelPlan` for the devices' target (or a named one), the mesh over the devices and the
optimizer. The `Run` then hands out what every caller needs from them -- the state's
shardings, its initial or abstract value, the loss-and-gradients function, the train step
and the guarded step -- so `train`, `evaluate`, `generate`, `profile`, `analyze`, the benches
and the tests all run the step `train` runs.

    run = assemble(cfg, jax.devices()[:8])
    state, step = run.init_state(), run.train_step()
    state, metrics = step(state, run.put_batch(np_batch))

A run assembled for a `target` with no devices has no mesh (a deviceless GPU compile picks
its devices later): `run.on(devices)` gives the same plan on a mesh.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import jax
from jax.sharding import NamedSharding

from jax_overlap import model_api
from jax_overlap import plan as plan_lib
from jax_overlap.config import Config, check_device_count
from jax_overlap.parallel.mesh import data_spec, make_mesh
from jax_overlap.pipeline import layout
from jax_overlap.training import loop_state
from jax_overlap.training import loss_scale as loss_scale_lib
from jax_overlap.training import step as steplib
from jax_overlap.training.guarded_step import make_guarded_step


@dataclass(frozen=True)
class Run:
    """A config assembled into a runnable step.

    Attributes:
      cfg: the config.
      model: the `StagedModel`.
      plan: its `ParallelPlan` (every `auto` resolved for the target).
      mesh: the (dcn, dp, pp, tp) mesh; None for a run assembled for a target alone.
      optimizer: the run's optimizer (`step.make_optimizer(cfg.train)`).
    """

    cfg: Config
    model: Any
    plan: Any
    mesh: Any
    optimizer: Any

    def on(self, devices: list) -> "Run":
        """The same run (model, plan) on a mesh over `devices` (the plan's axis sizes)."""
        p = self.plan
        return dataclasses.replace(self, mesh=make_mesh(p.dp, p.pp, p.tp, list(devices),
                                                        dcn=p.dcn))

    @property
    def lr(self):
        """The learning-rate schedule (the `lr` metric)."""
        return steplib.lr_schedule(self.cfg.train)

    @property
    def loss_scaled(self) -> bool:
        return self.cfg.train.precision == "fp16"

    # ---- state ----------------------------------------------------------------------------

    def param_shardings(self) -> Any:
        """NamedSharding per parameter leaf (the plan's layout)."""
        return steplib.param_shardings(self.model, self.mesh, self.plan.layout)

    def place_params(self, logical: Any) -> Any:
        """Parameters in the model's logical layer order (`model.init`'s, a checkpoint's, a
        Hugging Face import's) put in the plan's staged order on the mesh."""
        return jax.device_put(layout.to_staged(logical, self.plan.layer_perm),
                              self.param_shardings())

    def state_shardings(self, optimizer=None) -> Any:
        """NamedShardings of the train state (parameters in the plan's staged layout)."""
        staged = jax.eval_shape(self._staged_init, jax.random.key(self.cfg.train.seed))
        return steplib.state_shardings(self.model, self.mesh, optimizer or self.optimizer,
                                       staged, self.plan.layout, self.plan,
                                       loss_scaled=self.loss_scaled)

    def init_state(self, optimizer=None) -> Any:
        """The initial train state, built directly in its sharded layout."""
        return steplib.init_state(self.model, self.plan, self.mesh, optimizer or self.optimizer,
                                  self.cfg.train.seed, loss_scale_lib.initial(self.cfg.train))

    def abstract_state(self) -> Any:
        """ShapeDtypeStructs (with shardings) of the train state: nothing allocated. The
        parameters are laid out as `init_state` lays them (padded chunks when uneven)."""
        shapes = jax.eval_shape(self.init_state)
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, self.state_shardings())

    def _staged_init(self, key):
        return layout.to_staged(self.model.init(key), self.plan.layer_perm)

    # ---- the loop's state (train state + guard + rollbacks) ---------------------------

    def loop_shardings(self, optimizer=None) -> Any:
        return loop_state.loop_shardings(self.model, self.cfg, self.plan, self.mesh,
                                         optimizer or self.optimizer)

    def abstract_loop_state(self, optimizer=None) -> Any:
        """The target a checkpoint restores to (see `loop_state.abstract_loop_state`)."""
        return loop_state.abstract_loop_state(self.model, self.cfg, self.plan, self.mesh,
                                              optimizer or self.optimizer)

    def initializer(self, optimizer=None) -> Callable[[], Any]:
        """`() -> LoopState`, compiled once (see `loop_state.make_initializer`)."""
        return loop_state.make_initializer(self.model, self.cfg, self.plan, self.mesh,
                                           optimizer or self.optimizer)

    # ---- steps ----------------------------------------------------------------------------

    def loss_and_grads(self) -> Callable:
        """`(params, batch) -> (loss, grads)`: the executor at pp > 1, else `grads`."""
        return steplib.make_loss_and_grads(self.model, self.plan, self.mesh)

    def train_step(self, fault_hook: Callable | None = None, jit: bool = True,
                   optimizer=None) -> Callable:
        """`step(state, batch) -> (state, metrics)` (`step.make_train_step`); jitted with the
        state donated unless `jit` is False."""
        return steplib.make_train_step(
            self.model, self.plan, self.mesh, optimizer or self.optimizer, self.lr,
            fault_hook=fault_hook, jit=jit,
            loss_scale_growth_interval=self.cfg.train.loss_scale_growth_interval)

    def guarded_step(self, optimizer=None) -> Callable:
        """`step(loop, batch) -> (loop, metrics)`: the train step with the step guard and
        fault injection, as `train` runs it (`guarded_step.make_guarded_step`)."""
        return make_guarded_step(self.model, self.cfg, self.plan, self.mesh,
                                 optimizer or self.optimizer)

    # ---- batches --------------------------------------------------------------------------

    def put_batch(self, batch_np: dict) -> dict:
        """A global numpy batch split over the data axes of the mesh."""
        return steplib.put_batch(batch_np, self.mesh)

    def abstract_batch(self) -> dict:
        """ShapeDtypeStructs (with shardings) of one global batch."""
        sharding = NamedSharding(self.mesh, data_spec(dict(self.mesh.shape)))
        example = model_api.batch_shapes(self.model, self.cfg.train.global_batch,
                                         self.cfg.model.seq_len)
        return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
                for k, (shape, dtype) in example.items()}


def job_devices(cfg: Config) -> list:
    """The devices a run uses when none are named: all of the job's (their number must be
    the config's mesh size)."""
    return jax.devices()


def assemble(cfg: Config, devices: list | None = None, *, target: Any = None,
             model: Any = None) -> Run:
    """The run of `cfg`: model, plan, mesh and optimizer.

    Args:
      cfg: a validated config.
      devices: the mesh's devices (default: all of the job's, unless `target` is given); their
        number must be the config's mesh size.
      target: a `plan.Target` to plan for instead of the devices' own; with no `devices` the
        run has no mesh (`Run.on(devices)` gives it one).
      model: a `StagedModel` to run instead of the one `model.kind` names.

    Returns:
      The `Run`.

    Raises:
      ConfigError: the devices do not match the mesh, or the plan refuses the config.
    """
    if devices is None and target is None:
        devices = job_devices(cfg)
    if devices is not None:
        devices = list(devices)
        check_device_count(cfg, len(devices))
    model = model_api.build_model(cfg) if model is None else model
    plan = plan_lib.ParallelPlan.build(
        cfg, model, target if target is not None else plan_lib.Target.of_devices(devices))
    run = Run(cfg, model, plan, None, steplib.make_optimizer(cfg.train))
    return run if devices is None else run.on(devices)


def plan_for(cfg: Config, target: Any = None, model: Any = None) -> Any:
    """The `ParallelPlan` alone (default target: a CPU), for tools that price or check a plan
    before any device work (preflight, the simulator); `assemble` for anything that runs."""
    return plan_lib.ParallelPlan.build(cfg, model, target)
