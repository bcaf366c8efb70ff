"""The one cost model: the per-action `Costs` of a plan for the simulator.

Three sources, one structure (TP collectives, parameter and stash bytes per virtual stage,
`assemble_costs`):

* FLOPs and the machine model (`flop_costs`; `costs_from_model` the per-layer formulas):
  what the tuner prices a plan by without measuring, at an assumed fraction of peak;
* a calibration of the model on this machine (`costs_for_config`, from
  `calibrate.Calibration`; `compute_times` turns measured pieces into F, B, W);
* timing callables directly (`costs_from_measurement`), for hand-built stages.

The simulator (`simulate`), the tuner (`analysis.tune`) and `calibrate`'s measurements all
meet here; how a measurement becomes the cost of any plan is described in `calibrate`'s
module docstring.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from jax_overlap.analysis.calibrate import Calibration
from jax_overlap.analysis.plan_shape import (
    block_variant,
    layers_per_virtual_stage,
    micro_batch_size,
    quantities_for,
    stash_bytes,
)
from jax_overlap.analysis.simulate import Costs
from jax_overlap.config import Config
from jax_overlap.hardware.machine import HardwareProfile, Link
from jax_overlap.model_api import param_counts
from jax_overlap.hardware.memory import dtype_bytes

# Assumed model-FLOPs utilisation of the compute for FLOP-based costs: an assumption,
# not a measurement; it scales every compute time alike, so it moves the balance between
# compute and communication, not the order of plans with equal communication.
FLOP_EFFICIENCY = 0.5
PARAM_BYTES = 4  # master weights, gradients and Adam moments stay fp32 under bf16 compute


# ------------------------------------------------------------------- from FLOPs


def _split(layers: int, parts: int) -> list[int]:
    """Layers per virtual stage: as even as possible, earlier stages take the extra."""
    base, extra = divmod(layers, parts)
    return [base + (i < extra) for i in range(parts)]


def costs_from_model(
    layers: int,
    d_model: int,
    heads: int,
    d_ff: int,
    vocab: int,
    seq_len: int,
    micro_batch: int,
    tp: int,
    dtype_bytes: int,
    chip_flops: float,
    efficiency: float,
    *,
    num_virtual_stages: int = 1,
    optimizer_factor: float = 2.0,
    stage_layers: Sequence[int] | None = None,
    vocab_shards: int = 1,
) -> Costs:
    """FLOP-based costs of a decoder-only transformer split into virtual stages.

    Per layer with ``P = 4 d^2 + 2 d d_ff`` weights (attention projections and a
    two-matrix MLP) and ``T = micro_batch x seq_len`` tokens: forward
    ``2 P T + 4 seq_len^2 d micro_batch`` FLOPs (matmuls plus attention scores and
    values), backward twice that, split as ``B = 2 P T + 8 seq_len^2 d micro_batch``
    (input gradients, including all of attention's backward) and ``W = 2 P T`` (weight
    gradients). The embedding sits on the first virtual stage (no FLOPs), the LM head
    (``2 d vocab T`` per pass) on the last. Everything is divided by ``tp``.

    Args:
      layers: transformer layers.
      d_model: hidden size.
      heads: attention heads (sets the attention-probability activation size).
      d_ff: MLP hidden size.
      vocab: vocabulary size.
      seq_len: tokens per sequence.
      micro_batch: sequences per microbatch.
      tp: tensor-parallel degree.
      dtype_bytes: bytes per parameter / activation element.
      chip_flops: peak FLOP/s of one device.
      efficiency: achieved fraction of ``chip_flops`` (MFU).
      num_virtual_stages: ``p * v``; layers are split as evenly as possible unless
        ``stage_layers`` is given.
      optimizer_factor: optimizer-state bytes per parameter byte.
      stage_layers: layers per virtual stage in model order (the plan's uneven split).
      vocab_shards: > 1: the head runs vocabulary-parallel over that many pipeline stages,
        each doing its share of the head's three passes in :attr:`Costs.head_s`, and the
        last virtual stage leaves the head out.

    Returns:
      The :class:`Costs` (bytes per device).
    """
    tokens = micro_batch * seq_len
    rate = chip_flops * efficiency
    per_layer_params = 4 * d_model**2 + 2 * d_model * d_ff
    attn = 4 * seq_len**2 * d_model * micro_batch
    f_layer = 2 * per_layer_params * tokens + attn
    b_layer = 2 * per_layer_params * tokens + 2 * attn
    w_layer = 2 * per_layer_params * tokens
    head = 2 * d_model * vocab * tokens
    # Saved for backward per token and layer: norm and matmul inputs (4 d, replicated
    # across TP ranks without sequence parallelism) plus q, k, v, attention output,
    # both MLP hidden tensors and the attention probabilities (sharded over TP).
    stash_layer = (
        tokens * dtype_bytes * (4 * d_model + (4 * d_model + 2 * d_ff + heads * seq_len) / tp)
    )
    fwd, bwd, wgt, tpb, prm, stash = [], [], [], [], [], []
    counts = _split(layers, num_virtual_stages) if not stage_layers else list(stage_layers)
    if len(counts) != num_virtual_stages or sum(counts) != layers:
        raise ValueError(f"costs_from_model: stage_layers {list(counts)} does not split "
                         f"{layers} layers into {num_virtual_stages} virtual stages")
    for vs, n in enumerate(counts):
        first, last = vs == 0, vs == num_virtual_stages - 1
        f, b, w = n * f_layer, n * b_layer, n * w_layer
        params = n * per_layer_params + (vocab * d_model if first else 0)
        if last:
            if vocab_shards == 1:
                f, b, w = f + head, b + head, w + head
            params += vocab * d_model
        fwd.append(f / tp / rate)
        bwd.append(b / tp / rate)
        wgt.append(w / tp / rate)
        # Two all-reduces of the layer output per layer and pass (attention and MLP).
        tpb.append(2 * n * tokens * d_model * dtype_bytes if tp > 1 else 0.0)
        prm.append(params * dtype_bytes / tp)
        stash.append(n * stash_layer + (tokens * d_model * dtype_bytes if last else 0.0))
    return Costs(
        forward_s=tuple(fwd),
        backward_s=tuple(bwd),
        weight_s=tuple(wgt),
        act_bytes=float(tokens * d_model * dtype_bytes),
        tp_bytes=tuple(float(x) for x in tpb),
        param_bytes=tuple(float(x) for x in prm),
        stash_bytes=tuple(float(x) for x in stash),
        optimizer_factor=optimizer_factor,
        head_s=3 * head / tp / rate / vocab_shards if vocab_shards > 1 else 0.0,
    )


def flop_costs(cfg: Config, plan, hw: HardwareProfile, efficiency: float = FLOP_EFFICIENCY
               ) -> Costs:
    """FLOP-based :class:`Costs` of the plan ``cfg`` on the chip ``hw`` describes.

    Compute times come from :func:`costs_from_model` at ``efficiency`` of the chip's
    peak, per virtual stage from the plan's layer split (`pipeline.stage_layers`), the
    embedding on the first and the LM head on the last. The backward is priced the way the
    executor runs it: an F stashes its residuals, so no backward re-runs the forward except
    what the remat policy (`model.remat`) recomputes per layer -- ``full`` the block's
    forward, ``minimal`` its attention scores, ``none`` / ``save_dots`` nothing. Split: B
    is the input gradients (plus the recompute), W only the weight-gradient GEMMs (what B
    kept), virtual stage 0's alike (its B ends in the embedding's gradient). The structure --
    TP collective count, parameter bytes per stage, stash -- is the same as for calibrated
    costs.

    Args:
      cfg: the candidate config.
      plan: its `ParallelPlan`.
      hw: the hardware profile.
      efficiency: achieved fraction of peak FLOP/s.

    Returns:
      The :class:`Costs`.
    """
    m = cfg.model
    s = plan.schedule
    layers = layers_per_virtual_stage(cfg, plan)
    base = costs_from_model(
        m.layers, m.d_model, m.heads, m.d_ff, m.vocab, m.seq_len, plan.micro_batch,
        plan.tp, dtype_bytes(cfg.train.precision), hw.chip_flops, efficiency,
        num_virtual_stages=plan.num_virtual_stages, stage_layers=layers,
        vocab_shards=plan.pp if plan.vocab_parallel else 1,
    )
    fwd, bwd, wgt = list(base.forward_s), list(base.backward_s), list(base.weight_s)
    tokens = plan.micro_batch * m.seq_len
    attn = 4 * m.seq_len ** 2 * m.d_model * plan.micro_batch
    per_layer = {"full": 2 * (4 * m.d_model ** 2 + 2 * m.d_model * m.d_ff) * tokens + attn,
                 "minimal": attn}.get(plan.remat, 0.0)
    redo = [n * per_layer / plan.tp / (hw.chip_flops * efficiency) for n in layers]
    if plan.pp == 1 or not s.split_backward:
        # A non-split B does both gradients: costs_from_model splits them into B and W.
        bwd = [b + w + r for b, w, r in zip(bwd, wgt, redo)]
        wgt = [0.0] * len(wgt)
    else:
        bwd = [b + r for b, r in zip(bwd, redo)]
    return assemble_costs(cfg, plan, hw, s.placement, fwd, bwd, wgt, base.head_s)


# --------------------------------------------------------------- from a calibration


def tp_collectives(cfg: Config, plan, vs: int, kind: str) -> tuple[int, float]:
    """TP collectives one ``F`` or ``B`` of virtual stage ``vs`` issues (plain Megatron).

    Per layer two all-reduces of the ``(b, T, d)`` activations in the forward (after
    the row-parallel attention and MLP projections) and two in the backward (the
    gradients of the column-parallel inputs). The embedding's forward adds one; the
    vocabulary-parallel loss adds a max and two sums of ``(b, T)`` fp32 values in the
    forward and one ``(b, T, d)`` all-reduce in the backward (the head input's gradient).

    Args:
      cfg: the candidate config.
      vs: virtual stage index.
      kind: ``F`` or ``B`` (``W`` issues none).

    Returns:
      ``(count, bytes)`` per device; ``(0, 0)`` without TP.
    """
    if plan.tp <= 1 or kind not in ("F", "B"):
        return 0, 0.0
    b, t, d = micro_batch_size(cfg, plan), cfg.model.seq_len, cfg.model.d_model
    act = b * t * d * dtype_bytes(cfg.train.precision)
    n_vs = plan.num_virtual_stages
    n_layers = layers_per_virtual_stage(cfg, plan)[vs]
    count, nbytes = 2 * n_layers, 2 * n_layers * act
    if kind == "F" and vs == 0:
        count, nbytes = count + 1, nbytes + act
    if vs == n_vs - 1:
        if kind == "F":
            count, nbytes = count + 3, nbytes + 3 * b * t * 4
        else:
            count, nbytes = count + 1, nbytes + act
    return count, nbytes


def latency_equivalent_bytes(count: int, nbytes: float, n: int, link: Link) -> float:
    """Bytes of one ring all-reduce over ``n`` devices costing as much as ``count`` ones.

    ``count`` all-reduces totalling ``nbytes`` cost ``2(n-1)(count latency) + 2(n-1)/n
    nbytes / bw``; one of ``nbytes + n (count-1) latency bw`` costs the same.

    Args:
      count: collectives.
      nbytes: their summed bytes.
      n: group size.
      link: the group's link.

    Returns:
      Bytes for :attr:`Costs.tp_bytes`.
    """
    if count <= 0:
        return 0.0
    return nbytes + n * (count - 1) * link.latency_s * link.effective_bandwidth


def assemble_costs(
    cfg: Config,
    plan,
    hw: HardwareProfile,
    placement: Sequence[tuple[int, int]],
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    weight_s: Sequence[float],
    head_s: float = 0.0,
) -> Costs:
    """:class:`Costs` of ``cfg`` from per-virtual-stage compute times and its structure.

    Args:
      cfg: the candidate config.
      hw: hardware profile (TP link latency for the collective count).
      placement: the schedule's virtual stage -> ``(stage, chunk)``.
      forward_s: F seconds per virtual stage.
      backward_s: B seconds per virtual stage (input gradients when split).
      weight_s: W seconds per virtual stage.
      head_s: a vocabulary-parallel head's phase per device (:attr:`Costs.head_s`).

    Returns:
      The :class:`Costs` (bytes per device).
    """
    n_vs = plan.num_virtual_stages
    link = hw.link("tp")
    tp_bytes = []
    for vs in range(n_vs):
        # The simulator charges the same tp_bytes to F and B; use the mean of the two.
        f_count, f_bytes = tp_collectives(cfg, plan, vs, "F")
        b_count, b_bytes = tp_collectives(cfg, plan, vs, "B")
        f_eq = latency_equivalent_bytes(f_count, f_bytes, plan.tp, link)
        b_eq = latency_equivalent_bytes(b_count, b_bytes, plan.tp, link)
        tp_bytes.append((f_eq + b_eq) / 2)
    c = param_counts(cfg, plan.tp)
    per_layer = layers_per_virtual_stage(cfg, plan)
    params = []
    for vs in range(n_vs):
        # Every stage holds the embedding and head (replicated over pp): count them once
        # per stage, on its chunk 0.
        extra = c.embed + c.head if placement[vs][1] == 0 else 0
        params.append(float((per_layer[vs] * c.per_layer + extra) * PARAM_BYTES))
    return Costs(
        forward_s=tuple(float(x) for x in forward_s),
        backward_s=tuple(float(x) for x in backward_s),
        weight_s=tuple(float(x) for x in weight_s),
        act_bytes=activation_bytes(cfg, plan),
        tp_bytes=tuple(tp_bytes),
        param_bytes=tuple(params),
        stash_bytes=tuple(stash_bytes(cfg, plan, vs) for vs in range(n_vs)),
        optimizer_factor=2.0,
        head_s=float(head_s),
    )


def activation_bytes(cfg: Config, plan) -> float:
    """Bytes of one microbatch's activation at a stage boundary (what a permute carries)."""
    tokens = micro_batch_size(cfg, plan) * cfg.model.seq_len
    return float(tokens * cfg.model.d_model * dtype_bytes(cfg.train.precision))


def busy_scale(cfg: Config, plan, capacity: float, devices: int, bubble: float) -> float:
    """Compute-time factor for a pipelined step on shared cores (see module docstring).

    Args:
      cfg: the candidate config.
      capacity: :attr:`Calibration.parallel_capacity`.
      devices: devices the calibration ran on at once.
      bubble: the schedule's lockstep bubble fraction.

    Returns:
      ``max(N (1 - bubble), capacity) / max(N, capacity)``; 1 for ``pp = 1``.
    """
    if plan.pp <= 1:
        return 1.0
    busy = devices * (1.0 - bubble)
    return max(busy, capacity) / max(devices, capacity)


def backward_of(fb: float, f: float) -> float:
    """Seconds of a backward from a measured forward+backward ``fb`` and forward ``f``.

    A backward does twice its forward's FLOPs, so it never costs less than the forward;
    at tiny shapes on a loaded host the difference ``fb - f`` is noise and can even be
    negative, and the forward's own time is the floor.
    """
    return max(fb - f, f)


def compute_times(cal: Calibration, cfg: Config, plan, split_backward: bool, bubble: float = 0.0
                  ) -> tuple[list[float], list[float], list[float]]:
    """Per-virtual-stage F, B, W seconds of ``cfg`` from a calibration.

    Args:
      cal: the calibration (of ``cfg``'s model).
      cfg: the candidate config.
      split_backward: whether the schedule splits B and W.
      bubble: the schedule's lockstep bubble fraction (shared-core scaling).

    Returns:
      ``(forward_s, backward_s, weight_s)`` lists, one entry per virtual stage.
    """
    b, k = micro_batch_size(cfg, plan), plan.tp
    n_vs = plan.num_virtual_stages
    s = {q: cal.seconds(q, b, k) for q in quantities_for(cfg, plan, split_backward)}
    scale = busy_scale(cfg, plan, cal.parallel_capacity, cal.devices, bubble)
    blk = block_variant(cfg, plan)
    redo = s[f"{blk}_f"] if plan.remat == "full" else 0.0  # per layer, recomputed in B
    fwd, bwd, wgt = [], [], []
    # A vocabulary-parallel head is no virtual stage's work (`head_phase_time`).
    head_last = not plan.vocab_parallel
    for vs, n in enumerate(layers_per_virtual_stage(cfg, plan)):
        first, last = vs == 0, vs == n_vs - 1 and head_last
        f = n * s[f"{blk}_f"] + first * s["embed_f"] + last * s["head_f"]
        fb = n * s[f"{blk}_fb"] + first * s["embed_fb"] + last * s["head_fb"]
        if plan.pp == 1:
            fwd.append(f)
            bwd.append(backward_of(fb, f))
            wgt.append(0.0)
        elif not split_backward:
            # An F stashes its residuals: the backward re-runs no forward but what the remat
            # policy recomputes (`full`: the blocks' forward).
            fwd.append(f)
            bwd.append(backward_of(fb, f) + n * redo)
            wgt.append(0.0)
        else:
            # The measured backward (fb less its forward) split between B (the input
            # gradients, plus the remat recompute) and W (the weight-gradient GEMMs on what B
            # kept) in the ratio of the measured split pieces fbx : fbw. Differences such as
            # fbx - f are noise at small shapes; the ratio keeps both parts positive. The
            # head's backward runs half in each (its pullback gives the input gradient in B,
            # the weights' in W). Virtual stage 0's B also pulls back into the embedding.
            back = backward_of(s[f"{blk}_fb"], s[f"{blk}_f"])
            pieces = s[f"{blk}_fbx"] + s[f"{blk}_fbw"]
            if pieces <= 0:  # the tuner prices such a plan by FLOPs (`nonpositive_pieces`)
                raise ValueError(f"calibration: {blk}_fbx and {blk}_fbw are both 0 at micro-batch "
                                 f"{b}, tp {k}; price this plan by FLOPs")
            share = s[f"{blk}_fbx"] / pieces
            block_b, block_w = back * share, back * (1.0 - share)
            head = last * max(s["head_fb"] - s["head_f"], 0.0) / 2
            fwd.append(f)
            embed = first * max(s["embed_fb"] - s["embed_f"], 0.0)
            bwd.append(n * (block_b + redo) + head + embed)
            wgt.append(n * block_w + head)
    return [x * scale for x in fwd], [x * scale for x in bwd], [x * scale for x in wgt]


def nonpositive_pieces(cal: Calibration, cfg: Config, plan) -> list[str]:
    """The pieces of `plan`'s costs whose calibrated time at its shape is <= 0.

    A fit extrapolated far from the measured shapes can reach zero (`Fit.at` clamps it
    there), e.g. both split pieces of a small block at a small micro-batch: a cost of zero
    is no cost at all, so the tuner prices such a plan by FLOPs instead and says so.
    """
    b, k = micro_batch_size(cfg, plan), plan.tp
    split = plan.pp > 1 and plan.schedule.split_backward
    return [q for q in quantities_for(cfg, plan, split) if cal.seconds(q, b, k) <= 0]


def costs_for_config(cal: Calibration, cfg: Config, plan, hw: HardwareProfile) -> Costs:
    """Simulator :class:`Costs` of the plan ``cfg`` from a calibration.

    Args:
      cal: calibration of ``cfg``'s model (measured on the machine ``hw`` describes).
      cfg: the candidate config (model and batch).
      plan: its `ParallelPlan` (mesh, schedule with its transfer latency, overlap).
      hw: the hardware profile (links).

    Returns:
      The :class:`Costs`.
    """
    from jax_overlap.pipeline.table import bubble_fraction

    schedule = plan.schedule
    bubble = bubble_fraction(schedule)
    fwd, bwd, wgt = compute_times(cal, cfg, plan, schedule.split_backward, bubble)
    return assemble_costs(cfg, plan, cal.profile(hw, plan), schedule.placement, fwd, bwd, wgt,
                          head_phase_time(cal, cfg, plan, bubble))


def head_phase_time(cal: Calibration, cfg: Config, plan, bubble: float = 0.0) -> float:
    """A vocabulary-parallel head's phase on one device: 1/pp of the measured head forward
    and backward (0 unless `plan.vocab_parallel`)."""
    if not plan.vocab_parallel:
        return 0.0
    b, k = micro_batch_size(cfg, plan), plan.tp
    scale = busy_scale(cfg, plan, cal.parallel_capacity, cal.devices, bubble)
    return cal.seconds("head_fb", b, k) * scale / plan.pp


# ------------------------------------------------------------ from timed callables


def time_call(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` with its result blocked on.

    Args:
      fn: zero-argument callable (a closure over its inputs), e.g. a jitted stage.
      repeats: timed calls.
      warmup: untimed calls first (compilation).

    Returns:
      Seconds.
    """
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(max(repeats, 1)):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def costs_from_measurement(
    forward_fns: Sequence[Callable[[], Any]],
    backward_fns: Sequence[Callable[[], Any]],
    weight_fns: Sequence[Callable[[], Any]] | None = None,
    *,
    act_bytes: float = 0.0,
    tp_bytes: Sequence[float] = (),
    param_bytes: Sequence[float] = (),
    stash_bytes: Sequence[float] = (),
    optimizer_factor: float = 2.0,
    repeats: int = 5,
    warmup: int = 1,
) -> Costs:
    """Costs from timing each virtual stage's compute on this machine.

    Args:
      forward_fns: per virtual stage, a zero-argument callable running its forward on
        one microbatch.
      backward_fns: per virtual stage, its backward: input gradients only when
        ``weight_fns`` is given, else the whole backward.
      weight_fns: per virtual stage, its weight-gradient backward, or None.
      act_bytes: boundary activation bytes per microbatch.
      tp_bytes: per virtual stage TP bytes per ``F`` / ``B`` (empty: none).
      param_bytes: per virtual stage parameter bytes (empty: zero).
      stash_bytes: per virtual stage held activation bytes (empty: ``act_bytes``).
      optimizer_factor: optimizer-state bytes per parameter byte.
      repeats: timed calls per function (median taken).
      warmup: untimed calls per function.

    Returns:
      The :class:`Costs`; without ``weight_fns`` the whole backward is ``backward_s``
      and ``weight_s`` is 0, which is right for non-split schedules.
    """
    if len(backward_fns) != len(forward_fns) or (
        weight_fns is not None and len(weight_fns) != len(forward_fns)
    ):
        raise ValueError("costs_from_measurement: need one callable per virtual stage in each list")
    fwd = tuple(time_call(f, repeats, warmup) for f in forward_fns)
    bwd = tuple(time_call(f, repeats, warmup) for f in backward_fns)
    wgt = (
        tuple(time_call(f, repeats, warmup) for f in weight_fns)
        if weight_fns
        else (0.0,) * len(fwd)
    )
    return Costs(
        forward_s=fwd,
        backward_s=bwd,
        weight_s=wgt,
        act_bytes=float(act_bytes),
        tp_bytes=tuple(float(x) for x in tp_bytes),
        param_bytes=tuple(float(x) for x in param_bytes),
        stash_bytes=tuple(float(x) for x in stash_bytes),
        optimizer_factor=optimizer_factor,
    )
