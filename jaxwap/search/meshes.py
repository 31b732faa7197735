"""Which meshes a search tries: the device counts worth a mesh, and the (data, model)
shapes of each that the batch, the layers and the cluster's nodes allow."""

from __future__ import annotations

import math
from collections import Counter

from jaxwap.analysis.graph import Graph

# Clusters up to this many devices try every device count; larger ones powers of two
# (and the whole cluster), which is where the meshes that can win are (see device_counts).
EXHAUSTIVE_DEVICES = 64


def device_counts(num_devices: int, node_size: int | None = None) -> list[int]:
    """The device counts worth a mesh: every count up to `EXHAUSTIVE_DEVICES`; beyond,
    powers of two and the whole cluster (a count between two powers of two splits a
    power-of-two batch and model unevenly, and costs more than either neighbour in energy
    or time). With nodes (`node_size` devices each), a mesh larger than a node takes whole
    nodes: part of a node left idle is neither faster nor cheaper than the node's own
    counts."""
    n_max = num_devices
    if n_max <= EXHAUSTIVE_DEVICES:
        counts = set(range(1, n_max + 1))
    else:
        counts = {1 << k for k in range(n_max.bit_length()) if 1 << k <= n_max} | {n_max}
    if node_size is not None and node_size < n_max:
        counts = {n for n in counts if n <= node_size or n % node_size == 0}
        counts |= {node_size * (1 << k) for k in range(n_max.bit_length())
                   if node_size * (1 << k) <= n_max}
    return sorted(counts)


def mesh_shapes(num_devices: int, batch_size: int | None, graph: Graph,
                num_devices_exact: int | None = None, micro_batches: int = 1,
                mesh: tuple[int, int] | None = None, node_size: int | None = None
                ) -> tuple[list[tuple[int, int]], list[str]]:
    """Every (data, model) factorisation of n <= num_devices devices worth trying (with
    micro-batches, each micro-batch must split evenly over the data axis); only `mesh`
    when the caller fixes it. With nodes of `node_size` devices, the model axis stays
    inside a node (its size divides the node's), so tensor parallelism never crosses the
    network; the data axis spans the nodes. Nodes of one device have no inside: there
    the model axis may span nodes, priced on the network's links (`collectives.tp_group_cost`),
    or such a cluster could never split a layer."""
    shapes, skipped = [], []
    ns = [num_devices_exact] if num_devices_exact else device_counts(num_devices, node_size)
    if not num_devices_exact and mesh is None and batch_size is not None:
        ns = sorted(set(ns) | even_split_counts(num_devices, batch_size, graph, micro_batches,
                                                node_size, ns))
    if mesh is not None:
        ns = [mesh[0] * mesh[1]]
    for n in ns:
        for d in range(1, n + 1):
            if n % d or (mesh is not None and d != mesh[0]):
                continue
            m = n // d
            if node_size is not None and node_size > 1 and (m > node_size or node_size % m):
                skipped.append(f"{d}x{m}: the model axis of {m} would cross nodes of "
                               f"{node_size} devices")
                continue
            if batch_size is None and d > 1:
                skipped.append(f"{d}x{m}: the step has no batch dimension to split")
                continue
            if batch_size is not None and batch_size % (d * micro_batches):
                what = f"batch {batch_size}" if micro_batches == 1 else \
                    f"micro-batch {batch_size // micro_batches}"
                skipped.append(f"{d}x{m}: {what} is not divisible by data={d}")
                continue
            if m > 1 and not any(
                    any(graph.params[L.param].shape[i] % m == 0 for i in L.in_dims + L.out_dims)
                    for L in graph.layers):
                skipped.append(f"{d}x{m}: no layer weight has a dim divisible by model={m}")
                continue
            shapes.append((d, m))
    return shapes, skipped


def even_split_counts(num_devices: int, batch_size: int, graph: Graph, micro_batches: int,
                      node_size: int | None, counts: list[int]) -> set[int]:
    """The device counts beyond `counts` that no larger count beats on both what a device
    computes and what it holds: a count whose data axis splits the batch (each
    micro-batch) evenly, and which is the largest that does or whose mesh divides the
    weights' dims further than every larger count's.

    `device_counts` takes powers of two past `EXHAUSTIVE_DEVICES`, which is where a
    power-of-two batch and model split. A batch with few factors of two does not. 1,000
    sequences split over no power of two past 8: on 1,024 GPUs the meshes of
    `device_counts` that split them use 64, where 1,000 data-parallel GPUs each compute
    a sixteenth as much. 2,520 sequences on 2,520 GPUs leave a data axis of 315 (at a
    model axis of 8), which shares only 5 with a 20,480-wide model's dims, so its weights
    shard 40 ways at most; 2,240 of the GPUs (7 replicas of a data axis of 40 at model 8)
    shard them 320 ways. Walking down from the cluster's size, a count is added where no
    larger count splits the batch at all, or where it holds 5% fewer parameter bytes a
    device than every larger one at its best (data, model) split (`_held_estimate`, an
    estimate to choose what to search; the search prices the meshes themselves). Kept
    with the graph: a search asks it of every micro-batch count."""
    if num_devices <= EXHAUSTIVE_DEVICES or batch_size % micro_batches:
        return set()
    return graph.memoized(
        ("even_split_counts", num_devices, batch_size, micro_batches, node_size,
         tuple(counts)),
        lambda: _even_split_counts(num_devices, batch_size // micro_batches, graph,
                                   node_size, counts))


def _even_split_counts(num_devices: int, per_micro_batch: int, graph: Graph,
                       node_size: int | None, counts: list[int]) -> set[int]:
    node = node_size if node_size is not None and node_size > 1 else 1
    models = _divisors(node if node > 1 else num_devices)
    datas = _divisors(per_micro_batch)
    splits: dict[int, list[tuple[int, int]]] = {}
    for d in datas:
        for m in models:
            n = d * m
            if n <= num_devices and (n <= node or n % node == 0):
                splits.setdefault(n, []).append((d, m))
    shapes = Counter((tuple(int(x) for x in p.shape), p.nbytes) for p in graph.params)
    held = {n: min(_held_estimate(shapes, d, m) for d, m in dms) for n, dms in splits.items()}
    added, least = set(), math.inf      # the least held by the larger counts searched
    for n in sorted(set(held) | set(counts), reverse=True):
        h = held.get(n, math.inf)
        if n not in counts and h < 0.95 * least:
            added.add(n)
        if n in counts or n in added:
            least = min(least, h)
    return added


def _divisors(n: int) -> list[int]:
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return sorted(set(small) | {n // k for k in small})


def _held_estimate(shapes: Counter, d: int, m: int) -> float:
    """Parameter bytes a device holds with every leaf split as far as a data axis of d
    (any sub-axis of it, replicated over the rest: HSDP) and a model axis of m divide its
    dims, one axis a dim or both on one: what a count's best mesh could shard, for
    choosing the counts to search (`even_split_counts`)."""
    total = 0.0
    for (shape, nbytes), k in shapes.items():
        best = max([1, *(math.gcd(d * m, a) for a in shape),        # both on one dim
                    *(math.gcd(d, a) * math.gcd(m, b)                # each on its own
                      for i, a in enumerate(shape) for j, b in enumerate(shape) if i != j)])
        total += k * nbytes / best
    return total


__all__ = ["EXHAUSTIVE_DEVICES", "device_counts", "even_split_counts", "mesh_shapes"]
