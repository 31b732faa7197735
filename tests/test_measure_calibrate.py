"""Calibration (cached, re-used, and used by hardware=None planning) and measured choice
(the measured-best finalist wins, whatever the model said)."""

from __future__ import annotations

import importlib

import jax
import numpy as np
import pytest
from models import MLP, copy_tree, setup

import jaxwap
import jaxwap.measure
from jaxwap.calibrate import calibrate_full, calibration_path
from jaxwap.hardware import detect_cluster


def test_calibration_is_measured_cached_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXWAP_CACHE_DIR", str(tmp_path))
    cal = calibrate_full(quick=True, progress=False)
    s = cal.spec
    assert s.peak_flops > 0 and s.peak_flops_f32 > 0 and s.memory_bandwidth > 0
    assert s.kernel_overhead_s > 0 and s.efficiency_half_flops > 0
    assert cal.measurements["matmul_f32"]["seconds"] and cal.num_devices == len(jax.devices())
    assert cal.measurements["link"] is not None  # 8 devices: an all-reduce was timed
    assert any("power not measured" in n for n in cal.notes)  # CPU: no NVML, said so
    assert calibration_path(jax.devices()[0]).exists()

    def boom(*a, **k):
        raise AssertionError("a cached calibration must not be measured again")

    monkeypatch.setattr(importlib.import_module("jaxwap.calibrate"), "_matmul_curve", boom)
    assert jaxwap.calibrate(progress=False) == s
    # hardware=None plans with the calibrated profile (scaled to the host's devices)
    cluster, note = detect_cluster(jax.devices())
    assert cluster.device.name.startswith("calibrated") and "calibrated" in note
    # a corrupt file is ignored, not trusted
    calibration_path(jax.devices()[0]).write_text("{not json")
    assert jaxwap.load_calibration(jax.devices()[0]) is None


def test_measured_choice_picks_the_measured_best(monkeypatch):
    step, params, opt, batch = setup(MLP((128, 128, 10)), (32, 16))
    seen = []

    def fake_measure(run, devices, steps, modeled_power_w):
        run()  # the finalist really runs
        n = len(devices)
        seen.append(n)
        # the measurement says: the 2-device layout is by far the best
        t = 0.001 if n == 2 else 0.01
        return jaxwap.Measurement(t, 0.5 * t * n, "modeled", steps, "faked in the test")

    monkeypatch.setattr(jaxwap.measure, "measure_step", fake_measure)
    sharded = jaxwap.auto_shard(step, params, hardware=jaxwap.Cluster("h100-sxm", 8),
                                measure=2, cache=False)
    ref = jax.jit(step)(copy_tree(params), copy_tree(opt), batch)[0]
    out = sharded(copy_tree(params), copy_tree(opt), batch)[0]
    assert 2 in seen and len(seen) >= 2
    assert sharded.plan.num_devices == 2
    assert sharded.plan.measured is not None and sharded.plan.measured.step_time_s == 0.001
    measured = [c for c in sharded.plan.candidates if c.measured is not None]
    assert len(measured) == len(seen)
    assert [c for c in measured if c.chosen][0].num_devices == 2
    assert jaxwap.Plan.from_json(sharded.plan.to_json()) == sharded.plan
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6), ref, out)
    # later calls reuse the measured plan
    sharded(copy_tree(params), copy_tree(opt), batch)
    assert len(seen) == len(measured)


def test_measure_argument_is_checked():
    with pytest.raises(ValueError, match="measure"):
        jaxwap.auto_shard(lambda p: p, measure=-1)
