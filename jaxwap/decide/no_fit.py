"""Why no plan fits, in words: the planner's memory errors, naming the smallest
candidate, what it needs, and what the user pinned (`constraints=`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxwap.core.units import si
from jaxwap.decide.verify import Verification
from jaxwap.search.constraints import LayoutRules, path_string
from jaxwap.search.solve import SearchResult


def nothing_fits(result: SearchResult, budget: float, batch: int | None,
                  rules: LayoutRules | None = None, params: Sequence[Any] = ()) -> str:
    best = result.results[result.best]
    mesh = " x ".join(f"{a}={n}" for a, n in best.mesh)
    pinned = "" if rules is None or not rules.pins else (
        " It keeps the constraints' pins (" + "; ".join(
            f"{path_string(params[j].path)} with shape {tuple(params[j].shape)} as "
            f"{c.describe()}" for j, c in rules.pins) + "): a pin may be what does not fit.")
    return (f"no candidate plan fits the memory budget of {si(budget, 'B')} per device: the "
            f"smallest, mesh {mesh}, needs "
            f"{si(best.predicted.peak_memory_bytes, 'B')} per device.{pinned} Use more "
            f"devices, a smaller batch (now {batch}), a smaller model, or a larger "
            f"memory_budget=.")


def nothing_fits_compiled(ver: Verification, result: SearchResult, budget: float,
                           batch: int | None) -> str:
    if not ver.figures:
        errors = "; ".join(f"{result.results[i].d}x{result.results[i].m}: {e}"
                           for i, e in list(ver.failed.items())[:3])
        return f"no candidate plan compiled: {errors}"
    i = min(ver.figures, key=lambda i: ver.figures[i].memory_bytes)
    r = result.results[i]
    mesh = " x ".join(f"{a}={n}" for a, n in r.mesh)
    return (f"no candidate plan fits the memory budget of {si(budget, 'B')} per device by "
            f"XLA's own memory analysis: the smallest compiled, mesh {mesh}, "
            f"needs {si(ver.figures[i].memory_bytes, 'B')} per device (the model predicted "
            f"{si(r.predicted.peak_memory_bytes, 'B')}). Use more devices, a smaller batch "
            f"(now {batch}), a smaller model, or a larger memory_budget=.")


__all__ = ["nothing_fits", "nothing_fits_compiled"]
