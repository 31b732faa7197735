"""User constraints (`constraints=`): pinned parameters keep the layout asked for, the
planner searches the rest around them, the step still equals the unsharded one (f32,
rtol 2e-5), and a pin that cannot hold raises naming the parameter, its shape, the spec
and the reason. Flax logical partitioning metadata becomes constraints through
`jaxwap.logical_constraints`."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxwap

RTOL, ATOL = 2e-5, 2e-6


def _loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["up"]["kernel"] + params["up"]["bias"])
    return jnp.mean((h @ params["down"]["kernel"] - batch["y"]) ** 2)


def _setup():
    rng = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.3, jnp.float32)  # noqa: E731
    # 36 hidden units: divisible by a model axis of 2 or 4, not of 8
    params = {"up": {"kernel": f(32, 36), "bias": f(36)}, "down": {"kernel": f(36, 16)}}
    batch = {"x": f(16, 32), "y": f(16, 16)}
    return params, batch


def _by_path(plan):
    return {"/".join(p.path): p for p in plan.params}


def test_a_pinned_spec_is_kept_and_the_rest_is_searched_and_equals_the_unsharded_step():
    step = jaxwap.make_train_step(_loss, optax.adam(1e-2))
    params, batch = _setup()
    opt = step.init(params)
    want = jax.jit(step)(params, opt, batch)
    sharded = jaxwap.auto_shard(step, cache=False, verify=1, mesh_shape={"data": 2, "model": 4},
                                constraints={"up/kernel": P(None, "model")})
    got = sharded(params, opt, batch)
    placed = _by_path(sharded.plan)
    assert placed["up/kernel"].spec == (None, "model")
    assert placed["up/kernel"].strategy.endswith("pinned")
    assert not placed["down/kernel"].strategy.endswith("pinned")
    assert "pinned" in sharded.plan.explain()
    assert any("constraints pin up/kernel to P(None, 'model')" in n
               for n in sharded.plan.notes)
    assert got[0]["up"]["kernel"].sharding.spec == P(None, "model")
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)


def test_a_spec_the_search_would_not_offer_is_pinned_as_given():
    """Row-parallel is not what the search offers for `down/kernel` on a model axis it
    splits the other way; pinned, it is taken as given and priced as a row split."""
    step = jaxwap.make_train_step(_loss, optax.adam(1e-2))
    params, batch = _setup()
    plan = jaxwap.plan(step, params, step.init(params), batch, cache=False, verify=0,
                       mesh_shape={"data": 4, "model": 2},
                       constraints={"down/kernel": P("model", "data")})
    p = _by_path(plan)["down/kernel"]
    assert p.spec == ("model", "data") and p.strategy.endswith("pinned")


def test_a_pinned_family_restricts_that_parameter_only():
    step = jaxwap.make_train_step(_loss, optax.adam(1e-2))
    params, batch = _setup()
    plan = jaxwap.plan(step, params, step.init(params), batch, cache=False, verify=0,
                       num_devices=8, constraints={"kernel": "fsdp"})
    placed = _by_path(plan)
    for path in ("up/kernel", "down/kernel"):
        assert "fsdp" in placed[path].strategy and placed[path].strategy.endswith("pinned")
        assert "data" in placed[path].spec
    assert not placed["up/bias"].strategy.endswith("pinned")


def test_constraints_that_cannot_hold_name_the_parameter_shape_spec_and_reason():
    step = jaxwap.make_train_step(_loss, optax.adam(1e-2))
    params, batch = _setup()
    opt = step.init(params)

    def plan(**kw):
        return jaxwap.plan(step, params, opt, batch, cache=False, verify=0, **kw)

    with pytest.raises(ValueError, match=r"pattern 'nope/kernel' matches no parameter"):
        plan(constraints={"nope/kernel": P()})
    with pytest.raises(ValueError, match=r"axis 'stage' is not in jaxwap's mesh"):
        jaxwap.PlanOptions(constraints={"up/kernel": P("stage", None)})
    with pytest.raises(ValueError, match=r"a strategy name must be one of"):
        jaxwap.PlanOptions(constraints={"up/kernel": "megatron"})
    # 36 columns over a model axis of 8: not divisible
    with pytest.raises(ValueError, match=r"up/kernel with shape \(32, 36\), constraint "
                                         r"P\(None, 'model'\): dim 1 \(36\) is not divisible "
                                         r"by the model axis of size 8"):
        plan(mesh_shape={"data": 1, "model": 8}, constraints={"up/kernel": P(None, "model")})
    # a bias split over model is its kernel's column split: on a model axis of 8 that
    # does not divide its 36 features
    with pytest.raises(ValueError, match=r"up/bias with shape \(36,\), constraint "
                                         r"P\('model',\): dim 0 \(36\) is not divisible"):
        plan(mesh_shape={"data": 1, "model": 8}, constraints={"up/bias": P("model")})
    # on 4 it does, and the pin holds
    pinned = _by_path(plan(mesh_shape={"data": 2, "model": 4},
                           constraints={"up/bias": P("model")}))["up/bias"]
    assert (pinned.spec, pinned.strategy) == (("model",), "tp-col, pinned")
    # pinned replicated, no layout fits 6 kB a device: the error names the pin
    with pytest.raises(MemoryError, match=r"pins \(up/kernel with shape \(32, 36\) as "
                                          r"'replicate'\)"):
        plan(num_devices=8, memory_budget=6e3, constraints={"up/kernel": "replicate"})


class _Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        h = nn.Dense(64, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")),
                     name="up")(x)
        return nn.Dense(16, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")),
                        name="down")(jnp.tanh(h))


def test_flax_logical_partitioning_becomes_constraints_under_the_rules():
    model = _Mlp()
    x = jnp.ones((16, 32))
    boxed = model.init(jax.random.key(0), x)["params"]
    rules = (("embed", None), ("mlp", "model"))
    cons = jaxwap.logical_constraints(boxed, rules)
    assert cons == {"^up/kernel(/value)?$": (None, "model"),
                    "^down/kernel(/value)?$": ("model", None)}
    params = nn.unbox(boxed)

    def loss(p, batch):
        return jnp.mean((model.apply({"params": p}, batch["x"]) - batch["y"]) ** 2)

    step = jaxwap.make_train_step(loss, optax.sgd(0.1))
    batch = {"x": x, "y": jnp.zeros((16, 16))}
    plan = jaxwap.plan(step, params, step.init(params), batch, cache=False, verify=0,
                       mesh_shape={"data": 2, "model": 4}, constraints=cons)
    placed = _by_path(plan)
    assert placed["up/kernel"].spec == (None, "model")
    assert placed["down/kernel"].spec == ("model", None)



def test_logical_names_map_to_mesh_axes_as_flax_maps_them():
    """Flax's convention (`nn.logical_to_mesh_axes`, the oracle where its axes are
    jaxwap's): a name no rule lists is replicated, the first rule whose axis is still free
    places a name, and a rule naming an axis jaxwap's mesh lacks is an error naming it."""
    boxed = _Mlp().init(jax.random.key(0), jnp.ones((16, 32)))["params"]
    for rules in [(("embed", None),), (("embed", "data"),), (("mlp", "model"),),
                  (("embed", "model"), ("mlp", "model"), ("mlp", "data")),
                  (("mlp", "data"), ("embed", "data"), ("embed", "model"))]:
        cons = jaxwap.logical_constraints(boxed, rules)
        for name, names in (("up", ("embed", "mlp")), ("down", ("mlp", "embed"))):
            want = tuple(nn.logical_to_mesh_axes(names, rules))
            assert cons[f"^{name}/kernel(/value)?$"] == want, (rules, name, want)
    assert jaxwap.logical_constraints(boxed, (("embed", None),))["^up/kernel(/value)?$"] \
        == (None, None)
    with pytest.raises(ValueError, match=r"\['down'\]\['kernel'\]: the rule \('mlp', 'tensor'\) "
                                         r"maps logical axis 'mlp' to 'tensor'"):
        jaxwap.logical_constraints(boxed, (("mlp", "tensor"),))
    with pytest.raises(ValueError, match="shards one dim over 2 axes"):
        jaxwap.logical_constraints(boxed, (("mlp", ("data", "model")),))


def test_nnx_sharding_metadata_becomes_constraints_under_the_rules():
    from flax import nnx

    class Mlp(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.lecun_normal()
            self.up = nnx.Linear(32, 64, kernel_init=nnx.with_partitioning(
                init, ("embed", "mlp")), rngs=rngs)
            self.down = nnx.Linear(64, 16, kernel_init=nnx.with_partitioning(
                init, ("mlp", "embed")), rngs=rngs)

    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(Mlp(nnx.Rngs(0)), nnx.Param)
    cons = jaxwap.logical_constraints(state, (("embed", None), ("mlp", "model")))

    def loss(p, batch):
        m = nnx.merge(graphdef, p)
        return jnp.mean((m.down(jnp.tanh(m.up(batch["x"]))) - batch["y"]) ** 2)

    step = jaxwap.make_train_step(loss, optax.sgd(0.1))
    batch = {"x": jnp.ones((16, 32)), "y": jnp.zeros((16, 16))}
    plan = jaxwap.plan(step, state, step.init(state), batch, cache=False, verify=0,
                       mesh_shape={"data": 2, "model": 4}, constraints=cons)
    placed = _by_path(plan)
    assert placed["up/kernel/value"].spec == (None, "model")
    assert placed["down/kernel/value"].spec == ("model", None)
    assert placed["up/kernel/value"].strategy.endswith("pinned")


def test_a_model_pin_on_a_non_layer_dim_holds_where_the_model_axis_is_one():
    """A norm scale pinned over "model" (Flax rules shard them over the tensor axis):
    jaxwap splits only layer feature dims over the model axis, so on a 4x2 mesh the pin
    is refused with the reason, and on an 8x1 mesh, where the model axis splits nothing,
    it holds and the plan keeps the spec as given."""
    def loss(p, b):
        x = b["x"] * jax.lax.rsqrt(jnp.mean(b["x"] ** 2, -1, keepdims=True) + 1e-6)
        return jnp.mean(((x * (1 + p["norm"]["scale"])) @ p["up"]["kernel"] - b["y"]) ** 2)

    params = {"norm": {"scale": jnp.zeros(32)}, "up": {"kernel": jnp.ones((32, 64)) * .01}}
    batch = {"x": jnp.ones((16, 32)), "y": jnp.zeros((16, 64))}
    step = jaxwap.make_train_step(loss, optax.sgd(0.1))
    pin = {"norm/scale": P("model")}
    with pytest.raises(ValueError, match="model axis on dim 0 is not a feature dim"):
        jaxwap.plan(step, params, step.init(params), batch, cache=False, verify=0,
                    mesh_shape={"data": 4, "model": 2}, constraints=pin)
    plan = jaxwap.plan(step, params, step.init(params), batch, cache=False, verify=0,
                       mesh_shape={"data": 8, "model": 1}, constraints=pin)
    placed = _by_path(plan)
    assert placed["norm/scale"].spec == ("model",)
    assert placed["norm/scale"].strategy == "replicate, pinned"
