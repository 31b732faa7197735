"""benchmarks/cluster_timeline.py's reading of two processes' timelines: which part of a
collective is its own time and which the early process's wait, and what counts as
compute. Synthetic timelines with known answers; the benchmark itself needs a cluster."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import cluster_timeline as tl  # noqa: E402

MS = 1_000_000   # ns


def _process(steps, events, wall_s=0.01):
    prices = {"all-gather.1": {"kind": "all-gather", "bytes": 64, "buffers": 1,
                               "priced_s": 0.002},
              "all-reduce": {"kind": "all-reduce", "bytes": 8, "buffers": 2,
                             "priced_s": 0.004}}
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


def test_union_counts_overlapping_spans_once():
    assert tl.union_ns([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20
    assert tl.union_ns([]) == 0
