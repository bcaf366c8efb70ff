"""One typed config tree, loaded from YAML with `--set section.key=value` overrides.

Every user error (missing file, unknown key, wrong type, a combination that cannot work) is
collected into a `ConfigError` whose lines each name the field and the fix; the CLI prints them
and exits with code 2. This module imports no JAX, so the CLI can read the config (and size the
forced CPU device count) before the backend starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin

import yaml

from jax_overlap.errors import ConfigError  # defined low, raised here and re-exported


@dataclass
class MeshConfig:
    dp: int = 1  # data-parallel replicas
    pp: int = 1  # pipeline stages
    tp: int = 1  # tensor-parallel shards (Megatron-style, inside each block)
    # Slow data axis, outermost: groups of dp x pp x tp devices on different hosts (or slices)
    # joined by a slow link. The batch is split over (dcn, dp); gradients are reduced over dp
    # first, so only 1/dp of them crosses dcn (docs/guides/slow_links.md).
    dcn: int = 1
    # Expert parallelism (model.experts > 0): the routed experts are stored split over dp
    # (each rank holds experts/dp of them, with their gradients and optimizer state); ep
    # slots of dp/ep consecutive ranks each serve experts/ep, gathered from the slot's ranks.
    # Tokens travel to their experts and back by all-to-alls among ep ranks, one per slot.
    # Must divide dp; model.experts must be divisible by dp.
    ep: int = 1
    # Per-device bandwidth of the slow link in Gb/s: what the plan's slow-axis decisions and
    # the exposed-time estimate in metrics.jsonl assume.
    dcn_gbps: float = 100.0


@dataclass
class ModelConfig:
    # gpt (decoder), llama (RMSNorm, RoPE, SwiGLU, grouped-query attention), bert (MLM
    # encoder) or resnet (image classifier); your own: docs/guides/custom_models.md
    kind: Literal["gpt", "bert", "resnet", "llama"] = "gpt"
    layers: int = 4  # blocks; divisible by pp x virtual_stages (or set pipeline.stage_layers)
    d_model: int = 128  # hidden size
    heads: int = 4  # attention heads; divisible by mesh.tp
    d_ff: int = 512  # feed-forward hidden size (llama: the SwiGLU's); divisible by mesh.tp
    # >= the tokenizer's size (256 for bytes); auto: the data's tokenizer size (the shards'
    # index for data.source=tokens, else data.tokenizer) rounded up to a multiple of mesh.tp
    vocab: int | Literal["auto"] = 256
    seq_len: int = 64  # tokens per sequence
    tied_embeddings: bool = True  # output layer reuses the token embedding
    # What each block keeps for its backward (jax_overlap/parallel/remat.py): none keeps
    # everything; full keeps only the block input and recomputes; save_dots / minimal keep
    # (weight) matmul outputs; auto on a GPU: minimal where it fits at pp = 1 with
    # collective-matmul rings and in a pipeline at tp = 1 (plan.RING_REMAT_WHY,
    # PIPELINE_REMAT_WHY), else full (moving kept residuals through memory costs more than the
    # recompute: plan.GPU_REMAT_WHY); none on a CPU but full in a pipeline.
    remat: Literal["auto", "none", "full", "save_dots", "minimal"] = "auto"
    # Attention kernel (jax_overlap/parallel/attention.py): fused is cuDNN flash attention
    # (GPU, bf16/fp16, head dim a multiple of 8 up to 128); plain the einsum path that
    # materialises the [b, h, T, T] probabilities; auto fused where the target allows it.
    attention: Literal["auto", "fused", "plain"] = "auto"
    # Llama (the other models ignore the Llama keys; docs/guides/data_and_hf.md): key/value
    # heads of grouped-query attention (0: = heads); split over tp when kv_heads >= tp,
    # replicated otherwise.
    kv_heads: int = 0
    rope_theta: float = 10000.0  # Llama: the RoPE base
    rope_scaling: Literal["none", "llama3"] = "none"  # Llama: Llama-3.1 frequency scaling
    rope_factor: float = 8.0  # Llama, rope_scaling llama3: the scaling factor
    rope_low_freq_factor: float = 1.0  # Llama, rope_scaling llama3: low-frequency factor
    rope_high_freq_factor: float = 4.0  # Llama, rope_scaling llama3: high-frequency factor
    rope_original_max_len: int = 8192  # Llama, rope_scaling llama3: the pre-training length
    norm_eps: float = 1e-5  # Llama: the RMSNorm epsilon
    # Mixture of experts (Llama only, models/moe.py; d_ff is each expert's hidden size):
    # experts per MoE layer (0: dense).
    experts: int = 0
    experts_per_token: int = 2  # MoE: the router's top-k
    # MoE: each expert's capacity per sequence, `dropless` (never drops) or a factor of the
    # even share (ceil(factor * seq_len * k / experts) tokens, the rest dropped, first
    # choices first).
    expert_capacity: float | Literal["dropless"] = "dropless"
    shared_experts: int = 0  # MoE: experts every token passes through
    moe_every: int = 1  # MoE: every moe_every-th layer is MoE (the others dense)
    router_aux_loss: float = 0.01  # MoE: the load-balancing loss coefficient
    router_z_loss: float = 0.001  # MoE: the router z-loss coefficient


@dataclass
class DataConfig:
    # stdlib: the Python standard library's own source text (present on every machine);
    # file: `path` to a UTF-8/bytes text file; synthetic: a learnable random Markov stream;
    # tokens: `path` to a `jax-overlap prepare-data` directory (token shards, read by Grain).
    source: Literal["stdlib", "file", "synthetic", "tokens"] = "stdlib"
    path: str = ""  # the text file (file) or prepare-data directory (tokens)
    max_bytes: int = 8_000_000  # how much of the corpus to load (stdlib, file)
    # bytes, or a Hugging Face tokenizer.json for stdlib/file (tokens: the shards' own; a path
    # given here must be the one they were made with)
    tokenizer: str = "bytes"
    # Written by train into a run's config.json (a config need not set it): the kind of the
    # tokenizer the run's tokens were made with; the run dir keeps that tokenizer.json
    # (jax_overlap/data/run_tokenizer.py).
    tokenizer_kind: Literal["", "bytes", "tokenizers", "synthetic"] = ""
    tokenizer_sha256: str = ""  # written by train: the sha256 of that tokenizer
    # stdlib/file/synthetic: the corpus's last fraction, held out for train.eval_every
    # (tokens: the split prepare-data --val-fraction wrote)
    val_fraction: float = 0.05


@dataclass
class TrainConfig:
    steps: int = 100  # optimizer steps
    seed: int = 0  # initialisation, data order and sampling all derive from (seed, step)
    global_batch: int = 16  # sequences per optimizer step, over all devices
    lr: float = 3e-3  # peak learning rate
    warmup_steps: int = 10  # linear warmup to lr, then cosine decay
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.01  # decoupled (AdamW / LAMB)
    grad_clip: float = 1.0  # global-norm clipping; 0 disables
    # bf16 / fp16: that compute dtype, fp32 master weights; fp16 adds dynamic loss scaling
    # (training/loss_scale.py): start at loss_scale_init, x2 after loss_scale_growth_interval
    # clean steps, /2 and the step skipped on overflow.
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    loss_scale_init: float = 65536.0  # fp16: the first loss scale
    loss_scale_growth_interval: int = 2000  # fp16: clean steps before the scale doubles
    optimizer: Literal["adamw", "lamb"] = "adamw"  # lamb: layer-wise trust ratios (large batches)
    log_every: int = 1  # metrics.jsonl gets every step; the progress bar refreshes this often
    eval_every: int = 0  # held-out loss and perplexity every this many steps; 0: off
    eval_batches: int = 4  # global batches of held-out data per evaluation
    # Every this many steps, a few continuations of sample_prompt ("": a default) of
    # sample_tokens tokens (fewer if model.seq_len is shorter) in metrics.jsonl and
    # TensorBoard's text tab (jax_overlap/training/sample_hook.py); 0: off
    sample_every: int = 0
    sample_prompt: str = ""  # the prompt of sample_every ("": a default)
    sample_tokens: int = 32  # tokens per sample_every continuation


@dataclass
class PipelineConfig:
    # auto: the plan picks (plan.schedule.AUTO_SCHEDULE_WHY): on a GPU interleaved 1F1B for a
    # decoder whose layers split evenly into two chunks per stage (virtual_stages auto: 3 or 4
    # chunks of >= 2 layers where the layers split so, else 2), else 1f1b (paired on a GPU);
    # interleaved where virtual_stages > 1 is given.
    schedule: Literal["auto", "gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"] = "auto"
    # Per data-parallel replica per step; also gradient accumulation when pp=1. auto: the plan
    # picks (1 on CPU at pp=1; on a GPU the microbatch that keeps GEMMs large and fits memory).
    microbatches: int | Literal["auto"] = "auto"
    # Chunks per pipeline stage. auto follows the schedule when the config is loaded
    # (`resolve_virtual_stages`): 2 for interleaved and zb-v at mesh.pp > 1, else 1; on a GPU
    # the plan may make it 3 or 4 for interleaved (2 from 1 where it picks interleaved under
    # schedule auto): `PlanDecides`, plan.schedule.INTERLEAVED_CHUNKS.
    virtual_stages: int | Literal["auto"] = "auto"
    # Ticks between stages: 1 sends each tick's output between ticks (on the critical path);
    # 2 sends it beside the next tick's compute, so every transfer hides under a tick of GEMMs,
    # at the price of a longer ramp (bubble L(p-1)/(m+L(p-1)) for 1F1B) and more activations.
    # auto: 1, or 2 on a GPU where a transfer outlasts the GEMMs it would hide under and the
    # step still fits (plan.schedule.AUTO_LATENCY_WHY); 1 on a CPU.
    transfer_latency: int | Literal["auto"] = "auto"
    # Paired ticks: a stage may run one forward and one backward (of other microbatches) in
    # the same tick, so steady-state ticks cost alike on every stage and each stage-to-stage
    # transfer hides under the tick's other action (zb-h1 / zb-v: a W may take either lane).
    # Needs transfer_latency 1; holds up to twice the unpaired schedule's activations per
    # stage. auto: on a GPU at latency 1, off on a CPU (collectives are synchronous there;
    # pairing only adds permutes).
    paired: bool | Literal["auto"] = "auto"
    # Paired tables only: run a tick's two actions as one switch over the (forward, backward)
    # pairs the table takes, so each lane's collectives inside its action (tensor-parallel
    # all-gathers / reduce-scatters, expert all-to-alls) run under the other lane's GEMMs; the
    # stage-to-stage transfers then run between ticks. false: each lane its own switch, each
    # transfer under the other lane. auto: on a GPU where the actions hold collectives
    # (tp > 1 or ep > 1), else off (plan.schedule.FUSED_PAIRS_WHY).
    fused_pairs: bool | Literal["auto"] = "auto"
    # Paired tables only: steps of a search over which ticks run pairs, so the actions
    # sharing a lockstep tick cost alike at tick_costs (0: one pairing rule for the whole
    # step; ~35 ms a step at p = 4, m = 16, done once when the plan is built).
    pair_search: int = 0
    # Paired tables only: [F, B, W], measured per-action tick times (`bench/pipeline.py`
    # prints them) or ratios; null: equal.
    tick_costs: list[float] | None = None
    # Layers per virtual stage, in model order (pp x virtual_stages counts summing to
    # model.layers): even (equal chunks), balanced (by cost, counting the embedding on the
    # first virtual stage and the LM head + loss on the last), auto (balanced on a GPU; on a
    # CPU even where the layers divide), or an explicit list.
    stage_layers: Literal["even", "balanced", "auto"] | list[int] = "auto"
    # Vocabulary-parallel LM head: instead of the last virtual stage's stage running the
    # whole head and loss, every stage computes the logits of 1/pp of the vocabulary for
    # each microbatch (its last hidden state broadcast over pp, the softmax statistics and
    # the hidden state's gradient summed over pp), so no stage carries the head's ~2 layers
    # of extra work. Needs pp > 1, a model whose head supports it (the built-in decoders)
    # and vocab / tp divisible by pp. auto: on a GPU at pp > 1 where the model supports it
    # (plan.derived.AUTO_VOCAB_PARALLEL_WHY); off on CPU.
    vocab_parallel: bool | Literal["auto"] = "auto"
    # zb-h1 / zb-v: W as only the weight-gradient GEMMs (F keeps each weight matmul's input
    # and B its output gradient in stash slots until W) or as the chunk's whole backward.
    # auto: split (plan.schedule.AUTO_SPLIT_WHY).
    split_backward: bool | Literal["auto"] = "auto"


@dataclass
class OverlapConfig:
    # 0: one reduction per gradient leaf, after the backward. auto: the plan picks (64 MiB
    # buckets issued during the backward on a GPU with dp > 1; 0 on a CPU).
    grad_bucket_mb: float | Literal["auto"] = "auto"
    # backward: buckets in the order the backward completes them (last layer first)
    bucket_order: Literal["backward", "largest_first"] = "backward"
    # backward order: reduce the embedding's gradients before the first layer's, so the
    # first layer's weight-gradient GEMMs can hide them (see buckets.pack_units); pays off
    # when the embedding's bucket is above XLA's combine threshold (configs/gpt_1p3b.yaml).
    # auto: on where gradients go in buckets in backward order on a GPU.
    embed_before_first_layer: bool | Literal["auto"] = "auto"
    # Shard the optimizer state over dp (psum_scatter + all_gather). auto: on a GPU with
    # dp > 1 where a replica's step does not fit without it; off on a CPU.
    zero1: bool | Literal["auto"] = "auto"
    # Expert parallelism (mesh.ep > 1): each MoE layer sends its tokens in this many chunks,
    # software-pipelined: chunk i's expert GEMMs run beside chunk i+1's dispatch and chunk
    # i-1's combine all-to-alls; from 3 chunks the first and the last are half-size, their
    # all-to-alls having no GEMM of the layer to hide under (models/moe.py).
    # auto: 6 on a GPU with ep > 1, else 1; 1 where microbatches pair (pipeline.fused_pairs,
    # overlap.pair_microbatches), the other one's GEMMs hiding the all-to-alls.
    moe_chunks: int | Literal["auto"] = "auto"
    # pp = 1: the microbatch loop runs microbatch i+1's forward and microbatch i's backward
    # as one computation (their layers unrolled), so each one's all-to-alls and TP
    # collectives run under the other's GEMMs (DualPipe's overlap without a pipeline); one
    # more microbatch's residuals are kept. auto: on a GPU with expert parallelism (ep > 1),
    # two microbatches or more and no FSDP; off elsewhere (plan.comm.PAIR_MICROBATCHES_WHY).
    pair_microbatches: bool | Literal["auto"] = "auto"
    grad_comm_dtype: Literal["fp32", "bf16"] = "fp32"  # bf16 halves dp gradient traffic
    # auto: the plan picks fsdp on a GPU where a replica's step does not fit even at one
    # sequence per microbatch under remat full, replicated otherwise.
    param_sharding: Literal["auto", "replicated", "fsdp"] = "auto"
    window: int = 2  # fsdp: all-gather block l+window while block l computes
    # auto: the plan picks (collective_matmul with tp > 1 on a GPU, plain elsewhere)
    tp_comm: Literal["auto", "plain", "sequence_parallel", "collective_matmul"] = "auto"
    # bi: a bidirectional ring (half the steps); auto: bi where seq_len / tp is even
    collective_matmul_direction: Literal["auto", "uni", "bi"] = "auto"
    # Fused pipeline ticks (pipeline.fused_pairs) that run one action have no other lane to
    # hide its sequence-parallel collectives: collective_matmul runs those actions' blocks
    # as collective matmul (the gather under the own sequence chunk's GEMM); same keeps
    # tp_comm. Needs model.remat: full (both then stash the same residuals). auto:
    # collective_matmul on a GPU at tp = 2 under fused pairs and sequence parallelism.
    lone_tp_comm: Literal["auto", "same", "collective_matmul"] = "auto"
    # What sequence parallelism (and grouped collective matmul at tp = 2) splits over TP
    # between blocks: each rank's positions of every sequence (Megatron's), or its share
    # of the microbatch's sequences. A GPU all-gather concatenates along the major-most
    # dim, so the gathered positions land sequence-major and every weight-gradient GEMM
    # transposes them first; gathered sequences are already in order. auto: batch where
    # the microbatch's sequences divide by tp and no collective-matmul ring cuts the
    # sequence; sequence elsewhere.
    sp_split: Literal["auto", "sequence", "batch"] = "auto"
    # XLA flag preset (overlap/xla_flags.py), applied before JAX starts. auto: gpu_overlap
    # when the step runs on (or is compiled for) a GPU, none on a CPU.
    xla_preset: str = "auto"
    # 1: the cross-dcn gradient reduction of step t runs under step t+1's compute and is
    # applied one step late (the dp reduction stays exact); needs mesh.dcn > 1. auto: the
    # plan picks 1 where a bucket's dcn transfer outlasts the compute it hides under even in
    # bf16 (on a GPU target; 0 on a CPU).
    dcn_delay: int | Literal["auto"] = 0
    # dtype of the gradient bytes that cross dcn (the dp reduction keeps grad_comm_dtype).
    # auto: bf16 where a bucket's fp32 dcn transfer outlasts the compute it hides under.
    dcn_comm_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    # DC-ASGD delay compensation of the one-step-late gradient: g + lambda * g * g * (the
    # update applied since it was computed); 0 applies it as it is.
    dcn_delay_compensation: float = 0.0
    # With dcn_delay 1, what arrives one step late (docs/guides/slow_links.md). gradient: the whole
    # reduced gradient, applied to the shared parameters (one device's training with each
    # gradient a step late). local: each dcn group applies its own update (from its fresh
    # fast-axis-reduced gradient) at once; the mean of the groups' updates replaces it one
    # step later, so the groups' parameters differ by at most their last own update.
    # local is the default: it trains within 1% of synchronous training where gradient ends
    # 35% above it (AdamW at lr 3e-3, bench/slow_axis.py --convergence).
    dcn_delay_mode: Literal["gradient", "local"] = "local"


@dataclass
class DilocoConfig:
    # Streaming DiLoCo over dcn (docs/guides/slow_links.md): each dcn group trains on its own for
    # inner_steps (H) steps per fragment sync; 0 is off. Needs mesh.dcn > 1.
    inner_steps: int = 0
    fragments: int = 1  # parameter fragments, synced in turn (every H / fragments steps)
    delay: int = 0  # tau: inner steps between issuing a fragment's sync and applying it
    outer_lr: float = 0.7  # outer Nesterov SGD
    outer_momentum: float = 0.9  # the outer Nesterov momentum
    # dtype the outer gradient crosses dcn in; int8 is per-fragment absmax scaled
    outer_dtype: Literal["fp32", "bf16", "int8"] = "bf16"
    # with delay > 0, how much of the local fragment is kept when the synced one arrives
    # (0: replaced; the Streaming DiLoCo paper's alpha)
    mix: float = 0.5


@dataclass
class CheckpointConfig:
    dir: str = ""  # empty: <run_dir>/checkpoints
    every_steps: int = 0  # 0 disables checkpointing
    keep: int = 3  # committed checkpoints kept
    async_save: bool = True  # write in the background while training continues
    # When committed checkpoints exist but none verifies: refuse (exit 2, nothing changed), or
    # restart from step 0 on purpose (the bad steps are quarantined, the summary lists them).
    on_unreadable: Literal["refuse", "restart"] = "refuse"
    # The fast local tier (docs/guides/fault_tolerance.md): a copy of every process's own
    # shards every `local_every` accepted steps, written in the background; 0 turns it off.
    # The newest step that verifies in either tier is resumed. Needs checkpoint.every_steps > 0.
    local_every: int = 0
    local_keep: int = 2  # local steps kept (1 or 2)
    local_dir: str = ""  # empty: /dev/shm/jax_overlap where it exists, else the system temp dir
    # A Hugging Face directory (config.json + safetensors) whose weights replace the random
    # initialisation (fine-tuning); the model config must match it (jax_overlap/hf/convert.py).
    init_from_hf: str = ""


@dataclass
class GuardConfig:
    enabled: bool = True  # skip non-finite or spiking steps in-graph, roll back after max_skips
    spike_sigma: float = 6.0  # a loss this many standard deviations above the window's is a spike
    window: int = 20  # steps of loss history the spike test uses
    max_skips: int = 3  # consecutive bad steps before a rollback
    skip_batches: int = 1  # batches skipped past the ones that caused a rollback
    lr_scale_on_rollback: float = 1.0  # multiply lr by this after each rollback


@dataclass
class FaultConfig:
    nan_at_step: int = -1  # inject a NaN loss at this step (drills and tests); -1 off
    spike_at_step: int = -1  # inject a loss spike at this step; -1 off
    # The persistent save of this step fails as if the disk were full (ENOSPC); -1 off
    disk_full_at_step: int = -1
    # Seconds every checkpoint save waits between its data and its commit marker (drills:
    # widens the window a kill can land in); 0 off
    commit_delay_s: float = 0.0


@dataclass
class DistributedConfig:
    coordinator: str = ""  # host:port of process 0; empty: from env or single process
    num_processes: int = 1  # processes in the run (one per host on GPUs)
    process_id: int = 0  # this process's rank, 0 .. num_processes - 1
    timeout_s: int = 300  # survivors give up on a lost process after this long


@dataclass
class Config:
    mesh: MeshConfig = field(default_factory=MeshConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    overlap: OverlapConfig = field(default_factory=OverlapConfig)
    diloco: DilocoConfig = field(default_factory=DilocoConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    @property
    def num_devices(self) -> int:
        return self.mesh.dcn * self.mesh.dp * self.mesh.pp * self.mesh.tp

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


# ---------------------------------------------------------------------------------------------
# Building the typed tree from plain data


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp: Any) -> str:
    if get_origin(tp) is list:
        return f"list of {_type_name(get_args(tp)[0])}"
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str, problems: list[str]) -> Any:
    """Checks one leaf value against its declared type; ints are accepted for floats."""
    if isinstance(tp, types.UnionType) or get_origin(tp) is typing.Union:
        # e.g. int | Literal["auto"]: the first arm that fits
        for arm in get_args(tp):
            trial: list[str] = []
            out = _coerce(value, arm, where, trial)
            if not trial:
                return out
        names = " or ".join(_type_name(a) for a in get_args(tp))
        problems.append(f"{where}: expected {names}, got {type(value).__name__} {value!r}")
        return None
    if get_origin(tp) is list:
        (item,) = get_args(tp)
        if isinstance(value, (list, tuple)):
            trial: list[str] = []
            out = [_coerce(v, item, f"{where}[{i}]", trial) for i, v in enumerate(value)]
            if not trial:
                return out
        problems.append(f"{where}: expected a list of {_type_name(item)}, got "
                        f"{type(value).__name__} {value!r}")
        return None
    if get_origin(tp) is Literal:
        choices = get_args(tp)
        if value in choices:
            return value
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        problems.append(f"{where}: {value!r} is not one of {_type_name(tp)}{hint}")
        return None
    if tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    problems.append(f"{where}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}; "
                    f"write a {_type_name(tp)} value")
    return None


def _build(cls, data: Any, where: str, problems: list[str]):
    if not isinstance(data, dict):
        problems.append(f"{where or 'config'}: expected a mapping of keys, got {type(data).__name__}")
        return cls()
    hints = _hints(cls)
    known = list(hints)
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in hints:
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.5)
            hint = f"did you mean '{(where + '.') if where else ''}{close[0]}'?" if close else (
                f"known keys: {', '.join(known)}")
            problems.append(f"{path}: unknown key; {hint}")
            continue
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value if value is not None else {}, path, problems)
        else:
            coerced = _coerce(value, tp, path, problems)
            if coerced is not None:
                kwargs[key] = coerced
    return cls(**kwargs)


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError([f"--set {text}: expected section.key=value, e.g. --set train.steps=10"])
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        raise ConfigError([f"--set {text}: the value is not valid YAML; quote it "
                           f"(--set '{key.strip()}=\"...\"') or fix the syntax"]) from None
    if not key.strip() or any(not k for k in key.strip().split(".")):
        raise ConfigError([f"--set {text}: expected section.key=value, e.g. --set train.steps=10"])
    return key.strip().split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Returns a copy of `data` with each `section.key=value` applied (values parsed as YAML)."""
    data = json.loads(json.dumps(data))
    for text in overrides:
        keys, value = _parse_override(text)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError([f"--set {text}: '{k}' is not a section"])
        node[keys[-1]] = value
    return data


def from_dict(data: dict) -> Config:
    problems: list[str] = []
    cfg = _build(Config, data, "", problems)
    if problems:
        raise ConfigError(problems)
    cfg = resolve_virtual_stages(cfg)
    cfg = resolve_vocab(cfg)
    validate(cfg)
    return cfg


class PlanDecides(int):
    """A count the config resolved from `auto` that the plan may still change for its target:
    `pipeline.virtual_stages` under `schedule: auto` (1 here; the plan's schedule choice may
    make it 2). Everything before the plan reads it as the int it is."""


def resolve_virtual_stages(cfg: Config) -> Config:
    """`pipeline.virtual_stages: auto` -> what the schedule places per stage: 2 for zb-v (its
    only value) and interleaved (the fewest it runs) at mesh.pp > 1, else 1 (a `PlanDecides`
    under `schedule: auto` and `interleaved`, whose chunks the plan picks on a GPU)."""
    pl = cfg.pipeline
    if pl.virtual_stages != "auto":
        return cfg
    v = 2 if cfg.mesh.pp > 1 and pl.schedule in ("interleaved", "zb-v") else 1
    if pl.schedule in ("auto", "interleaved"):
        v = PlanDecides(v)
    return dataclasses.replace(cfg, pipeline=dataclasses.replace(pl, virtual_stages=v))


def resolve_vocab(cfg: Config) -> Config:
    """`model.vocab: auto` -> the data's tokenizer size rounded up to a multiple of mesh.tp
    (of mesh.tp x mesh.pp under `pipeline.vocab_parallel`)."""
    if cfg.model.vocab != "auto":
        return cfg
    from jax_overlap.data.tokenizer import data_vocab, padded_vocab  # no JAX

    size, _ = data_vocab(cfg.data)
    return dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, vocab=padded_vocab(size, max(1, cfg.mesh.tp) * (
            cfg.mesh.pp if cfg.pipeline.vocab_parallel is True else 1))))


def load(path: str | os.PathLike | None, overrides: list[str] = ()) -> Config:
    """Loads a YAML config, applies overrides, checks it; raises ConfigError on any problem."""
    data: dict = {}
    if path is not None:
        data = _read_yaml(str(path))
    return from_dict(apply_overrides(data, list(overrides)))


def _read_yaml(path: str) -> dict:
    """The mapping a config file holds; ConfigError for anything that is not one.

    An empty file (or one holding only comments) is refused rather than read as "all
    defaults": an empty file is far more often a mistake than a choice. `{}` says it on purpose.
    """
    where = f"--config {path}"
    if not os.path.exists(path):
        raise ConfigError([f"{where}: file not found; pass an existing YAML file, "
                           f"e.g. configs/tiny.yaml"])
    if os.path.isdir(path):
        raise ConfigError([f"{where}: is a directory; pass a YAML file, e.g. configs/tiny.yaml"])
    try:
        with open(path, "rb") as f:
            raw = f.read(16 * 1024 * 1024 + 1)
    except OSError as e:
        raise ConfigError([f"{where}: cannot read it ({e.strerror}); check its permissions"]) from None
    if len(raw) > 16 * 1024 * 1024:
        raise ConfigError([f"{where}: larger than 16 MiB, not a config; pass a YAML file"])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError([f"{where}: not a text file (not UTF-8); pass a YAML config, e.g. "
                           f"configs/tiny.yaml"]) from None
    if "\x00" in text:
        raise ConfigError([f"{where}: not a text file (holds NUL bytes); pass a YAML config"])
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError([f"{where}: not valid YAML{at}; fix the syntax"]) from None
    if data is None:
        raise ConfigError([f"{where}: the file is empty; write the settings (see "
                           f"configs/tiny.yaml), or '{{}}' to train the built-in defaults on "
                           f"purpose"])
    if not isinstance(data, dict):
        raise ConfigError([f"{where}: holds a {type(data).__name__}, not a mapping of "
                           f"sections; write e.g. 'train: {{steps: 10}}'"])
    return data


def validate(cfg: Config) -> None:
    """Raises ConfigError listing every problem of `cfg` (`jax_overlap.config_validate`)."""
    from jax_overlap.config_validate import validate as check

    check(cfg)


def check_device_count(cfg: Config, available: int) -> None:
    """The mesh must use exactly the devices the job has."""
    if cfg.num_devices != available:
        m = cfg.mesh
        raise ConfigError([
            f"mesh: dcn x dp x pp x tp = {m.dcn} x {m.dp} x {m.pp} x {m.tp} = "
            f"{cfg.num_devices}, but {available} devices are available; make the product "
            f"{available} (e.g. --set mesh.dp={max(1, available // (m.dcn * m.pp * m.tp))})"])
