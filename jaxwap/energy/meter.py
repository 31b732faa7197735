"""Measured (or, failing that, clearly modeled) energy of a window of JAX work.

The planner trades speed against energy, so it needs joules it can trust. NVML offers two
sources: the total-energy counter (Volta and later; exact, but it only updates every ~20-100 ms)
and instantaneous power (everywhere NVML works; we integrate it from a polling thread). When
NVML cannot be used at all (CPU devices, no driver, permission denied, a call failing
mid-window) the meter says why and reports *modeled* energy, labelled as such, so a training
run is never crashed or silently fed fake measurements.

Usage::

    with EnergyMeter() as meter:
        jax.block_until_ready(step(state, batch))   # the caller blocks: the meter needs no arrays
    meter.reading.total_j, meter.reading.source

or ``reading, n = measure_energy(lambda: jax.block_until_ready(step(state, batch)))``, which
repeats the step until the window is long enough for the energy counter to move.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

__all__ = ["EnergyMeter", "EnergyReading", "measure_energy"]

SOURCE_COUNTER = "nvml-energy-counter"
SOURCE_POLLING = "nvml-power-polling"
SOURCE_MODELED = "modeled"

# NVML's energy counter is refreshed every ~20-100 ms; a zero delta over a window shorter than
# this says "the counter did not tick", not "no energy was used".
COUNTER_UPDATE_PERIOD_S = 0.2


@dataclass(frozen=True)
class EnergyReading:
    """Energy of one measured window.

    ``source`` tells how far to trust it: the counter is a hardware measurement, polling is an
    integral of sampled power, and ``"modeled"`` is not a measurement at all (see ``note``).
    """

    seconds: float  # wall time of the window
    joules: tuple[float, ...]  # per device
    total_j: float
    avg_power_w: float  # total_j / seconds
    source: str  # "nvml-energy-counter" | "nvml-power-polling" | "modeled"
    note: str  # why this source


def _error_types(nvml: Any) -> tuple[type[BaseException], ...]:
    """The exceptions that mean "NVML is not usable", for this (possibly fake) NVML module."""
    nvml_error = getattr(nvml, "NVMLError", Exception) if nvml is not None else Exception
    if not (isinstance(nvml_error, type) and issubclass(nvml_error, BaseException)):
        nvml_error = Exception
    return (nvml_error, OSError, ImportError, RuntimeError)


def _describe(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def nvml_handle(nvml: Any, device: Any) -> tuple[Any, str]:
    """NVML handle for a jax GPU device, and a note saying how the two were matched.

    PCI bus id is the only identifier shared by CUDA and NVML without ambiguity, so it is
    preferred; jax devices do not currently expose it, so the fallback is the CUDA ordinal
    (``local_hardware_id``, else ``id``) translated through ``CUDA_VISIBLE_DEVICES``. That
    assumes CUDA and NVML enumerate in the same (PCI) order, which the note records. Shared by
    the energy meter and the power-limit guard so both always address the same physical GPU.
    """
    bus = getattr(device, "pci_bus_id", None)
    if bus and hasattr(nvml, "nvmlDeviceGetHandleByPciBusId"):
        return nvml.nvmlDeviceGetHandleByPciBusId(bus), "devices matched to NVML by PCI bus id"
    ordinal = getattr(device, "local_hardware_id", None)
    attr = "local_hardware_id"
    if ordinal is None:
        ordinal, attr = int(getattr(device, "id", 0)), "id"
    note = (
        f"devices matched to NVML by {attr} (jax exposes no PCI bus id; assumes CUDA and "
        "NVML enumerate in the same order)"
    )
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    visible = [v for v in visible if v]
    if visible and 0 <= ordinal < len(visible):
        entry = visible[ordinal]
        if entry.isdigit():
            ordinal = int(entry)
        elif hasattr(nvml, "nvmlDeviceGetHandleByUUID"):
            return nvml.nvmlDeviceGetHandleByUUID(entry), note
    return nvml.nvmlDeviceGetHandleByIndex(int(ordinal)), note


class EnergyMeter:
    """Context manager measuring the energy the given devices use between enter and exit.

    Per device it reads NVML's total-energy counter at enter and exit where supported, and
    otherwise integrates power sampled by a daemon thread every ``poll_interval_s``. The work
    inside the window must be finished by the time the block exits (call
    ``jax.block_until_ready`` on its outputs): the meter cannot see the arrays, and work still
    queued at exit would be billed to whatever runs next.

    Every NVML problem (import, init, handle lookup, a read failing mid-window) is caught and
    turned into a ``"modeled"`` reading with the reason in ``note`` / ``reason``; nothing here
    raises into the training run. Exceptions raised by the body itself are not suppressed.
    """

    reading: EnergyReading | None
    available: bool
    reason: str

    def __init__(
        self,
        devices: Sequence[Any] | None = None,
        *,
        nvml: Any = None,
        modeled_power_w: float | None = None,
        poll_interval_s: float = 0.02,
    ) -> None:
        self.devices = list(devices) if devices is not None else list(jax.local_devices())
        self.modeled_power_w = modeled_power_w
        self.poll_interval_s = max(float(poll_interval_s), 1e-4)
        self.reading = None
        self.available = False
        self.reason = ""
        self._nvml_arg = nvml
        self._nvml: Any = None
        self._initialised = False
        self._handles: list[Any] = []
        self._mapping_note = ""
        self._mode: str | None = None
        self._start_mj: list[float] = []
        self._samples: list[list[tuple[float, float]]] = []
        self._poll_error: str | None = None
        self._counter_reason = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    # ----------------------------------------------------------------------------- lifecycle

    def __enter__(self) -> EnergyMeter:
        self.reading = None
        self.available = False
        self.reason = ""
        self._mode = None
        self._poll_error = None
        self._counter_reason = ""
        self._handles, self._start_mj, self._samples = [], [], []
        self._stop = threading.Event()
        self._thread = None
        try:
            self._start()
        except Exception as err:  # NVML must never crash the run, whatever it raises
            self._fail(f"NVML setup failed ({_describe(err)})")
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        t1 = time.perf_counter()
        try:
            self.reading = self._finish(t1)
        except Exception as err:  # belt and braces: a reading is always produced
            self._fail(f"NVML read failed ({_describe(err)})")
            self.reading = self._modeled(t1 - self._t0)
        finally:
            self._stop_thread()
            self._shutdown()

    # ------------------------------------------------------------------------------ internals

    def _fail(self, reason: str) -> None:
        """Switch to the modeled path, keeping the first reason (it is the root cause)."""
        self.available = False
        self._mode = SOURCE_MODELED
        if not self.reason:
            self.reason = reason

    def _start(self) -> None:
        if not self.devices:
            self._fail("no devices")
            return
        platforms = sorted({str(getattr(d, "platform", "unknown")) for d in self.devices})
        if platforms != ["gpu"]:
            self._fail(f"devices are {'/'.join(platforms)}")
            return
        nvml = self._nvml_arg
        if nvml is None:
            try:
                import pynvml as nvml  # lazy: CPU-only installs need not load it
            except ImportError as err:
                self._fail(f"pynvml not importable ({_describe(err)})")
                return
        self._nvml = nvml
        errors = _error_types(nvml)
        try:
            nvml.nvmlInit()
            self._initialised = True
            self._handles = []
            for d in self.devices:
                handle, self._mapping_note = nvml_handle(nvml, d)
                self._handles.append(handle)
        except errors as err:
            self._fail(f"NVML unavailable ({_describe(err)})")
            return
        try:
            self._start_mj = [float(nvml.nvmlDeviceGetTotalEnergyConsumption(h))
                              for h in self._handles]
            self._mode = SOURCE_COUNTER
        except errors as err:
            self._counter_reason = f"energy counter unsupported ({_describe(err)})"
            try:
                now = time.perf_counter()
                self._samples = [[(now, self._power_w(h))] for h in self._handles]
            except errors as err2:
                self._fail(f"NVML power unavailable ({_describe(err2)})")
                return
            self._mode = SOURCE_POLLING
            self._thread = threading.Thread(
                target=self._poll, name="jaxwap-energy-poll", daemon=True
            )
            self._thread.start()
        self.available = True

    def _power_w(self, handle: Any) -> float:
        return float(self._nvml.nvmlDeviceGetPowerUsage(handle)) / 1000.0

    def _poll(self) -> None:
        """Sampling loop of the polling path; an NVML error ends it and is reported at exit."""
        while not self._stop.wait(self.poll_interval_s):
            try:
                for i, h in enumerate(self._handles):
                    self._samples[i].append((time.perf_counter(), self._power_w(h)))
            except Exception as err:  # a daemon thread must not die with a traceback
                self._poll_error = f"NVML power polling failed mid-window ({_describe(err)})"
                return

    def _stop_thread(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(1.0, 10 * self.poll_interval_s))
            self._thread = None

    def _shutdown(self) -> None:
        if self._initialised:
            self._initialised = False
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # a shutdown failure cannot affect the reading
                pass

    def _finish(self, t1: float) -> EnergyReading:
        seconds = t1 - self._t0
        if self._mode == SOURCE_COUNTER:
            return self._finish_counter(seconds)
        if self._mode == SOURCE_POLLING:
            return self._finish_polling(seconds)
        return self._modeled(seconds)

    def _finish_counter(self, seconds: float) -> EnergyReading:
        nvml = self._nvml
        errors = _error_types(nvml)
        try:
            end = [float(nvml.nvmlDeviceGetTotalEnergyConsumption(h)) for h in self._handles]
        except errors as err:
            self._fail(f"NVML energy counter failed mid-window ({_describe(err)})")
            return self._modeled(seconds)
        joules = [max(e - s, 0.0) / 1000.0 for s, e in zip(self._start_mj, end, strict=True)]
        notes = [self._mapping_note]
        short = [i for i, j in enumerate(joules) if j == 0.0]
        if short and seconds < COUNTER_UPDATE_PERIOD_S:
            # A zero here means the counter did not tick, not zero energy: estimate instead.
            estimated = []
            for i in short:
                try:
                    joules[i] = self._power_w(self._handles[i]) * seconds
                    estimated.append(str(i))
                except errors:
                    if self.modeled_power_w is not None:
                        joules[i] = float(self.modeled_power_w) * seconds
            notes.insert(
                0,
                f"window shorter than the counter's update period ({seconds:.3f} s < "
                f"{COUNTER_UPDATE_PERIOD_S} s; counter did not advance on device(s) "
                f"{', '.join(str(i) for i in short)}; estimated from instantaneous power for "
                f"[{', '.join(estimated)}]; use measure_energy to repeat the step)",
            )
        return self._make(seconds, joules, SOURCE_COUNTER, "; ".join(n for n in notes if n))

    def _finish_polling(self, seconds: float) -> EnergyReading:
        self._stop_thread()
        if self._poll_error is not None:
            self._fail(self._poll_error)
            return self._modeled(seconds)
        errors = _error_types(self._nvml)
        try:
            now = time.perf_counter()
            for i, h in enumerate(self._handles):
                self._samples[i].append((now, self._power_w(h)))
        except errors as err:
            self._fail(f"NVML power polling failed at exit ({_describe(err)})")
            return self._modeled(seconds)
        joules = []
        for samples in self._samples:
            total = 0.0
            for (ta, pa), (tb, pb) in zip(samples, samples[1:], strict=False):
                total += 0.5 * (pa + pb) * (tb - ta)
            joules.append(total)
        n = min(len(s) for s in self._samples)
        note = (
            f"{self._counter_reason or 'energy counter unsupported'}; integrated "
            f"{n} power samples per device (trapezoid, every {self.poll_interval_s} s; NVML "
            "power is a ~1 s average on Ampere+)"
        )
        if self._mapping_note:
            note += f"; {self._mapping_note}"
        return self._make(seconds, joules, SOURCE_POLLING, note)

    def _modeled(self, seconds: float) -> EnergyReading:
        n = len(self.devices)
        reason = self.reason or "NVML not used"
        if self.modeled_power_w is None:
            note = f"NVML unavailable: {reason}; no modeled_power_w given, reporting 0 J"
            joules = [0.0] * n
        else:
            p = float(self.modeled_power_w)
            note = f"NVML unavailable: {reason}; modeled at {p:g} W x {n} devices"
            joules = [p * seconds] * n
        return self._make(seconds, joules, SOURCE_MODELED, note)

    @staticmethod
    def _make(seconds: float, joules: Sequence[float], source: str, note: str) -> EnergyReading:
        total = float(sum(joules))
        return EnergyReading(
            seconds=float(seconds),
            joules=tuple(float(j) for j in joules),
            total_j=total,
            avg_power_w=total / seconds if seconds > 0 else 0.0,
            source=source,
            note=note,
        )


# NVML's energy counter updates every ~20-100 ms: a shorter window reads 0
MIN_WINDOW_S = 0.25


def measure_energy(
    run: Callable[[], Any],
    devices: Sequence[Any] | None = None,
    *,
    min_window_s: float = MIN_WINDOW_S,
    max_repeats: int = 10_000,
    nvml: Any = None,
    modeled_power_w: float | None = None,
) -> tuple[EnergyReading, int]:
    """Call run() (it must block until its work is done, e.g. with jax.block_until_ready)
    repeatedly inside one EnergyMeter window until the window lasts at least min_window_s
    (NVML's energy counter updates only every ~20-100 ms: shorter windows read 0), and
    return the reading and how many times run() was called.

    Divide ``reading.total_j`` by the count for joules per call. ``run`` is always called at
    least once; exceptions from ``run`` itself propagate (they are the caller's, not NVML's).
    """
    meter = EnergyMeter(devices, nvml=nvml, modeled_power_w=modeled_power_w)
    calls = 0
    limit = max(int(max_repeats), 1)
    with meter:
        t0 = time.perf_counter()
        while True:
            jax.block_until_ready(run())  # in case run() forgot to block
            calls += 1
            if calls >= limit or time.perf_counter() - t0 >= min_window_s:
                break
    assert meter.reading is not None
    return meter.reading, calls
