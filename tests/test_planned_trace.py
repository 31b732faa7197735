"""The step as the planner traces it (`TrainStep.planned_as`): an unrolled model's alike
repeated blocks each one jitted call (`layer_remat.shared_blocks_loss`), so its value and
gradient are traced one block at a time. It must be the same program: analysed as the
user's own trace is, planned as it is, and never in the way of a plan."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import jaxwap
from benchmarks.models import zoo
from jaxwap.analysis.graph import analyze
from jaxwap.analysis.trace import layout_of


@pytest.fixture(scope="module")
def unrolled():
    """A 6-layer decoder written as a Python loop over its layers, in bfloat16 under
    Adam, with real arrays."""
    w = zoo.llama("llama_tiny", batch_size=8, seq_len=64, scan=False, dtype="bfloat16",
                  layers=6, d_model=64, ffn=256, heads=4, kv_heads=4)
    params, _, batch = w.init(0)
    step = jaxwap.make_train_step(w.step.loss_fn, optax.adam(1e-3))
    return step, params, step.init(params), batch


def _calls(jaxpr):
    return [e for e in jaxpr.eqns if e.primitive.name in ("pjit", "jit")]


def test_the_planner_traces_an_unrolled_step_with_one_jitted_call_per_block(unrolled):
    """The forward pass runs one call per layer, all of one traced function (whose
    derivative jax then traces once)."""
    step, params, opt, batch = unrolled
    assert step.planned_as() is step.planned_as() and step.planned_as() is not step
    planned = jax.make_jaxpr(step.planned_as())(params, opt, batch).jaxpr
    blocks = [e for e in _calls(planned) if len(e.params["jaxpr"].jaxpr.eqns) > 20]
    assert len(blocks) >= 2 * 6            # each layer's forward and backward call
    forward = {id(e.params["jaxpr"]) for e in blocks[:6]}
    assert len(forward) == 1, "the six layers' forward calls trace one function"


def test_the_planned_trace_analyses_as_the_users_own_trace(unrolled):
    """Per op, the same work, bytes and batch splits; step by step, the same memory held
    (each row of the liveness matrix summed), the same layers: the graph the cost model
    prices does not know which trace it came from."""
    step, params, opt, batch = unrolled

    def graph(fn):
        layout, closed = layout_of(fn, (params, opt, batch), {}, params)
        return analyze(closed, layout.inputs.roles, layout.outputs.roles, layout.params,
                       layout.inputs.batch_size)
    own, planned = graph(step), graph(step.planned_as())
    assert len(own.flops) == len(planned.flops)
    for name in ("flops", "bytes", "kernels", "repeat", "grad_repeat"):
        np.testing.assert_array_equal(np.sort(getattr(own, name)),
                                      np.sort(getattr(planned, name)), err_msg=name)
    assert own.batched.sum() == planned.batched.sum()
    assert len(own.layers) == len(planned.layers)
    np.testing.assert_allclose(np.asarray(own.live).sum(1).max(),
                               np.asarray(planned.live).sum(1).max())
    np.testing.assert_array_equal(own.resident_bytes, planned.resident_bytes)


def test_a_plan_of_the_unrolled_step_is_that_of_its_users_trace(unrolled):
    """Planned through the faster trace (a `make_train_step` step) or through the user's
    own (the same step behind a plain function, which the planner traces as it is): the
    same mesh, the same layout, the same predicted step and memory."""
    step, params, opt, batch = unrolled
    kw = {"hardware": jaxwap.Cluster("h100-sxm", 8), "verify": 0, "cache": False}
    fast = jaxwap.plan(step, params, opt, batch, **kw)
    plain = jaxwap.plan(lambda p, o, b: step(p, o, b), params, opt, batch, **kw)
    assert fast.mesh_shape == plain.mesh_shape
    assert [p.partition_spec for p in fast.params] == [p.partition_spec for p in plain.params]
    assert fast.predicted.step_time_s == pytest.approx(plain.predicted.step_time_s,
                                                       rel=1e-9)
    assert fast.predicted.peak_memory_bytes == pytest.approx(
        plain.predicted.peak_memory_bytes, rel=1e-9)


def test_a_failing_faster_trace_plans_from_the_users_trace(unrolled, monkeypatch):
    """The faster trace is an optional branch: where it raises, the step is traced as it
    is and planned the same."""
    from jaxwap.runtime import layer_remat

    step, params, opt, batch = unrolled
    kw = {"hardware": jaxwap.Cluster("h100-sxm", 8), "verify": 0, "cache": False}
    want = jaxwap.plan(step, params, opt, batch, **kw)

    def broken(loss_fn):
        def loss(params, batch):
            raise RuntimeError("a rewrite that cannot trace this loss")
        return loss
    monkeypatch.setattr(layer_remat, "shared_blocks_loss", broken)
    fresh = jaxwap.make_train_step(step.loss_fn, step.optimizer)
    got = jaxwap.plan(fresh, params, opt, batch, **kw)
    assert got.mesh_shape == want.mesh_shape and got.param_specs == want.param_specs
    assert got.predicted.step_time_s == pytest.approx(want.predicted.step_time_s, rel=1e-9)
