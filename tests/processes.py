"""Local processes standing in for the nodes of a cluster: the harness the multi-process
tests share (a free coordinator port, the workers started together, their output)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent

# LLVM's optimisation of the CPU code off: it is about a third of a test's time, and no
# test depends on how fast the generated code runs (XLA's HLO passes, sharding,
# collectives, buffer assignment, are untouched by it). Every process a test starts that
# compiles steps without timing them sets it too; a calibration, which times the code it
# compiles, does not.
FAST_COMPILE = "--xla_backend_optimization_level=0"


def worker_env() -> dict[str, str]:
    """The environment a worker script needs: the tests' helpers and jaxwap importable."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent)]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(worker: str, *args: str, count: int = 2, timeout: float = 600
                  ) -> list[tuple[int, str]]:
    """Run `count` copies of `HERE / worker` together, process i given `*args, i, port`
    (a shared coordinator port); (exit status, stdout and stderr) of each, in process
    order. A process still running after `timeout` seconds has every process killed."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(HERE / worker), *args, str(i), port],
                              env=worker_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(count)]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append(out)
    return [(p.returncode, out) for p, out in zip(procs, outs, strict=True)]
