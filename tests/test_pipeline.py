"""Pipeline stages (`jaxwap.runtime.schedule`, laid out by `runtime.stage_layout`): a
pipelined stack equals the plain `lax.scan` over the same layers, forward and gradients,
in float32 (rtol 1e-5, atol 1e-6).

2 and 4 stages, each with a data axis, on the 8 simulated CPU devices; GPipe (one round)
and the circular schedule (two rounds, micro-batches >= stages), each loop step keeping
what its layers keep or only its input (`stage_remat`). The backward pipeline is
the forward loop differentiated. Also: constants reach every stage, the mesh may come
from the context, a stage in the bubble runs no layer, and micro-batches are strided rows
so a data-sharded batch splits without moving."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxwap.runtime.schedule import STAGE, pipelined
from jaxwap.runtime.stage_layout import (
    carry_split_dim,
    chunking,
    micro_join,
    micro_split,
    stage_order,
    to_stages,
)

L, D, B = 8, 16, 16
AUTO = jax.sharding.AxisType.Auto  # as jaxwap's meshes: XLA places what shard_map takes


def _layer(w, h):
    return jnp.tanh(h @ w["kernel"] + w["bias"])


def _setup(L=L):
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
    with pytest.raises(ValueError, match="3 layers cannot be split into 2 stages x 2"):
        stage_order(3, 2, 2)


def test_an_uneven_stack_is_spread_as_evenly_as_it_goes():
    """Chunks of ceil(L / (p r)) slots, the last ones one layer short (an empty slot,
    -1); 126 layers over 16 stages: 14 stages of 8 layers and 2 of 7."""
    assert stage_order(8, 3, 1) == [0, 1, 2, 3, 4, 5, 6, 7, -1]
    # 4 chunks of 3, 3, 2, 2 layers; stage 0 holds chunks 0 and 2
    assert stage_order(10, 2, 2) == [0, 1, 2, 6, 7, -1, 3, 4, 5, 8, 9, -1]
    assert chunking(126, 16) == (8, 14)
    per_stage = np.asarray(stage_order(126, 16)).reshape(16, 8)
    assert sorted((per_stage >= 0).sum(1).tolist()) == [7] * 2 + [8] * 14
    assert sorted(i for i in per_stage.ravel() if i >= 0) == list(range(126))
    x = jnp.arange(10.0).reshape(10, 1)
    np.testing.assert_array_equal(np.asarray(to_stages(x, 2, 2))[:, 0],
                                  [0, 1, 2, 6, 7, 0, 3, 4, 5, 8, 9, 0])


# GPipe and circular, 2 and 4 stages, stages checkpointed or not, even and uneven splits
@pytest.mark.parametrize("layers, stages, data, micro, repeats, stage_remat", [
    (L, 2, 4, 4, 1, False), (L, 4, 2, 4, 2, False), (L, 4, 2, 4, 1, True),
    (L, 2, 4, 2, 2, True), (7, 4, 2, 4, 1, False), (11, 2, 4, 4, 2, True)])
def test_pipelined_stack_equals_the_scan_forward_and_backward(layers, stages, data, micro,
                                                              repeats, stage_remat):
    """Even splits and uneven ones (7 layers over 4 stages, 11 over 2 stages x 2 rounds):
    the padded slots run no layer and get a zero gradient."""
    params, x = _setup(layers)
    mesh = jax.make_mesh((stages, data), (STAGE, "data"), axis_types=(AUTO, AUTO))
    f = pipelined(_layer, mesh, micro_batches=micro, repeats=repeats, data_axis="data",
                  stage_remat=stage_remat, layers=layers)
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


def _close(got, want):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                         rtol=1e-5, atol=1e-6), got, want)


def test_consts_reach_every_stage_and_the_mesh_comes_from_the_context():
    """`layer(w, h, *consts)`, the mesh of `jax.set_mesh`, and a batch split over two data
    axes (a hybrid replica x data layout)."""
    params, x = _setup()
    gain, shift = jnp.linspace(0.5, 1.5, D), jnp.linspace(-0.1, 0.1, D)

    def layer(w, h, g, b):
        return _layer(w, h) * g + b

    def reference(p, x, g, b):
        return jax.lax.scan(lambda h, w: (layer(w, h, g, b), None), x, p)[0]

    def loss(fn, *args):
        return jnp.sum(fn(*args) ** 2)

    f = pipelined(layer, micro_batches=4, repeats=2, data_axis=("replica", "data"))
    mesh = jax.make_mesh((2, 2, 2), (STAGE, "replica", "data"), axis_types=(AUTO,) * 3)
    staged = to_stages(params, 2, 2)
    with jax.set_mesh(mesh):
        got = jax.jit(f)(staged, x, gain, shift)
        g = jax.jit(jax.grad(lambda *a: loss(f, *a), argnums=(0, 1, 2, 3)))(staged, x, gain,
                                                                              shift)
    _close(got, reference(params, x, gain, shift))
    r = jax.grad(lambda *a: loss(reference, *a), argnums=(0, 1, 2, 3))(params, x, gain, shift)
    _close(g, (to_stages(r[0], 2, 2), *r[1:]))


def test_a_pipeline_needs_a_mesh_with_a_stage_axis():
    params, x = _setup()
    f = pipelined(_layer, micro_batches=2)
    with pytest.raises(ValueError, match="needs a mesh"):
        f(params, x)
    with jax.set_mesh(jax.make_mesh((8,), ("data",), axis_types=(AUTO,))):
        with pytest.raises(ValueError, match="has no 'stage' axis"):
            f(params, x)


@pytest.mark.parametrize("layers, stages, data, micro, repeats", [
    (L, 2, 4, 4, 1), (L, 4, 2, 4, 2), (7, 4, 2, 4, 1), (10, 2, 4, 2, 2)])
def test_a_stage_in_the_bubble_runs_no_layer(layers, stages, data, micro, repeats):
    """Every device runs its layers once per micro-batch and nothing more: the
    m r + p - 1 loop steps of a padded bubble would run (m r + p - 1) L / (p r), and
    an uneven stack's empty slots would add theirs."""
    params, x = _setup(layers)
    calls = []

    def counted(w, h):
        jax.debug.callback(lambda: calls.append(1))
        return _layer(w, h)

    mesh = jax.make_mesh((stages, data), (STAGE, "data"), axis_types=(AUTO, AUTO))
    f = pipelined(counted, mesh, micro_batches=micro, repeats=repeats, data_axis="data",
                  layers=layers)
    jax.block_until_ready(jax.jit(f)(to_stages(params, stages, repeats), x))
    jax.effects_barrier()
    assert len(calls) == data * micro * layers


def test_gpipe_keeping_only_its_inputs_runs_the_bubble_for_a_stage_share_less_memory():
    """GPipe with `stage_remat` runs its layers in the bubble too (every device: m + p - 1
    loop steps of L / p layers, forward) and drops the result, where skipping them under
    `lax.cond` costs a buffer of the stage's weight gradient: with activations small
    beside the weights, XLA's compiled temporaries are at least 0.8 of a stage's share
    below the same loop keeping what its layers keep (which idles its bubble)."""
    stages, data, micro, width, layers = 2, 4, 8, 512, 8
    calls = []

    def counted(w, h):
        jax.debug.callback(lambda: calls.append(1))
        return jnp.tanh(h @ w["kernel"])

    params = {"kernel": jnp.full((layers, width, width), 0.01, jnp.float32)}
    x = jnp.ones((64, width), jnp.float32)
    mesh = jax.make_mesh((stages, data), (STAGE, "data"), axis_types=(AUTO, AUTO))
    f = pipelined(counted, mesh, micro_batches=micro, data_axis="data", stage_remat=True)
    jax.block_until_ready(jax.jit(f)(params, x))
    jax.effects_barrier()
    assert len(calls) == data * (micro + stages - 1) * layers

    temps = {}
    for remat in (False, True):
        f = pipelined(lambda w, h: jnp.tanh(h @ w["kernel"]), mesh, micro_batches=micro,
                      data_axis="data", stage_remat=remat)
        g = jax.jit(jax.grad(lambda p, x, f=f: jnp.sum(f(p, x) ** 2)))
        temps[remat] = g.lower(params, x).compile().memory_analysis().temp_size_in_bytes
    share = layers * width * width * 4 / stages
    assert temps[False] - temps[True] > 0.8 * share


def test_micro_batch_i_holds_rows_i_i_plus_m_and_so_on():
    x = jnp.arange(12.0).reshape(12, 1)
    xs = micro_split(x, 3)
    assert xs.shape == (3, 4, 1)
    np.testing.assert_array_equal(np.asarray(xs[1, :, 0]), [1, 4, 7, 10])
    np.testing.assert_array_equal(np.asarray(micro_join(xs)), np.asarray(x))


def test_a_batch_sharded_over_the_data_axis_splits_without_moving():
    """Contiguous micro-batches would need an all-to-all to cut a batch sharded in
    contiguous blocks; strided ones are cut where the rows are."""
    params, _ = _setup()
    mesh = jax.make_mesh((2, 4), (STAGE, "data"), axis_types=(AUTO, AUTO))
    rows = NamedSharding(mesh, P("data"))
    f = jax.jit(pipelined(_layer, mesh, micro_batches=4, data_axis="data"),
                in_shardings=(NamedSharding(mesh, P(STAGE)), rows), out_shardings=rows)
    text = f.lower(params, jax.ShapeDtypeStruct((4 * B, D), jnp.float32)).compile().as_text()
    assert not re.search(r"(all-to-all|all-gather)(-start)?\(", text)


def test_to_stages_follows_stage_order():
    x = jnp.arange(16.0).reshape(16, 1)
    for stages, repeats in [(2, 2), (4, 2), (2, 4), (4, 1)]:
        np.testing.assert_array_equal(np.asarray(to_stages(x, stages, repeats))[:, 0],
                                      stage_order(16, stages, repeats))


@pytest.mark.parametrize("repeats", [1, 2])
def test_layers_sharded_inside_a_stage_are_gathered_per_layer_and_equal_the_scan(repeats):
    """FSDP inside a stage (`param_specs`): each stage's share also split over data, the
    loop gathering one layer at a time; forward and gradients equal the scan, and the
    gradients come back sharded as the weights are."""
    params, x = _setup()
    mesh = jax.make_mesh((2, 4), (STAGE, "data"), axis_types=(AUTO, AUTO))
    specs = {"bias": ("data",), "kernel": (None, "data")}
    f = pipelined(_layer, mesh, micro_batches=4, repeats=repeats, data_axis="data",
                  param_specs=specs)
    staged = to_stages(params, 2, repeats)
    placed = {k: jax.device_put(v, NamedSharding(mesh, P(STAGE, *specs[k])))
              for k, v in staged.items()}
    _close(jax.jit(f)(placed, x), _reference(params, x))

    def loss(fn, p, x):
        return jnp.sum(fn(p, x) ** 2)

    g = jax.jit(jax.grad(lambda p: loss(f, p, x)))(placed)
    r = jax.grad(lambda p: loss(_reference, p, x))(params)
    _close(g, to_stages(r, 2, repeats))
    assert g["kernel"].sharding.is_equivalent_to(placed["kernel"].sharding, 3)


def _mlp(w, h):
    return h + jnp.tanh(h @ w["up"]) @ w["down"]


@pytest.mark.parametrize("repeats, fsdp", [(1, False), (2, True)])
def test_layers_split_over_the_model_axis_inside_a_stage_equal_the_scan(repeats, fsdp):
    """Tensor parallelism inside a stage: the loop is manual over stage and data only,
    so a stage's share split over the model axis (column then row, Megatron's MLP) stays
    split and XLA partitions each layer; with `fsdp` the other dim is also over data
    (gathered per layer). Forward and gradients equal the scan; the gradients come back
    split as the weights are."""
    rng = np.random.default_rng(3)
    params = {"up": jnp.asarray(rng.standard_normal((L, D, 2 * D)) / np.sqrt(D), jnp.float32),
              "down": jnp.asarray(rng.standard_normal((L, 2 * D, D)) / np.sqrt(2 * D),
                                  jnp.float32)}
    x = jnp.asarray(rng.standard_normal((B, D)), jnp.float32)
    mesh = jax.make_mesh((2, 2, 2), (STAGE, "data", "model"), axis_types=(AUTO,) * 3)
    other = "data" if fsdp else None
    specs = {"up": (other, "model"), "down": ("model", other)}
    f = pipelined(_mlp, mesh, micro_batches=4, repeats=repeats, data_axis="data",
                  param_specs=specs)
    placed = {k: jax.device_put(v, NamedSharding(mesh, P(STAGE, *specs[k])))
              for k, v in to_stages(params, 2, repeats).items()}

    def ref(p, x):
        return jax.lax.scan(lambda h, w: (_mlp(w, h), None), x, p)[0]

    _close(jax.jit(f)(placed, x), ref(params, x))
    # a mean: the residual stack's sums of squares run to 1e4, where f32 rounding of the
    # model axis's partial sums alone exceeds atol
    g = jax.jit(jax.grad(lambda p: jnp.mean(f(p, x) ** 2)))(placed)
    r = jax.grad(lambda p: jnp.mean(ref(p, x) ** 2))(params)
    _close(g, to_stages(r, 2, repeats))
    for k in specs:
        assert g[k].sharding.is_equivalent_to(placed[k].sharding, 3), (k, g[k].sharding)


def test_a_stage_spec_that_cannot_shard_names_the_parameter_and_axis():
    params, x = _setup()
    mesh = jax.make_mesh((2, 4), (STAGE, "data"), axis_types=(AUTO, AUTO))
    for specs, why in [({"bias": ("model",), "kernel": (None, None)}, "names axis 'model'"),
                       ({"bias": (None,), "kernel": ("data",)}, "must name 2 dims"),
                       ({"bias": (STAGE,), "kernel": (None, None)}, "names axis 'stage'")]:
        f = pipelined(_layer, mesh, micro_batches=4, param_specs=specs)
        with pytest.raises(ValueError, match=re.escape(why)):
            f(params, x)
    wide = {"kernel": jnp.zeros((L, D, 6)), "bias": jnp.zeros((L, 6))}
    f = pipelined(_layer, mesh, micro_batches=4, param_specs={"bias": ("data",),
                                                              "kernel": (None, None)})
    with pytest.raises(ValueError, match=r"shape \(8, 6\): dim 1 does not divide over "
                                         r"'data' of size 4"):
        f(wide, x)


def test_stage_remat_holds_one_input_per_loop_step_whatever_the_layers_keep():
    """XLA's compiled temporaries of the differentiated pipeline (4 stages, 16
    micro-batches, layers 4x wider inside than the carried activation): keeping only each
    loop step's input holds far less than keeping what the stage's layers keep, and its
    residuals do not grow with the layers a stage holds."""
    rng = np.random.default_rng(0)

    def wide(w, h):
        return h + jnp.tanh(jnp.tanh(h @ w["up"]) @ w["down"])

    def temps(layers, stage_remat):
        params = {"up": jnp.asarray(rng.standard_normal((layers, D, 4 * D)), jnp.float32),
                  "down": jnp.asarray(rng.standard_normal((layers, 4 * D, D)), jnp.float32)}
        x = jnp.ones((256, D), jnp.float32)
        mesh = jax.make_mesh((4, 2), (STAGE, "data"), axis_types=(AUTO, AUTO))
        f = pipelined(wide, mesh, micro_batches=16, data_axis="data",
                      stage_remat=stage_remat)
        grad = jax.jit(jax.grad(lambda p, x: jnp.sum(f(p, x) ** 2)))
        return grad.lower(params, x).compile().memory_analysis().temp_size_in_bytes

    kept = {layers: temps(layers, False) for layers in (8, 16)}
    inputs = {layers: temps(layers, True) for layers in (8, 16)}
    assert inputs[8] < 0.5 * kept[8], (inputs, kept)
    # twice the layers a stage: what the layers keep doubles its residuals, inputs do not
    assert inputs[16] - inputs[8] < 0.25 * (kept[16] - kept[8]), (inputs, kept)


def test_a_staged_stack_must_hold_the_slots_its_layer_count_takes():
    params, x = _setup(7)
    mesh = jax.make_mesh((4, 2), (STAGE, "data"), axis_types=(AUTO, AUTO))
    with pytest.raises(ValueError, match="7 staged layer slots do not split into 4 stages"):
        pipelined(_layer, mesh, micro_batches=4, layers=7)(params, x)
    with pytest.raises(ValueError, match="layers=9 over 4 stages x 1 repeats takes 12"):
        pipelined(_layer, mesh, micro_batches=4, layers=9)(to_stages(params, 4), x)


@pytest.mark.parametrize("repeats, stacked_buffers", [(1, 1), (2, 2)])
def test_only_the_circular_loop_carries_a_round_buffer(repeats, stacked_buffers):
    """The loop's state of m micro-batches: the output, and for the circular schedule the
    round buffer of micro-batches waiting for their next round. GPipe has none (one
    less buffer of the local batch forward, and one less for its gradient backward)."""
    params, x = _setup()
    mesh = jax.make_mesh((2, 4), (STAGE, "data"), axis_types=(AUTO, AUTO))
    f = pipelined(_layer, mesh, micro_batches=4, repeats=repeats, data_axis="data")
    jaxpr = jax.make_jaxpr(f)(to_stages(params, 2, repeats), x)

    def loops(jx):          # the schedule's loop (fori_loop: a scan, its bounds fixed)
        for eqn in jx.eqns:
            if eqn.primitive.name in ("scan", "while") and any(
                    v.aval.shape[:1] == (4,) for v in eqn.outvars):
                yield eqn
            for sub in eqn.params.values():
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from loops(sub)
    (loop,) = list(loops(jaxpr.jaxpr))
    micro = (4, B // (4 * 4), D)                 # m micro-batches of a data shard's rows
    assert sum(v.aval.shape == micro for v in loop.outvars) == stacked_buffers


@pytest.mark.parametrize("stage_remat", [False, True])
def test_the_loop_keeps_its_activations_split_over_the_model_axis(stage_remat):
    """`carry_axis`: tensor-parallel layers inside a stage (stage x data x model = 2 x 2
    x 2) with the loop's buffers, sends and kept inputs split over the model axis along
    the sequence: the same forward and gradients as the scan, half the stage sends, and
    at least one local batch's activation fewer in XLA's compiled temporaries."""
    from collections import Counter

    from jaxwap.decide.xla_figures import parse_collectives

    rng = np.random.default_rng(0)
    n, seq, width, rows = 4, 16, 64, 512
    params = {"w1": jnp.asarray(rng.standard_normal((n, width, 4 * width)) / 8, jnp.float32),
              "w2": jnp.asarray(rng.standard_normal((n, 4 * width, width)) / 16,
                                jnp.float32)}
    x = jnp.asarray(rng.standard_normal((rows, seq, width)), jnp.float32)

    def layer(w, h):
        return h + jnp.tanh(h @ w["w1"]) @ w["w2"]

    def reference(p, x):
        return jax.lax.scan(lambda h, w: (layer(w, h), None), x, p)[0]

    mesh = jax.make_mesh((2, 2, 2), (STAGE, "data", "model"), axis_types=(AUTO,) * 3)
    figures = {}
    for axis in (None, "model"):
        f = pipelined(layer, mesh, micro_batches=8, data_axis="data", stage_remat=stage_remat,
                      param_specs={"w1": (None, "model"), "w2": ("model", None)},
                      carry_axis=axis)
        grad = jax.jit(jax.grad(lambda p, x, f=f: jnp.sum(f(p, x) ** 2), argnums=(0, 1)))
        compiled = grad.lower(params, x).compile()
        sends = Counter()
        for c in parse_collectives(compiled.as_text(), (2, 2), 1, 2):
            sends[c.kind, c.axes] += c.bytes
        figures[axis] = (compiled.memory_analysis().temp_size_in_bytes,
                         sends["collective-permute", (STAGE,)])
        if axis is not None:
            # sums over 8192 rows of O(1) terms: held to 1e-5 of each result's largest
            got = (jax.jit(f)(params, x), grad(params, x))
            want = (reference(params, x), jax.grad(
                lambda p, x: jnp.sum(reference(p, x) ** 2), argnums=(0, 1))(params, x))
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                scale = float(jnp.max(jnp.abs(b)))
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5 * scale)
    assert carry_split_dim((seq, width), 2) == 0          # the sequence
    local_batch = rows // 2 * seq * width * 4             # one data shard's activation
    assert figures["model"][1] == figures[None][1] / 2
    assert figures[None][0] - figures["model"][0] > local_batch
