"""Bad input gets a clear error that names the offending leaf or argument, and a failed call
leaves every array the user passed alive and unchanged (nothing donated, nothing moved)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models import abstract_setup

import jaxwap

H100X8 = jaxwap.Cluster("h100-sxm", 8)


def materialize(shapes, rng):
    """Concrete arrays for a tree of ShapeDtypeStructs: small normals, or zeros without rng."""
    def one(s):
        if rng is None:
            return jnp.asarray(np.zeros(s.shape, s.dtype))
        return jnp.asarray((0.1 * rng.standard_normal(s.shape)).astype(s.dtype))

    return jax.tree_util.tree_map(one, shapes)


@functools.cache
def make_setup(features=(32, 16, 4), in_dim=8, batch=16, seed=0):
    """(train_step, params, opt_state, batch) for a small MLP trained with adam.

    Cached per configuration: tests here never donate these arrays (a test that runs the
    step passes copies), so sharing them is safe.
    """
    rng = np.random.default_rng(seed)
    # Built from shapes with numpy values: eager flax/optax init compiles many tiny ops.
    train_step, params, opt_state, data = abstract_setup(features, batch, in_dim,
                                                         regression=True)
    return (train_step, materialize(params, rng), materialize(opt_state, None),
            materialize(data, rng))


def snapshot(*trees):
    """Every jax.Array leaf of the trees with a host copy of its value."""
    leaves = [x for t in trees for x in jax.tree_util.tree_leaves(t) if isinstance(x, jax.Array)]
    assert leaves, "nothing to check"
    return [(x, np.array(x)) for x in leaves]


def assert_intact(snap):
    for x, before in snap:
        assert not x.is_deleted(), "a failed call consumed (donated) a user array"
        np.testing.assert_array_equal(np.asarray(x), before)


def copy_tree(tree):
    return jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), tree)


_SI = {"": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}


# --------------------------------------------------------------------------- params
def test_params_not_found_other_shapes_names_missing_leaf():
    step, params, opt_state, batch = make_setup()
    _, other, _, _ = make_setup(features=(20, 10, 4))  # same paths, other shapes
    snap = snapshot(params, opt_state, batch, other)
    wrapped = jaxwap.auto_shard(step, params=other)
    with pytest.raises(ValueError, match="params not found") as e:
        wrapped(params, opt_state, batch)
    msg = str(e.value)
    assert "params['params']['Dense_0']['kernel']" in msg
    assert "(8, 20)" in msg  # the missing leaf's shape
    assert_intact(snap)


def test_params_not_found_other_paths_names_missing_leaf():
    step, params, opt_state, batch = make_setup()
    other = {"encoder": {"w": jnp.ones((3, 5))}}
    snap = snapshot(params, opt_state, batch, other)
    with pytest.raises(ValueError, match="params not found") as e:
        jaxwap.auto_shard(step, params=other)(params, opt_state, batch)
    assert "params['encoder']['w']" in str(e.value)
    assert "(3, 5)" in str(e.value)
    assert_intact(snap)
    # the planning entry point says the same
    with pytest.raises(ValueError, match=r"params not found.*\['encoder'\]\['w'\]"):
        jaxwap.plan(step, params, opt_state, batch, params=other)
    assert_intact(snap)


def test_params_given_in_another_dtype_names_the_leaf_and_both_dtypes():
    """params= as ShapeDtypeStructs of bfloat16 for a step that receives float32 weights:
    the plan would count every weight at half its bytes, so it is refused, naming the leaf."""
    step, params, opt_state, batch = make_setup()
    as_bf16 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16), params)
    snap = snapshot(params, opt_state, batch)
    with pytest.raises(TypeError, match=r"params\['params'\]\['Dense_0'\]\['(kernel|bias)'\] "
                       r"is bfloat16.*receives float32 at args\[0\]") as e:
        jaxwap.auto_shard(step, params=as_bf16)(params, opt_state, batch)
    assert "dtypes the step receives" in str(e.value)
    assert_intact(snap)
    with pytest.raises(TypeError, match="is bfloat16"):
        jaxwap.plan(step, params, opt_state, batch, params=as_bf16)
    # the same shapes in the step's own dtype are fine
    same = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    assert jaxwap.plan(step, params, opt_state, batch, params=same, verify=0).mesh_shape


@pytest.mark.parametrize("flag", ["donate", "offload"])
def test_a_string_for_a_yes_no_option_is_refused_not_read_as_true(flag):
    """donate="False" (a config file's string) read as True would delete the arrays of a
    user who asked to keep them."""
    with pytest.raises(TypeError, match=f"{flag} must be True or False, got 'False'"):
        jaxwap.auto_shard(make_setup()[0], cache=False, **{flag: "False"})


def test_a_device_listed_twice_is_refused_naming_it():
    d = jax.devices()[1]
    with pytest.raises(ValueError, match=re.escape(f"devices= lists {d} more than once")):
        jaxwap.auto_shard(make_setup()[0], devices=[d, d], cache=False)


@pytest.mark.parametrize("text", ["[1, 2]", '"a plan"', '{"format": 99}'])
def test_a_plan_file_that_is_not_a_plan_names_the_file(tmp_path, text):
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(f"plan={str(path)!r} cannot be read")):
        jaxwap.auto_shard(make_setup()[0], plan=path, cache=False)


# --------------------------------------------------------------------------- non-array leaves
def test_string_leaf_in_batch_is_type_error_naming_path():
    step, params, opt_state, batch = make_setup()
    bad = dict(batch, name="abc")
    snap = snapshot(params, opt_state, batch)
    with pytest.raises(TypeError) as e:
        jaxwap.auto_shard(step)(params, opt_state, bad)
    msg = str(e.value)
    assert "['name']" in msg
    assert "str" in msg and "abc" in msg
    assert_intact(snap)


def test_object_array_leaf_in_batch_is_type_error_naming_path():
    step, params, opt_state, batch = make_setup()
    bad = dict(batch, tags=np.array(["a", 1, None], dtype=object))
    snap = snapshot(params, opt_state, batch)
    with pytest.raises(TypeError, match=re.escape("['tags']") + ".*dtype=object"):
        jaxwap.auto_shard(step)(params, opt_state, bad)
    assert_intact(snap)


def test_plan_given_with_a_contradicting_mesh_or_device_count_is_refused():
    step, params, opt, batch = abstract_setup((32, 10), 16, 8)
    made = jaxwap.plan(step, params, opt, batch, verify=0, cache=False,
                       hardware=jaxwap.Cluster("cpu", 8), mesh_shape={"data": 4})
    with pytest.raises(ValueError, match=r"mesh_shape=\{'data': 2, 'model': 1\} contradicts"):
        jaxwap.PlanOptions(plan=made, mesh_shape={"data": 2})
    with pytest.raises(ValueError, match="num_devices=8 contradicts the plan given"):
        jaxwap.PlanOptions(plan=made, num_devices=8)
    same = jaxwap.PlanOptions(plan=made, mesh_shape={"data": 4}, num_devices=4)
    assert same.plan == made


def test_plan_given_with_contradicting_planning_options_is_refused():
    """plan= runs the saved plan as it is: offload=False, strategies=, constraints= or a
    memory_budget= that it breaks were ignored without a word."""
    step, params, opt, batch = abstract_setup((32, 10), 16, 8)
    made = jaxwap.plan(step, params, opt, batch, verify=0, cache=False,
                       hardware=jaxwap.Cluster("cpu", 8), mesh_shape={"data": 4},
                       strategies=("offload",))
    assert all(p.offload for p in made.params)
    for bad, says in [({"offload": False}, "offload=False contradicts"),
                      ({"strategies": ("fsdp",)}, r"strategies=\('fsdp',\) contradicts"),
                      ({"constraints": {"kernel": "fsdp"}}, "constraint 'kernel': 'fsdp'"),
                      ({"memory_budget": 1000}, "memory_budget=1000 contradicts")]:
        with pytest.raises(ValueError, match=says) as e:
            jaxwap.PlanOptions(plan=made, **bad)
        assert "give one of them" in str(e.value)
        if "memory" not in says:     # the parameter the plan lays out otherwise is named
            assert re.search(r"params\[.*\] is .*offload", str(e.value)), str(e.value)
    # what the plan obeys is fine
    same = jaxwap.PlanOptions(plan=made, strategies=("offload", "replicate"),
                              constraints={"kernel": "offload"},
                              memory_budget=made.predicted.peak_memory_bytes)
    assert same.plan == made


def test_string_leaf_plan_names_the_argument():
    step, params, opt_state, batch = make_setup()
    bad = dict(batch, name="abc")
    snap = snapshot(params, opt_state, batch)
    with pytest.raises(TypeError, match=re.escape("args[2]['name']")):
        jaxwap.plan(step, params, opt_state, bad)
    assert_intact(snap)


def test_string_leaf_auto_shard_names_the_argument():
    # regression: the wrapper's own leaf check once said args[0][2]['name'] (the path
    # through its internal (args, kwargs) tuple) for the third positional argument
    step, params, opt_state, batch = make_setup()
    bad = dict(batch, name="abc")
    with pytest.raises(TypeError, match=re.escape("args[2]['name']")):
        jaxwap.auto_shard(step)(params, opt_state, bad)


def test_python_float_param_leaf_names_params_path():
    step, params, opt_state, batch = make_setup()
    bad_params = {"params": dict(params["params"], scale=1.0)}
    snap = snapshot(params, opt_state, batch)
    with pytest.raises(TypeError) as e:
        jaxwap.auto_shard(step)(bad_params, opt_state, batch)
    msg = str(e.value)
    assert "params['params']['scale']" in msg
    assert "1.0" in msg
    assert_intact(snap)
    # also when the params tree is given explicitly
    with pytest.raises(TypeError, match=re.escape("params['params']['scale']")):
        jaxwap.auto_shard(step, params=bad_params)(params, opt_state, batch)
    assert_intact(snap)


# --------------------------------------------------------------------------- meshes
def test_batch_not_divisible_by_any_usable_mesh():
    # 7 is prime and no layer dim (5, 12, 6) divides by 8: no 8-device mesh works.
    step, params, opt_state, batch = make_setup(features=(12, 6), in_dim=5, batch=7)
    snap = snapshot(params, opt_state, batch)
    wrapped = jaxwap.auto_shard(step, params, num_devices=8, hardware=H100X8)
    with pytest.raises(ValueError, match="not divisible") as e:
        wrapped(params, opt_state, batch)
    msg = str(e.value)
    assert re.search(r"batch size 7\b", msg), msg
    assert "8" in msg
    assert_intact(snap)


def test_same_batch_is_fine_without_forcing_eight_devices():
    # the contrast: with the device count free, a 1-device mesh takes batch 7
    step, params, opt_state, batch = make_setup(features=(12, 6), in_dim=5, batch=7)
    plan = jaxwap.plan(step, params, opt_state, batch, hardware=H100X8)
    assert plan.mesh_shape["data"] == 1
    assert plan.batch_size == 7


def test_forced_device_count_with_a_tiny_batch_plans_tensor_parallel():
    # batch 2 on exactly 8 devices leaves only meshes with a model axis (1x8, 2x4); with
    # tensor parallelism allowed, the layer weights take it and the plan uses all 8
    step, params, opt_state, batch = make_setup(features=(64, 64, 8), in_dim=16, batch=2)
    plan = jaxwap.plan(step, params, opt_state, batch, num_devices=8, hardware=H100X8,
                       cache=False)
    assert plan.num_devices == 8 and plan.mesh_shape["model"] > 1
    assert any(p.strategy.startswith("tp") for p in plan.params)


def test_forced_device_count_without_model_axis_gain_is_clear():
    # regression: when no parameter can gain from the model axis those meshes need (here
    # tensor parallelism is not allowed), the search once died in a bare "min() arg is an
    # empty sequence"; it must say why and what to change
    step, params, opt_state, batch = make_setup(features=(64, 64, 8), in_dim=16, batch=2)
    with pytest.raises(ValueError, match="needs a model axis") as e:
        jaxwap.plan(step, params, opt_state, batch, num_devices=8, hardware=H100X8,
                    strategies=("replicate", "fsdp"), cache=False)
    msg = str(e.value)
    assert "min()" not in msg
    assert "num_devices=" in msg and "params/Dense_0/kernel" in msg


# --------------------------------------------------------------------------- memory
def test_nothing_fits_is_memory_error_with_needed_bytes():
    step, params, opt_state, batch = make_setup()
    snap = snapshot(params, opt_state, batch)
    wrapped = jaxwap.auto_shard(step, memory_budget=1000, hardware=H100X8)
    with pytest.raises(MemoryError) as e:
        wrapped(params, opt_state, batch)
    msg = str(e.value)
    assert "memory_budget" in msg
    assert "1 kB" in msg  # the budget it was given
    m = re.search(r"needs ([\d.]+) ([kMGTP]?)B per device", msg)
    assert m, msg
    needed = float(m.group(1)) * _SI[m.group(2)]
    assert needed > 1000
    assert_intact(snap)


@pytest.mark.parametrize("budget", [0, -5.0])
def test_non_positive_memory_budget(budget):
    step, params, opt_state, batch = make_setup()
    snap = snapshot(params, opt_state, batch)
    with pytest.raises(ValueError, match="memory_budget"):
        jaxwap.auto_shard(step, memory_budget=budget)(params, opt_state, batch)
    assert_intact(snap)


# --------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("n", [0, -1, 9, 100])
def test_num_devices_out_of_range(n):
    step, params, opt_state, batch = make_setup()
    snap = snapshot(params, opt_state, batch)
    with pytest.raises(ValueError, match=rf"num_devices={n}\b.*1\.\.8"):
        jaxwap.auto_shard(step, num_devices=n)(params, opt_state, batch)
    assert_intact(snap)


@pytest.mark.parametrize("n", [2.5, "4"])
def test_non_integer_num_devices_names_the_argument(n):
    # regression: 2.5 once passed the range check and failed deep in the search with
    # "'float' object cannot be interpreted as an integer", naming no argument
    step, params, opt_state, batch = make_setup()
    snap = snapshot(params, opt_state, batch)
    with pytest.raises((TypeError, ValueError), match="num_devices"):
        jaxwap.auto_shard(step, num_devices=n)(params, opt_state, batch)
    assert_intact(snap)


def test_bad_objective_string():
    step, params, opt_state, batch = make_setup()
    snap = snapshot(params, opt_state, batch)
    with pytest.raises(ValueError, match="fastest") as e:
        jaxwap.auto_shard(step, objective="fastest")
    assert "throughput" in str(e.value)  # lists what is allowed
    with pytest.raises(ValueError, match="fastest"):
        jaxwap.plan(step, params, opt_state, batch, objective="fastest")
    assert_intact(snap)


def test_bad_objective_type():
    step, *_ = make_setup()
    with pytest.raises(TypeError, match="objective"):
        jaxwap.auto_shard(step, objective=3)


def test_bad_hardware_type():
    step, params, opt_state, batch = make_setup()
    snap = snapshot(params, opt_state, batch)
    with pytest.raises(TypeError, match="hardware") as e:
        jaxwap.auto_shard(step, hardware=42)(params, opt_state, batch)
    assert "int" in str(e.value)
    assert_intact(snap)


def test_unknown_device_profile():
    with pytest.raises(ValueError, match="tpu-v9") as e:
        jaxwap.Cluster("tpu-v9", 8)
    assert "h100-sxm" in str(e.value)  # names the built-ins
    step, params, opt_state, batch = make_setup()
    snap = snapshot(params, opt_state, batch)
    with pytest.raises(ValueError, match="tpu-v9"):
        jaxwap.auto_shard(step, hardware="tpu-v9")(params, opt_state, batch)
    assert_intact(snap)


def test_negative_max_slowdown():
    with pytest.raises(ValueError, match="max_slowdown"):
        jaxwap.Objective(max_slowdown=-1)


def test_not_callable_step():
    _, params, _, _ = make_setup()
    with pytest.raises(TypeError, match="callable"):
        jaxwap.auto_shard(params)


def test_empty_devices():
    step, params, opt_state, batch = make_setup()
    snap = snapshot(params, opt_state, batch)
    with pytest.raises(ValueError, match="devices"):
        jaxwap.auto_shard(step, devices=[])(params, opt_state, batch)
    assert_intact(snap)


def test_no_positional_args_and_no_params():
    step, params, opt_state, batch = make_setup()
    snap = snapshot(params, opt_state, batch)
    wrapped = jaxwap.auto_shard(step)
    with pytest.raises(ValueError, match="positional") as e:
        wrapped(params=params, opt_state=opt_state, batch=batch)
    assert "params=" in str(e.value)
    assert_intact(snap)
    with pytest.raises(ValueError, match="positional"):
        jaxwap.plan(step, params=None, opt_state=opt_state, batch=batch)
    assert_intact(snap)


def test_failed_call_does_not_poison_the_wrapper():
    step, params, opt_state, batch = make_setup()
    wrapped = jaxwap.auto_shard(step)
    snap = snapshot(params, opt_state, batch)
    with pytest.raises(TypeError):
        wrapped(params, opt_state, dict(batch, name="abc"))
    assert_intact(snap)
    with pytest.raises(RuntimeError, match="no plan"):
        _ = wrapped.plan
    # the same wrapper then runs good input (copies: the state passed in is donated)
    new_params, _, metrics = wrapped(copy_tree(params), copy_tree(opt_state), batch)
    assert np.isfinite(float(metrics["loss"]))
    assert wrapped.plan.batch_size == 16
    assert jax.tree_util.tree_structure(new_params) == jax.tree_util.tree_structure(params)
    assert_intact(snap)


def test_a_model_axis_no_layout_can_use_is_refused_with_the_weights_and_advice():
    # a narrow MLP on 8 fast GPUs: no split over a model axis of 2 pays for itself, so the
    # mesh's tensor-parallel layout is planned; with tensor parallelism excluded no layout
    # can use the axis, and the error says so and how to force it
    step, params, opt, batch = abstract_setup((32, 10), 16, 8)
    base = dict(hardware=jaxwap.Cluster("h100-sxm", 8), mesh_shape={"data": 1, "model": 2},
                verify=0, cache=False)
    with pytest.raises(ValueError, match=re.escape(
            "mesh_shape 1x2: no layout splits any parameter over its model axis of 2 (the "
            "strategies allowed (replicate) exclude tensor parallelism")
            + ".*" + re.escape("force tensor parallelism with strategies=")):
        jaxwap.plan(step, params, opt, batch, strategies=("replicate",), **base)
    plan = jaxwap.plan(step, params, opt, batch, strategies=("tp", "replicate"), **base)
    assert {pl.strategy for pl in plan.params if pl.path[-1] == "kernel"} == {"tp-col",
                                                                               "tp-row"}


def test_no_mesh_message_gives_each_meshs_own_reason():
    # batch 12 on exactly 7 devices: 7x1 fails on the batch split, 1x7 on the weights (no
    # dim of them divides by 7); the message used to blame the batch for both
    step, params, opt, batch = abstract_setup((32, 10), 12, 8)
    with pytest.raises(ValueError) as e:
        jaxwap.plan(step, params, opt, batch, hardware=jaxwap.Cluster("cpu", 8),
                    num_devices=7, verify=0, cache=False)
    msg = str(e.value)
    assert msg.startswith("no mesh of exactly 7 devices can run batch size 12: "), msg
    assert "1x7: no layer weight has a dim divisible by model=7" in msg
    assert "7x1: batch 12 is not divisible by data=7" in msg


def test_a_key_among_the_params_names_it_and_points_to_params():
    # an NNX model's whole state holds its RNG streams beside its parameters
    state = {"w": jnp.ones((4, 4)), "rngs": {"key": jax.random.key(0)}}

    def step(state, x):
        return {**state, "w": state["w"] - 0.1 * (x @ state["w"])}, x.sum()

    with pytest.raises(TypeError, match=re.escape("params['rngs']['key']: a PRNG key is not "
                                                  "a parameter") + ".*params="):
        jaxwap.plan(step, state, jnp.ones((8, 4)), verify=0, cache=False)
