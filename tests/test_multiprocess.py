"""Nothing assumes a single process: two CPU processes, each with its own slice of the
batch, run one auto-sharded step over all 8 devices and get the single-device numbers;
then the same as two nodes of 4 devices (the layout detected), with a tensor-parallel
model axis that stays inside each process; hybrid sharding with one replica per process;
a pipeline with one stage per process; the measured choice (`measure=`), its step
counts and figures agreed between the processes; and a step that would run on fewer
devices held to devices of every process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one_device():
    here = Path(__file__).parent
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), str(here.parent)]))
    procs = [subprocess.Popen([sys.executable, str(here / "multiprocess_worker.py"), str(i),
                               str(port)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append(out)
    for i, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-4000:]}"
        assert f"process {i}: OK" in out
        assert f"process {i}: OK hierarchical" in out
        assert f"process {i}: OK hsdp" in out
        assert f"process {i}: OK pipeline" in out
        assert f"process {i}: OK measured choice" in out
        assert f"process {i}: OK every process" in out
        assert f"process {i}: OK batch replicated across processes" in out
