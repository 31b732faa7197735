"""The measured power limit -> clock curve of a GPU, and the power profile calibration keeps.

A power cap slows a compute-bound step by lowering the clock the board sustains. The
published curves are generic, so calibration measures this device's: it caps the board at
several limits (each through `power_limit.PowerLimitGuard`, so every limit is put back)
and times a compute-bound kernel under each (`measure_clock_curve`).
`measured_power_profile` joins that curve with the phases' measured power into the
`PowerProfile` a calibrated `DeviceSpec` carries, falling back to the built-in profile's
curve, with a note saying why, wherever the limits cannot be read or set.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxwap.energy.power_limit import (
    PowerLimitGuard,
    device_label,
    limit_range_or_reason,
    limit_range_w,
)
from jaxwap.hardware.device import DeviceSpec
from jaxwap.hardware.power_model import PowerProfile, borrowed, curve_from_points

__all__ = ["measure_clock_curve", "measured_power_profile"]


def _time_under_cap(
    device: Any,
    watts: float,
    run_compute: Callable[[], Any],
    nvml: Any,
    repeats: int,
    timer: Callable[[], float],
) -> float | str:
    """Median seconds of run_compute() with the device capped at ``watts``, or the refusal."""
    with PowerLimitGuard([device], watts, nvml=nvml, warn=False) as guard:
        if not guard.applied:
            return guard.reason
        jax.block_until_ready(run_compute())  # warm-up: compilation, and clocks settling
        times = []
        for _ in range(repeats):
            t0 = timer()
            jax.block_until_ready(run_compute())  # in case run_compute forgot to block
            times.append(timer() - t0)
    return statistics.median(times)


def measure_clock_curve(
    device: Any,
    limits_w: Sequence[float],
    run_compute: Callable[[], Any],
    *,
    nvml: Any = None,
    repeats: int = 3,
    timer: Callable[[], float] = time.perf_counter,
) -> tuple[tuple[float, float], ...] | str:
    """Measured (limit W, sustained clock fraction) curve of one GPU, for calibration.

    ``run_compute`` must run a compute-bound kernel and block until it is done; its median
    time over ``repeats`` calls (after one warm-up) is taken at the board's default limit and
    under each limit in ``limits_w``. The fraction at L is t_default / t_L clipped to (0, 1]
    (compute-bound time scales with 1 / clock). The result is sorted by limit and always holds
    (default, 1.0). If limits cannot be set (no root, no NVML, not a GPU) it returns the
    reason instead, so calibration keeps the published curve and can say why. Every limit is
    restored before this returns. ``timer`` is injectable so tests need no real GPU or sleep.
    """
    if repeats < 1:
        raise ValueError(f"measure_clock_curve: repeats must be >= 1, got {repeats}")
    found = limit_range_or_reason(device, nvml)
    if isinstance(found, str):
        return found
    lo, hi, default = found
    limits = sorted({float(w) for w in limits_w} - {default})
    outside = [w for w in limits if not lo <= w <= hi]
    if outside:
        raise ValueError(
            f"measure_clock_curve: limits {outside} W are outside {device_label(device)}'s allowed "
            f"range {lo:g}-{hi:g} W"
        )
    t_default = _time_under_cap(device, default, run_compute, nvml, repeats, timer)
    if isinstance(t_default, str):
        return t_default
    if t_default <= 0:
        raise ValueError(
            f"measure_clock_curve: run_compute took no measurable time ({t_default} s) at the "
            "default limit; give it more work"
        )
    curve = [(default, 1.0)]
    for watts in limits:
        t = _time_under_cap(device, watts, run_compute, nvml, repeats, timer)
        if isinstance(t, str):
            return t
        curve.append((watts, min(1.0, t_default / t) if t > 0 else 1.0))
    return tuple(sorted(curve))


def measured_power_profile(base: DeviceSpec, dev: Any, watts: list[float] | None,
                           memory_w: float, compute: Callable[[], Any], notes: list[str],
                           *, set_limits: bool = True, nvml: Any = None
                           ) -> PowerProfile | None:
    """The device's power profile: the phases' power as measured (the communication
    phase keeps the built-in profile's share of the dynamic range: no probe isolates it),
    the limits NVML says it accepts, and the clock each limit leaves a compute-bound
    kernel, measured by setting them. Without NVML: the built-in profile; without the
    right to set limits, or with `set_limits=False` (the caller forbids touching them):
    the built-in curve, and the notes say why."""
    prior = base.power_profile()
    if watts is None:
        return base.power
    idle, hot = watts
    comm = borrowed(prior, base.idle_watts, idle, max(hot, idle + 1e-9))[1]
    limits = limit_range_w(dev, nvml=nvml)
    curve = prior.clock_curve
    if limits is None:
        notes.append("power limits not read (NVML gives no range): the device is planned "
                     "uncapped")
    elif not set_limits:
        notes.append("power-limit curve not measured (set_power_limits=False: the limits "
                     "were left alone): kept the built-in profile's")
    else:
        lo, hi, default = limits
        tried = [float(w) for w in np.linspace(lo, default, 6)[:-1]]
        got = measure_clock_curve(dev, tried, compute, nvml=nvml)
        if isinstance(got, str):
            notes.append(f"power-limit curve not measured ({got}): kept the built-in "
                         f"profile's")
        else:
            curve = curve_from_points(got)
    return PowerProfile(
        matmul_watts=hot, memory_watts=memory_w if not math.isnan(memory_w)
        else prior.memory_watts, comm_watts=comm,
        limit_range_w=None if limits is None else (limits[0], limits[1]),
        default_limit_w=None if limits is None else limits[2], clock_curve=curve,
        source="measured by jaxwap calibrate (NVML)"
        + ("" if curve is not prior.clock_curve else "; published clock curve"))
