"""What fits: the step's estimated bytes per device (`estimated_step_bytes`, from
`hardware.memory`), and the `auto` knobs decided against the device's memory: the attention
kernel, the remat policy and the microbatch count (`resolve_microbatches`, which picks the last
two together)."""

from __future__ import annotations

import functools

from jax_overlap.config import Config, ConfigError
from jax_overlap.model_api import param_elements
from jax_overlap.plan.derived import auto_vocab_parallel, pipeline_slots, ring_steps, schedule_name
from jax_overlap.plan.values import Choice, OverlapPlan, Target

# GEMM rows per microbatch (sequences x positions) auto microbatching allows on a GPU where
# tensor parallelism's collectives run whole beside the GEMMs (sequence parallel or plain TP at
# pp = 1): small enough that one microbatch's activations leave XLA's latency-hiding scheduler
# room to keep those collectives in flight (it serialises them when the step would not fit
# otherwise). `gemm_tokens`.
MICROBATCH_TOKENS = 8192
# Everywhere else four times that: data parallelism's GEMMs, each collective-matmul ring
# step's (1/tp of the rows), each pipeline action's. Each microbatch adds a pass over the f32
# gradient accumulators and its share of kernel launches (deviceless 8 x H100, remat full:
# GPT-1.3B dp8, 2026-12-03, m 4 / 2 / 1: 1017 / 960 / 941 ms estimated step, 29.0 / 32.4 /
# 44.9 GiB compiled, at m 1 the f32 logits of the whole batch start to dominate; with the
# exposed communication in the step, 2026-12-06: dp2 x tp4 collective matmul, m 2 / 4 / 8 /
# 16: 1312 / 1429 / 1593 / 1981 ms; pp2 x dp2 x tp2, m 8 / 16 / 32: 1278 / 1271 / 1336 ms).
GEMM_TOKENS = 4 * MICROBATCH_TOKENS
# A pipeline's microbatches fill it: auto takes no fewer than make its bubble,
# (pp - 1) / (m + pp - 1), at most this share (GPT-1.3B pp4 x dp2, m 8 / 16 / 32: 1282 /
# 1151 / 1134 ms; 0.889 / 0.933 / 0.962 of the collective bytes under GEMMs).
PIPELINE_BUBBLE = 0.1
# Share of device memory the estimated step may take under auto microbatching / remat; the rest
# is headroom for the buffers that overlapping keeps alive longer and for XLA's own
# temporaries. (XLA's GPU scheduler itself plans for 80% of the device, and its
# rematerialization pass starts cloning instructions -- GEMMs included -- near 95%.)
MEMORY_BUDGET = 0.8
# Why `model.remat: auto` recomputes a pipeline's forward on a CPU, where no memory needs
# saving: its F files every residual into a stash slot that a later tick reads back, and that
# traffic costs more than the recompute (bench/pipeline.py, p = 4, m = 8: 1F1B's CPU work is
# about 0.8 of a pp = 1 step's under `full`, 1.5 under `none`).
CPU_PIPELINE_REMAT_WHY = ("CPU pipeline: stashing each block's input and recomputing costs "
                          "less work than moving every residual through the stash slots")
# `model.remat` policies by how much of the forward the backward recomputes, least first: on a
# GPU `auto` takes the first whose estimated step fits where no layer scan stacks residuals.
REMAT_ORDER = ("none", "save_dots", "minimal", "full")
# Why `model.remat: auto` recomputes on a GPU even where keeping every residual would fit.
GPU_REMAT_WHY = ("GPU: stashing only each block's input and recomputing is faster than moving "
                 "every residual through memory (traced on one H200: GPT-1.3B 1.28 s a step "
                 "under full, 1.48 s under none; deviceless 8 x H100, estimated: pp4 x dp2 "
                 "paired 1F1B 3.24 -> 1.43 s)")
# `model.remat` policies `auto` tries on a GPU, first the one that fits, where keeping the
# projections' outputs beats recomputing them (`_keeps_projections`), and why.
KEPT_REMATS = ("minimal", "full")
RING_REMAT_WHY = ("collective-matmul rings: recomputing a block's forward would run its ring "
                  "steps again; keeping the projections' outputs recomputes only the "
                  "elementwise work and attention (GPT-1.3B dp2 x tp4, deviceless 8 x H100, "
                  "estimated: 1.21 s under full, 1.09 s under minimal, 1.73 s under none)")
PIPELINE_REMAT_WHY = ("pipeline at tp = 1: B reads the projections' outputs from the F's "
                      "stash slot instead of recomputing the block's GEMMs (GPT-1.3B pp4 x dp2, "
                      "deviceless 8 x H100, estimated: interleaved 1.02 -> 0.98 s, ZB-V "
                      "1.27 -> 1.17 s; at tp = 2 under sequence parallelism no faster: B "
                      "gathers the inputs again for the weight gradients)")


# Model kinds `hardware.memory` estimates (transformers; GPT-calibrated).
ESTIMATED_KINDS = ("gpt", "bert", "llama")


def resolve_attention(cfg: Config, target: Target, choices: dict[str, Choice]) -> str:
    """`model.attention`, `auto` resolved (`parallel.attention.resolve`): "fused" or "plain"."""
    from jax_overlap.parallel.attention import resolve

    mo = cfg.model
    value, why, problem = resolve(mo.attention, accelerator=target.accelerator,
                                  target_name=target.name, kind=mo.kind,
                                  precision=cfg.train.precision,
                                  head_dim=mo.d_model // max(mo.heads, 1))
    if problem:
        raise ConfigError([problem])
    if why is not None:
        choices["model.attention"] = Choice(value, why)
    return value


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def estimated_step_bytes(cfg: Config, micro_batch: int, overlap: OverlapPlan, remat: str,
                         attention: str = "plain") -> float:
    """The step's estimated peak bytes per device (`hardware.memory.step_bytes`) with
    `micro_batch` sequences per microbatch under a remat policy; at pp > 1 with the slot
    counts of the tick program that microbatch count gives (pairing search off: it keeps the
    same activation caps)."""
    from jax_overlap.hardware.memory import PipelineSlots, step_bytes

    m, pl = cfg.mesh, cfg.pipeline
    count = max(1, cfg.train.global_batch // (m.dcn * m.dp * max(micro_batch, 1)))
    # As the plan resolves it on a GPU (the only target with a memory estimate).
    vocab_parallel = auto_vocab_parallel(cfg, accelerator=True)[0]
    slots, split = None, False
    if m.pp > 1:
        try:
            costs = tuple(pl.tick_costs) if pl.tick_costs is not None else None
            slots, split = pipeline_slots(schedule_name(cfg), m.pp, count, pl.virtual_stages,
                                          pl.transfer_latency, pl.paired, costs,
                                          overlap.buckets_in_loop, vocab_parallel)
        except ValueError:  # no table for this count: the rough slot counts
            slots = PipelineSlots.rough(m.pp, count, pl.virtual_stages)
        split = split and pl.split_backward is not False
    return step_bytes(cfg.model, micro_batch, m.tp, m.pp, m.dp, cfg.train.precision,
                      params=param_elements(cfg), zero1=overlap.zero1, fsdp=overlap.fsdp,
                      remat=remat, attention=attention,
                      microbatches=count, sequence_parallel=overlap.tp_comm != "plain",
                      slots=slots, split_backward=split, vocab_parallel=vocab_parallel,
                      paired=m.pp > 1 and pl.paired is True,
                      buckets_in_loop=m.pp > 1 and overlap.buckets_in_loop,
                      unrolled_buckets=(m.pp == 1 and overlap.grad_bucket_bytes > 0
                                        and not overlap.fsdp
                                        and overlap.bucket_order == "largest_first"),
                      ep=m.ep, ring_steps=ring_steps(cfg, overlap.tp_comm),
                      paired_microbatches=m.pp == 1 and overlap.pair_microbatches)


def fits_memory(need: float, target: Target) -> bool:
    """Whether an estimated step of `need` bytes per device fits the target: within
    `MEMORY_BUDGET` of its memory (always, where the memory is unknown)."""
    return not target.memory_bytes or need <= MEMORY_BUDGET * target.memory_bytes


def _keeps_projections(cfg: Config, tp_comm: str) -> str | None:
    """Why `auto` remat on a GPU tries `minimal` before `full`, or None where recomputing the
    projections costs less than keeping them: at pp = 1 with collective-matmul rings (the
    recompute would run the rings again: `RING_REMAT_WHY`), and in a pipeline at tp = 1
    without experts (B reads them from the stash slot: `PIPELINE_REMAT_WHY`)."""
    if ring_steps(cfg, tp_comm):
        return RING_REMAT_WHY
    if cfg.mesh.pp > 1 and cfg.mesh.tp == 1 and not cfg.model.experts:
        return PIPELINE_REMAT_WHY
    return None


def _remat_candidates(cfg: Config, target: Target, unrolled: bool = False,
                      kept: str | None = None) -> tuple[str, ...]:
    """The policies `model.remat` may take: the explicit one; `auto` on a CPU `none` (there
    recomputing only adds work) but `full` for a pipeline; on a GPU `full` (`GPU_REMAT_WHY`),
    but every policy, least recompute first, for a step whose one microbatch runs `unrolled`
    (`_unrolled`: no layer scan stacks its residuals), and `minimal` before `full` where
    keeping the projections pays (`kept`: `_keeps_projections`'s reason); `none` for a model
    the memory estimate does not describe (`ESTIMATED_KINDS`)."""
    if cfg.model.remat != "auto":
        return (cfg.model.remat,)
    if not target.accelerator and cfg.mesh.pp > 1:
        return ("full",)  # see CPU_PIPELINE_REMAT_WHY
    if target.accelerator and cfg.model.kind in ESTIMATED_KINDS:
        # Kept residuals travel through memory: a pipeline's F files them into stash slots
        # that every tick reads and writes, and the pp = 1 layer scan stacks them with
        # dynamic-update-slices and copies. Stashing only each block's input and recomputing
        # costs less on both (GPU_REMAT_WHY).
        if unrolled:
            return REMAT_ORDER
        return KEPT_REMATS if kept else ("full",)
    return ("none",)


def _unrolled(cfg: Config, overlap: OverlapPlan, microbatches: int) -> bool:
    """Whether the whole step is the last microbatch, run with its layers unrolled for the
    gradient buckets (`training/grads.py`): one microbatch at pp = 1 with in-backward buckets
    that mix layers (`bucket_order: largest_first`) and no FSDP. (Buckets packed per layer
    are reduced in the layer scan's backward.)"""
    return (cfg.mesh.pp == 1 and microbatches == 1 and overlap.grad_bucket_bytes > 0
            and not overlap.fsdp and overlap.bucket_order == "largest_first")


def _cheapest_remat(cfg: Config, micro_batch: int, overlap: OverlapPlan, target: Target,
                    attention: str, remats: tuple[str, ...]
                    ) -> tuple[str | None, float, dict[str, float]]:
    """The first of `remats` whose estimated step fits the target (None if none does), its
    estimated bytes (the last one's when none fits), and the estimate of each policy tried.

    A policy estimated to keep no less than one that recomputes less is passed over; one
    estimated to keep exactly what the next does is named as the next (with the fused
    attention kernel, which is no dot, `save_dots` keeps what `minimal` does).
    """
    @functools.cache
    def bytes_of(remat: str) -> float:
        return estimated_step_bytes(cfg, micro_batch, overlap, remat, attention)

    tried: dict[str, float] = {}
    need = 0.0
    for i, remat in enumerate(remats):
        need = bytes_of(remat)
        if tried and need >= min(tried.values()) and i < len(remats) - 1:
            continue
        while i + 1 < len(remats) and bytes_of(remats[i + 1]) == need:
            i, remat = i + 1, remats[i + 1]
        tried[remat] = need
        if fits_memory(need, target):
            return remat, need, tried
    return None, need, tried


def gemm_tokens(cfg: Config, tp_comm: str) -> int:
    """Most tokens a microbatch takes under auto microbatching on a GPU: `GEMM_TOKENS` GEMM
    rows (per ring step under collective matmul), `MICROBATCH_TOKENS` where TP collectives
    run whole beside the GEMMs (sequence parallel or plain TP at pp = 1)."""
    if ring_steps(cfg, tp_comm):
        return GEMM_TOKENS * cfg.mesh.tp
    if cfg.mesh.pp == 1 and cfg.mesh.tp > 1:
        return MICROBATCH_TOKENS
    return GEMM_TOKENS


def pipeline_bubble(stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The idle share of a 1F1B-like pipeline: (p - 1) / (v m + p - 1) with v chunks per
    stage (interleaved)."""
    return ((stages - 1) / (virtual_stages * microbatches + stages - 1) if stages > 1
            else 0.0)


def microbatch_fits(cfg: Config, micro_batch: int, overlap: OverlapPlan, target: Target,
                    remat: str | None = None, attention: str | None = None
                    ) -> tuple[bool, float]:
    """Whether `micro_batch` sequences per microbatch suit a GPU: at most `MICROBATCH_TOKENS`
    GEMM rows, and the estimated step (`estimated_step_bytes`, bytes returned too) within
    `MEMORY_BUDGET` of the target's memory where it is known (`fits_memory`). `remat`
    (default `model.remat`) at `auto`: under the policy auto would take for it."""
    remat = remat or cfg.model.remat
    if attention is None:
        attention = resolve_attention(cfg, target, {})
    per_replica = cfg.train.global_batch // (cfg.mesh.dcn * cfg.mesh.dp)
    unrolled = _unrolled(cfg, overlap, max(1, per_replica // max(micro_batch, 1)))
    remats = (_remat_candidates(cfg, target, unrolled,
                                _keeps_projections(cfg, overlap.tp_comm))
              if remat == "auto" else (remat,))
    chosen, need, _ = _cheapest_remat(cfg, micro_batch, overlap, target, attention, remats)
    return (micro_batch * cfg.model.seq_len <= gemm_tokens(cfg, overlap.tp_comm)
            and chosen is not None), need


def _remat_why(remat: str, need: float, tried: dict[str, float], target: Target,
               kept: str | None = None) -> str:
    """Why auto took `remat`: its estimate against the budget, and what the policies that
    recompute less were estimated to need (`kept`: why `minimal` was tried first)."""
    budget = (f" (budget {MEMORY_BUDGET * target.memory_bytes / 1e9:.0f} GB)"
              if target.memory_bytes else "")
    lead = ("nothing recomputed" if remat == "none" else "the least recompute that fits")
    if remat == "minimal" and kept and "none" not in tried:
        lead = kept
    elif remat == "full" and target.accelerator and "none" not in tried:
        lead = GPU_REMAT_WHY
    why = f"{lead}: ~{need / 1e9:.0f} GB per device estimated{budget}"
    over = [f"{r} ~{b / 1e9:.0f} GB" for r, b in tried.items() if r != remat]
    return why + (f"; over it: {', '.join(over)}" if over else "")


def resolve_microbatches(cfg: Config, target: Target, overlap: OverlapPlan,
                         choices: dict[str, Choice], attention: str = "plain"
                         ) -> tuple[int, str]:
    """`pipeline.microbatches` and `model.remat`, `auto` resolved together (explicit values are
    kept): on a GPU the fewest microbatches whose GEMMs stay within `gemm_tokens` rows, whose
    pipeline bubble is at most `PIPELINE_BUBBLE` and whose estimated step fits (`fits_memory`)
    under the candidate policies (`_remat_candidates`); on a CPU the fewest microbatches and
    no recompute but in a pipeline (`CPU_PIPELINE_REMAT_WHY`)."""
    m, pl, mo = cfg.mesh, cfg.pipeline, cfg.model
    auto_remat = mo.remat == "auto"
    per_replica = cfg.train.global_batch // (m.dcn * m.dp)

    kept = _keeps_projections(cfg, overlap.tp_comm)

    def remats(n: int) -> tuple[str, ...]:
        return _remat_candidates(cfg, target, _unrolled(cfg, overlap, n), kept)

    def pick_remat(n: int) -> str:
        """The remat policy for an explicit (or CPU) microbatch count."""
        if not auto_remat:
            return mo.remat
        if not target.accelerator and m.pp > 1:
            choices["model.remat"] = Choice("full", CPU_PIPELINE_REMAT_WHY)
            return "full"
        if not target.accelerator:
            choices["model.remat"] = Choice("none", "CPU: no device memory to save, and "
                                                    "recomputing only adds work")
            return "none"
        if mo.kind not in ESTIMATED_KINDS:
            choices["model.remat"] = Choice("none", f"no memory estimate for model.kind="
                                                    f"{mo.kind}: nothing recomputed")
            return "none"
        b = max(1, per_replica // n)
        remat, need, tried = _cheapest_remat(cfg, b, overlap, target, attention, remats(n))
        if remat is None:
            choices["model.remat"] = Choice("full", f"the least memory: ~{need / 1e9:.0f} GB "
                                                    f"per device estimated; the step may "
                                                    f"still not fit the device's memory")
            return "full"
        choices["model.remat"] = Choice(remat,
                                        _remat_why(remat, need, tried, target, kept))
        return remat

    if pl.microbatches != "auto":
        return pl.microbatches, pick_remat(pl.microbatches)
    group = m.pp * pl.transfer_latency if pl.schedule == "interleaved" and m.pp > 1 else 1
    least = m.pp if m.pp > 1 and pl.schedule != "gpipe" else 1
    valid = [n for n in _divisors(per_replica) if n >= least and n % group == 0]
    if not valid:
        raise ConfigError([
            f"pipeline.microbatches: auto finds no count that divides the {per_replica} "
            f"sequences per replica (train.global_batch / mesh.dp) and suits "
            f"{pl.schedule} on {m.pp} stages; set pipeline.microbatches or train.global_batch"])
    if m.pp > 1:  # fill the pipeline twice over where the batch allows: less bubble
        valid = [n for n in valid if n >= 2 * m.pp] or valid[-1:]
    if not target.accelerator:
        n = valid[0]
        why = ("CPU: wall time follows total work, so the fewest microbatches"
               + (" that fill the pipeline twice" if m.pp > 1 else ""))
        choices["pipeline.microbatches"] = Choice(n, why)
        return n, pick_remat(n)
    budget = MEMORY_BUDGET * target.memory_bytes if target.memory_bytes else None
    tokens = gemm_tokens(cfg, overlap.tp_comm)
    v = pl.virtual_stages if pl.schedule == "interleaved" else 1
    filled = [n for n in valid if pipeline_bubble(m.pp, n, v) <= PIPELINE_BUBBLE] or valid[-1:]
    for n in filled:
        b = per_replica // n
        if b * mo.seq_len > tokens:
            continue
        remat, need, tried = _cheapest_remat(cfg, b, overlap, target, attention, remats(n))
        if remat is not None:
            rows = (f"collective-matmul ring steps of {b * mo.seq_len // m.tp} rows"
                    if ring_steps(cfg, overlap.tp_comm)
                    else f"GEMMs of {b * mo.seq_len} rows")
            bubble = (f", bubble {pipeline_bubble(m.pp, n, v):.3f}" if m.pp > 1 else "")
            why = (f"{b} sequences x {mo.seq_len} positions per microbatch: {rows}{bubble}, "
                   f"~{need / 1e9:.0f} GB per device estimated")
            if budget is not None:
                why += f" (budget {budget / 1e9:.0f} GB)"
            choices["pipeline.microbatches"] = Choice(n, why)
            if auto_remat and mo.kind not in ESTIMATED_KINDS:
                return n, pick_remat(n)
            if auto_remat:
                choices["model.remat"] = Choice(
                    remat, _remat_why(remat, need, tried, target, kept))
            return n, remat
    n = valid[-1]
    choices["pipeline.microbatches"] = Choice(n, "the most microbatches the batch allows; the "
                                                 "step may still not fit the device's memory")
    return n, pick_remat(n)
