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
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin

import yaml


class ConfigError(ValueError):
    """A config that cannot work; `problems` holds one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


@dataclass
class MeshConfig:
    dp: int = 1  # data-parallel replicas
    pp: int = 1  # pipeline stages
    tp: int = 1  # tensor-parallel shards (Megatron-style, inside each block)
    # Slow data axis, outermost: groups of dp x pp x tp devices on different hosts (or slices)
    # joined by a slow link. The batch is split over (dcn, dp); gradients are reduced over dp
    # first, so only 1/dp of them crosses dcn (docs/slow_axis.md).
    dcn: int = 1
    # Expert parallelism (model.experts > 0): each group of ep consecutive dp ranks splits the
    # experts among itself, tokens travelling to their experts and back with all-to-alls
    # inside the group; must divide dp and model.experts.
    ep: int = 1
    # Per-device bandwidth of the slow link in Gb/s: what the plan's slow-axis decisions and
    # the exposed-time estimate in metrics.jsonl assume.
    dcn_gbps: float = 100.0


@dataclass
class ModelConfig:
    kind: Literal["gpt", "bert", "resnet", "llama"] = "gpt"
    layers: int = 4
    d_model: int = 128
    heads: int = 4
    d_ff: int = 512
    # >= the tokenizer's size (256 for bytes); auto: the data's tokenizer size (the shards'
    # index for data.source=tokens, else data.tokenizer) rounded up to a multiple of mesh.tp
    vocab: int | Literal["auto"] = 256
    seq_len: int = 64
    tied_embeddings: bool = True  # output layer reuses the token embedding
    # What each block keeps for its backward (jax_overlap/parallel/remat.py): none keeps
    # everything; full keeps only the block input and recomputes; save_dots / minimal keep
    # (weight) matmul outputs; auto: on a GPU the least recompute whose estimated step fits
    # the device (jax_overlap/plan.py, analysis/memory.py), on a CPU none.
    remat: Literal["auto", "none", "full", "save_dots", "minimal"] = "auto"
    # Attention kernel (jax_overlap/parallel/attention.py): fused is cuDNN flash attention
    # (GPU, bf16/fp16, head dim a multiple of 8 up to 128); plain the einsum path that
    # materialises the [b, h, T, T] probabilities; auto fused where the target allows it.
    attention: Literal["auto", "fused", "plain"] = "auto"
    # Llama only (docs/llama_and_hf.md; the other models ignore them): key/value heads of
    # grouped-query attention (0: = heads), RoPE base and optional Llama-3.1 frequency
    # scaling, RMSNorm epsilon. d_ff is the SwiGLU's hidden size.
    kv_heads: int = 0
    rope_theta: float = 10000.0
    rope_scaling: Literal["none", "llama3"] = "none"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    norm_eps: float = 1e-5
    # Mixture of experts (Llama only, models/moe.py): experts per MoE layer (0: dense);
    # the router's top-k; each expert's capacity per sequence, `dropless` (never drops) or
    # a factor of the even share (ceil(factor * seq_len * k / experts) tokens, the rest
    # dropped, first choices first); shared experts every token passes through; every
    # moe_every-th layer is MoE (the others dense); the load-balancing and router z-loss
    # coefficients. d_ff is each expert's hidden size.
    experts: int = 0
    experts_per_token: int = 2
    expert_capacity: float | Literal["dropless"] = "dropless"
    shared_experts: int = 0
    moe_every: int = 1
    router_aux_loss: float = 0.01
    router_z_loss: float = 0.001


@dataclass
class DataConfig:
    # stdlib: the Python standard library's own source text (present on every machine);
    # file: `path` to a UTF-8/bytes text file; synthetic: a learnable random Markov stream;
    # tokens: `path` to a `jax-overlap prepare-data` directory (token shards, read by Grain).
    source: Literal["stdlib", "file", "synthetic", "tokens"] = "stdlib"
    path: str = ""
    max_bytes: int = 8_000_000  # how much of the corpus to load (stdlib, file)
    # bytes, or a Hugging Face tokenizer.json for stdlib/file (tokens: the shards' own; a path
    # given here must be the one they were made with)
    tokenizer: str = "bytes"
    # Written by train into a run's config.json (a config need not set them): the kind
    # (bytes, tokenizers, synthetic) and sha256 of the tokenizer the run's tokens were made
    # with; the run dir keeps that tokenizer.json (jax_overlap/data/run_tokenizer.py).
    tokenizer_kind: Literal["", "bytes", "tokenizers", "synthetic"] = ""
    tokenizer_sha256: str = ""
    # stdlib/file/synthetic: the corpus's last fraction, held out for train.eval_every
    # (tokens: the split prepare-data --val-fraction wrote)
    val_fraction: float = 0.05


@dataclass
class TrainConfig:
    steps: int = 100
    seed: int = 0
    global_batch: int = 16  # sequences per optimizer step, over all devices
    lr: float = 3e-3  # peak learning rate
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.01
    grad_clip: float = 1.0  # global-norm clipping; 0 disables
    # bf16 / fp16: that compute dtype, fp32 master weights; fp16 adds dynamic loss scaling
    # (training/loss_scale.py): start at loss_scale_init, x2 after loss_scale_growth_interval
    # clean steps, /2 and the step skipped on overflow.
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    loss_scale_init: float = 65536.0
    loss_scale_growth_interval: int = 2000
    optimizer: Literal["adamw", "lamb"] = "adamw"
    log_every: int = 1  # metrics.jsonl gets every step; the progress bar refreshes this often
    eval_every: int = 0  # held-out loss and perplexity every this many steps; 0: off
    eval_batches: int = 4  # global batches of held-out data per evaluation
    # Every this many steps, a few continuations of sample_prompt ("": a default) of
    # sample_tokens tokens (fewer if model.seq_len is shorter) in metrics.jsonl and
    # TensorBoard's text tab (jax_overlap/training/sample_hook.py); 0: off
    sample_every: int = 0
    sample_prompt: str = ""
    sample_tokens: int = 32


@dataclass
class PipelineConfig:
    # auto: the plan picks (plan.AUTO_SCHEDULE_WHY): 1f1b (paired on a GPU), or interleaved
    # where virtual_stages > 1 is given.
    schedule: Literal["auto", "gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"] = "auto"
    # Per data-parallel replica per step; also gradient accumulation when pp=1. auto: the plan
    # picks (1 on CPU at pp=1; on a GPU the microbatch that keeps GEMMs large and fits memory).
    microbatches: int | Literal["auto"] = "auto"
    # Chunks per pipeline stage. auto follows the schedule when the config is loaded
    # (`resolve_virtual_stages`): 2 for interleaved and zb-v at mesh.pp > 1, else 1.
    virtual_stages: int | Literal["auto"] = "auto"
    # Ticks between stages: 1 sends each tick's output between ticks (on the critical path);
    # 2 sends it beside the next tick's compute, so every transfer hides under a tick of GEMMs,
    # at the price of a longer ramp (bubble L(p-1)/(m+L(p-1)) for 1F1B) and more activations.
    transfer_latency: int = 1
    # Paired ticks: a stage may run one forward and one backward (of other microbatches) in
    # the same tick, so steady-state ticks cost alike on every stage and each stage-to-stage
    # transfer hides under the tick's other action. Needs transfer_latency 1; holds up to
    # twice the unpaired schedule's activations per stage. auto: on a GPU at latency 1, off
    # on a CPU (collectives are synchronous there; pairing only adds permutes).
    paired: bool | Literal["auto"] = "auto"
    # Paired tables only. pair_search: steps of a search over which ticks run pairs, so the
    # actions sharing a lockstep tick cost alike at tick_costs (0: one pairing rule for the
    # whole step; ~35 ms a step at p = 4, m = 16, done once when the plan is built).
    # tick_costs: [F, B, W], measured per-action tick times (`bench/pipeline.py` prints
    # them) or ratios; null: equal.
    pair_search: int = 0
    tick_costs: list[float] | None = None
    # Layers per virtual stage, in model order (pp x virtual_stages counts summing to
    # model.layers): even (equal chunks), auto (balanced by cost, counting the embedding on
    # the first virtual stage and the LM head + loss on the last), or an explicit list.
    stage_layers: Literal["even", "auto"] | list[int] = "even"
    # Vocabulary-parallel LM head: instead of the last virtual stage's stage running the
    # whole head and loss, every stage computes the logits of 1/pp of the vocabulary for
    # each microbatch (its last hidden state broadcast over pp, the softmax statistics and
    # the hidden state's gradient summed over pp), so no stage carries the head's ~2 layers
    # of extra work. Needs pp > 1, a model whose head supports it (the built-in decoders)
    # and vocab / tp divisible by pp.
    vocab_parallel: bool = False
    # zb-h1 / zb-v: W as only the weight-gradient GEMMs (F keeps each weight matmul's input
    # and B its output gradient in stash slots until W) or as the chunk's whole backward.
    # auto: split, but on a GPU under a remat policy that recomputes (there the slots' traffic
    # every tick costs more than W's recompute).
    split_backward: bool | Literal["auto"] = "auto"


@dataclass
class OverlapConfig:
    # 0: one reduction per gradient leaf, after the backward. auto: the plan picks (64 MiB
    # buckets issued during the backward on a GPU with dp > 1; 0 on a CPU).
    grad_bucket_mb: float | Literal["auto"] = "auto"
    bucket_order: Literal["backward", "largest_first"] = "backward"
    # backward order: reduce the embedding's gradients before the first layer's, so the
    # first layer's weight-gradient GEMMs can hide them (see buckets.pack_units); pays off
    # when the embedding's bucket is above XLA's combine threshold (configs/gpt_1p3b.yaml).
    # auto: on where gradients go in buckets in backward order on a GPU.
    embed_before_first_layer: bool | Literal["auto"] = "auto"
    zero1: bool = False  # shard optimizer state over dp (psum_scatter + all_gather)
    # Expert parallelism (mesh.ep > 1): each MoE layer sends its tokens in this many chunks,
    # so chunk i's all-to-all can run under chunk i-1's expert GEMMs (models/moe.py).
    moe_chunks: int = 1
    grad_comm_dtype: Literal["fp32", "bf16"] = "fp32"
    # auto: the plan picks fsdp on a GPU where a replica's step does not fit even at one
    # sequence per microbatch under remat full, replicated otherwise.
    param_sharding: Literal["auto", "replicated", "fsdp"] = "auto"
    window: int = 2  # fsdp: all-gather block l+window while block l computes
    # auto: the plan picks (collective_matmul with tp > 1 on a GPU, plain elsewhere)
    tp_comm: Literal["auto", "plain", "sequence_parallel", "collective_matmul"] = "auto"
    collective_matmul_direction: Literal["auto", "uni", "bi"] = "auto"
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
    # With dcn_delay 1, what arrives one step late (docs/slow_axis.md). gradient: the whole
    # reduced gradient, applied to the shared parameters (one device's training with each
    # gradient a step late). local: each dcn group applies its own update (from its fresh
    # fast-axis-reduced gradient) at once; the mean of the groups' updates replaces it one
    # step later, so the groups' parameters differ by at most their last own update.
    # local is the default: it trains within 1% of synchronous training where gradient ends
    # 35% above it (AdamW at lr 3e-3, bench/slow_axis.py --convergence).
    dcn_delay_mode: Literal["gradient", "local"] = "local"


@dataclass
class DilocoConfig:
    # Streaming DiLoCo over dcn (docs/slow_axis.md): each dcn group trains on its own for
    # inner_steps (H) steps per fragment sync; 0 is off. Needs mesh.dcn > 1.
    inner_steps: int = 0
    fragments: int = 1  # parameter fragments, synced in turn (every H / fragments steps)
    delay: int = 0  # tau: inner steps between issuing a fragment's sync and applying it
    outer_lr: float = 0.7  # outer Nesterov SGD
    outer_momentum: float = 0.9
    # dtype the outer gradient crosses dcn in; int8 is per-fragment absmax scaled
    outer_dtype: Literal["fp32", "bf16", "int8"] = "bf16"
    # with delay > 0, how much of the local fragment is kept when the synced one arrives
    # (0: replaced; the Streaming DiLoCo paper's alpha)
    mix: float = 0.5


@dataclass
class CheckpointConfig:
    dir: str = ""  # empty: <run_dir>/checkpoints
    every_steps: int = 0  # 0 disables checkpointing
    keep: int = 3
    async_save: bool = True
    # When committed checkpoints exist but none verifies: refuse (exit 2, nothing changed), or
    # restart from step 0 on purpose (the bad steps are quarantined, the summary lists them).
    on_unreadable: Literal["refuse", "restart"] = "refuse"
    # The fast local tier (docs/resilience.md): a copy of every process's own shards every
    # `local_every` accepted steps, written in the background; 0 turns it off. The newest
    # step that verifies in either tier is resumed. Needs checkpoint.every_steps > 0.
    local_every: int = 0
    local_keep: int = 2  # local steps kept (1 or 2)
    local_dir: str = ""  # empty: /dev/shm/jax_overlap where it exists, else the system temp dir
    # A Hugging Face directory (config.json + safetensors) whose weights replace the random
    # initialisation (fine-tuning); the model config must match it (jax_overlap/hf/convert.py).
    init_from_hf: str = ""


@dataclass
class GuardConfig:
    enabled: bool = True
    spike_sigma: float = 6.0
    window: int = 20
    max_skips: int = 3  # consecutive bad steps before a rollback
    skip_batches: int = 1  # batches skipped past the ones that caused a rollback
    lr_scale_on_rollback: float = 1.0


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
    num_processes: int = 1
    process_id: int = 0
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


def resolve_virtual_stages(cfg: Config) -> Config:
    """`pipeline.virtual_stages: auto` -> what the schedule places per stage: 2 for zb-v (its
    only value) and interleaved (the fewest it runs) at mesh.pp > 1, else 1."""
    pl = cfg.pipeline
    if pl.virtual_stages != "auto":
        return cfg
    v = 2 if cfg.mesh.pp > 1 and pl.schedule in ("interleaved", "zb-v") else 1
    return dataclasses.replace(cfg, pipeline=dataclasses.replace(pl, virtual_stages=v))


def _data_vocab(cfg: Config) -> tuple[int, str]:
    """(the data's tokenizer size, where it comes from); ConfigError naming the field."""
    from jax_overlap.data.tokenizer import data_vocab_size  # no JAX

    d = cfg.data
    if d.source == "tokens" and not os.path.isdir(d.path):
        raise ConfigError([f"data.path: {d.path or '(empty)'} is not a directory; "
                           f"data.source=tokens needs a `jax-overlap prepare-data --out` "
                           f"directory"])
    try:
        return data_vocab_size(d.source, d.path, d.tokenizer)
    except ValueError as e:
        raise ConfigError([str(e)]) from None


def resolve_vocab(cfg: Config) -> Config:
    """`model.vocab: auto` -> the data's tokenizer size rounded up to a multiple of mesh.tp
    (of mesh.tp x mesh.pp under `pipeline.vocab_parallel`)."""
    if cfg.model.vocab != "auto":
        return cfg
    from jax_overlap.data.tokenizer import padded_vocab

    size, _ = _data_vocab(cfg)
    return dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, vocab=padded_vocab(size, max(1, cfg.mesh.tp) * (
            cfg.mesh.pp if cfg.pipeline.vocab_parallel else 1))))


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


# ---------------------------------------------------------------------------------------------
# Cross-field rules: one line per problem, naming the field and the fix.


def validate(cfg: Config) -> None:
    p: list[str] = []
    m, mo, t, pl, ov = cfg.mesh, cfg.model, cfg.train, cfg.pipeline, cfg.overlap
    for name in ("dp", "pp", "tp", "dcn", "ep"):
        if getattr(m, name) < 1:
            p.append(f"mesh.{name}: must be >= 1, got {getattr(m, name)}")
    for name in ("layers", "d_model", "heads", "d_ff", "vocab", "seq_len"):
        if getattr(mo, name) < 1:
            p.append(f"model.{name}: must be >= 1, got {getattr(mo, name)}")
    if p:
        raise ConfigError(p)
    if mo.kind == "llama":
        _check_llama(mo, m.tp, p)
    _check_moe(cfg, p)
    if mo.kind in ("gpt", "bert", "llama"):
        if mo.d_model % mo.heads:
            p.append(f"model.d_model: {mo.d_model} is not divisible by model.heads={mo.heads}; "
                     f"pick d_model a multiple of heads")
        for name in ("heads", "d_ff", "vocab"):
            if getattr(mo, name) % m.tp:
                p.append(f"model.{name}: {getattr(mo, name)} is not divisible by mesh.tp={m.tp}; "
                         f"use a multiple of {m.tp} or change mesh.tp")
        if cfg.data.source != "synthetic":
            try:
                size, where = _data_vocab(cfg)
            except ConfigError as e:
                p += e.problems
                size, where = 0, ""
            if mo.vocab < size:
                p.append(f"model.vocab: {mo.vocab} < {size}, the size of {where}; set "
                         f"model.vocab=auto or a value >= {size}")
        if ov.tp_comm not in ("plain", "auto") and mo.seq_len % m.tp:
            p.append(f"model.seq_len: {mo.seq_len} is not divisible by mesh.tp={m.tp}, which "
                     f"overlap.tp_comm={ov.tp_comm} needs; use a multiple of {m.tp}")
    if pl.vocab_parallel:
        if m.pp == 1:
            p.append("pipeline.vocab_parallel: needs mesh.pp > 1 (it splits the head over the "
                     "pipeline stages); set it to false")
        elif mo.kind == "resnet":
            p.append("pipeline.vocab_parallel: resnet's head is a small classifier with no "
                     "vocabulary to split; set it to false")
        elif mo.kind in ("gpt", "bert", "llama") and mo.vocab % (m.tp * m.pp):
            p.append(f"pipeline.vocab_parallel: model.vocab {mo.vocab} is not divisible by "
                     f"mesh.tp x mesh.pp = {m.tp * m.pp}; pad it to a multiple of "
                     f"{m.tp * m.pp} (e.g. {-(-mo.vocab // (m.tp * m.pp)) * m.tp * m.pp})")
    chunks = m.pp * pl.virtual_stages
    # ResNet groups its residual blocks into pp x v balanced units itself (models/resnet.py).
    split = pl.stage_layers
    if mo.kind == "resnet" and split != "even":
        p.append("pipeline.stage_layers: resnet balances its residual blocks over the stages "
                 "itself (models/resnet.py); leave it at even")
    elif isinstance(split, list):
        from jax_overlap.pipeline.stage_split import (
            list_problems,  # pure Python, no jax
        )

        p.extend(list_problems(split, mo.layers, chunks))
    elif split == "auto" and mo.layers < chunks:
        p.append(f"pipeline.stage_layers: auto needs model.layers >= mesh.pp x "
                 f"pipeline.virtual_stages = {chunks}, got {mo.layers}; use fewer stages")
    elif split == "even" and mo.kind != "resnet" and mo.layers % chunks:
        p.append(f"model.layers: {mo.layers} is not divisible by mesh.pp x pipeline.virtual_stages "
                 f"= {chunks}; use a multiple of {chunks}, or set pipeline.stage_layers "
                 f"(auto or a list)")
    explicit_mb = pl.microbatches != "auto"
    if explicit_mb and pl.microbatches < 1:
        p.append(f"pipeline.microbatches: must be >= 1, got {pl.microbatches}")
    elif not explicit_mb and t.global_batch % (m.dcn * m.dp):
        p.append(f"train.global_batch: {t.global_batch} is not divisible by mesh.dcn x mesh.dp "
                 f"= {m.dcn * m.dp}; use a multiple of {m.dcn * m.dp}")
    elif explicit_mb and t.global_batch % (m.dcn * m.dp * pl.microbatches):
        n = m.dcn * m.dp * pl.microbatches
        p.append(f"train.global_batch: {t.global_batch} is not divisible by mesh.dcn x mesh.dp x "
                 f"pipeline.microbatches = {n}; use a multiple of {n}")
    if explicit_mb and m.pp > 1 and pl.microbatches < m.pp and pl.schedule != "gpipe":
        p.append(f"pipeline.microbatches: {pl.microbatches} < mesh.pp={m.pp}, which schedule "
                 f"{pl.schedule} needs to fill the pipeline; use at least {m.pp}")
    group = m.pp * pl.transfer_latency
    if explicit_mb and pl.schedule == "interleaved" and m.pp > 1 and pl.microbatches % group:
        from jax_overlap.pipeline.schedules import multiples_near  # pure Python, no jax

        p.append(f"pipeline.microbatches: interleaved needs a multiple of mesh.pp x "
                 f"pipeline.transfer_latency = {group}, got {pl.microbatches}; use "
                 f"{multiples_near(pl.microbatches, group)}")
    if pl.schedule == "interleaved" and m.pp > 1 and pl.virtual_stages < 2:
        p.append("pipeline.virtual_stages: interleaved needs >= 2; set pipeline.virtual_stages=2")
    if pl.schedule == "zb-v" and m.pp > 1 and pl.virtual_stages != 2:
        p.append("pipeline.virtual_stages: zb-v places exactly 2 chunks per stage; set it to 2")
    if pl.transfer_latency not in (1, 2):
        p.append(f"pipeline.transfer_latency: must be 1 or 2, got {pl.transfer_latency}; use 2 "
                 f"to overlap stage-to-stage transfers with compute")
    if pl.paired is True and pl.transfer_latency != 1:
        p.append(f"pipeline.paired: paired ticks hide each transfer under the tick's other "
                 f"action and run at transfer_latency 1, got {pl.transfer_latency}; set "
                 f"pipeline.transfer_latency=1 or pipeline.paired=false")
    if not isinstance(pl.pair_search, int) or pl.pair_search < 0:
        p.append(f"pipeline.pair_search: must be an integer >= 0 (search steps), got "
                 f"{pl.pair_search!r}; try 300")
    elif pl.pair_search and pl.paired is False:
        p.append("pipeline.pair_search: searches where paired ticks run; set pipeline.paired="
                 "true or pipeline.pair_search=0")
    costs = pl.tick_costs
    if costs is not None and (not isinstance(costs, (list, tuple)) or len(costs) != 3 or not all(
            isinstance(c, (int, float)) and not isinstance(c, bool) and c > 0 for c in costs)):
        p.append(f"pipeline.tick_costs: must be three positive numbers [F, B, W] (per-action "
                 f"tick times, e.g. [15.2, 18.8, 18.6]), got {costs!r}; or null for equal")
    if pl.virtual_stages > 1 and pl.schedule not in ("interleaved", "zb-v", "auto"):
        p.append(f"pipeline.virtual_stages: {pl.virtual_stages} needs pipeline.schedule "
                 f"interleaved or zb-v (got {pl.schedule}); set it to 1")
    if t.steps < 1:
        p.append(f"train.steps: must be >= 1, got {t.steps}")
    if not t.lr > 0 or not math.isfinite(t.lr):
        p.append(f"train.lr: must be a finite number > 0, got {t.lr}")
    p += _finite_floats(cfg)
    p += _checkpoint_and_guard_problems(cfg)
    if t.global_batch < 1:
        p.append(f"train.global_batch: must be >= 1, got {t.global_batch}")
    if t.loss_scale_init < 1 or t.loss_scale_growth_interval < 1:
        p.append(f"train.loss_scale_init: must be >= 1 (got {t.loss_scale_init}) and "
                 f"train.loss_scale_growth_interval >= 1 (got {t.loss_scale_growth_interval})")
    if not 1 <= ov.window <= 3 and ov.param_sharding == "fsdp":
        p.append(f"overlap.window: {ov.window} is outside 1..3; use 1, 2 or 3")
    if ov.grad_bucket_mb != "auto" and ov.grad_bucket_mb < 0:
        p.append(f"overlap.grad_bucket_mb: must be >= 0, got {ov.grad_bucket_mb}")
    if cfg.data.source == "file" and not cfg.data.path:
        p.append("data.path: data.source=file needs a path; set data.path=/path/to/text.txt")
    elif cfg.data.source == "file":
        p += _data_file_problems(cfg)
    if cfg.data.max_bytes < 1:
        p.append(f"data.max_bytes: must be >= 1, got {cfg.data.max_bytes}")
    if not 0.0 <= cfg.data.val_fraction < 1.0:
        p.append(f"data.val_fraction: {cfg.data.val_fraction} is outside [0, 1); e.g. 0.05")
    if t.eval_every < 0:
        p.append(f"train.eval_every: must be >= 0 (0: no evaluation), got {t.eval_every}")
    if t.eval_batches < 1:
        p.append(f"train.eval_batches: must be >= 1, got {t.eval_batches}")
    if t.sample_every < 0:
        p.append(f"train.sample_every: must be >= 0 (0: no samples), got {t.sample_every}")
    if t.sample_tokens < 1:
        p.append(f"train.sample_tokens: must be >= 1, got {t.sample_tokens}")
    if t.eval_every > 0 and cfg.data.source != "tokens" and cfg.data.val_fraction == 0:
        p.append("data.val_fraction: 0 holds nothing out, but train.eval_every > 0 needs "
                 "held-out data; set data.val_fraction=0.05 or train.eval_every=0")
    if cfg.data.source == "tokens" and cfg.data.tokenizer not in ("", "bytes"):
        p += _tokenizer_mismatch(cfg)
    if cfg.data.source == "tokens" and os.path.isdir(cfg.data.path):
        p += _split_problems(cfg)
    if cfg.checkpoint.init_from_hf and not os.path.isdir(cfg.checkpoint.init_from_hf):
        p.append(f"checkpoint.init_from_hf: {cfg.checkpoint.init_from_hf} is not a directory; "
                 f"point it at a Hugging Face model directory")
    p += _slow_axis_problems(cfg)
    d = cfg.distributed
    if d.num_processes < 1 or not 0 <= d.process_id < d.num_processes:
        p.append(f"distributed.process_id: {d.process_id} is outside 0..{d.num_processes - 1}")
    elif cfg.num_devices % d.num_processes:
        p.append(f"mesh: {cfg.num_devices} devices do not split evenly over "
                 f"distributed.num_processes={d.num_processes}")
    if p:
        raise ConfigError(p)


def _finite_floats(cfg: Config) -> list[str]:
    """Every float field must be a finite number (YAML reads .inf and .nan as floats)."""
    out = []
    for section in dataclasses.fields(cfg):
        sub = getattr(cfg, section.name)
        for f in dataclasses.fields(sub):
            v = getattr(sub, f.name)
            if isinstance(v, float) and not math.isfinite(v) and f"{section.name}.{f.name}" != "train.lr":
                out.append(f"{section.name}.{f.name}: must be a finite number, got {v}")
    return out


def _checkpoint_and_guard_problems(cfg: Config) -> list[str]:
    c, g, t = cfg.checkpoint, cfg.guard, cfg.train
    p = []
    if c.every_steps < 0:
        p.append(f"checkpoint.every_steps: must be >= 0 (0 turns checkpointing off), got "
                 f"{c.every_steps}")
    if c.keep < 1:
        p.append(f"checkpoint.keep: must be >= 1 (the newest steps kept), got {c.keep}; use 1 "
                 f"or more")
    if c.local_every < 0:
        p.append(f"checkpoint.local_every: must be >= 0 (0 turns the local tier off), got "
                 f"{c.local_every}")
    elif c.local_every > 0 and c.every_steps == 0:
        p.append("checkpoint.local_every: the local tier needs the persistent one; set "
                 "checkpoint.every_steps > 0 too")
    if not 1 <= c.local_keep <= 2:
        p.append(f"checkpoint.local_keep: must be 1 or 2, got {c.local_keep}")
    if g.window < 2:
        p.append(f"guard.window: {g.window} is too small for the spike statistic (a mean and "
                 f"standard deviation over at least 2 accepted losses); use >= 2, e.g. 20")
    if not g.spike_sigma > 0:
        p.append(f"guard.spike_sigma: must be > 0 (standard deviations above the mean), got "
                 f"{g.spike_sigma}; e.g. 6")
    if g.max_skips < 0:
        p.append(f"guard.max_skips: must be >= 0 (0 rolls back at the first rejected step), got "
                 f"{g.max_skips}")
    if g.skip_batches < 0:
        p.append(f"guard.skip_batches: must be >= 0, got {g.skip_batches}")
    if not g.lr_scale_on_rollback > 0:
        p.append(f"guard.lr_scale_on_rollback: must be > 0, got {g.lr_scale_on_rollback}")
    for name in ("warmup_steps", "log_every"):
        if getattr(t, name) < 0:
            p.append(f"train.{name}: must be >= 0, got {getattr(t, name)}")
    if t.grad_clip < 0:
        p.append(f"train.grad_clip: must be >= 0 (0 disables clipping), got {t.grad_clip}")
    if cfg.fault.commit_delay_s < 0:
        p.append(f"fault.commit_delay_s: must be >= 0, got {cfg.fault.commit_delay_s}")
    return p


def _data_file_problems(cfg: Config) -> list[str]:
    path = cfg.data.path
    if not os.path.exists(path):
        return [f"data.path: {path} not found; point it at an existing text file"]
    if os.path.isdir(path):
        return [f"data.path: {path} is a directory; point it at a text file"]
    if not os.access(path, os.R_OK):
        return [f"data.path: {path} is not readable; check its permissions"]
    usable = min(os.path.getsize(path), cfg.data.max_bytes)
    need = cfg.model.seq_len + 2  # one window of seq_len + 1 tokens, and a choice of start
    if usable < need:
        return [f"data.path: {path} holds {usable} usable bytes, fewer than one sequence "
                f"(model.seq_len + 2 = {need}); use a longer file or a smaller model.seq_len"]
    return []


def _check_llama(mo: ModelConfig, tp: int, p: list[str]) -> None:
    kv = mo.kv_heads or mo.heads
    if mo.kv_heads < 0 or mo.heads % kv:
        p.append(f"model.kv_heads: {mo.kv_heads} must divide model.heads={mo.heads} "
                 f"(0 means = heads); pick a divisor of {mo.heads}")
    elif kv >= tp and kv % tp:
        p.append(f"model.kv_heads: {kv} >= mesh.tp={tp} is split over tp and must be a "
                 f"multiple of it; use a multiple of {tp}")
    elif kv < tp and tp % kv:
        p.append(f"model.kv_heads: {kv} < mesh.tp={tp} is replicated over tp, which needs "
                 f"tp to be a multiple of it; use a divisor of {tp}")
    if mo.heads and (mo.d_model // mo.heads) % 2:
        p.append(f"model.d_model: head size {mo.d_model}/{mo.heads} is odd; RoPE needs an "
                 f"even head size")
    if mo.rope_theta <= 0:
        p.append(f"model.rope_theta: must be > 0, got {mo.rope_theta}")
    if mo.rope_scaling == "llama3" and mo.rope_high_freq_factor <= mo.rope_low_freq_factor:
        p.append("model.rope_high_freq_factor: must exceed model.rope_low_freq_factor")


def _check_moe(cfg: Config, p: list[str]) -> None:
    """model.experts and the keys that go with it (models/moe.py)."""
    mo, m = cfg.model, cfg.mesh
    if cfg.overlap.moe_chunks < 1:
        p.append(f"overlap.moe_chunks: must be >= 1, got {cfg.overlap.moe_chunks}")
    if mo.experts == 0:
        if m.ep > 1:
            p.append(f"mesh.ep: {m.ep} splits experts, but model.experts is 0 (dense); set "
                     f"model.experts or mesh.ep=1")
        return
    if m.ep > 1 and (m.dp % m.ep or mo.experts % m.ep):
        p.append(f"mesh.ep: {m.ep} must divide mesh.dp={m.dp} and model.experts="
                 f"{mo.experts}; pick a common divisor")
    if mo.kind != "llama":
        p.append(f"model.experts: mixture of experts is built on the Llama decoder; set "
                 f"model.kind=llama or model.experts=0 (got kind {mo.kind})")
        return
    if mo.experts < 0:
        p.append(f"model.experts: must be >= 0 (0 = dense), got {mo.experts}")
        return
    if not 1 <= mo.experts_per_token <= mo.experts:
        p.append(f"model.experts_per_token: {mo.experts_per_token} must be between 1 and "
                 f"model.experts={mo.experts}")
    if mo.expert_capacity != "dropless" and not mo.expert_capacity > 0:
        p.append(f"model.expert_capacity: must be dropless or a factor > 0, got "
                 f"{mo.expert_capacity}")
    if mo.shared_experts < 0:
        p.append(f"model.shared_experts: must be >= 0, got {mo.shared_experts}")
    if mo.moe_every < 1 or mo.layers % mo.moe_every:
        p.append(f"model.moe_every: {mo.moe_every} must be >= 1 and divide model.layers="
                 f"{mo.layers}; pick a divisor of {mo.layers}")
    elif (mo.layers // mo.moe_every) % (m.pp * cfg.pipeline.virtual_stages):
        p.append(f"model.moe_every: the pipeline splits groups of {mo.moe_every} layers "
                 f"(one MoE layer each), and {mo.layers // mo.moe_every} groups are not "
                 f"divisible by mesh.pp x pipeline.virtual_stages = "
                 f"{m.pp * cfg.pipeline.virtual_stages}; change model.moe_every or model.layers")
    for name in ("router_aux_loss", "router_z_loss"):
        if getattr(mo, name) < 0:
            p.append(f"model.{name}: must be >= 0, got {getattr(mo, name)}")
    if cfg.train.precision == "fp16":
        p.append("train.precision: fp16's loss scaling would rescale the router losses of "
                 "model.experts > 0; use bf16")
    if m.dcn > 1 and cfg.overlap.dcn_delay_mode == "local":
        p.append("overlap.dcn_delay_mode: local keeps its own gradients, which would not "
                 "carry the MoE router statistics; use gradient with model.experts > 0")


def _slow_axis_problems(cfg: Config) -> list[str]:
    """mesh.dcn, overlap.dcn_delay and diloco.*: one line per problem."""
    m, ov, dl = cfg.mesh, cfg.overlap, cfg.diloco
    p = []
    if cfg.train.precision == "fp16" and m.dcn > 1 and (ov.dcn_delay in (1, "auto")
                                                         or dl.inner_steps > 0):
        p.append("train.precision: fp16's skipped overflow steps are not supported with "
                 "overlap.dcn_delay or diloco over mesh.dcn; use bf16 (no loss scaling needed)")
    if ov.dcn_delay not in (0, 1, "auto"):
        p.append(f"overlap.dcn_delay: must be 0, 1 or auto, got {ov.dcn_delay}")
    elif ov.dcn_delay == 1 and m.dcn < 2:
        p.append("overlap.dcn_delay: 1 delays the reduction over mesh.dcn, which is 1; set "
                 "mesh.dcn >= 2 or overlap.dcn_delay=0")
    if ov.dcn_delay_mode not in ("gradient", "local"):
        p.append(f"overlap.dcn_delay_mode: must be gradient or local, got {ov.dcn_delay_mode}")
    elif ov.dcn_delay_mode == "local" and ov.dcn_delay_compensation:
        p.append("overlap.dcn_delay_compensation: applies to dcn_delay_mode=gradient (the "
                 "local mode's own update is fresh); set it to 0")
    if m.dcn_gbps <= 0:
        p.append(f"mesh.dcn_gbps: must be > 0, got {m.dcn_gbps}")
    if ov.dcn_delay_compensation < 0:
        p.append(f"overlap.dcn_delay_compensation: must be >= 0, got "
                 f"{ov.dcn_delay_compensation}")
    if dl.inner_steps < 0:
        p.append(f"diloco.inner_steps: must be >= 0 (0 is off), got {dl.inner_steps}")
    elif dl.inner_steps:
        if m.dcn < 2:
            p.append("diloco.inner_steps: DiLoCo runs over mesh.dcn, which is 1; set "
                     "mesh.dcn >= 2 or diloco.inner_steps=0")
        if ov.dcn_delay == 1:
            p.append("overlap.dcn_delay: DiLoCo never reduces gradients over dcn; set "
                     "overlap.dcn_delay=0 with diloco.inner_steps > 0")
        if dl.fragments < 1 or dl.inner_steps % dl.fragments:
            p.append(f"diloco.fragments: {dl.fragments} must be >= 1 and divide "
                     f"diloco.inner_steps={dl.inner_steps}")
        elif (cfg.model.layers // m.pp) % dl.fragments:
            p.append(f"diloco.fragments: {dl.fragments} must divide the layers per stage "
                     f"(model.layers / mesh.pp = {cfg.model.layers // m.pp})")
        elif not 0 <= dl.delay < dl.inner_steps // dl.fragments:
            p.append(f"diloco.delay: {dl.delay} must be in 0..{dl.inner_steps // dl.fragments - 1}"
                     f" (below inner_steps / fragments, so a fragment's sync lands before its "
                     f"next one is issued)")
        if not 0 <= dl.mix < 1:
            p.append(f"diloco.mix: must be in [0, 1), got {dl.mix}")
    if (ov.dcn_delay == 1 or dl.inner_steps) and cfg.pipeline.schedule in ("interleaved", "zb-v") \
            and m.pp > 1:
        p.append(f"pipeline.schedule: {cfg.pipeline.schedule} stages layers out of order, which "
                 f"the slow-axis state does not follow yet; use 1f1b, gpipe or zb-h1 with "
                 f"overlap.dcn_delay / diloco")
    return p


def check_device_count(cfg: Config, available: int) -> None:
    """The mesh must use exactly the devices the job has."""
    if cfg.num_devices != available:
        m = cfg.mesh
        raise ConfigError([
            f"mesh: dcn x dp x pp x tp = {m.dcn} x {m.dp} x {m.pp} x {m.tp} = "
            f"{cfg.num_devices}, but {available} devices are available; make the product "
            f"{available} (e.g. --set mesh.dp={max(1, available // (m.dcn * m.pp * m.tp))})"])


def _tokenizer_mismatch(cfg: Config) -> list[str]:
    """A data.tokenizer given with data.source=tokens must be the one the shards were made with."""
    from jax_overlap.data.tokenizer import file_sha256, read_index

    d = cfg.data
    if not os.path.isfile(d.tokenizer):
        return [f"data.tokenizer: {d.tokenizer} is not a file; pass `bytes` (use the shards' "
                f"own tokenizer) or a tokenizer.json"]
    try:
        want = read_index(d.path)["tokenizer"]["sha256"]
    except ValueError as e:
        return [str(e)]
    if file_sha256(d.tokenizer) != want:
        return [f"data.tokenizer: {d.tokenizer} is not the tokenizer {d.path} was prepared "
                f"with (sha256 differs); drop data.tokenizer or prepare the data again"]
    return []


def _split_problems(cfg: Config) -> list[str]:
    """Each split the run reads must hold at least one window of model.seq_len + 1 tokens."""
    from jax_overlap.data.shards import index_problem
    from jax_overlap.data.tokenizer import read_index

    d, need = cfg.data, cfg.model.seq_len + 1
    try:
        index = read_index(d.path)
    except ValueError as e:
        return [str(e)]
    problem = index_problem(d.path, index)  # missing or truncated shards, a lying index
    if problem:
        return [f"data.path: {d.path}: {problem}; run prepare-data again"]
    split = index["split"]
    out = []
    if split["train_tokens"] < need:
        out.append(f"data.path: {d.path}: the train split has {split['train_tokens']} tokens, "
                   f"fewer than model.seq_len + 1 = {need}; prepare more data or lower "
                   f"model.seq_len")
    if cfg.train.eval_every > 0 and split["val_tokens"] < need:
        out.append(f"train.eval_every: {d.path} holds out {split['val_tokens']} tokens, fewer "
                   f"than model.seq_len + 1 = {need}; prepare-data with a larger "
                   f"--val-fraction or set train.eval_every=0")
    return out
