"""The `Plan` record: frozen, JSON round-trips exactly, specs shaped like the params and
dividing their dimensions, a readable explanation, consistent predicted figures; and
planning works from abstract arguments alone."""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import jax
import jax.numpy as jnp
import models
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxwap

H100X8 = jaxwap.Cluster("h100-sxm", 8)


@functools.cache
def abstract_setup(features=(32, 16, 4), in_dim=8, batch=16):
    """(train_step, params, opt_state, batch), all jax.ShapeDtypeStruct: no arrays."""
    return models.abstract_setup(features, batch, in_dim, regression=True)


# name -> (setup kwargs, plan kwargs). "single" is the 1-device balanced choice for a small
# MLP; "data" is data-parallel with FSDP; "tensor" (a batch of 2 under a tight budget) puts
# tensor-parallel weights on a data x model mesh (the analytic choice: XLA's memory figure
# for so tiny a program is dominated by fixed buffers, so verification would undo it). Some
# dims (20, 36) divide by few mesh sizes, so a spec that ignored divisibility would show.
CONFIGS = {
    "single": (dict(), dict()),
    "data": (dict(features=(48, 20, 8), in_dim=12, batch=64), dict(objective="throughput")),
    # 18 kB: a data x model mesh with FSDP and tensor parallelism (at 25 kB, since Adam's
    # moments are counted updated in place, tensor parallelism alone on 1 x 8 fits)
    "tensor": (dict(features=(64, 36, 8), in_dim=64, batch=2),
               dict(objective="throughput", memory_budget=18_000, verify=0)),
}


@functools.cache
def planned(name):
    setup_kw, plan_kw = CONFIGS[name]
    step, params, opt_state, batch = abstract_setup(**setup_kw)
    plan = jaxwap.plan(step, params, opt_state, batch, hardware=H100X8, cache=False, **plan_kw)
    return plan, params, batch["x"].shape[0]


def strict_json(text):
    """json.loads that refuses NaN / Infinity, which are not JSON."""
    def refuse(const):
        raise ValueError(f"non-JSON constant {const}")

    return json.loads(text, parse_constant=refuse)


def without_timing(plan):
    return dataclasses.replace(plan, planning_time_s={})


def is_spec(x):
    return isinstance(x, P)


# --------------------------------------------------------------------------- JSON
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_json_round_trip(name):
    plan, _, _ = planned(name)
    text = plan.to_json()
    d = strict_json(text)
    assert d["mesh_shape"] == plan.mesh_shape
    assert len(d["params"]) == len(plan.params)
    loaded = jaxwap.Plan.from_json(text)
    assert loaded == plan
    # the parts, so a too-lenient __eq__ could not hide a loss
    assert loaded.mesh_shape == plan.mesh_shape
    assert loaded.device_ids == plan.device_ids
    assert loaded.params == plan.params
    assert loaded.candidates == plan.candidates
    assert loaded.predicted == plan.predicted
    assert loaded.hardware == plan.hardware
    assert loaded.objective == plan.objective
    assert loaded.batch_size == plan.batch_size
    assert loaded.param_specs == plan.param_specs
    # stable: serialising the loaded plan gives the same text, compact form too
    assert loaded.to_json() == text
    assert jaxwap.Plan.from_json(plan.to_json(indent=None)) == plan


def test_different_plans_are_not_equal():
    a, _, _ = planned("single")
    b, _, _ = planned("data")
    assert a != b
    assert jaxwap.Plan.from_json(a.to_json()) != b
    assert dataclasses.replace(a, batch_size=a.batch_size + 1) != a


def test_from_dict_rejects_unknown_format():
    plan, _, _ = planned("single")
    d = plan.to_dict()
    d["format"] = 999
    with pytest.raises(ValueError, match="format"):
        jaxwap.Plan.from_dict(d)


# --------------------------------------------------------------------------- specs
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_param_specs_have_params_structure(name):
    plan, params, _ = planned(name)
    specs = plan.param_specs
    assert (jax.tree_util.tree_structure(specs, is_leaf=is_spec)
            == jax.tree_util.tree_structure(params))
    leaves = jax.tree_util.tree_leaves(specs, is_leaf=is_spec)
    assert all(isinstance(s, P) for s in leaves)
    assert leaves == [p.partition_spec for p in plan.params]
    # the placements describe the params' own leaves, in order
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    assert [p.keystr for p in plan.params] == [jax.tree_util.keystr(k) for k, _ in flat]
    assert [p.shape for p in plan.params] == [tuple(v.shape) for _, v in flat]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_param_specs_after_json_are_nested_dict_of_path_tokens(name):
    plan, _, _ = planned(name)
    loaded = jaxwap.Plan.from_json(plan.to_json())
    specs = loaded.param_specs
    assert isinstance(specs, dict)
    for p in plan.params:
        node = specs
        for tok in p.path:
            assert isinstance(node, dict), p.keystr
            node = node[tok]
        assert isinstance(node, P)
        assert node == p.partition_spec
    n = len(jax.tree_util.tree_leaves(specs, is_leaf=is_spec))
    assert n == len(plan.params)


def test_param_specs_of_non_dict_params():
    """Params as a tuple of dicts: before JSON a tuple, after JSON dicts keyed '0', '1'."""
    def init(k, din, dout):
        return {"w": jax.ShapeDtypeStruct((din, dout), jnp.float32),
                "b": jax.ShapeDtypeStruct((dout,), jnp.float32)}

    params = (init(0, 8, 16), init(1, 16, 4))
    tx = optax.sgd(0.1)

    def train_step(params, opt_state, batch):
        def loss_fn(ps):
            h = jax.nn.relu(batch["x"] @ ps[0]["w"] + ps[0]["b"])
            return jnp.mean((h @ ps[1]["w"] + ps[1]["b"] - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss}

    batch = {"x": jax.ShapeDtypeStruct((16, 8), jnp.float32),
             "y": jax.ShapeDtypeStruct((16, 4), jnp.float32)}
    plan = jaxwap.plan(train_step, params, jax.eval_shape(tx.init, params), batch,
                       hardware=H100X8)
    specs = plan.param_specs
    assert isinstance(specs, tuple) and len(specs) == 2
    assert set(specs[1]) == {"w", "b"} and isinstance(specs[1]["w"], P)
    loaded = jaxwap.Plan.from_json(plan.to_json())
    assert loaded == plan
    after = loaded.param_specs
    assert set(after) == {"0", "1"}
    assert after["1"]["w"] == specs[1]["w"]
    assert after["0"]["b"] == specs[0]["b"]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_spec_divides_its_dimension(name):
    plan, _, _ = planned(name)
    mesh = plan.mesh_shape
    assert set(mesh) == {"data", "model"}
    assert math.prod(mesh.values()) == plan.num_devices == len(plan.device_ids)
    for p in plan.params:
        assert len(p.spec) <= len(p.shape), p.keystr
        used = []
        for dim, entry in enumerate(p.spec):
            if entry is None:
                continue
            axes = entry if isinstance(entry, tuple) else (entry,)
            assert all(a in mesh for a in axes), (p.keystr, p.spec)
            used += list(axes)
            size = math.prod(mesh[a] for a in axes)
            assert p.shape[dim] % size == 0, (p.keystr, p.shape, p.spec, mesh)
        assert len(used) == len(set(used)), f"{p.keystr}: an axis used twice in {p.spec}"


def test_configs_exercise_both_mesh_axes():
    """Guard for the divisibility test above: between them the plans shard over both axes
    (if the cost model stops choosing these, pick new configurations)."""
    axes = set()
    for name in CONFIGS:
        plan, _, _ = planned(name)
        for p in plan.params:
            for e in p.spec:
                axes.update(e if isinstance(e, tuple) else (e,))
    assert {"data", "model"} <= axes


# --------------------------------------------------------------------------- explain
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_explain(name):
    plan, _, _ = planned(name)
    text = plan.explain()
    d, m = plan.mesh_shape["data"], plan.mesh_shape["model"]
    assert f"mesh data={d} x model={m}" in text
    for p in plan.params:
        assert p.keystr in text
    assert text.count("CHOSEN") == 1
    # the candidates table: one row per candidate mesh (its axes named), the chosen one
    # first, then each basis's rows under their heading, by score
    section = text.split("candidates (every mesh considered):")[1].split("\n\n")[0]
    rows = [ln for ln in section.splitlines()[3:] if not ln.strip().startswith("--")]
    order = _table_order(plan)
    assert len(rows) == len(order)
    for row, c in zip(rows, order, strict=True):
        assert row.startswith(f"  {c.label}  "), (row, c.label)
    assert "CHOSEN" in rows[0] and all("CHOSEN" not in r for r in rows[1:])
    assert str(plan) == text


def _table_order(plan):
    """The candidates in the order explain() lists them: the chosen one, then by basis
    (measured, XLA, model), by score within a basis."""
    rank = {"measured": 0, "compiled": 1, "predicted": 2}
    rest = sorted((c for c in plan.candidates if not c.chosen),
                  key=lambda c: (rank[c.judged.basis], c.score))
    return [c for c in plan.candidates if c.chosen] + rest


# --------------------------------------------------------------------------- candidates
def test_candidates_include_fewer_devices_than_available():
    plan, _, _ = planned("single")
    counts = [c.num_devices for c in plan.candidates]
    assert max(counts) <= H100X8.num_devices
    assert min(counts) < H100X8.num_devices
    assert 1 in counts and 8 in counts
    meshes = {c.mesh_shape for c in plan.candidates}
    # each mesh once, plus at most the data-parallel baseline as a layout of its own
    assert len({(c.mesh_shape, c.variant) for c in plan.candidates}) == len(plan.candidates)
    assert sum(c.variant == "data-parallel" for c in plan.candidates) <= 1
    assert (("data", 1), ("model", 1)) in meshes
    chosen = [c for c in plan.candidates if c.chosen]
    assert len(chosen) == 1
    assert dict(chosen[0].mesh_shape) == plan.mesh_shape
    assert chosen[0].predicted == plan.predicted
    assert chosen[0].reason == "chosen"
    assert all(c.reason for c in plan.candidates)


def test_forced_device_count_limits_candidates():
    step, params, opt_state, batch = abstract_setup()
    plan = jaxwap.plan(step, params, opt_state, batch, hardware=H100X8, num_devices=4)
    assert plan.num_devices == 4
    assert {c.num_devices for c in plan.candidates} == {4}


# --------------------------------------------------------------------------- frozen
def test_plan_is_frozen():
    plan, _, _ = planned("data")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.mesh_shape = {"data": 1, "model": 1}
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.batch_size = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.params[0].spec = (None,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.predicted.step_time_s = 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.candidates[0].chosen = True
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.hardware.num_devices = 1
    assert isinstance(plan.params, tuple) and isinstance(plan.candidates, tuple)


def test_plan_is_deeply_immutable():
    # regression: mesh_shape and planning_time_s were plain dicts, so hash(plan) raised
    # and plan.mesh_shape["data"] = 99 changed a "frozen" plan
    step, params, opt_state, batch = abstract_setup()
    plan = jaxwap.plan(step, params, opt_state, batch, hardware=H100X8)  # a private copy
    assert hash(plan) == hash(jaxwap.Plan.from_json(plan.to_json()))
    before = dict(plan.mesh_shape)
    with pytest.raises(TypeError):
        plan.mesh_shape["data"] = 99
    with pytest.raises(TypeError):
        plan.planning_time_s["trace"] = 0.0
    assert plan.mesh_shape == before


# --------------------------------------------------------------------------- predicted
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_predicted_figures_are_consistent(name):
    plan, _, batch = planned(name)
    assert plan.batch_size == batch
    for pr in [plan.predicted] + [c.predicted for c in plan.candidates]:
        assert pr.step_time_s > 0 and np.isfinite(pr.step_time_s)
        assert pr.samples_per_s == pytest.approx(batch / pr.step_time_s, rel=1e-9)
        assert pr.energy_per_step_j > 0
        assert pr.energy_per_sample_j == pytest.approx(pr.energy_per_step_j / batch, rel=1e-9)
        assert pr.peak_memory_bytes > 0
        assert 0 <= pr.utilization <= 1
    assert plan.predicted.num_devices == plan.num_devices


# --------------------------------------------------------------------------- abstract
def test_planning_from_abstract_args_matches_concrete():
    step, params, opt_state, batch = abstract_setup()
    rng = np.random.default_rng(0)

    def real(s):
        return jnp.asarray(rng.standard_normal(s.shape).astype(s.dtype))

    concrete = jax.tree_util.tree_map(real, (params, opt_state, batch))
    assert all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(concrete))
    assert not any(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(
        (params, opt_state, batch)))
    for objective in ("balanced", "throughput"):
        # each plans afresh (cache=False): a plan read back from the cache would make the
        # two equal by construction
        from_abstract = jaxwap.plan(step, params, opt_state, batch, hardware=H100X8,
                                    objective=objective, cache=False)
        from_real = jaxwap.plan(step, *concrete, hardware=H100X8, objective=objective,
                                cache=False)
        assert without_timing(from_abstract) == without_timing(from_real)
    # the wrapper's plan_for is the same planner
    wrapped = jaxwap.auto_shard(step, hardware=H100X8, objective="throughput", cache=False)
    assert without_timing(wrapped.plan_for(params, opt_state, batch)) == \
        without_timing(from_abstract)
    assert without_timing(wrapped.plan) == without_timing(from_abstract)


def test_planning_from_eval_shape_of_all_arguments():
    step, params, opt_state, batch = abstract_setup()
    args = jax.eval_shape(lambda *a: a, params, opt_state, batch)
    plan = jaxwap.plan(step, *args, hardware=H100X8, cache=False)
    assert plan == dataclasses.replace(planned("single")[0], planning_time_s=plan.planning_time_s)
    assert set(plan.planning_time_s) >= {"trace", "search"}
    assert all(t >= 0 for t in plan.planning_time_s.values())
