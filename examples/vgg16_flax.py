"""VGG-16 on synthetic ImageNet-shaped data, single-device or auto-sharded by jaxwap.

Run from the repository root:

    .venv/bin/python examples/vgg16_flax.py            # jax.jit on one device
    .venv/bin/python examples/vgg16_flax.py --auto     # jaxwap.auto_shard over all devices
    .venv/bin/python examples/vgg16_flax.py --auto --objective energy --hardware h100-sxm

Without a GPU it runs on 8 simulated CPU devices at 32 px (224 px on GPU); set
JAXWAP_EXAMPLE_PLATFORM=cpu|gpu to override the detection. `--help` lists all flags.
"""

import common  # first: no jax import at module level, so setup_devices() can still act

common.setup_devices()  # sets XLA_FLAGS before anything imports jax

from models import VGG16  # noqa: E402 - must follow setup_devices()

if __name__ == "__main__":
    common.main(VGG16, name="VGG-16", cpu_image_size=32)
