"""Which argument leaf is a parameter, a mirror of one, batch data or other: the cases where
paths and shapes alone mislead (flat-tuple params beside a batch tuple, a legacy PRNG key
beside a batch of one)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxwap
from jaxwap.analysis.roles import BATCH, OTHER, PARAM, LeafRole
from jaxwap.analysis.trace import layout_of

K1, K2, K3 = jax.random.split(jax.random.PRNGKey(0), 3)


def flat_problem(y_shape=(16, 16)):
    """Plain-JAX params `(W (16,16), b (16,))` and a batch `(x (16,16), y)`: `x` ends at
    the path `0` with the shape of `W`, `y` of shape (16,) at `1` with that of `b`."""
    params = (jax.random.normal(K1, (16, 16)) * 0.1, jnp.zeros((16,)))
    x = jax.random.normal(K2, (16, 16))
    y = jax.random.normal(K3, y_shape)
    return params, (x, y)


def mse(p, x, y):
    pred = x @ p[0] + p[1]
    return jnp.mean((pred - (y if y.ndim == 2 else y[:, None])) ** 2), pred


def sgd(p, batch):
    (loss, pred), g = jax.value_and_grad(mse, has_aux=True)(p, *batch)
    return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g), loss, pred


def roles(table):
    return dict(zip(table.paths, table.roles, strict=True))


def test_batch_leaf_at_a_flat_tuple_params_path_is_not_donated_and_step_matches_jit():
    params, batch = flat_problem()
    step = jaxwap.auto_shard(sgd, cache=False)
    ref_p, ref_batch = jax.tree_util.tree_map(jnp.copy, (params, batch))
    p = jax.tree_util.tree_map(jnp.copy, params)
    ref = jax.jit(sgd)
    for _ in range(2):                              # the same batch fed twice
        p, loss, pred = step(p, batch)
        ref_p, ref_loss, ref_pred = ref(ref_p, ref_batch)
        assert not batch[0].is_deleted() and not batch[1].is_deleted()
        for a, b in zip(jax.tree_util.tree_leaves((p, loss, pred)),
                        jax.tree_util.tree_leaves((ref_p, ref_loss, ref_pred)), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    r = roles(step._current.layout.inputs)
    assert r["args[1][0]"].kind == BATCH and r["args[1][1]"].kind == BATCH
    assert r["args[0][0]"] == LeafRole(PARAM, 0, mirror=False)


def _adam_step(p, o, batch):
    tx = optax.adam(1e-2)
    (loss, _), g = jax.value_and_grad(mse, has_aux=True)(p, *batch)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o, loss


def _momentum_step(p, m, batch):
    (loss, _), g = jax.value_and_grad(mse, has_aux=True)(p, *batch)
    m = jax.tree_util.tree_map(lambda m, g: 0.9 * m + g, m, g)
    return jax.tree_util.tree_map(lambda a, m: a - 0.1 * m, p, m), m, loss


@pytest.mark.parametrize("case", ["adam", "adam, outputs reordered", "adam, batch first",
                                  "hand-rolled momentum", "momentum, outputs reordered"])
def test_batch_matching_params_paths_and_shapes_is_data_beside_real_mirrors(case):
    # y (16,) matches b too: the whole batch tuple looks like the params tuple
    params, batch = flat_problem(y_shape=(16,))
    state = (optax.adam(1e-2).init(params) if "adam" in case
             else jax.tree_util.tree_map(jnp.zeros_like, params))
    step = _adam_step if "adam" in case else _momentum_step
    args = (params, state, batch)
    if "reordered" in case:
        def step(p, o, b, inner=step):
            new_p, new_o, loss = inner(p, o, b)
            return loss, new_o, new_p
    elif "batch first" in case:
        def step(p, b, o, inner=step):
            return inner(p, o, b)
        args = (params, batch, state)
    layout, _ = layout_of(step, args, {}, None)
    where = 1 if "batch first" in case else 2
    for path, r in roles(layout.inputs).items():
        if path.startswith(f"args[{where}]"):
            assert r.kind == BATCH, (path, r)               # never a mirror, never donated
        elif path.startswith("args[0]"):
            assert r.kind == PARAM and not r.mirror, (path, r)
        elif r.kind != OTHER:                               # adam's count is other
            assert r.kind == PARAM and r.mirror, (path, r)
    assert layout.inputs.batch_size == 16
    assert sum(r.mirror for r in layout.inputs.roles) == (4 if "adam" in case else 2)


def _noisy_step(p, x, key, impl="threefry2x32"):
    def loss(p):
        k = jax.random.wrap_key_data(key, impl=impl)        # a raw key of that impl
        xn = x + 0.1 * jax.random.normal(k, x.shape)
        return jnp.mean((xn @ p["w"] - x) ** 2)
    loss, g = jax.value_and_grad(loss)(p)
    return jax.tree_util.tree_map(lambda a, g: a - 0.1 * g, p, g), loss


def test_legacy_prng_key_does_not_make_a_batch_of_one_a_batch_of_two():
    params = {"w": jnp.ones((16, 16)) * 0.1}
    x = jnp.ones((1, 16))
    step = jaxwap.auto_shard(_noisy_step, cache=False)
    plan = step.plan_for(params, x, jax.random.PRNGKey(0))
    r = roles(step._current.layout.inputs)
    assert plan.batch_size == 1
    assert r["args[1]"].kind == BATCH and r["args[2]"].kind == OTHER
    assert "batch: 1 " in plan.explain()


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_legacy_prng_key_is_neither_a_batch_vote_nor_batch_data(impl):
    key = jax.random.PRNGKey(0, impl=impl)          # uint32[2] or uint32[4]
    width = key.shape[0]
    params = {"w": jnp.ones((16, 16)) * 0.1}
    # one batch leaf with the key's width as its batch: the key must not be data with it
    step = functools.partial(_noisy_step, impl=impl)
    layout, _ = layout_of(step, (params, jnp.ones((width, 16)), key), {}, None)
    r = roles(layout.inputs)
    assert layout.inputs.batch_size == width
    assert r["args[1]"].kind == BATCH and r["args[2]"].kind == OTHER


def test_explicit_batch_size_still_takes_a_uint32_leaf_of_that_length_as_data():
    params = {"w": jnp.ones((2,))}

    def step(p, labels):
        loss, g = jax.value_and_grad(lambda p: jnp.sum(p["w"] * labels.astype(jnp.float32)))(p)
        return jax.tree_util.tree_map(lambda a, g: a - 0.1 * g, p, g), loss

    labels = jnp.arange(2, dtype=jnp.uint32)
    layout, _ = layout_of(step, (params, labels), {}, None, batch_size=2)
    assert layout.inputs.batch_size == 2 and roles(layout.inputs)["args[1]"].kind == BATCH


def test_a_batch_leaf_the_step_returns_untouched_stays_data():
    # labels handed back beside the predictions (or the whole batch, for logging) were
    # taken for carried state: replicated, and with the whole batch returned the step had
    # no batch to split. Returned untouched, an input is not made state by that.
    params = {"w": jnp.ones((16, 10)) * 0.1}
    batch = {"x": jnp.ones((16, 16)), "labels": jnp.arange(16) % 10}

    def step(p, b):
        def loss(p):
            logits = b["x"] @ p["w"]
            lp = jax.nn.log_softmax(logits)
            return -jnp.mean(jnp.take_along_axis(lp, b["labels"][:, None], 1)), logits
        (value, logits), g = jax.value_and_grad(loss, has_aux=True)(p)
        p = jax.tree_util.tree_map(lambda a, g: a - 0.1 * g, p, g)
        return p, {"loss": value, "preds": jnp.argmax(logits, -1), "labels": b["labels"]}

    def step_all(p, b):
        return (*step(p, b), b)

    layout, _ = layout_of(step, (params, batch), {}, params)
    roles = dict(zip(layout.inputs.paths, layout.inputs.roles, strict=True))
    assert roles["args[1]['labels']"].kind == BATCH and roles["args[1]['x']"].kind == BATCH
    plan = jaxwap.auto_shard(step_all, cache=False, verify=0,
                             mesh_shape={"data": 8}).plan_for(params, batch)
    assert plan.mesh_shape == {"data": 8, "model": 1} and plan.batch_size == 16
