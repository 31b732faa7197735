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
device) keeps the built-in profile's value, and the notes say so."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxwap.calibration import accel_probes, conv_probes, cpu_probes, probes
from jaxwap.calibration.host_calls import python_call_seconds
from jaxwap.core.paths import default_cache_dir, driver_version
from jaxwap.core.progress import Progress
from jaxwap.cost.collectives import ring_fit
from jaxwap.energy.power_limit import measured_power_profile
from jaxwap.hardware.calibration import Calibration
from jaxwap.hardware.cluster import HOST_KINDS, DeviceSpec, builtin_for_kind
from jaxwap.hardware.device import efficiency_table
from jaxwap.runtime.launch import all_processes, process_median


# --------------------------------------------------------------------------- storage
def _known(v: float, below: float = math.inf) -> float | None:
    """A figure, or None where it was not measured (NaN) or is not below `below`."""
    return None if math.isnan(v) or v >= below else v


def _table(fig: dict[str, float], prefix: str) -> tuple[tuple[float, float], ...]:
    """The (size, value) pairs a figure table was flattened to (`prefix` + size keys),
    the entries no process measured (NaN) left out."""
    return tuple(sorted((float(k[len(prefix):]), v) for k, v in fig.items()
                        if k.startswith(prefix) and not math.isnan(v)))


def calibration_path(device: Any, directory: Path | None = None,
                     num_processes: int | None = None) -> Path:
    """Where the calibration of this device kind, driver, jax version and process count
    (default: this run's) is kept. Links between processes are not links inside one, so a
    cluster's calibration has a file of its own; one process keeps the plain name."""
    base = Path(directory) if directory is not None else default_cache_dir()
    kind = "".join(c if c.isalnum() else "-" for c in device.device_kind.lower())
    procs = jax.process_count() if num_processes is None else int(num_processes)
    name = f"{device.platform}-{kind}-jax{jax.__version__}-driver{driver_version()}"
    return base / "calibration" / (name + (f"-{procs}proc" if procs > 1 else "") + ".json")


def load_calibration(device: Any, directory: Path | None = None,
                     num_processes: int | None = None) -> Calibration | None:
    """The cached calibration for this device kind and process count (default: this
    run's), or None (a bad file counts as none)."""
    path = calibration_path(device, directory, num_processes)
    try:
        return Calibration.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _save(cal: Calibration, path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # a temporary name of this process's own; the rename is atomic (whole records)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cal.to_dict(), indent=1))
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache must not lose the measurement
        warnings.warn(f"could not save the calibration to {path}: {e}", stacklevel=3)


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
    dev = local[0]
    path = calibration_path(dev, directory, procs)
    if use_cache:
        cached = load_calibration(dev, directory, procs)
        hit = cached is not None and cached.num_devices == len(devs) \
            and cached.num_processes == procs
        if procs > 1:  # all reuse or all measure: a measuring process needs its peers
            hit = all_processes(hit)
        if hit and cached is not None:
            return dataclasses.replace(cached, notes=cached.notes + tuple(notes))
    on_cpu, nan = dev.platform == "cpu", float("nan")  # nan: none, and so its median
    sizes, dense_sizes, bw_bytes = probes.sizes_for(on_cpu, quick)
    steps = 2 * len(sizes) + len(dense_sizes) + 6
    bar = Progress(steps, progress, "jaxwap calibrate")
    notes_: list[str] = list(notes)
    base = builtin_for_kind(dev.device_kind, dev.platform)
    if not on_cpu:   # from its idle clock (`accel_probes`)
        accel_probes.warm_up(dev)
    f32 = probes.matmul_curve(dev, jnp.float32, sizes, bar)
    bf16 = probes.matmul_curve(dev, jnp.bfloat16, sizes, bar)
    # the device's fast matmul (bf16 on a GPU; f32 on a CPU, whose bf16 is emulated)
    main = bf16 if bf16["peak_flops"] > 1.2 * f32["peak_flops"] else f32
    fast = jnp.bfloat16 if main is bf16 else jnp.float32
    dense = probes.matmul_training(dev, fast, dense_sizes, bar)
    # a CPU cluster's processes of one host share its memory (an accelerator has its own):
    # the bandwidth is each one's alone, not what chance overlap left it
    host = cpu_probes.host_memory(dev, bw_bytes) if on_cpu and procs > 1 else (0, {}, {})
    bandwidth = 2.0 * bw_bytes / host[1]["stream"] if host[0] else (
        probes.bandwidth if on_cpu else accel_probes.stream_bandwidth)(dev, bw_bytes)
    relayout = probes.layout_change(dev, ([256, 2048] if quick else [64, 256, 1024, 2048])
                                    if on_cpu else [4096, 8192, 16384])  # past launches
    bar.step("memory bandwidth")
    overhead = probes.kernel_overhead(dev)
    call = probes.step_call(local)
    python_call = python_call_seconds()
    bar.step("kernel overhead")
    # the curve as the model will use it, on this process's own figures, for what is
    # measured against it (convolutions)
    curve = dataclasses.replace(base, matmul_efficiency=efficiency_table(
        dense, main["peak_flops"], overhead))
    # convolutions against matmuls of their dtype: f32 on a CPU; on an accelerator the
    # fast one, at its scale (the CPU's small shapes time a GPU's launches alone)
    peak = f32["peak_flops"] if on_cpu else main["peak_flops"]

    def matmul_s(w: float) -> float:   # a matmul of w flops, its launch excluded
        return w / (peak * float(curve.matmul_eff(w, peak)))

    conv_eff, small_conv, small_by_width = conv_probes.conv_rates(
        dev, lambda w: matmul_s(w) + overhead, quick,
        *(() if on_cpu else (conv_probes.ACCEL_CONV_SHAPES, fast)))
    narrow = conv_probes.narrow_conv_efficiency(
        dev, jnp.float32 if on_cpu else fast, lambda w: matmul_s(w) + overhead,
        conv_probes.CPU_NARROW_CONVS[:1 if quick else None] if on_cpu
        else conv_probes.NARROW_CONVS)
    tiny_s, tiny_flops = conv_probes.tiny_conv(dev)
    transposed = cpu_probes.transposed_matmul_efficiency(dev) if on_cpu else float("nan")
    pool_tap, pool_grad = cpu_probes.pooling(dev) if on_cpu else (0.0, 0.0)
    # past the cache: an H100's 50 MB L2 holds 4 MiB, whose tanh its launch dominates
    per_tanh = probes.transcendental(dev, 2**20 if on_cpu else 2**26)
    reduce = probes.reduction(dev, [2**12, 2**14, 2**16, 2**18, 2**20, 2**22], bandwidth,
                              overhead)
    bar.step("convolutions")
    fresh = probes.fresh_memory(dev, probes.fresh_memory_sizes(on_cpu, quick))
    bar.step("fresh memory")
    link = probes.all_reduce(devs, probes.link_sizes(on_cpu, quick), repeats=5 if quick else 20)
    buffer_latency = probes.buffer_latency(devs) if link is not None else float("nan")
    in_program = probes.collective_latency(devs) if link is not None else (float("nan"),) * 2
    bar.step("all-reduce")
    if link is None:
        notes_.append("one device: link bandwidth and latency are the built-in profile's")
    power = None
    compute, memory = accel_probes.power_loads(dev, sizes[-1], bw_bytes)
    try:
        power = accel_probes.power(local, compute, memory)
    except Exception as e:  # noqa: BLE001 - power is optional; the profile says so
        notes_.append(f"power not measured: {type(e).__name__}: {e}")
    bar.step("power")
    # the fallback curve of the fast matmul: a matmul of w flops takes (w + w_half) / peak
    # + a launch, so each size gives w_half = peak * (t - launch) - w; the median over them
    half = float(np.median([main["peak_flops"] * (t - overhead) - w for w, t in
                            zip(main["work_flops"], main["seconds"], strict=True)]))
    half = max(half, main["peak_flops"] * 1e-7)
    # what a tiny convolution takes beyond its work at the convolution rate and a launch
    conv_overhead = max(tiny_s - matmul_s(tiny_flops) / conv_eff - overhead, 0.0)
    fig = {"peak_flops": bf16["peak_flops"], "peak_flops_f32": f32["peak_flops"],
           "efficiency_half_flops": half, "memory_bandwidth": bandwidth,
           "main_peak_flops": main["peak_flops"],
           "kernel_overhead_s": overhead, "conv_efficiency": conv_eff,
           **{f"call_s@{d}": a for d, a, _ in call},
           **{f"call_array_s@{d}": c for d, _, c in call}, "python_call_s": python_call,
           "narrow_conv_efficiency": narrow, "transposed_matmul_efficiency": transposed,
           "window_tap_s": pool_tap, "window_grad_s": pool_grad,
           "conv_overhead_s": conv_overhead,
           # a term only where it is slower than the memory it moves (a CPU's polynomials)
           "transcendental_s": per_tanh if per_tanh > 1.5 * 8 / bandwidth else 0.0,
           "small_input_conv_flops": small_conv,
           "link_bandwidth": link["bandwidth_Bps"] if link else nan,
           "all_reduce_s": in_program[0], "all_gather_s": in_program[1],
           "link_buffer_latency_s": buffer_latency, "host_devices": host[0] or nan,
           **{f"host_{k}@{kind}": v for kind in HOST_KINDS for k, v in (
               ("alone_s", host[1].get(kind, nan)), ("together_s", host[2].get(kind, nan)),
               ("slowdown", max(host[2][kind] / host[1][kind], 1.0) if host[0] else nan))},
           "idle_watts": power[0] if power else nan, "loaded_watts": power[1] if power else nan,
           "memory_watts": power[2] if power and power[2] is not None else nan,
           # tables as one figure per entry, so processes agree on each by its median
           **{f"small_conv_flops@{c}": r for c, r in small_by_width.items()},
           **{f"fresh_s_per_byte@{n}": c for n, c in fresh},
           **{f"layout_s_per_byte@{n}": c for n, c in relayout},
           **{f"dense_matmul_s@{w:.0f}": t for w, t in dense},
           **{f"reduce_s_per_byte@{n}": c for n, c in reduce}}
    per_process = None
    if procs > 1:
        fig, per_process = process_median(fig)
        if link is not None:
            link = dict(link, bandwidth_Bps=fig["link_bandwidth"])
        notes_.append(f"measured on {procs} processes x {len(local)} device(s): per-device "
                      f"figures are the median of each process's own device; links were "
                      f"timed across all {len(devs)} devices")
    watts = None if math.isnan(fig["idle_watts"] + fig["loaded_watts"]) else \
        [fig["idle_watts"], fig["loaded_watts"]]
    if watts is None:
        notes_.append("power not measured (no NVML for these devices): idle and max watts "
                      "are the built-in profile's")
    linked = link is not None
    if linked:   # inside a program: overhead + 2(n-1) or n-1 steps x latency
        ar, ag = fig["all_reduce_s"], fig["all_gather_s"]
        lat, once = ring_fit(ar, ag, len(devs))
        link = dict(link, in_program_s={"all-reduce": ar, "all-gather": ag}, latency_s=lat,
                    overhead_s=once, fitted_latency_s=link["latency_s"])
    small_conv = fig["small_input_conv_flops"]
    # a generic-loop convolution far below the library's rate is a backend's slow path
    # (XLA:CPU); where it is not slower, the backend has no such path
    slow_convs = on_cpu and small_conv < 0.5 * fig["conv_efficiency"] * fig["peak_flops_f32"]
    rates, fresh_cost, layout_cost, dense, reduce_cost = (_table(fig, t) for t in (
        "small_conv_flops@", "fresh_s_per_byte@", "layout_s_per_byte@", "dense_matmul_s@",
        "reduce_s_per_byte@"))
    mm_eff = efficiency_table(dense, fig["main_peak_flops"], fig["kernel_overhead_s"])
    call_cost = tuple((round(d), a, c) for (d, a), (_, c) in zip(
        _table(fig, "call_s@"), _table(fig, "call_array_s@"), strict=True))
    spec = dataclasses.replace(
        base, name=f"calibrated {dev.device_kind}", peak_flops=fig["peak_flops"],
        peak_flops_f32=fig["peak_flops_f32"], memory_bandwidth=fig["memory_bandwidth"],
        kernel_overhead_s=fig["kernel_overhead_s"], call_cost=call_cost,
        python_call_s=fig["python_call_s"],
        efficiency_half_flops=fig["efficiency_half_flops"],
        matmul_efficiency=mm_eff, reduction_cost=reduce_cost,
        conv_efficiency=fig["conv_efficiency"], conv_overhead_s=fig["conv_overhead_s"],
        narrow_conv_efficiency=_known(fig["narrow_conv_efficiency"]),
        transposed_matmul_efficiency=_known(fig["transposed_matmul_efficiency"], 0.9),
        transcendental_s=fig["transcendental_s"], window_tap_s=fig["window_tap_s"],
        window_grad_s=fig["window_grad_s"],
        layout_change_cost=layout_cost,
        small_input_conv_flops=small_conv if slow_convs else None,
        small_input_conv_rates=rates if slow_convs else (),
        fresh_memory_cost=fresh_cost,
        idle_watts=watts[0] if watts else base.idle_watts,
        max_watts=max(watts) if watts else base.max_watts,
        link_bandwidth=fig["link_bandwidth"] if linked else base.link_bandwidth,
        link_latency_s=link["latency_s"] if linked else base.link_latency_s,
        collective_overhead_s=link["overhead_s"] if linked else base.collective_overhead_s,
        link_buffer_latency_s=fig["link_buffer_latency_s"] if linked
        else base.link_buffer_latency_s,
        power=measured_power_profile(base, dev, watts, fig["memory_watts"], compute, notes_,
                                     set_limits=set_power_limits))
    topology = {"processes": procs, "devices": len(devs), "devices_per_process": len(local),
                "written_by_process": me}
    raw = {"matmul_f32": f32, "matmul_bf16": bf16, "dense_layer_matmul_flops_s": dense,
           "matmul_efficiency": mm_eff, "reduction_cost": reduce_cost,
           "bandwidth_Bps": fig["memory_bandwidth"], **{k: fig[k] for k in (
               "kernel_overhead_s", "conv_efficiency", "narrow_conv_efficiency",
               "transposed_matmul_efficiency", "conv_overhead_s", "transcendental_s",
               "small_input_conv_flops", "window_tap_s", "window_grad_s")},
           "call_cost": call_cost, "python_call_s": fig["python_call_s"],
           "layout_change_cost": layout_cost, "small_input_conv_rates": rates,
           "fresh_memory_cost": fresh_cost, "link": link,
           "link_buffer_latency_s": fig["link_buffer_latency_s"], "power_w": watts,
           "topology": topology, "per_process": per_process,
           "host_memory": None if math.isnan(fig["host_devices"]) else {
               "devices": round(fig["host_devices"]) * len(local),
               **{kind: fig[f"host_slowdown@{kind}"] for kind in HOST_KINDS},
               **{f"{k}@{kind}": fig[f"host_{k}@{kind}"] for kind in HOST_KINDS
                  for k in ("alone_s", "together_s")}}}
    cal = Calibration(spec, dev.device_kind, dev.platform, len(devs), jax.__version__,
                      driver_version(), raw, tuple(notes_), procs)
    # in a cluster process 0 writes, and then (a barrier) only a process whose directory
    # lacks the same profile (another machine's disk): sharers never race on the file
    if procs == 1 or me == 0:
        _save(cal, path)
    if procs > 1 and all_processes(True) and me != 0:
        there = load_calibration(dev, directory, procs)
        if there is None or there.spec != cal.spec:
            _save(cal, path)
    return cal
