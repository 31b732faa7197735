"""The built-in device profiles, each figure with where it comes from.

A GPU's profile is its datasheet (`datasheets`) times the shares calibrations on real
GPUs measured (`measured_runs`: a matmul reaches 70% of a Hopper's datasheet peak, a
memory copy 84-88% of its bandwidth), carried by `measured_runs.carry`'s rules to the
GPUs no run here measured; the rest are published figures (power, fused attention) and
stated ones (links, the backend's behaviour), each with its reason. `BUILTIN_PROFILES` are
the `DeviceSpec`s by name; `PROVENANCE` says, for every field of each, its source
(`provenance.provenance_table` renders it for the docs, so the table cannot drift from
the profiles). Calibration starts from these and measures what it can
(`jaxwap.calibration.calibrate`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxwap.hardware.datasheets import DATASHEETS, KIND_PATTERNS, Datasheet, FigureSource
from jaxwap.hardware.device import BACKEND_FLAGS, GB, DeviceSpec, GiB
from jaxwap.hardware.measured_runs import MeasuredRun, load_runs
from jaxwap.hardware.measured_runs import carry as carry_runs
from jaxwap.hardware.power_model import A100_SXM, H100_SXM, H200_SXM, V100_IDLE_W, V100_PCIE

# cuDNN's fused attention on an H100 SXM5 (BF16, head dim 128, sequence 8k), published in
# FlashAttention-3 (Shah et al. 2024, arXiv:2407.08608, Figs. 5 and 6): causal forward
# 529 Tflop/s, backward 518. The H200 is the same GPU (the same SMs and clocks): the same
# rates. A profile holds them as shares of its own `peak_flops`.
_FA3 = "FlashAttention-3 (Shah et al. 2024, arXiv:2407.08608), Figs. 5-6: cuDNN on an H100 SXM5"
_ATTENTION_FWD_FLOPS, _ATTENTION_BWD_FLOPS = 529e12, 518e12

_GPU_FLAGS = ("XLA:GPU's behaviour: collectives combined and overlapped with compute, "
              "reductions fused; batched-matmul relayouts and expanded pooling gradients "
              "seen in an H100's trace (benchmarks/results/gpu_trace)")
_HOPPER_IDLE = "published: Hopper SXM idle 78.8 W (stackhpc/ansible-slurm-appliance#975)"


def _gpu(ds: Datasheet, runs: Sequence[MeasuredRun], *, idle: FigureSource, power: Any,
         host_bandwidth: float, network_bandwidth: float, link_latency_s: float,
         attention: bool = False) -> tuple[DeviceSpec, dict[str, FigureSource]]:
    """A GPU's profile from its datasheet, the measured `runs` carried to it, and the
    system figures given, with every field's source."""
    got = carry_runs(ds, runs)
    src: dict[str, FigureSource] = {}

    def sheet(field: str, value: Any) -> None:
        src[field] = FigureSource(value, "datasheet", ds.source)

    for field in ("memory_bytes", "max_watts", "link_bandwidth", "compute_capability"):
        sheet(field, getattr(ds, field))
    for field, share in (("peak_flops", "matmul_share"), ("peak_flops_f32", "f32_share"),
                         ("memory_bandwidth", "bandwidth_share")):
        peak = getattr(ds, field)
        if share in got:
            g = got[share]
            src[field] = FigureSource(peak * g.value, g.kind, f"datasheet {peak:.4g} x "
                                      f"{g.value:.3f}: {g.rule}", (ds.source, *g.sources))
        else:
            sheet(field, peak)
    for field in ("kernel_overhead_s", "matmul_efficiency", "conv_efficiency",
                  "narrow_conv_efficiency", "conv_overhead_s", "python_call_s", "call_cost"):
        if field in got:
            src[field] = got[field]
    src["idle_watts"] = idle
    if power is not None:
        src["power"] = FigureSource(power, "published" if power.source.startswith(
            "published") else "measured", power.source)
    src["host_bandwidth"] = FigureSource(host_bandwidth, "stated", "the host link (PCIe) "
                                         "as a copy to pinned memory reaches it, below its "
                                         "nominal figure")
    src["network_bandwidth"] = FigureSource(network_bandwidth, "stated", "the GPU's share "
                                            "of a DGX-class node's network adapters")
    src["link_latency_s"] = FigureSource(link_latency_s, "stated", "a typical NVLink "
                                         "(or PCIe) hop with NCCL's launch")
    for flag in BACKEND_FLAGS:
        src[flag] = FigureSource(flag != "relayouts_conv_grads", "stated", _GPU_FLAGS)
    src["f32_conv_shares"] = (
        FigureSource(True, "stated", "TF32: float32 convolutions run on the tensor cores "
                     "the convolution shares were measured on") if ds.f32_on_tensor_cores
        else FigureSource(False, "stated", f"no TF32 on {ds.generation}: float32 "
                          "convolutions run on the CUDA cores at the float32 matmul rate; "
                          "the convolution shares are tensor-core ones"))
    if attention:
        peak = src["peak_flops"].value
        for field, rate in (("attention_fwd_efficiency", _ATTENTION_FWD_FLOPS),
                            ("attention_bwd_efficiency", _ATTENTION_BWD_FLOPS)):
            src[field] = FigureSource(rate / peak, "published", f"{rate / 1e12:.0f} "
                                      f"Tflop/s, {_FA3}, as a share of peak_flops")
    values = {f: s.value for f, s in src.items()}
    spec = DeviceSpec(name=ds.name, **values)
    return spec, _complete(spec, src)


# why a field no source above sets holds its default
_DEFAULT_WHY = {
    "efficiency_half_flops": "unused where matmul_efficiency (a measured curve) is set; "
                             "else one microsecond of peak work",
    "collective_overhead_s": "0: the link latency stands for a collective's launch",
    "transposed_matmul_efficiency": "None: a GPU's library runs those matmuls at its rate "
                                    "(a CPU's generic dot does not)",
    "small_input_conv_flops": "None: no generic-loop convolution path (an XLA:CPU one)",
    "small_input_conv_rates": "none: as small_input_conv_flops",
    "transcendental_s": "0: special-function units keep them memory-bound (calibration "
                        "measured about 0 on Hopper)",
    "window_tap_s": "0: pooling memory-bound on a GPU (an XLA:CPU term)",
    "window_grad_s": "0: an XLA:CPU term (a GPU's is expands_pooling_grads)",
    "layout_change_cost": "none: a relayout reads and writes at memory_bandwidth",
    "reduction_cost": "none: reductions fused, at memory_bandwidth (an XLA:CPU term)",
    "fresh_memory_cost": "none: XLA:GPU's pooled allocator maps nothing per step",
    "link_buffer_latency_s": "0: NCCL groups a combined collective's buffers",
    "network_latency_s": "a typical InfiniBand hop with NCCL's launch",
    "python_call_s": "0: not measured",
    "call_cost": "none: not measured",
    "attention_fwd_efficiency": "None: fused attention priced as matmuls (no published "
                                "kernel rate for this GPU)",
    "attention_bwd_efficiency": "None: as attention_fwd_efficiency",
    "kernel_overhead_s": "a typical launch (no measured run)",
    "matmul_efficiency": "none: efficiency_half_flops' curve (no measured run)",
    "conv_efficiency": "1: convolutions at the matmul rate (no measured run)",
    "narrow_conv_efficiency": "None: as any convolution (no measured run)",
    "conv_overhead_s": "0 (no measured run)",
    "compute_capability": "None: not a CUDA device",
    "power": "None: modelled from idle and board power",
    "name": "the profile's name",
}


def _complete(spec: DeviceSpec, src: dict[str, FigureSource]) -> dict[str, FigureSource]:
    """`src` with every other field of `spec` stated as its default, with the reason."""
    out = {"name": FigureSource(spec.name, "stated", _DEFAULT_WHY["name"])}
    for f in dataclasses.fields(DeviceSpec):
        if f.name != "name":
            out[f.name] = src.get(f.name) or FigureSource(
                getattr(spec, f.name), "stated", _DEFAULT_WHY.get(f.name, "default"))
    return out


def _cpu() -> tuple[DeviceSpec, dict[str, FigureSource]]:
    """One host CPU core as an XLA device: AVX2/AVX-512 FMA throughput actually reached by
    XLA's CPU matmuls, a core's share of DRAM bandwidth and of socket power. Simulated CPU
    devices share the host's cores: `detect_cluster` scales this. Typical figures: a CPU
    is always at hand, so `jaxwap calibrate` measures the machine's own."""
    spec = DeviceSpec("cpu", peak_flops=5e10, peak_flops_f32=5e10, memory_bandwidth=1e10,
                      memory_bytes=8 * GiB, idle_watts=3, max_watts=15,
                      kernel_overhead_s=2e-6, efficiency_half_flops=1e6,
                      link_bandwidth=10 * GB, link_latency_s=5e-6, host_bandwidth=1e10,
                      overlaps_collectives=False, combines_collectives=False,
                      relayouts_conv_grads=True, fuses_reductions=False,
                      relayouts_batched_dots=True,
                      network_bandwidth=1.25 * GB, network_latency_s=50e-6)
    why = "a typical server core (jaxwap calibrate measures the machine's own)"
    flags = "XLA:CPU's behaviour, seen in its compiled programs"
    src = {f.name: FigureSource(getattr(spec, f.name), "stated",
                                flags if f.name in BACKEND_FLAGS else why)
           for f in dataclasses.fields(DeviceSpec) if f.name in (
               "peak_flops", "peak_flops_f32", "memory_bandwidth", "memory_bytes",
               "idle_watts", "max_watts", "kernel_overhead_s", "efficiency_half_flops",
               "link_bandwidth", "link_latency_s", "host_bandwidth", "network_bandwidth",
               "network_latency_s", *BACKEND_FLAGS)}
    return spec, _complete(spec, src)


def _published(value: float, why: str) -> FigureSource:
    return FigureSource(value, "published", why)


def build_profiles(runs: Sequence[MeasuredRun]
                   ) -> tuple[dict[str, DeviceSpec], dict[str, dict[str, FigureSource]]]:
    """Every built-in profile from the datasheets and the measured `runs`, and every
    field's source: what `BUILTIN_PROFILES` and `PROVENANCE` hold for the committed runs,
    and what they would hold for others (`jaxwap profiles --runs-file`)."""
    built = (
        _gpu(DATASHEETS["h100-sxm"], runs, idle=_published(79, _HOPPER_IDLE), power=H100_SXM,
             host_bandwidth=50 * GB, network_bandwidth=50 * GB, link_latency_s=3e-6,
             attention=True),
        _gpu(DATASHEETS["h200"], runs, idle=FigureSource(
                 116, "measured", "nvidia-smi's power samples on an H200 here before any "
                 "work (mean)"),
             power=H200_SXM, host_bandwidth=50 * GB, network_bandwidth=50 * GB,
             link_latency_s=3e-6, attention=True),
        *(_gpu(DATASHEETS[name], runs, idle=_published(60, "published: A100 SXM idle "
                                                       "(hardware/power_model.py cites it)"),
               power=A100_SXM, host_bandwidth=25 * GB, network_bandwidth=25 * GB,
               link_latency_s=4e-6) for name in ("a100-sxm-80gb", "a100-sxm-40gb")),
        _gpu(DATASHEETS["v100-sxm2"], runs, idle=FigureSource(
                 40, "stated", "a V100 SXM2 allocated and waiting (typical)"),
             power=None, host_bandwidth=12 * GB, network_bandwidth=12.5 * GB,
             link_latency_s=5e-6),
        # the 250 W PCIe card (no NVLink: its peers over PCIe 3.0), the V100 the published
        # power trace `benchmarks/gpu/power.py` checks against ran on
        _gpu(DATASHEETS["v100-pcie"], runs, idle=_published(
                 V100_IDLE_W, "published: the Zeus trace's V100 PCIe (power_model.py)"),
             power=V100_PCIE, host_bandwidth=12 * GB, network_bandwidth=12.5 * GB,
             link_latency_s=10e-6),
        _cpu(),
    )
    return ({spec.name: spec for spec, _ in built},
            {spec.name: src for spec, src in built})


#: the built-in profiles by name, and every field of each with its source, from the
#: committed measured runs (`measured_runs.RUNS_FILE`)
BUILTIN_PROFILES, PROVENANCE = build_profiles(load_runs())


def device_spec(name: str | DeviceSpec) -> DeviceSpec:
    """A built-in profile by name (or the spec itself)."""
    if isinstance(name, DeviceSpec):
        return name
    key = str(name).lower()
    if key not in BUILTIN_PROFILES:
        raise ValueError(f"unknown device profile {name!r}; built-ins are "
                         f"{sorted(BUILTIN_PROFILES)} (or pass a jaxwap.DeviceSpec)")
    return BUILTIN_PROFILES[key]


def builtin_device_names() -> tuple[str, ...]:
    """The names `device_spec` accepts, sorted (what the CLI and error messages list)."""
    return tuple(sorted(BUILTIN_PROFILES))


__all__ = ["BUILTIN_PROFILES", "KIND_PATTERNS", "PROVENANCE", "build_profiles",
           "builtin_device_names", "device_spec"]
