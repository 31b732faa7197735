"""What calibrations on real GPUs measured, as shares of their datasheets, and the rules
that carry those shares to GPUs nobody here has measured.

A calibration (`jaxwap calibrate`) measures a device's achieved matmul rates, memory
bandwidth, kernel launch, convolution shares and host call costs. Divided by the device's
datasheet (`datasheets`), the rates become shares that say something about every GPU of
the generation: the share of the dense peak a matmul reaches is set by the SM and its
clocks under load, not by the die's size. Each run's shares are one `MeasuredRun`; the
runs are kept in `measured_runs.json` beside this module (committed, so a user planning
for an A100 gets what a lent H100 measured without a GPU of their own), and a new run is
added with `jaxwap profiles --add RECORD` or `jaxwap calibrate --contribute`.

`carry` is the rule a built-in profile reads its figures with, per figure:
  - compute figures (matmul shares and their curve by size, kernel launch, convolution
    shares and set-up): the median over the runs of the same generation (one SM design);
    else over the runs of the nearest measured generation, carried as shares of the
    target's own datasheet;
  - memory bandwidth share: the runs of the same GPU (its memory type), else of the same
    generation, else of the nearest;
  - host figures (the host's call of a step, per array, per Python call): the median of
    every run that measured them; they are the host CPU's, not the GPU's;
  - the matmul shares of a GPU whose generation no run here measured are its published
    dense-GEMM microbenchmark's where one is in reach (`datasheets.PUBLISHED_GEMM`): a
    Hopper's 0.70 is its clocks under a full tensor-core load at its power limit, which
    says little of another generation's; the curve by size is still carried (relative to
    that rate);
  - a GPU without TF32 (Volta) runs float32 matmuls on its CUDA cores, which no run here
    measured: it takes its 16-bit share (both are the share of a datasheet peak its
    clocks under load allow).
Medians, so one odd run (the two H200 runs' convolution shares: 0.57 and 0.91) moves a
figure less than a mean would.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxwap.hardware.datasheets import (
    DATASHEETS,
    GENERATIONS,
    PUBLISHED_GEMM,
    Datasheet,
    FigureSource,
    profile_for_kind,
)
from jaxwap.hardware.matmul_efficiency import efficiency_at

#: the committed file of measured runs the built-in profiles read
RUNS_FILE = Path(__file__).with_name("measured_runs.json")
RUNS_FORMAT = 1

#: figures set by the SM design, pooled over a generation's runs
COMPUTE = ("matmul_share", "f32_share", "kernel_overhead_s", "matmul_efficiency",
           "conv_efficiency", "narrow_conv_efficiency", "conv_overhead_s")
#: figures set by the GPU's memory, pooled over its own runs first
MEMORY = ("bandwidth_share",)
#: figures set by the host, pooled over every run that has them
HOST = ("python_call_s", "call_cost")


@dataclass(frozen=True)
class MeasuredRun:
    """One calibration on one GPU, as shares of its datasheet.

    Attributes:
      profile: the built-in profile of the GPU measured ("h200").
      device_kind: jax's name of it ("NVIDIA H200").
      source: where the calibration is recorded (a path in this repository, or the file
        `jaxwap calibrate` wrote).
      date_utc, jax_version, driver: when and with what it was measured.
      matmul_share: achieved 16-bit matmul rate / datasheet 16-bit peak.
      f32_share: achieved float32 (default precision) matmul rate / datasheet f32 peak.
      bandwidth_share: achieved memory bandwidth / datasheet bandwidth.
      kernel_overhead_s: one kernel's launch inside a program, seconds.
      matmul_efficiency: the share of the achieved rate by size (`DeviceSpec.matmul_efficiency`).
      conv_efficiency, narrow_conv_efficiency: convolutions' shares of the matmul rate.
      conv_overhead_s: a convolution's set-up beyond a launch, seconds.
      python_call_s, call_cost: the host's cost of a step's call (None: not measured).
    """

    profile: str
    device_kind: str
    source: str
    date_utc: str
    jax_version: str
    driver: str
    matmul_share: float
    f32_share: float
    bandwidth_share: float
    kernel_overhead_s: float
    matmul_efficiency: tuple[tuple[float, float], ...]
    conv_efficiency: float
    narrow_conv_efficiency: float | None
    conv_overhead_s: float
    python_call_s: float | None = None
    call_cost: tuple[tuple[int, float, float], ...] | None = None

    @property
    def generation(self) -> str:
        return DATASHEETS[self.profile].generation

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["matmul_efficiency"] = [list(p) for p in self.matmul_efficiency]
        d["call_cost"] = None if self.call_cost is None else [list(r) for r in self.call_cost]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MeasuredRun:
        d = dict(d)
        d["matmul_efficiency"] = tuple(tuple(p) for p in d["matmul_efficiency"])
        if d.get("call_cost") is not None:
            d["call_cost"] = tuple((int(n), float(a), float(c)) for n, a, c in d["call_cost"])
        return cls(**d)


def run_from_calibration(record: dict[str, Any], source: str,
                         date_utc: str = "") -> MeasuredRun:
    """A `MeasuredRun` from a calibration's dict (`Calibration.to_dict`, or the
    "calibration" of a `benchmarks/gpu/gpu_sweep.py` record). Raises ValueError naming the
    device kind when it is no GPU with a datasheet here."""
    kind = record["device_kind"]
    name = profile_for_kind(kind)
    if name not in DATASHEETS:
        raise ValueError(f"device kind {kind!r} (platform {record.get('platform')!r}) has no "
                         f"GPU datasheet here ({sorted(DATASHEETS)}): its calibration cannot "
                         f"be turned into shares of one")
    ds, s = DATASHEETS[name], record["spec"]
    call = s.get("call_cost")
    return MeasuredRun(
        profile=name, device_kind=kind, source=source, date_utc=date_utc,
        jax_version=str(record.get("jax_version", "")), driver=str(record.get("driver", "")),
        matmul_share=s["peak_flops"] / ds.peak_flops,
        f32_share=s["peak_flops_f32"] / ds.peak_flops_f32,
        bandwidth_share=s["memory_bandwidth"] / ds.memory_bandwidth,
        kernel_overhead_s=s["kernel_overhead_s"],
        matmul_efficiency=tuple(tuple(p) for p in s["matmul_efficiency"]),
        conv_efficiency=s["conv_efficiency"],
        narrow_conv_efficiency=s.get("narrow_conv_efficiency"),
        conv_overhead_s=s.get("conv_overhead_s", 0.0),
        python_call_s=s.get("python_call_s") or None,
        call_cost=tuple((int(n), float(a), float(c)) for n, a, c in call) if call else None)


def load_runs(path: Path = RUNS_FILE) -> tuple[MeasuredRun, ...]:
    """The measured runs in `path` (none when it does not exist)."""
    if not path.exists():
        return ()
    d = json.loads(path.read_text())
    if d.get("format") != RUNS_FORMAT:
        raise ValueError(f"{path}: measured-runs format {d.get('format')!r}, this jaxwap "
                         f"reads {RUNS_FORMAT}; regenerate it with `jaxwap profiles --add`")
    return tuple(MeasuredRun.from_dict(r) for r in d["runs"])


def save_runs(runs: Iterable[MeasuredRun], path: Path = RUNS_FILE) -> None:
    """Write `runs` to `path` (one per source, sorted), as `load_runs` reads them."""
    by_source = {r.source: r for r in runs}
    doc = {"format": RUNS_FORMAT,
           "about": "calibrations on real GPUs as shares of their datasheets "
                    "(jaxwap/hardware/measured_runs.py); add one with `jaxwap profiles "
                    "--add RECORD` or `jaxwap calibrate --contribute`",
           "runs": [by_source[k].to_dict() for k in sorted(by_source)]}
    path.write_text(json.dumps(doc, indent=1) + "\n")


def _median_curve(curves: Sequence[tuple[tuple[float, float], ...]]
                  ) -> tuple[tuple[float, float], ...]:
    """The pointwise median of efficiency curves, at the times of the first (each read
    with `efficiency_at`, as the cost model reads it)."""
    times = np.asarray([t for t, _ in curves[0]], float)
    values = np.median([efficiency_at(c, times) for c in curves], axis=0)
    return tuple((float(t), float(v)) for t, v in zip(times, values, strict=True))


def _median(values: list[Any]) -> Any:
    if isinstance(values[0], tuple):
        if values[0] and len(values[0][0]) == 2:
            return _median_curve(values)
        return values[len(values) // 2]          # call-cost tables: the middle run's
    return float(statistics.median(values))


def _nearest(generation: str, measured: set[str]) -> str | None:
    """The measured generation nearest to `generation` in `GENERATIONS` (newer first on
    a tie: the measured runs here are newer than the GPUs they are carried to)."""
    at = GENERATIONS.index(generation)
    return min(measured, key=lambda g: (abs(GENERATIONS.index(g) - at),
                                        GENERATIONS.index(g)), default=None)


def carry(ds: Datasheet, runs: Sequence[MeasuredRun]) -> dict[str, FigureSource]:
    """Each measured figure for the GPU of datasheet `ds`, by the module's rules (figures
    no run has are left out)."""
    out: dict[str, FigureSource] = {}
    gens = {r.generation for r in runs}
    near = ds.generation if ds.generation in gens else _nearest(ds.generation, gens)

    def pick(field: str, pool: list[MeasuredRun], why: str) -> None:
        pool = [r for r in pool if getattr(r, field) is not None]
        if not pool:
            return
        own = any(r.profile == ds.name for r in pool)
        out[field] = FigureSource(_median([getattr(r, field) for r in pool]),
                                  "measured" if own else "carried",
                                  f"median of {len(pool)} run(s) {why}",
                                  tuple(sorted(r.source for r in pool)))

    if near is None:
        return out
    same = [r for r in runs if r.generation == near]
    across = "" if near == ds.generation else f", carried from {near} to {ds.generation}"
    for field in COMPUTE:
        pick(field, same, f"on {near} GPUs ({', '.join(sorted({r.profile for r in same}))})"
             + across)
    own = [r for r in runs if r.profile == ds.name]
    pick("bandwidth_share", own or same, "on this GPU" if own else
         f"on {near} GPUs (their memory stands for this one's){across}")
    for field in HOST:
        pick(field, list(runs), "on the hosts of every measured GPU (a host's figure)")
    if ds.name in PUBLISHED_GEMM and near != ds.generation:
        bf16, f32, source = PUBLISHED_GEMM[ds.name]
        for field, share in (("matmul_share", bf16), ("f32_share", f32)):
            out[field] = FigureSource(share, "published", "a published dense-GEMM "
                                      f"microbenchmark of this GPU: {source}", ())
    if not ds.f32_on_tensor_cores and "matmul_share" in out:
        m = out["matmul_share"]
        out["f32_share"] = FigureSource(m.value, "carried", m.rule + "; no TF32 on "
                                        f"{ds.generation}: float32 matmuls run on CUDA "
                                        "cores, unmeasured here, at the 16-bit share",
                                        m.sources)
    return out


__all__ = ["COMPUTE", "HOST", "MEMORY", "RUNS_FILE", "MeasuredRun", "carry",
           "load_runs", "run_from_calibration", "save_runs"]
