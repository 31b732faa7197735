"""One accelerator's profile: what the cost model knows about a device.

How fast one accelerator computes and moves memory, how much memory it has and power it
draws, what a kernel launch costs, and the slow paths a backend takes (generic-loop
convolutions, memory the host allocator maps afresh each step). Built-ins are datasheet
numbers (dense, no sparsity) except `efficiency_half_flops` and `kernel_overhead_s`,
typical values until calibration measures them. `cluster.Cluster` joins N by links.

This module holds the record, its checks and the tables it reads; the built-in profiles
are in `builtin_profiles`, the matmul efficiency curve's arithmetic in `matmul_efficiency`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxwap.hardware.matmul_efficiency import efficiency_at
from jaxwap.hardware.power_model import PowerProfile, default_profile

GB = 1e9
GiB = 2**30


# fields of a DeviceSpec that must be > 0 and >= 0 where given
_POSITIVE = ("peak_flops_f32", "efficiency_half_flops", "link_bandwidth", "host_bandwidth",
             "conv_efficiency", "narrow_conv_efficiency", "transposed_matmul_efficiency",
             "small_input_conv_flops", "network_bandwidth", "attention_fwd_efficiency",
             "attention_bwd_efficiency")
_NON_NEGATIVE = ("kernel_overhead_s", "python_call_s", "link_latency_s",
                 "link_buffer_latency_s", "collective_overhead_s", "conv_overhead_s",
                 "transcendental_s", "window_tap_s", "window_grad_s", "network_latency_s")
# the (size, value) tables of a DeviceSpec
_TABLES = ("small_input_conv_rates", "fresh_memory_cost", "layout_change_cost",
           "matmul_efficiency", "reduction_cost")


def _per_byte(table: tuple[tuple[float, float], ...], nbytes: Any) -> Any:
    """A (bytes, seconds per byte) table at `nbytes` (a number or an array): interpolated
    in log size, held at the ends; 0 for an empty table or no bytes."""
    n = np.asarray(nbytes, float)
    if not table:
        return np.zeros_like(n) if n.ndim else 0.0
    sizes, per_byte = zip(*table, strict=True)
    got = np.where(n > 0, np.interp(np.log(np.maximum(n, 1e-30)), np.log(sizes), per_byte), 0.0)
    return got if n.ndim else float(got)


# DeviceSpec fields that say what the backend does, not what was measured: a calibration
# takes them from the backend's built-in profile (records made before one existed too)
BACKEND_FLAGS = ("combines_collectives", "overlaps_collectives", "relayouts_conv_grads",
                 "fuses_reductions", "relayouts_batched_dots", "expands_pooling_grads",
                 "f32_conv_shares")


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator as the cost model sees it.

    Attributes:
      name: profile name ("h100-sxm", ...).
      peak_flops: dense 16-bit (bf16/fp16) matmul peak, flop/s.
      memory_bandwidth: main-memory bandwidth, bytes/s.
      memory_bytes: usable memory per device, bytes.
      idle_watts: power drawn when allocated but idle.
      max_watts: power at full load (board limit).
      kernel_overhead_s: fixed cost of one kernel launch; it is what makes many tiny
        kernels slow whatever the device count.
      peak_flops_f32: float32 matmul peak (TF32 tensor cores where XLA uses them by
        default); defaults to peak_flops / 2.
      efficiency_half_flops: per-kernel work (flops) at which a matmul reaches half the
        peak; efficiency = w / (w + this), so a matmul costs (w + this) / peak: small
        ones cannot fill the device, which is why splitting small work stops paying.
        Defaults to one microsecond of peak work. Used where `matmul_efficiency` is empty.
      matmul_efficiency: measured (seconds at the peak rate, efficiency) pairs: the share of
        the peak a matmul whose work takes that long at the peak reaches, timed on the
        matmuls a dense layer's training step runs (forward, input and weight gradients,
        token-major). Interpolated in log time; past the longest measured it holds, and
        below the shortest it follows `t / (t + h)` through the shortest point (a fixed
        cost h, as `efficiency_half_flops` models it). Keyed on time, not
        flops, so a device with a share of a host's peak keeps its curve. Calibration
        measures it; the built-ins have none and use `efficiency_half_flops`.
      link_bandwidth: default per-direction bandwidth of the device's peer link, bytes/s.
      link_latency_s: default per-hop latency of that link.
      collective_overhead_s: what each collective costs beyond its ring steps' latency
        (a backend's rendezvous and launch): a collective over n devices takes this plus
        its steps' latency plus its bytes over the bandwidth. Calibrated from an
        all-reduce's and an all-gather's cost inside a program, the two unknowns of
        their two ring formulas (on this project's 2-process gloo cluster about 1.3 ms
        with 1.3 ms a step); 0 in the built-ins, whose link latency stands for it.
      host_bandwidth: per-direction bandwidth between the device and pinned host memory,
        bytes/s (PCIe for a GPU, effective rather than the link's nominal figure): what
        keeping optimizer state in host memory costs per step.
      conv_efficiency: the share of the matmul rate convolutions reach (library
        convolutions such as cuDNN's come close to 1; XLA:CPU's do not): calibrated.
      narrow_conv_efficiency: the share of the matmul rate a convolution over fewer than 8
        input channels reaches (`op_work.conv_kind` 3: a CNN's first layer), where it is far
        below `conv_efficiency` (cuDNN on an H200 here: AlexNet's 11x11 first layer at
        about 17 Tflop/s forward, 44 its kernel gradient; XLA:CPU here ResNet-50-small's
        7x7 stem at 21 and 44 Gflop/s on a core whose matmuls reach 108); None: as any
        convolution. Calibrated (`conv_probes.narrow_conv_efficiency`).
      transposed_matmul_efficiency: the share of its matmul rate a matmul contracting
        both operands over a dim that is not their last reaches (`op_work.transposed_matmul`:
        a dense layer's kernel gradient), where the backend runs those on a slower path
        (XLA:CPU's generic dot, not its matmul library); None: as any matmul. Calibrated
        on a CPU.
      small_input_conv_flops: flop/s of a convolution whose window is larger than its
        input (a 3x3 kernel over a 2x2 map), which XLA:CPU computes with a generic loop
        far below its library's rate; None: the backend has no such path.
      conv_overhead_s: fixed seconds each convolution costs beyond a kernel launch (a
        library's set-up per call: about 15 us on XLA:CPU, measured on this project's
        2-core VM). Calibrated.
      reduction_cost: measured ((bytes, seconds per byte), ...) of a reduction moving that
        many bytes, its launch apart: a CPU splits a mid-sized reduction over its thread
        pool, which costs more than it saves (a 64 KiB one: about 20-40 us on two cores
        of this project's VM, 10 on one). Interpolated in log size; the op takes at least
        this. Calibrated; the built-ins have none.
      transcendental_s: seconds per element of an op that evaluates a transcendental
        function (exp, tanh, erf, ...: `op_work.TRANSCENDENTAL`), its memory traffic
        included: the op's time is at least its elements times this. A CPU computes them
        as polynomials, several times slower than its memory (about 1 ns per element on
        this project's 2-core VM); a GPU's special-function units keep them memory-bound,
        so the built-ins have 0 (no term). Calibrated, from tanh.
      window_tap_s: seconds per window tap of a pooling op (a max pool,
        `op_work.window_taps`); it takes at least its taps times this. Calibrated on a CPU;
        0 elsewhere (no term).
      window_grad_s: seconds per element of a pooling gradient's result (select-and-
        scatter, the un-pooled map): XLA:CPU computes it as a reduce-window over the values
        and four index arrays of that map, then a scatter into it, a cost that follows the
        map's size more than the window's (2x2 and 3x3 windows at stride 2: 3.2-10 and
        4.3-10 ns per element here). ResNet-50-small's one max pool's gradient took 0.7 ms
        of a 5.6 ms step on one core, priced at nothing before. Calibrated on a CPU; 0
        elsewhere (no term).
      layout_change_cost: ((array bytes, seconds per byte), ...) that moving an array
        into another layout adds (a physical transpose XLA's layout assignment inserts,
        `xla_figures.layout_changes`): XLA:CPU's loop fusions read one side across rows, about as
        fast as a plain loop for arrays in cache and 50x slower past it. Interpolated in
        log size and held at the ends. Empty: read and written at `memory_bandwidth`.
        Calibrated.
      small_input_conv_rates: ((input features, flop/s), ...) of that generic loop
        measured at several widths: its rate depends on the width (XLA:CPU's 512-wide
        rows alias in cache and run 3x slower than 384-wide ones), so a convolution takes
        the rate of the nearest measured width (log scale). Empty: one rate for all.
      fresh_memory_cost: ((bytes, seconds per byte), ...) that the step's scratch memory
        costs because the host allocator maps it afresh each step (glibc maps blocks of
        32 MiB and more anew, and the OS faults each page in on first touch); XLA:GPU's
        pooled allocator pays nothing. Interpolated in log size between the measured
        sizes and held at the ends. Empty: free. Calibrated.
      link_buffer_latency_s: latency a combined collective pays for each buffer it
        carries. NCCL groups the buffers of XLA's combined all-reduce (0); XLA:CPU's gloo
        collectives reduce each buffer apart, at about a round trip each. Calibrated.
      call_cost: ((devices, seconds, seconds per array), ...): jax's call of a step over
        that many of a process's devices with n arrays in and out takes seconds + n x per
        array, linear in devices between rows. Calibrated; the built-ins have none.
      python_call_s: seconds per Python function call of a call's work on the step's
        pytrees (`pytree_cost`: counted per step, `Graph.tree_calls`). Calibrated; 0: none.
      combines_collectives: whether the backend combines a step's all-gathers and makes a
        reduce-scatter of an all-reduce each device slices (XLA:GPU's collective passes;
        the sharded layouts' textbook prices, unverified on a GPU). XLA:CPU does neither:
        each all-gather is a collective of its own and a sharded gradient is all-reduced
        whole, and the FSDP and ZeRO-1 prices follow its compiled programs.
      overlaps_collectives: whether the backend runs gradient collectives concurrently
        with the backward pass (XLA:GPU's asynchronous collectives); XLA:CPU runs its
        collectives in line, so none of their time hides.
      relayouts_conv_grads: whether the backend copies a kernel-gradient convolution's
        activations and output gradient into another layout before it
        (`grad_reductions.conv_grad_relayouts`), each copy priced as a layout change
        (`layout_change_s`). XLA:CPU does; cuDNN reads them as they are.
      relayouts_batched_dots: whether the backend copies a batched matmul's operands into
        a layout with the batch dims leading, and materializes a transpose next to one
        (`grad_reductions.dot_relayouts`: attention's heads), each copy priced as a layout
        change. XLA:CPU does, and XLA:GPU: in an H100's trace of GPT-2's step (jax
        0.11.2) 48 copy and transpose kernels made batched-matmul operands, 0.81 ms a
        step, priced 0.80 ms with this (benchmarks/results/gpu_trace_nvidia-h100-80gb-
        hbm3.md); the GPU built-ins set it.
      expands_pooling_grads: whether the backend runs a max pool's gradient (select-and-
        scatter) as an argmax reduce-window and a scatter (XLA:GPU), moving its indices and
        a zeroed result besides its operands (`op_work.expanded_pool_grad`); XLA:CPU runs
        it in one loop (`window_grad_s`). The GPU built-ins set it.
      fuses_reductions: whether the backend computes a reduction inside the fusion of the
        elementwise ops that make its input (XLA:GPU), so that it costs what that fusion
        reads. XLA:CPU runs reductions as library kernels of their own (YNNPACK), each
        walking all it reduces: `reduction_cost` is then priced at that input's bytes.
      network_bandwidth: default per-direction bandwidth from one device to another node
        (its share of the node's network adapters), bytes/s: a `Cluster` of several nodes
        takes it unless given `inter_node_bandwidth`.
      network_latency_s: default latency of one step between nodes.
      power: what the device draws in each phase of a step and the power limits it
        accepts (`power_model`); None: modelled from idle and board power, no limits.
      compute_capability: the CUDA compute capability of an NVIDIA GPU ("9.0"), None for
        another device: what jax's cuDNN checks ask of the target when planning traces on
        a host without that GPU (`fused_attention.target_checks`).
      attention_fwd_efficiency, attention_bwd_efficiency: the share of `peak_flops`
        cuDNN's fused attention kernels reach, forward and backward (their flops counted
        as FlashAttention counts them: a causal kernel's half of the scores,
        `fused_attention.fused_flops`); None: priced as a matmul of their flops. The built-ins'
        are published figures (H100 SXM5, BF16, head dim 128, sequence 8k, cuDNN as
        benchmarked in FlashAttention-3, Shah et al. 2024, arXiv:2407.08608, Figs. 5-6:
        causal forward 529 Tflop/s, backward 518, of 989).
      f32_conv_shares: whether `conv_efficiency` and `narrow_conv_efficiency` also price
        float32 convolutions. They are shares of a tensor-core matmul rate (a first layer's
        3 input channels fill a sliver of a tensor-core tile), which float32 runs on where
        it runs as TF32 (Ampere and later) and on a CPU's one rate. False on a GPU without
        TF32 (Volta): its float32 convolutions run on the CUDA cores at the float32 matmul
        rate, with no tile to waste.
    """

    name: str
    peak_flops: float
    memory_bandwidth: float
    memory_bytes: float
    idle_watts: float
    max_watts: float
    kernel_overhead_s: float = 5e-6
    peak_flops_f32: float | None = None
    efficiency_half_flops: float | None = None
    link_bandwidth: float = 25 * GB
    link_latency_s: float = 10e-6
    host_bandwidth: float = 25 * GB
    collective_overhead_s: float = 0.0
    conv_efficiency: float = 1.0
    narrow_conv_efficiency: float | None = None
    transposed_matmul_efficiency: float | None = None
    small_input_conv_flops: float | None = None
    small_input_conv_rates: tuple[tuple[int, float], ...] = ()
    conv_overhead_s: float = 0.0
    transcendental_s: float = 0.0
    window_tap_s: float = 0.0
    window_grad_s: float = 0.0
    layout_change_cost: tuple[tuple[float, float], ...] = ()
    matmul_efficiency: tuple[tuple[float, float], ...] = ()
    reduction_cost: tuple[tuple[float, float], ...] = ()
    fresh_memory_cost: tuple[tuple[float, float], ...] = ()
    link_buffer_latency_s: float = 0.0
    call_cost: tuple[tuple[int, float, float], ...] = ()
    python_call_s: float = 0.0
    combines_collectives: bool = True
    overlaps_collectives: bool = True
    relayouts_conv_grads: bool = False
    relayouts_batched_dots: bool = False
    expands_pooling_grads: bool = False
    fuses_reductions: bool = True
    network_bandwidth: float = 25 * GB
    network_latency_s: float = 10e-6
    power: PowerProfile | None = None
    compute_capability: str | None = None
    attention_fwd_efficiency: float | None = None
    attention_bwd_efficiency: float | None = None
    f32_conv_shares: bool = True

    def __post_init__(self) -> None:
        for field in ("peak_flops", "memory_bandwidth", "memory_bytes", "max_watts"):
            if not getattr(self, field) > 0:
                raise ValueError(f"DeviceSpec {self.name!r}: {field} must be > 0, "
                                 f"got {getattr(self, field)!r}")
        for field in (*_POSITIVE, *_NON_NEGATIVE):
            v, strict = getattr(self, field), field in _POSITIVE
            if v is not None and not (v > 0 if strict else v >= 0):
                raise ValueError(f"DeviceSpec {self.name!r}: {field} must be "
                                 f"{'>' if strict else '>='} 0, got {v!r}")
        for field in _TABLES:
            pairs = tuple((type(a)(a), float(b)) for a, b in getattr(self, field))
            if any(not (a > 0 and b >= 0) for a, b in pairs):
                raise ValueError(f"DeviceSpec {self.name!r}: {field} must be (size > 0, "
                                 f"value >= 0) pairs, got {getattr(self, field)!r}")
            object.__setattr__(self, field, tuple(sorted(pairs)))
        call = tuple(sorted((int(d), float(a), float(c)) for d, a, c in self.call_cost))
        if any(d < 1 or a < 0 or c < 0 for d, a, c in call):
            raise ValueError(f"DeviceSpec {self.name!r}: call_cost must be (devices >= 1, "
                             f"seconds >= 0, seconds per array >= 0) rows, got {self.call_cost!r}")
        object.__setattr__(self, "call_cost", call)
        if any(not 0 < e <= 1 for _, e in self.matmul_efficiency):
            raise ValueError(f"DeviceSpec {self.name!r}: matmul_efficiency values must be "
                             f"in (0, 1], got {self.matmul_efficiency!r}")
        for field in ("attention_fwd_efficiency", "attention_bwd_efficiency"):
            v = getattr(self, field)
            if v is not None and v > 1:
                raise ValueError(f"DeviceSpec {self.name!r}: {field} is a share of the peak, "
                                 f"in (0, 1], got {v!r}")
        if self.efficiency_half_flops is None:
            object.__setattr__(self, "efficiency_half_flops", self.peak_flops * 1e-6)
        if self.idle_watts < 0 or self.idle_watts > self.max_watts:
            raise ValueError(f"DeviceSpec {self.name!r}: idle_watts must be in "
                             f"[0, max_watts], got {self.idle_watts!r}")

    def flops_rate(self, dtype: Any) -> float:
        """Peak matmul rate for operands of `dtype` (16-bit types get the tensor-core peak)."""
        itemsize = np.dtype(dtype).itemsize if dtype is not None else 4
        if itemsize <= 2:
            return self.peak_flops
        return self.peak_flops_f32 if self.peak_flops_f32 is not None else self.peak_flops / 2

    def small_conv_rate(self, width: int, out_width: float = 0.0) -> float | None:
        """Flop/s of a generic-loop convolution over `width` input features: the rate
        measured at the nearest width (log scale), else `small_input_conv_flops`; with
        `out_width` (its kernel's output features as a device holds them), the geometric
        mean of the two widths' rates, as the loop's rate follows both (on this project's
        CPU 512 -> 256 ran at 1.88 Gflop/s, 256 -> 512 at 1.40; square: 0.92 at 512, 2.91
        at 256)."""
        if not self.small_input_conv_rates or width <= 0:
            return self.small_input_conv_flops

        def at(w: float) -> float:
            return min(self.small_input_conv_rates, key=lambda p: abs(np.log(p[0] / w)))[1]
        return at(width) if out_width <= 0 else float(np.sqrt(at(width) * at(out_width)))

    def matmul_eff(self, work: np.ndarray, rate: np.ndarray, speed: float = 1.0
                   ) -> np.ndarray:
        """Efficiency of matmuls of `work` flops per kernel at a peak `rate` (flop/s, as
        scaled by `speed`): the measured curve where there is one, else
        w / (w + efficiency_half_flops * speed)."""
        if self.matmul_efficiency:
            return self.matmul_efficiency_at(np.asarray(work, float) / rate)
        half = float(self.efficiency_half_flops or 0.0) * speed
        return np.asarray(work, float) / (np.asarray(work, float) + half)

    def matmul_efficiency_at(self, peak_s: np.ndarray) -> np.ndarray:
        """Efficiency of matmuls whose work takes `peak_s` seconds at the peak rate, from
        `matmul_efficiency` (which must not be empty; `matmul_efficiency.efficiency_at`)."""
        return efficiency_at(self.matmul_efficiency, peak_s)

    def reduction_s(self, nbytes: np.ndarray) -> np.ndarray:
        """Seconds of reductions moving `nbytes` each (`reduction_cost`; 0 without it)."""
        return np.asarray(nbytes, float) * _per_byte(self.reduction_cost, nbytes)

    def fresh_memory_s(self, nbytes: float) -> float:
        """Seconds the step pays for `nbytes` of scratch memory mapped afresh."""
        return nbytes * _per_byte(self.fresh_memory_cost, nbytes)

    def layout_change_s(self, nbytes: float) -> float:
        """Seconds moving an array of `nbytes` into another layout adds."""
        if not self.layout_change_cost:
            return 2.0 * nbytes / self.memory_bandwidth
        return nbytes * _per_byte(self.layout_change_cost, nbytes)

    def power_profile(self) -> PowerProfile:
        """The profile the power model uses: the device's own, else modelled."""
        return self.power or default_profile(self.idle_watts, self.max_watts)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["power"] = None if self.power is None else self.power.to_dict()
        for field in (*_TABLES, "call_cost"):
            d[field] = [list(p) for p in d[field]]   # as JSON keeps them
        for term in ("call_cost", "python_call_s", "compute_capability",
                     "attention_fwd_efficiency", "attention_bwd_efficiency"):
            if not d[term]:      # as before the terms: plan-cache keys unchanged
                del d[term]
        if d["f32_conv_shares"]:
            del d["f32_conv_shares"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeviceSpec:
        d = dict(d)
        for field in _TABLES:
            d[field] = tuple(tuple(p) for p in d.get(field, ()))
        if isinstance(d.get("power"), dict):
            d["power"] = PowerProfile.from_dict(d["power"])
        return cls(**d)


__all__ = ["BACKEND_FLAGS", "GB", "GiB", "DeviceSpec"]
