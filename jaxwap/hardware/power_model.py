"""Power that follows what a step does, and what a power limit does to it.

A device does not draw its board power whenever it is busy. Tensor-core work at full rate
draws the most, memory-bound work (elementwise ops, normalisations, optimizer updates)
markedly less, a device waiting on a collective or launching kernels little more than
idle. `PowerProfile` gives the power of each phase; `step_energy` weighs them by the
time the cost model gives each phase.

A power limit is the second energy knob (Zeus, NSDI'23): the GPU's firmware lowers the
SM clock until the board draws no more than the limit. Compute-bound time stretches as
the clock falls; memory-bound time barely moves (the memory clock is not lowered), so a
cap costs a memory-bound step almost nothing while it saves on a compute-bound one.
`clock_curve` says what sustained clock a compute-bound load keeps under each limit; a
load that draws less than that reference is slowed as if the limit were proportionally
higher (its dynamic power has more headroom under the same cap).

Every figure here is per device. Nothing imports the rest of jaxwap: the hardware
profiles hold a `PowerProfile`, the cost model calls `step_energy`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

# Dynamic power ~ C V^2 f, and over the DVFS range the voltage rises with the clock:
# power above the busy floor grows about as the clock's cube. Used where no measured curve
# exists.
DVFS_EXPONENT = 3.0
# Below this share of the default clock the voltage stays at its floor and dynamic power
# falls only linearly with the clock: a deep cap costs more clock than the cube law says.
# Fitted to the one published cap-versus-GEMM figure (a GB300 at a 500 W cap of 1400 W kept
# 0.28-0.39 of its throughput; 0.35 here with idle 150 W); checked against the Zeus V100
# trace in `benchmarks/gpu/power.py`.
VOLTAGE_KNEE = 0.75
# No sustained clock below this share of the default (the lowest DVFS states).
MIN_CLOCK_FRACTION = 0.2


@dataclass(frozen=True)
class PowerProfile:
    """What one device draws in each phase of a step, and the limits it accepts.

    Attributes:
      matmul_watts: drawn while compute-bound kernels run at the device's full rate; a
        compute-bound phase at a lower achieved rate (small matmuls) draws idle plus that
        share of the dynamic part.
      memory_watts: drawn while memory-bound kernels stream at full bandwidth.
      comm_watts: drawn while the device launches kernels, waits on or runs collectives
        and host transfers.
      limit_range_w: (min, max) power limits the device accepts; None: it cannot be capped
        (a CPU, or a GPU whose range is unknown).
      default_limit_w: the board's default limit (None: the range's max).
      clock_curve: (limit W, sustained clock as a share of the clock at the default
        limit) for a compute-bound load drawing `matmul_watts` uncapped, by rising limit;
        empty: the DVFS model (`DVFS_EXPONENT`).
      source: where the figures come from ("published: ...", "measured: ...", "modelled").
    """

    matmul_watts: float
    memory_watts: float
    comm_watts: float
    limit_range_w: tuple[float, float] | None = None
    default_limit_w: float | None = None
    clock_curve: tuple[tuple[float, float], ...] = ()
    source: str = "modelled"

    def __post_init__(self) -> None:
        for name in ("matmul_watts", "memory_watts", "comm_watts"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and np.isfinite(v) and v > 0):
                raise ValueError(f"PowerProfile {name} must be a finite number > 0, got {v!r}")
        if self.limit_range_w is not None:
            lo, hi = (float(x) for x in self.limit_range_w)
            if not 0 < lo <= hi:
                raise ValueError(f"PowerProfile limit_range_w must be (min, max) with "
                                 f"0 < min <= max, got {self.limit_range_w!r}")
            object.__setattr__(self, "limit_range_w", (lo, hi))
        curve = tuple((float(w), float(c)) for w, c in self.clock_curve)
        if any(not 0 < c <= 1 for _, c in curve) or any(
                b[0] <= a[0] or b[1] < a[1] for a, b in zip(curve, curve[1:], strict=False)):
            raise ValueError("PowerProfile clock_curve must be (limit W, clock share in "
                             "(0, 1]) points with rising limits and non-falling clocks, got "
                             f"{self.clock_curve!r}")
        object.__setattr__(self, "clock_curve", curve)

    @property
    def default_w(self) -> float | None:
        """The limit the board runs at unless told otherwise."""
        if self.default_limit_w is not None:
            return float(self.default_limit_w)
        return self.limit_range_w[1] if self.limit_range_w is not None else None

    def check_limit(self, limit: float, device: str = "device") -> float:
        """`limit` as a float, or a ValueError naming the device and its accepted range."""
        if self.limit_range_w is None:
            raise ValueError(f"{device} accepts no power limit (its profile has no "
                             f"limit range)")
        lo, hi = self.limit_range_w
        if not (isinstance(limit, (int, float)) and lo <= float(limit) <= hi):
            raise ValueError(f"power limit {limit!r} W is outside {device}'s accepted range "
                             f"{lo:g}-{hi:g} W")
        return float(limit)

    def limits(self, count: int = 10) -> tuple[float, ...]:
        """The caps worth planning with: `count` limits evenly from the accepted minimum
        up to (not including) the default, rounded to 5 W; () for a device that cannot be
        capped."""
        default = self.default_w
        if self.limit_range_w is None or default is None:
            return ()
        lo = self.limit_range_w[0]
        if default <= lo:
            return ()
        got = {float(5 * round(w / 5)) for w in np.linspace(lo, default, count + 1)[:-1]}
        return tuple(sorted(w for w in got if lo <= w < default))

    def clock_at(self, limit: float | None, load_watts: float, idle_watts: float) -> float:
        """The sustained clock share of a load that draws `load_watts` at the default
        limit, under `limit` (None: the default).

        What the clock can trade is the power above the busy floor, the waiting power
        (`comm_watts`: the device in its working state, its memory clocked up), not idle:
        a capped device is busy. Without a measured curve the dynamic power above that
        floor follows the clock's cube down to `VOLTAGE_KNEE`, then falls linearly.
        Checked against published traces (`benchmarks/gpu/power.py`): a V100 PCIe training
        ResNet-50 kept 0.52-0.58 of its throughput at 100 of 250 W (0.46-0.50 here; the
        cube law over idle said 0.68-0.70), and 0.85-0.95 at 150-200 W (within 1.2%)."""
        if limit is None or load_watts <= limit:
            return 1.0
        floor = min(max(idle_watts, self.comm_watts), self.matmul_watts)
        dyn_ref = max(self.matmul_watts - floor, 1e-9)
        dyn = max(load_watts - floor, 1e-9)
        # the reference load under the limit this load's headroom amounts to
        ref_limit = floor + max(limit - floor, 0.0) * dyn_ref / dyn
        if self.clock_curve:
            w = [p[0] for p in self.clock_curve]
            c = [p[1] for p in self.clock_curve]
            if ref_limit >= self.matmul_watts and ref_limit >= w[-1]:
                return 1.0
            got = float(np.interp(ref_limit, w + [max(self.matmul_watts, w[-1] + 1.0)],
                                  c + [1.0]))
        else:
            got = dvfs_clock(max(ref_limit - floor, 0.0) / dyn_ref)
        return float(min(1.0, max(got, MIN_CLOCK_FRACTION)))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: tuples as lists, as they come back from a file."""
        d = asdict(self)
        if self.limit_range_w is not None:
            d["limit_range_w"] = list(self.limit_range_w)
        d["clock_curve"] = [list(p) for p in self.clock_curve]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PowerProfile:
        d = dict(d)
        if d.get("limit_range_w") is not None:
            d["limit_range_w"] = tuple(d["limit_range_w"])
        d["clock_curve"] = tuple(tuple(p) for p in d.get("clock_curve", ()))
        return cls(**d)


def dvfs_clock(power_share: float) -> float:
    """The clock share that keeps a compute-bound load's dynamic power at `power_share` of
    its uncapped dynamic power: the cube law (`DVFS_EXPONENT`) above the voltage floor's
    knee, linear below it (the voltage no longer falls with the clock)."""
    p = max(power_share, 0.0)
    at_knee = VOLTAGE_KNEE ** DVFS_EXPONENT
    if p >= at_knee:
        return p ** (1.0 / DVFS_EXPONENT)
    return p * VOLTAGE_KNEE / at_knee


def borrowed(ref: PowerProfile, ref_idle_watts: float, idle_watts: float,
             max_watts: float) -> tuple[float, float]:
    """(memory-bound, waiting) watts of a device with this idle and top power whose
    phases split its dynamic range as `ref`'s do (`dynamic_shares`): how a profile known
    only in part is completed."""
    memory, comm = dynamic_shares(ref, ref_idle_watts)
    dyn = max_watts - idle_watts
    return idle_watts + memory * dyn, idle_watts + comm * dyn


def dynamic_shares(ref: PowerProfile, idle_watts: float) -> tuple[float, float]:
    """`ref`'s memory-bound and waiting power as shares of its dynamic range (from
    `idle_watts` up to `matmul_watts`): how a profile known only in part borrows them."""
    dyn = max(ref.matmul_watts - idle_watts, 1e-9)
    return (ref.memory_watts - idle_watts) / dyn, (ref.comm_watts - idle_watts) / dyn


@functools.lru_cache(maxsize=64)   # assemble asks for it per prediction
def default_profile(idle_watts: float, max_watts: float) -> PowerProfile:
    """A device with only idle and board power known: the phases split its dynamic range
    as the built-in A100 profile's do, and it cannot be capped. The A100's memory-bound
    power is a direct measurement of that phase (an HBM stream test); the Hopper figure
    is the top of an LLM decode's range."""
    memory, comm = borrowed(A100_SXM, A100_IDLE_W, idle_watts, max_watts)
    return PowerProfile(
        matmul_watts=max_watts, memory_watts=memory, comm_watts=comm,
        source="modelled: idle and board power only, phases split as the A100 profile's")


@dataclass(frozen=True)
class PhaseTimes:
    """Seconds per device a step spends in each phase the power model tells apart.

    `bound_work` is the compute-bound phase's work at the device's full rate (seconds), at
    most `bound`: their ratio is how hard the compute units are driven."""

    bound: float      # compute-bound kernels (roofline: flops dominate)
    bound_work: float
    memory: float     # memory-bound kernels
    side: float       # launches, collectives, host transfers
    idle: float       # a pipeline's bubble (waiting, as the side phase)


@dataclass(frozen=True)
class StepEnergy:
    """One device's step under a power limit: the seconds the limit adds (the phases it
    slows), the joules drawn, and the compute-bound phase's sustained clock share."""

    extra_time_s: float
    energy_j: float
    clock: float


def step_energy(profile: PowerProfile, idle_watts: float, phases: PhaseTimes,
                limit: float | None = None) -> StepEnergy:
    """Per device: the energy of a step's phases at their powers. Under `limit` the
    compute-bound phase runs at the clock the limit allows and draws at most the limit;
    a memory-bound phase that would draw more than the limit is slowed until it does not
    (its energy unchanged: a cap saves nothing there, it only costs time); launches,
    communication and a pipeline's bubble draw the waiting power (the device is in its
    working state with the job's memory allocated, not idle)."""
    cap = float("inf") if limit is None else float(limit)
    activity = min(1.0, phases.bound_work / phases.bound) if phases.bound > 0 else 0.0
    bound_w = idle_watts + (profile.matmul_watts - idle_watts) * activity
    clock = profile.clock_at(limit, bound_w, idle_watts)
    bound_t = phases.bound / clock
    memory_t = phases.memory * max(1.0, profile.memory_watts / cap)
    energy = (min(bound_w, cap) * bound_t + profile.memory_watts * phases.memory
              + min(profile.comm_watts, cap) * (phases.side + phases.idle))
    return StepEnergy(bound_t - phases.bound + memory_t - phases.memory, energy, clock)


def curve_from_points(points: Sequence[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """A measured (limit, clock share) list made a valid `clock_curve`: sorted by limit,
    clock shares clipped to (0, 1] and made non-falling (measurement noise)."""
    out: list[tuple[float, float]] = []
    for w, c in sorted((float(w), float(c)) for w, c in points):
        c = min(1.0, max(c, 1e-3))
        if out and w == out[-1][0]:
            continue
        out.append((w, max(c, out[-1][1]) if out else c))
    return tuple(out)


# ---------------------------------------------------------------------- built-in profiles
# Published figures, not measured here (`jaxwap calibrate` measures them where NVML is).
# - Limits accepted: `nvidia-smi -q` of a 700 W Hopper SXM part, "Min Power Limit 200.00 W,
#   Max Power Limit 700.00 W, Default 700.00 W" (github.com/stackhpc/ansible-slurm-
#   appliance/pull/975); A100-SXM4-80GB and -40GB, "Min 100.00 W, Max 400.00 W, Default
#   400.00 W" (github.com/NVIDIA/DCGM/issues/152, github.com/NVIDIA/nvidia-docker/issues/1648).
# - Idle: the same Hopper part idle at 78.8 W (stackhpc #975); A100-80GB idle 59-62 W
#   between runs (github.com/chuyishang/inference-energy, results_paste.md).
# - Waiting in a job (launch gaps, collectives): an H100 80GB HBM3 at P0 with 72 GB
#   allocated and 0-4% utilisation draws 140-145 W (github.com/wilicc/gpu-burn/issues/114).
# - Memory-bound: LLM decode, which streams HBM at full bandwidth, draws 137-300 W on a
#   700 W H200 (Ma et al., "The Illusion of Power Capping in LLM Decode", arXiv
#   2605.11999): its top, 300 W, for the H100 and H200.
# - Compute-bound: Hopper matmuls are power limited at the 700 W default (H. He,
#   "Strangely, matrix multiplications on GPUs run faster when given predictable data";
#   a GEMM's clock falls from 1980 to 1575 MHz when it reaches the limit,
#   github.com/deepseek-ai/DeepGEMM/issues/120): they draw the limit.
# - Memory-bound on an A100: FlagPerf's HBM bandwidth test on a DGX A100 (A100-40GB SXM,
#   400 W), 1328 GB/s (85% of its bandwidth), draws 239.3 W per GPU, the average of the
#   8 (github.com/FlagOpen/FlagPerf, base/benchmarks/main_memory-bandwidth/nvidia/A100/
#   README.md, commit 1b5a030); the same page set measures GEMMs (BF16 338.4 W at 83% of
#   peak, TF32 383.5 W at 79%), which `benchmarks/gpu/power.py` sets the model against.
# - V100 PCIe: the Zeus trace (You et al., NSDI'23; github.com/ml-energy/zeus, examples/
#   research_reproducibility/zeus_nsdi23/trace/summary_power_v100.csv) sets limits from
#   100 to 250 W on its V100 (below the SXM2's 150 W minimum: a 250 W PCIe card), and its
#   least loaded job (NCF) averages 34.8 W, which bounds the idle power from above; its
#   ResNet-50 and BERT figures are checks (`benchmarks/gpu/power.py`), not inputs.
# - Not found in reach: a published table of clock or throughput at each limit for the
#   H100, H200 or A100 (Ujeniya et al., arXiv 2604.11391, and Mayr et al., arXiv
#   2603.16164, measured such curves; only their abstracts could be read), and an A100's
#   waiting power. So the clock curve is the DVFS model (`DVFS_EXPONENT`), and the A100's
#   waiting power takes the H100's share of the dynamic range; `source` says so.
#   `benchmarks/gpu/power.py` sets the DVFS model against the published cap-versus-throughput
#   figures found (a GB300 GEMM, the V100's ResNet-50).
H100_IDLE_W = 79.0
HOPPER_SOURCE = ("published: limits, idle, waiting and memory-bound power (hardware/power_model.py "
                 "cites each); clock under a limit modelled (DVFS)")
H100_SXM = PowerProfile(matmul_watts=700.0, memory_watts=300.0, comm_watts=145.0,
                        limit_range_w=(200.0, 700.0), default_limit_w=700.0,
                        source=HOPPER_SOURCE)
# - H200 (measured here, not published): `jaxwap calibrate` on one H200 SXM lent to this
#   project (benchmarks/results/gpu_sweep/nvidia-h200_traced.json, 2026-11-26; limits left alone):
#   chained bf16 matmuls on random data draw 690 W at the 700 W default limit, elementwise
#   passes streaming HBM 535 W, idle after work 121 W (nvidia-smi: 116 W on average over
#   2.4 s before any work, 80-130 W); training steps there drew 531-698 W. The waiting
#   power keeps the H100's share of the dynamic range (no probe isolates it);
#   `nvidia-smi -q` there: limits 200-700 W.
H200_SXM = PowerProfile(matmul_watts=690.0, memory_watts=535.0,
                        comm_watts=round(borrowed(H100_SXM, H100_IDLE_W, 116.0, 690.0)[1]),
                        limit_range_w=(200.0, 700.0), default_limit_w=700.0,
                        source="measured on an H200 here by jaxwap calibrate (phases); "
                               "waiting power as the H100's share (modelled); clock under "
                               "a limit modelled (DVFS)")
A100_IDLE_W = 60.0
A100_SXM = PowerProfile(
    matmul_watts=400.0, memory_watts=239.0,
    comm_watts=round(borrowed(H100_SXM, H100_IDLE_W, A100_IDLE_W, 400.0)[1]),
    limit_range_w=(100.0, 400.0), default_limit_w=400.0,
    source="published: limits, idle and memory-bound power (power_model.py cites each); "
           "waiting power as the H100's share (modelled); clock under a limit modelled "
           "(DVFS)")
V100_IDLE_W = 35.0
V100_PCIE = PowerProfile(
    250.0, *(round(w) for w in borrowed(A100_SXM, A100_IDLE_W, V100_IDLE_W, 250.0)),
    limit_range_w=(100.0, 250.0), default_limit_w=250.0,
    source="published: limits and idle (Zeus NSDI'23 trace); memory-bound and waiting "
           "power as the A100's shares (modelled); clock under a limit modelled (DVFS)")

__all__ = ["A100_SXM", "DVFS_EXPONENT", "H100_SXM", "H200_SXM", "V100_PCIE", "PhaseTimes",
           "PowerProfile", "StepEnergy", "VOLTAGE_KNEE", "borrowed", "curve_from_points",
           "default_profile", "dvfs_clock", "dynamic_shares", "step_energy"]
