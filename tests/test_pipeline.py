"""Pipeline stages (`jaxwap.pipeline`): a pipelined stack equals the plain `lax.scan` over
the same layers, forward and gradients, in float32.

2 and 4 stages, each with a data axis, on the 8 simulated CPU devices; GPipe (one round)
and the circular schedule (two rounds, micro-batches >= stages). The backward pipeline is
the forward loop differentiated."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxwap.pipeline import STAGE, pipelined, stage_order, to_stages

L, D, B = 8, 16, 16
AUTO = jax.sharding.AxisType.Auto  # as jaxwap's meshes: XLA places what shard_map takes


def _layer(w, h):
    return jnp.tanh(h @ w["kernel"] + w["bias"])


def _setup():
    rng = np.random.default_rng(0)
    params = {"kernel": jnp.asarray(rng.standard_normal((L, D, D)) / np.sqrt(D), jnp.float32),
              "bias": jnp.asarray(rng.standard_normal((L, D)) * 0.1, jnp.float32)}
    x = jnp.asarray(rng.standard_normal((B, D)), jnp.float32)
    return params, x


def _reference(params, x):
    return jax.lax.scan(lambda h, w: (_layer(w, h), None), x, params)[0]


def test_stage_order_gives_each_stage_its_rounds():
    # 8 layers, 2 stages, 2 rounds: chunks of 2; stage 0 holds chunks 0 and 2
    assert stage_order(8, 2, 2) == [0, 1, 4, 5, 2, 3, 6, 7]
    assert stage_order(8, 4, 1) == list(range(8))
    with pytest.raises(ValueError, match="8 layers cannot be split into 3 stages"):
        stage_order(8, 3, 1)


@pytest.mark.parametrize("stages, data, micro, repeats", [
    (2, 4, 4, 1), (4, 2, 4, 1), (2, 4, 2, 2), (4, 2, 4, 2)])
def test_pipelined_stack_equals_the_scan_forward_and_backward(stages, data, micro, repeats):
    params, x = _setup()
    mesh = jax.make_mesh((stages, data), (STAGE, "data"), axis_types=(AUTO, AUTO))
    f = pipelined(_layer, mesh, micro_batches=micro, repeats=repeats, data_axis="data")
    staged = to_stages(params, stages, repeats)

    got = jax.jit(f)(staged, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(_reference(params, x)),
                               rtol=1e-5, atol=1e-6)

    def loss(fn, p, x):
        return jnp.sum(fn(p, x) ** 2)

    g_p, g_x = jax.jit(jax.grad(lambda p, x: loss(f, p, x), argnums=(0, 1)))(staged, x)
    r_p, r_x = jax.grad(lambda p, x: loss(_reference, p, x), argnums=(0, 1))(params, x)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                         rtol=1e-5, atol=1e-6),
                 (g_p, g_x), (to_stages(r_p, stages, repeats), r_x))


def test_the_circular_schedule_needs_as_many_micro_batches_as_stages():
    mesh = jax.make_mesh((4, 2), (STAGE, "data"), axis_types=(AUTO, AUTO))
    with pytest.raises(ValueError, match="micro_batches=2 < 4 stages"):
        pipelined(_layer, mesh, micro_batches=2, repeats=2)
