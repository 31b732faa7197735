"""graph.analyze: layers from the primitive table's rules, and the roofline adapter's checks.

Inputs are built from `jax.make_jaxpr` and `analysis.roles` alone, as the planner builds them.
"""

import dataclasses
import sys

import jax
import jax.numpy as jnp
import pytest
from models import analyze_step as _analyze

from jaxwap.analysis.graph import Graph
from jaxwap.analysis.primitives import ELEMENTWISE, FREE, HEAVY, MATMUL, prim_info
from jaxwap.analysis.roofline_adapter import roofline_rules


def _sgd(loss):
    def step(params, *args):
        grads = jax.grad(loss)(params, *args)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    return step


def _layer(graph: Graph, param: int):
    return next(L for L in graph.layers if L.param == param)


def _f32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def test_ragged_dot_weight_is_a_layer():
    g, k, n, B = 4, 8, 16, 32
    params = {"w": _f32(g, k, n)}

    def loss(p, x, group_sizes):
        return jnp.sum(jax.lax.ragged_dot(x, p["w"], group_sizes) ** 2)

    graph = _analyze(_sgd(loss), params, _f32(B, k), jax.ShapeDtypeStruct((g,), jnp.int32),
                     batch_size=B)
    layer = _layer(graph, 0)
    assert (layer.in_dims, layer.out_dims) == ((1,), (2,))
    assert graph.tp_param[layer.op_index] == 0


def test_dense_and_conv_layer_dims():
    params = {"conv": _f32(3, 3, 4, 8), "dense": _f32(8, 10), "head": _f32(5, 10)}

    def loss(p, x):
        h = jax.lax.conv_general_dilated(x, p["conv"], (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        h = jnp.mean(jax.nn.relu(h), axis=(1, 2)) @ p["dense"]
        return jnp.sum((h @ p["head"].T) ** 2)  # a transposed [out, in] weight

    graph = _analyze(_sgd(loss), params, _f32(16, 6, 6, 4), batch_size=16)
    dims = {j: (L.in_dims, L.out_dims) for j, L in enumerate(graph.layers)}
    assert dims == {0: ((2,), (3,)), 1: ((0,), (1,)), 2: ((1,), (0,))}
    assert [L.param for L in graph.layers] == [0, 1, 2]  # params in key order: conv, dense, head



def test_each_layer_knows_its_bias():
    # the bias is what is added to the layer's own output, one element per output
    # feature (a conv's per channel, past Flax's reshape); a norm's offset added to
    # another value, a bias-less layer and a transposed head have none
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.relu(nn.Conv(8, (3, 3), name="conv")(x)).mean(axis=(1, 2))
            h = nn.LayerNorm(name="norm")(nn.Dense(10, name="dense")(h))
            return nn.Dense(5, use_bias=False, name="head")(h)

    params = jax.eval_shape(Net().init, jax.random.key(0), _f32(16, 6, 6, 4))["params"]

    def loss(p, x):
        return jnp.sum(Net().apply({"params": p}, x) ** 2)

    graph = _analyze(_sgd(loss), params, _f32(16, 6, 6, 4), batch_size=16)
    name = {j: "/".join(p.path) for j, p in enumerate(graph.params)}
    biases = {name[L.param]: name.get(L.bias) for L in graph.layers}
    assert biases == {"conv/kernel": "conv/bias", "dense/kernel": "dense/bias",
                      "head/kernel": None}


def test_primitive_table():
    for name in ("dot_general", "conv_general_dilated", "ragged_dot_general"):
        assert prim_info(name).kind == MATMUL and prim_info(name).layer is not None
    assert prim_info("reshape").kind == FREE
    assert prim_info("convert_element_type").same_layout
    assert prim_info("transpose").permutation is not None
    assert prim_info("reduce_sum").kind == HEAVY
    assert prim_info("pjit").inline
    assert prim_info("no_such_primitive").kind == ELEMENTWISE
    assert prim_info("add").layer is None


@pytest.fixture
def fresh_adapter():
    roofline_rules.cache_clear()
    yield
    roofline_rules.cache_clear()


@pytest.mark.parametrize("missing", ["_rooflines", "RooflineRuleContext", "RooflineShape"])
def test_roofline_adapter_fails_loudly(monkeypatch, fresh_adapter, missing):
    monkeypatch.delattr(sys.modules["jax.experimental.roofline.roofline"], missing)
    with pytest.raises(RuntimeError, match=missing) as e:
        _analyze(_sgd(lambda p, x: jnp.sum(x @ p["w"])), {"w": _f32(4, 2)}, _f32(8, 4),
                 batch_size=8)
    assert jax.__version__ in str(e.value) and "jaxwap needs updating" in str(e.value)


def test_roofline_adapter_rejects_changed_context(monkeypatch, fresh_adapter):
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Context:  # a jax that renamed a field the adapter passes
        name_stack: object
        primitive: object

    monkeypatch.setattr(sys.modules["jax.experimental.roofline.roofline"],
                        "RooflineRuleContext", Context)
    with pytest.raises(RuntimeError, match="avals_in"):
        roofline_rules()


def test_a_table_read_by_a_lookup_is_looked_up_and_a_matmul_weight_is_not():
    # the embedding table is cast to bf16 before the lookup (a form of it, as a
    # mixed-precision model reads its weights); the dense weight is only multiplied
    from jaxwap.analysis.dataflow import looked_up
    from jaxwap.analysis.flatten import flatten
    from jaxwap.analysis.trace import layout_of

    def step(params, tokens):
        def loss(p):
            x = jnp.take(p["embed"].astype(jnp.bfloat16), tokens, axis=0)
            return jnp.mean((x.astype(jnp.float32) @ p["dense"]) ** 2)
        g = jax.grad(loss)(params)
        return jax.tree.map(lambda w, d: w - 0.1 * d, params, g)

    params = {"embed": jax.ShapeDtypeStruct((50, 16), jnp.float32),
              "dense": jax.ShapeDtypeStruct((16, 16), jnp.float32)}
    tokens = jax.ShapeDtypeStruct((8, 4), jnp.int32)
    layout, closed = layout_of(step, (params, tokens), {}, params)
    got = looked_up(flatten(closed), layout.inputs.roles, layout.outputs.roles,
                    layout.params, layout.inputs.batch_size)
    assert {layout.params[j].keystr for j in got} == {"['embed']"}


def test_a_weight_without_the_data_axis_keeps_its_model_split():
    from jax.sharding import PartitionSpec as P

    from jaxwap.runtime.compile import without_data

    assert without_data(P(None, "data")) == P(None, None)
    assert without_data(P(("replica", "data"), "model")) == P(None, "model")
    assert without_data(P(("data", "model"), None)) == P("model", None)
    assert without_data(P("model", None)) == P("model", None)


@pytest.mark.parametrize("name, leaking, megatron", [
    ("gpt2", ("attn/proj", "attn/qkv"), ("mlp/fc",)),
    ("llama", ("attn/o",), ("attn/q", "attn/k", "attn/v", "mlp/gate", "mlp/up")),
])
def test_a_column_split_xla_would_not_keep_is_not_offered(name, leaking, megatron):
    # an output projection's column split is added to the residual stream and reaches
    # every later layer (XLA then keeps the stream split by feature: 7.5 GB of
    # collectives for full-size GPT-2 on 8 devices, 1.1 GB without); a fused q/k/v
    # projection's split is cut into q, k and v, which XLA reshuffles. A Megatron column
    # layer's split ends at its row partner (Llama's separate q, k, v too). Only the
    # column kind of the others is withheld.
    import jaxwap
    from benchmarks.models import zoo
    from jaxwap.planner import make_plan
    from jaxwap.search.strategies import param_strategies

    w = zoo.small("gpt2") if name == "gpt2" else zoo.llama()
    graph = make_plan(w.step, w.args, {}, params=w.params, options=jaxwap.PlanOptions(
        hardware=jaxwap.Cluster("h100-sxm", 2), verify=0, cache=False)).graph
    path = {L.param: "/".join(graph.params[L.param].path) for L in graph.layers}
    blocks = {j: p for j, p in path.items() if p.startswith("blocks/")}
    for j, p in blocks.items():
        kinds = {s.tp for s in param_strategies(graph, j, 1, 2)}
        if any(f"/{k}/" in p for k in leaking):
            assert j in graph.tp_leaks, p
            assert kinds == {"none", "row"}, (p, kinds)
        elif any(f"/{k}/" in p for k in megatron):
            assert j not in graph.tp_leaks, p
            assert kinds == {"none", "col", "row"}, (p, kinds)


def test_fused_elementwise_and_reduction_move_what_xla_fusions_move():
    """A chain of elementwise ops reduced at its end is one fusion: it reads its input
    and writes the reduced result, not every intermediate (the rule before counted each
    elementwise result written once more). A result a matmul reads is written once."""
    from jaxwap.analysis.dataflow import op_kinds
    from jaxwap.analysis.flatten import flatten
    from jaxwap.analysis.op_work import op_costs

    x = jnp.ones((256, 1024), jnp.float32)

    def traffic(f, *args):
        prog = flatten(jax.make_jaxpr(f)(*args))
        kinds, _ = op_kinds(prog)
        return float(op_costs(prog, kinds, roofline_rules()).bytes.sum())

    n = x.size * 4
    # x read once, the row sums written (and the two scalar constants read)
    assert traffic(lambda v: jnp.sum(jnp.exp(v * 2.0 - 1.0), axis=-1), x) == \
        pytest.approx(n + 256 * 4, abs=16)
    w = jnp.ones((1024, 64), jnp.float32)
    chained = traffic(lambda v, w: jnp.tanh(v * 2.0 + 1.0) @ w, x, w)
    matmul = traffic(lambda v, w: v @ w, x, w)
    # the chain reads x and writes its result
    assert chained - matmul == pytest.approx(2 * n, abs=16)


@pytest.mark.parametrize("layers", [4, 16])
def test_a_scans_stacked_outputs_are_priced_as_each_iteration_writes_its_slice(layers):
    """XLA writes each iteration's output into the loop's stacked buffer in place: one
    slice per iteration. The stacking op is priced at that slice's bytes, so a stack of
    `layers` residuals costs `layers` slices a step (it was priced as the whole stack
    rewritten every iteration: 92% of a 64-layer scan's bytes), and jaxwap's own op is not
    reported as one no rule prices."""
    from jaxwap.analysis.dataflow import op_kinds
    from jaxwap.analysis.flatten import flatten
    from jaxwap.analysis.op_work import op_costs

    x = jnp.ones((64, 256), jnp.float32)
    w = jnp.ones((layers, 256, 256), jnp.float32)

    def loss(w, x):
        h, _ = jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)
        return h.sum()

    prog = flatten(jax.make_jaxpr(jax.grad(loss))(w, x))
    costs = op_costs(prog, op_kinds(prog)[0], roofline_rules())
    stacks = [k for k, op in enumerate(prog.ops) if op.prim == "scan_stack"]
    assert stacks and "scan_stack" not in costs.unmodeled
    for k in stacks:
        op = prog.ops[k]
        assert op.repeat == layers and costs.flops[k] == 0
        assert costs.bytes[k] == layers * prog.nbytes[op.ins[0]]
        assert prog.nbytes[op.outs[0]] == layers * prog.nbytes[op.ins[0]]


def test_a_first_layers_convolutions_are_narrow_and_priced_apart():
    """A convolution over 3 input channels (forward, and its kernel gradient, whose lhs
    batch the channels become) is kind 3 and takes `narrow_conv_efficiency`; the next
    layer's are plain convolutions; without the figure (a built-in profile) narrow ones
    price as any."""
    from jaxwap.cost.op_time import op_times
    from jaxwap.hardware.cluster import Cluster
    from jaxwap.hardware.device import DeviceSpec

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def loss(p, x):
        return jnp.sum(conv(jax.nn.relu(conv(x, p["w1"])), p["w2"]) ** 2)

    graph = _analyze(_sgd(loss), {"w1": _f32(3, 3, 3, 16), "w2": _f32(3, 3, 16, 16)},
                     _f32(32, 16, 16, 3), batch_size=32)
    kinds = sorted(int(k) for k in graph.conv if k)
    assert kinds == [1, 1, 1, 3, 3]   # first layer: forward, kernel gradient; second: three
    plain = DeviceSpec("g", peak_flops=1e14, memory_bandwidth=1e12, memory_bytes=1e10,
                       idle_watts=50, max_watts=500, conv_efficiency=0.5)
    narrow = dataclasses.replace(plain, narrow_conv_efficiency=0.05)
    t0, t1 = (op_times(graph, Cluster(s, 1), 1.0) for s in (plain, narrow))
    first = graph.conv == 3
    assert (t1[~first] == t0[~first]).all()
    assert (t1[first] > 5 * t0[first]).all()


def _grouped_graph(dtype, groups: int, channels: int = 128):
    """A training step of one grouped 3x3 convolution (`groups` groups over `channels`)."""
    def loss(p, x):
        y = jax.lax.conv_general_dilated(x.astype(dtype), p["w"].astype(dtype), (1, 1),
                                         "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                         feature_group_count=groups)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    return _analyze(_sgd(loss), {"w": _f32(3, 3, channels // groups, channels)},
                    _f32(16, 8, 8, channels), batch_size=16)


def test_grouped_convolutions_with_few_channels_per_group_are_narrow():
    """A ResNeXt's 32 groups of 4 channels (forward, and the kernel gradient, which groups
    its lhs batch) are kind 3, as a first layer over RGB is: each group is a convolution
    over 4 channels; 8 groups of 16 are plain convolutions."""
    assert sorted(int(k) for k in _grouped_graph(jnp.float32, 32).conv if k) == [3, 3]
    assert sorted(int(k) for k in _grouped_graph(jnp.float32, 8).conv if k) == [1, 1]


def test_float32_convolutions_on_cuda_cores_take_no_tensor_core_shares():
    """A V100 (no TF32) prices float32 convolutions at its float32 matmul rate, with no
    convolution share (those are tensor-core shares: `f32_conv_shares=False`); its float16
    ones keep the shares; a profile whose float32 runs on tensor cores applies them to
    both."""
    from jaxwap.cost.op_time import op_times
    from jaxwap.hardware.builtin_profiles import device_spec
    from jaxwap.hardware.cluster import Cluster

    v100 = device_spec("v100-sxm2")
    assert not v100.f32_conv_shares and device_spec("a100-sxm-80gb").f32_conv_shares
    shared = dataclasses.replace(v100, f32_conv_shares=True)
    for dtype, differ in ((jnp.float32, True), (jnp.float16, False)):
        graph = _grouped_graph(dtype, 32)
        convs = graph.conv > 0
        t_volta, t_shared = (op_times(graph, Cluster(s, 1), 1.0)[convs] for s in (v100, shared))
        assert (t_volta < t_shared).all() if differ else (t_volta == t_shared).all()


def test_fsdp_memory_per_device_does_not_grow_with_the_devices_at_a_fixed_local_batch():
    """What an FSDP layout holds whole (`liveness.gathered_whole`) is a layer's weight and
    its weight gradient, never the batched activations its matmuls make: the LM head's
    [batch, seq, vocab] logits were counted whole (at the global batch), so a Llama-8B at
    2 sequences per device needed 43 GB a device on 8 H100s and 589 GB on 128. Here, a
    decoder with a large-vocabulary head at 2 sequences per device: about the same per
    device on 32 devices as on 8 (it was 7 times as much)."""
    import jaxwap
    from benchmarks.models import zoo

    def peak(n):
        w = zoo.llama("llama_tiny", batch_size=2 * n, seq_len=1024, vocab=65536, d_model=128,
                      ffn=256, scan=True)
        plan = jaxwap.plan(w.step, *w.args, params=w.params, verify=0, cache=False,
                           hardware=jaxwap.Cluster("h100-sxm", n), mesh_shape={"data": n},
                           strategies=("fsdp",), objective="throughput")
        assert {p.strategy for p in plan.params} == {"fsdp"}
        return plan.predicted.peak_memory_bytes

    assert peak(32) < 1.1 * peak(8)
