"""Whether a config can work: every problem collected, one line each naming the field and
the fix (`ConfigError`). `config.from_dict` calls `validate`; the checks that read the data
directory or the schedules ask `data/` and the pure `pipeline/` modules."""

from __future__ import annotations

import dataclasses
import math
import os

from jax_overlap.data.tokenizer import data_vocab  # no JAX
from jax_overlap.errors import ConfigError


def validate(cfg: Config) -> None:
    """Raises ConfigError listing every problem of `cfg` (the sizes first: the other checks
    divide by them)."""
    p = _sizes_problems(cfg)
    if p:
        raise ConfigError(p)
    p = (_model_problems(cfg) + _stage_split_problems(cfg) + _schedule_problems(cfg)
         + _train_problems(cfg) + _run_problems(cfg))
    if p:
        raise ConfigError(p)


def _sizes_problems(cfg: Config) -> list[str]:
    """Every mesh axis and model size is at least 1."""
    p: list[str] = []
    m, mo, t, pl, ov = cfg.mesh, cfg.model, cfg.train, cfg.pipeline, cfg.overlap
    for name in ("dp", "pp", "tp", "dcn", "ep"):
        if getattr(m, name) < 1:
            p.append(f"mesh.{name}: must be >= 1, got {getattr(m, name)}")
    for name in ("layers", "d_model", "heads", "d_ff", "vocab", "seq_len"):
        if getattr(mo, name) < 1:
            p.append(f"model.{name}: must be >= 1, got {getattr(mo, name)}")
    return p


def _model_problems(cfg: Config) -> list[str]:
    """The model's shapes against the mesh, the data's vocabulary and vocab_parallel."""
    p: list[str] = []
    m, mo, t, pl, ov = cfg.mesh, cfg.model, cfg.train, cfg.pipeline, cfg.overlap
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
                size, where = data_vocab(cfg.data)
            except ConfigError as e:
                p += e.problems
                size, where = 0, ""
            if mo.vocab < size:
                p.append(f"model.vocab: {mo.vocab} < {size}, the size of {where}; set "
                         f"model.vocab=auto or a value >= {size}")
        if ov.tp_comm not in ("plain", "auto") and mo.seq_len % m.tp:
            p.append(f"model.seq_len: {mo.seq_len} is not divisible by mesh.tp={m.tp}, which "
                     f"overlap.tp_comm={ov.tp_comm} needs; use a multiple of {m.tp}")
    if pl.vocab_parallel is True:
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
    if mo.kind == "resnet" and m.tp > 1:
        p.append(f"mesh.tp: ResNet has no tensor-parallel layout; set mesh.tp=1 and use "
                 f"mesh.dp / mesh.pp (got mesh.tp={m.tp})")
    return p


def _stage_split_problems(cfg: Config) -> list[str]:
    """`pipeline.stage_layers` against the model's layers and the stages."""
    p: list[str] = []
    m, mo, t, pl, ov = cfg.mesh, cfg.model, cfg.train, cfg.pipeline, cfg.overlap
    chunks = m.pp * pl.virtual_stages
    # ResNet groups its residual blocks into pp x v balanced units itself (models/resnet.py).
    split = pl.stage_layers
    if mo.kind == "resnet" and split not in ("even", "auto"):
        p.append("pipeline.stage_layers: resnet balances its residual blocks over the stages "
                 "itself (models/resnet.py); leave it at auto or even")
    elif isinstance(split, list):
        from jax_overlap.pipeline.stage_split import (
            list_problems,  # pure Python, no jax
        )

        p.extend(list_problems(split, mo.layers, chunks))
    elif split in ("auto", "balanced") and mo.kind != "resnet" and mo.layers < chunks:
        p.append(f"pipeline.stage_layers: {split} needs model.layers >= mesh.pp x "
                 f"pipeline.virtual_stages = {chunks}, got {mo.layers}; use fewer stages")
    elif split == "even" and mo.kind != "resnet" and mo.layers % chunks:
        p.append(f"model.layers: {mo.layers} is not divisible by mesh.pp x pipeline.virtual_stages "
                 f"= {chunks}; use a multiple of {chunks}, or set pipeline.stage_layers "
                 f"(auto or a list)")
    return p


def _schedule_problems(cfg: Config) -> list[str]:
    """Microbatches, schedule, virtual stages, latency, pairing and tick costs."""
    p: list[str] = []
    m, mo, t, pl, ov = cfg.mesh, cfg.model, cfg.train, cfg.pipeline, cfg.overlap
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
    latency = 1 if pl.transfer_latency == "auto" else pl.transfer_latency  # auto: 1 or 2
    group = m.pp * latency
    if explicit_mb and pl.schedule == "interleaved" and m.pp > 1 and pl.microbatches % group:
        from jax_overlap.pipeline.generators import multiples_near  # pure Python, no jax

        p.append(f"pipeline.microbatches: interleaved needs a multiple of mesh.pp x "
                 f"pipeline.transfer_latency = {group}, got {pl.microbatches}; use "
                 f"{multiples_near(pl.microbatches, group)}")
    if pl.schedule == "interleaved" and m.pp > 1 and pl.virtual_stages < 2:
        p.append("pipeline.virtual_stages: interleaved needs >= 2; set pipeline.virtual_stages=2")
    if pl.schedule == "zb-v" and m.pp > 1 and pl.virtual_stages != 2:
        p.append("pipeline.virtual_stages: zb-v places exactly 2 chunks per stage; set it to 2")
    if pl.transfer_latency not in (1, 2, "auto"):
        p.append(f"pipeline.transfer_latency: must be 1 or 2, got {pl.transfer_latency}; use 2 "
                 f"to overlap stage-to-stage transfers with compute")
    if pl.paired is True and pl.transfer_latency not in (1, "auto"):
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
    return p


def _train_problems(cfg: Config) -> list[str]:
    """Steps, learning rate, batch, loss scale, finite floats, checkpoints and guard."""
    p: list[str] = []
    m, mo, t, pl, ov = cfg.mesh, cfg.model, cfg.train, cfg.pipeline, cfg.overlap
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
    return p


def _run_problems(cfg: Config) -> list[str]:
    """Overlap sizes, data, evaluation, sampling, HF weights, slow axis and processes."""
    p: list[str] = []
    m, mo, t, pl, ov = cfg.mesh, cfg.model, cfg.train, cfg.pipeline, cfg.overlap
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
    return p


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
    if cfg.overlap.moe_chunks != "auto" and cfg.overlap.moe_chunks < 1:
        p.append(f"overlap.moe_chunks: must be >= 1, got {cfg.overlap.moe_chunks}")
    if mo.experts == 0:
        if m.ep > 1:
            p.append(f"mesh.ep: {m.ep} splits experts, but model.experts is 0 (dense); set "
                     f"model.experts or mesh.ep=1")
        return
    if m.ep > 1 and (m.dp % m.ep or mo.experts % m.ep):
        p.append(f"mesh.ep: {m.ep} must divide mesh.dp={m.dp} and model.experts="
                 f"{mo.experts}; pick a common divisor")
    elif (m.ep > 1 and m.pp > 1 and cfg.overlap.grad_bucket_mb != "auto"
          and cfg.overlap.grad_bucket_mb > 0):
        p.append(f"overlap.grad_bucket_mb: in-loop buckets under a pipeline do not take the "
                 f"experts each rank stores (mesh.ep={m.ep}); set it to 0 or auto")
    if m.ep > 1 and not m.dp % m.ep and mo.experts % m.dp:
        p.append(f"model.experts: {mo.experts} experts cannot be stored split over "
                 f"mesh.dp={m.dp} ranks (mesh.ep > 1 stores E/dp experts per rank); use a "
                 f"dp that divides the experts (hosts as mesh.dcn) or mesh.ep=1")
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
    if m.dcn > 1 and cfg.overlap.dcn_delay == 1 and cfg.overlap.dcn_delay_mode == "local":
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
