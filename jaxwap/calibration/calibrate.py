"""Calibration: measure the device profile on the devices present.

Datasheet peaks flatter every device. `calibrate()` times what the cost model's
parameters stand for, on the real device: matmuls of several sizes and dtypes (peak
flop/s, efficiency curve), a large elementwise op (memory bandwidth), a chain of tiny
matmuls (per-kernel overhead), calls of a program passing many arrays (the host's
dispatch of a step), all-reduces across the devices (link bandwidth and
latency), where NVML answers idle and loaded power, and more (`calibrate_full`). Cached
per device kind, driver, jax version and process count; `hardware=None` planning uses it.

Under jax.distributed (`jaxwap calibrate --coordinator ...`, once per process) every
process measures its own device, the links are timed by all-reduces over all the global
devices (gloo between CPU processes), and the processes agree on the median of their
figures so that every process plans with the same profile.

A CPU cluster's processes of one host also run memory-side work alone and all at once:
how much they slow each other's (`cluster.HostMemory`). Every figure is
measured on the device named; what could not be (power without NVML, links with one
device) keeps the built-in profile's value, and the notes say so.

This module runs a calibration and turns the figures into the calibrated `DeviceSpec`
and record; the probes' run is `calibration/device_figures.py`'s, the files and how a
cluster's processes share them `calibration/store.py`'s."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from jaxwap.calibration.device_figures import Measured, measure_figures
from jaxwap.calibration.store import reusable_calibration, store_calibration
from jaxwap.core.paths import driver_version
from jaxwap.cost.collectives import ring_fit
from jaxwap.energy.clock_curve import measured_power_profile
from jaxwap.hardware.calibration import Calibration
from jaxwap.hardware.cluster import HOST_KINDS, builtin_for_kind
from jaxwap.hardware.device import DeviceSpec
from jaxwap.hardware.matmul_efficiency import efficiency_table
from jaxwap.hardware.power_model import PowerProfile
from jaxwap.runtime.distributed import process_median


def calibrate(devices: Sequence[Any] | None = None, *, progress: bool = True,
              quick: bool = False, directory: Path | None = None,
              use_cache: bool = True, set_power_limits: bool = True) -> DeviceSpec:
    """Measure the profile of the devices present (all of one kind) and cache it.

    `quick` uses smaller sizes (seconds on a CPU). `set_power_limits=False` leaves the
    GPUs' power limits alone (a shared machine, or one whose owner forbids it): the
    power-limit curve is then the built-in profile's, and the record's notes say so; with
    True (the default) the curve is measured by setting several limits through NVML,
    each restored before calibration returns. Returns the calibrated `DeviceSpec`;
    `load_calibration(device)` gives the full record with the raw measurements."""
    return calibrate_full(devices, progress=progress, quick=quick, directory=directory,
                          use_cache=use_cache, set_power_limits=set_power_limits).spec


def calibrate_full(devices: Sequence[Any] | None = None, *, progress: bool = True,
                   quick: bool = False, directory: Path | None = None,
                   use_cache: bool = True, notes: Sequence[str] = (),
                   set_power_limits: bool = True) -> Calibration:
    """`calibrate`, returning the whole record (raw measurements, what it was measured on).

    `devices` defaults to every device of the run, `jax.devices()`: under jax.distributed
    they span the processes, and every process must then call this with the same
    arguments, since the links are timed by collectives all of them take part in.
    `notes` are added to the record's (why a cluster calibration fell back, say)."""
    devs, local, procs = _devices_to_calibrate(devices)
    dev = local[0]
    if use_cache:
        cached = reusable_calibration(dev, directory, len(devs), procs)
        if cached is not None:
            return dataclasses.replace(cached, notes=cached.notes + tuple(notes))
    notes_: list[str] = list(notes)
    base = builtin_for_kind(dev.device_kind, dev.platform)
    measured = measure_figures(dev, devs, local, base, quick, progress, notes_)
    fig, per_process, link = _agree(measured, procs, len(local), len(devs), notes_)
    watts = None if math.isnan(fig["idle_watts"] + fig["loaded_watts"]) else \
        [fig["idle_watts"], fig["loaded_watts"]]
    if watts is None:
        notes_.append("power not measured (no NVML for these devices): idle and max watts "
                      "are the built-in profile's")
    link = _fit_links(fig, link, len(devs))
    tables = _Tables.of(fig)
    power = measured_power_profile(base, dev, watts, fig["memory_watts"], measured.compute,
                                   notes_, set_limits=set_power_limits)
    spec = _calibrated_spec(base, dev, fig, tables, link, watts, power)
    topology = {"processes": procs, "devices": len(devs), "devices_per_process": len(local),
                "written_by_process": jax.process_index()}
    raw = _raw_measurements(measured, fig, tables, link, watts, topology, per_process,
                            len(local))
    cal = Calibration(spec, dev.device_kind, dev.platform, len(devs), jax.__version__,
                      driver_version(), raw, tuple(notes_), procs)
    store_calibration(cal, dev, directory)
    return cal


def _devices_to_calibrate(devices: Sequence[Any] | None
                          ) -> tuple[tuple[Any, ...], list[Any], int]:
    """(every device, this process's own, the process count) of a calibration, checked:
    one kind, some of this process's own (each process measures its own device), and
    one process or all of them (the links are timed by collectives all take part in)."""
    devs = tuple(devices) if devices is not None else tuple(jax.devices())
    if not devs:
        raise ValueError("calibrate: no devices")
    kinds = {d.device_kind for d in devs}
    if len(kinds) != 1:
        raise ValueError(f"calibrate: devices of several kinds {sorted(kinds)}")
    me = jax.process_index()
    local = [d for d in devs if d.process_index == me]
    procs = len({d.process_index for d in devs})
    if not local:
        raise ValueError(f"calibrate: devices holds none of process {me}'s own; each "
                         f"process measures its own device")
    if 1 < procs < jax.process_count():
        raise ValueError(f"calibrate: devices span {procs} of the {jax.process_count()} "
                         f"processes; pass all of them (jax.devices()) or this process's own")
    return devs, local, procs


def _agree(measured: Measured, procs: int, per_process_devices: int, devices: int,
           notes: list[str]) -> tuple[dict[str, float], dict[str, Any] | None,
                                      dict[str, Any] | None]:
    """(figures, each process's own figures, all-reduce fit): in a cluster the median over
    the processes of each figure, so that every process plans with the same profile
    (a collective); one process keeps its own."""
    fig, per_process, link = measured.figures, None, measured.link
    if procs > 1:
        fig, per_process = process_median(fig)
        if link is not None:
            link = dict(link, bandwidth_Bps=fig["link_bandwidth"])
        notes.append(f"measured on {procs} processes x {per_process_devices} device(s): "
                     f"per-device figures are the median of each process's own device; "
                     f"links were timed across all {devices} devices")
    return fig, per_process, link


def _fit_links(fig: dict[str, float], link: dict[str, Any] | None, devices: int
               ) -> dict[str, Any] | None:
    """The all-reduce fit with the latency and per-collective overhead that collectives
    inside a program give: overhead + 2(n-1) or n-1 steps x latency (`ring_fit`)."""
    if link is None:
        return None
    ar, ag = fig["all_reduce_s"], fig["all_gather_s"]
    lat, once = ring_fit(ar, ag, devices)
    return dict(link, in_program_s={"all-reduce": ar, "all-gather": ag}, latency_s=lat,
                overhead_s=once, fitted_latency_s=link["latency_s"])


def _known(v: float, below: float = math.inf) -> float | None:
    """A figure, or None where it was not measured (NaN) or is not below `below`."""
    return None if math.isnan(v) or v >= below else v


def _table(fig: dict[str, float], prefix: str) -> tuple[tuple[float, float], ...]:
    """The (size, value) pairs a figure table was flattened to (`prefix` + size keys),
    the entries no process measured (NaN) left out."""
    return tuple(sorted((float(k[len(prefix):]), v) for k, v in fig.items()
                        if k.startswith(prefix) and not math.isnan(v)))


@dataclass(frozen=True)
class _Tables:
    """The profile's tables, read back from the flat figures the processes agreed on."""

    small_conv_rates: tuple[tuple[float, float], ...]
    fresh_memory: tuple[tuple[float, float], ...]
    layout_change: tuple[tuple[float, float], ...]
    dense: tuple[tuple[float, float], ...]
    reduction: tuple[tuple[float, float], ...]
    matmul_efficiency: tuple[tuple[float, float], ...]
    call_cost: tuple[tuple[int, float, float], ...]

    @classmethod
    def of(cls, fig: dict[str, float]) -> _Tables:
        rates, fresh, layout, dense, reduce = (_table(fig, t) for t in (
            "small_conv_flops@", "fresh_s_per_byte@", "layout_s_per_byte@",
            "dense_matmul_s@", "reduce_s_per_byte@"))
        mm_eff = efficiency_table(dense, fig["main_peak_flops"], fig["kernel_overhead_s"])
        call_cost = tuple((round(d), a, c) for (d, a), (_, c) in zip(
            _table(fig, "call_s@"), _table(fig, "call_array_s@"), strict=True))
        return cls(rates, fresh, layout, dense, reduce, mm_eff, call_cost)


def _calibrated_spec(base: DeviceSpec, dev: Any, fig: dict[str, float], tables: _Tables,
                     link: dict[str, Any] | None, watts: list[float] | None,
                     power: PowerProfile | None) -> DeviceSpec:
    """The built-in profile with every figure that was measured in its place."""
    linked = link is not None
    small_conv = fig["small_input_conv_flops"]
    # a generic-loop convolution far below the library's rate is a backend's slow path
    # (XLA:CPU); where it is not slower, the backend has no such path
    slow_convs = dev.platform == "cpu" \
        and small_conv < 0.5 * fig["conv_efficiency"] * fig["peak_flops_f32"]
    return dataclasses.replace(
        base, name=f"calibrated {dev.device_kind}", peak_flops=fig["peak_flops"],
        peak_flops_f32=fig["peak_flops_f32"], memory_bandwidth=fig["memory_bandwidth"],
        kernel_overhead_s=fig["kernel_overhead_s"], call_cost=tables.call_cost,
        python_call_s=fig["python_call_s"],
        efficiency_half_flops=fig["efficiency_half_flops"],
        matmul_efficiency=tables.matmul_efficiency, reduction_cost=tables.reduction,
        conv_efficiency=fig["conv_efficiency"], conv_overhead_s=fig["conv_overhead_s"],
        narrow_conv_efficiency=_known(fig["narrow_conv_efficiency"]),
        transposed_matmul_efficiency=_known(fig["transposed_matmul_efficiency"], 0.9),
        transcendental_s=fig["transcendental_s"], window_tap_s=fig["window_tap_s"],
        window_grad_s=fig["window_grad_s"],
        layout_change_cost=tables.layout_change,
        small_input_conv_flops=small_conv if slow_convs else None,
        small_input_conv_rates=tables.small_conv_rates if slow_convs else (),
        fresh_memory_cost=tables.fresh_memory,
        idle_watts=watts[0] if watts else base.idle_watts,
        max_watts=max(watts) if watts else base.max_watts,
        link_bandwidth=fig["link_bandwidth"] if linked else base.link_bandwidth,
        link_latency_s=link["latency_s"] if link is not None else base.link_latency_s,
        collective_overhead_s=link["overhead_s"] if link is not None
        else base.collective_overhead_s,
        link_buffer_latency_s=fig["link_buffer_latency_s"] if linked
        else base.link_buffer_latency_s,
        power=power)


def _raw_measurements(measured: Measured, fig: dict[str, float], tables: _Tables,
                      link: dict[str, Any] | None, watts: list[float] | None,
                      topology: dict[str, int], per_process: dict[str, Any] | None,
                      per_process_devices: int) -> dict[str, Any]:
    """The record's raw measurements: the curves, the figures and tables as measured, the
    links' fit, what the run spanned and each process's own figures."""
    return {"matmul_f32": measured.f32, "matmul_bf16": measured.bf16,
            "dense_layer_matmul_flops_s": tables.dense,
            "matmul_efficiency": tables.matmul_efficiency,
            "reduction_cost": tables.reduction,
            "bandwidth_Bps": fig["memory_bandwidth"], **{k: fig[k] for k in (
                "kernel_overhead_s", "conv_efficiency", "narrow_conv_efficiency",
                "transposed_matmul_efficiency", "conv_overhead_s", "transcendental_s",
                "small_input_conv_flops", "window_tap_s", "window_grad_s")},
            "call_cost": tables.call_cost, "python_call_s": fig["python_call_s"],
            "layout_change_cost": tables.layout_change,
            "small_input_conv_rates": tables.small_conv_rates,
            "fresh_memory_cost": tables.fresh_memory, "link": link,
            "link_buffer_latency_s": fig["link_buffer_latency_s"], "power_w": watts,
            "topology": topology, "per_process": per_process,
            "host_memory": None if math.isnan(fig["host_devices"]) else {
                "devices": round(fig["host_devices"]) * per_process_devices,
                **{kind: fig[f"host_slowdown@{kind}"] for kind in HOST_KINDS},
                **{f"{k}@{kind}": fig[f"host_{k}@{kind}"] for kind in HOST_KINDS
                   for k in ("alone_s", "together_s")}}}
