"""Checkpoints that survive a change of plan: save under one plan with orbax, restore
straight onto another plan's shardings through `AutoShardedStep.abstract_state`, train on.

Layouts are forced through the public knobs (`mesh_shape=`, `strategies=`) and each test
asserts the plan really is that layout before trusting anything else. Plans are analytic
(`verify=0`): each plan compiles one program, its own step. The model is a tiny MLP whose
widths (16, 32, 32, 8) divide by 2, 4 and 8, so every forced layout splits every weight.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import PartitionSpec as P
from models import copy_tree

import jaxwap

# float32: the resumed run reduces in another order (another mesh) than the uninterrupted
# one, so the two agree to rounding, not bit for bit; the restore itself is exact.
RTOL, ATOL = 2e-5, 2e-6
WIDTHS = (16, 32, 32, 8)
BATCH = 16

# The plans, forced through the public options; the checks below assert each is what it
# says. "fsdp-4" uses 4 of the 8 devices: a job resumed on a smaller slice.
PLANS = {
    "tp-2x4": {"mesh_shape": {"data": 2, "model": 4}, "strategies": ("tp",)},
    "zero1-8": {"mesh_shape": {"data": 8}, "strategies": ("zero1",)},
    "fsdp-4": {"mesh_shape": {"data": 4}, "strategies": ("fsdp",)},
}


def loss_fn(params, batch):
    """Mean squared error of a relu MLP written in plain jax (no Flax: nothing to init)."""
    x = batch["x"]
    names = sorted(params)
    for name in names[:-1]:
        x = jax.nn.relu(x @ params[name]["kernel"] + params[name]["bias"])
    out = x @ params[names[-1]]["kernel"] + params[names[-1]]["bias"]
    return jnp.mean((out - batch["y"]) ** 2)


STEP = jaxwap.make_train_step(loss_fn, optax.adam(1e-2))


def setup(seed=0):
    """(params, opt_state, batch) on the default device: N(0, 1/fan_in) kernels, small
    random biases (not zeros, so no bias starts with the same value on every unit)."""
    rng = np.random.default_rng(seed)
    params = {f"layer{i}": {
        "kernel": jnp.asarray(rng.standard_normal((n, m), np.float32) / np.sqrt(n)),
        "bias": jnp.asarray(rng.standard_normal(m, np.float32) * 0.1)}
        for i, (n, m) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:], strict=True))}
    batch = {"x": jnp.asarray(rng.standard_normal((BATCH, WIDTHS[0]), np.float32)),
             "y": jnp.asarray(rng.standard_normal((BATCH, WIDTHS[-1]), np.float32))}
    return params, STEP.init(params), batch


def sharded(name):
    return jaxwap.auto_shard(STEP, cache=False, verify=0, **PLANS[name])


def abstract(tree):
    """Shapes and dtypes only, as a job that resumes knows them before it has any data."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def assert_is_forced_plan(name, plan):
    """The plan is the layout `PLANS[name]` forces, not whatever the planner preferred."""
    placements = plan.params
    assert len(placements) == 2 * (len(WIDTHS) - 1)
    if name == "tp-2x4":
        assert dict(plan.mesh_shape) == {"data": 2, "model": 4}
        kernels = [p for p in placements if p.path[-1] == "kernel"]
        assert {p.strategy for p in kernels} <= {"tp-col", "tp-row"}, kernels
        assert all("model" in p.spec for p in kernels), kernels
        assert all(p.state_spec is None for p in placements)   # state follows the weight
    elif name == "zero1-8":
        assert dict(plan.mesh_shape) == {"data": 8, "model": 1}
        for p in placements:   # weights whole on every device, Adam moments split over 8
            assert p.strategy == "zero1" and not p.offload, p
            assert all(a is None for a in p.spec) and "data" in p.state_spec, p
    elif name == "fsdp-4":
        assert dict(plan.mesh_shape) == {"data": 4, "model": 1}
        for p in placements:
            assert p.strategy == "fsdp" and "data" in p.spec, p
    else:
        raise AssertionError(f"no check for plan {name}")
    assert len(plan.device_ids) == int(np.prod(list(plan.mesh_shape.values())))


def by_key(tree):
    return {jax.tree_util.keystr(p): leaf
            for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def expected_specs(plan, state):
    """{keystr: spec} of a {"params", "opt_state"} tree under `plan`, from the plan record
    alone: a weight takes its `spec`, an Adam moment its `layout_of_state`, the step count
    is replicated. Independent of the code that computes shardings for `abstract_state`."""
    where = {p.keystr: p for p in plan.params}
    out = {}
    for key in by_key(state):
        if key.startswith("['params']"):
            out[key] = where[key.removeprefix("['params']")].spec
        elif moment := re.search(r"\.(mu|nu)(\[.*)$", key):
            out[key] = where[moment.group(2)].layout_of_state
        else:
            out[key] = ()
    return out


def padded(spec, ndim):
    return tuple(spec) + (None,) * (ndim - len(tuple(spec)))


def assert_on_plan(state, plan):
    """Every leaf lies on the plan's mesh (its devices, in its order), as the plan says."""
    want = expected_specs(plan, state)
    ids = list(plan.device_ids)
    for key, leaf in by_key(state).items():
        sh = leaf.sharding
        assert padded(sh.spec, leaf.ndim) == padded(want[key], leaf.ndim), (key, sh.spec)
        assert [d.id for d in sh.mesh.devices.flat] == ids, key
        assert sh.memory_kind == "device", key


def assert_close(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(
        np.asarray(x), np.asarray(y), rtol=RTOL, atol=ATOL), a, b)


# ------------------------------------------------------------------ save, re-plan, resume
@pytest.mark.parametrize("plan_a,plan_b", [("tp-2x4", "zero1-8"), ("zero1-8", "fsdp-4")])
def test_checkpoint_restores_exactly_onto_another_plan_and_training_continues_identically(
        tmp_path, plan_a, plan_b):
    params, opt_state, batch = setup()
    path = tmp_path / "step2"

    # plan A: 2 steps, save, then 2 more: the uninterrupted run
    step_a = sharded(plan_a)
    p, o = copy_tree(params), copy_tree(opt_state)      # auto_shard donates its state
    for _ in range(2):
        p, o, _ = step_a(p, o, batch)
    assert_is_forced_plan(plan_a, step_a.plan)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, {"params": p, "opt_state": o})
    checkpointer.wait_until_finished()                  # before step A donates p and o
    saved = jax.tree.map(np.asarray, {"params": p, "opt_state": o})
    for _ in range(2):
        p, o, _ = step_a(p, o, batch)
    uninterrupted = {"params": p, "opt_state": o}

    # plan B, made from shapes alone; the checkpoint restored straight onto its layout
    step_b = sharded(plan_b)
    shapes = abstract((params, opt_state))
    step_b.plan_for(*shapes, abstract(batch))
    assert_is_forced_plan(plan_b, step_b.plan)
    assert step_b.plan.mesh_shape != step_a.plan.mesh_shape
    target_p, target_o = step_b.abstract_state(*shapes)
    restored = checkpointer.restore(path, {"params": target_p, "opt_state": target_o})

    assert jax.tree.structure(restored) == jax.tree.structure(saved)
    jax.tree.map(np.testing.assert_array_equal, restored, saved)   # bit for bit
    assert_on_plan(restored, step_b.plan)
    # and on exactly the shardings plan B's compiled step returns its state on, so the
    # restored state enters the step with no resharding
    restored_shardings = jax.tree.map(lambda a: a.sharding, restored)
    p, o = restored["params"], restored["opt_state"]
    for _ in range(2):
        p, o, _ = step_b(p, o, batch)
    resumed = {"params": p, "opt_state": o}
    jax.tree.map(lambda s, a: np.testing.assert_equal(s.is_equivalent_to(a.sharding, a.ndim),
                                                      True), restored_shardings, resumed)
    assert_close(uninterrupted, resumed)


# ------------------------------------------------------------------ abstract_state itself
def test_abstract_state_gives_the_layouts_shard_places_on_without_allocating():
    params, opt_state, batch = setup()
    step = sharded("zero1-8")
    step.plan_for(params, opt_state, batch)
    assert_is_forced_plan("zero1-8", step.plan)

    live = len(jax.live_arrays())
    from_shapes = step.abstract_state(abstract(params), abstract(opt_state))
    assert len(jax.live_arrays()) == live                 # nothing was allocated
    from_arrays = step.abstract_state(params, opt_state)
    assert from_shapes == from_arrays                     # shape, dtype and sharding each
    for leaf, given in zip(jax.tree.leaves(from_shapes), jax.tree.leaves((params, opt_state)),
                           strict=True):
        assert type(leaf) is jax.ShapeDtypeStruct
        assert (leaf.shape, leaf.dtype) == (given.shape, given.dtype)

    # the very layouts `shard` places data on, tree for tree (one tree in, one tree out)
    placed = step.shard(copy_tree(params), copy_tree(opt_state))
    jax.tree.map(lambda t, a: np.testing.assert_equal(t.sharding.is_equivalent_to(
        a.sharding, a.ndim), True), from_shapes, placed)
    assert step.abstract_state(params) == from_shapes[0]
    # ZeRO-1: weights replicated, moments over the data axis; by the plan record
    assert_on_plan({"params": step.shard(copy_tree(params)),
                    "opt_state": placed[1]}, step.plan)
    assert from_shapes[1][0].mu["layer1"]["kernel"].sharding.spec == P("data", None)


def test_abstract_state_before_any_plan_raises_naming_the_missing_plan():
    params, opt_state, _ = setup()
    step = sharded("tp-2x4")
    with pytest.raises(RuntimeError, match=r"step\.abstract_state needs the step's plan, "
                                           r"and there is no plan yet.*plan_for"):
        step.abstract_state(params, opt_state)
    with pytest.raises(RuntimeError, match=r"step\.shard needs the step's plan"):
        step.shard(params)


def test_abstract_state_of_no_tree_is_an_error():
    params, opt_state, batch = setup()
    step = sharded("tp-2x4")
    step.plan_for(*abstract((params, opt_state, batch)))
    with pytest.raises(TypeError, match="one or more pytrees, got none"):
        step.abstract_state()
