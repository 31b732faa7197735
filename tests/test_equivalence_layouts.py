"""Every layout jaxwap can choose gives the single-device numbers.

Each test forces a layout through the public knobs (`strategies=`, `mesh_shape=`,
`num_devices=`, `memory_budget=`), asserts that the plan really is that layout and that the
arrays the step returns really are placed that way, and compares the state after a few
steps with `jax.jit(step)` on one device run on deep copies (auto_shard donates its state
arguments). Models are tiny and plans analytic (`verify=0`) where XLA's verification is not
what is tested: each sharded test compiles one program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P
from models import CNN, MLP, TypedMLP, copy_tree, host_setup

import jaxwap
from benchmarks.models import zoo
from jaxwap.decide.xla_figures import compiled_figures

# float32: a sharded program sums its reductions (the batch mean, split contractions) in
# another order, so results agree to rounding, not bit for bit.
RTOL, ATOL = 2e-5, 2e-6
H100X8 = jaxwap.Cluster("h100-sxm", 8)
PINNED_HOST = "pinned_host"


# ------------------------------------------------------------------ helpers
def reference(step, args, n_steps):
    """`n_steps` of `jax.jit(step)` on one device from deep copies of the state; the batch
    (the last argument) is the same every step. Returns the outputs of the last step."""
    state, batch = copy_tree(args[:-1]), args[-1]
    single = jax.jit(step)
    for _ in range(n_steps):
        *state, metrics = single(*state, batch)
    return (*state, metrics)


def sharded_run(sharded, args, n_steps):
    """The same under a `jaxwap.auto_shard` step, feeding its returned state back."""
    state, batch = copy_tree(args[:-1]), args[-1]
    for _ in range(n_steps):
        *state, metrics = sharded(*state, batch)
    return (*state, metrics)


def assert_close(a, b, rtol=RTOL, atol=ATOL):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(
        np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=rtol, atol=atol), a, b)


def by_path(tree):
    """{keystr: leaf}; the keys are the plan's `ParamPlacement.keystr` for a params tree
    (and for an optimizer moment, which mirrors it)."""
    return {jax.tree_util.keystr(p): leaf
            for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def placements(plan):
    return {p.keystr: p for p in plan.params}


def shard_shape(shape, spec, mesh_shape):
    """The per-device shape of an array of `shape` laid out as `spec`."""
    return tuple(n // (mesh_shape[axis] if axis else 1)
                 for n, axis in zip(shape, tuple(spec) + (None,) * len(shape), strict=False))


def assert_laid_out(leaf, spec, mesh_shape, memory_kind="device"):
    """`leaf` is on the whole mesh as `spec` says: its spec, the shape each device holds,
    and its memory kind."""
    want = tuple(spec)
    got = tuple(leaf.sharding.spec) + (None,) * (leaf.ndim - len(leaf.sharding.spec))
    assert got == want, (got, want)
    assert leaf.addressable_shards[0].data.shape == shard_shape(leaf.shape, want, mesh_shape)
    assert len(leaf.sharding.device_set) == int(np.prod(list(mesh_shape.values())))
    assert leaf.sharding.memory_kind == memory_kind


def assert_biases_follow_their_kernels(where):
    """Megatron's layout: a bias meets its kernel's output, so it is split with a column-
    parallel kernel (over its one dim, the output features) and whole beside any other,
    a row-parallel one adding it to the all-reduced sum."""
    for k, pl in where.items():
        if k.endswith("['bias']"):
            col = where[k.replace("['bias']", "['kernel']")].strategy == "tp-col"
            assert (pl.strategy, pl.spec) == (("tp-col", ("model",)) if col
                                              else ("replicate", (None,))), (k, pl)


def mlp_args(widths=(64, 64, 10), batch=32, in_dim=16, tx=None):
    step, params, opt, data = host_setup(MLP(widths), (batch, in_dim),
                                         num_classes=widths[-1], tx=tx)
    return step, (params, opt, data)


# ------------------------------------------------------------------ FSDP
def test_forced_fsdp_shards_every_divisible_parameter_over_data_and_matches_single_device():
    step, args = mlp_args()
    sharded = jaxwap.auto_shard(step, args[0], strategies=("fsdp",), num_devices=4,
                                verify=0, cache=False)
    p, o, m = sharded_run(sharded, args, 3)
    plan = sharded.plan
    assert dict(plan.mesh_shape) == {"data": 4, "model": 1}
    # every parameter with a dim the data axis divides is FSDP (weight, gradient and Adam
    # moments over data); only the (10,) output bias cannot be and stays replicated
    for pl in plan.params:
        if any(n % 4 == 0 for n in pl.shape):
            assert pl.strategy == "fsdp" and "data" in pl.spec, pl
        else:
            assert pl.strategy == "replicate" and pl.shape == (10,), pl
    assert sum(pl.strategy == "fsdp" for pl in plan.params) == 5
    # what comes back is sharded as planned: each device holds a quarter of an FSDP weight
    # and of both of its Adam moments
    where = placements(plan)
    for tree in (p, o[0].mu, o[0].nu):
        for key, leaf in by_path(tree).items():
            assert_laid_out(leaf, where[key].spec, plan.mesh_shape)
    kernel = p["params"]["Dense_1"]["kernel"]
    assert kernel.addressable_shards[0].data.size == kernel.size // 4
    ref = reference(step, args, 3)
    assert_close(ref, (p, o, m))


def test_forced_fsdp_gathers_an_embedding_table_split_on_its_features_before_the_lookup():
    # a vocabulary of 257 (prime): the data axis can only split the tied embedding table
    # on its 64 features. Left to XLA, the lookup's result takes the table's sharding and
    # the whole network runs feature-split over the whole batch (its logits all-reduced
    # whole: 2.5 MB of collectives here); the step gathers the table first, as FSDP
    # gathers any weight, and sends what the model prices.
    w = zoo.small("gpt2", vocab=257)
    args = w.init(0)
    sharded = jaxwap.auto_shard(w.step, w.params, strategies=("fsdp",), num_devices=2,
                                verify=0, cache=False)
    out = sharded_run(sharded, args, 2)
    plan = sharded.plan
    table = placements(plan)["['wte']['embedding'].value"]
    assert (table.strategy, table.shape, table.spec) == ("fsdp", (257, 64), (None, "data"))
    assert_laid_out(by_path(out[0])["['wte']['embedding'].value"], table.spec,
                    plan.mesh_shape)
    figs = compiled_figures(sharded.lower_and_compile(*args), (2, 1), H100X8)
    assert figs.comm_bytes <= 1.05 * plan.predicted.comm_bytes, (
        figs.comm_bytes, plan.predicted.comm_bytes)
    assert_close(reference(w.step, args, 2), out)


# ------------------------------------------------------------------ tensor parallelism
def test_forced_tensor_parallel_splits_conv_kernels_over_the_model_axis():
    # SGD: Adam's g / sqrt(v) would turn rounding noise in near-zero gradients into steps
    step, *args = host_setup(CNN(), (16, 8, 8, 3), tx=optax.sgd(0.05, momentum=0.9))
    sharded = jaxwap.auto_shard(step, args[0], strategies=("tp",),
                                mesh_shape={"data": 1, "model": 4}, verify=0, cache=False)
    p, o, m = sharded_run(sharded, args, 3)
    plan = sharded.plan
    assert dict(plan.mesh_shape) == {"data": 1, "model": 4}
    where = placements(plan)
    conv = {k: v for k, v in where.items() if "Conv" in k and k.endswith("['kernel']")}
    assert len(conv) == 2
    for pl in conv.values():
        # HWIO: column parallel splits the output channels (dim 3), row the input ones (2)
        assert pl.strategy in ("tp-col", "tp-row"), pl
        channel = 3 if pl.strategy == "tp-col" else 2
        assert pl.spec == tuple("model" if i == channel else None for i in range(4)), pl
    # the 3-channel first conv can only be split by its 16 output channels
    assert where["['params']['Conv_0']['kernel']"].strategy == "tp-col"
    # the dense kernels too; each bias split with its kernel exactly where that is column
    # parallel
    assert {where[k].strategy for k in where if k.endswith("['kernel']")} <= {"tp-col", "tp-row"}
    assert_biases_follow_their_kernels(where)
    for tree in (p, o[0].trace):
        for key, leaf in by_path(tree).items():
            assert_laid_out(leaf, where[key].spec, plan.mesh_shape)
    assert_close(reference(step, args, 3), (p, o, m))


@pytest.fixture(scope="module")
def gpt2():
    """GPT-2 (small, from the zoo: 2 layers, d 64, 4 heads, Adam 3e-4), its own
    initialisation and 2 single-device steps: shared by the tests that shard it.

    `init`, not `synthetic`: the key bias's true gradient is zero (softmax ignores a shift
    shared by every key), so Adam, which divides each gradient element by its own size,
    turns its rounding noise into steps of up to lr. With GPT-2's initialisation (std 0.02)
    that noise stays far below Adam's eps and both sides agree to float32 rounding; with
    N(0, 1/fan_in) weights it does not (seen: key-bias elements 5e-5 apart)."""
    w = zoo.small("gpt2")
    args = w.init(0)
    return w, args, reference(w.step, args, 2)


def test_forced_tensor_parallel_on_gpt2_is_megatron_mlp_and_no_column_split_qkv(gpt2):
    w, args, ref = gpt2
    sharded = jaxwap.auto_shard(w.step, w.params, strategies=("tp",),
                                mesh_shape={"data": 2, "model": 2}, verify=0, cache=False)
    out = sharded_run(sharded, args, 2)
    plan = sharded.plan
    assert dict(plan.mesh_shape) == {"data": 2, "model": 2}
    where = placements(plan)
    # per block: the MLP's first layer splits its output (column), its second its input
    # (row): one all-reduce for the pair, no gather in between. The fused q/k/v
    # projection is not column-parallel (q, k and v cut its split: XLA reshuffles them)
    # and the attention projection's column split would reach the residual stream, so
    # under "tp" alone both are row-parallel
    expect = {"['attn']['qkv']['kernel']": ("tp-row", ("model", None)),
              "['attn']['proj']['kernel']": ("tp-row", ("model", None)),
              "['mlp']['fc']['kernel']": ("tp-col", (None, "model")),
              "['mlp']['proj']['kernel']": ("tp-row", ("model", None))}
    for block in range(2):
        for name, (strategy, spec) in expect.items():
            pl = where[f"['blocks'][{block}]{name}.value"]
            assert (pl.strategy, pl.spec) == (strategy, spec), pl
    for key, leaf in by_path(out[0]).items():
        assert_laid_out(leaf, where[key].spec, plan.mesh_shape)
    fc = by_path(out[0])["['blocks'][0]['mlp']['fc']['kernel'].value"]
    assert fc.addressable_shards[0].data.shape == (64, 128)      # [64, 256] over 2
    assert_close(ref, out)


def test_forced_tensor_parallel_on_llama_is_megatron_with_sibling_layers_and_matches():
    """A Llama block's siblings take one kind: q, k, v and gate, up column-parallel, o
    and down row-parallel; two steps on a 2x2 mesh equal the single-device steps. AdamW
    divides each gradient element by its own size, so an element whose gradient is near
    zero turns float32 rounding of the split sums into parameter differences of up to a
    few 1e-6 (seen: 6e-6 on 1 of 8192): the absolute tolerance is 2e-5, lr / 15."""
    w = zoo.llama("llama_tiny", dtype=jnp.float32, batch_size=8)
    args = w.init(0)
    ref = reference(w.step, args, 2)
    sharded = jaxwap.auto_shard(w.step, w.params, strategies=("tp",),
                                mesh_shape={"data": 2, "model": 2}, verify=0, cache=False)
    out = sharded_run(sharded, args, 2)
    kinds = {"q": "tp-col", "k": "tp-col", "v": "tp-col", "o": "tp-row",
             "gate": "tp-col", "up": "tp-col", "down": "tp-row"}
    seen = set()
    for pl in sharded.plan.params:
        layer = next((str(k) for k in pl.path if str(k) in kinds), None)
        if layer is not None and "blocks" in [str(k) for k in pl.path]:
            assert pl.strategy == kinds[layer], pl
            seen.add(layer)
    assert seen == set(kinds)
    assert_close(ref, out, atol=2e-5)


# ------------------------------------------------------------------ ZeRO-1 and host offload
def test_forced_zero1_shards_only_the_optimizer_state_and_matches_single_device():
    step, args = mlp_args()
    sharded = jaxwap.auto_shard(step, args[0], strategies=("zero1",),
                                mesh_shape={"data": 4}, verify=0, cache=False)
    p, o, m = sharded_run(sharded, args, 3)
    plan = sharded.plan
    assert dict(plan.mesh_shape) == {"data": 4, "model": 1}
    for pl in plan.params:
        if pl.shape == (10,):   # no dim 4 divides: replicated, state and all
            assert (pl.strategy, pl.state_spec) == ("replicate", None)
            continue
        assert pl.strategy == "zero1" and not pl.offload, pl
        assert all(a is None for a in pl.spec) and "data" in pl.state_spec, pl
    where = placements(plan)
    for key, leaf in by_path(p).items():                 # weights: whole on every device
        assert leaf.sharding.is_fully_replicated, key
    for tree in (o[0].mu, o[0].nu):                      # Adam moments: a quarter each
        for key, leaf in by_path(tree).items():
            assert_laid_out(leaf, where[key].layout_of_state, plan.mesh_shape)
    assert_close(reference(step, args, 3), (p, o, m))


@pytest.mark.parametrize("family, extra, kinds, whole", [
    ("zero1", 0, {"all-reduce", "all-gather"}, True),
    ("fsdp", 3, {"all-reduce", "all-gather", "all-to-all"}, False)])
def test_forced_sharding_on_resnet50_small_gathers_each_weight_once_and_matches_single_device(
        family, extra, kinds, whole):
    """ZeRO-1 and FSDP on a batch-norm network compile to what they mean: each weight
    all-gathered once a step (under FSDP a 3x3 kernel's reversed copy for the input
    gradient again, and the head's activations moved), the numbers those of one device.

    ZeRO-1: told only the split optimizer state, XLA had split the batch norms' statistics
    too and gathered them back where the forward and backward passes read them (92
    all-gathers for 29 weights, measured 2.2x the data-parallel step on the two-process
    cluster); the step pins each ZeRO-1 gradient to its weight's layout where it is made
    (`runtime.grad_pins`). FSDP: a split batch-norm scale split the statistics computed with it,
    gathered back wherever they met the batch (86 all-gathers for 29 weights); the step
    gathers such a scale first and keeps its gradient whole (`compile.gathered_first`)."""
    w = zoo.small("resnet50")
    args = w.synthetic(0)
    sharded = jaxwap.auto_shard(w.step, w.params, strategies=(family,),
                                mesh_shape={"data": 2}, verify=1, cache=False)
    out = sharded_run(sharded, args, 2)
    plan = sharded.plan
    assert dict(plan.mesh_shape) == {"data": 2, "model": 1}
    assert {pl.strategy for pl in plan.params} == {family}
    gathers = [c for c in plan.compiled.collectives if c.kind == "all-gather"]
    assert sum(c.buffers for c in gathers) == len(plan.params) + extra
    assert {c.kind for c in plan.compiled.collectives} == kinds
    for leaf in jax.tree.leaves(out[0]):   # ZeRO-1's weights whole, FSDP's split
        assert leaf.sharding.is_fully_replicated == whole
    assert_close_adam(reference(w.step, args, 2), out, lr=1e-3, n_steps=2)


@pytest.mark.parametrize("families", [("offload",), ("zero1", "offload")])
def test_forced_host_offload_keeps_the_optimizer_state_in_pinned_host_memory(families):
    # XLA:CPU ignores memory kinds when it runs the program, but the arrays must still carry
    # them, the step must compile with the moves in and out, and the numbers must match
    step, args = mlp_args()
    # with ZeRO-1 allowed, it is pinned wherever the data axis divides (which of the two
    # the model prefers follows from the host's cores), so the (10,) bias that no axis
    # divides is the one left to host memory (plain replication is not allowed)
    pins = {} if families == ("offload",) else {"kernel|Dense_[01]/bias": "zero1"}
    sharded = jaxwap.auto_shard(step, args[0], strategies=families, constraints=pins,
                                mesh_shape={"data": 4}, verify=0, cache=False)
    p, o, m = sharded_run(sharded, args, 3)
    plan = sharded.plan
    where = placements(plan)
    assert {pl.strategy for pl in plan.params} == (
        {"replicate+offload"} if families == ("offload",)
        else {"zero1, pinned", "replicate+offload"})
    assert where["['params']['Dense_2']['bias']"].offload
    for tree in (o[0].mu, o[0].nu):
        for key, leaf in by_path(tree).items():
            pl = where[key]
            assert_laid_out(leaf, pl.layout_of_state, plan.mesh_shape,
                            PINNED_HOST if pl.offload else "device")
    for leaf in jax.tree.leaves(p):                      # the weights stay in device memory
        assert leaf.sharding.memory_kind == "device"
    assert_close(reference(step, args, 3), (p, o, m))


# ------------------------------------------------------------------ micro-batches
def test_micro_batched_plan_on_four_devices_equals_the_full_batch_step():
    model = CNN()
    _, params, _, batch = host_setup(model, (64, 8, 8, 3))

    def loss_fn(p, b):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, b["x"]),
                                                               b["y"]).mean()

    step = jaxwap.make_train_step(loss_fn, optax.adam(1e-2))
    args = (params, step.init(params), batch)
    # the analytic plan (verify=0: each compile to check a candidate costs seconds here):
    # 60% of what the plan with room needs on 4 devices; activations dominate, so no layout
    # frees enough and the planner splits the batch
    roomy = jaxwap.plan(step, *args, num_devices=4, verify=0, cache=False)
    sharded = jaxwap.auto_shard(step, params, num_devices=4, verify=0, cache=False,
                                memory_budget=0.6 * roomy.predicted.peak_memory_bytes)
    out = sharded_run(sharded, args, 2)
    plan = sharded.plan
    assert roomy.step.micro_batches == 1
    assert plan.step.micro_batches > 1 and plan.num_devices == 4
    assert plan.predicted.peak_memory_bytes <= 0.6 * roomy.predicted.peak_memory_bytes
    assert all(len(leaf.sharding.device_set) == 4 for leaf in jax.tree.leaves(out[0]))
    # micro-batching sums k partial means instead of one mean: rounding differs a little
    # more than sharding alone makes it (the same tolerance as tests/test_memory.py)
    assert_close(reference(step, args, 2), out, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ odd device counts
@pytest.fixture(scope="module")
def mlp_210():
    """An MLP on a batch of 210 = 2 * 3 * 5 * 7 rows and its 2 single-device steps."""
    step, args = mlp_args(batch=210)
    return step, args, reference(step, args, 2)


@pytest.mark.parametrize("n", [3, 5, 6, 7])
def test_meshes_of_three_five_six_and_seven_devices_match_single_device(n, mlp_210):
    step, args, ref = mlp_210
    sharded = jaxwap.auto_shard(step, args[0], num_devices=n, hardware=H100X8, verify=0,
                                cache=False)
    out = sharded_run(sharded, args, 2)
    plan = sharded.plan
    assert plan.num_devices == n and len(plan.device_ids) == n
    for leaf in jax.tree.leaves(out[:2]):
        assert len(leaf.sharding.device_set) == n
    # the batch is split over the data axis (210 divides by every n here)
    assert plan.mesh_shape["data"] > 1
    assert_close(ref, out)


# ------------------------------------------------------------------ any mesh, any width
def _meshes():
    """(data, model) meshes of 1 to 8 devices, every factorisation."""
    return st.integers(1, 8).flatmap(lambda n: st.sampled_from(
        [(n // m, m) for m in range(1, n + 1) if n % m == 0]))


@settings(max_examples=5, deadline=None)
@given(mesh=_meshes(), hidden=st.integers(4, 32))
def test_any_mesh_and_width_with_tensor_parallel_matches_single_device(mesh, hidden):
    """A mesh of 1 to 8 devices split any way between data and model, and a hidden width
    the model axis may or may not divide: tensor parallelism where it can split a kernel,
    replication where it cannot, and the single-device numbers either way. (Each example
    compiles twice, so a handful per run: successive runs try other meshes and widths.)"""
    data, model = mesh
    kernels = [(8, hidden), (hidden, hidden), (hidden, 6)]
    # a model axis must have something to split: tensor parallelism forced, and a kernel dim
    # it divides (with none, the plan is refused, as it should be)
    assume(model == 1 or any(n % model == 0 for shape in kernels for n in shape))
    step, args = mlp_args(widths=(hidden, hidden, 6), batch=4 * data, in_dim=8,
                          tx=optax.sgd(0.1, momentum=0.9))
    tp = ("tp",) if model > 1 else None
    sharded = jaxwap.auto_shard(step, args[0], mesh_shape={"data": data, "model": model},
                                strategies=tp, verify=0, cache=False)
    out = sharded_run(sharded, args, 2)
    plan = sharded.plan
    assert dict(plan.mesh_shape) == {"data": data, "model": model}
    assert all(len(leaf.sharding.device_set) == data * model for leaf in jax.tree.leaves(out[0]))
    for pl in plan.params if model > 1 else ():
        if len(pl.shape) == 2 and any(n % model == 0 for n in pl.shape):
            assert pl.strategy in ("tp-col", "tp-row"), pl
        elif len(pl.shape) == 2:     # kernels the model axis does not divide
            assert pl.strategy == "replicate", pl
    if model > 1:
        assert_biases_follow_their_kernels(placements(plan))
    assert_close(reference(step, args, 2), out)


# ------------------------------------------------------------------ the zoo
def assert_close_adam(a, b, lr, n_steps, max_outliers=1e-4):
    """The float32 tolerance for all but a fraction `max_outliers` of the elements, and
    Adam's largest move for those. Adam divides each gradient element by its own size, so
    an element whose gradient is as small as Adam's eps (1e-8) is mostly rounding noise, and
    its update carries that noise at full scale: up to lr per step (seen: one ResNet kernel
    element off by 1.7e-5, 1.7% of lr, after the first step, among 99,375 elements).

    Which part checks what: the per-element bound (2 lr per step) only says no element
    moved further than Adam can move it, which two Adam runs from one start always meet,
    and Adam's update is nearly blind to the gradient's scale (a gradient summed where it
    should be averaged moves the weights the same). The real check is the outlier count,
    over every leaf of `a` and `b`, which are the whole step outputs: Adam's first and
    second moments carry the gradient itself, so a missing, doubled or misplaced reduction
    puts most of their elements outside float32's tolerance, far above one in 10,000."""
    total = outliers = 0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        diff = np.abs(x - y)
        assert diff.max() <= 2 * lr * n_steps   # a sanity bound, see above
        outliers += int((diff > ATOL + RTOL * np.abs(x)).sum())
        total += x.size
    assert outliers <= max_outliers * total, (outliers, total)


def test_gpt2_small_under_plain_options_matches_single_device(gpt2):
    # plain options: the planner's own choice for 8 H100s (verify=0: the analytic plan,
    # since compiling the finalists would cost seconds each here)
    w, args, ref = gpt2
    sharded = jaxwap.auto_shard(w.step, w.params, hardware=H100X8, num_devices=8, verify=0,
                                cache=False)
    out = sharded_run(sharded, args, 2)
    plan = sharded.plan
    # when written: data=8 x model=1, every parameter FSDP (the batch of 8 over 8 devices)
    assert plan.num_devices == 8
    assert any(any(a is not None for a in pl.spec) for pl in plan.params)
    assert_close(ref, out)


def test_gpt2_small_under_forced_zero1_pins_its_reduced_gradients_and_matches(gpt2):
    """ZeRO-1 on GPT-2-small: the step is evaluated again from its jaxpr with the
    gradients a reduction makes pinned (the layer norms' scales and offsets and the
    biases; `runtime.grad_pins`), through NNX's state, and gives the single-device numbers."""
    from jaxwap.analysis.trace import layout_of
    from jaxwap.runtime.compile import zero1_weights
    from jaxwap.runtime.grad_pins import gradient_pins

    w, args, ref = gpt2
    sharded = jaxwap.auto_shard(w.step, w.params, strategies=("zero1",),
                                mesh_shape={"data": 2}, verify=0, cache=False)
    out = sharded_run(sharded, args, 2)
    plan = sharded.plan
    assert {pl.strategy for pl in plan.params} == {"zero1"}
    layout, closed = layout_of(w.step, w.args, {}, w.params)
    pinned = gradient_pins(closed, layout, zero1_weights(plan.params))
    shapes = [closed.jaxpr.eqns[k].outvars[j].aval.shape
              for k, outs in pinned.items() for j in outs]
    assert len(shapes) >= 16 and all(len(x) == 1 for x in shapes)   # vectors, no kernel
    assert_close(ref, out)


def test_resnet50_small_under_plain_options_matches_single_device():
    w = zoo.small("resnet50")                # 2 bottleneck stages, width 16, batch norm
    # `synthetic`, not `init`: compiling ResNet's initialiser costs ~10 s on this CPU;
    # these are real arrays of the same shapes (N(0, 1/fan_in) kernels, unit norm scales)
    args = w.synthetic(0)
    sharded = jaxwap.auto_shard(w.step, w.params, hardware=H100X8, num_devices=8, verify=0,
                                cache=False)
    out = sharded_run(sharded, args, 2)
    plan = sharded.plan
    # when written: data=8 x model=1, the larger kernels FSDP, the rest replicated; the
    # batch-norm statistics (the second argument) are carried state, kept whole
    assert plan.num_devices == 8
    assert any(any(a is not None for a in pl.spec) for pl in plan.params)
    for leaf in jax.tree.leaves(out[1]):
        assert leaf.sharding.is_fully_replicated
    assert_close_adam(reference(w.step, args, 2), out, lr=1e-3, n_steps=2)


# ------------------------------------------------------------------ bfloat16
# A bf16 value keeps 8 significant bits: one rounding moves it by up to one ulp, 2**-7
# (0.8%) of it. Sharded, the program rounds elsewhere (each device sums its rows' gradient
# in bf16 before the devices' sums are added; a split contraction rounds partial sums; XLA
# fuses differently), so gradients, momentum and weights (all bf16 here, updated 3 times)
# come out a few ulps apart: when written, up to 2 ulps of the largest element of a leaf.
# So every leaf must agree to 3% of its largest value (4 ulps; a missing or doubled
# reduction is off by 50% or more), and the loss, a float32 reduction of bf16 logits, to
# 0.5%. float32 above agrees to 2e-5.
BF16_TOL, BF16_LOSS_RTOL = 3e-2, 5e-3


def test_bf16_mlp_under_forced_tensor_parallel_and_fsdp_matches_within_bf16_rounding():
    # weights, gradients, their reductions and the momentum all in bfloat16
    step, *args = host_setup(TypedMLP((64, 64, 10)), (32, 16),
                            tx=optax.sgd(0.1, momentum=0.9))
    # every parameter pinned to a layout with FSDP in it (on this CPU's links the model
    # would leave the tiny ones whole: each gather is a collective of its own), the first
    # two kernels to Megatron's pair over model as well (whether tensor parallelism gains
    # on so small a model follows from the host's cores)
    sharded = jaxwap.auto_shard(step, args[0], strategies=("tp", "fsdp"),
                                constraints={"Dense_0/kernel": P("data", "model"),
                                             "Dense_1/kernel": P("model", "data"),
                                             ".*": "fsdp"},
                                mesh_shape={"data": 2, "model": 2}, verify=0, cache=False)
    out = sharded_run(sharded, args, 3)
    plan = sharded.plan
    assert dict(plan.mesh_shape) == {"data": 2, "model": 2}
    where = placements(plan)
    # every parameter sharded over data; the first two kernels also over model, Megatron's
    # column-then-row pair
    for pl in plan.params:
        assert pl.strategy.split(",")[0].endswith("fsdp") and "data" in pl.spec \
            and pl.dtype == "bfloat16"
    assert where["['params']['Dense_0']['kernel']"].strategy == "tp-col+fsdp, pinned"
    assert where["['params']['Dense_1']['kernel']"].strategy == "tp-row+fsdp, pinned"
    for key, leaf in by_path(out[0]).items():
        assert leaf.dtype == jnp.bfloat16
        assert_laid_out(leaf, where[key].spec, plan.mesh_shape)
    ref = reference(step, args, 3)
    # the momentum is zero before the first step, so a sharded step that got no gradient
    # to a leaf, or half of it, is off by far more than the tolerance there
    for r, o in zip(jax.tree.leaves(ref[:2]), jax.tree.leaves(out[:2]), strict=True):
        r, o = np.asarray(r, np.float32), np.asarray(o, np.float32)
        assert np.abs(r - o).max() <= BF16_TOL * np.abs(r).max()
    np.testing.assert_allclose(ref[2]["loss"], out[2]["loss"], rtol=BF16_LOSS_RTOL)
