"""A step written for one device gives the same numbers under auto_shard."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from models import CNN, MLP, BNNet, copy_tree, make_bn_step, run_both, setup

import jaxwap

# float32 on CPU: sharded reductions sum in a different order, so results agree to
# rounding, not bit for bit. 3 adam steps with lr 1e-2 stay well inside this.
RTOL, ATOL = 2e-5, 2e-6

SLOW_LINKS = jaxwap.DeviceSpec(
    "slow-link-test", peak_flops=1e12, memory_bandwidth=1e11, memory_bytes=3e6,
    idle_watts=10, max_watts=100, kernel_overhead_s=1e-6, link_bandwidth=1e9,
    link_latency_s=1e-6)


def assert_trees_close(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y),
                                                         rtol=RTOL, atol=ATOL), a, b)


@pytest.mark.parametrize("num_devices", [8, 4])
def test_mlp_data_parallel_matches_single_device(num_devices):
    step, params, opt, batch = setup(MLP(), (32, 16))
    ref, out, sharded = run_both(step, params, opt, batch, num_devices=num_devices,
                                 hardware=jaxwap.Cluster("h100-sxm", 8))
    plan = sharded.plan
    # data parallel, as the name says: every device on the data axis, no parameter split
    # over another axis, and the compiled step takes each batch leaf split on its rows
    # over that axis (XLA's own input shardings, not the plan's record of them)
    assert plan.num_devices == num_devices
    assert plan.mesh_shape.get("data") == num_devices
    assert all(a in (None, "data") for pl in plan.params for a in pl.spec)
    compiled = sharded.lower_and_compile(params, opt, batch)
    flat = compiled.input_shardings[0]   # the step is compiled on its flat leaves
    batch_shardings = flat[len(flat) - len(jax.tree.leaves(batch)):]
    for sh in batch_shardings:
        assert tuple(sh.spec)[:1] == ("data",), sh
    assert_trees_close(ref[0], out[0])
    assert_trees_close(ref[1], out[1])
    np.testing.assert_allclose(ref[2]["loss"], out[2]["loss"], rtol=RTOL)


def test_cnn_matches_single_device():
    step, params, opt, batch = setup(CNN(), (16, 16, 16, 3), tx=optax.sgd(0.05, momentum=0.9))
    ref, out, sharded = run_both(step, params, opt, batch,
                                 hardware=jaxwap.Cluster("h100-sxm", 8), num_devices=8)
    assert sharded.plan.mesh_shape["data"] > 1
    assert_trees_close(ref[0], out[0])


def test_slow_links_and_little_memory_plan_tensor_parallel_with_zero1_state():
    """Slow links and 3 MB per device: the planner splits the kernels column / row over the
    model axis and, to fit, shards every other parameter's optimizer state over the data
    axis (ZeRO-1: weights not sharded over data), a column-parallel kernel's bias split
    with it. The momentum comes back laid out as the plan
    says and the numbers match. (Since the memory model credits the activations the model
    axis splits, this fits without host offload; FSDP and offload are forced and tested in
    tests/test_equivalence_layouts.py.)"""
    model = MLP((512, 512, 512, 16))
    # SGD: Adam's g/sqrt(v) turns rounding noise in near-zero gradients into full steps
    step, params, opt, batch = setup(model, (256, 64), num_classes=16,
                                     tx=optax.sgd(0.1, momentum=0.9))
    # the analytic plan (verify=0): XLA's figures for so small a program would move it
    ref, out, sharded = run_both(step, params, opt, batch, objective="throughput",
                                 hardware=jaxwap.Cluster(SLOW_LINKS, 8), verify=0)
    plan = sharded.plan
    strategies = {p.strategy for p in plan.params}
    assert plan.mesh_shape["model"] > 1 and plan.mesh_shape["data"] > 1
    assert any(s.startswith("tp-col") for s in strategies), strategies
    assert any(s.startswith("tp-row") for s in strategies), strategies
    placed = {p.keystr: p for p in plan.params}
    for p in plan.params:
        kernel = placed.get(p.keystr.replace("['bias']", "['kernel']"))
        if p.keystr.endswith("['bias']") and kernel.strategy.startswith("tp-col"):
            # a column-parallel kernel's bias is split with it (its one dim taken by the
            # model axis, its state with it), so XLA gathers nothing after the update
            assert (p.strategy, p.spec) == ("tp-col", ("model",)), p
            continue
        assert p.state_spec is not None and "data" in p.state_spec, p    # ZeRO-1 state
        assert "data" not in p.spec and "zero1" in p.strategy, p          # not FSDP
    # it fits by XLA's own memory analysis of the compiled step, not only by the model
    # (nothing is offloaded, so XLA:CPU's figure is the whole of it)
    assert not any(p.offload for p in plan.params)
    mem = sharded.lower_and_compile(params, opt, batch).memory_analysis()
    xla_bytes = (mem.argument_size_in_bytes + mem.output_size_in_bytes
                 + mem.temp_size_in_bytes - mem.alias_size_in_bytes)
    assert xla_bytes <= SLOW_LINKS.memory_bytes, xla_bytes
    trace = out[1][0].trace
    for path, leaf in jax.tree_util.tree_flatten_with_path(trace)[0]:
        p = placed[jax.tree_util.keystr(path)]
        assert tuple(leaf.sharding.spec) == tuple(p.state_spec or p.spec), p
        assert leaf.sharding.memory_kind == ("pinned_host" if p.offload else "device"), p
    assert_trees_close(ref[0], out[0])
    assert_trees_close(ref[1], out[1])


def test_outputs_keep_the_plans_shardings_and_the_step_is_reused():
    step, params, opt, batch = setup(MLP((64, 64, 10)), (32, 16))
    sharded = jaxwap.auto_shard(step, params, hardware=jaxwap.Cluster(SLOW_LINKS, 8),
                                objective="throughput")
    p, o, _ = sharded(copy_tree(params), copy_tree(opt), batch)
    plan = sharded.plan
    specs = plan.param_specs
    got = jax.tree.map(lambda a: a.sharding.spec, p)
    assert jax.tree.structure(got) == jax.tree.structure(specs)
    for g, s in zip(jax.tree.leaves(got, is_leaf=lambda x: isinstance(x, jax.P)),
                    jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.P)),
                    strict=True):
        assert tuple(g) == tuple(s) or (all(e is None for e in g) and all(e is None for e in s))
    # adam moments mirror the params: same shardings
    mu = o[0].mu
    for a, b in zip(jax.tree.leaves(mu), jax.tree.leaves(p), strict=True):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    # feeding the outputs back reuses the compiled step and keeps the plan
    before = len(sharded._execs)
    p, o, _ = sharded(p, o, batch)
    assert len(sharded._execs) == before and sharded.plan is plan


def test_new_shapes_plan_again():
    step, params, opt, batch = setup(MLP(), (32, 16))
    sharded = jaxwap.auto_shard(step, params, hardware=jaxwap.Cluster("h100-sxm", 8))
    sharded(copy_tree(params), copy_tree(opt), batch)
    first = sharded.plan
    small = jax.tree.map(lambda a: a[:8], batch)
    sharded(copy_tree(params), copy_tree(opt), small)
    assert sharded.plan.batch_size == 8 and first.batch_size == 32


def test_decorator_forms_and_train_state():
    from flax.training import train_state

    model = MLP()
    _, params, _, batch = setup(model, (32, 16))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                          tx=optax.adam(1e-2))

    def loss_fn(p, b):
        logits = model.apply(p, b["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    def train_step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), {"loss": loss}

    ref_state = jax.jit(train_step)(copy_tree(state), batch)[0]

    @jaxwap.auto_shard
    def bare(state, batch):
        return train_step(state, batch)

    @jaxwap.auto_shard(objective="throughput", hardware=jaxwap.Cluster("h100-sxm", 8),
                       num_devices=8)
    def configured(state, batch):
        return train_step(state, batch)

    for wrapped in (bare, configured):
        new_state, _ = wrapped(copy_tree(state), batch)
        assert_trees_close(ref_state.params, new_state.params)
    # the TrainState's params and adam moments were recognised as parameters
    plan = configured.plan
    assert plan.num_devices == 8
    assert len(plan.params) == len(jax.tree.leaves(params))
    mu = new_state.opt_state[0].mu
    for a, b in zip(jax.tree.leaves(mu), jax.tree.leaves(new_state.params), strict=True):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)


def test_shard_places_a_tree_like_the_plan():
    step, params, opt, batch = setup(MLP((512, 512, 512, 16)), (16, 64), num_classes=16)
    sharded = jaxwap.auto_shard(step, params, hardware=jaxwap.Cluster(SLOW_LINKS, 8),
                                objective="throughput")
    sharded.plan_for(params, opt, batch)
    placed = sharded.shard(params)
    for leaf, pl in zip(jax.tree.leaves(placed), sharded.plan.params, strict=True):
        assert tuple(leaf.sharding.spec) == tuple(pl.spec)
    placed_batch = sharded.shard(batch)
    d = sharded.plan.mesh_shape["data"]
    assert placed_batch["x"].addressable_shards[0].data.shape[0] == 16 // d


def test_nnx_state_params_and_their_optimizer_moments():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.l1 = nnx.Linear(16, 64, rngs=rngs)
            self.l2 = nnx.Linear(64, 10, rngs=rngs)

        def __call__(self, x):
            return self.l2(jax.nn.relu(self.l1(x)))

    graphdef, params = nnx.split(Net(nnx.Rngs(0)), nnx.Param)
    tx = optax.adam(1e-2)
    opt = tx.init(params)

    def step(params, opt_state, batch):
        def loss_fn(p):
            logits = nnx.merge(graphdef, p)(batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss}

    batch = {"x": jax.random.normal(jax.random.key(1), (32, 16)),
             "y": jax.numpy.arange(32) % 10}
    # params omitted: the first argument (an nnx.State) is taken as the parameters
    ref, out, sharded = run_both(step, params, opt, batch, objective="throughput",
                                 hardware=jaxwap.Cluster("h100-sxm", 8), num_devices=8,
                                 pass_params=False)
    assert len(sharded.plan.params) == 4
    assert_trees_close(ref[0], out[0])
    # each Adam moment is laid out as the plan lays out its parameter's optimizer state
    # (the weight's layout, or ZeRO-1's where the plan shards the state further)
    mu = out[1][0].mu
    mesh = sharded.mesh
    for a, p in zip(jax.tree.leaves(mu), sharded.plan.params, strict=True):
        want = NamedSharding(mesh, P(*p.layout_of_state))
        assert a.sharding.is_equivalent_to(want, a.ndim), (p.keystr, a.sharding, want)


def test_python_scalars_and_keyword_arguments():
    model = MLP()
    _, params, _, batch = setup(model, (32, 16))

    def sgd_step(params, batch, lr, *, scale=1.0):
        def loss_fn(p):
            logits = model.apply(p, batch["x"]) * scale
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss

    sharded = jaxwap.auto_shard(sgd_step, hardware=jaxwap.Cluster("h100-sxm", 8),
                                num_devices=8)
    ref = jax.jit(sgd_step)(copy_tree(params), batch, 0.1, scale=2.0)
    out = sharded(copy_tree(params), batch, 0.1, scale=2.0)
    assert_trees_close(ref, out)
    # a different learning rate value is the same signature: no new plan or compile
    sharded(out[0], batch, 0.05, scale=2.0)
    assert len(sharded._execs) == 1


@pytest.mark.parametrize("channels", [16, 24])
def test_batch_norm_statistics_are_state_not_data(channels):
    """Running statistics the step hands back are carried state: never split as data, even
    when they outnumber the batch leaves or their length equals the batch size."""
    model, tx = BNNet(channels, layers=3), optax.sgd(0.05, momentum=0.9)
    x = jax.random.normal(jax.random.key(0), (16, 8, 8, 3))
    y = jax.numpy.arange(16) % 10
    variables = model.init(jax.random.key(1), x)
    params, stats = variables["params"], variables["batch_stats"]
    step = make_bn_step(model, tx)

    batch = {"x": x, "y": y}
    ref = (copy_tree(params), copy_tree(stats), tx.init(params))
    single = jax.jit(step)
    sharded = jaxwap.auto_shard(step, params, hardware=jaxwap.Cluster("h100-sxm", 8),
                                num_devices=8, objective="throughput")
    out = (copy_tree(params), copy_tree(stats), tx.init(params))
    for _ in range(2):
        ref = single(*ref, batch)[:3]
        out = sharded(*out, batch)[:3]
    assert sharded.plan.batch_size == 16
    for leaf in jax.tree.leaves(out[1]):
        assert leaf.sharding.is_fully_replicated
    assert_trees_close(ref[0], out[0])
    assert_trees_close(ref[1], out[1])
