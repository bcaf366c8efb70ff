"""The attention kernel a block runs (`model.attention`): plain einsums or a fused kernel.

The plain path (written in each model) materialises the scores and probabilities as
`[b, h, T, T]` tensors -- in fp32, the softmax's precision -- and on a GPU those dominate
the bytes of every non-GEMM kernel of the step. The fused path is cuDNN's flash attention
through `jax.nn.dot_product_attention(implementation="cudnn")`: one custom call forward
(`__cudnn$fmhaSoftmax`) and one backward, keeping only the output and the softmax's
log-sum-exp per query for the backward.

The choice travels in `Parallel.attention`, which `ParallelPlan.parallel()` fills in from
the plan's `attention` (`auto` resolved by `resolve` for the plan's target), so it reaches the
block the same way on the pp = 1 path, inside the pipeline executor's branches and under
every remat policy. The decision is the target's, never `jax.default_backend()`: a GPU step
compiled without a GPU (`analysis.deviceless`) traces on a CPU backend.

Values of `Parallel.attention`:
  plain  the model's einsum path (the reference; fp32 numerics of the CPU tests)
  fused  cuDNN flash attention (GPU only)
  xla    the same `jax.nn.dot_product_attention` call with XLA's implementation: runs
         anywhere, so tests compare the fused code path against the plain one on a CPU

A model supports it by calling `fused_attention` when `use_fused(par)` holds; a model that
never does simply runs its own attention (the knob then changes nothing for it).
"""

from __future__ import annotations

import math

import jax

from jax_overlap.parallel import compat

KERNELS = ("plain", "fused", "xla")
# The model kinds whose blocks call `fused_attention` (`models/gpt.py`, `bert.py`, `llama.py`).
ATTENTION_KINDS = ("gpt", "bert", "llama")
# Head dims cuDNN's flash attention takes on every supported GPU: a multiple of 8 up to 128
# (Hopper and later go to 256, but a deviceless compile cannot see the device's generation).
MAX_HEAD_DIM = 128
FUSED_DTYPES = ("bf16", "fp16")


def unsupported(precision: str, head_dim: int) -> str | None:
    """Why the fused kernel cannot run this attention, or None when it can."""
    if precision not in FUSED_DTYPES:
        return f"train.precision={precision}: cuDNN flash attention needs bf16 or fp16"
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return (f"head dim {head_dim} (d_model / heads): cuDNN flash attention needs a "
                f"multiple of 8 up to {MAX_HEAD_DIM}")
    return None


def resolve(knob: str, *, accelerator: bool, target_name: str, kind: str, precision: str,
            head_dim: int) -> tuple[str, str | None, str | None]:
    """`model.attention` resolved for a target: `(value, why, problem)`.

    Args:
      knob: the config value, "auto", "fused" or "plain".
      accelerator: whether the target is a GPU (`plan.Target.accelerator`).
      target_name: the target's name, for the reason.
      kind: `model.kind`.
      precision: `train.precision`.
      head_dim: `d_model // heads`.

    Returns:
      value: "fused" or "plain" (what the blocks run).
      why: the reason, for `plan.choices` (None unless `knob` is "auto").
      problem: a config error line when an explicit `fused` cannot run (else None).
    """
    if knob == "plain":
        return "plain", None, None
    if kind not in ATTENTION_KINDS:
        why = f"model.kind={kind} has no attention"
        if knob == "fused":
            return "plain", None, f"model.attention: fused: {why}; use auto or plain"
        return "plain", why, None
    reason = (None if accelerator else
              f"{target_name}: the fused kernel (cuDNN flash attention) needs a GPU")
    reason = reason or unsupported(precision, head_dim)
    if knob == "fused":
        if reason:
            return "plain", None, f"model.attention: fused: {reason}; use auto or plain"
        return "fused", None, None
    if reason:
        return "plain", reason + "; the einsum path", None
    return "fused", (f"{target_name}, {precision}, head dim {head_dim}: cuDNN flash attention, "
                     f"no [b, h, T, T] scores or probabilities in memory (traced on one H200: "
                     f"GPT-1.3B 1.28 s a step, 1.91 s with the einsums)"), None


def use_fused(par) -> bool:
    """Whether a block given `par` (a `collectives.Parallel`) calls `fused_attention`."""
    return getattr(par, "attention", "plain") != "plain"


def fused_attention(q_bthe: jax.Array, k_bske: jax.Array, v_bske: jax.Array, *,
                    causal: bool, par) -> jax.Array:
    """softmax(q k^T / sqrt(e)) v per head, in one kernel: `(B, T, H, E)` queries,
    `(B, S, K, E)` keys and values with `H` a multiple of `K` (grouped-query attention: query
    head `h` reads key/value head `h // (H / K)`), output `(B, T, H, E)` in q's dtype.

    `par.attention` names the implementation ("fused": cuDNN, "xla": XLA's); the block's
    local heads are all it sees, so tensor parallelism (heads split over tp) needs nothing
    more. Called inside `jax.checkpoint`, the kernel is no dot: policies that keep matmul
    outputs (`save_dots`, `minimal`) recompute it in the backward, as `full` does.
    """
    impl = {"fused": "cudnn", "xla": "xla"}.get(par.attention)
    if impl is None:
        raise ValueError(f"attention: unknown kernel {par.attention!r}; use one of "
                         f"{', '.join(KERNELS)}")
    scale = 1.0 / math.sqrt(q_bthe.shape[-1])
    return compat.dot_product_attention(q_bthe, k_bske, v_bske, is_causal=causal, scale=scale,
                                        implementation=impl)
