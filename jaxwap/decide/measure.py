"""Measured choice: time the finalists on the real devices.

Model and compiler both estimate; the devices decide. With `auto_shard(measure=True)`
(or `measure=n` steps) the verified finalists are each compiled (without donation, so
the user's state survives), run for a warm-up and then for at least `n` steps inside an
energy window (NVML where the devices have it, modeled and labelled so otherwise). This
module only measures; the planner decides again on the measurements
(`planner.record_measurements`), which are kept beside the predicted and compiled figures.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxwap.core.progress import Progress
from jaxwap.core.records import Measurement
from jaxwap.energy.meter import MIN_WINDOW_S, measure_energy
from jaxwap.runtime.compile import compile_layout
from jaxwap.runtime.distributed import process_median
from jaxwap.runtime.train_step import restructured


def measure_step(run: Callable[[], Any], devices: Sequence[Any], steps: int,
                 modeled_power_w: float) -> Measurement:
    """Time `run` (one blocking step) for at least `steps` calls and a window long
    enough for NVML's energy counter; energy is modeled (and says so) without NVML.

    With several processes every process runs every finalist (a step that runs holds
    devices of every process), in the same order. A step's collectives need all of them,
    so the window's number of calls is agreed before it opens (the most any process asks
    for), never left to each process's clock: one process stopping a call early would
    leave the others waiting in a collective for ever. The figures are then agreed too
    (the median over the processes), so every process decides on the same measurements
    and runs the same plan."""
    t0 = time.perf_counter()
    for _ in range(steps):
        run()
    each = (time.perf_counter() - t0) / steps
    calls = max(steps, math.ceil(MIN_WINDOW_S / max(each, 1e-9)))
    several = jax.process_count() > 1
    if several:
        _, asked = process_median({"calls": float(calls)})
        calls = int(max(v or 0.0 for v in asked["calls"]))
    reading, n = measure_energy(run, devices, min_window_s=math.inf, max_repeats=calls,
                                modeled_power_w=modeled_power_w)
    secs, joules, note = reading.seconds / n, reading.total_j / n, reading.note
    if several:
        agreed, _ = process_median({"s": secs, "j": joules})
        secs, joules = agreed["s"], agreed["j"]
        note = " ".join(filter(None, [note, f"median over the {jax.process_count()} "
                                            f"processes' measurements"]))
    return Measurement(secs, joules, reading.source, n, note)


def finalists(planned: Any) -> list[int]:
    """The candidates worth running: those that fit and were compiled (or chosen)."""
    return [i for i, c in enumerate(planned.plan.candidates)
            if c.fits and (c.verified is not None or c.chosen)]


def measure_finalists(fn: Callable, planned: Any, flat_args: Sequence[Any], steps: int,
                      place: Callable[[Any, Any, Any], Any], *,
                      compiler_options: dict[str, Any] | None = None,
                      progress: bool = True) -> tuple[dict[int, Measurement], float]:
    """Run the plan's finalists on the devices, each compiled as it would run (the
    restructured step where the plan restructured it). Returns the measurements keyed by
    candidate index (empty when there is nothing to choose between) and the seconds spent.
    """
    t0 = time.perf_counter()
    picks = finalists(planned)
    if planned.search is None or len(picks) < 2:
        return {}, 0.0
    bar = Progress(len(picks), progress, "jaxwap measure", width=20)
    measured: dict[int, Measurement] = {}
    for i in picks:
        r = planned.search.results[i]
        step = restructured(fn, r.step) if r.step is not None else planned.fn or fn
        cs = compile_layout(step, planned.layout, r.d, r.m, r.strategies,
                            planned.all_devices, donate=False,
                            compiler_options=compiler_options, r=r.r, stages=r.stages)
        placed = [place(leaf, sh, aval) for leaf, sh, aval in
                  zip(flat_args, cs.in_shardings, planned.layout.inputs.avals, strict=True)]
        run = lambda cs=cs, placed=placed: jax.block_until_ready(cs.compiled(*placed))
        run()  # warm-up
        cand = planned.plan.candidates[i]
        devices = list(cs.mesh.devices.flat)
        measured[i] = measure_step(run, devices, steps, cand.judged.avg_power_w / len(devices))
        bar.step(cand.label)
    return measured, time.perf_counter() - t0


__all__ = ["finalists", "measure_finalists", "measure_step"]
