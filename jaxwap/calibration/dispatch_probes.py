"""The host's dispatch of a compiled step, timed: what calling it costs beyond its work.

`in_program` timings leave out what a step pays once per call: jax parsing its arguments,
the donation, making its results, on each device. `step_call` measures that for one device
and all of a process's (`DeviceSpec.call_cost`) from programs that do next to no work;
the Python work on the step's pytrees is `calibration/host_calls.py`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxwap.calibration.timing import time_it
from jaxwap.runtime.compile import make_mesh


def call_seconds(devices: Sequence[Any], arrays: int, repeats: int = 101) -> float:
    """Median seconds the host takes to call a compiled program over `devices` that adds
    one to each of its `arrays` donated arguments (16 floats each, replicated), in place:
    jax's dispatch of a step's arrays with next to no work (`step_call`). A program that
    handed them back as they were would write nothing, as no step does: with GPT-2-small's
    87 arrays it took 0.12 ms here, this one 0.21-0.23, the step's own call 0.47-0.57."""
    sharding = NamedSharding(make_mesh(1, len(devices), list(devices)), P())
    xs = [jax.device_put(jnp.full((16,), i, jnp.float32), sharding) for i in range(arrays)]
    call = jax.jit(lambda *a: tuple(x + 1 for x in a), donate_argnums=tuple(range(arrays)))
    xs = list(call(*xs))

    def once() -> None:
        xs[:] = jax.block_until_ready(call(*xs))
    return time_it(once, repeats)


def step_call(devices: Sequence[Any], arrays: int = 64, repeats: int = 101
              ) -> list[tuple[int, float, float]]:
    """[(d, seconds, seconds per array)]: the host's call of a compiled program over d of
    `devices` (this process's own; d = 1 and all of them) passing n arrays in and as many
    out takes seconds + 2n x per array: jax's dispatch of a training step, which
    `in_program` leaves out and a step pays once (parsing its arguments, the donation,
    making its results, on each device). Timed by `call_seconds` at n = 1 and `arrays`
    (`benchmarks/accuracy/step_call.py` times it at more counts)."""
    out = []
    for d in sorted({1, len(devices)}):
        one, many = (call_seconds(devices[:d], n, repeats) for n in (1, arrays))
        per_array = max(many - one, 0.0) / (2 * (arrays - 1))
        out.append((d, max(one - 2 * per_array, 0.0), per_array))
    return out


__all__ = ["call_seconds", "step_call"]
