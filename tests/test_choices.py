"""The planner's choices follow from the model: small work wants few devices, large work
many; the objective moves the choice where time and energy disagree. These test the
analytic search (`verify=0`); verification is tested in test_verify.py."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from models import abstract_setup

import jaxwap
from jaxwap.cost.collectives import all_gather, all_reduce

analytic_plan = functools.partial(jaxwap.plan, verify=0, cache=False)

# Fast devices joined by slow links (PCIe-class, high latency).
FAST_SLOW = jaxwap.Cluster("h100-sxm", 8, link_bandwidth=10e9, link_latency=30e-6)


def test_tiny_workload_gets_fewer_devices_than_a_large_one():
    tiny = analytic_plan(*abstract_setup((32, 10), 8, 16), hardware=FAST_SLOW,
                       objective="throughput")
    # same small weights, a huge batch: compute per gradient byte is what pays for links
    large = analytic_plan(*abstract_setup((512, 512, 10), 262144, 512),
                        hardware=FAST_SLOW, objective="throughput")
    assert tiny.num_devices == 1
    assert large.num_devices >= 4
    assert large.mesh_shape["data"] == large.num_devices


def test_objective_changes_the_choice_where_the_model_says_so():
    args = abstract_setup((512, 512, 10), 262144, 512)
    plans = {o: analytic_plan(*args, hardware=FAST_SLOW, objective=o)
             for o in ("throughput", "energy", "balanced")}
    # the model's own numbers: the fastest candidate and the least-energy candidate
    cands = plans["throughput"].candidates
    fastest = min(cands, key=lambda c: c.predicted.step_time_s)
    frugal = min(cands, key=lambda c: c.predicted.energy_per_step_j)
    assert fastest.mesh_shape != frugal.mesh_shape, "pick a workload where they differ"
    assert plans["throughput"].num_devices == fastest.num_devices
    assert plans["energy"].num_devices == frugal.num_devices
    assert plans["energy"].num_devices < plans["throughput"].num_devices
    assert (plans["energy"].predicted.energy_per_step_j
            <= plans["throughput"].predicted.energy_per_step_j)
    # max_slowdown lies between: least energy among those within 5% of the fastest (its
    # candidates include power-limited points, which only a limit slows)
    slow = analytic_plan(*args, hardware=FAST_SLOW, objective=jaxwap.Objective(max_slowdown=0.05))
    assert slow.predicted.step_time_s <= fastest.predicted.step_time_s * 1.05 * (1 + 1e-9)
    allowed = [c for c in slow.candidates if c.predicted.step_time_s
               <= fastest.predicted.step_time_s * 1.05 * (1 + 1e-9) and c.fits]
    assert slow.predicted.energy_per_step_j == pytest.approx(
        min(c.predicted.energy_per_step_j for c in allowed))


def test_slower_links_mean_fewer_or_equal_devices():
    args = abstract_setup((1024, 1024, 1000), 256, 1024)
    nvlink = analytic_plan(*args, hardware=jaxwap.Cluster("h100-sxm", 8), objective="balanced")
    pcie = analytic_plan(*args, hardware=jaxwap.Cluster("h100-sxm", 8, link_bandwidth=2e9,
                                                        link_latency=50e-6),
                       objective="balanced")
    assert pcie.num_devices <= nvlink.num_devices
    assert pcie.predicted.step_time_s >= nvlink.predicted.step_time_s


def test_memory_pressure_shards_parameters_and_every_plan_fits_by_the_model():
    """The analytic search's own consistency: under a budget its chosen plan is within it
    and every candidate over it is refused, by the predicted peak. Not a fit oracle: the
    plan offloads optimizer state, which XLA:CPU cannot place in host memory, so its
    compiled bytes here would count the offloaded state on the device. That plans fit by
    XLA's own analysis is test_memory's test_every_plan_returned_under_shrinking_budgets_
    fits_by_xla and test_verify's."""
    args = abstract_setup((2048, 2048, 1000), 64, 1024)
    roomy = analytic_plan(*args, hardware=FAST_SLOW, objective="energy")
    assert roomy.num_devices == 1
    # a third: more than one device's worth even with its optimizer state in host memory
    budget = roomy.predicted.peak_memory_bytes * 0.3
    tight = analytic_plan(*args, hardware=FAST_SLOW, objective="energy", memory_budget=budget)
    assert tight.predicted.peak_memory_bytes <= budget
    assert tight.num_devices > 1
    assert any(p.strategy != "replicate" for p in tight.params)
    over = [c for c in tight.candidates if c.predicted.peak_memory_bytes > budget]
    assert over and all(not c.fits and not c.chosen for c in over)


def test_ring_formulas():
    c = jaxwap.Cluster("h100-sxm", 8, link_bandwidth=1e9, link_latency=0.0)
    t, sent = all_reduce(8e9, 8, c)
    assert sent == pytest.approx(2 * 7 / 8 * 8e9) and t == pytest.approx(14.0)
    t, sent = all_gather(8e9, 8, c)
    assert sent == pytest.approx(7 / 8 * 8e9) and t == pytest.approx(7.0)
    assert all_reduce(1e6, 1, c) == (0.0, 0.0)


def test_predicted_compute_follows_the_jaxpr_flops():
    step, params, opt, batch = abstract_setup((256, 10), 128, 64)
    plan = analytic_plan(step, params, opt, batch, hardware=FAST_SLOW, num_devices=1)
    # forward + two backward matmuls per Dense layer (the first layer needs no dx)
    fwd = 2 * 128 * (64 * 256 + 256 * 10)
    expected = fwd + 2 * 128 * 64 * 256 + 2 * (2 * 128 * 256 * 10)
    assert plan.predicted.flops_per_device >= expected
    assert plan.predicted.flops_per_device < expected * 1.2


def test_convolution_flops_are_counted():
    import optax
    from models import CNN, make_step

    model, tx = CNN(), optax.sgd(0.1)
    x = jax.ShapeDtypeStruct((8, 16, 16, 3), jnp.float32)
    params = jax.eval_shape(model.init, jax.random.key(0), x)
    batch = {"x": x, "y": jax.ShapeDtypeStruct((8,), jnp.int32)}
    plan = analytic_plan(make_step(model, tx), params, jax.eval_shape(tx.init, params), batch,
                       hardware=FAST_SLOW, num_devices=1)
    # the first conv alone: 2 * 8 images * 16*16 positions * 3*3*3 taps * 16 channels, fwd
    conv1_fwd = 2 * 8 * 16 * 16 * 27 * 16
    assert plan.predicted.flops_per_device > 3 * conv1_fwd
