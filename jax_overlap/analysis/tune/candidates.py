"""The tuner's candidate space: every parallel plan of a config's model and batch on N
devices, as a `Candidate` (config terms) and its validated `Config`."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from jax_overlap import config as configlib
from jax_overlap.analysis import plan_shape
from jax_overlap.config import Config, ConfigError
from jax_overlap.pipeline.generators import SCHEDULES
from jax_overlap.plan import ParallelPlan

DEFAULT_BUCKETS_MB: tuple[float, ...] = (0.0, 1.0, 4.0, 16.0, 64.0, 256.0)
# Bucket sizes that cut one stage's gradients into more pieces than this are skipped:
# per-bucket latency dominates there, and each bucket is an event to simulate.
MAX_BUCKETS = 256
DEFAULT_WINDOWS: tuple[int, ...] = (1, 2, 3)
MAX_MICROBATCHES = 64
MAX_VIRTUAL_STAGES = 4


@dataclass(frozen=True, order=True)
class Candidate:
    """One parallel plan, in config terms.

    Attributes:
      dp: data-parallel degree.
      tp: tensor-parallel degree.
      pp: pipeline stages.
      virtual_stages: chunks per stage.
      microbatches: microbatches per replica per step.
      schedule: pipeline schedule name.
      grad_bucket_mb: gradient bucket size (0: one reduction per array after the
        backward).
      fsdp: parameters sharded over dp and all-gathered before use.
      window: FSDP prefetch depth (1 when not sharded).
      transfer_latency: ticks between pipeline stages (1, or 2: every stage-to-stage transfer
        under the next tick's compute, for a longer ramp); 1 when pp = 1.
      stage_layers: ``even`` or ``balanced`` (`pipeline.stage_layers`: layers balanced by cost,
        counting the embedding and the LM head), or an explicit split found by
        :func:`search_split` written ``"7,6,6,5"``; ``even`` when pp = 1.
      paired: paired F+B ticks (`pipeline.paired`, latency 1); False when pp = 1.
      remat: the `model.remat` policy: what every layer keeps for its backward (memory)
        against what it recomputes (time).
      dcn: `mesh.dcn`, the slow axis between hosts (1: none; ``dp`` is then the dp inside
        one host).
      slow: how the gradient crosses dcn (``flat`` with dcn = 1): ``hierarchical``,
        ``delay1`` (one step late) or ``diloco:H,F,tau,dtype`` (Streaming DiLoCo).
      vocab_parallel: the LM head split over the pipeline stages (`pipeline.vocab_parallel`);
        False when pp = 1.
    """

    dp: int
    tp: int
    pp: int
    virtual_stages: int
    microbatches: int
    schedule: str
    grad_bucket_mb: float
    fsdp: bool
    window: int
    transfer_latency: int = 1
    stage_layers: str = "even"
    paired: bool = False
    remat: str = "none"
    dcn: int = 1
    slow: str = "flat"
    vocab_parallel: bool = False

    def key(self) -> tuple:
        """Stable tie-break key (the fields in order)."""
        return dataclasses.astuple(self)

    def label(self) -> str:
        """Short human-readable name, e.g. ``dp2 tp4 pp1 m2 1f1b b0 repl``."""
        sched = self.schedule + (f"/v{self.virtual_stages}" if self.virtual_stages > 1 else "")
        if self.transfer_latency > 1:
            sched += f" L{self.transfer_latency}"
        if self.paired:
            sched += " paired"
        if self.stage_layers != "even":
            sched += f" split-{self.stage_layers}"
        if self.remat != "none":
            sched += f" remat-{self.remat}"
        if self.vocab_parallel:
            sched += " vocab"
        shard = f"fsdp w{self.window}" if self.fsdp else "repl"
        hosts = f"dcn{self.dcn} " if self.dcn > 1 else ""
        slow = f" {self.slow}" if self.dcn > 1 else ""
        return (
            f"{hosts}dp{self.dp} tp{self.tp} pp{self.pp} m{self.microbatches} {sched} "
            f"b{self.grad_bucket_mb:g} {shard}{slow}"
        )

    @property
    def stale(self) -> bool:
        """Trains with stale gradients (one step late, or DiLoCo): not one device's training."""
        return self.slow == "delay1" or self.slow.startswith("diloco")


def apply_candidate(cfg: Config, cand: Candidate) -> Config:
    """``cfg`` with the plan's fields set, validated.

    Args:
      cfg: the base config.
      cand: the plan.

    Returns:
      A new validated :class:`Config`.

    Raises:
      ConfigError: if the plan is not valid for this config.
    """
    c = cand
    out = dataclasses.replace(
        cfg,
        mesh=dataclasses.replace(cfg.mesh, dp=c.dp, tp=c.tp, pp=c.pp),
        pipeline=dataclasses.replace(cfg.pipeline, schedule=c.schedule,
                                     microbatches=c.microbatches,
                                     virtual_stages=c.virtual_stages,
                                     transfer_latency=c.transfer_latency,
                                     stage_layers=_split_value(c.stage_layers),
                                     paired=c.paired, vocab_parallel=c.vocab_parallel),
        model=dataclasses.replace(cfg.model, remat=c.remat),
        overlap=dataclasses.replace(cfg.overlap, grad_bucket_mb=float(c.grad_bucket_mb),
                                    param_sharding="fsdp" if c.fsdp else "replicated",
                                    window=c.window),
    )
    if c.dcn > 1 or cfg.mesh.dcn > 1:
        h, f, tau, dtype = _diloco_setting(c.slow)
        out = dataclasses.replace(
            out, mesh=dataclasses.replace(out.mesh, dcn=c.dcn),
            overlap=dataclasses.replace(out.overlap, dcn_delay=int(c.slow == "delay1")),
            diloco=dataclasses.replace(cfg.diloco, inner_steps=h, fragments=f, delay=tau,
                                       outer_dtype=dtype))
    configlib.validate(out)
    return out


def _diloco_setting(slow: str) -> tuple[int, int, int, str]:
    """``diloco:H,F,tau,dtype`` -> (H, F, tau, dtype); (0, 1, 0, bf16) for other modes."""
    if not slow.startswith("diloco:"):
        return 0, 1, 0, "bf16"
    h, f, tau, dtype = slow.split(":", 1)[1].split(",")
    return int(h), int(f), int(tau), dtype


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _split_value(text: str):
    """A candidate's `stage_layers` as the config takes it ("7,6,6,5" -> [7, 6, 6, 5])."""
    if text in ("even", "balanced", "auto"):
        return text
    return [int(n) for n in text.split(",")]


def plan_of(cfg: Config) -> ParallelPlan:
    """The `ParallelPlan` of a candidate config (no model: the analytic costs need none)."""
    return ParallelPlan.build(cfg)


def _layouts(pp: int) -> list[tuple[str, int]]:
    """``(schedule, virtual stages)`` pairs worth trying with ``pp`` stages."""
    if pp == 1:
        # One stage: every schedule is the same microbatch loop; keep one.
        return [("1f1b", 1)]
    out = []
    for name in SCHEDULES:
        if name == "interleaved":
            out += [(name, v) for v in range(2, MAX_VIRTUAL_STAGES + 1)]
        elif name == "zb-v":
            out.append((name, 2))
        else:
            out.append((name, 1))
    return out


def _bucket_sizes(cfg: Config, dp: int, tp: int, pp: int, sizes: Sequence[float]) -> list[float]:
    """Bucket sizes that give distinct, sensible plans for one layout.

    Sizes past the whole gradient are all one plan (the smallest is kept); sizes that
    make more than :data:`MAX_BUCKETS` buckets are dropped.
    """
    if dp == 1:
        return [0.0]  # nothing to reduce over dp
    probe = dataclasses.replace(cfg, mesh=configlib.MeshConfig(dp=dp, pp=pp, tp=tp),
                                pipeline=dataclasses.replace(cfg.pipeline, schedule="gpipe",
                                                             virtual_stages=1,
                                                             transfer_latency=1,
                                                             stage_layers="balanced"))
    grad_mb = plan_shape.stage_param_elements(probe, plan_of(probe)) * 4 / 2**20
    out, whole = [], False
    for s in sorted(set(float(x) for x in sizes)):
        if s > 0 and grad_mb / s > MAX_BUCKETS:
            continue
        if s > 0 and s >= grad_mb:
            if whole:
                continue
            whole = True
        out.append(s)
    return out


def _vocab_parallel_head(cfg: Config) -> bool:
    """Whether the config's model can run its head vocabulary-parallel (it declares
    `vocab_parallel_head`, as the plan requires)."""
    from jax_overlap.model_api import build_model

    return bool(getattr(build_model(cfg), "vocab_parallel_head", False))


def _pipeline_options(cfg: Config, pp: int, v: int, schedule: str, m: int,
                      vocab_parallel: bool = False) -> list[tuple[int, str, bool, bool]]:
    """``(transfer latency, stage split, paired, vocab-parallel head)`` worth trying: both
    latencies, paired ticks (latency 1) and, where the balanced split differs from the even
    one (or the layers do not split evenly), ``auto``; and, with ``vocab_parallel`` (the
    model's head supports it), unpaired at both latencies, the head split over the stages
    (its balanced split is the even one)."""
    if pp == 1:
        return [(1, "even", False, False)]
    splits = ["even"]
    try:
        even = apply_candidate(cfg, Candidate(1, 1, pp, v, m, schedule, 0.0, False, 1, 1))
        balanced = dataclasses.replace(even, pipeline=dataclasses.replace(
            even.pipeline, stage_layers="balanced"))
        if plan_of(balanced).stage_layers != plan_of(even).stage_layers:
            splits.append("balanced")
    except (ConfigError, ValueError):
        splits = ["balanced"]  # even is impossible (layers not a multiple): balanced may fit
    lanes = ((1, False), (2, False), (1, True))
    out = [(latency, split, paired, False) for latency, paired in lanes for split in splits]
    if vocab_parallel:  # unpaired: a paired tick's lanes both wait around the head phase
        out += [(latency, splits[0], False, True) for latency in (1, 2)]
    return out


def enumerate_candidates(
    cfg: Config,
    devices: int,
    *,
    bucket_sizes_mb: Sequence[float] = DEFAULT_BUCKETS_MB,
    windows: Sequence[int] = DEFAULT_WINDOWS,
    max_microbatches: int = MAX_MICROBATCHES,
    remats: Sequence[str] | None = None,
) -> list[tuple[Candidate, Config]]:
    """Every valid plan of ``cfg``'s model and batch on ``devices`` devices.

    Args:
      cfg: the base config (model, batch, precision, optimizer are kept).
      devices: devices the plan must use exactly (dp x tp x pp).
      bucket_sizes_mb: gradient bucket sizes to try (sizes past the whole gradient are
        one plan).
      windows: FSDP prefetch depths to try (FSDP only when dp > 1).
      max_microbatches: most microbatches tried.
      remats: `model.remat` policies to try (default: the configured one and ``full``).

    Returns:
      ``(candidate, validated config)`` pairs in a fixed order.
    """
    if devices < 1:
        raise ValueError(f"--devices: must be >= 1, got {devices}")
    # The configured policy, and `full` (the least activation memory) when that differs.
    # (`auto`, the default, is `none` where the tuner's cost model decides.)
    policies = list(dict.fromkeys("none" if r == "auto" else r
                                  for r in (remats or (cfg.model.remat, "full"))))
    out = []
    vocab = _vocab_parallel_head(cfg)
    for tp in _divisors(devices):
        for pp in _divisors(devices // tp):
            dp = devices // (tp * pp)
            buckets = None
            for schedule, v in _layouts(pp):
                for m in _divisors(max(1, cfg.train.global_batch // dp)):
                    if m > max_microbatches:
                        break
                    for latency, split, paired, head in _pipeline_options(cfg, pp, v,
                                                                          schedule, m, vocab):
                        base = Candidate(dp, tp, pp, v, m, schedule, 0.0, False, 1, latency,
                                         split, paired, vocab_parallel=head)
                        try:
                            plan_of(apply_candidate(cfg, base))
                        except (ConfigError, ValueError):
                            continue
                        if buckets is None:
                            buckets = _bucket_sizes(cfg, dp, tp, pp, bucket_sizes_mb)
                        shardings = [(False, 1)] + ([(True, w) for w in windows] if dp > 1
                                                    else [])
                        for bucket, (fsdp, window), remat in itertools.product(
                                buckets, shardings, policies):
                            cand = dataclasses.replace(
                                base, grad_bucket_mb=bucket, fsdp=fsdp, window=window,
                                remat=remat)
                            try:
                                out.append((cand, apply_candidate(cfg, cand)))
                            except ConfigError:
                                continue
    return out
