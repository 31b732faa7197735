"""Scale: clusters of nodes, meshes that follow them, plans for clusters not present."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from models import MLP, abstract_setup, copy_tree, setup

import jaxwap
from jaxwap.analysis.graph import analyze
from jaxwap.cost.collectives import all_gather, all_reduce
from jaxwap.search.meshes import device_counts, mesh_shapes

GB = 1e9


# --------------------------------------------------------------------------- Cluster
def test_cluster_without_nodes_is_one_flat_domain_as_before():
    c = jaxwap.Cluster("h100-sxm", 8, 25e9, 1e-5)
    assert c.devices_per_node is None and c.num_nodes == 1
    assert (c.link_bandwidth, c.link_latency) == (25e9, 1e-5)
    assert c.devices_in_node(8, 1) == 8
    assert jaxwap.Cluster.from_dict(c.to_dict()) == c


def test_cluster_of_nodes_defaults_and_round_trips():
    c = jaxwap.Cluster("h100-sxm", 64, devices_per_node=8)
    assert c.num_nodes == 8 and c.node_size == 8
    assert c.inter_node_bandwidth == c.device.network_bandwidth == 50 * GB
    assert jaxwap.Cluster.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    # a data axis of 16 with a model axis of 4 inside: 2 of its devices per node
    assert c.devices_in_node(16, 4) == 2
    assert c.devices_in_node(4, 1) == 4       # the model axis: inside one node
    assert c.devices_in_node(2, 4) == 2       # 8 devices: one node


@pytest.mark.parametrize("kwargs, field", [
    ({"devices_per_node": 3}, "devices_per_node"),
    ({"devices_per_node": 0}, "devices_per_node"),
    ({"devices_per_node": 8, "inter_node_bandwidth": 0.0}, "inter_node_bandwidth"),
    ({"devices_per_node": 8, "inter_node_latency": -1.0}, "inter_node_latency"),
    ({"link_bandwidth": -5.0}, "link_bandwidth"),
    ({"devices_per_node": 8, "inter_node_bandwidth": float("nan")}, "inter_node_bandwidth"),
])
def test_cluster_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        jaxwap.Cluster("h100-sxm", 16, **kwargs)


# --------------------------------------------------------------------------- pricing
def test_all_reduce_inside_a_node_is_the_ring_formula():
    c = jaxwap.Cluster("h100-sxm", 64, devices_per_node=8)
    t, sent = all_reduce(1 * GB, 8, c, inner=8)
    assert sent == pytest.approx(2 * 7 / 8 * GB)
    assert t == pytest.approx(2 * 7 / 8 * GB / c.link_bandwidth + 2 * 7 * c.link_latency)


def test_all_reduce_across_nodes_is_hierarchical_when_that_is_cheaper():
    """Reduce-scatter inside each node, all-reduce the 1/8 shards across the 8 nodes over
    each device's own network share, all-gather inside: seed 002's hybrid aggregation."""
    c = jaxwap.Cluster("h100-sxm", 64, link_latency=0.0, devices_per_node=8,
                       inter_node_bandwidth=12.5e9, inter_node_latency=0.0)
    B = 1 * GB
    t, _ = all_reduce(B, 64, c, inner=8)
    inside = 2 * (7 / 8) * B / c.link_bandwidth
    across = 2 * (7 / 8) * (B / 8) / 12.5e9
    flat = 2 * (63 / 64) * B / 12.5e9
    assert t == pytest.approx(inside + across)
    assert t < flat / 5
    # an all-gather across nodes gathers the same rank's pieces first, then inside
    g, _ = all_gather(B, 64, c, inner=8)
    assert g == pytest.approx(7 / 8 * B / 8 / 12.5e9 + 7 / 8 * B / c.link_bandwidth)


def test_one_device_per_node_reduces_over_the_network():
    c = jaxwap.Cluster("cpu", 2, devices_per_node=1, inter_node_bandwidth=1e9,
                       inter_node_latency=1e-3)
    t, _ = all_reduce(1e6, 2, c, inner=c.devices_in_node(2, 1))
    assert t == pytest.approx(1e6 / 1e9 + 2 * 1e-3)


# --------------------------------------------------------------------------- meshes
def test_model_axis_never_crosses_a_node():
    step, params, opt, data = abstract_setup((512, 512, 512, 16), 256, 512)
    graph = analyze(*_analysis_inputs(step, params, opt, data))
    shapes, skipped = mesh_shapes(64, 256, graph, node_size=8)
    assert shapes and all(8 % m == 0 for _, m in shapes)
    assert any("would cross nodes" in s for s in skipped)
    # meshes larger than a node take whole nodes
    assert all(d * m <= 8 or (d * m) % 8 == 0 for d, m in shapes)


def test_nodes_of_one_device_may_split_layers_over_the_network_at_its_price():
    # a cluster of one device per node (the two-process CPU cluster) has no inside of a
    # node: the model axis may span nodes, and its collectives then pay the network
    from jaxwap.cost.collectives import tp_group_cost

    step, params, opt, data = abstract_setup((512, 512, 512, 16), 256, 512)
    graph = analyze(*_analysis_inputs(step, params, opt, data))
    shapes, skipped = mesh_shapes(2, 256, graph, node_size=1)
    assert (1, 2) in shapes and (2, 1) in shapes and not skipped
    group = graph.layer_groups[0]
    nodes = jaxwap.Cluster("cpu", 2, devices_per_node=1, inter_node_bandwidth=1e9,
                           inter_node_latency=1e-3)
    flat = jaxwap.Cluster("cpu", 2, link_bandwidth=1e10, link_latency=5e-6)
    # a row-parallel first layer all-reduces its output over the model axis
    t_nodes, b_nodes = tp_group_cost(group, "none", ["row"], 1.0, 2, nodes)
    t_flat, b_flat = tp_group_cost(group, "none", ["row"], 1.0, 2, flat)
    assert b_nodes == b_flat > 0
    out = group[0].act_out_bytes
    assert t_nodes == pytest.approx(out / 1e9 + 2 * 1e-3)   # the ring of 2 over the network
    assert t_flat < t_nodes / 5


def test_large_clusters_enumerate_powers_of_two_and_whole_nodes():
    counts = device_counts(4096, 8)
    assert counts[-1] == 4096 and len(counts) <= 14
    assert all(n & (n - 1) == 0 for n in counts)
    assert device_counts(48, 8) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 40, 48]
    assert device_counts(8) == list(range(1, 9))


def _analysis_inputs(step, params, opt, data):
    from jaxwap.analysis.trace import layout_of

    layout, closed = layout_of(step, (params, opt, data), {}, params, None)
    return (closed, layout.inputs.roles, layout.outputs.roles, layout.params,
            layout.inputs.batch_size)


# --------------------------------------------------------------------------- plans
def _cluster(n: int, **kw) -> jaxwap.Cluster:
    return jaxwap.Cluster("h100-sxm", n, devices_per_node=8, **kw)


def test_plan_for_a_described_cluster_larger_than_the_devices_present():
    step, params, opt, data = abstract_setup((1024, 1024, 1024, 16), 1024, 1024)
    free = jaxwap.plan(step, params, opt, data, hardware=_cluster(512), cache=False,
                       objective="throughput")
    assert len(jax.devices()) == 8 and max(c.num_devices for c in free.candidates) == 512
    plan = jaxwap.plan(step, params, opt, data, hardware=_cluster(512), cache=False,
                       objective="throughput", num_devices=64)
    assert plan.num_devices == 64
    assert int(np.prod(list(plan.mesh_shape.values()))) == plan.num_devices
    assert plan.compiled is None and plan.verified is None
    assert any("analytic" in n and "512 devices" in n for n in plan.notes), plan.notes
    assert plan.device_ids == tuple(range(plan.num_devices))
    assert plan.mesh_shape["model"] <= 8
    text = plan.explain()
    assert "64 nodes of 8" in text and "nodes:" in text


def test_explain_of_a_512_device_plan_reads_at_that_scale():
    """Device ids as ranges, energy and power with SI prefixes, every mesh with its axes
    named (hybrid meshes' replica axis included), the chosen row first."""
    step, params, opt, data = abstract_setup((1024, 1024, 1024, 16), 1024, 1024)
    plan = jaxwap.plan(step, params, opt, data, hardware=_cluster(512), cache=False,
                       num_devices=512, objective="throughput")
    text = plan.explain()
    ids = ", ".join(f"{a}-{b}" for a, b in [(min(plan.device_ids), max(plan.device_ids))])
    assert f"devices: {ids}   batch" in text and "[0, 1, 2" not in text
    energy = next(ln for ln in text.splitlines() if ln.strip().startswith("energy"))
    # three significant digits and a prefix, not "140848.755 J/step"
    assert re.search(r" \d[\d.]{0,3} [kM]?J/step +\d[\d.]{0,3} [kMm\u00b5]?J/sample +"
                     r"\d[\d.]{0,3} k?W average", energy), energy
    table = text.split("candidates (every mesh considered):")[1].split("\n\n")[0]
    rows = [ln for ln in table.splitlines()[3:] if not ln.strip().startswith("--")]
    assert "CHOSEN" in rows[0]
    assert len(rows) == len(plan.candidates)
    for row in rows:
        assert re.match(r"  (replica|stage|data|model)=\d+( x (data|model)=\d+)*( dp)?"
                        r"( @\d+W)?  ", row), row


def test_auto_shard_with_fewer_devices_than_described_plans_for_those_present():
    step, params, opt, data = abstract_setup((64, 64, 16), 64, 32)
    sharded = jaxwap.auto_shard(step, params, hardware=_cluster(64), cache=False, verify=0)
    plan = sharded.plan_for(params, opt, data)
    assert plan.num_devices <= 8
    assert any("only 8 are present" in n for n in plan.notes), plan.notes


def test_a_saved_plan_runs_where_its_devices_are_and_is_refused_elsewhere(tmp_path):
    model = MLP((32, 32, 10))
    step, params, opt, batch = setup(model, (16, 12))
    made = jaxwap.plan(step, params, opt, batch, hardware=jaxwap.Cluster("cpu", 8),
                       cache=False, verify=0, objective="throughput")
    path = tmp_path / "plan.json"
    path.write_text(made.to_json())
    ran = jaxwap.auto_shard(step, params, plan=str(path))
    p, _, _ = ran(copy_tree(params), copy_tree(opt), batch)
    assert dict(ran.plan.mesh_shape) == dict(made.mesh_shape)
    assert ran.plan.params == made.params
    ref_p, _, _ = jax.jit(step)(params, opt, batch)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6),
                 ref_p, p)
    # made for 512 devices: refused on the 8 present, with the reason
    big = jaxwap.plan(step, params, opt, batch, hardware=_cluster(512), cache=False)
    with pytest.raises(ValueError, match="512 devices.*8 devices are present"):
        jaxwap.auto_shard(step, params, plan=big)(params, opt, batch)
    # another step's parameters: refused, naming the parameter
    other_step, other_params, other_opt, _ = setup(MLP((32, 48, 10)), (16, 12))
    with pytest.raises(ValueError, match=r"plan= cannot run this step here: parameter "
                                         r"params/Dense_1/bias is \(48,\) float32 here"):
        jaxwap.auto_shard(other_step, other_params, plan=made)(other_params, other_opt, batch)


_DETERMINISM = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import sys
sys.path.insert(0, {tests!r})
from models import abstract_setup
import jaxwap
step, params, opt, data = abstract_setup((256, 256, 256, 16), 512, 256)
plan = jaxwap.plan(step, params, opt, data, cache=False,
                   hardware=jaxwap.Cluster("h100-sxm", 256, devices_per_node=8))
sys.stdout.write(plan.to_json())
"""


def test_two_processes_planning_the_same_step_write_the_same_bytes():
    code = _DETERMINISM.format(tests=str(Path(__file__).parent))
    outs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=300, check=True).stdout for _ in range(2)]
    assert outs[0] == outs[1] and json.loads(outs[0])["mesh_shape"]


@pytest.mark.parametrize("objective", ["throughput", "balanced", "energy"])
def test_pruned_search_of_a_large_cluster_finds_the_best_of_every_mesh(objective):
    """Branch and bound skips only meshes that cannot win: the plan equals the best of
    solving every mesh shape (and hybrid-sharding the best of those, as the search does)."""
    from jaxwap.search.across_meshes import _hybrids, search
    from jaxwap.search.meshes import mesh_shapes
    from jaxwap.search.solve import solve_mesh

    step, params, opt, data = abstract_setup((2048, 2048, 2048, 16), 65536, 2048)
    graph = analyze(*_analysis_inputs(step, params, opt, data))
    cluster = _cluster(512)
    obj = jaxwap.Objective.parse(objective)
    got = search(graph, cluster, obj, 512, 72e9)
    if objective == "throughput":   # small meshes cannot be fast enough: not solved
        assert any("cannot beat" in s for s in got.skipped)
    best = got.results[got.best]
    shapes, _ = mesh_shapes(512, graph.batch_size, graph, node_size=8)
    every = [solve_mesh(graph, cluster, d, m, 72e9) for d, m in shapes]
    every += _hybrids(graph, cluster, obj, every, 72e9, True, None)
    ranked = obj.rank([r.predicted if r.fits else None for r in every],
                      max_watts=cluster.device.max_watts, num_devices_available=512)
    want = every[ranked.best]
    assert (best.d, best.m, best.r, best.strategies) == (want.d, want.m, want.r,
                                                         want.strategies)
    # + the data-parallel baseline
    assert len(got.results) <= len(every) + 1 and len(every) <= 2 * len(shapes)


# --------------------------------------------------------------------------- uneven batches
def _decoder_for_2520():
    """A scanned, checkpointed decoder 640 wide (2^7 x 5) for a batch of 2,520 sequences
    (2^3 x 3^2 x 5 x 7): weights dominate what a device holds."""
    from benchmarks.models import zoo

    return zoo.llama("llama_tiny", batch_size=2520, scan=True, remat=True, layers=8,
                     d_model=640, heads=8, kv_heads=8, ffn=2560, vocab=640, seq_len=4)


def test_a_batch_with_few_factors_of_two_searches_the_counts_that_shard_its_weights_further():
    """2,520 sequences on 2,520 GPUs: no power of two past 8 splits the batch, and the
    whole cluster's data axis (315 at a model axis of 8) shares only 5 with the weights'
    dims, so every power-of-two count and the whole cluster hold the weights 64 or 40
    ways. 2,240 GPUs (7 replicas of a data axis of 40, model 8) hold them 320 ways: the
    only count that fits a budget the others miss, and one `device_counts` never lists."""
    w = _decoder_for_2520()
    cluster = jaxwap.Cluster("a100-sxm-80gb", 2520, devices_per_node=8)
    assert 2240 not in device_counts(2520, 8)
    plan = jaxwap.plan(w.step, *w.args, params=w.params, hardware=cluster, cache=False,
                       objective="throughput", verify=0, memory_budget=3e6)
    assert plan.num_devices == 2240
    assert dict(plan.mesh_shape) == {"replica": 7, "data": 40, "model": 8}
    assert plan.predicted.peak_memory_bytes <= 3e6
    others = [c for c in plan.candidates if c.num_devices != 2240]
    assert others and not any(c.fits for c in others)


def test_a_power_of_two_batch_adds_no_device_counts_and_an_uneven_one_adds_few():
    from jaxwap.search.meshes import even_split_counts

    step, params, opt, data = abstract_setup((1024, 1024, 1024, 16), 4096, 1024)
    graph = analyze(*_analysis_inputs(step, params, opt, data))
    counts = device_counts(4096, 8)
    assert even_split_counts(4096, 4096, graph, 1, 8, counts) == set()
    assert even_split_counts(4096, 4096, graph, 4, 8, counts) == set()
    # a 2,520 batch on 2,520 devices of nodes of 8: a handful of counts, each a whole
    # number of nodes whose (data, model) split divides the batch
    added = even_split_counts(2520, 2520, graph, 1, 8, device_counts(2520, 8))
    assert added and len(added) <= 8, added
    assert all(n % 8 == 0 and n not in device_counts(2520, 8) for n in added)
    assert all(any(2520 % (n // m) == 0 for m in (1, 2, 4, 8) if n % m == 0)
               for n in added)
    # a cluster small enough to try every count adds none
    assert even_split_counts(48, 48, graph, 1, 8, device_counts(48, 8)) == set()


def test_a_batch_no_power_of_two_splits_far_is_planned_on_the_devices_that_split_it():
    """1,000 sequences on 1,024 H100s: the power-of-two meshes that split the batch stop
    at 64 devices (a data axis of 8 x model 8); the 1,000 GPUs that split it evenly
    compute each step's batch over 16x as many, and throughput takes them."""
    from benchmarks.models import zoo

    w = zoo.llama("llama_tiny", batch_size=1000, scan=True, remat=True, layers=4,
                  d_model=1024, heads=8, kv_heads=8, ffn=4096, vocab=32000, seq_len=2048)
    assert not any(1000 % d == 0 and d > 8 for d in device_counts(1024, 8))
    plan = jaxwap.plan(w.step, *w.args, params=w.params, hardware=_cluster(1024),
                       cache=False, objective="throughput", verify=0)
    assert plan.num_devices == 1000
    mesh = dict(plan.mesh_shape)
    assert 1000 % (mesh.get("replica", 1) * mesh["data"]) == 0


def test_a_pipelines_stages_take_the_devices_that_split_their_rows():
    """1,536 sequences over 16 stages of 8,192 H100s: a stage's 96 rows split over no
    data axis of its 512 devices with the model axis inside a node (64 x TP8 at the
    least), so the halvings gave each stage 256 (data 32 x TP8); 384 devices split them
    too (data 48 x TP8 or 96 x TP4), and the stages take those: 6,144 GPUs."""
    from benchmarks.models import zoo

    w = zoo.llama("llama_tiny", batch_size=1536, scan=True, remat=True, layers=32,
                  d_model=1024, heads=8, kv_heads=8, ffn=4096, vocab=32000, seq_len=2048)
    plan = jaxwap.plan(w.step, *w.args, params=w.params, hardware=_cluster(8192),
                       cache=False, objective="throughput", verify=0,
                       pipeline={"stages": 16})
    mesh = dict(plan.mesh_shape)
    assert plan.step.stages == mesh["stage"] == 16
    assert mesh["data"] * mesh["model"] == 384 and plan.num_devices == 6144
    assert 96 % mesh["data"] == 0
