"""The layer stack of a loss function: found in its jaxpr from abstract arguments
(`runtime.layer_scan`), refused with the reason when it cannot be pipelined, and run
pipelined by a rewritten loss (`runtime.layer_scan_rewrite`) that equals the original,
value and gradients, in float32 (rtol 1e-5, atol 1e-6; one bf16 step for the weight cast
through bf16), on 2 and 4 stages, GPipe and circular, and through a whole training step.

The model's layer is written the way real ones are: it reshapes with its own batch size
(the stage runs it on a micro-batch), calls a `jax.jit` helper and `custom_jvp` functions
(`relu`, `softmax`), and its stacked weights reach the scan through a bf16 -> f32 cast."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxwap
from jaxwap.core.records import STAGE, StepVariant
from jaxwap.runtime.layer_scan import NoLayerScan, find_layer_scan
from jaxwap.runtime.layer_scan_rewrite import pipelined_loss, stack_cut

L, D, B = 8, 16, 16
AUTO = jax.sharding.AxisType.Auto


def _setup(layers=L):
    rng = np.random.default_rng(1)
    f = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[-1]), jnp.float32)  # noqa: E731
    params = {"a_in": f(4, D), "blocks": {"w": f(layers, D, D), "scale": f(layers, D)},
              "z_out": f(D, 3)}
    batch = {"x": f(B, 4), "y": jnp.asarray(rng.standard_normal((B, 3)), jnp.float32)}
    return params, batch


_squash = jax.jit(lambda a: jnp.tanh(a) + 0.1 * jax.nn.relu(a))


def _loss(params, batch, aux=False):
    h = batch["x"] @ params["a_in"]
    shift = jnp.tanh(params["a_in"].sum(0))          # a const computed from the params

    def layer(h, w):
        # two "heads": a reshape by the batch size, which a stage's micro-batch changes
        a = jax.nn.softmax((h @ w["w"]).reshape(h.shape[0], 2, D // 2), axis=-1)
        return h + _squash(a.reshape(h.shape[0], D) * w["scale"] + shift), None

    # mixed precision: the stacked weights reach the scan through casts
    blocks = dict(params["blocks"], w=params["blocks"]["w"].astype(jnp.bfloat16)
                  .astype(jnp.float32))
    h, _ = jax.lax.scan(layer, h, blocks)
    loss = jnp.mean((h @ params["z_out"] - batch["y"]) ** 2)
    return (loss, {"h_norm": jnp.mean(h ** 2)}) if aux else loss


def _paths(params, indices):
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    return sorted(paths[i] for i in indices)


def test_the_layer_scan_is_found_from_abstract_arguments():
    params, batch = _setup()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, batch))
    scan = find_layer_scan(_loss, *abstract)
    assert scan.length == L
    assert _paths(params, scan.stacked) == ["['blocks']['scale']", "['blocks']['w']"]
    assert scan.carry_shape == (B, D) and scan.carry_dtype == "float32"
    assert scan.batch_size == B and scan.carry_row_bytes == D * 4


def test_a_scan_inside_a_nested_jit_is_found():
    params, batch = _setup()
    inner = jax.jit(lambda p, b: _loss(p, b))
    scan = find_layer_scan(lambda p, b: inner(p, b) * 2.0, params, batch)
    assert len(scan.path) == 2 and scan.length == L
    assert _paths(params, scan.stacked) == ["['blocks']['scale']", "['blocks']['w']"]


def _two_carries(params, batch):
    def layer(c, w):
        h, s = c
        return (h @ w["w"], s + 1.0), None
    (h, _), _ = jax.lax.scan(layer, (batch["x"] @ params["a_in"], 0.0), params["blocks"])
    return jnp.mean(h)


def _fori_loop_reversed(params, batch):   # layer L - 1 - i at iteration i
    h = jax.lax.fori_loop(0, L, lambda i, h: jnp.tanh(h @ params["blocks"]["w"][L - 1 - i]),
                          batch["x"] @ params["a_in"])
    return jnp.mean(h)


def _scans_data(params, batch):
    h, _ = jax.lax.scan(lambda h, x: (h + x.sum(), None), batch["x"] @ params["a_in"],
                        jnp.arange(L, dtype=jnp.float32))
    return jnp.mean(h)


def _rows_per_layer(params, batch):
    rows = jnp.broadcast_to(batch["y"][None, :, :1], (L, B, 1))
    h, _ = jax.lax.scan(lambda h, wr: (jnp.tanh(h @ wr[0]["w"]) * wr[1], None),
                        batch["x"] @ params["a_in"], (params["blocks"], rows))
    return jnp.mean(h)


def _no_scan(params, batch):
    return jnp.mean(batch["x"] @ params["a_in"])


def _scan_in_checkpoint(params, batch):
    return jax.checkpoint(_loss)(params, batch)


@pytest.mark.parametrize("fn, why", [
    (_no_scan, "no lax.scan over stacked parameters at its top level"),
    (_two_carries, "carries 2 values; pipelining needs one carried activation"),
    (_fori_loop_reversed, r"reads its stacked parameters other than as layer i at "
                          r"iteration i \(a fori_loop reading w\[L - 1 - i\], say\); written "
                          r"as a lax.scan over them, it can be pipelined"),
    (_scans_data, "the scan has no stacked parameters as per-layer inputs"),
    (_rows_per_layer, r"a per-layer input of the scan \(float32\[8,16,1\]\) has the "
                      r"batch's rows"),
    (_scan_in_checkpoint, "inside jax.checkpoint, not at the top level"),
])
def test_a_scan_that_cannot_be_pipelined_says_why(fn, why):
    params, batch = _setup()
    with pytest.raises(NoLayerScan, match=why):
        find_layer_scan(fn, params, batch)


def _loss_with_extras(params, batch):
    """`_loss` of a batch that also holds leaves without its rows, as training batches
    do: a dropout PRNG key, a scalar temperature and per-output class weights."""
    keep = jax.random.bernoulli(batch["key"], 0.9, batch["x"].shape)
    x = jnp.where(keep, batch["x"] / 0.9, 0.0) * batch["t"]
    h, _ = jax.lax.scan(lambda h, w: (h + jnp.tanh(h @ w["w"]) * w["scale"], None),
                        x @ params["a_in"], params["blocks"])
    return jnp.mean(batch["w"] * (h @ params["z_out"] - batch["y"]) ** 2)


@pytest.mark.parametrize("stages, micro, repeats", [(2, 4, 1), (2, 2, 2)])
def test_a_batch_with_leaves_without_its_rows_is_pipelined_and_equals_the_loss(
        stages, micro, repeats):
    # the rows are the leading dim most leaves share (16); a key, a scalar and 3 class
    # weights stay whole (they were refused: "the batch leaves disagree")
    params, batch = _setup()
    batch = dict(batch, key=jax.random.key_data(jax.random.key(0)), t=jnp.float32(0.5),
                 w=jnp.asarray([1.0, 2.0, 0.5], jnp.float32))
    scan = find_layer_scan(_loss_with_extras, params, batch)
    assert scan.batch_size == B and scan.length == L
    _assert_pipelined_equal(_loss_with_extras, scan, params, batch, stages, micro, repeats)
    with pytest.raises(NoLayerScan, match="no array with a leading"):
        find_layer_scan(_loss, params, {"t": jnp.float32(0.5)})


def _mesh(stages, data):
    return jax.make_mesh((stages, data), (STAGE, "data"), axis_types=(AUTO, AUTO))


def _assert_close(got, want):
    """float32 tolerance (5e-5 relative: the pipelined loop sums the micro-batches'
    gradients in another order than the scan, and unvectorised CPU code, as the suite
    compiles it, rounds a few elements 2e-5 apart), except for the stacked weight cast
    through bf16: its gradient is rounded to bf16 on the way back, so a different
    summation order may land one bf16 step (2**-8 relative) away."""
    def check(path, a, b):
        bf16 = jax.tree_util.keystr(path).endswith("['blocks']['w']")
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6,
                                   rtol=2.0 ** -7 if bf16 else 5e-5)
    jax.tree_util.tree_map_with_path(check, got, want)


def _assert_pipelined_equal(loss, scan, params, batch, stages, micro, repeats, data=None):
    """`loss` pipelined over `stages` (x `data`, the rest of the 8 devices) equals itself
    in value and gradients (`_assert_close`)."""
    fn = pipelined_loss(loss, scan, stages=stages, micro_batches=micro, repeats=repeats,
                        data_axis="data")
    with jax.set_mesh(_mesh(stages, data or 8 // stages)):
        got = jax.jit(jax.value_and_grad(fn))(params, batch)
    _assert_close(got, jax.value_and_grad(loss)(params, batch))


@pytest.mark.parametrize("layers, stages, data, micro, repeats", [
    (L, 2, 4, 4, 1), (L, 4, 2, 4, 2), (6, 4, 2, 4, 1), (7, 2, 4, 2, 2)])
def test_the_rewritten_loss_equals_the_loss_value_and_gradients(layers, stages, data, micro,
                                                                 repeats):
    """Even and uneven splits (6 layers over 4 stages; 7 over 2 stages x 2 rounds): the
    parameters keep their shapes, the gradients too."""
    params, batch = _setup(layers)
    scan = find_layer_scan(_loss, params, batch)
    _assert_pipelined_equal(_loss, scan, params, batch, stages, micro, repeats, data)


def _per_layer_inputs(params, batch):
    """`_loss`'s layers scanned with per-layer inputs that are not parameters, as models
    write them: a flag (local or global attention, alternating, as Gemma 2's layers), a
    per-layer constant computed in the loss, and a key the layers never draw from (Flax's
    `nn.scan` splits the dropout key over the layers whether or not dropout is on)."""
    h = batch["x"] @ params["a_in"]
    n = params["blocks"]["w"].shape[0]
    local = jnp.arange(n) % 2 == 0
    gain = 1.0 + 0.1 * jnp.tanh(params["a_in"][0, 0]) * jnp.arange(n, dtype=jnp.float32)

    def layer(h, xs):
        w, is_local, g, _unused_key = xs
        mix = jnp.where(is_local, jnp.tanh(h @ w["w"]), jax.nn.relu(h @ w["w"]))
        return h + g * mix * w["scale"], None
    h, _ = jax.lax.scan(layer, h, (params["blocks"], local, gain,
                                   jax.random.split(jax.random.key(0), n)))
    return jnp.mean((h @ params["z_out"] - batch["y"]) ** 2)


@pytest.mark.parametrize("layers, stages, micro, repeats", [(7, 2, 2, 2), (6, 4, 4, 1)])
def test_a_scan_with_per_layer_inputs_besides_its_parameters_is_pipelined_and_equals_the_loss(
        layers, stages, micro, repeats):
    """They were refused ("a value that is not a stacked parameter"); each layer now
    reads its own row of them in its stage, even and uneven splits."""
    params, batch = _setup(layers)
    scan = find_layer_scan(_per_layer_inputs, params, batch)
    assert scan.extras == (2, 3, 4) and scan.length == layers   # after scale, w
    assert _paths(params, scan.stacked) == ["['blocks']['scale']", "['blocks']['w']"]
    _assert_pipelined_equal(_per_layer_inputs, scan, params, batch, stages, micro, repeats)
    # a stage's cut of the stack (what the pipeline search prices) reads as many rows
    cut = stack_cut(_per_layer_inputs, scan, 3)
    short = dict(params, blocks=jax.tree.map(lambda x: x[:3], params["blocks"]))
    assert float(cut(short, batch)) == pytest.approx(float(_per_layer_inputs(short, batch)),
                                                     rel=1e-6)


def _fori_loops(params, batch):
    """The stack run by `fori_loop`s reading layer i at iteration i, as loops are
    written: `w[i]` (its index wrapped for negative values), `dynamic_index_in_dim` (a
    jitted call) under a checkpointed body counting from 1 (`scale[i - 1]`), and the
    counter read by the layer itself (a flag by parity)."""
    blocks = params["blocks"]
    n = blocks["w"].shape[0]

    def first(i, h):
        return h + jnp.where(i % 2 == 0, 1.0, 0.5) * jnp.tanh(h @ blocks["w"][i])

    @jax.checkpoint
    def second(i, h):
        w = jax.lax.dynamic_index_in_dim(blocks["w"], i - 1, keepdims=False)
        return h + jnp.tanh(h @ w) * blocks["scale"][i - 1]
    h = jax.lax.fori_loop(0, n, first, batch["x"] @ params["a_in"])
    h = jax.lax.fori_loop(1, n + 1, second, h)
    return jnp.mean((h @ params["z_out"] - batch["y"]) ** 2)


@pytest.mark.parametrize("layers, stages, micro, repeats", [(7, 2, 2, 2)])
def test_a_fori_loop_reading_layer_i_at_iteration_i_is_the_layer_scan_it_is(
        layers, stages, micro, repeats):
    """Each loop is found as a layer scan (its counter a per-layer input) and pipelined
    equal to the loss in value and gradients (an uneven circular split); one that reads
    another layer stays a loop, and says why (`test_a_scan_that_cannot_be_pipelined_...`)."""
    params, batch = _setup(layers)
    scan = find_layer_scan(_fori_loops, params, batch)   # the second: more bytes
    assert scan.length == layers and scan.extras == (2,)
    assert _paths(params, scan.stacked) == ["['blocks']['scale']", "['blocks']['w']"]
    _assert_pipelined_equal(_fori_loops, scan, params, batch, stages, micro, repeats)


def _dropout_layer(h, w, key):
    keep = jax.random.bernoulli(key, 0.8, h.shape)
    return h + jnp.where(keep, jnp.tanh(h @ w["w"]) * w["scale"] / 0.8, 0.0)


def _layer_keys(batch, raw):
    """A key per layer split from the batch's: typed, or raw data (`PRNGKey`'s uint32[2]
    each, which the layers' `jax.random` calls wrap)."""
    return jax.random.split(batch["key"] if raw else jax.random.wrap_key_data(batch["key"]), L)


def _dropout_layers(params, batch, raw=False):
    """Dropout inside the stack: a key per layer, split from the batch's key, as Flax's
    `nn.scan(..., split_rngs={"dropout": True})` hands its layers."""
    keys = _layer_keys(batch, raw)
    h, _ = jax.lax.scan(lambda h, wk: (_dropout_layer(h, *wk), None),
                        batch["x"] @ params["a_in"], (params["blocks"], keys))
    return jnp.mean((h @ params["z_out"] - batch["y"]) ** 2)


def _dropout_drawn_apart(params, batch, micro, data, raw):
    """The oracle, in plain loops: micro-batch b (rows b, b + micro, ...) split in
    contiguous blocks over `data` shards, shard d's rows through layer l with
    fold_in(fold_in(key_l, b), d)."""
    keys = _layer_keys(batch, raw)
    x = batch["x"] @ params["a_in"]
    out, n = jnp.zeros_like(x), B // (micro * data)
    for b in range(micro):
        for d in range(data):
            rows = np.arange(b, B, micro)[d * n:(d + 1) * n]
            h = x[rows]
            for layer in range(L):
                w = jax.tree.map(lambda a, i=layer: a[i], params["blocks"])
                key = jax.random.fold_in(jax.random.fold_in(keys[layer], b), d)
                h = _dropout_layer(h, w, key)
            out = out.at[rows].set(h)
    return jnp.mean((out @ params["z_out"] - batch["y"]) ** 2)


@pytest.mark.parametrize("stages, micro, repeats, raw", [(2, 2, 2, False), (4, 4, 1, True)])
def test_dropout_inside_a_pipelined_stack_draws_apart_for_each_micro_batch_and_shard(
        stages, micro, repeats, raw):
    """It was refused (a stage would draw the same mask for every micro-batch and every
    data shard): each layer's key, typed or raw data, is now folded with both indices,
    and the pipelined loss equals the oracle that draws so, value and gradients."""
    params, batch = _setup()
    batch = dict(batch, key=jax.random.key_data(jax.random.key(5)))
    loss = functools.partial(_dropout_layers, raw=raw)
    scan = find_layer_scan(loss, params, batch)
    assert scan.extras == (2,) and scan.draws == ((2, "threefry2x32" if raw else None),)
    fn = pipelined_loss(loss, scan, stages=stages, micro_batches=micro, repeats=repeats,
                        data_axis="data")
    with jax.set_mesh(_mesh(stages, 8 // stages)):
        got = jax.jit(jax.value_and_grad(fn))(params, batch)
    want = jax.value_and_grad(_dropout_drawn_apart)(params, batch, micro, 8 // stages, raw)
    _assert_close(got, want)
    assert abs(float(got[0]) - float(loss(params, batch))) > 1e-4


def _reads_the_batch(params, batch):
    """Layers that close over values from the batch, as real decoders do: per-row
    positions-like gates (MaxText passes segment ids and positions to every layer), a
    mask made from the batch's shape (Flax's `make_causal_mask(x)` with
    `in_axes=nn.broadcast`), and a batch statistic without rows."""
    gate = jax.nn.sigmoid(batch["y"][:, :1])                    # [B, 1], from the batch
    shaped = jnp.ones((batch["x"].shape[0], D)) * 0.5            # [B, D], its shape only
    m = jnp.mean(batch["x"])                                     # no rows

    def layer(h, w):
        return h + jnp.tanh(h @ w["w"]) * w["scale"] * gate * shaped + 0.01 * m, None
    h, _ = jax.lax.scan(layer, batch["x"] @ params["a_in"], params["blocks"])
    return jnp.mean((h @ params["z_out"] - batch["y"]) ** 2)


@pytest.mark.parametrize("stages, micro, repeats", [(2, 2, 2), (4, 4, 1)])
def test_layers_that_close_over_the_batch_are_pipelined_and_equal_the_loss(
        stages, micro, repeats):
    """They were refused ("the scan's consts depend on the batch"): a value with the
    batch's rows is cut into micro-batches and split over the data axis as the activation
    is, each layer reading its micro-batch's rows; one without rows goes whole."""
    params, batch = _setup()
    fn = _reads_the_batch
    scan = find_layer_scan(fn, params, batch)
    assert scan.row_consts and scan.row_const_bytes == 4 * (1 + D)   # gate, shaped
    fn_p = pipelined_loss(fn, scan, stages=stages, micro_batches=micro, repeats=repeats,
                          data_axis="data")
    with jax.set_mesh(_mesh(stages, 8 // stages)):
        got = jax.jit(jax.value_and_grad(fn_p))(params, batch)
    _assert_close(got, jax.value_and_grad(fn)(params, batch))


def test_the_rewritten_loss_keeps_the_output_tree():
    params, batch = _setup()
    aux_loss = lambda p, b: _loss(p, b, aux=True)  # noqa: E731
    scan = find_layer_scan(aux_loss, params, batch)
    fn = pipelined_loss(aux_loss, scan, stages=2, micro_batches=2, data_axis="data")
    with jax.set_mesh(_mesh(2, 4)):
        (loss, aux), _ = jax.jit(jax.value_and_grad(fn, has_aux=True))(params, batch)
    assert set(aux) == {"h_norm"}
    _assert_close((loss, aux), aux_loss(params, batch))
    with pytest.raises(ValueError, match="8 layers cannot be split into 3 stages x 3"):
        pipelined_loss(aux_loss, scan, stages=3, micro_batches=3, repeats=3)
    with jax.set_mesh(_mesh(4, 2)), pytest.raises(ValueError, match="made for 2 stages"):
        fn(params, batch)


def test_a_training_step_pipelined_gives_the_same_parameters():
    """`make_train_step`'s step restructured into a pipeline (as a plan does) over a
    stage x replica x data mesh, the batch split over both data axes."""
    params, batch = _setup()
    step = jaxwap.make_train_step(_loss, optax.sgd(0.1))
    piped = step.with_variant(StepVariant(micro_batches=4, stages=2, repeats=2))
    opt_state = step.init(params)
    want_params, _, want_loss = jax.jit(step)(params, opt_state, batch)
    mesh = jax.make_mesh((2, 2, 2), (STAGE, "replica", "data"), axis_types=(AUTO,) * 3)
    with jax.set_mesh(mesh):
        got_params, _, got_loss = jax.jit(piped)(params, opt_state, batch)
    _assert_close((got_params, got_loss), (want_params, want_loss))


def _constrained(params, batch, spec):
    h = jax.lax.with_sharding_constraint(batch["x"] @ params["a_in"], spec)

    def layer(h, w):
        return jax.lax.with_sharding_constraint(h + jnp.tanh(h @ w["w"]), spec), None
    h, _ = jax.lax.scan(layer, h, params["blocks"])
    return jnp.mean((h @ params["z_out"] - batch["y"]) ** 2)


def test_sharding_constraints_in_the_loss():
    """A stage lays out its own rows: the layer's constraints are dropped there, and the
    rest of the loss keeps them. A bare PartitionSpec cannot be traced inside the
    pipeline's shard_map (its axes are manual there), so it is refused with the fix."""
    params, batch = _setup()
    mesh = _mesh(2, 4)
    named = lambda p, b: _constrained(p, b, jax.sharding.NamedSharding(mesh, P("data")))  # noqa: E731
    bare = lambda p, b: _constrained(p, b, P("data"))  # noqa: E731
    with jax.set_mesh(mesh):
        fn = pipelined_loss(named, find_layer_scan(named, params, batch), stages=2,
                            micro_batches=4, data_axis="data")
        _assert_close(jax.jit(jax.value_and_grad(fn))(params, batch),
                      jax.value_and_grad(named)(params, batch))
        fn = pipelined_loss(bare, find_layer_scan(bare, params, batch), stages=2,
                            micro_batches=4, data_axis="data")
        with pytest.raises(NoLayerScan, match="bare PartitionSpec"):
            jax.jit(fn)(params, batch)
