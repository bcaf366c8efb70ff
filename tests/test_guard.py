"""Step guards: non-finite and spike detection, skip semantics, rollback policy."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jax_overlap.training.guard import (
    GuardState,
    RollbackPolicy,
    guard_init,
    guard_update,
    select_tree,
)


def feed(state, losses, **kw):
    oks = []
    for loss in losses:
        ok, state = guard_update(state, jnp.float32(loss), jnp.float32(1.0), **kw)
        oks.append(bool(ok))
    return oks, state


@pytest.mark.parametrize("loss,gnorm", [(math.nan, 1.0), (math.inf, 1.0), (-math.inf, 1.0), (1.0, math.nan), (1.0, math.inf)])
def test_non_finite_loss_or_grads_rejected(loss, gnorm):
    _, state = feed(guard_init(8), [3.0, 2.9, 2.8])
    ok, new = guard_update(state, jnp.float32(loss), jnp.float32(gnorm))
    assert not bool(ok)
    assert int(new.consecutive_bad) == 1
    assert int(new.count) == 3  # the bad loss did not enter the window
    np.testing.assert_array_equal(new.losses, state.losses)


def test_non_finite_rejected_even_before_history():
    ok, new = guard_update(guard_init(8), jnp.float32(jnp.nan), None)
    assert not bool(ok) and int(new.consecutive_bad) == 1


def test_spike_threshold_known_numbers():
    # Window [1, 2, 3, 4]: mean 2.5, population std sqrt(1.25) = 1.1180;
    # with sigma 2 the threshold is 2.5 + 2.2361 = 4.7361.
    kw = dict(spike_sigma=2.0, min_history=4, min_std_frac=0.0)
    _, state = feed(guard_init(4), [1.0, 2.0, 3.0, 4.0], **kw)
    ok_below, _ = guard_update(state, jnp.float32(4.73), None, **kw)
    ok_above, after = guard_update(state, jnp.float32(4.74), None, **kw)
    assert bool(ok_below) and not bool(ok_above)
    assert int(after.consecutive_bad) == 1


def test_no_spike_judgement_until_min_history():
    kw = dict(spike_sigma=1.0, min_history=3, min_std_frac=0.0)
    oks, _ = feed(guard_init(8), [1.0, 1.1, 100.0], **kw)  # only 2 accepted before 100
    assert oks == [True, True, True]
    oks, _ = feed(guard_init(8), [1.0, 1.1, 1.2, 100.0], **kw)
    assert oks == [True, True, True, False]


def test_rejected_losses_do_not_raise_the_bar_and_recovery_resets_count():
    kw = dict(spike_sigma=3.0, min_history=4)
    oks, state = feed(guard_init(8), [2.0, 2.1, 1.9, 2.0, 2.05, 50.0, 60.0, 70.0], **kw)
    assert oks == [True] * 5 + [False] * 3
    assert int(state.consecutive_bad) == 3
    ok, state = guard_update(state, jnp.float32(2.0), None, **kw)
    assert bool(ok) and int(state.consecutive_bad) == 0 and int(state.count) == 6


def test_ring_buffer_keeps_last_window_losses():
    _, state = feed(guard_init(3), [5.0, 4.0, 3.0, 2.0, 1.0], spike_sigma=100.0)
    assert sorted(np.asarray(state.losses).tolist()) == [1.0, 2.0, 3.0]


def test_no_false_positive_on_smooth_noisy_decreasing_curve():
    rng = np.random.default_rng(0)
    steps = np.arange(2000)
    curve = 2.0 + 8.0 * np.exp(-steps / 300.0)
    losses = curve * (1.0 + 0.01 * rng.standard_normal(steps.size))
    update = jax.jit(lambda s, l: guard_update(s, l, jnp.float32(1.0), spike_sigma=6.0))
    state, rejected = guard_init(50), 0
    for loss in losses:
        ok, state = update(state, jnp.float32(loss))
        rejected += not bool(ok)
    assert rejected == 0
    # ... and the same guard does catch a real spike at the end of it.
    ok, _ = update(state, jnp.float32(losses[-1] * 1.5))
    assert not bool(ok)


def test_jit_matches_eager_and_scans():
    losses = jnp.array([3.0, 2.5, 2.4, 2.3, 9.0, jnp.nan, 2.2], jnp.float32)

    def body(state, loss):
        ok, state = guard_update(state, loss, jnp.float32(0.5), spike_sigma=3.0, min_history=3)
        return state, ok

    state_scan, oks_scan = jax.jit(lambda s: jax.lax.scan(body, s, losses))(guard_init(4))
    oks_eager, state_eager = feed(guard_init(4), losses.tolist(), spike_sigma=3.0, min_history=3)
    assert oks_scan.tolist() == oks_eager == [True, True, True, True, False, False, True]
    for a, b in zip(state_scan, state_eager):
        np.testing.assert_array_equal(a, b)
    assert isinstance(state_scan, GuardState)


def test_select_tree_skips_update_without_advancing_adam():
    params = {"w": jnp.arange(4.0), "b": jnp.ones(2)}
    opt = optax.adamw(0.1)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, guard, loss):
        grads = jax.tree.map(jnp.ones_like, params)
        gnorm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))
        ok, guard = guard_update(guard, loss, gnorm)
        updates, new_opt = opt.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        return select_tree(ok, new_params, params), select_tree(ok, new_opt, opt_state), guard

    guard = guard_init(4)
    p1, o1, guard = step(params, opt_state, guard, jnp.float32(1.0))
    p2, o2, guard = step(p1, o1, guard, jnp.float32(jnp.nan))
    for a, b in zip(jax.tree.leaves((p2, o2)), jax.tree.leaves((p1, o1))):
        np.testing.assert_array_equal(a, b)
    assert int(o2[0].count) == 1 and int(guard.consecutive_bad) == 1
    p3, o3, _ = step(p2, o2, guard, jnp.float32(1.0))
    assert int(o3[0].count) == 2 and not np.array_equal(p3["w"], p2["w"])


def test_rollback_policy():
    policy = RollbackPolicy(max_skips=2, skip_batches=5, lr_scale=0.5)
    assert [policy.should_roll_back(n) for n in range(5)] == [False, False, False, True, True]
    assert policy.should_roll_back(jnp.int32(3))
    with pytest.raises(ValueError):
        RollbackPolicy(max_skips=-1)
    with pytest.raises(ValueError):
        guard_init(1)
