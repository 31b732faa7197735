"""A step's time and energy from its parts: the one place a `Prediction` is made.

The cost model (`cost/mesh_cost.py`) and the pipeline's (`cost/pipeline_cost.py`) price what a step
does; this adds it up: compute, the communication that blocks, the part of the gradient
reduction and of host transfers the step cannot hide, the host's call of the step, and
the energy each phase draws (`power_model.step_energy`) under the board's default power limit
or a chosen one. A prediction keeps its parts, so the same step can be re-assembled under
another limit (`at_power_limit`) without pricing it again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxwap.core.records import Prediction
from jaxwap.hardware.cluster import Cluster
from jaxwap.hardware.power_model import PhaseTimes, step_energy

# Share of the backward pass in a step's batched compute (backward ~ 2x forward).
BACKWARD_SHARE = 2.0 / 3.0


@dataclass(frozen=True)
class StepParts:
    """What a step's time and energy are assembled from (seconds per device, unless
    stated): the model's own figures, or the model's figures with XLA's put in."""

    compute: float
    busy: float                 # the roofline part of compute
    blocking: float             # communication nothing overlaps (tensor parallelism)
    grad_comm: float            # gradient reduction, which the backward pass can hide
    tail_comm: float            # ... except this much, produced last (the first layer's)
    batched_time: float         # compute of batched ops (backward is most of it)
    host_one_way: float         # offloaded state moved host <-> device, each way
    comm_bytes: float
    memory: float
    flops: float
    loop_flops_ratio: float = 1.0
    bubble: float = 0.0         # of `compute`: a pipeline's bubble, devices idle
    sends: float = 0.0          # of `blocking`: a pipeline's stage-to-stage sends
    bound: float = 0.0          # of `busy`: compute-bound ops (what a power limit slows)
    bound_work: float = 0.0     # their work at the full rate (how hard they drive it)
    fresh: float = 0.0          # not in `compute`: scratch memory mapped afresh each step
    relayout: float = 0.0       # of `compute` and `busy`: arrays moved into another layout
    call: float = 0.0           # not in `compute`: the host's call of the step (`call_time`)


def exposed_comm(grad_comm: float, tail: float, batched_time: float,
                 overlaps: bool = True) -> float:
    """The gradient reduction the step waits for: what the backward pass (its share of
    the batched compute) cannot hide, and never less than the tail, whose gradient is
    produced last; all of it on a backend that runs collectives in line (`overlaps`
    False). The one exposure rule, for the model's figures and for XLA's."""
    if not overlaps:
        return grad_comm
    return max(grad_comm - BACKWARD_SHARE * batched_time, min(tail, grad_comm), 0.0)


def exposed_host(one_way: float, batched_time: float) -> float:
    """Seconds of host transfer the step cannot hide: offloaded state comes in while the
    forward and backward passes run (prefetch), but the new state goes out after the
    update, at the end of the step, with nothing left to overlap it."""
    return max(one_way - batched_time, 0.0) + one_way


def call_time(cluster: Cluster, buffers: int, n: int, tree_calls: int = 0) -> float:
    """Seconds the host takes to call a step over a mesh of n devices that passes
    `buffers` arrays in and out (`DeviceSpec.call_cost`, linear in devices between its
    rows, held past them) in pytrees whose reading and building make `tree_calls` Python
    calls (`Graph.tree_calls`, at `DeviceSpec.python_call_s` each): each process calls it
    on its own devices of the mesh (a node's, one process to a node), all at once. 0
    without a measured cost."""
    rows = cluster.device.call_cost
    if not rows:
        return 0.0
    devices, fixed, per_array = (np.asarray(v, float) for v in zip(*rows, strict=True))
    here = cluster.devices_in_node(n)
    return float(np.interp(here, devices, fixed) + buffers * np.interp(here, devices, per_array)
                 + tree_calls * cluster.device.python_call_s)


def assemble(cluster: Cluster, n: int, batch: int, parts: StepParts,
             power_limit: float | None = None) -> Prediction:
    """A step's time and energy from its parts: compute, blocking communication, and the
    gradient reduction and host transfers the step does not hide. Each of the n devices
    draws each phase's power (`power_model.step_energy`: compute-bound kernels, memory-bound
    ones, launches and communication, a pipeline's bubble) for that phase's time; under a
    `power_limit` (watts per device, None: the board default) the compute-bound phase
    runs at the clock the limit allows. The one place a `Prediction` is made."""
    dev = cluster.device
    profile = dev.power_profile()
    memory = max(parts.busy - parts.bound, 0.0)
    stretch = step_energy(profile, dev.idle_watts, PhaseTimes(
        parts.bound, parts.bound_work, memory, 0.0, 0.0), power_limit).extra_time_s
    compute = parts.compute + parts.fresh + stretch
    # the backward pass, slowed with the rest, hides more of the gradient reduction
    active = parts.compute - parts.bubble
    batched = parts.batched_time + (stretch * parts.batched_time / active if active > 0 else 0.0)
    comm = exposed_comm(parts.grad_comm, parts.tail_comm, batched, dev.overlaps_collectives)
    host = exposed_host(parts.host_one_way, batched)
    step = compute + parts.blocking + comm + host + parts.call
    side = max(parts.compute - parts.bubble - parts.busy, 0.0) + parts.fresh + parts.blocking \
        + comm + host + parts.call
    got = step_energy(profile, dev.idle_watts, PhaseTimes(
        parts.bound, parts.bound_work, memory, side, parts.bubble), power_limit)
    # devices of one shared pool (simulated CPU devices) draw the share of those left out
    energy = n * got.energy_j * cluster.speedup_when_using(n)
    busy = parts.busy + stretch
    return Prediction(
        step_time_s=step, samples_per_s=batch / step if step else float("inf"),
        energy_per_step_j=energy, energy_per_sample_j=energy / batch,
        avg_power_w=energy / step if step > 0 else 0.0,
        peak_memory_bytes=parts.memory, comm_bytes=parts.comm_bytes,
        compute_time_s=compute, tp_comm_time_s=parts.blocking,
        grad_comm_time_s=parts.grad_comm, exposed_comm_time_s=comm,
        flops_per_device=parts.flops, utilization=min(1.0, busy / step) if step > 0 else 0.0,
        num_devices=n, busy_time_s=busy, batched_time_s=batched,
        host_transfer_time_s=2 * parts.host_one_way, loop_flops_ratio=parts.loop_flops_ratio,
        tail_comm_time_s=parts.tail_comm, exposed_host_time_s=host,
        bubble_time_s=parts.bubble, send_time_s=parts.sends,
        compute_bound_time_s=parts.bound, compute_bound_work_s=parts.bound_work,
        power_limit_w=power_limit, power_stretch_s=stretch,
        fresh_memory_time_s=parts.fresh, layout_change_time_s=parts.relayout,
        call_time_s=parts.call)


def parts_of(pred: Prediction) -> StepParts:
    """The parts a prediction was assembled from, at the board's default limit."""
    s = pred.power_stretch_s
    active = pred.compute_time_s - pred.bubble_time_s
    batched = pred.batched_time_s
    if s > 0 and active > 0:
        batched = batched * (active - s) / active
    return StepParts(
        compute=pred.compute_time_s - s - pred.fresh_memory_time_s, busy=pred.busy_time_s - s,
        blocking=pred.tp_comm_time_s, grad_comm=pred.grad_comm_time_s,
        tail_comm=pred.tail_comm_time_s, batched_time=batched,
        host_one_way=pred.host_transfer_time_s / 2, comm_bytes=pred.comm_bytes,
        memory=pred.peak_memory_bytes, flops=pred.flops_per_device,
        loop_flops_ratio=pred.loop_flops_ratio, bubble=pred.bubble_time_s,
        sends=pred.send_time_s, bound=pred.compute_bound_time_s,
        bound_work=pred.compute_bound_work_s, fresh=pred.fresh_memory_time_s,
        relayout=pred.layout_change_time_s, call=pred.call_time_s)


def at_power_limit(pred: Prediction, cluster: Cluster, batch: int,
                   power_limit: float | None) -> Prediction:
    """The same step under another power limit (None: the board default)."""
    return assemble(cluster, pred.num_devices, batch, parts_of(pred), power_limit)


__all__ = ["BACKWARD_SHARE", "StepParts", "assemble", "at_power_limit", "call_time", "exposed_comm",
           "exposed_host", "parts_of"]
