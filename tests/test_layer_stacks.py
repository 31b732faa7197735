"""Layer stacks in the forms users write them, planned and pipelined.

A deep model's blocks run as one scan over parameters stacked along a layer dim, written
as Flax Linen's `nn.scan(Block, variable_axes={"params": 0}, length=L)` (MaxText's
`scan_layers`; with or without `nn.remat` inside), as NNX layers made with `nnx.vmap` and
run by `nnx.scan`, or as a hand-written `jax.lax.scan`. A module whose length is fixed
cannot be called with fewer layers, so the planner prices a stage's share of the stack
from the traced jaxpr (`layer_scan_rewrite.stack_cut`). Each form: pipelines weighed for a
cluster of nodes and under a tight memory budget, and the forced pipeline on the 8 CPU devices equal
to the plain step under `jax.jit` (f32, one Adam step, rtol 2e-5).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxwap
from jaxwap.core.records import STAGE
from jaxwap.runtime.layer_scan import NoLayerScan, find_layer_scan
from jaxwap.runtime.layer_scan_rewrite import stack_cut

L, D, B, V = 8, 32, 16, 16


class _LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return h + nn.Dense(D)(jnp.tanh(nn.Dense(2 * D)(h))), None


class _LinenModel(nn.Module):
    remat: bool
    layers: int = L

    @nn.compact
    def __call__(self, x):
        h = nn.Embed(V, D)(x).mean(1)
        block = nn.remat(_LinenBlock) if self.remat else _LinenBlock
        h, _ = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                       length=self.layers)()(h, None)
        return nn.Dense(V)(h)


class _EvalDropoutBlock(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        y = nn.Dropout(0.1, deterministic=True)(jnp.tanh(nn.Dense(2 * D)(h)))
        return h + nn.Dense(D)(y), None


class _LinenDropoutKeys(nn.Module):
    """MaxText's way: the scan splits a dropout key over the layers (`split_rngs`) and
    the step passes one, while dropout itself is off (rate 0 in pretraining,
    `deterministic`): every layer gets a key it never draws from."""

    layers: int = L

    @nn.compact
    def __call__(self, x):
        h = nn.Embed(V, D)(x).mean(1)
        h, _ = nn.scan(_EvalDropoutBlock, variable_axes={"params": 0},
                       split_rngs={"params": True, "dropout": True},
                       length=self.layers)()(h, None)
        return nn.Dense(V)(h)


class _DecoderBlock(nn.Module):
    """Pre-norm causal self-attention and MLP, the mask broadcast to every layer."""

    @nn.compact
    def __call__(self, h, mask):
        h = h + nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=D)(
            nn.LayerNorm()(h), mask=mask)
        return h + nn.Dense(D)(nn.gelu(nn.Dense(4 * D)(nn.LayerNorm()(h)))), None


class _LinenDecoder(nn.Module):
    """A decoder as the Flax examples write one: `nn.scan` over remat'd blocks, with the
    causal mask made from the tokens and passed in with `in_axes=nn.broadcast`."""

    layers: int = L

    @nn.compact
    def __call__(self, x):
        blocks = nn.scan(nn.remat(_DecoderBlock), variable_axes={"params": 0},
                         split_rngs={"params": True}, in_axes=nn.broadcast,
                         length=self.layers)
        h, _ = blocks()(nn.Embed(V, D)(x), nn.make_causal_mask(x))
        return nn.Dense(V)(nn.LayerNorm()(h)).mean(1)


class _NnxBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(D, 2 * D, rngs=rngs)
        self.down = nnx.Linear(2 * D, D, rngs=rngs)

    def __call__(self, h):
        return h + self.down(jnp.tanh(self.up(h)))


class _NnxModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, layers: int = L):
        self.embed = nnx.Embed(V, D, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(r: nnx.Rngs) -> _NnxBlock:
            return _NnxBlock(r)

        self.blocks = make(rngs)
        self.head = nnx.Linear(D, V, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(h, block):
            return block(h)

        return self.head(run(self.embed(x).mean(1), self.blocks))


def _xent(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _linen(remat: bool, layers: int = L):
    model = _LinenModel(remat, layers)
    params = model.init(jax.random.key(0), jnp.zeros((B, 4), jnp.int32))["params"]
    return lambda p, b: _xent(model.apply({"params": p}, b["x"]), b["y"]), params


def _dropout_keys(layers: int = L):
    model = _LinenDropoutKeys(layers)
    params = model.init(jax.random.key(0), jnp.zeros((B, 4), jnp.int32))["params"]

    def loss(p, b):
        rngs = {"dropout": jax.random.wrap_key_data(b["key"])}
        return _xent(model.apply({"params": p}, b["x"], rngs=rngs), b["y"])
    return loss, params


def _decoder(layers: int = L):
    model = _LinenDecoder(layers)
    params = model.init(jax.random.key(0), jnp.zeros((B, 4), jnp.int32))["params"]
    return lambda p, b: _xent(model.apply({"params": p}, b["x"]), b["y"]), params


def _nnx(layers: int = L):
    graphdef, params = nnx.split(_NnxModel(nnx.Rngs(0), layers), nnx.Param)
    return lambda p, b: _xent(nnx.merge(graphdef, p)(b["x"]), b["y"]), params


def _lax(layers: int = L):
    rng = np.random.default_rng(0)
    f = lambda *s, scale=0.3: jnp.asarray(rng.standard_normal(s) * scale, jnp.float32)  # noqa: E731
    params = {"embed": f(V, D), "head": f(D, V),
              "blocks": {"w1": f(L, D, 2 * D, scale=D ** -0.5), "b1": f(L, 2 * D, scale=0.1),
                         "w2": f(L, 2 * D, D, scale=(2 * D) ** -0.5)}}

    def loss(p, b):
        def layer(h, w):
            return h + jnp.tanh(h @ w["w1"] + w["b1"]) @ w["w2"], None

        h, _ = jax.lax.scan(layer, jnp.take(p["embed"], b["x"], axis=0).mean(1), p["blocks"])
        return _xent(h @ p["head"], b["y"])
    return loss, params


def _fori(layers: int = L):
    """The hand-written stack run by a `fori_loop` reading layer i of each stacked leaf
    (`w[i]`), the odd layers' branch scaled by a half (a flag read from the counter)."""
    _, params = _lax(layers)

    def loss(p, b):
        def layer(i, h):
            w = jax.tree.map(lambda x: x[i], p["blocks"])
            return h + jnp.where(i % 2 == 0, 1.0, 0.5) * jnp.tanh(
                h @ w["w1"] + w["b1"]) @ w["w2"]

        h = jax.lax.fori_loop(0, p["blocks"]["w1"].shape[0], layer,
                              jnp.take(p["embed"], b["x"], axis=0).mean(1))
        return _xent(h @ p["head"], b["y"])
    return loss, params


FORMS = {"linen_scan_remat": lambda n=L: _linen(True, n),
         "linen_scan": lambda n=L: _linen(False, n), "linen_decoder": _decoder,
         "linen_dropout_keys": _dropout_keys,
         "nnx_vmap_scan": _nnx, "lax_scan": _lax, "lax_fori_loop": _fori}
# Adam's first step divides each gradient element by its own size, so an element whose
# gradient is near Adam's eps moves by rounding noise at full scale (up to lr): the
# attention decoder, with many such elements, is compared under SGD, whose update is
# the gradient itself, and the MLP stacks under Adam, which they meet at rtol 2e-5
_OPTIMIZER = {"linen_decoder": optax.sgd(0.1)}


def _setup(form: str):
    loss, params = FORMS[form]()
    rng = np.random.default_rng(1)
    batch = {"x": jnp.asarray(rng.integers(0, V, (B, 4)), jnp.int32),
             "y": jnp.asarray(rng.integers(0, V, (B,)), jnp.int32)}
    if form == "linen_dropout_keys":
        batch["key"] = jax.random.key_data(jax.random.key(7))
    step = jaxwap.make_train_step(loss, _OPTIMIZER.get(form, optax.adam(1e-2)))
    return step, params, step.init(params), batch


def _staged(plan: jaxwap.Plan) -> list[jaxwap.Candidate]:
    return [c for c in plan.candidates if dict(c.mesh_shape).get(STAGE, 1) > 1]


@pytest.mark.parametrize("form", FORMS)
def test_a_stage_of_the_stack_is_the_loss_over_fewer_layers(form):
    """`stack_cut` of the whole stack is the loss itself, and over k layers it is the loss
    of the same model built with k layers, given the first k layers' parameters."""
    step, params, _, batch = _setup(form)
    loss = step.loss_fn
    scan = find_layer_scan(loss, params, batch)
    assert scan.length == L
    np.testing.assert_allclose(stack_cut(loss, scan, L)(params, batch), loss(params, batch),
                               rtol=1e-6)
    leaves, treedef = jax.tree.flatten(params)
    cut = jax.tree.unflatten(treedef, [x[:3] if i in scan.stacked else x
                                       for i, x in enumerate(leaves)])
    three = stack_cut(loss, scan, 3)(cut, batch)
    shallow, _ = FORMS[form](3)          # the model written with 3 layers: the oracle
    np.testing.assert_allclose(three, shallow(cut, batch), rtol=1e-6)
    assert not np.isclose(three, loss(params, batch))
    with pytest.raises(ValueError, match="layers=0: a stack has at least one layer"):
        stack_cut(loss, scan, 0)


def test_a_stack_used_outside_its_scan_is_not_cut_and_says_why():
    loss, params = _lax()
    step, _, _, batch = _setup("lax_scan")

    def with_norm(p, b):     # the whole stack's weights read outside the scan too
        return loss(p, b) + 1e-3 * jnp.sum(p["blocks"]["w1"].reshape(L, -1) ** 2)

    scan = find_layer_scan(with_norm, params, batch)
    leaves, treedef = jax.tree.flatten(params)
    cut = jax.tree.unflatten(treedef, [x[:4] if i in scan.stacked else x
                                       for i, x in enumerate(leaves)])
    with pytest.raises(NoLayerScan, match="outside the layer scan too \\(reshape\\)"):
        stack_cut(with_norm, scan, 4)(cut, batch)
    # the planner skips pipelines for it, and says why, instead of failing the plan
    step = jaxwap.make_train_step(with_norm, optax.adam(1e-2))
    plan = jaxwap.plan(step, params, step.init(params), batch, cache=False, verify=0)
    assert not _staged(plan)
    assert any("pipelin" in n and "outside the layer scan" in n for n in plan.notes), \
        plan.notes


@pytest.mark.parametrize("form", ["linen_decoder", "nnx_vmap_scan", "lax_scan"])
def test_pipelines_are_weighed_for_a_cluster_of_nodes(form):
    step, params, opt, batch = _setup(form)
    cluster = jaxwap.Cluster("h100-sxm", 16, devices_per_node=8, inter_node_bandwidth=1e9)
    plan = jaxwap.plan(step, params, opt, batch, hardware=cluster, cache=False, verify=0)
    assert {dict(c.mesh_shape)[STAGE] for c in _staged(plan)} == {2, 4}
    assert not any("pipelining not considered" in n for n in plan.notes), plan.notes


@pytest.mark.parametrize("form", ["linen_scan_remat", "nnx_vmap_scan", "lax_scan"])
def test_a_tight_memory_budget_is_planned_with_pipelines_weighed(form):
    step, params, opt, batch = _setup(form)
    loose = jaxwap.plan(step, params, opt, batch, cache=False, verify=0, num_devices=1)
    budget = 0.6 * loose.predicted.peak_memory_bytes    # one device's plan does not fit
    plan = jaxwap.plan(step, params, opt, batch, cache=False, verify=0,
                       memory_budget=budget)
    assert plan.predicted.peak_memory_bytes <= budget
    assert _staged(plan) and not any("pipelining not considered" in n for n in plan.notes)


@pytest.mark.parametrize("form", ["linen_scan_remat", "linen_scan", "linen_decoder",
                                  "nnx_vmap_scan", "linen_dropout_keys", "lax_fori_loop"])
def test_the_pipelined_step_equals_the_plain_step(form):
    """2 stages x data 4, 4 micro-batches (the hand-written scan's pipelines are run by
    `test_pipeline_plan.py`)."""
    step, params, _, batch = _setup(form)
    # under SGD (the update is the gradient): Adam's first step moves an element whose
    # gradient is near its eps by rounding noise at full scale, which the pipeline's
    # other summation order shows
    step = jaxwap.make_train_step(step.loss_fn, optax.sgd(0.1))
    opt = step.init(params)
    want = jax.jit(step)(params, opt, batch)
    sharded = jaxwap.auto_shard(step, cache=False, verify=0, num_devices=8,
                                strategies=("replicate", "zero1"),
                                pipeline={"stages": 2, "micro_batches": 4})
    # what runs is the pipeline: its loop sends activations from stage to stage
    hlo = sharded.lower_and_compile(params, opt, batch).as_text()
    assert "collective-permute" in hlo
    got = sharded(params, opt, batch)
    assert dict(sharded.plan.mesh_shape)[STAGE] == 2
    assert (sharded.plan.step.stages, sharded.plan.step.micro_batches) == (2, 4)
    # f32, one step: the pipelined sums run in another order
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)


def test_a_pipeline_that_fails_to_build_leaves_the_plan_without_pipelines(monkeypatch):
    """An optional branch never takes the plan down: a failure anywhere in building the
    stages (here one jaxwap cannot foresee, simulated) is a note; forced, it is the plan's
    error."""
    from jaxwap.search import pipeline_search as pipeline_plan

    def boom(*args, **kwargs):
        raise RuntimeError("stage step exploded")

    monkeypatch.setattr(pipeline_plan, "_best_for_stages", boom)
    step, params, opt, batch = _setup("lax_scan")
    plan = jaxwap.plan(step, params, opt, batch, cache=False, verify=0)
    assert not _staged(plan)
    assert ("pipelining not considered: building the stages failed (RuntimeError: stage "
            "step exploded)") in plan.notes
    with pytest.raises(RuntimeError, match="stage step exploded"):
        jaxwap.plan(step, params, opt, batch, cache=False, verify=0,
                    pipeline={"stages": 2})


def test_a_step_variant_that_cannot_be_built_is_skipped_and_named():
    """A loss that reshapes with its batch size fixed traces whole but not in
    micro-batches: each micro-batch rung is skipped with the reason, and when nothing else
    fits the plan's error names why each was not built."""
    _, params, _, batch = _setup("lax_scan")

    def fixed_batch(p, b):
        h = jnp.take(p["embed"], b["x"].reshape(B * 4), axis=0).reshape(B, 4, D).mean(1)
        return _xent(h @ p["head"], b["y"]) + 0 * jnp.sum(p["blocks"]["w1"])

    step = jaxwap.make_train_step(fixed_batch, optax.adam(1e-2))
    one = {"cache": False, "verify": 0, "num_devices": 1, "offload": False, "pipeline": False}
    need = jaxwap.plan(step, params, step.init(params), batch, **one)
    # just below the step as written: the micro-batch counts' floors are under it, so
    # they are traced (as the bisection asks) and none is built
    with pytest.raises(MemoryError) as e:
        jaxwap.plan(step, params, step.init(params), batch, **one,
                    memory_budget=0.99 * need.predicted.peak_memory_bytes)
    said = str(e.value)
    assert "micro-batches: could not be built (TypeError" in said
    assert "(estimated)" not in said and "(predicted)" not in said.split("Also tried")[1]


def _abstract_stack(loop: str):
    """A 32-layer MLP stack (d 2048, bf16 compute, 256 x 2048 tokens) as abstract
    arguments, run by a `lax.scan` over its stacked weights or a `fori_loop` reading
    `w[i]`: on 8 H100s the step as written does not fit unpipelined."""
    layers, d, vocab = 32, 2048, 32000
    sds = jax.ShapeDtypeStruct
    params = {"embed": sds((vocab, d), jnp.float32), "head": sds((d, vocab), jnp.float32),
              "w_in": sds((layers, d, 4 * d), jnp.float32),
              "w_out": sds((layers, 4 * d, d), jnp.float32)}

    def block(h, w_in, w_out):
        return h + jax.nn.gelu(h @ w_in.astype(jnp.bfloat16)) @ w_out.astype(jnp.bfloat16)

    def loss(p, b):
        h = p["embed"].astype(jnp.bfloat16)[b["x"]]
        if loop == "scan":
            h, _ = jax.lax.scan(lambda h, w: (block(h, *w), None), h, (p["w_in"], p["w_out"]))
        else:
            h = jax.lax.fori_loop(0, layers, lambda i, h: block(h, p["w_in"][i],
                                                                  p["w_out"][i]), h)
        return _xent((h @ p["head"].astype(jnp.bfloat16)).astype(jnp.float32), b["y"])
    step = jaxwap.make_train_step(loss, optax.adam(1e-4))
    tokens = sds((256, 2048), jnp.int32)
    return step, params, jax.eval_shape(step.init, params), {"x": tokens, "y": tokens}


@pytest.mark.parametrize("loop", ["scan", "fori_loop"])
def test_where_only_pipelines_fit_the_ladders_restructurings_are_weighed_against_them(loop):
    """The step as written fits 8 H100s only pipelined (stages checkpointed, many
    micro-batches); per-layer remat over the 8 devices without stages is predicted
    faster, and is what the plan takes, saying what it weighed."""
    step, params, opt, batch = _abstract_stack(loop)
    h100 = jaxwap.Cluster("h100-sxm", 8)
    plan = jaxwap.plan(step, params, opt, batch, hardware=h100, verify=0, cache=False,
                       objective="throughput")
    assert plan.step.stages == 1 and plan.step.remat.startswith("layer_"), plan.step
    # every pipeline that fits, forced: each predicted slower than the plan taken
    piped = []
    for stages in (2, 4, 8):
        try:
            piped.append(jaxwap.plan(step, params, opt, batch, hardware=h100, verify=0,
                                     cache=False, objective="throughput",
                                     pipeline={"stages": stages}))
        except MemoryError:
            pass
    assert piped and all(p.step.stages > 1 for p in piped)
    assert plan.predicted.step_time_s < min(p.predicted.step_time_s for p in piped)
    assert any(n.startswith("as written, only pipelined candidates fit; the best, stage=")
               and "lost to" in n for n in plan.notes), plan.notes
