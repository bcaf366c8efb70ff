"""B/W split of a block's backward: B's input, output-gradient and small-parameter gradients
plus W's weight-gradient GEMMs give exactly the block's full gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_overlap.parallel.collectives import Parallel
from jax_overlap.pipeline.weight_grads import split_block
from models.gpt import GPT


def _split_grads(block, p, x, dy):
    """(dx, d params) from the split: B's pullback, then W's weight matmuls."""
    split, why = split_block(block, p, x)
    assert split is not None, why
    leaves, treedef = jax.tree.flatten(p)
    other = split.other_leaves(len(leaves))

    def merged(values, idx, base):
        out = list(base)
        for i, v in zip(idx, values):
            out[i] = v
        return jax.tree.unflatten(treedef, out)

    z0 = [jnp.zeros(shape, dtype) for shape, dtype, _ in split.z_avals]
    y, pull_b, acts = jax.vjp(
        lambda x_, z_, po: split.forward(merged(po, other, leaves), x_, z_), x, z0,
        [leaves[i] for i in other], has_aux=True)
    dx, dz, d_other = pull_b(dy)
    dot = split.dot_leaves
    _, pull_w = jax.vjp(lambda pd: split.weight_matmuls(merged(pd, dot, leaves), acts),
                        [leaves[i] for i in dot])
    (d_dot,) = pull_w(dz)
    grads = list(leaves)
    for i, g in zip(other, d_other):
        grads[i] = g
    for i, g in zip(split.dot_leaves, d_dot):
        grads[i] = g
    return y, dx, jax.tree.unflatten(treedef, grads), split


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpt_block_split_matches_its_vjp(dtype):
    model = GPT(2, 32, 4, 64, 256, 16, True)
    p = jax.tree.map(lambda a: a[0], model.init(jax.random.key(0))["blocks"])
    par = Parallel(compute_dtype=jnp.bfloat16 if dtype == "bf16" else jnp.float32)
    block = lambda p_, x_: model.block(p_, x_, par)  # noqa: E731
    x = jax.random.normal(jax.random.key(1), (2, 16, 32))
    y_ref, pull = jax.vjp(block, p, x)
    dy = jax.random.normal(jax.random.key(2), y_ref.shape, y_ref.dtype)
    dp_ref, dx_ref = pull(dy)
    y, dx, dp, split = _split_grads(block, p, x, dy)
    # The four weight matmuls (QKV, attention out, MLP in and out) are W's; biases and
    # LayerNorm parameters are B's.
    names = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(p)[0]]
    assert sorted(names[i] for i in split.dot_leaves) == ["['w_in']", "['w_o']", "['w_out']",
                                                          "['w_qkv']"]
    # Six matmuls (q, k and v apiece), four inputs kept for W: q, k and v share the norm's
    # output, so it is stashed once (stashed three times, GPT-1.3B pp4 x dp2 ZB-V held 39.8
    # GiB instead of 36.4, deviceless H100).
    _, acts = split.forward(p, x, [jnp.zeros(s_, d_) for s_, d_, _ in split.z_avals])
    assert len(split.z_avals) == 6 and len(acts) == 4
    tol = 1e-6 if dtype == "fp32" else 2e-2
    np.testing.assert_allclose(y, y_ref, atol=tol)
    np.testing.assert_allclose(dx, dx_ref, atol=tol)
    for got, want in zip(jax.tree.leaves(dp), jax.tree.leaves(dp_ref)):
        np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


def test_shared_weight_is_b_s_and_transposed_use_is_split():
    """A weight used both in a matmul and elsewhere stays with B; a transposed use is a
    weight matmul like any other."""

    def block(p, x):
        h = jnp.tanh(x @ p["a"].T) * p["s"]
        return h @ p["b"] + p["b"].sum(0)

    p = {"a": jnp.ones((8, 4)) * 0.1, "b": jnp.ones((8, 4)) * 0.2, "s": jnp.ones((8,))}
    x = jax.random.normal(jax.random.key(0), (3, 4))
    y_ref, pull = jax.vjp(block, p, x)
    dy = jnp.ones_like(y_ref)
    dp_ref, dx_ref = pull(dy)
    y, dx, dp, split = _split_grads(block, p, x, dy)
    assert split.dot_leaves == (0,)  # "a"; "b" is also summed, "s" scales
    np.testing.assert_allclose(dx, dx_ref, atol=1e-6)
    for k in p:
        np.testing.assert_allclose(dp[k], dp_ref[k], atol=1e-6)


def test_weight_matmul_inside_a_loop_is_not_split():
    def block(p, x):
        return jax.lax.scan(lambda h, _: (h @ p["w"], None), x, None, length=2)[0]

    split, why = split_block(block, {"w": jnp.eye(4)}, jnp.ones((2, 4)))
    assert split is None and "scan" in why
