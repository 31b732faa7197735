"""Devices that share one host's memory (a CPU cluster's processes on one machine): a
mesh whose devices run at once prices its memory-side work slower by what the
calibration measured of the host, each kind by its own slowdown, and a one-device mesh,
or devices with memory of their own, as before. The calibration's measurement itself is
tested on a real two-process cluster (`test_calibrate_cluster.py`)."""

from __future__ import annotations

import pytest
from models import abstract_setup

import jaxwap
from jaxwap.hardware.cluster import Cluster, HostMemory
from jaxwap.hardware.device import DeviceSpec
from jaxwap.planner import make_plan

MiB = 2**20
SPEC = DeviceSpec("test-cpu", peak_flops=1e11, memory_bandwidth=2e10, memory_bytes=8e9,
                  idle_watts=5, max_watts=50, kernel_overhead_s=1e-6,
                  fresh_memory_cost=((16 * MiB, 1e-10), (64 * MiB, 6e-10)),
                  layout_change_cost=((2**14, 1e-10), (2**24, 2e-9)),
                  reduction_cost=((2**12, 3e-11), (2**22, 1e-11)))
HOST = HostMemory(2, stream=1.5, layout=1.2, fresh=1.1)


def test_a_shared_host_slows_each_kind_by_how_many_devices_run_at_once():
    """The host is devices / slowdown devices' worth of each kind: one device alone runs
    at its own speed, each further one takes a share once that is exceeded."""
    four = HostMemory(4, stream=2.0, layout=1.0, fresh=3.0)
    assert [four.slowdown("stream", n) for n in (1, 2, 3, 4, 8)] == [1.0, 1.0, 1.5, 2.0, 2.0]
    assert [four.slowdown("fresh", n) for n in (1, 2, 4)] == [1.0, 1.5, 3.0]
    assert four.slowdown("layout", 4) == 1.0
    # one device runs alone as measured, even where all at once took more than k times
    assert HostMemory(2, stream=3.0, layout=1.0, fresh=1.0).slowdown("stream", 1) == 1.0
    two = Cluster(SPEC, 2, host_memory=HOST)
    assert two.co_running(1) is two
    slowed = two.co_running(2).device
    assert slowed.memory_bandwidth == pytest.approx(SPEC.memory_bandwidth / 1.5)
    for table, by in (("reduction_cost", 1.5), ("layout_change_cost", 1.2),
                      ("fresh_memory_cost", 1.1)):
        got, was = getattr(slowed, table), getattr(SPEC, table)
        assert [b for b, _ in got] == [b for b, _ in was], table
        assert [v for _, v in got] == pytest.approx([v * by for _, v in was]), table
    # compute is not the memory's: untouched
    assert slowed.peak_flops == SPEC.peak_flops and slowed.kernel_overhead_s == 1e-6
    # devices with memory of their own (the default): nothing shared, nothing slowed
    own = Cluster(SPEC, 2)
    assert own.co_running(2) is own


def test_the_host_record_survives_a_plan_record_and_bad_figures_are_named():
    c = Cluster(SPEC, 2, host_memory=HOST)
    assert Cluster.from_dict(c.to_dict()) == c
    # a cluster without one keeps the record (and so the plan cache's key) it had
    assert "host_memory" not in Cluster(SPEC, 2).to_dict()
    with pytest.raises(ValueError, match="HostMemory stream slowdown"):
        HostMemory(2, stream=0.5, layout=1.0, fresh=1.0)
    with pytest.raises(ValueError, match="HostMemory devices"):
        HostMemory(0, stream=1.0, layout=1.0, fresh=1.0)
    with pytest.raises(ValueError, match="Cluster host_memory"):
        Cluster(SPEC, 2, host_memory={"devices": 2})


def _predictions(cluster: Cluster) -> dict[tuple[int, int], jaxwap.Plan]:
    step, params, opt, batch = abstract_setup([1024, 1024, 10], 256, 1024)
    planned = make_plan(step, (params, opt, batch), {}, params=None,
                        options=jaxwap.PlanOptions(hardware=cluster, verify=0, cache=False))
    return {(r.d, r.m): r.predicted for r in planned.search.results if r.variant == "planner"}


def test_a_mesh_of_co_running_devices_pays_the_hosts_memory_slowdown():
    """The same model planned for two devices of their own and for two processes of one
    host: the one-device step is priced alike; on two devices the memory-side work (and
    only it) takes longer, compute-bound time stays, and the flops are the same."""
    own = _predictions(Cluster(SPEC, 2))
    shared = _predictions(Cluster(SPEC, 2, host_memory=HOST))
    assert shared[1, 1] == own[1, 1]
    two = [k for k in own if k[0] * k[1] == 2]
    assert two
    for k in two:
        a, b = own[k], shared[k]
        assert b.flops_per_device == a.flops_per_device
        # what grew is memory-side: more than nothing, at most half again of the time
        # that is not compute-bound (the largest slowdown, 1.5)
        memory_side = a.compute_time_s - a.compute_bound_time_s
        assert 0 < b.compute_time_s - a.compute_time_s <= 0.5 * memory_side + 1e-12, k


def test_explain_says_what_the_shared_host_costs_the_chosen_mesh():
    step, params, opt, batch = abstract_setup([1024, 1024, 10], 256, 1024)
    plan = jaxwap.plan(step, params, opt, batch, hardware=Cluster(SPEC, 2, host_memory=HOST),
                       verify=0, cache=False)
    n = plan.num_devices
    assert (f"2 devices share a host's memory: streaming {HOST.slowdown('stream', n):.2f}x, "
            f"layout changes {HOST.slowdown('layout', n):.2f}x, fresh memory "
            f"{HOST.slowdown('fresh', n):.2f}x as long on this mesh") in plan.explain()
    assert "share a host" not in jaxwap.plan(step, params, opt, batch, hardware=Cluster(
        SPEC, 2), verify=0, cache=False).explain()
