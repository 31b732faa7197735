"""One process's calibration measurements, as flat figures its peers can agree on.

`measure_figures` runs every probe of a calibration on this process's device (and the
links over all the devices) and returns what they measured as one flat dict of floats:
tables as one entry per size (`"fresh_s_per_byte@<bytes>"`), NaN where nothing was
measured, so that the processes of a cluster can agree on each figure by its median
(`process_median`) before `calibrate` turns the figures into a `DeviceSpec`. The steps
run in a fixed order, which is part of what they measure: an accelerator's clocks are
woken first, and the convolutions are timed against the matmul curve measured before
them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxwap.calibration import (
    accel_probes,
    conv_probes,
    cpu_probes,
    dispatch_probes,
    link_probes,
    probes,
)
from jaxwap.calibration.host_calls import python_call_seconds
from jaxwap.core.progress import Progress
from jaxwap.hardware.cluster import HOST_KINDS
from jaxwap.hardware.device import DeviceSpec
from jaxwap.hardware.matmul_efficiency import efficiency_table

NAN = float("nan")  # a figure not measured: so is its median over the processes


@dataclass(frozen=True)
class Measured:
    """What one process measured: the flat `figures`, and what is kept whole besides (the
    matmul curves and the all-reduce fit for the record, and the compute-bound load the
    power-limit curve is timed on)."""

    figures: dict[str, float]
    f32: dict[str, Any]
    bf16: dict[str, Any]
    link: dict[str, Any] | None
    compute: Callable[[], Any]


@dataclass(frozen=True)
class _Matmuls:
    """The matmul curves of both dtypes, the device's fast one (`main`, of dtype `fast`),
    and the dense layers' (flops, seconds) timed in it."""

    f32: dict[str, Any]
    bf16: dict[str, Any]
    main: dict[str, Any]
    fast: Any
    dense: list[tuple[float, float]]

    def figures(self, overhead: float) -> dict[str, float]:
        """The peaks, the fallback curve's half-efficiency work (given the kernel launch
        `overhead`) and the dense layers' timings, one figure per size."""
        return {"peak_flops": self.bf16["peak_flops"], "peak_flops_f32": self.f32["peak_flops"],
                "efficiency_half_flops": _half_flops(self.main, overhead),
                "main_peak_flops": self.main["peak_flops"],
                **{f"dense_matmul_s@{w:.0f}": t for w, t in self.dense}}


def measure_figures(dev: Any, devs: Sequence[Any], local: Sequence[Any], base: DeviceSpec,
                    quick: bool, progress: bool, notes: list[str]) -> Measured:
    """Every probe of a calibration, run on `dev` (this process's first device; `local`
    all of its own, `devs` every device the links span, `base` the built-in profile),
    with a progress bar; what could not be measured is NaN and `notes` say why."""
    on_cpu = dev.platform == "cpu"
    procs = len({d.process_index for d in devs})
    sizes, dense_sizes, bw_bytes = probes.sizes_for(on_cpu, quick)
    bar = Progress(2 * len(sizes) + len(dense_sizes) + 6, progress, "jaxwap calibrate")
    if not on_cpu:   # from its idle clock (`accel_probes`)
        accel_probes.warm_up(dev)
    mm = _matmuls(dev, sizes, dense_sizes, bar)
    memory = _memory(dev, on_cpu, quick, procs, bw_bytes, bar)
    launches = _launches(dev, local, bar)
    overhead = launches["kernel_overhead_s"]
    kernels = _kernels(dev, base, on_cpu, quick, mm, overhead, memory["memory_bandwidth"], bar)
    fresh = probes.fresh_memory(dev, probes.fresh_memory_sizes(on_cpu, quick))
    bar.step("fresh memory")
    link, links = _links(devs, on_cpu, quick, bar, notes)
    compute, power = _power(dev, local, sizes[-1], bw_bytes, bar, notes)
    figures = {**mm.figures(overhead), **memory, **launches, **kernels, **links, **power,
               **{f"fresh_s_per_byte@{n}": c for n, c in fresh}}
    return Measured(figures, mm.f32, mm.bf16, link, compute)


def _matmuls(dev: Any, sizes: Sequence[int], dense_sizes: Sequence[int],
             bar: Progress) -> _Matmuls:
    """Both dtypes' matmul curves, and the dense layers in the faster one (bf16 on a GPU;
    f32 on a CPU, whose bf16 is emulated)."""
    f32 = probes.matmul_curve(dev, jnp.float32, sizes, bar)
    bf16 = probes.matmul_curve(dev, jnp.bfloat16, sizes, bar)
    # the device's fast matmul (bf16 on a GPU; f32 on a CPU, whose bf16 is emulated)
    main = bf16 if bf16["peak_flops"] > 1.2 * f32["peak_flops"] else f32
    fast = jnp.bfloat16 if main is bf16 else jnp.float32
    dense = probes.matmul_training(dev, fast, dense_sizes, bar)
    return _Matmuls(f32, bf16, main, fast, dense)


def _half_flops(main: dict[str, Any], overhead: float) -> float:
    """The fallback curve of the fast matmul: a matmul of w flops takes (w + w_half) /
    peak + a launch, so each size gives w_half = peak * (t - launch) - w; the median over
    them, at least a tenth of a microsecond of peak work."""
    half = float(np.median([main["peak_flops"] * (t - overhead) - w for w, t in
                            zip(main["work_flops"], main["seconds"], strict=True)]))
    return max(half, main["peak_flops"] * 1e-7)


def _memory(dev: Any, on_cpu: bool, quick: bool, procs: int, bw_bytes: int,
            bar: Progress) -> dict[str, float]:
    """Memory bandwidth, a layout change's cost by size, and on a CPU cluster how much its
    processes of one host slow each other's memory-side work (`cluster.HostMemory`)."""
    # a CPU cluster's processes of one host share its memory (an accelerator has its own):
    # the bandwidth is each one's alone, not what chance overlap left it
    host = cpu_probes.host_memory(dev, bw_bytes) if on_cpu and procs > 1 else (0, {}, {})
    bandwidth = 2.0 * bw_bytes / host[1]["stream"] if host[0] else (
        probes.bandwidth if on_cpu else accel_probes.stream_bandwidth)(dev, bw_bytes)
    relayout = probes.layout_change(dev, ([256, 2048] if quick else [64, 256, 1024, 2048])
                                    if on_cpu else [4096, 8192, 16384])  # past launches
    bar.step("memory bandwidth")
    return {"memory_bandwidth": bandwidth, "host_devices": host[0] or NAN,
            **{f"host_{k}@{kind}": v for kind in HOST_KINDS for k, v in (
                ("alone_s", host[1].get(kind, NAN)), ("together_s", host[2].get(kind, NAN)),
                ("slowdown", max(host[2][kind] / host[1][kind], 1.0) if host[0] else NAN))},
            **{f"layout_s_per_byte@{n}": c for n, c in relayout}}


def _launches(dev: Any, local: Sequence[Any], bar: Progress) -> dict[str, float]:
    """A kernel launch, the host's call of a step over 1 and all of this process's devices
    (`dispatch_probes.step_call`), and one Python call of a step's pytree work."""
    overhead = probes.kernel_overhead(dev)
    call = dispatch_probes.step_call(local)
    python_call = python_call_seconds()
    bar.step("kernel overhead")
    return {"kernel_overhead_s": overhead, **{f"call_s@{d}": a for d, a, _ in call},
            **{f"call_array_s@{d}": c for d, _, c in call}, "python_call_s": python_call}


def _kernels(dev: Any, base: DeviceSpec, on_cpu: bool, quick: bool, mm: _Matmuls,
             overhead: float, bandwidth: float, bar: Progress) -> dict[str, float]:
    """Convolutions against matmuls of their dtype (and the generic loop a window larger
    than its input takes, by width), a transposed matmul's and pooling's slower paths on a
    CPU, a transcendental function, and reductions by size."""
    # the curve as the model will use it, on this process's own figures, for what is
    # measured against it (convolutions)
    curve = dataclasses.replace(base, matmul_efficiency=efficiency_table(
        mm.dense, mm.main["peak_flops"], overhead))
    # convolutions against matmuls of their dtype: f32 on a CPU; on an accelerator the
    # fast one, at its scale (the CPU's small shapes time a GPU's launches alone)
    peak = mm.f32["peak_flops"] if on_cpu else mm.main["peak_flops"]

    def matmul_s(w: float) -> float:   # a matmul of w flops, its launch excluded
        return w / (peak * float(curve.matmul_eff(w, peak)))

    conv_eff, small_conv, small_by_width = conv_probes.conv_rates(
        dev, lambda w: matmul_s(w) + overhead, quick,
        *(() if on_cpu else (conv_probes.ACCEL_CONV_SHAPES, mm.fast)))
    narrow = conv_probes.narrow_conv_efficiency(
        dev, jnp.float32 if on_cpu else mm.fast, lambda w: matmul_s(w) + overhead,
        conv_probes.CPU_NARROW_CONVS[:1 if quick else None] if on_cpu
        else conv_probes.NARROW_CONVS)
    tiny_s, tiny_flops = conv_probes.tiny_conv(dev)
    transposed = cpu_probes.transposed_matmul_efficiency(dev) if on_cpu else NAN
    pool_tap, pool_grad = cpu_probes.pooling(dev) if on_cpu else (0.0, 0.0)
    # past the cache: an H100's 50 MB L2 holds 4 MiB, whose tanh its launch dominates
    per_tanh = probes.transcendental(dev, 2**20 if on_cpu else 2**26)
    reduce = probes.reduction(dev, [2**12, 2**14, 2**16, 2**18, 2**20, 2**22], bandwidth,
                              overhead)
    bar.step("convolutions")
    # what a tiny convolution takes beyond its work at the convolution rate and a launch
    conv_overhead = max(tiny_s - matmul_s(tiny_flops) / conv_eff - overhead, 0.0)
    return {"conv_efficiency": conv_eff, "narrow_conv_efficiency": narrow,
            "transposed_matmul_efficiency": transposed,
            "window_tap_s": pool_tap, "window_grad_s": pool_grad,
            "conv_overhead_s": conv_overhead,
            # a term only where it is slower than the memory it moves (a CPU's polynomials)
            "transcendental_s": per_tanh if per_tanh > 1.5 * 8 / bandwidth else 0.0,
            "small_input_conv_flops": small_conv,
            **{f"small_conv_flops@{c}": r for c, r in small_by_width.items()},
            **{f"reduce_s_per_byte@{n}": c for n, c in reduce}}


def _links(devs: Sequence[Any], on_cpu: bool, quick: bool, bar: Progress,
           notes: list[str]) -> tuple[dict[str, Any] | None, dict[str, float]]:
    """The all-reduce fit over every device (None with one device) and the figures of the
    links: bandwidth, collectives' cost inside a program, latency per combined buffer."""
    link = link_probes.all_reduce(devs, link_probes.link_sizes(on_cpu, quick),
                                  repeats=5 if quick else 20)
    buffer_latency = link_probes.buffer_latency(devs) if link is not None else NAN
    in_program = link_probes.collective_latency(devs) if link is not None else (NAN,) * 2
    bar.step("all-reduce")
    if link is None:
        notes.append("one device: link bandwidth and latency are the built-in profile's")
    return link, {"link_bandwidth": link["bandwidth_Bps"] if link else NAN,
                  "all_reduce_s": in_program[0], "all_gather_s": in_program[1],
                  "link_buffer_latency_s": buffer_latency}


def _power(dev: Any, local: Sequence[Any], size: int, bw_bytes: int, bar: Progress,
           notes: list[str]) -> tuple[Callable[[], Any], dict[str, float]]:
    """The compute-bound load (of `size` matmuls) and the idle, loaded and memory-bound
    power NVML reads under it (NaN without NVML, with a note)."""
    power = None
    compute, memory = accel_probes.power_loads(dev, size, bw_bytes)
    try:
        power = accel_probes.power(local, compute, memory)
    except Exception as e:  # noqa: BLE001 - power is optional; the profile says so
        notes.append(f"power not measured: {type(e).__name__}: {e}")
    bar.step("power")
    return compute, {"idle_watts": power[0] if power else NAN,
                     "loaded_watts": power[1] if power else NAN,
                     "memory_watts": power[2] if power and power[2] is not None else NAN}


__all__ = ["Measured", "measure_figures"]
