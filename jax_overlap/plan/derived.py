"""What the config alone gives, before the plan chooses: the table a schedule name builds
(memoised), the schedule `auto` names from the config, the vocabulary-parallel head, and
whether each GEMM runs as collective-matmul ring steps. The memory estimate and the resolvers
above it all ask here."""

from __future__ import annotations

import functools

from jax_overlap.config import Config
from jax_overlap.pipeline.program import compile_program
from jax_overlap.pipeline.schedules import make_schedule
from jax_overlap.pipeline.table import KINDS, Schedule


@functools.lru_cache(maxsize=1024)
def cached_schedule(name: str, stages: int, microbatches: int, virtual_stages: int = 1,
                    transfer_latency: int = 1, paired: bool = False,
                    tick_costs: tuple[float, float, float] | None = None,
                    pair_search: int = 0) -> Schedule:
    """`make_schedule`, memoised: the tuner plans hundreds of configs and a large table takes a
    while to build. Schedules are immutable, so sharing one is safe."""
    cost = dict(zip(KINDS, tick_costs)) if tick_costs is not None else None
    return make_schedule(name, stages, microbatches, virtual_stages, transfer_latency, paired,
                         cost, pair_search)


def schedule_name(cfg: Config) -> str:
    """`pipeline.schedule` with `auto` resolved: interleaved where more than one virtual stage
    is asked for, else 1f1b (the same on every target today: `schedule.AUTO_SCHEDULE_WHY`)."""
    pl = cfg.pipeline
    if pl.schedule != "auto":
        return pl.schedule
    return "interleaved" if pl.virtual_stages > 1 else "1f1b"


# Why `pipeline.vocab_parallel: auto` splits the LM head over the stages on a GPU (measured;
# docs/results.md).
AUTO_VOCAB_PARALLEL_WHY = (
    "GPU: the last stage no longer runs the whole head and loss while the others wait (GPT-1.3B "
    "pp4 x dp2, deviceless 8 x H100, estimated step: 1F1B paired 1.28 -> 1.18 s, ZB-V "
    "1.84 -> 1.42 s with the chunk's layers scanned)")


def auto_vocab_parallel(cfg: Config, accelerator: bool) -> tuple[bool, str]:
    """`pipeline.vocab_parallel` (`auto` resolved by the config alone) and why."""
    m, mo, value = cfg.mesh, cfg.model, cfg.pipeline.vocab_parallel
    if value != "auto":
        return bool(value) and m.pp > 1, "set in the config"
    if m.pp == 1:
        return False, "pp = 1: no stages to split the head over"
    if mo.kind == "resnet":
        return False, "resnet's head is a small classifier with no vocabulary to split"
    if not isinstance(mo.vocab, int) or mo.vocab % (m.tp * m.pp):
        return False, (f"model.vocab {mo.vocab} is not divisible by mesh.tp x mesh.pp = "
                       f"{m.tp * m.pp} (pad it to split the head)")
    if not accelerator:
        return False, ("CPU: the head stays on the last stage (every collective is "
                       "synchronous there: the head phase's psums over pp add work, they hide "
                       "nothing)")
    return True, AUTO_VOCAB_PARALLEL_WHY


@functools.lru_cache(maxsize=256)
def pipeline_slots(name: str, stages: int, microbatches: int, virtual_stages: int,
                   transfer_latency: int, paired: bool, tick_costs, buckets_in_loop: bool,
                   vocab_parallel: bool):
    """(`memory.PipelineSlots`, split backward) of a schedule's compiled tick program."""
    from jax_overlap.hardware.memory import PipelineSlots

    schedule = cached_schedule(name, stages, microbatches, virtual_stages, transfer_latency,
                               paired, tick_costs)
    program = compile_program(schedule, buckets_in_loop, vocab_parallel)
    return PipelineSlots.of_program(program), schedule.split_backward


def ring_steps(cfg: Config, tp_comm: str) -> bool:
    """Whether each GEMM runs as tp collective-matmul ring steps of 1/tp of its rows (at
    pp = 1; a pipeline's grouped steps are whole GEMMs)."""
    return tp_comm == "collective_matmul" and cfg.mesh.pp == 1 and cfg.mesh.tp > 1
