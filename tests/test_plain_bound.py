"""The step as written is not searched where no layout of any mesh can fit it and the
planner will restructure it (`variant_trials.Trials._over_floor`): its lower bound, the
one each mesh's search prunes by, says so, and the error when nothing fits is still the
search's own."""

from __future__ import annotations

import optax
import pytest

import jaxwap
from benchmarks.models import zoo
from jaxwap.core.records import StepVariant
from jaxwap.planning import variant_trials


@pytest.fixture(scope="module")
def unrolled():
    """An 8-layer decoder written as a Python loop over its layers, in float32."""
    w = zoo.llama("llama_tiny", batch_size=8, seq_len=128, scan=False, dtype="float32",
                  layers=8, d_model=128, ffn=512, heads=4, kv_heads=4)
    params, _, batch = w.init(0)
    step = jaxwap.make_train_step(w.step.loss_fn, optax.sgd(1e-2))
    return step, params, step.init(params), batch


ONE = {"hardware": jaxwap.Cluster("h100-sxm", 16), "mesh_shape": {"data": 1}, "verify": 0,
       "cache": False, "offload": False}


def _counted(monkeypatch):
    """The graphs the variants' searches were run on."""
    searched = []
    real = variant_trials.step_searcher

    def counted(*a, **k):
        base = real(*a, **k)

        def search(graph, **kw):
            searched.append(graph)
            return base(graph, **kw)
        return search
    monkeypatch.setattr(variant_trials, "step_searcher", counted)
    return searched


def test_the_step_as_written_is_not_searched_where_no_layout_can_fit_it(unrolled,
                                                                        monkeypatch):
    """With room for full per-layer remat and not for the step as written: the plan is
    restructured, the step as written's graph never searched (each graph searched has
    the recomputation's ops), and the note gives the bound."""
    step, params, opt, batch = unrolled
    full = jaxwap.plan(step.with_variant(StepVariant(remat="layer_full")), params, opt,
                       batch, **ONE).predicted.peak_memory_bytes
    budget = 1.05 * full
    searched = _counted(monkeypatch)
    plan = jaxwap.plan(step, params, opt, batch, **ONE, memory_budget=budget)
    assert plan.step.remat.startswith("layer_")
    note = next(n for n in plan.notes if n.startswith("the step as written does not fit"))
    assert "as written: needs at least" in note and "(a lower bound)" in note
    as_written = _graph_of(step, params, opt, batch)
    assert searched and all(len(g.flops) != len(as_written.flops) for g in searched)
    # the bound was right: the step as written, which nothing restructures behind a
    # plain function, fits no layout
    with pytest.raises(MemoryError, match="no candidate plan fits"):
        jaxwap.plan(lambda p, o, b: step(p, o, b), params, opt, batch, **ONE,
                    memory_budget=budget)


def _graph_of(step, params, opt, batch):
    from jaxwap.analysis.graph import analyze
    from jaxwap.analysis.trace import layout_of

    layout, closed = layout_of(step, (params, opt, batch), {}, params)
    return analyze(closed, layout.inputs.roles, layout.outputs.roles, layout.params,
                   layout.inputs.batch_size)


def test_where_nothing_fits_the_error_is_the_step_as_writtens_search(unrolled):
    """Below the weights alone, no variant fits: the error begins with what the search
    of the step as written found (its smallest candidate and its need), as it did when
    that search ran first."""
    step, params, opt, batch = unrolled
    with pytest.raises(MemoryError) as e:
        jaxwap.plan(step, params, opt, batch, **ONE, memory_budget=1e5)
    text = str(e.value)
    assert text.startswith("no candidate plan fits the memory budget of 100 kB per device: "
                           "the smallest, mesh data=1 x model=1, needs")
    assert "Also tried restructuring the step" in text
