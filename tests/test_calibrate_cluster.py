"""Calibration on a real cluster of processes (two, one CPU core and one device each,
gloo between them), the fall-back when the cluster cannot start, and the rendezvous and
launcher under them. The cluster runs are real subprocesses; the rest is fast."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
from pathlib import Path

import jax
import pytest
from models import collectives_reproduced

from jaxwap.calibration.probes import cpu_bandwidth_bytes
from jaxwap.calibration.store import load_calibration
from jaxwap.hardware.calibration import Calibration
from jaxwap.hardware.cluster import HostMemory, detect_cluster
from jaxwap.runtime.distributed import rendezvous, start_distributed
from jaxwap.runtime.launch import describe, free_port, launch_local

HERE = Path(__file__).parent


class _Dev:
    """What `detect_cluster` reads of a device of the cluster the record was made on."""

    platform = device_kind = "cpu"

    def __init__(self, id: int, process_index: int) -> None:
        self.id, self.process_index = id, process_index


def _records(results):
    out = []
    for r in results:
        lines = [ln for ln in r.output.splitlines() if ln.startswith("RECORD ")]
        assert lines, f"process {r.process_id} printed no record:\n{r.tail()}"
        out.append(Calibration.from_dict(json.loads(lines[-1][len("RECORD "):])))
    return out


def test_two_process_cluster_calibration_measures_the_link(tmp_path):
    results = launch_local([sys.executable, str(HERE / "calibrate_worker.py"), str(tmp_path)],
                           num_processes=2, timeout_s=150)
    assert all(r.ok for r in results), describe(results)
    if len(os.sched_getaffinity(0)) >= 2:
        assert results[0].core != results[1].core  # pinned apart: two real devices
    cals = _records(results)
    for r, cal in zip(results, cals, strict=True):
        assert cal.num_processes == 2 and cal.num_devices == 2, describe(results)
        assert cal.measurements["topology"]["devices_per_process"] == 1
        link = cal.measurements["link"]
        assert link is not None and len(link["sizes_bytes"]) >= 3
        assert min(link["sizes_bytes"]) <= 4096 and max(link["sizes_bytes"]) >= 2**20
        assert "2 process" in link["what"]
        assert cal.spec.link_bandwidth > 0 and cal.spec.link_latency_s >= 0
        collectives_reproduced(cal)
        assert cal.spec.peak_flops_f32 > 0 and cal.spec.memory_bandwidth > 0
        assert not any("one device" in n or "fell back" in n for n in cal.notes)
        assert "REUSED True" in r.output  # the second calibration reused it, on both
        # each process's own directory holds the record (process 1 wrote its own copy)
        mine = load_calibration(jax.devices()[0], tmp_path / f"process{r.process_id}", 2)
        assert mine is not None and mine.spec == cal.spec
    # the processes agree: one profile, the same link figures, each one's own on record
    assert cals[0].spec == cals[1].spec
    per = cals[0].measurements["per_process"]
    assert len(per["link_bandwidth"]) == 2 and all(v > 0 for v in per["link_bandwidth"])
    # both processes on this host: each ran the memory-side work alone, in turn, and then
    # both at once; a slowdown is each process's together over alone (their median)
    host = cals[0].measurements["host_memory"]
    assert host["devices"] == 2
    for kind in ("stream", "layout", "fresh"):
        # a call of each (256 MiB streamed at the most) takes well under its 0.5 s window
        assert 0 < host[f"alone_s@{kind}"] < 0.25 and 0 < host[f"together_s@{kind}"] < 0.5
        own = per[f"host_slowdown@{kind}"]
        assert all(v >= 1.0 for v in own) and host[kind] == pytest.approx(sum(own) / 2)
    # the calibrated bandwidth is the stream's alone, not what chance overlap left it
    alone = per["host_alone_s@stream"]
    assert cals[0].spec.memory_bandwidth == pytest.approx(
        sum(2 * cpu_bandwidth_bytes() / t for t in alone) / 2, rel=1e-5)
    cluster, _ = detect_cluster([_Dev(0, 0), _Dev(1, 1)], cals[0])
    assert cluster.host_memory == HostMemory(2, host["stream"], host["layout"], host["fresh"])
    # a one-process load does not pick up the cluster's record
    assert load_calibration(jax.devices()[0], tmp_path / "process0", 1) is None


def test_a_lone_process_falls_back_within_the_timeout(tmp_path):
    argv = [sys.executable, "-m", "jaxwap", "calibrate", "--quick", "--fresh",
            "--coordinator", "{coordinator}", "--num-processes", "2", "--process-id", "0",
            "--timeout", "3"]
    # the launcher's 90 s is a safety net, not the check: a process that waited past it
    # is reported timed out and fails `r.ok`; what is asserted is that it gave up by its
    # own 3 s timeout (the message) and calibrated alone
    (r,) = launch_local(argv, num_processes=1, timeout_s=90,
                        env={**os.environ, "JAXWAP_CACHE_DIR": str(tmp_path)})
    assert r.ok and not r.timed_out, describe([r])
    assert "jax.distributed did not start" in r.output
    assert "process 0 of 2" in r.output and "missing process ids [1]" in r.output
    cal = load_calibration(jax.devices()[0], tmp_path, 1)
    assert cal is not None and cal.num_devices == 1 and cal.num_processes == 1
    assert any(n.startswith("fell back to one process") for n in cal.notes)
    assert cal.measurements["link"] is None


# --------------------------------------------------------------------------- fast parts
def _meet(coordinator, specs, timeout_s):
    out = {}

    def one(n, i):
        out[i] = rendezvous(coordinator, n, i, timeout_s)

    threads = [threading.Thread(target=one, args=s) for s in specs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_rendezvous_meets_everyone_or_says_why():
    c = f"127.0.0.1:{free_port()}"
    assert _meet(c, [(3, 0), (3, 1), (3, 2)], 10) == {0: None, 1: None, 2: None}
    c = f"127.0.0.1:{free_port()}"
    got = _meet(c, [(3, 0), (3, 1)], 0.5)   # returns only by the timeout: one never comes
    assert "missing process ids [2]" in got[0] and got[1].startswith("process 0 refused")
    got = _meet(f"127.0.0.1:{free_port()}", [(2, 0), (3, 1)], 10)
    assert "expects 3 processes" in got[0] and "expects 3 processes" in got[1]
    assert "no coordinator answered" in rendezvous(f"127.0.0.1:{free_port()}", 2, 1, 0.3)


def test_rendezvous_on_a_taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        c = f"127.0.0.1:{s.getsockname()[1]}"
        assert "cannot listen" in rendezvous(c, 2, 0, 1)
        assert "did not answer" in rendezvous(c, 2, 1, 0.3)


def test_bad_cluster_arguments_are_named():
    with pytest.raises(ValueError, match="coordinator"):
        start_distributed("localhost", 2, 0)
    with pytest.raises(ValueError, match="process_id"):
        start_distributed("localhost:1234", 2, 2)
    with pytest.raises(ValueError, match="timeout_s"):
        start_distributed("localhost:1234", 2, 0, timeout_s=0)
    # this process's backend is running: no attempt, a reason (never a crash)
    jax.devices()
    assert "already" in start_distributed(f"127.0.0.1:{free_port()}", 2, 0, 1)


def test_launcher_kills_the_rest_when_one_fails():
    code = "import os, sys, time; sys.exit(3) if os.environ['JAXWAP_PROCESS_ID'] == '1' " \
           "else time.sleep(60)"
    # process 0 would sleep 60 s, past the 30 s timeout: killed and not timed out means
    # the launcher stopped it because process 1 failed, whatever the machine's speed
    results = launch_local([sys.executable, "-c", code, "{process_id}"], 2, timeout_s=30)
    assert results[1].returncode == 3 and not results[1].killed
    assert results[0].killed and not results[0].timed_out
    results = launch_local([sys.executable, "-c", "import time; time.sleep(60)"], 1,
                           timeout_s=0.5)
    assert results[0].timed_out and "time ran out" in describe(results)


def test_launcher_threads_size_xla_pools_and_leave_cores_to_the_os():
    # `threads`: XLA:CPU's pools sized by NPROC, every core left open (gloo's threads run
    # wherever one is free); pinned: each process on one core, NPROC untouched
    code = ("import os; print('NPROC=' + os.environ.get('NPROC', '-'), "
            "'CORES=' + str(len(os.sched_getaffinity(0))))")
    cores = len(os.sched_getaffinity(0))
    for kwargs, nproc, seen in (({"pin_cores": False, "threads": 1}, "1", cores),
                                ({"pin_cores": True}, "-", 1)):
        results = launch_local([sys.executable, "-c", code], 2, timeout_s=30,
                               env={k: v for k, v in os.environ.items() if k != "NPROC"},
                               **kwargs)
        assert all(r.ok for r in results), describe(results)
        for r in results:
            assert f"NPROC={nproc} CORES={seen}" in r.output, (kwargs, r.output)
    with pytest.raises(ValueError, match="threads"):
        launch_local([sys.executable, "-c", "pass"], 1, threads=0)


@pytest.mark.parametrize("fmt", [1, 3])
def test_a_record_of_an_older_format_is_stale(tmp_path, fmt):
    # formats before 4 timed the link latency by calls of their own and lack what a
    # collective costs inside a program: calibrating again beats planning with them
    path = tmp_path / "calibration"
    path.mkdir()
    from jaxwap.calibration.store import calibration_path
    from jaxwap.hardware.calibration import CALIBRATION_FORMAT
    from jaxwap.hardware.cluster import builtin_for_kind

    d = {"spec": builtin_for_kind("cpu", "cpu").to_dict(), "device_kind": "cpu",
         "platform": "cpu", "num_devices": 8, "jax_version": jax.__version__,
         "driver": "none", "measurements": {}, "notes": [], "format": fmt}
    calibration_path(jax.devices()[0], tmp_path, 1).write_text(json.dumps(d))
    assert load_calibration(jax.devices()[0], tmp_path, 1) is None
    d["format"] = CALIBRATION_FORMAT
    calibration_path(jax.devices()[0], tmp_path, 1).write_text(json.dumps(d))
    cal = load_calibration(jax.devices()[0], tmp_path, 1)
    assert cal is not None and cal.num_processes == 1 and cal.num_devices == 8
