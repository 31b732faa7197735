"""State that shares arrays runs and gives `jax.jit`'s numbers: the same jax arrays passed
as two arguments (an EMA started as `ema = params`) or used at two paths of the params
(one zeros array as two biases). auto_shard donates its state arguments, and XLA refuses
to donate one buffer twice, so each donated leaf must get a buffer of its own; and each
use of a shared array must still be found as its own parameter.

Models are tiny and plans analytic (`verify=0`); the reference runs `jax.jit(step)` on
deep copies (which do not share), so donation of the sharded run cannot touch it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models import copy_tree

import jaxwap

RTOL, ATOL = 2e-5, 2e-6


def assert_close(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(
        np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=RTOL, atol=ATOL), a, b)


def mlp_params():
    rng = np.random.default_rng(0)
    return {"w1": jnp.asarray(0.1 * rng.standard_normal((16, 32)), jnp.float32),
            "b1": jnp.zeros((32,)),
            "w2": jnp.asarray(0.1 * rng.standard_normal((32, 8)), jnp.float32)}


def data():
    rng = np.random.default_rng(1)
    return (jnp.asarray(rng.standard_normal((16, 16)), jnp.float32),
            jnp.asarray(rng.standard_normal((16, 8)), jnp.float32))


def ema_step(p, ema, batch):
    x, y = batch
    loss = lambda p: jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)  # noqa: E731
    value, g = jax.value_and_grad(loss)(p)
    p = jax.tree.map(lambda a, g: a - 0.1 * g, p, g)
    ema = jax.tree.map(lambda e, q: 0.9 * e + 0.1 * q, ema, p)
    return p, ema, value


@pytest.mark.parametrize("layout", [
    {},
    {"mesh_shape": {"data": 2, "model": 4}, "strategies": ("tp",)},
], ids=["auto", "tp-2x4"])
def test_ema_that_is_params_runs_donated_and_matches_jit(layout):
    """`ema = params`: the very same arrays as two donated arguments. Two steps (the
    second feeds back the step's own outputs) give jax.jit's numbers."""
    params, batch = mlp_params(), data()
    single = jax.jit(ema_step)
    ref_p, ref_ema = copy_tree(params), copy_tree(params)
    for _ in range(2):
        ref_p, ref_ema, ref_loss = single(ref_p, ref_ema, batch)

    step = jaxwap.auto_shard(ema_step, cache=False, verify=0, **layout)
    p = copy_tree(params)
    ema = p                                     # the same arrays, not a copy
    for _ in range(2):
        p, ema, loss = step(p, ema, batch)
    assert_close((ref_p, ref_ema, ref_loss), (p, ema, loss))
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ema), strict=True):
        assert a is not b and not a.is_deleted() and not b.is_deleted()


def tied_step(p, x, y):
    def loss(p):
        h = jnp.tanh(x @ p["l0"]["w"] + p["l0"]["b"])
        return jnp.mean((h @ p["l1"]["w"] + p["l1"]["b"] - y) ** 2)
    value, g = jax.value_and_grad(loss)(p)
    return jax.tree.map(lambda a, g: a - 0.1 * g, p, g), value


def test_one_array_at_two_param_paths_is_two_params_and_matches_jit():
    """One zeros array as both biases: each path is its own parameter in the plan (not
    'params not found'), and the step, which donates that array twice over, runs and gives
    jax.jit's numbers."""
    rng = np.random.default_rng(0)
    zeros = jnp.zeros((32,))
    params = {"l0": {"w": jnp.asarray(0.1 * rng.standard_normal((16, 32)), jnp.float32),
                     "b": zeros},
              "l1": {"w": jnp.asarray(0.1 * rng.standard_normal((32, 32)), jnp.float32),
                     "b": zeros}}
    x = jnp.asarray(rng.standard_normal((16, 16)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
    ref = jax.jit(tied_step)(copy_tree(params), x, y)

    step = jaxwap.auto_shard(tied_step, cache=False, verify=0)
    keys = {p.keystr for p in step.plan_for(params, x, y).params}
    assert keys == {"['l0']['b']", "['l0']['w']", "['l1']['b']", "['l1']['w']"}
    out = step(params, x, y)
    assert_close(ref, out)
    assert out[0]["l0"]["b"] is not out[0]["l1"]["b"]


def ema_in_state_step(p, state, batch):
    """State as a tuple `(ema, opt_state)`: the EMA's paths (`args[1][0]['w1']`) end in
    more of the new params' output path (`out[0]['w1']`) than the params' own do."""
    ema, (count,) = state
    p, ema, value = ema_step(p, ema, batch)
    return p, (ema, (count + 1,)), value


@pytest.mark.parametrize("strategy", ["zero1", "offload"])
def test_params_beside_a_tuple_of_ema_and_state_come_back_on_their_own_layout(strategy):
    """The new params came back on the EMA's layout: split over data under ZeRO-1, in
    pinned host memory under offload (the buffers donated for them unused, and a user's
    own jit of the returned params failing on their memory kind)."""
    params, batch = mlp_params(), data()
    state = (copy_tree(params), (jnp.zeros((), jnp.int32),))
    ref = jax.jit(ema_in_state_step)(copy_tree(params), copy_tree(state), batch)
    step = jaxwap.auto_shard(ema_in_state_step, cache=False, verify=0,
                             mesh_shape={"data": 4}, strategies=(strategy,))
    p = copy_tree(params)
    step.plan_for(p, state, batch)
    went_in = jax.tree.map(lambda a: a.sharding, step.shard(p))
    out = step(p, copy_tree(state), batch)
    assert all(strategy in pl.strategy for pl in step.plan.params), step.plan.params
    for name, a in out[0].items():
        assert a.sharding.spec == went_in[name].spec, name
        assert a.sharding.memory_kind == went_in[name].memory_kind, name
    assert_close(ref, out)
