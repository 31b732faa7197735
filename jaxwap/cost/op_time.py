"""What each op of the flat program takes on a device: its roofline (flops at the matmul,
convolution, fused-attention or generic-loop rate, bytes at the bandwidth or a
reduction's measured rate, the slow elementwise work a CPU evaluates apart) plus its
kernel launches, for a share of its work. `mesh_cost.mesh_costs` sums these over a layout's
splits."""

from __future__ import annotations

import numpy as np

from jaxwap.analysis.graph import Graph
from jaxwap.hardware.cluster import Cluster
from jaxwap.hardware.device import DeviceSpec


def op_parts(graph: Graph, cluster: Cluster, split: np.ndarray | float,
             speed: float = 1.0, data: np.ndarray | float = 1.0
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-op (seconds, compute-bound seconds, compute-bound work) when op k's work is
    divided by split[k] on devices running `speed` times their profile (see
    Cluster.shared_compute), `data` of those ways by splitting the batch: what a batched
    op moves whole whatever its batch share (`Graph.fixed_bytes`: the weights it reads,
    the gradients it writes) is divided by the other split[k] / data[k] ways alone (the
    model axis). An op is compute-bound where its flops, not its bytes, set its roofline
    time; its work, that time at the full rate, is what the power model acts on."""
    dev = cluster.device
    f = graph.flops / split
    b = (graph.bytes + graph.fixed_bytes * (np.asarray(data, float) - 1.0)
         + graph.window_grad_bytes * dev.expands_pooling_grads) / split
    rate = np.where(graph.low_precision, dev.peak_flops, dev.flops_rate(np.float32)) * speed
    per_kernel = f / graph.repeat  # one scan iteration
    eff = np.where(graph.is_matmul, dev.matmul_eff(per_kernel, rate, speed), 1.0)
    eff = eff * attention_share(graph, dev)
    conv_eff = np.where(graph.conv == 3, dev.narrow_conv_efficiency or dev.conv_efficiency,
                        dev.conv_efficiency)
    if not dev.f32_conv_shares:   # float32 on CUDA cores: at the float32 matmul rate
        conv_eff = np.where(graph.low_precision, conv_eff, 1.0)
    rate = rate * np.where(graph.conv > 0, conv_eff, 1.0) * np.where(
        graph.transposed, dev.transposed_matmul_efficiency or 1.0, 1.0)
    if dev.small_input_conv_flops is not None:
        # the backend's generic convolution loop: no library, no efficiency curve, a rate
        # that depends on the width
        slow = graph.conv == 2
        rate = rate.astype(float)
        for k in np.flatnonzero(slow).tolist():
            rate[k] = dev.small_conv_rate(int(graph.conv_width[k]),
                                          float(graph.conv_out_width[k])) * speed
        eff = np.where(slow, 1.0, eff)
    trans_t = (graph.transcendentals * dev.transcendental_s + graph.window_taps  # compute
               * dev.window_tap_s + graph.window_grad_elems * dev.window_grad_s) / split / speed
    flop_t = np.maximum(f / (rate * np.maximum(eff, 1e-9)), trans_t)
    byte_t = b / (dev.memory_bandwidth * speed)
    if dev.reduction_cost:
        # a reduction takes at least its measured time at its size, per kernel: what it
        # reduces, or, fused with its producers (`fuses_reductions`), what the fusion reads
        per = np.where(graph.reduced > 0, b if dev.fuses_reductions
                       else graph.reduced / split, 0.0) / np.maximum(graph.kernels, 1.0)
        byte_t = np.maximum(byte_t, graph.kernels * dev.reduction_s(per) / speed)
    busy = np.maximum(flop_t, byte_t)
    bound = flop_t > byte_t
    if graph.host_transfer.any():   # remat residuals offloaded cross the host link
        busy = np.where(graph.host_transfer, b / 2 / dev.host_bandwidth, busy)
        bound &= ~graph.host_transfer
    launch = dev.kernel_overhead_s + np.where(graph.conv > 0, dev.conv_overhead_s, 0.0)
    return (busy + graph.kernels * launch + relayout_times(graph, cluster, split, speed),
            np.where(bound, busy, 0.0), np.where(bound, np.maximum(f / rate, trans_t), 0.0))


def attention_share(graph: Graph, dev: DeviceSpec) -> np.ndarray | float:
    """[ops] the share of a matmul's rate cuDNN's fused attention reaches, forward and
    backward (`DeviceSpec.attention_fwd_efficiency`, `attention_bwd_efficiency`: the
    published rates of long sequences), 1 for other ops or where the profile has none.
    It multiplies the matmul efficiency of the kernel's work, which stays near 1 for such
    kernels and keeps tiny ones from pricing as large ones."""
    att = graph.attention
    if att is None or not att.any():
        return 1.0
    fwd, bwd = dev.attention_fwd_efficiency or 1.0, dev.attention_bwd_efficiency or 1.0
    return np.where(att == 1, fwd, np.where(att == 2, bwd, 1.0))


def relayout_times(graph: Graph, cluster: Cluster, split: np.ndarray | float,
                   speed: float = 1.0) -> np.ndarray:
    """Per-op seconds of the copies the backend makes around batched matmuls
    (`grad_reductions.dot_relayouts`), at a `split` share, where it makes them
    (`DeviceSpec.relayouts_batched_dots`): a layout change and a kernel launch each.
    Part of `op_parts`' seconds; `mesh_cost.mesh_costs` keeps them apart as layout changes,
    which XLA's own replace where the model is fed its figures."""
    dev = cluster.device
    if not dev.relayouts_batched_dots or not graph.dot_relayout_bytes.any():
        return np.zeros(len(graph.flops))
    moved = graph.dot_relayout_bytes / split
    return np.where(moved > 0, dev.layout_change_s(moved) / speed + dev.kernel_overhead_s, 0.0)


def op_times(graph: Graph, cluster: Cluster, split: np.ndarray | float,
             speed: float = 1.0, data: np.ndarray | float = 1.0) -> np.ndarray:
    """Per-op seconds (`op_parts`'s first)."""
    return op_parts(graph, cluster, split, speed, data)[0]


__all__ = ["attention_share", "op_parts", "op_times", "relayout_times"]
