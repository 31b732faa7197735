"""Nothing assumes a single process: two CPU processes, each with its own slice of the
batch, run one auto-sharded step over all 8 devices and get the single-device numbers;
then the same as two nodes of 4 devices (the layout detected), with a tensor-parallel
model axis that stays inside each process; hybrid sharding with one replica per process;
a pipeline with one stage per process; the measured choice (`measure=`), its step
counts and figures agreed between the processes; and a step that would run on fewer
devices held to devices of every process."""

from __future__ import annotations

from processes import run_processes


def test_two_processes_match_one_device():
    ran = run_processes("multiprocess_worker.py", timeout=240)
    for i, (code, out) in enumerate(ran):
        assert code == 0, f"process {i} failed:\n{out[-4000:]}"
        assert f"process {i}: OK" in out
        assert f"process {i}: OK hierarchical" in out
        assert f"process {i}: OK hsdp" in out
        assert f"process {i}: OK pipeline" in out
        assert f"process {i}: OK measured choice" in out
        assert f"process {i}: OK every process" in out
        assert f"process {i}: OK batch replicated across processes" in out
