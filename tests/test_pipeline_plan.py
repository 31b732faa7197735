"""Pipelining chosen by the planner: a `make_train_step` step whose loss scans a stack of
layers runs pipelined with no change to the user's code.

The stacked parameters' leading dim goes over the plan's stage axis; the step compiled
and run by `auto_shard` equals the same step under plain `jax.jit` on one device (f32,
one Adam step, tolerance stated per test); a step the planner cannot pipeline says why in
`explain()`; forced pipelines that cannot be built raise, naming what is wrong.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from models import scanned_mlp_step

import jaxwap
from jaxwap.core.records import DATA, MODEL, STAGE

L, D, B, V = 8, 32, 16, 16


def _loss(params, batch):
    h = jnp.take(params["embed"], batch["x"], axis=0).mean(1)          # [B, D]

    def layer(h, w):
        return h + jnp.tanh(h @ w["w1"] + w["b1"]) @ w["w2"], None

    h, _ = jax.lax.scan(layer, h, params["blocks"])
    logits = h @ params["head"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][:, None], 1))


def _setup(seed=0, layers=L):
    rng = np.random.default_rng(seed)
    f = lambda *s, scale=0.3: jnp.asarray(rng.standard_normal(s) * scale, jnp.float32)  # noqa: E731
    params = {"embed": f(V, D), "head": f(D, V),
              "blocks": {"w1": f(layers, D, 2 * D, scale=D ** -0.5),
                         "b1": f(layers, 2 * D, scale=0.1),
                         "w2": f(layers, 2 * D, D, scale=(2 * D) ** -0.5)}}
    batch = {"x": jnp.asarray(rng.integers(0, V, (B, 4)), jnp.int32),
             "y": jnp.asarray(rng.integers(0, V, (B,)), jnp.int32)}
    return params, batch


def _step():
    return jaxwap.make_train_step(_loss, optax.adam(1e-2))


def _forced(step, params, batch, stages, micro, repeats):
    """(the plan, its step's outputs, plain jax.jit's) for `step` forced into a pipeline of
    that shape on all 8 devices (num_devices=8: else the objective may give a stage
    fewer), checked to be the shape asked for."""
    opt = step.init(params)
    want = jax.jit(step)(params, opt, batch)
    sharded = jaxwap.auto_shard(step, cache=False, verify=1, num_devices=8, pipeline={
        "stages": stages, "micro_batches": micro, "repeats": repeats})
    got = sharded(params, opt, batch)
    plan = sharded.plan
    assert (plan.step.stages, plan.step.micro_batches, plan.step.repeats) == (
        stages, micro, repeats)
    return plan, got, want


@pytest.mark.parametrize("stages, micro, repeats", [(2, 4, 1), (4, 4, 1), (2, 4, 2),
                                                    (4, 4, 2)])
def test_a_forced_pipeline_is_planned_as_asked_and_equals_the_unsharded_step(
        stages, micro, repeats):
    params, batch = _setup()
    plan, got, want = _forced(_step(), params, batch, stages, micro, repeats)
    assert dict(plan.mesh_shape)[STAGE] == stages
    # a stage's devices: all 8 // stages (the model may split them over data and model)
    assert dict(plan.mesh_shape)[DATA] * dict(plan.mesh_shape)[MODEL] == 8 // stages
    for p in plan.params:
        assert (p.spec[:1] == (STAGE,)) == (p.path[0] == "blocks"), p
    assert "pipeline" in plan.explain() and "bubble" in plan.explain()
    # f32, one Adam step of lr 1e-2: the pipelined sums run in another order
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    # the first call consumes the state it is given (copied onto the mesh, then deleted)
    assert params["blocks"]["w1"].is_deleted()


@pytest.mark.parametrize("layers, stages, micro, repeats", [(10, 4, 4, 1), (7, 2, 4, 2)])
def test_an_uneven_pipeline_is_stored_split_along_another_dim_and_equals_the_step(
        layers, stages, micro, repeats):
    """10 layers over 4 stages (3, 3, 2, 2), 7 over 2 stages x 2 rounds (2, 2, 2, 1): the
    [L, ...] leaves cannot split their layer dim over the stages, so the plan stores
    them split along another dim, and the step lays them out by layers inside. SGD, not
    Adam: Adam's first step is lr x g / (|g| + eps), which turns the float32 noise of a
    gradient summed in another order near zero (|g| ~ 4e-7 here) into 3e-5 of the update."""
    plan, got, want = _forced(jaxwap.make_train_step(_loss, optax.sgd(0.1)),
                              *_setup(layers=layers), stages, micro, repeats)
    for p in plan.params:
        axes = [a for e in p.spec for a in (e if isinstance(e, tuple) else (e,))]
        assert (STAGE in axes) == (p.path[0] == "blocks"), p
        assert p.spec[0] != STAGE, p
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    # priced as closely as an even split of the same pipeline is, on the same mesh
    # (XLA:CPU's memory against the model's: 1.0x on stage=2 x data=4, 0.76-0.79x with
    # a model axis inside the stages, uneven or not)
    even = -(-layers // (stages * repeats)) * stages * repeats
    plan_even, _, _ = _forced(jaxwap.make_train_step(_loss, optax.sgd(0.1)),
                              *_setup(layers=even), stages, micro, repeats)
    assert plan_even.mesh_shape == plan.mesh_shape
    ratios = [c.compiled.memory_bytes / c.predicted.peak_memory_bytes
              for p in (plan, plan_even) for c in p.candidates if c.chosen]
    assert 0.7 < ratios[0] < 1.3 and ratios[0] == pytest.approx(ratios[1], abs=0.05)


def test_pipelined_candidates_are_weighed_beside_the_others():
    step = _step()
    params, batch = _setup()
    plan = jaxwap.plan(step, params, step.init(params), batch, cache=False, verify=0)
    staged = [c for c in plan.candidates if dict(c.mesh_shape).get(STAGE, 1) > 1]
    assert {dict(c.mesh_shape)[STAGE] for c in staged} == {2, 4}
    for c in staged:
        assert c.predicted.bubble_time_s > 0 and c.predicted.send_time_s > 0
        shape = dict(c.mesh_shape)
        assert c.num_devices <= 8 and c.num_devices % shape[STAGE] == 0
    assert not any("pipelining not considered" in n for n in plan.notes)


def test_a_step_that_cannot_be_pipelined_says_why():
    params, batch = _setup()

    def no_scan(params, batch):
        h = jnp.take(params["embed"], batch["x"], axis=0).mean(1)
        return jnp.mean((h @ params["head"]) ** 2)

    step = jaxwap.make_train_step(no_scan, optax.sgd(0.1))
    plan = jaxwap.plan(step, params, step.init(params), batch, cache=False, verify=0)
    why = [n for n in plan.notes if n.startswith("pipelining not considered")]
    assert len(why) == 1 and "scan" in why[0]
    assert "pipelining not considered" in plan.explain()

    def own_step(params, batch):
        g = jax.grad(_loss)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g)

    plan = jaxwap.plan(own_step, params, batch, cache=False, verify=0)
    assert any("not built by jaxwap.make_train_step" in n for n in plan.notes)


def test_a_forced_pipeline_that_cannot_be_built_names_the_reason():
    step = _step()
    params, batch = _setup()
    with pytest.raises(ValueError, match="pipeline=.*stages.*3.*cannot be used"):
        jaxwap.plan(step, params, step.init(params), batch, cache=False, verify=0,
                    pipeline={"stages": 3})
    # a forced pipeline that fits nowhere is not replaced by a plan without one
    with pytest.raises(MemoryError, match="smallest, mesh stage=2 x data="):
        jaxwap.plan(step, params, step.init(params), batch, cache=False, verify=0,
                    memory_budget=10e3, pipeline={"stages": 2})
    with pytest.raises(ValueError, match="unknown key"):
        jaxwap.PlanOptions(pipeline={"stages": 2, "rounds": 2})
    with pytest.raises(ValueError, match="circular schedule"):
        jaxwap.StepVariant(micro_batches=2, stages=4, repeats=2)


def test_a_pipelined_plan_round_trips_through_json():
    step = _step()
    params, batch = _setup()
    plan = jaxwap.plan(step, params, step.init(params), batch, cache=False, verify=0,
                       pipeline={"stages": 2, "micro_batches": 4})
    back = jaxwap.Plan.from_json(plan.to_json())
    assert back.step == plan.step and back.step.stages == 2
    assert dict(back.mesh_shape) == dict(plan.mesh_shape)
    assert back.predicted.bubble_time_s == plan.predicted.bubble_time_s


def test_fsdp_inside_a_stage_gathers_layers_in_the_loop_and_equals_the_unsharded_step():
    """Circular, 2 rounds (GPipe is covered by `test_pipeline.py`'s sharded stages)."""
    repeats = 2
    step = _step()
    params, batch = _setup()
    opt = step.init(params)
    want = jax.jit(step)(params, opt, batch)
    sharded = jaxwap.auto_shard(step, cache=False, verify=1, num_devices=8,
                                strategies=("fsdp",),
                                pipeline={"stages": 2, "micro_batches": 4, "repeats": repeats})
    got = sharded(params, opt, batch)
    plan = sharded.plan
    blocks = [p for p in plan.params if p.path[0] == "blocks"]
    # every stacked parameter is FSDP inside its stage: sharded over stage and data
    assert all(p.strategy == "stage+fsdp" and p.spec[0] == STAGE and DATA in p.spec[1:]
               for p in blocks), blocks
    # the loop is told to gather them: one spec per stacked leaf, naming the data axis
    assert plan.step.stage_sharded and len(plan.step.stage_specs) == len(blocks)
    assert "gathering each layer" in plan.explain()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    back = jaxwap.Plan.from_json(plan.to_json())
    assert back.step == plan.step


def test_fsdp_inside_a_stage_holds_less_than_a_whole_stage_by_xla():
    """XLA's compiled memory of the pipelined step: the stage's weights, gradients and
    optimizer state sharded 4 ways and gathered one layer at a time take less than the
    stage's share held whole (the gathers are not kept once per loop step)."""
    step = _step()
    rng = np.random.default_rng(1)
    d = 128
    params = {"embed": jnp.zeros((V, d)), "head": jnp.zeros((d, V)),
              "blocks": {"w1": jnp.asarray(rng.standard_normal((L, d, 2 * d)), jnp.float32),
                         "b1": jnp.zeros((L, 2 * d)),
                         "w2": jnp.asarray(rng.standard_normal((L, 2 * d, d)), jnp.float32)}}
    batch = _setup()[1]
    opt = step.init(params)
    peak = {}
    for families in (("replicate",), ("fsdp",)):
        plan = jaxwap.plan(step, params, opt, batch, cache=False, verify=1, num_devices=8,
                           strategies=families, pipeline={"stages": 2, "micro_batches": 4})
        assert plan.step.stage_sharded == (families == ("fsdp",))
        peak[families[0]] = plan.verified.peak_memory_bytes
    # a stage's share of the stacked weights, and as much again of gradient and of each
    # Adam moment: FSDP over data=4 keeps a quarter of the four, 3 shares less
    share = sum(x.nbytes for x in jax.tree.leaves(params["blocks"])) / 2
    assert peak["fsdp"] < peak["replicate"] - 3 * share, peak


def test_fsdp_inside_a_stage_gathers_one_layer_at_a_time_in_the_backward_pass_by_xla():
    """XLA's compiled memory of FSDP inside 2 stages over data=4, GPipe with 2
    micro-batches of 8 blocks of 256 -> 1024 -> 256 (`benchmarks.pipelines.
    pipeline_memory`'s first row), within 10% of the prediction, which holds one layer's
    gathered weights at a time in the backward pass. Were each layer's gathered weights
    kept for the chunk's backward pass, as its scan keeps residuals, the chunk's 4 layers
    would be held whole there: XLA compiled 33% above the prediction."""
    step = _step()
    s = jax.ShapeDtypeStruct
    d, vocab = 256, 512
    params = {"embed": s((vocab, d), jnp.float32), "head": s((d, vocab), jnp.float32),
              "blocks": {"w1": s((L, d, 4 * d), jnp.float32),
                         "b1": s((L, 4 * d), jnp.float32),
                         "w2": s((L, 4 * d, d), jnp.float32)}}
    batch = {"x": s((64, 4), jnp.int32), "y": s((64,), jnp.int32)}
    plan = jaxwap.plan(step, params, jax.eval_shape(step.init, params), batch, cache=False,
                       verify=1, num_devices=8, strategies=("fsdp",),
                       pipeline={"stages": 2, "micro_batches": 2, "repeats": 1})
    assert dict(plan.mesh_shape) == {STAGE: 2, DATA: 4, MODEL: 1}
    assert plan.step.stage_sharded and plan.step.repeats == 1
    compiled, predicted = plan.compiled.memory_bytes, plan.predicted.peak_memory_bytes
    assert abs(compiled / predicted - 1) < 0.10, (compiled, predicted)


def test_stage_specs_are_checked_and_kept_as_tuples():
    v = jaxwap.StepVariant(micro_batches=4, stages=2, stage_specs=[[None, "data"], ["data"]])
    assert v.stage_specs == ((None, "data"), ("data",)) and v.stage_sharded
    assert not jaxwap.StepVariant(stages=2, stage_specs=((None,),)).stage_sharded
    with pytest.raises(ValueError, match="axis names or None, got 3"):
        jaxwap.StepVariant(stages=2, stage_specs=((None, 3),))
    with pytest.raises(ValueError, match="needs a pipeline"):
        jaxwap.StepVariant(stage_specs=(("data",),))


def test_tensor_parallel_layers_inside_a_stage_equal_the_unsharded_step():
    """Stage x data x model = 2 x 2 x 2, forced through the public knobs (a fixed stage
    mesh, tensor-parallel layouts only), circular with 2 rounds (GPipe with a model axis:
    `test_pipeline.py`): the stacked weights stay split over the model axis inside the
    loop, where XLA partitions each layer (Megatron's all-reduce of the activations over
    the model axis alone), and the step equals the unsharded one."""
    repeats = 2
    step = _step()
    params, batch = _setup()
    opt = step.init(params)
    want = jax.jit(step)(params, opt, batch)
    sharded = jaxwap.auto_shard(step, cache=False, verify=1, strategies=("tp",),
                                mesh_shape={"data": 2, "model": 2},
                                pipeline={"stages": 2, "micro_batches": 4, "repeats": repeats})
    got = sharded(params, opt, batch)
    plan = sharded.plan
    assert dict(plan.mesh_shape) == {STAGE: 2, DATA: 2, MODEL: 2}
    blocks = {p.path[1]: p for p in plan.params if p.path[0] == "blocks"}
    # w1 column-parallel, w2 row-parallel: both split over the model axis in the stage
    assert blocks["w1"].strategy == "stage+tp-col" and blocks["w2"].strategy == "stage+tp-row"
    assert all(blocks[w].spec[0] == STAGE and MODEL in blocks[w].spec[1:] for w in ("w1", "w2"))
    assert plan.step.stage_tensor_parallel and not plan.step.stage_sharded
    assert "tensor-parallel layers" in plan.explain()
    assert "model axis's collectives" in plan.explain()
    assert any(c.kind == "all-reduce" and c.axes == (MODEL,)
               for c in plan.compiled.collectives), plan.compiled.collectives
    assert plan.predicted.tp_comm_time_s > plan.predicted.send_time_s
    # the loop keeps its activations split over the model axis, gathered for the layers
    assert any(c.kind == "all-gather" and c.axes == (MODEL,)
               for c in plan.compiled.collectives), plan.compiled.collectives
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    back = jaxwap.Plan.from_json(plan.to_json())
    assert back.step == plan.step


def _deep_mlp_on_slow_nodes():
    """(step, params, opt_state, batch), abstract, of a deep MLP stack (48 blocks of d
    2048 under `lax.scan`, batch 2048, Adam), and 64 H100s in 8 nodes at 100 Gb/s."""
    return scanned_mlp_step(48, 2048, 2048), jaxwap.Cluster(
        "h100-sxm", 64, devices_per_node=8, inter_node_bandwidth=12.5e9)


def test_the_default_chooses_a_pipeline_where_one_wins_and_false_excludes_them():
    """A deep MLP stack (48 blocks of d 2048, batch 2048, abstract) on 64 H100s in 8 nodes
    at 100 Gb/s: with the default `pipeline=None` the planner weighs pipelines itself and
    chooses one, because it predicts it faster than every unpipelined candidate;
    `pipeline=False` leaves them out entirely, and its plan is one of those slower ones."""
    args, nodes = _deep_mlp_on_slow_nodes()
    kw = dict(hardware=nodes, verify=0, cache=False, objective="throughput")

    chosen = jaxwap.plan(*args, **kw)
    assert dict(chosen.mesh_shape).get(STAGE, 1) > 1 and chosen.step.stages > 1
    assert chosen.step.micro_batches > 1
    flat = [c for c in chosen.candidates if dict(c.mesh_shape).get(STAGE, 1) == 1]
    assert flat and all(c.predicted.step_time_s > chosen.predicted.step_time_s
                        for c in flat)

    excluded = jaxwap.plan(*args, pipeline=False, **kw)
    assert STAGE not in dict(excluded.mesh_shape) and excluded.step.stages == 1
    assert not any(dict(c.mesh_shape).get(STAGE, 1) > 1 for c in excluded.candidates)
    assert excluded.predicted.step_time_s > chosen.predicted.step_time_s


def test_a_stage_keeps_its_stacked_weights_whole_where_the_loop_would_gather_them_each_step():
    """The stage step solved as an ordinary step shards the deep MLP's stacked weights
    over data (FSDP: one gather a pass, hidden behind compute); the loop gathers them on
    every loop step, forward and backward. The search also prices the stage with its
    stacked weights whole over data (optimizer state ZeRO-1) and takes it where the
    objective prefers it: here the pinned FSDP stage is predicted several times slower."""
    args, nodes = _deep_mlp_on_slow_nodes()
    kw = dict(hardware=nodes, verify=0, cache=False, objective="throughput",
              pipeline={"stages": 4}, mesh_shape={"data": 16, "model": 1})

    whole = jaxwap.plan(*args, **kw)
    assert whole.step.stages == 4 and not whole.step.stage_sharded
    assert all(p.strategy == "stage+zero1" and DATA not in p.spec for p in whole.params)
    assert "gathering each layer" not in whole.explain()
    gathered = jaxwap.plan(*args, constraints={"blocks": "fsdp"}, **kw)
    assert gathered.step.stage_sharded
    assert all(p.strategy.startswith("stage+fsdp") for p in gathered.params)
    assert "gathering each layer" in gathered.explain()
    assert gathered.predicted.step_time_s > 2 * whole.predicted.step_time_s


def test_a_stage_with_its_stacked_weights_whole_and_their_state_zero1_equals_the_step():
    """The layout the search now also prices, run: the stacked weights whole over the
    stage's data axis (no gather in the loop), their Adam moments split over it (ZeRO-1),
    GPipe on 2 stages x data 4; the step equals the unsharded one."""
    step = _step()
    params, batch = _setup()
    opt = step.init(params)
    want = jax.jit(step)(params, opt, batch)
    sharded = jaxwap.auto_shard(step, cache=False, verify=1, constraints={"blocks": "zero1"},
                                mesh_shape={"data": 4, "model": 1},
                                pipeline={"stages": 2, "micro_batches": 4})
    got = sharded(params, opt, batch)
    plan = sharded.plan
    blocks = [p for p in plan.params if p.path[0] == "blocks"]
    assert blocks and all(p.spec[0] == STAGE and DATA not in p.spec for p in blocks)
    assert all(DATA in p.state_spec for p in blocks), blocks
    assert not plan.step.stage_sharded
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)


def _wide_loss(params, batch):
    """Layers 8x wider inside than the activation they carry: what GPipe keeps per layer
    and micro-batch is 16 times the carried activation."""
    h = jnp.take(params["embed"], batch["x"], axis=0)                  # [B, T, D]

    def layer(h, w):
        return h + jnp.tanh(jnp.tanh(h @ w["w1"]) @ w["w2"]), None

    h, _ = jax.lax.scan(layer, h, params["blocks"])
    logits = h.mean(1) @ params["head"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][:, None], 1))


def _wide_setup(loss=_wide_loss):
    """(step, params, opt_state, batch) of `loss` (`_wide_loss`'s parameters), SGD."""
    rng = np.random.default_rng(0)
    f = lambda *s, scale=0.3: jnp.asarray(rng.standard_normal(s) * scale, jnp.float32)  # noqa: E731
    d, b, t = 128, 128, 16
    params = {"embed": f(V, d), "head": f(d, V),
              "blocks": {"w1": f(L, d, 8 * d, scale=d ** -0.5),
                         "w2": f(L, 8 * d, d, scale=(8 * d) ** -0.5)}}
    batch = {"x": jnp.asarray(rng.integers(0, V, (b, t)), jnp.int32),
             "y": jnp.asarray(rng.integers(0, V, (b,)), jnp.int32)}
    step = jaxwap.make_train_step(loss, optax.sgd(1e-2))
    return step, params, step.init(params), batch


def test_where_the_budget_binds_keeping_only_inputs_wins_even_where_a_schedule_fits(
        monkeypatch):
    """A budget between what the circular schedule keeps with 32 micro-batches and with
    16: 32 fits, but the budget binds (the 4 micro-batches the objective prefers do not
    fit), so the schedule keeping only each loop step's input is priced too, and with 4
    micro-batches it is predicted faster than 32 that keep what their layers keep: the
    plan takes it, as the objective ranks the two."""
    from jaxwap.search import pipeline_search

    step, params, opt, batch = _wide_setup()
    kw = dict(cache=False, verify=0, mesh_shape={"data": 4, "model": 1},
              strategies=("replicate",), objective="throughput")
    need = {}
    for mb in (16, 32):
        forced = jaxwap.plan(step, params, opt, batch, **kw,
                             pipeline={"stages": 2, "micro_batches": mb, "repeats": 4})
        assert forced.step.remat == "none"
        need[mb] = forced.predicted.peak_memory_bytes
    assert need[32] < need[16]
    priced = {}
    real = pipeline_search._priced

    def spy(*args):
        out = real(*args)
        priced[args[-1]] = out
        return out
    monkeypatch.setattr(pipeline_search, "_priced", spy)
    plan = jaxwap.plan(step, params, opt, batch, **kw, pipeline={"stages": 2},
                       memory_budget=(need[16] + need[32]) / 2)
    kept, binds = priced[False][0], priced[False][3]
    assert kept.fits and binds and kept.step.micro_batches == 32
    lean = priced[True][0]
    assert lean.fits and lean.step.micro_batches < 32
    assert lean.predicted.step_time_s < kept.predicted.step_time_s
    assert (plan.step.remat, plan.step.micro_batches) == ("stage", lean.step.micro_batches)


def test_where_gpipe_does_not_fit_loop_steps_keep_only_their_inputs_and_equal_the_step():
    """A budget below what GPipe's loop keeps (every layer's residuals for every
    micro-batch): the planner keeps only each loop step's input (`remat="stage"`), its
    predicted peak within 15% of XLA's compiled one, well below GPipe's compiled peak, and
    the step equals the unsharded one."""
    step, params, opt, batch = _wide_setup()
    kw = dict(cache=False, verify=1, mesh_shape={"data": 4, "model": 1},
              strategies=("replicate",),
              pipeline={"stages": 2, "micro_batches": 8, "repeats": 1})
    gpipe = jaxwap.plan(step, params, opt, batch, **kw)
    assert gpipe.step.remat == "none"
    budget = 0.7 * gpipe.predicted.peak_memory_bytes
    plan = jaxwap.plan(step, params, opt, batch, memory_budget=budget, **kw)
    assert (plan.step.stages, plan.step.remat) == (2, "stage")
    assert plan.predicted.peak_memory_bytes <= budget
    assert plan.predicted.peak_memory_bytes == pytest.approx(plan.compiled.memory_bytes,
                                                             rel=0.15)
    assert plan.compiled.memory_bytes < 0.6 * gpipe.compiled.memory_bytes
    assert "only its input kept" in plan.explain()
    # GPipe keeping only its inputs computes its bubble rather than idle (a stage share
    # of memory less): said, and priced busy
    assert not plan.step.bubble_idles and "run on no micro-batch" in plan.explain()
    assert plan.predicted.bubble_time_s == 0.0
    want = jax.jit(step)(params, opt, batch)
    got = jaxwap.auto_shard(step, cache=False, verify=0, memory_budget=budget,
                            **{k: v for k, v in kw.items() if k not in ("cache", "verify")}
                            )(params, opt, batch)
    for a, b_ in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b_), rtol=2e-5, atol=2e-6)


def _embedded_stack(layers):
    """(step, params, opt_state, batch), abstract: an MLP stack of `layers` blocks of d
    1024 under `lax.scan` between a tied 64k-row embedding and its head (Adam, batch
    256): the weights outside the stack about a third of the whole, as an LLM's."""
    S = jax.ShapeDtypeStruct
    d, rows, vocab = 1024, 256, 65536

    def loss(p, b):
        h = jnp.take(p["embed"], b["x"], axis=0).mean(1)

        def layer(h, w):
            return h + jax.nn.gelu(h @ w["up"]) @ w["down"], None

        h, _ = jax.lax.scan(layer, h, p["blocks"])
        logits = h @ p["embed"].T
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), b["y"][:, None], 1))

    params = {"embed": S((vocab, d), jnp.float32),
              "blocks": {"up": S((layers, d, 4 * d), jnp.float32),
                         "down": S((layers, 4 * d, d), jnp.float32)}}
    batch = {"x": S((rows, 8), jnp.int32), "y": S((rows,), jnp.int32)}
    step = jaxwap.make_train_step(loss, optax.adam(1e-4))
    return step, params, jax.eval_shape(step.init, params), batch


@pytest.mark.parametrize("layers, pipeline", [(8, {"stages": 4}), (10, {"stages": 4}),
                                              (8, {"stages": 4, "repeats": 2})])
def test_a_pipelined_plan_never_gets_slower_as_the_memory_budget_grows(layers, pipeline):
    """Four stages x data 2 on 8 H100s (abstract), GPipe or circular, the stack even or
    not (10 layers: stored split along another dim, its copy laid out by layers), planned
    at budgets from 0.5 to 1.5 GB: more memory never gives a slower plan. Two searches
    did: where the loop's holdings of the stage's share (a chunk's gradient and weights,
    an uneven or circular stack's copy) put every schedule over the budget, the stage
    step was solved again within less room than it was given, though it had needed far
    less (the same layouts three times, and a slower mesh or no plan: Llama 3 405B on
    Meta's own layout); and where the stage step fit only by offloading to host memory,
    the loop keeping only its inputs (room for faster layouts) was not priced."""
    args = _embedded_stack(layers)
    kw = dict(hardware=jaxwap.Cluster("h100-sxm", 8, devices_per_node=8), verify=0,
              cache=False, objective="throughput", pipeline=pipeline,
              mesh_shape={"data": 2, "model": 1})
    steps = []
    for budget in np.arange(0.5e9, 1.2e9, 0.02e9):
        try:
            plan = jaxwap.plan(*args, memory_budget=float(budget), **kw)
        except MemoryError:
            assert not steps, f"no plan at {budget / 1e9:.2f} GB, one at less"
            continue
        assert plan.step.stages == 4 and plan.predicted.peak_memory_bytes <= budget
        steps.append((float(budget), plan.predicted.step_time_s))
    assert len(steps) > 10       # the sweep reaches plans that fit
    for (b0, t0), (b1, t1) in zip(steps, steps[1:], strict=False):
        assert t1 <= t0 * (1 + 1e-9), f"{t1 * 1e3:.3f} ms at {b1 / 1e9:.2f} GB > " \
                                      f"{t0 * 1e3:.3f} ms at {b0 / 1e9:.2f} GB"


def test_stage_counts_tried_reach_from_the_fewest_stages_to_the_most():
    """At most four stage counts are traced. Even splits first, then powers of two, and
    within those, spread from the fewest stages to the most: Megatron's 529.6 B (105
    layers on 2,520 GPUs) runs 35 stages, Llama 3 405B (126 on 8,192) 16, Megatron's 1 T
    (128 on 3,072) 64; each is tried, where only the fewest were before (3, 5, 7, 15 and
    2, 4, 8, 16)."""
    from jaxwap.search.pipeline_shapes import stage_counts

    assert stage_counts(105, 2520, None) == [3, 7, 15, 35]
    assert stage_counts(126, 8192, None) == [2, 4, 16, 32]   # 2 is the only even split
    assert stage_counts(128, 3072, None) == [2, 8, 16, 64]
    assert stage_counts(48, 512, None) == [2, 4, 8, 16]      # four to try: all of them
    assert stage_counts(10, 8, None) == [2, 4]
    assert stage_counts(105, 2520, {"stages": 35}) == [35]


def test_a_step_with_no_scan_is_planned_without_tracing_its_loss_for_a_layer_scan(
        monkeypatch):
    """An unrolled MLP built by make_train_step on 8 H100s: the step's own trace has no
    scan, so the pipelined search says there is no layer scan without tracing the loss
    again to look for one; the note is the one looking gives."""
    from jaxwap.search import pipeline_search

    looked = []
    real = pipeline_search.find_layer_scan
    monkeypatch.setattr(pipeline_search, "find_layer_scan",
                        lambda *a: looked.append(1) or real(*a))
    S = jax.ShapeDtypeStruct

    def loss(p, b):
        h = b["x"]
        for w in p:
            h = h + jax.nn.gelu(h @ w)
        return jnp.mean((h - b["y"]) ** 2)

    params = [S((64, 64), jnp.float32) for _ in range(4)]
    batch = {"x": S((32, 64), jnp.float32), "y": S((32, 64), jnp.float32)}
    step = jaxwap.make_train_step(loss, optax.adam(1e-3))
    plan = jaxwap.plan(step, params, jax.eval_shape(step.init, params), batch,
                       hardware=jaxwap.Cluster("h100-sxm", 8), verify=0, cache=False)
    assert looked == [] and plan.step.stages == 1
    assert any("the loss function has no lax.scan over stacked parameters" in n
               for n in plan.notes), plan.notes


def _closes_over_rows(width):
    """An 8-layer stack whose layers read a [B, width] value computed from the batch."""
    rng = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[-1]), jnp.float32)  # noqa: E731
    params = {"a": f(32, 64), "w": f(L, 64, 64), "z": f(64, 4)}
    batch = {"x": f(64, 32), "y": jnp.zeros((64, 4), jnp.float32)}

    def loss(p, b):
        c = jnp.tanh(b["x"][:, :1] * jnp.linspace(0.0, 1.0, width))    # [64, width]
        h, _ = jax.lax.scan(lambda h, w: (h + jnp.tanh(h @ w) * c.mean(1, keepdims=True),
                                          None), b["x"] @ p["a"], p["w"])
        return jnp.mean((h @ p["z"] - b["y"]) ** 2)
    step = jaxwap.make_train_step(loss, optax.sgd(0.1))
    return step, params, step.init(params), batch


def test_what_the_layers_close_over_with_the_batchs_rows_is_priced_as_the_loop_holds_it():
    """The loop takes such a value in cut into micro-batches and holds the local batch's
    rows of it through both loops: a [64, 16384] float32 value on 2 stages x 4 data
    devices is 1 MB a device. The model's peak rises by at least that, and by no more
    than XLA's compiled peak does (the stage step alone held one micro-batch's: 0.48 MB
    of XLA's 2.03 MB rise)."""
    figures = {}
    for width in (16, 16384):
        step, params, opt, batch = _closes_over_rows(width)
        plan = jaxwap.plan(step, params, opt, batch, verify=1, cache=False, num_devices=8,
                           pipeline={"stages": 2, "micro_batches": 4},
                           strategies=("replicate",))
        assert dict(plan.mesh_shape) == {STAGE: 2, DATA: 4, MODEL: 1}
        figures[width] = (plan.predicted.peak_memory_bytes, plan.compiled.memory_bytes)
    held = 64 / 4 * (16384 - 16) * 4
    predicted = figures[16384][0] - figures[16][0]
    compiled = figures[16384][1] - figures[16][1]
    assert held <= predicted <= compiled, (held, figures)
