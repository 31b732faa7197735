"""Timed convolution probes: what a device profile's convolution figures stand for.

Convolutions with their gradients against the matmul curve (their share of its rate, one
work-weighted figure), over maps smaller than their window (a backend's generic loop, per
width), a chain of tiny ones (what each costs whatever its size), and a network's first
layers over RGB, which both an accelerator and XLA:CPU run far below the rest
(`narrow_conv_efficiency`). `calibration/device_figures.py` runs them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxwap.analysis.flatten import flatten
from jaxwap.analysis.roofline_adapter import roofline_rules
from jaxwap.calibration.timing import in_program, operand, repeated, time_it


def _conv(x: Any, w: Any) -> Any:
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


# (batch, spatial, in channels, out channels) of 3x3 convolutions timed with their two
# gradients: the layers of a small CNN, maps larger than the window
CONV_SHAPES = ((8, 16, 64, 64), (8, 8, 128, 128), (8, 8, 32, 64))
# the same at an accelerator's scale, where the small ones time the launch alone: ResNet's
# bottleneck layers and VGG's at training batches, 12-460 Gflop a pass, work-weighted. Alone,
# cuDNN's share rises with the work (on an H100 here 0.41-0.59 at 12-29 Gflop, 0.90-0.97
# at 226-462; benchmarks/results/conv_probe/nvidia-h100-80gb-hbm3.md), but inside a
# training step ResNet-50's small layers ran at 0.83 and VGG-16's at 1.05 (profiler trace,
# gpu_trace/nvidia-h100-80gb-hbm3.md): the work-weighted figure (0.92 there) is the one
# that held. A share by work fitted to these probes put ResNet-50's step 11% above its
# queued time (flat: 0%), 39% when each probe was one call waited for
ACCEL_CONV_SHAPES = ((64, 56, 64, 64), (64, 14, 256, 256), (64, 56, 128, 128),
                     (64, 14, 512, 512), (64, 56, 256, 256), (64, 28, 512, 512),
                     (128, 56, 256, 256))
# 3x3 convolutions over a 2x2 map (the window larger than the input) at the usual CNN
# widths. On XLA:CPU's generic loop the rate (per tap that lands on the input) is about
# flat from 64 to 384 channels, and 512 -> 512 runs 3x slower than its neighbours (seen
# on this project's 2-core EPYC: the kernel's 2 KiB rows alias in cache); each width's
# rate is kept (`DeviceSpec.small_input_conv_rates`) and their median stands for widths
# far from all of them
SMALL_INPUT_CONVS = ((8, 2, 128, 128), (8, 2, 256, 256), (8, 2, 384, 384), (8, 2, 512, 512))


#: calls an accelerator's convolution timing queues before it waits (`conv_timings`)
QUEUED = 8


def conv_flops(fn: Callable[..., Any], *args: Any) -> float:
    """Flops of the convolutions `fn` runs, by jax's roofline rule: the figure the cost
    model divides by the rates measured here (it counts only the window taps that land on
    the input, 4 of 9 for a 3x3 window over a 2x2 map), so rate and work agree."""
    rules = roofline_rules()
    prog = flatten(jax.make_jaxpr(fn)(*args))
    return sum((rules.cost(op.eqn) or (0.0, 0.0))[0] * op.repeat for op in prog.ops
               if op.prim == "conv_general_dilated")


def conv_timings(device: Any, matmul_s: Callable[[float], float],
                 shapes: Sequence[tuple[int, int, int, int]], dtype: Any
                 ) -> list[tuple[float, float, float]]:
    """[(flops of one pass, seconds the matmul curve gives its three passes, seconds
    measured)] of 3x3 convolutions of `shapes` (batch, map, in, out), forward and both
    gradients in `dtype`; `matmul_s`: seconds of one matmul of w flops, launch included.
    On an accelerator each timing queues QUEUED calls and waits for the last, as a step's
    kernels run back to back: one call waited for adds the host's dispatch and wait to a
    0.3-2 ms program (XLA:CPU runs a call on the calling thread; there one is timed)."""
    out = []
    queued = 1 if device.platform == "cpu" else QUEUED
    for b, h, c, k in shapes:
        x, w = operand(device, (b, h, h, c), dtype), operand(device, (3, 3, c, k), dtype, 9 * c)
        f = jax.jit(jax.value_and_grad(lambda x, w: _conv(x, w).sum(), argnums=(0, 1)))
        seconds = time_it(lambda f=f, x=x, w=w: jax.block_until_ready(
            [f(x, w) for _ in range(queued)])) / queued
        work = conv_flops(f, x, w) / 3
        out.append((work, 3 * matmul_s(work), seconds))
    return out


def conv_rates(device: Any, matmul_s: Callable[[float], float], quick: bool,
               shapes: Sequence[tuple[int, int, int, int]] = CONV_SHAPES,
               dtype: Any = jnp.float32) -> tuple[float, float, dict[int, float]]:
    """(conv_efficiency, small_input_conv_flops, {input features: flop/s}): convolutions
    of `shapes` (forward and both gradients, in `dtype`) against what the matmul curve
    gives the same work (`matmul_s`: seconds of one matmul of w flops in that dtype, its
    launch included), and the f32 flop/s of a convolution whose window is larger than its
    input, the median and per width. Work is counted as the cost model counts it
    (`conv_flops`)."""
    timed = conv_timings(device, matmul_s, shapes[:2] if quick else shapes, dtype)
    as_matmul, measured = (sum(t[i] for t in timed) for i in (1, 2))
    rates = {}
    g = jax.jit(_conv)
    for b, h, c, k in SMALL_INPUT_CONVS[:1] if quick else SMALL_INPUT_CONVS:
        x = jax.device_put(jnp.ones((b, h, h, c), jnp.float32), device)
        w = jax.device_put(jnp.ones((3, 3, c, k), jnp.float32), device)
        rates[c] = conv_flops(_conv, x, w) / time_it(
            lambda x=x, w=w: g(x, w).block_until_ready(), 3)
    return min(as_matmul / measured, 1.0), float(np.median(list(rates.values()))), rates



#: a CNN's first layers over RGB at a training batch, 3 -> 64 channels: (batch, map,
#: window, stride) of VGG's, ResNet's stem and AlexNet's; on a CPU at its scale (64 px)
NARROW_CONVS = ((64, 224, 3, 1), (64, 224, 7, 2), (64, 224, 11, 4))
CPU_NARROW_CONVS = ((16, 64, 3, 1), (16, 64, 7, 2), (16, 64, 11, 4))


def narrow_conv_efficiency(device: Any, dtype: Any, matmul_s: Callable[[float], float],
                           shapes: Sequence[tuple[int, int, int, int]] = NARROW_CONVS
                           ) -> float:
    """The share of the matmul rate (`matmul_s`: seconds of one matmul of w flops in
    `dtype`, its launch included) that the first layers `shapes` reach, forward and kernel
    gradient (a first layer's input needs none), work-weighted:
    `DeviceSpec.narrow_conv_efficiency`. cuDNN on an H200 ran them at 0.03-0.07; XLA:CPU on
    this project's VM ran ResNet-50-small's 7x7 stem (16 x 32 x 32 x 3) at 21 Gflop/s
    forward and 44 its kernel gradient, on one core whose matmuls reach 108."""
    as_matmul = measured = 0.0
    for b, h, win, stride in shapes:
        x = operand(device, (b, h, h, 3), dtype)
        w = operand(device, (win, win, 3, 64), dtype, win * win * 3)

        def loss(w: Any, x: Any, s: int = stride) -> Any:
            y = jax.lax.conv_general_dilated(x, w, (s, s), "SAME",
                                             dimension_numbers=("NHWC", "HWIO", "NHWC"))
            return jnp.sum(y * y)

        f = jax.jit(jax.value_and_grad(loss))
        measured += time_it(lambda f=f, w=w, x=x: jax.block_until_ready(f(w, x)))
        as_matmul += 2 * matmul_s(conv_flops(f, w, x) / 2)
    return min(as_matmul / measured, 1.0)


def tiny_conv(device: Any, chain: int = 32) -> tuple[float, float]:
    """(seconds, flops) of one tiny 3x3 convolution inside a program, a dependent chain
    of them (`in_program`): its work is a few microseconds, so the rest is what each
    convolution costs whatever its size (`DeviceSpec.conv_overhead_s`)."""
    x = jax.device_put(jnp.ones((8, 8, 8, 16), jnp.float32), device)
    w = jax.device_put(jnp.ones((3, 3, 16, 16), jnp.float32), device)
    chained = repeated(lambda v, w: jnp.tanh(_conv(v, w)))
    return in_program(chained, (x, w), chain - 1, repeats=9), conv_flops(_conv, x, w)


__all__ = ["ACCEL_CONV_SHAPES", "CONV_SHAPES", "CPU_NARROW_CONVS", "NARROW_CONVS", "QUEUED",
           "SMALL_INPUT_CONVS", "conv_flops", "conv_rates", "conv_timings",
           "narrow_conv_efficiency", "tiny_conv"]
