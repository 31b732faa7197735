"""The cost model: time, memory, communication and energy of one candidate plan.

A candidate is a mesh (data x model) and a sharding strategy per parameter. Its step
time is compute + blocking tensor-parallel communication + the part of the gradient
reduction that backward compute cannot hide:

- compute: every op runs on its share of the work (batched ops over the data axis, a
  tensor-parallel weight's matmuls also over the model axis, a parameter's own ops
  such as the optimizer update over however the parameter is sharded); each op costs
  its kernel launches plus a roofline `max(flops / (peak * eff), bytes / bandwidth)`,
  where matmul efficiency `w / (w + w_half)` falls as the per-device work `w` shrinks.
  That fall, with the fixed launch cost, is what makes a small workload slower on
  many devices.
- communication: ring collectives, `2(n-1)/n * bytes / bw + 2(n-1) * latency` for an
  all-reduce and half that for all-gather / reduce-scatter.
- energy: each used device draws `idle + (max - idle) * utilization` for the step.

Everything here is a prediction; the verification stage compares it with XLA's own
analysis of the compiled step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .graph import GRAD, NUM_CLASSES, OPT, Graph, Layer
from .hardware import Cluster

DATA, MODEL = "data", "model"
# Share of the backward pass in a step's batched compute (backward ~ 2x forward).
BACKWARD_SHARE = 2.0 / 3.0
# Utilization credited while a device launches kernels or runs collectives.
SIDE_UTILIZATION = 0.3


@dataclass(frozen=True)
class Strategy:
    """How one parameter is laid out on the mesh.

    `spec` is a PartitionSpec as a tuple of per-dim entries (None or an axis name).
    `tp` is "col" (an output-feature dim over the model axis), "row" (a contracted dim
    over the model axis) or "none"; `data_sharded` marks ZeRO-3 / FSDP sharding over
    the data axis (weight, gradient and optimizer state). Memory-only variants:
    `state_spec` (when not None) lays out the parameter's optimizer state differently from
    the parameter: ZeRO-1, the state sharded over the data axis while the weight is not;
    `offload` keeps that state in pinned host memory between steps, moved in and out
    inside the compiled step.
    """

    name: str
    spec: tuple[str | None, ...]
    tp: str = "none"
    data_sharded: bool = False
    state_spec: tuple[str | None, ...] | None = None
    offload: bool = False

    def shard(self, d: int, m: int) -> int:
        """How many ways the weight (and its gradient) is split."""
        return (d if self.data_sharded else 1) * (m if self.tp != "none" else 1)

    def state_shard(self, d: int, m: int) -> int:
        """How many ways the optimizer state is split."""
        zero1 = self.state_spec is not None and DATA in self.state_spec
        return self.shard(d, m) * (d if zero1 and not self.data_sharded else 1)

    def divisors(self, d: int, m: int) -> tuple[float, float, float, float]:
        """Per-device share divisors of the WEIGHT, GRAD, OPT and RESIDENT classes
        (infinite: not in device memory between uses)."""
        w, s = float(self.shard(d, m)), float(self.state_shard(d, m))
        return w, w, s, (float("inf") if self.offload else s)

    @property
    def layout_of_state(self) -> tuple[str | None, ...]:
        return self.spec if self.state_spec is None else self.state_spec


@dataclass(frozen=True)
class Prediction:
    """Predicted figures for one step of one candidate (per device unless stated)."""

    step_time_s: float
    samples_per_s: float
    energy_per_step_j: float
    energy_per_sample_j: float
    avg_power_w: float            # all devices of the mesh together
    peak_memory_bytes: float      # per device
    comm_bytes: float             # bytes each device sends per step
    compute_time_s: float
    tp_comm_time_s: float
    grad_comm_time_s: float
    exposed_comm_time_s: float
    flops_per_device: float
    utilization: float
    num_devices: int
    busy_time_s: float = 0.0      # the roofline part of compute (no launch overhead)
    batched_time_s: float = 0.0   # compute of batched ops: the backward pass hides in it
    host_transfer_time_s: float = 0.0   # offloaded state moved in and out, seconds
    # flops XLA's cost analysis counts (a loop body once) over the true flops: what to
    # compare with compiled figures when the step has a scan (micro-batches)
    loop_flops_ratio: float = 1.0

    @property
    def flops_as_xla_counts(self) -> float:
        return self.flops_per_device * self.loop_flops_ratio

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Prediction:
        return cls(**d)


# --------------------------------------------------------------------------- collectives
def all_reduce(nbytes: float, n: int, cluster: Cluster,
               latency: bool = True) -> tuple[float, float]:
    """(seconds, bytes sent per device) of a ring all-reduce over n devices.

    `latency=False` leaves out the per-step latency, for collectives XLA's combiner
    merges into one (gradient reductions): their latency is charged once per step.
    """
    if n <= 1 or nbytes <= 0:
        return 0.0, 0.0
    sent = 2 * (n - 1) / n * nbytes
    return sent / cluster.link_bandwidth + latency * 2 * (n - 1) * cluster.link_latency, sent


def all_gather(nbytes: float, n: int, cluster: Cluster,
               latency: bool = True) -> tuple[float, float]:
    """(seconds, bytes sent per device) of a ring all-gather (or reduce-scatter) whose
    full result is `nbytes`."""
    if n <= 1 or nbytes <= 0:
        return 0.0, 0.0
    sent = (n - 1) / n * nbytes
    return sent / cluster.link_bandwidth + latency * (n - 1) * cluster.link_latency, sent


# --------------------------------------------------------------------------- compute
def op_times(graph: Graph, cluster: Cluster, split: np.ndarray | float,
             speed: float = 1.0) -> np.ndarray:
    """Per-op seconds when op k's work is divided by split[k] on devices running `speed`
    times their profile (see Cluster.shared_compute)."""
    dev = cluster.device
    f = graph.flops / split
    b = graph.bytes / split
    rate = np.where(graph.low_precision, dev.peak_flops, dev.flops_rate(np.float32)) * speed
    half = float(dev.efficiency_half_flops or 0.0) * speed
    per_kernel = f / graph.repeat  # one scan iteration
    eff = np.where(graph.is_matmul, per_kernel / (per_kernel + half), 1.0)
    busy = np.maximum(f / (rate * np.maximum(eff, 1e-9)), b / (dev.memory_bandwidth * speed))
    if graph.host_transfer.any():
        # residuals a remat policy offloads cross the host link, not device memory
        busy = np.where(graph.host_transfer, b / 2 / dev.host_bandwidth, busy)
    return busy + graph.kernels * dev.kernel_overhead_s


@dataclass(frozen=True)
class MeshCosts:
    """What one mesh's costs decompose into, so the solver can add them per parameter.

    `base` is the time of ops no parameter's strategy changes; `param_time[j][s]` the
    time of param j's ops under its strategy s; `grad_comm[j][s]` the (seconds, bytes)
    of its gradient reduction over the data axis; `host[j][s]` the seconds to move its
    offloaded optimizer state one way between host and device (0 when not offloaded).
    """

    d: int
    m: int
    base: float
    base_busy: float
    base_kernels: float
    batched_time: float
    strategies: tuple[tuple[Strategy, ...], ...]
    param_time: tuple[tuple[float, ...], ...]
    param_busy: tuple[tuple[float, ...], ...]
    grad_comm: tuple[tuple[tuple[float, float], ...], ...]
    host: tuple[tuple[float, ...], ...]


def mesh_costs(graph: Graph, cluster: Cluster, d: int, m: int,
               strategies: Sequence[Sequence[Strategy]]) -> MeshCosts:
    """Decompose the step's compute and gradient communication on a (d, m) mesh."""
    dev = cluster.device
    times: dict[int, np.ndarray] = {}
    busies: dict[int, np.ndarray] = {}
    speed = cluster.speedup_when_using(d * m)

    def at(split: int) -> tuple[np.ndarray, np.ndarray]:
        if split not in times:
            t = op_times(graph, cluster, float(split), speed)
            times[split] = t
            busies[split] = t - graph.kernels * dev.kernel_overhead_s
        return times[split], busies[split]

    batched, owner, tp = graph.batched, graph.owner, graph.tp_param
    fixed = (batched & (tp < 0)) | (~batched & (owner < 0))
    t_d, b_d = at(d)
    t_1, b_1 = at(1)
    fixed_b = fixed & batched
    fixed_o = fixed & ~batched
    base = float(t_d[fixed_b].sum() + t_1[fixed_o].sum())
    base_busy = float(b_d[fixed_b].sum() + b_1[fixed_o].sum())
    base_kernels = float(graph.kernels[fixed].sum())
    batched_time = float(t_d[batched].sum())

    P = len(graph.params)
    # a parameter's optimizer work (and the gradient post-processing feeding it, such as
    # Adam's g*g) follows the optimizer state's layout; casts of the weight follow the weight
    opt_op = np.isin(graph.op_class, (GRAD, OPT))
    resident = graph.resident_bytes
    # per-parameter sums of op times at each split, by group: its tensor-parallel matmuls,
    # its own weight/gradient ops, its optimizer ops (one bincount per split, not per
    # strategy: this loop runs for every mesh of every planning)
    groups = {"tp": (batched & (tp >= 0), tp), "w": (~batched & (owner >= 0) & ~opt_op, owner),
              "s": (~batched & (owner >= 0) & opt_op, owner)}
    sums: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}

    def summed(group: str, split: int) -> tuple[np.ndarray, np.ndarray]:
        if (group, split) not in sums:
            mask, who = groups[group]
            t, b = at(split)
            sums[group, split] = (np.bincount(who[mask], t[mask], minlength=P),
                                  np.bincount(who[mask], b[mask], minlength=P))
        return sums[group, split]

    reps = graph.grad_repeat
    p_time, p_busy, g_comm, host = [], [], [], []
    for j, strats in enumerate(strategies):
        row_t, row_b, row_c, row_h = [], [], [], []
        pbytes = graph.params[j].nbytes
        for s in strats:
            tt, bb = summed("tp", d * m if s.tp != "none" else d)
            tw, bw = summed("w", s.shard(d, m))
            ts, bs = summed("s", s.state_shard(d, m))
            row_t.append(float(tt[j] + tw[j] + ts[j]))
            row_b.append(float(bb[j] + bw[j] + bs[j]))
            local = pbytes / (m if s.tp != "none" else 1)
            if s.data_sharded:
                t, b = fsdp_comm(local, d, cluster)
            else:
                # ZeRO-1 reduce-scatters the gradient and all-gathers the new weight:
                # the bytes of the all-reduce it replaces (textbook; verification checks
                # what XLA does)
                t, b = all_reduce(local, d, cluster, False)
            row_c.append((t * reps[j], b * reps[j]))
            row_h.append(float(resident[j]) / s.state_shard(d, m)
                         / dev.host_bandwidth if s.offload else 0.0)
        p_time.append(tuple(row_t))
        p_busy.append(tuple(row_b))
        g_comm.append(tuple(row_c))
        host.append(tuple(row_h))
    return MeshCosts(d, m, base, base_busy, base_kernels, batched_time,
                     tuple(tuple(s) for s in strategies), tuple(p_time), tuple(p_busy),
                     tuple(g_comm), tuple(host))


def fsdp_comm(param_bytes: float, d: int, cluster: Cluster) -> tuple[float, float]:
    """(seconds, bytes) of a data-sharded (ZeRO-3 / FSDP) weight: gather it for the
    forward pass and again for the backward pass, reduce-scatter its gradient; 1.5x the
    bytes of the all-reduce plain data parallelism pays. (XLA may instead move activations
    when they are the smaller, but whether it does depends on the neighbouring layouts:
    the fidelity benchmark showed both, so the model takes the textbook cost and leaves
    the difference to verification.)"""
    t, sent = all_gather(param_bytes, d, cluster, False)
    return 3 * t, 3 * sent


# --------------------------------------------------------------------------- tensor parallel
def tp_pair_cost(layer: Layer, prev: str, kind: str, d: int, m: int,
                 cluster: Cluster) -> tuple[float, float]:
    """(seconds, bytes) of model-axis communication a layer adds, given the previous
    layer's kind: Megatron's column-then-row pairing costs one all-reduce forward and
    one backward; an unpaired layer pays gathers to restore a replicated activation."""
    if m <= 1:
        return 0.0, 0.0
    a_in, a_out = layer.act_in_bytes / d, layer.act_out_bytes / d
    parts: list[tuple[float, float]] = []
    if kind == "col":
        if prev == "col":
            parts.append(all_gather(a_in, m, cluster))
        if layer.needs_input_grad:
            parts.append(all_reduce(a_in, m, cluster))
    elif kind == "row":
        parts.append(all_reduce(a_out, m, cluster))
        if prev != "col" and layer.needs_input_grad:
            parts.append(all_gather(a_in, m, cluster))
    elif prev == "col":
        parts.append(all_gather(a_in, m, cluster))
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


def tp_final_cost(layer: Layer, kind: str, d: int, m: int,
                  cluster: Cluster) -> tuple[float, float]:
    """A column-sharded last layer leaves its output sharded: gather it for the loss."""
    if m <= 1 or kind != "col":
        return 0.0, 0.0
    return all_gather(layer.act_out_bytes / d, m, cluster)


def tp_chain_cost(graph: Graph, kinds: dict[int, str], d: int, m: int,
                  cluster: Cluster) -> tuple[float, float]:
    t = b = 0.0
    prev = "none"
    for layer in graph.layers:
        kind = kinds.get(layer.param, "none")
        dt, db = tp_pair_cost(layer, prev, kind, d, m, cluster)
        t, b, prev = t + dt, b + db, kind
    if graph.layers:
        dt, db = tp_final_cost(graph.layers[-1], prev, d, m, cluster)
        t, b = t + dt, b + db
    return t, b


# --------------------------------------------------------------------------- one candidate
def memory_weights(graph: Graph, d: int, strats: Sequence[Strategy], m: int) -> np.ndarray:
    """Per-bucket share of each live byte on one device: 1/d for batched values, 1 for the
    rest, and per parameter and class one over how many ways that class is split (0 for
    state kept in host memory)."""
    P = len(graph.params)
    w = np.empty(graph.live.shape[1])
    w[0] = 1.0 / d
    w[1] = 1.0
    div = np.array([s.divisors(d, m) for s in strats], dtype=np.float64).reshape(P, -1)
    w[2:] = (1.0 / div.T[:NUM_CLASSES]).reshape(-1)
    return w


def peak_memory(graph: Graph, d: int, m: int, strats: Sequence[Strategy]) -> tuple[float, int]:
    """(peak live bytes per device, index of the peak point)."""
    per_point = graph.live @ memory_weights(graph, d, strats, m)
    k = int(np.argmax(per_point))
    return float(per_point[k]), k


def predict(graph: Graph, cluster: Cluster, mc: MeshCosts, choice: Sequence[int]) -> Prediction:
    """The full prediction for a mesh's costs and a strategy index per parameter."""
    d, m = mc.d, mc.m
    n = d * m
    strats = [mc.strategies[j][s] for j, s in enumerate(choice)]
    compute = mc.base + sum(mc.param_time[j][s] for j, s in enumerate(choice))
    busy = mc.base_busy + sum(mc.param_busy[j][s] for j, s in enumerate(choice))
    grads = [mc.grad_comm[j][s] for j, s in enumerate(choice)]
    grad_t = sum(g[0] for g in grads) + _combined_latency(strats, d, cluster)
    grad_b = sum(g[1] for g in grads)
    kinds = {j: s.tp for j, s in enumerate(strats)}
    tp_t, tp_b = tp_chain_cost(graph, kinds, d, m, cluster)
    # Gradient reduction overlaps the backward pass, except the first layer's, whose
    # gradient is produced last.
    first = graph.layers[0].param if graph.layers else None
    last_grad = grads[first][0] if first is not None else 0.0
    exposed = max(grad_t - BACKWARD_SHARE * mc.batched_time, min(last_grad, grad_t), 0.0)
    host = sum(mc.host[j][s] for j, s in enumerate(choice))
    mem, _ = peak_memory(graph, d, m, strats)
    exposed += host_exposed(host, mc.batched_time)
    return assemble(cluster, n, graph.batch_size or 1, compute=compute, busy=busy,
                    blocking=tp_t, grad_comm=grad_t, exposed=exposed,
                    comm_bytes=grad_b + tp_b, memory=mem,
                    flops=_flops_per_device(graph, d, m, strats),
                    batched_time=mc.batched_time, host_transfer=2 * host,
                    loop_flops_ratio=loop_flops_ratio(graph))


def loop_flops_ratio(graph: Graph) -> float:
    total = graph.total_flops
    if total <= 0 or (graph.repeat == 1).all():
        return 1.0
    return float((graph.flops / graph.repeat).sum() / total)


def host_exposed(one_way: float, batched_time: float) -> float:
    """Seconds of host transfer the step cannot hide: offloaded state comes in while the
    forward and backward passes run (prefetch), but the new state goes out after the
    update, at the end of the step, with nothing left to overlap it."""
    return max(one_way - batched_time, 0.0) + one_way


def assemble(cluster: Cluster, n: int, batch: int, *, compute: float, busy: float,
             blocking: float, grad_comm: float, exposed: float, comm_bytes: float,
             memory: float, flops: float, batched_time: float,
             host_transfer: float = 0.0, loop_flops_ratio: float = 1.0) -> Prediction:
    """A step's time and energy from its parts: compute, blocking communication and the
    gradient reduction the backward pass does not hide. Each of the n devices draws
    idle + (max - idle) x utilization, where launches and collectives count partly."""
    dev = cluster.device
    step = compute + blocking + exposed
    side = SIDE_UTILIZATION * (compute - busy + blocking + exposed)
    util = min(1.0, (busy + side) / step) if step > 0 else 0.0
    power = (dev.idle_watts + (dev.max_watts - dev.idle_watts) * util) \
        * cluster.speedup_when_using(n)
    energy = n * power * step
    return Prediction(
        step_time_s=step, samples_per_s=batch / step if step else float("inf"),
        energy_per_step_j=energy, energy_per_sample_j=energy / batch, avg_power_w=n * power,
        peak_memory_bytes=memory, comm_bytes=comm_bytes, compute_time_s=compute,
        tp_comm_time_s=blocking, grad_comm_time_s=grad_comm, exposed_comm_time_s=exposed,
        flops_per_device=flops, utilization=util, num_devices=n, busy_time_s=busy,
        batched_time_s=batched_time, host_transfer_time_s=host_transfer,
        loop_flops_ratio=loop_flops_ratio)


def _combined_latency(strats: Sequence[Strategy], d: int, cluster: Cluster) -> float:
    """Ring latency of the gradient collectives once each: XLA combines the per-parameter
    all-reduces (and reduce-scatters / all-gathers) of a step into few large ones."""
    if d <= 1:
        return 0.0
    steps = 0
    if any(not s.data_sharded for s in strats):
        steps += 2 * (d - 1)
    if any(s.data_sharded for s in strats):
        steps += 2 * (d - 1)
    return steps * cluster.link_latency


def _flops_per_device(graph: Graph, d: int, m: int, strats: Sequence[Strategy]) -> float:
    tp_on = np.array([s.tp != "none" for s in strats] + [False])
    shard = np.array([s.shard(d, m) for s in strats] + [1])
    split = np.where(graph.batched, d * np.where(tp_on[graph.tp_param], m, 1),
                     shard[graph.owner])
    return float((graph.flops / split).sum())
