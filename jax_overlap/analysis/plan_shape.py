"""What one device holds and does under a plan, from the config and its `ParallelPlan`:
layers per (virtual) stage, parameter elements, stashed activations, gradient buckets, and
which calibrated pieces a plan's compute is made of. Plain numbers for the cost model
(`plan_costs`), the tuner and the simulator's inputs."""

from __future__ import annotations

from jax_overlap.config import Config
from jax_overlap.model_api import param_counts


def micro_batch_size(cfg: Config, plan) -> int:
    """Sequences per microbatch on one data-parallel replica."""
    return plan.micro_batch


def layers_per_virtual_stage(cfg: Config, plan) -> list[int]:
    """Layers of each virtual stage in model order: the plan's `stage_layers` (even unless
    `pipeline.stage_layers` says otherwise)."""
    n_vs = plan.num_virtual_stages
    split = list(getattr(plan, "stage_layers", ()) or ())
    return split if len(split) == n_vs else [cfg.model.layers // n_vs] * n_vs


def layers_per_device(cfg: Config, plan) -> list[int]:
    """Layers each pipeline stage holds: the sum of its virtual stages'."""
    out = [0] * plan.pp
    for vs, n in enumerate(layers_per_virtual_stage(cfg, plan)):
        out[plan.schedule.placement[vs][0]] += n
    return out


def stage_param_elements(cfg: Config, plan) -> float:
    """Parameter elements one device holds: its stage's layers plus embedding and head.

    Every pipeline stage holds the (TP-sharded) embedding and head: they are replicated
    over ``pp`` and their gradients summed over it.
    """
    c = param_counts(cfg, plan.tp)
    layers = max(layers_per_device(cfg, plan))  # the most loaded stage (uneven splits)
    return layers * c.per_layer + c.embed + c.head


def quantities_for(cfg: Config, plan, split_backward: bool) -> tuple[str, ...]:
    """The pieces a plan's costs are made of (see :func:`compute_times`)."""
    block = block_variant(cfg, plan)
    out = [f"{block}_f", f"{block}_fb", "embed_f", "embed_fb", "head_f", "head_fb"]
    if plan.pp > 1 and split_backward:
        out += [f"{block}_fbx", f"{block}_fbw"]
    return tuple(out)


def block_variant(cfg: Config, plan) -> str:
    """``block1`` when the pipeline runs one-layer chunks (an unrolled scan), else ``block``."""
    n = max(layers_per_virtual_stage(cfg, plan))
    return "block1" if plan.pp > 1 and n == 1 and cfg.model.layers > 1 else "block"


def stash_bytes(cfg: Config, plan, vs: int) -> float:
    """Activation bytes one microbatch holds on ``vs`` between its ``F`` and backward.

    What each of the virtual stage's layers keeps under the remat policy
    (`hardware/memory.py`'s `layer_stash_bytes`: every residual for ``none`` -- per token
    the norm and matmul inputs, q, k, v, attention output, both MLP hidden tensors and the
    attention probabilities --, the block input for ``full``, the matmul outputs for
    ``save_dots`` / ``minimal``), the same at pp = 1 and pp > 1 (an F stashes its vjp
    residuals), plus the fp32 logits slice on the last virtual stage.
    """
    from jax_overlap.hardware.memory import layer_stash_bytes

    m, tp = cfg.model, plan.tp
    tokens = micro_batch_size(cfg, plan) * m.seq_len
    kept = layer_stash_bytes(m, micro_batch_size(cfg, plan), tp, cfg.train.precision,
                             plan.remat)
    layers = layers_per_virtual_stage(cfg, plan)[vs]
    last = vs == plan.num_virtual_stages - 1
    return float(kept * layers + (tokens * m.vocab // tp * 4 if last else 0))


def layer_residual_bytes(cfg: Config, plan) -> float:
    """Residual bytes one layer keeps for its backward, for one microbatch on one rank."""
    from jax_overlap.hardware.memory import layer_residual_bytes as per_layer

    return per_layer(cfg.model, micro_batch_size(cfg, plan), plan.tp, cfg.train.precision)


def transient_bytes(cfg: Config, plan) -> float:
    """Peak residuals the backward rebuilds on top of the stash: one layer's under
    ``model.remat: full`` (the others keep what their backward reads)."""
    return layer_residual_bytes(cfg, plan) if plan.remat == "full" else 0.0


def grad_buckets(cfg: Config, plan) -> tuple[tuple[float, ...], str]:
    """Gradient buckets of one device's stage and when they are issued.

    ``overlap.grad_bucket_mb = 0`` reduces each gradient array on its own after the
    backward (per stage: its layers' stacked arrays, the embedding's and the head's);
    otherwise buckets of that many MB are issued as the backward produces them.

    Returns:
      ``(bucket bytes in issue order, Plan.bucket_issue)``.
    """
    from jax_overlap.analysis.simulate import even_buckets

    grad_bytes = 2 if plan.overlap.grad_comm_dtype == "bf16" else 4
    c = param_counts(cfg, plan.tp)
    per_device = layers_per_device(cfg, plan)

    def of(layers):
        if plan.overlap.grad_bucket_bytes <= 0:
            leaves = [n * layers for n in c.leaves_per_layer] + list(c.embed_leaves
                                                                     + c.head_leaves)
            return tuple(float(n * grad_bytes) for n in reversed(leaves))
        total = (layers * c.per_layer + c.embed + c.head) * grad_bytes
        return even_buckets(total, plan.overlap.grad_bucket_bytes)

    issue = "after_backward" if plan.overlap.grad_bucket_bytes <= 0 else "during_backward"
    if len(set(per_device)) == 1:  # every stage alike: one list
        return of(per_device[0]), issue
    return tuple(of(n) for n in per_device), issue
