"""The matmul efficiency curve: fitted from timed matmuls, and read at a matmul's size.

`DeviceSpec.matmul_efficiency` holds (seconds at the peak rate, share of the peak) pairs;
calibration fits them from timings (`efficiency_table`) and the cost model reads them
(`efficiency_at`, through `DeviceSpec.matmul_eff`). Keyed on time at the peak, not flops,
so a device with a share of a host's peak keeps its curve. The record keeps the numbers;
the arithmetic of making and reading them lives here, apart from the record's fields.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def efficiency_table(timed: Sequence[tuple[float, float]], peak_flops: float,
                     launch_s: float) -> tuple[tuple[float, float], ...]:
    """`DeviceSpec.matmul_efficiency` from (flops, seconds) timings of single matmuls at a
    device's `peak_flops`, `launch_s` of each being the kernel launch the model charges
    apart: (w / peak, (w / peak) / (t - launch)), kept within (0, 1]."""
    out = []
    for w, t in timed:
        at_peak = w / peak_flops
        out.append((at_peak, float(min(max(at_peak / max(t - launch_s, 1e-12), 1e-6), 1.0))))
    return tuple(sorted(out))


def efficiency_at(table: Sequence[tuple[float, float]], peak_s: np.ndarray) -> np.ndarray:
    """Efficiency of matmuls whose work takes `peak_s` seconds at the peak rate, from a
    `matmul_efficiency` table (which must not be empty): interpolated in log time, held
    past the longest measured; below the shortest, `t / (t + h)` with the fixed cost h that
    gives the shortest its measured efficiency."""
    times, eff = (np.asarray(v, float) for v in zip(*table, strict=True))
    t = np.maximum(np.asarray(peak_s, float), 1e-15)
    inside = np.interp(np.log(t), np.log(times), eff)
    fixed = times[0] * (1.0 / max(eff[0], 1e-9) - 1.0)
    return np.where(t < times[0], t / (t + fixed), inside)


__all__ = ["efficiency_at", "efficiency_table"]
