"""Verification: the HLO collective parser, XLA's figures in the plan, and the memory
budget enforced on what XLA says, not on what the model guessed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from models import abstract_setup

import jaxwap
from jaxwap.cost.collectives import collective_cost
from jaxwap.decide.xla_figures import axes_of, parse_collectives, replica_groups

H100X8 = jaxwap.Cluster("h100-sxm", 8)


def mesh_2x4(kind=AxisType.Auto):
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"),
                axis_types=(kind, kind))


def collectives_of(fn, *avals, out_shardings=None):
    compiled = jax.jit(fn, out_shardings=out_shardings).lower(*avals).compile()
    return parse_collectives(compiled.as_text(), (2, 4))


def test_all_reduce_over_one_axis_of_a_2d_mesh():
    mesh = mesh_2x4()
    x = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=NamedSharding(mesh, P(None, "model")))
    w = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P("model")))
    # contracting a model-sharded dim leaves partial sums to all-reduce over "model" only
    colls = collectives_of(lambda x, w: x @ w, x, w,
                           out_shardings=NamedSharding(mesh, P()))
    assert [(c.kind, c.axes, c.group_size) for c in colls] == [("all-reduce", ("model",), 4)]
    assert colls[0].bytes == 16 * 32 * 4


def test_all_gather_of_a_sharded_weight():
    mesh = mesh_2x4()
    w = jax.ShapeDtypeStruct((64, 32), jnp.float32,
                             sharding=NamedSharding(mesh, P("data", "model")))
    colls = collectives_of(lambda w: w * 2, w, out_shardings=NamedSharding(mesh, P()))
    assert {c.kind for c in colls} == {"all-gather"}
    assert sorted(c.axes for c in colls) == [("data",), ("model",)]
    # every gather ends with a piece of the full weight; the last one is the whole of it
    assert max(c.bytes for c in colls) == 64 * 32 * 4
    gathered = {c.axes: c for c in colls}
    assert gathered[("data",)].group_size == 2 and gathered[("model",)].group_size == 4


def test_reduce_scatter():
    mesh = mesh_2x4(AxisType.Explicit)
    f = jax.shard_map(lambda x: lax.psum_scatter(x, "model", scatter_dimension=0, tiled=True),
                      mesh=mesh, in_specs=P("data", None), out_specs=P("data", "model"))
    x = jax.ShapeDtypeStruct((16, 32), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    colls = collectives_of(f, x)
    assert [(c.kind, c.axes, c.group_size) for c in colls] == [("reduce-scatter", ("model",), 4)]
    assert colls[0].bytes == 2 * 32 * 4  # each device keeps 8 rows / 4
    t, sent = collective_cost(colls[0], H100X8)
    assert sent == pytest.approx(3 * colls[0].bytes) and t > 0


@pytest.mark.parametrize("text, groups", [
    ("replica_groups={{0,1,2,3},{4,5,6,7}}, x", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("replica_groups=[2,4]<=[8], x", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("replica_groups=[4,2]<=[2,4]T(1,0), x", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, x",
     [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}, x",
     [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) "
     "{'axis_0'}, x", [[0, 1, 2, 3], [4, 5, 6, 7]]),
])
def test_replica_group_syntaxes(text, groups):
    got = replica_groups(text)
    assert sorted(map(sorted, got)) == sorted(map(sorted, groups))


def test_combined_all_reduce_with_a_tuple_shape():
    line = ("%all-reduce.30 = (f32[64]{0}, f32[64,64]{1,0}, f32[192]{0}, f32[192,64]{1,0}, "
            "f32[64]{0}, /*index=5*/f32[64]{0}) all-reduce(%a, %b, %c, %d, %e, %f), "
            "channel_id=3, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true")
    (c,) = parse_collectives(line, (2, 4))
    assert c.kind == "all-reduce" and c.axes == ("data",) and c.group_size == 2
    assert c.bytes == 4 * (64 + 64 * 64 + 192 + 192 * 64 + 64 + 64)


def test_axes_of_groups():
    assert axes_of([[0, 1, 2, 3], [4, 5, 6, 7]], (2, 4)) == ("model",)
    assert axes_of([[0, 4], [1, 5], [2, 6], [3, 7]], (2, 4)) == ("data",)
    assert axes_of([list(range(8))], (2, 4)) == ("data", "model")


def test_plan_carries_xla_figures():
    step, params, opt, batch = abstract_setup((256, 256, 10), 64, 128)
    plan = jaxwap.plan(step, params, opt, batch, hardware=H100X8, num_devices=8,
                       objective="throughput")
    assert plan.compiled is not None and plan.verified is not None
    c = plan.compiled
    assert c.memory_bytes == pytest.approx(
        c.argument_bytes + c.output_bytes + c.temp_bytes - c.alias_bytes)
    assert c.alias_bytes > 0  # donation of the state works
    # how close the model is, per quantity, is measured by benchmarks/accuracy/fidelity.py;
    # here only that the figures are XLA's per-device ones (flops: 1/8 of the step each)
    assert c.flops == pytest.approx(plan.predicted.flops_per_device, rel=0.25)
    assert 0 < c.memory_bytes < 4 * plan.predicted.peak_memory_bytes
    assert plan.verified.peak_memory_bytes == c.memory_bytes
    assert "compiled (XLA's own analysis" in plan.explain()
    assert jaxwap.Plan.from_json(plan.to_json()) == plan


def test_a_candidate_over_the_budget_by_xla_is_never_returned():
    step, params, opt, batch = abstract_setup((256, 256, 10), 64, 128)
    first = jaxwap.plan(step, params, opt, batch, hardware=H100X8, objective="energy")
    need = first.compiled.memory_bytes
    budget = need * 0.98
    second = jaxwap.plan(step, params, opt, batch, hardware=H100X8, objective="energy",
                         memory_budget=budget)
    assert second.compiled.memory_bytes <= budget
    # more devices, or (the cheaper repair under the energy objective) the optimizer state
    # in host memory: on CPU that saving is modelled, and the plan says so
    offloaded = [p for p in second.params if p.offload]
    assert second.mesh_shape != first.mesh_shape or offloaded
    if offloaded:
        assert second.compiled.host_unverified_bytes > 0
        assert any("not verified" in n for n in second.notes)
    for c in second.candidates:
        if c.compiled is not None and c.compiled.memory_bytes > budget:
            assert not c.fits and not c.chosen
            assert "XLA" in c.reason


def test_nothing_fits_by_xla_is_a_clear_error():
    # a budget the model thinks some candidates meet but XLA's figures do not
    step, params, opt, batch = abstract_setup((36, 20, 8), 2, 12, regression=True)
    with pytest.raises(MemoryError, match=r"XLA's own memory analysis.*memory_budget="):
        jaxwap.plan(step, params, opt, batch, hardware=H100X8, objective="throughput",
                    memory_budget=3200)   # the model: 3.09 kB fits; XLA: 4.83 kB


def test_verify_zero_compiles_nothing_and_bad_values_are_refused():
    step, params, opt, batch = abstract_setup((32, 10), 16, 8)
    plan = jaxwap.plan(step, params, opt, batch, hardware=H100X8, verify=0)
    assert plan.compiled is None and all(c.compiled is None for c in plan.candidates)
    assert "verify" not in plan.planning_time_s
    with pytest.raises(ValueError, match="verify"):
        jaxwap.plan(step, params, opt, batch, hardware=H100X8, verify=-1)


def test_the_run_reuses_the_verified_executable():
    from models import copy_tree, setup
    step, params, opt, batch = setup(__import__("models").MLP(), (32, 16))
    sharded = jaxwap.auto_shard(step, params, hardware=H100X8, num_devices=8, cache=False)
    sharded(copy_tree(params), copy_tree(opt), batch)
    key = next(iter(sharded._plans))
    assert sharded._execs[key] is sharded._plans[key].compiled


def test_the_data_parallel_baseline_is_always_verified():
    """Whatever the analytic ranking, the best plain data-parallel layout is compiled too,
    so the plan is never worse than it on XLA's figures."""
    step, params, opt, batch = abstract_setup((256, 256, 10), 64, 128)
    plan = jaxwap.plan(step, params, opt, batch, hardware=H100X8, verify=1, cache=False)
    dp = [c for c in plan.candidates if c.compiled is not None
          and c.mesh_shape[1] == ("model", 1)
          and dict(c.strategy_counts) == {"replicate": len(plan.params)}]
    assert dp, [(c.label, c.strategy_counts) for c in plan.candidates if c.compiled]
    chosen = next(c for c in plan.candidates if c.chosen)
    assert chosen.score <= min(c.score for c in dp)


# ------------------------------------------------------------------ one compile path
def _forced_candidate(family: str, d: int = 4):
    """The planner's own candidate on a (d, 1) mesh with `family` forced, and with every
    parameter replicated, compiled by `verify.compile_candidate` (the function verification,
    the benchmarks and `auto_shard` compile a candidate through)."""
    from jaxwap.decide.verify import compile_candidate
    from jaxwap.planner import make_plan
    from jaxwap.search.constraints import LayoutRules
    from jaxwap.search.solve import solve_mesh

    step, params, opt, batch = abstract_setup((64, 64, 16), 32, 32)
    planned = make_plan(step, (params, opt, batch), {}, params=None,
                        options=jaxwap.PlanOptions(hardware=H100X8, verify=0, cache=False,
                                                   mesh_shape={"data": d},
                                                   strategies=(family,)))
    out = {}
    for name in (family, "replicate"):
        r = solve_mesh(planned.graph, H100X8, d, 1, 1e12,
                       allowed=LayoutRules(frozenset({name})))
        assert {s.name for s in r.strategies} == {name}, r.strategies
        figs, cs = compile_candidate(step, planned.layout, r, jax.devices(), H100X8)
        out[name] = (cs, figs)
    return planned.layout, out


def _bytes_per_device(cs, layout, mirror: bool) -> int:
    """Per-device bytes of the parameter (mirror=False) or optimizer-state (mirror=True)
    arguments, from the shardings the compiled executable itself takes."""
    shardings = jax.tree.leaves(cs.compiled.input_shardings[0])
    total = 0
    for sh, aval, role in zip(shardings, layout.inputs.avals, layout.inputs.roles,
                              strict=True):
        if role.kind == "param" and role.mirror == mirror:
            total += int(np.prod(sh.shard_shape(aval.shape))) * aval.dtype.itemsize
    return total


@pytest.mark.parametrize("family, mirror", [("zero1", True), ("fsdp", False)])
def test_compiled_zero1_state_and_fsdp_weights_are_one_dth_per_device(family, mirror):
    """ZeRO-1 compiles with the Adam moments sharded 4 ways and FSDP with the weights
    sharded 4 ways: the compiled program's own argument layout and XLA's memory analysis
    both show it (a candidate compiled from bare specs would hold the full state)."""
    d = 4
    layout, out = _forced_candidate(family, d)
    (cs, figs), (cs_rep, figs_rep) = out[family], out["replicate"]
    full = _bytes_per_device(cs_rep, layout, mirror)
    assert full > 0
    assert _bytes_per_device(cs, layout, mirror) * d == full
    # XLA's own argument bytes fall by exactly what those layouts no longer hold
    state = [_bytes_per_device(c, layout, True) + _bytes_per_device(c, layout, False)
             for c in (cs, cs_rep)]
    # (the compiled figures the fidelity benchmark records are XLA's memory analysis)
    assert figs.argument_bytes == cs.compiled.memory_analysis().argument_size_in_bytes
    assert figs_rep.argument_bytes - figs.argument_bytes == state[1] - state[0] \
        >= full - full // d
    if family == "zero1":  # the weights themselves stay whole
        assert _bytes_per_device(cs, layout, False) == _bytes_per_device(cs_rep, layout, False)
    else:  # FSDP shards the weights' optimizer state with them
        assert _bytes_per_device(cs, layout, True) * d == _bytes_per_device(cs_rep, layout, True)
