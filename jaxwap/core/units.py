"""Figures as people read them: SI prefixes, named meshes and device id ranges, the
formatters every report uses."""

from __future__ import annotations

from collections.abc import Iterable


def si(x: float, unit: str = "", sep: str = " ", small: bool = False) -> str:
    """`x` with an SI prefix and three significant digits: si(2.5e9, "B") -> "2.5 GB".
    `small`: below 1, milli and micro too (si(0.0068, "J", small=True) -> "6.8 mJ"), for
    units whose small values people read so (energy per sample)."""
    scales = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))
    if small and 0 < abs(x) < 1:
        scales = ((1e-3, "m"), (1e-6, "\u00b5"))
    for scale, prefix in scales:
        if abs(x) >= scale:
            return f"{x / scale:.3g}{sep}{prefix}{unit}"
    return f"{x:.3g}{sep}{unit}".rstrip()


def named_mesh(axes: Iterable[tuple[str, int]]) -> str:
    """A mesh as its named axes, "stage=2 x data=8 x model=4" ("1 device" for none)."""
    return " x ".join(f"{a}={s}" for a, s in axes) or "1 device"


def id_ranges(ids: Iterable[int]) -> str:
    """Device ids as runs, "0-511" or "0-3, 8-11": a 512-device plan's ids on one line."""
    runs: list[list[int]] = []
    for i in map(int, ids):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs) or "none"


__all__ = ["id_ranges", "named_mesh", "si"]
