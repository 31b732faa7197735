"""The public surface and the one options record: every entry point takes the same
options, checks them once, and keys the plan cache on all of them."""

from __future__ import annotations

import dataclasses

import jax
import pytest
from models import abstract_setup

import jaxwap

PUBLIC = {
    "AutoShardedStep", "Calibration", "Candidate", "Cluster", "DeviceSpec", "EnergyMeter",
    "EnergyReading", "Measurement", "Objective", "ParamPlacement", "Plan", "PlanCache",
    "PlanOptions", "Prediction", "StepVariant", "Strategy", "TrainStep", "__version__",
    "auto_shard", "builtin_device_names", "calibrate", "device_spec", "load_calibration",
    "make_train_step", "measure_energy", "plan",
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
                 measure=0, offload=False)
    assert set(every) == {f.name for f in dataclasses.fields(jaxwap.PlanOptions)}
    plan = jaxwap.plan(step, params, opt, batch, **every)
    assert plan.num_devices == 2 and plan.objective.kind == "throughput"
    wrapped = jaxwap.auto_shard(step, params, **every)
    assert wrapped.options == jaxwap.PlanOptions(**every)
    # a record and keywords together: the keywords replace the record's fields
    rec = jaxwap.PlanOptions(**every)
    assert jaxwap.plan(step, params, opt, batch, options=rec, num_devices=1).num_devices == 1


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
                   dict(num_devices=2)):
        jaxwap.plan(step, params, opt, batch, **base, **change)
    assert len(list(tmp_path.glob("*.json"))) == 5
    jaxwap.plan(step, params, opt, batch, **base)  # the same question: read back
    assert len(list(tmp_path.glob("*.json"))) == 5
