"""The host's call of a step (jax's dispatch of its arrays): measured by the calibration,
priced once per step on each device a process calls, kept by every prediction that is
re-assembled from another's parts, and absent (no term, the old records) where a profile
has none."""

from __future__ import annotations

import cProfile
import dataclasses
import json
import pstats

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models import MLP, abstract_setup, copy_tree, setup

import jaxwap
from jaxwap.calibration import dispatch_probes
from jaxwap.calibration.host_calls import python_call_seconds
from jaxwap.cost.mesh_prediction import with_compiled
from jaxwap.cost.prediction import at_power_limit, call_time
from jaxwap.decide.verify import compile_candidate
from jaxwap.hardware.cluster import Cluster
from jaxwap.hardware.device import DeviceSpec
from jaxwap.planner import make_plan

SPEC = DeviceSpec("test-cpu", peak_flops=1e11, memory_bandwidth=2e10, memory_bytes=8e9,
                  idle_watts=5, max_watts=50, kernel_overhead_s=1e-6)
# 6 us and 0.6 us an array on one device, 40 us and 3 us an array on 8 of them
CALL = ((1, 6e-6, 6e-7), (8, 4e-5, 3e-6))
PER_CALL = 1.5e-7   # seconds per Python call of the step's pytree work
PRICED = dataclasses.replace(SPEC, call_cost=CALL, python_call_s=PER_CALL)


def _one_device(spec: DeviceSpec, devices: int = 1, **kw):
    step, params, opt, batch = abstract_setup([64, 64, 10], 32, 16)
    cluster = Cluster(spec, devices, **kw)
    planned = make_plan(step, (params, opt, batch), {}, params=None,
                        options=jaxwap.PlanOptions(hardware=cluster, verify=0, cache=False))
    return step, planned, cluster


def test_the_probe_times_one_device_and_all_and_each_array_costs():
    """On the 8 simulated devices: a row for one device and one for all 8, every figure
    >= 0 and each array > 0 (what the model prices per leaf)."""
    rows = dispatch_probes.step_call(jax.devices(), arrays=64, repeats=31)
    assert [d for d, _, _ in rows] == [1, 8]
    assert all(a >= 0 and c > 0 for _, a, c in rows)


def test_a_step_pays_its_call_per_array_and_per_device_a_process_calls():
    """`Graph.buffers` is the step's argument and result leaves; each candidate's step is
    longer by the call of its mesh's devices exactly (linear in devices between the
    rows: a mesh of 4 of one process's devices between 1 and 8), and 4 processes of one
    device each (devices_per_node=1) each pay one device's call."""
    step, plain, _ = _one_device(dataclasses.replace(SPEC, call_cost=CALL), 4)
    _, priced, cluster = _one_device(PRICED, 4)
    args = abstract_setup([64, 64, 10], 32, 16)[1:]
    leaves = len(jax.tree.leaves(args)) + len(jax.tree.leaves(jax.eval_shape(step, *args)))
    assert priced.graph.buffers == plain.graph.buffers == leaves
    # the pytrees' Python calls are counted where the profile prices them, and only there
    assert priced.graph.tree_calls > 0 and plain.graph.tree_calls == 0
    def key(r):
        return r.d, r.m, r.variant, tuple(s.name for s in r.strategies)

    was = {key(r): r.predicted for r in _one_device(SPEC, 4)[1].search.results}
    # the same candidates priced (a list may keep fewer alternatives: it keeps the close)
    assert {key(r) for r in priced.search.results} <= was.keys()
    assert {r.d * r.m for r in priced.search.results} == {1, 2, 4}
    for r in priced.search.results:
        f = (r.d * r.m - 1) / 7   # of the way from the 1-device row to the 8-device one
        want = (6e-6 + f * 34e-6 + priced.graph.buffers * (6e-7 + f * 24e-7)
                + priced.graph.tree_calls * PER_CALL)
        assert r.predicted.call_time_s == pytest.approx(want)
        assert r.predicted.step_time_s - was[key(r)].step_time_s == pytest.approx(want, rel=1e-6)
    nodes = Cluster(dataclasses.replace(SPEC, call_cost=CALL), 4, devices_per_node=1)
    assert call_time(nodes, 100, 4) == pytest.approx(6e-6 + 100 * 6e-7)
    assert call_time(cluster, 100, 4) == pytest.approx(6e-6 + 3 / 7 * 34e-6
                                                       + 100 * (6e-7 + 3 / 7 * 24e-7))
    # past the last row it holds; no rows, no term
    assert call_time(Cluster(nodes.device, 16), 100, 16) == pytest.approx(4e-5 + 100 * 3e-6)
    assert call_time(Cluster(SPEC, 4), 100, 4) == 0.0


def test_the_call_survives_reassembly_and_xla_figures():
    """Under another power limit and fed XLA's figures the step keeps its call."""
    step, planned, cluster = _one_device(dataclasses.replace(SPEC, call_cost=CALL))
    r = next(r for r in planned.search.results if r.d == r.m == 1)
    assert r.predicted.call_time_s > 0
    again = at_power_limit(r.predicted, cluster, 32, None)
    assert again.call_time_s == r.predicted.call_time_s
    assert again.step_time_s == pytest.approx(r.predicted.step_time_s)
    figs, _ = compile_candidate(step, planned.layout, r, jax.devices()[:1], cluster)
    assert with_compiled(r.predicted, figs, cluster, 32).call_time_s == r.predicted.call_time_s


def test_call_cost_is_recorded_only_where_measured_and_bad_values_are_named():
    priced = dataclasses.replace(SPEC, call_cost=[[8, 4e-5, 3e-6], [1, 6e-6, 6e-7]])  # JSON
    assert priced.call_cost == CALL    # rows as tuples, by device count
    assert DeviceSpec.from_dict(json.loads(json.dumps(priced.to_dict()))) == priced
    # a profile without the term keeps the record (and the plan cache's key) it had
    assert "call_cost" not in SPEC.to_dict()
    assert DeviceSpec.from_dict(SPEC.to_dict()) == SPEC
    with pytest.raises(ValueError, match="call_cost must be .devices >= 1"):
        dataclasses.replace(SPEC, call_cost=((1, 1e-6, -1e-7),))
    with pytest.raises(ValueError, match="call_cost"):
        dataclasses.replace(SPEC, call_cost=((0, 1e-6, 1e-7),))


def test_explain_names_the_call_where_there_is_one():
    _, planned, _ = _one_device(dataclasses.replace(SPEC, call_cost=CALL))
    _, plain, _ = _one_device(SPEC)
    assert "host's call" in planned.plan.explain()
    assert "host's call" not in plain.plan.explain()


WORK = 10   # Python calls each flatten of a `_Costly` node makes beyond its own


def _helper():
    return None


@jax.tree_util.register_pytree_node_class
class _Costly:
    """A custom pytree node whose flatten calls a helper WORK times (as Flax NNX's states
    and variables run Python for each node)."""

    def __init__(self, tree):
        self.tree = tree

    def tree_flatten(self):
        for _ in range(WORK):
            _helper()
        return (self.tree,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0])


def _costly_step(state, batch):
    def loss(p):
        return jnp.mean((batch["x"] @ p["w"] - batch["y"]) ** 2)
    value, grads = jax.value_and_grad(loss)(state.tree)
    return _Costly(jax.tree.map(lambda p, g: p - 0.1 * g, state.tree, grads)), value


def _plain_step(state, batch):
    new, value = _costly_step(_Costly(state), batch)
    return new.tree, value


def _plan_in(wrap, step, spec=PRICED):
    params = {"w": jax.ShapeDtypeStruct((16, 4), jnp.float32)}
    batch = {"x": jax.ShapeDtypeStruct((8, 16), jnp.float32),
             "y": jax.ShapeDtypeStruct((8, 4), jnp.float32)}
    return make_plan(step, (wrap(params), batch), {}, params=params, options=jaxwap.PlanOptions(
        hardware=Cluster(spec, 1), verify=0, cache=False))


def test_a_step_in_custom_pytree_nodes_is_priced_their_python_calls():
    """A call reads the arguments' structure once: a step whose state sits in a node that
    calls a helper WORK times per flatten is counted at least WORK calls more than the same
    step in plain dicts, the same count on every planning (a plan can be re-made from
    it), and priced the count times the profile's seconds per call on top of its arrays'."""
    costly, plain = _plan_in(_Costly, _costly_step), _plan_in(lambda t: t, _plain_step)
    assert costly.graph.buffers == plain.graph.buffers
    assert costly.graph.tree_calls - plain.graph.tree_calls >= WORK
    assert _plan_in(_Costly, _costly_step).graph.tree_calls == costly.graph.tree_calls
    one = next(r for r in costly.search.results if r.d == r.m == 1).predicted
    assert one.call_time_s == pytest.approx(6e-6 + costly.graph.buffers * 6e-7
                                            + costly.graph.tree_calls * PER_CALL)


def test_planning_under_cprofile_counts_the_same_calls_and_leaves_the_profiler_running():
    """A user profiling their script with cProfile: the count is made in a thread of its
    own (a profile function is per thread), so it is the same as without a profiler, and
    cProfile's own hook is left in place (put back through `sys.setprofile`, it raised
    "'Profile' object is not callable")."""
    want = _plan_in(_Costly, _costly_step).graph.tree_calls
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        got = _plan_in(_Costly, _costly_step).graph.tree_calls
        _after_counting()
    finally:
        profiler.disable()
    assert got == want
    names = {fn for _, _, fn in pstats.Stats(profiler).stats}
    assert "_after_counting" in names


def _after_counting() -> None:
    """A call cProfile must still see after the planning counted its calls."""


def test_python_calls_are_priced_by_the_calibrated_figure_and_kept_in_records():
    """The reference structure's seconds per call is a positive figure; a profile without
    it counts nothing and keeps its record (and plan-cache key) as before."""
    assert 0 < python_call_seconds(nodes=16, repeats=5) < 1e-4
    assert "python_call_s" not in SPEC.to_dict()
    assert DeviceSpec.from_dict(json.loads(json.dumps(PRICED.to_dict()))) == PRICED
    assert _plan_in(_Costly, _costly_step, dataclasses.replace(SPEC, call_cost=CALL)
                    ).graph.tree_calls == 0
    with pytest.raises(ValueError, match="python_call_s must be >= 0"):
        dataclasses.replace(SPEC, python_call_s=-1e-9)


def _counting_puts(monkeypatch) -> list:
    moved = []
    real = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda x, *a, **k: moved.append(x) or real(x, *a, **k))
    return moved


def _assert_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_a_later_call_goes_to_the_compiled_program_as_it_is(monkeypatch):
    """After the first call (placed by jaxwap: `StepCall.fallbacks`), the state a step
    hands back and a batch made on the mesh's one device go to the compiled program
    directly: no `device_put` of jaxwap's, no call placed by it. A host (numpy) batch of
    the same shapes reuses the plan and goes there directly too (jax's dispatch places
    it), and every step gives what `jax.jit` gives."""
    step, params, opt, batch = setup(MLP((16, 4)), (8, 8), num_classes=4)
    ref = jax.jit(step)(copy_tree(params), copy_tree(opt), batch)
    ref = jax.jit(step)(*ref[:2], batch)
    wrapped = jaxwap.auto_shard(step, params, cache=False, verify=0, num_devices=1)
    params, opt, _ = wrapped(params, opt, batch)
    assert wrapped.plan.num_devices == 1
    call = wrapped._last
    assert call.fallbacks == 1       # the first call: the user's state placed here
    moved = _counting_puts(monkeypatch)
    params, opt, metrics = wrapped(params, opt, batch)
    _assert_close((params, opt, metrics), ref)
    assert moved == [] and call.fallbacks == 1
    host = jax.tree.map(np.asarray, batch)
    plans = []
    real_plan = jaxwap.api.make_plan
    monkeypatch.setattr(jaxwap.api, "make_plan", lambda *a, **k: plans.append(1) or
                        real_plan(*a, **k))
    again = wrapped(params, opt, host)
    assert plans == [] and moved == [] and call.fallbacks == 1
    assert len(jax.tree.leaves(again)) == len(jax.tree.leaves((params, opt))) + 1


def test_on_a_sharded_mesh_a_later_call_goes_to_the_program_and_matches_one_device():
    """On 2 data-parallel devices the returned state and a batch on one device (jax's
    dispatch splits it over the data axis) go to the compiled program directly, and the
    steps are the one-device steps."""
    step, params, opt, batch = setup(MLP((16, 4)), (8, 8), num_classes=4)
    one_params, one_opt = copy_tree(params), copy_tree(opt)
    wrapped = jaxwap.auto_shard(step, params, cache=False, verify=0,
                                mesh_shape={"data": 2, "model": 1})
    params, opt, _ = wrapped(params, opt, batch)
    call = wrapped._last
    for _ in range(2):
        params, opt, metrics = wrapped(params, opt, batch)
    assert call.fallbacks == 1
    for _ in range(3):
        one_params, one_opt, one_metrics = jax.jit(step)(one_params, one_opt, batch)
    _assert_close((params, metrics), (one_params, one_metrics))
    mesh = set(wrapped.mesh.devices.flat)
    assert all(x.sharding.device_set == mesh for x in jax.tree.leaves((params, opt)))


def _counting_signatures(monkeypatch):
    """Every `trace.signature` a step's call makes (the plan's key read from the
    arguments: what a call like the last one skips)."""
    from jaxwap.runtime import step_call as calls

    made = []
    real = calls.signature
    monkeypatch.setattr(calls, "signature", lambda *a: made.append(1) or real(*a))
    monkeypatch.setattr(jaxwap.api, "signature", lambda *a: made.append(1) or real(*a))
    return made


def test_a_call_like_the_last_is_served_without_reading_the_key_and_matches_jit(monkeypatch):
    """After a step has run, calls whose arguments have its structure, shapes and dtypes
    (the state it returned, a fresh batch each time) are served by the same call without
    `signature`, and give the steps `jax.jit` gives. A batch of another size reads its key
    and plans again; one of the first size afterwards is served again unread."""
    step, params, opt, batch = setup(MLP((16, 4)), (8, 8), num_classes=4)
    ref_params, ref_opt = copy_tree(params), copy_tree(opt)
    wrapped = jaxwap.auto_shard(step, params, cache=False, verify=0,
                                mesh_shape={"data": 2, "model": 1})
    params, opt, _ = wrapped(params, opt, batch)
    ref_params, ref_opt, _ = jax.jit(step)(ref_params, ref_opt, batch)
    made = _counting_signatures(monkeypatch)
    rng = np.random.default_rng(1)
    for _ in range(3):
        fresh = {"x": jnp.asarray(rng.standard_normal((8, 8), np.float32)),
                 "y": jnp.asarray(rng.integers(0, 4, 8), jnp.int32)}
        params, opt, metrics = wrapped(params, opt, fresh)
        ref_params, ref_opt, ref_metrics = jax.jit(step)(ref_params, ref_opt, fresh)
    assert made == []
    for got, want in zip(jax.tree.leaves((params, opt, metrics)),
                         jax.tree.leaves((ref_params, ref_opt, ref_metrics)), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    plans = []
    real_plan = jaxwap.api.make_plan
    monkeypatch.setattr(jaxwap.api, "make_plan", lambda *a, **k: plans.append(1) or
                        real_plan(*a, **k))
    small = jax.tree.map(lambda a: a[:4], batch)
    params, opt, _ = wrapped(params, opt, small)
    assert len(made) == 1 and plans == [1]
    made.clear()
    params, opt, _ = wrapped(params, opt, batch)
    assert len(made) == 1 and plans == [1]      # its key read once, its plan reused
    made.clear()
    wrapped(params, opt, batch)
    assert made == []


def test_a_served_call_still_places_an_argument_moved_off_its_sharding(monkeypatch):
    """A call like the last one whose state the loop put on another device (a checkpoint
    restored onto device 5, say): jax refuses the committed arrays before anything runs,
    and the call places them back on the plan's shardings and steps as `jax.jit` does;
    the arrays given are consumed (deleted), as donated ones are. The calls after go to
    the program directly again."""
    step, params, opt, batch = setup(MLP((16, 4)), (8, 8), num_classes=4)
    ref_params, ref_opt = copy_tree(params), copy_tree(opt)
    wrapped = jaxwap.auto_shard(step, params, cache=False, verify=0,
                                mesh_shape={"data": 2, "model": 1})
    for _ in range(2):
        params, opt, _ = wrapped(params, opt, batch)
        ref_params, ref_opt, _ = jax.jit(step)(ref_params, ref_opt, batch)
    elsewhere = jax.device_put(params, jax.devices()[5])
    assert all(x.sharding.device_set == {jax.devices()[5]} for x in jax.tree.leaves(elsewhere))
    made = _counting_signatures(monkeypatch)
    call = wrapped._last
    before = call.fallbacks
    params, opt, metrics = wrapped(elsewhere, opt, batch)
    assert made == []       # served as the last call was: jax refused, jaxwap placed
    assert call.fallbacks == before + 1
    assert all(x.is_deleted() for x in jax.tree.leaves(elsewhere))   # consumed
    ref_params, ref_opt, ref_metrics = jax.jit(step)(ref_params, ref_opt, batch)
    mesh = set(wrapped.mesh.devices.flat)
    assert len(mesh) == 2
    assert all(x.sharding.device_set == mesh for x in jax.tree.leaves(params))
    for got, ref in zip(jax.tree.leaves((params, opt, metrics)),
                        jax.tree.leaves((ref_params, ref_opt, ref_metrics)), strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    for _ in range(2):
        params, opt, metrics = wrapped(params, opt, batch)
    assert call.fallbacks == before + 1 and made == []
