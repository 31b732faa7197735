"""Start a jax.distributed cluster without risking the process, and agree across it.

Why a rendezvous of our own: in jax 0.10.2 a failed `jax.distributed.initialize` does
not raise. A coordinator (process 0) whose peers never come, or a peer that never reaches
its coordinator, is killed with SIGABRT by a fatal check in the coordination client some
five seconds after `initialization_timeout`; a coordinator whose port is taken dies with
SIGSEGV at once. Nothing after the call runs, so no fall-back is possible in-process once
jax has been asked. (Once started, a process whose peer dies gets an error from its next
gloo collective, or blocks in it, and is aborted when the heartbeat timeout passes; at
exit jax's shutdown barrier waits for the dead peer just as long.)

`start_distributed` therefore first holds a small TCP rendezvous on the coordinator's
port, with the timeout: only when all processes answered (and process 0 could listen on
the port) does it call `jax.distributed.initialize`. Every other failure comes back as a
reason, with the jax backend untouched and usable on its own. All processes of a cluster
must start through `start_distributed` (a peer calling `jax.distributed.initialize`
directly never joins the rendezvous). Once started, `all_processes` and `process_median`
make the processes take one branch and agree on one figure.

Launching such a cluster's processes on one machine is `launch.py`'s. This module imports
nothing of jaxwap: any layer may use it.
"""

from __future__ import annotations

import json
import math
import select
import socket
import time
from collections.abc import Mapping

_MAGIC = "jaxwap-rendezvous-1"
_RETRY_S = 0.1


def parse_address(coordinator: str) -> tuple[str, int]:
    """(host, port) of "HOST:PORT" or "[IPV6]:PORT"; a ValueError names a bad one."""
    host, sep, port = str(coordinator).rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"coordinator must be HOST:PORT with a port in 1..65535, "
                         f"got {coordinator!r}")
    return host, int(port)


def check_cluster_args(num_processes: int, process_id: int, timeout_s: float) -> None:
    """Refuse a cluster size, process id or timeout no cluster could meet with, before
    any socket or process is made: a ValueError names the bad one."""
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be an int >= 1, got {num_processes!r}")
    if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be an int in [0, num_processes={num_processes}), "
                         f"got {process_id!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")


def _send(conn: socket.socket, msg: dict) -> None:
    conn.sendall((json.dumps(msg) + "\n").encode())


def _recv_line(conn: socket.socket, deadline: float) -> dict | None:
    """One JSON line from conn before the deadline, or None (closed, late, not ours)."""
    buf = b""
    while b"\n" not in buf and len(buf) < 4096:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        conn.settimeout(left)
        try:
            chunk = conn.recv(4096)
        except OSError:
            return None
        if not chunk:
            return None
        buf += chunk
    try:
        msg = json.loads(buf.split(b"\n", 1)[0])
    except ValueError:
        return None
    return msg if isinstance(msg, dict) and msg.get("magic") == _MAGIC else None


def _hung_up(conn: socket.socket) -> bool:
    """Whether the peer on conn has gone (readable, with nothing to read)."""
    try:
        readable, _, _ = select.select([conn], [], [], 0)
        return bool(readable) and conn.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _serve(port: int, num_processes: int, deadline: float, where: str) -> str | None:
    """Process 0: wait for every peer to say hello, then tell them all to go on."""
    try:
        family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
        server = socket.create_server(("", port), family=family,
                                      dualstack_ipv6=family == socket.AF_INET6)
    except OSError as e:
        return f"process 0 cannot listen on the coordinator port {port}: {e}"
    peers: dict[int, socket.socket] = {}
    reason = None
    try:
        while reason is None and len(peers) < num_processes - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, num_processes)) - set(peers))
                reason = (f"only {len(peers) + 1} of {num_processes} processes came to "
                          f"{where} in time; missing process ids {missing}")
                break
            server.settimeout(left)
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            hello = _recv_line(conn, min(deadline, time.monotonic() + 5.0))
            if hello is None:  # not one of ours (a port scanner, a stray client)
                conn.close()
                continue
            pid, n = hello.get("process_id"), hello.get("num_processes")
            if n != num_processes:
                reason = (f"process {pid} expects {n} processes, process 0 expects "
                          f"{num_processes}")
            elif not isinstance(pid, int) or not 0 < pid < num_processes or pid in peers:
                reason = f"process id {pid!r} is out of range or came twice"
            peers[pid if reason is None else -1 - len(peers)] = conn
        gone = sorted(pid for pid, conn in peers.items() if _hung_up(conn))
        if reason is None and gone:  # told to go, the rest would wait for them in jax
            reason = f"process(es) {gone} left the rendezvous before all had come"
        server.close()  # before "go": a peer's jax client must not reach this socket
        for conn in peers.values():
            _send(conn, {"magic": _MAGIC, "go": reason is None, "reason": reason})
        for conn in peers.values():  # let the peers close first (no TIME_WAIT on the port)
            _recv_line(conn, min(deadline, time.monotonic() + 2.0))
        return reason
    except OSError as e:  # a peer vanished while being told: the cluster is not whole
        return f"the rendezvous at {where} broke: {e}"
    finally:
        for conn in peers.values():
            conn.close()
        server.close()


def _join(host: str, port: int, num_processes: int, process_id: int, deadline: float,
          where: str) -> str | None:
    """A peer: reach process 0 (retrying until the deadline) and wait for its go."""
    last = "nothing listened"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return f"no coordinator answered at {where} in time ({last})"
        try:
            conn = socket.create_connection((host, port), timeout=min(left, 5.0))
        except OSError as e:
            last = str(e)
            time.sleep(min(_RETRY_S, max(deadline - time.monotonic(), 0)))
            continue
        with conn:
            try:
                _send(conn, {"magic": _MAGIC, "num_processes": num_processes,
                             "process_id": process_id})
            except OSError as e:
                last = str(e)
                time.sleep(_RETRY_S)
                continue
            # process 0 answers at its own deadline at the latest: a grace to hear why
            reply = _recv_line(conn, deadline + 2.0)
        if reply is None:
            return (f"the program at {where} did not answer the jaxwap rendezvous in time "
                    f"(process 0 gave up, or another program holds the port)")
        if not reply.get("go"):
            return f"process 0 refused: {reply.get('reason')}"
        return None


def rendezvous(coordinator: str, num_processes: int, process_id: int,
               timeout_s: float) -> str | None:
    """Meet all `num_processes` processes at `coordinator` within `timeout_s`: None when
    all came, else why not. Process 0 listens on the coordinator's port; it must be free."""
    host, port = parse_address(coordinator)
    check_cluster_args(num_processes, process_id, timeout_s)
    deadline = time.monotonic() + timeout_s
    if process_id == 0:
        return _serve(port, num_processes, deadline, coordinator)
    return _join(host, port, num_processes, process_id, deadline, coordinator)


def start_distributed(coordinator: str, num_processes: int, process_id: int,
                      timeout_s: float = 60.0, *,
                      heartbeat_timeout_s: int | None = None) -> str | None:
    """Join a jax.distributed cluster: None when started, else the reason it did not
    (this process is then a plain one-process jax, untouched and usable).

    Call it before any other jax use (devices, arrays, computations). It gives up after
    about `timeout_s` when the others do not come; `heartbeat_timeout_s` (default: jax's,
    100 s) is how long the cluster tolerates a silent process once started. Once all have
    met, jax itself can still fail (the port taken in the instant between, a peer killed
    then) and then ends the process as the module's docstring says; that window is short.
    """
    parse_address(coordinator)
    check_cluster_args(num_processes, process_id, timeout_s)
    import jax

    if jax.distributed.is_initialized():
        return "jax.distributed is already initialized in this process"
    try:
        from jax._src import xla_bridge

        started = xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):  # a jax without it: initialize() checks too
        started = False
    if started:
        return "the jax backend is already in use; start_distributed must come first"
    reason = rendezvous(coordinator, num_processes, process_id, timeout_s)
    if reason is not None:
        return reason
    kwargs = {} if heartbeat_timeout_s is None else \
        {"heartbeat_timeout_seconds": int(heartbeat_timeout_s)}
    try:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id,
                                   initialization_timeout=max(1, math.ceil(timeout_s)),
                                   **kwargs)
    except Exception as e:  # noqa: BLE001 - a reason, not a crash: the caller falls back
        try:
            jax.distributed.shutdown()
        except Exception:  # noqa: BLE001 - best effort; the reason below is what matters
            pass
        first = (str(e).strip().splitlines() or [""])[0]
        return f"jax.distributed.initialize failed: {type(e).__name__}: {first}"
    return None


def all_processes(flag: bool) -> bool:
    """Whether `flag` holds on every process of the jax cluster (a collective: every
    process must call it), so that all take the same branch, as SPMD requires."""
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.asarray(multihost_utils.process_allgather(np.array([int(flag)]))).all())


def process_median(figures: Mapping[str, float]) -> tuple[dict[str, float],
                                                          dict[str, list[float | None]]]:
    """The median over the processes of each figure (NaN where any process has NaN) and
    every process's own values in process order (None for NaN, so JSON can keep them).
    A collective: every process calls it with the same keys. Processes that measure apart
    agree on one result this way (exchanged as float32: about 7 significant digits)."""
    import numpy as np
    from jax.experimental import multihost_utils

    keys = sorted(figures)
    rows = np.asarray(multihost_utils.process_allgather(
        np.array([figures[k] for k in keys], np.float32)), np.float64).reshape(-1, len(keys))
    return ({k: float(np.median(rows[:, i])) for i, k in enumerate(keys)},
            {k: [None if np.isnan(v) else float(v) for v in rows[:, i]]
             for i, k in enumerate(keys)})


__all__ = ["all_processes", "check_cluster_args", "parse_address", "process_median",
           "rendezvous", "start_distributed"]
