"""What NVIDIA's datasheets say of the GPUs jaxwap knows: the figures a built-in profile
starts from before the measured shares are applied (`measured_runs`, `builtin_profiles`).

A datasheet peak is what no program reaches: a dense matmul on a Hopper GPU here ran at
70% of it (its clocks drop under a full tensor-core load at the 700 W board limit), a
memory copy at 83-88% of the bandwidth. So a built-in profile is the datasheet figure
times the share measured on a GPU of the same or another generation, and the record of
which is which stays here and in `measured_runs`, apart from the profiles that combine
them. Also the jax `device_kind` substrings that name each GPU (`KIND_PATTERNS`), which
both the profiles and the measured runs read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GB = 1e9

#: where a built-in profile's figure comes from (`FigureSource.kind`)
SOURCE_KINDS = ("datasheet", "measured", "carried", "published", "stated")


@dataclass(frozen=True)
class FigureSource:
    """A built-in profile's figure and where it comes from.

    Attributes:
      value: the figure as the profile holds it.
      kind: "datasheet" (the vendor's document), "measured" (a calibration here on this
        GPU), "carried" (measured here on another GPU, brought over by a stated rule),
        "published" (a measurement someone else published) or "stated" (a value chosen
        for a stated reason: a backend's behaviour, a typical figure, an unused one).
      rule: which document, runs or reason, in words.
      sources: the files or documents the figure is read from.
    """

    value: Any
    kind: str
    rule: str
    sources: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in SOURCE_KINDS:
            raise ValueError(f"FigureSource kind must be one of {SOURCE_KINDS}, "
                             f"got {self.kind!r}")

#: architecture generations, newest first: the order in which a figure measured on one is
#: carried to another (`measured_runs.carry`)
GENERATIONS = ("hopper", "ampere", "volta")


@dataclass(frozen=True)
class Datasheet:
    """One GPU as its datasheet gives it (dense figures, no sparsity).

    Attributes:
      name: the built-in profile's name.
      generation: "hopper", "ampere" or "volta": the SM design, which decides what a
        figure measured on another GPU says about this one.
      compute_capability: CUDA's, as jax's cuDNN checks ask for it.
      peak_flops: dense 16-bit tensor-core peak (BF16 on Ampere and later, FP16 on Volta).
      peak_flops_f32: the rate jax's default float32 matmul runs at: TF32 tensor cores on
        Ampere and later (XLA's default precision uses them), the CUDA cores' FP32 on
        Volta, which has no TF32.
      f32_on_tensor_cores: whether `peak_flops_f32` is a tensor-core (TF32) figure.
      memory_bandwidth, memory_bytes: HBM bandwidth (bytes/s) and capacity (bytes).
      max_watts: the board's default power limit.
      link_bandwidth: NVLink per direction (half the datasheet's bidirectional figure).
      source: the document the figures are from.
    """

    name: str
    generation: str
    compute_capability: str
    peak_flops: float
    peak_flops_f32: float
    f32_on_tensor_cores: bool
    memory_bandwidth: float
    memory_bytes: float
    max_watts: float
    link_bandwidth: float
    source: str

    def __post_init__(self) -> None:
        if self.generation not in GENERATIONS:
            raise ValueError(f"Datasheet {self.name!r}: generation must be one of "
                             f"{GENERATIONS}, got {self.generation!r}")


_H100 = "NVIDIA H100 Tensor Core GPU datasheet (SXM5)"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet (SXM)"
_A100 = "NVIDIA A100 Tensor Core GPU datasheet (SXM4)"
_V100 = "NVIDIA Tesla V100 GPU datasheet"

DATASHEETS: dict[str, Datasheet] = {d.name: d for d in (
    Datasheet("h100-sxm", "hopper", "9.0", 989e12, 494e12, True, 3.35e12, 80 * GB, 700,
              450 * GB, _H100),
    # the same GH100 die as the H100, with HBM3e: more and faster memory
    Datasheet("h200", "hopper", "9.0", 989e12, 494e12, True, 4.8e12, 141 * GB, 700,
              450 * GB, _H200),
    Datasheet("a100-sxm-80gb", "ampere", "8.0", 312e12, 156e12, True, 2.039e12, 80 * GB,
              400, 300 * GB, _A100),
    Datasheet("a100-sxm-40gb", "ampere", "8.0", 312e12, 156e12, True, 1.555e12, 40 * GB,
              400, 300 * GB, _A100),
    Datasheet("v100-sxm2", "volta", "7.0", 125e12, 15.7e12, False, 0.9e12, 32 * GB, 300,
              150 * GB, _V100 + " (SXM2 32 GB)"),
    # the PCIe card has no NVLink: its link_bandwidth is the profile's PCIe figure
    Datasheet("v100-pcie", "volta", "7.0", 112e12, 14e12, False, 0.9e12, 32 * GB, 250,
              12 * GB, _V100 + " (PCIe 32 GB)"),
)}

#: published dense-GEMM microbenchmarks: profile -> (16-bit share of the datasheet peak,
#: float32 (TF32) share, source). Where a GPU's generation has no run measured here, these
#: say more about its matmul rate than a share carried from another generation: Hopper's
#: 0.70 is its clocks under a full tensor-core load at the 700 W limit, which an A100
#: (83% at 338 W of its 400) does not reach (`measured_runs.carry`).
_FLAGPERF = ("FlagPerf base/benchmarks/computation-{}/nvidia/A100/README.md, 8-GPU average "
             "(github.com/FlagOpen/FlagPerf 1b5a030)")
PUBLISHED_GEMM: dict[str, tuple[float, float, str]] = {
    name: (0.831, 0.793, _FLAGPERF.format("BF16") + " (A100-40GB SXM); "
           + _FLAGPERF.format("TF32") + " (A800-80GB SXM, an A100)")
    for name in ("a100-sxm-80gb", "a100-sxm-40gb")}

#: jax `device_kind` substrings -> built-in profile, most specific first.
KIND_PATTERNS: tuple[tuple[str, str], ...] = (
    ("h200", "h200"),
    ("h100", "h100-sxm"),
    ("a100-sxm4-80gb", "a100-sxm-80gb"),
    ("a100 80gb", "a100-sxm-80gb"),
    ("a100", "a100-sxm-40gb"),
    ("v100-pcie", "v100-pcie"),
    ("v100", "v100-sxm2"),
    ("cpu", "cpu"),
)


def profile_for_kind(kind: str) -> str | None:
    """The built-in profile a jax `device_kind` names, None when no pattern matches."""
    low = kind.lower()
    return next((prof for pat, prof in KIND_PATTERNS if pat in low), None)


__all__ = ["DATASHEETS", "GENERATIONS", "KIND_PATTERNS", "PUBLISHED_GEMM", "SOURCE_KINDS",
           "Datasheet",
           "FigureSource", "profile_for_kind"]
