"""Test set-up: 8 simulated CPU devices, configured before jax is imported anywhere."""

import os

# LLVM's optimisation of the CPU code is off (--xla_backend_optimization_level=0): it is
# about a third of the suite's time, and no test depends on how fast the generated code
# runs. XLA's HLO passes (sharding, collectives, buffer assignment, what the tests check)
# are untouched by it.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Plans made by the tests go to a fresh cache directory per session, never the user's.
if "JAXWAP_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["JAXWAP_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxwap-test-cache-")
