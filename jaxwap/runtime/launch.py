"""Launch a local cluster: N processes of one jax.distributed cluster on this machine.

`launch_local` starts them the way the tests and benchmarks need it: a free port for the
coordinator, each process's id in its environment (`cluster_from_env` reads it back),
one core each, and all of them killed when one fails or the time runs out, since a
cluster missing a member would only wait for it. Each process then joins the cluster
through `distributed.start_distributed`. Of jaxwap it imports only `distributed`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO

from jaxwap.runtime.distributed import check_cluster_args

# The environment a launched process finds its place in the cluster by.
ENV_COORDINATOR = "JAXWAP_COORDINATOR"
ENV_NUM_PROCESSES = "JAXWAP_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXWAP_PROCESS_ID"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def cluster_from_env(env: Mapping[str, str] | None = None) -> tuple[str, int, int] | None:
    """(coordinator, num_processes, process_id) that `launch_local` gave this process, or
    None when it was not launched by it."""
    env = os.environ if env is None else env
    if ENV_COORDINATOR not in env:
        return None
    return (env[ENV_COORDINATOR], int(env[ENV_NUM_PROCESSES]), int(env[ENV_PROCESS_ID]))


@dataclass(frozen=True)
class ProcessResult:
    """How one launched process ended: exit status (negative: killed by that signal),
    whether the launcher killed it (a peer failed, or the time ran out), its output."""

    process_id: int
    returncode: int
    output: str
    core: int | None
    killed: bool
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def tail(self, chars: int = 4000) -> str:
        return self.output[-chars:]


# pins itself to a core, then becomes the command: every thread it starts inherits the core
_PIN = ("import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])}); "
        "os.execvp(sys.argv[2], sys.argv[2:])")


def _child_env(base: Mapping[str, str], platform: str | None) -> dict[str, str]:
    """The launching environment without forced device counts: one device per process."""
    env = dict(base)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags)
    env.pop("JAX_NUM_CPU_DEVICES", None)
    if platform is not None:
        env["JAX_PLATFORMS"] = platform
    return env


def launch_local(argv: Sequence[str], num_processes: int = 2, *, pin_cores: bool = True,
                 timeout_s: float = 300.0, env: Mapping[str, str] | None = None,
                 cwd: str | None = None, platform: str | None = "cpu",
                 host: str = "127.0.0.1", threads: int | None = None) -> list[ProcessResult]:
    """Run `argv` as `num_processes` processes of one cluster on this machine and wait.

    Each process learns its place from the environment (read it with `cluster_from_env`)
    and from "{coordinator}", "{num_processes}" and "{process_id}" in argv, replaced.
    With `pin_cores` process i runs on the i-th core this process may use (modulo their
    number), so processes are separate devices rather than threads fighting over one pool.
    With `threads` instead, XLA:CPU sizes each process's thread pools to that many threads
    (its NPROC setting) and the processes are left to the OS: each computes on `threads`
    cores' worth, while its other threads (gloo's, which carry the collectives) run on
    whichever core is free. Pinned, those share the core with XLA's threads, and on this
    project's 2-core VM a small gloo collective then took 0.1 ms or lasted until the
    scheduler's next 4 ms tick (2.96 ms each, back to back; 0.19 ms with one thread
    each, unpinned). JAX_PLATFORMS is set to `platform` and forced CPU device counts are
    cleared. When one
    process fails, or `timeout_s` passes, all are killed (with their children): a cluster
    missing a member would only wait for it."""
    if not argv:
        raise ValueError("argv must name a command, got an empty one")
    check_cluster_args(num_processes, 0, timeout_s)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pin = pin_cores and bool(cores)
    coordinator = f"{host}:{free_port(host)}"
    base = _child_env(os.environ if env is None else env, platform)
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        base["NPROC"] = str(threads)
    procs, files, used = _start(argv, num_processes, coordinator, base,
                                cores if pin else [], cwd)
    killed, timed_out = _wait(procs, timeout_s)
    return _results(procs, files, used, killed, timed_out)


def _start(argv: Sequence[str], num_processes: int, coordinator: str,
           base: Mapping[str, str], cores: Sequence[int], cwd: str | None
           ) -> tuple[list[subprocess.Popen], list[IO[bytes]], list[int | None]]:
    """Start every process, each pinned to `cores[i % len(cores)]` (none: not pinned) and
    writing to a file of its own: (the processes, their output files, their cores). Each
    runs in a session of its own, so that `_kill` reaches the children it starts too. A
    process that cannot be started kills the ones already started: no half-started
    cluster is left behind, waiting for a member that never comes."""
    procs, files, used = [], [], []
    for i in range(num_processes):
        args = [a.replace("{coordinator}", coordinator)
                .replace("{num_processes}", str(num_processes))
                .replace("{process_id}", str(i)) for a in argv]
        core = cores[i % len(cores)] if cores else None
        if core is not None:
            args = [sys.executable, "-c", _PIN, str(core), *args]
        child = dict(base, **{ENV_COORDINATOR: coordinator,
                              ENV_NUM_PROCESSES: str(num_processes), ENV_PROCESS_ID: str(i)})
        out = tempfile.TemporaryFile()
        files.append(out)
        used.append(core)
        try:
            procs.append(subprocess.Popen(args, env=child, cwd=cwd, stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        except OSError:  # no half-started cluster left behind
            _kill(procs)
            raise
    return procs, files, used


def _wait(procs: Sequence[subprocess.Popen], timeout_s: float) -> tuple[bool, bool]:
    """Wait until all have ended, killing all once one fails or `timeout_s` has passed
    (counted from now, all started): (whether they were killed, whether for the time)."""
    deadline = time.monotonic() + timeout_s
    killed = timed_out = False
    while None in (codes := [p.poll() for p in procs]):  # poll them all, every time
        failed = any(c not in (None, 0) for c in codes)
        timed_out = time.monotonic() > deadline
        if failed or timed_out:
            killed = True
            _kill(procs)
            break
        time.sleep(0.05)
    return killed, timed_out


def _results(procs: Sequence[subprocess.Popen], files: Sequence[IO[bytes]],
             used: Sequence[int | None], killed: bool, timed_out: bool) -> list[ProcessResult]:
    """Each ended process's result, its output read back and its file closed. Only a
    process that died of the launcher's SIGKILL counts as killed: one that had already
    ended (the failed one) keeps its own exit status."""
    results = []
    for i, (p, out, core) in enumerate(zip(procs, files, used, strict=True)):
        out.seek(0)
        text = out.read().decode("utf-8", "replace")
        out.close()
        was_killed = killed and p.returncode == -signal.SIGKILL
        results.append(ProcessResult(i, p.returncode, text, core, was_killed,
                                     timed_out and was_killed))
    return results


def _kill(procs: Sequence[subprocess.Popen]) -> None:
    """Kill every process still running, with its children (its own session), and reap."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
    for p in procs:
        p.wait()


def describe(results: Sequence[ProcessResult], tail_chars: int = 2000) -> str:
    """A report of launched processes: each one's status and the tail of its output."""
    lines = []
    for r in results:
        how = "killed (time ran out)" if r.timed_out else \
            "killed (a peer failed)" if r.killed else f"exit {r.returncode}"
        lines.append(f"--- process {r.process_id} (core {r.core}): {how}\n{r.tail(tail_chars)}")
    return "\n".join(lines)


__all__ = ["ProcessResult", "cluster_from_env", "describe", "free_port", "launch_local"]
