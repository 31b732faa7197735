"""What communication costs: ring collectives, and the collectives a layout implies.

Every collective is priced by the same ring formulas, whether the model foresaw it (a
gradient all-reduce, the gathers around a tensor-parallel layer) or XLA put it in the
compiled program (`collective_cost` of a parsed `Collective`):
`2(n-1)/n * bytes / bw + 2(n-1) * latency` for an all-reduce and half that for an
all-gather or reduce-scatter.

What data parallelism reduces is found the way XLA's SPMD partitioner finds it
(`batch_dims`): an op that sums over the batch dim leaves every device a partial sum,
which is all-reduced over the data axis where it is made, before anything adds it to
another. So a weight used by several batched ops (a tied embedding: lookup and LM head)
has its gradient reduced once per use, not once per step; and a loss, a metric or a
batch-norm statistic is reduced too. (XLA:CPU compiles it so; XLA:GPU's
all-reduce-reassociate pass may merge `add(all-reduce(a), all-reduce(b))` into one when
only reshapes, pads, slices or converts stand between them, so there this is an upper
bound that verification corrects.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .flatten import FlatProgram
from .hardware import Cluster
from .primitives import batch_rule, default_batch
from .records import Collective

if TYPE_CHECKING:
    from .graph import Graph, Layer


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


def collective_cost(c: Collective, cluster: Cluster) -> tuple[float, float]:
    """(seconds, bytes sent per device) of a collective XLA inserted, by the ring formulas
    the model uses for its own."""
    n = c.group_size
    if c.kind == "all-reduce":
        return all_reduce(c.bytes, n, cluster)
    if c.kind in ("all-gather", "all-to-all"):
        return all_gather(c.bytes, n, cluster)
    if c.kind == "reduce-scatter":
        return all_gather(c.bytes * n, n, cluster)
    if n <= 1:  # collective-permute
        return 0.0, 0.0
    return c.bytes / cluster.link_bandwidth + cluster.link_latency, float(c.bytes)


def batch_dims(prog: FlatProgram, batch_inputs: Sequence[int]
               ) -> tuple[list[int | None], np.ndarray]:
    """Where data parallelism splits every value of the flat program, and which ops make
    partial sums of it.

    Batch inputs are split on their leading dim (as `compile_layout` places them); each
    op's batch rule (`primitives.register_batch`) says where that dim goes in its results
    and whether the op sums over it (a contraction over the batch, a reduction, a scatter
    of every row into one array). Returns the split dim of every value (None: whole on
    every device) and, per op, whether its results are such partial sums: one all-reduce
    over the data axis each.
    """
    axis: list[int | None] = [None] * len(prog.vars)
    for i in batch_inputs:
        axis[i] = 0 if prog.vars[i].shape else None
    partial = np.zeros(len(prog.ops), dtype=bool)
    for k, op in enumerate(prog.ops):
        ins = [axis[i] for i in op.ins]
        if all(a is None for a in ins):
            continue
        try:
            outs, summed = batch_rule(op.prim)(op.eqn, ins)
        except Exception:  # noqa: BLE001 - an equation its rule does not expect
            outs, summed = default_batch(op.eqn, ins)
        for o, a in zip(op.outs, outs, strict=True):
            axis[o] = a
        partial[k] = summed and all(a is None for a in outs)
    return axis, partial


def buffer_latency(buffers: float, d: int, cluster: Cluster) -> float:
    """Seconds `buffers` of XLA's combined collectives over d devices add where the
    backend reduces each buffer apart (`DeviceSpec.link_buffer_latency_s`: gloo on CPU;
    0 where the library groups them, as NCCL does)."""
    return buffers * cluster.device.link_buffer_latency_s if d > 1 else 0.0


def batch_reduce_comm(graph: Graph, d: int, cluster: Cluster) -> tuple[float, float]:
    """(seconds, bytes) of the partial sums over the batch that are not gradients (the
    loss, metrics, batch-norm statistics: `Graph.reduce_bytes`), all-reduced over the data
    axis whatever the parameters' layouts; the ring latency left to the combined
    reduction, each sum a buffer of its own."""
    t, b = all_reduce(graph.reduce_bytes, d, cluster, False)
    return t + buffer_latency(graph.reduce_count, d, cluster), b


def grad_reduce_comm(param_bytes: float, d: int, cluster: Cluster, reductions: float = 1.0,
                     zero1: bool = False) -> tuple[float, float]:
    """(seconds, bytes) of reducing a gradient that is not data-sharded, once per partial
    gradient (`reductions`). ZeRO-1 reduce-scatters it and all-gathers the new weight:
    the bytes of the all-reduce it replaces (textbook; verification checks what XLA does),
    in two buffers instead of one."""
    t, b = all_reduce(param_bytes, d, cluster, False)
    buffers = reductions * (2 if zero1 else 1)
    return t * reductions + buffer_latency(buffers, d, cluster), b * reductions


def fsdp_comm(param_bytes: float, d: int, cluster: Cluster, reductions: float = 1.0,
              passes: float = 1.0) -> tuple[float, float]:
    """(seconds, bytes) of a data-sharded (ZeRO-3 / FSDP) weight: gather it for the
    forward pass and again for the backward pass (in each of `passes` loop iterations,
    micro-batches), reduce-scatter its gradient once per partial gradient (`reductions`:
    a weight used twice has two, and each micro-batch its own); 1.5x the bytes of the
    all-reduce plain data parallelism pays. (XLA may instead move activations when they
    are the smaller, but whether it does depends on the neighbouring layouts: the fidelity
    benchmark showed both, so the model takes the textbook cost and leaves the difference
    to verification.)"""
    t, sent = all_gather(param_bytes, d, cluster, False)
    k = 2 * passes + reductions
    return k * t + buffer_latency(k, d, cluster), k * sent


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


def tp_chain_cost(graph: Graph, kinds: Mapping[int, str], d: int, m: int,
                  cluster: Cluster) -> tuple[float, float]:
    """(seconds, bytes) of the model-axis communication of a whole chain of layers whose
    parameters are tensor-parallel of the given kinds (absent: not split)."""
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


__all__ = ["all_gather", "all_reduce", "batch_dims", "batch_reduce_comm", "collective_cost",
           "fsdp_comm", "tp_chain_cost", "tp_final_cost", "tp_pair_cost"]
