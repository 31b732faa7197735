"""Probes that mean something on an accelerator: its clocks woken, its memory streamed
inside one program, its power under load read from NVML.

A GPU idles at a low clock (an H200 here at 345 MHz, 1980 under load) and takes a while to
come up; a call of its own of a 512 MiB elementwise op is about as long as the dispatch and
synchronisation around it; and its power depends on how busy it is kept and on its data.
The first calibration of an H200 here, with the CPU's probes (`gpu_sweep.py`, 2026-11-26),
measured 1725 GB/s of its 4.8 TB/s and 393 W for matmuls on constant data, while training
steps drew 538-704 W. So on an accelerator `calibrate` wakes the clocks first, times the
bandwidth in a chain inside one program, and measures power on loads that keep the device
busy (a chain of matmuls or of memory passes per call, on random data) over a window of
seconds, after the load has run for a while.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxwap.calibration.probes import stream
from jaxwap.calibration.timing import in_program, operand, repeated

#: seconds of load before a power window opens: clocks and board power settle
SETTLE_S = 0.5
#: seconds each power window lasts at least (NVML's counter moves in steps of ~10-100 ms)
POWER_WINDOW_S = 2.0


def _passes(v: Any) -> Any:
    """One memory pass that XLA cannot fuse with the next (`stream`, then a barrier)."""
    return jax.lax.optimization_barrier(stream(v))


def warm_up(device: Any, seconds: float = 1.0) -> None:
    """Run matmuls for `seconds`, so the probes after it time the device at its working
    clock, not at the idle clock it starts from."""
    w = operand(device, (4096, 4096), jnp.bfloat16, 4096)
    chain = jax.jit(repeated(lambda v, w: v @ w)(8))
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        jax.block_until_ready(chain(w, w))


def stream_bandwidth(device: Any, nbytes: int) -> float:
    """Bytes/s (read plus written) of an elementwise pass over `nbytes` of f32, each pass
    of a chain inside one program (`in_program`), so no dispatch or synchronisation falls
    inside the timing."""
    x = operand(device, (nbytes // 4,), jnp.float32)
    return 2.0 * nbytes / in_program(repeated(_passes), (x,), 8)


def power_loads(device: Any, n: int, nbytes: int, chain: int = 16
                ) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(compute, memory): each call runs `chain` n x n matmuls in the device's fast dtype
    (bf16; f32 on a CPU, whose bf16 is emulated), or `chain` passes over `nbytes` of f32,
    in one program on `operand` data, and blocks. The memory load's array is made on its
    first call (on a CPU without NVML it is never needed)."""
    dtype = jnp.float32 if device.platform == "cpu" else jnp.bfloat16
    w = operand(device, (n, n), dtype, n)
    matmuls = jax.jit(repeated(lambda v, w: v @ w)(chain))
    passes = jax.jit(repeated(_passes)(chain))

    @functools.cache
    def vec() -> Any:
        return operand(device, (nbytes // 4,), jnp.float32)

    return (lambda: jax.block_until_ready(matmuls(w, w)),
            lambda: jax.block_until_ready(passes(vec())))


def _window(load: Callable[[], Any], devices: Sequence[Any], window_s: float) -> Any:
    """NVML's reading of `load` run for at least `window_s`, after SETTLE_S of it."""
    from jaxwap.energy.meter import measure_energy

    t_end = time.perf_counter() + SETTLE_S
    while time.perf_counter() < t_end:
        load()
    return measure_energy(load, devices, min_window_s=window_s)[0]


def power(devices: Sequence[Any], compute: Callable[[], Any],
          memory: Callable[[], Any] | None = None, window_s: float = POWER_WINDOW_S
          ) -> tuple[float, float, float | None, str] | None:
    """(idle W, compute-bound W, memory-bound W or None, source) per device from NVML,
    each the average over a window of at least `window_s` of that load once it has run
    for SETTLE_S, or None without NVML: the power model's phases, measured."""
    from jaxwap.energy.meter import EnergyMeter

    with EnergyMeter(devices) as meter:
        time.sleep(0.5)
    idle = meter.reading
    if idle is None or idle.source == "modeled":
        return None
    n = len(devices)
    loaded = _window(compute, devices, window_s)
    streamed = _window(memory, devices, window_s) if memory else None
    return (idle.avg_power_w / n, loaded.avg_power_w / n,
            streamed.avg_power_w / n if streamed else None, loaded.source)


__all__ = ["POWER_WINDOW_S", "SETTLE_S", "power",
           "power_loads", "stream_bandwidth", "warm_up"]
