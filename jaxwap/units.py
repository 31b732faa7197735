"""Figures as people read them: SI prefixes, the one formatter every report uses."""

from __future__ import annotations


def si(x: float, unit: str = "", sep: str = " ") -> str:
    """`x` with an SI prefix and three significant digits: si(2.5e9, "B") -> "2.5 GB"."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{sep}{prefix}{unit}"
    return f"{x:.3g}{sep}{unit}".rstrip()


__all__ = ["si"]
