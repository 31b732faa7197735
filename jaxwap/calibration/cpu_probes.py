"""Probes of what XLA:CPU does apart from other backends, for `jaxwap.calibrate` on a CPU
(`accel_probes` holds the accelerators' own)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxwap.calibration.probes import stream
from jaxwap.calibration.timing import in_program, repeated

# (rows contracted, K, N): a dense layer's kernel gradient at CI and mid sizes
TRANSPOSED_SHAPES = ((1024, 256, 64), (4096, 256, 64))


def _weight_gradient(w: Any, x: Any, d: Any) -> Any:
    return w * 0.5 + x.T @ (d + w[:1] * 1e-3)          # x^T dy: contracts the rows


def _forward(w: Any, x: Any, d: Any) -> Any:
    return w * 0.5 + (x @ w + d)[: w.shape[0]] * 1e-3   # the same work as x @ w


def transposed_matmul_efficiency(device: Any,
                                 shapes: tuple[tuple[int, int, int], ...] = TRANSPOSED_SHAPES
                                 ) -> float:
    """The share of its matmul rate a matmul contracting both operands over their first
    dim (x^T dy, `op_work.transposed_matmul`) reaches against the same work as x @ w: the
    median over `shapes` of the two times' ratio, each timed in a dependent chain of 16
    inside a program (`timing.in_program`, 15 times each), capped at 1. XLA:CPU runs the
    first on its generic dot, the second in its matmul library. Chains of 8 timed 7 times
    each read 0.43-0.75 on this 2-core VM in five tries, which moved GPT-2-small's
    predicted step by 20%; chains of 16 timed 15 times read 0.44-0.48 (2.2 s a try)."""
    ratios = []
    for m, k, n in shapes:
        w, x, d = (jax.device_put(jnp.full(s, 0.01, jnp.float32), device)
                   for s in ((k, n), (m, k), (m, n)))
        # each link's product feeds the next (its input moved by the last weight's row)
        grad = in_program(repeated(_weight_gradient), (w, x, d), 16, repeats=15)
        fwd = in_program(repeated(_forward), (w, x, d), 16, repeats=15)
        ratios.append(fwd / grad)
    return float(min(np.median(ratios), 1.0))


def _pool(v: Any, stride: int = 1) -> Any:   # a 3x3 max pool; at stride 1 it chains
    return jax.lax.reduce_window(v, -jnp.inf, jax.lax.max, (1, 3, 3, 1),
                                 (1, stride, stride, 1), "SAME")


def _pool_grad(v: Any) -> Any:   # a CNN's pool, at stride 2; its gradient has v's shape
    return v + jax.grad(lambda u: jnp.sum(_pool(u, 2) * 1e-3))(v)


def pooling(device: Any, shape: tuple[int, ...] = (8, 32, 32, 32)) -> tuple[float, float]:
    """(seconds per window tap of a 3x3 max pool, seconds per element of its gradient's
    result at stride 2, as CNNs pool): each timed in a chain inside a program
    (`timing.in_program`) on an f32 map of `shape` (1 MiB); the gradient's link also pools
    forward, which is taken out."""
    x = jax.device_put(jnp.linspace(0.0, 1.0, int(np.prod(shape)), dtype=jnp.float32)
                       .reshape(shape), device)
    per_tap = in_program(repeated(_pool), (x,), 4) / (float(np.prod(shape)) * 9)
    taps = float(np.prod(jax.eval_shape(lambda u: _pool(u, 2), x).shape)) * 9
    grad = in_program(repeated(_pool_grad), (x,), 4) - per_tap * taps
    return per_tap, max(grad, 0.0) / float(np.prod(shape))


def _host_work(device: Any, nbytes: int) -> dict[str, Callable[[], Any]]:
    """One call each of the memory-side work `host_memory` times, set up (arrays placed,
    ops compiled): an in-place elementwise op over `nbytes` (streaming), an in-place one
    reading its operand transposed (a layout change) over an n x n array of about a
    sixteenth of that, one writing a fresh output of a quarter of it (scratch)."""
    n = 1 << max(int(np.log2(nbytes // 64)) // 2, 6)
    ops = {"stream": (stream, (nbytes // 4,)), "layout": (lambda y, v: y * 0.9 + 0.1 * v.T,
                                                          (n, n)),
           "fresh": (stream, (nbytes // 16,))}
    out = {}
    for kind, (fn, shape) in ops.items():
        x = jax.device_put(jnp.ones(shape, jnp.float32), device)
        if kind == "fresh":
            f = jax.jit(fn)
            out[kind] = lambda f=f, x=x: f(x).block_until_ready()
        else:
            f = jax.jit(fn, donate_argnums=0)
            rest = (x,) if kind == "layout" else ()
            box = [f(jax.device_put(jnp.ones(shape, jnp.float32), device), *rest)]

            def call(f: Any = f, box: list[Any] = box, rest: tuple[Any, ...] = rest) -> Any:
                box[0] = f(box[0], *rest)
                box[0].block_until_ready()
            out[kind] = call
        out[kind]()
    return out


def host_memory(device: Any, nbytes: int, seconds: float = 0.5
                ) -> tuple[int, dict[str, float], dict[str, float]]:
    """(processes on this one's host, seconds a call alone, seconds a call with all of
    them at once) of each kind of memory-side work (`_host_work`): the processes of one
    host (by hostname) run it one after another while the rest wait, then all at once,
    each kind for `seconds`. Each window starts at one moment of the host's clock, agreed
    after a barrier, so the work overlaps whatever the barrier's skew. A collective:
    every process of the cluster calls it. On this project's 2-core VM two processes
    streamed at 26 GB/s each where one alone got 46, and a 2-device program computed up to
    1.5x its one-core time with both cores busy (calibration's own bandwidth probe, the
    processes left to overlap by chance, read 22 to 50 GB/s). Alone on its host: (1,
    alone, alone)."""
    import socket
    import time
    import zlib

    from jax.experimental import multihost_utils

    def gathered(*v: int) -> np.ndarray:   # [processes, len(v)]; int32 travels exactly
        return np.asarray(multihost_utils.process_allgather(np.array(v, np.int32))
                          ).reshape(-1, len(v))

    me = jax.process_index()
    host = zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF
    hosts = gathered(host)[:, 0]
    mine = np.flatnonzero(hosts == host)
    turns = max(int(np.sum(hosts == h)) for h in set(hosts.tolist()))
    work = _host_work(device, nbytes)

    def window(run: bool) -> dict[str, float]:
        """Seconds a call of each kind, timed from one agreed moment (the latest clock
        reading of this host's processes after a barrier, plus 0.2 s), where `run`."""
        now = time.time_ns() // 1000   # whole seconds and microseconds: int32 each
        clock = gathered(now // 10**6, now % 10**6)[mine].astype(np.int64)
        start = float((clock[:, 0] * 10**6 + clock[:, 1]).max()) * 1e-6 + 0.2
        out = {}
        for kind, call in work.items():
            while run and time.time() < start:
                time.sleep(1e-3)
            calls, end = 0, start + seconds
            while run and time.time() < end:
                call()
                calls += 1
            out[kind] = (time.time() - start) / max(calls, 1)
            start = end + 0.05
        return out

    alone: dict[str, float] = {}
    for turn in range(turns):   # every process takes part in every barrier
        mine_now = turn < len(mine) and mine[turn] == me
        got = window(mine_now)
        if mine_now:
            alone = got
    together = window(True) if len(mine) > 1 else alone
    return len(mine), alone, together


__all__ = ["TRANSPOSED_SHAPES", "host_memory", "pooling", "transposed_matmul_efficiency"]
