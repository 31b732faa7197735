"""Devices that share one host's memory system (a CPU cluster's processes on one machine):
a mesh whose devices run at once prices its memory-bound work slower by what the
calibration measured of the host, and a one-device mesh, or devices with memory of their
own, as before. The calibration's measurement itself is tested on a real two-process
cluster (`test_calibrate_cluster.py`)."""

from __future__ import annotations

import pytest
from models import abstract_setup

import jaxwap
from jaxwap.device import DeviceSpec
from jaxwap.hardware import Cluster
from jaxwap.planner import make_plan

MiB = 2**20
SPEC = DeviceSpec("test-cpu", peak_flops=1e11, memory_bandwidth=2e10, memory_bytes=8e9,
                  idle_watts=5, max_watts=50, kernel_overhead_s=1e-6,
                  fresh_memory_cost=((16 * MiB, 1e-10), (64 * MiB, 6e-10)),
                  layout_change_cost=((2**14, 1e-10), (2**24, 2e-9)),
                  reduction_cost=((2**12, 3e-11), (2**22, 1e-11)))


def test_a_shared_bus_slows_each_device_by_how_many_share_it():
    """The host's bandwidth is host_devices / slowdown devices' worth: one device alone
    runs at its own speed, and each further one takes a share once that is exceeded."""
    c = Cluster(SPEC, 4, host_devices=4, host_memory_slowdown=2.0)
    assert [c.memory_slowdown_when_using(n) for n in (1, 2, 3, 4, 8)] == \
        [1.0, 1.0, 1.5, 2.0, 2.0]
    two = Cluster(SPEC, 2, host_devices=2, host_memory_slowdown=1.5)
    assert two.co_running(1) is two
    slowed = two.co_running(2).device
    assert slowed.memory_bandwidth == pytest.approx(SPEC.memory_bandwidth / 1.5)
    for table in ("fresh_memory_cost", "layout_change_cost", "reduction_cost"):
        assert getattr(slowed, table) == tuple((b, v * 1.5) for b, v in getattr(SPEC, table))
    # compute is not the memory system's: untouched
    assert slowed.peak_flops == SPEC.peak_flops and slowed.kernel_overhead_s == 1e-6
    # devices with memory of their own (the default): nothing shared, nothing slowed
    own = Cluster(SPEC, 2)
    assert own.co_running(2) is own and own.memory_slowdown_when_using(2) == 1.0


def test_the_host_figures_survive_a_record_and_bad_ones_are_named():
    c = Cluster(SPEC, 2, host_devices=2, host_memory_slowdown=1.4)
    assert Cluster.from_dict(c.to_dict()) == c
    # a cluster without them keeps the record (and so the plan cache's key) it had
    assert "host_memory_slowdown" not in Cluster(SPEC, 2).to_dict()
    with pytest.raises(ValueError, match="host_memory_slowdown"):
        Cluster(SPEC, 2, host_devices=2, host_memory_slowdown=0.5)
    with pytest.raises(ValueError, match="host_devices"):
        Cluster(SPEC, 2, host_devices=0)


def _predictions(cluster: Cluster) -> dict[tuple[int, int], jaxwap.Plan]:
    step, params, opt, batch = abstract_setup([1024, 1024, 10], 256, 1024)
    planned = make_plan(step, (params, opt, batch), {}, params=None,
                        options=jaxwap.PlanOptions(hardware=cluster, verify=0, cache=False))
    return {(r.d, r.m): r.predicted for r in planned.search.results if r.variant == "planner"}


def test_a_mesh_of_co_running_devices_pays_the_hosts_memory_slowdown():
    """The same model planned for two devices of their own and for two processes of one
    host: the one-device step is priced alike; on two devices the memory-bound work (and
    only it) takes longer, compute-bound time stays, and the flops are the same."""
    own = _predictions(Cluster(SPEC, 2))
    shared = _predictions(Cluster(SPEC, 2, host_devices=2, host_memory_slowdown=1.5))
    assert shared[1, 1] == own[1, 1]
    two = [k for k in own if k[0] * k[1] == 2]
    assert two
    for k in two:
        a, b = own[k], shared[k]
        assert b.compute_time_s > a.compute_time_s, k
        assert b.flops_per_device == a.flops_per_device
        # what grew is memory-bound: at most half again of the time that is not
        # compute-bound (the 1.5 slowdown), and more than nothing
        memory_side = a.compute_time_s - a.compute_bound_time_s
        assert 0 < b.compute_time_s - a.compute_time_s <= 0.5 * memory_side + 1e-12, k


def test_explain_says_what_the_shared_host_costs_the_chosen_mesh():
    step, params, opt, batch = abstract_setup([1024, 1024, 10], 256, 1024)
    cluster = Cluster(SPEC, 2, host_devices=2, host_memory_slowdown=1.5)
    plan = jaxwap.plan(step, params, opt, batch, hardware=cluster, verify=0, cache=False)
    text = plan.explain()
    slow = cluster.memory_slowdown_when_using(plan.num_devices)
    assert f"2 devices share a host's memory: {slow:.2f}x the memory-bound time" in text
    assert "share a host" not in jaxwap.plan(step, params, opt, batch, hardware=Cluster(
        SPEC, 2), verify=0, cache=False).explain()
