"""Calibration: measure the device profile on the devices present.

Datasheet peaks flatter every device. `calibrate()` times what the cost model's
parameters stand for, on the real device: matmuls of several sizes and dtypes (peak
flop/s and the efficiency curve: a matmul of w flops takes (w + w_half) / peak), a large
elementwise op (memory bandwidth), a chain of tiny matmuls (per-kernel overhead), an
all-reduce of two sizes across the devices (link bandwidth and latency), and, where NVML
answers, idle and loaded power. The result is cached per device kind, driver and jax
version, and `hardware=None` planning uses it when it exists.

Every figure is measured on the device named; what could not be measured (power without
NVML, links with one device) keeps the built-in profile's value and says so in the notes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .compile import make_mesh
from .dirs import default_cache_dir
from .hardware import DeviceSpec, builtin_for_kind
from .progress import Progress

CALIBRATION_FORMAT = 1


@dataclass(frozen=True)
class Calibration:
    """A calibrated profile, what it was measured on, and what was not measured."""

    spec: DeviceSpec
    device_kind: str
    platform: str
    num_devices: int
    jax_version: str
    driver: str
    measurements: dict[str, Any]
    notes: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["spec"] = self.spec.to_dict()
        d["notes"] = list(self.notes)
        d["format"] = CALIBRATION_FORMAT
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        if d.get("format") != CALIBRATION_FORMAT:
            raise ValueError("stale calibration format")
        return cls(DeviceSpec.from_dict(d["spec"]), d["device_kind"], d["platform"],
                   d["num_devices"], d["jax_version"], d["driver"], d["measurements"],
                   tuple(d["notes"]))


# --------------------------------------------------------------------------- storage
@functools.lru_cache(maxsize=1)
def _driver_version() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else str(v)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML: the driver is not part of the key
        return "none"


def calibration_path(device: Any, directory: Path | None = None) -> Path:
    """Where the calibration of this device kind, driver and jax version is kept."""
    base = Path(directory) if directory is not None else default_cache_dir()
    kind = "".join(c if c.isalnum() else "-" for c in device.device_kind.lower())
    name = f"{device.platform}-{kind}-jax{jax.__version__}-driver{_driver_version()}.json"
    return base / "calibration" / name


def load_calibration(device: Any, directory: Path | None = None) -> Calibration | None:
    """The cached calibration for this device kind, or None (a bad file counts as none)."""
    path = calibration_path(device, directory)
    try:
        return Calibration.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _save(cal: Calibration, path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cal.to_dict(), indent=1))
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache must not lose the measurement
        import warnings

        warnings.warn(f"could not save the calibration to {path}: {e}", stacklevel=3)


# --------------------------------------------------------------------------- timing
def _time(fn: Callable[[], Any], repeats: int = 5) -> float:
    """Median seconds of fn() after one warm-up call (fn must block until done)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _fit_line(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Least-squares slope and intercept (intercept clipped at 0)."""
    slope, intercept = np.polyfit(np.asarray(x, float), np.asarray(y, float), 1)
    return float(slope), float(max(intercept, 0.0))


# --------------------------------------------------------------------------- measurements
def _matmul_curve(device: Any, dtype: Any, sizes: Sequence[int],
                  progress: Progress) -> dict[str, Any]:
    """Seconds per n x n x n matmul: slope = 1 / peak, intercept = w_half / peak + launch."""
    works, times = [], []
    for n in sizes:
        a = jax.device_put(jnp.ones((n, n), dtype), device)
        f = jax.jit(lambda x: x @ x)
        t = _time(lambda f=f, a=a: f(a).block_until_ready())
        works.append(2.0 * n ** 3)
        times.append(t)
        progress.step(f"matmul {np.dtype(dtype).name} {n}")
    slope, intercept = _fit_line(works, times)
    best = max(w / t for w, t in zip(works, times, strict=True))
    return {"sizes": list(sizes), "work_flops": works, "seconds": times,
            "peak_flops": 1.0 / slope if slope > 0 else best, "intercept_s": intercept}


def _bandwidth(device: Any, nbytes: int) -> float:
    """Bytes/s of an elementwise op that reads and writes nbytes each."""
    x = jax.device_put(jnp.ones((nbytes // 4,), jnp.float32), device)
    f = jax.jit(lambda v: v * 1.0001 + 1.0)
    t = _time(lambda: f(x).block_until_ready())
    return 2.0 * nbytes / t


def _kernel_overhead(device: Any, chain: int = 64) -> float:
    """Seconds per extra kernel: a chain of tiny dependent matmuls that cannot fuse."""
    x = jax.device_put(jnp.ones((8, 8), jnp.float32), device)

    def chained(k: int) -> Callable[[Any], Any]:
        def f(v: Any) -> Any:
            for _ in range(k):
                v = jnp.tanh(v @ v)
            return v
        return jax.jit(f)

    f1, fk = chained(1), chained(chain)
    t1 = _time(lambda: f1(x).block_until_ready(), 9)
    tk = _time(lambda: fk(x).block_until_ready(), 9)
    return max((tk - t1) / (chain - 1), 1e-7)


def _all_reduce(devices: Sequence[Any], sizes: Sequence[int]) -> tuple[float, float] | None:
    """(link bandwidth B/s, latency s) from timed all-reduces of two sizes, ring model."""
    n = len(devices)
    if n < 2:
        return None
    mesh = make_mesh(n, 1, devices)
    ts = []
    for nbytes in sizes:
        per = max(nbytes // 4, 1)
        x = jax.device_put(jnp.ones((n, per), jnp.float32), NamedSharding(mesh, P("data")))
        f = jax.jit(lambda v: v.sum(0), out_shardings=NamedSharding(mesh, P()))
        ts.append(_time(lambda f=f, x=x: f(x).block_until_ready()))
    # t = 2(n-1)/n * B / bw + 2(n-1) * lat
    xs = [2 * (n - 1) / n * s for s in sizes]
    slope, intercept = _fit_line(xs, ts)
    bw = 1.0 / slope if slope > 0 else xs[-1] / ts[-1]
    return bw, intercept / (2 * (n - 1))


def _power(devices: Sequence[Any], load: Callable[[], Any]) -> tuple[float, float, str] | None:
    """(idle W, loaded W) per device from NVML, or None without it."""
    from .energy import EnergyMeter, measure_energy

    with EnergyMeter(devices) as meter:
        time.sleep(0.5)
    idle = meter.reading
    if idle is None or idle.source == "modeled":
        return None
    loaded, _ = measure_energy(load, devices, min_window_s=1.0)
    n = len(devices)
    return idle.avg_power_w / n, loaded.avg_power_w / n, loaded.source


def calibrate(devices: Sequence[Any] | None = None, *, progress: bool = True,
              quick: bool = False, directory: Path | None = None,
              use_cache: bool = True) -> DeviceSpec:
    """Measure the profile of the devices present (all of one kind) and cache it.

    `quick` uses smaller sizes (seconds on a CPU). Returns the calibrated `DeviceSpec`;
    `load_calibration(device)` gives the full record with the raw measurements."""
    return calibrate_full(devices, progress=progress, quick=quick, directory=directory,
                          use_cache=use_cache).spec


def calibrate_full(devices: Sequence[Any] | None = None, *, progress: bool = True,
                   quick: bool = False, directory: Path | None = None,
                   use_cache: bool = True) -> Calibration:
    devs = tuple(devices) if devices is not None else tuple(jax.local_devices())
    if not devs:
        raise ValueError("calibrate: no devices")
    kinds = {d.device_kind for d in devs}
    if len(kinds) != 1:
        raise ValueError(f"calibrate: devices of several kinds {sorted(kinds)}")
    dev = devs[0]
    path = calibration_path(dev, directory)
    if use_cache:
        cached = load_calibration(dev, directory)
        if cached is not None and cached.num_devices == len(devs):
            return cached
    on_cpu = dev.platform == "cpu"
    sizes = [128, 256, 512] if (quick or on_cpu) else [1024, 2048, 4096, 8192]
    if quick and not on_cpu:
        sizes = [512, 1024, 2048]
    bw_bytes = (16 if on_cpu or quick else 512) * 2**20
    steps = 2 * len(sizes) + 4
    bar = Progress(steps, progress, "jaxwap calibrate")
    notes: list[str] = []
    base = builtin_for_kind(dev.device_kind, dev.platform)
    f32 = _matmul_curve(dev, jnp.float32, sizes, bar)
    bf16 = _matmul_curve(dev, jnp.bfloat16, sizes, bar)
    bandwidth = _bandwidth(dev, bw_bytes)
    bar.step("memory bandwidth")
    overhead = _kernel_overhead(dev)
    bar.step("kernel overhead")
    link = _all_reduce(devs, [2**12, 2**22 if not (on_cpu or quick) else 2**18])
    bar.step("all-reduce")
    if link is None:
        notes.append("one device: link bandwidth and latency are the built-in profile's")
    power = None
    try:
        power = _power(devs, lambda: jax.block_until_ready(
            jax.jit(lambda x: x @ x)(jax.device_put(jnp.ones((sizes[-1],) * 2), dev))))
    except Exception as e:  # noqa: BLE001 - power is optional; the profile says so
        notes.append(f"power not measured: {type(e).__name__}: {e}")
    bar.step("power")
    if power is None:
        notes.append("power not measured (no NVML for these devices): idle and max watts "
                     "are the built-in profile's")
    peak16 = bf16["peak_flops"]
    # intercept = w_half / peak + launch overhead
    half = max((bf16["intercept_s"] - overhead) * peak16, peak16 * 1e-7)
    spec = dataclasses.replace(
        base, name=f"calibrated {dev.device_kind}", peak_flops=peak16,
        peak_flops_f32=f32["peak_flops"], memory_bandwidth=bandwidth,
        kernel_overhead_s=overhead, efficiency_half_flops=half,
        idle_watts=power[0] if power else base.idle_watts,
        max_watts=max(power[1], power[0]) if power else base.max_watts,
        link_bandwidth=link[0] if link else base.link_bandwidth,
        link_latency_s=link[1] if link else base.link_latency_s)
    cal = Calibration(spec, dev.device_kind, dev.platform, len(devs), jax.__version__,
                      _driver_version(),
                      {"matmul_f32": f32, "matmul_bf16": bf16, "bandwidth_Bps": bandwidth,
                       "kernel_overhead_s": overhead,
                       "link": list(link) if link else None,
                       "power_w": list(power) if power else None},
                      tuple(notes))
    _save(cal, path)
    return cal


def main(argv: Sequence[str] | None = None) -> int:
    """`jaxwap calibrate [--quick]`: measure, cache and print the profile."""
    import argparse

    p = argparse.ArgumentParser(prog="jaxwap", description="jaxwap command line")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("calibrate", help="measure the device profile and cache it")
    c.add_argument("--quick", action="store_true", help="smaller sizes (seconds)")
    c.add_argument("--fresh", action="store_true", help="ignore a cached calibration")
    args = p.parse_args(argv)
    cal = calibrate_full(quick=args.quick, use_cache=not args.fresh)
    s = cal.spec
    print(f"{s.name}: {s.peak_flops / 1e12:.3g} Tflop/s bf16, "
          f"{(s.peak_flops_f32 or 0) / 1e12:.3g} Tflop/s f32, "
          f"{s.memory_bandwidth / 1e9:.3g} GB/s, kernel {s.kernel_overhead_s * 1e6:.1f} us, "
          f"half-efficiency at {s.efficiency_half_flops or 0:.3g} flop, links "
          f"{s.link_bandwidth / 1e9:.3g} GB/s / {s.link_latency_s * 1e6:.1f} us, "
          f"{s.idle_watts:.0f}-{s.max_watts:.0f} W (measured on {cal.num_devices} x "
          f"{cal.device_kind})")
    for n in cal.notes:
        print("note:", n)
    print("saved:", calibration_path(jax.local_devices()[0]))
    return 0
