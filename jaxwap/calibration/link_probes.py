"""Timed probes of the links between devices: collectives' bandwidth, latency and overheads.

All-reduces from 4 KiB up (link bandwidth and latency), chains of small all-reduces and
all-gathers inside a program (what each collective costs there), and a combined
all-reduce of many small buffers (latency per buffer). The devices may span processes
(jax.distributed), so every process must call each probe with the same devices (SPMD).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxwap.calibration.timing import fit_line, in_program, repeated, time_it
from jaxwap.runtime.compile import make_mesh


def link_sizes(on_cpu: bool, quick: bool) -> list[int]:
    """All-reduce sizes from latency-bound (4 KiB) to bandwidth-bound, so the fit pins
    both figures; a GPU link needs far larger messages to reach its peak, and a CPU's
    must pass its last-level cache (64 MiB), as a model's gradients do."""
    if on_cpu:
        return [2**12, 2**16, 2**20] if quick else [2**12, 2**16, 2**20, 2**22, 2**24, 2**26]
    return [2**12, 2**20, 2**25] if quick else [2**12, 2**20, 2**24, 2**27]


def buffer_latency(devices: Sequence[Any], buffers: int = 16, repeats: int = 10) -> float:
    """Seconds a combined all-reduce pays per buffer it carries: one reduction of
    `buffers` small blocks in a tuple (the form XLA's combiner gives gradient reductions)
    against one of a single block, per extra buffer. About 0 where the collective library
    groups them (NCCL); a round trip each where it reduces them apart (gloo on CPU).
    Every process must call it (SPMD)."""
    n = len(devices)
    mesh = make_mesh(n, 1, devices)
    rows = NamedSharding(mesh, P("data"))
    mine = sum(1 for d in devices if d.process_index == jax.process_index())
    per = 64
    xs = [jax.make_array_from_process_local_data(
        rows, np.full((mine, per), float(i), np.float32), (n, per)) for i in range(buffers)]
    out = NamedSharding(mesh, P())
    one = jax.jit(lambda v: v.sum(0), out_shardings=out)
    many = jax.jit(lambda *vs: tuple(v.sum(0) for v in vs), out_shardings=(out,) * buffers)
    t1 = time_it(lambda: jax.block_until_ready(one(xs[0])), repeats)
    tk = time_it(lambda: jax.block_until_ready(many(*xs)), repeats)
    return max((tk - t1) / (buffers - 1), 0.0)


def collective_latency(devices: Sequence[Any], reps: int = 8,
                       repeats: int = 10) -> tuple[float, float]:
    """(all-reduce, all-gather) seconds each of a small collective (64 floats a device)
    over `devices` costs inside a program, as a step runs its collectives: a chain of
    reps + 1 against one (`in_program`). A call of its own times less than that (the
    all-reduces from 4 KiB up fit 3.3 ms at zero bytes on this project's 2-process gloo
    cluster, where one in a program cost 4.0 ms and an all-gather 2.7). Every process
    must call it (SPMD)."""
    n = len(devices)
    mesh = make_mesh(n, 1, devices)
    rows, whole = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    mine = sum(1 for d in devices if d.process_index == jax.process_index())
    x = jax.make_array_from_process_local_data(rows, np.ones((mine, 64), np.float32), (n, 64))

    def reduced(v: Any) -> Any:     # an all-reduce, then each device keeps its rows
        s = jax.lax.with_sharding_constraint(v.sum(0, keepdims=True), whole)
        return jax.lax.with_sharding_constraint(jnp.broadcast_to(s, v.shape) * 0.5, rows)

    def gathered(v: Any) -> Any:    # an all-gather, then each device keeps its rows
        return jax.lax.with_sharding_constraint(
            jax.lax.with_sharding_constraint(v, whole) * 1.0001, rows)

    return tuple(in_program(repeated(op), (x,), reps, repeats)   # type: ignore[return-value]
                 for op in (reduced, gathered))


def all_reduce(devices: Sequence[Any], sizes: Sequence[int],
                repeats: int = 10) -> dict[str, Any] | None:
    """Link bandwidth (B/s) and latency (s) from timed all-reduces over `devices`, which may
    span processes: every process must call it with the same devices and sizes (SPMD)."""
    n = len(devices)
    if n < 2:
        return None
    mesh = make_mesh(n, 1, devices)
    rows = NamedSharding(mesh, P("data"))
    mine = sum(1 for d in devices if d.process_index == jax.process_index())
    f = jax.jit(lambda v: v.sum(0), out_shardings=NamedSharding(mesh, P()))
    ts, fastest = [], []
    for nbytes in sizes:
        per = max(nbytes // 4, 1)
        # each process passes its own rows: a host array cannot go to another's devices
        x = jax.make_array_from_process_local_data(rows, np.ones((mine, per), np.float32),
                                                   (n, per))
        ts.append(time_it(lambda x=x: f(x).block_until_ready(), repeats, raw := []))
        fastest.append(min(raw))
    # ring all-reduce: t = 2(n-1)/n * B / bw + 2(n-1) * lat
    xs = [2 * (n - 1) / n * s for s in sizes]
    slope, intercept = fit_line(xs, ts, relative=True)
    bw = 1.0 / slope if slope > 0 else xs[-1] / ts[-1]
    procs = len({d.process_index for d in devices})
    via = str(getattr(jax.config, "jax_cpu_collectives_implementation", "cpu")) \
        if procs > 1 and devices[0].platform == "cpu" else devices[0].platform
    return {"what": f"all-reduce (sum) of one float32 block per device over {n} devices "
                    f"in {procs} process(es) ({via}); median of {repeats} after a warm-up",
            "model": "t = 2(n-1)/n * bytes / bandwidth + 2(n-1) * latency, fitted by "
                     "least squares weighted by 1/t",
            "sizes_bytes": list(sizes), "seconds": ts, "fastest_seconds": fastest,
            "repeats": repeats,
            "bandwidth_Bps": bw, "latency_s": intercept / (2 * (n - 1))}


__all__ = ["all_reduce", "buffer_latency", "collective_latency", "link_sizes"]
