"""The device costs calibration found in real steps on XLA:CPU (issue 10): a generic-loop
convolution's rate by its width, a fixed cost per convolution, the scratch memory the
host allocator maps afresh each step, the matmul efficiency measured on dense layers'
training forms and the time per transcendental element; each priced where the model
says, and the fresh memory of a compiled candidate taken from XLA's own temp
allocation."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models import abstract_setup, analyze_step

import jaxwap
from jaxwap.core.records import DATA
from jaxwap.cost.collectives import fsdp_moves
from jaxwap.cost.mesh_cost import mesh_costs
from jaxwap.cost.mesh_prediction import predict, with_compiled
from jaxwap.cost.op_time import op_times
from jaxwap.decide.verify import compile_candidate
from jaxwap.decide.xla_figures import layout_changes
from jaxwap.hardware.cluster import Cluster
from jaxwap.hardware.device import DeviceSpec
from jaxwap.hardware.matmul_efficiency import efficiency_table
from jaxwap.planner import make_plan
from jaxwap.search.strategies import param_strategies

MiB = 2**20
SPEC = DeviceSpec("test-cpu", peak_flops=1e11, memory_bandwidth=2e10, memory_bytes=8e9,
                  idle_watts=5, max_watts=50, kernel_overhead_s=1e-6,
                  small_input_conv_flops=2e9,
                  small_input_conv_rates=((128, 3e9), (256, 2e9), (512, 5e8)),
                  fresh_memory_cost=((16 * MiB, 0.0), (32 * MiB, 6e-10), (64 * MiB, 6e-10)),
                  layout_change_cost=((2**14, 1e-10), (2**24, 2e-9)))


def _conv(x, w):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _sgd(loss):
    def step(params, x):
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, jax.grad(loss)(params, x))
    return step


def _small_map_graph(c: int):
    """A 3x3 convolution over a 2x2 map at width c, with its gradients: the case XLA:CPU
    computes with its generic loop."""
    f32 = jax.ShapeDtypeStruct
    return analyze_step(_sgd(lambda p, x: jnp.sum(_conv(x, p["w"]) ** 2)),
                        {"w": f32((3, 3, c, c), jnp.float32)}, f32((8, 2, 2, c), jnp.float32),
                        batch_size=8)


def test_small_conv_rate_is_the_nearest_measured_width():
    assert SPEC.small_conv_rate(512) == 5e8
    assert SPEC.small_conv_rate(384) == 5e8          # log-nearer 512 than 256
    assert SPEC.small_conv_rate(300) == 2e9
    assert SPEC.small_conv_rate(16) == 3e9           # below the table: its first entry
    assert SPEC.small_conv_rate(0) == 2e9            # unknown width: the median rate
    bare = dataclasses.replace(SPEC, small_input_conv_rates=())
    assert bare.small_conv_rate(512) == 2e9


def test_fresh_memory_interpolates_in_log_size_and_holds_at_the_ends():
    assert SPEC.fresh_memory_s(8 * MiB) == 0.0       # below the table: its first entry
    assert SPEC.fresh_memory_s(64 * MiB) == pytest.approx(64 * MiB * 6e-10)
    assert SPEC.fresh_memory_s(1024 * MiB) == pytest.approx(1024 * MiB * 6e-10)
    mid = SPEC.fresh_memory_s(np.sqrt(16 * 32) * MiB) / (np.sqrt(16 * 32) * MiB)
    assert mid == pytest.approx(3e-10)               # halfway in log size
    assert dataclasses.replace(SPEC, fresh_memory_cost=()).fresh_memory_s(1e9) == 0.0


def test_device_tables_survive_json_and_bad_pairs_are_named():
    back = DeviceSpec.from_dict(json.loads(json.dumps(SPEC.to_dict())))
    assert back == SPEC and hash(back.fresh_memory_cost) == hash(SPEC.fresh_memory_cost)
    with pytest.raises(ValueError, match="fresh_memory_cost"):
        dataclasses.replace(SPEC, fresh_memory_cost=((0, 1e-9),))
    with pytest.raises(ValueError, match="conv_overhead_s"):
        dataclasses.replace(SPEC, conv_overhead_s=-1.0)


def test_generic_loop_convolution_is_priced_at_its_widths_rate():
    cluster = Cluster(SPEC, 1)
    for c, rate in ((128, 3e9), (512, 5e8)):
        g = _small_map_graph(c)
        slow = np.flatnonzero(g.conv == 2)
        assert len(slow) >= 1 and (g.conv_width[slow] == c).all()
        t = op_times(g, cluster, 1.0)
        # a generic-loop op is priced at its width's rate (no efficiency curve) + a launch
        expect = np.maximum(g.flops[slow] / rate, g.bytes[slow] / SPEC.memory_bandwidth) \
            + g.kernels[slow] * SPEC.kernel_overhead_s
        np.testing.assert_allclose(t[slow], expect, rtol=1e-12)


def test_each_convolution_pays_the_fixed_conv_overhead():
    g = _small_map_graph(128)
    base = op_times(g, Cluster(SPEC, 1), 1.0)
    more = op_times(g, Cluster(dataclasses.replace(SPEC, conv_overhead_s=4e-5), 1), 1.0)
    conv = g.conv > 0
    np.testing.assert_allclose(more[conv] - base[conv], 4e-5 * g.kernels[conv], rtol=1e-9)
    np.testing.assert_array_equal(more[~conv], base[~conv])


def test_fresh_scratch_memory_adds_its_cost_to_the_step():
    """A step whose scratch is past the table's threshold pays bytes x cost; the plan's
    prediction says how much, and with XLA's figures the scratch is XLA's temp bytes."""
    step, params, opt, batch = abstract_setup([2048, 2048, 10], 512, 2048)
    cheap = Cluster(dataclasses.replace(SPEC, fresh_memory_cost=()), 1)
    costly = Cluster(dataclasses.replace(SPEC, fresh_memory_cost=((MiB, 1e-9),)), 1)
    got = {}
    for name, cluster in (("cheap", cheap), ("costly", costly)):
        planned = make_plan(step, (params, opt, batch), {}, params=None,
                            options=jaxwap.PlanOptions(hardware=cluster, verify=0, cache=False))
        got[name] = (planned, next(r for r in planned.search.results if r.d == r.m == 1))
    p0, p1 = got["cheap"][1].predicted, got["costly"][1].predicted
    assert p0.fresh_memory_time_s == 0.0 and p1.fresh_memory_time_s > 0.0
    assert p1.step_time_s - p0.step_time_s == pytest.approx(p1.fresh_memory_time_s)
    # the scratch priced is the peak over the state the step starts with: > 0, < the peak
    assert 0 < p1.fresh_memory_time_s / 1e-9 < p1.peak_memory_bytes
    planned, r = got["costly"]
    figs, _ = compile_candidate(step, planned.layout, r, jax.devices()[:1], costly)
    compiled = with_compiled(r.predicted, figs, costly, 512)
    assert compiled.fresh_memory_time_s == pytest.approx(figs.temp_bytes * 1e-9)


def test_layout_changes_are_read_from_the_compiled_program():
    """A fused update that reads its input transposed moves that array into another
    layout; the same update read straight, or a transpose over a size-1 dim (a bitcast),
    moves nothing."""
    x = jax.ShapeDtypeStruct((256, 512), jnp.float32)
    y = jax.ShapeDtypeStruct((512, 256), jnp.float32)
    moved = jax.jit(lambda a, b: b * 0.9 + 0.1 * a.T).lower(x, y).compile().as_text()
    assert layout_changes(moved) == ((256 * 512 * 4, 1),)
    straight = jax.jit(lambda a, b: b * 0.9 + 0.1 * a).lower(x, x).compile().as_text()
    assert layout_changes(straight) == ()
    v = jax.ShapeDtypeStruct((1, 512), jnp.float32)
    bitcast = jax.jit(lambda a: a.T * 2.0).lower(v).compile().as_text()
    assert layout_changes(bitcast) == ()


def _compiled_mlp() -> tuple:
    """(cluster, one-device candidate, XLA's figures of it) for a small MLP's Adam step
    on SPEC: what the compiled prediction is made from."""
    step, params, opt, batch = abstract_setup([64, 64, 10], 32, 64)
    cluster = Cluster(SPEC, 1)
    planned = make_plan(step, (params, opt, batch), {}, params=None,
                        options=jaxwap.PlanOptions(hardware=cluster, verify=0, cache=False))
    r = next(r for r in planned.search.results if r.d == r.m == 1)
    figs, _ = compile_candidate(step, planned.layout, r, jax.devices()[:1], cluster)
    return cluster, r, figs


def test_compiled_prediction_charges_each_layout_change_at_its_size():
    cluster, r, figs = _compiled_mlp()
    changes = ((2**14, 1), (2**24, 2))
    base = with_compiled(r.predicted, dataclasses.replace(figs, layout_changes=()), cluster, 32)
    more = with_compiled(r.predicted, dataclasses.replace(figs, layout_changes=changes),
                         cluster, 32)
    expect = 2**14 * 1e-10 + 2 * 2**24 * 2e-9
    assert more.step_time_s - base.step_time_s == pytest.approx(expect, rel=1e-9)
    assert more.compute_time_s - base.compute_time_s == pytest.approx(expect, rel=1e-9)


def test_a_combined_collective_pays_the_buffer_latency_per_extra_array():
    """gloo reduces each array of XLA's combined all-reduce apart: the compiled program's
    tuple collective is priced with the calibrated latency for each array past the first
    (as the analytic model prices its gradient buffers)."""
    from jaxwap.cost.collectives import collective_cost
    from jaxwap.decide.xla_figures import parse_collectives

    text = ("ENTRY %main () -> f32[] {\n"
            "  %all-reduce.1 = (f32[64]{0}, f32[32,4]{1,0}, f32[8]{0}) all-reduce(%a, %b, %c), "
            "replica_groups={{0,1}}, to_apply=%add\n}\n")
    (c,) = parse_collectives(text, (2, 1))
    assert (c.buffers, c.bytes) == (3, (64 + 128 + 8) * 4)
    cluster = Cluster(dataclasses.replace(SPEC, link_buffer_latency_s=4e-3), 2)
    one = dataclasses.replace(c, buffers=1)
    assert collective_cost(c, cluster, 2, 1)[0] - collective_cost(one, cluster, 2, 1)[0] \
        == pytest.approx(2 * 4e-3)


CURVE = dataclasses.replace(SPEC, matmul_efficiency=((1e-6, 0.2), (1e-5, 0.5), (1e-4, 0.9)))


def test_matmul_efficiency_curve_interpolates_holds_and_falls_below_the_table():
    at = CURVE.matmul_efficiency_at
    np.testing.assert_allclose(at(np.array([1e-6, 1e-5, 1e-4, 1.0])), [0.2, 0.5, 0.9, 0.9])
    assert at(np.array([10 ** -5.5]))[0] == pytest.approx(0.35)     # halfway in log time
    # below the shortest: t / (t + h), h giving the shortest its efficiency (h = 4 us)
    assert at(np.array([1e-7]))[0] == pytest.approx(1e-7 / (1e-7 + 4e-6))
    # keyed on time at the peak: the same work at twice the rate is half as long
    assert CURVE.matmul_eff(1e6, 1e11) == pytest.approx(0.5)
    assert CURVE.matmul_eff(1e6, 2e11) == pytest.approx(at(np.array([5e-6]))[0])
    # without a curve: the half-efficiency model
    bare = dataclasses.replace(SPEC, efficiency_half_flops=1e6)
    assert bare.matmul_eff(3e6, 1e11) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="matmul_efficiency"):
        dataclasses.replace(SPEC, matmul_efficiency=((1e-6, 1.5),))


def test_efficiency_table_takes_the_launch_out_and_stays_within_one():
    # 1 Mflop at 1e11 flop/s is 10 us of work; measured 21 us with a 1 us launch: 0.5
    ((t, e),) = efficiency_table([(1e6, 21e-6)], 1e11, 1e-6)
    assert (t, e) == (pytest.approx(1e-5), pytest.approx(0.5))
    assert efficiency_table([(1e6, 5e-6)], 1e11, 1e-6) == ((1e-5, 1.0),)   # faster: 1


def test_matmuls_are_priced_by_the_measured_curve():
    f32 = jax.ShapeDtypeStruct
    g = analyze_step(_sgd(lambda p, x: jnp.sum(jnp.tanh(x @ p["w"]))),
                     {"w": f32((64, 256), jnp.float32)}, f32((256, 64), jnp.float32),
                     batch_size=256)
    mm = np.flatnonzero(g.is_matmul)
    assert len(mm) >= 2          # forward and weight gradient
    rate = SPEC.peak_flops_f32 or SPEC.peak_flops / 2
    t = op_times(g, Cluster(CURVE, 1), 1.0)
    eff = CURVE.matmul_efficiency_at(g.flops[mm] / rate)
    expect = np.maximum(g.flops[mm] / (rate * eff), g.bytes[mm] / SPEC.memory_bandwidth) \
        + g.kernels[mm] * SPEC.kernel_overhead_s
    np.testing.assert_allclose(t[mm], expect, rtol=1e-12)


def test_transcendental_elements_cost_at_least_their_calibrated_time():
    f32 = jax.ShapeDtypeStruct
    g = analyze_step(_sgd(lambda p, x: jnp.sum(jnp.tanh(x * p["s"]) + jnp.sqrt(x * x))),
                     {"s": f32((4096,), jnp.float32)}, f32((256, 4096), jnp.float32),
                     batch_size=256)
    tanh = np.flatnonzero(g.transcendentals > 0)
    assert len(tanh) >= 1 and (g.transcendentals[tanh] == 256 * 4096).all()
    slow = dataclasses.replace(SPEC, transcendental_s=1e-9)
    base, more = (op_times(g, Cluster(s, 1), 1.0) for s in (SPEC, slow))
    np.testing.assert_allclose(more[tanh], 256 * 4096 * 1e-9 + g.kernels[tanh] * 1e-6,
                               rtol=1e-9)
    others = np.setdiff1d(np.arange(len(base)), tanh)
    np.testing.assert_array_equal(more[others], base[others])   # sqrt is no such op


def test_reductions_take_at_least_their_measured_time_at_their_size():
    f32 = jax.ShapeDtypeStruct
    g = analyze_step(_sgd(lambda p, x: jnp.sum(jnp.mean(x * p["s"], axis=0) ** 2)),
                     {"s": f32((256,), jnp.float32)}, f32((64, 256), jnp.float32),
                     batch_size=64)
    red = np.flatnonzero(g.reduced)
    assert len(red) >= 2            # the mean over the batch, the sum, the gradient's
    slow = dataclasses.replace(SPEC, reduction_cost=((2**10, 1e-8), (2**20, 1e-8)))
    base, more = (op_times(g, Cluster(s, 1), 1.0) for s in (SPEC, slow))
    per = g.bytes[red] / g.kernels[red]     # a fusing backend's: what each fusion reads
    np.testing.assert_allclose(
        more[red], g.kernels[red] * (per * 1e-8 + SPEC.kernel_overhead_s), rtol=1e-9)
    others = np.setdiff1d(np.arange(len(base)), red)
    np.testing.assert_array_equal(more[others], base[others])


@pytest.mark.parametrize("state", ["replicate", "zero1"])
def test_an_all_reduced_transposed_gradient_is_moved_for_each_read(state):
    """jax makes a dense weight's gradient as the transpose of a matmul; once data
    parallelism has all-reduced it, XLA:CPU moves it into the weight's layout for each
    optimizer op that reads it (ZeRO-1: its shard), on one device not at all. The model
    names those arrays and reads as the compiled program has them (replicated: exactly),
    and prices them."""
    step, params, opt, batch = abstract_setup([1024, 1024, 16], 32, 512)
    graph = analyze_step(step, params, opt, batch, batch_size=32)
    big = {j for j in range(len(graph.params)) if graph.relayout_bytes[j] >= MiB}
    assert big, "the 1 and 2 MiB dense weights' gradients are made transposed"

    def compiled(d):
        plan = jaxwap.plan(step, params, opt, batch, params=params, cache=False,
                           hardware=Cluster(SPEC, 8), mesh_shape={"data": d, "model": 1},
                           strategies=(state if d > 1 else "replicate",), verify=1,
                           objective="throughput")
        assert all(p.strategy == (state if d > 1 else "replicate") for p in plan.params)
        return {b: t for b, t in plan.compiled.layout_changes if b >= MiB // 2}, plan

    shard = 2 if state == "zero1" else 1
    want: dict[float, float] = {}
    for j in big:
        b = graph.relayout_bytes[j] / shard
        want[b] = want.get(b, 0) + graph.relayout_reads[j]
    got, plan = compiled(2)
    if state == "replicate":
        assert got == want
    else:
        # under ZeRO-1 XLA moves one shard a third time (the update of the 2 MiB weight,
        # as AlexNet's fc6): the model prices the optimizer's two reads, most of it
        assert set(got) == set(want) and all(got[b] >= n for b, n in want.items())
        total = sum(b * n for b, n in got.items())
        assert sum(b * n for b, n in want.items()) >= 0.8 * total
    assert compiled(1)[0] == {}
    # and the analytic step time carries them at the device's layout-change cost
    bare = dataclasses.replace(graph, relayout_reads=np.zeros(len(graph.params)))
    cluster = Cluster(SPEC, 8)
    strats = [param_strategies(graph, j, 2, 1) for j in range(len(graph.params))]
    choice = [next(i for i, s in enumerate(o) if s.name == state) for o in strats]
    pred = {name: predict(g, cluster, mesh_costs(g, cluster, 2, 1, strats), choice)
            for name, g in (("with", graph), ("bare", bare))}
    t = {name: p.compute_time_s for name, p in pred.items()}
    expect = sum(n * SPEC.layout_change_s(b) for b, n in want.items())
    small = sum(graph.relayout_reads[j] * SPEC.layout_change_s(graph.relayout_bytes[j] / shard)
                for j in range(len(graph.params)) if j not in big)
    assert t["with"] - t["bare"] == pytest.approx(expect + small, rel=1e-9)
    assert pred["with"].layout_change_time_s == pytest.approx(expect + small, rel=1e-9)
    # fed XLA's figures, XLA's layout changes replace the model's: counted once
    figs = plan.compiled
    fed = {name: with_compiled(p, figs, cluster, 32, 2).step_time_s for name, p in pred.items()}
    assert fed["with"] == pytest.approx(fed["bare"], rel=1e-9)


@pytest.mark.parametrize("d", [1, 2])
def test_convolution_kernels_are_moved_as_xla_cpu_moves_them(d):
    """XLA:CPU's layout assignment moves each convolution kernel into the layout the input
    gradient's transposed convolution reads it in (the kernel jax reverses), and twice in
    the update, once where data parallelism all-reduces the gradient (the first layer has
    no input gradient). The model counts those moves of each kernel as the compiled
    program has them, and prices them (`grad_reductions.conv_relayouts`)."""
    from models import CNN, host_setup

    step, params, opt, batch = host_setup(CNN(), (8, 16, 16, 3))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                            (params, opt, batch))
    graph = analyze_step(step, *abstract, batch_size=8)
    kernels = {j: p for j, p in enumerate(graph.params) if len(p.shape) == 4}
    assert sorted(graph.conv_relayout_moves[j] for j in kernels) == [2, 3]   # conv1, conv2
    plan = jaxwap.plan(step, *abstract, params=abstract[0], cache=False,
                       hardware=Cluster(SPEC, 8), mesh_shape={"data": d, "model": 1},
                       strategies=("replicate",), verify=1, objective="throughput")
    sizes = {graph.conv_relayout_bytes[j] for j in kernels}
    got = {b: n for b, n in plan.compiled.layout_changes if b in sizes}
    want = {graph.conv_relayout_bytes[j]: graph.conv_relayout_moves[j] - (d > 1)
            for j in kernels}
    assert got == want
    # and the analytic prediction carries them at the device's layout-change cost
    assert plan.predicted.layout_change_time_s >= sum(
        n * SPEC.layout_change_s(b) for b, n in want.items())


def test_library_calls_keep_the_models_flops_in_the_compiled_prediction():
    """XLA:GPU's cost analysis counts no flops for cuBLAS and cuDNN calls; a compiled
    program that makes them is priced on the model's flops, one that makes none on XLA's."""
    from jaxwap.decide.xla_figures import library_calls

    gpu_text = ('%c = (bf16[128,55,55,64]{3,2,1,0}, u8[0]{0}) custom-call(%a, %b), '
                'custom_call_target="__cudnn$convForward", backend_config={}\n'
                '%d = bf16[128,4096]{1,0} custom-call(%x, %y), '
                'custom_call_target="__cublas$lt$matmul"\n'
                '%e = bf16[128,4096]{1,0} custom-call(%x, %y), '
                'custom_call_target="__cudnn$convBackwardFilter"\n'
                '%f = f32[4]{0} custom-call(%z), custom_call_target="SomethingElse"\n')
    assert library_calls(gpu_text) == {"__cudnn$convForward": 1, "__cublas$lt$matmul": 1,
                                       "__cudnn$convBackwardFilter": 1}
    cluster, r, figs = _compiled_mlp()
    assert figs.library_calls == 0    # XLA:CPU calls no vendor library
    tenth = dataclasses.replace(figs, flops=r.predicted.flops_as_xla_counts / 10)
    exact = dataclasses.replace(figs, flops=r.predicted.flops_as_xla_counts)
    scaled = with_compiled(r.predicted, tenth, cluster, 32)
    kept = with_compiled(r.predicted, dataclasses.replace(tenth, library_calls=3), cluster, 32)
    assert scaled.compute_time_s < 0.5 * kept.compute_time_s
    assert kept.step_time_s == pytest.approx(
        with_compiled(r.predicted, exact, cluster, 32).step_time_s, rel=1e-12)


def test_a_reduction_of_a_fused_value_is_priced_at_what_it_reduces_on_xla_cpu():
    """x * s is fused into the mean that reads it (no traffic of its own), but XLA:CPU's
    reduction kernel still walks all 64 x 256 elements: its reduction cost is of those
    bytes where the backend runs reductions apart (`DeviceSpec.fuses_reductions`)."""
    f32 = jax.ShapeDtypeStruct
    g = analyze_step(_sgd(lambda p, x: jnp.sum(jnp.mean(x * p["s"], axis=0) ** 2)),
                     {"s": f32((256,), jnp.float32)}, f32((64, 256), jnp.float32),
                     batch_size=64)
    mean = next(k for k in np.flatnonzero(g.reduced) if g.reduced[k] == 64 * 256 * 4)
    assert g.bytes[mean] < 64 * 256 * 4        # its input never went through memory
    slow = dataclasses.replace(SPEC, reduction_cost=((2**10, 1e-8), (2**20, 1e-8)),
                               fuses_reductions=False)
    t = op_times(g, Cluster(slow, 1), 1.0)[mean]
    np.testing.assert_allclose(t, 64 * 256 * 4 * 1e-8 + slow.kernel_overhead_s, rtol=1e-9)
    # where the backend fuses it with its producer, it costs what the fusion reads
    fused = dataclasses.replace(slow, fuses_reductions=True)
    t = op_times(g, Cluster(fused, 1), 1.0)[mean]
    np.testing.assert_allclose(t, g.bytes[mean] * 1e-8 + slow.kernel_overhead_s, rtol=1e-9)


def test_kernel_gradient_convolutions_pay_the_operand_copies_xla_cpu_compiles():
    """XLA:CPU copies a kernel-gradient convolution's activations and output gradient into
    another layout (checked here in the compiled program, independent of the model); the
    model prices those bytes as layout changes of the step where the backend does
    (`DeviceSpec.relayouts_conv_grads`), and no op's own time moves."""
    f32 = jax.ShapeDtypeStruct
    x, w = f32((16, 8, 8, 32), jnp.float32), {"w": f32((3, 3, 32, 64), jnp.float32)}
    step = _sgd(lambda p, x: jnp.sum(jnp.tanh(_conv(x, p["w"])) ** 2))
    hlo = jax.jit(step).lower(w, x).compile().as_text()
    copies = {m for m in ("f32[32,8,8,16]", "f32[8,8,16,64]") if m in hlo
              and any(m in line and "transpose" in line for line in hlo.splitlines())}
    assert copies == {"f32[32,8,8,16]", "f32[8,8,16,64]"}, hlo
    g = analyze_step(step, w, x, batch_size=16)
    grad = np.flatnonzero(g.conv_grad_bytes)
    # one kernel gradient; it reads the activations and the output's gradient
    assert g.conv_grad_bytes[grad].tolist() == [(16 * 8 * 8 * 32 + 16 * 8 * 8 * 64) * 4]
    on = dataclasses.replace(SPEC, relayouts_conv_grads=True)
    # priced as layout changes of the kernel's parameter (per device: the batch split in
    # two), which XLA's own replace when the model is fed its figures
    strats = [param_strategies(g, j, 2, 1) for j in range(len(g.params))]
    rep = [next(i for i, s in enumerate(o) if s.name == "replicate") for o in strats]
    pred = {name: predict(g, Cluster(spec, 2), mesh_costs(g, Cluster(spec, 2), 2, 1, strats),
                          rep) for name, spec in (("off", SPEC), ("on", on))}
    moved = g.conv_grad_bytes[grad[0]] / 2
    want = on.layout_change_s(moved) + moved / on.memory_bandwidth + 2 * on.kernel_overhead_s
    assert pred["on"].layout_change_time_s - pred["off"].layout_change_time_s == \
        pytest.approx(want, rel=1e-9)
    assert pred["on"].compute_time_s - pred["off"].compute_time_s == pytest.approx(want,
                                                                                    rel=1e-9)
    assert (op_times(g, Cluster(on, 1), 1.0) == op_times(g, Cluster(SPEC, 1), 1.0)).all()


def test_a_dense_kernel_gradient_is_a_transposed_matmul_priced_at_its_own_share():
    """x^T dy contracts both operands over their rows (`op_work.transposed_matmul`: XLA:CPU
    runs it on its generic dot, checked in the compiled program); the forward x @ w and
    the input gradient dy w^T do not. Only the kernel gradient's time moves with
    `DeviceSpec.transposed_matmul_efficiency`."""
    f32 = jax.ShapeDtypeStruct
    step = _sgd(lambda p, x: jnp.sum(jnp.tanh(jnp.tanh(x @ p["a"]) @ p["b"]) ** 2))
    w, x = {"a": f32((256, 128), jnp.float32), "b": f32((128, 64), jnp.float32)}, \
        f32((512, 256), jnp.float32)
    hlo = jax.jit(step).lower(w, x).compile().as_text()
    entry = hlo[hlo.index("ENTRY"):]
    assert " dot(" in entry or "dot_general" in entry      # the generic dot is there
    g = analyze_step(step, w, x, batch_size=512)
    mm = np.flatnonzero(g.is_matmul)
    t = np.flatnonzero(g.transposed)
    # a's and b's kernel gradients; the two forward matmuls and b's input gradient are not
    assert len(mm) == 5 and len(t) == 2 and set(t) <= set(mm)
    assert sorted(g.flops[t].tolist()) == [2 * 512 * 128 * 64, 2 * 512 * 256 * 128]
    half = dataclasses.replace(SPEC, transposed_matmul_efficiency=0.5)
    base, slow = (op_times(g, Cluster(s, 1), 1.0) for s in (SPEC, half))
    others = np.setdiff1d(np.arange(len(base)), t)
    np.testing.assert_array_equal(slow[others], base[others])
    assert (slow[t] > base[t]).all()


def test_max_pooling_and_its_gradient_are_priced_per_tap_and_per_element():
    """jax's roofline prices reduce_window_max and select_and_scatter_add at nothing; each
    is priced at its window taps and its operands' bytes, and at least the calibrated
    `window_tap_s` per tap (the pool) or `window_grad_s` per element of its result (the
    gradient, the un-pooled map). XLA:CPU's gradient is the slow expansion the figure
    stands for (a reduce-window over index arrays, then a scatter: checked in the compiled
    program)."""
    f32 = jax.ShapeDtypeStruct

    def pool(v):
        return jax.lax.reduce_window(v, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1),
                                     "SAME")

    step = _sgd(lambda p, x: jnp.sum(pool(_conv(x, p["w"])) ** 2))
    w, x = {"w": f32((3, 3, 8, 16), jnp.float32)}, f32((4, 16, 16, 8), jnp.float32)
    hlo = jax.jit(step).lower(w, x).compile().as_text()
    assert "reduce-window" in hlo and "scatter" in hlo
    g = analyze_step(step, w, x, batch_size=4)
    fwd, grad = np.flatnonzero(g.window_taps), np.flatnonzero(g.window_grad_elems)
    taps, elems = 4 * 8 * 8 * 16 * 9, 4 * 16 * 16 * 16   # pooled map x 3x3; the map
    assert g.window_taps[fwd].tolist() == [taps]
    assert g.window_grad_elems[grad].tolist() == [elems]
    assert g.bytes[fwd[0]] > 0 and g.bytes[grad[0]] > 0 and g.flops[grad[0]] == taps
    slow = dataclasses.replace(SPEC, window_tap_s=1e-7, window_grad_s=1e-6)
    base, more = (op_times(g, Cluster(s, 1), 1.0) for s in (SPEC, slow))
    np.testing.assert_allclose(more[fwd], taps * 1e-7 + SPEC.kernel_overhead_s, rtol=1e-9)
    np.testing.assert_allclose(more[grad], elems * 1e-6 + SPEC.kernel_overhead_s, rtol=1e-9)
    others = np.setdiff1d(np.arange(len(base)), np.concatenate([fwd, grad]))
    np.testing.assert_array_equal(more[others], base[others])


def test_gpu_profiles_price_the_expanded_pooling_gradient_and_batched_matmul_copies():
    """XLA:GPU runs a max pool's gradient as an argmax reduce-window writing each pooled
    element's value (f32) and position (one s32 per dim) and a scatter reading them back
    into a zeroed result (checked on an H100's compiled VGG-16: gpu_trace_nvidia-h100-
    80gb-hbm3.md), and copies batched matmuls' operands like XLA:CPU: the GPU built-ins
    say so (`expands_pooling_grads`, `relayouts_batched_dots`), the CPU's does not expand.
    The gradient's op is priced at those bytes more, at the bandwidth; nothing else moves."""
    from jaxwap.hardware.builtin_profiles import device_spec

    gpus = [device_spec(n) for n in ("h100-sxm", "h200", "a100-sxm-80gb", "v100-pcie")]
    assert all(d.expands_pooling_grads and d.relayouts_batched_dots for d in gpus)
    assert not device_spec("cpu").expands_pooling_grads
    bf16 = jax.ShapeDtypeStruct

    def pool(v):
        return jax.lax.reduce_window(v, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1),
                                     "VALID")

    step = _sgd(lambda p, x: jnp.sum(pool(_conv(x, p["w"])).astype(jnp.float32) ** 2))
    w, x = {"w": bf16((3, 3, 8, 64), jnp.bfloat16)}, bf16((4, 32, 32, 8), jnp.bfloat16)
    g = analyze_step(step, w, x, batch_size=4)
    (grad,) = np.flatnonzero(g.window_grad_elems)
    pooled, out = 4 * 16 * 16 * 64, 4 * 32 * 32 * 64
    assert g.window_grad_bytes[grad] == out * 2 + pooled * (4 + 8 * 4)
    assert np.count_nonzero(g.window_grad_bytes) == 1
    h100 = dataclasses.replace(device_spec("h100-sxm"), kernel_overhead_s=0.0)
    flat = dataclasses.replace(h100, expands_pooling_grads=False)
    on, off = (op_times(g, Cluster(s, 1), 1.0) for s in (h100, flat))
    np.testing.assert_allclose(on[grad] - off[grad],
                               g.window_grad_bytes[grad] / h100.memory_bandwidth, rtol=1e-9)
    others = np.arange(len(on)) != grad
    np.testing.assert_array_equal(on[others], off[others])


def test_small_conv_rate_follows_both_feature_counts_of_the_kernel():
    assert SPEC.small_conv_rate(512, 256) == pytest.approx(np.sqrt(5e8 * 2e9))
    assert SPEC.small_conv_rate(512, 512) == SPEC.small_conv_rate(512) == 5e8
    assert SPEC.small_conv_rate(0, 256) == 2e9       # unknown width: the median rate


def test_tensor_parallel_generic_loop_convolution_is_priced_at_the_kernel_a_device_holds():
    """A 3x3 convolution over a 2x2 map at 512 features takes XLA:CPU's generic loop, whose
    rate follows the kernel's feature counts. Split over the model axis, each device holds
    half the output features: its convolutions are priced at the rate of (512, 256), not
    at the whole kernel's; replicated, nothing changes."""
    g = _small_map_graph(512)
    slow = np.flatnonzero((g.conv == 2) & (g.tp_param == 0))
    assert len(slow) == 1        # the forward (the input is the batch: no input gradient)
    # B: the 256 rate made the 512 one, so a feature split cannot change the price
    flat = dataclasses.replace(SPEC, small_input_conv_rates=((128, 3e9), (256, 5e8),
                                                             (512, 5e8)))
    strats = [param_strategies(g, j, 1, 2) for j in range(len(g.params))]
    tp = next(i for i, s in enumerate(strats[0]) if s.tp != "none")
    rep = next(i for i, s in enumerate(strats[0]) if s.tp == "none")
    t = {(name, c): predict(g, Cluster(spec, 2), mesh_costs(g, Cluster(spec, 2), 1, 2, strats),
                            [c]).compute_time_s
         for name, spec in (("per-width", SPEC), ("flat", flat)) for c in (tp, rep)}
    assert t["per-width", rep] == pytest.approx(t["flat", rep], rel=1e-12)
    work = g.flops[slow].sum() / 2
    want = work / np.sqrt(5e8 * 2e9) - work / 5e8      # faster at the held width
    assert t["per-width", tp] - t["flat", tp] == pytest.approx(want, rel=1e-9)


def test_a_moved_fsdp_generic_loop_convolution_is_priced_at_the_kernel_a_device_holds():
    """Two convolutions over 2x2 maps, both FSDP on two devices: XLA moves their (small)
    activations and keeps each kernel split on its features (`collectives.fsdp_moves`), so each
    device runs its half of the features on the whole batch; their generic-loop time is
    priced at the width a device holds. Data-parallel (kernels whole), nothing moves."""
    f32 = jax.ShapeDtypeStruct
    w = {"a": f32((3, 3, 8, 512), jnp.float32), "b": f32((3, 3, 512, 512), jnp.float32)}
    g = analyze_step(_sgd(lambda p, x: jnp.sum(jnp.tanh(_conv(jnp.tanh(_conv(x, p["a"])),
                                                              p["b"])) ** 2)),
                     w, f32((8, 2, 2, 8), jnp.float32), batch_size=8)
    strats = [param_strategies(g, j, 2, 1) for j in range(len(g.params))]
    fsdp = [next(i for i, s in enumerate(o) if s.name == "fsdp") for o in strats]
    rep = [next(i for i, s in enumerate(o) if s.name == "replicate") for o in strats]
    moved = fsdp_moves(g.layers, {j: strats[j][fsdp[j]].spec.index(DATA)
                                  for j in range(len(g.params))})
    assert moved == {0, 1}
    flat = dataclasses.replace(SPEC, small_input_conv_rates=((128, 5e8), (256, 5e8),
                                                             (512, 5e8)))
    t = {(name, tuple(c)): predict(g, Cluster(spec, 2),
                                   mesh_costs(g, Cluster(spec, 2), 2, 1, strats), c
                                   ).compute_time_s
         for name, spec in (("per-width", SPEC), ("flat", flat)) for c in (fsdp, rep)}
    assert t["per-width", tuple(rep)] - t["flat", tuple(rep)] == pytest.approx(
        sum(g.flops[k] / 2 * (1 / SPEC.small_conv_rate(int(g.conv_width[k]),
                                                        float(g.conv_out_width[k]))
                              - 1 / 5e8)
            for k in np.flatnonzero(g.conv == 2)), rel=1e-9)
    slow = np.flatnonzero((g.conv == 2) & (g.tp_param >= 0))
    assert len(slow) >= 3        # both forwards and b's input gradient
    want = sum(g.flops[k] / 2 * (1 / SPEC.small_conv_rate(int(g.conv_width[k]),
                                                          g.conv_out_width[k] / 2) - 1 / 5e8)
               for k in slow)
    others = sum(g.flops[k] / 2 * (1 / SPEC.small_conv_rate(int(g.conv_width[k]),
                                                            float(g.conv_out_width[k])) - 1 / 5e8)
                 for k in np.setdiff1d(np.flatnonzero(g.conv == 2), slow))
    assert t["per-width", tuple(fsdp)] - t["flat", tuple(fsdp)] == pytest.approx(
        want + others, rel=1e-9)


def test_attention_heads_pay_the_copies_xla_cpu_makes_around_its_batched_matmuls():
    """XLA:CPU runs a batched matmul on operands with the batch dims leading: attention's
    `bqhd,bkhd->bhqk` has both operands copied, the heads split out of q, k and v and the
    output merged back are materialized. The model names most of those arrays
    (`grad_reductions.dot_relayouts`, checked against the compiled program's layout changes,
    independent of the model) and prices them as layout changes where the backend makes
    them (`DeviceSpec.relayouts_batched_dots`), which XLA's own replace when the model is
    fed its figures."""
    f32 = jax.ShapeDtypeStruct
    B, T, H, D = 8, 32, 4, 16

    def loss(p, x):
        q, k, v = (a.reshape(B, T, H, D) for a in jnp.split(x @ p["qkv"], 3, axis=-1))
        s = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5, axis=-1)
        return jnp.mean((jnp.einsum("bhqk,bkhd->bqhd", s, v).reshape(B, T, H * D)
                         @ p["o"]) ** 2)

    params = {"qkv": f32((H * D, 3 * H * D), jnp.float32), "o": f32((H * D, H * D), jnp.float32)}
    x = f32((B, T, H * D), jnp.float32)
    step = _sgd(loss)
    heads = {B * T * H * D * 4, B * H * T * T * 4}     # the arrays of q, k, v and scores
    xla = sum(b * n for b, n in layout_changes(jax.jit(step).lower(params, x).compile()
                                                .as_text()) if b in heads)
    g = analyze_step(step, params, x, batch_size=B)
    named = float(g.dot_relayout_bytes.sum())
    assert 0.5 * xla <= named <= xla, (named, xla)
    on = dataclasses.replace(SPEC, relayouts_batched_dots=True)
    strats = [param_strategies(g, j, 1, 1) for j in range(len(g.params))]
    rep = [0] * len(strats)
    pred = {name: predict(g, Cluster(spec, 1), mesh_costs(g, Cluster(spec, 1), 1, 1, strats),
                          rep) for name, spec in (("off", SPEC), ("on", on))}
    moved = g.dot_relayout_bytes[g.dot_relayout_bytes > 0]
    want = float(sum(on.layout_change_s(b) + on.kernel_overhead_s for b in moved))
    assert pred["on"].layout_change_time_s - pred["off"].layout_change_time_s == \
        pytest.approx(want, rel=1e-9)
    assert pred["on"].compute_time_s - pred["off"].compute_time_s == pytest.approx(want,
                                                                                    rel=1e-9)
