"""benchmarks/cluster/cluster_timeline.py's reading of two processes' timelines: which part of a
collective is its own time and which the early process's wait, and what counts as
compute. Synthetic timelines with known answers; the benchmark itself needs a cluster."""

import pytest

from benchmarks.cluster import cluster_timeline as tl

MS = 1_000_000   # ns


def _process(steps, events, wall_s=0.01):
    prices = {"all-gather.1": {"kind": "all-gather", "bytes": 64, "buffers": 1,
                               "priced_s": 0.002},
              "all-reduce": {"kind": "all-reduce", "bytes": 8, "buffers": 2,
                             "priced_s": 0.004}}
    # each event with its kind, as the worker records it (op_profile.xla_kind)
    events = [(a, d, name, "collective" if tl.COLLECTIVE.match(name) else name.split(".")[0])
              for a, d, name in events]
    return {"steps": steps, "events": events, "walls_s": [wall_s] * 3, "prices": prices,
            "predicted": {"step_s": 0.0, "compute_s": 0.0, "comm_s": 0.0,
                          "xla_fed_step_s": 0.0, "xla_fed_comm_s": 0.0}}


def test_the_later_process_times_the_collective_and_the_earlier_one_waits():
    # step 2 of each process: p0 enters the gather at 10 ms, p1 at 14 ms; both leave at
    # 15 ms, so the gather's own time is 1 ms and p0 waited 4 ms on top
    p0 = _process([(0, 20 * MS), (100 * MS, 130 * MS)], [
        (1 * MS, 5 * MS, "fusion"),                      # step 1: ignored
        (101 * MS, 9 * MS, "fusion.2"),                  # 101-110 compute
        (110 * MS, 5 * MS, "all-gather.1"),
        (115 * MS, 3 * MS, "all-reduce"),
        (118 * MS, 2 * MS, "convolution")])              # 118-120 compute
    p1 = _process([(0, 20 * MS), (100 * MS, 130 * MS)], [
        (101 * MS, 13 * MS, "fusion.2"),                 # 101-114 compute
        (112 * MS, 2 * MS, "copy.3"),                    # overlaps the fusion: counted once
        (114 * MS, 1 * MS, "all-gather.1"),
        (115 * MS, 3 * MS, "all-reduce"),
        (118 * MS, 2 * MS, "convolution")], wall_s=0.03)
    got = tl.analyse([p0, p1])
    rows = {r["name"]: r for r in got["collectives"]}
    assert list(rows) == ["all-gather.1", "all-reduce"]      # in the order they ran
    assert rows["all-gather.1"]["own_s"] == pytest.approx(0.001)
    assert rows["all-gather.1"]["wait_s"] == pytest.approx([0.004, 0.0])
    assert rows["all-reduce"]["own_s"] == pytest.approx(0.003)
    assert rows["all-reduce"]["wait_s"] == pytest.approx([0.0, 0.0])
    assert got["own_s"] == pytest.approx(0.004)
    assert got["wait_s"] == pytest.approx([0.004, 0.0])
    assert got["compute_s"] == pytest.approx([0.011, 0.015])
    assert got["priced_s"] == pytest.approx(0.006)
    assert got["step_s"] == pytest.approx(0.03)          # the slower process's wall
    # each moment of the step goes to what ran then, shared where two ran at once; the
    # rest is idle: before the first operation, between, after the last
    assert got["by_kind_s"][0] == pytest.approx(
        {"fusion": 0.009, "collective": 0.008, "convolution": 0.002})
    assert got["by_kind_s"][1] == pytest.approx(
        {"fusion": 0.012, "copy": 0.001, "collective": 0.004, "convolution": 0.002})
    assert [tuple(x) for x in got["idle_s"]] == [pytest.approx((0.001, 0.0, 0.010))] * 2


def test_a_one_device_candidate_is_read_from_the_process_that_ran_it():
    p0 = _process([(0, 10 * MS)], [(1 * MS, 4 * MS, "fusion"), (6 * MS, 2 * MS, "dot")])
    got = tl.analyse([p0, {"process": 1, "idle": True, "predicted": p0["predicted"]}])
    assert got["collectives"] == [] and got["compute_s"] == pytest.approx([0.006])
    assert [tuple(x) for x in got["idle_s"]] == [pytest.approx((0.001, 0.001, 0.002))]


def test_a_collective_in_a_loop_is_summed_over_its_trips_and_priced_per_trip():
    ev0 = [(10 * MS + i * 10 * MS, 2 * MS, "all-gather.1") for i in range(3)]
    ev1 = [(11 * MS + i * 10 * MS, 1 * MS, "all-gather.1") for i in range(3)]
    got = tl.analyse([_process([(0, 50 * MS)], ev0), _process([(0, 50 * MS)], ev1)])
    (row,) = got["collectives"]
    assert row["times"] == 3
    assert row["own_s"] == pytest.approx(0.003)
    assert row["wait_s"] == pytest.approx([0.003, 0.0])
    assert row["priced_s"] == pytest.approx(0.006)


def test_only_collective_operations_are_collectives():
    for name in ("all-gather", "all-reduce.11", "all-to-all.1", "reduce-scatter.2",
                 "collective-permute-start.3", "all-gather-done"):
        assert tl.COLLECTIVE.match(name), name
    for name in ("fusion.all-gather", "copy_all-reduce_fusion", "all-gathered", "dot.2"):
        assert not tl.COLLECTIVE.match(name), name


def test_an_operation_runs_to_its_end_mark_and_overlaps_are_shared_out():
    # XLA:CPU records an operation split into parallel parts for its launching thread's
    # part, and marks when its last part ends ("end: <op>"): it runs to that mark
    from types import SimpleNamespace as NS

    from benchmarks.accuracy import op_profile

    def ev(name, start, dur):
        return NS(name=name, start_ns=start, duration_ns=dur)

    profile = NS(planes=[NS(name="/host:CPU", lines=[
        NS(name="python", events=[ev("$x.py:1 run", 0, 50)]),
        NS(name="tf_XLAEigen/1", events=[ev("copy.65", 0, 5), ev("end: copy.65", 35, 0),
                                         ev("ThreadpoolListener::Record", 1, 0),
                                         ev("dot", 36, 4), ev("copy.65", 41, 2),
                                         ev("end: copy.65", 44, 0)])])])
    ops, host = op_profile.op_events(profile)
    assert sorted(ops) == [(0, 35, "copy.65"), (36, 4, "dot"), (41, 3, "copy.65")]
    assert host == [(0, 50, "$x.py:1 run")]
    got = op_profile.shared_out([(0, 10, "a"), (5, 15, "b"), (20, 25, "a")])
    assert got == pytest.approx({"a": 12.5e-9, "b": 7.5e-9})


def test_union_counts_overlapping_spans_once():
    assert tl.union_ns([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20
    assert tl.union_ns([]) == 0
