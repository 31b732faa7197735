"""Timed probes: what each figure of a device profile stands for, measured on a device.

Matmuls of several sizes (peak flop/s and the efficiency curve), a large in-place
elementwise op (memory bandwidth), a chain of tiny matmuls (per-kernel overhead),
convolutions with their gradients (their share of the matmul rate) and over maps smaller
than their window (a backend's generic loop), all-reduces from 4 KiB up (link bandwidth
and latency), chains of small all-reduces and all-gathers inside a program (what each
collective costs there), a combined all-reduce of many small buffers (latency per
buffer). `calibration/accel_probes.py` holds those that mean something on an accelerator alone
(NVML power among them). `calibration/calibrate.py` runs them and keeps the profile; each probe is a
plain function of devices to figures. The collective probes must be called by every process (SPMD).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxwap.core.progress import Progress
from jaxwap.runtime.compile import make_mesh


# --------------------------------------------------------------------------- timing
def time_it(fn: Callable[[], Any], repeats: int = 5, times: list[float] | None = None) -> float:
    """Median seconds of fn() after one warm-up call (fn must block until done); `times`,
    when given, receives every timing."""
    fn()
    times = [] if times is None else times
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def fit_line(x: Sequence[float], y: Sequence[float],
              relative: bool = False) -> tuple[float, float]:
    """Least-squares slope and intercept (intercept clipped at 0). `relative` weighs each
    point by 1/y, so a small (latency-bound) point counts as much as a large one."""
    ys = np.asarray(y, float)
    w = 1.0 / np.maximum(ys, 1e-12) if relative else None
    slope, intercept = np.polyfit(np.asarray(x, float), ys, 1, w=w)
    return float(slope), float(max(intercept, 0.0))


# --------------------------------------------------------------------------- measurements
def in_program(make: Callable[[int], Callable[..., Any]], args: Sequence[Any],
               reps: int, repeats: int = 7) -> float:
    """Seconds one repetition of an op takes inside a compiled program: `make(r)` builds a
    function that applies the op r times in a dependent chain, and the difference between
    r = reps + 1 and r = 1, over reps, is what each repetition adds. A training step runs
    its ops back to back inside one program, so this, not the time of a call of its own,
    is what an op costs there: a call of its own also pays the dispatch and the wake-up
    of the host's thread pool (about 50 us each on a 2-core CPU, far more than a small
    matmul). The two are timed in turn, not one after the other, so the machine's drift
    falls on both alike (`benchmarks/calibration_spread.py`)."""
    return in_programs([(make, args, reps)], repeats)[0]


def in_programs(chains: Sequence[tuple[Callable[[int], Callable[..., Any]], Sequence[Any], int]],
                repeats: int = 7) -> list[float]:
    """`in_program` of several (make, args, reps) at once, every chain timed once in each
    of `repeats` rounds: a spell of the machine's drift falls on all of them alike, not on
    whichever was being timed (on this project's 2-core VM, dense layers timed size by
    size read 1.15-1.96x apart at one size across 12 curves in 3 processes, 1.10-1.36x
    timed in rounds: `benchmarks/calibration_spread.py --dense`)."""
    progs = [(jax.jit(make(1)), jax.jit(make(reps + 1)), args, reps)
             for make, args, reps in chains]
    t1: list[list[float]] = [[] for _ in progs]
    tr: list[list[float]] = [[] for _ in progs]
    for _ in range(repeats):
        for i, (one, many, args, _) in enumerate(progs):
            time_it(lambda one=one, args=args: jax.block_until_ready(one(*args)), 1, t1[i])
            time_it(lambda many=many, args=args: jax.block_until_ready(many(*args)), 1, tr[i])
    return [max((float(np.median(b)) - float(np.median(a))) / reps, 1e-9)
            for a, b, (_, _, _, reps) in zip(t1, tr, progs, strict=True)]


def operand(device: Any, shape: tuple[int, ...], dtype: Any, fan_in: float = 1.0) -> Any:
    """A probe's operand whose products keep their scale: on a CPU the constant 1/fan_in
    (its speed does not depend on the data; the CPU figures in benchmarks/results were
    measured so), on an accelerator N(0, 1/fan_in): a GPU's matmul runs faster and draws
    less power on predictable data (13% faster on zeros on an H200 here), so its rate and
    power are measured on data like a training step's."""
    if device.platform == "cpu":
        return jax.device_put(jnp.full(shape, 1.0 / fan_in, dtype), device)
    with jax.default_device(device):
        return jax.random.normal(jax.random.key(0), shape, dtype) * (fan_in ** -0.5)


def _repeated(link: Callable[..., Any]) -> Callable[[int], Callable[..., Any]]:
    """`make(k)` for `in_program`: a function of (v, *rest) that applies `v = link(v,
    *rest)` k times, each link depending on the one before."""
    def make(k: int) -> Callable[..., Any]:
        def f(v: Any, *rest: Any) -> Any:
            for _ in range(k):
                v = link(v, *rest)
            return v
        return f
    return make


def matmul_curve(device: Any, dtype: Any, sizes: Sequence[int],
                  progress: Progress) -> dict[str, Any]:
    """Seconds per n x n x n matmul inside a program (`in_program`: a chain of them, the
    weight an `operand` of fan-in n, so the values keep their scale): slope = 1 / peak,
    intercept = w_half / peak + launch. Each size is repeated until it holds about eight
    times the largest size's work (at twice, the largest size's two-matmul difference of
    two timings swung the peak between 0.5x and 2x the machine's on this 2-core VM)."""
    works, times = [], []
    target = 16.0 * float(sizes[-1]) ** 3
    for n in sizes:
        w = operand(device, (n, n), dtype, n)
        work = 2.0 * n ** 3
        reps = int(min(64, max(2, target // work)))
        works.append(work)
        times.append(in_program(_repeated(lambda v, w: v @ w), (w, w), reps))
        progress.step(f"matmul {np.dtype(dtype).name} {n}")
    slope, intercept = fit_line(works, times)
    best = max(w / t for w, t in zip(works, times, strict=True))
    return {"sizes": list(sizes), "work_flops": works, "seconds": times,
            "timed": "in a program: a chain of matmuls, per matmul",
            "peak_flops": 1.0 / slope if slope > 0 else best, "intercept_s": intercept}


def _dense_layers(r: int) -> Callable[[Any, Any, Any], Any]:
    """r pairs of token-major dense layers (t, k) -> (t, n) -> (t, k), forward and both
    gradients: each matmul runs in the three forms a training step runs it in."""
    layers = _repeated(lambda x, a, b: (x @ a) @ b)(r)
    return jax.value_and_grad(lambda x, a, b: layers(x, a, b).sum(), argnums=(0, 1, 2))


def matmul_training(device: Any, dtype: Any, sizes: Sequence[int],
                    progress: Progress) -> list[tuple[float, float]]:
    """(flops, seconds) per matmul of dense layers in a training step (`_dense_layers`,
    timed `in_programs`, every size in each of 15 rounds): for each n of `sizes`, 4n
    tokens through n/4 -> n -> n/4 features, so each matmul is 2n^3 flops, as the square
    of that size, in the shapes and transposes of a real step (a weight gradient contracts
    the tokens). Operands of fan-in k and n (`operand`) keep the values' scale. Launches
    are included."""
    chains, works = [], []
    for n in sizes:
        t, k = 4 * n, max(n // 4, 8)
        x, a, b = (operand(device, (t, k), dtype), operand(device, (k, n), dtype, k),
                   operand(device, (n, k), dtype, n))
        work = 2.0 * t * k * n
        chains.append((_dense_layers, (x, a, b),
                       int(min(16, max(2, 4.0 * float(sizes[-1]) ** 3 // (6 * work))))))
        works.append(work)
    out = [(w, s / 6) for w, s in zip(works, in_programs(chains, repeats=15), strict=True)]
    for n in sizes:
        progress.step(f"dense layer {n}")
    return out


def in_place(fn: Callable[..., Any], first: Any, *rest: Any, repeats: int = 5) -> float:
    """Seconds of `fn(first, *rest)` run as a training step runs its donated state: the
    last result is the next call's `first`, donated, so the output takes its memory
    (median of `repeats` calls)."""
    f = jax.jit(fn, donate_argnums=0)
    box = [f(first, *rest)]

    def step() -> None:
        box[0] = f(box[0], *rest)
        box[0].block_until_ready()

    return time_it(step, repeats)


def _ones(device: Any, *shape: int) -> Any:
    return jax.device_put(jnp.ones(shape, jnp.float32), device)


def _stream(v: Any) -> Any:
    return v * 1.0001 + 1.0


def bandwidth(device: Any, nbytes: int) -> float:
    """Bytes/s of an elementwise op that reads and writes nbytes each, in place (its input
    donated), as a training step with donated state updates it: a fresh output each call
    would time the operating system handing out new pages, not the memory."""
    return 2.0 * nbytes / in_place(_stream, _ones(device, nbytes // 4))


def fresh_memory(device: Any, sizes: Sequence[int]) -> list[tuple[int, float]]:
    """[(bytes, seconds per byte)] that an op pays for writing a fresh output of that
    size over writing it in place (its input donated): the allocator mapping new memory
    and the OS faulting its pages in. A step pays it for its scratch memory every step;
    where the allocator keeps a pool (XLA:GPU) it is about 0."""
    fresh = jax.jit(_stream)
    out = []
    for nbytes in sizes:
        x = _ones(device, nbytes // 4)
        t_fresh = time_it(lambda x=x: fresh(x).block_until_ready())
        t_in_place = in_place(_stream, _ones(device, nbytes // 4))
        out.append((nbytes, max(t_fresh - t_in_place, 0.0) / nbytes))
    return out


def sizes_for(on_cpu: bool, quick: bool) -> tuple[list[int], list[int], int]:
    """(matmul sizes, dense-layer sizes, bandwidth bytes) of a calibration. The dense-layer
    curve also runs between the matmul sizes (a factor 8 in work between points is too
    coarse where the efficiency climbs fastest), rounded to 16 on a CPU and to 256 on an
    accelerator, whose tensor-core kernels run misaligned sizes far below their rate (on
    an H200 here 1456 and 2896 at 0.25 and 0.37 of the peak, 2048 and 4096 at 0.89 and
    1.0), where models' sizes are aligned (768, 3072, 4096)."""
    sizes = [64, 128, 256, 512] if (quick or on_cpu) else [1024, 2048, 4096, 8192]
    if quick and not on_cpu:
        sizes = [512, 1024, 2048]
    bw_bytes = cpu_bandwidth_bytes() if on_cpu else (16 if quick else 512) * 2**20
    step = 16 if on_cpu else 256
    dense = sizes if quick else sorted({*sizes, *(
        step * round((a * b) ** 0.5 / step) for a, b in zip(sizes, sizes[1:], strict=False))})
    return sizes, dense, bw_bytes


def fresh_memory_sizes(on_cpu: bool, quick: bool) -> list[int]:
    """Sizes for `fresh_memory`: on a CPU both sides of glibc's largest mmap threshold
    (32 MiB: smaller blocks come back from the heap, larger ones are mapped anew)."""
    if quick:
        return [2**24, 2**26]
    return [2**22, 2**24, 3 * 2**23, 2**25, 3 * 2**24, 2**26, 2**27] if on_cpu \
        else [2**24, 2**26, 2**28]


def cpu_bandwidth_bytes() -> int:
    """Bytes for the bandwidth test on a CPU: far past the last-level cache (8x it, at
    least 256 MiB), or the test times the cache rather than the memory a step streams."""
    try:
        llc = max(os.sysconf(f"SC_LEVEL{k}_CACHE_SIZE") for k in (2, 3))
    except (ValueError, OSError, AttributeError):
        llc = 0
    return max(256 * 2**20, 8 * int(llc))


def layout_change(device: Any, sizes: Sequence[int]) -> list[tuple[int, float]]:
    """[(array bytes, seconds per byte)] a layout change adds as training steps run them:
    inside an elementwise fusion (an update reading a gradient XLA laid out the other
    way) whose input is read across rows, for n x n float32 arrays of each n in `sizes`
    (in cache and past it), timed against the same fusion without the transpose, so the
    figure is what the change adds to the roofline the model already charges. A small
    array's call is mostly dispatch, whose jitter dwarfs what the change adds: each
    difference is the median of seven alternating rounds, each round's calls repeated
    until they move about 64 MiB (5 to 401 calls). With three rounds of 16 MiB the 16 KiB
    point read 4e-11 to 1.5e-9 s a byte between calibrations on this 2-core VM (one such
    outlier put GPT-2-small's XLA-fed step at +45%); so, 3e-11 to 9e-11 in six tries. An
    accelerator's 16 MiB call is all launch and jitter too (an H200 here read 4e-12 s a byte
    at 16 KiB and 16 MiB and 0 between; an H100 3e-13 to 4e-13): there `calibrate` times
    64 MiB to 1 GiB."""
    out = []
    for n in sizes:
        x = _ones(device, n, n)
        reps = int(min(401, max(5, 2**26 // (n * n * 4))))
        diffs = [in_place(lambda y, v: y * 0.9 + 0.1 * v.T, _ones(device, n, n), x,
                          repeats=reps)
                 - in_place(lambda y, v: y * 0.9 + 0.1 * v, _ones(device, n, n), x,
                            repeats=reps) for _ in range(7)]
        out.append((n * n * 4, max(float(np.median(diffs)), 0.0) / (n * n * 4)))
    return out


def kernel_overhead(device: Any, chain: int = 64) -> float:
    """Seconds per extra kernel: a chain of tiny dependent matmuls that cannot fuse."""
    x = jax.device_put(jnp.ones((8, 8), jnp.float32), device)
    return in_program(_repeated(lambda v: jnp.tanh(v @ v)), (x,), chain - 1, repeats=9)


def call_seconds(devices: Sequence[Any], arrays: int, repeats: int = 101) -> float:
    """Median seconds the host takes to call a compiled program over `devices` that adds
    one to each of its `arrays` donated arguments (16 floats each, replicated), in place:
    jax's dispatch of a step's arrays with next to no work (`step_call`). A program that
    handed them back as they were would write nothing, as no step does: with GPT-2-small's
    87 arrays it took 0.12 ms here, this one 0.21-0.23, the step's own call 0.47-0.57."""
    sharding = NamedSharding(make_mesh(1, len(devices), list(devices)), P())
    xs = [jax.device_put(jnp.full((16,), i, jnp.float32), sharding) for i in range(arrays)]
    call = jax.jit(lambda *a: tuple(x + 1 for x in a), donate_argnums=tuple(range(arrays)))
    xs = list(call(*xs))

    def once() -> None:
        xs[:] = jax.block_until_ready(call(*xs))
    return time_it(once, repeats)


def step_call(devices: Sequence[Any], arrays: int = 64, repeats: int = 101
              ) -> list[tuple[int, float, float]]:
    """[(d, seconds, seconds per array)]: the host's call of a compiled program over d of
    `devices` (this process's own; d = 1 and all of them) passing n arrays in and as many
    out takes seconds + 2n x per array: jax's dispatch of a training step, which
    `in_program` leaves out and a step pays once (parsing its arguments, the donation,
    making its results, on each device). Timed by `call_seconds` at n = 1 and `arrays`
    (`benchmarks/step_call.py` times it at more counts)."""
    out = []
    for d in sorted({1, len(devices)}):
        one, many = (call_seconds(devices[:d], n, repeats) for n in (1, arrays))
        per_array = max(many - one, 0.0) / (2 * (arrays - 1))
        out.append((d, max(one - 2 * per_array, 0.0), per_array))
    return out


def transcendental(device: Any, elements: int = 2**20) -> float:
    """Seconds per element of a tanh over `elements` (4 MiB of f32 by default: past a
    CPU's cache, as a training step's activations are; an accelerator needs more, its
    launch dominating 4 MiB: on an H100 the figure crossed the 1.5x-memory line of
    `calibrate` in one of two runs and priced GPT-2's step 26% slower), its memory traffic
    included, timed in a chain of them inside a program (a barrier keeps each its own
    kernel)."""
    x = jax.device_put(jnp.ones((elements // 256, 256), jnp.float32), device)
    chained = _repeated(lambda v: jax.lax.optimization_barrier(jnp.tanh(v)))
    return in_program(chained, (x,), 8) / elements


def reduction(device: Any, sizes: Sequence[int], bandwidth_Bps: float, launch_s: float
              ) -> list[tuple[int, float]]:
    """(bytes, seconds per byte) of a reduction over an f32 array of each size, its launch
    apart: a chain of column then row sums, each added back to the array (so the chain
    depends on it), timed `in_program`; the add (a kernel reading and writing the array)
    is taken out at `bandwidth_Bps` and `launch_s`."""
    def sums(v: Any) -> Any:
        v = v + jnp.sum(v, axis=0, keepdims=True) * 1e-6
        return v + jnp.sum(v, axis=1, keepdims=True) * 1e-6

    chained, out = _repeated(sums), []
    for n in sizes:
        x = jax.device_put(jnp.zeros((max(n // 1024, 1), 256), jnp.float32), device)
        each = in_program(chained, (x,), 8) / 2
        out.append((n, max(each - 2 * n / bandwidth_Bps - 2 * launch_s, 0.0) / n))
    return out


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

    return tuple(in_program(_repeated(op), (x,), reps, repeats)   # type: ignore[return-value]
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


__all__ = ["all_reduce", "bandwidth", "buffer_latency", "cpu_bandwidth_bytes", "fit_line",
           "fresh_memory",
           "fresh_memory_sizes", "in_place", "in_program", "kernel_overhead", "layout_change",
           "link_sizes", "matmul_curve", "matmul_training", "operand", "reduction", "sizes_for",
           "time_it", "transcendental"]
