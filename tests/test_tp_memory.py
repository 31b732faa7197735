"""Tensor parallelism in the memory model, and scanned (stacked) layers that split.

A Megatron layout (a column-parallel layer, then a row-parallel one) splits the
activations between the two over the model axis: an MLP's hidden, attention's q/k/v,
scores and probabilities per head, and in the backward pass their cotangents. The graph
keeps those batched bytes in columns of their own (`Graph.tp_live_param` /
`tp_live_kind`), which `layout_memory.memory_weights` divides by the model axis when the layout
is of that kind. The predictions are checked against XLA's memory analysis of the same
layouts compiled on 4 of the simulated CPU devices.

Scanned blocks (`zoo.llama(..., scan=True)`) slice each stacked parameter per iteration;
the ops that use a slice belong to the parameter, so a scanned block has the layers of an
unrolled one, its dims named in the stacked parameter's own dims.
"""

from __future__ import annotations

import dataclasses
from functools import cache

import jax
import jax.numpy as jnp
import pytest
from models import abstract_setup

import jaxwap
from benchmarks.models import zoo
from jaxwap.analysis.graph import NUM_CLASSES, Graph, analyze
from jaxwap.analysis.trace import layout_of
from jaxwap.cost.layout_memory import memory_weights, peak_memory
from jaxwap.runtime.compile import compile_layout
from jaxwap.search.strategies import param_strategies

M = 4  # the model axis of the (1, M) mesh every comparison uses
ROW = {"o", "down", "Dense_1"}  # a block's second linear layer of each pair


@cache
def _traced(name: str, scan: bool = False):
    if name == "mlp":
        step, params, opt, batch = abstract_setup((512, 16), batch=64, in_dim=64)
        args = (params, opt, batch)
    else:
        # as many kv heads as query heads (4): the model axis of 4 splits whole heads
        w = zoo.llama("llama_tiny", layers=2, scan=scan, dtype=jnp.float32, batch_size=8,
                      kv_heads=4)
        step, args, params = w.step, w.args, w.params
    layout, closed = layout_of(step, args, {}, params, None)
    graph = analyze(closed, layout.inputs.roles, layout.outputs.roles, layout.params,
                    layout.inputs.batch_size)
    return step, layout, graph


def _layout(graph: Graph, megatron: bool):
    """Every parameter replicated, or every layer but the LM head tensor-parallel the
    Megatron way (column, then row), on a (1, M) mesh."""
    layer_params = {L.param for L in graph.layers}
    out = []
    for j, p in enumerate(graph.params):
        want = "none"
        if megatron and j in layer_params and "lm_head" not in p.path:
            want = "row" if ROW & set(p.path) else "col"
        opts = param_strategies(graph, j, 1, M)
        out.append(next(s for s in opts if s.tp == want and s.state_spec is None
                        and not s.data_sharded and not s.offload))
    return out


def _uncredited(graph: Graph) -> Graph:
    """The graph with every batched byte in the batched column (the model before
    tensor parallelism was credited)."""
    base = 2 + NUM_CLASSES * len(graph.params)
    live = graph.live.copy()
    live[:, 0] += live[:, base:].sum(axis=1)
    return dataclasses.replace(graph, live=live[:, :base], tp_live_param=None,
                               tp_live_kind=())


def _xla(name: str, megatron: bool) -> float:
    """XLA's per-device figure for the layout: arguments + outputs + temporaries less
    the donated (aliased) bytes."""
    step, layout, graph = _traced(name)
    cs = compile_layout(step, layout, 1, M, _layout(graph, megatron), jax.devices())
    mem = cs.compiled.memory_analysis()
    return float(mem.argument_size_in_bytes + mem.output_size_in_bytes
                 + mem.temp_size_in_bytes - mem.alias_size_in_bytes)


# ------------------------------------------------------------------ the columns
def test_columns_hold_moved_batched_bytes():
    """The extra columns are (parameter, kind) pairs with bytes, after the per-class
    ones; the bytes are moved out of the batched column, not copied, so with nothing
    tensor-parallel (or m = 1) every prediction is the old one."""
    _, _, g = _traced("llama")
    P, E = len(g.params), len(g.tp_live_param)
    assert E > 0 and g.live.shape[1] == 2 + NUM_CLASSES * P + E
    assert set(g.tp_live_kind) == {"col", "row"}
    assert len(set(zip(g.tp_live_param.tolist(), g.tp_live_kind, strict=True))) == E
    assert (g.live[:, 2 + NUM_CLASSES * P:].max(axis=0) > 0).all()
    layers = {L.param for L in g.layers}
    assert set(g.tp_live_param.tolist()) <= layers
    old = _uncredited(g)
    assert len(old.tp_live_param) == 0  # a Graph without the columns is valid
    for m in (1, M):
        rep = _layout(g, False) if m == M else [param_strategies(g, j, 1, 1)[0]
                                                for j in range(P)]
        assert peak_memory(g, 1, m, rep)[0] == peak_memory(old, 1, m, rep)[0]
        assert (memory_weights(g, 2, rep, m) >= 0).all()  # pruning stays exact
    meg = _layout(g, True)
    assert peak_memory(g, 1, 1, meg)[0] == peak_memory(old, 1, 1, meg)[0]


def test_mlp_hidden_and_its_cotangent_are_split():
    """x -> Dense(512) (column) -> relu -> Dense(16) (row): the hidden activation and its
    cotangent are the first layer's and the second's column; the credit at the peak is
    (1 - 1/m) of those bytes."""
    _, _, g = _traced("mlp")
    P = len(g.params)
    first, second = (L.param for L in g.layers)
    pairs = dict(zip(zip(g.tp_live_param.tolist(), g.tp_live_kind, strict=True),
                     range(2 + NUM_CLASSES * P, g.live.shape[1]), strict=True))
    hidden = 64 * 512 * 4
    assert g.live[:, pairs[first, "col"]].max() >= hidden
    assert g.live[:, pairs[second, "row"]].max() >= hidden
    meg, rep = _layout(g, True), _layout(g, False)
    assert [meg[j].tp for j in (first, second)] == ["col", "row"]
    credited = peak_memory(g, 1, M, meg)[0]
    assert credited < peak_memory(_uncredited(g), 1, M, meg)[0] < peak_memory(g, 1, M, rep)[0]


# ------------------------------------------------------------------ against XLA
@pytest.mark.parametrize("name", ["mlp", "llama"])
def test_megatron_lowers_the_peak_as_xla_does(name):
    """On a (1, 4) mesh the Megatron layout's predicted peak is below the replicated
    one's, by the weights' share and the split activations', and XLA's memory analysis
    of the two compiled layouts drops too.

    Tolerance: the predicted drop is within a factor 1.5 of XLA's either way, and nearer
    to it than the drop of the model that does not credit activations. The model walks
    the jaxpr with its own fusion and liveness rules, not XLA:CPU's buffer assignment (it
    predicts the replicated tiny Llama at about 0.8x XLA's figure), so the two agree on
    the direction and the size of the change, not to the byte."""
    _, _, g = _traced(name)
    rep, meg = _layout(g, False), _layout(g, True)
    pred_rep, pred_meg = peak_memory(g, 1, M, rep)[0], peak_memory(g, 1, M, meg)[0]
    old = _uncredited(g)
    old_drop = peak_memory(old, 1, M, rep)[0] - peak_memory(old, 1, M, meg)[0]
    xla_rep, xla_meg = _xla(name, False), _xla(name, True)
    drop, xla_drop = pred_rep - pred_meg, xla_rep - xla_meg
    assert drop > old_drop > 0 and xla_drop > 0
    assert xla_drop / 1.5 < drop < 1.5 * xla_drop
    assert abs(drop - xla_drop) < abs(old_drop - xla_drop)


# ------------------------------------------------------------------ scanned layers
def test_scanned_blocks_have_the_layers_of_unrolled_ones():
    """Per block, the scanned tiny Llama has the unrolled one's layers, in the same order,
    their dims those of the unrolled layer shifted past the stacked dim; the matmuls
    tensor parallelism splits do the same flops; its batched activations are credited
    to the stacked parameters' layouts."""
    _, _, unrolled = _traced("llama")
    _, _, scanned = _traced("llama", scan=True)

    def block(g, i=None):
        return [L for L in g.layers if "blocks" in g.params[L.param].path
                and (i is None or g.params[L.param].path[1] == str(i))]

    first, stacked = block(unrolled, 0), block(scanned)
    assert len(first) == len(block(unrolled, 1)) == len(stacked) == 7
    for a, b in zip(first, stacked, strict=True):
        pa, pb = unrolled.params[a.param], scanned.params[b.param]
        assert pa.path[2:] == pb.path[1:] and pb.shape == (2, *pa.shape)
        assert scanned.stacked_dim[b.param] == 0
        assert b.in_dims == tuple(d + 1 for d in a.in_dims)
        assert b.out_dims == tuple(d + 1 for d in a.out_dims)
        assert (b.act_in_bytes, b.act_out_bytes) == (a.act_in_bytes, a.act_out_bytes)
    assert float(scanned.flops[scanned.tp_param >= 0].sum()) == pytest.approx(
        float(unrolled.flops[unrolled.tp_param >= 0].sum()), rel=1e-12)
    assert float(scanned.flops[scanned.is_matmul].sum()) == pytest.approx(
        float(unrolled.flops[unrolled.is_matmul].sum()), rel=1e-12)
    assert scanned.grad_repeat.tolist() == [1.0] * len(scanned.params)
    block_params = {L.param for L in stacked}
    assert block_params <= set(scanned.tp_live_param.tolist())
    meg, rep = _layout(scanned, True), _layout(scanned, False)
    assert peak_memory(scanned, 1, M, meg)[0] < peak_memory(_uncredited(scanned), 1, M, meg)[0]
    assert peak_memory(scanned, 1, M, meg)[0] < peak_memory(scanned, 1, M, rep)[0]


def test_scanned_llama_plans_tensor_parallel_and_compiles():
    w = zoo.llama("llama_tiny", layers=2, scan=True, dtype=jnp.float32, batch_size=8)
    # a fixed profile (the built-in CPU one for two devices), not this machine's: the profile
    # detected here scales with the cores present, and with 32 or more no layer gains from
    # the model axis, so the decision asserted would follow the machine
    plan = jaxwap.plan(w.step, *w.args, params=w.params, mesh_shape={"data": 1, "model": 2},
                       strategies=("replicate", "tp"), verify=1, cache=False,
                       hardware=jaxwap.Cluster("cpu", 2))
    assert plan.compiled is not None
    stacked = [p for p in plan.params if p.path[0] == "blocks" and len(p.shape) == 3]
    assert any(p.strategy.startswith("tp") for p in stacked)
    assert all(p.spec[0] is None for p in stacked)  # never the stacked dim
