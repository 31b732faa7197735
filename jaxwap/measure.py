"""Measured choice: time the finalists on the real devices and choose on what happened.

Model and compiler both estimate; the devices decide. With `auto_shard(measure=True)`
(or `measure=n` steps) the verified finalists are each compiled (without donation, so
the user's state survives), run for a warm-up and then for at least `n` steps inside an
energy window (NVML where the devices have it, modeled and labelled so otherwise), and
the objective chooses on the measured step time and energy. Measured figures are kept
next to the predicted and compiled ones in the `Plan`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import jax

from .compile import compile_layout
from .progress import Progress


@dataclass(frozen=True)
class Measurement:
    """What one candidate did on the devices: per step, over `steps` steps."""

    step_time_s: float
    energy_per_step_j: float
    energy_source: str     # "nvml-energy-counter" | "nvml-power-polling" | "modeled"
    steps: int
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Measurement:
        return cls(**d)


def measure_step(run: Callable[[], Any], devices: Sequence[Any], steps: int,
                 modeled_power_w: float) -> Measurement:
    """Time `run` (one blocking step) for at least `steps` calls and a window long
    enough for NVML's energy counter; energy is modeled (and says so) without NVML."""
    from .energy import measure_energy

    t0 = time.perf_counter()
    for _ in range(steps):
        run()
    min_window = max(0.25, time.perf_counter() - t0)
    reading, calls = measure_energy(run, devices, min_window_s=min_window,
                                    modeled_power_w=modeled_power_w)
    return Measurement(reading.seconds / calls, reading.total_j / calls, reading.source,
                       calls, reading.note)


def measured_choice(fn: Callable, planned: Any, flat_args: Sequence[Any], steps: int,
                    place: Callable[[Any, Any, Any], Any], *,
                    compiler_options: dict[str, Any] | None = None,
                    progress: bool = True) -> Any:
    """Run the plan's verified finalists and return the `Planned` re-chosen on measured
    figures (the plan itself when there is nothing to choose between)."""
    from .planner import rechoose

    plan, search = planned.plan, planned.search
    finalists = [i for i, c in enumerate(plan.candidates)
                 if c.fits and (c.verified is not None or c.chosen)]
    if search is None or len(finalists) < 2:
        return planned
    bar = Progress(len(finalists), progress, "jaxwap measure", width=20)
    measured: dict[int, Measurement] = {}
    for i in finalists:
        r = search.results[i]
        cs = compile_layout(planned.fn or fn, planned.layout, r.d, r.m, r.strategies,
                            planned_devices(planned), donate=False,
                            compiler_options=compiler_options)
        placed = [place(leaf, sh, aval) for leaf, sh, aval in
                  zip(flat_args, cs.in_shardings, planned.layout.inputs.avals, strict=True)]
        run = lambda cs=cs, placed=placed: jax.block_until_ready(cs.compiled(*placed))
        run()  # warm-up
        pred = plan.candidates[i].verified or plan.candidates[i].predicted
        devices = list(cs.mesh.devices.flat)
        measured[i] = measure_step(run, devices, steps, pred.avg_power_w / len(devices))
        bar.step(plan.candidates[i].label)
    return rechoose(planned, measured)


def planned_devices(planned: Any) -> Sequence[Any]:
    """Every device the planning could use (finalists may use more than the choice)."""
    return planned.all_devices or planned.devices


__all__ = ["Measurement", "measure_step", "measured_choice"]
