"""Calibration (cached, re-used, and used by hardware=None planning) and measured choice
(the measured-best finalist wins, whatever the model said)."""

from __future__ import annotations

import importlib

import jax
import numpy as np
import pytest
from models import MLP, collectives_reproduced, copy_tree, setup

import jaxwap
import jaxwap.decide.measure
from jaxwap.calibration.calibrate import calibrate_full
from jaxwap.calibration.store import calibration_path
from jaxwap.planning.devices import resolve_cluster


def test_calibration_is_measured_cached_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXWAP_CACHE_DIR", str(tmp_path))
    cal = calibrate_full(quick=True, progress=False)
    s = cal.spec
    assert s.peak_flops > 0 and s.peak_flops_f32 > 0 and s.memory_bandwidth > 0
    assert s.kernel_overhead_s > 0 and s.efficiency_half_flops > 0
    # convolutions timed apart: their share of the matmul rate, and (XLA:CPU) the generic
    # loop a window larger than its input takes, well below it. Their range is not asserted:
    # (0, 1] is the probes' clamp and DeviceSpec's own check, so asserting it here could
    # not fail; what these figures are worth is held to measured steps in benchmarks/accuracy
    assert s.conv_efficiency is not None
    # a first layer over RGB (3 input channels) timed apart, on a CPU as on accelerators
    assert s.narrow_conv_efficiency is not None
    assert s.small_input_conv_flops is None or 0 < s.small_input_conv_flops < s.peak_flops_f32
    # the per-width rates back the median; each convolution's fixed cost; the fresh
    # memory table at the quick sizes either side of glibc's 32 MiB mapping threshold
    if s.small_input_conv_flops is not None:
        assert all(0 < r < s.peak_flops_f32 for _, r in s.small_input_conv_rates)
    assert s.conv_overhead_s >= 0
    # the matmul curve of dense layers in training forms, one point per size timed, each
    # efficiency at increasing times (in (0, 1] by the record's own check, not asserted);
    # tanh timed per element (0 where it is no slower than its memory)
    dense = cal.measurements["dense_layer_matmul_flops_s"]
    assert len(s.matmul_efficiency) == len(dense) >= 2
    assert [w for w, _ in dense] == sorted(w for w, _ in dense)
    assert s.transcendental_s >= 0
    assert len(s.reduction_cost) == 6 and all(c >= 0 for _, c in s.reduction_cost)
    assert [n for n, _ in s.fresh_memory_cost] == [2**24, 2**26]
    assert all(c >= 0 for _, c in s.fresh_memory_cost)
    assert cal.measurements["link_buffer_latency_s"] >= 0
    # the host's call of a step on one device and on all 8: each array costs something
    assert [d for d, _, _ in s.call_cost] == [1, 8]
    assert all(a >= 0 and c > 0 for _, a, c in s.call_cost)
    assert cal.measurements["call_cost"] == s.call_cost
    assert 0 < s.python_call_s == cal.measurements["python_call_s"]
    assert cal.measurements["matmul_f32"]["seconds"] and cal.num_devices == len(jax.devices())
    assert cal.measurements["link"] is not None  # 8 devices: an all-reduce was timed
    collectives_reproduced(cal)
    assert any("power not measured" in n for n in cal.notes)  # CPU: no NVML, said so
    assert calibration_path(jax.devices()[0]).exists()

    def boom(*a, **k):
        raise AssertionError("a cached calibration must not be measured again")

    monkeypatch.setattr(importlib.import_module("jaxwap.calibration.probes"), "matmul_curve", boom)
    assert jaxwap.calibrate(progress=False) == s
    # hardware=None plans with the calibrated profile (scaled to the host's devices)
    cluster, note = resolve_cluster(None, jax.devices())
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

    monkeypatch.setattr(jaxwap.decide.measure, "measure_step", fake_measure)
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


def _fake_measure(calls):
    """A stand-in for measure_step that runs the finalist once and calls the 2-device
    candidates fastest (so the choice is known), counting its calls."""
    def fake(run, devices, steps, modeled_power_w):
        run()
        calls.append(len(devices))
        t = 0.001 if len(devices) == 2 else 0.01
        return jaxwap.Measurement(t, 0.5 * t * len(devices), "modeled", steps, "faked")
    return fake


def test_measured_micro_batched_plan_runs_micro_batched(monkeypatch):
    """A plan restructured into micro-batches and then chosen on measurements compiles the
    micro-batched step it reports (the measured re-choice used to drop it)."""
    import re

    from test_memory import close, cnn_problem, run

    step, params, opt, batch = cnn_problem(batch=32, size=16)
    plain = jax.jit(step).lower(params, opt, batch).compile().memory_analysis()
    need = plain.argument_size_in_bytes + plain.output_size_in_bytes + \
        plain.temp_size_in_bytes - plain.alias_size_in_bytes
    calls = []
    monkeypatch.setattr(jaxwap.decide.measure, "measure_step", _fake_measure(calls))
    sharded = jaxwap.auto_shard(step, params, num_devices=2, memory_budget=0.5 * need,
                                hardware=jaxwap.Cluster("h100-sxm", 8), measure=1, verify=1,
                                cache=False)
    p, o, loss = sharded(copy_tree(params), copy_tree(opt), batch)
    plan = sharded.plan
    assert len(calls) >= 2 and plan.measured is not None  # chosen on measurements
    k = plan.step.micro_batches
    assert k > 1
    hlo = sharded.lower_and_compile(params, opt, batch).as_text()
    trips = [int(n) for n in re.findall(r"known_trip_count\W+n\W+(\d+)", hlo)]
    assert k in trips  # the step that runs is the micro-batched one
    close(run(step, params, opt, batch, n=1), (p, o, loss), rtol=1e-4, atol=1e-5)


def test_measured_choice_is_what_the_cache_keeps(monkeypatch, tmp_path):
    """measure= is part of the plan cache's key and the cache keeps the measured choice:
    a second run reads it back instead of silently skipping the measurement."""
    step, params, opt, batch = setup(MLP((128, 128, 10)), (32, 16))
    calls = []
    monkeypatch.setattr(jaxwap.decide.measure, "measure_step", _fake_measure(calls))
    kw = dict(hardware=jaxwap.Cluster("h100-sxm", 8), cache=jaxwap.PlanCache(tmp_path),
              verify=1)
    first = jaxwap.auto_shard(step, params, measure=2, **kw)
    first(copy_tree(params), copy_tree(opt), batch)
    measured_calls = len(calls)
    assert measured_calls >= 2 and first.plan.measured is not None
    second = jaxwap.auto_shard(step, params, measure=2, **kw)
    second(copy_tree(params), copy_tree(opt), batch)
    assert len(calls) == measured_calls  # read back, not measured again
    assert second.plan == first.plan and second.plan.measured == first.plan.measured
    assert second.plan.num_devices == 2
    # without measure= the key differs: the analytic/verified plan, not the measured one
    unmeasured = jaxwap.plan(step, params, opt, batch, **kw)
    assert unmeasured.measured is None
    assert len(list(tmp_path.glob("*.json"))) == 2
