"""Per-device memory of a transformer train step, estimated from shapes alone (no tracing).

Used where a decision has to be made before anything is compiled: the plan's automatic
microbatch count and remat policy (`jax_overlap.plan.memory`), `analyze`'s hints, the preflight
check and the calibrated cost model's stash sizes. The terms are what XLA's buffer assignment holds at the
step's peak, read off deviceless compiles of GPT-1.3B for 8 x H100 (`compiled.
memory_analysis()` and XLA's memory-usage report; tests/test_memory_estimate.py keeps the
comparison, within 15% for dp8, dp2 x tp4, pp4 x dp2 1F1B and ZB-V, pp2 x dp2 x tp2 under
`none` and `full`):

* state: fp32 parameters and Adam's two moments (the step's arguments, updated in place), the
  fp32 gradient accumulator and, at pp = 1 with more than one microbatch, the microbatch's own
  gradient beside it. TP splits the blocks and the vocabulary, PP the layers (the embedding
  and the head are on every stage), ZeRO-1 the moments over dp, FSDP the blocks' parameters,
  gradients and moments over dp.
* kept for the backward: per layer and token what the remat policy leaves
  (`layer_token_bytes`; attention's part, which depends on the kernel, in
  `attention_token_bytes`), and under `none` the compute-dtype copy of each layer's weights.
  At pp = 1 for one microbatch (the layer scan stacks them). At pp > 1 the executor's residual
  pools hold them: `TickProgram.res_slots` slots plus a trash slot, each one microbatch of a
  chunk's layers (plus, on the plain attention path, the causal mask and the masked fill the
  chunk's vjp keeps per microbatch), and a split backward's pool of matmul-output gradients.
* working memory: one layer's residuals rebuilt while a recomputing policy backpropagates
  through it, or the fp32 logits of a microbatch, whichever is larger; at pp > 1 also one or
  two more copies of a slot's stacked residuals (`PIPELINE_SLOT_COPIES`), the activation stash
  (`TickProgram.slots` + 1 plus the inboxes), a chunk's weight gradients, with in-loop DP
  buckets the second copy of the stage's gradients the filing branch writes, and in paired
  ticks under a recomputing policy a share of the whole chunk's residuals
  (`PIPELINE_RECOMPUTE_SHARE`) instead of one layer's.

* at pp = 1 with gradient buckets that mix layers (`bucket_order: largest_first`), under a
  recomputing policy: a share of the last microbatch's residuals as if nothing were
  recomputed (`UNROLLED_RECOMPUTE_SHARE`): its layers are unrolled for the bucket hooks, and
  XLA's GPU scheduler runs their recomputes ahead of the backward. (Buckets packed per layer,
  the default, are reduced inside the layer scan's backward: nothing extra.)

Not counted: DP gradient buckets and FSDP's gathered blocks in flight (`resilience.preflight`
adds them as communication buffers), XLA's scheduler keeping buffers alive longer for overlap.
"""

from __future__ import annotations

from dataclasses import dataclass

# d-sized fp32 tensors one LayerNorm keeps per token for its backward: x - mean, the
# normalised x and the scaled one (the per-token rsqrt is noise).
NORM_FP32_TENSORS = 3
# tanh-GELU's residuals: its input and four d_ff-sized intermediates (compute dtype).
GELU_TENSORS = 5
# Extra copies of one residual slot's stacked tensors a pipeline step holds at its peak: the F's
# fresh residuals before they are filed into the pool and the B's read of its slot. XLA's buffer
# assignment gives them one buffer or two (GPT-1.3B deviceless: one at pp2 x dp2 x tp2, two at
# pp4 x dp2 1F1B); the estimate takes the middle.
PIPELINE_SLOT_COPIES = 1.5
# Inboxes of a pipeline step: one per ring direction, and the local hand-off.
PIPELINE_INBOXES = 3
# Share of a whole chunk's residuals (`remat: none`, every layer of the chunk) a paired tick
# (F and B in one branch) holds at its peak under a recomputing policy: the F's forward and the
# B's recompute of the chunk run in the same branch and XLA schedules the layers ahead of the
# backward, so more than one layer's residuals are live at once (GPT-1.3B deviceless for
# 8 x H100, remat full: about 0.5 of a 12-layer chunk at pp2 x dp2 x tp2, 0.25-0.4 of a
# 6-layer chunk at pp4 x dp2; unpaired ticks hold one layer's, as the estimate had it).
PIPELINE_RECOMPUTE_SHARE = 0.45
# Share of the last microbatch's residuals under `remat: none` (every layer) XLA holds at pp = 1
# with gradient buckets that mix layers (`bucket_order: largest_first`) under a recomputing
# policy: the layers are unrolled for the bucket hooks and the recomputes run ahead of the
# backward. Measured on deviceless 8 x H100 compiles, remat full, when every bucket ran that
# way: GPT-1.3B dp8 0.29-0.34, dp2 x tp4 0.55, Llama-3-8B dp2 x tp4 0.16; the low side.
UNROLLED_RECOMPUTE_SHARE = 0.2
# Whole-sequence activations (B, T, d_model) in the compute dtype that collective matmul's
# unrolled ring steps hold at pp = 1 (`parallel.collective_matmul`), beside a layer's
# recompute or the head's logits (its gather is a ring too): the chunks in flight, the partial
# outputs and the accumulators of both ring directions.
# Deviceless 8 x H100, remat full, m 2, bidirectional rings: GPT-1.3B dp2 x tp4 +3.3 GiB over
# the scanned rings (6.6 sequences of 512 MiB), Llama-3-8B dp2 x tp4 +5.5 GiB (5.5 of 1 GiB).
RING_STEP_SEQUENCES = 6


def dtype_bytes(precision: str) -> int:
    """Bytes per activation element: 2 under bf16/fp16 compute, else 4."""
    return 2 if precision in ("bf16", "fp16") else 4


def _fused(attention) -> bool:
    """`attention` as "fused"/"plain" (the resolved `model.attention`) or a bool."""
    return attention is True or attention == "fused"


@dataclass(frozen=True)
class AttentionBytes:
    """Bytes per token that attention adds to what one layer keeps for its backward.

    Attributes:
      layer: per layer (the score-sized tensors of the plain path, the fused kernel's output
        and log-sum-exp).
      chunk: per microbatch of a pipeline chunk, once for all its layers: the causal mask and
        the masked fill the chunk's vjp keeps (the layer scan hoists them; at pp = 1 XLA folds
        them into the backward).
    """

    layer: float
    chunk: float = 0.0


def attention_token_bytes(model, tp: int, precision: str, *, fused, remat: str = "none",
                          pipelined: bool = False) -> AttentionBytes:
    """What one layer's attention keeps per token for its backward, on one TP rank (heads split
    over tp), by kernel and remat policy.

    Args:
      model: the model config (d_model, heads, seq_len).
      tp: tensor-parallel degree.
      precision: "fp32", "bf16" or "fp16" (the probabilities are in the compute dtype).
      fused: the fused attention kernel (`model.attention: fused`, "fused" or True): no
        [b, h, T, T] tensor is kept, only the kernel's output and fp32 log-sum-exp per head.
      remat: `none` keeps the plain path's fp32 masked scores and the probabilities;
        `save_dots` the scores and context matmul outputs (the fused kernel is no dot, so it
        is recomputed); `full` / `minimal` nothing.
      pipelined: a pipeline chunk's residual pool (`AttentionBytes.chunk`).
    """
    a = dtype_bytes(precision)
    heads = model.heads / tp
    scores = heads * model.seq_len  # [h, T] per token: one row of the [b, h, T, T] scores
    if _fused(fused):
        layer = (a * model.d_model / tp + 4 * heads) if remat == "none" else 0.0
        return AttentionBytes(layer)
    if remat == "none":
        # fp32 masked scores and the probabilities; a pipeline slot also keeps the causal mask
        # (bool) and the fp32 fill, broadcast to [b, h, T, T] once per chunk.
        return AttentionBytes((4 + a) * scores, (1 + 4) * scores if pipelined else 0.0)
    if remat == "save_dots":
        return AttentionBytes(a * scores + a * model.d_model / tp)
    return AttentionBytes(0.0)


def layer_token_bytes(model, tp: int, precision: str, remat: str = "none", *,
                      attention="plain", sequence_parallel: bool = False,
                      pipelined: bool = False, split_backward: bool = False,
                      ring_steps: bool = False) -> float:
    """Bytes per token one transformer layer keeps between its forward and its backward under
    a remat policy (`parallel/remat.py`), on one TP rank.

    `none`: each norm's fp32 statistics (`NORM_FP32_TENSORS`, split over the sequence under
    sequence parallelism) and its output as the next matmul's input (gathered: full length);
    q, k, v and the context; tanh-GELU's input and intermediates (`GELU_TENSORS`, d_ff split);
    attention's part (`attention_token_bytes`). `full`: the block's input. `save_dots` /
    `minimal`: the block's input and the projections' outputs (q/k/v, the attention output's
    partial sums, the MLP input; a custom-vjp matmul's named by `remat.kept_matmul`); with
    collective matmul's `ring_steps` the attention output is kept after the ring's
    reduce-scatter, the rank's chunk. A split backward (ZB schedules) also keeps each weight
    matmul's input for W when a policy recomputes.
    """
    a = dtype_bytes(precision)
    d, f = model.d_model, model.d_ff
    s = tp if sequence_parallel else 1
    att = attention_token_bytes(model, tp, precision, fused=attention, remat=remat,
                                pipelined=pipelined)
    if remat == "none":
        norms = 2 * (NORM_FP32_TENSORS * 4 * d / s + a * d)
        projections = 4 * a * d / tp  # q, k, v, the context
        mlp = GELU_TENSORS * a * f / tp
        return norms + projections + mlp + att.layer
    kept = a * d / s  # the block's input
    if remat in ("save_dots", "minimal"):
        # q/k/v, the attention output (partial sums, or the ring's reduced chunk), MLP input
        kept += a * (3 * d / tp + (d / tp if ring_steps else d) + f / tp)
    if remat == "save_dots":
        kept += att.layer
    if split_backward:
        # W's inputs: both norms' outputs, the context, GELU's output. (The zero addends B
        # pulls the matmuls' output gradients from are handed to it again, not kept.)
        kept += a * (2 * d + d / tp + f / tp)
    return kept


def layer_residual_bytes(model, micro_batch: int, tp: int, precision: str,
                         attention="plain", *, sequence_parallel: bool = False) -> float:
    """Residual bytes one transformer layer keeps for its backward with nothing recomputed
    (`model.remat: none`), for one microbatch on one TP rank (`layer_token_bytes`)."""
    return micro_batch * model.seq_len * layer_token_bytes(
        model, tp, precision, "none", attention=attention,
        sequence_parallel=sequence_parallel)


def layer_stash_bytes(model, micro_batch: int, tp: int, precision: str,
                      remat: str = "none", attention="plain", *,
                      sequence_parallel: bool = False, pipelined: bool = False) -> float:
    """What one layer keeps between its forward and its backward under a remat policy, for one
    microbatch on one TP rank (`layer_token_bytes`)."""
    return micro_batch * model.seq_len * layer_token_bytes(
        model, tp, precision, remat, attention=attention,
        sequence_parallel=sequence_parallel, pipelined=pipelined)


def routed_expert_elements(model) -> float:
    """Elements of one layer's routed experts (gate, up and down of every expert; 0 for a
    dense model): the part `mesh.ep` stores split over dp."""
    experts = getattr(model, "experts", 0)
    return float(experts * 3 * model.d_model * model.d_ff) if experts else 0.0


@dataclass(frozen=True)
class PipelineSlots:
    """The slot counts of a pipeline step's pools (`TickProgram.slots`, `res_slots`).

    Attributes:
      stash: activation stash slots per stage.
      chunk: residual slots of the chunks' vjps.
      first, last: residual slots of the embedding's and the head's vjps.
      dz: a split backward's slots of matmul-output gradients (0 without).
      chunks: chunks per stage (virtual stages).
    """

    stash: int
    chunk: int
    first: int
    last: int
    dz: int = 0
    chunks: int = 1

    @classmethod
    def of_program(cls, program) -> "PipelineSlots":
        """From a compiled `jax_overlap.pipeline.program.TickProgram`."""
        res = dict(program.res_slots)
        return cls(program.slots, res.get("chunk", 0), res.get("first", 0),
                   res.get("last", 0), res.get("dz", 0), program.schedule.virtual_stages)

    @classmethod
    def rough(cls, pp: int, microbatches: int, virtual_stages: int = 1) -> "PipelineSlots":
        """Without a program: a 1F1B-like stage 0 with `pp` microbatches in flight per chunk."""
        n = min(pp, max(microbatches, 1)) * virtual_stages
        return cls(n + 1, n, n, 1, 0, virtual_stages)


@dataclass(frozen=True)
class StepMemory:
    """Estimated peak bytes per device of one train step, by part (see the module docstring).

    Attributes:
      state: parameters, optimizer moments and gradient buffers.
      kept: what the backward keeps: layer residuals and weight copies (pp = 1), residual
        pools (pp > 1).
      work: working memory on top: recomputed layer, score gradient, logits; at pp > 1 the
        slot copies and the activation stash.
    """

    state: float
    kept: float
    work: float

    @property
    def total(self) -> float:
        return self.state + self.kept + self.work


def step_memory(model, micro_batch: int, tp: int, pp: int, dp: int, precision: str, *,
                params: tuple[float, float], zero1: bool = False, fsdp: bool = False, remat: str = "none",
                attention="plain", microbatches: int = 1, sequence_parallel: bool = False,
                slots: PipelineSlots | None = None, split_backward: bool = False,
                vocab_parallel: bool = False, paired: bool = False,
                buckets_in_loop: bool = False, unrolled_buckets: bool = False,
                ep: int = 1, ring_steps: bool = False,
                paired_microbatches: bool = False) -> StepMemory:
    """Estimated peak bytes per device of one train step, by part.

    Args:
      model: the model config (`cfg.model`: layers, d_model, heads, d_ff, vocab, seq_len).
      micro_batch: sequences per microbatch on one replica.
      tp, pp, dp: mesh axis sizes.
      params: (embedding + head elements, elements of one block), unsplit: the model's own
        count (`model_api.param_elements`, `ParallelPlan.param_elements`).
      precision: "fp32", "bf16" or "fp16".
      zero1: Adam's moments split over dp.
      fsdp: block parameters, gradients and moments split over dp.
      remat: the `model.remat` policy (`layer_token_bytes`).
      attention: the resolved `model.attention`, "plain" or "fused" (`attention_token_bytes`).
      microbatches: per replica per step (pp = 1: more than one keeps a second gradient).
      sequence_parallel: TP splits the residual stream over the sequence (`overlap.tp_comm`
        sequence_parallel or collective_matmul with tp > 1).
      slots: the pipeline's pool sizes (pp > 1; default `PipelineSlots.rough`).
      split_backward: the schedule splits B and W (ZB-H1, ZB-V).
      vocab_parallel: the head runs over pp (`pipeline.vocab_parallel`): no head pool, the
        logits split over tp x pp.
      paired: paired F + B ticks (`pipeline.paired`; `PIPELINE_RECOMPUTE_SHARE`).
      buckets_in_loop: a pipeline's DP gradient buckets run inside the tick loop: the filing
        branch writes a new copy of the stage's f32 gradients beside the loop's.
      unrolled_buckets: pp = 1 with DP gradient buckets that mix layers (`overlap.bucket_order:
        largest_first`): the last microbatch's layers run unrolled for their hooks
        (`UNROLLED_RECOMPUTE_SHARE`). Buckets packed per layer are reduced in the layer
        scan's backward and cost nothing here.
      ring_steps: collective matmul's ring steps at pp = 1 (`overlap.tp_comm:
        collective_matmul`, tp > 1): unrolled, a ring's chunks in flight, partial outputs
        and accumulators are live at once beside the recomputed layer or the logits
        (`RING_STEP_SEQUENCES`).
      paired_microbatches: pp = 1, a microbatch's forward beside the previous one's
        backward (`overlap.pair_microbatches`): two microbatches' residuals are kept, and
        the layers run unrolled (`UNROLLED_RECOMPUTE_SHARE`).
      ep: `mesh.ep`; above 1 the routed experts, their gradients and moments are stored
        split over dp (E/dp per rank, models/moe.py) and a layer's compute copy holds the
        ep slot's E/ep.
    """
    a = dtype_bytes(precision)
    d = model.d_model
    s = tp if sequence_parallel and tp > 1 else 1
    tokens = micro_batch * model.seq_len
    embed, block = params
    layers = model.layers / pp
    routed = routed_expert_elements(model) if ep > 1 else 0.0  # per layer, all E experts
    block_elems = (block - routed) / tp / (dp if fsdp else 1) + routed / tp / dp
    other = layers * (block - routed) / tp / (dp if fsdp else 1) + embed / tp
    elems = other + layers * routed / tp / dp
    moments = 8 * (elems - other / dp * (dp - 1) if zero1 and not fsdp else elems)
    grads = 4 * elems * (2 if pp == 1 and microbatches > 1 else 1)
    state = 4 * elems + moments + grads
    # The compute-dtype copy of a layer's weights (none keeps it; fp32 needs no copy).
    copies = (a * (block - routed + routed / ep) / tp) if a < 4 else 0.0
    pipelined = pp > 1
    rings = ring_steps and tp > 1 and not pipelined
    per_token = layer_token_bytes(model, tp, precision, remat, attention=attention,
                                  sequence_parallel=s > 1, pipelined=pipelined,
                                  split_backward=split_backward and pipelined,
                                  ring_steps=rings)
    att = attention_token_bytes(model, tp, precision, fused=attention, remat=remat,
                                pipelined=pipelined)
    # A recomputing policy rebuilds one layer's residuals at a time in the backward.
    redo = 0.0
    if remat != "none":
        redo = tokens * layer_token_bytes(model, tp, precision, "none", attention=attention,
                                          sequence_parallel=s > 1) + copies
    # The fp32 logits of one microbatch (the head's peak, when no layer is being rebuilt).
    logits = tokens * 4 * model.vocab / tp / (pp if vocab_parallel else 1)
    work = max(redo, logits)
    if rings:  # beside a layer's and the head's GEMMs alike
        work += RING_STEP_SEQUENCES * tokens * a * d
    if not pipelined:
        kept = layers * (tokens * per_token + (copies if remat == "none" else 0.0))
        if paired_microbatches:
            kept *= 2
        if (unrolled_buckets or paired_microbatches) and remat != "none":
            kept += UNROLLED_RECOMPUTE_SHARE * layers * (redo - copies)
        return StepMemory(float(state), float(kept), float(work))
    slots = slots or PipelineSlots.rough(pp, microbatches)
    chunk_layers = layers / max(slots.chunks, 1)
    stacked = chunk_layers * tokens * per_token  # one slot's per-layer residuals
    act = tokens * a * d / s  # one microbatch's activations between stages
    if (paired or split_backward) and remat != "none":
        # A chunk run unrolled (paired ticks, a split backward) keeps its first layer's input
        # as the chunk's own, in the activation stash, not in this slot.
        stacked -= act
    slot = stacked + tokens * att.chunk + (chunk_layers * copies if remat == "none" else 0.0)
    kept = (slots.chunk + 1) * slot
    kept += (slots.first + 1) * 2.5 * act  # the embedding's residuals and its output
    if not vocab_parallel:
        kept += (slots.last + 1) * act  # the head's input
    if slots.dz and split_backward:  # (the program counts them for any split schedule)
        dz = chunk_layers * tokens * a * (3 * d / tp + 2 * d + model.d_ff / tp)
        kept += (slots.dz + 1) * dz
    if paired and remat != "none":  # more than one layer live (see the constant)
        chunk_redo = PIPELINE_RECOMPUTE_SHARE * chunk_layers * (redo - copies)
        work = max(chunk_redo + copies, logits) if chunk_redo > redo else work
    work += PIPELINE_SLOT_COPIES * stacked + (slots.stash + 1 + PIPELINE_INBOXES) * act
    # The chunk's weight gradients before they join the accumulator; with in-loop buckets the
    # new accumulator the filing branch writes beside the one the loop carries.
    work += 4 * chunk_layers * block_elems + (4 * elems if buckets_in_loop else 0.0)
    return StepMemory(float(state), float(kept), float(work))


def step_bytes(model, micro_batch: int, tp: int, pp: int, dp: int, precision: str, *,
               params: tuple[float, float], zero1: bool = False, fsdp: bool = False,
               remat: str = "none", attention="plain", **details) -> float:
    """Estimated peak bytes per device of one train step (`step_memory(...).total`; `details`
    are its keyword arguments: microbatches, sequence_parallel, slots, split_backward,
    vocab_parallel)."""
    return step_memory(model, micro_batch, tp, pp, dp, precision, params=params, zero1=zero1,
                       fsdp=fsdp, remat=remat, attention=attention, **details).total


def plan_step_memory(model, precision: str, plan) -> StepMemory:
    """`step_memory` of a built `ParallelPlan` (its mesh and expert parallelism,
    microbatching, remat policy, attention kernel, TP mode and pipeline program)."""
    ov = plan.overlap
    program = plan.program
    return step_memory(
        model, plan.micro_batch, plan.tp, plan.pp, plan.dp, precision,
        params=plan.param_elements, zero1=ov.zero1,
        fsdp=ov.fsdp, remat=plan.remat, attention=getattr(plan, "attention", "plain"),
        microbatches=plan.microbatches, sequence_parallel=ov.tp_comm != "plain",
        slots=PipelineSlots.of_program(program) if program is not None else None,
        split_backward=plan.split_backward, vocab_parallel=plan.vocab_parallel,
        paired=program is not None and bool(program.schedule.paired),
        buckets_in_loop=program is not None and ov.buckets_in_loop,
        unrolled_buckets=(program is None and ov.grad_bucket_bytes > 0 and not ov.fsdp
                          and ov.bucket_order == "largest_first"),
        ep=plan.ep, ring_steps=ov.tp_comm == "collective_matmul",
        paired_microbatches=program is None and ov.pair_microbatches)
