"""`parallel.compute_cast`: which parameters a function only reads in the compute dtype."""

import jax
import jax.numpy as jnp
import numpy as np

from jax_overlap.parallel.compute_cast import cast_leaves, cast_on_use


def _block(p, x):
    h = x @ p["w"].reshape(4, 4).astype(jnp.bfloat16)               # cast after a reshape
    qk = jnp.concatenate([p["q"], p["k"]], axis=1).astype(jnp.bfloat16)  # after a concat
    h = (h @ qk[:, :4]).astype(jnp.float32) * p["scale"]           # a norm's scale in fp32
    router = x.astype(jnp.float32) @ p["router"]                    # read in fp32 once ...
    mixed = x @ p["router"].T.astype(jnp.bfloat16)                  # ... and cast once
    return h.sum() + router.sum() + mixed.astype(jnp.float32).sum() + p["b"].sum()


PARAMS = {"w": jnp.ones((16,)), "q": jnp.ones((4, 2)), "k": jnp.ones((4, 2)),
          "scale": jnp.ones((4,)), "router": jnp.ones((4, 4)), "b": jnp.ones((4,)),
          "unused": jnp.ones((3,))}


def test_only_leaves_every_read_of_which_is_a_cast_are_cast():
    x = jnp.ones((2, 4), jnp.bfloat16)
    mask = dict(zip(sorted(PARAMS), cast_on_use(_block, PARAMS, x, dtype=jnp.bfloat16)))
    assert mask == {"b": False, "k": True, "q": True, "router": False, "scale": False,
                    "unused": False, "w": True}


def test_cast_once_gives_the_values_and_gradients_of_casting_at_every_use():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 4)), jnp.bfloat16)
    params = jax.tree.map(
        lambda w: w * jnp.asarray(np.random.default_rng(1).normal(size=w.shape), jnp.float32),
        PARAMS)
    mask = cast_on_use(_block, params, x, dtype=jnp.bfloat16)
    once = cast_leaves(params, mask, jnp.bfloat16)
    assert [leaf.dtype for leaf in jax.tree.leaves(once)].count(jnp.bfloat16) == sum(mask)
    value, grads = jax.value_and_grad(_block)(params, x)
    value_once, grads_once = jax.value_and_grad(_block)(once, x)
    assert value == value_once
    for g, g_once in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_once)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(g_once, np.float32))
