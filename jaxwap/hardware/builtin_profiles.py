"""The built-in device profiles: datasheet figures for the accelerators jaxwap knows.

A table of `DeviceSpec`s by name (`device_spec`), and the jax `device_kind` substrings
that pick one for the devices present (`KIND_PATTERNS`, read by
`cluster.builtin_for_kind`). Kept apart from the record so that the record's module says
what a profile is and this one what each known device's profile holds; calibration
starts from these and measures what it can (`jaxwap.calibration.calibrate`).
"""

from __future__ import annotations

from jaxwap.hardware.device import GB, DeviceSpec, GiB
from jaxwap.hardware.power_model import A100_SXM, H100_SXM, H200_SXM, V100_IDLE_W, V100_PCIE

# cuDNN's fused attention on an H100 SXM5 (BF16, head dim 128, sequence 8k), published in
# FlashAttention-3 (Shah et al. 2024, arXiv:2407.08608, Figs. 5 and 6): causal forward
# 529 Tflop/s, backward 518, of the 989 dense peak. The H200 is the same GPU (the same
# peak) with more memory bandwidth: its kernels are priced at the same shares.
_ATTENTION_FWD, _ATTENTION_BWD = 529 / 989, 518 / 989

BUILTIN_PROFILES: dict[str, DeviceSpec] = {
    spec.name: spec
    for spec in (
        DeviceSpec("h100-sxm", peak_flops=989e12, peak_flops_f32=494e12,
                   memory_bandwidth=3.35e12, memory_bytes=80 * GB, idle_watts=79,
                   max_watts=700, kernel_overhead_s=4e-6, efficiency_half_flops=1e9,
                   link_bandwidth=450 * GB, link_latency_s=3e-6,
                   host_bandwidth=50 * GB, network_bandwidth=50 * GB, power=H100_SXM,
                   relayouts_batched_dots=True, expands_pooling_grads=True,
                   compute_capability="9.0", attention_fwd_efficiency=_ATTENTION_FWD,
                   attention_bwd_efficiency=_ATTENTION_BWD),
        # datasheet peaks; the convolutions' shares of the matmul rate as `jaxwap calibrate`
        # measured them on one H200 here (benchmarks/results/gpu_sweep/nvidia-h200_run1.json): 0.57
        # for 3x3 layers at a training batch, 0.029 over 3 input channels (first layers);
        # idle: nvidia-smi's power samples there before any work, 116 W on average
        DeviceSpec("h200", peak_flops=989e12, peak_flops_f32=494e12,
                   memory_bandwidth=4.8e12, memory_bytes=141 * GB, idle_watts=116,
                   max_watts=700, kernel_overhead_s=4e-6, efficiency_half_flops=1e9,
                   conv_efficiency=0.57, narrow_conv_efficiency=0.029,
                   link_bandwidth=450 * GB, link_latency_s=3e-6,
                   host_bandwidth=50 * GB, network_bandwidth=50 * GB, power=H200_SXM,
                   relayouts_batched_dots=True, expands_pooling_grads=True,
                   compute_capability="9.0", attention_fwd_efficiency=_ATTENTION_FWD,
                   attention_bwd_efficiency=_ATTENTION_BWD),
        DeviceSpec("a100-sxm-80gb", peak_flops=312e12, peak_flops_f32=156e12,
                   memory_bandwidth=2.039e12, memory_bytes=80 * GB, idle_watts=60,
                   max_watts=400, kernel_overhead_s=5e-6, efficiency_half_flops=4e8,
                   link_bandwidth=300 * GB, link_latency_s=4e-6,
                   host_bandwidth=25 * GB, power=A100_SXM,
                   relayouts_batched_dots=True, expands_pooling_grads=True,
                   compute_capability="8.0"),
        DeviceSpec("a100-sxm-40gb", peak_flops=312e12, peak_flops_f32=156e12,
                   memory_bandwidth=1.555e12, memory_bytes=40 * GB, idle_watts=60,
                   max_watts=400, kernel_overhead_s=5e-6, efficiency_half_flops=4e8,
                   link_bandwidth=300 * GB, link_latency_s=4e-6,
                   host_bandwidth=25 * GB, power=A100_SXM,
                   relayouts_batched_dots=True, expands_pooling_grads=True,
                   compute_capability="8.0"),
        DeviceSpec("v100-sxm2", peak_flops=125e12, peak_flops_f32=15.7e12,
                   memory_bandwidth=0.9e12, memory_bytes=32 * GB, idle_watts=40,
                   max_watts=300, kernel_overhead_s=6e-6, efficiency_half_flops=2e8,
                   link_bandwidth=150 * GB, link_latency_s=5e-6,
                   host_bandwidth=12 * GB, network_bandwidth=12.5 * GB,
                   relayouts_batched_dots=True, expands_pooling_grads=True,
                   compute_capability="7.0"),
        # the 250 W PCIe card (no NVLink: its peers over PCIe 3.0), the V100 the published
        # power trace `benchmarks/gpu/power.py` checks against ran on
        DeviceSpec("v100-pcie", peak_flops=112e12, peak_flops_f32=14e12,
                   memory_bandwidth=0.9e12, memory_bytes=32 * GB, idle_watts=V100_IDLE_W,
                   max_watts=250, kernel_overhead_s=6e-6, efficiency_half_flops=2e8,
                   link_bandwidth=12 * GB, link_latency_s=10e-6,
                   host_bandwidth=12 * GB, network_bandwidth=12.5 * GB, power=V100_PCIE,
                   relayouts_batched_dots=True, expands_pooling_grads=True,
                   compute_capability="7.0"),
        # One host CPU core as an XLA device: AVX2/AVX-512 FMA throughput actually
        # reached by XLA's CPU matmuls, a core's share of DRAM bandwidth and of socket power.
        # Simulated CPU devices share the host's cores: `detect_cluster` scales this.
        DeviceSpec("cpu", peak_flops=5e10, peak_flops_f32=5e10, memory_bandwidth=1e10,
                   memory_bytes=8 * GiB, idle_watts=3, max_watts=15,
                   kernel_overhead_s=2e-6, efficiency_half_flops=1e6,
                   link_bandwidth=10 * GB, link_latency_s=5e-6, host_bandwidth=1e10,
                   overlaps_collectives=False, combines_collectives=False,
                   relayouts_conv_grads=True, fuses_reductions=False,
                   relayouts_batched_dots=True,
                   network_bandwidth=1.25 * GB, network_latency_s=50e-6),
    )
}

# jax `device_kind` substrings -> built-in profile, most specific first.
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


__all__ = ["BUILTIN_PROFILES", "KIND_PATTERNS", "builtin_device_names", "device_spec"]
