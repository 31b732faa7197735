"""The analyses of the steps jaxwap builds are kept (`analysis.graph_cache`): planning a
step again (another memory budget, another objective) traces none of its restructured
variants or pipeline stages again, and gives the plan a first planning gives."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from models import scanned_mlp_step

import jaxwap
from jaxwap.analysis import graph_cache
from jaxwap.planning import variant_trials
from jaxwap.search import stage_graphs


def _stack(layers: int = 8, d: int = 256, rows: int = 4096):
    """A `make_train_step` step over a `lax.scan` of `layers` MLP layers, abstract."""
    return scanned_mlp_step(layers, d, rows)


def _counting(monkeypatch, module, name: str) -> list[int]:
    """Calls of `module.name` from here on, one entry each."""
    calls: list[int] = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _decision(plan: jaxwap.Plan) -> tuple:
    return (plan.step, dict(plan.mesh_shape), tuple(p.strategy for p in plan.params),
            plan.predicted.step_time_s, plan.predicted.peak_memory_bytes)


def test_a_restructured_step_planned_again_is_not_traced_again_and_plans_the_same(
        monkeypatch):
    """One H100's budget under the step as written: per-layer remat or micro-batches are
    traced once; planning again under a slightly larger budget traces no variant, and
    its plan is the one planning afresh (after `jaxwap.clear_caches()`) gives."""
    args = _stack()
    kw = dict(hardware=jaxwap.Cluster("h100-sxm", 1), verify=0, cache=False,
              pipeline=False, offload=False)
    plain = jaxwap.plan(*args, **kw).predicted.peak_memory_bytes
    traced = _counting(monkeypatch, variant_trials, "trace_layout")
    first = jaxwap.plan(*args, memory_budget=0.6 * plain, **kw)
    assert not first.step.is_plain and traced
    traced.clear()
    again = jaxwap.plan(*args, memory_budget=0.62 * plain, **kw)
    assert traced == []
    jaxwap.clear_caches()              # the public way to forget them: traced afresh
    fresh = jaxwap.plan(*args, memory_budget=0.62 * plain, **kw)
    assert traced and _decision(again) == _decision(fresh)


def test_a_pipelined_step_planned_again_traces_no_stage_again_and_plans_the_same(
        monkeypatch):
    """Four stages on 8 H100s: the stage steps are traced by the first plan only; a
    second plan under another budget (one the first plan's stages fit, so no other kind
    of stage step is asked for) gives what a first plan under it gives."""
    args = _stack()
    kw = dict(hardware=jaxwap.Cluster("h100-sxm", 8, devices_per_node=8), verify=0,
              cache=False, objective="throughput", pipeline={"stages": 4})
    traced = _counting(monkeypatch, stage_graphs, "layout_of")
    first = jaxwap.plan(*args, **kw)
    assert first.step.stages == 4 and traced
    traced.clear()
    budget = 1.05 * first.predicted.peak_memory_bytes
    again = jaxwap.plan(*args, memory_budget=budget, **kw)
    assert traced == []
    graph_cache.clear()
    fresh = jaxwap.plan(*args, memory_budget=budget, **kw)
    assert traced and _decision(again) == _decision(fresh)


def test_another_loss_function_is_analysed_afresh(monkeypatch):
    """The key is the loss function itself: a second step built from a new function of
    the same code is traced, not served another's analysis."""
    kw = dict(hardware=jaxwap.Cluster("h100-sxm", 1), verify=0, cache=False,
              pipeline=False, offload=False)
    step, params, opt, batch = _stack()
    budget = 0.6 * jaxwap.plan(step, params, opt, batch, **kw).predicted.peak_memory_bytes
    jaxwap.plan(step, params, opt, batch, memory_budget=budget, **kw)
    traced = _counting(monkeypatch, variant_trials, "trace_layout")
    other = _stack()[0]
    jaxwap.plan(other, params, opt, batch, memory_budget=budget, **kw)
    assert traced


def test_the_oldest_analyses_are_forgotten_past_the_count_or_the_bytes(monkeypatch):
    """Kept: the last `KEPT` keys within `KEPT_BYTES` of arrays, the oldest forgotten
    first; a value over the byte bound alone, or an unhashable key, is built each time."""
    import numpy as np

    monkeypatch.setattr(graph_cache, "KEPT", 3)
    monkeypatch.setattr(graph_cache, "KEPT_BYTES", 1000)
    built: list[str] = []

    def value(name: str, nbytes: int):
        return lambda: built.append(name) or (name, np.zeros(nbytes // 8))

    for name in "abc":
        graph_cache.kept((name,), value(name, 200))
    graph_cache.kept(("a",), value("a", 200))           # kept: not built again
    graph_cache.kept(("d",), value("d", 200))           # a fourth key: b, the oldest, goes
    graph_cache.kept(("b",), value("b", 200))
    assert built == ["a", "b", "c", "d", "b"]
    graph_cache.kept(("e",), value("e", 800))           # over 1000 bytes with the rest
    held = [k[0] for k in graph_cache._KEPT]
    assert held[-1] == "e" and sum(graph_cache.array_bytes(v) for v, _ in
                                   graph_cache._KEPT.values()) <= 1000
    graph_cache.kept(("f",), value("f", 2000))          # alone over the bound
    graph_cache.kept(("f",), value("f", 2000))
    graph_cache.kept(([],), value("g", 8))              # a key that does not hash
    graph_cache.kept(([],), value("g", 8))

    class Loss:                                         # one that does not compare
        def __hash__(self):
            return 0

        def __eq__(self, other):
            raise ValueError("the truth value of an array is ambiguous")

    graph_cache.kept((Loss(),), value("h", 8))
    graph_cache.kept((Loss(),), value("h", 8))
    assert built[-6:] == ["f", "f", "g", "g", "h", "h"]


def test_a_kept_trace_counts_its_equations_nested_calls_included():
    """A jaxpr is counted at `EQN_BYTES` an equation, the equations of the jaxprs it calls
    (a nested `jax.jit`) included, so the byte bound covers traces as well as arrays."""
    def inner(x):
        return jnp.sin(x) * 2.0

    def outer(x):
        return jax.jit(inner)(x) + jnp.cos(x)

    closed = jax.make_jaxpr(outer)(jnp.ones(3))
    top = len(closed.jaxpr.eqns)
    nested = len(closed.jaxpr.eqns[0].params["jaxpr"].jaxpr.eqns)
    assert nested >= 2
    assert graph_cache.array_bytes(closed) == graph_cache.EQN_BYTES * (top + nested)
    assert graph_cache.array_bytes((closed, [closed.jaxpr])) == \
        2 * graph_cache.EQN_BYTES * (top + nested)


def test_the_cyclic_collector_is_paused_while_planning_and_restored_after(monkeypatch):
    """Planning runs with Python's cyclic garbage collector off (`core.collector`: a deep
    model's traces are millions of objects each full collection would walk again), and
    leaves it as it found it: back on after a plan made or failed, still off where the
    caller had turned it off."""
    import gc

    from jaxwap import planner

    seen: list[bool] = []
    real = planner._make_plan
    monkeypatch.setattr(planner, "_make_plan",
                        lambda *a, **k: seen.append(gc.isenabled()) or real(*a, **k))
    step, params, opt, batch = _stack(layers=2, d=64, rows=256)
    one = {"hardware": jaxwap.Cluster("cpu", 1), "verify": 0, "cache": False}
    assert gc.isenabled()
    jaxwap.plan(step, params, opt, batch, **one)
    assert seen == [False] and gc.isenabled()
    with pytest.raises(MemoryError):
        jaxwap.plan(step, params, opt, batch, **one, memory_budget=1)
    assert seen == [False, False] and gc.isenabled()
    gc.disable()
    try:
        jaxwap.plan(step, params, opt, batch, **one)
        assert not gc.isenabled()
    finally:
        gc.enable()
