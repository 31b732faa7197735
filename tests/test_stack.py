"""The layer stack of a loss function (`jaxwap.stack`): found in its jaxpr from abstract
arguments, refused with the reason when it cannot be pipelined, and run pipelined by a
rewritten loss that equals the original, value and gradients, in float32 (rtol 1e-5)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxwap.pipeline import micro_join, micro_split
from jaxwap.records import STAGE
from jaxwap.stack import NoLayerScan, find_layer_scan, pipelined_loss

L, D, B = 8, 16, 16
AUTO = jax.sharding.AxisType.Auto


def _setup():
    rng = np.random.default_rng(1)
    f = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[-1]), jnp.float32)  # noqa: E731
    params = {"a_in": f(4, D), "blocks": {"w": f(L, D, D), "scale": f(L, D)}, "z_out": f(D, 3)}
    batch = {"x": f(B, 4), "y": jnp.asarray(rng.standard_normal((B, 3)), jnp.float32)}
    return params, batch


def _loss(params, batch, aux=False):
    h = batch["x"] @ params["a_in"]
    shift = jnp.tanh(params["a_in"].sum(0))          # a const computed from the params

    def layer(h, w):
        return h + jnp.tanh(h @ w["w"] * w["scale"] + shift), None

    # mixed precision: the stacked weights reach the scan through casts
    blocks = dict(params["blocks"], w=params["blocks"]["w"].astype(jnp.bfloat16)
                  .astype(jnp.float32))
    h, _ = jax.lax.scan(layer, h, blocks)
    loss = jnp.mean((h @ params["z_out"] - batch["y"]) ** 2)
    return (loss, {"h_norm": jnp.mean(h ** 2)}) if aux else loss


def test_the_layer_scan_is_found_from_abstract_arguments():
    params, batch = _setup()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, batch))
    scan = find_layer_scan(_loss, *abstract)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    assert scan.length == L
    assert sorted(paths[i] for i in scan.stacked) == ["['blocks']['scale']", "['blocks']['w']"]
    assert scan.carry_shape == (B, D) and scan.batch_size == B
    assert scan.carry_row_bytes == D * 4


def _two_carries(params, batch):
    def layer(c, w):
        h, s = c
        return (h @ w["w"], s + 1.0), None
    (h, _), _ = jax.lax.scan(layer, (batch["x"] @ params["a_in"], 0.0), params["blocks"])
    return jnp.mean(h)


def _scans_data(params, batch):
    h, _ = jax.lax.scan(lambda h, x: (h + x.sum(), None), batch["x"] @ params["a_in"],
                        jnp.arange(L, dtype=jnp.float32))
    return jnp.mean(h)


def _batch_const(params, batch):
    m = batch["x"].mean()
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w["w"]) * m, None),
                        batch["x"] @ params["a_in"], params["blocks"])
    return jnp.mean(h)


def _no_scan(params, batch):
    return jnp.mean(batch["x"] @ params["a_in"])


@pytest.mark.parametrize("fn, why", [
    (_no_scan, "no lax.scan over stacked parameters"),
    (_two_carries, "carries 2 values"),
    (_scans_data, "not a stacked parameter"),
    (_batch_const, "consts depend on the batch"),
])
def test_a_scan_that_cannot_be_pipelined_says_why(fn, why):
    params, batch = _setup()
    with pytest.raises(NoLayerScan, match=why):
        find_layer_scan(fn, params, batch)


def test_micro_batch_i_holds_rows_i_i_plus_m_and_so_on():
    x = jnp.arange(12.0).reshape(12, 1)
    xs = micro_split(x, 3)
    assert xs.shape == (3, 4, 1)
    np.testing.assert_array_equal(np.asarray(xs[1, :, 0]), [1, 4, 7, 10])
    np.testing.assert_array_equal(np.asarray(micro_join(xs)), np.asarray(x))


@pytest.mark.parametrize("stages, data, micro, repeats", [(2, 4, 4, 1), (4, 2, 4, 2)])
def test_the_rewritten_loss_equals_the_loss_value_and_gradients(stages, data, micro,
                                                                 repeats):
    params, batch = _setup()
    mesh = jax.make_mesh((stages, data), (STAGE, "data"), axis_types=(AUTO, AUTO))
    scan = find_layer_scan(_loss, params, batch)
    fn = pipelined_loss(_loss, scan, stages=stages, micro_batches=micro, repeats=repeats,
                        data_axis="data")
    with jax.set_mesh(mesh):
        got, g_got = jax.jit(jax.value_and_grad(fn))(params, batch)
    want, g_want = jax.value_and_grad(_loss)(params, batch)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_the_rewritten_loss_keeps_the_output_tree():
    params, batch = _setup()
    aux_loss = lambda p, b: _loss(p, b, aux=True)  # noqa: E731
    mesh = jax.make_mesh((2, 4), (STAGE, "data"), axis_types=(AUTO, AUTO))
    fn = pipelined_loss(aux_loss, find_layer_scan(aux_loss, params, batch), stages=2,
                        micro_batches=2, data_axis="data")
    with jax.set_mesh(mesh):
        (loss, aux), _ = jax.jit(jax.value_and_grad(fn, has_aux=True))(params, batch)
    want_loss, want_aux = aux_loss(params, batch)
    assert set(aux) == {"h_norm"}
    np.testing.assert_allclose(float(aux["h_norm"]), float(want_aux["h_norm"]), rtol=1e-5)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    with pytest.raises(ValueError, match="8 layers cannot be split into 3 stages"):
        pipelined_loss(aux_loss, find_layer_scan(aux_loss, params, batch), stages=3,
                       micro_batches=2)
