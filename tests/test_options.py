"""The public surface and the one options record: every entry point takes the same
options, checks them once, and keys the plan cache on all of them."""

from __future__ import annotations

import dataclasses

import jax
import pytest
from models import MLP, abstract_setup, copy_tree, setup

import jaxwap

PUBLIC = {
    "AutoShardedStep", "Calibration", "Candidate", "Cluster", "DeviceSpec", "EnergyMeter",
    "HostMemory",
    "EnergyReading", "Measurement", "Objective", "ParamPlacement", "Plan", "PlanCache",
    "PlanOptions", "Prediction", "STRATEGY_FAMILIES", "StepVariant", "Strategy", "TrainStep",
    "__version__",
    "auto_shard", "builtin_device_names", "calibrate", "clear_caches", "device_spec",
    "load_calibration",
    "logical_constraints", "make_train_step", "measure_energy", "plan",
}


def test_public_surface_is_all_and_resolves():
    assert set(jaxwap.__all__) == PUBLIC
    for name in jaxwap.__all__:
        assert getattr(jaxwap, name) is not None


def test_every_option_is_accepted_by_plan_and_auto_shard():
    step, params, opt, batch = abstract_setup((32, 10), 16, 8)
    every = dict(objective="throughput", hardware=jaxwap.Cluster("h100-sxm", 8),
                 devices=jax.devices(), memory_budget=1e9, num_devices=2, verify=0,
                 donate=False, compiler_options={}, cache=False, batch_size=16,
                 measure=0, offload=False, mesh_shape={"data": 2}, strategies=("replicate",),
                 pipeline=False, constraints={".*": "replicate"}, power_limit="recommend")
    # `plan=` replaces planning altogether: tested below and in test_scale.py
    assert set(every) | {"plan"} == {f.name for f in dataclasses.fields(jaxwap.PlanOptions)}
    plan = jaxwap.plan(step, params, opt, batch, **every)
    assert plan.num_devices == 2 and plan.objective.kind == "throughput"
    wrapped = jaxwap.auto_shard(step, params, **every)
    assert wrapped.options == jaxwap.PlanOptions(**every)
    # a record and keywords together: the keywords replace the record's fields
    rec = jaxwap.PlanOptions(**every)
    assert jaxwap.plan(step, params, opt, batch, options=rec, num_devices=1,
                       mesh_shape=None).num_devices == 1


def test_a_given_plan_is_used_as_it_is_by_plan_and_auto_shard(tmp_path):
    step, params, opt, batch = abstract_setup((32, 10), 16, 8)
    made = jaxwap.plan(step, params, opt, batch, verify=0, cache=False,
                       hardware=jaxwap.Cluster("cpu", 8), mesh_shape={"data": 4})
    (tmp_path / "p.json").write_text(made.to_json())
    for given in (made, str(tmp_path / "p.json"), tmp_path / "p.json"):
        again = jaxwap.plan(step, params, opt, batch, plan=given)
        assert again == made and again.mesh_shape == {"data": 4, "model": 1}
    assert jaxwap.auto_shard(step, params, plan=made).plan_for(params, opt, batch) == made
    with pytest.raises(TypeError, match="plan must be"):
        jaxwap.PlanOptions(plan=3)
    with pytest.raises(ValueError, match="cannot be read as a jaxwap plan"):
        jaxwap.PlanOptions(plan=str(tmp_path / "missing.json"))


def test_options_are_checked_once_by_name():
    with pytest.raises(TypeError, match="unknown option.*'verfiy'.*options are.*verify"):
        jaxwap.auto_shard(lambda p: p, verfiy=0)
    with pytest.raises(ValueError, match="verify"):
        jaxwap.PlanOptions(verify=-1)
    with pytest.raises(ValueError, match="memory_budget"):
        jaxwap.PlanOptions(memory_budget=0)
    with pytest.raises(TypeError, match="hardware"):
        jaxwap.PlanOptions(hardware=3)
    with pytest.raises(TypeError, match="cache"):
        jaxwap.PlanOptions(cache="yes")
    assert jaxwap.PlanOptions(measure=True).measure == 5


def test_plan_refuses_a_misspelt_option_the_step_cannot_take_and_passes_its_own():
    step, params, opt, batch = abstract_setup((32, 10), 16, 8)
    with pytest.raises(TypeError, match="'mesh_shap'.*did you mean mesh_shape"):
        jaxwap.plan(step, params, opt, batch, mesh_shap={"data": 4}, verify=0, cache=False)

    def scaled(params, opt_state, batch, *, scale=1.0):   # a keyword of the step's own
        return step(params, opt_state, batch)

    made = jaxwap.plan(scaled, params, opt, batch, scale=2.0, verify=0, cache=False,
                       hardware=jaxwap.Cluster("cpu", 8), mesh_shape={"data": 4})
    assert made.mesh_shape == {"data": 4, "model": 1}


def test_plan_measure_needs_arrays():
    step, params, opt, batch = abstract_setup((32, 10), 16, 8)
    with pytest.raises(ValueError, match="measure"):
        jaxwap.plan(step, params, opt, batch, measure=True, verify=0, cache=False)


def test_every_option_that_can_change_a_plan_is_in_the_cache_key(tmp_path):
    step, params, opt, batch = abstract_setup((32, 10), 16, 8)
    store = jaxwap.PlanCache(tmp_path)
    base = dict(hardware=jaxwap.Cluster("h100-sxm", 8), verify=0, cache=store)
    jaxwap.plan(step, params, opt, batch, **base)
    for change in (dict(donate=False), dict(offload=False), dict(compiler_options={"x": 1}),
                   dict(num_devices=2), dict(mesh_shape={"data": 2, "model": 1}),
                   dict(strategies=("fsdp",))):
        jaxwap.plan(step, params, opt, batch, **base, **change)
    assert len(list(tmp_path.glob("*.json"))) == 7
    jaxwap.plan(step, params, opt, batch, **base)  # the same question: read back
    assert len(list(tmp_path.glob("*.json"))) == 7


def test_mesh_shape_and_strategies_are_checked_by_name():
    with pytest.raises(ValueError, match="mesh_shape has unknown axis.*'pipe'"):
        jaxwap.PlanOptions(mesh_shape={"pipe": 2})
    with pytest.raises(ValueError, match=r"mesh_shape\['model'\] must be >= 1"):
        jaxwap.PlanOptions(mesh_shape={"model": 0})
    with pytest.raises(TypeError, match="mesh_shape must be a dict"):
        jaxwap.PlanOptions(mesh_shape=(2, 4))
    with pytest.raises(ValueError, match="num_devices=4 contradicts mesh_shape"):
        jaxwap.PlanOptions(mesh_shape={"data": 2, "model": 4}, num_devices=4)
    with pytest.raises(ValueError, match=r"unknown name\(s\) \['zero3'\].*choose from"):
        jaxwap.PlanOptions(strategies=("zero3",))
    assert jaxwap.PlanOptions(strategies="fsdp").strategies == ("fsdp",)
    assert jaxwap.PlanOptions(mesh_shape={"model": 4}).mesh == (1, 4)
    step, params, opt, batch = abstract_setup((32, 10), 16, 8)
    with pytest.raises(ValueError, match="needs 16 devices; 8 are usable"):
        jaxwap.plan(step, params, opt, batch, mesh_shape={"data": 4, "model": 4},
                    hardware=jaxwap.Cluster("h100-sxm", 8), verify=0, cache=False)


def test_mesh_shape_fixes_the_mesh_and_strategies_restrict_every_layout():
    step, params, opt, batch = abstract_setup((256, 256, 16), 16, 64)
    base = dict(hardware=jaxwap.Cluster("h100-sxm", 8), verify=0, cache=False)
    plan = jaxwap.plan(step, params, opt, batch, mesh_shape={"data": 4}, **base)
    assert dict(plan.mesh_shape) == {"data": 4, "model": 1}
    assert {c.num_devices for c in plan.candidates} == {4}
    # a model axis the free layouts would leave unused gets the mesh's tensor-parallel one
    tp = jaxwap.plan(step, params, opt, batch, mesh_shape={"data": 2, "model": 4}, **base)
    assert any("model" in pl.spec for pl in tp.params)
    both = jaxwap.plan(step, params, opt, batch, mesh_shape={"data": 2, "model": 4},
                       strategies=("tp",), **base)
    assert dict(both.mesh_shape) == {"data": 2, "model": 4}
    with pytest.raises(ValueError, match="mesh_shape 1x5 cannot be used: no layer weight has "
                                         "a dim divisible by model=5"):
        jaxwap.plan(step, params, opt, batch, mesh_shape={"model": 5}, strategies=("tp",),
                    **base)
    fsdp = jaxwap.plan(step, params, opt, batch, strategies=("fsdp",), num_devices=4, **base)
    # every parameter a data-axis split divides is FSDP, the rest replicated; no other
    # family anywhere, and no mesh without a data axis
    assert {p.strategy for p in fsdp.params} <= {"fsdp", "replicate"}
    assert any(p.strategy == "fsdp" for p in fsdp.params)
    assert all(p.strategy == "fsdp" for p in fsdp.params if p.shape[0] % fsdp.mesh_shape[
        "data"] == 0 or p.shape[-1] % fsdp.mesh_shape["data"] == 0)
    assert fsdp.mesh_shape["data"] > 1
    tp = jaxwap.plan(step, params, opt, batch, strategies=("tp",),
                     mesh_shape={"model": 4}, **base)
    kernels = [p for p in tp.params if len(p.shape) == 2]
    assert {p.strategy for p in kernels} <= {"tp-col", "tp-row"} and kernels


def test_compiler_options_reach_xla_in_verification_and_the_step(tmp_path):
    """`compiler_options=` is handed to XLA's compile, not only recorded: `xla_dump_to`
    makes XLA write the optimized programs where it says (for the finalists verification
    compiles, and for the step the call compiles), and an option XLA does not know is
    refused by XLA, naming it, with the user's arrays intact."""
    step, params, opt, batch = setup(MLP((16, 10)), (16, 8))
    verified = tmp_path / "verify"
    jaxwap.plan(step, params, opt, batch, verify=1, cache=False, num_devices=2,
                compiler_options={"xla_dump_to": str(verified)})
    assert list(verified.glob("*after_optimizations.txt"))

    called = tmp_path / "call"
    sharded = jaxwap.auto_shard(step, params, verify=0, cache=False, num_devices=2,
                                compiler_options={"xla_dump_to": str(called)})
    sharded(copy_tree(params), copy_tree(opt), batch)
    assert list(called.glob("*after_optimizations.txt"))

    p, o = copy_tree(params), copy_tree(opt)
    bad = jaxwap.auto_shard(step, params, verify=0, cache=False, num_devices=2,
                            compiler_options={"xla_no_such_option": True})
    with pytest.raises(Exception, match="xla_no_such_option"):
        bad(p, o, batch)
    assert not any(x.is_deleted() for x in jax.tree.leaves((p, o)))
