"""AlexNet and VGG-16 as Flax Linen modules, sized for ImageNet but usable at any image size.

These are the two workloads the examples and `benchmarks/planning/plan_time.py` hand to jaxwap. They
are deliberately plain: no batch norm (the originals had none, and it would add mutable
`batch_stats` to the variables), no dropout (so a training step is a pure, deterministic
function of params, optimizer state and batch, which is what an auto-sharded step is compared
against), and no local response normalisation (it is obsolete and adds nothing to the
parallelisation problem).

Shapes follow the papers at 224 px (AlexNet ends in a 6x6x256 map, VGG-16 in 7x7x512), so
parameter counts, and with them the planner's memory and communication estimates, match
the networks people know. At small images (32 or 64 px, for CPU runs) a pooling window that
no longer fits the map is applied with 'SAME' padding instead, which can only keep a side at
1, never take it to 0; the classifier flattens whatever map is left.

`dtype` is the compute dtype (activations and matmul inputs); parameters are always kept in
float32 (`param_dtype`), the usual mixed-precision arrangement, so optimizer updates do not
lose precision in bfloat16.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

# He (Kaiming) initialisation for layers followed by ReLU. Without batch norm, Flax's default
# LeCun init halves the activation variance at every ReLU layer, so after VGG's 15 hidden
# layers the logits and gradients are tiny and the loss barely moves in a short run.
_HE_INIT = nn.initializers.variance_scaling(2.0, "fan_in", "truncated_normal")


def _pool(x: jax.Array, window: int, stride: int) -> jax.Array:
    """Max-pool NHWC `x`, falling back to 'SAME' padding when the window does not fit.

    'VALID' pooling reproduces the papers' feature-map sizes at 224 px; on a map smaller
    than the window it would produce a zero-sized side, so there 'SAME' is used, which
    yields ceil(side / stride) >= 1.
    """
    fits = min(x.shape[1], x.shape[2]) >= window
    padding = "VALID" if fits else "SAME"
    return nn.max_pool(x, (window, window), strides=(stride, stride), padding=padding)


def _classifier(x: jax.Array, num_classes: int, dtype: jnp.dtype) -> jax.Array:
    """Flatten, then the fc6-ReLU-fc7-ReLU-fc8 head shared by AlexNet and VGG.

    Called from inside a parent's `@nn.compact` method, so the Dense layers become direct
    children named fc6/fc7/fc8: parameter paths (which jaxwap's plan tables print) then read
    like the papers' layer names.
    """
    x = x.reshape((x.shape[0], -1))
    for name in ("fc6", "fc7"):
        x = nn.Dense(4096, dtype=dtype, param_dtype=jnp.float32, kernel_init=_HE_INIT, name=name)(x)
        x = nn.relu(x)
    # The last layer starts at zero: the softmax starts uniform, so the first loss is exactly
    # ln(num_classes) whatever the image size, instead of a large value from He-scaled
    # features meeting random weights. Its gradient is not zero, so everything still trains.
    x = nn.Dense(num_classes, dtype=dtype, param_dtype=jnp.float32,
                 kernel_init=nn.initializers.zeros, name="fc8")(x)
    # Softmax / cross-entropy in float32 even when computing in bfloat16.
    return x.astype(jnp.float32)


class AlexNet(nn.Module):
    """AlexNet (Krizhevsky et al., 2012), single-tower, without LRN or dropout.

    Input: NHWC images of any size >= 1 px. Output: float32 logits [batch, num_classes].
    """

    num_classes: int = 1000
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        def conv(
            name: str, features: int, kernel: int, stride: int = 1, padding: str | Sequence = "SAME"
        ) -> nn.Conv:
            return nn.Conv(
                features,
                (kernel, kernel),
                strides=(stride, stride),
                padding=padding,
                dtype=self.dtype,
                param_dtype=jnp.float32,
                kernel_init=_HE_INIT,
                name=name,
            )

        x = x.astype(self.dtype)
        # Padding 2 on the 11x11/4 conv gives the canonical 55x55 map at 224 px.
        x = nn.relu(conv("conv1", 96, 11, stride=4, padding=((2, 2), (2, 2)))(x))
        x = _pool(x, 3, 2)
        x = nn.relu(conv("conv2", 256, 5)(x))
        x = _pool(x, 3, 2)
        x = nn.relu(conv("conv3", 384, 3)(x))
        x = nn.relu(conv("conv4", 384, 3)(x))
        x = nn.relu(conv("conv5", 256, 3)(x))
        x = _pool(x, 3, 2)
        return _classifier(x, self.num_classes, self.dtype)


# VGG-16 ("configuration D" of Simonyan & Zisserman, 2014): conv widths, "M" = 2x2/2 max-pool.
VGG16_LAYERS: tuple[int | str, ...] = (
    64, 64, "M",
    128, 128, "M",
    256, 256, 256, "M",
    512, 512, 512, "M",
    512, 512, 512, "M",
)  # fmt: skip


class VGG16(nn.Module):
    """VGG-16 (13 3x3 convs + 3 dense layers), without dropout.

    Input: NHWC images of any size >= 1 px. Output: float32 logits [batch, num_classes].
    """

    num_classes: int = 1000
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(self.dtype)
        block, index = 1, 1
        for layer in VGG16_LAYERS:
            if layer == "M":
                x = _pool(x, 2, 2)
                block, index = block + 1, 1
            else:
                x = nn.Conv(
                    int(layer),
                    (3, 3),
                    padding="SAME",
                    dtype=self.dtype,
                    param_dtype=jnp.float32,
                    kernel_init=_HE_INIT,
                    name=f"conv{block}_{index}",
                )(x)
                x = nn.relu(x)
                index += 1
        return _classifier(x, self.num_classes, self.dtype)
