"""Timed probes of one device's compute and memory: what each figure of a profile stands for.

Matmuls of several sizes (peak flop/s and the efficiency curve), dense layers in a
training step's forms, a large in-place elementwise op (memory bandwidth), memory mapped
afresh and arrays moved into another layout, a chain of tiny matmuls (per-kernel
overhead), a transcendental function and reductions; and the sizes a calibration times
them at. How each is timed is `calibration/timing.py`'s; the links' probes are
`calibration/link_probes.py`'s, the host's dispatch of a step `calibration/dispatch_probes.py`'s,
convolutions `calibration/conv_probes.py`'s, and those that mean something on an
accelerator alone (NVML power among them) `calibration/accel_probes.py`'s.
`calibration/calibrate.py` runs them and keeps the profile; each probe is a plain function
of a device to figures.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxwap.calibration.timing import (
    fit_line,
    in_place,
    in_program,
    in_programs,
    operand,
    repeated,
    time_it,
)
from jaxwap.core.progress import Progress


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
        times.append(in_program(repeated(lambda v, w: v @ w), (w, w), reps))
        progress.step(f"matmul {np.dtype(dtype).name} {n}")
    slope, intercept = fit_line(works, times)
    best = max(w / t for w, t in zip(works, times, strict=True))
    return {"sizes": list(sizes), "work_flops": works, "seconds": times,
            "timed": "in a program: a chain of matmuls, per matmul",
            "peak_flops": 1.0 / slope if slope > 0 else best, "intercept_s": intercept}


def _dense_layers(r: int) -> Callable[[Any, Any, Any], Any]:
    """r pairs of token-major dense layers (t, k) -> (t, n) -> (t, k), forward and both
    gradients: each matmul runs in the three forms a training step runs it in."""
    layers = repeated(lambda x, a, b: (x @ a) @ b)(r)
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



def _ones(device: Any, *shape: int) -> Any:
    return jax.device_put(jnp.ones(shape, jnp.float32), device)


def stream(v: Any) -> Any:
    """The memory probes' op: one read and one write of each element, nothing to fold
    away (also the load `accel_probes` and `cpu_probes` stream)."""
    return v * 1.0001 + 1.0


def bandwidth(device: Any, nbytes: int) -> float:
    """Bytes/s of an elementwise op that reads and writes nbytes each, in place (its input
    donated), as a training step with donated state updates it: a fresh output each call
    would time the operating system handing out new pages, not the memory."""
    return 2.0 * nbytes / in_place(stream, _ones(device, nbytes // 4))


def fresh_memory(device: Any, sizes: Sequence[int]) -> list[tuple[int, float]]:
    """[(bytes, seconds per byte)] that an op pays for writing a fresh output of that
    size over writing it in place (its input donated): the allocator mapping new memory
    and the OS faulting its pages in. A step pays it for its scratch memory every step;
    where the allocator keeps a pool (XLA:GPU) it is about 0."""
    fresh = jax.jit(stream)
    out = []
    for nbytes in sizes:
        x = _ones(device, nbytes // 4)
        t_fresh = time_it(lambda x=x: fresh(x).block_until_ready())
        t_in_place = in_place(stream, _ones(device, nbytes // 4))
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
    return in_program(repeated(lambda v: jnp.tanh(v @ v)), (x,), chain - 1, repeats=9)


def transcendental(device: Any, elements: int = 2**20) -> float:
    """Seconds per element of a tanh over `elements` (4 MiB of f32 by default: past a
    CPU's cache, as a training step's activations are; an accelerator needs more, its
    launch dominating 4 MiB: on an H100 the figure crossed the 1.5x-memory line of
    `calibrate` in one of two runs and priced GPT-2's step 26% slower), its memory traffic
    included, timed in a chain of them inside a program (a barrier keeps each its own
    kernel)."""
    x = jax.device_put(jnp.ones((elements // 256, 256), jnp.float32), device)
    chained = repeated(lambda v: jax.lax.optimization_barrier(jnp.tanh(v)))
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

    chained, out = repeated(sums), []
    for n in sizes:
        x = jax.device_put(jnp.zeros((max(n // 1024, 1), 256), jnp.float32), device)
        each = in_program(chained, (x,), 8) / 2
        out.append((n, max(each - 2 * n / bandwidth_Bps - 2 * launch_s, 0.0) / n))
    return out


__all__ = ["bandwidth", "cpu_bandwidth_bytes", "fresh_memory", "fresh_memory_sizes",
           "kernel_overhead", "layout_change", "matmul_curve", "matmul_training", "reduction",
           "sizes_for", "stream", "transcendental"]
