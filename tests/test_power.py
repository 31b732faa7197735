"""The power model and the power limit as a planned decision.

Phases draw their own power, a limit slows the compute-bound phase by the clock it
allows and holds every phase's power to it; the planner weighs (layout, limit) pairs
together, "throughput" never caps, and `power_limit="apply"` sets the limit and always
puts the previous one back (a fake NVML stands in for the driver).
"""

from __future__ import annotations

import gc
import math

import jax
import numpy as np
import pytest

import jaxwap
from jaxwap import Cluster
from jaxwap.hardware.builtin_profiles import device_spec
from jaxwap.hardware.device import DeviceSpec
from jaxwap.hardware.power_model import (
    H100_SXM,
    VOLTAGE_KNEE,
    PhaseTimes,
    PowerProfile,
    step_energy,
)
from jaxwap.runtime.step_call import StepCall
from tests.models import MLP, abstract_setup, setup
from tests.test_power_limit import FakeGpu, FakeNVML

H100 = device_spec("h100-sxm")


class HopperNVML(FakeNVML):
    """The fake driver with an H100's limits: 200-700 W, 700 W by default."""

    def __init__(self, n: int = 8, **kw) -> None:
        super().__init__(n, start_mw=700_000, **kw)

    def nvmlDeviceGetPowerManagementLimitConstraints(self, h: int) -> tuple[int, int]:
        return 200_000, 700_000

    def nvmlDeviceGetPowerManagementDefaultLimit(self, h: int) -> int:
        return 700_000


IDLE = H100.idle_watts
ARGS = abstract_setup((4096, 4096, 4096, 10), 512, 4096)


def plan(objective, **kw):
    return jaxwap.plan(*ARGS, hardware=Cluster("h100-sxm", 8), objective=objective,
                       cache=False, verify=0, **kw)


@pytest.mark.parametrize("limit", [200.0, 300.0, 450.0, 600.0, None])
def test_power_drawn_under_a_limit_is_at_most_that_limit(limit):
    phases = PhaseTimes(bound=1.0, bound_work=0.9, memory=0.5, side=0.2, idle=0.1)
    got = step_energy(H100_SXM, IDLE, phases, limit)
    seconds = 1.0 + 0.5 + 0.2 + 0.1 + got.extra_time_s
    if limit is not None:
        assert got.energy_j / seconds <= limit * (1 + 1e-9)
    else:
        assert got.extra_time_s == 0.0 and got.clock == 1.0


def test_compute_bound_time_scales_with_the_clock_and_memory_bound_time_does_not():
    compute = PhaseTimes(bound=1.0, bound_work=1.0, memory=0.0, side=0.0, idle=0.0)
    capped = step_energy(H100_SXM, IDLE, compute, 400.0)
    assert 0 < capped.clock < 1
    assert capped.extra_time_s == pytest.approx(1.0 / capped.clock - 1.0)
    # the DVFS model: the power above the busy floor (the waiting power) as the clock's
    # cube, so the clock at 400 W is
    floor = H100_SXM.comm_watts
    assert capped.clock == pytest.approx(((400 - floor) / (700 - floor)) ** (1 / 3))
    # below the voltage floor's knee dynamic power falls only linearly with the clock:
    # a deep cap costs more clock than the cube law says
    share = (250 - floor) / (700 - floor)
    assert share < VOLTAGE_KNEE ** 3
    deep = step_energy(H100_SXM, IDLE, compute, 250.0).clock
    assert deep == pytest.approx(share / VOLTAGE_KNEE ** 2)
    assert deep < share ** (1 / 3)
    # a cap above what memory-bound work draws costs it nothing
    memory = PhaseTimes(bound=0.0, bound_work=0.0, memory=1.0, side=0.0, idle=0.0)
    assert step_energy(H100_SXM, IDLE, memory, 400.0).extra_time_s == 0.0
    # below it, the phase slows and saves nothing
    low = step_energy(H100_SXM, IDLE, memory, 200.0)
    assert low.extra_time_s == pytest.approx(H100_SXM.memory_watts / 200.0 - 1)
    assert low.energy_j == pytest.approx(step_energy(H100_SXM, IDLE, memory).energy_j)


def test_a_measured_clock_curve_replaces_the_model():
    prof = PowerProfile(700.0, 300.0, 145.0, (200.0, 700.0), 700.0,
                        ((200.0, 0.5), (450.0, 0.8), (700.0, 1.0)))
    assert prof.clock_at(450.0, 700.0, IDLE) == pytest.approx(0.8)
    assert prof.clock_at(325.0, 700.0, IDLE) == pytest.approx(0.65)
    assert prof.clock_at(800.0, 700.0, IDLE) == 1.0
    with pytest.raises(ValueError, match="clock_curve"):
        PowerProfile(700.0, 300.0, 145.0, clock_curve=((300.0, 0.9), (200.0, 0.5)))
    with pytest.raises(ValueError, match="outside h100's accepted range 200-700 W"):
        H100_SXM.check_limit(150.0, "h100")


def test_device_spec_with_a_power_profile_survives_json():
    import json

    back = DeviceSpec.from_dict(json.loads(json.dumps(H100.to_dict())))
    assert back == H100 and back.power == H100_SXM


def test_throughput_never_caps():
    p = plan("throughput")
    assert p.power_limit_w is None
    assert all(c.power_limit_w is None for c in p.candidates)
    assert "throughput, which never caps" in p.explain()


def test_energy_objective_chooses_the_least_energy_point_capped_or_not():
    p = plan("energy")
    assert p.power_limit_w is not None
    lo, hi = H100_SXM.limit_range_w
    assert lo <= p.power_limit_w < hi
    assert p.predicted.power_limit_w == p.power_limit_w
    chosen = next(c for c in p.candidates if c.chosen)
    # no candidate at the board default uses less energy, and capping saved some
    assert all(p.predicted.energy_per_step_j <= c.predicted.energy_per_step_j
               for c in p.candidates if c.fits)
    base = p.candidates[chosen.of]
    assert base.power_limit_w is None and base.mesh_shape == chosen.mesh_shape
    assert p.predicted.energy_per_step_j < base.predicted.energy_per_step_j
    assert p.predicted.step_time_s >= base.predicted.step_time_s
    text = p.explain()
    assert f"{p.power_limit_w:.0f} W per device, recommended" in text
    assert "less energy per step" in text
    back = jaxwap.Plan.from_json(p.to_json())
    assert back.power_limit_w == p.power_limit_w and back == p


def test_max_slowdown_may_cap_but_stays_within_the_slowdown():
    fastest = plan("throughput").predicted.step_time_s
    p = plan(jaxwap.Objective(max_slowdown=0.05))
    assert p.predicted.step_time_s <= fastest * 1.05 * (1 + 1e-9)
    inside = [c for c in p.candidates
              if c.fits and c.predicted.step_time_s <= fastest * 1.05 * (1 + 1e-9)]
    assert p.predicted.energy_per_step_j == pytest.approx(
        min(c.predicted.energy_per_step_j for c in inside))


def test_the_frontier_includes_power_limited_points():
    front = plan("balanced").frontier()
    assert any(c.power_limit_w is not None for c in front)
    times = [c.judged.step_time_s for c in front]
    energies = [c.judged.energy_per_step_j for c in front]
    assert times == sorted(times) and energies == sorted(energies, reverse=True)


def test_a_device_without_limits_is_planned_uncapped():
    p = jaxwap.plan(*ARGS, hardware=Cluster("v100-sxm2", 4), objective="energy",
                    cache=False, verify=0)
    assert p.power_limit_w is None
    assert "this device accepts no power limit" in p.explain()


def _applied_step(monkeypatch, nvml, mode="apply"):
    """auto_shard planning for 8 H100s (the energy objective picks a cap) and running on
    the CPU devices, its limit guard pointed at a fake NVML and fake GPUs."""
    import jaxwap.api as api
    from jaxwap.energy.power_limit import PowerLimitGuard as real

    monkeypatch.setattr(api, "PowerLimitGuard", lambda devs, watts: real(
        [FakeGpu(i) for i in range(len(devs))], watts, nvml=nvml))
    step, params, opt, batch = setup(MLP((2048, 2048, 10)), (256, 512))
    wrapped = jaxwap.auto_shard(step, params, hardware=Cluster("h100-sxm", 8),
                                objective="energy", power_limit=mode, cache=False, verify=0)
    return wrapped, params, opt, batch


def test_apply_sets_the_chosen_limit_and_close_restores_it(monkeypatch):
    nvml = HopperNVML()
    before = dict(nvml.limits)
    step, params, opt, batch = _applied_step(monkeypatch, nvml)
    params, opt, _ = step(params, opt, batch)
    w = step.plan.power_limit_w
    assert w is not None
    used = step.plan.num_devices
    assert [nvml.limits[i] for i in range(used)] == [round(w * 1000)] * used
    step(params, opt, batch)   # kept, not set again
    assert len(nvml.sets) == used
    step.close()
    assert nvml.limits == before


def test_apply_restores_after_a_step_raises_and_on_garbage_collection(monkeypatch):
    nvml = HopperNVML()
    before = dict(nvml.limits)
    step, params, opt, batch = _applied_step(monkeypatch, nvml)
    params, opt, _ = step(params, opt, batch)
    assert nvml.limits != before
    real = StepCall.__call__
    monkeypatch.setattr(StepCall, "__call__", lambda self, leaves: 1 / 0)  # the step raises
    with pytest.raises(ZeroDivisionError):
        step(params, opt, batch)
    assert nvml.limits == before
    monkeypatch.setattr(StepCall, "__call__", real)
    step(params, opt, batch)
    assert nvml.limits != before
    del step
    gc.collect()
    assert nvml.limits == before


def test_recommend_changes_nothing_and_a_refusal_runs_uncapped(monkeypatch):
    nvml = HopperNVML()
    step, params, opt, batch = _applied_step(monkeypatch, nvml, mode="recommend")
    step(params, opt, batch)
    assert step.plan.power_limit_w is not None and not nvml.sets
    refusing = HopperNVML(refuse=True)
    step, params, opt, batch = _applied_step(monkeypatch, refusing)
    with pytest.warns(RuntimeWarning, match="uncapped"):
        params, opt, _ = step(params, opt, batch)
    params, opt, loss = step(params, opt, batch)   # warned once, runs on
    assert math.isfinite(float(np.asarray(jax.device_get(loss)["loss"]
                                          if isinstance(loss, dict) else loss)))
    assert refusing.limits == HopperNVML().limits


def test_power_limit_option_is_checked():
    with pytest.raises(ValueError, match="power_limit must be one of"):
        jaxwap.PlanOptions(power_limit="max")
